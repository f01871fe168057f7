"""Split rules for ops that keep their input's layout (epl/passes/split/split.py
describes the pass).

Unary and binary elementwise ops (`UNARY`, `BINARY`; sums of partial sums for
`LINEAR_BINARY`), BiasAdd (the bias split along with the tensor it is added
to), a Reshape that keeps the sharded last axis whole, and L2Loss of a split
tensor or weight (weight decay: partial sums of squares).
"""
from __future__ import annotations

import tensorflow as tf

from epl.passes.split.layouts import Partial, Pending, Sharded, is_full
from epl.passes.split.rewriter import Rewriter, as_sharded, clone_on_slots
from epl.passes.split.rules import KEEP, rule

UNARY = ("Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Log", "Neg", "Square",
         "Sqrt", "Rsqrt", "Abs", "Softplus", "Erf", "Identity", "Cast", "LeakyRelu", "StopGradient",
         "Reciprocal", "Sin", "Cos")
BINARY = ("Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "Maximum", "Minimum", "SquaredDifference",
          "Pow", "DivNoNan")
LINEAR_BINARY = ("Add", "AddV2", "Sub")


@rule(*UNARY)
def _unary(rw: Rewriter, op, layouts):
    (layout,) = layouts[:1]
    if isinstance(layout, Sharded) and len(op.inputs) == 1:
        parts = clone_on_slots(rw, op, lambda j: [layout.parts[j]])
        return [Sharded(parts, layout.axis, layout.sizes)]
    if isinstance(layout, Partial) and op.type in ("Identity", "Neg") and len(op.inputs) == 1:
        return [Partial(clone_on_slots(rw, op, lambda j: [layout.parts[j]]))]
    if isinstance(layout, Pending) or layout is None:
        return KEEP
    return None


def _operand_for(rw, layout, tensor, out_axis, out_rank, sizes, full):
    """Slot parts of one operand of a broadcasting op whose output is sharded on out_axis
    (`full` entries in all, `sizes` of them on this worker's slots)."""
    if isinstance(layout, Sharded):
        axis = out_axis - (out_rank - tensor.shape.rank)
        return layout.parts if layout.axis == axis and layout.sizes == sizes else None
    if isinstance(layout, Partial) or tensor.shape.rank is None:
        return None
    axis = out_axis - (out_rank - tensor.shape.rank)
    if axis < 0 or tensor.shape[axis] == 1:                 # broadcast along the split axis
        value = rw.value(layout, tensor)
        return [value] * rw.k
    if tensor.shape[axis] != full:
        return None
    if isinstance(layout, Pending):
        return as_sharded(rw, layout, tensor, axis, sizes).parts
    return rw.slice(rw.value(layout, tensor), axis, sizes).parts


@rule(*BINARY)
def _binary(rw: Rewriter, op, layouts):
    x, y = op.inputs
    lx, ly = layouts
    if isinstance(lx, Partial) and isinstance(ly, Partial) and op.type in LINEAR_BINARY:
        return [Partial(clone_on_slots(rw, op, lambda j: [lx.parts[j], ly.parts[j]]))]
    sharded = next((l for l, t in ((lx, x), (ly, y)) if isinstance(l, Sharded)), None)
    if sharded is None:
        return KEEP if all(is_full(l) for l in layouts) else None
    out_rank = op.outputs[0].shape.rank
    source = x if sharded is lx else y
    if out_rank is None or source.shape.rank is None:
        return None
    out_axis = sharded.axis + (out_rank - source.shape.rank)
    full = source.shape[sharded.axis]
    if full is None:
        return None
    px = _operand_for(rw, lx, x, out_axis, out_rank, sharded.sizes, full)
    py = _operand_for(rw, ly, y, out_axis, out_rank, sharded.sizes, full)
    if px is None or py is None:
        return None
    return [Sharded(clone_on_slots(rw, op, lambda j: [px[j], py[j]]), out_axis, sharded.sizes)]


@rule("L2Loss")
def _l2_loss(rw: Rewriter, op, layouts):
    """tf.nn.l2_loss (weight decay) of a split tensor or a sharded variable: each
    device's share of the sum of squares, a partial sum (no gather)."""
    (layout,) = layouts
    if isinstance(layout, Pending) and layout.variable.op in rw.sharded:
        layout = rw.shard_variable(layout, rw.sharded[layout.variable.op].axis)
    if isinstance(layout, Sharded):
        return [Partial(clone_on_slots(rw, op, lambda j: [layout.parts[j]]))]
    return KEEP if is_full(layout) else None


@rule("BiasAdd")
def _bias_add(rw: Rewriter, op, layouts):
    x, bias = op.inputs
    lx, lb = layouts
    if op.get_attr("data_format") not in (b"NHWC", "NHWC") or not isinstance(lx, Sharded):
        return KEEP if all(is_full(l) for l in layouts) else None
    last = x.shape.rank - 1 if x.shape.rank is not None else None
    if lx.axis == last:
        sb = as_sharded(rw, lb, bias, 0, lx.sizes) if isinstance(lb, (Pending, Sharded)) else \
            rw.slice(rw.value(lb, bias), 0, lx.sizes, sum(lx.sizes), f"{op.name} ({op.type})")
        if sb is None:
            return None
        parts = [sb.parts[j] for j in range(rw.k)]
    else:
        value = rw.value(lb, bias)
        parts = [value] * rw.k
    return [Sharded(clone_on_slots(rw, op, lambda j: [lx.parts[j], parts[j]]), lx.axis, lx.sizes)]


@rule("Reshape")
def _reshape(rw: Rewriter, op, layouts):
    """A reshape that keeps the sharded last axis whole (e.g. [N, V] -> [B, S, V])."""
    x = op.inputs[0]
    lx = layouts[0]
    if not isinstance(lx, Sharded):
        return KEEP if all(is_full(l) for l in layouts) else None
    out_shape = op.outputs[0].shape
    if out_shape.rank is None or x.shape.rank is None or lx.axis != x.shape.rank - 1 \
            or out_shape[-1] != x.shape[-1]:
        return None
    lead = [-1 if d is None else int(d) for d in out_shape.as_list()[:-1]]
    if lead.count(-1) > 1:
        return None
    parts = []
    for j in range(rw.k):
        with rw.on(j):
            parts.append(tf.reshape(lx.parts[j], lead + [lx.sizes[j]]))
    return [Sharded(parts, out_shape.rank - 1, lx.sizes)]
