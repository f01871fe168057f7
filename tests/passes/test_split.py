"""Tensor and expert parallelism (epl.split): the oracle, placement, checkpoints, bad input.

Every oracle test builds the same model twice: once with EPL off (the
single-device reference) and once with the EPL scopes, trains both for a few
steps from the same initial values on the same global batch, and compares
the losses and every variable (shards reassembled into the full variable by
their checkpoint slice info).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import epl
import epl.layers as layers
from epl.checkpoint.sharded_variable import full_values, shards_of
from epl import env
from epl.hooks.record import record_of
from epl.passes.split.rewriter import SplitFallbackWarning
from paths import EXAMPLES  # noqa: E402

B = 8


def scope(strategy):
    return strategy if env.is_initialized() else contextlib.nullcontext()


def train(build, config=None, use_epl=True, steps=3, optimizer="adam"):
    """Build with `build(feeds) -> loss`, train `steps` steps; (losses, variables, graph).

    These builders feed one batch of B rows that EPL slices among the replicas:
    io.batch_mode "global" (tests/integration/test_batch_semantics.py covers split models
    under the default "replica" contract)."""
    env.reset()
    if use_epl:
        epl.init(epl.Config({"io.batch_mode": "global", **dict(config or {})}))
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(7)
        loss, feed = build()
        opt = (tf.compat.v1.train.AdamOptimizer(0.01) if optimizer == "adam"
               else tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], feed)[1]) for _ in range(steps)]
            values = full_values(sess, graph)
    env.reset()
    return losses, values, graph


def assert_oracle(build, config=None, optimizer="adam", steps=3, rtol=2e-5, atol=2e-6,
                  extra_variables=()):
    reference = train(build, use_epl=False, optimizer=optimizer, steps=steps)
    result = train(build, config, optimizer=optimizer, steps=steps)
    assert sorted(set(result[1]) - set(extra_variables)) == sorted(reference[1])
    for name, value in reference[1].items():
        assert not np.isnan(result[1][name]).any(), f"shards of {name} do not cover it"
        np.testing.assert_allclose(result[1][name], value, rtol=rtol, atol=atol,
                                   err_msg=f"variable {name}")
    np.testing.assert_allclose(result[0], reference[0], rtol=rtol, atol=atol)
    return result


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def _init(shape, seed, scale=0.3):
    return tf.constant_initializer(np.random.RandomState(seed).randn(*shape).astype(np.float32) * scale)


def dense_pair(k=4, hidden=16):
    """A column-split layer followed by a row-split layer, all under split(k)."""
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 6])
        y = tf.compat.v1.placeholder(tf.float32, [B, 5])
        with scope(epl.split(k, name="mlp")):
            w1 = tf.compat.v1.get_variable("w1", [6, hidden], initializer=_init([6, hidden], 1))
            b1 = tf.compat.v1.get_variable("b1", [hidden], initializer=_init([hidden], 2, 0.1))
            w2 = tf.compat.v1.get_variable("w2", [hidden, 5], initializer=_init([hidden, 5], 3))
            b2 = tf.compat.v1.get_variable("b2", [5], initializer=_init([5], 4, 0.1))
            h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
            out = tf.matmul(h, w2) + b2
            loss = tf.reduce_mean(tf.square(out - y))
        return loss, {x: rng.randn(B, 6), y: rng.randn(B, 5)}
    return build


def classifier(classes, k=4, loss_in_split=True):
    """A data-parallel body and a split classifier with sparse softmax cross-entropy."""
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 6])
        y = tf.compat.v1.placeholder(tf.int64, [B])
        with scope(epl.replicate(1, name="body")):
            h = layers.dense(x, 16, activation=tf.nn.relu, kernel_initializer=_init([6, 16], 1),
                             name="body")
        with scope(epl.split(k, name="classifier")):
            logits = layers.dense(h, classes, kernel_initializer=_init([16, classes], 2),
                                  name="classifier")
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            if loss_in_split:
                loss = tf.reduce_mean(per_example)
        if not loss_in_split:
            with scope(epl.replicate(1, name="body")):
                loss = tf.reduce_mean(per_example)
        return loss, {x: rng.randn(B, 6), y: rng.randint(0, classes, B)}
    return build


def embedding_model(vocab=40, k=4):
    """A vocabulary-split embedding table feeding a data-parallel body."""
    def build():
        rng = np.random.RandomState(0)
        ids = tf.compat.v1.placeholder(tf.int32, [B, 5])
        y = tf.compat.v1.placeholder(tf.float32, [B, 3])
        with scope(epl.split(k, name="embedding")):
            table = tf.compat.v1.get_variable("table", [vocab, 8],
                                              initializer=_init([vocab, 8], 5))
            emb = tf.nn.embedding_lookup(table, ids)
        with scope(epl.replicate(1, name="body")):
            pooled = tf.reduce_mean(emb, axis=1)
            out = layers.dense(pooled, 3, kernel_initializer=_init([8, 3], 6), name="head")
            loss = tf.reduce_mean(tf.square(out - y))
        return loss, {ids: rng.randint(0, vocab, (B, 5)), y: rng.randn(B, 3)}
    return build


def moe_model(k, experts=8):
    """A mixture-of-experts layer whose experts are split over k devices."""
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 6, 8])
        y = tf.compat.v1.placeholder(tf.float32, [B, 6, 8])
        if env.is_initialized():
            epl.set_default_strategy(epl.replicate(1))
        out, aux = layers.moe(x, experts, 16, k=2, capacity_factor=2.0, split_devices=k)
        loss = tf.reduce_mean(tf.square(out - y)) + 0.01 * aux
        return loss, {x: rng.randn(B, 6, 8), y: rng.randn(B, 6, 8)}
    return build


# --------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_oracle_column_row_dense_pair(optimizer):
    _, _, graph = assert_oracle(dense_pair(), optimizer=optimizer)
    record = record_of(graph).splits[0]
    axes = {name: sharded.axis for name, sharded in record.variables.items()}
    assert axes == {"w1": 1, "b1": 0, "w2": 0}   # column, its bias, row; b2 stays whole
    assert record.fallbacks == []


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("loss_in_split", [True, False])
def test_oracle_split_classifier_with_replicated_body(optimizer, loss_in_split):
    assert_oracle(classifier(1000, loss_in_split=loss_in_split), optimizer=optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_oracle_vocab_split_softmax_100k_classes(optimizer):
    _, _, graph = assert_oracle(classifier(100_000), optimizer=optimizer, steps=2)
    ops = graph.get_operations()
    # the logits are never gathered: no op outside the slots holds [B, 100000]
    gathered = [op for op in ops if op.outputs and op.outputs[0].shape.rank == 2
                and op.outputs[0].shape.as_list() == [B, 100_000]
                and "_epl_shard" not in op.node_def.attr
                and "_epl_split_replaced" not in op.node_def.attr
                and op.node_def.attr.get("_epl_phase") is not None
                and op.node_def.attr["_epl_phase"].s == b"forward"]
    assert gathered == []


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_oracle_vocab_split_embedding(optimizer):
    _, _, graph = assert_oracle(embedding_model(), optimizer=optimizer)
    assert {n: v.axis for n, v in record_of(graph).splits[0].variables.items()} == {"table": 0}


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_oracle_mixture_of_experts_8_experts(devices, optimizer):
    _, _, graph = assert_oracle(moe_model(devices), optimizer=optimizer)
    record = record_of(graph).splits[0]
    assert {n.rsplit("/", 1)[-1]: v.sizes for n, v in record.variables.items()} == {
        name: tuple([8 // devices] * devices)
        for name in ("experts_in", "experts_in_bias", "experts_out", "experts_out_bias")}
    # the dispatch became an all-to-all: each device reads only its experts' slice
    # of every replica's tokens (one slice per replica and device). With
    # cluster.colocate_split_and_replicate off, split(2) takes the last 2 of the 4
    # devices and the replicas the other 2; split(4) shares all 4 with 4 replicas.
    plan = record_of(graph).result.plan
    assert plan.num_replicas == (2 if devices == 2 else 4)
    assert plan.split_devices[record.taskgraph] == tuple(
        f"/device:CPU:{i}" for i in range(4 - devices, 4))
    slices = [op for op in graph.get_operations() if op.type == "Slice"
              and op.name.startswith("EPL_SPLIT_DISPATCH")]
    assert len(slices) == plan.num_replicas * devices


def test_uneven_shards_follow_device_capability():
    profiles = {"CPU:0": {"peak_flops": {"float32": 3e11}}, "CPU:1": {"peak_flops": {"float32": 1e11}},
                "CPU:2": {"peak_flops": {"float32": 3e11}}, "CPU:3": {"peak_flops": {"float32": 1e11}}}
    config = {"cluster.device_profiles": profiles}
    _, _, graph = assert_oracle(classifier(80), config, optimizer="adam")
    sharded = record_of(graph).splits[0].variables["classifier/kernel"]
    assert sharded.sizes == (30, 10, 30, 10)


def test_per_device_parameter_bytes_are_one_kth():
    _, _, graph = train(classifier(4000), steps=1)
    per_device: dict = {}
    (kernel,) = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
                 if v.op.name == "classifier/kernel"]
    for shard in shards_of(kernel):
        nbytes = shard.shape.num_elements() * 4
        per_device[shard.device] = per_device.get(shard.device, 0) + nbytes
    whole = 16 * 4000 * 4
    assert sorted(per_device) == [f"/device:CPU:{i}" for i in range(4)]
    assert all(nbytes == whole // 4 for nbytes in per_device.values())


def test_checkpoint_uses_full_name_and_shape_and_restores_unsplit(tmp_path):
    env.reset()
    epl.init(epl.Config({"io.batch_mode": "global"}))
    path = os.path.join(str(tmp_path), "model.ckpt")
    with tf.Graph().as_default():
        loss, feed = classifier(40)()
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, feed)
            saved = full_values(sess, sess.graph)
            saver.save(sess, path)
    shapes = dict(tf.train.list_variables(path))
    assert shapes["classifier/kernel"] == [16, 40]
    assert shapes["classifier/kernel/Adam"] == [16, 40]
    assert not any("part_" in name for name in shapes)
    env.reset()
    with tf.Graph().as_default():   # a plain single-device script restores it
        loss, feed = classifier(40)()
        tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, path)
            restored = full_values(sess, sess.graph)
    for name, value in saved.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_split_pass_is_dumped(tmp_path):
    dump = str(tmp_path / "dump")
    train(dense_pair(), {"debug.dump_dir": dump}, steps=1)
    names = sorted(os.listdir(dump))
    assert "001_split.pb" in names and "002_gradients.pb" in names
    # then the training pipeline, from its first pass
    assert "003_auto_stages.json" in names and "004_annotate.json" in names


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------


def test_split_dimension_not_divisible_with_even_shards():
    with pytest.raises(epl.PassError) as err:
        train(classifier(10, k=4), steps=1)
    assert ("the dimension 1 of variable classifier/kernel (shape [16, 10]) of size 10 is not "
            "divisible by the split degree 4, and its shards must be even. Use a size divisible "
            "by 4, or epl.split(device_count=d) with d dividing 10.") in str(err.value)


def test_expert_count_not_divisible_by_split_degree():
    with pytest.raises(epl.PassError) as err:
        train(moe_model(4, experts=6), steps=1)
    assert ("the expert count 6 (axis 0 of moe/experts_in, shape [6, 8, 16], "
            "read by moe/MatMul_1) is not divisible by the split degree 4: every device must "
            "hold whole experts.") in str(err.value)


def test_op_without_rule_on_sharded_input_warns_and_still_trains():
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 6])
        with scope(epl.split(2, name="head")):
            w = tf.compat.v1.get_variable("w", [6, 4], initializer=_init([6, 4], 1))
            logits = tf.matmul(x, w)
            loss = tf.reduce_mean(tf.nn.softmax(logits)[:, 0]) + tf.reduce_mean(logits)
        return loss, {x: rng.randn(B, 6)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, graph = assert_oracle(build, optimizer="sgd")
    messages = [str(w.message) for w in caught if issubclass(w.category, SplitFallbackWarning)]
    assert any(m.startswith("epl.split: op Softmax (type Softmax) has a split rule, but not "
                            "for its inputs split as they are (MatMul:0 split along axis 1); "
                            "EPL gathers MatMul:0 and runs the op unsplit on one device.")
               for m in messages), messages
    assert any("(type Softmax)" in f for f in record_of(graph).splits[0].fallbacks)


def test_split_with_micro_batches_is_refused():
    with pytest.raises(epl.PassError) as err:
        train(classifier(40), {"pipeline.num_micro_batch": 2}, steps=1)
    assert "cannot be combined with: pipeline.num_micro_batch > 1 (micro-batches)" in str(err.value)


def _load_example(name):
    import importlib.util
    path = os.path.join(EXAMPLES, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_oracle_m6_mini_over_4_devices():
    m6 = _load_example("m6_mini")
    rng = np.random.RandomState(0)
    patches_np = rng.randn(B, m6.PATCHES, m6.PATCH_DIM).astype(np.float32)
    captions_np = rng.randint(1, m6.VOCAB, (B, m6.TEXT)).astype(np.int32)

    def build():
        patches = tf.compat.v1.placeholder(tf.float32, [B, m6.PATCHES, m6.PATCH_DIM])
        captions = tf.compat.v1.placeholder(tf.int32, [B, m6.TEXT])
        if env.is_initialized():
            epl.set_default_strategy(epl.replicate(1))
        caption_loss, balance = m6.m6_mini(patches, captions, split_devices=4)
        return caption_loss + 0.01 * balance, {patches: patches_np, captions: captions_np}

    # SGD: Adam turns the float noise of gradients that are zero in exact
    # arithmetic (the key bias under softmax) into full-size steps
    _, _, graph = assert_oracle(build, {"cluster.colocate_split_and_replicate": True},
                                optimizer="sgd", steps=2, rtol=1e-4, atol=1e-5)
    state = record_of(graph)
    assert len(state.splits) == m6.LAYERS
    assert state.result.plan.num_replicas == 4
    for record in state.splits:
        assert record.fallbacks == []
        assert all(v.sizes == (2, 2, 2, 2) for v in record.variables.values())


@pytest.mark.parametrize("script,args", [
    ("large_classifier", ["--steps", "20", "--classes", "20000", "--batch", "8", "--log-every", "5"]),
    ("m6_mini", ["--steps", "20", "--batch", "4", "--log-every", "5"]),
])
def test_examples_train(script, args):
    import re
    import subprocess
    import sys
    path = os.path.join(EXAMPLES, f"{script}.py")
    result = subprocess.run([sys.executable, path, *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) >= 3, result.stdout
    assert losses[-1] < losses[0], result.stdout


@pytest.mark.parametrize("kind", ["auto", "collection"])
def test_gradient_checkpointing_with_split_and_replicas(kind):
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 6])
        y = tf.compat.v1.placeholder(tf.int64, [B])
        with scope(epl.replicate(1, name="body")):
            h = x
            for i in range(4):
                h = layers.dense(h, 6, activation=tf.nn.tanh, name=f"body{i}",
                                 kernel_initializer=_init([6, 6], 10 + i))
                if i == 1:
                    tf.compat.v1.add_to_collection("checkpoints", h)
        with scope(epl.split(4, name="classifier")):
            logits = layers.dense(h, 40, kernel_initializer=_init([6, 40], 2), name="classifier")
            loss = layers.sparse_softmax_cross_entropy(y, logits)
        return loss, {x: rng.randn(B, 6), y: rng.randint(0, 40, B)}
    _, _, graph = assert_oracle(build, {"gradient_checkpoint.type": kind,
                                        "gradient_checkpoint.check_gradients": True},
                                optimizer="adam")
    recomputed = [op for op in graph.get_operations() if "_epl_recompute" in op.node_def.attr]
    assert recomputed, "no forward op is recomputed"
    assert record_of(graph).result.gradient_check_max_diff < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_oracle_vocab_parallel_lm_head_on_sequences(optimizer):
    """A dense layer over [B, S, d] under split: reshape rule keeps the vocab axis sharded."""
    def build():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [B, 5, 6])
        y = tf.compat.v1.placeholder(tf.int64, [B, 5])
        with scope(epl.replicate(1, name="body")):
            h = layers.dense(x, 8, activation=tf.nn.tanh, kernel_initializer=_init([6, 8], 1),
                             name="body")
        with scope(epl.split(4, name="lm_head")):
            logits = layers.dense(h, 64, kernel_initializer=_init([8, 64], 2), name="lm_head")
            loss = layers.sparse_softmax_cross_entropy(y, logits)
        return loss, {x: rng.randn(B, 5, 6), y: rng.randint(0, 64, (B, 5))}
    _, _, graph = assert_oracle(build, optimizer=optimizer)
    record = record_of(graph).splits[0]
    assert record.fallbacks == []
    assert {n: v.axis for n, v in record.variables.items()} == {"lm_head/kernel": 1,
                                                                "lm_head/bias": 0}


@pytest.mark.parametrize("config", [{"zero.level": "v1"}, {"amp.level": "O1"},
                                    {"offload.level": "v0"}],
                         ids=["zero", "amp", "offload"])
def test_split_with_memory_features(config):
    """ZeRO shards the replicated body's optimizer state (the split classifier is
    sharded already), AMP computes the matmuls in float16 with loss scaling
    (shard gradients unscaled and checked too), offload keeps weights on the host."""
    amp = dict(rtol=2e-2, atol=2e-3, extra_variables=("EPL_AMP/loss_scale", "EPL_AMP/good_steps")) \
        if "amp.level" in config else {}
    _, _, graph = assert_oracle(classifier(400), config, optimizer="adam", **amp)
    assert record_of(graph).splits[0].variables["classifier/kernel"].sizes == (100,) * 4


def test_planner_sees_the_split_part():
    """epl-plan's model of a split graph: the classifier is the split part, sharded by class."""
    from epl.planner.planner import model_from_graph
    env.reset()
    epl.init(epl.Config({"io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        loss, _ = classifier(4000)()
        tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        model = model_from_graph(graph, epl.parallelize(graph).view)
    assert model.split_units == 4000
    split = [layer for layer in model.layers if layer.split_parameter_bytes]
    assert [layer.name for layer in split] == ["classifier"]
    assert split[0].split_parameter_bytes == (16 * 4000 + 4000) * 4
    assert split[0].split_flops_per_example >= 3 * 2 * 16 * 4000   # fwd + 2 bwd matmuls


@pytest.mark.parametrize("chunks", [1, 3])
def test_oracle_mixture_of_experts_chunked_dispatch(chunks):
    """split.moe_chunks=3 on epl.layers.moe (tokens [B, E, capacity 3, d]): one
    dispatch slice and expert matmul per chunk and device, the same training."""
    _, _, graph = assert_oracle(moe_model(4), {"split.moe_chunks": chunks}, optimizer="adam")
    chunk_slices = [op for op in graph.get_operations() if op.type == "Slice"
                    and op.name.startswith("EPL_SPLIT_DISPATCH")]
    # global batch mode: the dispatch is rebuilt per replica (4) and device (4), per chunk
    assert len(chunk_slices) == 4 * 4 * chunks


def test_moe_chunks_not_dividing_the_capacity_names_the_option():
    with pytest.raises(epl.PassError) as err:
        train(moe_model(4), {"split.moe_chunks": 2})
    assert str(err.value) == (
        "pass 'split' failed (passes run before it: none): split.moe_chunks=2 must divide "
        "the tokens' capacity axis 2 of moe/einsum/Einsum:0 (shape [8, 8, 3, 8]), the input "
        "of moe/MatMul_1 (BatchMatMulV2), which has 3 entries. Set split.moe_chunks to a "
        "divisor of 3 (1: no chunks), or give the tokens a static capacity divisible by it.")
