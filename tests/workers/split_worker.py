"""Worker script for split TaskGraphs across workers (run under horovodrun).

Every worker runs a data-parallel body over its 2 virtual devices and a
classifier under epl.split(2) over the same devices; across workers the whole
model is data-parallel (the split TaskGraph's shard gradients are summed over
the workers through Horovod). Each worker feeds its own part of one global
batch; the variables after the steps must equal single-device training on the
whole global batch, computed in this same process with EPL not initialized.

With GROUP = 4 the split group spans both workers (2 x 2 devices): each
worker holds 2 of the 4 classifier shards, reads every worker's features
(all-gather through Horovod) and computes the global loss; its shards are
compared with their slices of the single-device variables.

usage: split_worker.py OPTIMIZER BATCH_SIZES OUT_DIR [GROUP [loss-outside]]
"""
import contextlib
import sys

import numpy as np
import tensorflow as tf

import epl
import epl.layers as layers
from common import global_batch, my_rows, write_record
from epl.checkpoint.sharded_variable import full_values
from epl import env

STEPS = 3
CLASSES = 12


def build(batch, use_epl, optimizer_name, group=2, loss_outside=False):
    x = tf.compat.v1.placeholder(tf.float32, [batch, 6])
    y = tf.compat.v1.placeholder(tf.int64, [batch])
    rng = np.random.RandomState(1)
    body = epl.replicate(1, name="body") if use_epl else None
    if body:
        body.__enter__()
    h = layers.dense(x, 8, activation=tf.nn.tanh, name="body",
                     kernel_initializer=tf.constant_initializer(rng.randn(6, 8) * 0.5))
    if body:
        body.__exit__(None, None, None)
    head = epl.split(group, name="classifier") if use_epl else None
    if head:
        head.__enter__()
    logits = layers.dense(h, CLASSES, name="classifier",
                          kernel_initializer=tf.constant_initializer(rng.randn(8, CLASSES) * 0.5))
    if not loss_outside:
        loss = layers.sparse_softmax_cross_entropy(y, logits)
    if head:
        head.__exit__(None, None, None)
    if loss_outside:   # replicated ops read the split logits
        with (epl.replicate(1, name="body") if use_epl else contextlib.nullcontext()):
            loss = layers.sparse_softmax_cross_entropy(y, logits)
    opt = (tf.compat.v1.train.AdamOptimizer(0.05) if optimizer_name == "adam"
           else tf.compat.v1.train.GradientDescentOptimizer(0.5))
    return x, y, loss, opt.minimize(loss)


def train(items, features, labels):
    x, y, loss, train_op = items
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [float(sess.run([loss, train_op], {x: features, y: labels})[0])
                  for _ in range(STEPS)]
        return losses, full_values(sess, sess.graph)


def main():
    optimizer_name, sizes, out_dir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
    group = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    loss_outside = len(sys.argv) > 5 and sys.argv[5] == "loss-outside"
    tf.compat.v1.disable_eager_execution()
    total = sum(sizes)
    features, labels = global_batch(sizes, CLASSES)
    with tf.Graph().as_default():
        ref_losses, ref_vars = train(build(total, False, optimizer_name, loss_outside=loss_outside),
                                     features, labels)

    # a group over every worker computes over every worker's whole batch at once, which
    # EPL supports under io.batch_mode "global"; a group within a worker runs under the
    # default contract (the worker's rows are its 2 replicas' batches)
    mode = "global" if group > 2 else "replica"
    epl.init(epl.Config({"cluster.virtual_devices": 2, "io.batch_mode": mode,
                         "cluster.colocate_split_and_replicate": True}))
    rank, part = my_rows(sizes)
    script_batch = sizes[rank] if mode == "global" else sizes[rank] // 2
    with tf.Graph().as_default():
        try:
            losses, variables = train(build(script_batch, True, optimizer_name, group,
                                            loss_outside),
                                      features[part], labels[part])
        except epl.EPLError as err:
            print(f"EPL-ERROR rank {rank}: {err}", flush=True)
            raise
    held = {name: float(np.mean(~np.isnan(variables[name]))) for name in ref_vars}
    errors = {name: float(np.nanmax(np.abs(variables[name] - value)))
              for name, value in ref_vars.items()}
    write_record(out_dir, rank, {"rank": rank, "losses": losses, "ref_losses": ref_losses,
                                 "errors": errors, "held": held})
    env.reset()


if __name__ == "__main__":
    main()
