"""Split rules for softmax (epl/passes/split/split.py describes the pass).

Softmax / LogSoftmax over rows split along another axis (attention scores split
by heads), and SparseSoftmaxCrossEntropyWithLogits / SoftmaxCrossEntropyWithLogits
over vocabulary-split logits: distributed max and sum of exponentials and the
label logit from the shard that owns it; the logits are never gathered.
"""
from __future__ import annotations

import tensorflow as tf

from epl.passes.split.layouts import Full, Sharded, is_full
from epl.passes.split.rewriter import Rewriter, clone_on_slots
from epl.passes.split.rules import KEEP, rule


@rule("Softmax", "LogSoftmax")
def _softmax(rw: Rewriter, op, layouts):
    """Softmax over the last axis of a tensor split along another axis (attention
    scores split by heads): each device normalizes its own rows."""
    (layout,) = layouts
    if isinstance(layout, Sharded) and layout.axis != op.inputs[0].shape.rank - 1:
        parts = clone_on_slots(rw, op, lambda j: [layout.parts[j]])
        return [Sharded(parts, layout.axis, layout.sizes)]
    return KEEP if is_full(layout) else None


def _softmax_parts(rw: Rewriter, op, logits: Sharded):
    """Per-slot exp-sums, the global max, with the logits never gathered."""
    maxes = []
    for j in range(rw.k):
        with rw.on(j):
            maxes.append(tf.reduce_max(logits.parts[j], axis=-1))
    top = rw.max_slots(maxes, op.name)                                  # all-reduce (max)
    sums = []
    for j in range(rw.k):
        with rw.on(j):
            sums.append(tf.reduce_sum(tf.exp(logits.parts[j] - top[..., None]), axis=-1))
    total = rw.sum_slots(sums, op.name)                                 # all-reduce (sum)
    with rw.gathering(op.name):
        return tf.math.log(total) + top


@rule("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_softmax_ce(rw: Rewriter, op, layouts):
    """loss = log(sum_j sum exp(logits_j - max)) + max - logit[label], per example."""
    logits, labels = op.inputs
    ll, lab = layouts
    if not isinstance(ll, Sharded) or ll.axis != logits.shape.rank - 1 or not is_full(lab) \
            or op.outputs[1].consumers():
        return None
    labels_value = rw.value(lab, labels)
    log_sum = _softmax_parts(rw, op, ll)
    picked = []
    offsets = rw.offsets(list(ll.sizes), int(logits.shape[-1]))
    for j in range(rw.k):
        with rw.on(j):
            local = tf.cast(labels_value, tf.int64) - offsets[j]
            onehot = tf.one_hot(local, ll.sizes[j], dtype=ll.parts[j].dtype)  # 0 where not owned
            picked.append(tf.reduce_sum(onehot * ll.parts[j], axis=-1))
    label_logit = rw.sum_slots(picked, op.name)
    with rw.gathering(op.name):
        loss = log_sum - label_logit
    return [Full(loss), None]


@rule("SoftmaxCrossEntropyWithLogits")
def _softmax_ce(rw: Rewriter, op, layouts):
    """Dense labels: loss = sum_v y_v * (log_sum - logit_v), summed over the shards."""
    logits, labels = op.inputs
    ll, lab = layouts
    if not isinstance(ll, Sharded) or ll.axis != logits.shape.rank - 1 or op.outputs[1].consumers():
        return None
    sl = lab if isinstance(lab, Sharded) and lab.axis == ll.axis and lab.sizes == ll.sizes \
        else (rw.slice(rw.value(lab, labels), ll.axis, ll.sizes, sum(ll.sizes),
                       f"{op.name} ({op.type})") if is_full(lab) else None)
    if sl is None:
        return None
    log_sum = _softmax_parts(rw, op, ll)
    label_mass, label_logit = [], []
    for j in range(rw.k):
        with rw.on(j):
            label_mass.append(tf.reduce_sum(sl.parts[j], axis=-1))
            label_logit.append(tf.reduce_sum(sl.parts[j] * ll.parts[j], axis=-1))
    mass, picked = rw.sum_slots(label_mass, op.name), rw.sum_slots(label_logit, op.name)
    with rw.gathering(op.name):
        loss = log_sum * mass - picked
    return [Full(loss), None]
