"""What each copy of the model reads as its batch: the replicate pass's input side.

The replicate pass copies the model once per unit, a (replica k, micro-batch m)
pair, numbered u = k x M + m (replica-major; M = `pipeline.num_micro_batch`).
This module decides what each unit reads in place of every batch input
(`TrainingView.batch_inputs`: tf.data iterator outputs, placeholders, constants
whose first dimension is the batch) and how much each unit weighs in the
global batch. `io.batch_mode` chooses between two contracts.

"replica" (the default; EPL's documented contract, and Horovod's habit): the
batch the script builds is ONE replica's micro-batch. A worker with R replicas
consumes U = R x M of them per step, and the global batch of a step is
workers x U x micro-batch examples. Every unit's static shapes are the
script's own, so a batch size baked into the script (a `drop_remainder=True`
pipeline, a reshape to `[batch, seq, width]` built from Python ints) stays
valid. Per kind of batch input:
- tf.data iterator output: every unit draws its own batch with its own
  `IteratorGetNext` on the user's iterator. Unit 0 uses the user's op; the
  draws are chained by control edges, so unit u takes the u-th batch of the
  step (replica 0's micro-batches first). Single-device training on the
  concatenation of those U batches, in that order, is what the step computes.
- placeholder with a static batch dimension B: the feed holds all U
  micro-batches, U x B rows, replica-major (unit u's rows are [u B, (u+1) B)).
  EPL adds a placeholder of U x B rows (`EPL_FEED/<name>`); `Session.run`
  moves the user's feed onto it (`FeedRedirect`) and feeds the user's
  placeholder unit 0's rows, for ops outside the training step. A feed of
  any other row count is refused with an error saying what to feed.
- placeholder with a dynamic batch dimension: the feed holds every unit's
  rows; they are cut into U equal parts at run time (an Assert fails the step
  when the count does not divide), or by the plan's shares when they differ.
- constant: every unit reads it as it is (each micro-batch is that constant).
Uneven per-replica shares (the hardware-aware planner's) need batches of
different sizes, so in this mode they apply only when every batch input is a
dynamic-batch placeholder (`supports_uneven_shares`).

"global" (the behaviour of earlier versions, opt-in): the script's batch is the
worker's whole batch, sliced along its first dimension among the units (static
split when the batch size is known, run-time boundaries round(B x cumulative
share) otherwise). A batch size baked into a forward constant cannot follow
the slice: `check_sliced_shapes` runs TensorFlow's shape inference on the
sliced forward graph (in a scratch graph, so nothing is added to the user's)
and refuses, naming the op, when a constant holds the whole batch; folded
`tf.shape` constants of batch tensors (`shape_constants`) are rewritten per
unit by the copies.

Weights: a unit's weight is its rows over the rows of the global batch (every
worker's, summed with one scalar all-reduce per step when there are several);
a replica's is the sum of its units'. Python floats when every size is static,
scalar tensors otherwise.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from epl.errors import ParallelizeError
from epl.ir.annotations import Phase
from epl.ir.clone import COLOCATION_ATTR, NodeBatch, copy_node_def
from epl.ir.graph_view import (ITERATOR_OUTPUT_TYPES, PLACEHOLDER_TYPES, ancestors,
                               calls_functions, descendants)
from epl.passes.split.boundary import batch_axes, scratch_placeholder
from epl.runtime.run_errors import SHORT_INPUT_MARKER

BATCH_MODE_KEY = "io.batch_mode"
REPLICA_MODE, GLOBAL_MODE = "replica", "global"
FEED_SCOPE = "EPL_FEED"
SLICE_SCOPE = "EPL_BATCH_SLICES"
# Binary element-wise ops that broadcast: a copy whose output keeps the whole
# batch while an input lost it re-inflated the batch from a baked constant.
_BROADCASTING = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
                           "Minimum", "Pow", "SquaredDifference", "FloorDiv", "FloorMod",
                           "SelectV2", "BiasAdd", "Equal", "NotEqual", "Less", "LessEqual",
                           "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr"})


def batch_mode(config) -> str:
    """`io.batch_mode`: "replica" (the default) or "global"."""
    return config.get(BATCH_MODE_KEY)


@dataclasses.dataclass(frozen=True)
class FeedRedirect:
    """A user's placeholder whose feed EPL moves onto its own, wider placeholder.

    original: the user's placeholder (static batch dimension `rows`);
    widened: EPL's placeholder of `units` x `rows` rows, which the units read.
    """

    original: tf.Tensor
    widened: tf.Tensor
    units: int
    rows: int

    def feeds(self, value) -> dict:
        """{tensor: value} for a user's feed `value` of `original`; raise if it has
        the wrong number of rows."""
        array = np.asarray(value)
        expected = self.units * self.rows
        if array.ndim == 0 or array.shape[0] != expected:
            got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows (shape {array.shape})"
            raise ParallelizeError(
                f"the feed of placeholder {self.original.name} (shape {self.original.shape}) holds "
                f"{got}, but this step runs {self.units} micro-batches of {self.rows} (replicas x "
                f"pipeline.num_micro_batch on this worker): feed {expected} rows, the "
                f"micro-batches concatenated replica-major (io.batch_mode 'replica', EPL's "
                "contract). To feed one batch that EPL slices among the replicas instead, set "
                "io.batch_mode to 'global'.")
        return {self.widened: array, self.original: array[:self.rows]}


@dataclasses.dataclass
class UnitInputs:
    """What the units read and what they weigh.

    tensors: template batch tensor -> [what unit u reads in its place].
    unit_weights: per unit, its share of the global batch.
    replica_weights: per replica, the sum of its units' shares.
    micro_scales: per replica, per micro-batch, its share of the replica's rows
      (how its gradient enters the replica's accumulated gradient).
    feeds: user's placeholder -> FeedRedirect (replica mode, static batch).
    draws: the ops that draw the step's batches from the user's iterators
      (every unit's GetNext in replica mode, the user's own in global mode).
    shape_constants: forward Const -> the batch tensor whose static shape it holds
      (global mode: the copies compute that shape from their own slice).
    unit_rows: static rows per unit (None where only known at run time).
    """

    tensors: dict
    unit_weights: list
    replica_weights: list
    micro_scales: list
    feeds: dict
    shape_constants: dict
    unit_rows: list
    draws: list = dataclasses.field(default_factory=list)

    def of_unit(self, unit: int) -> dict:
        """{template batch tensor: what unit `unit` reads}."""
        return {t: parts[unit] for t, parts in self.tensors.items()}


# --------------------------------------------------------------------------
# analysis (validate: nothing is added to the graph)
# --------------------------------------------------------------------------


def supports_uneven_shares(view, mode: str) -> bool:
    """True if replicas may take batches of different sizes: always in global mode;
    in replica mode only when every batch input is a dynamic-batch placeholder."""
    if mode == GLOBAL_MODE:
        return True
    return all(t.op.type in PLACEHOLDER_TYPES and t.shape.rank and t.shape[0] is None
               for t in view.batch_inputs)


def check_batch(view, plan, micro: int, mode: str) -> list[int] | None:
    """Static rows per replica (None when only known at run time); raise on a batch
    that cannot be cut as the plan and `mode` ask."""
    if mode == REPLICA_MODE:
        return _check_replica_mode(view, plan, micro)
    return _check_global_mode(view, plan, micro)


def _check_replica_mode(view, plan, micro: int) -> list[int] | None:
    if not plan.even and not supports_uneven_shares(view, REPLICA_MODE):
        fixed = [t.name for t in view.batch_inputs if not (
            t.op.type in PLACEHOLDER_TYPES and t.shape.rank and t.shape[0] is None)]
        raise ParallelizeError(
            f"uneven replica shares {[round(w, 4) for w in plan.replica_weights]} need batches of "
            f"different sizes, but with io.batch_mode 'replica' every replica draws the script's "
            f"own batch, and these batch inputs have a fixed size or come from an iterator: "
            f"{', '.join(fixed[:5])}. Set io.batch_mode to 'global' (the script's batch is sliced "
            "among the replicas by share), feed a placeholder with a None batch dimension, or "
            "use even shares.")
    optional = [t.name for t in view.batch_inputs if t.op.type == "OptionalGetValue"]
    if optional and plan.num_replicas * micro > 1:
        raise ParallelizeError(
            f"the batch comes from Iterator.get_next_as_optional() ({', '.join(optional[:3])}); "
            "with io.batch_mode 'replica' every replica and micro-batch draws its own batch, "
            "which EPL does for get_next() only. Use iterator.get_next(), or set io.batch_mode "
            "to 'global'.")
    batch = view.global_batch_size
    return None if batch is None else [batch * micro] * plan.num_replicas


def _check_global_mode(view, plan, micro: int) -> list[int] | None:
    batch = view.global_batch_size
    if batch is None:
        return None
    inputs = ", ".join(t.name for t in view.batch_inputs)
    if plan.even and batch % plan.num_replicas:
        raise ParallelizeError(
            f"the global batch of {batch} examples cannot be split evenly over "
            f"{plan.num_replicas} replicas (io.batch_mode 'global'; inputs: {inputs}). Use a "
            f"global batch size divisible by {plan.num_replicas}, or io.batch_mode 'replica' "
            "(the default: the script's batch is one replica's micro-batch).")
    sizes = plan.batch_sizes(batch)
    if min(sizes) < 1:
        raise ParallelizeError(
            f"the global batch of {batch} examples leaves a replica with no examples "
            f"(per-replica sizes {sizes}). Use a global batch of at least "
            f"{plan.num_replicas} examples.")
    if any(size % micro for size in sizes):
        replicas = plan.num_replicas
        raise ParallelizeError(
            f"pipeline.num_micro_batch={micro} does not divide the batch: the per-replica "
            f"batch sizes {sizes} (global batch {batch} over {replicas} replica(s); inputs: "
            f"{inputs}) cannot each be cut into {micro} equal micro-batches. Use a global "
            f"batch size divisible by {replicas * micro} ({replicas} replica(s) x {micro} "
            f"micro-batches), or a pipeline.num_micro_batch that divides every replica's batch.")
    return sizes


def check_sliced_shapes(view, unit_rows: list[int]) -> None:
    """Global mode, static batch: refuse a forward graph that cannot run on a slice.

    Runs TensorFlow's shape inference on the forward ops with the batch inputs
    cut to each distinct slice size, in a scratch graph (the user's graph is not
    touched). Refuses, naming the op, its static shape and the batch size, when
    inference fails (a reshape to a shape holding the whole batch) or when a
    broadcasting op's output keeps the whole batch while one of its inputs was
    sliced (a constant of the whole batch re-inflated it).
    """
    batch = view.global_batch_size
    if batch is None:
        return
    forward = [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]
    if not forward:
        return
    if any(rows != batch for rows in unit_rows):
        _refuse_functions_on_the_batch(view, forward, batch)
    for rows in sorted(set(unit_rows)):
        if rows != batch:
            _check_slice(view, forward, batch, rows)


def _refuse_functions_on_the_batch(view, forward: list, batch: int) -> None:
    """v2 control flow (If, While, their functions) on the batch: the functions were
    traced for the whole batch, and a slice cannot run through them."""
    derived = descendants(view.batch_inputs)
    calls = [op for op in forward if op in derived and calls_functions(op)]
    if calls:
        raise ParallelizeError(
            f"io.batch_mode 'global' slices the batch of {batch} examples, but "
            f"{view.describe_op(calls[0])} runs v2 control flow on it: its functions were "
            f"built for the whole batch and cannot run on a slice"
            + (f" ({len(calls) - 1} more such op(s))" if len(calls) > 1 else "") +
            ". Use io.batch_mode 'replica' (the default: every replica runs them on a batch "
            "of the script's size), or a batch dimension of None.")


def _check_slice(view, forward: list, batch: int, rows: int) -> None:
    remedy = ("Build the shape with -1 or tf.shape(x)[0] instead of the batch size, or use "
              "io.batch_mode 'replica' (the default: every replica reads a whole batch of the "
              "script's size, so its static shapes stay valid).")
    if _scratch_import(view, forward, batch)[1] is not None:
        return  # the scratch graph does not stand for this model: nothing to conclude
    scratch, err = _scratch_import(view, forward, rows)
    if err is not None:
        op = _named_op(view.graph, str(err))
        where = view.describe_op(op) if op is not None else "an op of the model"
        raise ParallelizeError(
            f"io.batch_mode 'global' slices the batch of {batch} examples into slices of {rows}, "
            f"but {where} holds the whole batch in a constant and cannot run on a slice "
            f"(TensorFlow: {str(err).splitlines()[0][:300]}). {remedy}")
    for op in forward:
        if op.type not in _BROADCASTING or not op.outputs:
            continue
        copy = scratch.get_operation_by_name(op.name)
        if _first_dim(op.outputs[0]) == batch and _first_dim(copy.outputs[0]) == batch and any(
                _first_dim(t) == batch and _first_dim(c) == rows
                for t, c in zip(op.inputs, copy.inputs)):
            raise ParallelizeError(
                f"io.batch_mode 'global' slices the batch of {batch} examples into slices of "
                f"{rows}, but {view.describe_op(op)} broadcasts a slice against a tensor that "
                f"holds the whole batch of {batch} (a constant or a shape built from the batch "
                f"size), so its result would keep {batch} rows. {remedy}")


def _scratch_import(view, forward: list, rows: int):
    """(scratch graph, None) with the replicated forward ops imported on batch inputs
    of `rows` rows, or (None, the import error). Inputs from outside that region
    (the input pipeline) become placeholders of their static shape; outputs of
    split ops (which run once over the whole batch, sliced per replica) become
    placeholders with an unknown first dimension."""
    sources = {t.op for t in view.batch_inputs}
    split = set(view.split_ops)
    keep = (ancestors(forward) - ancestors(sources) - split) | sources
    names = {op.name for op in keep}
    graph_def = graph_pb2.GraphDef()
    stand_ins: dict = {}
    folded = shape_constants_of(view)   # the copies compute these from their slice
    # where a split output's rows lie (epl/passes/split/boundary.py)
    rows_axes = batch_axes(view, [t for op in keep for t in op.inputs if t.op in split]) \
        if split else {}
    for op in sorted(keep, key=lambda o: o._id):
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        del node.input[:]
        if COLOCATION_ATTR in node.attr:
            del node.attr[COLOCATION_ATTR]
        if op in folded:
            source = folded[op]
            node.op = "Shape"
            node.attr.clear()
            node.attr["out_type"].type = op.outputs[0].dtype.as_datatype_enum
            node.attr["T"].type = source.dtype.as_datatype_enum
            node.input.append(source.name)
        elif op in sources:
            _slice_source(node, op, rows, graph_def, stand_ins)
        else:
            for tensor in op.inputs:
                node.input.append(tensor.name if tensor.op.name in names else scratch_placeholder(
                    graph_def, stand_ins, tensor, unknown_rows=tensor.op in split,
                    rows_axis=rows_axes.get(tensor, 0)))
        node.input.extend(f"^{c.name}" for c in op.control_inputs
                          if c.name in names and op not in sources and op not in folded)
    scratch = tf.Graph()
    try:
        with scratch.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, tf.errors.InvalidArgumentError) as err:
        return None, err
    return scratch, None


def _slice_source(node, op: tf.Operation, rows: int, graph_def, stand_ins: dict) -> None:
    """Rewrite a batch input's NodeDef (inputs cleared) so its outputs have `rows` rows."""
    if op.type in PLACEHOLDER_TYPES:
        node.op = "Placeholder"
        for key in list(node.attr):
            if key not in ("dtype", "shape"):
                del node.attr[key]
        if node.attr["shape"].shape.dim:
            node.attr["shape"].shape.dim[0].size = rows
    elif op.type in ("IteratorGetNext", "IteratorGetNextSync"):
        node.input.append(scratch_placeholder(graph_def, stand_ins, op.inputs[0]))
        for shape in node.attr["output_shapes"].list.shape:
            if shape.dim:
                shape.dim[0].size = rows
    elif op.type == "Const":
        value = tf.make_ndarray(node.attr["value"].tensor)[:rows]
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    else:  # another source (OptionalGetValue): a placeholder of its sliced shape
        node.op = "Placeholder"
        dtype = op.outputs[0].dtype.as_datatype_enum
        shape = op.outputs[0].shape
        node.attr.clear()
        node.attr["dtype"].type = dtype
        if shape.rank is not None:
            node.attr["shape"].shape.CopyFrom(
                tf.TensorShape([rows] + shape.as_list()[1:]).as_proto())


def _first_dim(tensor: tf.Tensor) -> int | None:
    shape = tensor._shape_tuple()
    return shape[0] if shape else None


def _named_op(graph: tf.Graph, message: str) -> tf.Operation | None:
    """The op TensorFlow's shape-inference error is about (it quotes the node's name)."""
    for marker in ("{{node ", "for '", "node "):
        start = message.find(marker)
        while start >= 0:
            rest = message[start + len(marker):]
            name = rest.split("}}")[0].split("'")[0].split(" ")[0]
            try:
                return graph.get_operation_by_name(name)
            except (KeyError, ValueError):
                start = message.find(marker, start + 1)
    return None


# --------------------------------------------------------------------------
# rewrite (run)
# --------------------------------------------------------------------------


def build_unit_inputs(view, plan, micro: int, mode: str, communicator, host: str,
                      sizes: list[int] | None) -> UnitInputs:
    """Add the ops that give every unit its batch; return what each reads and weighs."""
    if mode == REPLICA_MODE:
        tensors, feeds, unit_rows = _replica_inputs(view, plan, micro, host)
        shape_constants = {}
    else:
        tensors, unit_rows = _global_inputs(view, plan, micro, host, sizes)
        feeds, shape_constants = {}, shape_constants_of(view)
    unit_weights = _unit_weights(view, tensors, unit_rows, communicator, host)
    replicas = plan.num_replicas
    replica_weights, micro_scales = [], []
    for k in range(replicas):
        mine = unit_weights[k * micro:(k + 1) * micro]
        if all(isinstance(w, float) for w in mine):
            total = sum(mine)
            rows = unit_rows[k * micro:(k + 1) * micro]
            replica_weights.append(total)
            micro_scales.append([r / sum(rows) for r in rows] if None not in rows
                                else [w / total for w in mine])
        else:
            with tf.device(host), tf.name_scope(SLICE_SCOPE):
                total = tf.add_n([tf.cast(w, tf.float32) for w in mine]) if micro > 1 \
                    else tf.cast(mine[0], tf.float32)
                replica_weights.append(total)
                micro_scales.append([tf.cast(w, tf.float32) / total for w in mine]
                                    if micro > 1 else [1.0])
    draws = []
    for parts in tensors.values():
        for part in parts:
            if part.op.type in ITERATOR_OUTPUT_TYPES and part.op not in draws:
                draws.append(part.op)
    for tensor in view.batch_inputs:   # global mode slices the user's own draw
        if tensor.op.type in ITERATOR_OUTPUT_TYPES and tensor.op not in draws:
            draws.append(tensor.op)
    return UnitInputs(tensors, unit_weights, replica_weights, micro_scales, feeds,
                      shape_constants, unit_rows, draws)


def _replica_inputs(view, plan, micro: int, host: str):
    """Replica mode: a draw per unit, widened placeholders, shared constants."""
    units = plan.num_replicas * micro
    tensors, feeds, draws = {}, {}, {}
    for tensor in view.batch_inputs:
        op = tensor.op
        if units == 1:
            tensors[tensor] = [tensor]
        elif op.type in ITERATOR_OUTPUT_TYPES:
            if op not in draws:
                draws[op] = _draws(op, units)
            tensors[tensor] = [d.outputs[tensor.value_index] for d in draws[op]]
        elif op.type in PLACEHOLDER_TYPES and tensor.shape[0] is not None:
            redirect = _widened(tensor, units, host)
            feeds[tensor] = redirect
            with tf.device(host), tf.name_scope(SLICE_SCOPE):
                tensors[tensor] = tf.split(redirect.widened, units, axis=0)
        elif op.type in PLACEHOLDER_TYPES:
            tensors[tensor] = _runtime_slices(tensor, plan, micro, host)
        else:  # a constant: every micro-batch is the constant itself
            tensors[tensor] = [tensor] * units
    first = view.batch_inputs[0]
    rows = first.shape[0] if first.shape.rank else None
    return tensors, feeds, [rows] * units


def _draws(op: tf.Operation, units: int) -> list[tf.Operation]:
    """[the user's GetNext, then one draw per further unit], each drawing after the one
    before it (control edges), on the iterator's device.

    A further unit draws through an optional (IteratorGetNextAsOptional): when the input
    ends within a step (a dataset without drop_remainder, or one whose batches do not
    fill the last step), its check fails with SHORT_INPUT_MARKER and the rows the earlier
    units of the step drew, which the session reports as the end of the input and logs
    as the rows dropped (no silent loss of the short last batch)."""
    if op.type != "IteratorGetNext" or units == 1:
        return _copied_draws(op, units)
    types, shapes = op.get_attr("output_types"), op.get_attr("output_shapes")
    draws = [op]
    rows_of = next((i for i, t in enumerate(op.outputs) if t.shape.rank != 0), None)
    drawn = None   # the rows the draws so far returned: a running sum, one add per draw
    # (a sum over all earlier draws for each draw made the check quadratic in the
    # units: 10,080 ops for 64 micro-batches, a third of the step's graph ops)
    with tf.device(op.device), tf.name_scope(FEED_SCOPE):
        for unit in range(1, units):
            with tf.control_dependencies([draws[-1]]):
                optional = tf.raw_ops.IteratorGetNextAsOptional(
                    iterator=op.inputs[0], output_types=types, output_shapes=shapes)
                if rows_of is None:
                    drawn = tf.constant(0, tf.int64)
                else:
                    rows = tf.shape(draws[-1].outputs[rows_of], out_type=tf.int64)[0]
                    drawn = rows if drawn is None else drawn + rows
                # the raw op: tf.debugging.Assert guards it with a cond (an If and two
                # functions in the graph per draw)
                check = tf.raw_ops.Assert(condition=tf.raw_ops.OptionalHasValue(optional=optional),
                                          data=[SHORT_INPUT_MARKER, drawn, unit, units])
                with tf.control_dependencies([check]):
                    draws.append(tf.raw_ops.OptionalGetValue(
                        optional=optional, output_types=types, output_shapes=shapes)[0].op)
    return draws


def _copied_draws(op: tf.Operation, units: int) -> list[tf.Operation]:
    """[the user's GetNext, then one copy per further unit], each drawing after the
    one before it (control edges), on the iterator's device; one import."""
    batch = NodeBatch(op.graph)
    names, previous = [], None
    for _ in range(1, units):
        name = batch.new_name(f"{FEED_SCOPE}/{op.name}")
        node = copy_node_def(op, name, op.device)
        node.input.extend(batch.ref(t) for t in op.inputs)
        node.input.extend(batch.control_ref(c) for c in op.control_inputs)
        node.input.append(f"^{previous}" if previous else batch.control_ref(op))
        previous = batch.add(node)
        names.append(name)
    created = batch.commit()
    return [op] + [created[name] for name in names]


def _widened(tensor: tf.Tensor, units: int, host: str) -> FeedRedirect:
    """EPL's placeholder for `units` micro-batches of a static-batch placeholder."""
    rows = tensor.shape[0]
    shape = [units * rows] + tensor.shape.as_list()[1:]
    with tf.device(host), tf.name_scope(FEED_SCOPE):
        if tensor.op.type == "PlaceholderWithDefault":
            default = tf.concat([tensor.op.inputs[0]] * units, axis=0)
            widened = tf.compat.v1.placeholder_with_default(default, shape, name=tensor.op.name)
        else:
            widened = tf.compat.v1.placeholder(tensor.dtype, shape, name=tensor.op.name)
    return FeedRedirect(tensor, widened, units, rows)


def _global_inputs(view, plan, micro: int, host: str, sizes: list[int] | None):
    """Global mode: every batch input sliced among the units."""
    units = plan.num_replicas * micro
    tensors = {}
    if sizes is not None:
        unit_rows = [s // micro for s in sizes for _ in range(micro)]
        with tf.device(host), tf.name_scope(SLICE_SCOPE):
            for tensor in view.batch_inputs:
                tensors[tensor] = tf.split(tensor, unit_rows, axis=0) if units > 1 else [tensor]
        return tensors, unit_rows
    for tensor in view.batch_inputs:
        tensors[tensor] = _runtime_slices(tensor, plan, micro, host)
    return tensors, [None] * units


def _runtime_slices(tensor: tf.Tensor, plan, micro: int, host: str) -> list[tf.Tensor]:
    """`tensor`'s rows cut at run time: into R parts by the plan's shares (equal
    parts when even), each into `micro` equal micro-batches; Asserts fail the step
    when a count does not divide."""
    replicas = plan.num_replicas
    units = replicas * micro
    if units == 1:
        return [tensor]
    with tf.device(host), tf.name_scope(SLICE_SCOPE):
        rows = tf.shape(tensor, out_type=tf.int64)[0]
        if plan.even:
            what = (f"{replicas} replicas" if micro == 1
                    else f"{replicas} replicas x {micro} micro-batches")
            check = tf.debugging.Assert(
                tf.equal(rows % units, 0),
                [f"EPL: the batch cannot be split evenly over {what}; rows:", rows])
            with tf.control_dependencies([check]):
                bounds = [rows * u // units for u in range(units + 1)]
        else:
            cumulative = [sum(plan.replica_weights[:k]) for k in range(replicas + 1)]
            replica_bounds = [tf.cast(tf.round(tf.cast(rows, tf.float64) * c), tf.int64)
                              for c in cumulative[:-1]] + [rows]
            bounds = _micro_bounds(replica_bounds, micro)
        return [tensor[bounds[u]:bounds[u + 1]] for u in range(units)]


def _micro_bounds(bounds: list, micro: int) -> list:
    """Run-time boundaries of every unit from the replicas' ones: each replica's
    rows cut into `micro` equal slices (an Assert fails the step otherwise)."""
    if micro == 1:
        return list(bounds)
    sizes = [bounds[k + 1] - bounds[k] for k in range(len(bounds) - 1)]
    check = tf.debugging.Assert(
        tf.reduce_all(tf.equal(tf.stack(sizes) % micro, 0)),
        [f"EPL: pipeline.num_micro_batch={micro} does not divide every replica's batch; "
         "per-replica batch sizes:", tf.stack(sizes)])
    with tf.control_dependencies([check]):
        unit_bounds = [bounds[k] + size * m // micro
                       for k, size in enumerate(sizes) for m in range(micro)]
    return unit_bounds + [bounds[-1]]


def _unit_weights(view, tensors: dict, unit_rows: list, communicator, host: str) -> list:
    """Each unit's share of the global batch (floats when every row count is static
    and there is one worker)."""
    first = view.batch_inputs[0]
    parts = tensors[first]
    if None not in unit_rows and communicator.num_workers == 1:
        total = sum(unit_rows)
        return [rows / total for rows in unit_rows]
    with tf.device(host), tf.name_scope(SLICE_SCOPE):
        if None not in unit_rows:
            rows = [tf.constant(float(r)) for r in unit_rows]
        else:
            rows = [tf.cast(tf.shape(p)[0], tf.float32) for p in parts]
        local = tf.add_n(rows) if len(rows) > 1 else rows[0]
        total = communicator.sum_over_workers(local) if communicator.num_workers > 1 else local
        return [r / total for r in rows]


def shape_constants_of(view) -> dict:
    """Forward constants holding the static shape of a batch-sized tensor -> that tensor.

    Global mode: TensorFlow folds tf.shape(t) into a Const when t's shape is
    fully defined (library code does this too: softmax_cross_entropy_with_logits
    reshapes its result to such a folded shape), which bakes the global batch
    size into the graph; each unit must use the shape of its own slice instead.
    A constant matches t when it is an integer vector equal to t's static shape,
    t's first dimension is the global batch and t is a batch input or a forward
    op computed from one (also through split ops: a split op's output a forward op
    reads); t is the latest such tensor created before the
    constant (tf.shape folds an existing tensor). Read from values and shapes,
    never from names.
    """
    batch = view.global_batch_size
    if batch is None:
        return {}
    forward = {op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD}
    # through split ops too: a split part before the replicated body (an embedding
    # under epl.split) returns the global batch's rows to it
    split = set(view.split_ops)
    derived = descendants(view.batch_inputs, within=forward | split)
    latest: dict = {}
    for tensor in view.batch_inputs:
        if tensor.shape.is_fully_defined():
            latest.setdefault(tuple(tensor.shape.as_list()), tensor)
    found = {}
    for op in view.graph.get_operations():  # creation order
        if op in forward and op.type == "Const" and op.outputs[0].dtype in (tf.int32, tf.int64) \
                and op.outputs[0].shape.rank == 1:
            value = tuple(int(v) for v in tf.make_ndarray(op.get_attr("value")).reshape(-1))
            if value and value[0] == batch and value in latest:
                found[op] = latest[value]
        if op in derived:
            for tensor in op.outputs:
                if op in split and not any(c in forward for c in tensor.consumers()):
                    continue   # only what the split part hands to the replicas
                shape = tensor.shape
                if shape.rank and shape.is_fully_defined() and shape[0] == batch:
                    latest[tuple(shape.as_list())] = tensor
    return found
