"""Explicit layers for users who prefer them to plain TensorFlow ops.

Each layer is ordinary tf.compat.v1 graph code (variables from
`tf.compat.v1.get_variable`, so variable scopes, reuse and checkpoints work as
usual) built only from op types the split pass has rules for
(epl/passes/split/, one module per family of rules). Outside `epl.split` they are plain layers; inside
`epl.split(k)` the split pass shards them:
- `dense`: the kernel column-split (output sharded) when the input is full, or
  row-split (partial sums, one all-reduce) when the input is the output of a
  column-split layer;
- `embedding`: the table split by vocabulary rows;
- `sparse_softmax_cross_entropy`: over vocabulary-split logits without
  gathering them;
- `moe`: a mixture-of-experts feed-forward layer (top-k gating, capacity,
  load-balancing loss). With `split_devices=k` its experts are created under
  `epl.split(k)`: each device holds E/k experts, and the tokens travel to
  their experts and back by all-to-all once the replicate pass connects the
  data-parallel replicas to them.
"""
from __future__ import annotations

import contextlib
import math

import tensorflow as tf
from epl.env import is_initialized
from epl.strategies import split


def dense(x: tf.Tensor, units: int, activation=None, use_bias: bool = True,
          kernel_initializer=None, name: str = "dense") -> tf.Tensor:
    """x @ kernel (+ bias), then `activation`; x of rank >= 2 (last axis contracted)."""
    x = tf.convert_to_tensor(x)
    with tf.compat.v1.variable_scope(None, default_name=name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [int(x.shape[-1]), units], dtype=x.dtype,
            initializer=kernel_initializer or tf.compat.v1.glorot_uniform_initializer())
        if x.shape.rank == 2:
            y = tf.matmul(x, kernel)
        else:
            flat = tf.reshape(x, [-1, int(x.shape[-1])])
            inner = x.shape.as_list()[1:-1]
            if all(d is not None for d in inner):   # -1 for the batch: no batch size baked in
                y = tf.reshape(tf.matmul(flat, kernel), [-1] + inner + [units])
            else:
                y = tf.reshape(tf.matmul(flat, kernel),
                               tf.concat([tf.shape(x)[:-1], [units]], axis=0))
        if use_bias:
            bias = tf.compat.v1.get_variable("bias", [units], dtype=x.dtype,
                                             initializer=tf.compat.v1.zeros_initializer())
            y = y + bias
        return activation(y) if activation is not None else y


def embedding(ids: tf.Tensor, vocab_size: int, dim: int, initializer=None,
              name: str = "embedding") -> tf.Tensor:
    """Rows of a [vocab_size, dim] table for `ids` (any shape); returns ids.shape + [dim]."""
    with tf.compat.v1.variable_scope(None, default_name=name):
        table = tf.compat.v1.get_variable(
            "table", [vocab_size, dim],
            initializer=initializer or tf.compat.v1.random_normal_initializer(stddev=dim ** -0.5))
        return tf.nn.embedding_lookup(table, ids)


def sparse_softmax_cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean over examples of the softmax cross-entropy of integer `labels`."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))


