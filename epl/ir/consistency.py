"""Replica consistency: which variable writes of a training graph read per-replica values.

A data-parallel graph holds one copy of each replicated variable per replica
(replica 0 the user's variable, the others its mirrors). They stay equal only if
every write of a copy computes the same value on every replica: from values that
are the same everywhere (variables, constants, feeds, reduced gradients, merged
values), never from one replica's batch. This module is the data-flow analysis
behind that rule (docs/consistency.md); the
analysis (`epl.ir.graph_view.analyze`) asks it how to copy each write, the
`consistency` pass (epl/passes/consistency.py) carries out its decisions and
refuses what cannot be kept equal, and the verify pass checks the rewritten graph
with `varying_writes`.

What varies per replica ("sources"): the batch each unit (replica, micro-batch)
reads (iterator outputs, placeholders of rank >= 1; a batch constant is the same
for every unit), the random ops and iterator reads the units' forward copies run
(each unit draws its own numbers), and random ops without a seed in the update
ops (each replica's kernel seeds itself). Variation flows along data edges; it
stops at what EPL reduces over the replicas: a gradient where an update reads it
(the gradient_comm and zero passes reduce it), the merged value of a loss or of a
tensor of an EPL merge collection (`epl.add_to_collection`), and, in the
rewritten graph, the outputs of the cross-replica collectives (and of a local
all-reduce summed on one device, `epl.ir.collectives.is_reduction_to_one_device`).

A write (an op that writes a variable: assign, assign_add, an optimizer's apply, a
scatter) that reads a varying value is one of (`WriteKind`):
- MERGED_INPUTS: every varying path into it passes a merged tensor (a running sum
  of the loss, `total.assign_add(loss)`). It and the ops between the merged
  tensors and it run once per replica (inside the training step) or once on the
  user's variable (outside it; the session then copies the variable into the
  mirrors), reading the merged values: the value single-device training writes.
- MOVING_STATISTIC: a write in `tf.GraphKeys.UPDATE_OPS` (batch norm's moving
  mean and variance): it runs once per replica per step, and the value it moves
  towards is chosen by `batch_norm.moving_statistics` (the consistency pass):
  "replica0", the first unit's batch statistic (Horovod's), or "mean", the mean
  over every unit (MirroredStrategy's).
- SHARED_ACCUMULATOR: an assign_add into a variable of
  `tf.GraphKeys.METRIC_VARIABLES` (the totals and counts of tf.compat.v1.metrics),
  every write of which adds: the variable is not mirrored, every unit adds its
  batch's part into the one variable, which then holds the value over the
  worker's whole batch (streaming metrics are built to add over batches). Ops
  that read it after the adds (the metric's update op) read it after every unit's.
- REFUSED: anything else; `PerReplicaWrite` names the variable, the op, what
  varying value it reads and the remedy.

Feedable placeholders that are no batch input (a keep probability, an
is-training flag, a learning rate) are not copied per unit: every copy reads the
one the user feeds; nor are summary ops, which report the job's values
(`WritePlan.not_copied`).
"""
from __future__ import annotations

import dataclasses
import enum

import tensorflow as tf

from epl.ir.collectives import is_reduction_to_one_device

# Op types that add to the variable whose handle or ref is their first input.
ADD_TYPES = frozenset({"AssignAdd", "AssignAddVariableOp"})
# TensorFlow's and Horovod's collectives whose output is the same on every participant.
CONSISTENT_COLLECTIVE_TYPES = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGather",
    "CollectiveGatherV2", "CollectiveBcastRecv", "CollectiveBcastRecvV2", "CollectiveBcastSend",
    "CollectiveBcastSendV2", "NcclAllReduce", "HorovodAllreduce", "HorovodGroupedAllreduce",
    "HorovodAllgather", "HorovodBroadcast"})
