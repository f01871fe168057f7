"""The split pass's rewriter (epl/passes/split/split.py describes the pass).

`Rewriter` rewrites one split TaskGraph's region in creation order: it gives
each op with a sharded, partial or pending input to the rule of its op type
(rules.py), runs an op no rule covers unsplit on its gathered inputs (a
`SplitFallbackWarning`), shards the variables the rules ask for, gathers or sums
the values read outside the rewritten ops, and warns about the TaskGraph's
variables that stay whole (`SplitUnshardedVariableWarning`). Also the helpers
the rule families share: `as_sharded`, `clone_on_slots`, `static_dim` and
`handle_input`.
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import tensorflow as tf

from epl.checkpoint.sharded_variable import ShardedVariable, shard_existing
from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import SHARD_ATTR, SPLIT_REPLACED_ATTR, TASKGRAPH_ATTR
from epl.ir.clone import clone_op, replace_input
from epl.ir.graph_view import VARIABLE_OP_TYPES
from epl.passes.split.layouts import Full, Partial, Pending, Sharded, Slicer, SplitRecord
from epl.passes.split.rules import KEEP, RULES, splittable_op_types
from epl.planner.plan import SplitPlan

_LOG = logging.getLogger(__name__)


class SplitFallbackWarning(UserWarning):
    """An op inside epl.split has no rule for its sharded input; it runs unsplit."""


class SplitUnshardedVariableWarning(SplitFallbackWarning):
    """A variable created under epl.split is not sharded: it stays whole on one device."""


# ops a variable's own construction adds (initialization, its first read)
_INIT_OP_TYPES = frozenset({"AssignVariableOp", "Assign", "VarIsInitializedOp",
                            "IsVariableInitialized", "ReadVariableOp", "Identity"})


class Rewriter:
    """Rewrites one split TaskGraph's ops; the rules call back into it."""

    def __init__(self, graph: tf.Graph, taskgraph: str, plan: SplitPlan, host: str,
                 record: SplitRecord, variables: dict, communicator=None,
                 moe_chunks: int = 1, slice_reads: bool = False):
        self.graph = graph
        # a traced tf.function's variables are the user's eager variables, which cannot
        # become shards: the first use that needs one sharded reads it whole and slices
        # the value onto the slots (`shard_variable`); the variable, its gradient and
        # its optimizer state stay whole (epl/hooks/function.py)
        self.slice_reads = slice_reads
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
        self.sliced: dict = {}      # slice mode: variable op -> its Sharded slices
        self._full_cache: dict = {}
        self._name = ""
        self.readers: dict = {}     # variable op -> [(op, input layouts)] that read it in the walk
        self.kept_whole: dict = {}  # variable op -> why a rule chose to leave it whole

    def keep_whole(self, variable_op, reason: str) -> None:
        """A rule leaves `variable_op` whole on purpose; `reason` is reported as why."""
        self.kept_whole.setdefault(variable_op, reason)

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

    def refuse_across_workers(self, what: str) -> None:
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
            if sharded is None or self.slice_reads:   # whole, or still read whole
                return layout.read
            self.refuse_across_workers(f"variable {sharded.name} would have to be gathered whole")
            parts = [shard.value() for shard in sharded.shards]
            result = self._concat(parts, sharded.axis, tensor)
        elif isinstance(layout, Sharded):
            self.refuse_across_workers(f"{tensor.name} (sharded) is read where the whole tensor "
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
            if self.slice_reads:
                return self.sliced[var.op]
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
        if self.slice_reads:
            return self._slice_read(pending, axis, list(sizes))
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

    def _slice_read(self, pending: Pending, axis: int, sizes: list) -> Sharded:
        """Slice mode (`slice_reads`): the variable's whole value, read where the variable
        is and cut there along `axis` (one Split, whose gradient is one Concat: the
        variable's whole gradient, as single-device autodiff computes it), each slice
        moved to its slot. The variable is not replaced: its other reads stay."""
        var = pending.variable
        read = pending.read
        with self.graph._attr_scope(self.attrs(None)), tf.device(var.device), \
                tf.name_scope(f"{var.op.name}/EPL_SPLIT_SLICES/"):
            if read.dtype == tf.resource:   # a lookup on the handle: read the value once
                read = tf.raw_ops.ReadVariableOp(resource=read, dtype=var.dtype)
            pieces = tf.split(read, sizes, axis=axis) if self.k > 1 else [read]
        parts = []
        for j, piece in enumerate(pieces):
            with self.on(j):
                parts.append(tf.identity(piece))
        layout = Sharded(parts, axis, tuple(sizes))
        self.sharded[var.op] = ShardedVariable(
            var.op.name, tuple(var.shape.as_list()), axis, tuple(sizes), [],
            tuple(self.offsets(sizes, int(var.shape[axis]))))
        self.sliced[var.op] = layout
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
        extent = static_dim(tensor, chunk_axis)
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
            handle_var = handle_input(op, variables)
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
                        or (isinstance(layout, Pending) and layout.variable.op in self.sharded
                            and not self.slice_reads)]
        gathered = [t for t, _ in split_inputs]
        if gathered:
            self.refuse_across_workers(
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
            if isinstance(layout, Pending) and (layout.variable.op not in self.sharded
                                                or self.slice_reads):
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
        to the loss, e.g. a metric) read the full value assembled from the shards.
        In slice mode the variable stays whole and its other reads read it."""
        if self.slice_reads:
            return
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
            # slice mode: the user's eager variable's name (not its capture's)
            name = variable.name if self.slice_reads else variable_op.name
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
        if variable_op in self.kept_whole:
            return self.kept_whole[variable_op]
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


def _split_axis(rw: Rewriter, layout) -> int:
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


def handle_input(op: tf.Operation, variables: dict):
    """The region variable whose handle `op` takes (ResourceGather), if any."""
    if op.type == "ResourceGather":
        return variables.get(op.inputs[0].op)
    return None


def static_dim(tensor: tf.Tensor, axis: int) -> int | None:
    """The static length of `tensor`'s `axis` (None where unknown)."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    return shape[axis]


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


def as_sharded(rw: Rewriter, layout, tensor, axis, sizes=None, what="", must_divide=False):
    """`layout` as Sharded along `axis` (sharding a pending variable); None if it is not."""
    if isinstance(layout, Sharded):
        if layout.axis == axis and (sizes is None or tuple(sizes) == layout.sizes):
            return layout
        return None
    if isinstance(layout, Pending):
        return rw.shard_variable(layout, axis, sizes, what, must_divide)
    return None


def clone_on_slots(rw: Rewriter, op, inputs_of, suffix: str = "") -> list:
    """Copies of `op` on each slot, with slot j's inputs `inputs_of(j)`."""
    parts = []
    for j in range(rw.k):
        copy = clone_op(op, inputs_of(j), f"{op.name}/EPL_SPLIT_{j}{suffix}",
                        rw.plan.devices[j], rw.attrs(j))
        parts.append(copy.outputs[0])
    return parts
