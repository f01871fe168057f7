"""Verification: invariants every parallel graph must satisfy.

Checked after the last pass (and after every pass when debug.check_invariants
is set, which the tests do):
- every op has a TaskGraph attribute and a device;
- the graph has no cycles (data and control edges);
- exactly one reduction per trainable gradient (once the gradient pass ran);
- the train ops need none of the template ops (the original forward/backward
  ops that the replicas were copied from), so no work is done twice;
- replica consistency (epl/ir/consistency.py): no write of a replicated variable
  (or, by a copy, of any variable but a shared accumulator) reads a value that
  differs per replica (a unit's batch, a unit's random numbers) without a
  reduction over the replicas or a merged value in between.
A violation raises PassError naming every offending op.
"""
from __future__ import annotations

import tensorflow as tf

from epl.errors import PassError
from epl.ir.annotations import TASKGRAPH_ATTR, Phase, taskgraph_tag
from epl.ir.clone import created_complete
from epl.ir.consistency import WriteKind, is_random, varying_writes
from epl.ir.graph_view import TrainingView, ancestors, predecessors, successors
from epl.passes.gradient_comm import ReducedGradients
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.consistency import REMEDY, ConsistentValues
from epl.passes.manager import GraphPass, Instrument, PassContext, PassResult
from epl.passes.replication.result import Replication

MAX_LISTED = 10


def _describe(op: tf.Operation) -> str:
    shape = op.outputs[0].shape if op.outputs else "()"
    taskgraph = taskgraph_tag(op) or "none"
    return f"{op.name} (type {op.type}, shape {shape}, TaskGraph {taskgraph}, device {op.device or 'unset'})"


def _fail(what: str, ops, fix: str) -> None:
    listed = "; ".join(_describe(op) for op in ops[:MAX_LISTED])
    more = f" and {len(ops) - MAX_LISTED} more" if len(ops) > MAX_LISTED else ""
    raise PassError(f"invariant violated: {what}: {listed}{more}. {fix}")


def check_tagged_and_placed(graph: tf.Graph) -> None:
    """Every op has a TaskGraph and a device (both read from one NodeDef read per op, except
    for ops NodeBatch created with both, which keep them)."""
    bad = []
    for op in graph.get_operations():
        if created_complete(op):   # tagged and placed when created
            continue
        node = op.node_def
        if TASKGRAPH_ATTR not in node.attr or not node.device:
            bad.append(op)
    if bad:
        _fail("ops without a TaskGraph or a device", bad,
              "Ops created after parallelization are not placed by EPL; build the whole "
              "model before the first session.")


def check_acyclic(graph: tf.Graph, preds: dict | None = None) -> None:
    """The graph (data and control edges) has no cycle.

    preds: `predecessors(graph)` where the caller has it.

    Speed: an op's inputs usually exist before it is created, so almost every
    edge runs from an earlier op to a later one in graph (creation) order; the
    others, "back edges", come from rewiring (`_update_input`, control inputs
    added later). Graph order cannot increase all the way around a cycle, so
    a cycle contains a back edge, and all its ops are reachable from that
    edge's consumer and reach its producer through ops so reachable. Only
    those ops (usually the few update ops the gradient pass rewired) are
    sorted topologically; the whole graph is sorted only when they hold a
    cycle, to name the ops.
    """
    preds = preds if preds is not None else predecessors(graph)
    back = _back_edges(preds)
    if not back:
        return
    reached = successors([consumer for _, consumer in back])
    suspects = _predecessors_closure([p for p, _ in back if p in reached], preds, within=reached)
    if suspects and _unsorted([op for op in preds if op in suspects], preds):
        _fail("the graph has a cycle through these ops", _unsorted(list(preds), preds),
              "A stage reads a tensor computed by a later stage; check the order of the scopes.")


def _back_edges(preds: dict) -> list:
    """(producer, consumer) of every edge not from an earlier op to a later one."""
    position = {op: i for i, op in enumerate(preds)}
    return [(producer, op) for i, (op, producers) in enumerate(preds.items())
            for producer in producers if position[producer] >= i]


def _predecessors_closure(targets: list, preds: dict, within=None) -> set:
    """`targets` and every op that reaches one of them (only through ops of
    `within`, when given)."""
    seen = set(targets)
    stack = list(seen)
    while stack:
        for producer in preds[stack.pop()]:
            if producer not in seen and (within is None or producer in within):
                seen.add(producer)
                stack.append(producer)
    return seen


def _unsorted(ops: list, preds: dict) -> list:
    """The ops Kahn's algorithm cannot order using the edges among `ops`: those
    on a cycle or after one (in the order given)."""
    members = set(ops)
    indegree = {}
    consumers = {op: [] for op in ops}
    for op in ops:
        producers = [p for p in preds[op] if p in members]
        indegree[op] = len(producers)
        for producer in producers:
            consumers[producer].append(op)
    ready = [op for op in ops if indegree[op] == 0]
    while ready:
        op = ready.pop()
        for consumer in consumers[op]:
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                ready.append(consumer)
    return [op for op in ops if indegree[op] > 0]


def check_one_reduction_per_gradient(replication, reduced: dict | None) -> None:
    """Each trainable gradient of `replication` (the replicate pass's result) is
    reduced exactly once (`reduced`: the gradient_comm pass's counts, None before it)."""
    if replication is None or reduced is None:
        return
    missing = [var for var, _, _ in replication.gradients if var.name not in reduced]
    if missing:
        _fail("gradients without a reduction", missing, "This is an EPL bug; please report it.")


