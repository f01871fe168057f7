"""Worker script: workers whose EPL graphs differ get a clear error, not a hang.

usage: mismatch_worker.py MODE [KEY=VALUE,...]
  MODE: extra_layer | shape | fetch | config | version
Rank 1 adds a layer (extra_layer), uses a wider hidden layer (shape),
fetches only the train op while rank 0 fetches the loss too (fetch), sets the
config keys KEY=VALUE (JSON values; rank 0 keeps the defaults) (config), or
reports another EPL version (version).
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import epl


def main():
    mode = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    config = {"cluster.virtual_devices": 2, "communication.collective_timeout_s": 30,
              "communication.fusion_threshold_mb": 1e-6}
    rank = int(os.environ["HOROVOD_RANK"])
    if mode == "config" and rank == 1:
        for item in sys.argv[2].split(","):
            key, value = item.split("=", 1)
            config[key] = json.loads(value)
    if mode == "version" and rank == 1:
        epl.__version__ = "0.0.9"
    epl.init(epl.Config(config))
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
            # every (replica, micro-batch) unit's batch of 4
            units = 2 * int(config.get("pipeline.num_micro_batch", 1))
            sess.run(fetches, {x: np.ones([4 * units, 3])})
    except epl.ClusterError as err:
        print(f"EPL-ERROR rank {rank}: {err}", flush=True)
        sys.exit(3)
    print(f"rank {rank} trained", flush=True)


if __name__ == "__main__":
    main()