_ITERATOR_TYPES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})
_PLACEHOLDER_TYPES = frozenset({"Placeholder", "PlaceholderWithDefault"})
# Summary ops (tf.compat.v1.summary and tf.summary's writes): they report the job's
# values, so they are not copied per unit (they read merged values, or replica 0's).
SUMMARY_TYPES = frozenset({"ScalarSummary", "HistogramSummary", "WriteScalarSummary",
                           "WriteHistogramSummary", "TensorSummary", "TensorSummaryV2",
                           "WriteSummary", "ImageSummary", "AudioSummaryV2", "WriteImageSummary",
                           "WriteAudioSummary", "MergeSummary"})
_VARIABLE_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
# Op types that write the variable whose handle (or ref) is their first input.
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "Apply",
                   "SparseApply", "Scatter", "ResourceStridedSliceAssign", "StridedSliceAssign")


class WriteKind(str, enum.Enum):
    """How EPL keeps one write consistent (module docstring)."""

    MERGED_INPUTS = "merged_inputs"
    MOVING_STATISTIC = "moving_statistic"
    SHARED_ACCUMULATOR = "shared_accumulator"
    REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class WriteDecision:
    """What EPL does with one write that reads a varying value.

    op / variable: the write and the variable op it writes. in_step: the training
    step runs it (else a run of its own does). cone: the ops that run once per
    replica (or once) with it, the write included (MERGED_INPUTS: the ops between
    the merged tensors and the write). merged: the merged tensors they read.
    source: for REFUSED, the varying tensor it reads (a batch input or a random
    op's output) and `reason` in words.
    """

    op: tf.Operation
    variable: tf.Operation
    kind: WriteKind
    in_step: bool
    cone: tuple = ()
    merged: tuple = ()
    value: tf.Tensor | None = None
    source: tf.Tensor | None = None
    reason: str = ""


@dataclasses.dataclass
class WritePlan:
    """The decisions for one training graph (`plan_writes`).

    decisions: one per write that reads a varying value.
    shared_variables: the SHARED_ACCUMULATOR variables (not mirrored).
    apply_ops: ops the analysis makes "apply": run once per replica in the step.
    other_ops: ops the analysis makes "other": run once, on the user's variables.
    after_reads: ops that read a shared accumulator after its adds (they are not
      copied; the consistency pass makes them wait for every unit's add).
    not_copied: ops kept out of the per-unit copies (other_ops, after_reads and
      the feedable placeholders that are no batch input, and summary ops).
    per_unit: ops the analysis makes "forward" (copied per unit): the adds into a
      shared accumulator that read no batch (a count of rows).
    """

    decisions: list = dataclasses.field(default_factory=list)
    shared_variables: set = dataclasses.field(default_factory=set)
    apply_ops: set = dataclasses.field(default_factory=set)
    other_ops: set = dataclasses.field(default_factory=set)
    after_reads: set = dataclasses.field(default_factory=set)
    not_copied: set = dataclasses.field(default_factory=set)
    per_unit: set = dataclasses.field(default_factory=set)

    def of_kind(self, kind: WriteKind) -> list:
        """The decisions of one kind, in creation order of their writes."""
        return [d for d in self.decisions if d.kind == kind]


def written_variable(op: tf.Operation) -> tf.Operation | None:
    """The variable op `op` writes (an assign, an optimizer's apply, a scatter), if any."""
    if not op.inputs or not op.type.startswith(_WRITE_PREFIXES):
        return None
    source = op.inputs[0]
    if source.op.type in _VARIABLE_TYPES and (source.dtype == tf.resource
                                              or source.dtype._is_ref_dtype):
        return source.op
    return None


def is_random(op: tf.Operation) -> bool:
    """A stateful op that draws random numbers (it has the `seed2` attribute of
    TensorFlow's random ops): its copies draw different numbers."""
    return op.op_def.is_stateful and any(a.name == "seed2" for a in op.op_def.attr)


def is_seeded(op: tf.Operation) -> bool:
    """A random op with a seed (graph or op seed): its copies made with the same
    attributes draw the same numbers."""
    return bool(op.get_attr("seed") or op.get_attr("seed2"))


