"""TaskGraph: a part of the model under one strategy, and the per-graph state.

A `GraphState` is attached to each tf.Graph that EPL annotates. It holds what
construction and gradient time recorded (TaskGraphs in creation order, the
losses, the gradients and the train ops) and, after parallelization, the
result the session integration needs. It is reached with `graph_state(graph)`;
there is one per graph, never a process-wide grab-bag.
"""
from __future__ import annotations

import dataclasses
import weakref
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


@dataclasses.dataclass
class GraphState:
    """What EPL knows about one tf.Graph."""

    taskgraphs: list[TaskGraph] = dataclasses.field(default_factory=list)
    scope_stack: list[StrategySpec] = dataclasses.field(default_factory=list)
    default_spec: StrategySpec | None = None
    default_scope_exit: Any = None
    train_steps: list[TrainStep] = dataclasses.field(default_factory=list)
    # epl/passes/split.SplitRecord per split TaskGraph, written at gradient time
    splits: list = dataclasses.field(default_factory=list)
    dumps_written: int = 0   # pass dumps written before parallelize (the split pass)
    parallelized: bool = False
    result: Any = None   # epl.parallel.ParallelGraph once parallelized
    # ops epl.ir.clone.NodeBatch created with a TaskGraph, a phase and a device
    # already set (tags and devices are never removed): the pass manager's
    # adoption of new ops and the verifier skip reading their NodeDefs again
    created_complete: set = dataclasses.field(default_factory=set)

    def taskgraph(self, name: str) -> TaskGraph | None:
        """Return the TaskGraph called `name`, or None."""
        for taskgraph in self.taskgraphs:
            if taskgraph.name == name:
                return taskgraph
        return None

    def add_taskgraph(self, spec: StrategySpec) -> TaskGraph:
        """Register a TaskGraph for `spec` (or return the one with that name)."""
        existing = self.taskgraph(spec.name)
        if existing is not None:
            return existing
        taskgraph = TaskGraph(index=len(self.taskgraphs), spec=spec)
        self.taskgraphs.append(taskgraph)
        return taskgraph


_STATES: "weakref.WeakKeyDictionary[tf.Graph, GraphState]" = weakref.WeakKeyDictionary()


def graph_state(graph: tf.Graph, create: bool = True) -> GraphState | None:
    """Return the GraphState of `graph`, creating it when `create` is true."""
    state = _STATES.get(graph)
    if state is None and create:
        state = GraphState()
        _STATES[graph] = state
    return state
