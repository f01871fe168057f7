"""epl.split on tf.einsum models: experts (FastNN's MoE layer, EPL's split_test) and
dense contractions (attention heads and a feed-forward layer, Megatron-style).

The oracle (tests/split_oracle.py): EPL's training equals single-device training
on the rows the replicas consumed, under both batch contracts (io.batch_mode
"replica" and "global").

The models are written like real TF1 code: static batch shapes, layers from
tf.compat.v1.layers, an expert layer as a tf.compat.v1.layers.Layer whose build()
creates the expert weights under one epl.split scope and whose call() uses them
under another (as FastNN's moe_ffn.py and EPL's tests/split_test.py do).
"""
from __future__ import annotations

import contextlib
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.hooks.record import record_of
from epl.passes.split.rewriter import SplitFallbackWarning, SplitUnshardedVariableWarning
from split_oracle import assert_matches_single_device

SEQ, MODEL, HIDDEN, EXPERTS, CAPACITY = 8, 8, 16, 8, 2
HEADS, HEAD_DIM, FF = 4, 4, 32
CLASSES = 5


def _init(shape, seed, scale=0.3):
    return tf.compat.v1.constant_initializer(
        np.random.RandomState(seed).randn(*shape).astype(np.float32) * scale)


def _split(k: int, name: str | None = None):
    return epl.split(k, name=name) if env.is_initialized() else contextlib.nullcontext()


# --------------------------------------------------------------------------
# mixture of experts with einsum (FastNN's moe/moe_ffn.py)
# --------------------------------------------------------------------------


def switch_gating(inputs: tf.Tensor):
    """FastNN's SwitchGating (argmax policy): combine and dispatch tensors [G, S, E, C]
    and the load-balancing loss, for inputs [G, S, M]."""
    gating_weight = tf.compat.v1.get_variable("gating_weight", [MODEL, EXPERTS],
                                              initializer=_init([MODEL, EXPERTS], 11))
    logits = tf.einsum("GSM,ME->GSE", inputs, gating_weight)
    raw_gates = tf.nn.softmax(logits)
    expert_index = tf.math.argmax(raw_gates, axis=-1, output_type=tf.int32)
    expert_mask = tf.one_hot(expert_index, EXPERTS, dtype=tf.float32)
    gate_1 = tf.einsum("GSE,GSE->GS", raw_gates, expert_mask)
    position_in_expert = tf.cumsum(expert_mask, exclusive=True, axis=1)
    density = tf.reduce_mean(expert_mask, axis=1)
    density_proxy = tf.reduce_mean(raw_gates, axis=1)
    aux_loss = tf.reduce_mean(density_proxy * density) * EXPERTS * EXPERTS
    expert_mask *= tf.cast(tf.less(position_in_expert, CAPACITY), dtype=expert_mask.dtype)
    position_in_expert = tf.einsum("GSE,GSE->GS", position_in_expert, expert_mask)
    mask_flat = tf.einsum("GSE->GS", expert_mask)
    gate_1 *= mask_flat
    b = tf.one_hot(tf.cast(position_in_expert, dtype=tf.int32), CAPACITY, dtype=tf.float32)
    a = tf.expand_dims(gate_1 * mask_flat, -1) * tf.one_hot(expert_index, EXPERTS,
                                                           dtype=tf.float32)
    combine_tensor = tf.einsum("GSE,GSC->GSEC", a, b)
    dispatch_mask = tf.cast(tf.cast(combine_tensor, tf.bool), tf.float32)
    return combine_tensor, dispatch_mask, aux_loss


