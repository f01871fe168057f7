"""Guards of issue 28, item 5: more virtual devices than cores, the legacy-Keras hint,
and error texts that follow the active io.batch_mode."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.runtime import cluster as cluster_lib
from epl.strategies import LEGACY_KERAS_HINT

from paths import ROOT


@pytest.fixture(autouse=True)
def fresh_epl():
    env.reset()
    yield
    env.reset()


def test_more_virtual_devices_than_cores_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(cluster_lib, "_WARNED_DEVICE_COUNTS", set())
    cores = cluster_lib.usable_cores()
    with caplog.at_level(logging.WARNING, logger="epl"):
        epl.init(epl.Config({"cluster.virtual_devices": cores}))
        assert epl.Env.get().cluster.gpu_num_per_worker == cores
        assert not caplog.records
        epl.init(epl.Config({"cluster.virtual_devices": 16 * cores}))
        epl.Env.get().cluster
        epl.Env.get().cluster   # once per count
    expected = (f"cluster.virtual_devices is {16 * cores}, more than the {cores} CPU "
                f"core{'' if cores == 1 else 's'} this worker may use: the devices share the "
                f"cores, so a step is no faster than with {cores} (the numbers are the same)")
    assert [r.getMessage() for r in caplog.records] == [expected]


def test_keras_3_error_inside_a_scope_gets_the_legacy_keras_hint():
    epl.init()
    with tf.Graph().as_default():
        with pytest.raises(AttributeError) as caught:
            with epl.replicate(device_count=1):
                raise AttributeError("`dense` is not available with Keras 3.")
        with pytest.raises(AttributeError) as other:
            with epl.replicate(device_count=1):
                raise AttributeError("no such thing")
    assert caught.value.__notes__ == [LEGACY_KERAS_HINT]
    assert not getattr(other.value, "__notes__", None)


def test_tf_compat_v1_layers_without_legacy_keras_shows_the_hint(tmp_path):
    """The real failure: TensorFlow's Keras 3 error for tf.compat.v1.layers, in a script
    run without TF_USE_LEGACY_KERAS."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import tensorflow as tf
        import epl
        tf.compat.v1.disable_eager_execution()
        epl.init()
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        with epl.replicate(device_count=1):
            tf.compat.v1.layers.dense(x, 2)
        """))
    environ = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environ.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=environ, timeout=300)
    assert result.returncode == 1
    assert result.stderr.rstrip().splitlines()[-2:] == [
        "AttributeError: `dense` is not available with Keras 3.", LEGACY_KERAS_HINT]


def _no_batch_graph():
    with epl.replicate(device_count=1):
        w = tf.compat.v1.get_variable("w", initializer=np.ones([3], np.float32))
        loss = tf.reduce_sum(w * w)
    tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)


@pytest.mark.parametrize("mode, words", [
    ("replica", "each replica and micro-batch draws its own batch (io.batch_mode 'replica', "
                "the default) from"),
    ("global", "EPL slices the worker's batch (io.batch_mode 'global') along the first "
               "dimension of")])
def test_no_batch_input_error_describes_the_active_batch_mode(mode, words):
    epl.init(epl.Config({"cluster.virtual_devices": 2, "io.batch_mode": mode}))
    with tf.Graph().as_default() as graph:
        _no_batch_graph()
        with pytest.raises(epl.ParallelizeError) as caught:
            epl.parallelize(graph)
    assert str(caught.value) == (
        f"no batch input feeds the loss: {words} tf.data iterator outputs, placeholders of "
        "rank >= 1, or constants whose first dimension is the batch. Feed the examples "
        "through one of these.")


def test_disagreeing_batch_inputs_error_describes_the_replica_mode():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [8, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [4, 1], name="y")
        with epl.replicate(device_count=1):
            w = tf.compat.v1.get_variable("w", [3, 1])
            loss = tf.reduce_mean(tf.matmul(x, w)) + tf.reduce_mean(y)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(epl.ParallelizeError) as caught:
            epl.parallelize(graph)
    assert str(caught.value) == (
        "the batch inputs disagree on the batch size (first dimension): x:0 (8, 3); y:0 (4, 1)."
        " Each replica and micro-batch draws its own batch (io.batch_mode 'replica', the "
        "default) from every placeholder or iterator output of rank >= 1 that feeds the loss; "
        "give them the same batch dimension, or feed per-example constants (like class "
        "weights) as tf.constant instead of placeholders.")
