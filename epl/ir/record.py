"""The record of one graph: what construction and gradient time saw.

A `GraphRecord` holds, for one tf.Graph (a `FuncGraph` too), the TaskGraphs in
creation order and the scope state that tags ops with them (construction), the
training steps and the split pass's records (gradient time), the config EPL was
initialized with when it first recorded something, and, once the graph is
parallelized, the driver's result. The hooks own the records (epl/hooks/record.py
finds a graph's record, and is the only place that does); everything below them
is handed the record explicitly: `epl.parallel.parallelize(graph, record)`, the
analysis (`epl.ir.graph_view.analyze(graph, record)`), the pass context.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from epl.ir.annotations import StrategyKind, StrategySpec
from epl.ir.taskgraph import TaskGraph, TrainStep


@dataclasses.dataclass
class GraphRecord:
    """What EPL recorded about one tf.Graph.

    taskgraphs: in creation order (stage order). scope_stack / default_spec /
      default_scope_exit: the open strategy scopes and the default strategy
      (epl/strategies.py).
    train_steps: the optimizer steps recorded at gradient time (epl/hooks/optimizer.py).
    splits: the split pass's SplitRecord per TaskGraph it split (gradient time).
    config: the active epl.Config when the record was made (None: EPL was not
      initialized yet; the graph is then rewritten under the config active at
      parallelize time).
    result: the driver's ParallelGraph once the graph is parallelized.
    shard_gradients: the gradient of a split variable the script's tf.gradients returned
      (its shards' gradients concatenated) -> [(shard gradient, shard)], which
      apply_gradients updates the shards with (epl/hooks/optimizer.py).
    """

    taskgraphs: list[TaskGraph] = dataclasses.field(default_factory=list)
    scope_stack: list[StrategySpec] = dataclasses.field(default_factory=list)
    default_spec: StrategySpec | None = None
    default_scope_exit: Any = None
    train_steps: list[TrainStep] = dataclasses.field(default_factory=list)
    splits: list = dataclasses.field(default_factory=list)
    config: Any = None
    result: Any = None
    shard_gradients: dict = dataclasses.field(default_factory=dict)
    # the config to rewrite the graph under, when its maker gives one (a traced
    # tf.function's lowered graph: the active config with the step's batch contract,
    # epl/hooks/function.py); None: the active config (epl.parallel.config_of)
    rewrite_config: Any = None
    # writes of variables the forward pass reads that a traced step runs outside its
    # update (Keras 3's dropout-seed state, epl/hooks/function.py): forward ops, copied
    # per replica and micro-batch like the reads they advance (epl.ir.graph_view)
    forward_writes: list = dataclasses.field(default_factory=list)

    @property
    def parallelized(self) -> bool:
        """True once the driver rewrote the graph."""
        return self.result is not None

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

    def unsplit_taskgraphs(self) -> list[TaskGraph]:
        """The epl.split TaskGraphs the split pass has not rewritten yet."""
        done = {record.taskgraph for record in self.splits}
        return [tg for tg in self.taskgraphs
                if tg.spec.kind == StrategyKind.SPLIT and tg.name not in done]
