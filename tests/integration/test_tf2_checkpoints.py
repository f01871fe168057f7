"""Checkpoints of eager TensorFlow 2 programs across layouts (Keras 3 processes).

tests/workers/tf2_checkpoint_worker.py: saved under EPL (a pipeline of 2 stages x
2 micro-batches over 2 pipelines), `model.save_weights`, a `.keras` file and
`tf.train.CheckpointManager` load into a single-device model with the same values;
a single-device checkpoint restored (and weights loaded) into a model EPL already
trains reaches every replica's copy: training on from it equals single-device
training on from it. tests/workers/tf2_refusals_worker.py: what EPL refuses in
eager programs, with the exact messages.
"""
from __future__ import annotations

import tf2_oracle

CHECKS = [
    "OK save_weights under EPL -> load_weights single-device",
    "OK .keras file under EPL -> load_model single-device",
    "OK tf.train.CheckpointManager under EPL -> restore single-device",
    "OK single-device checkpoint -> restore under EPL, trained on",
    "OK single-device save_weights -> load_weights under EPL, trained on",
]


def test_checkpoints_cross_layouts_both_ways(tmp_path):
    output = tf2_oracle.run_worker("tf2_checkpoint_worker.py", [str(tmp_path)])
    lines = [line for line in output.splitlines() if line.startswith("OK ")]
    assert lines == CHECKS


def test_eager_refusals_say_why_and_what_to_use_instead():
    output = tf2_oracle.run_worker("tf2_refusals_worker.py", [])
    lines = {line.split(":")[0]: line for line in output.splitlines()
             if line.startswith(("REFUSED", "RAN"))}
    refused = lines["REFUSED split_loss_metric_in_a_custom_fit"]
    assert refused.startswith("REFUSED split_loss_metric_in_a_custom_fit: PassError: pass "
                              "'consistency' failed"), refused
    for part in ("variable loss/total is written by", "which the split part (epl.split) "
                 "computes once over the global batch, while the step's other updates run on "
                 "each of the 2 replicas", "Update the state from a value computed under an "
                 "epl.replicate scope"):
        assert part in refused, refused


def test_devices_created_too_late_are_refused_with_the_fix():
    output = tf2_oracle.run_worker("tf2_refusals_worker.py", ["--late-init"])
    assert "REFUSED late_init: ClusterError: EPL plans 2 local devices (cluster.virtual_devices) " \
        "but TensorFlow has 1 (/device:CPU:0): the eager context was initialized before " \
        "epl.init could create the virtual devices. Call epl.init() before TensorFlow runs its " \
        "first op (before creating any tensor, variable or model)." in output.splitlines()
