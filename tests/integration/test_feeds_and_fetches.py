"""Feeds and fetches mean what they mean in plain TensorFlow, on one device and several.

- A fed tensor reaches every copy of the model that reads it: a scalar placeholder (a
  learning rate, a keep probability), a `placeholder_with_default` (an is-training
  flag), any other fed tensor, on every replica and micro-batch.
- A fetch of a tensor that has one value per replica and is in no EPL merge
  collection returns replica 0's value (its first micro-batch's), with one warning
  per tensor naming it and the collections; so does a tensor built after the rewrite
  on such tensors.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env

B = 4
DATA = np.arange(48, dtype=np.float32).reshape(16, 3) / 10
LAYOUTS = {"one_device": {"cluster.virtual_devices": 1},
           "two_replicas": {"cluster.virtual_devices": 2},
           "micro_batches": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}}


def _units(config: dict) -> int:
    return config["cluster.virtual_devices"] * config.get("pipeline.num_micro_batch", 1)


def _scaled_model(rows: int, scale: tf.Tensor):
    x = tf.compat.v1.placeholder(tf.float32, [rows, 3], name="x")
    w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1], np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w))) * scale
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
    return x, loss, train_op


def _fed_run(config: dict | None, kind: str, value: float, callable_: bool = False):
    """(loss, final w) of two steps with the scale fed `value`."""
    env.reset()
    units = 1
    if config is not None:
        epl.init(epl.Config(dict(config)))
        units = _units(config)
    rows = len(DATA) // 2
    with tf.Graph().as_default():
        if kind == "placeholder_with_default":
            scale = tf.compat.v1.placeholder_with_default(1.0, [], name="scale")
        elif kind == "placeholder":
            scale = tf.compat.v1.placeholder(tf.float32, [], name="scale")
        else:   # any fed tensor: an identity of a constant
            scale = tf.identity(tf.constant(1.0), name="scale")
        x, loss, train_op = _scaled_model(rows // units, scale)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            if callable_:   # Session.make_callable: the same as Session.run
                step = sess.make_callable([loss, train_op], feed_list=[x, scale])
                losses = [step(DATA[i * rows:(i + 1) * rows], value)[0] for i in range(2)]
            else:
                losses = [sess.run([loss, train_op], {x: DATA[i * rows:(i + 1) * rows],
                                                      scale: value})[0] for i in range(2)]
            return losses, sess.run(tf.compat.v1.trainable_variables()[0])
    env.reset()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["placeholder_with_default", "placeholder", "tensor"])
def test_a_fed_tensor_reaches_every_copy(kind, layout):
    reference = _fed_run(None, kind, 0.5)
    result = _fed_run(LAYOUTS[layout], kind, 0.5)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-6)
    if kind == "placeholder_with_default":   # fed 0: no loss, no update
        zero = _fed_run(LAYOUTS[layout], kind, 0.0)
        assert zero[0] == [0.0, 0.0]
        np.testing.assert_array_equal(zero[1], np.ones([3, 1], np.float32))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_make_callable_runs_what_session_run_runs(layout):
    """A step made with Session.make_callable fetches the merged loss and trains as
    Session.run does (TensorFlow's own callable bypasses Session.run)."""
    reference = _fed_run(None, "placeholder", 0.5)
    result = _fed_run(LAYOUTS[layout], "placeholder", 0.5, callable_=True)
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-6)


def test_a_per_replica_fetch_is_replica_0s_value_with_one_warning(caplog):
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        x, loss, train_op = _scaled_model(B, tf.constant(1.0))
        activation = tf.matmul(x, tf.compat.v1.trainable_variables()[0], name="activation")
        with tf.compat.v1.Session() as sess, caplog.at_level(logging.WARNING, logger="epl"):
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: DATA[:2 * B]}
            first = sess.run(activation, feed)
            again, value = sess.run([activation, loss], feed)
            doubled = loss * 2.0                   # built after the rewrite, on the model
            late = sess.run(doubled, feed)
    np.testing.assert_allclose(first, DATA[:B].sum(axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(again, first)
    np.testing.assert_allclose(value, np.mean(np.square(DATA[:2 * B].sum(axis=1))), rtol=1e-6)
    np.testing.assert_allclose(late, 2 * np.mean(np.square(DATA[:B].sum(axis=1))), rtol=1e-6)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.getMessage().startswith("fetching")]
    assert warnings == [
        "fetching activation:0, which has one value per replica and micro-batch and is in no "
        "EPL merge collection: it returns replica 0's value (its first micro-batch's). For the "
        "value over the global batch, add it to epl.GraphKeys.GLOBAL_MEAN_OBJECTS (a mean over "
        "examples), GLOBAL_SUM_OBJECTS (a sum or count) or GLOBAL_CONCAT_OBJECTS (one row per "
        "example) with epl.add_to_collection before the first session.",
        "fetching mul_1:0, which was built after EPL rewrote the graph, on tensors that have "
        "one value per replica and is in no EPL merge collection: it returns replica 0's value "
        "(its first micro-batch's). For the value over the global batch, add it to "
        "epl.GraphKeys.GLOBAL_MEAN_OBJECTS (a mean over examples), GLOBAL_SUM_OBJECTS (a sum or "
        "count) or GLOBAL_CONCAT_OBJECTS (one row per example) with epl.add_to_collection "
        "before the first session."]
