"""Gradient communication: one reduction per trainable gradient.

For every gradient the replicate pass produced (one copy per replica), the pass
reduces the copies through the communicator and makes each replica's update
ops read the reduced gradient. With the default `communication.
gradients_reduce_method: mean` the reduced gradient is the batch-share-weighted
sum (sum of share_k x gradient_k), which equals the single-device gradient of
the mean loss over the whole global batch; with even shares this is a plain
mean (the collective divides). With `sum`, the copies are summed.

Fusion of small gradients into buckets is the fusion pass's job; this pass
issues the reductions in reverse order of the forward pass (last layers
first), the order in which backward produces them.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, Phase
from epl.ir.graph_view import ancestors
from epl.ir.clone import replace_input
from epl.pass_manager import GraphPass, PassContext, PassResult


def _is_apply(op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(PHASE_ATTR)
    return attr is not None and attr.s.decode() == Phase.APPLY.value


def _tag_replicas(new_ops, grads, reduced) -> None:
    """Give the ops built to reduce replica k's gradient replica k's `_epl_replica` attr.

    The collectives (and the share scaling before them) belong to the replica
    whose gradient they read; without the attr they would count as replica 0
    in dumps and analyses.
    """
    new_ops = set(new_ops)
    for grad, out in zip(grads, reduced):
        attr = grad.op.node_def.attr.get(REPLICA_ATTR)
        if attr is None:
            continue
        for op in ancestors([out.op]) & new_ops:
            op._set_attr(REPLICA_ATTR, attr)


class GradientCommPass(GraphPass):
    """All-reduces each gradient over the replicas and rewires the updates."""

    name = "gradient_comm"
    requires = ("replicate",)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        replication = ctx.artifacts["replicate"]
        method = ctx.config.get("communication.gradients_reduce_method")
        even = ctx.plan.even and ctx.communicator.num_workers == 1
        before = set(graph.get_operations())
        reduced_of = {}
        for var, grads in reversed(replication.gradients):
            consumers = [[c for c in g.consumers() if _is_apply(c)] for g in grads]
            devices = [g.op.device for g in grads]
            first = len(graph.get_operations())
            reduced = self._reduce(ctx.communicator, grads, devices, replication.weights, method, even)
            _tag_replicas(graph.get_operations()[first:], grads, reduced)
            for grad, new, ops in zip(grads, reduced, consumers):
                for op in ops:
                    replace_input(op, grad, new)
            reduced_of[var.name] = [t.op.name for t in reduced]
        ctx.artifacts[self.name] = reduced_of
        added = [op.name for op in graph.get_operations() if op not in before]
        return PassResult(added=added, notes=[f"{len(reduced_of)} gradient reductions ({method})"])

    @staticmethod
    def _reduce(communicator, grads, devices, weights, method, even):
        if len(grads) == 1 and communicator.num_workers == 1:
            return list(grads)
        if method == "sum":
            return communicator.all_reduce(grads, devices, op="sum")
        if even:
            return communicator.all_reduce(grads, devices, op="mean")
        scaled = []
        for grad, device, weight in zip(grads, devices, weights):
            with tf.device(device):
                scaled.append(grad * tf.cast(weight, grad.dtype))
        return communicator.all_reduce(scaled, devices, op="sum")
