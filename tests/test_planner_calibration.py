"""Calibration: the planner's predicted step time against the measured one on this machine.

An MLP built here, data-parallel over 2 virtual CPU devices, and each example
under examples/ (captured as epl-plan --script captures it, then run as a
subprocess with small settings and timed from its samples/s lines) are planned
with the measured CPU profile of their virtual devices. The ratios are printed
at the end of the test log ("reported figures"); the assertion is only a loose
bound, since the roofline model does not see TensorFlow's per-op overhead,
which dominates the examples' small steps, and the CPU profile is measured on
a shared machine.
"""
import os
import re
import statistics
import subprocess
import sys
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
def test_predicted_vs_measured_step_time(epl_env, report, batch):
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
    report(f"calibration[mlp batch {batch}]: predicted {predicted * 1e3:.2f} ms, "
          f"measured {measured * 1e3:.2f} ms, predicted/measured = {ratio:.2f}")
    assert 0.02 < ratio < 50


EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "examples")


def _measured_step_time(path, argv, batch):
    """Median seconds per step of the example, from its "samples/s" lines
    (the first interval, with the warm-up, left out)."""
    result = subprocess.run([sys.executable, path, *argv], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rates = [float(v) for v in re.findall(r"(\d+(?:\.\d+)?) samples/s", result.stdout)]
    assert len(rates) >= 3, result.stdout
    return statistics.median(batch / rate for rate in rates[1:])


def _predicted_step_time(path, argv, batch, devices):
    """The planner's step time for the example's strategy on `devices`
    virtual CPU devices with the measured CPU profile."""
    from epl.planner.planner import PlanOptions, model_from_graph
    from tools.epl_plan import capture_script_graph
    graph, config = capture_script_graph(path, argv)
    model = model_from_graph(graph, name=os.path.basename(path))
    micro = config.get("pipeline.num_micro_batch")
    plan = plan_cluster(model, [HostSpec(virtual_cpu_profiles(devices)[0], devices)],
                        global_batch=batch, options=PlanOptions(num_micro_batch=micro))
    # identical devices: the balanced split is the even one; a model with
    # annotated stages runs as the pipeline the example builds
    name = f"pipeline, {model.stages} stages" if model.stages > 1 \
        else "data-parallel, even split"
    return plan.alternative(name).step_time


# batch: the global batch of a step (the examples' --batch is one replica's, EPL's
# contract: 64 x 4, 8 x 4, 4 x 4, and bert_pipeline's 8 x 4 micro-batches)
@pytest.mark.parametrize("script,argv,batch,devices", [
    ("train_mlp", ["--steps", "60", "--log-every", "10"], 256, 4),
    ("large_classifier", ["--steps", "24", "--classes", "20000", "--batch", "8",
                          "--log-every", "4"], 32, 4),
    ("m6_mini", ["--steps", "24", "--batch", "4", "--log-every", "4"], 16, 4),
    ("bert_pipeline", ["--steps", "30", "--log-every", "5"], 32, 2),
])
def test_examples_predicted_vs_measured_step_time(report, script, argv, batch, devices):
    path = os.path.join(EXAMPLES_DIR, f"{script}.py")
    predicted = _predicted_step_time(path, argv, batch, devices)
    measured = _measured_step_time(path, argv, batch)
    ratio = predicted / measured
    report(f"calibration[{script}, {devices} virtual CPU devices, batch {batch}]: predicted "
          f"{predicted * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms, "
          f"predicted/measured = {ratio:.3f}")
    assert 0.001 < ratio < 50
