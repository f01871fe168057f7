"""Worker script: worker 1 stalls or leaves; every worker must fail within the timeout.

usage: stall_worker.py SESSION MODE TIMEOUT_S [MARKER]
  SESSION  session    `with tf.compat.v1.Session() as sess:` and a loop of STEPS steps
           monitored  MonitoredTrainingSession with a StopAtStepHook
  MODE     outside    worker 1 sleeps in Python between two steps, at global step STALL_AT
           inside     worker 1 blocks in I/O inside its step at global step STALL_AT (its
                      input op opens a FIFO nobody writes), before any collective
           between    worker 1 sleeps inside its step at global step STALL_AT after it
                      submitted the all-reduce of dense/kernel, before the one of dense/bias
           stopped    worker 1 stops itself (SIGSTOP) between two steps at global step
                      STALL_AT: alive, but none of its threads runs
           fewer      worker 1 runs STALL_AT steps instead of STEPS, then its script ends
  MARKER   (for restarts) a file: worker 1 stalls only if it does not exist, and creates it

The script handles no error: it fails the way a user's script does. Worker 1
prints "stall <time>" when it starts to stall (or leaves), so the test can
measure the time to failure.
"""
import os
import signal
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import epl

STEPS = 6
STALL_AT = 3
SLEEP_S = 120


def _stall_print(rank, how):
    print(f"rank {rank} stall {time.time():.3f} {how}", flush=True)


def main():
    session_kind, mode, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    marker = sys.argv[4] if len(sys.argv) > 4 else None
    tf.compat.v1.disable_eager_execution()
    config = {"cluster.virtual_devices": 1, "communication.collective_timeout_s": timeout}
    if mode == "between":  # one all-reduce per gradient, so that one can come before the other
        config["communication.fusion_threshold_mb"] = 1e-6
    epl.init(epl.Config(config))
    rank = epl.Cluster.current().worker_rank
    stalls = rank == 1 and not (marker and os.path.exists(marker))
    stall_now = {"inside": False, "between": False}

    def input_op(x):  # the same op on every worker; it blocks in I/O on worker 1 when told to
        if stall_now["inside"]:
            fifo = os.path.join(tempfile.mkdtemp(), "never-written")
            os.mkfifo(fifo)
            _stall_print(rank, "inside")
            with open(fifo, "rb") as f:  # blocks: nobody opens it for writing
                f.read()
        return x

    def slow_op(x):  # on the path of dense/bias only: after dense/kernel's all-reduce
        if stall_now["between"]:
            time.sleep(1.0)  # dense/kernel's gradient is ready and submitted by then
            _stall_print(rank, "between")
            time.sleep(SLEEP_S)
        return x

    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    features = tf.reshape(tf.numpy_function(input_op, [x], tf.float32), [4, 3])
    with epl.replicate(1):
        w = tf.compat.v1.get_variable("dense/kernel", [3, 1])
        loss = tf.reduce_mean(tf.matmul(features, w))
        if mode == "between":
            b = tf.compat.v1.get_variable("dense/bias", [1])
            slow = tf.reshape(tf.numpy_function(slow_op, [features], tf.float32), [4, 3])
            loss += tf.reduce_mean(slow) * b[0]
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
    last = STALL_AT if (mode == "fewer" and stalls) else STEPS

    def before(value):
        if not stalls or value != STALL_AT:
            return
        if marker:
            open(marker, "w").close()
        if mode == "outside":
            _stall_print(rank, "outside")
            time.sleep(SLEEP_S)
        elif mode == "stopped":
            _stall_print(rank, "stopped")
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode in ("inside", "between"):
            stall_now[mode] = True
        elif mode == "fewer":
            _stall_print(rank, "leaves")

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
