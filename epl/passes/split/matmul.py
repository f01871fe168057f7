"""Split rules for matrix products (epl/passes/split/split.py describes the pass).

MatMul: a column-split weight (input full, output sharded on its last axis) or
a row-split weight (input sharded on the contracted axis, output partial sums).
BatchMatMulV2/V3 with an [experts, m, n] weight: the weight split along its
expert axis, the input sliced along the same experts (the dispatch; cut into
chunks when split.moe_chunks > 1), the output sharded by expert.
"""
from __future__ import annotations

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.passes.split.layouts import Partial, Pending, Sharded, is_full
from epl.passes.split.rewriter import Rewriter, as_sharded, static_dim
from epl.passes.split.rules import KEEP, rule


@rule("MatMul")
def _matmul(rw: Rewriter, op, layouts):
    a, b = op.inputs
    la, lb = layouts
    ta, tb = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    a_contract, a_rows = (0, 1) if ta else (1, 0)
    b_contract, b_out = (1, 0) if tb else (0, 1)

    def build(pa, pb, layout_of):
        parts = []
        for j in range(rw.k):
            with rw.on(j):
                parts.append(tf.linalg.matmul(pa(j), pb(j), transpose_a=ta, transpose_b=tb))
        return [layout_of(parts)]

    if isinstance(la, Sharded) and la.axis == a_contract:       # row-split weight: partial sums
        sb = as_sharded(rw, lb, b, b_contract, la.sizes)
        if sb is not None:
            return build(lambda j: la.parts[j], lambda j: sb.parts[j], Partial)
        return None
    if isinstance(la, Pending) and not isinstance(lb, (Sharded, Pending)):
        return KEEP if lb is None else None
    if is_full(la) and not isinstance(la, Pending):            # column-split weight
        if isinstance(lb, Partial):
            return None
        sb = as_sharded(rw, lb, b, b_out)
        if sb is None:
            return KEEP if is_full(lb) else None
        a_value = rw.value(la, a)
        return build(lambda j: a_value, lambda j: sb.parts[j],
                     lambda parts: Sharded(parts, 1, sb.sizes))
    if isinstance(la, Sharded) and la.axis == a_rows and is_full(lb):   # row-sharded input
        b_value = rw.value(lb, b)
        return build(lambda j: la.parts[j], lambda j: b_value,
                     lambda parts: Sharded(parts, 0, la.sizes))
    if isinstance(la, Partial) and is_full(lb):
        b_value = rw.value(lb, b)
        return build(lambda j: la.parts[j], lambda j: b_value, Partial)
    return None


@rule("BatchMatMulV2", "BatchMatMulV3")
def _expert_matmul(rw: Rewriter, op, layouts):
    """Experts: an [E, m, n] weight split along E; the input's matching axis follows it."""
    a, b = op.inputs
    la, lb = layouts
    if b.shape.rank != 3 or a.shape.rank is None or a.shape.rank < 3:
        return None
    a_axis = a.shape.rank - 3
    experts = static_dim(b, 0)
    if experts is None or static_dim(a, a_axis) not in (experts, None):
        return None
    weight = lb.variable.op.name if isinstance(lb, Pending) else b.op.name
    what = (f"expert count {experts} (axis 0 of {weight}, shape {b.shape.as_list()}, read by "
            f"{op.name})")
    if isinstance(la, Sharded):
        if la.axis != a_axis:
            return None
        sb = as_sharded(rw, lb, b, 0, la.sizes)
        sa = la
    else:
        if isinstance(la, Partial):
            return None
        if isinstance(lb, Pending) and experts % rw.k:
            raise ParallelizeError(
                f"the {what} is not divisible by the split degree {rw.k}: every device must "
                f"hold whole experts. Use a number of experts divisible by {rw.k}, or "
                f"epl.split(device_count=d) with d dividing {experts}.")
        sb = as_sharded(rw, lb, b, 0, None, what, must_divide=True)
        if sb is None:
            return KEEP if is_full(lb) else None
        if rw.moe_chunks > 1:      # the chunked dispatch: one slice and matmul per chunk
            return _chunked_expert_matmul(rw, op, rw.value(la, a), a_axis, sb)
        sa = rw.slice(rw.value(la, a), a_axis, sb.sizes, experts, f"{op.name} ({op.type})")
    if sb is None:
        return None
    adj_x, adj_y = op.get_attr("adj_x"), op.get_attr("adj_y")
    parts = []
    for j in range(rw.k):
        with rw.on(j):
            parts.append(tf.linalg.matmul(sa.parts[j], sb.parts[j], adjoint_a=adj_x,
                                          adjoint_b=adj_y))
    return [Sharded(parts, op.outputs[0].shape.rank - 3, sb.sizes)]


def _chunked_expert_matmul(rw: Rewriter, op, tokens, a_axis: int, sb: Sharded):
    """The expert matmul on a dispatch cut into `rw.moe_chunks` chunks along the
    tokens' rows (axis m of [.., E, m, d]; the last axis under adj_x): chunk c's
    slice and matmul on every slot, the chunks concatenated back per slot."""
    adj_x, adj_y = op.get_attr("adj_x"), op.get_attr("adj_y")
    rank = tokens.shape.rank
    chunk_axis = rank - 1 if adj_x else rank - 2
    chunks = rw.slice_chunks(tokens, a_axis, sb.sizes, chunk_axis, f"{op.name} ({op.type})",
                             static_dim(op.inputs[1], 0))
    results = []
    for chunk in chunks:
        parts = []
        for j in range(rw.k):
            with rw.on(j):
                parts.append(tf.linalg.matmul(chunk.parts[j], sb.parts[j], adjoint_a=adj_x,
                                              adjoint_b=adj_y))
        results.append(parts)
    out_rank = op.outputs[0].shape.rank
    return [Sharded(rw.concat_chunks(results, out_rank - 2), out_rank - 3, sb.sizes)]
