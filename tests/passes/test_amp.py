"""AMP O1 (amp.level "O1"): the oracle within the precision's tolerance, dynamic loss
scaling that skips an overflowed step on every replica alike, and the float32
fallback of an op with no low-precision kernel (named in the dump)."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.ir.annotations import REPLICA_ATTR
from epl.ir.graph_view import ancestors
from epl.passes import unit_functions

STEPS = 5
TOLERANCE = {"float16": dict(rtol=1e-2, atol=1e-3), "bfloat16": dict(rtol=5e-2, atol=1e-2)}
BASE = {"amp.level": "O1", "debug.check_invariants": True,
        "communication.collective_timeout_s": 60}


ADAM_LR = 0.01


def _assert_close(result, reference, dtype, optimizer="sgd"):
    """The model's variables and losses within the precision's tolerance (AMP adds its
    loss-scale state variables, which single-device training does not have).

    Adam moves every weight by about the learning rate per step whatever the size of
    its gradient, so a weight whose gradient is near zero may move the other way under
    rounding: with Adam, 90% of each variable's elements must be within the tolerance
    and all of them within learning rate x steps.
    """
    for name, value in reference.variables.items():
        if optimizer == "adam" and "power" not in name:
            actual = result.variables[name]
            close = np.isclose(actual, value, **TOLERANCE[dtype])
            assert close.mean() >= 0.9, (name, close.mean())
            assert np.max(np.abs(actual - value)) <= ADAM_LR * STEPS, name
        else:
            np.testing.assert_allclose(result.variables[name], value, err_msg=name,
                                       **TOLERANCE[dtype])
    np.testing.assert_allclose(result.losses, reference.losses, **TOLERANCE[dtype])


def _step_types(train_op) -> list:
    """(type, its attr T or None) of every op the step runs, the nodes of the unit
    functions it calls included (epl/passes/unit_functions.py)."""
    step = ancestors([train_op])
    pairs = [(op.type, op.get_attr("T") if "T" in op.node_def.attr else None) for op in step]
    return pairs + [(node.op, tf.as_dtype(node.attr["T"].type) if "T" in node.attr else None)
                    for node in unit_functions.body_nodes(step)]


def _low_precision_products(graph, train_op, dtype) -> int:
    return sum(1 for kind, t in _step_types(train_op) if kind in ("MatMul", "BatchMatMulV2")
               and t == tf.as_dtype(dtype))


@pytest.mark.parametrize("model,optimizer,dtype,replicas,micro", [
    ("mlp", "sgd", "float16", 2, 1),
    ("mlp", "adam", "float16", 1, 1),
    # bfloat16 keeps 8 bits of mantissa: with Adam, which moves every weight by about
    # the learning rate whatever its gradient's size, weights with tiny gradients
    # drift apart; SGD keeps the comparison meaningful
    ("mlp", "sgd", "bfloat16", 2, 1),
    ("mlp", "adam", "float16", 2, 2),
    ("transformer", "adam", "float16", 2, 1),
    ("transformer", "sgd", "bfloat16", 2, 2),
])
def test_amp_matches_single_device_within_tolerance(models, epl_env, model, optimizer, dtype,
                                                     replicas, micro):
    reference = models.single_device(model=model, optimizer=optimizer)
    epl_env({**BASE, "amp.dtype": dtype, "cluster.virtual_devices": replicas,
             "pipeline.num_micro_batch": micro})
    result = models.train(STEPS, model=model, optimizer=optimizer)
    _assert_close(result, reference, dtype, optimizer)
    train_op = result.graph.get_operation_by_name(
        [op.name for op in result.graph.get_operations() if op.type == "AssignAddVariableOp"
         and op.inputs[0].op.name == "global_step"][0])
    # forward and backward products run in low precision on every replica
    assert _low_precision_products(result.graph, train_op, dtype) >= 3 * replicas * micro
    # float32 master weights
    assert all(v.dtype.base_dtype == tf.float32 for v in
               result.graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))


def test_fixed_loss_scale_and_zero_match_single_device(models, epl_env):
    reference = models.single_device(model="mlp", optimizer="adam")
    epl_env({**BASE, "amp.loss_scale": 128, "zero.level": "v1", "cluster.virtual_devices": 2})
    _assert_close(models.train(STEPS, model="mlp", optimizer="adam"), reference, "float16", "adam")


@pytest.mark.parametrize("extra", [{"gradient_checkpoint.type": "auto"},
                                   {"optimizer.num_apply_group": 3}])
def test_amp_combined_with_memory_features(models, epl_env, extra):
    reference = models.single_device(model="transformer", optimizer="sgd")
    epl_env({**BASE, "cluster.virtual_devices": 2, **extra})
    _assert_close(models.train(STEPS, model="transformer", optimizer="sgd"), reference, "float16")


def _replica_reads(graph):
    """Per replica, reads of every variable it holds (originals are replica 0)."""
    reads = {}
    with graph.as_default():
        for op in graph.get_operations():
            if op.type != "VarHandleOp" or op.name.startswith("EPL_AMP"):
                continue
            if not any(c.type == "ReadVariableOp" for c in op.outputs[0].consumers()):
                continue  # never used (ZeRO's working shards before the first step)
            replica = op.get_attr(REPLICA_ATTR) if REPLICA_ATTR in op.node_def.attr else 0
            with tf.device(op.device):
                reads[(replica, op.name)] = tf.raw_ops.ReadVariableOp(
                    resource=op.outputs[0], dtype=op.get_attr("dtype"))
    return reads


@pytest.mark.parametrize("zero", [False, True])
def test_injected_overflow_skips_the_step_on_every_replica(models, epl_env, zero):
    """Replica 0's slice overflows in float16, replica 1's does not: both skip the
    update (parameters and Adam's state unchanged everywhere), the scale halves,
    the global step still counts; the next finite step updates everything."""
    config = {**BASE, "cluster.virtual_devices": 2}
    if zero:
        config["zero.level"] = "v1"
    epl_env(config)
    with tf.Graph().as_default() as graph:
        built = models.build("mlp", "adam")
        epl.parallelize(graph)
        reads = _replica_reads(graph)
        scale = [v for v in tf.compat.v1.global_variables() if v.op.name == "EPL_AMP/loss_scale"][0]
        features, labels = built.feed[built.features], built.feed[built.labels]
        bad = features.copy()
        bad[0] = 1e6  # first row: replica 0's slice; float16 overflows to inf
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(built.train_op, built.feed)  # one finite step: Adam's state is non-zero
            before = sess.run(reads)
            scale_before = sess.run(scale)
            sess.run(built.train_op, {built.features: bad, built.labels: labels})
            after = sess.run(reads)
            assert sess.run(scale) == scale_before / 2
            assert sess.run(built.global_step) == 2
            sess.run(built.train_op, built.feed)
            later = sess.run(reads)
    replicas = {replica for replica, _ in before}
    assert replicas == {0, 1}
    for key, value in before.items():
        if "global_step" in key[1]:
            continue
        np.testing.assert_array_equal(after[key], value, err_msg=f"replica {key[0]} {key[1]}")
    changed = [key for key in before if not np.array_equal(later[key], after[key])]
    assert {replica for replica, _ in changed} == {0, 1}


def _batch_matmul_v3_loss(features, labels):
    """A model whose product is a BatchMatMulV3 (no float16 kernel on CPU)."""
    rng = np.random.RandomState(3)
    w = tf.compat.v1.get_variable("w", initializer=rng.randn(6, 4).astype(np.float32))
    v = tf.compat.v1.get_variable("v", initializer=rng.randn(4, 4).astype(np.float32))
    h = tf.nn.relu(tf.raw_ops.BatchMatMulV3(x=features[:, None, :], y=w[None], Tout=tf.float32))
    logits = tf.matmul(tf.reshape(h, [-1, 4]), v)
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _train_fallback_model(models, epl_config=None):
    features_np, labels_np = models.make_data("mlp")
    units = 2 if epl_config is not None else 1   # the feed holds both replicas' batches
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [len(features_np) // units, 6])
        y = tf.compat.v1.placeholder(tf.float32, [len(labels_np) // units, 4])
        if epl_config is not None:
            with epl.replicate(device_count=1):
                loss = _batch_matmul_v3_loss(x, y)
        else:
            loss = _batch_matmul_v3_loss(x, y)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train_op, loss], {x: features_np, y: labels_np})[1]
                      for _ in range(STEPS)]
            values = sess.run({v.op.name: v for v in tf.compat.v1.trainable_variables()})
        types = {kind: t for kind, t in _step_types(train_op)
                 if kind in ("MatMul", "BatchMatMulV3") and t is not None}
        return losses, values, types


def test_op_without_low_precision_kernel_falls_back_and_says_so(models, epl_env, tmp_path):
    losses_ref, values_ref, _ = _train_fallback_model(models)
    epl_env({**BASE, "cluster.virtual_devices": 2, "debug.dump_dir": str(tmp_path)})
    losses, values, types = _train_fallback_model(models, {})
    [summary_file] = glob.glob(os.path.join(str(tmp_path), "*_amp.json"))
    notes = json.load(open(summary_file))["notes"]
    assert notes[0] == "1 ops in float16, loss scale dynamic"
    assert notes[1].startswith("BatchMatMulV3") and notes[1].endswith(
        " (BatchMatMulV3) kept in float32: no float16 kernel on CPU")
    assert types["MatMul"] == tf.float16
    np.testing.assert_allclose(losses, losses_ref, **TOLERANCE["float16"])
    for name, value in values_ref.items():
        np.testing.assert_allclose(values[name], value, err_msg=name, **TOLERANCE["float16"])


def test_amp_dynamic_loss_scale_refuses_reference_variables(models, epl_env):
    epl_env({**BASE, "cluster.virtual_devices": 2})
    with tf.Graph().as_default() as graph:
        models.build("mlp", "adam", use_resource=False)
        with pytest.raises(epl.errors.PassError) as err:
            epl.parallelize(graph)
    assert str(err.value) == (
        "pass 'amp' rejected the graph before any rewrite: amp.loss_scale 'dynamic' skips the "
        "update of a step whose gradients overflow, which needs resource variables, but w1 is a "
        "reference variable (VariableV2). Create variables with use_resource=True (or call "
        "tf.compat.v1.enable_resource_variables()), or set a fixed amp.loss_scale.")


@pytest.mark.multiworker
def test_overflow_on_one_worker_skips_the_step_on_every_worker(tmp_path):
    """2 workers x 2 devices under horovodrun: only worker 1's batch overflows."""
    from multiworker import errors as _errors, horovodrun as _horovodrun
    result = _horovodrun("amp_worker.py", str(tmp_path))
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["skipped"], record
        assert record["scale"] == [2.0 ** 15, 2.0 ** 14], record
        assert record["updated_later"], record
