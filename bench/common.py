"""Shared helpers for the benchmarks: timing, tables and two models in raw TF ops.

The models are written twice-usable: `*_params(spec, create_var)` creates the
variables through a factory (so the same model is built with
`tf.compat.v1.get_variable` in a graph, or with `tf.Variable` under a
`tf.distribute` strategy scope), and `*_loss(spec, params, inputs, labels)`
builds the forward pass and the mean loss from plain `tf.matmul` / `tf.nn`
ops. Reshapes use -1 for the batch dimension, so the same ops work on a
replica's slice of the batch.

`create_var(name, shape, kind)` must return a variable; kind is one of
"glorot" (weights), "normal" (embeddings, std 0.02), "zeros" or "ones".
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

CreateVar = Callable[[str, Sequence[int], str], tf.Variable]


# -- timing -------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    """The median of `values` (a non-empty sequence of numbers)."""
    return float(statistics.median(values))


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Run fn() once after a garbage collection; return (seconds, its result)."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: one header line, a rule, and one line per row."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3f}"
        return f"{value:.3g}"
    return str(value)


# -- variable factories ---------------------------------------------------------

def v1_variable(name: str, shape: Sequence[int], kind: str) -> tf.Variable:
    """A `tf.compat.v1.get_variable` factory (graph mode, inside the current scope)."""
    initializers = {
        "glorot": tf.compat.v1.glorot_uniform_initializer(),
        "normal": tf.compat.v1.random_normal_initializer(stddev=0.02),
        "zeros": tf.compat.v1.zeros_initializer(),
        "ones": tf.compat.v1.ones_initializer(),
    }
    return tf.compat.v1.get_variable(name, shape=list(shape), initializer=initializers[kind])


def v2_variable(name: str, shape: Sequence[int], kind: str) -> tf.Variable:
    """A `tf.Variable` factory (eager; use under a strategy scope to mirror it)."""
    shape = list(shape)
    if kind == "glorot":
        fan_in, fan_out = shape[-2] if len(shape) > 1 else shape[0], shape[-1]
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        value = tf.random.uniform(shape, -limit, limit)
    elif kind == "normal":
        value = tf.random.normal(shape, stddev=0.02)
    elif kind == "zeros":
        value = tf.zeros(shape)
    else:
        value = tf.ones(shape)
    return tf.Variable(value, name=name.replace("/", "_"))


# -- MLP -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """A ReLU MLP classifier: input_dim -> `layers` x width -> classes."""

    input_dim: int = 512
    width: int = 512
    layers: int = 4
    classes: int = 10


def mlp_params(spec: MLPSpec, create_var: CreateVar) -> dict:
    """Create the MLP's variables (name -> variable)."""
    params = {}
    fan_in = spec.input_dim
    for i in range(spec.layers):
        params[f"dense{i}/w"] = create_var(f"dense{i}/w", [fan_in, spec.width], "glorot")
        params[f"dense{i}/b"] = create_var(f"dense{i}/b", [spec.width], "zeros")
        fan_in = spec.width
    params["out/w"] = create_var("out/w", [fan_in, spec.classes], "glorot")
    params["out/b"] = create_var("out/b", [spec.classes], "zeros")
    return params


def mlp_loss(spec: MLPSpec, params: dict, inputs: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy of the MLP on inputs [B, input_dim], labels [B] int."""
    hidden = inputs
    for i in range(spec.layers):
        hidden = tf.nn.relu(tf.matmul(hidden, params[f"dense{i}/w"]) + params[f"dense{i}/b"])
    logits = tf.matmul(hidden, params["out/w"]) + params["out/b"]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def mlp_batch(spec: MLPSpec, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic batch: float32 inputs [batch, input_dim], int32 labels [batch]."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, spec.input_dim)).astype(np.float32),
            rng.integers(0, spec.classes, size=batch).astype(np.int32))


# -- transformer -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """A pre-norm transformer encoder classifier.

    vocab > 0: token ids [B, seq] through an embedding table (tf.gather);
    vocab == 0: float features [B, seq, input_dim] through a dense projection.
    """

    layers: int = 6
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    seq: int = 16
    vocab: int = 0
    input_dim: int = 32
    classes: int = 10


def transformer_params(spec: TransformerSpec, create_var: CreateVar) -> dict:
    """Create the transformer's variables (name -> variable)."""
    h = spec.hidden
    params = {}
    if spec.vocab:
        params["embed/table"] = create_var("embed/table", [spec.vocab, h], "normal")
    else:
        params["embed/w"] = create_var("embed/w", [spec.input_dim, h], "glorot")
        params["embed/b"] = create_var("embed/b", [h], "zeros")
    params["embed/pos"] = create_var("embed/pos", [spec.seq, h], "normal")
    shapes = {"ln1/g": ([h], "ones"), "ln1/b": ([h], "zeros"),
              "attn/qkv_w": ([h, 3 * h], "glorot"), "attn/qkv_b": ([3 * h], "zeros"),
              "attn/out_w": ([h, h], "glorot"), "attn/out_b": ([h], "zeros"),
              "ln2/g": ([h], "ones"), "ln2/b": ([h], "zeros"),
              "mlp/w1": ([h, spec.ffn], "glorot"), "mlp/b1": ([spec.ffn], "zeros"),
              "mlp/w2": ([spec.ffn, h], "glorot"), "mlp/b2": ([h], "zeros")}
    for layer in range(spec.layers):
        for name, (shape, kind) in shapes.items():
            full = f"layer{layer}/{name}"
            params[full] = create_var(full, shape, kind)
    params["final_ln/g"] = create_var("final_ln/g", [h], "ones")
    params["final_ln/b"] = create_var("final_ln/b", [h], "zeros")
    params["head/w"] = create_var("head/w", [h, spec.classes], "glorot")
    params["head/b"] = create_var("head/b", [spec.classes], "zeros")
    return params


def _layer_norm(x: tf.Tensor, gamma, beta, eps: float = 1e-5) -> tf.Tensor:
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + eps) * gamma + beta


