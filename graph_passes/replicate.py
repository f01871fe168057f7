"""Replication (data parallelism) among the devices of one worker.

Given the plan's R replicas, the pass
- slices every batch input along its first dimension into R parts, with the
  plan's per-replica shares (static split when the batch size is known,
  run-time boundaries round(B * cumulative share) otherwise);
- copies the forward and backward ops once per replica, onto the replica's
  devices, each copy reading its slice; a constant that TensorFlow folded
  from tf.shape of a static-shaped batch tensor (it holds the global batch
  size) becomes, in each copy, a Shape op of the replica's own tensor;
- mirrors every variable those ops read: replica 0 uses the original variable,
  replica k > 0 a copy on its device; one `sync` op copies the originals into
  the mirrors (the session runs it after initialization or restore), so the
  replicas start identical and stay identical (same reduced gradients, same
  update);
- keeps the original apply ops (the optimizer update) as replica 0's update and
  copies them for replicas k > 0; the user's train op also runs their updates;
- merges each loss into the mean over the global batch (sum of share x replica
  loss), which is what fetching the loss returns.

Why replica 0 is a copy too: the original forward ops were shape-inferred for
the whole batch, and TensorFlow refuses to feed them a slice with a different
static shape. So the original forward and backward ops stay in the graph as
the template (never run: nothing the train op needs reads them), while the
variables and the update ops stay the originals. This departs from DESIGN.md's
"original ops remain replica 0" only for the forward/backward ops.

Artifacts for the next passes (ctx.artifacts["replicate"]): the per-replica
copy of every gradient and each replica's weight.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.graph_view import colocation_root, descendants
from epl.ir.clone import clone_op, clone_ops, replace_control_inputs, replace_input
from epl.graph_keys import merge_requests
from epl.pass_manager import GraphPass, PassContext, PassResult

REPLICA_PREFIX = "EPL_REPLICA_{}"


@dataclasses.dataclass
class Replication:
    """What the replicate pass built, for the passes after it.

    gradients: per trainable gradient, (variable op, [gradient per replica], the
      original gradient).
    weights: per replica, its share of the global batch (float or scalar tensor).
    devices: per replica, the device its gradients live on (by variable op).
    merged: original tensor -> merged tensor (what a fetch of it returns).
    sync_ops: original variable op -> op copying it into its mirrors (the session runs
      it after a run that wrote the original: initialization, restore, assign).
    mirrors: original variable op -> [variable op per replica].
    """

    gradients: list
    weights: list
    merged: dict
    sync_ops: dict
    mirrors: dict
    replica_maps: list


def _replica_attr(k: int) -> dict:
    return {REPLICA_ATTR: tf.compat.v1.AttrValue(i=k)}


class ReplicatePass(GraphPass):
    """Copies the model once per replica and slices the global batch."""

    name = "replicate"
    requires = ("annotate",)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        self._check_batch(ctx.view, ctx.plan)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view, plan = ctx.view, ctx.plan
        sizes = self._check_batch(view, plan)
        shape_consts = self._shape_constants(view)
        before = set(graph.get_operations())
        forward = [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]
        apply_ops = [op for op in view.replica_ops if view.phase_of[op] == Phase.APPLY]
        devices = {op: plan.device(view.taskgraph_of[op], 0) for op in view.replica_ops}
        self._place(graph, view, plan)
        slices, weights = self._slice_batch(view, plan, sizes, ctx.cluster.host_device)
        weights = self._global_weights(view, weights, ctx.communicator, ctx.cluster.host_device)
        mirrors = self._mirror_variables(view, plan)
        replica_maps, gradients = [], []
        for k in range(plan.num_replicas):
            forward_map = self._copy_forward(view, plan, k, forward, slices, mirrors, shape_consts)
            gradients.append(self._regenerate_gradients(view, plan, k, forward_map, mirrors))
            replica_maps.append(forward_map)
        for k in range(1, plan.num_replicas):  # copy the originals before rewiring them
            replica_maps[k].update(self._copy_apply(view, plan, k, apply_ops, slices, mirrors,
                                                    replica_maps[k], gradients[k]))
        self._rewire_replica0_apply(apply_ops, replica_maps[0], _gradient_map(view, gradients[0]))
        self._chain_train_ops(view, replica_maps)
        merged = self._merge_fetches(graph, view, replica_maps, weights, devices, ctx.communicator)
        sync_ops = self._sync_ops(mirrors, ctx.communicator)
        per_gradient = [(var, [gradients[k][i] for k in range(plan.num_replicas)], grad)
                        for i, (grad, var) in enumerate(view.gradients)]
        ctx.artifacts[self.name] = Replication(per_gradient, weights, merged, sync_ops, mirrors,
                                               replica_maps)
        added = [op.name for op in graph.get_operations() if op not in before]
        op_map = {op.name: [m[op].name for m in replica_maps if op in m] for op in view.replica_ops}
        return PassResult(added=added, op_map=op_map,
                          notes=[f"{plan.num_replicas} replicas, shares {list(plan.replica_weights)}"])

    # -- analysis -----------------------------------------------------------
    @staticmethod
    def _check_batch(view, plan) -> list[int] | None:
        batch = view.global_batch_size
        if batch is None:
            return None
        if plan.even and batch % plan.num_replicas:
            raise ParallelizeError(
                f"the global batch of {batch} examples cannot be split evenly over "
                f"{plan.num_replicas} replicas (inputs: {', '.join(t.name for t in view.batch_inputs)}). "
                f"Use a global batch size divisible by {plan.num_replicas}.")
        sizes = plan.batch_sizes(batch)
        if min(sizes) < 1:
            raise ParallelizeError(
                f"the global batch of {batch} examples leaves a replica with no examples "
                f"(per-replica sizes {sizes}). Use a global batch of at least "
                f"{plan.num_replicas} examples.")
        return sizes

    @staticmethod
    def _shape_constants(view) -> dict:
        """Forward constants holding the static shape of a batch-sized tensor -> that tensor.

        TensorFlow folds tf.shape(t) into a Const when t's shape is fully
        defined (library code does this too: softmax_cross_entropy_with_logits
        reshapes its result to such a folded shape), which bakes the global
        batch size into the graph. Each replica must use the shape of its own
        slice instead. A constant matches t when it is an integer vector equal
        to t's static shape, t's first dimension is the global batch and t is a
        batch input or a forward op computed from one; t is the latest such
        tensor created before the constant (tf.shape folds an existing tensor).
        Read from values and shapes, never from names.
        """
        batch = view.global_batch_size
        if batch is None:
            return {}
        forward = {op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD}
        derived = descendants(view.batch_inputs, within=forward)
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
                    shape = tensor.shape
                    if shape.rank and shape.is_fully_defined() and shape[0] == batch:
                        latest[tuple(shape.as_list())] = tensor
        return found

    # -- rewrite ------------------------------------------------------------
    @staticmethod
    def _place(graph, view, plan) -> None:
        """Originals on replica 0's devices; everything else where it belongs."""
        replica = set(view.replica_ops) | set(view.variables)
        for op in graph.get_operations():
            if op in replica or (op in view.taskgraph_of and op.type in ("VarHandleOp", "VariableV2")):
                op._set_device(plan.device(view.taskgraph_of[op], 0))
        for op in graph.get_operations():
            if op not in replica and not op.device:
                root = colocation_root(op)
                op._set_device(root.device if root is not None and root.device else "/device:CPU:0")

    @staticmethod
    def _slice_batch(view, plan, sizes, host):
        """Return ({batch tensor: [slice per replica]}, [weight per replica])."""
        replicas = plan.num_replicas
        slices = {}
        with tf.device(host), tf.name_scope("EPL_BATCH_SLICES"):
            if sizes is not None:
                weights = [s / view.global_batch_size for s in sizes]
                for tensor in view.batch_inputs:
                    slices[tensor] = tf.split(tensor, sizes, axis=0) if replicas > 1 else [tensor]
                return slices, weights
            first = view.batch_inputs[0]
            batch = tf.shape(first, out_type=tf.int64)[0]
            if plan.even:
                check = tf.debugging.Assert(
                    tf.equal(batch % replicas, 0),
                    [f"EPL: the global batch cannot be split evenly over {replicas} replicas; "
                     "batch size:", batch])
                with tf.control_dependencies([check]):
                    bounds = [batch * k // replicas for k in range(replicas + 1)]
            else:
                cumulative = [sum(plan.replica_weights[:k]) for k in range(replicas + 1)]
                bounds = [tf.cast(tf.round(tf.cast(batch, tf.float64) * c), tf.int64)
                          for c in cumulative[:-1]] + [batch]
            weights = [tf.cast(bounds[k + 1] - bounds[k], tf.float32) / tf.cast(batch, tf.float32)
                       for k in range(replicas)]
            for tensor in view.batch_inputs:
                slices[tensor] = [tensor[bounds[k]:bounds[k + 1]] for k in range(replicas)]
        return slices, weights

    @staticmethod
    def _global_weights(view, weights, communicator, host) -> list:
        """Shares of the global batch when several workers each slice their own batch.

        The global batch is the concatenation of the workers' batches, which may
        differ in size: each replica's share is its rows over the sum of every
        worker's rows (one scalar all-reduce per step).
        """
        if communicator.num_workers == 1:
            return weights
        with tf.device(host), tf.name_scope("EPL_BATCH_SLICES"):
            local = tf.cast(tf.shape(view.batch_inputs[0])[0], tf.float32)
            share = local / communicator.sum_over_workers(local)
            return [tf.cast(w, tf.float32) * share for w in weights]

    @staticmethod
    def _mirror_variables(view, plan) -> dict:
        """original variable op -> [variable op per replica] (index 0: the original)."""
        mirrors = {}
        for var in view.variables:
            copies = [var]
            for k in range(1, plan.num_replicas):
                attrs = _replica_attr(k)
                shared = var.get_attr("shared_name").decode() or var.name
                attrs["shared_name"] = tf.compat.v1.AttrValue(s=f"{REPLICA_PREFIX.format(k)}/{shared}".encode())
                copies.append(clone_op(var, [], f"{REPLICA_PREFIX.format(k)}/{var.name}",
                                       plan.device(view.taskgraph_of[var], k), attrs))
            mirrors[var] = copies
        return mirrors

    @staticmethod
    def _copy_forward(view, plan, k, forward, slices, mirrors, shape_consts) -> dict:
        """Copy the forward ops for replica k, reading its slice and its variables.

        A constant in `shape_consts` (a folded static shape of a batch-sized
        tensor) becomes a Shape op of replica k's copy of that tensor.
        """
        input_map = {t: parts[k] for t, parts in slices.items()}
        input_map.update({var.outputs[0]: copies[k].outputs[0] for var, copies in mirrors.items()})
        prefix = REPLICA_PREFIX.format(k)
        device_fn = lambda op: plan.device(view.taskgraph_of[op], k)  # noqa: E731
        op_map: dict = {}
        run: list = []  # consecutive ops cloned in one clone_ops call
        for op in forward + [None]:
            if op is not None and op not in shape_consts:
                run.append(op)
                continue
            if run:
                op_map.update(clone_ops(run, prefix, device_fn, input_map, _replica_attr(k),
                                        known=op_map))
                run = []
            if op is not None:
                source = shape_consts[op]
                source = (input_map[source] if source in input_map
                          else op_map[source.op].outputs[source.value_index])
                op_map[op] = _shape_op(op, source, f"{prefix}/{op.name}", device_fn(op), k)
        return op_map

    @staticmethod
    def _regenerate_gradients(view, plan, k, forward_map, mirrors) -> list:
        """Autodiff of replica k's loss copy, as compute_gradients did for the original.

        The original backward ops were built for the whole batch (gradient
        functions fold static shapes into constants), so each replica gets its
        own backward ops, colocated with its forward copies.
        """
        grads_out = []
        graph = view.graph
        for step in view.steps:
            pairs = [(g, v) for g, v in step.grads_and_vars if g is not None]
            if not pairs:
                continue
            loss = forward_map[step.loss.op].outputs[step.loss.value_index]
            targets = [mirrors[v.op][k].outputs[0] if v.op in mirrors else v.op.outputs[0]
                       for _, v in pairs]
            first = len(graph.get_operations())
            kwargs = step.gradient_kwargs
            gate = kwargs.get("gate_gradients", tf.compat.v1.train.Optimizer.GATE_OP)
            grads = tf.compat.v1.gradients(
                loss, targets, grad_ys=kwargs.get("grad_loss"),
                gate_gradients=gate == tf.compat.v1.train.Optimizer.GATE_OP,
                aggregation_method=kwargs.get("aggregation_method"),
                colocate_gradients_with_ops=True)
            if gate == tf.compat.v1.train.Optimizer.GATE_GRAPH:
                grads = tf.tuple(grads)
            if kwargs.get("sparse_as_dense"):
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            _tag_backward(graph.get_operations()[first:], k, plan.device(view.taskgraphs[0], k))
            grads_out.extend(grads)
        return grads_out

    @staticmethod
    def _copy_apply(view, plan, k, apply_ops, slices, mirrors, forward_map, grads) -> dict:
        """Copy the update (apply) ops for replica k > 0."""
        input_map = {t: parts[k] for t, parts in slices.items()}
        input_map.update({var.outputs[0]: copies[k].outputs[0] for var, copies in mirrors.items()})
        input_map.update(_gradient_map(view, grads))
        return clone_ops(apply_ops, REPLICA_PREFIX.format(k),
                         lambda op: plan.device(view.taskgraph_of[op], k), input_map,
                         _replica_attr(k), known=forward_map)

    @staticmethod
    def _rewire_replica0_apply(apply_ops, forward_map, grads_and_map) -> None:
        """Original apply ops read replica 0's copies and gradients, not the template."""
        gradient_map = grads_and_map
        for op in apply_ops:
            for tensor in list(op.inputs):
                new = gradient_map.get(tensor)
                if new is None and tensor.op in forward_map:
                    new = forward_map[tensor.op].outputs[tensor.value_index]
                if new is not None:
                    replace_input(op, tensor, new)
            replace_control_inputs(op, forward_map)

    @staticmethod
    def _chain_train_ops(view, replica_maps) -> None:
        """The user's train op also runs every other replica's update."""
        for train_op in view.train_ops:
            copies = [m[train_op] for m in replica_maps[1:] if train_op in m]
            if copies:
                train_op._add_control_inputs(copies)

    @staticmethod
    def _merge_fetches(graph, view, replica_maps, weights, devices, communicator) -> dict:
        """Merged value of each loss and each tensor in an EPL merge collection."""
        requests = {loss: "mean" for loss in view.losses}
        requests.update({t: kind for t, kind in merge_requests(graph).items() if t not in requests})
        merged = {}
        for tensor, kind in requests.items():
            if tensor.op not in replica_maps[0]:
                continue
            parts = [m[tensor.op].outputs[tensor.value_index] for m in replica_maps]
            with tf.device(devices.get(tensor.op, "/device:CPU:0")), tf.name_scope("EPL_MERGED"):
                merged[tensor] = _merge(parts, weights, kind, communicator)
            for consumer in list(tensor.consumers()):
                if consumer not in devices and tensor.shape == merged[tensor].shape:
                    replace_input(consumer, tensor, merged[tensor])
        return merged

    @staticmethod
    def _sync_ops(mirrors, communicator) -> dict:
        """original variable op -> op copying its value into its mirrors.

        With several workers the value is worker 0's (broadcast), written into
        the original too, so workers that initialized with different random
        seeds start identical.
        """
        sync = {}
        cross = communicator.cross
        with tf.name_scope("EPL_SYNC"):
            for var, copies in mirrors.items():
                if len(copies) == 1 and cross is None:
                    continue
                with tf.device(var.device):
                    value = _read(var)
                assigns = []
                if cross is not None:
                    with tf.device(var.device):
                        value = cross.broadcast(value, 0)
                        assigns.append(_assign(var, value))
                for copy in copies[1:]:
                    with tf.device(copy.device):
                        assigns.append(_assign(copy, value))
                with tf.device(var.device):
                    sync[var] = tf.group(*assigns)
        return sync


def _gradient_map(view, grads) -> dict:
    """Original dense gradient tensors -> this replica's gradients.

    Sparse gradients (IndexedSlices) are not mapped: the update ops keep
    reading the original's values and indices, whose static shapes are those
    of the whole batch, until the gradient pass feeds them every replica's
    gathered rows (which have that same shape).
    """
    return {orig: new for (orig, _), new in zip(view.gradients, grads)
            if not isinstance(orig, tf.IndexedSlices)}


def _tag_backward(ops, replica: int, fallback_device: str) -> None:
    """Phase, replica, TaskGraph and device of regenerated backward ops."""
    phase = tf.compat.v1.AttrValue(s=Phase.BACKWARD.value.encode())
    for op in ops:
        op._set_attr(PHASE_ATTR, phase)
        op._set_attr(REPLICA_ATTR, tf.compat.v1.AttrValue(i=replica))
        source = colocation_root(op) or next((t.op for t in op.inputs
                                              if TASKGRAPH_ATTR in t.op.node_def.attr), None)
        if source is not None and TASKGRAPH_ATTR in source.node_def.attr:
            op._set_attr(TASKGRAPH_ATTR, source.node_def.attr[TASKGRAPH_ATTR])
        op._set_device(source.device if source is not None and source.device else fallback_device)


def _shape_op(const: tf.Operation, source: tf.Tensor, name: str, device: str,
              replica: int) -> tf.Operation:
    """A Shape op of `source` standing in for the folded shape constant `const`."""
    dtype = const.outputs[0].dtype
    attrs = {k: v for k, v in const.node_def.attr.items() if k in (TASKGRAPH_ATTR, PHASE_ATTR)}
    attrs.update(_replica_attr(replica))
    attrs["T"] = tf.compat.v1.AttrValue(type=source.dtype.as_datatype_enum)
    attrs["out_type"] = tf.compat.v1.AttrValue(type=dtype.as_datatype_enum)
    op = const.graph._create_op_internal("Shape", [source], [dtype], name=name, attrs=attrs,
                                         compute_device=False)
    op._set_device(device)
    return op


def _merge(parts: list[tf.Tensor], weights: list, kind: str, communicator) -> tf.Tensor:
    """Merge per-replica values; across workers too (every worker must fetch it)."""
    cross = communicator.cross
    if kind == "concat":
        local = tf.concat(parts, axis=0)
        return cross.all_gather(local) if cross is not None else local
    if kind == "sum":
        local = tf.add_n(parts)
    else:  # weights are shares of the global batch, so the sum over workers is the mean
        local = tf.add_n([tf.cast(w, p.dtype) * p for w, p in zip(weights, parts)])
    return cross.all_reduce(local, "sum") if cross is not None else local


def _read(var: tf.Operation) -> tf.Tensor:
    if var.type == "VarHandleOp":
        return tf.raw_ops.ReadVariableOp(resource=var.outputs[0], dtype=var.get_attr("dtype"))
    return tf.identity(var.outputs[0])


def _assign(var: tf.Operation, value: tf.Tensor) -> tf.Operation:
    if var.type == "VarHandleOp":
        return tf.raw_ops.AssignVariableOp(resource=var.outputs[0], value=value)
    return tf.compat.v1.assign(var.outputs[0], value).op