class MoEFFN(tf.compat.v1.layers.Layer):
    """FastNN's MoEFFN with op_split: expert weights [E, M, H] and [E, H, M] built
    under epl.split, the expert computation under epl.split in call().

    layout: "fastnn" (dispatch outside the split scopes, combine inside, as FastNN),
    "combine_outside" (the combine einsum outside too), "dispatch_inside" (the
    dispatch einsum inside the split scope as well).
    """

    def __init__(self, devices: int, layout: str = "fastnn", **kwargs):
        super().__init__(**kwargs)
        self.devices = devices
        self.layout = layout

    def build(self, input_shape):
        with _split(self.devices):
            self.inter_experts = self.add_weight(
                "inter_experts", shape=(EXPERTS, MODEL, HIDDEN), dtype=tf.float32,
                initializer=_init([EXPERTS, MODEL, HIDDEN], 12))
            self.out_experts = self.add_weight(
                "out_experts", shape=(EXPERTS, HIDDEN, MODEL), dtype=tf.float32,
                initializer=_init([EXPERTS, HIDDEN, MODEL], 13))
        super().build(input_shape)

    def call(self, inputs, combine_tensor, dispatch_mask):
        inside = self.layout == "dispatch_inside"
        with _split(self.devices) if inside else contextlib.nullcontext():
            dispatch_inputs = tf.einsum("GSEC,GSM->EGCM", dispatch_mask, inputs,
                                        name="dispatch_inputs")
        with _split(self.devices):
            intermediate = tf.einsum("EGCM,EMH->EGCH", dispatch_inputs, self.inter_experts,
                                     name="dispatched_inter_outputs")
            activated = tf.nn.relu(intermediate)
            output_experts = tf.einsum("EGCH,EHM->EGCM", activated, self.out_experts,
                                       name="dispatched_outputs")
            if self.layout != "combine_outside":
                return tf.einsum("GSEC,EGCM->GSM", combine_tensor, output_experts,
                                 name="combined_outputs")
        return tf.einsum("GSEC,EGCM->GSM", combine_tensor, output_experts,
                         name="combined_outputs")


def moe_classifier(layout: str = "fastnn", devices: int = 4):
    """Token features, an MoE feed-forward layer with a residual, mean-pooled
    into a softmax classifier; the body replicated (EPL's MoE tutorial)."""
    def build(rows: int):
        x = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, MODEL], name="tokens")
        y = tf.compat.v1.placeholder(tf.int64, [rows], name="labels")
        if env.is_initialized():
            epl.set_default_strategy(epl.replicate(1))
        ffn = MoEFFN(devices, layout, name="moe_ffn")

        def model(tokens, labels):
            hidden = tf.nn.tanh(_token_projection(tokens, 10))
            combine, dispatch, aux_loss = switch_gating(hidden)
            hidden = hidden + ffn(hidden, combine, dispatch)
            logits = tf.compat.v1.layers.dense(tf.reduce_mean(hidden, axis=1), CLASSES,
                                               kernel_initializer=_init([MODEL, CLASSES], 14),
                                               name="classifier")
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
            return loss + 0.01 * aux_loss

        def feed(rng, n):
            return {x: rng.randn(n, SEQ, MODEL), y: rng.randint(0, CLASSES, n)}
        return model, (x, y), feed
    return build


# --------------------------------------------------------------------------
# dense contractions: attention heads and a feed-forward layer in einsum
# --------------------------------------------------------------------------


