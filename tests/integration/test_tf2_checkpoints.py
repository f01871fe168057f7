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
    assert lines["REFUSED split_in_a_step"] == (
        "REFUSED split_in_a_step: ParallelizeError: epl.split(device_count=2, "
        "name='classifier') is used in a tf.function training step, which EPL does not split "
        "in eager TensorFlow 2: the split pass turns the layer's variables into shards on "
        "their devices, and the model's eager variables (which Keras, the optimizer and "
        "checkpoints hold) cannot become shards. Train that part with epl.replicate (data or "
        "pipeline parallelism), or split it in a graph-mode program "
        "(tf.compat.v1.disable_eager_execution(), a tf.compat.v1 or tf-keras graph), where "
        "epl.split shards dense, embedding, softmax and expert layers.")


def test_devices_created_too_late_are_refused_with_the_fix():
    output = tf2_oracle.run_worker("tf2_refusals_worker.py", ["--late-init"])
    assert "REFUSED late_init: ClusterError: EPL plans 2 local devices (cluster.virtual_devices) " \
        "but TensorFlow has 1 (/device:CPU:0): the eager context was initialized before " \
        "epl.init could create the virtual devices. Call epl.init() before TensorFlow runs its " \
        "first op (before creating any tensor, variable or model)." in output.splitlines()
