"""EPL compatibility gaps found with the original EPL's own tests (issue 28, item 7).

ScopeError is a RuntimeError as in EPL, `from epl.env import Env` works,
`pipeline.num_stages: None` (EPL's documented default) means "unset", and a
split TaskGraph over one device, which splits nothing, gets a warning.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.errors import ConfigError, ScopeError
from epl.passes.split.rewriter import SplitFallbackWarning


def test_nested_scopes_raise_a_runtime_error_as_in_epl():
    epl.init()
    with tf.Graph().as_default():
        with pytest.raises(RuntimeError) as caught:
            with epl.replicate(device_count=1):
                with epl.split(device_count=2):
                    pass
    assert isinstance(caught.value, ScopeError) and isinstance(caught.value, epl.EPLError)
    assert str(caught.value).startswith(
        "epl.split(device_count=2, name='split_") and "cannot be nested" in str(caught.value)


def test_env_imports_from_epl_env_as_in_epl():
    from epl.env import Env

    assert Env is epl.Env
    assert Env.get().config is None and Env.get().cluster is None
    config = epl.init(epl.Config({"cluster.virtual_devices": 3}))
    assert Env.get().config is config
    assert Env.get().cluster.gpu_num_per_worker == 3


def test_num_stages_none_is_unset_as_in_epl_docs(monkeypatch):
    monkeypatch.delenv("EPL_PIPELINE_NUM_STAGES", raising=False)
    assert epl.Config().pipeline.num_stages is None           # EPL's documented default
    assert epl.Config({"pipeline.num_stages": None}).get("pipeline.num_stages") is None
    assert epl.Config({"pipeline.num_stages": 3}).pipeline.num_stages == 3
    monkeypatch.setenv("EPL_PIPELINE_NUM_STAGES", "None")
    assert epl.Config().pipeline.num_stages is None
    monkeypatch.delenv("EPL_PIPELINE_NUM_STAGES")
    with pytest.raises(ConfigError) as caught:
        epl.Config({"pipeline.num_stages": 0})
    assert str(caught.value) == ("Invalid value 0 (int) for config key 'pipeline.num_stages': "
                                 "expected None (unset) or an int >= 1.")


def test_auto_parallel_with_num_stages_unset_trains_data_parallel():
    """EPL with auto.auto_parallel and no num_stages replicated the model (no automatic
    pipeline): so does EPL here."""
    epl.init(epl.Config({"auto.auto_parallel": True, "pipeline.num_stages": None,
                         "cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        x = tf.constant(np.ones([4, 3], np.float32))
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        result = epl.parallelize(graph)
    assert result.plan.num_replicas == 2
    assert len(result.view.taskgraphs) == 1   # no automatic stages


def test_split_over_one_device_warns_that_nothing_is_split(caplog):
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default(), caplog.at_level(logging.WARNING, logger="epl"):
        with pytest.warns(SplitFallbackWarning) as caught:
            with epl.split(device_count=1, name="experts"):
                pass
        with epl.split(device_count=1, name="experts"):   # the same TaskGraph: once
            pass
        with epl.split(device_count=2, name="wide"):
            pass
    message = ("epl.split(device_count=1, name='experts') spans one device, so nothing under "
               "it is split: its variables (expert weights, a classifier) stay whole on one "
               "device. Give device_count >= 2 (e.g. the worker's device count) to split them.")
    assert [str(w.message) for w in caught] == [message]
    assert [r.getMessage() for r in caplog.records] == [message]
