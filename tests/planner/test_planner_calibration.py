"""The planner's step-time prediction on virtual CPU devices, checked without a clock.

The ratio of predicted to measured step time is a benchmark's figure, not a unit
test's: `python bench/calibration.py` prints it per example against its target
(0.7-1.3), from medians of several runs, and tests/integration/test_bench_smoke.py
checks that the bench runs and prints it. A bound on a measured time here failed
on a loaded machine (issue 29), so these tests plan with a fixed profile (a
configured "CPU" profile, never the measured one) and
check what holds on any machine: the prediction is deterministic, positive and
grows with the work; every example the bench calibrates on is captured and
planned as the bench plans it.
"""
import math
import sys

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.planner.planner import PlanOptions, plan_cluster
from epl.planner.profiles import HostSpec, virtual_cpu_profiles

from paths import BENCH as BENCH_DIR

sys.path.insert(0, BENCH_DIR)
import calibration  # noqa: E402  (bench/calibration.py)

#: A complete "CPU" profile (configuring it skips the CPU micro-benchmark), split
#: over the virtual devices: the same on every machine.
FIXED = {"CPU": {"peak_flops": {"float32": 1e11}, "memory_bytes": 8 << 30,
                 "memory_bandwidth": 2e10, "intra_node_bandwidth": 2e10,
                 "inter_node_bandwidth": 1.25e9, "op_overhead_s": "20us",
                 "step_overhead_s": "300us"}}


def _mlp(x, y):
    h = x
    for i, width in enumerate([512, 512, 10]):
        h = tf.matmul(h, tf.compat.v1.get_variable(f"w{i}", [h.shape[-1], width]))
        h = tf.nn.relu(h) if width != 10 else h
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))


def _mlp_prediction(epl_env, batch: int) -> float:
    epl_env({"cluster.virtual_devices": 2})
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        x = tf.constant(rng.randn(batch, 256).astype(np.float32))
        y = tf.constant(rng.randint(0, 10, batch).astype(np.int64))
        with epl.replicate(1):
            loss = _mlp(x, y)
        tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
        hosts = [HostSpec(virtual_cpu_profiles(2, FIXED)[0], 2)]
        return plan_cluster(graph, hosts, optimizer="adam", global_batch=batch).chosen.step_time


def test_mlp_prediction_is_deterministic_and_grows_with_the_batch(epl_env):
    small = _mlp_prediction(epl_env, 256)
    assert small > 0 and math.isfinite(small)
    assert _mlp_prediction(epl_env, 256) == small
    large = _mlp_prediction(epl_env, 1024)
    # 4x the rows: more time, but no more than 4x (the fixed per-step and per-op
    # costs and the weights' update do not grow with the batch)
    assert small < large <= 4 * small, (small, large)


@pytest.mark.parametrize("example", calibration.EXAMPLES, ids=lambda e: e.script)
def test_examples_are_captured_and_planned_as_the_bench_plans_them(example):
    """Each example is captured as `epl-plan --script` captures it, and its strategy
    (data-parallel, or the pipeline of its stages) is planned on its devices."""
    model, micro = calibration.captured_model(example)
    assert model.layers, example.script
    hosts = [HostSpec(virtual_cpu_profiles(example.devices, FIXED)[0], example.devices)]
    plan = plan_cluster(model, hosts, global_batch=example.batch,
                        options=PlanOptions(num_micro_batch=micro))
    name = f"pipeline, {model.stages} stages" if model.stages > 1 \
        else "data-parallel, even split"
    step = plan.alternative(name).step_time
    assert step > 0 and math.isfinite(step), (example.script, step)
