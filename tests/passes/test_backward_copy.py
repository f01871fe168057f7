"""Replica backward ops copied from the user's backward ops (epl/passes/replication/backward_copy.py).

The replicate pass copies the template's backward ops for each replica and
rewrites the constants TensorFlow's gradient functions folded from the
global batch's static shapes. A model made of ops whose gradients fold shapes
(reductions with and without keepdims, over the batch axis and others,
tile, broadcasting, embedding gather, conv/pool, reshape to a folded
tf.shape, concat, strided slice, pad, batch matmul) must train exactly like
single-device training, with even and uneven slices and micro-batches; and
where a constant cannot be told apart from a batch-derived one, or a slice
has one row, the pass falls back to autodiff, still exact. (Slices whose shapes
differ from the template's exist under io.batch_mode 'global'; under 'replica'
every copy has the template's shapes and the constants need no rewrite.)
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR

BATCH, TOKENS, VOCAB, IMAGE, CLASSES = 8, 5, 20, 6, 3


def _data(seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randint(0, VOCAB, (BATCH, TOKENS)).astype(np.int32),
            rng.randn(BATCH, IMAGE, IMAGE, 2).astype(np.float32),
            rng.randint(0, CLASSES, BATCH).astype(np.int32))


def _params(embed, seed=1):
    rng = np.random.RandomState(seed)
    features = 9 * 4 + embed + 8 + 3
    return {"table": rng.randn(VOCAB, embed).astype(np.float32) * 0.3,
            "kernel": rng.randn(3, 3, 2, 4).astype(np.float32) * 0.3,
            "mix": rng.randn(embed, 3).astype(np.float32) * 0.3,
            "dense": rng.randn(features, CLASSES).astype(np.float32) * 0.2,
            "bias": np.zeros(CLASSES, np.float32)}


def _zoo_loss(ids, images, labels, embed):
    """Per-example computation through ops whose gradients fold static shapes."""
    v = {name: tf.compat.v1.get_variable(name, initializer=value)
         for name, value in _params(embed).items()}
    emb = tf.gather(v["table"], ids)                                  # [B, T, E]
    pooled = tf.reduce_mean(emb, axis=1)                              # [B, E]
    summed = tf.reduce_sum(emb, axis=1, keepdims=True)                # [B, 1, E]
    tiled = tf.reduce_max(tf.tile(summed, [1, 3, 1]), axis=1)         # [B, E]
    mixed = tf.matmul(tf.expand_dims(tiled, 1),                       # batch matmul [B, 1, 3]
                      tf.tile(tf.expand_dims(v["mix"], 0), [tf.shape(ids)[0], 1, 1]))
    conv = tf.nn.relu(tf.nn.conv2d(images, v["kernel"], 1, "SAME"))  # [B, 6, 6, 4]
    pool = tf.nn.max_pool2d(conv, 2, 2, "VALID")                      # [B, 3, 3, 4]
    flat = tf.reshape(pool, [tf.shape(pool)[0], -1])                  # folded shape constant
    wide = tf.pad(flat[:, 2:10], [[0, 0], [0, 0]])                    # strided slice
    scale = tf.reduce_mean(flat, axis=1, keepdims=True)               # broadcast [B, 1]
    features = tf.concat([flat * scale, pooled, wide, tf.squeeze(mixed, 1)], axis=1)
    logits = tf.matmul(features, v["dense"]) + v["bias"]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                          logits=logits))
    per_image = tf.reduce_mean(conv, axis=[1, 2, 3], keepdims=True)     # [B, 1, 1, 1]
    return loss + 0.01 * tf.reduce_mean(tf.square(images * per_image))


def _train(embed, config=None, weights=None, steps=3):
    """(losses, variables) of `steps` Adam steps; under EPL when `config` is given."""
    env.reset()
    ids_np, images_np, labels_np = _data()
    with tf.Graph().as_default() as graph:
        ids = tf.compat.v1.placeholder(tf.int32, [BATCH, TOKENS])
        images = tf.compat.v1.placeholder(tf.float32, [BATCH, IMAGE, IMAGE, 2])
        labels = tf.compat.v1.placeholder(tf.int32, [BATCH])
        if config is not None:   # the slices' shapes differ from the template's: global mode
            epl.init(epl.Config({"io.batch_mode": "global", **config}))
            with epl.replicate(device_count=1):
                loss = _zoo_loss(ids, images, labels, embed)
        else:
            loss = _zoo_loss(ids, images, labels, embed)
        train_op = tf.compat.v1.train.AdamOptimizer(0.05).minimize(loss)
        if weights is not None:
            epl.parallelize(graph, replica_weights=weights)
        feed = {ids: ids_np, images: images_np, labels: labels_np}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train_op, loss], feed)[1] for _ in range(steps)]
            variables = tf.compat.v1.global_variables()
            values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    env.reset()
    return losses, values, graph


def _replicate_notes(dump_dir) -> list[str]:
    [summary] = [path for path in glob.glob(os.path.join(dump_dir, "*.json"))
                 if "replicate" in os.path.basename(path)]
    return json.load(open(summary))["notes"]


def _assert_same(result, reference):
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    for name, value in reference[1].items():
        np.testing.assert_allclose(result[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("devices,weights,micro", [
    (2, [3, 1], 1),   # slices of 6 and 2 rows
    (4, None, 1),     # 2 rows each
    (2, None, 2),     # 2 replicas x 2 micro-batches of 2 rows
])
def test_copied_backward_matches_single_device(tmp_path, devices, weights, micro):
    reference = _train(embed=5)
    config = {"cluster.virtual_devices": devices, "debug.dump_dir": str(tmp_path),
              "pipeline.num_micro_batch": micro, "debug.check_invariants": True}
    result = _train(embed=5, config=config, weights=weights)
    _assert_same(result, reference)
    units = devices * micro
    assert f"backward ops: copied from the template for {units} unit(s), autodiff for 0" in \
        _replicate_notes(tmp_path)
    # every replica has its own backward ops, tagged with its index and phase
    graph = result[2]
    replicas = {op.get_attr(REPLICA_ATTR) for op in graph.get_operations()
                if PHASE_ATTR in op.node_def.attr and op.get_attr(PHASE_ATTR) == b"backward"
                and REPLICA_ATTR in op.node_def.attr}
    assert replicas == set(range(devices))


def test_coincident_dimension_is_exact(tmp_path):
    """The embedding width equals the batch (8): a constant holding 8 may be a shape of
    the weights or of the batch. Whichever path the pass takes, training is exact."""
    reference = _train(embed=BATCH)
    config = {"cluster.virtual_devices": 2, "debug.dump_dir": str(tmp_path)}
    result = _train(embed=BATCH, config=config, weights=[3, 1])
    _assert_same(result, reference)
    note = next(n for n in _replicate_notes(tmp_path) if n.startswith("backward ops:"))
    assert "autodiff for 0" in note or "may be derived from the batch size" in note, note


def test_one_row_slice_falls_back_to_autodiff(tmp_path):
    """A replica with one row: gradients of broadcasts reduce differently, so the pass
    runs autodiff for that slice shape and copies the template for the others."""
    reference = _train(embed=5)
    config = {"cluster.virtual_devices": 2, "debug.dump_dir": str(tmp_path)}
    result = _train(embed=5, config=config, weights=[7, 1])
    _assert_same(result, reference)
    note = next(n for n in _replicate_notes(tmp_path) if n.startswith("backward ops:"))
    assert note.startswith("backward ops: copied from the template for 1 unit(s), autodiff for 1")
    assert "has a dimension of 1 where the template has more" in note


def test_the_gradient_gates_are_not_copied_but_a_users_waiting_identity_is():
    """tf.tuple's gates (a NoOp waiting for an op's gradients, an Identity per
    gradient waiting for it) only order; the copies read the gradients directly.
    A NoOp that waits for a stateful op (an assign) is not a gate."""
    from epl.passes.replication.backward_copy import gates
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2])
        counter = tf.compat.v1.get_variable("counter", [], initializer=tf.zeros_initializer())
        loss = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)) * 2.0 + 1.0)
        start = len(graph.get_operations())
        grad, = tf.compat.v1.gradients(loss, [w], gate_gradients=True)
        backward = graph.get_operations()[start:]
        bump = counter.assign_add(1.0)
        waits = tf.group(bump, grad.op)
        with tf.control_dependencies([waits]):
            passed = tf.identity(grad)
    noops, identities = gates(backward + [waits, passed.op])
    tuple_noops = {op for op in backward if op.type == "NoOp"}
    # the user's group waits for w's gradient Identity: that gate stays whole
    kept = grad.op.control_inputs[0]
    assert len(tuple_noops) == 3 and noops == tuple_noops - {kept}
    assert identities == {op for op in backward if op.type == "Identity"
                          and list(op.control_inputs) and op.control_inputs[0] in noops}
    assert grad.op not in identities
    assert waits not in noops and passed.op not in identities


def test_replica_copies_have_no_gates_and_train_exactly(tmp_path):
    """The copied backward of every unit reads the gradients without tf.tuple's gates
    (the template keeps its own), and data parallelism with micro-batches still
    equals single-device training (the oracle above)."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}))
    graph = tf.Graph()
    with graph.as_default():
        with epl.replicate(device_count=1):
            x = tf.constant(np.arange(24, dtype=np.float32).reshape(8, 3) / 10)
            logits = tf.compat.v1.layers.dense(x, 2)
            loss = tf.reduce_mean(tf.square(logits))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        epl.parallelize(graph)
    copies = [op for op in graph.get_operations() if REPLICA_ATTR in op.node_def.attr
              and op.get_attr(PHASE_ATTR) == b"backward"]
    assert copies
    assert not [op for op in copies if op.type in ("NoOp", "Identity")]
    env.reset()
