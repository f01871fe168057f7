"""Replication (data parallelism) among the devices of one worker.

Given the plan's R replicas, the pass
- slices every batch input along its first dimension into R parts, with the
  plan's per-replica shares (static split when the batch size is known,
  run-time boundaries round(B * cumulative share) otherwise);
- copies the forward and backward ops once per replica, onto the replica's
  devices, each copy reading its slice;
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
from epl.ir.graph_view import colocation_root
from epl.ir.clone import clone_op, clone_ops, replace_control_inputs, replace_input
from epl.graph_keys import merge_requests
from epl.pass_manager import GraphPass, PassContext, PassResult

REPLICA_PREFIX = "EPL_REPLICA_{}"


@dataclasses.dataclass
class Replication:
    """What the replicate pass built, for the passes after it.

    gradients: per trainable gradient, (variable op, [gradient tensor per replica]).
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
        before = set(graph.get_operations())
        forward = [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]
        apply_ops = [op for op in view.replica_ops if view.phase_of[op] == Phase.APPLY]
        devices = {op: plan.device(view.taskgraph_of[op], 0) for op in view.replica_ops}
        self._place(graph, view, plan)
        slices, weights = self._slice_batch(view, plan, sizes, ctx.cluster.host_device)
        mirrors = self._mirror_variables(view, plan)
        replica_maps, gradients = [], []
        for k in range(plan.num_replicas):
            forward_map = self._copy_forward(view, plan, k, forward, slices, mirrors)
            gradients.append(self._regenerate_gradients(view, plan, k, forward_map, mirrors))
            replica_maps.append(forward_map)
        for k in range(1, plan.num_replicas):  # copy the originals before rewiring them
            replica_maps[k].update(self._copy_apply(view, plan, k, apply_ops, slices, mirrors,
                                                    replica_maps[k], gradients[k]))
        self._rewire_replica0_apply(apply_ops, replica_maps[0], _gradient_map(view, gradients[0]))
        self._chain_train_ops(view, replica_maps)
        merged = self._merge_fetches(graph, view, replica_maps, weights, devices)
        sync_ops = self._sync_ops(mirrors)
        per_gradient = [(var, [gradients[k][i] for k in range(plan.num_replicas)])
                        for i, (_, var) in enumerate(view.gradients)]
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
    def _copy_forward(view, plan, k, forward, slices, mirrors) -> dict:
        """Copy the forward ops for replica k, reading its slice and its variables."""
        input_map = {t: parts[k] for t, parts in slices.items()}
        input_map.update({var.outputs[0]: copies[k].outputs[0] for var, copies in mirrors.items()})
        return clone_ops(forward, REPLICA_PREFIX.format(k),
                         lambda op: plan.device(view.taskgraph_of[op], k), input_map,
                         _replica_attr(k))

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
    def _merge_fetches(graph, view, replica_maps, weights, devices) -> dict:
        """Merged value of each loss and each tensor in an EPL merge collection."""
        requests = {loss: "mean" for loss in view.losses}
        requests.update({t: kind for t, kind in merge_requests(graph).items() if t not in requests})
        merged = {}
        for tensor, kind in requests.items():
            if tensor.op not in replica_maps[0]:
                continue
            parts = [m[tensor.op].outputs[tensor.value_index] for m in replica_maps]
            with tf.device(devices.get(tensor.op, "/device:CPU:0")), tf.name_scope("EPL_MERGED"):
                merged[tensor] = _merge(parts, weights, kind)
            for consumer in list(tensor.consumers()):
                if consumer not in devices and tensor.shape == merged[tensor].shape:
                    replace_input(consumer, tensor, merged[tensor])
        return merged

    @staticmethod
    def _sync_ops(mirrors) -> dict:
        """original variable op -> op copying its value into its mirrors."""
        sync = {}
        with tf.name_scope("EPL_SYNC"):
            for var, copies in mirrors.items():
                if len(copies) == 1:
                    continue
                with tf.device(var.device):
                    value = _read(var)
                assigns = []
                for copy in copies[1:]:
                    with tf.device(copy.device):
                        assigns.append(_assign(copy, value))
                with tf.device(var.device):
                    sync[var] = tf.group(*assigns)
        return sync


def _gradient_map(view, grads) -> dict:
    """Original gradient tensors (all components) -> this replica's gradients."""
    mapping = {}
    for (orig, _), new in zip(view.gradients, grads):
        if isinstance(orig, tf.IndexedSlices):
            for a, b in ((orig.values, new.values), (orig.indices, new.indices)):
                mapping[a] = b
            if orig.dense_shape is not None and new.dense_shape is not None:
                mapping[orig.dense_shape] = new.dense_shape
        else:
            mapping[orig] = new
    return mapping


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


def _merge(parts: list[tf.Tensor], weights: list, kind: str) -> tf.Tensor:
    if kind == "concat":
        return tf.concat(parts, axis=0)
    if kind == "sum":
        return tf.add_n(parts)
    return tf.add_n([tf.cast(w, p.dtype) * p for w, p in zip(weights, parts)])


def _read(var: tf.Operation) -> tf.Tensor:
    if var.type == "VarHandleOp":
        return tf.raw_ops.ReadVariableOp(resource=var.outputs[0], dtype=var.get_attr("dtype"))
    return tf.identity(var.outputs[0])


def _assign(var: tf.Operation, value: tf.Tensor) -> tf.Operation:
    if var.type == "VarHandleOp":
        return tf.raw_ops.AssignVariableOp(resource=var.outputs[0], value=value)
    return tf.compat.v1.assign(var.outputs[0], value).op
