"""Gradient checkpointing: which forward tensors each training step keeps.

With `gradient_checkpoint.type` set, the backward of every (replica,
micro-batch) unit keeps only some forward tensors alive and recomputes the
others from them when the backward needs them (epl.passes.recompute.checkpoints, after Chen et
al., "Training deep nets with sublinear memory cost"). This pass decides which:

- "collection": the tensors of the "checkpoints" collection (an empty
  collection, or a tensor off the path from the variables to the loss, is
  refused before any rewrite);
- "auto": bottleneck tensors chosen by `epl.passes.recompute.checkpoints.select_checkpoints_auto`,
  limited to the TaskGraphs up to `gradient_checkpoint.end_taskgraph` when that
  is set.

The selection is made on the template (the graph as the user built it) and is
the pass's result (ctx.recompute, a `Recompute`). The replicate pass builds each
unit's backward once, with the selection, through
`epl.passes.recompute.checkpoints.checkpointed_gradients`; building the plain backward first and
rewriting it into the recomputing one afterwards would build every unit's
backward twice.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.ir.graph_view import TrainingView
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.options import RecomputeOptions
from epl.passes.recompute import checkpoints as recompute


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What the recompute pass chose.

    checkpoints: per recorded training step (by id), the template tensors its
      backward keeps (the others are recomputed).
    check_gradients: `gradient_checkpoint.check_gradients`: the replicate pass
      also builds replica 0's plain gradients, which the session compares with the
      checkpointed ones before the first step.
    """

    checkpoints: dict
    check_gradients: bool = False


def select_checkpoints(view, options: RecomputeOptions) -> dict:
    """Per recorded step (by id), the template tensors gradient checkpointing keeps.

    Raises (epl.errors) for an empty "checkpoints" collection or one that holds a
    tensor off the path from the variables to the loss.
    """
    kind, end = options.kind, options.end_taskgraph
    selected = {}
    for step in view.steps:
        xs = [v.op.outputs[0] for g, v in step.grads_and_vars if g is not None]
        if kind == "collection":
            selected[id(step)] = recompute.select_checkpoints_collection(view.graph, step.loss, xs)
        else:
            keep = None if end < 0 else (
                lambda op: op in view.taskgraph_of and view.taskgraph_of[op].index <= end)
            selected[id(step)] = recompute.select_checkpoints_auto(step.loss, xs,
                                                                   candidate_filter=keep)
    return selected


class RecomputePass(GraphPass):
    """Chooses the forward tensors each step's backward keeps (gradient checkpointing)."""

    name = "recompute"
    requires = (TrainingView,)   # the analysed TaskGraphs (end_taskgraph)
    provides = (Recompute,)
    after = ("annotate",)
    off_note = "no gradient checkpointing (gradient_checkpoint.type is empty)"

    def validate(self, graph: tf.Graph, ctx: PassContext) -> dict:
        """The selection, on the graph as the user built it (raises for a bad
        collection); run() hands it on."""
        return select_checkpoints(ctx.get(TrainingView), self.options)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        checkpoints = ctx.validated.get(self.name)
        if checkpoints is None:   # the caller did not validate (a pass run alone)
            checkpoints = select_checkpoints(ctx.get(TrainingView), self.options)
        ctx.provide(Recompute(checkpoints, self.options.check_gradients))
        kept = sum(len(tensors) for tensors in checkpoints.values())
        return PassResult(notes=[
            f"gradient_checkpoint.type {self.options.kind!r}: "
            f"{kept} forward tensor(s) kept over {len(checkpoints)} step(s), the rest "
            "recomputed in the backward"], modified=False)
