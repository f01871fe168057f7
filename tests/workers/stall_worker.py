"""Worker script: worker 1 stalls (sleeps) before a step; worker 0 must not hang.

usage: stall_worker.py
"""
import sys
import time

import numpy as np
import tensorflow as tf

import epl


def main():
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 1, "communication.collective_timeout_s": 8}))
    rank = epl.Cluster.current().worker_rank
    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    with epl.replicate(1):
        loss = tf.reduce_mean(tf.matmul(x, tf.compat.v1.get_variable("w", [3, 1])))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for step in range(3):
            if rank == 1 and step == 1:
                time.sleep(60)  # stalls: alive but not reaching the collective
            try:
                sess.run(train, {x: np.ones([4, 3])})
            except epl.ClusterError as err:
                print(f"EPL-ERROR rank {rank}: {err}", flush=True)
                sys.stdout.flush()
                import os
                os._exit(3)


if __name__ == "__main__":
    main()
