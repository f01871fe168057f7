"""Load balancing over numbers: batch shares, split shards, pipeline cuts.

Pure functions (no TensorFlow, no profiles): the planner turns device
profiles and the cost model into capabilities and byte counts, and these
functions share out the work.

- `balance_batch`: integer per-replica batch sizes summing to the global
  batch, proportional to capability (largest-remainder rounding), then
  moved off devices that would run out of memory onto the least-loaded
  devices with headroom (Whale's hardware-aware balancing).
- `balance_shards`: the same for the shards of a split dimension (experts,
  hidden units), with at least one unit per device.
- `balance_stages`: contiguous pipeline cuts over a list of layer costs that
  minimise the slowest stage's predicted time within each stage's memory;
  earlier stages go to the devices with more memory (in 1F1B scheduling the
  first stage keeps the most micro-batches' activations alive).

Conventions and decisions
-------------------------
- A capability is a rate: work units per second (examples/s, FLOP/s); a
  device's predicted time is its load divided by its capability, plus the
  time it is busy whatever its load (`fixed_time`, optional).
- Memory of a device = fixed bytes + bytes per unit x units; a device fits
  when that is at most its capacity (the planner passes usable bytes, i.e.
  the nominal size less a runtime reserve).
- Rounding: exact proportional quotas (computed with fractions, so the
  result does not depend on float noise), floors first, then the remaining
  units to the largest fractional remainders; ties go to the larger
  capability, then to the lower device index.
- Moving load: devices over capacity are visited in index order; each unit
  they cannot hold goes to the device with headroom whose predicted time
  after receiving it is smallest (the least-loaded one); ties go to the
  lower index.  The result is deterministic.
- Byte figures in messages are binary gigabytes (GiB) written "GB", as on
  NVIDIA's datasheets (a "16 GB" T4 has 16 GiB).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

from epl.errors import ClusterError

GiB = float(1 << 30)
#: Slack when comparing bytes (float rounding in sums of byte counts).
_BYTES_EPS = 1e-6


def gb(nbytes: float) -> str:
    """`nbytes` as "12.3 GB" (binary gigabytes, as NVIDIA labels memory)."""
    return f"{nbytes / GiB:.1f} GB"


def index_ranges(indices: Sequence[int]) -> str:
    """Sorted indices written compactly: [0, 1, 2, 5] -> "0-2,5"."""
    parts, run = [], []
    for index in sorted(indices):
        if run and index == run[-1] + 1:
            run.append(index)
            continue
        if run:
            parts.append(_run_text(run))
        run = [index]
    if run:
        parts.append(_run_text(run))
    return ",".join(parts)


def _run_text(run: list[int]) -> str:
    """"3" or "3-7" for a run of consecutive indices."""
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def grouped_lines(items: Sequence[tuple[int, str, str]]) -> list[str]:
    """Collapse (index, kind, text) items with the same kind and text.

    Returns lines "device 0-3 (kind): text" in order of first appearance, so
    that 512 identical devices take one line.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for index, kind, text in items:
        groups.setdefault((kind, text), []).append(index)
    lines = []
    for (kind, text), indices in groups.items():
        noun = "device" if len(indices) == 1 else "devices"
        label = f" ({kind})" if kind else ""
        lines.append(f"{noun} {index_ranges(indices)}{label}: {text}")
    return lines


# --------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Move:
    """`count` units moved from device `source` to device `target`."""

    source: int
    target: int
    count: int


@dataclasses.dataclass(frozen=True)
class Shares:
    """Integer shares of some total among devices.

    Attributes:
        sizes: units per device (sum = the total).
        times: predicted time per device: fixed time (if any) +
            sizes[i] / capabilities[i].
        memory: bytes per device, fixed + per-unit bytes x sizes[i].
        capacity: bytes each device may use (inf when unlimited).
        moves: what was moved off devices over capacity, in order.
    """

    sizes: tuple[int, ...]
    times: tuple[float, ...]
    memory: tuple[float, ...]
    capacity: tuple[float, ...]
    moves: tuple[Move, ...] = ()

    @property
    def total(self) -> int:
        """Sum of the shares."""
        return sum(self.sizes)

    @property
    def weights(self) -> tuple[float, ...]:
        """Shares as fractions of the total (what epl.planner.plan.Plan takes)."""
        total = self.total
        return tuple(size / total for size in self.sizes) if total else ()

    @property
    def makespan(self) -> float:
        """The largest predicted time: when the slowest device finishes."""
        return max(self.times, default=0.0)