def _top_k_routing(probs: tf.Tensor, k: int, capacity: int):
    """GShard routing within each example: dispatch and combine tensors [B, S, E, C].

    The i-th choice of every token goes to its i-th most likely expert while
    that expert has room (tokens in sequence order, first choices before
    second ones); the combine weights are the chosen gates renormalized over
    the k choices. Returns (dispatch, combine, first-choice mask [B, S, E]).
    """
    experts = int(probs.shape[-1])
    remaining = probs
    masks, gates = [], []
    for _ in range(k):
        choice = tf.argmax(remaining, axis=-1)
        mask = tf.one_hot(choice, experts, dtype=probs.dtype)
        masks.append(mask)
        gates.append(tf.reduce_sum(probs * mask, axis=-1))
        remaining = remaining * (1.0 - mask)
    denominator = tf.add_n(gates) + 1e-9
    dispatch, combine = 0.0, 0.0
    used = tf.zeros_like(probs[:, :1, :])   # slots taken by earlier choices, per expert
    for mask, gate in zip(masks, gates):
        position = tf.cumsum(mask, axis=1, exclusive=True) + used   # [B, S, E]
        used = used + tf.reduce_sum(mask, axis=1, keepdims=True)
        keep = mask * tf.cast(position < capacity, probs.dtype)
        slot = tf.one_hot(tf.cast(tf.reduce_sum(position * keep, axis=-1), tf.int32), capacity,
                          dtype=probs.dtype)                       # [B, S, C]
        routed = keep[..., None] * slot[:, :, None, :]             # [B, S, E, C]
        dispatch = dispatch + routed
        combine = combine + (gate / denominator)[..., None, None] * routed
    return dispatch, combine, masks[0]


def moe(x: tf.Tensor, num_experts: int, hidden: int, k: int = 2, capacity_factor: float = 1.25,
        activation=tf.nn.relu, split_devices: int | None = None, name: str = "moe"):
    """Mixture-of-experts feed-forward layer over x [B, S, d]; returns (y, aux_loss).

    Each example is one routing group (capacity = ceil(k x S / E x
    capacity_factor) tokens per expert and example), so the result does not
    depend on how the batch is cut over replicas. aux_loss is the
    load-balancing loss of Switch/GShard, E x sum_e (fraction of tokens whose
    first choice is e) x (mean gate of e), averaged over examples; add it to
    the loss with a small weight. split_devices: create the experts under
    epl.split(split_devices) (the number of experts must be divisible by it).
    """
    x = tf.convert_to_tensor(x)
    seq, dim = int(x.shape[1]), int(x.shape[2])
    capacity = max(1, int(math.ceil(k * seq / num_experts * capacity_factor)))
    with tf.compat.v1.variable_scope(None, default_name=name):
        gate_kernel = tf.compat.v1.get_variable(
            "gate", [dim, num_experts], initializer=tf.compat.v1.glorot_uniform_initializer())
        logits = tf.reshape(tf.matmul(tf.reshape(x, [-1, dim]), gate_kernel),
                            [-1, seq, num_experts])
        probs = tf.nn.softmax(logits, axis=-1)
        dispatch, combine, first = _top_k_routing(probs, k, capacity)
        expert_in = tf.einsum("bsec,bsd->becd", dispatch, x)              # [B, E, C, d]
        scope = split(split_devices, name=f"{tf.compat.v1.get_variable_scope().name}_experts") \
            if split_devices and is_initialized() else contextlib.nullcontext()
        with scope:
            w_in = tf.compat.v1.get_variable(
                "experts_in", [num_experts, dim, hidden],
                initializer=tf.compat.v1.glorot_uniform_initializer())
            b_in = tf.compat.v1.get_variable("experts_in_bias", [num_experts, 1, hidden],
                                             initializer=tf.compat.v1.zeros_initializer())
            w_out = tf.compat.v1.get_variable(
                "experts_out", [num_experts, hidden, dim],
                initializer=tf.compat.v1.glorot_uniform_initializer())
            b_out = tf.compat.v1.get_variable("experts_out_bias", [num_experts, 1, dim],
                                              initializer=tf.compat.v1.zeros_initializer())
            h = activation(tf.matmul(expert_in, w_in) + b_in)              # [B, E, C, hidden]
            expert_out = tf.matmul(h, w_out) + b_out                       # [B, E, C, d]
        y = tf.einsum("becd,bsec->bsd", expert_out, combine)
        fraction = tf.reduce_mean(first, axis=1)                           # [B, E]
        mean_gate = tf.reduce_mean(probs, axis=1)                          # [B, E]
        aux = tf.reduce_mean(num_experts * tf.reduce_sum(fraction * mean_gate, axis=-1))
        return y, aux
