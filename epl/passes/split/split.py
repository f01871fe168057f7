"""Tensor and expert parallelism: the split pass (runs at gradient time).

docs/architecture.md, "Data flow", step 2: when the optimizer's compute_gradients is
called, the forward graph is finished but has no gradients yet. This pass
rewrites, for every `epl.split(k)` TaskGraph, the ops of that TaskGraph on the
path to the loss into per-device ops on the TaskGraph's k devices ("slots");
autodiff then runs on the rewritten graph, so every gradient follows its
shard. At parallelize time the replicate pass connects the split ops to the
data-parallel replicas (epl/passes/replication/replicate.py, "split TaskGraphs").

How it works: sharding propagation in creation order. Every tensor of the
region has a layout:
- full (the tensor as the single-device graph computes it; the default),
- `Sharded(parts, axis, sizes)`: slot j holds the slice j along `axis`,
- `Partial(parts)`: slot j holds a full-shaped partial sum; the value is the sum,
- `Pending(variable)`: the read of a variable created in the region, not yet
  sharded; the first op that needs it sharded decides the axis ("the axis the
  layer needs") and the variable becomes a ShardedVariable
  (epl/checkpoint/sharded_variable.py; the user's variable object becomes a view that
  reads the full value from the shards).
The region: the TaskGraph's ops on the path to the loss, and the ops built
outside every scope that follow it (their latest input TaskGraph is this one,
as graph_view resolves them: a loss or weight decay added after the split
part). Its variables: those created under the scope, and those created under
another split scope on the same devices and used only here (weights built in
a layer's build() under one epl.split and used in its call() under another,
as FastNN's MoE layer does). Reads of a sharded variable anywhere else (off
the path, or in a replicated part) read the shards concatenated.
A rule, registered per op type (`@rule("MatMul")`), maps the input layouts of
one op to per-slot ops and output layouts. An op whose inputs are all full is
left alone. An op with a sharded input and no rule (or a rule that does not
cover that combination) is not split: its sharded inputs are gathered into the
full tensor first, and the pass warns, naming the op and its type (the
"fallbacks" in the record). Where a sharded or partial tensor is read outside
the rewritten ops (the loss outside the scope, a metric) it is gathered
(concat) or summed there. Rules:
- MatMul: a column-split weight (input full, output sharded on its last axis);
  a row-split weight (input sharded on the contracted axis, output partial:
  the one collective of a column layer followed by a row layer).
- BatchMatMulV2/V3 with an [experts, m, n] weight: the weight is split along
  its expert axis (the expert count must be divisible by k), the input is
  sliced along the same experts (dispatch), the output stays sharded by
  expert and is concatenated back where it leaves the region (combine). With
  data-parallel replicas around it the replicate pass turns the dispatch and
  the combine into all-to-all exchanges.
- BiasAdd and elementwise ops on sharded tensors (biases and scales are split
  along with the tensor they are added to); sums of partial tensors; a
  Reshape that keeps the sharded last axis whole ([N, V] -> [B, S, V]).
- GatherV2/ResourceGather (embedding lookup) with a vocabulary-split table:
  each id is looked up on the shard that owns it (dynamic partition and
  stitch, so sparse gradients touch only real rows).
- SparseSoftmaxCrossEntropyWithLogits / SoftmaxCrossEntropyWithLogits over
  vocabulary-split logits: distributed max and sum of exponentials and the
  label logit from the shard that owns it; the logits are never gathered.
- Einsum (tf.einsum), by equation labels: the split label is the label a
  sharded operand is split along, or, for a variable no rule has sharded yet,
  the label it shares with another operand and the output (the expert axis:
  "egcm,emh->egch" splits e, whole experts per device, the tokens sliced to
  match: the dispatch), else its first label only it and the output have (a
  column split: "bsd,dh->bsh" splits h, "bsd,dnh->bsnh" splits the heads n).
  Operands with the label are split along it, the others read whole on every
  device; the output is sharded along the label when it keeps it and partial
  sums when the label is contracted (the expert combine "gsec,egcm->gsm", a
  row split "bsh,hd->bsd", an attention output projection "bqnh,nhd->bqd").
  An einsum of partial sums with whole operands stays partial (it is linear).
- Softmax / LogSoftmax over rows split along another axis (attention scores
  split by heads); L2Loss of a split tensor or weight (weight decay): partial
  sums of squares.

A variable created under epl.split that no rule shards (a bias added to the
summed result of a row-split layer, a weight read only by ops without a rule,
or only outside the scope) stays whole on the first device, with a
`SplitUnshardedVariableWarning` (a SplitFallbackWarning, also logged to the
"epl" logger) naming it and why (the record's `unsharded`).

Shard sizes come from the split plan (`SplitPlan`): even by default, or
capability-weighted (epl.planner.planner.local_shard_weights) when device
profiles say the devices differ. The pass records what it built on the graph's
state (`SplitRecord`): the sharded variables, the dispatch slices and combine
concats the replicate pass rewires, the replaced ops, the fallbacks and the
variables kept whole.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import tensorflow as tf

from epl.checkpoint.sharded_variable import shard_existing
from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import SHARD_ATTR, SPLIT_REPLACED_ATTR, TASKGRAPH_ATTR
from epl.ir.clone import clone_op, replace_input
from epl.ir.graph_view import VARIABLE_OP_TYPES, ancestors, descendants, find_batch_inputs
from epl.ir.record import GraphRecord
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.planner.plan import SplitPlan
from epl.planner.worker_planner import WorkerPlanner

# Set on every op the split pass replaced (it stays in the graph, never runs).
_LOG = logging.getLogger(__name__)


class SplitFallbackWarning(UserWarning):
    """An op inside epl.split has no rule for its sharded input; it runs unsplit."""


class SplitUnshardedVariableWarning(SplitFallbackWarning):
    """A variable created under epl.split is not sharded: it stays whole on one device."""


# ops a variable's own construction adds (initialization, its first read)
_INIT_OP_TYPES = frozenset({"AssignVariableOp", "Assign", "VarIsInitializedOp",
                            "IsVariableInitialized", "ReadVariableOp", "Identity"})


# --------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Sharded:
    """Slot j holds slice j of the value along `axis` (extents `sizes`)."""

    parts: list
    axis: int
    sizes: tuple


@dataclasses.dataclass
class Partial:
    """Slot j holds a partial sum; the value is the sum over slots."""

    parts: list


@dataclasses.dataclass
class Full:
    """The value, recomputed by the pass (replaces the original tensor)."""

    tensor: tf.Tensor


@dataclasses.dataclass
class Pending:
    """The read of a region variable that no rule has sharded yet."""

    variable: object
    read: tf.Tensor


KEEP = object()  # a rule's answer: leave the op as it is (all of its inputs stay full)


@dataclasses.dataclass
class Slicer:
    """A dispatch slice: a slot reads `source`[offset:offset+size] along `axis`
    (and, for one chunk of a chunked dispatch, `chunk` = (axis, offset, size):
    the chunk's tokens along their capacity axis, `split.moe_chunks`)."""

    source: tf.Tensor
    axis: int
    offset: int
    size: int
    chunk: tuple | None = None


@dataclasses.dataclass
class SplitRecord:
    """What the split pass built for one split TaskGraph (kept on the GraphState).

    variables: full variable name -> ShardedVariable.
    slicers: slot tensor -> Slicer (dispatch: the replicate pass may feed the
      slot from every replica's rows directly, an all-to-all).
    gathers: full tensor -> (parts, axis) (combine: concat of the shards).
    replaced: ops the pass replaced (never run).
    ops: the ops the region runs (per-slot ops and ops left unsplit).
    fallbacks: "op (type)" of ops with a sharded input that ran unsplit.
    unsharded: "variable: why" for variables created in the TaskGraph that stay whole.
    """

    taskgraph: str
    plan: SplitPlan
    variables: dict = dataclasses.field(default_factory=dict)
    slicers: dict = dataclasses.field(default_factory=dict)
    gathers: dict = dataclasses.field(default_factory=dict)
    replaced: set = dataclasses.field(default_factory=set)
    ops: list = dataclasses.field(default_factory=list)
    fallbacks: list = dataclasses.field(default_factory=list)
    unsharded: list = dataclasses.field(default_factory=list)

    @property
    def spans_workers(self) -> bool:
        """The split group spans several workers (each holds some shards)."""
        return self.plan.spans_workers


# --------------------------------------------------------------------------
# the rule registry
# --------------------------------------------------------------------------

RULES: dict = {}


def rule(*op_types: str):
    """Register `fn(rewriter, op, layouts) -> [layout per output] | KEEP | None` for op types.

    layouts[i] is the layout of op.inputs[i] (None: full). None means the rule
    does not cover this combination (the op falls back to running unsplit).
    """
    def register(fn):
        for op_type in op_types:
            RULES[op_type] = fn
        return fn
    return register


def splittable_op_types() -> list[str]:
    """The op types the split pass has a rule for."""
    return sorted(RULES)


# --------------------------------------------------------------------------
# the rewriter
# --------------------------------------------------------------------------


class _Rewriter:
    """Rewrites one split TaskGraph's ops; the rules call back into it."""

    def __init__(self, graph: tf.Graph, taskgraph: str, plan: SplitPlan, host: str,
                 record: SplitRecord, variables: dict, communicator=None,
                 moe_chunks: int = 1):
        self.graph = graph
        self.moe_chunks = moe_chunks    # chunks of each expert dispatch (split.moe_chunks)
        # a group that spans every worker: its collectives include the other workers,
        # through the communicator's worker-level methods
        self.spanning = plan.spans_workers and communicator is not None and \
            communicator.num_workers > 1
        self.communicator = communicator
        self.variables = variables  # variable op -> tf.Variable, created in the TaskGraph
        self.taskgraph = taskgraph
        self.plan = plan
        self.k = len(plan.devices)
        self.host = host
        self.record = record
        self.layouts: dict = {}
        self.sharded: dict = {}     # variable op -> ShardedVariable
        self._full_cache: dict = {}
        self._name = ""
        self.readers: dict = {}     # variable op -> [(op, input layouts)] that read it in the walk

    # -- construction helpers ------------------------------------------------
    def attrs(self, slot: int | None) -> dict:
        values = {TASKGRAPH_ATTR: tf.compat.v1.AttrValue(s=self.taskgraph.encode())}
        if slot is not None:
            values[SHARD_ATTR] = tf.compat.v1.AttrValue(i=slot)
        return values

    @contextlib.contextmanager
    def on(self, slot: int):
        """Build on slot `slot`'s device, tagged with the TaskGraph and the slot."""
        with self.graph._attr_scope(self.attrs(slot)), tf.device(self.plan.devices[slot]), \
                tf.name_scope(f"{self._name}/EPL_SPLIT_{slot}/"):
            yield

    @contextlib.contextmanager
    def gathering(self, name: str):
        """Build a gather/reduce of the slots (on slot 0's device)."""
        with self.graph._attr_scope(self.attrs(None)), tf.device(self.plan.devices[0]), \
                tf.name_scope(f"{name}/EPL_SPLIT_GATHER/"):
            yield

    def offsets(self, sizes, full: int) -> list[int]:
        """Global start of each local slot along a dimension of `full` entries."""
        if not self.spanning:
            return [sum(sizes[:j]) for j in range(len(sizes))]
        return self.plan.offsets(full)

    def sum_slots(self, parts: list, name: str) -> tf.Tensor:
        """Sum over every slot of the group (local add, then over the workers).

        Across workers the result feeds a loss every worker computes alike, so
        the gradient of each worker's part is the gradient of the sum (identity),
        not its sum over the workers (Horovod's allreduce gradient).
        """
        with self.gathering(name):
            local = tf.add_n(parts) if len(parts) > 1 else parts[0]
            if not self.spanning:
                return local
            comm = self.communicator

            @tf.custom_gradient
            def replicated_sum(x):
                return comm.workers_all_reduce(x, "sum"), lambda dy: dy
            return replicated_sum(local)

    def max_slots(self, parts: list, name: str) -> tf.Tensor:
        """Max over every slot of the group (no gradient: used for stability only)."""
        with self.gathering(name):
            local = tf.stop_gradient(tf.reduce_max(tf.stack(parts), axis=0))
            if not self.spanning:
                return local
            return tf.stop_gradient(self.communicator.workers_all_reduce(local, "max"))

    def gather_batch(self, tensor: tf.Tensor) -> tf.Tensor:
        """Every worker's rows of a batch tensor (rank order), for a spanning group.

        Its gradient sums every worker's gradient and keeps this worker's rows
        (Horovod's own allgather gradient averages, which assumes each worker
        has its own loss; here every worker computes the same global loss).
        """
        key = ("batch", tensor)
        if key in self._full_cache:
            return self._full_cache[key]
        comm = self.communicator

        @tf.custom_gradient
        def gathered(x):
            def grad(dy):
                total = comm.workers_all_reduce(dy, "sum")
                rows = tf.shape(x)[:1]
                counts = comm.workers_all_gather(rows)
                start = tf.reduce_sum(counts[:comm.worker_rank])
                return total[start:start + rows[0]]
            return comm.workers_all_gather(x), grad
        with self.gathering(tensor.op.name):
            result = gathered(tensor)
        self._full_cache[key] = result
        return result

    def _refuse_across_workers(self, what: str) -> None:
        if self.spanning:
            raise ParallelizeError(
                f"epl.split over {self.plan.num_slots} devices spans several workers, and {what}; "
                "across workers EPL splits dense layers (column and row), their biases and "
                "elementwise ops, and the softmax cross-entropy over split logits, computed "
                "into a loss inside the split scope. Put that op outside the split scope, or "
                "use a split group within one worker (device_count <= its devices).")

    # -- layouts ---------------------------------------------------------------
    def value(self, layout, tensor: tf.Tensor) -> tf.Tensor:
        """The full value of an input (gathering a sharded or partial one)."""
        if layout is None:
            return tensor
        key = id(layout)
        if key in self._full_cache:
            return self._full_cache[key]
        if isinstance(layout, Full):
            result = layout.tensor
        elif isinstance(layout, Pending):
            sharded = self.sharded.get(layout.variable.op)
            if sharded is None:
                return layout.read
            self._refuse_across_workers(f"variable {sharded.name} would have to be gathered whole")
            parts = [shard.value() for shard in sharded.shards]
            result = self._concat(parts, sharded.axis, tensor)
        elif isinstance(layout, Sharded):
            self._refuse_across_workers(f"{tensor.name} (sharded) is read where the whole tensor "
                                        "is needed, so it would have to be gathered whole")
            result = self._concat(layout.parts, layout.axis, tensor)
        else:
            result = self.sum_slots(layout.parts, tensor.op.name)
        self._full_cache[key] = result
        return result

    def _concat(self, parts, axis, tensor) -> tf.Tensor:
        with self.gathering(tensor.op.name):
            result = tf.concat(parts, axis=axis)
        self.record.gathers[result] = (list(parts), axis)
        return result

    def shard_variable(self, pending: Pending, axis: int, sizes=None, what: str = "",
                       must_divide: bool = False) -> Sharded:
        """Shard a pending variable along `axis` (sizes from the plan unless given)."""
        var = pending.variable
        existing = self.sharded.get(var.op)
        if existing is not None:
            if existing.axis != axis or (sizes is not None and tuple(sizes) != existing.sizes):
                raise ParallelizeError(
                    f"variable {var.op.name} (shape {var.shape}) inside epl.split is used split "
                    f"along axis {existing.axis} and along axis {axis}; a split variable has "
                    "one layout. Use two variables, or move one use out of the split scope.")
            return Sharded([s.value() for s in existing.shards], axis, existing.sizes)
        dim = var.shape[axis]
        if sizes is None:
            sizes = self.plan.sizes(int(dim), what or f"dimension {axis} of variable "
                                    f"{var.op.name} (shape {var.shape.as_list()})", must_divide)
        elif (sum(sizes) != dim if not self.spanning else
              list(sizes) != self.plan.sizes(int(dim), "dimension")):
            raise ParallelizeError(
                f"variable {var.op.name} (shape {var.shape.as_list()}) must be split along axis "
                f"{axis} into {list(sizes)} to match its input, but that axis has {dim} entries.")
        sharded = shard_existing(var, axis, list(sizes), list(self.plan.devices), self.host,
                                 lambda j: self.attrs(j), self.offsets(list(sizes), int(dim)))
        self.sharded[var.op] = sharded
        self.record.variables[sharded.name] = sharded
        if pending.read.dtype != tf.resource:
            self.record.replaced.add(pending.read.op)
        parts = []
        for j, shard in enumerate(sharded.shards):
            with self.on(j):
                parts.append(shard.value())
        layout = Sharded(parts, axis, tuple(sizes))
        if pending.read.dtype != tf.resource:   # a value read: its readers get the shards
            self.layouts[pending.read] = layout
        return layout

    def slice(self, tensor: tf.Tensor, axis: int, sizes, extent: int | None = None,
              what: str = "") -> Sharded:
        """Slot j's slice of a full tensor along `axis` (a dispatch slice). extent: the
        axis's length where the tensor's static shape does not know it (a dynamic batch
        dimension read as the expert axis: the weight's expert count); what: the op,
        for the error when neither knows it."""
        rank = tensor.shape.rank
        parts = []
        offsets = self.offsets(list(sizes), _extent_of(tensor, axis, extent, what))
        for j, (size, offset) in enumerate(zip(sizes, offsets)):
            begin = [0] * rank
            extent = [-1] * rank
            begin[axis], extent[axis] = offset, size
            with self.on(j):
                part = tf.slice(tensor, begin, extent)
            self.record.slicers[part] = Slicer(tensor, axis, offset, size)
            parts.append(part)
        return Sharded(parts, axis, tuple(sizes))

    def slice_chunks(self, tensor: tf.Tensor, axis: int, sizes, chunk_axis: int,
                     what: str, full: int | None = None) -> list:
        """The chunked dispatch (`split.moe_chunks` = C > 1): slot j's slice of a
        full tensor along `axis`, cut into C equal chunks along `chunk_axis` (the
        tokens' capacity axis); one Sharded per chunk. Each chunk is its own
        slice (with data-parallel replicas, its own all-to-all), so the exchange
        of chunk c + 1 can run while the experts compute chunk c."""
        chunks = self.moe_chunks
        extent = _static_dim(tensor, chunk_axis)
        if extent is None or extent % chunks:
            raise ParallelizeError(
                f"split.moe_chunks={chunks} must divide the tokens' capacity axis "
                f"{chunk_axis} of {tensor.name} (shape {tensor.shape.as_list()}), the "
                f"input of {what}, which has {extent if extent is not None else 'an unknown'} "
                f"entries. Set split.moe_chunks to a divisor of {extent} (1: no chunks), "
                "or give the tokens a static capacity divisible by it.")
        rank = tensor.shape.rank
        step = extent // chunks
        offsets = self.offsets(list(sizes), _extent_of(tensor, axis, full, what))
        out = []
        for c in range(chunks):
            parts = []
            for j, (size, offset) in enumerate(zip(sizes, offsets)):
                begin, size_of = [0] * rank, [-1] * rank
                begin[axis], size_of[axis] = offset, size
                begin[chunk_axis], size_of[chunk_axis] = c * step, step
                with self.on(j):
                    part = tf.slice(tensor, begin, size_of, name=f"chunk_{c}")
                self.record.slicers[part] = Slicer(tensor, axis, offset, size,
                                                   (chunk_axis, c * step, step))
                parts.append(part)
            out.append(Sharded(parts, axis, tuple(sizes)))
        return out

    def concat_chunks(self, chunk_parts: list, axis: int) -> list:
        """Slot j's chunk results concatenated along `axis` (the chunked dispatch's
        per-slot output, in the tokens' order)."""
        parts = []
        for j in range(self.k):
            with self.on(j):
                parts.append(tf.concat([chunk[j] for chunk in chunk_parts], axis=axis,
                                       name="chunks"))
        return parts

    # -- the walk ------------------------------------------------------------
    def run(self, ops: list[tf.Operation], batch_derived: set = frozenset()) -> None:
        """Rewrite the region's ops (creation order). batch_derived: ops computed
        from the examples (a spanning group reads every worker's rows of them)."""
        variables = self.variables
        region = set(ops)
        for op in ops:
            if op.type in VARIABLE_OP_TYPES:
                continue
            if self.spanning:
                for index, tensor in enumerate(list(op.inputs)):
                    if tensor.op not in region and tensor.op in batch_derived \
                            and tensor.shape.rank:
                        graph_mutation.update_input(op, index, self.gather_batch(tensor))
            pending_var = _variable_read(op, variables)
            if pending_var is not None:
                self.layouts[op.outputs[0]] = Pending(pending_var, op.outputs[0])
                continue
            layouts = [self.layouts.get(t) or self._outside_read(t) for t in op.inputs]
            handle_var = _handle_input(op, variables)
            if all(layout is None for layout in layouts) and handle_var is None:
                self.record.ops.append(op)
                continue
            for layout in layouts:
                if isinstance(layout, Pending):
                    self.readers.setdefault(layout.variable.op, []).append((op, layouts))
            if handle_var is not None:
                self.readers.setdefault(handle_var.op, []).append((op, layouts))
            self._name = op.name
            fn = RULES.get(op.type)
            first = len(self.graph.get_operations())
            outputs = fn(self, op, layouts) if fn is not None else None
            if outputs is KEEP:
                self.record.ops.append(op)
                continue
            if outputs is None:
                self._fallback(op, layouts)
                continue
            for tensor, layout in zip(op.outputs, outputs):
                if layout is not None:
                    self.layouts[tensor] = layout
            self.record.replaced.add(op)
            self.record.ops.extend(self.graph.get_operations()[first:])

    def _outside_read(self, tensor: tf.Tensor):
        """Pending for a read of a region variable made outside the region (a reference
        variable's snapshot, built where the variable was created); else None."""
        variable = _variable_read(tensor.op, self.variables)
        if variable is None:
            return None
        layout = Pending(variable, tensor)
        self.layouts[tensor] = layout
        return layout

    def _fallback(self, op: tf.Operation, layouts: list) -> None:
        """Run `op` unsplit on gathered inputs; warn when a sharded input was gathered."""
        split_inputs = [(t, layout) for t, layout in zip(op.inputs, layouts)
                        if isinstance(layout, Sharded)
                        or (isinstance(layout, Pending) and layout.variable.op in self.sharded)]
        gathered = [t for t, _ in split_inputs]
        if gathered:
            self._refuse_across_workers(
                f"op {op.name} (type {op.type}) is not split: no rule covers its sharded input(s)")
        first = len(self.graph.get_operations())
        for index, (tensor, layout) in enumerate(zip(list(op.inputs), layouts)):
            if layout is not None and not (isinstance(layout, Pending)
                                           and layout.variable.op not in self.sharded):
                graph_mutation.update_input(op, index, self.value(layout, tensor))
        self.record.ops.extend(self.graph.get_operations()[first:])
        self.record.ops.append(op)
        if gathered:
            what = f"{op.name} (type {op.type})"
            self.record.fallbacks.append(what)
            inputs = ", ".join(t.name for t in gathered)
            if op.type in RULES:
                how = "; ".join(f"{t.name} split along axis {_split_axis(self, layout)}"
                                for t, layout in split_inputs)
                problem = (f"has a split rule, but not for its inputs split as they are ({how})"
                           f"; EPL gathers {inputs} and runs the op unsplit on one device")
            else:
                problem = (f"has no split rule for its sharded input(s) {inputs}; EPL gathers "
                           "the full tensor and runs the op unsplit on one device")
            message = (f"epl.split: op {what} {problem}. Op types with split rules: "
                       f"{', '.join(splittable_op_types())}.")
            _LOG.warning("%s", message)
            warnings.warn(message, SplitFallbackWarning, stacklevel=2)

    def finish(self, region: set) -> None:
        """Gather or sum values read outside the rewritten ops; place the region's ops;
        warn about the TaskGraph's variables that stay whole."""
        self._redirect_other_reads()
        for tensor, layout in list(self.layouts.items()):
            if isinstance(layout, Pending) and layout.variable.op not in self.sharded:
                continue
            for consumer in list(tensor.consumers()):
                if consumer in self.record.replaced:
                    continue
                self._name = consumer.name
                first = len(self.graph.get_operations())
                replace_input(consumer, tensor, self.value(layout, tensor))
                self.record.ops.extend(self.graph.get_operations()[first:])
        for op in self.record.replaced:
            graph_mutation.set_attr(op, SPLIT_REPLACED_ATTR, tf.compat.v1.AttrValue(b=True))
        for op in list(region) + self.record.ops:
            if not op.device and op not in self.record.replaced:
                graph_mutation.set_device(op, self.plan.devices[0])
        self._report_unsharded(region)

    def _redirect_other_reads(self) -> None:
        """Reads of a sharded variable that the walk did not see (built outside the
        split scope, e.g. a weight decay over trainable_variables(), or off the path
        to the loss, e.g. a metric) read the full value assembled from the shards."""
        for variable_op, sharded in self.sharded.items():
            handle = variable_op.outputs[0]
            for read in list(handle.consumers()):
                if read in self.record.replaced or read.outputs and read.outputs[0] in self.layouts:
                    continue
                if read.type in ("ReadVariableOp", "Identity") and read.outputs:
                    gathered = read.outputs[0]
                    pending = Pending(self.variables[variable_op], gathered)
                    for consumer in list(gathered.consumers()):
                        self._name = consumer.name
                        first = len(self.graph.get_operations())
                        replace_input(consumer, gathered, self.value(pending, gathered))
                        self.record.ops.extend(self.graph.get_operations()[first:])
                elif read.type == "ResourceGather" and read.get_attr("batch_dims") == 0:
                    self._name = read.name
                    first = len(self.graph.get_operations())
                    pending = Pending(self.variables[variable_op], handle)
                    with self.gathering(read.name):
                        rows = tf.gather(self.value(pending, handle), read.inputs[1])
                    for consumer in list(read.outputs[0].consumers()):
                        replace_input(consumer, read.outputs[0], rows)
                    self.record.ops.extend(self.graph.get_operations()[first:])

    def _report_unsharded(self, region: set) -> None:
        """A SplitUnshardedVariableWarning (and the "epl" logger) for each variable
        created in the TaskGraph that no rule sharded, saying why."""
        for variable_op, variable in self.variables.items():
            if variable_op in self.sharded:
                continue
            reason = self._why_whole(variable_op, region)
            name = variable_op.name
            self.record.unsharded.append(f"{name}: {reason}")
            message = (
                f"epl.split: variable {name} (shape {variable.shape.as_list()}) is created under "
                f"epl.split ({self.taskgraph}) but stays whole, not split over the {self.k} "
                f"devices: {reason}. Variables under epl.split are sharded by their first use "
                "in an op with a split rule (the weight of a MatMul, BatchMatMul or Einsum, an "
                "embedding table, the bias or scale of a split layer); create it outside "
                "epl.split to keep it whole without this warning.")
            _LOG.warning("%s", message)
            warnings.warn(message, SplitUnshardedVariableWarning, stacklevel=2)

    def _why_whole(self, variable_op, region: set) -> str:
        readers = self.readers.get(variable_op)
        if readers:
            op, layouts = readers[0]
            what = f"its first use, {op.name} (type {op.type}),"
            if any(isinstance(l, Partial) for l in layouts):
                return (f"{what} combines it with partial sums (the result of a row-split "
                        "layer, summed over the devices), which needs it whole")
            if op.type not in RULES:
                return f"{what} has no split rule"
            return f"{what} reads it whole (its split rule splits none of its inputs here)"
        outside = [op for t in variable_op.outputs for r in t.consumers()
                   for op in ([r] + [c for o in r.outputs for c in o.consumers()])
                   if op not in region and op.type not in _INIT_OP_TYPES]
        if outside:
            return (f"it is used outside the split scope, by {outside[0].name} (type "
                    f"{outside[0].type})")
        return "no op on the path to the loss reads it"


def _split_axis(rw: _Rewriter, layout) -> int:
    """The axis a Sharded layout, or a sharded variable's read, is split along."""
    if isinstance(layout, Pending):
        return rw.sharded[layout.variable.op].axis
    return layout.axis


def _variable_read(op: tf.Operation, variables: dict):
    """The region variable (tf.Variable) `op` reads the value of, if `op` is such a read."""
    if op.type == "ReadVariableOp" or (op.type == "Identity" and op.inputs
                                       and op.inputs[0].dtype._is_ref_dtype):
        return variables.get(op.inputs[0].op)
    return None


def _handle_input(op: tf.Operation, variables: dict):
    """The region variable whose handle `op` takes (ResourceGather), if any."""
    if op.type == "ResourceGather":
        return variables.get(op.inputs[0].op)
    return None


def _static_dim(tensor: tf.Tensor, axis: int) -> int | None:
    shape = tensor.shape
    if shape.rank is None:
        return None
    return shape[axis]


# --------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------


def _as_sharded(rw: _Rewriter, layout, tensor, axis, sizes=None, what="", must_divide=False):
    """`layout` as Sharded along `axis` (sharding a pending variable); None if it is not."""
    if isinstance(layout, Sharded):
        if layout.axis == axis and (sizes is None or tuple(sizes) == layout.sizes):
            return layout
        return None
    if isinstance(layout, Pending):
        return rw.shard_variable(layout, axis, sizes, what, must_divide)
    return None


def _is_full(layout) -> bool:
    return layout is None or isinstance(layout, Full) or (isinstance(layout, Pending))


@rule("MatMul")
def _matmul(rw: _Rewriter, op, layouts):
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
        sb = _as_sharded(rw, lb, b, b_contract, la.sizes)
        if sb is not None:
            return build(lambda j: la.parts[j], lambda j: sb.parts[j], Partial)
        return None
    if isinstance(la, Pending) and not isinstance(lb, (Sharded, Pending)):
        return KEEP if lb is None else None
    if _is_full(la) and not isinstance(la, Pending):            # column-split weight
        if isinstance(lb, Partial):
            return None
        sb = _as_sharded(rw, lb, b, b_out)
        if sb is None:
            return KEEP if _is_full(lb) else None
        a_value = rw.value(la, a)
        return build(lambda j: a_value, lambda j: sb.parts[j],
                     lambda parts: Sharded(parts, 1, sb.sizes))
    if isinstance(la, Sharded) and la.axis == a_rows and _is_full(lb):   # row-sharded input
        b_value = rw.value(lb, b)
        return build(lambda j: la.parts[j], lambda j: b_value,
                     lambda parts: Sharded(parts, 0, la.sizes))
    if isinstance(la, Partial) and _is_full(lb):
        b_value = rw.value(lb, b)
        return build(lambda j: la.parts[j], lambda j: b_value, Partial)
    return None


@rule("BatchMatMulV2", "BatchMatMulV3")
def _expert_matmul(rw: _Rewriter, op, layouts):
    """Experts: an [E, m, n] weight split along E; the input's matching axis follows it."""
    a, b = op.inputs
    la, lb = layouts
    if b.shape.rank != 3 or a.shape.rank is None or a.shape.rank < 3:
        return None
    a_axis = a.shape.rank - 3
    experts = _static_dim(b, 0)
    if experts is None or _static_dim(a, a_axis) not in (experts, None):
        return None
    weight = lb.variable.op.name if isinstance(lb, Pending) else b.op.name
    what = (f"expert count {experts} (axis 0 of {weight}, shape {b.shape.as_list()}, read by "
            f"{op.name})")
    if isinstance(la, Sharded):
        if la.axis != a_axis:
            return None
        sb = _as_sharded(rw, lb, b, 0, la.sizes)
        sa = la
    else:
        if isinstance(la, Partial):
            return None
        if isinstance(lb, Pending) and experts % rw.k:
            raise ParallelizeError(
                f"the {what} is not divisible by the split degree {rw.k}: every device must "
                f"hold whole experts. Use a number of experts divisible by {rw.k}, or "
                f"epl.split(device_count=d) with d dividing {experts}.")
        sb = _as_sharded(rw, lb, b, 0, None, what, must_divide=True)
        if sb is None:
            return KEEP if _is_full(lb) else None
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


def _chunked_expert_matmul(rw: _Rewriter, op, tokens, a_axis: int, sb: Sharded):
    """The expert matmul on a dispatch cut into `rw.moe_chunks` chunks along the
    tokens' rows (axis m of [.., E, m, d]; the last axis under adj_x): chunk c's
    slice and matmul on every slot, the chunks concatenated back per slot."""
    adj_x, adj_y = op.get_attr("adj_x"), op.get_attr("adj_y")
    rank = tokens.shape.rank
    chunk_axis = rank - 1 if adj_x else rank - 2
    chunks = rw.slice_chunks(tokens, a_axis, sb.sizes, chunk_axis, f"{op.name} ({op.type})",
                             _static_dim(op.inputs[1], 0))
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


def _einsum_chunk_label(labels: list, out: list, index: int, label):
    """The label along which the chunked dispatch cuts operand `index` (the
    tokens): its last label, other than the split one, that the output keeps and
    no other operand has (the capacity c of "egcm,emh->egch"); None if none."""
    others = {l for i, term in enumerate(labels) if i != index for l in term}
    for candidate in reversed(labels[index]):
        if candidate != label and candidate in out and candidate not in others:
            return candidate
    return None


def _einsum_labels(op):
    """(labels of each operand, labels of the output) of an Einsum op, one label
    per axis; an ellipsis becomes one label per axis it covers, right-aligned
    across operands as broadcasting aligns them. None when a rank is unknown or a
    label repeats within one term (a diagonal or trace)."""
    equation = op.get_attr("equation")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if "->" not in equation:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    ranks = [t.shape.rank for t in op.inputs]
    if None in ranks or len(terms) != len(ranks):
        return None
    spans = [rank - (len(term) - 3) if "..." in term else 0 for term, rank in zip(terms, ranks)]
    width = max(spans + [0])
    spare = [chr(0x100 + i) for i in range(width)]   # labels no equation spells

    def expand(term: str, span: int) -> list:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        return list(head) + spare[width - span:] + list(tail)

    labels = [expand(term, span) for term, span in zip(terms, spans)]
    out_labels = expand(out, width)
    if any(len(l) != len(set(l)) for l in labels + [out_labels]) \
            or any(len(l) != rank for l, rank in zip(labels, ranks)):
        return None
    return labels, out_labels


def _einsum_weight_axis(labels: list, out: list, index: int):
    """(axis, expert) along which to shard operand `index` (a variable no rule has
    sharded yet), or None to keep it whole. First choice: a label it shares with
    another operand and the output (the expert axis of an [experts, d, h] weight
    in "egcm,emh->egch": whole experts per device, the tokens sliced to match);
    then the first label only it and the output have (a column split, as
    "bsd,dh->bsh" splits h: the output is sharded, no collective)."""
    others = set()
    for i, term in enumerate(labels):
        if i != index:
            others.update(term)
    own = labels[index]
    for axis, label in enumerate(own):
        if label in others and label in out:
            return axis, True
    for axis, label in enumerate(own):
        if label not in others and label in out:
            return axis, False
    return None


@rule("Einsum")
def _einsum(rw: _Rewriter, op, layouts):
    """tf.einsum on split operands, by the label that is split.

    The split label comes from a sharded operand (all sharded operands must be
    split along the same label and extents), or, when none is sharded yet, from
    the first variable operand (`_einsum_weight_axis`). Every operand that has
    the label is split along it (a variable becomes shards; a full tensor is
    sliced: the dispatch of tokens to expert devices), the others are read
    whole on every device, and each device runs the einsum on its slices. The
    output is sharded along the label when the output keeps it ("egcm,emh->egch"
    keeps e; "bsd,dh->bsh" keeps h), and partial sums when the label is
    contracted ("gsec,egcm->gsm", the expert combine; "bsh,hd->bsd", a row
    split): one sum where the whole value is read. Partial sums go through an
    einsum whose other operands are whole (it is linear in each operand).
    """
    parsed = _einsum_labels(op)
    if parsed is None:
        return KEEP if all(_is_full(l) for l in layouts) else None
    labels, out = parsed
    partial = [i for i, l in enumerate(layouts) if isinstance(l, Partial)]
    sharded = [i for i, l in enumerate(layouts) if isinstance(l, Sharded)]
    if partial:
        if len(partial) > 1 or sharded:
            return None
        values = [None if i in partial else rw.value(l, t)
                  for i, (l, t) in enumerate(zip(layouts, op.inputs))]
        parts = _clone_on_slots(rw, op, lambda j: [layouts[i].parts[j] if i in partial
                                                   else values[i] for i in range(len(values))])
        return [Partial(parts)]
    expert, order = False, list(range(len(op.inputs)))
    if sharded:
        first = layouts[sharded[0]]
        label, sizes = labels[sharded[0]][first.axis], first.sizes
        full = op.inputs[sharded[0]].shape[first.axis]
        if any(labels[i][layouts[i].axis] != label or layouts[i].sizes != sizes
               for i in sharded):
            return None
    else:
        pending = [i for i, l in enumerate(layouts) if isinstance(l, Pending)]
        choice = _einsum_weight_axis(labels, out, pending[0]) if pending else None
        if choice is None:
            return KEEP
        axis, expert = choice
        label, sizes = labels[pending[0]][axis], None
        full = op.inputs[pending[0]].shape[axis]
        order = [pending[0]] + [i for i in order if i != pending[0]]   # its shards set the sizes
    if full is None:
        return None
    sliced = [i for i in order if not isinstance(layouts[i], (Sharded, Pending))
              and label in labels[i]]
    chunk_label = None
    if expert and rw.moe_chunks > 1 and len(sliced) == 1:
        chunk_label = _einsum_chunk_label(labels, out, sliced[0], label)
        if chunk_label is None:
            _LOG.info("split.moe_chunks: %s (%s) has no capacity axis to cut the "
                      "dispatch along; it is dispatched whole", op.name,
                      op.get_attr("equation"))
    parts_of, chunked = {}, None
    for i in order:
        tensor, layout = op.inputs[i], layouts[i]
        axis = labels[i].index(label) if label in labels[i] else None
        if axis is not None and tensor.shape[axis] == 1 and full != 1:
            axis = None                                  # broadcast along the split label
        if axis is None:
            if isinstance(layout, Sharded):
                return None
            value = rw.value(layout, tensor)
            parts_of[i] = [value] * rw.k
        elif isinstance(layout, Sharded):
            parts_of[i] = layout.parts
        elif isinstance(layout, Pending):
            what, divide = "", False
            if expert:
                what, divide = _check_whole_experts(rw, op, layout, tensor, axis, label)
            split = _as_sharded(rw, layout, tensor, axis, sizes, what, must_divide=divide)
            if split is None:
                return None
            parts_of[i], sizes = split.parts, split.sizes
        elif chunk_label is not None and i == sliced[0]:
            chunked = (i, rw.slice_chunks(rw.value(layout, tensor), axis, sizes,
                                          labels[i].index(chunk_label),
                                          f"{op.name} ({op.type})", int(full)))
        else:
            parts_of[i] = rw.slice(rw.value(layout, tensor), axis, sizes, int(full),
                                   f"{op.name} ({op.type}, {op.get_attr('equation')!r})").parts
    if chunked is not None:       # the chunked dispatch: one einsum per chunk and slot
        index, chunks = chunked
        results = []
        for c, chunk in enumerate(chunks):
            parts_of[index] = chunk.parts
            results.append(_clone_on_slots(
                rw, op, lambda j: [parts_of[i][j] for i in range(len(op.inputs))],
                suffix=f"/chunk_{c}"))
        parts = rw.concat_chunks(results, out.index(chunk_label))
    else:
        parts = _clone_on_slots(rw, op, lambda j: [parts_of[i][j]
                                                   for i in range(len(op.inputs))])
    if label in out:
        return [Sharded(parts, out.index(label), sizes)]
    return [Partial(parts)]


def _extent_of(tensor: tf.Tensor, axis: int, known: int | None, what: str) -> int:
    """The length of `tensor`'s `axis`: static, else `known`; a ParallelizeError naming
    the op and the dimension when neither says it."""
    static = tensor.shape[axis] if tensor.shape.rank is not None else None
    if static is not None:
        return int(static)
    if known is not None:
        return int(known)
    raise ParallelizeError(
        f"{what or 'an op of the split part'} slices {tensor.name} (shape "
        f"{tensor.shape.as_list() if tensor.shape.rank is not None else 'unknown'}) along "
        f"dimension {axis}, whose length is only known at run time: EPL cuts it among the "
        "split devices when the graph is built. Give that dimension a static size (a "
        "placeholder or reshape with it, not None or -1).")


def _check_whole_experts(rw: _Rewriter, op, layout: Pending, tensor, axis: int, label: str):
    """(what, must_divide) for sharding an expert axis; refuses a count that the
    split degree does not divide (every device holds whole experts)."""
    variable = layout.variable
    experts = int(tensor.shape[axis])
    what = (f"expert count {experts} (axis {axis} of {variable.op.name}, shape "
            f"{tensor.shape.as_list()}, read by {op.name})")
    if experts % rw.k and variable.op not in rw.sharded:
        raise ParallelizeError(
            f"the {what} is not divisible by the split degree {rw.k}: every device must "
            f"hold whole experts. Use a number of experts divisible by {rw.k}, or "
            f"epl.split(device_count=d) with d dividing {experts}.")
    return what, True


UNARY = ("Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Log", "Neg", "Square",
         "Sqrt", "Rsqrt", "Abs", "Softplus", "Erf", "Identity", "Cast", "LeakyRelu", "StopGradient",
         "Reciprocal", "Sin", "Cos")
BINARY = ("Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "Maximum", "Minimum", "SquaredDifference",
          "Pow", "DivNoNan")
LINEAR_BINARY = ("Add", "AddV2", "Sub")


def _clone_on_slots(rw: _Rewriter, op, inputs_of, suffix: str = "") -> list:
    """Copies of `op` on each slot, with slot j's inputs `inputs_of(j)`."""
    parts = []
    for j in range(rw.k):
        copy = clone_op(op, inputs_of(j), f"{op.name}/EPL_SPLIT_{j}{suffix}",
                        rw.plan.devices[j], rw.attrs(j))
        parts.append(copy.outputs[0])
    return parts


@rule(*UNARY)
def _unary(rw: _Rewriter, op, layouts):
    (layout,) = layouts[:1]
    if isinstance(layout, Sharded) and len(op.inputs) == 1:
        parts = _clone_on_slots(rw, op, lambda j: [layout.parts[j]])
        return [Sharded(parts, layout.axis, layout.sizes)]
    if isinstance(layout, Partial) and op.type in ("Identity", "Neg") and len(op.inputs) == 1:
        return [Partial(_clone_on_slots(rw, op, lambda j: [layout.parts[j]]))]
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
        return _as_sharded(rw, layout, tensor, axis, sizes).parts
    return rw.slice(rw.value(layout, tensor), axis, sizes).parts


@rule(*BINARY)
def _binary(rw: _Rewriter, op, layouts):
    x, y = op.inputs
    lx, ly = layouts
    if isinstance(lx, Partial) and isinstance(ly, Partial) and op.type in LINEAR_BINARY:
        return [Partial(_clone_on_slots(rw, op, lambda j: [lx.parts[j], ly.parts[j]]))]
    sharded = next((l for l, t in ((lx, x), (ly, y)) if isinstance(l, Sharded)), None)
    if sharded is None:
        return KEEP if all(_is_full(l) for l in layouts) else None
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
    return [Sharded(_clone_on_slots(rw, op, lambda j: [px[j], py[j]]), out_axis, sharded.sizes)]


@rule("L2Loss")
def _l2_loss(rw: _Rewriter, op, layouts):
    """tf.nn.l2_loss (weight decay) of a split tensor or a sharded variable: each
    device's share of the sum of squares, a partial sum (no gather)."""
    (layout,) = layouts
    if isinstance(layout, Pending) and layout.variable.op in rw.sharded:
        layout = rw.shard_variable(layout, rw.sharded[layout.variable.op].axis)
    if isinstance(layout, Sharded):
        return [Partial(_clone_on_slots(rw, op, lambda j: [layout.parts[j]]))]
    return KEEP if _is_full(layout) else None


@rule("Softmax", "LogSoftmax")
def _softmax(rw: _Rewriter, op, layouts):
    """Softmax over the last axis of a tensor split along another axis (attention
    scores split by heads): each device normalizes its own rows."""
    (layout,) = layouts
    if isinstance(layout, Sharded) and layout.axis != op.inputs[0].shape.rank - 1:
        parts = _clone_on_slots(rw, op, lambda j: [layout.parts[j]])
        return [Sharded(parts, layout.axis, layout.sizes)]
    return KEEP if _is_full(layout) else None


@rule("BiasAdd")
def _bias_add(rw: _Rewriter, op, layouts):
    x, bias = op.inputs
    lx, lb = layouts
    if op.get_attr("data_format") not in (b"NHWC", "NHWC") or not isinstance(lx, Sharded):
        return KEEP if all(_is_full(l) for l in layouts) else None
    last = x.shape.rank - 1 if x.shape.rank is not None else None
    if lx.axis == last:
        sb = _as_sharded(rw, lb, bias, 0, lx.sizes) if isinstance(lb, (Pending, Sharded)) else \
            rw.slice(rw.value(lb, bias), 0, lx.sizes, sum(lx.sizes), f"{op.name} ({op.type})")
        if sb is None:
            return None
        parts = [sb.parts[j] for j in range(rw.k)]
    else:
        value = rw.value(lb, bias)
        parts = [value] * rw.k
    return [Sharded(_clone_on_slots(rw, op, lambda j: [lx.parts[j], parts[j]]), lx.axis, lx.sizes)]


@rule("Reshape")
def _reshape(rw: _Rewriter, op, layouts):
    """A reshape that keeps the sharded last axis whole (e.g. [N, V] -> [B, S, V])."""
    x = op.inputs[0]
    lx = layouts[0]
    if not isinstance(lx, Sharded):
        return KEEP if all(_is_full(l) for l in layouts) else None
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


@rule("GatherV2", "ResourceGather")
def _embedding(rw: _Rewriter, op, layouts):
    """Vocabulary-split table: each id is looked up on the shard that owns it."""
    rw._refuse_across_workers(f"the embedding lookup {op.name} would need every worker's ids")
    if op.type == "ResourceGather":
        variable = _handle_input(op, rw.variables)
        if variable is None or op.get_attr("batch_dims") != 0:
            return None
        table = Pending(variable, _read_of(rw, variable))
        ids = op.inputs[1]
        ids_layout = layouts[1]
    else:
        params, ids, axis = op.inputs
        if not isinstance(layouts[0], (Pending, Sharded)) or op.get_attr("batch_dims") != 0:
            return None
        axis_value = tf.get_static_value(axis)
        if axis_value is None or int(axis_value) != 0:
            return None
        table = layouts[0]
        ids_layout = layouts[1]
    if not _is_full(ids_layout):
        return None
    if isinstance(table, Pending):
        what = (f"vocabulary ({table.variable.shape[0]} rows) of embedding table "
                f"{table.variable.op.name}")
        sharded = _as_sharded(rw, table, None, 0, None, what)
    else:
        sharded = table
    if sharded is None:
        return None
    shards = rw.sharded[table.variable.op].shards if isinstance(table, Pending) else None
    ids_value = rw.value(ids_layout, ids)
    offsets = [sum(sharded.sizes[:j]) for j in range(rw.k)]
    with rw.gathering(op.name):
        flat = tf.reshape(ids_value, [-1])
        owner = tf.add_n([tf.cast(flat >= offset, tf.int32) for offset in offsets[1:]]) \
            if rw.k > 1 else tf.zeros_like(flat, tf.int32)
        positions = tf.range(tf.size(flat))
        ids_of = tf.dynamic_partition(flat, owner, rw.k)
        positions_of = tf.dynamic_partition(positions, owner, rw.k)
    rows = []
    for j in range(rw.k):
        with rw.on(j):
            local = ids_of[j] - tf.cast(offsets[j], ids_of[j].dtype)
            source = shards[j] if shards is not None else sharded.parts[j]
            rows.append(tf.gather(source, local))
    with rw.gathering(op.name):
        stitched = tf.dynamic_stitch(positions_of, rows)
        out_shape = tf.concat([tf.shape(ids_value), tf.shape(stitched)[1:]], axis=0)
        result = tf.reshape(stitched, out_shape)
        result.set_shape(op.outputs[0].shape)
    return [Full(result)]


def _read_of(rw: _Rewriter, variable):
    """A value read of `variable` the walk has seen (so sharding the table also
    gives that read's other consumers the shards), else its handle."""
    for consumer in variable.op.outputs[0].consumers():
        if consumer.outputs and consumer.outputs[0] in rw.layouts:
            return consumer.outputs[0]
    return variable.op.outputs[0]


def _softmax_parts(rw: _Rewriter, op, logits: Sharded):
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
def _sparse_softmax_ce(rw: _Rewriter, op, layouts):
    """loss = log(sum_j sum exp(logits_j - max)) + max - logit[label], per example."""
    logits, labels = op.inputs
    ll, lab = layouts
    if not isinstance(ll, Sharded) or ll.axis != logits.shape.rank - 1 or not _is_full(lab) \
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
def _softmax_ce(rw: _Rewriter, op, layouts):
    """Dense labels: loss = sum_v y_v * (log_sum - logit_v), summed over the shards."""
    logits, labels = op.inputs
    ll, lab = layouts
    if not isinstance(ll, Sharded) or ll.axis != logits.shape.rank - 1 or op.outputs[1].consumers():
        return None
    sl = lab if isinstance(lab, Sharded) and lab.axis == ll.axis and lab.sizes == ll.sizes \
        else (rw.slice(rw.value(lab, labels), ll.axis, ll.sizes, sum(ll.sizes),
                       f"{op.name} ({op.type})") if _is_full(lab) else None)
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


# --------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitInputs:
    """The split pass's input at gradient time: the loss compute_gradients was given."""

    loss: tf.Tensor


@dataclasses.dataclass(frozen=True)
class SplitRecords:
    """The SplitRecord of every TaskGraph the split pass rewrote (its result at gradient
    time; the driver hands the graph's records to the training passes as an input)."""

    records: tuple


class SplitPass(GraphPass):
    """Rewrites each split TaskGraph's forward ops into per-device ops (gradient time).

    Reads the loss (SplitInputs), the graph's record (its TaskGraphs, and the split
    TaskGraphs an earlier gradient-time run rewrote) and the worker's planner (each
    split TaskGraph's devices and shard weights); provides the SplitRecords of the
    TaskGraphs it rewrote, which the caller adds to the record.
    """

    name = "split"
    requires = (SplitInputs, GraphRecord, WorkerPlanner)
    provides = (SplitRecords,)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        record_of_graph = ctx.get(GraphRecord)
        loss = ctx.get(SplitInputs).loss
        todo = record_of_graph.unsplit_taskgraphs()
        plans = ctx.get(WorkerPlanner).split_plans(todo)
        before = set(graph.get_operations())
        path = ancestors([loss.op])
        records, notes = [], []
        tagged_of = {tg.name: [] for tg in todo}
        followers = _follow_inputs(path, record_of_graph.taskgraphs)
        for op in graph.get_operations():
            name = _taskgraph_of(op) or followers.get(op)
            if name in tagged_of:
                tagged_of[name].append(op)
        owned = _owned_variables(graph, tagged_of, plans)
        for taskgraph in todo:
            tagged = tagged_of[taskgraph.name]
            region = [op for op in tagged if op in path]
            if not region:
                continue
            variables = owned[taskgraph.name]
            record = SplitRecord(taskgraph.name, plans[taskgraph.name])
            rewriter = _Rewriter(graph, taskgraph.name, record.plan, ctx.cluster.host_device, record,
                                 variables, ctx.communicator, self.options.moe_chunks)
            batch_derived = set()
            if rewriter.spanning:
                batch_inputs, _ = find_batch_inputs(path)
                batch_derived = descendants(batch_inputs) | {t.op for t in batch_inputs}
            with graph.name_scope(None), graph.control_dependencies(None):
                rewriter.run(region, batch_derived)
                rewriter.finish(set(region))
            for variable_op, sharded in rewriter.sharded.items():
                graph_mutation.set_attr(variable_op, SPLIT_REPLACED_ATTR,
                                        tf.compat.v1.AttrValue(b=True))
            records.append(record)
            notes.append(f"{taskgraph.name}: {len(record.variables)} variable(s) sharded over "
                         f"{len(record.plan.devices)} devices "
                         f"({', '.join(f'{n} axis {v.axis} sizes {list(v.sizes)}' for n, v in record.variables.items())})"
                         + (f"; unsplit fallbacks: {', '.join(record.fallbacks)}"
                            if record.fallbacks else "")
                         + (f"; kept whole: {'; '.join(record.unsharded)}"
                            if record.unsharded else ""))
        ctx.provide(SplitRecords(tuple(records)))
        added = [op.name for op in graph.get_operations() if op not in before]
        replaced = sorted(op.name for record in records for op in record.replaced)
        if replaced:  # they stay in the graph (TensorFlow cannot delete ops) and never run
            notes.append(f"replaced, never run: {', '.join(replaced)}")
        return PassResult(added=added, notes=notes)


def _taskgraph_of(op: tf.Operation) -> str | None:
    attr = op.node_def.attr.get(TASKGRAPH_ATTR)
    return attr.s.decode() if attr is not None else None


def _follow_inputs(path: set, taskgraphs: list) -> dict:
    """Untagged ops on the path to the loss -> the TaskGraph they will follow.

    An op built outside every scope takes the latest TaskGraph among its inputs
    (epl/ir/graph_view.py); one that follows a split TaskGraph (a loss or weight
    decay added outside the split scope to what the split part computed) is part
    of that TaskGraph's region: rewritten and placed with it.
    """
    index = {tg.name: tg.index for tg in taskgraphs}
    resolved: dict = {}      # op on the path -> its TaskGraph name (tagged or followed)
    followers: dict = {}
    for op in sorted(path, key=lambda o: o._id):   # creation order: inputs first
        name = _taskgraph_of(op)
        if name is None and op.type not in VARIABLE_OP_TYPES:
            names = [resolved[t.op] for t in op.inputs if t.op in resolved]
            if names:
                name = followers[op] = max(names, key=lambda n: index.get(n, -1))
        if name is not None:
            resolved[op] = name
    return followers


def _owned_variables(graph: tf.Graph, tagged_of: dict, plans: dict) -> dict:
    """TaskGraph name -> {variable op: tf.Variable} of the variables each split
    TaskGraph shards: those created in it, except a variable whose every use is in
    one other split TaskGraph on the same devices, which that one shards (weights
    created under one epl.split scope, e.g. in a layer's build(), and used under
    another, in its call(), as FastNN's MoE layer does)."""
    owned = {name: _region_variables(graph, tagged) for name, tagged in tagged_of.items()}
    for name, variables in owned.items():
        for variable_op in list(variables):
            users = _user_taskgraphs(variable_op)
            if len(users) != 1:
                continue
            (user,) = users
            if user != name and user in owned and plans.get(user) == plans.get(name):
                owned[user][variable_op] = variables.pop(variable_op)
    return owned


def _user_taskgraphs(variable_op: tf.Operation) -> set:
    """TaskGraph names (None: untagged) of the ops that use the values of a variable."""
    users = set()
    for consumer in variable_op.outputs[0].consumers():
        if consumer.type in ("ReadVariableOp", "Identity", "ResourceGather"):
            users.update(_taskgraph_of(op) for out in consumer.outputs for op in out.consumers())
            if consumer.type == "ResourceGather":
                users.add(_taskgraph_of(consumer))
    return users


def _region_variables(graph: tf.Graph, tagged: list) -> dict:
    """Variable op -> tf.Variable for the variables created inside the TaskGraph."""
    ops = {op for op in tagged if op.type in VARIABLE_OP_TYPES}
    found = {}
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
        for variable in graph.get_collection(key):
            if getattr(variable, "op", None) in ops:
                found[variable.op] = variable
    return found
