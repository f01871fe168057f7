"""Calibration: the planner's predicted step time against the measured one on this machine.

The examples' kind of model (an MLP), data-parallel over 2 virtual CPU
devices, are planned with the measured CPU profile and then timed. The ratio is
printed for the test log (`pytest -s`); the assertion is only a loose bound,
since the roofline model does not see TensorFlow's per-op overhead.
"""
import statistics
import time

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.planner.planner import plan_cluster
from epl.profiles import HostSpec, virtual_cpu_profiles


def _mlp(x, y):
    h = x
    for i, width in enumerate([512, 512, 10]):
        h = tf.matmul(h, tf.compat.v1.get_variable(f"w{i}", [h.shape[-1], width]))
        h = tf.nn.relu(h) if width != 10 else h
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))


@pytest.mark.parametrize("batch", [256, 1024])
def test_predicted_vs_measured_step_time(epl_env, batch):
    epl_env({"cluster.virtual_devices": 2})
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        x = tf.constant(rng.randn(batch, 256).astype(np.float32))
        y = tf.constant(rng.randint(0, 10, batch).astype(np.int64))
        with epl.replicate(1):
            loss = _mlp(x, y)
        train = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
        profile = virtual_cpu_profiles(2)[0]
        predicted = plan_cluster(graph, [HostSpec(profile, 2)], optimizer="adam",
                                 global_batch=batch).chosen.step_time
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(3):
                sess.run(train)
            times = []
            for _ in range(10):
                start = time.perf_counter()
                sess.run(train)
                times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    ratio = predicted / measured
    print(f"calibration[mlp batch {batch}]: predicted {predicted * 1e3:.2f} ms, "
          f"measured {measured * 1e3:.2f} ms, predicted/measured = {ratio:.2f}")
    assert 0.02 < ratio < 50
