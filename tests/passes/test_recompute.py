"""Gradient checkpointing (epl/passes/recompute/checkpoints.py): values, structure and errors.

Every model is built in its own tf.Graph without EPL; checkpointed gradients
are compared with tf.compat.v1.gradients in the same session run (so random
ops draw the same values for both).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from epl.errors import ParallelizeError
from epl.passes.recompute import checkpoints as recompute
from epl.passes.recompute.checkpoints import (RECOMPUTE_ATTR, checkpointed_gradients, compare_gradients,
                              select_checkpoints_auto, select_checkpoints_collection)

BATCH, WIDTH, LAYERS = 6, 16, 8
SEQ, D, HEADS, FFN, CLASSES = 4, 8, 2, 16, 3
RANDOM_TYPES = {"RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt"}


def _var(name, shape, seed, use_resource=True, scale=None):
    rng = np.random.RandomState(seed)
    factor = scale if scale is not None else 1.0 / np.sqrt(shape[0])
    value = (rng.randn(*shape) * factor).astype(np.float32)
    return tf.compat.v1.get_variable(name, initializer=value, use_resource=use_resource)


def _mlp(use_resource=True, dropout=False):
    """8 ReLU layers on a [None, WIDTH] placeholder.

    Returns (loss, variables, feed, layer outputs)."""
    x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH], name="x")
    h, variables, outputs = x, [], []
    for i in range(LAYERS):
        w = _var(f"w{i}", [WIDTH, WIDTH], i, use_resource)
        b = _var(f"b{i}", [WIDTH], 100 + i, use_resource, scale=0.1)
        variables += [w, b]
        h = tf.nn.relu(tf.matmul(h, w) + b)
        if dropout and i % 3 == 1:
            h = tf.nn.dropout(h, rate=0.3)
        outputs.append(h)
    loss = tf.reduce_mean(tf.square(h - 0.5))
    feed = {x: np.random.RandomState(7).randn(BATCH, WIDTH).astype(np.float32)}
    return loss, variables, feed, outputs


def _layer_norm(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta


def _transformer(layers=3):
    """A pre-norm transformer stack in raw TF ops (-1 for the batch); returns like _mlp."""
    x = tf.compat.v1.placeholder(tf.float32, [None, SEQ, D], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    head_dim = D // HEADS
    h = tf.reshape(x, [-1, D])
    variables, outputs = [], []
    for n in range(layers):
        with tf.compat.v1.variable_scope(f"layer{n}"):
            shapes = {"g1": [D], "b1": [D], "qkv": [D, 3 * D], "wo": [D, D], "g2": [D],
                      "b2": [D], "w1": [D, FFN], "c1": [FFN], "w2": [FFN, D]}
            p = {name: _var(name, shape, 10 * n + i, scale=0.1 if len(shape) == 1 else None)
                 for i, (name, shape) in enumerate(shapes.items())}
        variables += list(p.values())
        a = _layer_norm(h, 1.0 + p["g1"], p["b1"])
        qkv = tf.reshape(tf.matmul(a, p["qkv"]), [-1, SEQ, 3, HEADS, head_dim])
        q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]), num=3, axis=0)
        weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(head_dim), axis=-1)
        context = tf.reshape(tf.transpose(tf.matmul(weights, v), [0, 2, 1, 3]), [-1, D])
        h = h + tf.matmul(context, p["wo"])
        m = _layer_norm(h, 1.0 + p["g2"], p["b2"])
        h = h + tf.matmul(tf.nn.gelu(tf.matmul(m, p["w1"]) + p["c1"]), p["w2"])
        outputs.append(h)
    head = _var("head", [D, CLASSES], 999)
    variables.append(head)
    pooled = tf.reduce_mean(tf.reshape(h, [-1, SEQ, D]), axis=1)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(pooled, head)))
    rng = np.random.RandomState(3)
    feed = {x: rng.randn(BATCH, SEQ, D).astype(np.float32),
            y: rng.randint(0, CLASSES, BATCH).astype(np.int32)}
    return loss, variables, feed, outputs


def _checkpoints(mode, loss, variables, outputs):
    if mode == "auto":
        return select_checkpoints_auto(loss, variables)
    for t in outputs[:-1]:
        tf.compat.v1.add_to_collection("checkpoints", t)
    return select_checkpoints_collection(tf.compat.v1.get_default_graph(), loss, variables)


def _assert_same(sess, reference, checkpointed, feed):
    values = sess.run([[g for g in pair] for pair in zip(reference, checkpointed)], feed)
    for i, (want, got) in enumerate(values):
        dense = [recompute._dense_value(v) for v in (want, got)]
        np.testing.assert_allclose(dense[1], dense[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"gradient {i}")
    assert compare_gradients(sess, reference, checkpointed, feed) < 1e-5


def _run_and_compare(build, mode, **kwargs):
    with tf.Graph().as_default() as graph:
        loss, variables, feed, outputs = build(**kwargs)
        reference = tf.compat.v1.gradients(loss, variables)
        checkpoints = _checkpoints(mode, loss, variables, outputs)
        assert checkpoints
        before = set(graph.get_operations())
        grads = checkpointed_gradients(loss, variables, checkpoints)
        new_ops = [op for op in graph.get_operations() if op not in before]
        assert [type(g) for g in grads] == [type(g) for g in reference]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _assert_same(sess, reference, grads, feed)
        return graph, loss, variables, checkpoints, new_ops


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("mode", ["auto", "collection"])
def test_deep_mlp_matches_plain_gradients(mode, use_resource):
    _run_and_compare(_mlp, mode, use_resource=use_resource)


@pytest.mark.parametrize("mode", ["auto", "collection"])
def test_transformer_matches_plain_gradients(mode):
    _run_and_compare(_transformer, mode)


def _forward_activations(graph_ops, variables):
    """Forward ops computed from the variables, variable reads excluded (creation order)."""
    variable_ops = {v.op for v in variables}
    reads = {op for op in graph_ops if any(t.op in variable_ops for t in op.inputs)}
    activations = set()
    for op in graph_ops:
        if op not in reads and any(t.op in reads or t.op in activations for t in op.inputs):
            activations.add(op)
    return activations


@pytest.mark.parametrize("build", [_mlp, _transformer], ids=["mlp", "transformer"])
def test_backward_reads_only_checkpoints_and_last_segment(build):
    with tf.Graph().as_default() as graph:
        loss, variables, feed, outputs = build()
        forward_ops = list(graph.get_operations())
        activations = _forward_activations(forward_ops, variables)
        checkpoints = select_checkpoints_auto(loss, variables)
        ckpt_ops = {t.op for t in checkpoints}
        last = max(op._id for op in ckpt_ops)
        allowed = {t for op in ckpt_ops for t in op.outputs}
        allowed |= {t for op in activations if op._id > last for t in op.outputs}

        def reads(new_ops):
            # Shape ops on forward tensors run in the forward pass and keep an int vector
            return {t for op in new_ops if op.type not in recompute.SHAPE_OPS
                    for t in op.inputs if t.op in activations}

        n0 = len(graph.get_operations())
        tf.compat.v1.gradients(loss, variables)
        plain_reads = reads(graph.get_operations()[n0:])
        n1 = len(graph.get_operations())
        checkpointed_gradients(loss, variables, checkpoints)
        new_ops = graph.get_operations()[n1:]
        ckpt_reads = reads(new_ops)
        assert ckpt_reads <= allowed, sorted(t.name for t in ckpt_reads - allowed)
        early = {t for t in plain_reads if t.op._id < last}
        kept = {t for op in ckpt_ops for t in op.outputs}
        assert len({t for t in ckpt_reads if t.op._id < last}) <= len(kept) < len(early)
        # recompute copies exist, and each one that reads no other copy waits for a gradient
        copies = [op for op in new_ops if RECOMPUTE_ATTR in op.node_def.attr]
        assert copies
        copied = set(copies)
        roots = [op for op in copies if not any(t.op in copied for t in op.inputs)]
        assert roots and all(op.control_inputs for op in roots)
        # no copy runs only for its shape: shapes come from Shape ops on the originals
        shape_like = recompute.SHAPE_OPS | {"ZerosLike"}
        assert not [op for op in new_ops if op.type in shape_like and op.outputs[0].consumers()
                    and any(t.op in copied for t in op.inputs)]
        assert all(RECOMPUTE_ATTR not in c.node_def.attr for op in roots for c in op.control_inputs)


def _is_bottleneck(op, activations):
    """Brute force: every consumer of every ancestor of op is an ancestor of op or op."""
    ancestors, stack = set(), [t.op for t in op.inputs]
    while stack:
        a = stack.pop()
        if a in activations and a not in ancestors:
            ancestors.add(a)
            stack.extend(t.op for t in a.inputs)
    return all(c in ancestors or c is op
               for a in ancestors for t in a.outputs for c in t.consumers() if c in activations)


def test_auto_selection_picks_bottlenecks_about_sqrt_n():
    with tf.Graph().as_default() as graph:
        loss, variables, _, outputs = _transformer(layers=3)
        activations = _forward_activations(graph.get_operations(), variables)
        chosen = select_checkpoints_auto(loss, variables)
        assert chosen and all(_is_bottleneck(t.op, activations) for t in chosen)
        # between the first and the last block only the residual stream [*, D] separates
        inner = [t for t in chosen if outputs[0].op._id < t.op._id <= outputs[-1].op._id]
        assert inner and all(t.shape.as_list() == [None, D] for t in inner)
        assert len({t.op for t in select_checkpoints_auto(loss, variables, num_checkpoints=2)}) == 2
    with tf.Graph().as_default() as graph:
        loss, variables, _, _ = _mlp()
        activations = _forward_activations(graph.get_operations(), variables)
        chosen = select_checkpoints_auto(loss, variables)
        assert all(_is_bottleneck(t.op, activations) for t in chosen)
        assert 3 <= len(chosen) <= 8    # ~sqrt(3 x 8 forward activations)


def test_random_ops_are_kept_not_recomputed():
    graph, *_, new_ops = _run_and_compare(_mlp, "auto", dropout=True)
    assert not [op for op in new_ops if op.type in RANDOM_TYPES]
    assert any(RECOMPUTE_ATTR in op.node_def.attr for op in new_ops)


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_embedding_gather_gives_indexed_slices(use_resource):
    with tf.Graph().as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None, SEQ])
        table = _var("table", [20, D], 1, use_resource, scale=0.5)
        h = tf.reshape(tf.gather(table, ids), [-1, D])
        variables = [table]
        for i in range(4):
            w = _var(f"w{i}", [D, D], 2 + i, use_resource)
            variables.append(w)
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(tf.square(h))
        feed = {ids: np.random.RandomState(0).randint(0, 20, [BATCH, SEQ])}
        reference = tf.compat.v1.gradients(loss, variables)
        grads = checkpointed_gradients(loss, variables, select_checkpoints_auto(loss, variables))
        assert isinstance(reference[0], tf.IndexedSlices) and isinstance(grads[0], tf.IndexedSlices)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _assert_same(sess, reference, grads, feed)


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_weight_shared_by_every_segment(use_resource):
    """One weight read in every layer (a ref variable: one read op feeding every segment)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        w = _var("shared", [WIDTH, WIDTH], 0, use_resource)
        table = _var("tied", [WIDTH, WIDTH], 1, use_resource, scale=0.3)
        h = tf.matmul(x, table)
        for _ in range(LAYERS):
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.matmul(h, table, transpose_b=True) ** 2)
        variables = [w, table]
        feed = {x: np.random.RandomState(1).randn(BATCH, WIDTH)}
        reference = tf.compat.v1.gradients(loss, variables)
        checkpoints = select_checkpoints_auto(loss, variables)
        assert len(checkpoints) >= 2
        grads = checkpointed_gradients(loss, variables, checkpoints)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _assert_same(sess, reference, grads, feed)


