"""Analysis of an annotated training graph: phases, TaskGraphs, what to replicate.

`analyze(graph, record)` reads the graph (never op names) and the record of what
construction and gradient time saw (epl/ir/record.py), and returns a
`TrainingView`: the TaskGraph and Phase of every op, the ops one training step
runs, the batch inputs to slice, the variables to mirror and the ops that make
up one replica of the model. Passes read the view; they do not recompute it.

Rules, in the order they are applied:
- The training step is every op the recorded train ops need (data and control
  inputs, transitively).
- Phase: ops created by compute_gradients are "backward", by apply_gradients
  "apply" (both tagged at gradient time). Ops that process gradients between
  the two (clipping, scaling) are "apply" too. Batch inputs and everything they
  are computed from (the input pipeline) are "other". The remaining ancestors of
  the losses, and every op computed from a batch input (metrics), are
  "forward", and so are the writes GraphRecord.forward_writes lists (state a traced
  step advances in its forward pass, such as Keras 3's dropout seeds, recorded by
  epl/hooks/function.py) and what every forward write (a moving average) computes
  its value from: the read of the old value is each replica's. Everything else
  (initializers, savers, summaries of weights) is "other".
- Batch inputs: outputs of tf.data iterators, placeholders of known rank >= 1,
  and constants of rank >= 1 whose first dimension is the global batch size and
  which feed an op as data (not as a shape, axis or index argument, as read
  from the consumer's OpDef).
- TaskGraph: a backward or apply op colocated with another op takes that op's
  TaskGraph (its forward op or its variable), even when it was built inside
  another scope (minimize() called inside the last pipeline stage's scope);
  otherwise the scope's attribute where set; an untagged op of another phase
  takes the TaskGraph of the op it is colocated with; an untagged forward op
  takes the latest TaskGraph among its inputs, and a backward or apply op with
  control inputs only (autodiff's gate NoOps under GATE_OP) the latest among
  those; anything else takes the first
  replicated TaskGraph, except a variable whose training-step updates all belong
  to one other TaskGraph (a custom optimizer's slots, created outside every scope
  in its apply_gradients): it and the ops that take its handle belong to that one.
- Variables: those the replicated ops read are mirrored per replica (`variables`),
  except the shared accumulators of the consistency analysis (the variables of
  tf.GraphKeys.METRIC_VARIABLES), which stay one variable every replica adds into.
- Split TaskGraphs (epl.split, rewritten at gradient time by
  epl/passes/split/split.py): their forward ops ("split ops") run once over the
  global batch, on their own devices, and are not copied per replica; the
  variables they read (the shards) are not mirrored, and the updates of those
  variables ("split apply ops": apply ops that take such a variable) run once.
  Ops the split pass replaced (attr `_epl_split_replaced`) never run: phase
  "other".
"""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as c_api

from epl.errors import ParallelizeError
from epl.graph_keys import merge_requests
from epl.ir.annotations import (PHASE_ATTR, SPLIT_REPLACED_ATTR, TASKGRAPH_ATTR, Phase, StrategyKind,
                                StrategySpec)
from epl.ir.clone import COLOCATION_ATTR
from epl.ir.consistency import TemplateStep, WritePlan, plan_writes
from epl.ir.consistency import written_variable as variable_written  # noqa: F401 (public)
from epl.ir.record import GraphRecord
from epl.ir.taskgraph import TaskGraph

COLOCATION_PREFIX = b"loc:@"  # a `_class` entry naming the op to colocate with
VARIABLE_OP_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
ITERATOR_OUTPUT_TYPES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})
PLACEHOLDER_TYPES = frozenset({"Placeholder", "PlaceholderWithDefault"})
# TF1 control flow: ops inside while_loop/cond frames cannot be copied op by op.
CONTROL_FLOW_V1_TYPES = frozenset({"Enter", "Exit", "NextIteration", "Switch", "Merge",
                                   "RefEnter", "RefExit", "RefSwitch", "RefMerge", "LoopCond"})
# OpDef type attributes of arguments that hold shapes, axes or indices of a
# layout rather than data; a constant fed only into these is not a batch input.
SHAPE_LIKE_TYPE_ATTRS = frozenset({"Tshape", "Tidx", "Tmultiples", "Tpaddings", "Taxis", "Tperm",
                                   "Tdim", "Index", "index_type", "Tblock_shape", "Tcrops",
                                   "Tlen", "Tsplits", "Tshift", "out_idx"})
IMPLICIT_SPEC = StrategySpec(StrategyKind.REPLICATE, 1, "default")