class _Flow:
    """Which ops compute a varying value, by data edges from `sources`.

    cut: tensors whose readers do not vary through them (merged values);
    blocked(tensor, consumer): an edge along which nothing varies (a gradient read
    by an update, which EPL reduces first).
    """

    def __init__(self, sources, cut=frozenset(), blocked=None):
        self.sources, self.cut = set(sources), set(cut)
        self.blocked = blocked or (lambda tensor, consumer: False)
        self.ops: set = set()
        stack = list(self.sources)
        seen = set()
        while stack:
            tensor = stack.pop()
            if tensor in seen or tensor in self.cut:
                continue
            seen.add(tensor)
            for consumer in tensor.consumers():
                if consumer not in self.ops and not self.blocked(tensor, consumer):
                    self.ops.add(consumer)
                    stack.extend(consumer.outputs)

    def varies(self, tensor: tf.Tensor, consumer: tf.Operation) -> bool:
        """True if `consumer` reads a varying value through its input `tensor`."""
        if tensor in self.cut or self.blocked(tensor, consumer):
            return False
        return tensor in self.sources or tensor.op in self.ops

    def varying_inputs(self, op: tf.Operation, skip_first: bool = False) -> list:
        """The inputs of `op` that vary (a write's handle, its first input, skipped)."""
        inputs = list(op.inputs)[1:] if skip_first else list(op.inputs)
        return [t for t in inputs if self.varies(t, op)]

    def source_of(self, tensor: tf.Tensor) -> tf.Tensor:
        """A source `tensor` varies from (searched back along varying ops)."""
        stack, seen = [tensor], set()
        while stack:
            current = stack.pop()
            if current in self.sources:
                return current
            if current in seen:
                continue
            seen.add(current)
            stack.extend(t for t in current.op.inputs if self.varies(t, current.op))
        return tensor


@dataclasses.dataclass(frozen=True)
class TemplateStep:
    """What `plan_writes` reads about the template graph (from the analysis).

    ops: every op, creation order; phase_of: op -> Phase value string ("forward",
    "backward", "apply", "other"); step_ops: the ops a training step runs;
    candidates: the ops the replicate pass would copy (per unit: forward; per
    replica: backward and apply ops of the step); batch_inputs: the batch tensors;
    gradients: the recorded gradient tensors (values and indices of sparse ones);
    merged: tensors whose merged value EPL builds (the losses, the members of EPL's
    merge collections); update_ops: the ops of tf.GraphKeys.UPDATE_OPS;
    metric_variables: the variable ops of tf.GraphKeys.METRIC_VARIABLES.
    """

    ops: list
    phase_of: dict
    step_ops: set
    candidates: set
    batch_inputs: list
    gradients: set
    merged: set
    update_ops: set
    metric_variables: set


def template_sources(step: TemplateStep) -> set:
    """The template's varying tensors: the non-constant batch inputs, the outputs of
    the random ops and iterator reads the units copy, and of unseeded random ops in
    the updates (module docstring)."""
    sources = {t for t in step.batch_inputs if t.op.type != "Const"}
    for op in step.candidates:
        phase = step.phase_of.get(op)
        if phase == "forward" and (is_random(op) or op.type in _ITERATOR_TYPES):
            sources.update(op.outputs)
        elif phase == "apply" and is_random(op) and not is_seeded(op):
            sources.update(op.outputs)
    return sources


def plan_writes(step: TemplateStep) -> WritePlan:
    """Decide, for every write the training graph's copies would run, how it stays the
    same on every replica (module docstring). Reads the graph, changes nothing."""
    sources = template_sources(step)

    def reduced(tensor, consumer):   # an update reads the reduced gradient
        return tensor in step.gradients and step.phase_of.get(consumer) == "apply"

    everything = _Flow(sources, blocked=reduced)
    writes = [op for op in step.ops if (op in step.candidates or op in step.step_ops)
              and written_variable(op) is not None]
    varying = [w for w in writes if everything.varying_inputs(w, skip_first=True)]
    plan = WritePlan()
    plan.shared_variables, plan.per_unit = _shared_accumulators(step)
    shared_writes = [w for w in writes + sorted(plan.per_unit, key=lambda o: o._id)
                     if written_variable(w) in plan.shared_variables]
    cut = set(step.merged) | {t for w in shared_writes for t in w.outputs}
    through_cut = _Flow(sources, cut=cut, blocked=reduced)
    for write in shared_writes:
        plan.decisions.append(WriteDecision(write, written_variable(write),
                                            WriteKind.SHARED_ACCUMULATOR, write in step.step_ops))
    plan.after_reads = _after_reads(step, shared_writes, everything, through_cut)
    for write in varying:
        if written_variable(write) in plan.shared_variables:
            continue
        plan.decisions.append(_decide(step, write, everything, through_cut))
    for decision in plan.decisions:
        if decision.kind in (WriteKind.MERGED_INPUTS, WriteKind.MOVING_STATISTIC):
            (plan.apply_ops if decision.in_step else plan.other_ops).update(decision.cone)
    summaries = {op for op in step.candidates if op.type in SUMMARY_TYPES}
    plan.not_copied = plan.other_ops | plan.after_reads | _feedable(step) | summaries
    return plan