def einsum_transformer(devices: int = 4):
    """One post-layer-norm transformer block written with einsum: the attention
    heads and the feed-forward layer under epl.split (q, k, v split by heads, the
    output projection by heads as rows; the first feed-forward layer split by
    columns, the second by rows), layer norms and the classifier replicated."""
    def build(rows: int):
        x = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, MODEL], name="tokens")
        y = tf.compat.v1.placeholder(tf.int64, [rows], name="labels")
        if env.is_initialized():
            epl.set_default_strategy(epl.replicate(1))

        def attention(h):
            with tf.compat.v1.variable_scope("attention", reuse=tf.compat.v1.AUTO_REUSE), \
                    _split(devices, name="attention"):
                wq, wk, wv = (tf.compat.v1.get_variable(
                    name, [MODEL, HEADS, HEAD_DIM], initializer=_init([MODEL, HEADS, HEAD_DIM], s))
                    for name, s in (("query", 20), ("key", 21), ("value", 22)))
                wo = tf.compat.v1.get_variable("output", [HEADS, HEAD_DIM, MODEL],
                                               initializer=_init([HEADS, HEAD_DIM, MODEL], 23))
                q = tf.einsum("bsd,dnh->bsnh", h, wq)
                k = tf.einsum("bsd,dnh->bsnh", h, wk)
                v = tf.einsum("bsd,dnh->bsnh", h, wv)
                scores = tf.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(HEAD_DIM).astype(np.float32)
                probs = tf.nn.softmax(scores, axis=-1)
                context = tf.einsum("bnqk,bknh->bqnh", probs, v)
                return tf.einsum("bqnh,nhd->bqd", context, wo)

        def feed_forward(h):
            with tf.compat.v1.variable_scope("ffn", reuse=tf.compat.v1.AUTO_REUSE), \
                    _split(devices, name="ffn"):
                w_in = tf.compat.v1.get_variable("w_in", [MODEL, FF],
                                                 initializer=_init([MODEL, FF], 24))
                b_in = tf.compat.v1.get_variable("b_in", [FF], initializer=_init([FF], 25, 0.1))
                w_out = tf.compat.v1.get_variable("w_out", [FF, MODEL],
                                                  initializer=_init([FF, MODEL], 26))
                b_out = tf.compat.v1.get_variable("b_out", [MODEL],
                                                  initializer=_init([MODEL], 27, 0.1))
                inner = tf.nn.relu(tf.einsum("bsd,df->bsf", h, w_in) + b_in)
                return tf.einsum("bsf,fd->bsd", inner, w_out) + b_out

        def model(tokens, labels):
            norm = dict(begin_norm_axis=-1, begin_params_axis=-1,
                        reuse=tf.compat.v1.AUTO_REUSE)
            h = _token_projection(tokens, 28)
            h = _layer_norm(h + attention(h), "ln1", **norm)
            h = _layer_norm(h + feed_forward(h), "ln2", **norm)
            logits = tf.compat.v1.layers.dense(tf.reduce_mean(h, axis=1), CLASSES,
                                               kernel_initializer=_init([MODEL, CLASSES], 29),
                                               name="classifier", reuse=tf.compat.v1.AUTO_REUSE)
            return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)

        def feed(rng, n):
            return {x: rng.randn(n, SEQ, MODEL), y: rng.randint(0, CLASSES, n)}
        return model, (x, y), feed
    return build


def _token_projection(tokens, seed):
    """[B, S, M] -> [B, S, M] per token (an einsum: tf.compat.v1.layers.dense on a 3-D
    input bakes the batch size into a reshape, which io.batch_mode "global" refuses)."""
    kernel = tf.compat.v1.get_variable("embed/kernel", [MODEL, MODEL],
                                       initializer=_init([MODEL, MODEL], seed))
    bias = tf.compat.v1.get_variable("embed/bias", [MODEL], initializer=tf.zeros_initializer())
    return tf.einsum("bsd,de->bse", tokens, kernel) + bias