@dataclasses.dataclass
class TrainingView:
    """What the passes need to know about a training graph.

    taskgraphs: TaskGraphs in creation (stage) order.
    taskgraph_of / phase_of: per op.
    step_ops: ops one training step runs (ancestors of the train ops).
    replica_ops: ops that make up one replica (copied per replica), creation order.
    batch_inputs: tensors holding the global batch (sliced over replicas).
    global_batch_size: static size of their first dimension, or None if dynamic.
    variables: variable ops read by replica ops (mirrored per replica).
    losses: the losses passed to compute_gradients.
    gradients: (gradient tensor, variable op) for every trainable gradient.
    train_ops: the ops apply_gradients returned.
    split_taskgraphs: the epl.split TaskGraphs (not in `taskgraphs`, which are
      the replicated ones, in stage order).
    split_ops: forward ops of split TaskGraphs (run once, not copied).
    split_apply_ops: apply ops that update a variable of a split op (run once).
    split_variables: variables read by split ops (the shards; not mirrored).
    split_records: the split pass's SplitRecord of each split TaskGraph (from the record).
    writes: how each write that reads a per-replica value stays consistent
      (epl/ir/consistency.py); its decisions are applied to the phases, the
      replica ops and the variables above.
    write_orders: (read, write) pairs: a hand-written update of a variable
      (`global_step.assign(global_step + 1)` beside a step whose learning rate
      reads the global step) and a read of it the step runs, built before it, that
      nothing orders against it. The annotate pass makes each write wait for its
      reads (`_unordered_reads`).
    tags: op -> OpTags, its attributes as analysis read them (before any pass).
    """

    graph: tf.Graph
    taskgraphs: list[TaskGraph]
    taskgraph_of: dict[tf.Operation, TaskGraph]
    phase_of: dict[tf.Operation, Phase]
    step_ops: set[tf.Operation]
    replica_ops: list[tf.Operation]
    batch_inputs: list[tf.Tensor]
    global_batch_size: int | None
    variables: list[tf.Operation]
    losses: list[tf.Tensor]
    gradients: list[tuple[tf.Tensor, tf.Operation]]
    train_ops: list[tf.Operation]
    steps: list = dataclasses.field(default_factory=list)
    split_taskgraphs: list = dataclasses.field(default_factory=list)
    split_ops: list = dataclasses.field(default_factory=list)
    split_apply_ops: list = dataclasses.field(default_factory=list)
    split_variables: list = dataclasses.field(default_factory=list)
    tags: dict = dataclasses.field(default_factory=dict)
    split_records: list = dataclasses.field(default_factory=list)
    writes: WritePlan = dataclasses.field(default_factory=WritePlan)
    write_orders: list = dataclasses.field(default_factory=list)

    def describe_op(self, op: tf.Operation) -> str:
        """One line naming an op for error messages: name, type, shape, TaskGraph, device."""
        shape = op.outputs[0].shape if op.outputs else "()"
        taskgraph = self.taskgraph_of.get(op)
        return (f"{op.name} (type {op.type}, shape {shape}, TaskGraph "
                f"{taskgraph.name if taskgraph else '?'}, device {op.device or 'unset'})")


def ancestors(roots, include_control: bool = True) -> set[tf.Operation]:
    """Every op that `roots` (ops) need, including themselves."""
    seen: set[tf.Operation] = set(roots)
    stack = list(seen)
    while stack:
        op = stack.pop()
        for tensor in op.inputs:
            producer = tensor.op
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
        if include_control:
            for producer in op.control_inputs:
                if producer not in seen:
                    seen.add(producer)
                    stack.append(producer)
    return seen


def descendants(tensors, within: set | None = None) -> set[tf.Operation]:
    """Ops computed from `tensors` through data edges (optionally within a set)."""
    seen: set[tf.Operation] = set()
    stack = [c for t in tensors for c in t.consumers()]
    while stack:
        op = stack.pop()
        if op in seen or (within is not None and op not in within):
            continue
        seen.add(op)
        stack.extend(c for out in op.outputs for c in out.consumers())
    return seen


def successors(starts, outside: frozenset | set = frozenset()) -> set[tf.Operation]:
    """`starts` and every op reachable from them through data and control edges,
    not through the ops in `outside`."""
    seen = set(starts)
    stack = list(seen)
    while stack:
        op = stack.pop()
        for successor in [c for out in op.outputs for c in out.consumers()] + op._control_outputs:
            if successor not in seen and successor not in outside:
                seen.add(successor)
                stack.append(successor)
    return seen


