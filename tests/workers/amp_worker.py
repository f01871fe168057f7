"""Worker script: AMP dynamic loss scaling across workers (run under horovodrun).

2 workers x 2 virtual devices train oracle_worker's MLP in float16. On the
second step only worker 1 feeds a row that overflows in float16; every worker
must skip that step (its variables unchanged, the scale halved), and the third,
finite, step must update them again.

usage: amp_worker.py OUT_DIR
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import epl
from epl import env
from oracle_worker import build


def main():
    out_dir = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "amp.level": "O1",
                         "communication.collective_timeout_s": 60}))
    rank = epl.Cluster.current().worker_rank
    rng = np.random.RandomState(rank)
    features = rng.randn(8, 6).astype(np.float32)
    labels = rng.randint(0, 3, 8).astype(np.int64)
    bad = features.copy()
    if rank == 1:
        bad[-1] = 1e6  # worker 1's last replica only: inf in float16
    with tf.Graph().as_default():
        # each worker's 8 rows are its 2 replicas' batches of 4 (io.batch_mode "replica")
        x, y, _, train_op, variables = build(4, True, "adam")
        with tf.compat.v1.Session() as sess:  # parallelizes: creates the loss-scale variable
            scale = [v for v in tf.compat.v1.global_variables()
                     if v.op.name == "EPL_AMP/loss_scale"]
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, {x: features, y: labels})
            before = sess.run(variables[:-1] + scale)
            sess.run(train_op, {x: bad, y: labels})
            after = sess.run(variables[:-1] + scale)
            sess.run(train_op, {x: features, y: labels})
            later = sess.run(variables[:-1])
    record = {
        "rank": rank,
        "skipped": all(np.array_equal(a, b) for a, b in zip(after[:-1], before[:-1])),
        "scale": [float(before[-1]), float(after[-1])],
        "updated_later": all(not np.array_equal(a, b) for a, b in zip(later, after[:-1])),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    env.reset()


if __name__ == "__main__":
    main()
