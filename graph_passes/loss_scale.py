"""AMP loss scaling after replication: unscale, agree on overflow, skip, adapt the scale.

The amp pass (graph_passes/amp.py) made every replica's autodiff start from the
loss scale, so each replica's gradients are scale x the true ones. This pass,
after the gradient passes (replicate, zero, gradient_comm) have built the
per-replica gradients, their reduction and the updates:

- unscales every replica's own gradients (x 1/scale, before any
  communication: every consumer of a per-replica gradient, whether a fused
  all-reduce, ZeRO's reduce-scatter or the update itself, reads the unscaled
  one);
- with a dynamic scale, counts the non-finite values of each replica's
  unscaled gradients and sums the counts over every replica of every worker
  with the communicator (TensorFlow collectives locally, Horovod across
  workers), so all replicas decide on the same number: the step is skipped
  everywhere or nowhere;
- skips an overflowed step: every update op a step runs (an apply-phase op
  that writes a variable: the optimizer's updates and its own state such as
  Adam's beta powers, ZeRO's shard updates and write-backs), except the global
  step's increment, runs inside a tf.cond on "no overflow"; the ops that
  waited for an update wait for its cond;
- updates the scale once per step on the host: halved (not below 1) after an
  overflow, doubled after amp.DYNAMIC_GROWTH_STEPS finite steps in a row. The
  user's train ops wait for it.

A fixed amp.loss_scale only unscales (no check, no skipping).
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, Phase
from epl.ir.clone import replace_control_inputs
from epl.ir.graph_view import VARIABLE_OP_TYPES, ancestors
from epl.pass_manager import GraphPass, PassContext, PassResult
from graph_passes.amp import DYNAMIC_GROWTH_STEPS

SCOPE = "EPL_LOSS_SCALE"
READ_TYPES = frozenset({"ReadVariableOp", "VarIsInitializedOp", "Identity", "ResourceGather",
                        "VariableShape"})


def _tensors(grad) -> list[tf.Tensor]:
    return [grad.values] if isinstance(grad, tf.IndexedSlices) else [grad]


def _is_update(op: tf.Operation) -> bool:
    """An apply-phase op that takes a variable handle first and writes it."""
    attr = op.node_def.attr.get(PHASE_ATTR)
    if attr is None or attr.s.decode() != Phase.APPLY.value or not op.inputs:
        return False
    first = op.inputs[0]
    return first.op.type in VARIABLE_OP_TYPES and first.dtype == tf.resource \
        and op.type not in READ_TYPES


class LossScalePass(GraphPass):
    """Unscales per-replica gradients; with a dynamic scale, skips overflowed steps."""

    name = "loss_scale"
    requires = ("amp", "replicate", "gradient_comm")

    off_note = "no loss scaling (amp.level is off)"

    def enabled(self, config) -> bool:
        """Loss scaling belongs to AMP: amp.level is set."""
        return bool(config.get("amp.level"))

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        amp = ctx.amp
        if amp is None or amp.scale is None:
            return PassResult(notes=["no loss scaling"])
        replication = ctx.replication
        before = set(graph.get_operations())
        replicas = len(replication.gradients[0][1]) if replication.gradients else 0
        with tf.device(ctx.cluster.host_device), tf.name_scope(SCOPE):
            inverse = 1.0 / amp.scale
        replicas = max(replicas, 1)
        counts = [[] for _ in range(replicas)]
        # split variables have one gradient (computed with every replica's loss): replica 0's
        entries = list(replication.gradients) + [
            (var, [grad] + [None] * (replicas - 1), None)
            for var, grad in replication.split_gradients]
        for _, grads, _ in entries:
            for k, grad in enumerate(grads):
                if grad is None:
                    continue
                for tensor in _tensors(grad):
                    unscaled = self._unscale(tensor, inverse)
                    if amp.scale_var is not None:
                        with tf.device(tensor.device), tf.name_scope(SCOPE):
                            counts[k].append(tf.reduce_sum(tf.cast(
                                tf.logical_not(tf.math.is_finite(unscaled)), tf.float32)))
        if amp.scale_var is None:
            return PassResult(added=self._added(graph, before),
                              notes=["gradients unscaled by the fixed scale"])
        devices = [c[0].device for c in counts]
        with tf.name_scope(SCOPE):
            local = []
            for k, device in enumerate(devices):
                with tf.device(device):
                    local.append(tf.add_n(counts[k]) if len(counts[k]) > 1 else counts[k][0])
            agreed = ctx.communicator.all_reduce(local, devices, op="sum")
            finite = []
            for k, device in enumerate(devices):
                with tf.device(device):
                    finite.append(tf.equal(agreed[k], 0.0))
        skipped = self._guard_updates(graph, ctx, finite, amp)
        adapt = self._adapt(amp, finite[0], agreed[1:], ctx.cluster.host_device)
        for train_op in ctx.view.train_ops:
            graph_mutation.add_control_inputs(train_op, [adapt])
        return PassResult(added=self._added(graph, before), notes=[
            f"dynamic loss scale: overflow counted over {len(devices)} replicas x "
            f"{ctx.communicator.num_workers} workers; {skipped} updates skipped on overflow"])

    @staticmethod
    def _added(graph, before) -> list[str]:
        return [op.name for op in graph.get_operations() if op not in before]

    @staticmethod
    def _unscale(tensor: tf.Tensor, inverse: tf.Tensor) -> tf.Tensor:
        """tensor x 1/scale on its device; every other consumer reads the result."""
        consumers = list(tensor.consumers())
        with tf.device(tensor.device), tf.name_scope(SCOPE):
            unscaled = tensor * tf.cast(inverse, tensor.dtype)
        for consumer in consumers:
            for index, inp in enumerate(consumer.inputs):
                if inp is tensor:
                    graph_mutation.update_input(consumer, index, unscaled)
        return unscaled

    @staticmethod
    def _guard_updates(graph, ctx, finite, amp) -> int:
        """Run each update op of the step under tf.cond(finite of its replica)."""
        global_step = tf.compat.v1.train.get_global_step(graph)
        replication = ctx.replication
        counters = set()
        if global_step is not None:
            counters = {m.outputs[0] for m in replication.mirrors.get(global_step.op, [global_step.op])}
        state = {amp.scale_var.handle, amp.good_steps_var.handle}
        updates = [op for op in ancestors(ctx.view.train_ops) if _is_update(op)
                   and op.inputs[0] not in counters and op.inputs[0] not in state]
        for update in sorted(updates, key=lambda op: op._id):
            attr = update.node_def.attr.get(REPLICA_ATTR)
            ok = finite[attr.i if attr is not None else 0]
            with tf.device(update.device), tf.name_scope(SCOPE), \
                    tf.control_dependencies(update.control_inputs):
                applied = tf.cond(ok, lambda u=update: _rebuild(u), lambda: tf.constant(False))
            for waiting in list(update._control_outputs):
                replace_control_inputs(waiting, {update: applied.op})
        return len(updates)

    @staticmethod
    def _adapt(amp, finite, others, host) -> tf.Operation:
        """The scale update for the next step (after every replica's check)."""
        scale, good = amp.scale_var, amp.good_steps_var
        with tf.device(host), tf.name_scope(SCOPE), tf.control_dependencies(others):
            grown = good.read_value() + 1
            grow = tf.greater_equal(grown, DYNAMIC_GROWTH_STEPS)
            new_scale = tf.where(finite, tf.where(grow, amp.scale * 2.0, amp.scale),
                                 tf.maximum(amp.scale * 0.5, 1.0))
            new_good = tf.where(tf.logical_and(finite, tf.logical_not(grow)), grown,
                                tf.zeros_like(grown))
            return tf.group(scale.assign(new_scale), good.assign(new_good))


def _rebuild(update: tf.Operation) -> tf.Tensor:
    """A copy of `update` in the current (cond branch) graph; True once it ran."""
    graph = tf.compat.v1.get_default_graph()
    attrs = {k: v for k, v in update.node_def.attr.items() if not k.startswith("_")}
    copy = graph._create_op_internal(update.type, list(update.inputs),
                                     [o.dtype for o in update.outputs], name=update.name.split("/")[-1],
                                     attrs=attrs, op_def=update.op_def, compute_device=False)
    with tf.control_dependencies([copy]):
        return tf.constant(True)