def predecessors(graph: tf.Graph) -> dict:
    """op -> the ops it reads (data inputs, then control inputs), in graph order.

    Read once and shared by the readers of one pass (the verify pass's checks, the
    unit_functions pass). Speed: the first
    read of `op.inputs` builds and caches a Tensor object per input (about
    7 us per op; the ops the passes import have none cached yet); where none
    is cached, the producers are read from the C graph instead (about 4 us).
    """
    op_of = graph._get_operation_by_tf_operation
    preds = {}
    for op in graph.get_operations():
        cached = getattr(op, "_inputs_val", None)
        data = ([t.op for t in cached] if cached is not None
                else [op_of(output.oper) for output in c_api.GetOperationInputs(op._c_op)])
        preds[op] = data + op.control_inputs
    return preds


def topological_order(ops) -> list[tf.Operation]:
    """`ops` ordered so that every op comes after the ops of the set it reads (data and
    control inputs); creation order where that allows. Creation order alone is not
    enough once a rewrite made an op read a newer one (the split pass rewires a
    user's op to the per-device ops it built)."""
    members = set(ops)
    order, done = [], set()
    for root in sorted(members, key=lambda op: op._id):
        if root in done:
            continue
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op in done:
                continue
            if expanded:
                done.add(op)
                order.append(op)
                continue
            stack.append((op, True))
            preds = [t.op for t in op.inputs] + list(op.control_inputs)
            for pred in sorted((p for p in preds if p in members and p not in done),
                               key=lambda p: -p._id):
                stack.append((pred, False))
    return order


class OpTags(NamedTuple):
    """The attributes analysis reads from one op's NodeDef.

    name / type: the op's name and type; taskgraph / phase: its
    `_epl_taskgraph` / `_epl_phase` strings (None where unset);
    split_replaced: the split pass replaced it; colocated_with: the name of the
    op it is colocated with (its `_class` attribute), None when it is its own
    colocation root.
    """

    name: str
    type: str
    taskgraph: str | None
    phase: str | None
    split_replaced: bool
    colocated_with: str | None


def read_tags(op: tf.Operation) -> OpTags:
    """Read `op`'s OpTags with one NodeDef read.

    Speed: every `op.node_def`, `op.get_attr` or `op.colocation_groups()` call
    serializes the op's NodeDef in TensorFlow (get_attr several us more), so
    analysis reads each NodeDef once here rather than once per attribute.
    """
    node = op.node_def
    attrs = node.attr
    taskgraph = attrs[TASKGRAPH_ATTR].s.decode() if TASKGRAPH_ATTR in attrs else None
    phase = attrs[PHASE_ATTR].s.decode() if PHASE_ATTR in attrs else None
    colocated = _colocated_name(node.name, attrs)
    return OpTags(node.name, node.op, taskgraph, phase, SPLIT_REPLACED_ATTR in attrs, colocated)


def _colocated_name(name: str, attrs) -> str | None:
    """The first colocation group of a NodeDef's attrs naming another op (what
    `Operation.colocation_groups()` lists, read from the `_class` attribute)."""
    if COLOCATION_ATTR not in attrs:
        return None
    for group in attrs[COLOCATION_ATTR].list.s:
        if group.startswith(COLOCATION_PREFIX):
            other = group[len(COLOCATION_PREFIX):].decode()
            if other != name:
                return other
    return None


def _op_named(graph: tf.Graph, name: str | None) -> tf.Operation | None:
    if name is None:
        return None
    try:
        return graph.get_operation_by_name(name)
    except KeyError:
        return None


def colocation_root(op: tf.Operation) -> tf.Operation | None:
    """The op `op` is colocated with (through its `_class` attr), if another one."""
    return _op_named(op.graph, _colocated_name(op.name, op.node_def.attr))


def input_args(op: tf.Operation) -> list:
    """(OpDef argument, how many of op's inputs it takes) for each input argument."""
    return _arg_widths(op, op.op_def.input_arg)


def output_args(op: tf.Operation) -> list:
    """(OpDef argument, how many of op's outputs it gives) for each output argument."""
    return _arg_widths(op, op.op_def.output_arg)


def _arg_widths(op: tf.Operation, args) -> list:
    widths = []
    for arg in args:
        if arg.number_attr:
            width = op.get_attr(arg.number_attr)
        elif arg.type_list_attr:
            width = len(op.get_attr(arg.type_list_attr))
        else:
            width = 1
        widths.append((arg, width))
    return widths


