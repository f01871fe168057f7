"""Where data-parallel replicas meet split TaskGraphs (used by the replicate pass).

The split pass (epl/passes/split/split.py) rewrote each `epl.split` TaskGraph at
gradient time into per-device ops over the global batch. The replicate pass
then copies the replicated TaskGraphs once per replica, each on its slice of
the batch (batch axis 0). This module builds the exchanges between the two:

- Into a split op, from the replicas: a batch-derived tensor becomes the
  concatenation of every replica's copy along axis 0, built on the split op's
  device (an all-gather: each replica's rows travel once to each device that
  reads them). When the split op is a dispatch slice (an expert slice along a
  non-batch axis, `SplitRecord.slicers`), each replica slices its own copy
  first and the device concatenates only its experts' slices: an all-to-all.
  A scalar (a batch mean) becomes the batch-share-weighted sum of the copies,
  a scalar read from the batch's shape only (a count of rows) their sum;
  the Shape of a batch tensor, the shape of the gathered rows;
  a tensor that does not depend on the examples comes from replica 0.
- Out of a split op, into replica k: the rows of replica k along axis 0 (of a
  Shape of a batch tensor: the shape of replica k's rows). When
  the tensor is the combine concat of expert shards (`SplitRecord.gathers`
  along a non-batch axis), each shard sends replica k only its rows and the
  replica concatenates them: the all-to-all back. Tensors that do not depend
  on the examples (weights) go to every replica whole.

Row boundaries follow the replicas' batch shares: round(rows x cumulative
share), exact when the rows are the batch times a constant (tokens per example).

The rows of a tensor lie along its batch axis (`batch_axes`), axis 0 unless
the model moves the examples elsewhere: FastNN's expert layout
tf.einsum("GSEC,GSM->EGCM", ...) puts experts first and the groups (examples)
second, so its replicas' slices are concatenated, and its rows cut, along axis 1.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from epl.errors import ParallelizeError
from epl.ir.annotations import REPLICA_ATTR
from epl.ir.clone import COLOCATION_ATTR, replace_input
from epl.ir.graph_view import ancestors, descendants


def batch_axes(view, tensors) -> dict:
    """{tensor: the axis that holds its examples} for batch-derived `tensors`.

    Found by TensorFlow's shape inference on a scratch copy of the ops that
    compute them (the user's graph is not touched), with the batch inputs given
    an unknown first dimension: the one axis that becomes unknown. Axis 0 when
    no single axis does (a batch size baked into a constant, or a graph the
    scratch copy cannot stand for).
    """
    tensors = [t for t in tensors if t.shape.rank]
    if not tensors:
        return {}
    scratch = _unknown_batch_copy(view, {t.op for t in tensors})
    axes = {}
    for tensor in tensors:
        axes[tensor] = 0
        if scratch is None:
            continue
        copy = scratch.get_tensor_by_name(tensor.name).shape
        if copy.rank != tensor.shape.rank:
            continue
        unknown = [axis for axis, (a, b) in enumerate(zip(tensor.shape.as_list(), copy.as_list()))
                   if a is not None and b is None]
        if len(unknown) == 1:
            axes[tensor] = unknown[0]
    return axes


def _unknown_batch_copy(view, targets: set):
    """A scratch graph of the ops `targets` need, the batch inputs replaced by
    placeholders with an unknown first dimension (None if it cannot be built)."""
    batch = set(view.batch_inputs)
    keep = ancestors(targets) - ancestors({t.op for t in batch})
    names = {op.name for op in keep}
    graph_def = graph_pb2.GraphDef()
    stand_ins: dict = {}

    def stand_in(tensor: tf.Tensor, unknown_rows: bool) -> str:
        return scratch_placeholder(graph_def, stand_ins, tensor, unknown_rows)

    for op in sorted(keep, key=lambda o: o._id):
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        del node.input[:]
        if COLOCATION_ATTR in node.attr:
            del node.attr[COLOCATION_ATTR]
        for tensor in op.inputs:
            node.input.append(tensor.name if tensor.op.name in names and tensor not in batch
                              else stand_in(tensor, tensor in batch))
        node.input.extend(f"^{c.name}" for c in op.control_inputs if c.name in names)
    scratch = tf.Graph()
    try:
        with scratch.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, tf.errors.InvalidArgumentError):
        return None
    return scratch


class SplitBoundary:
    """Builds the exchanges between replicated copies and split ops."""

    def __init__(self, view, plan, weights: list, records: list, replica_device):
        self.view = view
        self.plan = plan
        self.weights = weights
        self.replica_device = replica_device          # k -> a device of replica k
        self.split_set = set(view.split_ops)
        self.slicers = {t: s for record in records for t, s in record.slicers.items()}
        self.gathers = {t: g for record in records for t, g in record.gathers.items()}
        self.batch_derived = descendants(view.batch_inputs)
        boundary = {t for op in view.split_ops for t in op.inputs
                    if t.op not in self.split_set and t.op in self.batch_derived}
        boundary |= {t for op in view.split_ops for t in op.outputs if t.op in self.batch_derived}
        self.axes = batch_axes(view, sorted(boundary, key=lambda t: (t.op._id, t.value_index)))
        self._cache: dict = {}

    # -- split -> replicas -----------------------------------------------------
    def outputs_to_replicas(self, forward: list) -> dict:
        """{split tensor read by a replicated forward op: [replica k's value]}."""
        read = []
        for op in forward:
            for tensor in op.inputs:
                if tensor.op in self.split_set and tensor not in read:
                    read.append(tensor)
        return {tensor: [self._rows_for(tensor, k) for k in range(self.plan.num_replicas)]
                for tensor in read}

    def _rows_for(self, tensor: tf.Tensor, k: int) -> tf.Tensor:
        if tensor.shape.rank == 0 or tensor.op not in self.batch_derived:
            return tensor
        if tensor.op.type == "Shape":   # the shape of a batch tensor: of replica k's rows
            rows = self._rows_for(tensor.op.inputs[0], k)
            with tf.name_scope("EPL_SPLIT_BOUNDARY"), tf.device(rows.device), \
                    tensor.graph._attr_scope({REPLICA_ATTR: tf.compat.v1.AttrValue(i=k)}):
                return tf.shape(rows, out_type=tensor.dtype)
        device = self.replica_device(k)
        gather = self.gathers.get(tensor)
        rows_axis = self.axes.get(tensor, 0)
        with tf.name_scope("EPL_SPLIT_BOUNDARY"), \
                tensor.graph._attr_scope({REPLICA_ATTR: tf.compat.v1.AttrValue(i=k)}):
            if gather is not None and gather[1] != rows_axis:   # all-to-all back: shards -> k
                parts, axis = gather
                pieces = []
                for part in parts:
                    with tf.device(part.device):
                        pieces.append(self._rows(part, k, rows_axis))
                with tf.device(device):
                    return tf.concat(pieces, axis=axis)
            with tf.device(tensor.device):
                return self._rows(tensor, k, rows_axis)

    def _rows(self, tensor: tf.Tensor, k: int, axis: int = 0) -> tf.Tensor:
        """Replica k's rows (along `axis`) of a tensor over the global batch."""
        weights = self.weights
        static = tensor.shape[axis] if tensor.shape.rank else None
        lead = (slice(None),) * axis
        if static is not None and all(isinstance(w, float) for w in weights):
            bounds = [int(round(static * sum(weights[:j]))) for j in range(len(weights))]
            bounds.append(static)
            return tensor[lead + (slice(bounds[k], bounds[k + 1]),)]
        rows = tf.cast(tf.shape(tensor, out_type=tf.int64)[axis], tf.float64)
        cumulative = [tf.add_n([tf.cast(w, tf.float64) for w in weights[:j]]) if j else
                      tf.constant(0.0, tf.float64) for j in range(len(weights))]
        start = tf.cast(tf.round(rows * cumulative[k]), tf.int64)
        end = (tf.cast(tf.round(rows * cumulative[k + 1]), tf.int64) if k + 1 < len(weights)
               else tf.cast(rows, tf.int64))
        return tensor[lead + (slice(start, end),)]

    # -- replicas -> split -----------------------------------------------------
    def connect_inputs(self, forward_copies: dict) -> list:
        """Make every split op read the replicas' copies instead of the template.

        forward_copies: replica k -> {template forward op: its copy}. Returns the
        dispatch slices it bypassed (they no longer run).
        """
        replicas = self.plan.num_replicas
        template = forward_copies[0]
        bypassed = []
        for op in self.view.split_ops:
            for tensor in list(op.inputs):
                if tensor.op not in template:
                    continue
                copies = [forward_copies[k][tensor.op].outputs[tensor.value_index]
                          for k in range(replicas)]
                slicer = self.slicers.get(op.outputs[0]) if op.outputs else None
                rows_axis = self.axes.get(tensor, 0)
                if slicer is not None and slicer.source is tensor and slicer.axis != rows_axis \
                        and tensor.op in self.batch_derived:
                    dispatched = self._dispatch(copies, slicer, op.device, rows_axis)
                    for consumer in list(op.outputs[0].consumers()):
                        replace_input(consumer, op.outputs[0], dispatched)
                    bypassed.append(op)
                    continue
                replace_input(op, tensor, self._gathered(tensor, copies, op.device))
        return bypassed

    def _dispatch(self, copies: list, slicer, device: str, rows_axis: int = 0) -> tf.Tensor:
        """All-to-all: each replica sends the device its slice along slicer.axis (its
        rows lie along rows_axis); for one chunk of a chunked dispatch
        (`slicer.chunk`, split.moe_chunks), only that chunk of its tokens."""
        chunk = getattr(slicer, "chunk", None)
        if chunk is not None and chunk[0] == rows_axis:
            raise ParallelizeError(
                f"split.moe_chunks cuts the expert dispatch of {slicer.source.name} along "
                f"its axis {rows_axis}, which holds the examples; the chunks must cut a "
                "capacity axis of their own (tokens [batch, experts, capacity, d] or "
                "[experts, groups, capacity, d]). Set split.moe_chunks to 1 for this model.")
        pieces = []
        for k, copy in enumerate(copies):
            begin = [0] * copy.shape.rank
            size = [-1] * copy.shape.rank
            begin[slicer.axis], size[slicer.axis] = slicer.offset, slicer.size
            if chunk is not None:
                begin[chunk[0]], size[chunk[0]] = chunk[1], chunk[2]
            with tf.device(copy.device), tf.name_scope("EPL_SPLIT_DISPATCH"):
                pieces.append(tf.slice(copy, begin, size))
        with tf.device(device), tf.name_scope("EPL_SPLIT_DISPATCH"):
            return tf.concat(pieces, axis=rows_axis)

    def _from_shapes(self, tensor: tf.Tensor) -> bool:
        """True if `tensor` is a count of the rows of batch tensors: a product of the
        Shape or Size of tensors of rank >= 1, cast (as a loss's mean divides by).
        Such a count is linear in the rows, so the replicas' counts add up. Anything
        else read from the batch (its values, the Shape of a scalar, one of the
        other dimensions) is not a count."""
        stack, seen, counted = [tensor.op], set(), False
        while stack:
            op = stack.pop()
            if op in seen or op not in self.batch_derived:
                continue
            seen.add(op)
            if op.type in ("Shape", "Size"):
                if op.inputs[0].shape.rank in (None, 0):
                    return False
                counted = True
            elif op.type in ("Cast", "Identity", "Prod"):
                stack.extend(t.op for t in op.inputs)
            else:
                return False
        return counted

    def _gathered(self, tensor: tf.Tensor, copies: list, device: str) -> tf.Tensor:
        key = (tensor, device)
        if key in self._cache:
            return self._cache[key]
        with tf.device(device), tf.name_scope("EPL_SPLIT_GATHER"):
            if tensor.shape.rank == 0 and self._from_shapes(tensor):   # a count of rows
                value = tf.add_n(copies)
            elif tensor.shape.rank == 0:     # a mean over the batch: weight by batch share
                value = tf.add_n([tf.cast(w, c.dtype) * c for w, c in zip(self.weights, copies)])
            elif tensor.op not in self.batch_derived:
                value = copies[0]
            elif tensor.op.type == "Shape":  # the shape of the gathered rows (axis 0)
                rows = tf.add_n([c[0] for c in copies])
                value = tf.concat([tf.reshape(rows, [1]), copies[0][1:]], axis=0)
            else:                            # all-gather of the replicas' rows
                value = tf.concat(copies, axis=self.axes.get(tensor, 0))
        self._cache[key] = value
        return value


def scratch_placeholder(graph_def, stand_ins: dict, tensor: tf.Tensor, unknown_rows: bool = False,
                        rows_axis: int = 0) -> str:
    """The name of a placeholder in `graph_def` (a scratch graph for shape inference)
    standing in for `tensor`, a tensor outside the imported region: added on first
    use and remembered in `stand_ins` (tensor -> name). With unknown_rows its
    `rows_axis` is unknown."""
    if tensor not in stand_ins:
        node = graph_def.node.add()
        node.name = f"EPL_SCRATCH_INPUT/{len(stand_ins)}"
        node.op = "Placeholder"
        node.attr["dtype"].type = tensor.dtype.base_dtype.as_datatype_enum
        if tensor.shape.rank is not None:
            shape = tensor.shape.as_list()
            if unknown_rows and shape:
                shape[rows_axis] = None
            node.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
        stand_ins[tensor] = node.name
    return stand_ins[tensor]
