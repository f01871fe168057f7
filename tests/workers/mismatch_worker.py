"""Worker script: workers whose EPL graphs differ get a clear error, not a hang.

usage: mismatch_worker.py MODE   (MODE: extra_layer | shape | fetch)
Rank 1 adds a layer (extra_layer), uses a wider hidden layer (shape), or
fetches only the train op while rank 0 fetches the loss too (fetch).
"""
import sys

import numpy as np
import tensorflow as tf

import epl


def main():
    mode = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "communication.collective_timeout_s": 30,
                         "communication.fusion_threshold_mb": 1e-6}))
    rank = epl.Cluster.current().worker_rank
    hidden = 6 if (mode == "shape" and rank == 1) else 4
    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    with epl.replicate(1):
        h = tf.matmul(x, tf.compat.v1.get_variable("w1", [3, hidden]))
        if mode == "extra_layer" and rank == 1:
            h = tf.matmul(h, tf.compat.v1.get_variable("extra", [hidden, hidden]))
        loss = tf.reduce_mean(tf.matmul(h, tf.compat.v1.get_variable("w2", [hidden, 1])))
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    try:
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            fetches = [loss, train] if (mode == "fetch" and rank == 0) else [train]
            sess.run(fetches, {x: np.ones([8, 3])})   # both replicas' batches of 4
    except epl.ClusterError as err:
        print(f"EPL-ERROR rank {rank}: {err}", flush=True)
        sys.exit(3)
    print(f"rank {rank} trained", flush=True)


if __name__ == "__main__":
    main()
