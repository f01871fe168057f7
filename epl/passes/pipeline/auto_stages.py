"""Automatic pipeline stages: cut an unannotated model into balanced stages.

With `auto.auto_parallel: True` and `pipeline.num_stages: K > 1`, a script
without stage scopes (no strategy scope at all, or a single
`epl.replicate(device_count=1)` around the whole model) is cut into K stages
before analysis, as if the user had written K consecutive
`epl.replicate(device_count=1, name="stage_<i>")` scopes. Scripts with two or
more TaskGraphs keep their own stages (the user's annotation wins).

How the cut is chosen (`plan_stages`, pure analysis; `apply_stages` writes it):

1. The forward ops are the loss's ancestors outside the input pipeline, in
   three kinds, told apart by the data flow alone:
   - activation ops: computed from a batch input and from a variable (through
     any chain of ops). In creation order (a topological order) they form the
     sequence to cut.
   - batch-derived ops: computed from batch inputs and constants but from no
     variable (attention masks, reshaped or one-hot ids and labels, position
     offsets). Such a tensor is typically read by every layer (the mask) or
     by the head (the labels), so it would cross every cut and tell none of
     them apart; counted as a crossing activation it hid every layer boundary
     of a BERT-style encoder behind a count of 2, and the 1-tensor cuts that
     remained were inside the last layer (stage 0 held 83% of the cost).
     These ops are not in the sequence and never count as crossing; they are
     placed like weights (below), and their cost is added to the stage they
     land in. A stage that reads one computed in an earlier stage receives it
     from there (`StagePartition.batch_crossing` lists those).
   - anchored ops (variables, their reads, constants, anything computed only
     from them).
   Anchored and batch-derived ops each go to the earliest stage that consumes
   them, so weights live with the layer that reads them and never cross a cut,
   and a label reshape written at the top of the script runs in the head's stage.
2. The cost of an op is the planner's cost model: the roofline time
   (`epl.planner.cost_model.predict_time`) of its FLOPs and bytes
   (`op_cost`, unknown dimensions counted as the global batch) on a fixed
   reference profile (V100-16GB). The stages run on identical devices, so only
   the ratio of FLOP/s to memory bandwidth matters, and a fixed profile makes
   the partition the same on every machine.
3. A cut after position p is allowed under a limit L when 1 to L activation
   tensors cross it (produced at or before p, consumed after p). In a
   transformer, L = 1 admits the layer boundaries (only the hidden state
   crosses) and the point between a layer's attention and its feed-forward
   block.
4. For a limit, dynamic programming picks the K - 1 allowed cuts that
   minimise the most expensive stage (ties: fewer crossing tensors). With
   devices of different speed (`cluster.device_profiles`), stage i's cost is
   divided by the relative FLOP/s of the device it runs on (`stage_speeds`:
   the device the plan gives stage i, the slowest over the replicas), so a
   faster device gets a longer stage: stages are sized to their devices.
5. Balance comes first, few crossing tensors second: the partition is that
   of the smallest limit (1 .. MAX_CROSSING) whose most expensive stage is
   within BALANCE_TOLERANCE of the best one any limit reaches (it is checked
   first against the lower bound total / sum of speeds, so well-layered
   models solve one limit only). A limit with enough cuts but a lopsided
   partition is no longer taken because it is the smallest.
6. Within that limit, partitions whose most expensive stage is within
   NEAR_TIE (5%, below the cost model's precision) of the best are equally
   balanced; among them the cuts cross the fewest tensors, then have the most
   fan-out (ops after the cut reading the crossing tensors). A tensor read
   by several ops is where a block begins (a transformer layer's input feeds
   its query, key and value projections and the residual); a tensor read by
   one op is inside a chain, such as the last steps of a layer norm, whose
   cut would split a layer's weights between two stages for a balance gain
   smaller than the cost model can tell.

Every forward op then carries `_epl_taskgraph = stage_<i>`; backward ops
inherit their forward op's stage and apply ops their variable's (analysis,
through colocation), as for user-annotated stages.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import TASKGRAPH_ATTR, StrategyKind, StrategySpec
from epl.ir.graph_view import (VARIABLE_OP_TYPES, ancestors, descendants, find_batch_inputs,
                               training_steps)
from epl.ir.record import GraphRecord
from epl.ir.taskgraph import TaskGraph
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.planner import cost_model, stage_cuts
from epl.planner.worker_planner import WorkerPlanner
from epl.planner.profiles import get_profile

STAGE_NAME = "stage_{}"
MAX_CROSSING = 4
BALANCE_TOLERANCE = 1.15  # most expensive stage vs the best any crossing limit reaches
NEAR_TIE = 0.05  # stage times this close to the best count as equally balanced
REFERENCE_PROFILE = "V100-16GB"


@dataclasses.dataclass(frozen=True)
class StagePartition:
    """A cut of the forward graph into stages.

    stage_of: forward op -> stage index.
    costs: estimated forward time (seconds on the reference profile) per stage.
    taskgraphs: the stages' TaskGraphs (stage_0 ... stage_<K-1>), which the analysis
      reads in place of the script's own.
    crossing: per cut (between stage i and i + 1), the activation tensors
      that cross it (computed from the weights; what the cut rule counts).
    batch_crossing: per cut, the batch-derived tensors (computed from batch
      inputs and constants only, such as an attention mask) that a stage at or
      after i + 1 reads from a stage at or before i; sent, but not counted.
    """

    stage_of: dict
    costs: tuple[float, ...]
    crossing: tuple[tuple[tf.Tensor, ...], ...]
    batch_crossing: tuple[tuple[tf.Tensor, ...], ...] = ()

    @property
    def taskgraphs(self) -> list[TaskGraph]:
        """The stages' TaskGraphs, in stage order."""
        return [TaskGraph(i, StrategySpec(StrategyKind.REPLICATE, 1, STAGE_NAME.format(i)))
                for i in range(self.num_stages)]

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.costs)

    def describe(self) -> str:
        """One line per stage: cost share and what crosses into the next stage."""
        total = sum(self.costs) or 1.0
        lines = []
        for i, cost in enumerate(self.costs):
            line = f"{STAGE_NAME.format(i)}: {100 * cost / total:.1f}% of the forward cost"
            if i < len(self.crossing):
                line += f"; sends {', '.join(t.name for t in self.crossing[i])}"
                if i < len(self.batch_crossing) and self.batch_crossing[i]:
                    names = ", ".join(t.name for t in self.batch_crossing[i])
                    line += f" (and batch-derived {names})"
            lines.append(line)
        return "\n".join(lines)


