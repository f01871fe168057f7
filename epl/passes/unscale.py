"""AMP loss scaling, first half: unscale each replica's gradients right after the backward.

The amp pass (epl/passes/amp.py) made every replica's autodiff start from the
loss scale, so each replica's gradients are scale x the true ones. This pass
runs after the gradients exist per replica (replicate, accumulate) and before
any communication (zero, gradient_comm): every replica's gradient is
multiplied by 1/scale on its device, and what read it (the replica's updates,
or the ops the script put between compute_gradients and apply_gradients) reads
the unscaled one; the communication passes then reduce unscaled gradients
(epl/passes/gradient_flow.py: gradients flow one way).

With a dynamic scale it also counts, per replica, the non-finite values of its
unscaled gradients: the skip_on_overflow pass (epl/passes/skip_on_overflow.py)
sums those counts over every replica of every worker at the end of the step and
skips the updates of a step that overflowed.

Results: the unscaled gradients (a `ReplicaGradients`, what the passes after it
reduce) and an `Unscaling` (the gradients and the counts).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.passes import gradient_flow
from epl.passes.amp import AmpRewrite
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.manager import GraphPass, PassContext, PassResult

SCOPE = "EPL_LOSS_SCALE"


@dataclasses.dataclass(frozen=True)
class Unscaling:
    """What the unscale pass built.

    gradients: each replica's unscaled gradients (gradient_flow.ReplicaGradients).
    nonfinite: per replica, scalar float32 tensors (on the replica's devices) that
      count the non-finite values of its unscaled gradients; empty lists for a fixed
      scale (no overflow check).
    """

    gradients: ReplicaGradients
    nonfinite: list


class UnscalePass(GraphPass):
    """Multiplies every replica's gradients by 1/loss scale, before any reduction."""

    name = "unscale"
    requires = (AmpRewrite, ReplicaGradients)
    provides = (ReplicaGradients, Unscaling)
    after = ("replicate", "accumulate")   # after the last per-replica stage
    off_note = "no loss scaling (amp.level is off)"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        amp = ctx.get(AmpRewrite)
        current = ctx.get(ReplicaGradients)
        first_new = len(graph.get_operations())
        replicas = max(len(current.entries[0][1]) if current.entries else 0, 1)
        dynamic = amp.scale_var is not None
        with tf.device(ctx.cluster.host_device), tf.name_scope(SCOPE):
            inverse = 1.0 / amp.scale
        nonfinite = [[] for _ in range(replicas)]

        def unscaled(gradient, k):
            taken = gradient_flow.readers(gradient)
            if isinstance(gradient, tf.IndexedSlices):
                values = self._unscale(gradient.values, inverse, nonfinite[k] if dynamic else None)
                new = tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
            else:
                new = self._unscale(gradient, inverse, nonfinite[k] if dynamic else None)
            gradient_flow.rewire(gradient, new, taken)
            return new

        entries = [(var, [None if g is None else unscaled(g, k) for k, g in enumerate(grads)],
                    original) for var, grads, original in current.entries]
        # a split variable's one gradient (computed with every replica's loss): replica 0's
        split = [(var, unscaled(grad, 0)) for var, grad in current.split]
        unscaled = ReplicaGradients(entries, split)
        ctx.provide(unscaled)
        ctx.provide(Unscaling(unscaled, nonfinite if dynamic else []))
        added = [op.name for op in graph.get_operations()[first_new:]]
        check = (f"; non-finite values counted per replica ({replicas})" if dynamic
                 else " (a fixed scale: no overflow check)")
        return PassResult(added=added, notes=[f"gradients unscaled by 1/scale{check}"])

    @staticmethod
    def _unscale(tensor: tf.Tensor, inverse: tf.Tensor, counts: list | None) -> tf.Tensor:
        """tensor x 1/scale on its device; with `counts`, appends the count of its
        non-finite values."""
        with tf.device(tensor.device), tf.name_scope(SCOPE):
            result = tensor * tf.cast(inverse, tensor.dtype)
            if counts is not None:
                counts.append(tf.reduce_sum(tf.cast(
                    tf.logical_not(tf.math.is_finite(result)), tf.float32)))
        return result
