"""Gradient accumulation over micro-batches: each replica's M micro-batch gradients -> one.

With `pipeline.num_micro_batch` M > 1, the replicate pass built M backward
copies per replica and wired the replica's updates to micro-batch 0's
gradients. This pass adds, per replica and variable, the M gradients weighted
by each micro-batch's share of the replica's examples (`accumulate`), and the
readers of micro-batch 0's gradient (the updates, or the ops the script put
between compute_gradients and apply_gradients, such as clipping) read the sum
instead (epl/passes/gradient_flow.py: gradients flow one way).

Results: the accumulated gradients (a `ReplicaGradients`, what the passes after
it read), and an `Accumulation`: those gradients and, per (replica, micro-batch),
the accumulation ops that are that micro-batch's work (the schedule pass runs them
in its backward step).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from epl.ir import graph_mutation
from epl.ir.annotations import MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR
from epl.ir.clone import NodeBatch
from epl.ir.graph_view import TrainingView
from epl.passes import gradient_flow
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.replication.result import Replication


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """What the accumulate pass built.

    gradients: each replica's accumulated gradients (gradient_flow.ReplicaGradients).
    ops: (replica, micro-batch) -> the accumulation ops that are that micro-batch's
      work (the add of its gradient; the last micro-batch's also the final scaling).
    finishing: the ops that finish the sums, in `ops` as the last micro-batch's work:
      the final x 1/M of each equal-share dense sum, and the concatenation of each
      sparse gradient's micro-batches (one per variable and replica whatever M is).
      The unit_functions pass keeps them out of the last micro-batch's backward call,
      whose body is then the middle micro-batches' one.
    starting: the zeros micro-batch 0 adds its gradient into (a Fill and its two
      constants per variable whose gradient has a static shape), in `ops` as
      micro-batch 0's work (the schedule runs them in its backward step). The
      unit_functions pass keeps them out of micro-batch 0's backward call, which
      takes them as the sum so far: its body is then the later micro-batches' one.
    """

    gradients: ReplicaGradients
    ops: dict
    finishing: frozenset = frozenset()
    starting: frozenset = frozenset()

    def kept_out_of_calls(self) -> frozenset:
        """The accumulation ops that stay graph ops beside the unit functions' calls."""
        return self.finishing | self.starting


class AccumulatePass(GraphPass):
    """Sums each replica's micro-batch gradients into one, weighted by their shares."""

    name = "accumulate"
    requires = (TrainingView, Replication)   # reads every unit's gradients
    provides = (ReplicaGradients, Accumulation)
    off_note = "one micro-batch per replica (pipeline.num_micro_batch is 1): nothing to add"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        replication = ctx.get(Replication)
        micro = replication.num_micro_batches
        replicas = len(replication.micro_scales)
        first_new = len(graph.get_operations())
        per_replica, ops, finishing, starting = [], {}, set(), set()
        for k in range(replicas):
            per_micro = [replication.unit_gradients[(k, m)] for m in range(micro)]
            taken = [None if g is None else gradient_flow.readers(g) for g in per_micro[0]]
            accumulated, ops_of = accumulate(per_micro, k, replication.micro_scales[k],
                                              finishing, starting)
            for first, total, readers in zip(per_micro[0], accumulated, taken):
                if first is not None:
                    gradient_flow.rewire(first, total, readers)
            per_replica.append(accumulated)
            ops.update({(k, m): list(new) for m, new in ops_of.items()})
        index = {id(grad): i for i, (grad, _) in enumerate(ctx.get(TrainingView).gradients)}
        entries = [(var, [per_replica[k][index[id(original)]] for k in range(replicas)], original)
                   for var, _, original in replication.gradients]
        # split TaskGraphs run one micro-batch (the replicate pass refuses more): unchanged
        accumulated = ReplicaGradients(entries, list(replication.split_gradients))
        ctx.provide(accumulated)
        ctx.provide(Accumulation(accumulated, ops, frozenset(finishing), frozenset(starting)))
        added = [op.name for op in graph.get_operations()[first_new:]]
        return PassResult(added=added, notes=[
            f"{micro} micro-batch gradients per variable added per replica, over {replicas} "
            "replica(s), weighted by each micro-batch's share of its replica's examples"])


def accumulate(per_micro: list[list], replica: int, scales: list | None = None,
               finishing: set | None = None, starting: set | None = None
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

    The sum is a chain of adds, ((0 + g0) + g1) + ..., not one AddN, and the
    add of g_m is tagged as micro-batch m's work (`_epl_micro_batch` = m; the
    final scaling is micro-batch M - 1's): the schedule pass puts it into that
    micro-batch's backward step, so g_m is freed as soon as it is added and the
    accumulator costs one gradient's memory whatever M is. (The step's control
    edges also keep Grappler from merging the chain back into one AddN, which
    would keep every micro-batch's gradient alive until the last one.) Sparse
    gradients (tf.IndexedSlices) are concatenated, with scaled values, at the
    last micro-batch.

    Why micro-batch 0 adds its gradient into zeros (a Fill from constants, in its
    backward step, where the gradient's shape is static) instead of starting the sum
    with it: every micro-batch's backward then does the same work, and the
    unit_functions pass gives all of a stage's micro-batches one backward function
    (the zeros stay outside the call, which takes them as the sum so far). With a
    function of its own for micro-batch 0, each stage had two backward bodies for
    TensorFlow to optimize and instantiate at the first step: at 24 layers and 16
    micro-batches (bench/startup.py's encoder) the first step took 6.3-6.6 s with
    two, 4.6-4.9 s with one. 0 + g0 is g0 exactly (but for a zero's sign), and the
    schedule runs the Fill in micro-batch 0's backward step, so the zeros live no
    longer than the sum they start.

    The dense sums with equal shares (every static batch: most of a step's
    accumulation ops, one add per variable and micro-batch) are written as NodeDefs
    and added in one import (`NodeBatch`, as the replicate pass adds its copies):
    building them as TensorFlow ops one by one took about 1 ms each, 2.4 of the
    rewrite's 16.7 s at 12 layers and 16 micro-batches (bench/startup.py).

    Returns (gradients, {m: ops added for micro-batch m}); the ops that finish the
    sums at the last micro-batch (the dense sums' x 1/M, the sparse concatenations)
    also go into `finishing`, and the zeros micro-batch 0 adds into (each a Fill and
    its constants) into `starting`, when given.
    """
    micro = len(per_micro)
    if micro == 1:
        return per_micro[0], {}
    scales = list(scales) if scales is not None else [1.0 / micro] * micro
    equal = all(isinstance(x, float) for x in scales) and len(set(scales)) == 1
    scale = scales[0]
    accumulated, ops_of = [], {m: [] for m in range(micro)}
    batch, written = None, []   # the dense equal-share sums: (position, {m: node names})
    for parts in zip(*per_micro):
        first = parts[0]
        if first is None:
            accumulated.append(None)
            continue
        if equal and not isinstance(first, tf.IndexedSlices):
            batch = batch or NodeBatch(first.graph)
            written.append((len(accumulated), *_dense_sum(batch, parts, replica, scale)))
            accumulated.append(None)   # filled in once the batch is committed
            continue
        source = first.values.op if isinstance(first, tf.IndexedSlices) else first.op
        device = source.device
        source_attrs = source.node_def.attr   # read once: node_def serializes the op
        old = {id(t) for p in parts for t in _tensors(p)} | {
            id(x) for x in scales if isinstance(x, tf.Tensor)}
        inherited = [(name, source_attrs[name]) for name in (TASKGRAPH_ATTR, PHASE_ATTR)
                     if name in source_attrs]

        def tagged(m, build):
            with tf.device(device), tf.name_scope("EPL_ACCUMULATE"):
                result = build()
            for new in _built(result, old):
                old.add(id(new))   # the next build reads the running total: no new op
                for name, value in inherited:
                    graph_mutation.set_attr(new, name, value)
                graph_mutation.set_attr(new, REPLICA_ATTR, tf.compat.v1.AttrValue(i=replica))
                graph_mutation.set_attr(new, MICRO_BATCH_ATTR, tf.compat.v1.AttrValue(i=m))
                ops_of[m].append(new)
            return result

        if isinstance(first, tf.IndexedSlices):
            before = len(ops_of[micro - 1])
            total = tagged(micro - 1, lambda: tf.IndexedSlices(
                tf.concat([p.values * tf.cast(x, first.dtype) for p, x in zip(parts, scales)],
                          axis=0),
                tf.concat([p.indices for p in parts], axis=0), first.dense_shape))
            if finishing is not None:
                finishing.update(ops_of[micro - 1][before:])
        else:   # unequal shares, or known only at run time (equal dense sums: `batch`)
            def weighted(gradient, share, dtype=first.dtype):
                return gradient * tf.cast(share, dtype)

            if first.shape.is_fully_defined():   # into zeros, as `_dense_sum` does
                before = len(ops_of[0])
                zeros = tagged(0, lambda: tf.fill(first.shape.as_list(),
                                                  tf.constant(0, first.dtype)))
                if starting is not None:
                    starting.update(ops_of[0][before:])
                total = tagged(0, lambda: zeros + weighted(parts[0], scales[0]))
            else:
                total = tagged(0, lambda: weighted(parts[0], scales[0]))
            for m in range(1, micro):
                total = tagged(m, lambda t=total, p=parts[m], x=scales[m]: t + weighted(p, x))
        accumulated.append(total)
    if batch is not None:
        created = batch.commit()
        for position, names, scale_names, zero_names in written:
            for m in range(micro):
                ops_of[m].extend(created[name] for name in names.get(m, ()))
            accumulated[position] = created[names[micro - 1][-1]].outputs[0]
            if finishing is not None:
                finishing.update(created[name] for name in scale_names)
            if starting is not None:
                starting.update(created[name] for name in zero_names)
    return accumulated, ops_of


def _dense_sum(batch: NodeBatch, parts: tuple, replica: int, scale: float) -> tuple:
    """Write (((0 + g_0) + g_1) + ...) x scale for one variable's dense gradients `parts` into
    `batch`, as `accumulate` builds it (on the device of g_0, with its TaskGraph and
    phase; the add of g_m is micro-batch m's op, the scaling the last one's), from the
    zeros micro-batch 0 adds into where the shape is static. Returns ({m: the names of
    micro-batch m's nodes}, the last one's ending with the sum; the names of the
    scaling's nodes; the names of the zeros' nodes)."""
    first = parts[0]
    source = first.op
    attrs = source.node_def.attr   # read once: node_def serializes the op
    dtype = tf.compat.v1.AttrValue(type=first.dtype.as_datatype_enum)
    names: dict = {}

    def node(op_type: str, name: str, m: int, inputs: list, **own) -> str:
        new = node_def_pb2.NodeDef(name=batch.new_name(name), op=op_type, device=source.device)
        new.input.extend(inputs)
        for key, value in own.items():
            new.attr[key].CopyFrom(value)
        for key in (TASKGRAPH_ATTR, PHASE_ATTR):
            if key in attrs:
                new.attr[key].CopyFrom(attrs[key])
        new.attr[REPLICA_ATTR].i = replica
        new.attr[MICRO_BATCH_ATTR].i = m
        names.setdefault(m, []).append(batch.add(new))
        return new.name

    total = batch.ref(first)
    zeros: tuple = ()
    if first.shape.is_fully_defined():   # see `accumulate`: micro-batch 0 adds into zeros
        dims = np.asarray(first.shape.as_list(), np.int64)
        index = tf.int32 if dims.size == 0 or dims.max() < 2 ** 31 else tf.int64
        index_type = tf.compat.v1.AttrValue(type=index.as_datatype_enum)
        shape = node("Const", "EPL_ACCUMULATE/zeros/shape", 0, [], dtype=index_type,
                     value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(
                         dims.astype(index.as_numpy_dtype))))
        zero = node("Const", "EPL_ACCUMULATE/zeros/value", 0, [], dtype=dtype,
                    value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(
                        np.zeros((), first.dtype.as_numpy_dtype))))
        fill = node("Fill", "EPL_ACCUMULATE/zeros", 0,
                    [batch.output(shape, 0), batch.output(zero, 0)], T=dtype,
                    index_type=index_type)
        add = node("AddV2", "EPL_ACCUMULATE/add", 0, [batch.output(fill, 0), total], T=dtype)
        total = batch.output(add, 0)
        zeros = (shape, zero, fill)
    for m in range(1, len(parts)):
        add = node("AddV2", "EPL_ACCUMULATE/add", m, [total, batch.ref(parts[m])], T=dtype)
        total = batch.output(add, 0)
    last = len(parts) - 1
    # the scale as tf.cast(scale, dtype) makes it: a float32 constant, cast
    value = np.asarray(np.float32(scale)).astype(first.dtype.as_numpy_dtype)
    const = node("Const", "EPL_ACCUMULATE/Cast/x", last, [], dtype=dtype,
                 value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(value)))
    mul = node("Mul", "EPL_ACCUMULATE/mul", last, [total, batch.output(const, 0)], T=dtype)
    return names, (const, mul), zeros


def _tensors(value) -> list:
    """The tensors of a gradient (a sparse one's values, indices and dense shape)."""
    if isinstance(value, tf.IndexedSlices):
        return [t for t in (value.values, value.indices, value.dense_shape) if t is not None]
    return [value] if value is not None else []


def _built(result, old: set) -> list[tf.Operation]:
    """The ops that computed `result` from the tensors (and ops) whose ids are in `old`
    (what one `tagged` build created: the walk stops at its inputs and at the ops of
    earlier builds), in creation order. Found from
    the result, not by listing the graph's ops before and after, which copies the whole
    graph's op list for every gradient and micro-batch (quadratic in the graph)."""
    seen, stack = {}, [t for t in _tensors(result) if id(t) not in old]
    while stack:
        op = stack.pop().op
        if op._id in seen or id(op) in old:
            continue
        seen[op._id] = op
        stack.extend(t for t in op.inputs if id(t) not in old)
    return [seen[i] for i in sorted(seen)]
