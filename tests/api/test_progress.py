"""`epl.observability.progress.ProgressHook` and what TensorBoard gets from a MonitoredTrainingSession run."""
from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import epl
from epl.observability.progress import ProgressHook

BATCH = 16


def _model():
    """Two replicas of a small regression model with a global step; returns (train_op, loss)."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(BATCH, 8).astype(np.float32))
    y = tf.constant(rng.rand(BATCH, 1).astype(np.float32))
    with epl.replicate(device_count=1):
        loss = tf.reduce_mean((tf.compat.v1.layers.dense(x, 1, name="out") - y) ** 2)
    step = tf.compat.v1.train.get_or_create_global_step()
    return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step), loss


def _events(logdir: str) -> list:
    return [event for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
            for event in tf.compat.v1.train.summary_iterator(path)]


def _graphs(logdir: str) -> list[graph_pb2.GraphDef]:
    graphs = []
    for event in _events(logdir):
        if event.graph_def:
            graph_def = graph_pb2.GraphDef()
            graph_def.ParseFromString(event.graph_def)
            graphs.append(graph_def)
    return graphs


def _collectives(graph_def: graph_pb2.GraphDef) -> int:
    return sum(node.op.startswith("Collective") for node in graph_def.node)


def test_progress_prints_first_every_nth_and_last_step_and_a_summary(epl_env, tmp_path):
    epl_env({"cluster.virtual_devices": 2})
    lines: list[str] = []
    logdir = str(tmp_path / "tb")
    with tf.Graph().as_default():
        train_op, loss = _model()
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=7),
                 ProgressHook(BATCH, {"loss": loss}, every_n_steps=3, last_step=7,
                              output_dir=logdir, print_fn=lines.append)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    assert re.fullmatch(r"session ready after \d+\.\d s \(graph rewrite and variable "
                        r"initialization\)", lines[0]), lines[0]
    assert re.fullmatch(r"step     1  loss \d+\.\d{4}  \(first step \d+\.\d\d s: warm-up, not "
                        r"counted in samples/s\)", lines[1]), lines[1]
    for line, step in zip(lines[2:5], (3, 6, 7)):
        assert re.fullmatch(rf"step {step:5d}  loss \d+\.\d{{4}} +\d+ samples/s", line), line
    assert re.fullmatch(r"done: 7 steps in \d+\.\d s \(session start \d+\.\d s, first step "
                        r"\d+\.\d\d s, then \d+ samples/s\); final loss \d+\.\d{4}", lines[5]), \
        lines[5]
    assert len(lines) == 6
    scalars = [(e.step, v.tag) for e in _events(logdir) for v in e.summary.value]
    assert scalars == [(3, "samples/sec"), (3, "loss"), (6, "samples/sec"), (6, "loss"),
                       (7, "samples/sec"), (7, "loss")]
    [graph] = _graphs(logdir)      # written after the rewrite only
    assert _collectives(graph) == 2


def test_monitored_session_checkpoint_dir_ends_with_the_parallel_graph(epl_env, tmp_path):
    """What MonitoredTrainingSession writes for TensorBoard: the summary writer it
    creates before the session holds the single-device graph; CheckpointSaverHook
    adds the graph after the session is created, i.e. the parallel one, and
    TensorBoard shows the newest graph of a run."""
    epl_env({"cluster.virtual_devices": 2})
    checkpoint_dir = str(tmp_path / "ckpt")
    with tf.Graph().as_default():
        train_op, _ = _model()
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, log_step_count_steps=1,
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=2)]) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    graphs = _graphs(checkpoint_dir)
    assert [_collectives(g) for g in graphs] == [0, 2]
    assert len(graphs[1].node) > len(graphs[0].node)
    tags = {v.tag for e in _events(checkpoint_dir) for v in e.summary.value}
    assert "global_step/sec" in tags


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        ProgressHook(8, every_n_steps=0)
