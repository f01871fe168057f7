"""v2 control flow (While, If and their gradients, functions of the graph's library).

A recurrent encoder written with `tf.compat.v1.while_loop` over the time steps
and a `tf.compat.v1.cond` that picks an activation by a mode switch, inside EPL
scopes: the
oracle holds under data parallelism, gradient accumulation, gradient
checkpointing and pipeline stages (io.batch_mode "replica": every copy runs
the functions at the script's shapes; each unit runs its own autodiff, since
gradient functions refer to the forward ops of the autodiff that built them).
Slicing one batch through them (io.batch_mode "global") is refused, naming the op.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.hooks.session import parallel_graph

BATCH, TIME, WIDTH, STEPS = 8, 5, 6, 3


def _recurrent_loss(inputs, labels, rng, stage):
    """A tanh RNN over TIME steps (while_loop) and a classifier head (cond)."""
    with stage(0):
        kernel = tf.compat.v1.get_variable(
            "rnn/kernel", initializer=(rng.randn(WIDTH, WIDTH) * 0.4).astype(np.float32))
        recurrent = tf.compat.v1.get_variable(
            "rnn/recurrent", initializer=(rng.randn(WIDTH, WIDTH) * 0.4).astype(np.float32))
        batch = inputs.shape[0]
        state = tf.zeros([batch, WIDTH])

        def body(t, h):
            x_t = tf.gather(inputs, t, axis=1)
            return t + 1, tf.tanh(tf.matmul(x_t, kernel) + tf.matmul(h, recurrent))

        _, final = tf.compat.v1.while_loop(lambda t, h: t < TIME, body, [tf.constant(0), state])
    with stage(1):
        hidden = tf.compat.v1.layers.dense(final, WIDTH, name="head",
                                           kernel_initializer=tf.constant_initializer(
                                               rng.randn(WIDTH, WIDTH) * 0.3))
        # a predicate that does not depend on the batch (a mode switch, as scripts
        # write `is_training`): a batch statistic would differ per replica
        use_relu = tf.compat.v1.placeholder_with_default(True, [], name="use_relu")
        hidden = tf.compat.v1.cond(use_relu, lambda: tf.nn.relu(hidden),
                                   lambda: tf.tanh(hidden))
        logits = tf.compat.v1.layers.dense(hidden, 3, name="logits",
                                           kernel_initializer=tf.constant_initializer(
                                               rng.randn(WIDTH, 3) * 0.3))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))


def _train(config: dict | None, units: int, stages: bool = False):
    tf.compat.v1.enable_control_flow_v2()
    env.reset()
    if config is not None:
        epl.init(epl.Config({"debug.check_invariants": True, **config}))
    rng = np.random.RandomState(0)
    data = np.random.RandomState(1)
    features = data.randn(BATCH, TIME, WIDTH).astype(np.float32)
    labels = data.randint(0, 3, BATCH).astype(np.int64)
    if config is None:
        stage = lambda s: contextlib.nullcontext()   # noqa: E731
    elif stages:
        stage = lambda s: epl.replicate(1, name=f"stage_{s}")   # noqa: E731
    else:
        stage = lambda s: epl.replicate(1, name="model")   # noqa: E731
    rows = BATCH // units
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [rows, TIME, WIDTH])
        y = tf.compat.v1.placeholder(tf.int64, [rows])
        loss = _recurrent_loss(x, y, rng, stage)
        train_op = tf.compat.v1.train.AdamOptimizer(0.02).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], {x: features, y: labels})[1])
                      for _ in range(STEPS)]
            values = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    env.reset()
    return losses, values, graph


@pytest.mark.parametrize("name,config,units,stages", [
    ("one-device", {"cluster.virtual_devices": 1}, 1, False),
    ("dp", {"cluster.virtual_devices": 2}, 2, False),
    ("ga", {"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 2}, 2, False),
    ("gc", {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"}, 2, False),
    ("pipeline", {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}, 2, True),
])
def test_while_and_cond_match_single_device(name, config, units, stages):
    reference = _train(None, 1)
    result = _train(config, units, stages)
    assert sorted(result[1]) == sorted(reference[1])
    for key, value in reference[1].items():
        np.testing.assert_allclose(result[1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    graph = result[2]
    whiles = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")
              and "_epl_replica" in op.node_def.attr]
    assert len(whiles) == 2 * units   # each unit's forward loop and its gradient loop
    assert parallel_graph(graph) is not None


def test_global_mode_refuses_control_flow_on_the_batch():
    tf.compat.v1.enable_control_flow_v2()
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, TIME, WIDTH])
        y = tf.compat.v1.placeholder(tf.int64, [BATCH])
        loss = _recurrent_loss(x, y, np.random.RandomState(0),
                               lambda s: epl.replicate(1, name="model"))
        tf.compat.v1.train.AdamOptimizer(0.02).minimize(loss)
        before = len(graph.get_operations())
        with pytest.raises(epl.PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == before
    env.reset()
    assert str(err.value) == (
        "pass 'replicate' rejected the graph before any rewrite: io.batch_mode 'global' slices "
        "the batch of 8 examples, but while (type While, shape (), TaskGraph model, device "
        "unset) runs v2 control flow on it: its functions were built for the whole batch and "
        "cannot run on a slice (1 more such op(s)). Use io.batch_mode 'replica' (the default: "
        "every replica runs them on a batch of the script's size), or a batch dimension of None.")
