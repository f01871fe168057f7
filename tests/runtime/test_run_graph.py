"""A session of a parallelized graph runs the run graph: the ops its runs need
(epl/runtime/run_graph.py).

- The oracle: a pipelined TF1 model (`tf.compat.v1.layers`, 2 stages, 4
  micro-batches, Adam, unit functions on) trains bit for bit as with `debug.whole_graph_sessions` (the whole
  graph in the session), and a Saver built after the first steps saves and restores.
- The structure: the run graph holds under half of the rewritten graph and none of
  the copies the unit functions replaced past the first unit.
- The names: an op named like a scope of an op the run graph already holds (TensorFlow's
  import refuses that name) is found by its own name all the same.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as c_api

import epl
from epl.hooks.session import parallel_graph
from epl.ir.annotations import MICRO_BATCH_ATTR
from epl.runtime.run_graph import attach_session, run_graph

MICRO = 4
CONFIG = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": MICRO}


def _build():
    """A two-stage TF1 classifier; returns (train op, loss, feed of every unit's rows)."""
    rng = np.random.RandomState(0)
    init = tf.compat.v1.constant_initializer
    x = tf.compat.v1.placeholder(tf.float32, [8, 6], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [8], name="y")
    with epl.replicate(device_count=1, name="stage_0"):
        h = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu,
                                      kernel_initializer=init(rng.randn(6, 16) / 3))
        h = tf.compat.v1.layers.dense(h, 16, activation=tf.nn.tanh,
                                      kernel_initializer=init(rng.randn(16, 16) / 4))
    with epl.replicate(device_count=1, name="stage_1"):
        logits = tf.compat.v1.layers.dense(h, 3, kernel_initializer=init(rng.randn(16, 3) / 4))
        loss = tf.reduce_mean(tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits))
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
    feed = {x: rng.randn(8 * MICRO, 6).astype(np.float32),   # every micro-batch's rows
            y: rng.randint(0, 3, size=[8 * MICRO]).astype(np.int32)}
    return train, loss, feed


def _train(tmp_path, steps: int = 3):
    """(losses, variables, the graph, the session's run graph) of the two-stage model:
    `steps` steps, a Saver built then saves and restores, then `steps` more."""
    with tf.Graph().as_default() as graph:
        train, loss, feed = _build()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train, loss], feed)[1]) for _ in range(steps)]
            saver = tf.compat.v1.train.Saver()   # built after the session's first runs
            path = saver.save(sess, str(tmp_path / "model"))
            sess.run(train, feed)        # moved away from the checkpoint...
            saver.restore(sess, path)    # ...and back
            losses += [float(sess.run([train, loss], feed)[1]) for _ in range(steps)]
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            values = dict(zip([v.op.name for v in variables], sess.run(variables)))
            runs = sess.__dict__.get("_epl_run_graph")
    return losses, values, graph, runs


def test_a_session_runs_what_its_runs_need_and_trains_as_on_the_whole_graph(epl_env, tmp_path):
    epl_env({**CONFIG, "debug.whole_graph_sessions": True})
    whole_losses, whole_values, _, whole_runs = _train(tmp_path / "whole")
    assert whole_runs is None
    epl_env(CONFIG)
    losses, values, graph, runs = _train(tmp_path / "run")
    assert losses == whole_losses
    assert sorted(values) == sorted(whole_values)
    for name, value in whole_values.items():
        np.testing.assert_array_equal(values[name], value, err_msg=name)

    assert runs is run_graph(graph)
    held = set(runs._ops)
    assert len(held) < len(graph.get_operations()) / 2, (len(held), len(graph.get_operations()))
    result = parallel_graph(graph)
    later = [op.name for op in result.outlined
             if MICRO_BATCH_ATTR in op.node_def.attr and op.get_attr(MICRO_BATCH_ATTR) > 0]
    assert later and not held & set(later)


def test_an_op_named_like_a_scope_of_one_the_run_graph_holds_runs_by_its_name():
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        outer = tf.add(x, 1.0, name="a")
        inner = tf.raw_ops.Mul(x=x, y=tf.constant(3.0), name="a/inner")
        assert inner.op.name == "a/inner"
        with tf.compat.v1.colocate_with(outer.op):
            beside = tf.negative(x, name="beside")   # colocated with "a"
        with tf.compat.v1.Session() as sess:
            attach_session(sess, sess._config)
            runs = sess.__dict__["_epl_run_graph"]
            np.testing.assert_array_equal(sess.run(inner, {x: [1.0, 2.0]}), [3.0, 6.0])
            assert "a" not in runs._ops
            # "a" is a scope of "a/inner" in the run graph now: it comes in under another
            # name, and the run finds it by its own
            np.testing.assert_array_equal(sess.run(outer, {x: [1.0, 2.0]}), [2.0, 3.0])
            np.testing.assert_array_equal(sess.run([outer, inner], {x: [0.0, 1.0]}),
                                          [[1.0, 2.0], [0.0, 3.0]])
            names = {n.name for n in runs.graph.as_graph_def().node}
            assert "a/inner" in names and "a" not in names and len(names) == len(runs)
            # an op colocated with it, copied in by a later run, is colocated with it there
            np.testing.assert_array_equal(sess.run(beside, {x: [1.0, 2.0]}), [-1.0, -2.0])
            node = next(n for n in runs.graph.as_graph_def().node if n.name == "beside")
            renamed = c_api.TF_OperationName(runs._ops["a"])
            assert renamed != "a" and list(node.attr["_class"].list.s) == [
                b"loc:@" + renamed.encode()]