#: Per-replica batch sizes.
BatchShares = Shares
#: Shard sizes of a split dimension.
ShardSizes = Shares


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


# --------------------------------------------------------------------------
# Input checks.
# --------------------------------------------------------------------------

def _per_device(value: float | Sequence[float] | None, n: int, what: str,
                default: float) -> list[float]:
    """`value` as one float per device (a scalar applies to all)."""
    if value is None:
        return [default] * n
    if isinstance(value, (int, float)):
        values = [float(value)] * n
    else:
        values = [float(v) for v in value]
    if len(values) != n:
        raise ClusterError(f"{what} holds {len(values)} values for {n} "
                           f"devices; give one per device or a single number")
    if any(math.isnan(v) or v < 0 for v in values):
        raise ClusterError(f"{what} must be non-negative, got {values}")
    return values


def _capabilities(capabilities: Sequence[float]) -> list[float]:
    """Validated positive, finite capabilities."""
    caps = [float(c) for c in capabilities]
    if not caps:
        raise ClusterError("cannot balance over zero devices")
    if any(not (c > 0 and math.isfinite(c)) for c in caps):
        raise ClusterError(f"capabilities must be positive and finite, got "
                           f"{caps}")
    return caps


def _labels(names: Sequence[str] | None, n: int) -> list[str]:
    """Device kind labels ("" when not given)."""
    if names is None:
        return [""] * n
    if len(names) != n:
        raise ClusterError(f"names holds {len(names)} labels for {n} devices")
    return [str(name) for name in names]


# --------------------------------------------------------------------------
# Proportional shares.
# --------------------------------------------------------------------------

