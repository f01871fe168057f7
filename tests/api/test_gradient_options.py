"""Every gradient option on every gradient path: the same numbers as single-device training.

The paths a script builds its gradients by: `Optimizer.minimize`; the script's own
`tf.gradients`, clipped by global norm, then an optimizer's `apply_gradients`; and
Google BERT's optimization.py (tf.gradients, clip_by_global_norm, an optimizer whose
apply_gradients is its own assign ops, a global step incremented by hand). Each gets
communication.sparse_as_dense, fp16 compression, AMP loss scaling, gradient
checkpointing, micro-batches and ZeRO (which clips the DeepSpeed way: the shards'
squared norms summed over the replicas). The model has an embedding lookup, so its
table's gradient is sparse unless sparse_as_dense makes it dense.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.hooks.session import parallel_graph

import bert_like
from conftest import ATOL, NOISE_FACTOR, RTOL   # the oracle's tolerance rule

VOCAB, SEQ, WIDTH, CLASSES, B, STEPS = 16, 4, 6, 3, 4, 3
RNG = np.random.RandomState(11)
IDS = RNG.randint(0, VOCAB, [64, SEQ]).astype(np.int32)
LABELS = RNG.randint(0, CLASSES, 64).astype(np.int32)
OPTIONS = {
    "sparse_as_dense": {"cluster.virtual_devices": 2, "communication.sparse_as_dense": True},
    "fp16": {"cluster.virtual_devices": 2, "communication.fp16": True},
    "amp": {"cluster.virtual_devices": 2, "amp.level": "O1", "amp.loss_scale": 128.0},
    "gradient_checkpoint": {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"},
    "micro_batches": {"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 2},
    "zero": {"cluster.virtual_devices": 2, "zero.level": "v1",
             "communication.sparse_as_dense": True},
}
# fp16 compression and AMP round the gradients: their tolerance. The others differ
# from single-device training by float noise only: RTOL, and an atol from the noise
# floor measured on this machine (tests/conftest.py: the same training with the
# batch's loss as the mean of its two halves' losses; AVX2 and AVX-512 kernels round
# differently, and Adam amplifies it near its epsilon: 8e-6 in hidden/bias on an AVX2
# EPYC, where a fixed atol of 1e-6 failed).
LOOSE = {"fp16": dict(rtol=2e-3, atol=2e-4), "amp": dict(rtol=2e-2, atol=2e-3)}


def _model(ids, labels):
    table = tf.compat.v1.get_variable("table", initializer=np.linspace(
        -1, 1, VOCAB * WIDTH, dtype=np.float32).reshape(VOCAB, WIDTH))
    pooled = tf.reduce_mean(tf.gather(table, ids), axis=1)
    hidden = tf.compat.v1.layers.dense(pooled, 8, activation=tf.tanh, name="hidden",
                                       kernel_initializer=tf.constant_initializer(0.2))
    logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits",
                                       kernel_initializer=tf.constant_initializer(-0.1))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))


def _minimize(loss, global_step):
    return tf.compat.v1.train.AdamOptimizer(0.05).minimize(loss, global_step=global_step)


def _clip_then_apply(loss, global_step):
    variables = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, variables)
    grads, _ = tf.clip_by_global_norm(grads, 0.5)
    return tf.compat.v1.train.AdamOptimizer(0.05).apply_gradients(
        zip(grads, variables), global_step=global_step)


def _bert_optimizer(loss, global_step):
    """Google BERT's create_optimizer, scaled down (tests/bert_like.py)."""
    variables = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, variables)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=0.5)
    optimizer = bert_like.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.01)
    train_op = optimizer.apply_gradients(zip(grads, variables), global_step=global_step)
    return tf.group(train_op, global_step.assign(global_step + 1))


PATHS = {"minimize": _minimize, "tf_gradients": _clip_then_apply, "bert": _bert_optimizer}


def _train(path: str, config: dict | None, halves: bool = False):
    """halves: single-device, the loss the mean of the two halves' losses (the noise floor)."""
    env.reset()
    units = 1
    if config is not None:
        epl.init(epl.Config(dict(config)))
        units = config["cluster.virtual_devices"] * config.get("pipeline.num_micro_batch", 1)
    rows = 2 * B // units
    with tf.Graph().as_default() as graph:
        ids = tf.compat.v1.placeholder(tf.int32, [rows, SEQ], name="ids")
        labels = tf.compat.v1.placeholder(tf.int32, [rows], name="labels")
        if halves:
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                             reuse=tf.compat.v1.AUTO_REUSE):
                loss = tf.add_n([_model(*part) for part in
                                 zip(tf.split(ids, 2), tf.split(labels, 2))]) / 2
        else:
            loss = _model(ids, labels)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = PATHS[path](loss, global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train_op, loss], {ids: IDS[i * 2 * B:(i + 1) * 2 * B],
                                                  labels: LABELS[i * 2 * B:(i + 1) * 2 * B]})[1]
                      for i in range(STEPS)]
            values = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    env.reset()
    return losses, values, graph


_REFERENCES: dict = {}   # path -> (single-device result, {variable or "<losses>": floor})


def _reference(path: str):
    if path not in _REFERENCES:
        reference, halves = _train(path, None), _train(path, None, halves=True)
        floor = {name: float(np.max(np.abs(halves[1][name] - value)))
                 for name, value in reference[1].items()}
        floor["<losses>"] = float(np.max(np.abs(np.array(halves[0]) - reference[0])))
        _REFERENCES[path] = reference, floor
    return _REFERENCES[path]


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_gradient_option_on_every_gradient_path(path, option):
    reference, floor = _reference(path)
    losses, values, graph = _train(path, OPTIONS[option])

    def tolerance(name):
        return LOOSE.get(option, dict(rtol=RTOL, atol=max(ATOL, NOISE_FACTOR * floor[name])))
    np.testing.assert_allclose(losses, reference[0], err_msg="losses", **tolerance("<losses>"))
    for name, value in reference[1].items():
        np.testing.assert_allclose(values[name], value, err_msg=name, **tolerance(name))
    if option in ("sparse_as_dense", "zero"):   # the table's gradient was reduced dense
        view = parallel_graph(graph).view
        table = [g for g, v in view.gradients if v.name == "table"]
        assert table and not isinstance(table[0], tf.IndexedSlices)
