"""Keras 3 `model.fit` under EPL (eager TensorFlow 2): the oracle on Keras-style models.

The three models of tests/workers/tf2_models.py (a convnet with BatchNormalization
and Dropout, a transformer text classifier with Embedding and MultiHeadAttention,
a subclassed model with its own train_step), compiled and fit on a tf.data
dataset of global batches: fit's train step takes the batch as a tensor, which
EPL cuts into replicas x micro-batches. After 3 steps every variable and the
logged loss equal single-device training on the units' batches
(tests/tf2_oracle.py); "split_embedding" builds the transformer's embeddings under
epl.split too, whose lookups run whole in a traced step. All cases run in one Keras 3 process.
"""
from __future__ import annotations

import pytest

import tf2_oracle

CASES = ["convnet:fit:dp", "convnet:fit:ga", "convnet:fit:pipeline", "convnet:fit:gc",
         "convnet:fit:amp", "transformer:fit:dp", "transformer:fit:pipeline",
         "transformer:fit:gpipe", "custom:fit:dp", "custom:fit:pipeline", "convnet:fit:auto_stages",
         "convnet:fit:zero_keras", "convnet:fit:split", "transformer:fit:split",
         "transformer:fit:split_embedding"]
# the embeddings' lookups run once over the global batch: their gradients are summed
# in another order than the reference's (see tf2_oracle.assert_matches)
NOISY_LOSSES = {"transformer:fit:split_embedding"}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """The worker's record of every case (one process)."""
    return tf2_oracle.run_cases(CASES, str(tmp_path_factory.mktemp("tf2_fit") / "fit.npz"))


@pytest.mark.parametrize("case", CASES)
def test_fit_matches_single_device_training_on_the_units_batches(record, case):
    tf2_oracle.assert_matches(record, case, amp=case.endswith(":amp"),
                              loss_floor=case in NOISY_LOSSES)


def test_an_embedding_under_split_runs_whole_and_says_why(record):
    """Keras 3 Embedding layers built under epl.split: in a traced step the lookups run
    unsplit on the whole tables (the user's eager variables), each table reported
    kept whole with why; the classifier after them is split."""
    messages = [str(m) for m in record["transformer:fit:split_embedding/unsharded"]]
    assert len(messages) == 2, messages
    for shape in ("[40, 8]", "[6, 8]"):
        message = next(m for m in messages if f"(shape {shape})" in m)
        assert "is created under epl.split (embedding) but stays whole" in message
        assert "in a tf.function training step EPL runs its lookup" in message
        assert "the table's gradient stays the IndexedSlices single-device training " \
            "gives it" in message
    ops = {str(line) for line in record["transformer:fit:split_embedding/split_ops"]}
    assert "MatMul 1 /device:CPU:1" in ops, sorted(ops)
