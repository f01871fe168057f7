"""Gradient communication with fusion: one reduction per bucket of gradients.

For every gradient the replicate pass produced (one copy per replica) the pass
reduces the copies through the communicator (local collectives, then Horovod
across workers) and makes each replica's update ops read the result.

Weighting. With the default `communication.gradients_reduce_method: mean` the
reduced gradient is sum_k share_k x gradient_k (share = the replica's part of
the global batch), which equals the single-device gradient of the mean loss
over the whole global batch; with even shares on one worker it is a plain mean
(the collective divides). With `sum` the copies are summed.

Fusion. Dense gradients are grouped by device (pipeline stage) and dtype into buckets of at most
`communication.fusion_threshold_mb` (Horovod's default fusion buffer, 128 MB)
and, when `communication.max_splits` is set, into at most that many buckets.
Buckets are filled and issued in reverse order of the forward pass (last layers
first: the order backward produces them, so communication can overlap the rest
of backward). Each bucket is flattened into one vector, reduced once, and split
back into the gradients' shapes.

`communication.fp16` sends float32 buckets as float16, multiplied by
`communication.fp16_scale` before the cast and divided after, to keep small
gradients out of float16's subnormal range.

Gradients the ZeRO pass (epl/passes/zero.py) already reduce-scattered are
skipped here (and counted as reduced).

Sparse gradients (tf.IndexedSlices from embedding lookups) are gathered, not
reduced: every replica gets the concatenation of all replicas' (weighted)
values and indices; the optimizer's sparse update sums duplicate indices. With
`communication.sparse_as_dense` they were made dense at gradient time and are
fused like any other.
"""
from __future__ import annotations

import dataclasses
import math

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import tensor_util

from epl.ir.annotations import PHASE_ATTR, Phase
from epl.ir.clone import NodeBatch, replace_input, with_dynamic_rows
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.replication.result import Replication
from epl.passes.zero import ZeroSharding
from epl.planner.plan import Plan
from epl.runtime.horovod_comm import names_fragment, names_label

MB = 1 << 20
_INT32_MAX = 2 ** 31 - 1  # larger static dimensions make TensorFlow write shapes as int64


