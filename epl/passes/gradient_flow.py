"""Each replica's gradients as they flow through the training passes, one way.

The replicate pass builds every unit's backward and wires each replica's
updates to its gradients. The passes after it each take the gradients as the
pass before left them and insert their stage between those gradients and what
reads them, never reaching back upstream:

    replicate (micro-batch 0's gradient of every replica)
      -> accumulate (the sum over micro-batches)
      -> unscale (x 1/loss scale, before any communication)
      -> zero / gradient_comm (reduced over replicas and workers)
      -> skip_on_overflow (the updates run only on a finite step)

Each of replicate, accumulate and unscale provides a `ReplicaGradients` result
(epl/passes/manager.py: results keyed by type, the latest wins), so what the
communication passes read, `ctx.get(ReplicaGradients)`, is the gradients as the
last of those stages that ran left them (a stage that is off leaves them as they were).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, Phase


@dataclasses.dataclass(frozen=True)
class ReplicaGradients:
    """Per-replica gradients at one stage of the flow.

    entries: per trainable non-split variable, (variable op, [its gradient on each
      replica], the template's gradient); what the updates of each replica read.
    split: (variable op, its one gradient) per split variable (computed with every
      replica's loss, so one gradient, not one per replica).
    """

    entries: list
    split: list


def tensors_of(gradient) -> list[tf.Tensor]:
    """The tensors a gradient's readers read: a dense gradient itself, a sparse
    one (tf.IndexedSlices) its values and indices."""
    if isinstance(gradient, tf.IndexedSlices):
        return [gradient.values, gradient.indices]
    return [gradient]


def readers(gradient) -> list[list[tf.Operation]]:
    """Per tensor of `gradient` (tensors_of), the ops that read it now: what a stage
    inserted after it rewires (taken before the stage builds its own readers). The
    backward ops that read it are not among them: a tensor that is one variable's
    gradient can also be an intermediate of the backward (BatchNormalization's beta
    gradient feeds the gradients of the layers below it), and those ops must keep
    reading the unit's own value."""
    return [[c for c in t.consumers() if not _is_backward(c)] for t in tensors_of(gradient)]


def _is_backward(op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(PHASE_ATTR)
    return attr is not None and attr.s.decode() == Phase.BACKWARD.value


def rewire(gradient, replacement, taken: list[list[tf.Operation]]) -> None:
    """The readers `taken` (readers(gradient)) read `replacement` instead."""
    for old, new, consumers in zip(tensors_of(gradient), tensors_of(replacement), taken):
        graph_mutation.rewire_consumers(old, new, consumers)
