"""Gradient checkpointing: gradients that keep only chosen forward tensors.

`checkpointed_gradients(ys, xs, checkpoints)` has the contract of
`tf.compat.v1.gradients` (a Tensor, an IndexedSlices or None per x), but the
backward pass reads only the checkpoint tensors of the forward pass (plus the
last segment, see below); everything else it needs is recomputed, one segment
at a time, just before it is needed (Chen et al. 2016, "Training deep nets
with sublinear memory cost"; OpenAI's gradient-checkpointing).

How:
- The forward ops are the ops between xs and ys (descendants of an x and
  ancestors of a y, through data edges). Checkpoints are per op: a
  checkpoint tensor makes every output of its op a checkpoint (TensorFlow
  stops gradients per op).
- A checkpoint's segment is the forward ops it is computed from, back to the
  previous checkpoints. Segments are processed from the loss backwards, by
  topological level of the checkpoints (checkpoints of one level are
  independent and share one recompute).
- The last segment (from the last checkpoints to ys) is differentiated on the
  original ops: its activations are live at the end of the forward pass
  anyway, so recomputing it would only cost time.
- Every other segment is copied (epl.ir.clone.clone_ops; copies carry the
  attribute RECOMPUTE_ATTR), the copies that read no other copy get control
  edges on the incoming gradient of the segment's checkpoints (so they run in
  the backward pass, not early), and tf.compat.v1.gradients runs on the copy
  with grad_ys = that incoming gradient and stop_gradients = the checkpoints.
  Partial gradients of each x (and of each checkpoint) are summed the way
  tf.compat.v1.gradients sums them (add_n; concatenation for IndexedSlices).
- Gradient functions often read only the shape of a tensor (Shape, Size,
  Rank, ShapeN, ZerosLike when the batch dimension is unknown). For a
  recomputed tensor those read a Shape op on the original tensor instead
  (attribute RECOMPUTE_SHAPE_ATTR; it runs in the forward pass and keeps an int
  vector), so no copy is computed only for its shape.

Ops that are never recomputed (their outputs are read from the forward pass):
- Variable reads: any op with a resource or ref input (ReadVariableOp, a ref
  variable's Identity, ResourceGather). A dense read aliases the variable's
  buffer (no memory); a gather's output stays live. Not recomputing them also
  means a recomputed read can never see a value the optimizer already updated.
- Stateful ops (random ops such as dropout masks, anything op_def.is_stateful):
  their outputs are kept like automatic checkpoints, so a recomputed segment
  uses the very values the forward pass drew. If such an op has a gradient,
  its forward inputs become checkpoints too.
Forward ops that do not depend on xs (input pipeline, masks, shapes of inputs)
are not recomputed either: tf.compat.v1.gradients would not recompute them.

TF1 control flow (Switch/Merge/Enter/Exit frames) between xs and ys is
refused with ParallelizeError; functional control flow (If/While) is copied.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from epl.errors import ParallelizeError
from epl.ir import graph_view
from epl.ir import graph_mutation
from epl.ir.annotations import RECOMPUTE_ATTR, RECOMPUTE_SHAPE_ATTR
from epl.ir.clone import clone_ops

CHECKPOINTS_COLLECTION = "checkpoints"
TF1_CONTROL_FLOW = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter",
                              "Exit", "RefExit", "NextIteration", "RefNextIteration",
                              "LoopCond"})

_EMPTY_COLLECTION = ("gradient_checkpoint.type is 'collection' but the 'checkpoints' collection "
                     "is empty: add tensors with tf.compat.v1.add_to_collection('checkpoints', t) "
                     "or use type 'auto'")


# ---------------------------------------------------------------------------
# Graph analysis
# ---------------------------------------------------------------------------

def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _to_tensor(x) -> tf.Tensor:
    """A variable's handle (resource) or ref tensor, like tf.compat.v1.gradients."""
    if isinstance(x, tf.Variable):
        return x.op.outputs[0]
    if isinstance(x, tf.Tensor):
        return x
    raise TypeError(f"expected a tf.Tensor or tf.Variable, got {x!r}")