def input_arg_type_attr(op: tf.Operation, index: int) -> tuple[str, bool]:
    """(type_attr, is_fixed_int) of the OpDef argument behind input `index`."""
    position = 0
    for arg, width in input_args(op):
        if index < position + width:
            fixed_int = not arg.type_attr and not arg.type_list_attr and arg.type in (
                tf.int32.as_datatype_enum, tf.int64.as_datatype_enum)
            return arg.type_attr, fixed_int
        position += width
    return "", False


def _feeds_as_data(tensor: tf.Tensor) -> bool:
    for consumer in tensor.consumers():
        for index, inp in enumerate(consumer.inputs):
            if inp is tensor:
                type_attr, fixed_int = input_arg_type_attr(consumer, index)
                if type_attr not in SHAPE_LIKE_TYPE_ATTRS and not fixed_int:
                    return True
    return False


def _first_dim(tensor: tf.Tensor) -> int | None:
    shape = tensor.shape
    if shape.rank is None or shape.rank == 0:
        return None
    return shape[0]


def batch_input_words(batch_mode: str = "replica") -> str:
    """What EPL does with the batch inputs under `batch_mode` (io.batch_mode), for errors."""
    if batch_mode == "global":
        return ("EPL slices the worker's batch (io.batch_mode 'global') along the first "
                "dimension of")
    return ("each replica and micro-batch draws its own batch (io.batch_mode 'replica', the "
            "default) from")


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def find_batch_inputs(loss_ancestors: set[tf.Operation], batch_mode: str = "replica"
                      ) -> tuple[list[tf.Tensor], int | None]:
    """Return the batch input tensors among the loss's ancestors and the batch size.

    batch_mode (io.batch_mode) only words the error raised when they disagree."""
    ordered = sorted(loss_ancestors, key=lambda op: op._id)
    sources = []
    for op in ordered:
        if op.type in ITERATOR_OUTPUT_TYPES:
            sources.extend(t for t in op.outputs if t.shape.rank is None or t.shape.rank >= 1)
        elif op.type in PLACEHOLDER_TYPES and op.outputs[0].shape.rank not in (None, 0):
            sources.append(op.outputs[0])
    known = {d for d in (_first_dim(t) for t in sources) if d is not None}
    if len(known) > 1:
        listing = "; ".join(f"{t.name} {t.shape}" for t in sources)
        raise ParallelizeError(
            "the batch inputs disagree on the batch size (first dimension): "
            f"{listing}. {_capitalized(batch_input_words(batch_mode))} every placeholder or "
            "iterator output of rank >= 1 that feeds the loss; give them the same batch "
            "dimension, or feed per-example constants (like class weights) as tf.constant "
            "instead of placeholders.")
    consts = [op.outputs[0] for op in ordered if op.type == "Const"
              and _first_dim(op.outputs[0]) is not None and _feeds_as_data(op.outputs[0])]
    if not known:
        known = {_first_dim(t) for t in consts if t.shape.rank >= 2 and t.dtype.is_floating}
        if len(known) > 1:
            known = {max(known, key=lambda d: sum(_first_dim(t) == d for t in consts))}
    batch = known.pop() if known else None
    if batch is not None:
        sources.extend(t for t in consts if _first_dim(t) == batch)
    return sources, batch


def _resolve_taskgraphs(ops, taskgraphs: list, phase_of, tags) -> dict[tf.Operation, TaskGraph]:
    """TaskGraph of every op, following the rules in the module docstring.

    A variable that no rule places (created outside every scope and colocated with
    nothing: the slots BERT's AdamWeightDecayOptimizer creates with get_variable in its
    apply_gradients) but whose updates all belong to one TaskGraph (the stage of the
    parameter whose gradient they read) belongs to that TaskGraph, with the ops that
    take its handle: a second resolution with those variables as hints."""
    first = next(tg for tg in taskgraphs if tg.spec.kind != StrategyKind.SPLIT)
    resolved, defaulted = _resolve_once(ops, taskgraphs, phase_of, tags, first, {})
    hints = _updated_variable_hints(ops, phase_of, resolved, defaulted, first)
    if hints:
        resolved, _ = _resolve_once(ops, taskgraphs, phase_of, tags, first, hints)
    return resolved