def _feedable(step: TemplateStep) -> set:
    """The placeholders the units would copy that are no batch input (every copy reads
    the one the user feeds), with what only their defaults need."""
    kept = {op for op in step.candidates if op.type in _PLACEHOLDER_TYPES
            and not any(t in step.batch_inputs for t in op.outputs)}
    stack = [t.op for op in kept for t in op.inputs]
    while stack:
        op = stack.pop()
        if op in kept or op not in step.candidates:
            continue
        if all(c in kept for t in op.outputs for c in t.consumers()):
            kept.add(op)
            stack.extend(t.op for t in op.inputs)
    return kept


def _shared_accumulators(step: TemplateStep) -> tuple[set, set]:
    """(metric variables the units add into, their adds the units do not copy yet).

    A metric variable every write of which the units would run adds (its initializer
    and resets, run on their own, write the one variable), one of them a forward op
    (copied per unit): a total and its count alike. An add of the count of a constant number of
    rows is no forward op (it reads no batch), but waits for the forward values it
    counts (tf.compat.v1.metrics' `control_dependencies([values])`): it is copied per
    unit too, so the count covers every unit's rows."""
    by_variable: dict = {}
    for op in step.ops:
        variable = written_variable(op)
        if variable is not None and variable in step.metric_variables:
            by_variable.setdefault(variable, []).append(op)
    forward = {op for op in step.candidates if step.phase_of.get(op) == "forward"}
    shared, extra = set(), set()
    for variable, ops in by_variable.items():
        waits = [op for op in ops if op not in step.candidates and op.type in ADD_TYPES and any(
            p in forward for p in [t.op for t in op.inputs] + list(op.control_inputs))]
        copied = [op for op in ops if op in step.candidates] + waits
        # its initializer and resets (assigns run on their own) are no units' writes
        if copied and all(op.type in ADD_TYPES for op in copied) \
                and (any(op in forward for op in copied) or waits):
            shared.add(variable)
            extra.update(waits)
    return shared, extra


def _after_reads(step: TemplateStep, shared_writes: list, everything: _Flow,
                 through_cut: _Flow) -> set:
    """The copied ops that vary only through the outputs of shared adds (a metric's
    update op on reference variables, which reads the AssignAdd's ref)."""
    after, stack = set(), [c for w in shared_writes for t in w.outputs for c in t.consumers()]
    while stack:
        op = stack.pop()
        if op in after or op not in step.candidates or op not in everything.ops \
                or op in through_cut.ops or written_variable(op) is not None:
            continue
        after.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
    return after