def _is_apply(op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(PHASE_ATTR)
    return attr is not None and attr.s.decode() == Phase.APPLY.value


@dataclasses.dataclass
class Bucket:
    """Gradients reduced together: indices into the replication's gradient list."""

    dtype: tf.DType
    members: list[int]
    nbytes: int


def _nbytes(tensor: tf.Tensor) -> int:
    shape = tensor.shape
    elements = shape.num_elements() if shape.is_fully_defined() else 1
    return elements * tensor.dtype.size


def plan_buckets(grads: list, threshold_bytes: float, max_splits: int) -> list[Bucket]:
    """Group dense gradients (replica 0's copies) into buckets, last layer first.

    grads: one tensor per gradient in forward order. A gradient larger than the
    threshold gets a bucket of its own. With max_splits > 0 the threshold is
    raised until at most max_splits buckets per dtype remain.
    """
    order = list(reversed(range(len(grads))))
    buckets: list[Bucket] = []
    for dtype in sorted({grads[i].dtype for i in order}, key=lambda d: d.name):
        members = [i for i in order if grads[i].dtype == dtype]
        limit = threshold_bytes
        if max_splits > 0:
            total = sum(_nbytes(grads[i]) for i in members)
            limit = max(limit, math.ceil(total / max_splits))
        current: Bucket | None = None
        for i in members:
            size = _nbytes(grads[i])
            if current is None or (current.nbytes + size > limit and current.members):
                current = Bucket(dtype, [], 0)
                buckets.append(current)
            current.members.append(i)
            current.nbytes += size
        if max_splits > 0:
            _merge_excess(buckets, dtype, max_splits)
    buckets.sort(key=lambda b: -max(b.members))  # issue order: last layers first
    return buckets


def _merge_excess(buckets: list[Bucket], dtype, max_splits: int) -> None:
    mine = [b for b in buckets if b.dtype == dtype]
    while len(mine) > max_splits:
        last = mine.pop()
        mine[-1].members.extend(last.members)
        mine[-1].nbytes += last.nbytes
        buckets.remove(last)


@dataclasses.dataclass(frozen=True)
class ReducedGradients:
    """What the gradient_comm pass reduced: variable name -> how many reductions its
    gradient got (the verify pass checks it is one each); gathered: the values and
    indices of the sparse gradients every replica's update reads, gathered from every
    replica into one tensor each (the same on every replica); shapes: the shape tensors
    of replica 0's dense gradients that a fused bucket reads to split and reshape its
    reduced vector where a gradient's static shape is unknown (a gradient has its
    variable's shape, the same on every replica, whatever each replica's batch)."""

    counts: dict
    gathered: tuple = ()
    shapes: tuple = ()


class GradientCommPass(GraphPass):
    """All-reduces the gradients over replicas (fused) and rewires the updates."""

    name = "gradient_comm"
    # reduces the gradients as accumulate and unscale left them; skips those ZeRO
    # reduce-scattered itself
    requires = (Plan, Replication, ReplicaGradients)
    optional = (ZeroSharding,)
    provides = (ReducedGradients,)
    after = ("accumulate", "unscale", "zero")

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        replication = ctx.get(Replication)
        options = self.options
        method = options.reduce_method
        if replication.presummed:  # gradients already weighted by batch share (split models)
            method = "sum"
        even = ctx.get(Plan).even and ctx.communicator.num_workers == 1
        fp16_scale = options.fp16_scale
        first_new = len(graph.get_operations())
        zero = ctx.find(ZeroSharding)  # gradients ZeRO reduce-scattered itself
        sharded = zero.reduced if zero is not None else {}
        per_gradient = [entry for entry in ctx.get(ReplicaGradients).entries
                        if entry[0].name not in sharded]
        needs_comm = len(per_gradient[0][1]) > 1 or ctx.communicator.num_workers > 1 if per_gradient else False
        reduced_of: dict[str, int] = {}
        gathered: list = []
        shapes: list = []
        buckets: list[Bucket] = []
        if needs_comm:
            buckets, bucket_members = [], []
            # One set of buckets per device (pipeline stage): a bucket never mixes
            # stages, so one stage's update does not wait for another's gradients.
            for device in sorted({g[0].op.device for _, g, _ in per_gradient}):
                dense = [i for i, (_, grads, _) in enumerate(per_gradient)
                         if not isinstance(grads[0], tf.IndexedSlices) and grads[0].op.device == device]
                if not dense:
                    continue
                for bucket in plan_buckets([per_gradient[i][1][0] for i in dense],
                                           options.fusion_threshold_bytes, options.max_splits):
                    buckets.append(bucket)
                    bucket_members.append([dense[i] for i in bucket.members])
            shapes += _reduce_buckets(graph, ctx.communicator,
                            [[per_gradient[i][1] for i in members] for members in bucket_members],
                            replication.weights, method, even, fp16_scale,
                            [[per_gradient[i][0].name for i in members]
                             for members in bucket_members])
            for members in bucket_members:
                for i in members:
                    reduced_of[per_gradient[i][0].name] = reduced_of.get(per_gradient[i][0].name, 0) + 1
            for var, grads, original in per_gradient:
                if isinstance(grads[0], tf.IndexedSlices):
                    gathered += self._gather_sparse(ctx.communicator, grads, original,
                                                    replication.weights, method, var.name)
                    reduced_of[var.name] = reduced_of.get(var.name, 0) + 1
        else:
            reduced_of = {var.name: 1 for var, _, _ in per_gradient}
            for _, grads, original in per_gradient:   # one replica: its own sparse gradient
                if isinstance(grads[0], tf.IndexedSlices):
                    _rewire_sparse(original, grads[0].values, grads[0].indices,
                                   grads[0].dense_shape)
        reduced_of.update(sharded)
        ctx.provide(ReducedGradients(reduced_of, tuple(gathered), tuple(shapes)))
        added = [op.name for op in graph.get_operations()[first_new:]]
        return PassResult(added=added, notes=[
            f"{len(per_gradient)} gradients in {len(buckets)} buckets ({method}"
            f"{', fp16' if fp16_scale else ''})"],
            modified=bool(added) or needs_comm or any(
                isinstance(grads[0], tf.IndexedSlices) for _, grads, _ in per_gradient))

    @staticmethod
    def _gather_sparse(communicator, grads, original, weights, method, name=None):
        """Every replica gets all replicas' (weighted) rows of a sparse gradient.

        The update ops of every replica still read the original gradient's
        values and indices (see the replicate pass); they now read the gathered ones.
        """
        values, indices = [], []
        for k, grad in enumerate(grads):
            with tf.device(grad.values.device):
                scaled = grad.values if method == "sum" else grad.values * tf.cast(weights[k], grad.values.dtype)
            values.append(scaled)
            indices.append(grad.indices)
        with tf.device(grads[0].values.device), tf.name_scope("EPL_SPARSE"):
            all_values = tf.concat(values, axis=0)  # TensorFlow copies the other replicas' rows
            all_indices = tf.concat(indices, axis=0)
            all_values = communicator.workers_all_gather(
                all_values, label=f"the gradient values of {name}")
            all_indices = communicator.workers_all_gather(
                all_indices, label=f"the gradient indices of {name}")
        _rewire_sparse(original, all_values, all_indices, grads[0].dense_shape)
        return [all_values, all_indices]


def _rewire_sparse(original: tf.IndexedSlices, values: tf.Tensor, indices: tf.Tensor,
                   dense_shape: tf.Tensor | None = None) -> None:
    """The update ops read `values` and `indices` (and `dense_shape`: replica 0's, for an
    update that makes the gradient dense) instead of the template's sparse gradient.
    They may hold more rows than the template's (every replica's, or every
    micro-batch's, each of the script's size under io.batch_mode "replica"), so their
    static row count is left unknown."""
    with tf.device(values.device), tf.name_scope("EPL_SPARSE"):
        values = with_dynamic_rows(values, original.values)
        indices = with_dynamic_rows(indices, original.indices)
    pairs = [(original.values, values), (original.indices, indices)]
    if dense_shape is not None and original.dense_shape is not None \
            and dense_shape is not original.dense_shape:
        pairs.append((original.dense_shape, dense_shape))
    for old, new in pairs:
        for consumer in [c for c in old.consumers() if _is_apply(c)]:
            replace_input(consumer, old, new)


# -- dense buckets -------------------------------------------------------------
#
# Speed: a bucket needs two ops per gradient and replica (flatten, reshape
# back). Creating them one by one through the Python API costs 0.3-1 ms each,
# so they are written as NodeDefs and added with one graph import per step
# (epl.ir.clone.NodeBatch, as the replicate pass copies ops); constants are
# shared per device. The few ops per bucket and replica (concat, weighting,
# fp16, the collective, split) are built through the Python API.

def _reduce_buckets(graph: tf.Graph, communicator, buckets: list, weights: list, method: str,
                    even: bool, fp16_scale: float | None, names: list | None = None) -> list:
    """Flatten, weight, reduce once, split back and rewire each bucket.

    buckets: per bucket, per member gradient, its copy per replica; names: per
    bucket, its variables' names (they name the cross-worker collective).
    Returns the shape tensors the buckets read (ReducedGradients.shapes).
    """
    replicas = len(buckets[0][0]) if buckets else 0
    grads_of = [[[member[k] for member in bucket] for k in range(replicas)] for bucket in buckets]
    vectors_of = _flatten(graph, grads_of)
    names = names or [None] * len(grads_of)
    reduced = [_reduce_flat(communicator, grads, vectors, weights, method, even, fp16_scale, n)
               for grads, vectors, n in zip(grads_of, vectors_of, names)]
    _reshape_and_rewire(graph, grads_of, reduced)
    return [s for _, shapes in reduced for s in (shapes or ())]


def _is_vector(tensor: tf.Tensor) -> bool:
    """A tensor of static shape [n]: already its own flattening (no Reshape needed)."""
    return tensor.shape.rank == 1 and tensor.shape.is_fully_defined()


def _flatten(graph: tf.Graph, grads_of: list) -> list:
    """Per bucket, per replica: the replica's gradients as vectors (a Reshape on
    the device of the replica's first gradient for each one that is not one)."""
    batch = NodeBatch(graph)
    consts = _Consts(batch)
    flat = []  # per bucket, per replica, per gradient: the gradient or a NodeDef name
    for bucket in grads_of:
        flat.append([])
        for grads in bucket:
            device = grads[0].op.device
            flat[-1].append([g if _is_vector(g) else _node(
                batch, "Reshape", device, [batch.ref(g), consts.get([-1], tf.int32, device)],
                T=_type(g.dtype), Tshape=_type(tf.int32)) for g in grads])
    created = batch.commit()
    return [[[v if isinstance(v, tf.Tensor) else created[v].outputs[0] for v in replica]
             for replica in bucket] for bucket in flat]


def _reduce_flat(communicator, grads_of: list, vectors_of: list, weights: list, method: str,
                 even: bool, fp16_scale: float | None,
                 names: list | None = None) -> tuple[list, list | None]:
    """Concatenate, weight, reduce once and split one bucket.

    grads_of / vectors_of: per replica, the bucket's gradients / their vectors.
    Returns (per replica the reduced parts in member order, the shape tensors of
    replica 0's gradients where some gradient's shape is not static, else None).
    """
    devices = [grads[0].op.device for grads in grads_of]
    sizes = [g.shape.num_elements() if g.shape.is_fully_defined() else None for g in grads_of[0]]
    dynamic = any(not g.shape.is_fully_defined() for grads in grads_of for g in grads)
    shapes = [tf.shape(g) for g in grads_of[0]] if dynamic else None
    flats = []
    for k, vectors in enumerate(vectors_of):
        with tf.device(devices[k]), tf.name_scope("EPL_FUSION"):
            flat = tf.concat(vectors, axis=0) if len(vectors) > 1 else vectors[0]
            if method != "sum" and not even:
                flat = flat * tf.cast(weights[k], flat.dtype)
            if fp16_scale is not None and flat.dtype == tf.float32:
                flat = tf.cast(flat * fp16_scale, tf.float16)
            flats.append(flat)
    op = "mean" if (method != "sum" and even) else "sum"
    label = {} if not names or communicator.num_workers == 1 else dict(
        label="the gradients of " + names_label(names), fragment=names_fragment(names))
    reduced = communicator.all_reduce(flats, devices, op=op, **label)
    parts_of = []
    for k, grads in enumerate(grads_of):
        with tf.device(devices[k]), tf.name_scope("EPL_FUSION"):
            flat = reduced[k]
            if fp16_scale is not None and grads[0].dtype == tf.float32:
                flat = tf.cast(flat, tf.float32) / fp16_scale
            if len(grads) == 1:
                parts_of.append([flat])
            elif all(s is not None for s in sizes):
                parts_of.append(tf.split(flat, sizes))
            else:
                parts_of.append(tf.split(flat, [tf.reduce_prod(s) for s in shapes]))
    return parts_of, shapes


def _reshape_and_rewire(graph: tf.Graph, grads_of: list, reduced: list) -> None:
    """Reshape every reduced part to its gradient's shape (static, else replica
    0's shape tensor), on the device of the replica's first gradient, and make
    the update ops (apply phase) that read the gradient read it instead.

    reduced: per bucket, what _reduce_flat returned.
    """
    batch = NodeBatch(graph)
    consts = _Consts(batch)
    rewires = []  # (gradient, its reduced value: a part, or the NodeDef name of its Reshape)
    for bucket_grads, (bucket_parts, shapes) in zip(grads_of, reduced):
        for grads, parts in zip(bucket_grads, bucket_parts):
            device = grads[0].op.device
            for i, (grad, part) in enumerate(zip(grads, parts)):
                if _is_vector(grad) and part.shape == grad.shape:  # nothing to reshape
                    rewires.append((grad, part))
                    continue
                if grad.shape.is_fully_defined():
                    dims = grad.shape.as_list()
                    shape_dtype = tf.int64 if any(d > _INT32_MAX for d in dims) else tf.int32
                    shape = consts.get(dims, shape_dtype, device)
                else:
                    shape_dtype, shape = shapes[i].dtype, batch.ref(shapes[i])
                rewires.append((grad, _node(batch, "Reshape", device, [batch.ref(part), shape],
                                            T=_type(grad.dtype), Tshape=_type(shape_dtype))))
    created = batch.commit()
    for grad, value in rewires:
        new = value if isinstance(value, tf.Tensor) else created[value].outputs[0]
        for consumer in [c for c in grad.consumers() if _is_apply(c)]:
            replace_input(consumer, grad, new)


class _Consts:
    """Constants of a NodeBatch, one per (value, dtype, device)."""

    def __init__(self, batch: NodeBatch):
        self.batch = batch
        self.names: dict = {}

    def get(self, value: list, dtype: tf.DType, device: str) -> str:
        """NodeDef input naming the constant `value` on `device`."""
        key = (tuple(value), dtype, device)
        if key not in self.names:
            tensor = tensor_util.make_tensor_proto(value, dtype=dtype)
            self.names[key] = _node(self.batch, "Const", device, [], dtype=_type(dtype),
                                    value=tf.compat.v1.AttrValue(tensor=tensor))
        return NodeBatch.output(self.names[key], 0)


def _type(dtype: tf.DType) -> tf.compat.v1.AttrValue:
    return tf.compat.v1.AttrValue(type=dtype.as_datatype_enum)


def _node(batch: NodeBatch, op_type: str, device: str, inputs: list, **attrs) -> str:
    """Add a NodeDef named after its type (under EPL_FUSION) to `batch`; return its name."""
    node = node_def_pb2.NodeDef(name=batch.new_name(f"EPL_FUSION/{op_type}"), op=op_type, device=device)
    node.input.extend(inputs)
    for key, value in attrs.items():
        node.attr[key].CopyFrom(value)
    return batch.add(node)