def _resolve_once(ops, taskgraphs: list, phase_of, tags, first: TaskGraph, hints: dict
                  ) -> tuple[dict[tf.Operation, TaskGraph], set]:
    """(TaskGraph of every op, the ops no rule placed: they got `first`). hints:
    variable op -> its TaskGraph, for variables no rule places."""
    taskgraph_named = {tg.name: tg for tg in reversed(taskgraphs)}  # first of a name wins
    op_named = {op_tags.name: op for op, op_tags in tags.items()}
    resolved: dict[tf.Operation, TaskGraph] = {}
    defaulted = set()
    for op in ops:  # creation order: inputs and colocation roots come first
        taskgraph = None
        op_tags, phase = tags[op], phase_of.get(op)
        root = op_named.get(op_tags.colocated_with)
        if phase in (Phase.BACKWARD, Phase.APPLY):  # follows its forward op / variable
            taskgraph = resolved.get(root) if root is not None else None
        if taskgraph is None and op_tags.taskgraph:
            taskgraph = taskgraph_named.get(op_tags.taskgraph)
        if taskgraph is None and phase in (Phase.BACKWARD, Phase.APPLY, Phase.OTHER):
            taskgraph = resolved.get(root) if root is not None else None
        if taskgraph is None and hints:
            taskgraph = hints.get(op) or next(
                (hints[t.op] for t in op.inputs if t.op in hints), None)  # takes its handle
        if taskgraph is None:
            producers = [resolved[t.op] for t in op.inputs if t.op in resolved]
            if not op.inputs and phase in (Phase.BACKWARD, Phase.APPLY):
                # a gate with control inputs only (autodiff's `<op>_grad/tuple/group_deps`
                # NoOp under GATE_OP): it waits for ops of its own layer
                producers = [resolved[c] for c in op.control_inputs if c in resolved]
            if producers and phase != Phase.OTHER:
                taskgraph = max(producers, key=lambda tg: tg.index)
        if taskgraph is None:
            defaulted.add(op)
        resolved[op] = taskgraph or first
    return resolved, defaulted


def _updated_variable_hints(ops, phase_of, resolved, defaulted: set, first: TaskGraph) -> dict:
    """Variable op -> the one TaskGraph its training-step updates belong to, for the
    variables in `defaulted` (placed by no rule) whose updates all belong to one
    TaskGraph other than `first`."""
    writers: dict[tf.Operation, dict] = {}   # variable -> {id: TaskGraph} of its updates
    for op in ops:
        variable = variable_written(op) if phase_of.get(op) == Phase.APPLY else None
        if variable is not None and variable in defaulted:
            writers.setdefault(variable, {})[id(resolved[op])] = resolved[op]
    return {variable: next(iter(groups.values())) for variable, groups in writers.items()
            if len(groups) == 1 and next(iter(groups.values())) is not first}


def _forward_writes(writes, batch_region, tags) -> set:
    """The writes of state the forward pass advances (a moving average, a traced step's
    GraphRecord.forward_writes) and what they compute their values from (the read of
    the old value), less variables and the input pipeline: each unit reads and writes
    its own replica's copy."""
    if not writes:
        return set()
    return {op for op in ancestors(writes, include_control=False) if op not in batch_region
            and tags[op].type not in VARIABLE_OP_TYPES
            and tags[op].phase not in (Phase.BACKWARD.value, Phase.APPLY.value)}


def _classify_phases(ops, tags, step_ops, loss_ancestors, gradients, batch_region, batch_inputs,
                     steps, writes=()):
    phase_of: dict[tf.Operation, Phase] = {}
    tagged_phases = {Phase.BACKWARD.value: Phase.BACKWARD, Phase.APPLY.value: Phase.APPLY}
    recorded = {op for step in steps if step.from_gradients for op in step.backward_ops}
    for op in ops:
        op_tags = tags[op]
        if op_tags.split_replaced:
            phase_of[op] = Phase.OTHER
        elif op in recorded:      # the autodiff of a confirmed tf.gradients step
            phase_of[op] = Phase.BACKWARD
        elif op_tags.phase in tagged_phases:
            phase_of[op] = tagged_phases[op_tags.phase]
    processing = descendants([g for g, _ in gradients], within=step_ops)
    forward = loss_ancestors | descendants(batch_inputs)
    # writes the forward pass makes (a moving average): not an update, which is computed
    # from the gradients (an optimizer's own assign ops, untagged when its apply_gradients
    # is the script's)
    forward_writes = [op for op in forward if variable_written(op) is not None
                      and op not in processing
                      and tags[op].phase not in (Phase.BACKWARD.value, Phase.APPLY.value)]
    forward |= _forward_writes(list(writes) + forward_writes, batch_region, tags)
    for op in ops:
        # built by autodiff but computed before the loss: the accumulators v2 control
        # flow's gradient adds as inputs of the forward While (its intermediates)
        if phase_of.get(op) == Phase.BACKWARD and op in loss_ancestors:
            phase_of[op] = Phase.FORWARD
        if op in phase_of:
            continue
        if op in processing:
            phase_of[op] = Phase.APPLY
        elif op in batch_region:
            phase_of[op] = Phase.OTHER
        elif op in forward:
            phase_of[op] = Phase.FORWARD
        else:
            phase_of[op] = Phase.OTHER
    if any(step.derived_train_op for step in steps):
        _untagged_updates(phase_of, step_ops, batch_region, tags)
    return phase_of