def keeps_own_stages(taskgraphs: list) -> bool:
    """True if the script's TaskGraphs are its stages (automatic stages replace only none,
    or one replicated TaskGraph of one device wrapping the whole model)."""
    return not (not taskgraphs or (len(taskgraphs) == 1
                              and taskgraphs[0].spec.kind == StrategyKind.REPLICATE
                              and taskgraphs[0].spec.device_count == 1))


def _forward_ops(graph: tf.Graph, record: GraphRecord):
    """(activation ops in creation order, batch-derived ops, anchored ops, batch size).

    See the module docstring for the three kinds; the last two in creation order.
    """
    losses = [step.loss.op for step in training_steps(record)]
    loss_ancestors = ancestors(losses)
    batch_inputs, batch = find_batch_inputs(loss_ancestors)
    if not batch_inputs:
        raise ParallelizeError(
            "automatic pipeline stages need a batch input feeding the loss (a placeholder, "
            "tf.data iterator output or batch-sized constant); none was found.")
    batch_region = ancestors([t.op for t in batch_inputs])
    forward = loss_ancestors - batch_region
    from_batch = descendants(batch_inputs, within=forward)
    from_weights = _computed_from_variables(sorted(forward, key=lambda op: op._id))
    ordered = sorted(from_batch & from_weights, key=lambda op: op._id)
    batch_derived = sorted(from_batch - from_weights, key=lambda op: op._id)
    anchored = sorted(forward - from_batch, key=lambda op: op._id)
    return ordered, batch_derived, anchored, batch


def _computed_from_variables(ops: list) -> set:
    """The ops of `ops` (in creation order) that are variables or read, through their
    data inputs, a value computed from one."""
    result: set = set()
    for op in ops:
        if op.type in VARIABLE_OP_TYPES or any(t.op in result for t in op.inputs):
            result.add(op)
    return result


