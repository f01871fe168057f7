"""Keras 3 `model.fit` under EPL (eager TensorFlow 2): the oracle on Keras-style models.

The three models of tests/workers/tf2_models.py (a convnet with BatchNormalization
and Dropout, a transformer text classifier with Embedding and MultiHeadAttention,
a subclassed model with its own train_step), compiled and fit on a tf.data
dataset of global batches: fit's train step takes the batch as a tensor, which
EPL cuts into replicas x micro-batches. After 3 steps every variable and the
logged loss equal single-device training on the units' batches
(tests/tf2_oracle.py). All cases run in one Keras 3 process.
"""
from __future__ import annotations

import pytest

import tf2_oracle

CASES = ["convnet:fit:dp", "convnet:fit:ga", "convnet:fit:pipeline", "convnet:fit:gc",
         "convnet:fit:amp", "transformer:fit:dp", "transformer:fit:pipeline",
         "transformer:fit:gpipe", "custom:fit:dp", "custom:fit:pipeline", "convnet:fit:auto_stages",
         "convnet:fit:zero_keras", "convnet:fit:split", "transformer:fit:split"]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """The worker's record of every case (one process)."""
    return tf2_oracle.run_cases(CASES, str(tmp_path_factory.mktemp("tf2_fit") / "fit.npz"))


@pytest.mark.parametrize("case", CASES)
def test_fit_matches_single_device_training_on_the_units_batches(record, case):
    tf2_oracle.assert_matches(record, case, amp=case.endswith(":amp"))
