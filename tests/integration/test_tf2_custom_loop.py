"""tf.function training steps under EPL (eager TensorFlow 2): the oracle.

A custom training loop as the Keras examples write one: a `tf.function` step with
GradientTape and the optimizer's apply, on the models of tests/workers/tf2_models.py.
"tensors": the step takes the global batch as arguments (EPL cuts it into
replicas x micro-batches); "iterator": the step draws from a tf.data iterator
(each unit draws its own batch of the script's size, R x M per call). ZeRO runs
with tf.compat.v1.train.AdamOptimizer (one update op per variable); "split" builds
the classifier under epl.split(2) (the custom model's body under epl.replicate,
the transformer's unscoped), "split_embedding" the transformer's embeddings too. After 3
calls every variable and the running loss equal single-device training on the
units' batches (tests/tf2_oracle.py). All cases run in one Keras 3 process.
"""
from __future__ import annotations

import pytest

import tf2_oracle

CASES = ["convnet:tensors:ga", "convnet:tensors:zero", "custom:iterator:dp",
         "custom:iterator:gpipe", "custom:iterator:zero", "transformer:iterator:gc",
         "custom:tensors:amp", "custom:iterator:zero_keras", "custom:iterator:split",
         "custom:tensors:split", "transformer:tensors:split",
         "transformer:iterator:split_embedding"]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """The worker's record of every case (one process)."""
    return tf2_oracle.run_cases(CASES, str(tmp_path_factory.mktemp("tf2_loop") / "loop.npz"))


@pytest.mark.parametrize("case", CASES)
def test_custom_loop_matches_single_device_training_on_the_units_batches(record, case):
    tf2_oracle.assert_matches(record, case, amp=case.endswith(":amp"))


@pytest.mark.parametrize("case", ["custom:iterator:zero", "custom:iterator:zero_keras"])
def test_zero_shards_the_optimizer_state(record, case):
    """ZeRO's shards of the slots are EPL's own eager variables (a tf.compat.v1.train
    optimizer's, and a Keras 3 optimizer's)."""
    state = [str(name) for name in record[f"{case}/state"]]
    assert any("shard_1" in name for name in state), state


@pytest.mark.parametrize("case", ["custom:iterator:split", "custom:tensors:split",
                                  "transformer:tensors:split"])
def test_split_classifier_runs_on_both_devices(record, case):
    """epl.split in a traced step: the classifier's matmul and the softmax cross-entropy
    run as per-device ops, one per split device (the logits never gathered)."""
    ops = {str(line) for line in record[f"{case}/split_ops"]}
    for slot, device in ((0, "/device:CPU:0"), (1, "/device:CPU:1")):
        assert f"MatMul {slot} {device}" in ops, sorted(ops)
        assert f"Exp {slot} {device}" in ops, sorted(ops)


def test_tf_module_with_hand_written_updates_and_a_retrace():
    """A tf.Module of tf.Variables updated by hand (v.assign_sub(lr * g)) with a running
    sum of the loss in a variable, called with a batch of 16 rows, then 8 (a retrace,
    rewritten too), then from an iterator: equals single-device training on the same
    rows (tests/workers/tf2_module_worker.py). A step that adds up its batch's values in
    a plain variable is refused naming it, with the eager remedy, and the remedy (the
    variable declared summed over replicas) runs and holds the global batch's sum."""
    output = tf2_oracle.run_worker("tf2_module_worker.py", [])
    lines = output.splitlines()
    diff = next(line for line in lines if line.startswith("DIFF module "))
    assert float(diff.split()[-1]) < 1e-6, output[-3000:]
    assert "TRACES 3" in lines   # the two signatures of the first step, and the second
    refused = next(line for line in lines if line.startswith("REFUSED rows_seen: "))
    assert refused.startswith(
        "REFUSED rows_seen: PassError: pass 'consistency' rejected the graph before any "
        "rewrite: variable Variable would hold a different value on each replica: "), refused
    assert refused.endswith(
        "In a tf.function step, a variable every replica should add its part into (a count "
        "or total over the global batch) is created with tf.Variable(..., "
        "aggregation=tf.VariableAggregation.SUM), as Keras 3 metrics create theirs."), refused
    _, _, value, bound = next(line for line in lines if line.startswith("DIFF rows_seen "
                                                                         )).split()
    assert float(value) <= float(bound), output[-3000:]