def _crossings(ordered: list) -> list[list[tf.Tensor]]:
    """crossings[p]: activation tensors produced at or before p and consumed after p."""
    position = {op: i for i, op in enumerate(ordered)}
    starts: dict[int, list] = {}
    for i, op in enumerate(ordered):
        for tensor in op.outputs:
            last = max((position[c] for c in tensor.consumers() if c in position), default=i)
            if last > i:
                starts.setdefault(i, []).append((tensor, last))
    live: list = []
    result = []
    for p in range(len(ordered)):
        live = [(t, last) for t, last in live if last > p] + starts.get(p, [])
        result.append([t for t, _ in live])
    return result


def _stage_time(costs: list[float], cuts: list[int], speeds: list[float] | None) -> float:
    """The most expensive stage's time (cost / speed) when the stages end at `cuts`."""
    bounds = [-1] + cuts + [len(costs) - 1]
    speeds = speeds or [1.0] * (len(cuts) + 1)
    return max(sum(costs[bounds[i] + 1:bounds[i + 1] + 1]) / speeds[i]
               for i in range(len(cuts) + 1))


def _choose_cuts(costs: list[float], counts: list[int], fan_out: list[int], num_stages: int,
                 speeds: list[float] | None) -> list[int] | None:
    """The cuts of the smallest crossing limit within BALANCE_TOLERANCE of the best
    balance any limit reaches, then, among that limit's cuts within NEAR_TIE of its
    balance, the fewest crossing tensors and the most fan-out (module docstring,
    3-6); None if no limit has enough cuts."""
    solved: dict[int, tuple | None] = {}

    def solve(limit: int):
        if limit not in solved:
            allowed = [p for p in range(len(costs) - 1) if 0 < counts[p] <= limit]
            bounds = stage_cuts.min_max_partition(
                costs, num_stages, speeds=speeds, allowed_cuts=[p + 1 for p in allowed],
                cut_weights=[counts[p] for p in allowed])
            cuts = None if bounds is None else [end - 1 for _, end in bounds[:-1]]
            solved[limit] = (_stage_time(costs, cuts, speeds), allowed) if cuts else None
        return solved[limit]

    def chosen(result) -> list[int]:
        time, allowed = result
        penalty = [(counts[p], -fan_out[p]) for p in range(len(costs))]
        return stage_cuts.min_penalty_cuts(costs, allowed, penalty, num_stages, speeds,
                               time * (1 + NEAR_TIE))

    bound = max(sum(costs) / sum(speeds or [1.0] * num_stages),
                max(costs, default=0.0) / max(speeds or [1.0]))
    for limit in range(1, MAX_CROSSING + 1):
        result = solve(limit)
        if result is not None and result[0] <= BALANCE_TOLERANCE * bound:
            return chosen(result)
    best = solve(MAX_CROSSING)
    if best is None:
        return None
    for limit in range(1, MAX_CROSSING + 1):
        result = solve(limit)
        if result is not None and result[0] <= BALANCE_TOLERANCE * best[0]:
            return chosen(result)
    return chosen(best)  # unreachable: MAX_CROSSING itself qualifies


def _fan_out(ordered: list, crossings: list[list[tf.Tensor]]) -> list[int]:
    """fan_out[p]: how many ops after p read the tensors crossing a cut after p."""
    position = {op: i for i, op in enumerate(ordered)}
    return [sum(1 for t in tensors for c in set(t.consumers()) if position.get(c, -1) > p)
            for p, tensors in enumerate(crossings)]


