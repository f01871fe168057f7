"""Worker script: workers with different random seeds start identical.

Each worker initializes its variables from a different random seed; EPL
broadcasts worker 0's values at initialization. Each worker writes the values
it sees after initialization and after one step to OUT_DIR/rank<r>.npz.
usage: broadcast_worker.py OUT_DIR
"""
import os
import sys

import numpy as np
import tensorflow as tf

import epl


def main():
    out_dir = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    rank = epl.Cluster.current().worker_rank
    tf.compat.v1.set_random_seed(100 + rank)
    x = tf.constant(np.random.RandomState(rank).randn(4, 5).astype(np.float32))
    with epl.replicate(1):
        w = tf.compat.v1.get_variable("w", [5, 2])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        initial = sess.run(w)
        sess.run(train)
        after = sess.run(w)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), initial=initial, after=after)


if __name__ == "__main__":
    main()
