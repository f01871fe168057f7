"""Replica consistency: every write of a replicated variable reads values equal on every replica.

The analysis (epl/ir/consistency.py, called by epl.ir.graph_view.analyze) decided,
for every write the copies would run that reads a per-replica value, how it stays
consistent (`TrainingView.writes`), and the analysis already made those writes run
once per replica (inside the training step) or once (outside it) instead of once
per unit. This pass, right after the replicate pass, carries the decisions out:

- validate: a write EPL cannot keep consistent is refused before any rewrite, with
  an error naming the variable, the op that writes it, what per-replica value it
  reads and the remedy (`refusal_message`); so is a write that reads the merged
  value of a GLOBAL_CONCAT tensor (its merge has another shape).
- merged inputs: each replica's copy of the write (and of the ops between the
  merged tensors and it) reads the merged value (the loss over the global batch,
  a collection's merge) instead of its replica's.
- moving statistics (batch norm's UPDATE_OPS): each replica's write moves the
  variable towards one value, by `batch_norm.moving_statistics`: "replica0", the
  first unit's value (replica 0, micro-batch 0; worker 0's, broadcast, with
  several workers: Horovod keeps rank 0's statistics), or "mean", the mean over
  every unit weighted by its share of the global batch (and over the workers:
  MirroredStrategy's mean of the replicas' statistics). A moving mean under
  "mean" is exactly single-device training's on the global batch; a moving
  variance is the mean of the units' batch variances (single-device training's
  holds the variance of the whole batch, which also counts how far the units'
  means lie apart).
- shared accumulators (tf.compat.v1.metrics' totals and counts): every unit adds
  into the one variable; an op outside the copies that waits for one of the
  template's forward ops (a metric's update op reads its total after the add)
  waits for every unit's copy of it instead, and a read of a reference
  variable's add reads the variable after every unit's add.

Result: `ConsistentValues`, the tensors this pass built that are the same on every
replica (the verify pass's data-flow check counts them as merged).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError, PassError
from epl.graph_keys import merge_requests
from epl.ir import graph_mutation
from epl.ir.clone import replace_input
from epl.ir.consistency import WriteKind
from epl.ir.graph_view import TrainingView
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.replication.merge import merge_parts
from epl.passes.replication.result import Replication

SCOPE = "EPL_CONSISTENT"
REMEDY = (
    "Remedy: compute the value from the loss, or add the tensor it is computed from to an "
    "EPL merge collection (epl.add_to_collection(t, epl.GraphKeys.GLOBAL_MEAN_OBJECTS) for a "
    "mean over examples, GLOBAL_SUM_OBJECTS for a sum or count), so the write reads its "
    "value over the global batch; for a moving statistic like batch norm's, add the write "
    "to tf.compat.v1.GraphKeys.UPDATE_OPS (batch_norm.moving_statistics then chooses the "
    "value); for a streaming metric, create its variables in "
    "tf.compat.v1.GraphKeys.METRIC_VARIABLES and only add to them.")


@dataclasses.dataclass(frozen=True)
class ConsistentValues:
    """What the consistency pass built: tensors the same on every replica (the merged
    statistics), and how many writes of each kind it made consistent."""

    clean: tuple
    counts: dict


def refusal_message(decision) -> str:
    """The error of a write EPL cannot keep consistent (a REFUSED WriteDecision)."""
    where = "in the training step" if decision.in_step else "outside the training step"
    return (f"variable {decision.variable.name} would hold a different value on each "
            f"replica: {decision.op.name} ({decision.op.type}, {where}) writes it, and "
            f"{decision.reason}, without a reduction over the replicas. EPL keeps every "
            "replica's copy of a variable equal (docs/consistency.md). "
            f"{REMEDY}")


class ConsistencyPass(GraphPass):
    """Makes the writes that read per-replica values read consistent ones (or refuses)."""

    name = "consistency"
    requires = (TrainingView, Replication)   # rewires the replicas' copies of the writes
    provides = (ConsistentValues,)
    after = ("replicate",)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        """Refuse a write EPL cannot keep consistent, before any rewrite."""
        writes = ctx.get(TrainingView).writes
        refused = writes.of_kind(WriteKind.REFUSED)
        if refused:
            raise ParallelizeError(refusal_message(refused[0]))
        kinds = merge_requests(graph)
        for decision in writes.of_kind(WriteKind.MERGED_INPUTS):
            concat = [t for t in decision.merged if kinds.get(t) == "concat"]
            if concat:
                raise ParallelizeError(
                    f"variable {decision.variable.name} is written by {decision.op.name} "
                    f"({decision.op.type}) from {concat[0].name}, which is in "
                    "epl.GraphKeys.GLOBAL_CONCAT_OBJECTS: its merge holds every replica's "
                    "rows, another shape than the write reads. Write it from a mean or a "
                    "sum over the rows (GLOBAL_MEAN_OBJECTS or GLOBAL_SUM_OBJECTS) instead.")

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view, replication = ctx.get(TrainingView), ctx.get(Replication)
        writes = view.writes
        first = len(graph.get_operations())
        replicas = len(replication.replica_maps)
        rewired = 0
        once = set(view.split_ops)
        for decision in writes.of_kind(WriteKind.MERGED_INPUTS):
            rewired += _read_merged(decision, replication, replicas, once)
        clean = [_move_statistic(d, replication, replicas, ctx.communicator,
                                 self.options.moving_statistics)
                 for d in writes.of_kind(WriteKind.MOVING_STATISTIC)]
        released = _release_units(writes, replication, replicas)
        waits = _wait_for_every_unit(view, replication)
        firsts = _read_first_unit(view, replication)
        after = _read_after_adds(writes, replication)
        if ctx.communicator.num_workers > 1:
            after += _sum_over_workers(writes, replication, ctx.communicator)
        counts = {kind.value: len(writes.of_kind(kind)) for kind in WriteKind}
        ctx.provide(ConsistentValues(tuple(clean), counts))
        added = [op.name for op in graph.get_operations()[first:]]
        notes = [f"writes made consistent: {counts[WriteKind.MERGED_INPUTS.value]} read merged "
                 f"values, {counts[WriteKind.MOVING_STATISTIC.value]} moving statistics "
                 f"({self.options.moving_statistics}), "
                 f"{counts[WriteKind.SHARED_ACCUMULATOR.value]} add into shared accumulators; "
                 f"{waits} op(s) outside the copies wait for every unit"]
        return PassResult(added=added, notes=notes,
                          modified=bool(added or rewired or waits or after or released or firsts))


def _replicas_of(decision, replicas: int) -> range:
    """The replicas that run a copy of the write: all in the step, replica 0 outside."""
    return range(replicas) if decision.in_step else range(1)


def _read_merged(decision, replication: Replication, replicas: int, once: set) -> int:
    """Each replica's copies of the decision's cone read the merged tensors; returns
    how many inputs were rewired. once: the split ops the replicate pass did not copy
    (they run once, over the global batch): their tensors are the merged values."""
    count = 0
    for tensor in decision.merged:
        merged = replication.merged.get(tensor)
        if merged is None and tensor.op in once and replication.copy_in(tensor, (0, 0)) is None:
            if decision.in_step and replicas > 1 and replication.replica_op(decision.op, 1) is None:
                raise ParallelizeError(
                    f"variable {decision.variable.name} is written by {decision.op.name} "
                    f"({decision.op.type}) from {tensor.name}, which the split part (epl.split) "
                    "computes once over the global batch, while the step's other updates run "
                    f"on each of the {replicas} replicas: a metric's total and its count would "
                    "then add up different numbers of terms. Update the state from a value "
                    "computed under an epl.replicate scope, or, where the step draws its "
                    "batch itself (a tf.data iterator, an input pipeline), use io.batch_mode "
                    "'replica' (each replica then runs the split part on its own batch).")
            continue
        if merged is None:
            raise PassError(f"{decision.op.name} reads {tensor.name}, which the replicate pass "
                            "did not merge; this is an EPL bug, please report it")
        for k in _replicas_of(decision, replicas):
            theirs = {tensor, replication.copy_in(tensor, (k, 0))} - {None}
            for op in decision.cone:
                copy = replication.replica_op(op, k)
                for old in [t for t in copy.inputs if t in theirs]:
                    replace_input(copy, old, merged)
                    count += 1
    return count


def _move_statistic(decision, replication: Replication, replicas: int, communicator,
                    rule: str) -> tf.Tensor:
    """The one value every replica's copy of a moving-statistic write moves by (the
    rule's: unit 0's or the mean over units), wired into each copy; returned."""
    value = decision.value
    parts = [replication.copy_in(value, unit) for unit in replication.units()]
    label = f"the moving statistic of {decision.variable.name}"
    with tf.device(decision.op.device), tf.name_scope(SCOPE):
        if rule == "mean":
            merged = merge_parts(parts, replication.unit_weights, "mean", communicator, label)
        elif communicator.num_workers > 1:
            merged = communicator.workers_broadcast(parts[0], 0, label=label)
        else:
            merged = parts[0]
    for k in _replicas_of(decision, replicas):
        copy = replication.replica_op(decision.op, k)
        replace_input(copy, copy.inputs[1], merged)
    return merged


def _release_units(writes, replication: Replication, replicas: int) -> int:
    """The units' forward and backward copies no longer wait for the writes that now
    run once per replica (a script's `with tf.control_dependencies(update_ops):
    minimize(loss)` makes the backward wait for batch norm's updates, which read every
    unit's statistics: a micro-batch's backward would wait for a later micro-batch's
    forward, against the pipeline schedule). The updates still wait for them.
    Returns how many copies were changed."""
    writes_once = {replication.replica_op(op, k)
                   for d in writes.decisions if d.in_step
                   and d.kind in (WriteKind.MERGED_INPUTS, WriteKind.MOVING_STATISTIC)
                   for op in d.cone for k in range(replicas)}
    writes_once.discard(None)
    if not writes_once:
        return 0
    units = [op for unit in replication.units() for op in
             list(replication.forward_copies[unit].values())
             + list(replication.backward_ops.get(unit, []))]
    copied = set(units)
    after = {c for op in writes_once for c in op._control_outputs if c not in copied}
    released = writes_once | after
    count = 0
    for op in units:
        controls = list(op.control_inputs)
        if any(c in released for c in controls):
            graph_mutation.remove_all_control_inputs(op)
            graph_mutation.add_control_inputs(op, [c for c in controls if c not in released])
            count += 1
    return count


def _wait_for_every_unit(view: TrainingView, replication: Replication) -> int:
    """Ops outside the copies that wait for a template forward op (a metric's update op
    reads its total once the add ran) wait for every unit's copy of it instead (the
    template never runs). Returns how many ops were rewired."""
    templates = {op for unit in replication.units() for op in replication.forward_copies[unit]}
    copied = set(view.replica_ops) | templates
    count = 0
    for op in view.tags:   # the ops of the graph as the analysis read it
        if op in copied or not any(c in templates for c in op.control_inputs):
            continue
        controls = list(op.control_inputs)
        graph_mutation.remove_all_control_inputs(op)
        waits = []
        for control in controls:
            copies = [replication.forward_copies[u].get(control) for u in replication.units()]
            waits += [c for c in copies if c is not None] if control in templates else [control]
        graph_mutation.add_control_inputs(op, waits)
        count += 1
    return count


def _sum_over_workers(writes, replication: Replication, communicator) -> int:
    """With several workers, a read of a shared accumulator by an op outside the copies
    (a metric's value and update ops) reads its sum over every worker: the metric over
    the job's global batch (every worker must then run those reads in the same runs,
    as for the merged loss). Returns how many reads were rewired."""
    shared = writes.shared_variables
    copied = {c for unit in replication.units()
              for c in replication.forward_copies[unit].values()}
    count = 0
    for var in sorted(shared, key=lambda op: op._id):
        handle = var.outputs[0]
        # in name order: every worker builds its collectives in the same order
        reads = sorted((c for c in handle.consumers() if c.type in ("ReadVariableOp", "Identity")
                        and c not in copied), key=lambda op: op.name)
        for read in reads:
            readers = [c for c in read.outputs[0].consumers() if c not in copied]
            if not readers:
                continue
            with tf.device(read.device), tf.name_scope(SCOPE):
                total = communicator.workers_all_reduce(read.outputs[0], "sum",
                                                        label=f"the metric total {var.name}")
            for reader in readers:
                replace_input(reader, read.outputs[0], total)
                count += 1
    return count


def _read_first_unit(view: TrainingView, replication: Replication) -> int:
    """Ops outside the copies that read a template forward tensor merged by nothing (a
    summary of an activation) read the first unit's copy of it (replica 0's value, the
    documented rule): the template, which the units were copied from, never runs.
    Returns how many inputs were rewired."""
    units = replication.units()
    if not units:
        return 0
    first = replication.forward_copies[units[0]]
    copied = set(view.replica_ops) | set(view.split_ops) | set(view.split_apply_ops)
    count = 0
    for op in view.tags:
        if op in copied or op in first:
            continue
        for tensor in list(op.inputs):
            copy = first.get(tensor.op)
            if copy is not None and not tensor.dtype._is_ref_dtype:
                value = copy.outputs[tensor.value_index]
                if not value.shape.is_compatible_with(tensor.shape):  # a slice (global mode)
                    with tf.device(value.device), tf.name_scope(SCOPE):
                        value = tf.compat.v1.placeholder_with_default(
                            value, [None] * value.shape.rank if value.shape.rank is not None
                            else None, name="EPL_ROWS")
                replace_input(op, tensor, value)
                count += 1
    return count


def _read_after_adds(writes, replication: Replication) -> int:
    """Ops outside the copies reading the output of a shared accumulator's add (a
    reference variable's AssignAdd returns the variable: the metric's update op) read
    the variable after every unit's add instead. Returns how many inputs were rewired."""
    count = 0
    copies_of = {}
    for unit in replication.units():
        for template, copy in replication.forward_copies[unit].items():
            copies_of.setdefault(template, []).append(copy)
    copied = {c for copies in copies_of.values() for c in copies}
    for decision in writes.of_kind(WriteKind.SHARED_ACCUMULATOR):
        for tensor in decision.op.outputs:
            readers = [c for c in tensor.consumers() if c not in copied]
            if not readers or not tensor.dtype._is_ref_dtype:
                continue
            with tf.device(decision.variable.device), tf.name_scope(SCOPE), \
                    tf.control_dependencies(copies_of.get(decision.op, [])):
                after = tf.identity(decision.variable.outputs[0])
            for reader in readers:
                replace_input(reader, tensor, after)
                count += 1
    return count