def _untagged_updates(phase_of, step_ops, batch_region, tags) -> None:
    """Updates no hooked apply_gradients tagged (a custom optimizer's assign ops, a
    global step incremented by hand) and what they read (the optimizer's own slot
    variables, the variable's value, a learning-rate schedule) are the apply phase,
    so that every replica runs them on its own variables."""
    writers = [op for op in step_ops if variable_written(op) is not None
               and phase_of[op] in (Phase.OTHER, Phase.APPLY)]
    after, stack = set(writers), list(writers)   # ops that wait for an update: the group
    while stack:                                  # ops up to the train op
        for nxt in _consumers(stack.pop()):
            if nxt in step_ops and nxt not in after:
                after.add(nxt)
                stack.append(nxt)
    for op in (ancestors(writers) & step_ops) | after:
        if phase_of[op] == Phase.OTHER and op not in batch_region \
                and tags[op].type not in VARIABLE_OP_TYPES:
            phase_of[op] = Phase.APPLY


def _unordered_reads(phase_of, step_ops, tags) -> list:
    """(read, write) for each hand-written update of a variable in the apply phase (one
    no hooked apply_gradients tagged) and each apply-phase read of that variable the
    step runs that was built before the write and that nothing orders against it.

    TensorFlow leaves such a pair unordered: in BERT's optimization.py the learning
    rate decays with a read of the global step, which the script then increments by
    hand in a `tf.group` beside the optimizer's updates. Which runs first is up to
    TensorFlow's executor: single-device TensorFlow ran the read first on
    tests/bert_like.py's model and the increment first on a two-layer model
    (tests/api/test_training_steps.py), and a graph placed over several devices, or
    pruned per run, may differ from both; every update of a step that reads the
    incremented value uses the next step's learning rate. EPL keeps the order the
    script wrote them in, the order tf.function's automatic control dependencies
    keep: a read built before the write reads the value before it."""
    writes: dict = {}    # variable op -> its hand-written updates in the step
    reads: dict = {}     # variable op -> the apply-phase ops that take its handle
    for op in step_ops:
        if phase_of.get(op) != Phase.APPLY:
            continue
        variable = variable_written(op)
        if variable is not None and tags[op].phase != Phase.APPLY.value:
            writes.setdefault(variable, []).append(op)
        for tensor in op.inputs:
            if tensor.op.type in VARIABLE_OP_TYPES:
                reads.setdefault(tensor.op, []).append(op)
    pairs = []
    for variable, writers in writes.items():
        for write in writers:
            before = ancestors([write])
            after = descendants(write.outputs, within=step_ops)
            pairs.extend((read, write) for read in sorted(reads.get(variable, ()),
                                                          key=lambda op: op._id)
                         if read._id < write._id and read not in before and read not in after)
    return pairs


def calls_functions(op: tf.Operation) -> bool:
    """True for an op that runs functions of the graph's library (v2 control flow:
    If, While, their stateless forms, Case, PartitionedCall)."""
    return any(attr.type in ("func", "list(func)") for attr in op.op_def.attr)


def _check_control_flow(replica_ops, describe, tags) -> None:
    bad = [op for op in replica_ops if tags[op].type in CONTROL_FLOW_V1_TYPES]
    if bad:
        raise ParallelizeError(
            "the model uses TF1 control flow (tf.compat.v1.while_loop/cond frames), which EPL "
            "cannot copy per replica: " + "; ".join(describe(op) for op in bad[:5]) +
            ". Call tf.compat.v1.enable_control_flow_v2() before building the model.")


def _split_parts(step_region, split_tgs, taskgraph_of, phase_of, variable_ops):
    """(split ops, split apply ops, split variables) of the training step.

    variable_ops: the graph's variable ops the split pass did not replace.

    Split variables: the variables of split TaskGraphs (the shards, and what
    the optimizer colocated with them: slots, and Adam's beta powers when the
    first variable by name is a shard). They are not mirrored; every apply op
    that takes one of them (its update, its slots' updates, reads of the beta
    powers) runs once, and the replicas' update copies read the same values.
    """
    if not split_tgs:
        return [], [], []
    split_names = {tg.name for tg in split_tgs}
    split_ops = [op for op in step_region if phase_of[op] == Phase.FORWARD
                 and taskgraph_of[op].name in split_names]
    variables = [op for op in variable_ops if taskgraph_of[op].name in split_names]
    chosen = set(variables)
    apply_ops = [op for op in step_region if phase_of[op] == Phase.APPLY
                 and any(t.op in chosen for t in op.inputs)]
    return split_ops, apply_ops, variables