def _attention(spec: TransformerSpec, p: dict, prefix: str, x2d: tf.Tensor) -> tf.Tensor:
    """Multi-head self-attention on x2d [B*seq, hidden]; returns [B*seq, hidden]."""
    h, heads, seq = spec.hidden, spec.heads, spec.seq
    head_dim = h // heads
    qkv = tf.matmul(x2d, p[f"{prefix}/attn/qkv_w"]) + p[f"{prefix}/attn/qkv_b"]
    qkv = tf.reshape(qkv, [-1, seq, 3, heads, head_dim])
    qkv = tf.transpose(qkv, [2, 0, 3, 1, 4])               # [3, B, heads, seq, head_dim]
    q, k, v = tf.unstack(qkv, num=3, axis=0)
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim))
    weights = tf.nn.softmax(scores, axis=-1)
    context = tf.matmul(weights, v)                        # [B, heads, seq, head_dim]
    context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, h])
    return tf.matmul(context, p[f"{prefix}/attn/out_w"]) + p[f"{prefix}/attn/out_b"]


def _mlp_block(p: dict, prefix: str, x2d: tf.Tensor) -> tf.Tensor:
    hidden = tf.nn.gelu(tf.matmul(x2d, p[f"{prefix}/mlp/w1"]) + p[f"{prefix}/mlp/b1"])
    return tf.matmul(hidden, p[f"{prefix}/mlp/w2"]) + p[f"{prefix}/mlp/b2"]


def transformer_loss(spec: TransformerSpec, params: dict, inputs: tf.Tensor,
                     labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy of the transformer.

    inputs: int ids [B, seq] (vocab > 0) or floats [B, seq, input_dim]; labels: int [B].
    """
    h, seq = spec.hidden, spec.seq
    if spec.vocab:
        x = tf.gather(params["embed/table"], inputs)         # [B, seq, h]
    else:
        flat = tf.reshape(inputs, [-1, spec.input_dim])
        x = tf.reshape(tf.matmul(flat, params["embed/w"]) + params["embed/b"], [-1, seq, h])
    x = tf.reshape(x + params["embed/pos"], [-1, h])        # [B*seq, h]
    for layer in range(spec.layers):
        prefix = f"layer{layer}"
        x = x + _attention(spec, params, prefix, _layer_norm(x, params[f"{prefix}/ln1/g"],
                                                            params[f"{prefix}/ln1/b"]))
        x = x + _mlp_block(params, prefix, _layer_norm(x, params[f"{prefix}/ln2/g"],
                                                       params[f"{prefix}/ln2/b"]))
    x = _layer_norm(x, params["final_ln/g"], params["final_ln/b"])
    pooled = tf.reduce_mean(tf.reshape(x, [-1, seq, h]), axis=1)
    logits = tf.matmul(pooled, params["head/w"]) + params["head/b"]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def transformer_batch(spec: TransformerSpec, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic batch: ids [batch, seq] int32 or features [batch, seq, input_dim] float32, labels."""
    rng = np.random.default_rng(seed)
    if spec.vocab:
        inputs = rng.integers(0, spec.vocab, size=(batch, spec.seq)).astype(np.int32)
    else:
        inputs = rng.standard_normal((batch, spec.seq, spec.input_dim)).astype(np.float32)
    return inputs, rng.integers(0, spec.classes, size=batch).astype(np.int32)


# -- one entry point for both models ---------------------------------------------

def model_fns(spec) -> tuple[Callable, Callable, Callable]:
    """(params_fn, loss_fn, batch_fn) for an MLPSpec or a TransformerSpec."""
    if isinstance(spec, MLPSpec):
        return mlp_params, mlp_loss, mlp_batch
    if isinstance(spec, TransformerSpec):
        return transformer_params, transformer_loss, transformer_batch
    raise TypeError(f"unknown model spec {spec!r}")


def input_placeholders(spec, batch: int | None) -> tuple[tf.Tensor, tf.Tensor]:
    """Graph-mode placeholders (inputs, labels) for `spec` with batch dimension `batch`."""
    if isinstance(spec, MLPSpec):
        x = tf.compat.v1.placeholder(tf.float32, [batch, spec.input_dim], name="inputs")
    elif spec.vocab:
        x = tf.compat.v1.placeholder(tf.int32, [batch, spec.seq], name="inputs")
    else:
        x = tf.compat.v1.placeholder(tf.float32, [batch, spec.seq, spec.input_dim], name="inputs")
    return x, tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