def plan_stages(graph: tf.Graph, record: GraphRecord, num_stages: int,
                profile=None, speeds: list[float] | None = None) -> StagePartition:
    """Choose `num_stages` balanced stages for the forward graph (changes nothing).

    speeds: relative speed of the device of each stage (default: all equal).
    Returns the partition: every forward op's stage, each stage's cost
    (including the batch-derived ops placed in it) and what crosses each cut.

    Raises:
        ParallelizeError: the model has fewer than `num_stages - 1` places where 1 to
          MAX_CROSSING activation tensors cross.
    """
    profile = profile or get_profile(REFERENCE_PROFILE)
    ordered, batch_derived, anchored, batch = _forward_ops(graph, record)

    def cost(op):
        return cost_model.predict_time(cost_model.op_cost(op, unknown_dim=batch), profile)

    costs = [cost(op) for op in ordered]
    crossings = _crossings(ordered)
    counts = [len(c) for c in crossings]
    cuts = _choose_cuts(costs, counts, _fan_out(ordered, crossings), num_stages, speeds)
    if cuts is None:
        raise ParallelizeError(
            f"pipeline.num_stages={num_stages}: the model has fewer than {num_stages - 1} "
            f"places where at most {MAX_CROSSING} activation tensors cross between consecutive "
            f"ops ({len(ordered)} forward ops computed from the batch and the weights). Lower "
            "pipeline.num_stages, or mark the stages with epl.replicate(device_count=1, "
            "name='stage_<i>') scopes.")
    bounds = [-1] + cuts + [len(ordered) - 1]
    stage_of = {}
    stage_costs = []
    for i in range(num_stages):
        members = ordered[bounds[i] + 1:bounds[i + 1] + 1]
        stage_of.update({op: i for op in members})
        stage_costs.append(sum(costs[bounds[i] + 1:bounds[i + 1] + 1]))
    placed = sorted(batch_derived + anchored, key=lambda op: op._id)
    for op in reversed(placed):  # consumers come later in creation order
        consumers = [stage_of[c] for out in op.outputs for c in out.consumers() if c in stage_of]
        stage_of[op] = min(consumers, default=0)
    for op in batch_derived:
        stage_costs[stage_of[op]] += cost(op)
    return StagePartition(stage_of, tuple(stage_costs),
                          tuple(tuple(crossings[p]) for p in cuts),
                          _batch_crossing(batch_derived, stage_of, num_stages))


def _batch_crossing(batch_derived: list, stage_of: dict, num_stages: int) -> tuple:
    """Per cut i, the batch-derived tensors made at or before stage i and read after it."""
    result = [[] for _ in range(num_stages - 1)]
    for op in batch_derived:
        for tensor in op.outputs:
            last = max((stage_of[c] for c in tensor.consumers() if c in stage_of),
                       default=stage_of[op])
            for cut in range(stage_of[op], last):
                result[cut].append(tensor)
    return tuple(tuple(tensors) for tensors in result)


def apply_stages(graph: tf.Graph, taskgraphs: list, partition: StagePartition) -> None:
    """Tag every forward op with its stage (the partition's TaskGraphs then replace the
    script's `taskgraphs` in the analysis).

    A single user TaskGraph that wrapped the whole model is replaced: its tag is
    removed from every op, so backward, apply and other ops resolve their stage
    through analysis.
    """
    replaced = taskgraphs[0].name if taskgraphs else None
    if replaced is not None:
        for op in graph.get_operations():
            attr = op.node_def.attr.get(TASKGRAPH_ATTR)
            if attr is not None and attr.s.decode() == replaced:
                graph_mutation.clear_attr(op, TASKGRAPH_ATTR)
    names = [tg.name for tg in partition.taskgraphs]
    for op, stage in partition.stage_of.items():
        graph_mutation.set_attr(op, TASKGRAPH_ATTR, tf.compat.v1.AttrValue(s=names[stage].encode()))


class AutoStagesPass(GraphPass):
    """Cuts an unannotated model into `pipeline.num_stages` balanced stages.

    Runs before the analysis (`before_analysis`): it only writes stage tags, and its
    result, the StagePartition it applied (with the stages' TaskGraphs), is what the
    driver analyses and plans with, as if the user had written the stage scopes. It
    provides nothing when the script keeps its own stages.
    """

    name = "auto_stages"
    requires = (GraphRecord, WorkerPlanner)
    provides = (StagePartition,)
    before_analysis = True
    off_note = "no automatic stages (auto.auto_parallel off, or pipeline.num_stages <= 1)"

    def validate(self, graph: tf.Graph, ctx: PassContext) -> StagePartition | None:
        """The partition (pure analysis; raises for a model with too few places to
        cut), or None when the script keeps its own TaskGraphs (`keeps_own_stages`)."""
        record = ctx.get(GraphRecord)
        if keeps_own_stages(record.taskgraphs):
            return None
        num_stages = self.options.num_stages
        # the local devices' speeds when cluster.device_profiles is set: stages sized
        # to their devices' speed
        speeds = ctx.get(WorkerPlanner).stage_speeds(num_stages)
        return plan_stages(graph, record, num_stages, speeds=speeds)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        partition = ctx.validated[self.name] if self.name in ctx.validated \
            else self.validate(graph, ctx)
        if partition is None:
            return PassResult(notes=["the script's own TaskGraphs are kept as its stages"],
                              modified=False)
        apply_stages(graph, ctx.get(GraphRecord).taskgraphs, partition)
        ctx.provide(partition)
        return PassResult(notes=partition.describe().splitlines())
