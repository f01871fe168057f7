"""Pipeline stage cuts over numbers: contiguous stages, the slowest one least.

Pure functions (no TensorFlow, no profiles), like `epl.planner.balance`,
whose input checks they share:

- `min_max_partition`: the one stage-partition dynamic programme of EPL,
  contiguous non-empty stages over a list of costs minimising the slowest
  stage (pipeline cuts over layers here, over a graph's ops in
  epl/passes/pipeline/auto_stages.py).
- `balance_stages`: contiguous pipeline cuts over a list of layer costs that
  minimise the slowest stage's predicted time within each stage's memory;
  earlier stages go to the devices with more memory (in 1F1B scheduling the
  first stage keeps the most micro-batches' activations alive), in the
  order `stage_device_order` gives (the plan search and the runtime
  layout use that one order).
- `min_penalty_cuts`: automatic stages' tie-break, the cuts of least
  penalty among the partitions within a ceiling.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from epl.errors import ClusterError
from epl.planner.balance import (check_capabilities, device_labels, gb,
                                 per_device)


@dataclasses.dataclass(frozen=True)
class StageCuts:
    """Contiguous pipeline stages over a list of layers.

    Attributes:
        bounds: (first layer, end layer) per stage, end exclusive.
        devices: the device (index into the inputs) of each stage.
        times: predicted time per stage (its layers' cost / capability).
        memory: bytes each stage needs on its device.
        capacity: bytes each stage's device may use.
    """

    bounds: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]
    times: tuple[float, ...]
    memory: tuple[float, ...]
    capacity: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """The slowest stage's predicted time."""
        return max(self.times)


def stage_device_order(memory: Sequence[float],
                       capabilities: Sequence[float] | None = None
                       ) -> list[int]:
    """Positions of one pipeline's devices in the order its stages take them.

    Earlier stages keep more micro-batches' activations alive (1F1B holds
    up to K - i on stage i), so they go to the devices with more memory:
    more memory first, then faster (`capabilities`, any rate; omitted: no
    preference), then the lower index.  The one order the plan search
    (`balance_stages`) and the runtime layout (`epl.planner.plan`) use.
    """
    speed = list(capabilities) if capabilities is not None else \
        [0.0] * len(memory)
    if len(speed) != len(memory):
        raise ClusterError(f"stage_device_order: {len(memory)} memory "
                           f"figures but {len(speed)} capabilities")
    return sorted(range(len(memory)),
                  key=lambda i: (-memory[i], -speed[i], i))


def balance_stages(layer_costs: Sequence[float],
                   stage_capabilities: Sequence[float],
                   stage_memory: Sequence[float] | None = None,
                   layer_memory: Sequence[float] | None = None,
                   layer_activation_memory: Sequence[float] | None = None,
                   activation_multiplier: Sequence[float] | None = None,
                   names: Sequence[str] | None = None,
                   order_by_memory: bool = True) -> StageCuts:
    """Contiguous pipeline cuts minimising the slowest stage's time.

    Args:
        layer_costs: per layer, in model order, its cost (e.g. FLOPs per
            micro-batch, forward plus backward).
        stage_capabilities: per device, the rate at which it works off that
            cost (e.g. effective FLOP/s); one device per stage.
        stage_memory: usable bytes per device (None: unlimited).
        layer_memory: per layer, bytes a stage holds for it whatever the
            schedule (parameters, gradients, optimizer state).
        layer_activation_memory: per layer, activation bytes of one
            micro-batch.
        activation_multiplier: per stage position (0 = first stage), how
            many micro-batches' activations it keeps alive; default 1.
        names: device kind per device, used in messages.
        order_by_memory: give earlier stages the devices with more memory
            (`stage_device_order`); otherwise keep the devices' order.

    Returns:
        StageCuts: every stage non-empty, the cuts found by dynamic
        programming (exact minimum of the maximum stage time among cuts that
        fit; ties to the earliest cut).

    Raises:
        ClusterError: fewer layers than stages, or no cut fits; the message
            names each stage that runs out of memory in the fastest cut
            ("stage 3 needs 18.2 GB on device 5 (T4) with 15.2 GB
            available") and what would help.
    """
    costs = [float(c) for c in layer_costs]
    caps = check_capabilities(stage_capabilities)
    n_layers, n_stages = len(costs), len(caps)
    if n_layers < n_stages:
        raise ClusterError(f"{n_layers} layer(s) cannot fill {n_stages} "
                           f"pipeline stages; use at most {n_layers} stages")
    mem_cap = per_device(stage_memory, n_stages, "stage memory", math.inf)
    fixed = per_device(layer_memory, n_layers, "layer memory", 0.0)
    acts = per_device(layer_activation_memory, n_layers,
                       "layer activation memory", 0.0)
    mult = per_device(activation_multiplier, n_stages,
                       "activation multiplier", 1.0)
    kinds = device_labels(names, n_stages)
    order = (stage_device_order(mem_cap, caps) if order_by_memory
             else list(range(n_stages)))
    prefix = _Prefix(costs, fixed, acts)
    problem = (prefix, [caps[d] for d in order], [mem_cap[d] for d in order],
               mult)
    bounds = _best_cuts(*problem, respect_memory=True)
    if bounds is None:
        fastest = _best_cuts(*problem, respect_memory=False)
        raise ClusterError(_stages_do_not_fit(fastest, order, prefix, mem_cap,
                                              mult, kinds))
    return StageCuts(
        bounds=tuple(bounds), devices=tuple(order),
        times=tuple(prefix.cost(a, b) / caps[d]
                    for (a, b), d in zip(bounds, order)),
        memory=tuple(prefix.memory(a, b, mult[s])
                     for s, (a, b) in enumerate(bounds)),
        capacity=tuple(mem_cap[d] for d in order))


class _Prefix:
    """Prefix sums of layer cost, fixed memory and activation memory."""

    def __init__(self, costs: list[float], fixed: list[float],
                 acts: list[float]) -> None:
        self.n = len(costs)
        self.costs = costs
        self._cost = _cumsum(costs)
        self._fixed = _cumsum(fixed)
        self._acts = _cumsum(acts)

    def cost(self, a: int, b: int) -> float:
        """Cost of layers a..b-1."""
        return self._cost[b] - self._cost[a]

    def memory(self, a: int, b: int, multiplier: float) -> float:
        """Bytes of layers a..b-1 with `multiplier` micro-batches alive."""
        return (self._fixed[b] - self._fixed[a]
                + multiplier * (self._acts[b] - self._acts[a]))


def _cumsum(values: list[float]) -> list[float]:
    """[0, v0, v0+v1, ...]."""
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _best_cuts(prefix: _Prefix, caps: list[float], mem_cap: list[float],
               mult: list[float], respect_memory: bool
               ) -> list[tuple[int, int]] | None:
    """Exact min-max contiguous cut of the layers (None when nothing fits)."""
    def fits(stage: int, start: int, end: int) -> bool:
        return prefix.memory(start, end, mult[stage]) <= \
            mem_cap[stage] * (1 + 1e-12)

    return min_max_partition(prefix.costs, len(caps), speeds=caps,
                             fits=fits if respect_memory else None)


def min_max_partition(costs: Sequence[float], num_stages: int, *,
                      speeds: Sequence[float] | None = None,
                      allowed_cuts: Sequence[int] | None = None,
                      cut_weights: Sequence[float] | None = None,
                      fits: Callable[[int, int, int], bool] | None = None
                      ) -> list[tuple[int, int]] | None:
    """Contiguous non-empty stages over `costs` minimising the slowest stage.

    The one stage-partition dynamic programme of EPL: pipeline cuts over
    layers (`balance_stages`) and over a graph's ops
    (epl/passes/pipeline/auto_stages.py).

    Args:
        costs: per position (layer, op), in order, its cost.
        num_stages: stages to cut the positions into (>= 1).
        speeds: per stage, the divisor of its cost (its device's speed);
            stage s takes sum(costs[a:b]) / speeds[s].  Default 1.
        allowed_cuts: boundaries a stage may start at; boundary b separates
            position b - 1 from position b (so 1 <= b <= len(costs) - 1).
            Default: every boundary.
        cut_weights: one weight per allowed cut (e.g. the tensors that cross
            it), in the order of `allowed_cuts`; default 0.
        fits: fits(stage, start, end): whether positions start..end-1 may
            form stage `stage` (memory); default always.

    Returns:
        (start, end) per stage, end exclusive, or None when no partition
        exists (fewer allowed cuts than num_stages - 1, or none fits).
        Exact: the least possible slowest-stage time; among the partitions
        that reach it, the least total weight of the cuts used; remaining
        ties go to the partition whose last stage starts earliest, then the
        one before it, and so on.
    """
    n = len(costs)
    if num_stages < 1:
        raise ClusterError(f"num_stages must be >= 1, got {num_stages!r}")
    speed = per_device(speeds, num_stages, "stage speeds", 1.0)
    if any(not v > 0 for v in speed):
        raise ClusterError(f"stage speeds must be positive, got {speed}")
    cuts = list(range(1, n)) if allowed_cuts is None else list(allowed_cuts)
    weights = [0.0] * len(cuts) if cut_weights is None else \
        [float(w) for w in cut_weights]
    if len(weights) != len(cuts):
        raise ClusterError(f"{len(weights)} cut weights for {len(cuts)} "
                           f"allowed cuts")
    if any(not 0 < c < n for c in cuts) or cuts != sorted(set(cuts)):
        raise ClusterError(f"allowed cuts must be increasing boundaries in "
                           f"1..{n - 1}, got {cuts}")
    if n < num_stages or len(cuts) < num_stages - 1:
        return None
    bounds = [0] + cuts + [n]
    weight = [0.0] + weights + [0.0]
    prefix = _cumsum([float(c) for c in costs])

    def time(stage: int, i: int, j: int) -> float:
        return (prefix[bounds[j]] - prefix[bounds[i]]) / speed[stage]

    def allowed(stage: int, i: int, j: int) -> bool:
        return fits is None or fits(stage, bounds[i], bounds[j])

    slowest = _partition_pass(num_stages, len(bounds), time, allowed,
                              lambda i: 0.0, math.inf)
    if slowest is None:
        return None
    if any(weights):
        slowest = _partition_pass(num_stages, len(bounds), time, allowed,
                                  lambda i: weight[i], slowest[0])
    chosen = slowest[1]
    return [(bounds[i], bounds[j]) for i, j in zip(chosen, chosen[1:])]


def _partition_pass(stages: int, m: int, time: Callable[[int, int, int], float],
                    allowed: Callable[[int, int, int], bool],
                    weight: Callable[[int], float], limit: float
                    ) -> tuple[float, list[int]] | None:
    """One dynamic programme of `min_max_partition` over boundary indices
    0..m-1: stage s spans boundaries i < j.  Key per state: (total weight of
    the cuts used, slowest stage so far); stages slower than `limit` are
    excluded.  Returns (slowest stage, boundary indices) or None."""
    inf = (math.inf, math.inf)
    best = [[inf] * m for _ in range(stages)]
    back = [[-1] * m for _ in range(stages)]
    for s in range(stages):
        ends = [m - 1] if s == stages - 1 else range(s + 1, m - (stages - s - 1))
        for j in ends:
            for i in ([0] if s == 0 else range(s, j)):
                before = (0.0, 0.0) if s == 0 else best[s - 1][i]
                if before == inf:
                    continue
                t = time(s, i, j)
                if t > limit or not allowed(s, i, j):
                    continue
                key = (before[0] + (weight(i) if s else 0.0), max(before[1], t))
                if key < best[s][j]:
                    best[s][j], back[s][j] = key, i
    if best[stages - 1][m - 1] == inf:
        return None
    chosen, j = [m - 1], m - 1
    for s in range(stages - 1, -1, -1):
        j = back[s][j]
        chosen.append(j)
    return best[stages - 1][m - 1][1], chosen[::-1]


def _stages_do_not_fit(bounds: list[tuple[int, int]], order: list[int],
                       prefix: _Prefix, mem_cap: list[float],
                       mult: list[float], kinds: list[str]) -> str:
    """The message for balance_stages when no cut fits."""
    lines = ["no pipeline cut fits in device memory. In the fastest cut:"]
    for s, ((a, b), d) in enumerate(zip(bounds, order)):
        need = prefix.memory(a, b, mult[s])
        kind = f" ({kinds[d]})" if kinds[d] else ""
        layers = f"layer {a}" if b == a + 1 else f"layers {a}-{b - 1}"
        state = (f"short by {gb(need - mem_cap[d])}" if need > mem_cap[d]
                 else "fits")
        lines.append(f"  stage {s} ({layers}) needs {gb(need)} on device "
                     f"{d}{kind} with {gb(mem_cap[d])} available: {state}")
    lines.append("What would help: gradient checkpointing or fewer "
                 "micro-batches in flight (activations); ZeRO or offload "
                 "(parameters and optimizer state); more pipeline stages or "
                 "devices with more memory.")
    return "\n".join(lines)


def min_penalty_cuts(costs: list[float], allowed: list[int], penalty: list[tuple],
                    num_stages: int, speeds: list[float] | None,
                    ceiling: float) -> list[int] | None:
    """K - 1 cut positions from `allowed` minimising the sum of penalty[p] over the
    cuts, every stage's time (cost / speed) at most `ceiling`; None if none fits.

    The tie-break of automatic stages (epl/passes/pipeline/auto_stages.py): among the
    partitions within a tolerance of `min_max_partition`'s slowest stage, the one
    whose cuts cost least (penalties are tuples, compared in order). A cut at
    position p ends a stage after position p; stage j's time is its cost / speeds[j].
    """
    speeds = speeds or [1.0] * num_stages
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    n = len(costs)

    def fits(start: int, end: int, stage: int) -> bool:  # ops start+1 .. end in `stage`
        return (prefix[end + 1] - prefix[start + 1]) / speeds[stage] <= ceiling

    def add(a: tuple, b: tuple) -> tuple:
        return tuple(x + y for x, y in zip(a, b))

    best: list[dict[int, tuple]] = [{e: (penalty[p], None) for e, p in enumerate(allowed)
                                     if fits(-1, p, 0)}]
    for j in range(1, num_stages - 1):
        layer = {}
        for e, p in enumerate(allowed):
            options = [(add(value[0], penalty[p]), d) for d, value in best[j - 1].items()
                       if d < e and fits(allowed[d], p, j)]
            if options:
                layer[e] = min(options)
        best.append(layer)
    final = [(value[0], d) for d, value in best[num_stages - 2].items()
             if fits(allowed[d], n - 1, num_stages - 1)]
    if not final:
        return None
    d = min(final)[1]
    cuts = []
    for j in range(num_stages - 2, -1, -1):
        cuts.append(allowed[d])
        d = best[j][d][1]
    return sorted(cuts)