def test_unconnected_and_grad_ys_like_plain_gradients():
    with tf.Graph().as_default():
        loss, variables, feed, outputs = _mlp()
        unused = _var("unused", [3], 0)
        scale = tf.constant(2.5)
        reference = tf.compat.v1.gradients(loss, variables + [unused], grad_ys=scale)
        grads = checkpointed_gradients(loss, variables + [unused], outputs[1:-1:2], grad_ys=scale)
        assert grads[-1] is None and reference[-1] is None
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _assert_same(sess, reference[:-1], grads[:-1], feed)


def test_empty_collection_is_an_error():
    with tf.Graph().as_default() as graph:
        with pytest.raises(ParallelizeError, match=r"'checkpoints' collection is empty.*"
                                                   r"add_to_collection\('checkpoints', t\)"):
            select_checkpoints_collection(graph)


def test_off_path_checkpoint_is_an_error_naming_it():
    with tf.Graph().as_default() as graph:
        loss, variables, _, outputs = _mlp()
        x = graph.get_tensor_by_name("x:0")
        stray = tf.square(x, name="input_only")          # not computed from a variable
        tf.compat.v1.add_to_collection("checkpoints", outputs[2])
        tf.compat.v1.add_to_collection("checkpoints", stray)
        with pytest.raises(ParallelizeError, match=r"'input_only:0'.*not on the path"):
            select_checkpoints_collection(graph, loss, variables)
        with pytest.raises(ParallelizeError, match=r"'input_only:0'"):
            checkpointed_gradients(loss, variables, [outputs[2], stray])
        assert select_checkpoints_collection(graph)[0] is outputs[2]  # no loss: no path check


def test_compare_gradients_reports_the_difference():
    with tf.Graph().as_default():
        a, b = tf.constant([1.0, 2.0]), tf.constant([1.0, 2.5])
        with tf.compat.v1.Session() as sess:
            assert compare_gradients(sess, [a, None], [b, None]) == pytest.approx(0.5)
