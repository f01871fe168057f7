"""Load balancing over numbers: batch shares and split shards.

Pure functions (no TensorFlow, no profiles): the planner turns device
profiles and the cost model into capabilities and byte counts, and these
functions share out the work.

- `balance_batch`: integer per-replica batch sizes summing to the global
  batch, proportional to capability (largest-remainder rounding), then
  moved off devices that would run out of memory onto the least-loaded
  devices with headroom (Whale's hardware-aware balancing).
- `balance_shards`: the same for the shards of a split dimension (experts,
  hidden units), with at least one unit per device.
- `grouped_proportional_shares`: `proportional_shares` over groups of
  identical devices, exactly.

Pipeline stage cuts (`balance_stages`, `min_max_partition`) are in
`epl.planner.stage_cuts`, which shares this module's input checks
(`per_device`, `check_capabilities`, `device_labels`) and `gb`.

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
from collections.abc import Sequence

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


# --------------------------------------------------------------------------
# Input checks.
# --------------------------------------------------------------------------

def per_device(value: float | Sequence[float] | None, n: int, what: str,
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


def check_capabilities(capabilities: Sequence[float]) -> list[float]:
    """Validated positive, finite capabilities."""
    caps = [float(c) for c in capabilities]
    if not caps:
        raise ClusterError("cannot balance over zero devices")
    if any(not (c > 0 and math.isfinite(c)) for c in caps):
        raise ClusterError(f"capabilities must be positive and finite, got "
                           f"{caps}")
    return caps


def device_labels(names: Sequence[str] | None, n: int) -> list[str]:
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
    caps_f = check_capabilities(capabilities)
    n = len(caps_f)
    _check_total(total, minimum, n)
    caps, caps_den = _integers(caps_f)
    if fixed_time is not None and any(fixed_time):
        if minimum:
            raise ClusterError("fixed_time needs minimum=0")
        busy, busy_den = _integers(
            per_device(fixed_time, n, "fixed time", 0.0))
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


def unit_limits(fixed: list[float], per_unit: list[float],
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
    caps = check_capabilities(capabilities)
    n = len(caps)
    busy = per_device(fixed_time, n, "fixed time", 0.0)
    per = per_device(per_unit, n, f"memory per {unit}", 0.0)
    fix = per_device(fixed, n, "fixed memory", 0.0)
    cap = per_device(capacity, n, "capacity", math.inf)
    kinds = device_labels(names, n)
    limits = unit_limits(fix, per, cap)
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
    caps_f = check_capabilities(capabilities)
    counts = [sum(b - a for a, b in runs) for runs in members]
    n = sum(counts)
    _check_total(total, minimum, n)
    caps, caps_den = _integers(caps_f)
    groups = range(len(caps))
    if fixed_time is not None and any(fixed_time):
        if minimum:
            raise ClusterError("fixed_time needs minimum=0")
        busy, busy_den = _integers(
            per_device(fixed_time, len(caps), "fixed time", 0.0))
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


def _check_total(total: int, minimum: int, n: int) -> None:
    """Raise ClusterError unless `total` (a non-negative int) can give each of `n`
    devices at least `minimum`."""
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ClusterError(f"the total to share must be a non-negative int, "
                           f"got {total!r}")
    if minimum * n > total:
        raise ClusterError(f"cannot give {n} devices at least {minimum} "
                           f"each out of {total}")