def _consumers(op: tf.Operation):
    for tensor in op.outputs:
        yield from tensor.consumers()
    yield from op._control_outputs


def derive_train_op(step) -> tf.Operation | None:
    """The op that runs a step's variable updates, found in the graph, or None when
    the step's gradients update no variable (then it is not a training step).

    For steps no hooked `apply_gradients` recorded: `tf.gradients` followed by
    an optimizer whose apply_gradients is its own assign ops (BERT's
    AdamWeightDecayOptimizer), or by clipping and any optimizer. The updates are
    the ops computed from the gradients that write a variable; the train op is
    the last-created op, among those nothing else consumes, that needs every
    update (typically the `tf.group` the script runs). Raises when no single op
    runs them all.
    """
    grads = []
    for grad, _ in step.grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            grads.extend([grad.values, grad.indices])
        elif grad is not None:
            grads.append(grad)
    updates = [op for op in descendants(grads) if variable_written(op) is not None]
    if not updates:
        return None
    after, stack = set(updates), list(updates)
    while stack:
        for nxt in _consumers(stack.pop()):
            if nxt not in after:
                after.add(nxt)
                stack.append(nxt)
    sinks = [op for op in after if next(_consumers(op), None) is None]
    needed = set(updates)
    covering = [op for op in sinks if needed <= ancestors([op])]
    if not covering:
        raise ParallelizeError(
            f"the gradients of loss {step.loss.name} update variables "
            f"({', '.join(sorted(variable_written(op).name for op in updates)[:5])}) but no "
            "single op runs every update, so EPL cannot tell which op is the training step. "
            "Group the updates into one op (tf.group) and run that op.")
    return max(covering, key=lambda op: op._id)


def training_steps(record: GraphRecord):
    """The recorded steps that train (a train op recorded by apply_gradients, or found
    in the graph for a step recorded from tf.gradients or whose optimizer overrides
    apply_gradients); error if there are none."""
    steps = []
    for step in record.train_steps:
        if step.loss is None:
            continue
        if step.train_op is None:
            train_op = derive_train_op(step)
            if train_op is None:
                continue
            step.train_op, step.derived_train_op = train_op, True
        steps.append(step)
    if not steps:
        seen = [s for s in record.train_steps if s.loss is not None]
        raise ParallelizeError(
            "the graph has EPL strategy annotations but no training step: EPL parallelizes "
            "the step that updates trainable variables from gradients (Optimizer.minimize, "
            "compute_gradients or tf.gradients, then apply_gradients or assign ops)"
            + (f"; the gradients recorded ({', '.join(s.loss.name for s in seen[:3])}) "
               "update no variable" if seen else "; no gradients were built")
            + ". Build the training step before creating the session or calling "
            "epl.parallelize(); an inference-only graph needs no EPL scopes."
            + (LEGACY_KERAS_FIT if not seen and "tf_keras" in sys.modules else ""))
    return steps


# tf-keras (legacy Keras) in graph mode: EPL parallelizes when fit (or train_on_batch)
# builds the training step, and moves the sessions opened before onto the rewritten
# graph (epl/hooks/legacy_keras.py). A session the script opens itself after building
# the model under the scopes and before fit is the one case that cannot wait.
LEGACY_KERAS_FIT = (
    " If this is a tf-keras (legacy Keras) model in graph mode: EPL parallelizes it when "
    "fit or train_on_batch builds the training step. Open your own session before building "
    "the model (tf.compat.v1.keras.backend.set_session), or leave the session to Keras.")


def has_training_step(record: GraphRecord) -> bool:
    """True if a recorded step trains (see `training_steps`); its problems, if any,
    are reported by analysis."""
    for step in record.train_steps:
        if step.loss is None:
            continue
        if step.train_op is not None:
            return True
        try:
            if derive_train_op(step) is not None:
                return True
        except ParallelizeError:
            return True
    return False


