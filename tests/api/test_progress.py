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
from epl.ir.collectives import is_reduction_node
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
    """The all-reduces of a GraphDef: collective ops, and the sums on one device of
    the CPU default (communication.local_reduction "auto"; one per bucket)."""
    return sum(node.op.startswith("Collective") or is_reduction_node(node)
               for node in graph_def.node)


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
    assert scalars == [(step, tag) for step in (3, 6, 7)
                       for tag in ("samples/sec", "global_step/sec", "loss")]
    [graph] = _graphs(logdir)      # written after the rewrite only
    assert _collectives(graph) == 1


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
    assert [_collectives(g) for g in graphs] == [0, 1]
    assert len(graphs[1].node) > len(graphs[0].node)
    tags = {v.tag for e in _events(checkpoint_dir) for v in e.summary.value}
    assert "global_step/sec" in tags


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        ProgressHook(8, every_n_steps=0)
    with pytest.raises(ValueError) as caught:
        ProgressHook(8, batch_size=4)
    assert str(caught.value) == (
        "give ProgressHook one of samples_per_step (what one run of this worker consumes) and "
        "batch_size (the script's batch), got samples_per_step=8, batch_size=4")


class _Clock:
    """A clock for ProgressHook: 1 s per run, 100 s for a traced run (the run's own
    time, added by `_Runtime` before ProgressHook reads the clock after the run)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    @staticmethod
    def time():
        return 0.0


class _Runtime(tf.compat.v1.train.SessionRunHook):
    """Advances the clock by each run's time (listed before ProgressHook, so its after_run
    comes first)."""

    def __init__(self, clock, tracer_of):
        self.clock, self.tracer_of = clock, tracer_of

    def after_run(self, run_context, run_values):
        tracer = self.tracer_of()
        self.clock.now += 100.0 if tracer is not None and tracer.last_run_traced else 1.0


def test_batch_size_gives_the_job_batch_and_traced_runs_stay_out_of_the_rates(
        epl_env, tmp_path, monkeypatch):
    """With batch_size, the hook counts the step's units from the parallel graph (2
    replicas x 16); the traced run 3 (debug.trace_dir) is left out of the rates, which
    are exactly 32 samples per 1 s run."""
    from epl.observability import progress
    from epl.hooks.session import parallel_graph
    clock = _Clock()
    monkeypatch.setattr(progress, "time", clock)
    epl_env({"cluster.virtual_devices": 2, "debug.trace_dir": str(tmp_path / "trace"),
             "debug.trace_steps": [3]})
    lines: list[str] = []
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensor_slices(
            np.ones([64, 8], np.float32)).repeat().batch(BATCH)).get_next()
        with epl.replicate(device_count=1):
            loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 1, name="out") ** 2)
        step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
        hook = ProgressHook(batch_size=BATCH, tensors={"loss": loss}, every_n_steps=2,
                            last_step=5, print_fn=lines.append)
        runtime = _Runtime(clock, lambda: parallel_graph(graph).tracer)
        with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=5), runtime, hook]) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    assert lines[0] == ("session ready after 0.0 s (graph rewrite and variable "
                        "initialization); global batch 32 (2 replicas x 16)")
    assert hook.samples_per_step == 32 and hook.batch.units_per_worker == 2
    assert [re.sub(r"loss \d+\.\d+", "loss L", line) for line in lines[2:]] == [
        "step     2  loss L         32 samples/s",
        "step     4  loss L         32 samples/s  (1 traced run not counted)",
        "step     5  loss L         32 samples/s",
        "done: 5 steps in 104.0 s (session start 0.0 s, first step 1.00 s, then 32 samples/s); "
        "final loss L"]


def test_logdir_holds_one_graph_the_parallel_one_without_the_dataset(epl_env, tmp_path):
    """ProgressHook's logdir (MonitoredTrainingSession without summary_dir, as the
    examples run) holds one graph event, the parallel graph, whose 128 KiB dataset
    constant is left out; TensorBoard's Python loader (--load_fast=false) shows it."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    epl_env({"cluster.virtual_devices": 2})
    logdir = str(tmp_path / "tb")
    with tf.Graph().as_default():
        data = np.random.RandomState(0).rand(4096, 8).astype(np.float32)
        x = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(data).repeat().batch(BATCH)).get_next()
        with epl.replicate(device_count=1):
            loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 1, name="out") ** 2)
        step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, step)
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=3),
                 ProgressHook(batch_size=BATCH, tensors={"loss": loss}, every_n_steps=1,
                              output_dir=logdir, print_fn=lambda line: None)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train_op)
    [graph] = _graphs(logdir)
    assert _collectives(graph) == 1
    elided = [node for node in graph.node if "_epl_dump_elided" in node.attr]
    assert [node.attr["_epl_dump_elided"].i >= data.nbytes for node in elided] == [True]
    assert sum(os.path.getsize(p) for p in glob.glob(os.path.join(logdir, "*"))) < data.nbytes
    accumulator = plugin_event_accumulator.EventAccumulator(logdir)
    accumulator.Reload()
    shown = accumulator.Graph()
    assert _collectives(shown) == 1 and len(shown.node) == len(graph.node)