def check_no_template_work(view, replication, preds: dict | None = None) -> None:
    """The train ops run no template op (no forward/backward work done twice). A
    template constant is no work: a sparse gradient's dense shape (the variable's
    shape, the same in every unit) is one that a Keras 3 optimizer's update reads.

    view: the analysis; replication: the replicate pass's result (None before it);
    preds: `predecessors(graph)` where the caller has it.
    """
    if replication is None:
        return
    template = set(replication.replica_maps[0]) | {
        op for op in view.replica_ops if view.phase_of[op] == Phase.BACKWARD}
    needed = (_predecessors_closure(view.train_ops, preds) if preds is not None
              else ancestors(view.train_ops))
    bad = sorted((op for op in template & needed if op.type != "Const"),
                 key=lambda op: op._id)
    if bad:
        _fail("the train op still needs original (template) ops", bad,
              "This is an EPL bug; please report it.")


def check_replica_consistency(view, replication, consistent, gradients=None,
                              workers: int = 1, preds: dict | None = None,
                              reduced=None) -> None:
    """No run writes a replicated variable from a value that differs per replica
    (module docstring). consistent: the consistency pass's ConsistentValues;
    gradients: the last ReplicaGradients, complete when there is one replica in all
    (its micro-batches summed); preds: `predecessors(graph)` where the caller has it;
    reduced: the gradient_comm pass's ReducedGradients (its gathered sparse gradients).

    Checked: the writes the training step runs, and the user's own writes outside it
    (a copy EPL made, or an update of the user's step, that the step no longer runs,
    such as an update ZeRO replaced, runs in no run)."""
    if replication is None:
        return
    units = replication.units()
    sources = set()
    for template, parts in replication.unit_batches.items():
        if len({id(p) for p in parts}) > 1 or template.op.type != "Const":
            sources.update(parts + [template])
    unit_copies = set()
    for unit in units:
        for template, copy in replication.forward_copies[unit].items():
            unit_copies.add(copy)
            if is_random(copy) or copy.type in ("IteratorGetNext", "IteratorGetNextSync"):
                sources.update(copy.outputs)
    for k, op_map in enumerate(replication.replica_maps[1:], 1):
        forward = set(replication.forward_copies.get((k, 0), {}).values())
        for copy in op_map.values():
            if copy not in forward:
                unit_copies.add(copy)
                if is_random(copy) and not (copy.get_attr("seed") or copy.get_attr("seed2")):
                    sources.update(copy.outputs)
    templates = {op for unit in units for op in replication.forward_copies[unit]}
    templates |= {op for op in view.replica_ops if view.phase_of[op] == Phase.BACKWARD}
    shared = view.writes.of_kind(WriteKind.SHARED_ACCUMULATOR)
    allowed = {d.op for d in shared} | {replication.forward_copies[u].get(d.op)
                                        for d in shared for u in units}
    replicated = {copy for copies in replication.mirrors.values() for copy in copies}
    clean = list(replication.merged.values()) + list(consistent.clean if consistent else ())
    if reduced is not None:   # gathered sparse gradients, dense gradients' shapes
        clean += list(reduced.gathered) + list(reduced.shapes)
    # a split variable's gradient: one autodiff over every replica's loss, one tensor
    clean += [t for _, g in replication.split_gradients
              for t in ([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])]
    if gradients is not None and len(replication.replica_maps) == 1 and workers == 1:
        clean += [t for _, grads, _ in gradients.entries for g in grads if g is not None
                  for t in ([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])]
    step = (_predecessors_closure(view.train_ops, preds) if preds is not None
            else ancestors(view.train_ops))
    # EPL's copies and the user's updates the step no longer runs (ZeRO runs its own)
    dead = {op for op in view.graph.get_operations()
            if op not in step and (op not in view.tags or op in view.step_ops)} - allowed
    found = varying_writes(view.graph, sources, clean, replicated, unit_copies,
                           templates | dead, allowed)
    if found:
        first = found[0]
        raise PassError(
            f"invariant violated: variable {first.variable.name} would hold a different value "
            f"on each replica: {_describe(first.op)} writes it from a value computed from "
            f"{first.source.name}, which differs per replica, without a reduction over the "
            f"replicas ({len(found)} such write(s)). {REMEDY}")


class InvariantInstrument(Instrument):
    """Checks the structural invariants after every pass."""

    def after(self, graph_pass, graph, ctx, result, duration_s):
        if "replicate" in ctx.passes_run:  # the replicate pass places the ops
            check_tagged_and_placed(graph)
        check_acyclic(graph)


class VerifyPass(GraphPass):
    """Checks all invariants on the final graph."""

    name = "verify"
    requires = (TrainingView, Replication, ReducedGradients)  # checks their results
    optional = (ConsistentValues, ReplicaGradients)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        preds = predecessors(graph)
        check_tagged_and_placed(graph)
        check_acyclic(graph, preds)
        check_one_reduction_per_gradient(ctx.get(Replication), ctx.get(ReducedGradients).counts)
        check_no_template_work(ctx.get(TrainingView), ctx.get(Replication), preds)
        check_replica_consistency(ctx.get(TrainingView), ctx.get(Replication),
                                  ctx.find(ConsistentValues), ctx.find(ReplicaGradients),
                                  ctx.communicator.num_workers, preds,
                                  ctx.get(ReducedGradients))
        return PassResult(notes=["invariants hold"], modified=False)
