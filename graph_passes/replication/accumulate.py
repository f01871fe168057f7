"""Gradient accumulation over micro-batches (one replica's M micro-batch gradients -> one).

Used by the replicate pass when `pipeline.num_micro_batch` > 1.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR


def accumulate(per_micro: list[list], replica: int, scales: list | None = None
               ) -> tuple[list, dict]:
    """One gradient per variable from the gradients of every micro-batch.

    per_micro[m][i] is micro-batch m's gradient of variable i; scales[m] is
    micro-batch m's share of the replica's examples (default 1/M each). The
    result is the sum over m, in micro-batch order, of scales[m] x g_m: the
    gradient of the mean loss over the replica's examples. With equal shares
    (every static batch) it is computed as (1/M) x (g_0 + ... + g_{M-1}); with
    shares known only at run time (a dynamic batch dimension) each g_m is
    weighted before it is added. It is placed on the device of micro-batch 0's
    gradient, tagged with its TaskGraph, phase "backward" and the replica.

    The sum is a chain of adds, ((g0 + g1) + g2) + ..., not one AddN, and the
    add of g_m is tagged as micro-batch m's work (`_epl_micro_batch` = m; the
    final scaling is micro-batch M - 1's): the schedule pass puts it into that
    micro-batch's backward step, so g_m is freed as soon as it is added and the
    accumulator costs one gradient's memory whatever M is. (The step's control
    edges also keep Grappler from merging the chain back into one AddN, which
    would keep every micro-batch's gradient alive until the last one.) Sparse
    gradients (tf.IndexedSlices) are concatenated, with scaled values, at the
    last micro-batch.

    Returns (gradients, {m: ops added for micro-batch m}).
    """
    micro = len(per_micro)
    if micro == 1:
        return per_micro[0], {}
    scales = list(scales) if scales is not None else [1.0 / micro] * micro
    equal = all(isinstance(x, float) for x in scales) and len(set(scales)) == 1
    scale = scales[0]
    accumulated, ops_of = [], {m: [] for m in range(micro)}
    for parts in zip(*per_micro):
        first = parts[0]
        if first is None:
            accumulated.append(None)
            continue
        source = first.values.op if isinstance(first, tf.IndexedSlices) else first.op
        graph = source.graph

        def tagged(m, build):
            start = len(graph.get_operations())
            with tf.device(source.device), tf.name_scope("EPL_ACCUMULATE"):
                result = build()
            for new in graph.get_operations()[start:]:
                for name in (TASKGRAPH_ATTR, PHASE_ATTR):
                    if name in source.node_def.attr:
                        graph_mutation.set_attr(new, name, source.node_def.attr[name])
                graph_mutation.set_attr(new, REPLICA_ATTR, tf.compat.v1.AttrValue(i=replica))
                graph_mutation.set_attr(new, MICRO_BATCH_ATTR, tf.compat.v1.AttrValue(i=m))
                ops_of[m].append(new)
            return result

        if isinstance(first, tf.IndexedSlices):
            total = tagged(micro - 1, lambda: tf.IndexedSlices(
                tf.concat([p.values * tf.cast(x, first.dtype) for p, x in zip(parts, scales)],
                          axis=0),
                tf.concat([p.indices for p in parts], axis=0), first.dense_shape))
        elif equal:
            total = parts[0]
            for m in range(1, micro):
                total = tagged(m, lambda t=total, p=parts[m]: t + p)
            total = tagged(micro - 1, lambda t=total: t * tf.cast(scale, first.dtype))
        else:
            total = tagged(0, lambda: parts[0] * tf.cast(scales[0], first.dtype))
            for m in range(1, micro):
                total = tagged(m, lambda t=total, p=parts[m], x=scales[m]:
                               t + p * tf.cast(x, first.dtype))
        accumulated.append(total)
    return accumulated, ops_of
