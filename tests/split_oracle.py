"""The oracle for split models (tensor and expert parallelism), in both batch contracts.

`assert_matches_single_device(name, build, mode)`: EPL's training equals
single-device training on the rows the replicas consumed, concatenated in
replica order: io.batch_mode "replica" (EPL's contract: the script's
placeholder holds one replica's batch, ROWS / REPLICAS rows, and the feed holds
every replica's rows) and "global" (the script's batch is the step's ROWS rows,
sliced among the replicas). Both consume the same ROWS rows, so one reference
serves both. The tolerance comes from the reference's noise floor
(tests/conftest.py): the same single-device training with the loss computed
over two halves of the batch.

What is compared: every stored variable (the shards reassembled by their
checkpoint slice info, optimizer slots included), the per-step losses, and the
user's variable objects: tf.compat.v1.trainable_variables() lists the
single-device names, and `sess.run(v)` on each returns its full value.

A builder is `build(rows) -> (model, inputs, feed)`: `model(*inputs) -> loss`
builds the model on placeholders `inputs` with a static batch of `rows`, and
`feed(rng, n)` gives n rows for them.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import epl
from epl import env
from epl.checkpoint.sharded_variable import full_values

ROWS = 8          # rows a step consumes (the reference's batch)
REPLICAS = 4      # 4 virtual devices, one-device replicas


def train(build, rows: int, config: dict | None, steps: int, chunks: int = 1):
    """(losses, stored variable values, the user's trainable variable values, graph):
    train `build` with a placeholder batch of `rows` (EPL: `config`; None: plain
    TensorFlow) on the step's ROWS rows; chunks > 1 computes the loss as the mean over
    that many equal parts of the batch."""
    env.reset()
    if config is not None:
        epl.init(epl.Config({"cluster.virtual_devices": REPLICAS,
                             "debug.check_invariants": True, **config}))
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(7)
        model, inputs, feed = build(rows)
        if chunks == 1:
            loss = model(*inputs)
        else:
            parts = zip(*(tf.split(t, chunks) for t in inputs))
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                             reuse=tf.compat.v1.AUTO_REUSE):
                loss = tf.add_n([model(*part) for part in parts]) / chunks
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        data = feed(np.random.RandomState(0), ROWS)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], data)[1]) for _ in range(steps)]
            values = full_values(sess, graph)
            trainable = tf.compat.v1.trainable_variables()
            user = dict(zip([v.op.name for v in trainable], sess.run(trainable)))
    env.reset()
    return losses, values, user, graph


_REFERENCES: dict = {}


def _reference(build_name: str, build, steps: int):
    """Single-device training on the ROWS rows, and its noise floor per variable."""
    key = (build_name, steps)
    if key not in _REFERENCES:
        plain = train(build, ROWS, None, steps)
        halves = train(build, ROWS, None, steps, chunks=2)
        floor = {name: float(np.max(np.abs(halves[1][name] - value)))
                 for name, value in plain[1].items()}
        floor["<losses>"] = float(np.max(np.abs(np.array(halves[0]) - plain[0])))
        _REFERENCES[key] = (plain, floor)
    return _REFERENCES[key]


def assert_matches_single_device(build_name: str, build, mode: str, config=None, steps=3):
    """EPL under io.batch_mode `mode` trains like single-device TensorFlow on the same
    ROWS rows; returns the EPL graph. In "replica" mode the script's batch is one
    replica's (ROWS / REPLICAS rows), in "global" mode the whole step's."""
    from conftest import ATOL, NOISE_FACTOR, RTOL
    rows = ROWS // REPLICAS if mode == "replica" else ROWS
    losses, values, user, graph = train(build, rows, {"io.batch_mode": mode, **(config or {})},
                                        steps)
    assert epl.parallelize(graph).plan.num_replicas == REPLICAS
    (ref_losses, ref_values, ref_user, _), floor = _reference(build_name, build, steps)
    assert sorted(user) == sorted(ref_user)   # the user's variables, single-device names
    for name, value in user.items():
        np.testing.assert_array_equal(value, values[name], err_msg=f"sess.run({name})")
    assert sorted(values) == sorted(ref_values)
    for name, value in ref_values.items():
        assert not np.isnan(values[name]).any(), f"shards of {name} do not cover it"
        np.testing.assert_allclose(values[name], value, rtol=RTOL,
                                   atol=max(ATOL, NOISE_FACTOR * floor[name]), err_msg=name)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL,
                               atol=max(ATOL, NOISE_FACTOR * floor["<losses>"]),
                               err_msg="per-step losses")
    return graph
