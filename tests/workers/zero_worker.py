"""Worker script for ZeRO across workers (run under horovodrun).

Like oracle_worker.py, with `zero.level: "v1"`: the optimizer state is sharded
over every replica of every worker (2 workers x 2 virtual devices = 4 shards).
Compares the variables (and Adam's moments, read back through the checkpoint
copies) with single-device training on the whole global batch, and records the
optimizer-state bytes per device of this worker.

usage: zero_worker.py OPTIMIZER BATCH_SIZES OUT_DIR
"""
import sys

import numpy as np
import tensorflow as tf

import epl
from common import global_batch, my_rows, write_record
from epl import env
from epl.passes.zero import optimizer_state_bytes
from oracle_worker import STEPS, build


def train(graph_items, features, labels):
    """Train STEPS steps; return losses, the variables and every global variable by name."""
    x, y, loss, train_op, variables = graph_items
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [float(sess.run([loss, train_op], {x: features, y: labels})[0]) for _ in range(STEPS)]
        everything = tf.compat.v1.global_variables()
        return losses, dict(zip([v.op.name for v in everything], sess.run(everything)))


def main():
    optimizer_name, sizes, out_dir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
    tf.compat.v1.disable_eager_execution()
    total = sum(sizes)
    features, labels = global_batch(sizes, 3)
    with tf.Graph().as_default():
        ref_losses, ref_vars = train(build(total, False, optimizer_name), features, labels)

    epl.init(epl.Config({"cluster.virtual_devices": 2, "zero.level": "v1",
                         "communication.collective_timeout_s": 60}))
    rank, part = my_rows(sizes)
    with tf.Graph().as_default() as graph:
        # the worker's rows are its 2 replicas' batches (io.batch_mode "replica")
        items = build(sizes[rank] // 2, True, optimizer_name)
        epl.parallelize(graph)
        state_bytes = optimizer_state_bytes(graph, [items[3]])
        losses, variables = train(items, features[part], labels[part])
    errors = {name: float(np.max(np.abs(variables[name] - value) / (np.abs(value) + 1e-6)))
              for name, value in ref_vars.items()}
    result = {"rank": rank, "losses": losses, "ref_losses": ref_losses, "errors": errors,
              "state_bytes": state_bytes}
    write_record(out_dir, rank, result)
    env.reset()


if __name__ == "__main__":
    main()
