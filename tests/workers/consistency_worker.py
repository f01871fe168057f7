"""Worker script for replica consistency across workers (run under horovodrun).

2 workers x 2 virtual devices, 4 units of 4 rows (16 rows a step). In one process:
- batch norm's moving statistics under both `batch_norm.moving_statistics` rules, and
  tf.compat.v1.metrics (accuracy, mean) with their update ops in GLOBAL_MEAN_OBJECTS:
  the statistics by their rule's definition over the job's units (the same on every
  worker), the metrics over the job's global batch (single-device training's);
- ZeRO with Google BERT's optimizer (tf.gradients, clip_by_global_norm, weight-decay
  Adam of assign ops) against single-device training.

usage: consistency_worker.py OUT_DIR
"""
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import bert_like  # noqa: E402
import epl  # noqa: E402
from common import write_record  # noqa: E402
from epl import env  # noqa: E402

UNIT, STEPS, WORKERS, DEVICES = 4, 2, 2, 2
RNG = np.random.RandomState(9)
X = RNG.randn(UNIT * WORKERS * DEVICES * STEPS, 3).astype(np.float32)
Y = RNG.randint(0, 2, len(X)).astype(np.int64)


def _rows(step: int, rank: int | None):
    """The step's rows: every worker's (rank None) or this worker's two units."""
    per_step = UNIT * WORKERS * DEVICES
    start = step * per_step + (0 if rank is None else rank * UNIT * DEVICES)
    stop = start + (per_step if rank is None else UNIT * DEVICES)
    return X[start:stop], Y[start:stop]


def _batch_norm_script(rows: int, use_epl: bool):
    x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
    y = tf.compat.v1.placeholder(tf.int64, [rows])
    normalized = tf.compat.v1.layers.batch_normalization(x, training=True, momentum=0.9)
    normalized_logits = tf.compat.v1.layers.dense(normalized, 2, name="normalized")
    # the metrics read a head without batch norm, which single-device training computes
    # alike (batch norm in training mode normalizes each unit by its own batch)
    logits = tf.compat.v1.layers.dense(x, 2, name="plain",
                                       kernel_initializer=tf.constant_initializer(
                                           [[0.4, -0.3], [0.2, 0.1], [-0.5, 0.3]]))
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    loss = tf.reduce_mean(per_example) + tf.reduce_mean(tf.square(normalized_logits))
    accuracy, accuracy_update = tf.compat.v1.metrics.accuracy(y, tf.argmax(logits, 1))
    mean_loss, mean_update = tf.compat.v1.metrics.mean(per_example)
    if use_epl:
        epl.add_to_collection([accuracy_update], epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return x, y, [train, accuracy_update, mean_update], [accuracy, mean_loss]


def run_batch_norm(rule: str | None) -> dict:
    """rule None: single-device training on every worker's rows."""
    env.reset()
    rank = None
    if rule is not None:
        epl.init(epl.Config({"cluster.virtual_devices": DEVICES,
                             "batch_norm.moving_statistics": rule,
                             "communication.collective_timeout_s": 60}))
        rank = epl.Cluster.current().worker_rank
    rows = UNIT if rule is not None else UNIT * WORKERS * DEVICES
    with tf.Graph().as_default():
        x, y, fetches, values = _batch_norm_script(rows, rule is not None)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            updates = []
            for step in range(STEPS):
                features, labels = _rows(step, rank)
                updates.append([float(v) for v in sess.run(fetches, {x: features, y: labels})[1:]])
            named = {v.op.name: v for v in tf.compat.v1.global_variables()}
            mean, variance = sess.run([named["batch_normalization/moving_mean"],
                                       named["batch_normalization/moving_variance"]])
            return {"updates": updates, "values": [float(v) for v in sess.run(values)],
                    "moving_mean": mean.tolist(), "moving_variance": variance.tolist()}


def expected_statistics(rule: str) -> dict:
    """The moving statistics by the rule's definition over the job's 4 units a step."""
    mean, variance = np.zeros(3), np.ones(3)
    for step in range(STEPS):
        features, _ = _rows(step, None)
        units = [features[u * UNIT:(u + 1) * UNIT] for u in range(WORKERS * DEVICES)]
        if rule == "replica0":
            units = units[:1]
        mean = 0.9 * mean + 0.1 * np.mean([u.mean(axis=0) for u in units], axis=0)
        variance = 0.9 * variance + 0.1 * np.mean([u.var(axis=0) for u in units], axis=0)
    return {"moving_mean": mean.tolist(), "moving_variance": variance.tolist()}


def run_zero(use_epl: bool) -> dict:
    env.reset()
    rank = None
    if use_epl:
        epl.init(epl.Config({"cluster.virtual_devices": DEVICES, "zero.level": "v1",
                             "communication.collective_timeout_s": 60}))
        rank = epl.Cluster.current().worker_rank
    rows = UNIT if use_epl else UNIT * WORKERS * DEVICES
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [rows, 3])
        y = tf.compat.v1.placeholder(tf.int64, [rows])
        hidden = tf.compat.v1.layers.dense(x, 5, activation=tf.tanh,
                                           kernel_initializer=tf.constant_initializer(0.3))
        logits = tf.compat.v1.layers.dense(hidden, 2, kernel_initializer=tf.constant_initializer(-0.2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        variables = tf.compat.v1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 0.3)
        train = bert_like.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.01).apply_gradients(
            zip(grads, variables))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = []
            for step in range(STEPS):
                features, labels = _rows(step, rank)
                losses.append(float(sess.run([train, loss], {x: features, y: labels})[1]))
            return {"losses": losses,
                    "variables": {v.op.name: sess.run(v).tolist() for v in variables}}


def _plain(value):
    """`value` with numpy arrays and scalars as lists and floats (for JSON)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def main():
    out_dir = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    record = {"reference": run_batch_norm(None), "zero_reference": run_zero(False)}
    for rule in ("replica0", "mean"):
        record[rule] = run_batch_norm(rule)
        record[f"{rule}_expected"] = expected_statistics(rule)
    record["zero"] = run_zero(True)
    record["rank"] = rank = epl.Cluster.current().worker_rank
    write_record(out_dir, rank, _plain(record))
    env.reset()


if __name__ == "__main__":
    main()