def _plan_writes(graph, ops, phase_of, step_ops, replica_ops, batch_inputs, losses,
                 gradients) -> WritePlan:
    """How each write the copies would run stays consistent (epl/ir/consistency.py);
    the plan's phases are written into `phase_of`."""
    grads = set()
    for grad, _ in gradients:
        grads.update([grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad])
    update_ops = {item if isinstance(item, tf.Operation) else item.op
                  for item in graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
                  if isinstance(item, (tf.Operation, tf.Tensor))}
    metric_variables = {item.op for item in graph.get_collection(
        tf.compat.v1.GraphKeys.METRIC_VARIABLES) if hasattr(item, "op")}
    merged = set(losses) | set(merge_requests(graph))
    plan = plan_writes(TemplateStep(ops, {op: phase.value for op, phase in phase_of.items()},
                                    step_ops, set(replica_ops), list(batch_inputs), grads,
                                    merged, update_ops, metric_variables))
    for op in plan.apply_ops:
        phase_of[op] = Phase.APPLY
    for op in plan.other_ops | plan.after_reads:
        phase_of[op] = Phase.OTHER
    for op in plan.per_unit:
        phase_of[op] = Phase.FORWARD
    return plan


def analyze(graph: tf.Graph, record: GraphRecord, taskgraphs: list | None = None,
            batch_mode: str = "replica") -> TrainingView:
    """Build the TrainingView of `graph` from its `record`; raises ParallelizeError on
    bad input (worded for `batch_mode`, io.batch_mode).

    taskgraphs: the TaskGraphs to analyse with (default: the record's; the automatic
    stages hand theirs). A model with no replicated TaskGraph gets the implicit
    `epl.replicate(1)` (ops outside any scope) in the view; the record is unchanged.
    """
    steps = training_steps(record)
    taskgraphs = list(record.taskgraphs if taskgraphs is None else taskgraphs)
    if not any(tg.spec.kind != StrategyKind.SPLIT for tg in taskgraphs):
        # ops outside any scope: the default strategy
        taskgraphs.append(TaskGraph(index=len(taskgraphs), spec=IMPLICIT_SPEC))
    ops = graph.get_operations()
    tags = {op: read_tags(op) for op in ops}
    losses = [s.loss for s in steps]
    train_ops = [s.train_op for s in steps]
    gradients = [(g, v.op) for s in steps for g, v in s.grads_and_vars if g is not None]
    step_ops = ancestors(train_ops)
    loss_ancestors = ancestors([t.op for t in losses])
    batch_inputs, batch = find_batch_inputs(loss_ancestors, batch_mode)
    if not batch_inputs:
        raise ParallelizeError(
            f"no batch input feeds the loss: {batch_input_words(batch_mode)} tf.data iterator "
            "outputs, placeholders of rank >= 1, or constants whose first dimension is the "
            "batch. Feed the examples through one of these.")
    batch_region = ancestors([t.op for t in batch_inputs])
    phase_of = _classify_phases(ops, tags, step_ops, loss_ancestors, gradients, batch_region,
                                batch_inputs, steps, record.forward_writes)
    taskgraph_of = _resolve_taskgraphs(ops, taskgraphs, phase_of, tags)
    variable_ops = [op for op in ops if tags[op].type in VARIABLE_OP_TYPES]
    step_region = [op for op in ops
                   if tags[op].type not in VARIABLE_OP_TYPES and op not in batch_region and (
                       phase_of[op] == Phase.FORWARD or (
                           phase_of[op] in (Phase.BACKWARD, Phase.APPLY) and op in step_ops))]
    split_tgs = [tg for tg in taskgraphs if tg.spec.kind == StrategyKind.SPLIT]
    split_ops, split_apply, split_variables = _split_parts(
        step_region, split_tgs, taskgraph_of, phase_of, [op for op in variable_ops
                                                         if not tags[op].split_replaced])
    single = set(split_ops) | set(split_apply)
    replica_ops = [op for op in step_region if op not in single]
    writes = _plan_writes(graph, ops, phase_of, step_ops, replica_ops, batch_inputs, losses,
                          gradients)
    replica_ops = [op for op in replica_ops if op not in writes.not_copied] + sorted(
        writes.per_unit - set(replica_ops), key=lambda op: op._id)
    replica_set = set(replica_ops)
    variables = [op for op in variable_ops if op not in writes.shared_variables
                 and any(c in replica_set for out in op.outputs for c in out.consumers())]
    replicated_tgs = [tg for tg in taskgraphs if tg.spec.kind != StrategyKind.SPLIT]
    view = TrainingView(graph, replicated_tgs, taskgraph_of, phase_of, step_ops,
                        replica_ops, batch_inputs, batch, variables, losses, gradients, train_ops,
                        steps, split_tgs, split_ops, split_apply, split_variables, tags,
                        list(record.splits), writes)
    if any(step.derived_train_op for step in steps):
        view.write_orders = _unordered_reads(phase_of, step_ops, tags)
    _check_control_flow(replica_ops, view.describe_op, tags)
    return view