def _layer_norm(h, name, **kwargs):
    with tf.compat.v1.variable_scope(name, reuse=kwargs.pop("reuse")):
        mean, variance = tf.nn.moments(h, axes=[-1], keepdims=True)
        gamma = tf.compat.v1.get_variable("gamma", [MODEL], initializer=tf.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [MODEL], initializer=tf.zeros_initializer())
        return (h - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


def _expert_records(graph):
    return [r for r in record_of(graph).splits if r.variables]


@pytest.mark.parametrize("mode", ["replica", "global"])
@pytest.mark.parametrize("layout", ["fastnn", "combine_outside", "dispatch_inside"])
def test_einsum_experts_match_single_device(mode, layout):
    """The expert weights are split by experts (2 of 8 on each of 4 devices), the
    tokens dispatched to them and combined back; no op falls back."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitFallbackWarning)
        graph = assert_matches_single_device(
            f"moe_{layout}", moe_classifier(layout), mode,
            {"cluster.colocate_split_and_replicate": True})
    (record,) = _expert_records(graph)
    assert {name: (v.axis, v.sizes) for name, v in record.variables.items()} == {
        "moe_ffn/inter_experts": (0, (2, 2, 2, 2)), "moe_ffn/out_experts": (0, (2, 2, 2, 2))}
    assert record.fallbacks == [] and record.unsharded == []
    # every expert einsum runs once per device (per replica in replica mode), on its shard
    einsums = [op for op in graph.get_operations() if op.type == "Einsum"
               and "_epl_shard" in op.node_def.attr and "_epl_split_replaced" not in
               op.node_def.attr]
    assert {op.get_attr("equation") for op in einsums} >= {b"EGCM,EMH->EGCH", b"EGCH,EHM->EGCM"}


@pytest.mark.parametrize("mode", ["replica", "global"])
def test_einsum_attention_and_feed_forward_match_single_device(mode, caplog):
    """Heads split over 4 devices (q, k, v by columns, the output projection by rows),
    the feed-forward layer by columns then rows: one partial sum per layer. The bias
    added after the row-split layer stays whole, with a warning saying why (also
    logged to the "epl" logger)."""
    caplog.set_level("WARNING", logger="epl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = assert_matches_single_device("transformer", einsum_transformer(), mode)
    records = {r.taskgraph: r for r in record_of(graph).splits}
    layout = {name: (v.axis, v.sizes) for r in records.values() for name, v in r.variables.items()}
    heads, ff = (1, 1, 1, 1), (8, 8, 8, 8)
    assert layout == {
        "attention/query": (1, heads), "attention/key": (1, heads), "attention/value": (1, heads),
        "attention/output": (0, heads), "ffn/w_in": (1, ff), "ffn/b_in": (0, ff),
        "ffn/w_out": (0, ff)}
    assert all(r.fallbacks == [] for r in records.values())
    assert [w for w in caught if issubclass(w.category, SplitFallbackWarning)
            and not issubclass(w.category, SplitUnshardedVariableWarning)] == []
    unsharded = [str(w.message) for w in caught
                 if issubclass(w.category, SplitUnshardedVariableWarning)]
    assert unsharded == [
        "epl.split: variable ffn/b_out (shape [8]) is created under epl.split (ffn) but stays "
        "whole, not split over the 4 devices: its first use, ffn/add_1 (type AddV2), combines "
        "it with partial sums (the result of a row-split layer, summed over the devices), "
        "which needs it whole. Variables under epl.split are sharded by their first use in an "
        "op with a split rule (the weight of a MatMul, BatchMatMul or Einsum, an embedding "
        "table, the bias or scale of a split layer); create it outside epl.split to keep it "
        "whole without this warning."]
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("epl")
              and r.levelname == "WARNING" and "stays whole" in r.getMessage()]
    assert logged == unsharded
    assert records["ffn"].unsharded == [
        "ffn/b_out: its first use, ffn/add_1 (type AddV2), combines it with partial sums (the "
        "result of a row-split layer, summed over the devices), which needs it whole"]


def test_expert_count_not_divisible_by_the_split_degree_is_refused():
    with pytest.raises(epl.PassError) as err:
        assert_matches_single_device("moe_fastnn", moe_classifier(devices=3), "replica",
                                     {"cluster.colocate_split_and_replicate": True})
    assert ("the expert count 8 (axis 0 of moe_ffn/inter_experts, shape [8, 8, 16], read by "
            "moe_ffn/dispatched_inter_outputs/Einsum) is not divisible by the split degree 3: "
            "every device must hold whole experts. Use a number of experts divisible by 3, or "
            "epl.split(device_count=d) with d dividing 8.") in str(err.value)


def test_einsum_of_operands_split_along_different_labels_falls_back_with_a_warning():
    """Two column-split projections (split along h and along e) contracted together:
    no single label splits both, so the einsum runs on the gathered tensors."""
    def build(rows):
        x = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, MODEL], name="tokens")
        y = tf.compat.v1.placeholder(tf.float32, [rows, HIDDEN, HIDDEN], name="targets")

        def model(tokens, targets):
            with _split(2, name="bilinear"):
                left = tf.compat.v1.get_variable("left", [MODEL, HIDDEN],
                                                 initializer=_init([MODEL, HIDDEN], 30))
                right = tf.compat.v1.get_variable("right", [MODEL, HIDDEN],
                                                  initializer=_init([MODEL, HIDDEN], 31))
                a = tf.einsum("bsd,dh->bsh", tokens, left)
                c = tf.einsum("bsd,de->bse", tokens, right)
                outer = tf.einsum("bsh,bse->bhe", a, c, name="outer")
                return tf.reduce_mean(tf.square(outer - targets))

        def feed(rng, n):
            return {x: rng.randn(n, SEQ, MODEL), y: rng.randn(n, HIDDEN, HIDDEN)}
        return model, (x, y), feed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = assert_matches_single_device("bilinear", build, "replica",
                                             {"cluster.colocate_split_and_replicate": True})
    messages = [str(w.message) for w in caught if w.category is SplitFallbackWarning]
    assert len(messages) == 1 and messages[0].startswith(
        "epl.split: op outer/Einsum (type Einsum) has a split rule, but not for its inputs split as "
        "they are (einsum/Einsum:0 split along axis 2; einsum_1/Einsum:0 split along axis 2); "
        "EPL gathers einsum/Einsum:0, einsum_1/Einsum:0 and runs the op unsplit on one "
        "device. Op types with split rules: "), messages
    (record,) = record_of(graph).splits
    assert record.fallbacks == ["outer/Einsum (type Einsum)"]


# ------------------------------------------- chunked expert dispatch --

def _expert_einsums(graph):
    return [op for op in graph.get_operations() if op.type == "Einsum"
            and "_epl_shard" in op.node_def.attr and "_epl_split_replaced" not in
            op.node_def.attr and op.get_attr("equation") == b"EGCM,EMH->EGCH"]


@pytest.mark.parametrize("mode", ["replica", "global"])
def test_chunked_expert_dispatch_matches_unchunked_and_single_device(mode):
    """split.moe_chunks=2: each device's dispatch is cut into 2 chunks along the
    capacity axis (CAPACITY 2), one slice and one expert einsum per chunk; the
    training equals single-device training (the oracle's tolerance) and the
    unchunked split to float rounding."""
    import split_oracle
    from conftest import ATOL, RTOL
    config = {"cluster.colocate_split_and_replicate": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitFallbackWarning)
        graph = assert_matches_single_device("moe_fastnn", moe_classifier("fastnn"), mode,
                                             {**config, "split.moe_chunks": 2})
    einsums = _expert_einsums(graph)
    assert all("/chunk_" in op.name for op in einsums)
    assert {re.search(r"EPL_SPLIT_(\d)/chunk_(\d)", op.name).groups() for op in einsums} \
        == {(str(j), str(c)) for j in range(4) for c in range(2)}
    rows = split_oracle.ROWS // split_oracle.REPLICAS if mode == "replica" else split_oracle.ROWS
    whole = split_oracle.train(moe_classifier("fastnn"), rows,
                               {"io.batch_mode": mode, **config}, 3)
    chunked = split_oracle.train(moe_classifier("fastnn"), rows,
                                 {"io.batch_mode": mode, **config, "split.moe_chunks": 2}, 3)
    for name, value in whole[1].items():
        np.testing.assert_allclose(chunked[1][name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=RTOL, atol=ATOL)


def test_moe_chunks_not_dividing_the_capacity_is_refused():
    with pytest.raises(epl.PassError) as err:
        assert_matches_single_device("moe_fastnn", moe_classifier("fastnn"), "replica",
                                     {"cluster.colocate_split_and_replicate": True,
                                      "split.moe_chunks": 3})
    assert str(err.value) == (
        "pass 'split' failed (passes run before it: none): split.moe_chunks=3 must divide "
        "the tokens' capacity axis 2 of moe_ffn/dispatch_inputs/Einsum:0 (shape [8, 2, 2, 8]), "
        "the input of moe_ffn/dispatched_inter_outputs/Einsum (Einsum), which has 2 entries. "
        "Set split.moe_chunks to a divisor of 2 (1: no chunks), or give the tokens a static "
        "capacity divisible by it.")


def _dynamic_expert_axis(use_epl: bool, feed: np.ndarray, steps: int = 3):
    """EPL's MoE test pattern: the expert axis of "EGCM,EMH->EGCH" is the batch axis of a
    placeholder with a dynamic batch dimension. (losses, w after `steps` steps, the
    variables stored)."""
    env.reset()
    if use_epl:
        epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, CAPACITY, MODEL])
        with (epl.replicate(1) if use_epl else contextlib.nullcontext()):
            hidden = tf.nn.relu(x)
        with _split(2):
            w = tf.compat.v1.get_variable("w", [4, MODEL, HIDDEN], initializer=_init(
                [4, MODEL, HIDDEN], 3))
            loss = tf.reduce_mean(tf.square(tf.einsum("EGCM,EMH->EGCH", hidden, w)))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([train_op, loss], {x: feed})[1] for _ in range(steps)]
            stored = [v.op.name for v in tf.compat.v1.global_variables()]
            return losses, sess.run(w), stored


def test_expert_axis_from_a_dynamic_batch_dimension_is_split():
    """The expert einsum's expert axis comes from a dynamic batch dimension: the split
    slices it by the weight's expert count (it crashed with an internal TypeError).
    Both replicas read the same 4 experts' rows, so the step equals single-device
    training on them."""
    experts = np.random.RandomState(4).randn(4, 2, CAPACITY, MODEL).astype(np.float32)
    reference = _dynamic_expert_axis(False, experts)
    result = _dynamic_expert_axis(True, np.concatenate([experts, experts]))
    env.reset()
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-5, atol=1e-6)
    assert "w/part_0" in result[2] and "w/part_1" in result[2]


class EplFFN(tf.compat.v1.layers.Layer):
    """EPL's split_test FFN: expert weights built under epl.split(2), used under an
    epl.split() of one device (EPL's worker count on one worker)."""

    def build(self, input_shape):
        with epl.split(2):
            self.in_weights = self.add_weight("in_weights", (4, MODEL, HIDDEN), tf.float32)
        super().build(input_shape)

    def call(self, tokens):
        with epl.split():
            return tf.einsum("EGCM,EMH->EGCH", tokens, self.in_weights)


def test_expert_weights_that_stay_whole_are_named_in_a_warning():
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = tf.compat.v1.placeholder(tf.float32, [4, 2, CAPACITY, MODEL])
        with epl.replicate(1):
            hidden = tf.nn.relu(tokens)
        loss = tf.reduce_mean(EplFFN(name="ffn")(hidden))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    env.reset()
    whole = [str(w.message) for w in caught if issubclass(w.category, SplitUnshardedVariableWarning)]
    assert len(whole) == 1 and whole[0].startswith(
        "epl.split: variable ffn/in_weights (shape [4, 8, 16]) is created under epl.split "), whole
    assert "stays whole, not split over the 2 devices: it is used outside the split scope, by " \
           "ffn/einsum/Einsum (type Einsum)" in whole[0]
