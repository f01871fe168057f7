"""Automatic pipeline stages: cut an unannotated model into balanced stages.

With `auto.auto_parallel: True` and `pipeline.num_stages: K > 1`, a script
without stage scopes (no strategy scope at all, or a single
`epl.replicate(device_count=1)` around the whole model) is cut into K stages
before analysis, as if the user had written K consecutive
`epl.replicate(device_count=1, name="stage_<i>")` scopes. Scripts with two or
more TaskGraphs keep their own stages (the user's annotation wins).

How the cut is chosen (`plan_stages`, pure analysis; `apply_stages` writes it):

1. The forward ops are the loss's ancestors outside the input pipeline. The
   ones computed from a batch input are the activation ops; in creation order
   they form the sequence to cut (creation order is a topological order).
   The others (variables, their reads, constants, anything computed only from
   them) are "anchored": each goes to the earliest stage that consumes it, so
   weights live with the layer that reads them and never cross a cut.
2. The cost of an op is the planner's cost model: the roofline time
   (`epl.planner.cost_model.predict_time`) of its FLOPs and bytes
   (`op_cost`, unknown dimensions counted as the global batch) on a fixed
   reference profile (V100-16GB). The stages run on identical devices, so only
   the ratio of FLOP/s to memory bandwidth matters, and a fixed profile makes
   the partition the same on every machine.
3. A cut after position p is allowed only where few activation tensors cross
   it (produced at or before p, consumed after p): at most 1, or the smallest
   number that still leaves K - 1 allowed cuts (up to MAX_CROSSING). In a
   transformer these are the layer boundaries, where only the hidden state
   crosses.
4. Among the allowed cuts, dynamic programming picks the K - 1 that minimise
   the most expensive stage (ties: fewer crossing tensors). With devices of
   different speed (`cluster.device_profiles`), stage i's cost is divided by
   the relative FLOP/s of the device it runs on (`stage_speeds`: the device
   the plan gives stage i, the slowest over the replicas), so a faster device
   gets a longer stage: stages are sized to their devices.

Every forward op then carries `_epl_taskgraph = stage_<i>`; backward ops
inherit their forward op's stage and apply ops their variable's (analysis,
through colocation), as for user-annotated stages.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.ir.annotations import TASKGRAPH_ATTR, StrategyKind, StrategySpec
from epl.ir.graph_view import ancestors, descendants, find_batch_inputs, training_steps
from epl.ir.taskgraph import GraphState
from epl.planner import cost_model
from epl.profiles import get_profile
from epl.ir import graph_mutation

STAGE_NAME = "stage_{}"
MAX_CROSSING = 4
REFERENCE_PROFILE = "V100-16GB"


@dataclasses.dataclass(frozen=True)
class StagePartition:
    """A cut of the forward graph into stages.

    stage_of: forward op -> stage index.
    costs: estimated forward time (seconds on the reference profile) per stage.
    crossing: per cut (between stage i and i + 1), the activation tensors
      that cross it.
    """

    stage_of: dict
    costs: tuple[float, ...]
    crossing: tuple[tuple[tf.Tensor, ...], ...]

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
            lines.append(line)
        return "\n".join(lines)


def wants_auto_stages(state: GraphState, config) -> bool:
    """True if the config asks for automatic stages and the script has no stage scopes."""
    if not config.get("auto.auto_parallel") or int(config.get("pipeline.num_stages")) <= 1:
        return False
    taskgraphs = state.taskgraphs
    return not taskgraphs or (len(taskgraphs) == 1
                              and taskgraphs[0].spec.kind == StrategyKind.REPLICATE
                              and taskgraphs[0].spec.device_count == 1)


def _forward_ops(graph: tf.Graph, state: GraphState):
    """(activation ops in creation order, anchored ops, batch size)."""
    losses = [step.loss.op for step in training_steps(state)]
    loss_ancestors = ancestors(losses)
    batch_inputs, batch = find_batch_inputs(loss_ancestors)
    if not batch_inputs:
        raise ParallelizeError(
            "automatic pipeline stages need a batch input feeding the loss (a placeholder, "
            "tf.data iterator output or batch-sized constant); none was found.")
    batch_region = ancestors([t.op for t in batch_inputs])
    forward = loss_ancestors - batch_region
    activations = descendants(batch_inputs, within=forward)
    ordered = sorted(activations, key=lambda op: op._id)
    anchored = sorted(forward - activations, key=lambda op: op._id)
    return ordered, anchored, batch


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


def _best_cuts(costs: list[float], allowed: list[int], crossing: list[int],
               num_stages: int, speeds: list[float] | None = None) -> list[int] | None:
    """K - 1 cut positions from `allowed` minimising (max stage time, total crossing).

    A cut at position p ends a stage after op p. best[j][e] is the best
    (max stage time, crossing, previous cut index) of j + 1 stages whose last
    one ends at allowed[e]; stage j's time is its cost / speeds[j].
    """
    speeds = speeds or [1.0] * num_stages
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    n = len(costs)

    def span(start: int, end: int) -> float:  # cost of ops start+1 .. end
        return prefix[end + 1] - prefix[start + 1]

    best: list[dict[int, tuple]] = [{e: (prefix[p + 1] / speeds[0], 0, None)
                                     for e, p in enumerate(allowed)}]
    for j in range(1, num_stages - 1):
        layer = {}
        for e, p in enumerate(allowed):
            options = [(max(value[0], span(allowed[d], p) / speeds[j]),
                        value[1] + crossing[allowed[d]], d)
                       for d, value in best[j - 1].items() if d < e]
            if options:
                layer[e] = min(options)
        best.append(layer)
    last = num_stages - 1
    final = [(max(value[0], span(allowed[d], n - 1) / speeds[last]),
              value[1] + crossing[allowed[d]], d)
             for d, value in best[num_stages - 2].items()]
    if not final:
        return None
    d = min(final)[2]
    cuts = []
    for j in range(num_stages - 2, -1, -1):
        cuts.append(allowed[d])
        d = best[j][d][2]
    return sorted(cuts)


def plan_stages(graph: tf.Graph, state: GraphState, num_stages: int,
                profile=None, speeds: list[float] | None = None) -> StagePartition:
    """Choose `num_stages` balanced stages for the forward graph (changes nothing).

    speeds: relative speed of the device of each stage (default: all equal).

    Raises:
        ParallelizeError: the model has fewer than `num_stages` places where at
          most MAX_CROSSING activation tensors cross.
    """
    profile = profile or get_profile(REFERENCE_PROFILE)
    ordered, anchored, batch = _forward_ops(graph, state)
    costs = [cost_model.predict_time(cost_model.op_cost(op, unknown_dim=batch), profile)
             for op in ordered]
    crossings = _crossings(ordered)
    counts = [len(c) for c in crossings]
    cuts = None
    for limit in range(1, MAX_CROSSING + 1):
        allowed = [p for p in range(len(ordered) - 1) if 0 < counts[p] <= limit]
        if len(allowed) >= num_stages - 1:
            cuts = _best_cuts(costs, allowed, counts, num_stages, speeds)
            if cuts is not None:
                break
    if cuts is None:
        raise ParallelizeError(
            f"pipeline.num_stages={num_stages}: the model has fewer than {num_stages - 1} "
            f"places where at most {MAX_CROSSING} activation tensors cross between consecutive "
            f"ops ({len(ordered)} forward ops computed from the batch). Lower "
            "pipeline.num_stages, or mark the stages with epl.replicate(device_count=1, "
            "name='stage_<i>') scopes.")
    bounds = [-1] + cuts + [len(ordered) - 1]
    stage_of = {}
    stage_costs = []
    for i in range(num_stages):
        members = ordered[bounds[i] + 1:bounds[i + 1] + 1]
        stage_of.update({op: i for op in members})
        stage_costs.append(sum(costs[bounds[i] + 1:bounds[i + 1] + 1]))
    for op in reversed(anchored):  # consumers come later in creation order
        consumers = [stage_of[c] for out in op.outputs for c in out.consumers() if c in stage_of]
        stage_of[op] = min(consumers, default=0)
    return StagePartition(stage_of, tuple(stage_costs),
                          tuple(tuple(crossings[p]) for p in cuts))


def apply_stages(graph: tf.Graph, state: GraphState, partition: StagePartition) -> None:
    """Register the stages as TaskGraphs and tag every forward op with its stage.

    A single user TaskGraph that wrapped the whole model is replaced: its tag is
    removed from every op, so backward, apply and other ops resolve their stage
    through analysis.
    """
    replaced = state.taskgraphs[0].name if state.taskgraphs else None
    if replaced is not None:
        for op in graph.get_operations():
            attr = op.node_def.attr.get(TASKGRAPH_ATTR)
            if attr is not None and attr.s.decode() == replaced:
                op._clear_attr(TASKGRAPH_ATTR)
        state.taskgraphs.clear()
    names = [STAGE_NAME.format(i) for i in range(partition.num_stages)]
    for name in names:
        state.add_taskgraph(StrategySpec(StrategyKind.REPLICATE, 1, name))
    for op, stage in partition.stage_of.items():
        graph_mutation.set_attr(op, TASKGRAPH_ATTR, tf.compat.v1.AttrValue(s=names[stage].encode()))


def stage_speeds(num_stages: int, profiles: list | None) -> list[float] | None:
    """Relative FLOP/s of the device each stage runs on (the slowest over replicas).

    The plan gives replica r the devices r*K .. r*K+K-1 and, within them,
    stage i the i-th by memory (epl.planner.plan.stage_device_order). None when
    the profiles are absent or all stages get the same speed.
    """
    from epl.planner.plan import stage_device_order
    if not profiles or len(profiles) < num_stages:
        return None
    replicas = len(profiles) // num_stages
    speeds = [min(profiles[r * num_stages + stage_device_order(
        [p.memory_bytes for p in profiles[r * num_stages:(r + 1) * num_stages]])[i]].flops("float32")
        for r in range(replicas)) for i in range(num_stages)]
    if all(abs(s - speeds[0]) <= 1e-12 * speeds[0] for s in speeds):
        return None
    top = max(speeds)
    return [s / top for s in speeds]


def auto_stages(graph: tf.Graph, state: GraphState, config,
                profiles: list | None = None) -> StagePartition | None:
    """Cut the model into `pipeline.num_stages` stages when the config asks for it.

    profiles: the local devices' profiles when `cluster.device_profiles` is set
    (stages are then sized to their devices' speed). Returns the partition
    applied, or None when the script keeps its own TaskGraphs (see
    `wants_auto_stages`).
    """
    if not wants_auto_stages(state, config):
        return None
    num_stages = int(config.get("pipeline.num_stages"))
    partition = plan_stages(graph, state, num_stages,
                            speeds=stage_speeds(num_stages, profiles))
    apply_stages(graph, state, partition)
    return partition