def _decide(step: TemplateStep, write: tf.Operation, everything: _Flow,
            through_cut: _Flow) -> WriteDecision:
    variable, in_step = written_variable(write), write in step.step_ops
    if not through_cut.varying_inputs(write, skip_first=True):
        cone = _cone(write, everything, through_cut)
        outside = _read_outside(step, cone, write)
        if outside is None:
            merged = tuple(sorted({t for op in cone for t in op.inputs
                                   if t in step.merged and t.op in everything.ops},
                                  key=lambda t: (t.op._id, t.value_index)))
            return WriteDecision(write, variable, WriteKind.MERGED_INPUTS, in_step,
                                 tuple(sorted(cone, key=lambda o: o._id)), merged)
        return WriteDecision(write, variable, WriteKind.REFUSED, in_step,
                             source=outside.outputs[0] if outside.outputs else None,
                             reason=f"it reads {outside.name}, computed from a merged value "
                                    "but also used by the model on each replica")
    if write in step.update_ops and len(write.inputs) == 2 \
            and step.phase_of.get(write.inputs[1].op) == "forward":
        return WriteDecision(write, variable, WriteKind.MOVING_STATISTIC, in_step, (write,),
                             value=write.inputs[1])
    varying = through_cut.varying_inputs(write, skip_first=True)
    source = through_cut.source_of(varying[0])
    return WriteDecision(write, variable, WriteKind.REFUSED, in_step, source=source,
                         reason=_describe_source(source))


def _cone(write: tf.Operation, everything: _Flow, through_cut: _Flow) -> set:
    """The write and the ops it reads through data edges that vary only through
    merged tensors (what runs once per replica with it)."""
    cone, stack = set(), [write]
    while stack:
        op = stack.pop()
        if op in cone:
            continue
        cone.add(op)
        stack.extend(t.op for t in op.inputs if everything.varies(t, op)
                     and t.op in everything.ops and t.op not in through_cut.ops
                     and t not in through_cut.cut)
    return cone


def _read_outside(step: TemplateStep, cone: set, write: tf.Operation) -> tf.Operation | None:
    """An op of the cone (not the write) whose value a copied op outside the cone also
    reads (it cannot run once per replica), or None."""
    for op in cone:
        if op is write:
            continue
        for tensor in op.outputs:
            if any(c in step.candidates and c not in cone for c in tensor.consumers()):
                return op
    return None


def _describe_source(source: tf.Tensor) -> str:
    if source.op.type in _ITERATOR_TYPES or source.op.type in _PLACEHOLDER_TYPES \
            or source.op.type == "Const":
        return f"its value is computed from the batch input {source.name}"
    if is_random(source.op):
        return (f"its value is computed from the random op {source.op.name} "
                f"({source.op.type}), which draws other numbers on each replica")
    return f"its value is computed from {source.name}, which differs per replica"


@dataclasses.dataclass(frozen=True)
class Violation:
    """A write of the rewritten graph that reads a value that differs per replica."""

    op: tf.Operation
    variable: tf.Operation
    source: tf.Tensor


def varying_writes(graph: tf.Graph, sources, clean, replicated: set, unit_copies: set,
                   excluded: set, allowed: set) -> list[Violation]:
    """The writes of the rewritten `graph` that read a value varying per replica.

    sources: the tensors that differ per unit (every unit's batch, the outputs of
    random ops the units draw); clean: tensors the same on every replica besides
    the collectives' outputs (merged values). replicated: every copy of every
    mirrored variable (their writes are checked); unit_copies: the ops the passes
    copied per unit or replica (their writes of any other variable are checked
    too); excluded: ops no run executes (the template the units were copied from);
    allowed: writes that may read varying values (shared accumulators' adds).
    """
    stops = set(clean) | {t for op in graph.get_operations()
                          if op.type in CONSISTENT_COLLECTIVE_TYPES or is_reduction_to_one_device(op)
                          for t in op.outputs}
    flow = _Flow([t for t in sources if t not in stops], cut=stops)
    found = []
    for op in graph.get_operations():
        variable = written_variable(op)
        if variable is None or op in excluded or op in allowed:
            continue
        if variable not in replicated and op not in unit_copies:
            continue
        varying = flow.varying_inputs(op, skip_first=True)
        if varying:
            found.append(Violation(op, variable, flow.source_of(varying[0])))
    return found


def varying_tensor(tensor: tf.Tensor, templates: set, limit: int = 100000) -> bool:
    """True if fetching `tensor` runs a template op (an op the units were copied
    from: it computes replica 0's value only). templates: the template ops."""
    stack, seen = [tensor.op], set()
    while stack and len(seen) < limit:
        op = stack.pop()
        if op in templates:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False
