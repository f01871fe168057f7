"""`debug.trace_dir`: Chrome traces of the chosen training runs (epl/observability/trace.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.errors import ConfigError

RUNS = 4


def _train(run_metadata=None) -> None:
    """Two replicas of a two-layer model, RUNS training runs (plus non-training runs)."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.constant(rng.rand(16, 8).astype(np.float32))
        y = tf.constant(rng.rand(16, 1).astype(np.float32))
        with epl.replicate(device_count=1):
            hidden = tf.compat.v1.layers.dense(x, 16, name="hidden")
            loss = tf.reduce_mean((tf.compat.v1.layers.dense(hidden, 1, name="out") - y) ** 2)
        train_op = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(loss)  # not a training run: not counted
            for _ in range(RUNS):
                sess.run(train_op, run_metadata=run_metadata)


def _events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["traceEvents"]


def test_chosen_runs_are_traced_one_row_per_device_collectives_named(epl_env, tmp_path):
    trace_dir = str(tmp_path / "trace")
    epl_env({"cluster.virtual_devices": 2, "debug.trace_dir": trace_dir,
             "debug.trace_steps": [2, 4], "communication.local_reduction": "collective"})
    _train()
    assert sorted(os.listdir(trace_dir)) == ["step_2.json", "step_4.json"]
    events = _events(os.path.join(trace_dir, "step_2.json"))
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(rows.values()) == ["CPU:0", "CPU:1"]
    ops = [e for e in events if e["ph"] == "X"]
    assert {rows[e["pid"]] for e in ops} == {"CPU:0", "CPU:1"}
    collectives = [e for e in ops if e["args"]["op"].startswith("Collective")]
    assert sorted(rows[e["pid"]] for e in collectives) == ["CPU:0", "CPU:1"]
    by_device = {rows[e["pid"]]: e["name"] for e in collectives}
    # the fused gradients of the four variables: 8x16 + 16 + 16x1 + 1 floats
    assert by_device["CPU:0"] == ("EPL all-reduce: hidden/kernel, hidden/bias, out/kernel"
                                  " (+1 more) 644 B")
    # replica 1 updates its own copies of the variables
    assert by_device["CPU:1"].startswith("EPL all-reduce: ") and "/hidden/kernel, " in \
        by_device["CPU:1"] and by_device["CPU:1"].endswith(" (+1 more) 644 B")


def test_the_cpu_sum_on_one_device_is_named_as_an_all_reduce(epl_env, tmp_path):
    """The CPU default (communication.local_reduction "auto"): the fused gradients'
    all-reduce is one AddN on CPU:0 over both replicas' buckets (2 x 644 B)."""
    trace_dir = str(tmp_path / "trace")
    epl_env({"cluster.virtual_devices": 2, "debug.trace_dir": trace_dir,
             "debug.trace_steps": [2]})
    _train()
    events = _events(os.path.join(trace_dir, "step_2.json"))
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "process_name"}
    named = [e for e in events if e["ph"] == "X" and e["name"].startswith("EPL all-reduce: ")]
    assert [(rows[e["pid"]], e["args"]["op"]) for e in named] == [("CPU:0", "AddN")]
    assert "hidden/kernel" in named[0]["name"] and named[0]["name"].endswith(" 1.3 KiB")


def test_users_run_metadata_is_filled_too(epl_env, tmp_path):
    trace_dir = str(tmp_path / "trace")
    epl_env({"cluster.virtual_devices": 2, "debug.trace_dir": trace_dir,
             "debug.trace_steps": [RUNS]})
    metadata = tf.compat.v1.RunMetadata()
    _train(run_metadata=metadata)   # the last run is traced: its stats stay in `metadata`
    assert os.listdir(trace_dir) == [f"step_{RUNS}.json"]
    assert len(metadata.step_stats.dev_stats) >= 2


@pytest.mark.parametrize("steps,shown", [([0], "[0]"), ([], "[]"), ([2, "3"], "[2, '3']"),
                                         ([True], "[True]")])
def test_bad_trace_steps_are_a_clear_error(epl_env, tmp_path, steps, shown):
    epl_env({"cluster.virtual_devices": 2, "debug.trace_dir": str(tmp_path),
             "debug.trace_steps": steps})
    with pytest.raises(ConfigError) as error:
        _train()
    assert str(error.value) == (
        "debug.trace_steps must be a non-empty list of training run numbers >= 1 (counted from 1"
        f" per graph), got {shown}; e.g. [2, 3]")
