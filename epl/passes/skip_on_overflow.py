"""AMP loss scaling, second half: agree on overflow, skip the updates, adapt the scale.

With `amp.loss_scale: "dynamic"`, at the end of the gradient path (after the
updates exist, their communication and apply groups included):

- the non-finite counts of each replica's unscaled gradients (made by the
  unscale pass, epl/passes/unscale.py) are summed over every replica of
  every worker with the communicator (TensorFlow collectives locally, Horovod
  across workers), so all replicas decide on the same number: the step is
  skipped everywhere or nowhere;
- every update op a step runs (an apply-phase op that writes a variable: the
  optimizer's updates and its own state such as Adam's beta powers, ZeRO's
  shard updates and write-backs), except the global step's increment, runs
  inside a tf.cond on "no overflow"; the ops that waited for an update wait
  for its cond;
- the scale is updated once per step on the host: halved (not below 1) after
  an overflow, doubled after amp.DYNAMIC_GROWTH_STEPS finite steps in a row.
  The user's train ops wait for it.

A fixed amp.loss_scale has nothing to skip: this pass is off.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, Phase
from epl.ir.clone import replace_control_inputs
from epl.ir.graph_view import VARIABLE_OP_TYPES, TrainingView, ancestors
from epl.passes.amp import DYNAMIC_GROWTH_STEPS, AmpRewrite
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.replication.result import Replication
from epl.passes.unscale import SCOPE, Unscaling

READ_TYPES = frozenset({"ReadVariableOp", "VarIsInitializedOp", "Identity", "ResourceGather",
                        "VariableShape"})


def _is_update(op: tf.Operation) -> bool:
    """An apply-phase op that takes a variable handle first and writes it."""
    attr = op.node_def.attr.get(PHASE_ATTR)
    if attr is None or attr.s.decode() != Phase.APPLY.value or not op.inputs:
        return False
    first = op.inputs[0]
    return first.op.type in VARIABLE_OP_TYPES and first.dtype == tf.resource \
        and op.type not in READ_TYPES


class SkipOnOverflowPass(GraphPass):
    """With a dynamic loss scale, skips the updates of an overflowed step everywhere."""

    name = "skip_on_overflow"
    requires = (TrainingView, AmpRewrite, Unscaling, Replication)
    # the last rewrite of the updates: after the passes that build or group them
    after = ("replicate", "zero", "gradient_comm", "apply_groups")
    off_note = "no dynamic loss scale (amp.level off, or a fixed amp.loss_scale)"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        amp, counts = ctx.get(AmpRewrite), ctx.get(Unscaling).nonfinite
        view = ctx.get(TrainingView)
        first_new = len(graph.get_operations())
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
        skipped = self._guard_updates(view, ctx.get(Replication), finite, amp)
        adapt = self._adapt(amp, finite[0], agreed[1:], ctx.cluster.host_device)
        for train_op in view.train_ops:
            graph_mutation.add_control_inputs(train_op, [adapt])
        added = [op.name for op in graph.get_operations()[first_new:]]
        return PassResult(added=added, notes=[
            f"dynamic loss scale: overflow counted over {len(devices)} replicas x "
            f"{ctx.communicator.num_workers} workers; {skipped} updates skipped on overflow"])

    @staticmethod
    def _guard_updates(view, replication, finite, amp) -> int:
        """Run each update op of the step under tf.cond(finite of its replica)."""
        global_step = tf.compat.v1.train.get_global_step(view.graph)
        counters = set()
        if global_step is not None:
            counters = {m.outputs[0] for m in replication.mirrors.get(global_step.op, [global_step.op])}
        state = {amp.scale_var.handle, amp.good_steps_var.handle}
        updates = [op for op in ancestors(view.train_ops) if _is_update(op)
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