def _integers(values: Sequence[float]) -> tuple[list[int], int]:
    """Exact integers N_i and a denominator D with values[i] == N_i / D.

    Floats are dyadic rationals, so D is the largest power-of-two
    denominator among them; integer arithmetic on the N_i is exact and much
    faster than fractions.
    """
    ratios = [float(v).as_integer_ratio() for v in values]
    denominator = max(den for _, den in ratios)
    return [num * (denominator // den) for num, den in ratios], denominator


def _round_quotas(total: int, numerators: list[int], denominator: int,
                  caps: list[int]) -> list[int]:
    """Largest-remainder rounding of quotas numerators[i] / denominator
    (summing to `total`); ties to the larger capability, then lower index."""
    sizes = [num // denominator for num in numerators]
    remainders = [num - size * denominator
                  for num, size in zip(numerators, sizes)]
    order = sorted(range(len(sizes)),
                   key=lambda i: (-remainders[i], -caps[i], i))
    for i in order[:total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _quotas_after_fixed_time(total: int, caps: list[int], caps_den: int,
                             busy: list[int], busy_den: int
                             ) -> tuple[list[int], int]:
    """Quotas q_i = (T - f_i) * c_i >= 0 summing to `total`, every device
    busy until the same time T (water filling), as (numerators,
    denominator).  c_i = caps[i] / caps_den, f_i = busy[i] / busy_den."""
    active = set(range(len(caps)))
    while True:
        weight = sum(caps[i] for i in active)
        # T = top / (busy_den * weight)
        top = total * busy_den * caps_den + sum(busy[i] * caps[i]
                                                for i in active)
        late = {i for i in active if busy[i] * weight >= top}
        if not late:
            break
        active -= late
    numerators = [(top - busy[i] * weight) * caps[i] if i in active else 0
                  for i in range(len(caps))]
    return numerators, busy_den * weight * caps_den


def proportional_shares(total: int, capabilities: Sequence[float],
                        minimum: int = 0,
                        fixed_time: Sequence[float] | None = None
                        ) -> list[int]:
    """Integers summing to `total`, proportional to `capabilities`.

    Exact quotas total * c_i / sum(c); a device whose quota is below
    `minimum` gets `minimum` and the others share the rest in proportion
    (repeated until no quota is below the minimum); then floors, and the
    remaining units to the largest remainders (exact integer arithmetic;
    ties to the larger capability, then the lower index).  With
    `fixed_time` (seconds each device is busy whatever its share; minimum 0
    only), the quotas instead make every device finish at the same time T:
    q_i = (T - fixed_i) * c_i, or 0 for a device busy past T already.
    """
    caps_f = _capabilities(capabilities)
    n = len(caps_f)
    _check_total(total, minimum, n)
    caps, caps_den = _integers(caps_f)
    if fixed_time is not None and any(fixed_time):
        if minimum:
            raise ClusterError("fixed_time needs minimum=0")
        busy, busy_den = _integers(
            _per_device(fixed_time, n, "fixed time", 0.0))
        numerators, den = _quotas_after_fixed_time(total, caps, caps_den,
                                                   busy, busy_den)
        return _round_quotas(total, numerators, den, caps)
    pinned: set[int] = set()
    while True:
        rest = total - minimum * len(pinned)
        weight = sum(c for i, c in enumerate(caps) if i not in pinned)
        low = {i for i, c in enumerate(caps)
               if i not in pinned and rest * c < minimum * weight}
        if not low:
            break
        pinned |= low
    numerators = [minimum * weight if i in pinned else rest * c
                  for i, c in enumerate(caps)]
    return _round_quotas(total, numerators, weight, caps)


def _unit_limits(fixed: list[float], per_unit: list[float],
                 capacity: list[float]) -> list[float]:
    """Most units each device holds within capacity (inf when unbounded)."""
    limits = []
    for f, u, c in zip(fixed, per_unit, capacity):
        room = c - f
        if room < -_BYTES_EPS * max(c, 1.0):
            limits.append(-1.0)
        elif u <= 0 or math.isinf(c):
            limits.append(math.inf)
        else:
            limits.append(float(math.floor(max(room, 0.0) / u * (1 + 1e-12))))
    return limits


def _shift_overflow(sizes: list[int], caps: list[float],
                    limits: list[float], busy: list[float]) -> list[Move]:
    """Move units off devices above their limit to the least-loaded ones."""
    moves: dict[tuple[int, int], int] = {}
    order: list[tuple[int, int]] = []
    heap = [(busy[j] + (sizes[j] + 1) / caps[j], j)
            for j in range(len(sizes)) if sizes[j] < limits[j]]
    heapq.heapify(heap)
    for i in range(len(sizes)):
        while sizes[i] > limits[i]:
            _, j = heapq.heappop(heap)
            sizes[i] -= 1
            sizes[j] += 1
            if (i, j) not in moves:
                order.append((i, j))
            moves[i, j] = moves.get((i, j), 0) + 1
            if sizes[j] < limits[j]:
                heapq.heappush(heap, (busy[j] + (sizes[j] + 1) / caps[j], j))
    return [Move(i, j, moves[i, j]) for i, j in order]


def _apportion(total: int, capabilities: Sequence[float],
               per_unit: float | Sequence[float], fixed: float |
               Sequence[float], capacity: float | Sequence[float] | None,
               names: Sequence[str] | None, minimum: int, unit: str,
               what: str, fixed_time: float | Sequence[float] | None = None
               ) -> Shares:
    """Shared core of balance_batch and balance_shards."""
    caps = _capabilities(capabilities)
    n = len(caps)
    busy = _per_device(fixed_time, n, "fixed time", 0.0)
    per = _per_device(per_unit, n, f"memory per {unit}", 0.0)
    fix = _per_device(fixed, n, "fixed memory", 0.0)
    cap = _per_device(capacity, n, "capacity", math.inf)
    kinds = _labels(names, n)
    limits = _unit_limits(fix, per, cap)
    wanted = proportional_shares(total, caps, minimum, busy)
    if any(lim < minimum for lim in limits) or sum(
            min(lim, total) for lim in limits) < total:
        raise ClusterError(_nothing_fits(total, wanted, caps, per, fix, cap,
                                         limits, kinds, minimum, unit, what))
    sizes = list(wanted)
    moves = _shift_overflow(sizes, caps, limits, busy)
    return Shares(
        sizes=tuple(sizes),
        times=tuple(b + s / c for b, s, c in zip(busy, sizes, caps)),
        memory=tuple(f + u * s for f, u, s in zip(fix, per, sizes)),
        capacity=tuple(cap), moves=tuple(moves))


def balance_batch(global_batch: int, capabilities: Sequence[float],
                  memory_per_example: float | Sequence[float] = 0.0,
                  fixed_memory: float | Sequence[float] = 0.0,
                  capacity: float | Sequence[float] | None = None,
                  names: Sequence[str] | None = None,
                  fixed_time: float | Sequence[float] | None = None,
                  minimum: int = 0) -> BatchShares:
    """Per-replica batch sizes proportional to capability, within memory.

    minimum: examples every replica gets at least (1 when the replicas
    already exist, as in a parallel graph: a replica cannot take no examples).

    Args:
        global_batch: examples per step (a non-negative int).
        capabilities: per replica, examples per second (or any rate
            proportional to it, e.g. effective FLOP/s).
        memory_per_example: activation bytes one example adds, per replica
            or one number for all.
        fixed_memory: bytes a replica holds whatever its batch (parameters,
            gradients, optimizer state), per replica or one number.
        capacity: usable bytes per replica (None: unlimited).
        names: device kind per replica ("V100-32GB"), used in messages.
        fixed_time: seconds each replica is busy whatever its batch (e.g.
            its experts' share of a split layer); shares then make all
            replicas finish together (see `proportional_shares`), and
            "least loaded" counts it.

    Returns:
        BatchShares: sizes summing to `global_batch`, proportional to
        capability by largest-remainder rounding; where a replica's share
        would not fit, the examples it cannot hold went one by one to the
        replica with headroom that finishes soonest once it has them.

    Raises:
        ClusterError: the batch fits nowhere; the message gives each
            device's shortfall in GB at its proportional share and what
            would help (gradient checkpointing, ZeRO or offload, more
            devices, a smaller global batch).
    """
    return _apportion(global_batch, capabilities, memory_per_example,
                      fixed_memory, capacity, names, minimum, "example",
                      f"the global batch of {global_batch} examples",
                      fixed_time)


def balance_shards(dim: int, capabilities: Sequence[float],
                   memory_per_unit: float | Sequence[float] = 0.0,
                   fixed_memory: float | Sequence[float] = 0.0,
                   capacity: float | Sequence[float] | None = None,
                   names: Sequence[str] | None = None,
                   minimum: int = 1) -> ShardSizes:
    """Shard sizes of a split dimension proportional to capability.

    Args:
        dim: size of the split dimension (experts, hidden units, classes).
        capabilities: per device, a rate proportional to its speed.
        memory_per_unit: bytes one unit of the dimension needs on a device
            (its slice of parameters, gradients, optimizer state and
            activations), per device or one number.
        fixed_memory: bytes a device holds whatever its shard.
        capacity: usable bytes per device (None: unlimited).
        names: device kind per device, used in messages.
        minimum: units every device gets (default 1: each shard non-empty).

    Returns:
        ShardSizes summing to `dim` (same rules as `balance_batch`).

    Raises:
        ClusterError: `dim` < minimum x devices, or the shards fit nowhere
            (per-device shortfall and what would help).
    """
    if isinstance(dim, int) and dim < minimum * len(capabilities):
        raise ClusterError(
            f"a dimension of size {dim} cannot be split into "
            f"{len(capabilities)} shards of at least {minimum}; use fewer "
            f"devices for the split or a larger dimension")
    return _apportion(dim, capabilities, memory_per_unit, fixed_memory,
                      capacity, names, minimum, "unit",
                      f"a split dimension of {dim} units")


def _nothing_fits(total: int, wanted: list[int], caps: list[float],
                  per: list[float], fix: list[float], cap: list[float],
                  limits: list[float], kinds: list[str], minimum: int,
                  unit: str, what: str) -> str:
    """The message for `_apportion` when no assignment fits."""
    items = []
    for i, (w, u, f, c) in enumerate(zip(wanted, per, fix, cap)):
        need = f + u * w
        if f > c + _BYTES_EPS * max(c, 1.0):
            text = (f"{gb(f)} before any {unit} (parameters, gradients, "
                    f"optimizer state) with {gb(c)} available: short by "
                    f"{gb(f - c)}")
        elif need > c:
            text = (f"{w} {unit}s need {gb(need)} ({gb(f)} fixed + "
                    f"{gb(u * w)} for the {unit}s) with {gb(c)} available: "
                    f"short by {gb(need - c)}")
        else:
            text = (f"{w} {unit}s need {gb(need)} with {gb(c)} available: "
                    f"fits ({gb(c - need)} headroom)")
        items.append((i, kinds[i], text))
    held = int(sum(max(min(lim, total), 0) for lim in limits if lim >= 0))
    lines = [f"{what} does not fit in device memory: the devices hold at "
             f"most {held} of the {total} {unit}s. At each device's "
             f"capability share:"]
    lines += ["  " + line for line in grouped_lines(items)]
    lines.append("What would help: " + "; ".join(
        _remedies(total, held, wanted, per, fix, cap, limits, unit)) + ".")
    return "\n".join(lines)


def _remedies(total: int, held: int, wanted: list[int], per: list[float],
              fix: list[float], cap: list[float], limits: list[float],
              unit: str) -> list[str]:
    """Suggestions, each with the numbers that make it relevant."""
    out = []
    over_fixed = [i for i, (f, c) in enumerate(zip(fix, cap)) if f > c]
    activations = max((u * w for u, w in zip(per, wanted)), default=0.0)
    if activations > 0:
        out.append(f"gradient checkpointing (activations take up to "
                   f"{gb(activations)} per device and shrink to about the "
                   f"square root of the number of layers' worth)")
    if any(f > 0 for f in fix):
        out.append(f"ZeRO or offloading parameters and optimizer state to "
                   f"host memory (fixed memory is up to {gb(max(fix))} per "
                   f"device)")
    if over_fixed:
        out.append("pipeline or split parallelism so that no device holds "
                   "the whole model")
    roomy = [lim for lim in limits if lim > 0 and math.isfinite(lim)]
    if not over_fixed and roomy and total > held:
        each = max(roomy)
        more = math.ceil((total - held) / each)
        out.append(f"more devices (about {more} more like the roomiest one, "
                   f"which holds {int(each)} {unit}s)")
    if unit == "example" and not over_fixed:
        out.append(f"a smaller global batch (at most {held} {unit}s fit)")
    return out or ["more device memory"]


# --------------------------------------------------------------------------
# Pipeline stages.
# --------------------------------------------------------------------------

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
    caps = _capabilities(stage_capabilities)
    n_layers, n_stages = len(costs), len(caps)
    if n_layers < n_stages:
        raise ClusterError(f"{n_layers} layer(s) cannot fill {n_stages} "
                           f"pipeline stages; use at most {n_layers} stages")
    mem_cap = _per_device(stage_memory, n_stages, "stage memory", math.inf)
    fixed = _per_device(layer_memory, n_layers, "layer memory", 0.0)
    acts = _per_device(layer_activation_memory, n_layers,
                       "layer activation memory", 0.0)
    mult = _per_device(activation_multiplier, n_stages,
                       "activation multiplier", 1.0)
    kinds = _labels(names, n_stages)
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
    speed = _per_device(speeds, num_stages, "stage speeds", 1.0)
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


# --------------------------------------------------------------------------
# Groups of identical devices.
# --------------------------------------------------------------------------

def grouped_proportional_shares(total: int, capabilities: Sequence[float],
                                members: Sequence[Sequence[tuple[int, int]]],
                                minimum: int = 0,
                                fixed_time: Sequence[float] | None = None
                                ) -> list[list[tuple[int, tuple]]]:
    """`proportional_shares` over groups of identical devices, exactly.

    Group g holds the devices in `members[g]` (sorted (first, end) runs of
    device indices, end exclusive), each of capability `capabilities[g]`
    (and busy `fixed_time[g]`).  The result is what `proportional_shares`
    gives over the devices one by one: the same exact quotas (every device
    of a group has the same one), floors, and the remaining units to the
    largest remainders, ties to the larger capability, then the lower
    device index.  So a group splits into at most two parts.

    Returns:
        Per group, [(units per device, runs of the devices that get them)],
        larger share first; parts with no devices are left out.
    """
    caps_f = _capabilities(capabilities)
    counts = [sum(b - a for a, b in runs) for runs in members]
    n = sum(counts)
    _check_total(total, minimum, n)
    caps, caps_den = _integers(caps_f)
    groups = range(len(caps))
    if fixed_time is not None and any(fixed_time):
        if minimum:
            raise ClusterError("fixed_time needs minimum=0")
        busy, busy_den = _integers(
            _per_device(fixed_time, len(caps), "fixed time", 0.0))
        active = set(groups)
        while True:
            weight = sum(counts[i] * caps[i] for i in active)
            top = total * busy_den * caps_den + sum(
                counts[i] * busy[i] * caps[i] for i in active)
            late = {i for i in active if busy[i] * weight >= top}
            if not late:
                break
            active -= late
        numerators = [(top - busy[i] * weight) * caps[i] if i in active
                      else 0 for i in groups]
        denominator = busy_den * weight * caps_den
    else:
        pinned: set[int] = set()
        while True:
            rest = total - minimum * sum(counts[i] for i in pinned)
            weight = sum(counts[i] * caps[i] for i in groups
                         if i not in pinned)
            low = {i for i in groups if i not in pinned
                   and rest * caps[i] < minimum * weight}
            if not low:
                break
            pinned |= low
        numerators = [minimum * weight if i in pinned else rest * caps[i]
                      for i in groups]
        denominator = weight
    floors = [num // denominator for num in numerators]
    remainders = [num - f * denominator for num, f in zip(numerators, floors)]
    left = total - sum(f * c for f, c in zip(floors, counts))
    plus: list[tuple] = [() for _ in groups]
    order = sorted(groups, key=lambda i: (-remainders[i], -caps[i]))
    start = 0
    while start < len(order) and left > 0:
        key = (remainders[order[start]], caps[order[start]])
        tied = [i for i in order[start:]
                if (remainders[i], caps[i]) == key]
        start += len(tied)
        runs = sorted((a, b, i) for i in tied for a, b in members[i])
        for a, b, i in runs:
            take = min(b - a, left)
            if take <= 0:
                break
            plus[i] += ((a, a + take),)
            left -= take
    out = []
    for i in groups:
        got = plus[i]
        rest_runs = _subtract_runs(tuple(tuple(r) for r in members[i]), got)
        parts = [(floors[i] + 1, got)] if got else []
        if rest_runs:
            parts.append((floors[i], rest_runs))
        out.append(parts)
    return out


def _subtract_runs(runs: tuple, taken: tuple) -> tuple:
    """`runs` without the devices in `taken` (a prefix of each run)."""
    taken_by_start = {a: b for a, b in taken}
    out = []
    for a, b in runs:
        end = taken_by_start.get(a)
        if end is None:
            out.append((a, b))
        elif end < b:
            out.append((end, b))
    return tuple(out)


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


def _check_total(total: int, minimum: int, n: int) -> None:
    """Raise ClusterError unless `total` (a non-negative int) can give each of `n`
    devices at least `minimum`."""
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ClusterError(f"the total to share must be a non-negative int, "
                           f"got {total!r}")
    if minimum * n > total:
        raise ClusterError(f"cannot give {n} devices at least {minimum} "
                           f"each out of {total}")
