"""The central oracle for data parallelism (epl.replicate on virtual CPU devices).

k training steps of the EPL graph (R replicas) from the same initial values on
the same global batch give the same variables and per-step losses as
single-device training, to float tolerance (tests/conftest.py: rtol 1e-5, atol
from the measured noise floor). Under the default io.batch_mode 'replica' the
script's batch is one replica's (conftest's `units`) and the feed holds every
replica's; uneven shares slice one batch ('global').
"""
from __future__ import annotations

import numpy as np
import pytest

from epl.hooks.session import parallel_graph

STEPS = 5


def _plan(result):
    """The plan EPL used for the graph `result` was trained in (asserts it was rewritten)."""
    parallel = parallel_graph(result.graph)
    assert parallel is not None, "EPL did not parallelize the graph"
    return parallel.plan


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_matches_single_device(models, epl_env, model, replicas, optimizer):
    reference = models.single_device(model=model, optimizer=optimizer)
    epl_env({"cluster.virtual_devices": replicas, "debug.check_invariants": True})
    result = models.train(STEPS, model=model, optimizer=optimizer)
    assert _plan(result).num_replicas == replicas
    models.assert_same_training(result, reference)
    assert result.global_step == STEPS


@pytest.mark.parametrize("model,inputs,replicas,optimizer", [
    ("mlp", "dataset", 2, "sgd"),
    ("mlp", "dataset", 4, "adam"),
    ("transformer", "dataset", 4, "sgd"),
    ("mlp", "constant", 2, "adam"),
    ("mlp", "constant", 4, "sgd"),
    ("mlp", "dynamic", 4, "adam"),
    ("transformer", "dynamic", 2, "adam"),
])
def test_input_kinds_match_single_device(models, epl_env, model, inputs, replicas, optimizer):
    """A tf.data iterator repeating the batch, tf.constant inputs, a None batch dimension."""
    reference = models.single_device(model=model, optimizer=optimizer, inputs=inputs)
    epl_env({"cluster.virtual_devices": replicas, "debug.check_invariants": True})
    result = models.train(STEPS, model=model, optimizer=optimizer, inputs=inputs)
    assert _plan(result).num_replicas == replicas
    models.assert_same_training(result, reference)


@pytest.mark.parametrize("replicas,weights,mode", [
    (2, None, "replica"), (4, None, "replica"), (2, None, "global"), (4, None, "global"),
    (2, [3, 1], "global")])
def test_folded_batch_shapes_match_single_device(models, epl_env, replicas, weights, mode):
    """tf.shape of a static-shaped batch tensor is folded into a constant holding the
    batch size: in global mode each replica must compute with its own slice's shape
    (replica mode keeps the script's shapes; uneven weights need global mode)."""
    reference = models.single_device(model="mlp_folded", optimizer="sgd")
    epl_env({"cluster.virtual_devices": replicas, "debug.check_invariants": True,
             "io.batch_mode": mode})
    result = models.train(STEPS, replica_weights=weights, model="mlp_folded", optimizer="sgd")
    models.assert_same_training(result, reference)


def test_ref_variables_match_single_device(models, epl_env):
    """Reference (VariableV2) variables are mirrored and updated like resource ones."""
    reference = models.single_device(model="mlp", optimizer="adam", use_resource=False)
    epl_env({"cluster.virtual_devices": 2, "debug.check_invariants": True})
    result = models.train(STEPS, model="mlp", optimizer="adam", use_resource=False)
    models.assert_same_training(result, reference)


def test_implicit_replicate_without_scope(models, epl_env):
    """No strategy scope at all: the optimizer step alone triggers data parallelism."""
    reference = models.single_device(model="mlp", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 4})
    result = models.train(STEPS, model="mlp", optimizer="sgd", scope=False)
    models.assert_same_training(result, reference)


@pytest.mark.parametrize("model,weights,sizes,inputs,optimizer", [
    pytest.param("mlp", [3, 1], [6, 2], "placeholder", "sgd", id="mlp-3:1-sgd"),
    pytest.param("mlp", [3, 1], [6, 2], "placeholder", "adam", id="mlp-3:1-adam"),
    pytest.param("transformer", [1, 3], [2, 6], "placeholder", "adam", id="transformer-1:3-adam"),
    pytest.param("mlp", [1, 1, 2], [2, 2, 4], "placeholder", "sgd", id="mlp-1:1:2-sgd"),
    pytest.param("mlp", [1, 2, 1], [2, 4, 2], "dataset", "adam", id="mlp-1:2:1-dataset-adam"),
    pytest.param("mlp", [1, 1, 1, 5], [1, 1, 1, 5], "constant", "sgd", id="mlp-1:1:1:5-constant"),
    # A None batch dimension: boundaries round(B x cumulative share) computed at run time.
    pytest.param("mlp", [3, 1], [6, 2], "dynamic", "sgd", id="mlp-3:1-dynamic-sgd"),
    pytest.param("mlp", [1, 1, 2], [2, 2, 4], "dynamic", "adam", id="mlp-1:1:2-dynamic-adam"),
])
def test_uneven_replica_weights_match_single_device(models, epl_env, model, weights, sizes,
                                                    inputs, optimizer):
    """Uneven per-replica batches: gradients weighted by share give the even-split update
    (io.batch_mode 'global': the script's batch is sliced by share)."""
    reference = models.single_device(model=model, optimizer=optimizer, inputs=inputs)
    epl_env({"cluster.virtual_devices": len(weights), "debug.check_invariants": True,
             "io.batch_mode": "global"})
    result = models.train(STEPS, replica_weights=weights, model=model, optimizer=optimizer,
                          inputs=inputs)
    plan = _plan(result)
    assert not plan.even and plan.batch_sizes(models.BATCH) == sizes
    np.testing.assert_allclose(plan.replica_weights, np.array(weights) / sum(weights))
    models.assert_same_training(result, reference)


@pytest.mark.parametrize("replicas,optimizer", [(2, "sgd"), (4, "sgd"), (4, "adam")])
def test_gradients_reduce_sum(models, epl_env, replicas, optimizer):
    """`communication.gradients_reduce_method: sum` with an even split.

    Replica k computes g_k, the gradient of the mean loss over its B/R
    examples. The single-device gradient of the mean loss over the batch is
    g = (1/R) sum_k g_k, so the summed gradient sum_k g_k = R g is the gradient
    of R x loss: training equals single-device training of loss * R. The
    fetched loss is still the mean over the global batch (unscaled).
    """
    scaled = models.single_device(model="mlp", optimizer=optimizer, loss_scale=float(replicas))
    plain = models.single_device(model="mlp", optimizer=optimizer)
    epl_env({"cluster.virtual_devices": replicas,
             "communication.gradients_reduce_method": "sum"})
    result = models.train(STEPS, model="mlp", optimizer=optimizer)
    models.assert_same_training(result, scaled)
    if optimizer == "sgd":  # the update really changed (Adam is nearly scale-invariant)
        assert not np.allclose(result.variables["w1"], plain.variables["w1"], rtol=1e-4)
    # The first loss is computed before any update: identical in all three runs.
    np.testing.assert_allclose(result.losses[0], plain.losses[0], rtol=1e-6)
