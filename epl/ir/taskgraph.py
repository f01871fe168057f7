"""TaskGraph (a part of the model under one strategy) and TrainStep (one optimizer
step recorded at gradient time): what construction and gradient time record about
a graph, in its `epl.ir.record.GraphRecord`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from epl.ir.annotations import StrategySpec


@dataclasses.dataclass
class TaskGraph:
    """One annotated part of the model.

    index: position in creation order (stage order for pipelines).
    spec: the strategy that created it.
    """

    index: int
    spec: StrategySpec

    @property
    def name(self) -> str:
        """The TaskGraph's name, as stored in each op's `_epl_taskgraph` attr."""
        return self.spec.name


@dataclasses.dataclass
class TrainStep:
    """One optimizer step recorded at gradient time.

    loss: the tensor passed to compute_gradients.
    grads_and_vars: the (gradient, variable) pairs compute_gradients returned.
    train_op: the op apply_gradients returned (None until it is called).
    gradient_kwargs: how compute_gradients was called (gate_gradients,
      aggregation_method, grad_loss, sparse_as_dense), so passes can rebuild
      the gradients of a copy of the forward graph the same way.
    backward_ops: the ops compute_gradients created, in creation order (the
      template that epl.passes.replication.backward_copy copies for each replica).
    A step recorded from `tf.gradients` (epl/hooks/optimizer.py) has no train
    op until analysis finds the updates its gradients feed
    (epl.ir.graph_view.derive_train_op).
    """

    loss: tf.Tensor
    grads_and_vars: list[tuple[Any, Any]]
    train_op: tf.Operation | None = None
    gradient_kwargs: dict = dataclasses.field(default_factory=dict)
    backward_ops: list = dataclasses.field(default_factory=list)
    # recorded from the user's own tf.gradients call: its ops are backward only if
    # analysis finds its gradients updating variables (it may be a gradient
    # penalty inside the forward pass instead)
    from_gradients: bool = False
    # the train op was found in the graph (no hooked apply_gradients recorded it)
    derived_train_op: bool = False