def _reads_variable(op: tf.Operation) -> bool:
    return any(t.dtype.base_dtype == tf.resource or t.dtype._is_ref_dtype for t in op.inputs)


def _is_stateful(op: tf.Operation) -> bool:
    try:
        return bool(op.op_def.is_stateful)
    except Exception:  # pragma: no cover - ops without an OpDef
        return False


def _has_gradient(op: tf.Operation) -> bool:
    try:
        return tf_ops.get_gradient_function(op) is not None
    except LookupError:
        return False


def _trainable_dtype(t: tf.Tensor) -> bool:
    dtype = t.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex


def _nbytes(t: tf.Tensor, unknown_dim: int) -> int:
    shape = t.shape
    if shape.rank is None:
        n = unknown_dim
    else:
        n = 1
        for d in shape.as_list():
            n *= unknown_dim if d is None else d
    size = t.dtype.base_dtype.size if t.dtype.base_dtype != tf.resource else 0
    return int(n * max(size, 1))


class _Forward:
    """The ops between xs and ys, classified, in a topological order."""

    def __init__(self, ys: list, xs: list):
        self.ys, self.xs = ys, xs
        upstream = graph_view.ancestors([y.op for y in ys], include_control=False)
        downstream = graph_view.descendants(xs)
        self.ops: set = upstream & downstream
        bad = sorted(op.name for op in self.ops if op.type in TF1_CONTROL_FLOW)
        if bad:
            raise ParallelizeError(
                "gradient checkpointing cannot recompute TF1 control flow (tf.compat.v1 "
                f"while_loop/cond frames) between the variables and the loss: {bad[:5]}; "
                "use control flow v2 (tf.compat.v1.enable_control_flow_v2()) or turn "
                "gradient_checkpoint.type off")
        self.variable_reads = {op for op in self.ops if _reads_variable(op)}
        self.kept = self.variable_reads | {op for op in self.ops if _is_stateful(op)}
        self.order = self._toposort()
        self.position = {op: i for i, op in enumerate(self.order)}

    def _toposort(self) -> list:
        indegree = {op: 0 for op in self.ops}
        for op in self.ops:
            for t in op.inputs:
                if t.op in self.ops:
                    indegree[op] += 1
        heap = [(op._id, op) for op, n in indegree.items() if n == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, op = heapq.heappop(heap)
            order.append(op)
            for out in op.outputs:
                for consumer in out.consumers():
                    if consumer in indegree:
                        indegree[consumer] -= 1
                        if indegree[consumer] == 0:
                            heapq.heappush(heap, (consumer._id, consumer))
        return order

    def recomputable(self, op: tf.Operation) -> bool:
        return op in self.ops and op not in self.kept

    def is_on_path(self, t: tf.Tensor) -> bool:
        """True if gradients from ys to xs flow through (or start at) tensor t."""
        return t.op in self.ops or any(t is x for x in self.xs)


def _off_path_error(tensors: Sequence[tf.Tensor], ys: list, source: str) -> ParallelizeError:
    names = ", ".join(f"'{t.name}'" for t in tensors)
    loss = ", ".join(f"'{y.name}'" for y in ys)
    return ParallelizeError(
        f"checkpoint tensor(s) {names} {source} not on the path from the trainable variables "
        f"to the loss {loss} (no gradient flows through them), so they cannot be "
        "checkpoints: remove them from the 'checkpoints' collection or checkpoint tensors "
        "computed from the variables that the loss is computed from")


# ---------------------------------------------------------------------------
# Checkpoint selection
# ---------------------------------------------------------------------------

def select_checkpoints_collection(graph: tf.Graph, ys=None, xs=None) -> list:
    """The tensors of the graph's 'checkpoints' collection (creation order kept).

    Raises ParallelizeError when the collection is empty, when it holds
    something that is not a tensor of `graph`, and (when ys is given) when a
    tensor is not on the path from xs (default: the graph's trainable
    variables) to ys; the error names the tensors.
    """
    items = graph.get_collection(CHECKPOINTS_COLLECTION)
    if not items:
        raise ParallelizeError(_EMPTY_COLLECTION)
    tensors = []
    for item in items:
        if (isinstance(item, tf.Variable) or not isinstance(item, tf.Tensor)
                or item.graph is not graph):
            raise ParallelizeError(
                f"the 'checkpoints' collection holds {item!r}, which is not a tensor of this "
                "graph: add forward tensors (e.g. a layer's output) with "
                "tf.compat.v1.add_to_collection('checkpoints', t)")
        if item not in tensors:
            tensors.append(item)
    if ys is not None:
        ys = [_to_tensor(y) for y in _as_list(ys)]
        if xs is None:
            xs = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
        fwd = _Forward(ys, [_to_tensor(x) for x in _as_list(xs)])
        off = [t for t in tensors if not fwd.is_on_path(t)]
        if off:
            raise _off_path_error(off, ys, "in the 'checkpoints' collection are")
    return tensors


def select_checkpoints_auto(ys, xs, num_checkpoints: int | None = None,
                            unknown_dim: int = 32,
                            candidate_filter: Callable[[tf.Operation], bool] | None = None
                            ) -> list:
    """Choose checkpoints from the graph's structure (op types, shapes, edges only).

    Candidates are bottleneck ops: forward ops v (recomputable, float outputs,
    not a y) such that every consumer of every ancestor of v is itself an
    ancestor of v or v, i.e. v's outputs are the only tensors through which
    everything computed before v reaches the rest of the graph (the outputs
    of the layers of an MLP, the residual stream between transformer blocks).
    They are found in one topological sweep with ancestor bitsets.

    Of the candidates, k are chosen, spaced by the cumulative activation bytes
    of their ancestors (memory-balanced segments): targets j * M / (k + 1) for
    j = 1..k, M the bytes of all recomputable forward outputs; k =
    num_checkpoints or round(sqrt(M / a)), a the median candidate's bytes
    (minimizing k * a + M / k). Unknown dimensions (the batch) count as
    `unknown_dim`. candidate_filter(op) -> bool restricts the candidates (e.g.
    to the TaskGraphs up to gradient_checkpoint.end_taskgraph).

    Returns the chosen tensors (all float outputs of each chosen op), in
    forward order; [] when the graph has no bottleneck.
    """
    ys = [_to_tensor(y) for y in _as_list(ys)]
    xs = [_to_tensor(x) for x in _as_list(xs)]
    fwd = _Forward(ys, xs)
    nodes = [op for op in fwd.order if op not in fwd.variable_reads]
    index = {op: i for i, op in enumerate(nodes)}
    weight = [sum(_nbytes(t, unknown_dim) for t in op.outputs) if fwd.recomputable(op) else 0
              for op in nodes]
    ancestors: list[int] = []
    consumer_union: list[int] = []   # consumers of every strict ancestor
    consumers_of: list[int] = []
    for op in nodes:
        mask = 0
        for out in op.outputs:
            for c in out.consumers():
                if c in index:
                    mask |= 1 << index[c]
        consumers_of.append(mask)
    y_ops = {y.op for y in ys}
    candidates = []
    for i, op in enumerate(nodes):
        anc = 1 << i
        reach = 0
        for t in op.inputs:
            p = index.get(t.op)
            if p is not None:
                anc |= ancestors[p]
                reach |= consumer_union[p] | consumers_of[p]
        ancestors.append(anc)
        consumer_union.append(reach)
        if (reach & ~anc) == 0 and fwd.recomputable(op) and op not in y_ops \
                and any(_trainable_dtype(t) for t in op.outputs) \
                and (candidate_filter is None or candidate_filter(op)):
            candidates.append(i)
    if not candidates:
        return []
    total = sum(weight)
    cumulative = {}
    for i in candidates:
        mask, acc = ancestors[i], 0
        while mask:
            low = mask & -mask
            acc += weight[low.bit_length() - 1]
            mask ^= low
        cumulative[i] = acc
    sizes = sorted(weight[i] for i in candidates)
    typical = max(sizes[len(sizes) // 2], 1)
    k = (num_checkpoints if num_checkpoints is not None
         else max(1, round(math.sqrt(total / typical))))
    k = max(0, min(k, len(candidates)))
    chosen: list[int] = []
    for j in range(1, k + 1):
        target = j * total / (k + 1)
        best = min((i for i in candidates if i not in chosen),
                   key=lambda i: (abs(cumulative[i] - target), weight[i]), default=None)
        if best is not None:
            chosen.append(best)
    chosen.sort(key=lambda i: cumulative[i])
    return [t for i in chosen for t in nodes[i].outputs if _trainable_dtype(t)]


# ---------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------

def _parts(grad) -> list:
    if grad is None:
        return []
    if isinstance(grad, tf.IndexedSlices):
        return [t for t in (grad.values, grad.indices, grad.dense_shape) if t is not None]
    return [grad]


def _aggregate(grads: list, colocate_op: tf.Operation | None, colocate: bool):
    """Sum partial gradients as tf.compat.v1.gradients does."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    context = (tf.compat.v1.colocate_with(colocate_op, ignore_existing=True)
               if colocate and colocate_op is not None else _null())
    with context:
        if all(isinstance(g, tf.IndexedSlices) for g in grads):
            index_dtype = (tf.int64 if any(g.indices.dtype == tf.int64 for g in grads)
                           else grads[0].indices.dtype)
            return tf.IndexedSlices(
                tf.concat([g.values for g in grads], axis=0),
                tf.concat([tf.cast(g.indices, index_dtype) for g in grads], axis=0),
                grads[0].dense_shape)
        return tf.math.add_n([tf.convert_to_tensor(g) for g in grads])


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


SHAPE_OPS = frozenset({"Shape", "Size", "Rank", "ShapeN"})


def _forward_shape(forward: tf.Tensor, out_type, device: str, cache: dict) -> tf.Tensor:
    """A Shape op on the original tensor `forward` (cached per tensor and type)."""
    key = (forward, out_type)
    if key not in cache:
        attrs = {"T": tf.compat.v1.AttrValue(type=forward.dtype.as_datatype_enum),
                 "out_type": tf.compat.v1.AttrValue(type=out_type.as_datatype_enum)}
        new = forward.graph._create_op_internal(
            "Shape", [forward], [out_type], name=f"{forward.op.name}/shape_for_backward",
            attrs={**attrs, RECOMPUTE_SHAPE_ATTR: tf.compat.v1.AttrValue(b=True)},
            compute_device=False)
        graph_mutation.set_device(new, device)
        cache[key] = new.outputs[0]
    return cache[key]


def _reroute(old: tf.Tensor, new: tf.Tensor) -> None:
    for consumer in list(old.consumers()):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                graph_mutation.update_input(consumer, i, new)


def _shapes_from_forward(new_ops: list, copies: dict, cache: dict) -> None:
    """Gradient functions read shapes of their op's inputs and outputs (Shape, Size,
    Rank, ShapeN, ZerosLike; with an unknown batch dimension). The shape of a
    recomputed tensor is the shape of its original: read it from a Shape op on the
    original (run in the forward pass, a tiny int vector), so that no copy runs
    only for its shape."""
    original = {new: old for old, new in copies.items()}
    for op in new_ops:
        if op.type not in SHAPE_OPS and op.type != "ZerosLike":
            continue
        for source, out in zip(op.inputs, op.outputs):
            old = original.get(source.op)
            if old is None or not out.consumers():
                continue
            if op.type == "ZerosLike" and not (out.dtype.is_floating or out.dtype.is_complex
                                               or out.dtype.is_integer):
                continue
            forward = old.outputs[source.value_index]
            with op.graph.as_default(), op.graph.name_scope(None):
                if op.type in ("Shape", "ShapeN"):
                    new = _forward_shape(forward, out.dtype, old.device, cache)
                elif op.type == "Size":
                    new = tf.reduce_prod(_forward_shape(forward, out.dtype, old.device, cache),
                                         name=f"{op.name}_from_forward")
                elif op.type == "Rank":
                    new = tf.size(_forward_shape(forward, tf.int32, old.device, cache),
                                  out_type=out.dtype, name=f"{op.name}_from_forward")
                else:   # ZerosLike
                    new = tf.zeros(_forward_shape(forward, tf.int32, old.device, cache),
                                   dtype=out.dtype, name=f"{op.name}_from_forward")
            if op.type not in ("Shape", "ShapeN"):
                graph_mutation.set_device(new.op, op.device)
            _reroute(out, new)


def _checkpoint_levels(parents: dict, position: dict) -> list[list]:
    """Topological levels of checkpoint ops; parents: op -> set of parent checkpoint ops."""
    level: dict = {}
    for op in sorted(parents, key=position.get):   # parents come first in a topological order
        level[op] = 1 + max((level[p] for p in parents[op]), default=-1)
    levels: dict = {}
    for op, lv in level.items():
        levels.setdefault(lv, []).append(op)
    return [sorted(levels[lv], key=position.get) for lv in sorted(levels)]


def checkpointed_gradients(ys, xs, checkpoints: Iterable[tf.Tensor], grad_ys=None,
                           colocate_gradients_with_ops: bool = True,
                           gate_gradients: bool = False, aggregation_method=None) -> list:
    """tf.compat.v1.gradients(ys, xs, grad_ys, ...) keeping only `checkpoints`.

    Returns one Tensor, IndexedSlices or None per x, with the values of
    tf.compat.v1.gradients. The backward pass reads from the forward pass only
    the checkpoints, the ops of the last segment (between the last checkpoints
    and ys), variable reads, stateful ops' outputs (random ops are kept as
    automatic checkpoints, never recomputed) and tensors that do not depend on
    xs; every other forward op it needs is recomputed (ops with attribute
    RECOMPUTE_ATTR), gated on the incoming gradient of its segment.

    checkpoints: forward tensors (e.g. from select_checkpoints_auto or
    select_checkpoints_collection). Every output of a checkpoint's op is kept.
    Tensors in xs or ys, and outputs of ops that are never recomputed, are
    ignored; a tensor that is not on the path from xs to ys raises
    ParallelizeError naming it. With no checkpoint left this is
    tf.compat.v1.gradients.
    """
    ys = [_to_tensor(y) for y in _as_list(ys)]
    xs = [_to_tensor(x) for x in _as_list(xs)]
    grad_ys = _as_list(grad_ys) or [None] * len(ys)
    if len(grad_ys) != len(ys):
        raise ValueError(f"grad_ys has {len(grad_ys)} entries for {len(ys)} ys")
    kwargs = dict(colocate_gradients_with_ops=colocate_gradients_with_ops,
                  gate_gradients=gate_gradients, aggregation_method=aggregation_method)
    checkpoints = [_to_tensor(c) for c in _as_list(list(checkpoints))]
    fwd = _Forward(ys, xs)
    off = [c for c in checkpoints if not fwd.is_on_path(c)]
    if off:
        raise _off_path_error(off, ys, "passed to checkpointed_gradients are")

    y_ops = {y.op for y in ys}
    x_ops = {x.op for x in xs}
    ckpt_ops = {c.op for c in checkpoints
                if fwd.recomputable(c.op) and c.op not in y_ops and c.op not in x_ops}
    for op in fwd.kept:   # a kept op with a gradient reads its forward inputs: keep them
        if _has_gradient(op):
            ckpt_ops.update(t.op for t in op.inputs
                            if fwd.recomputable(t.op) and t.op not in y_ops)
    if not ckpt_ops:
        return tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys, **kwargs)

    stop = [t for op in ckpt_ops for t in op.outputs]

    def walk(seeds: Iterable[tf.Operation]) -> tuple[list, list, list]:
        """Segment of `seeds`: its ops (back to other checkpoints), the checkpoints
        and the xs it reads. Chains of variable reads are followed to their xs."""
        seeds = set(seeds)
        seen, boundary, stack, read = set(), [], list(seeds), set()
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for t in op.inputs:
                read.add(t)
                if t.op not in fwd.ops:
                    continue
                if t.op in ckpt_ops and t.op not in seeds:
                    if _trainable_dtype(t) and t not in boundary:
                        boundary.append(t)
                elif op not in fwd.kept or t.op in fwd.kept:
                    stack.append(t.op)
        return sorted(seen, key=fwd.position.get), boundary, [x for x in xs if x in read]

    parents = {}
    for op in ckpt_ops:
        _, boundary, _ = walk([op])
        parents[op] = {t.op for t in boundary}
    levels = _checkpoint_levels(parents, fwd.position)

    partial: dict = {}        # tensor (checkpoint or x) -> list of partial gradients
    shape_cache: dict = {}

    def add_partials(targets: list, grads: list) -> None:
        for t, g in zip(targets, grads):
            if g is not None:
                partial.setdefault(t, []).append(g)

    graph = ys[0].graph
    with graph.as_default(), graph.name_scope("checkpointed_gradients"):
        # the last segment, on the original ops
        _, boundary, xs_read = walk(y_ops & fwd.ops)
        xs_read += [x for x in xs if any(x is y for y in ys) and x not in xs_read]
        grads = tf.compat.v1.gradients(ys, boundary + xs_read, grad_ys=grad_ys,
                                       stop_gradients=stop, **kwargs)
        add_partials(boundary + xs_read, grads)
        for number, group in enumerate(reversed(levels)):
            outputs = [t for op in group for t in op.outputs if _trainable_dtype(t)]
            incoming = [_aggregate(partial.get(t, []), t.op, colocate_gradients_with_ops)
                        for t in outputs]
            live = [(t, g) for t, g in zip(outputs, incoming) if g is not None]
            if not live:
                continue
            live = [(t, tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
                    for t, g in live]
            seg_ops, boundary, xs_read = walk(group)
            to_copy = [op for op in seg_ops if op not in fwd.kept]
            copies = clone_ops(to_copy, f"recompute_{number}", lambda op: op.device,
                               extra_attrs={RECOMPUTE_ATTR: tf.compat.v1.AttrValue(b=True)})
            copied = set(copies.values())
            gate = [p.op for _, g in live for p in _parts(g)]
            for new in copied:
                if not any(t.op in copied for t in new.inputs):
                    graph_mutation.add_control_inputs(new, gate)
            seg_ys = [copies[t.op].outputs[t.value_index] for t, _ in live]
            first = len(graph.get_operations())
            grads = tf.compat.v1.gradients(seg_ys, boundary + xs_read,
                                           grad_ys=[g for _, g in live],
                                           stop_gradients=stop, **kwargs)
            add_partials(boundary + xs_read, grads)
            _shapes_from_forward(graph.get_operations()[first:], copies, shape_cache)
        return [_aggregate(partial.get(x, []), x.op, colocate_gradients_with_ops) for x in xs]


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------

def _dense_value(value) -> np.ndarray:
    if hasattr(value, "indices") and hasattr(value, "dense_shape"):   # IndexedSlicesValue
        dense = np.zeros(value.dense_shape, dtype=value.values.dtype)
        np.add.at(dense, value.indices, value.values)
        return dense
    return np.asarray(value)


def compare_gradients(sess, reference: Sequence, checkpointed: Sequence, feed_dict=None) -> float:
    """Largest absolute difference between two gradient lists (one sess.run).

    IndexedSlices are compared as dense values; a None against a tensor
    compares the tensor with zeros. Raises ValueError if the lists differ in
    length or shape.
    """
    fetch = gradient_pairs(reference, checkpointed)
    return gradient_difference(sess.run(fetch, feed_dict=feed_dict), reference, checkpointed)


def gradient_pairs(reference: Sequence, checkpointed: Sequence) -> list:
    """What to fetch to compare two gradient lists: per gradient, its non-None values."""
    reference, checkpointed = list(reference), list(checkpointed)
    if len(reference) != len(checkpointed):
        raise ValueError(f"{len(reference)} reference gradients, {len(checkpointed)} checkpointed")
    return [[g for g in pair if g is not None] for pair in zip(reference, checkpointed)]


def gradient_difference(values: list, reference: Sequence, checkpointed: Sequence) -> float:
    """Largest absolute difference in the fetched `gradient_pairs` values."""
    worst = 0.0
    for i, (pair, got) in enumerate(zip(zip(reference, checkpointed), values)):
        got = [_dense_value(v) for v in got]
        if len(got) == 1:
            got.append(np.zeros_like(got[0]))
        if not got:
            continue
        a, b = got
        if a.shape != b.shape:
            raise ValueError(f"gradient {i}: shapes {a.shape} and {b.shape} differ")
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return worst
