"""Offload v0 (offload.level "v0"): weights in host memory, compute on the devices."""
from __future__ import annotations

import pytest
import tensorflow as tf

import epl
from epl.ir.graph_view import VARIABLE_OP_TYPES, ancestors
from epl.passes import unit_functions

STEPS = 5
HOST = "/device:CPU:0"


@pytest.mark.parametrize("model,optimizer,extra", [
    ("mlp", "adam", {}),
    ("transformer", "sgd", {}),
    ("mlp", "adam", {"zero.level": "v1"}),
    ("mlp", "sgd", {"pipeline.num_micro_batch": 2}),
])
def test_offload_matches_single_device(models, epl_env, model, optimizer, extra):
    reference = models.single_device(model=model, optimizer=optimizer)
    epl_env({"cluster.virtual_devices": 4, "offload.level": "v0", "debug.check_invariants": True,
             "communication.collective_timeout_s": 60, **extra})
    models.assert_same_training(models.train(STEPS, model=model, optimizer=optimizer), reference)


def test_weights_on_host_compute_on_devices(models, epl_env):
    epl_env({"cluster.virtual_devices": 4, "offload.level": "v0"})
    with tf.Graph().as_default() as graph:
        built = models.build("mlp", "adam")
        result = epl.parallelize(graph)
    step = ancestors([built.train_op])
    # (the calls' reference variable ops are no variables of the model: ref_scan_marks)
    variables = [op for op in step if op.type in VARIABLE_OP_TYPES
                 and op not in result.ref_marks]
    # per replica: 6 weights, 12 Adam slots, 2 beta powers, the global step
    assert len(variables) == 4 * (6 * 3 + 2 + 1)
    assert {op.device for op in variables} == {HOST}
    handles = {op.outputs[0] for op in variables}
    readers = [op for op in step if any(t in handles for t in op.inputs)]
    assert readers and {op.device for op in readers} == {HOST}
    # the products outside the unit functions' calls, and the calls that compute some
    # (epl/passes/unit_functions.py: a call's body runs on the call's device)
    products = [op for op in step if op.type == "MatMul" or (
        op.type in unit_functions.CALL_TYPES
        and any(node.op == "MatMul" for node in unit_functions.body_nodes([op])))]
    assert {op.device for op in products} == {f"/device:CPU:{k}" for k in range(4)}
    # a compute device reads the weight's value (copied from the host), never its handle
    assert all(t.dtype != tf.resource for op in products for t in op.inputs)
