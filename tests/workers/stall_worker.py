"""Worker script: worker 1 stalls or leaves; every worker must fail within the timeout.

usage: stall_worker.py SESSION MODE TIMEOUT_S
  SESSION  session    `with tf.compat.v1.Session() as sess:` and a loop of STEPS steps
           monitored  MonitoredTrainingSession with a StopAtStepHook
  MODE     outside    worker 1 sleeps between two steps, at global step STALL_AT
           inside     worker 1 sleeps inside its step at global step STALL_AT (in the
                      input op, before any collective of the step)
           fewer      worker 1 runs STALL_AT steps instead of STEPS, then its script ends

The script handles no error: it fails the way a user's script does. Each
worker prints "stall <time>" when worker 1 starts to stall (or leaves), so the
test can measure the time to failure.
"""
import sys
import time

import numpy as np
import tensorflow as tf

import epl

STEPS = 6
STALL_AT = 3
SLEEP_S = 120


def main():
    session_kind, mode, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 1,
                         "communication.collective_timeout_s": timeout}))
    rank = epl.Cluster.current().worker_rank
    stall_now = {"inside": False}

    def input_op(x):  # the same op on every worker; it sleeps on worker 1 when told to
        if stall_now["inside"]:
            print(f"rank {rank} stall {time.time():.3f} inside", flush=True)
            time.sleep(SLEEP_S)
        return x

    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    features = tf.reshape(tf.numpy_function(input_op, [x], tf.float32), [4, 3])
    with epl.replicate(1):
        w = tf.compat.v1.get_variable("dense/kernel", [3, 1])
        loss = tf.reduce_mean(tf.matmul(features, w))
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
    last = STALL_AT if (mode == "fewer" and rank == 1) else STEPS

    def before(value):
        if rank == 1 and value == STALL_AT:
            if mode == "outside":
                print(f"rank {rank} stall {time.time():.3f} outside", flush=True)
                time.sleep(SLEEP_S)
            elif mode == "inside":
                stall_now["inside"] = True
        if value == STALL_AT and mode == "fewer" and rank == 1:
            print(f"rank {rank} stall {time.time():.3f} leaves", flush=True)

    if session_kind == "session":
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for value in range(last):
                before(value)
                sess.run(train, {x: np.ones([4, 3])})
                print(f"rank {rank} step {value} done", flush=True)
            before(last)
    else:
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=last)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                value = int(sess.run(step))
                before(value)
                sess.run(train, {x: np.ones([4, 3])})
                print(f"rank {rank} step {value} done", flush=True)
        before(last)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
