"""Worker script for the multi-worker oracle (run under horovodrun).

Every worker trains the same MLP on its own part of one global batch with EPL
(local data parallelism over its virtual devices, Horovod between workers) and
compares the variables after the steps with single-device training on the
whole global batch, computed in this same process with EPL not initialized.

usage: oracle_worker.py OPTIMIZER BATCH_SIZES OUT_DIR [MODE]
  BATCH_SIZES: comma-separated rows per worker, e.g. "8,8" or "12,4"
  MODE: io.batch_mode, "replica" (default: the worker's script batch is one of
  its 2 replicas' batches, rows / 2, and the feed holds both) or "global" (the
  script's batch is the worker's rows, sliced among its replicas)
"""
import sys

import numpy as np
import tensorflow as tf

import epl
from common import global_batch, my_rows, write_record
from epl import env

STEPS = 4


def build(batch, scope, optimizer_name):
    x = tf.compat.v1.placeholder(tf.float32, [batch, 6])
    y = tf.compat.v1.placeholder(tf.int64, [batch])
    rng = np.random.RandomState(1)
    ctx = epl.replicate(1) if scope else None
    if ctx:
        ctx.__enter__()
    w1 = tf.compat.v1.get_variable("w1", initializer=rng.randn(6, 8).astype(np.float32) * 0.5)
    b1 = tf.compat.v1.get_variable("b1", initializer=np.zeros(8, np.float32))
    w2 = tf.compat.v1.get_variable("w2", initializer=rng.randn(8, 3).astype(np.float32) * 0.5)
    logits = tf.matmul(tf.nn.tanh(tf.matmul(x, w1) + b1), w2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    if ctx:
        ctx.__exit__(None, None, None)
    step = tf.compat.v1.train.get_or_create_global_step()
    opt = (tf.compat.v1.train.AdamOptimizer(0.05) if optimizer_name == "adam"
           else tf.compat.v1.train.GradientDescentOptimizer(0.5))
    train = opt.minimize(loss, global_step=step)
    return x, y, loss, train, [w1, b1, w2, step]


def train(graph_items, features, labels):
    x, y, loss, train_op, variables = graph_items
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [float(sess.run([loss, train_op], {x: features, y: labels})[0]) for _ in range(STEPS)]
        return losses, [np.asarray(v) for v in sess.run(variables)]


def main():
    optimizer_name, sizes, out_dir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "replica"
    tf.compat.v1.disable_eager_execution()
    total = sum(sizes)
    features, labels = global_batch(sizes, 3)
    with tf.Graph().as_default():
        ref_losses, ref_vars = train(build(total, False, optimizer_name), features, labels)

    epl.init(epl.Config({"cluster.virtual_devices": 2, "io.batch_mode": mode}))
    rank, part = my_rows(sizes)
    script_batch = sizes[rank] // 2 if mode == "replica" else sizes[rank]
    with tf.Graph().as_default():
        losses, variables = train(build(script_batch, True, optimizer_name), features[part],
                                  labels[part])
    # Random initial values differ per worker unless broadcast: perturb worker 1's start
    errors = [float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(variables, ref_vars)]
    result = {"rank": rank, "losses": losses, "ref_losses": ref_losses, "errors": errors}
    write_record(out_dir, rank, result)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(variables, ref_vars):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    env.reset()


if __name__ == "__main__":
    main()
