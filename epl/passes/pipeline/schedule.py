"""Pipeline schedule: lower each replica's schedule table into control edges.

The replicate pass made one copy of the forward and backward ops per
(replica r, micro-batch m); every copy op carries its TaskGraph, and the
TaskGraphs in creation order are the pipeline stages 0..S-1. A step of the
schedule (epl/passes/pipeline/step_order.py) is the forward or the backward of micro-batch m
on stage s; its ops, for replica r, are

- forward: the forward copies of (r, m) whose TaskGraph is stage s,
- backward: the backward ops regenerated for (r, m) whose TaskGraph is stage s
  (colocated with their forward op, so on the same stage), and the accumulate
  pass's adds of (r, m)'s gradients (epl/passes/pipeline/accumulate.py),

restricted to the ops a training step runs (ancestors of the train ops and of
the loss copies), so that no control edge forces extra work, and without
constants (a `Const` with no inputs: it computes nothing and holds no memory
that grows, so ordering it orders nothing; the micro-batches of a replica share
one copy of each constant, epl.ir.clone.ConstantPool, which would otherwise
sit in several steps at once).

For consecutive steps A -> B in a stage's row of
`make_schedule(pipeline.strategy, S, M)` (`Schedule.execution_dependencies`),
one NoOp on the stage's device (the "barrier": phase "other", the stage's
TaskGraph, the replica, B's micro-batch, and `_epl_schedule_edge` = "A->B",
e.g. "F1->B0") gets control inputs from the ops of A that have no
successor inside A, and every op of B that has no predecessor inside B gets
the barrier as a control input: all of A runs before any of B. Steps with no
ops (a stage without trainable variables has no backward) are skipped; the
order of the remaining ones is kept. With one stage and one micro-batch (plain
data parallelism) nothing is added.

Data dependencies between stages (forward of (s, m) feeds (s+1, m); backward
of (s+1, m) feeds (s, m)) are the tensors themselves: TensorFlow inserts its
own send/receive pairs where they cross devices.

Bad input, checked before any rewrite (`validate`): a forward op of a stage
reading a forward tensor of a later stage (the stages would form a cycle).
After the rewrite the pass checks that the graph is still acyclic.

Result: a `ScheduleLowering`.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import (MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, SCHEDULE_EDGE_ATTR,
                                TASKGRAPH_ATTR, Phase, taskgraph_tag)
from epl.ir.clone import plain_constant
from epl.ir.graph_view import TrainingView, ancestors
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.pipeline.accumulate import Accumulation
from epl.passes.pipeline.step_order import BACKWARD, FORWARD, Schedule, Step, make_schedule
from epl.passes.replication.result import Replication
from epl.planner.plan import Plan



@dataclasses.dataclass
class ScheduleLowering:
    """What the schedule pass built.

    schedule: the table every replica follows.
    step_ops: (replica, Step) -> the ops of that step (possibly empty).
    barriers: (replica, before Step, after Step) -> the barrier NoOp.
    boundaries: (from stage, to stage) -> forward tensors of replica 0,
      micro-batch 0 that cross between the stages (the activations sent).
    """

    schedule: Schedule | None
    step_ops: dict
    barriers: dict
    boundaries: dict


def _stage_index(op: tf.Operation, stages: dict) -> int | None:
    taskgraph = taskgraph_tag(op)
    return stages.get(taskgraph) if taskgraph is not None else None


def check_stage_order(view) -> None:
    """Raise ParallelizeError if a stage's forward reads a later stage's forward.

    Stages are the TaskGraphs in creation order; a forward tensor may only flow
    from a stage to itself or a later one.
    """
    if len(view.taskgraphs) < 2:
        return
    for op in view.replica_ops:
        if view.phase_of[op] != Phase.FORWARD:
            continue
        stage = view.taskgraph_of[op]
        for tensor in op.inputs:
            producer = tensor.op
            source = view.taskgraph_of.get(producer)
            if (source is not None and source.index > stage.index
                    and view.phase_of.get(producer) == Phase.FORWARD):
                raise ParallelizeError(
                    f"the pipeline stages form a cycle: {view.describe_op(op)} in stage "
                    f"{stage.index} ({stage.name}) reads {tensor.name} computed by "
                    f"{view.describe_op(producer)} in the later stage {source.index} "
                    f"({source.name}), so stage {source.index} feeds stage {stage.index}'s "
                    "forward. Stages are the strategy scopes in the order they were first "
                    "opened; a stage may only read tensors of itself or of earlier stages. "
                    "Move the op into the later stage's scope, or reorder the scopes.")


def _step_ops(replication, accumulation, replica: int, stages: dict, live: set) -> dict:
    """Step -> ops of that step for `replica` (see the module docstring)."""
    groups: dict = {}
    added = accumulation.ops if accumulation is not None else {}
    for m in range(replication.num_micro_batches):
        forward = replication.forward_copies[(replica, m)].values()
        backward = list(replication.backward_ops[(replica, m)]) + added.get((replica, m), [])
        for kind, ops in ((FORWARD, forward), (BACKWARD, backward)):
            for op in ops:
                if plain_constant(op):
                    continue
                stage = _stage_index(op, stages)
                if op in live and stage is not None:
                    groups.setdefault(Step(stage, m, kind), []).append(op)
    return groups


def _sinks(ops: list) -> list:
    """Ops of a step with no data or control successor inside the step."""
    members = set(ops)
    return [op for op in ops
            if not any(c in members for out in op.outputs for c in out.consumers())
            and not any(c in members for c in op._control_outputs)]


def _sources(ops: list) -> list:
    """Ops of a step with no data or control predecessor inside the step."""
    members = set(ops)
    return [op for op in ops
            if not any(t.op in members for t in op.inputs)
            and not any(c in members for c in op.control_inputs)]


def _barrier(graph, before: Step, after: Step, replica: int, stage_name: str, device: str,
             sinks: list) -> tf.Operation:
    """A NoOp on `device` that runs after `sinks`, tagged with the edge it stands for."""
    label = f"{before}->{after}"
    with tf.device(device), tf.control_dependencies(sinks):
        barrier = tf.no_op(name=f"EPL_SCHEDULE/replica_{replica}/stage_{after.stage}/"
                                f"{before}_to_{after}")
    graph_mutation.set_attr(barrier, TASKGRAPH_ATTR, tf.compat.v1.AttrValue(s=stage_name.encode()))
    graph_mutation.set_attr(barrier, PHASE_ATTR,
                            tf.compat.v1.AttrValue(s=Phase.OTHER.value.encode()))
    graph_mutation.set_attr(barrier, REPLICA_ATTR, tf.compat.v1.AttrValue(i=replica))
    graph_mutation.set_attr(barrier, MICRO_BATCH_ATTR, tf.compat.v1.AttrValue(i=after.micro_batch))
    graph_mutation.set_attr(barrier, SCHEDULE_EDGE_ATTR, tf.compat.v1.AttrValue(s=label.encode()))
    return barrier


def stage_boundaries(forward_copies: dict, stages: dict) -> dict:
    """(from stage, to stage) -> forward tensors crossing between the stages."""
    boundaries: dict = {}
    copies = set(forward_copies.values())
    stage_of = {op: _stage_index(op, stages) for op in copies}  # one tag read per copy
    for op in copies:
        to_stage = stage_of[op]
        for tensor in op.inputs:
            from_stage = stage_of.get(tensor.op)
            if tensor.op in copies and from_stage is not None and from_stage != to_stage:
                found = boundaries.setdefault((from_stage, to_stage), [])
                if tensor not in found:
                    found.append(tensor)
    return boundaries


class SchedulePass(GraphPass):
    """Orders the micro-batch copies of each stage by the pipeline schedule."""

    name = "schedule"
    requires = (TrainingView, Plan, Replication)
    optional = (Accumulation,)   # orders every unit's copies and its adds
    provides = (ScheduleLowering,)
    after = ("accumulate",)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        check_stage_order(ctx.get(TrainingView))

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view, plan = ctx.get(TrainingView), ctx.get(Plan)
        replication = ctx.get(Replication)
        stages = {tg.name: tg.index for tg in view.taskgraphs}
        num_stages, micro = len(view.taskgraphs), replication.num_micro_batches
        boundaries = stage_boundaries(replication.forward_copies.get((0, 0), {}), stages)
        if num_stages == 1 and micro == 1:
            ctx.provide(ScheduleLowering(None, {}, {}, boundaries))
            return PassResult(notes=["one stage and one micro-batch: nothing to schedule"],
                              modified=False)
        strategy = self.options.strategy
        schedule = make_schedule(strategy, num_stages, micro)
        loss_ops = [t.op for losses in replication.loss_copies.values() for t in losses]
        live = ancestors(list(view.train_ops) + loss_ops)
        step_ops, barriers = {}, {}
        before_ops = len(graph.get_operations())
        for k in range(plan.num_replicas):
            groups = _step_ops(replication, ctx.find(Accumulation), k, stages, live)
            step_ops.update({(k, step): groups.get(step, []) for step in schedule.all_steps()})
            for s, row in enumerate(schedule.per_stage):
                steps = [step for step in row if groups.get(step)]
                device = plan.device(view.taskgraphs[s], k)
                for before, after in zip(steps, steps[1:]):
                    barrier = _barrier(graph, before, after, k, view.taskgraphs[s].name, device,
                                       _sinks(groups[before]))
                    for op in _sources(groups[after]):
                        graph_mutation.add_control_inputs(op, [barrier])
                    barriers[(k, before, after)] = barrier
        # no cycle check here: the verify pass checks the whole graph once, after every
        # pass's edges (and after each pass under debug.check_invariants), and names
        # the ops of a cycle a schedule edge closed
        ctx.provide(ScheduleLowering(schedule, step_ops, barriers, boundaries))
        added = [op.name for op in graph.get_operations()[before_ops:]]
        notes = [f"{strategy}: {num_stages} stage(s) x {micro} micro-batch(es), "
                 f"{len(barriers)} schedule edges over {plan.num_replicas} replica(s)"]
        notes += schedule.format_table().splitlines()
        notes += [f"stage boundary {a}->{b}: {len(ts)} tensor(s) "
                  f"({', '.join(t.name for t in ts[:4])}{', ...' if len(ts) > 4 else ''})"
                  for (a, b), ts in sorted(boundaries.items())]
        return PassResult(added=added, notes=notes, modified=bool(barriers))
