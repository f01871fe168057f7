"""The plan search: every alternative's per-device loads, and the choice.

`plan_cluster` evaluates the alternatives the options allow (data-parallel
even and balanced, with gradient checkpointing and ZeRO; pipelines), chooses
the simplest feasible one within `CHOICE_TOLERANCE` of the fastest, and
returns a `ClusterPlan`; when nothing fits, the ClusterError says why and
what would help (each remedy checked by re-planning).  Costs come from
`epl.planner.step_cost`, shares and cuts from `epl.planner.balance`, the
text from `epl.planner.explain`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from epl.errors import ClusterError, ConfigError
from epl.planner import balance
from epl.planner import roofline as cm
from epl.planner.balance import GiB, gb
from epl.planner.devices import ClusterDevice, DeviceLayout, runs_count
from epl.planner.explain import explain_text, plan_dict
from epl.planner.model_spec import ModelSpec
from epl.planner.results import (CHOICE_TOLERANCE, Alternative, DeviceLoad,
                                 PlanOptions)
from epl.planner.step_cost import (_Context, _Totals, _alltoall_time,
                                   _allreduce_time, _per_example_time,
                                   exposed_alltoall_time, input_time,
                                   merge_op_counts,
                                   _ring_link,
                                   _slowest_link, _totals)
from epl.planner.profiles import (DeviceProfile, HostSpec, normalize_dtype, parse_cluster,
                          replica_speedup)

@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """The planner's answer: every alternative, and the chosen one."""

    model: ModelSpec
    hosts: tuple[HostSpec, ...]
    optimizer: str
    global_batch: int
    options: PlanOptions
    alternatives: tuple[Alternative, ...]
    chosen: Alternative

    @property
    def batch_sizes(self) -> list[int]:
        """The chosen plan's per-replica batch sizes."""
        return self.chosen.batch_sizes

    @property
    def replica_weights(self) -> list[float]:
        """The chosen plan's batch shares (sum to 1)."""
        sizes = self.batch_sizes
        return [s / self.global_batch for s in sizes]

    def alternative(self, name: str) -> Alternative:
        """The alternative called `name` (KeyError when absent)."""
        for alt in self.alternatives:
            if alt.name == name:
                return alt
        raise KeyError(name)

    def explain(self) -> str:
        """The per-device table, the chosen plan and the alternatives."""
        return explain_text(self)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (`epl-plan --json`): the model, the
        chosen plan with one row per group of identical devices, every
        alternative with its predicted step time or the constraint that
        ruled it out, the choice rule and the unknown op types.  Bytes are
        plain numbers of bytes, times seconds."""
        return plan_dict(self)


# --------------------------------------------------------------------------
# Data-parallel alternatives.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _DeviceState:
    """Bytes a device holds whatever its batch, split into the table's parts."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float  # split (expert) activations, fixed by the shard
    host: float
    update_bytes: float  # parameter bytes this device updates
    offload_traffic: float = 0.0  # bytes to and from the host per step


def _device_state(ctx: _Context, totals: _Totals, units: int, n: int,
                  zero: bool) -> _DeviceState:
    """Fixed bytes of one data-parallel device holding `units` split units."""
    share = units / ctx.model.split_units if ctx.model.split_units else 0.0
    dense, split = totals.params, totals.split_params * share
    dense_sharded = dense / n if zero else dense
    # ZeRO stage 1 as epl/passes/zero.py builds it: full gradients, slots and
    # update sharded, plus a working copy of the device's parameter shard
    params = dense + split + (dense_sharded if zero else 0.0)
    grads = dense + split
    slots = (dense_sharded + split) * ctx.slots
    split_act = totals.split_act * ctx.global_batch * share
    update = dense_sharded + split
    if not ctx.options.offload:
        return _DeviceState(params, grads, slots, split_act, 0.0, update)
    largest = totals.largest_layer_params + \
        totals.largest_layer_split_params * share
    return _DeviceState(2 * largest, largest, 0.0, split_act,
                        params + grads + slots, update, 2 * params + grads)


#: At most this many expert placements are evaluated per balanced plan.
MAX_PLACEMENTS = 17


def _barriers(ctx: _Context, totals: _Totals) -> bool:
    """Whether the devices meet at an expert all-to-all in every split
    layer (then the replicated and the expert work are balanced apart)."""
    return bool(totals.alltoall) and len(ctx.devices) > 1 and \
        ctx.model.split_units > 0


def _split_time(ctx: _Context, device: ClusterDevice, totals: _Totals
                ) -> float:
    """Seconds of one example's split-layer work (all experts) on `device`;
    0 when the model has none."""
    return ctx.time(device, totals.split_flops, totals.split_bytes)


def _placement_path(start: list[int], speed: list[float]) -> list[list[int]]:
    """Placements from `start` towards the one that finishes the experts
    soonest: each step moves one unit from the device that finishes its
    units last (keeping at least one) to the one that would finish one more
    unit first, while that shortens the slowest device's time (ties to the
    lower index).  Returns every placement on the way, `start` first."""
    units, n = list(start), len(start)
    path = [list(units)]
    while True:
        donors = [i for i in range(n) if units[i] > 1]
        if not donors:
            break
        src = max(donors, key=lambda i: (units[i] / speed[i], -i))
        dst = min(range(n), key=lambda i: ((units[i] + 1) / speed[i], i))
        if (units[dst] + 1) / speed[dst] >= units[src] / speed[src]:
            break
        units[src] -= 1
        units[dst] += 1
        path.append(list(units))
    return path


def _split_placements(ctx: _Context, totals: _Totals, caps: list[float],
                      balanced: bool, zero: bool) -> list[list[int]]:
    """Candidate split units (experts) per device, each device at least one.

    Even: one candidate, the even split.  Balanced: the placements on the
    way from the even split to the one proportional to each device's speed
    (`_placement_path`, one unit moved at a time; at most `MAX_PLACEMENTS`,
    evenly spaced), and the proportional one rounded within memory
    (`balance.balance_shards`).  The speed is the device's on the experts'
    work when the all-to-all barriers separate it from the replicated work
    (`_barriers`) and that work takes time, else on a whole example.  The caller evaluates each
    candidate and keeps the fastest.

    Why not just the proportional one: the experts a device holds set how
    many tokens its host receives from other hosts, and its batch how many
    it sends (`_alltoall_time`); when the two shares differ, the hosts
    exchange more than they need to.  Whole experts per device make them
    differ: 32 experts over 8 + 8 devices 1.95x apart round to 3 and 1 (24
    of 32 on the fast host for a 66% share).  A less skewed placement can
    be faster; only the whole cost model can tell.  `caps` (examples/s of
    the replicated work) estimate each device's batch share, whose
    activations take memory too.
    """
    units, n = ctx.model.split_units, len(ctx.devices)
    if not units:
        return [[0] * n]
    if units < n:
        raise ClusterError(
            f"the split dimension has {units} units (experts) but the "
            f"cluster has {n} devices; every device needs at least one")
    even = balance.proportional_shares(units, [1.0] * n, minimum=1)
    if not balanced:
        return [even]
    split = [_split_time(ctx, d, totals) for d in ctx.devices]
    if _barriers(ctx, totals) and all(split):
        speed = [1.0 / seconds for seconds in split]
    else:  # no barriers, or experts without work of their own
        speed = [1.0 / (_per_example_time(ctx, d, totals) + seconds)
                 for d, seconds in zip(ctx.devices, split)]
    path = _placement_path(even, speed)
    if len(path) > MAX_PLACEMENTS:
        last = len(path) - 1
        path = [path[round(i * last / (MAX_PLACEMENTS - 1))]
                for i in range(MAX_PLACEMENTS)]
    state_copies = 0 if ctx.options.offload else 2 + ctx.slots
    per_unit = (totals.split_params / units) * state_copies + \
        totals.split_act * ctx.global_batch / units
    empty = [_device_state(ctx, totals, 0, n, zero) for _ in ctx.devices]
    fixed = [s.parameters + s.gradients + s.optimizer + totals.act *
             ctx.global_batch * c / sum(caps) for s, c in zip(empty, caps)]
    try:
        fitted = list(balance.balance_shards(
            units, speed, per_unit, fixed, [ctx.usable(d) for d in ctx.devices],
            [d.profile.name for d in ctx.devices]).sizes)
    except ClusterError:
        fitted = balance.proportional_shares(units, speed, minimum=1)
    return path + [fitted] if fitted not in path else path


def _data_parallel(ctx: _Context, name: str, balanced: bool,
                   checkpointing: bool, zero: bool) -> Alternative:
    """Evaluate one data-parallel alternative: per group of identical
    devices where that gives the per-device answer (`_grouped_data_parallel`),
    else device by device (`_per_device_data_parallel`)."""
    grouped = _grouped_data_parallel(ctx, name, balanced, checkpointing, zero)
    if grouped is not None:
        return grouped
    return _per_device_data_parallel(ctx, name, balanced, checkpointing, zero)




def _grouped_data_parallel(ctx: _Context, name: str, balanced: bool,
                           checkpointing: bool, zero: bool
                           ) -> Alternative | None:
    """A data-parallel alternative computed once per DeviceClass, or None
    where only the per-device computation gives the answer.

    Without split layers every device of a class holds the same state and
    runs at the same speed, so its batch share is the same exact quota; the
    rounding gives some devices of a class one more example
    (`balance.grouped_proportional_shares`, the same rounding as
    device by device).  So a class is one or two rows.  When an assignment
    would not fit some device (the balancer would move examples one by one,
    or report a shortfall) the per-device computation runs instead, as it
    does for models with split layers (they are planned on at most as many
    devices as experts).
    """
    if ctx.model.split_units or not isinstance(ctx.devices, DeviceLayout):
        return None
    layout, n = ctx.devices, len(ctx.devices)
    classes = layout.classes
    totals = _totals(ctx.model.layers, checkpointing)
    reps = [c.representative for c in classes]
    state = _device_state(ctx, totals, 0, n, zero)
    fixed = state.parameters + state.gradients + state.optimizer + \
        state.activations
    members = [c.runs for c in classes]
    if balanced:
        caps = [1.0 / _per_example_time(ctx, d, totals) for d in reps]
        busy = [ctx.update_time(d, state.update_bytes) for d in reps]
        limits = balance._unit_limits([fixed] * len(reps),
                                      [totals.act] * len(reps),
                                      [ctx.usable(d) for d in reps])
        parts = balance.grouped_proportional_shares(
            ctx.global_batch, caps, members, 0, busy)
        if any(size > limit for group, limit in zip(parts, limits)
               for size, _ in group):
            return None
    else:
        parts = balance.grouped_proportional_shares(
            ctx.global_batch, [1.0] * len(reps), members)
    comm = _allreduce_time(reps, totals.params, _ring_link(ctx), n) + \
        state.offload_traffic / ctx.options.host_link_bandwidth + \
        input_time(reps, n, ctx.global_batch)
    rows = []
    for device, group in zip(reps, parts):
        for batch, runs in group:
            rows.append(DeviceLoad(
                device=layout[runs[0][0]], batch=batch,
                parameters=state.parameters, gradients=state.gradients,
                optimizer=state.optimizer,
                activations=state.activations + batch * totals.act,
                usable=ctx.usable(device),
                compute_s=ctx.time(device, batch * totals.flops,
                                   batch * totals.bytes, totals.op_counts)
                + ctx.update_time(device, state.update_bytes)
                + ctx.session_time(device),
                comm_s=comm, host_bytes=state.host,
                host_usable=ctx.options.host_memory_per_device
                if ctx.options.offload else math.inf,
                count=runs_count(runs), runs=runs))
    rows.sort(key=lambda row: row.device.index)
    reason = _memory_reason(rows)
    return Alternative(name, tuple(rows), not reason, reason, checkpointing,
                       zero, layout=layout)


def _per_device_data_parallel(ctx: _Context, name: str, balanced: bool,
                              checkpointing: bool, zero: bool
                              ) -> Alternative:
    """Evaluate one data-parallel alternative, device by device.

    Even: the even split of the batch and of the split units.  Balanced:
    for each candidate expert placement (`_split_placements`), the batch
    balanced by capability within memory (`_batch_sizes`) and, when the
    model has an expert all-to-all, its blends with the even split and with
    the batch that follows the experts (`_blended_batches`); the assignment
    that fits with the shortest predicted step is kept (the first on a
    tie).
    """
    devices, n = ctx.devices, len(ctx.devices)
    totals = _totals(ctx.model.layers, checkpointing)
    # Capability is compute speed: the all-to-all is one exchange every
    # device waits for (`_alltoall_time`), not a per-device cost to balance.
    caps = [1.0 / _per_example_time(ctx, d, totals) for d in devices]
    try:
        placements = _split_placements(ctx, totals, caps, balanced, zero)
    except ClusterError as err:
        return Alternative(name, (), False, str(err), checkpointing, zero)
    barriers = _barriers(ctx, totals)
    best = None
    for units in placements:
        states = [_device_state(ctx, totals, u, n, zero) for u in units]
        busy = [_busy_time(ctx, d, totals, u, s, barriers)
                for d, u, s in zip(devices, units, states)]
        batch = _batch_sizes(ctx, devices, caps, states, totals.act,
                             balanced, busy)
        batches = _blended_batches(ctx.global_batch, batch, units) \
            if balanced and barriers else [batch]
        for sizes in batches:
            loads = _dp_loads(ctx, totals, units, states, sizes)
            reason = _memory_reason(loads)
            key = (bool(reason), max(load.step_s for load in loads))
            if best is None or key < best[0]:
                best = (key, loads, reason)
    _, loads, reason = best
    return Alternative(name, tuple(loads), not reason, reason, checkpointing,
                       zero)


#: Blends of the balanced batch (1) with another one (0) that a plan with an
#: expert all-to-all tries.
BATCH_BLENDS = tuple(i / 8 for i in range(8, -1, -1))


def _blended_batches(global_batch: int, balanced: list[int],
                     units: list[int]) -> list[list[int]]:
    """Batch sizes to try with the placement `units`, all summing to
    `global_batch`: the balanced ones first, then their blends
    (`BATCH_BLENDS`) with the even split and with the batch that follows
    the experts (shares proportional to `units`); distinct ones only.

    Balancing equalizes compute, but in the all-to-all each host sends the
    tokens of its batch that go to other hosts' experts, and receives the
    other hosts' tokens for its own experts.  Piling the batch onto the
    fast devices loads their hosts' networks (towards even sends less);
    a batch whose shares match the experts' makes each host send as much as
    it receives, the least for its share (towards the experts).  When the
    network binds, the fastest batch lies on one of these lines; the caller
    keeps whichever the cost model predicts fastest (memory is checked
    there, so a share too large for a device is ruled out).
    """
    n = len(balanced)
    anchors = ([global_batch / n] * n,
               [global_batch * u / sum(units) for u in units])
    out = [list(balanced)]
    for anchor in anchors:
        for blend in BATCH_BLENDS:
            if blend >= 1:
                continue
            weights = [(1 - blend) * a + blend * b
                       for a, b in zip(anchor, balanced)]
            sizes = balance.proportional_shares(global_batch, weights)
            if sizes not in out:
                out.append(sizes)
    return out


def _busy_time(ctx: _Context, device: ClusterDevice, totals: _Totals,
               units: int, state: _DeviceState, barriers: bool) -> float:
    """Seconds `device` computes whatever its batch, which its batch share
    must make up for: its optimizer update and, unless the all-to-all
    barriers make every device wait for the slowest expert work anyway
    (`_dp_loads`), its experts' share of the split layers."""
    update = ctx.update_time(device, state.update_bytes)
    if barriers:
        return update
    share = units / ctx.model.split_units if ctx.model.split_units else 0.0
    tokens = ctx.global_batch * share
    return ctx.time(device, tokens * totals.split_flops,
                    tokens * totals.split_bytes) + update


def _batch_sizes(ctx: _Context, devices: Sequence[ClusterDevice],
                 caps: list[float], states: list[_DeviceState],
                 act: float, balanced: bool, busy: list[float]
                 ) -> list[int]:
    """Batch per device: even, or balanced within memory.  When the batch
    fits nowhere, shares follow each device's free memory instead, so that
    every device falls short by about the same fraction (the shortfall the
    planner reports is then the least one)."""
    g = ctx.global_batch
    if not balanced:
        return balance.proportional_shares(g, [1.0] * len(devices))
    fixed = [s.parameters + s.gradients + s.optimizer + s.activations
             for s in states]
    try:
        shares = balance.balance_batch(
            g, caps, act, fixed, [ctx.usable(d) for d in devices],
            [d.profile.name for d in devices], busy)
        return list(shares.sizes)
    except ClusterError:
        room = [max(ctx.usable(d) - f, 0.0) for d, f in zip(devices, fixed)]
        if not any(room):
            return balance.proportional_shares(g, caps, 0, busy)
        return balance.proportional_shares(
            g, [max(r, 1e-9 * max(room)) for r in room])


def _dp_loads(ctx: _Context, totals: _Totals, units: list[int],
              states: list[_DeviceState], batch: list[int]
              ) -> list[DeviceLoad]:
    """Per-device loads of a data-parallel assignment.

    With an expert all-to-all, every split layer's exchange is a barrier:
    the experts start when the last device has sent its tokens, and the
    next layer when the last expert has sent them back.  So the step pays
    the slowest device's replicated work plus the slowest device's expert
    work, not the slowest sum of both; a device that is done early waits
    (`DeviceLoad.wait_s`).  Each layer's work divides among the devices in
    the same proportions, so summing over layers first gives the same
    maxima.

    The dispatch may be cut into chunks (`PlanOptions.moe_chunks`, None:
    the fastest of `step_cost.MOE_CHUNK_CHOICES`), pipelined with the expert
    compute it feeds; the communication then counts only the part of the
    all-to-all not hidden behind the slowest device's expert compute
    (`step_cost.exposed_alltoall_time`).
    """
    devices = ctx.devices
    bandwidth, _ = _slowest_link(devices)
    allreduce = _allreduce_time(devices, totals.params, bandwidth) + \
        input_time(devices, len(devices), ctx.global_batch)
    dense, expert = [], []
    for device, u, b in zip(devices, units, batch):
        share = u / ctx.model.split_units if ctx.model.split_units else 0.0
        tokens = ctx.global_batch * share
        dense.append(ctx.time(device, b * totals.flops, b * totals.bytes,
                              totals.op_counts))
        expert.append(ctx.time(device, tokens * totals.split_flops,
                               tokens * totals.split_bytes))
    alltoall, chunks = exposed_alltoall_time(
        ctx, totals, _alltoall_time(ctx, totals, units, batch), max(expert),
        ctx.options.moe_chunks)
    barrier = _barriers(ctx, totals)
    loads = []
    for device, u, state, b, d, e in zip(devices, units, states, batch,
                                         dense, expert):
        compute = d + e + ctx.update_time(device, state.update_bytes) + \
            ctx.session_time(device)
        wait = (max(dense) - d) + (max(expert) - e) if barrier else 0.0
        comm = allreduce + alltoall
        comm += state.offload_traffic / ctx.options.host_link_bandwidth
        loads.append(DeviceLoad(
            device=device, batch=b, parameters=state.parameters,
            gradients=state.gradients, optimizer=state.optimizer,
            activations=state.activations + b * totals.act,
            usable=ctx.usable(device), compute_s=compute, comm_s=comm,
            wait_s=wait, host_bytes=state.host,
            host_usable=ctx.options.host_memory_per_device
            if ctx.options.offload else math.inf,
            shards=u if ctx.model.split_units else None,
            moe_chunks=chunks))
    return loads


def _memory_reason(loads: Sequence[DeviceLoad]) -> str:
    """"" when every device fits, else the constraint that rules it out."""
    device_over = [l for l in loads if l.shortfall > 1e-9 * l.usable]
    host_over = [l for l in loads if l.host_shortfall > 0]
    count = lambda rows: sum(l.count for l in rows)  # noqa: E731
    if not device_over and not host_over:
        return ""
    if device_over:
        worst = max(device_over, key=lambda l: (l.shortfall / l.usable,
                                                -l.device.index))
        text = _needs_text(worst)
        others = count(device_over) - 1
    else:
        worst = max(host_over, key=lambda l: (l.host_shortfall,
                                              -l.device.index))
        text = (f"device {worst.device.index} needs {gb(worst.host_bytes)} "
                f"of host memory with {gb(worst.host_usable)} per device")
        others = count(host_over) - 1
    if others:
        text += f" (and {others} more device{'s' if others > 1 else ''})"
    return text


def _needs_text(load: DeviceLoad) -> str:
    """"stage 3 needs 18.2 GB on a 16.0 GB V100-16GB (device 5, ...)"."""
    profile = load.device.profile
    who = f"stage {load.stage}" if load.stage is not None else \
        f"device {load.device.index}"
    where = f"device {load.device.index}, " if load.stage is not None else ""
    what = f"{load.batch} examples" if load.batch else "its share"
    return (f"{who} needs {gb(load.total)} on a "
            f"{profile.memory_bytes / GiB:.1f} GB {profile.name} "
            f"({where}{gb(load.usable)} usable) for {what}: parameters "
            f"{gb(load.parameters)}, gradients {gb(load.gradients)}, "
            f"optimizer {gb(load.optimizer)}, activations "
            f"{gb(load.activations)}")


# --------------------------------------------------------------------------
# Pipeline alternative.
# --------------------------------------------------------------------------

def _pipeline(ctx: _Context, stages: int, checkpointing: bool
              ) -> Alternative:
    """Evaluate a pipeline of `stages` stages, replicated over the rest."""
    name = f"pipeline, {stages} stages" + (
        " + gradient checkpointing" if checkpointing else "")
    devices, layers = ctx.devices, ctx.model.layers
    n = len(devices)
    reject = _pipeline_precheck(ctx, stages)
    if reject:
        return Alternative(name, (), False, reject, checkpointing,
                           pipeline_stages=stages)
    replicas = n // stages
    micro = ctx.options.num_micro_batch
    order = balance.stage_device_order(
        [ctx.usable(d) for d in devices],
        [1.0 / _per_example_time(ctx, d, _totals(layers, False))
         for d in devices])
    groups = [[devices[order[s * replicas + r]] for s in range(stages)]
              for r in range(replicas)]
    per_layer = [_totals([l], checkpointing) for l in layers]
    even_mb = max(math.ceil(ctx.global_batch / replicas / micro), 1)
    cuts, reason = [], ""
    for group in groups:
        try:
            cuts.append(_cut_pipeline(ctx, group, per_layer, even_mb))
        except ClusterError as err:
            cuts.append(None)
            reason = reason or str(err).splitlines()[0] + " " + "; ".join(
                line.strip() for line in str(err).splitlines()[1:-1]
                if "short by" in line)
    if reason:
        return Alternative(name, (), False, reason, checkpointing,
                           pipeline_stages=stages, num_micro_batch=micro)
    batch = _pipeline_batches(ctx, groups, cuts, per_layer)
    loads = _pipeline_loads(ctx, groups, cuts, per_layer, batch)
    reason = _memory_reason(loads)
    return Alternative(name, tuple(loads), not reason, reason, checkpointing,
                       pipeline_stages=stages, num_micro_batch=micro)


def _pipeline_precheck(ctx: _Context, stages: int) -> str:
    """Why a pipeline of `stages` cannot be laid out ("" if it can)."""
    n, layers = len(ctx.devices), len(ctx.model.layers)
    if ctx.model.split_units:
        return ("pipelines of models with split (expert) layers are not "
                "modelled")
    if layers < stages:
        return f"the model has {layers} layer(s), fewer than {stages} stages"
    if n % stages:
        return (f"{n} devices cannot be cut into pipelines of {stages} "
                f"stages")
    return ""


def _stage_inflight(stages: int, micro: int) -> list[float]:
    """Micro-batches whose activations stage s keeps alive (1F1B)."""
    return [float(min(stages - s, micro)) for s in range(stages)]


def _cut_pipeline(ctx: _Context, group: list[ClusterDevice],
                  per_layer: list[_Totals], micro_batch: int
                  ) -> balance.StageCuts:
    """Stage cuts of one pipeline for micro-batches of `micro_batch`."""
    stages = len(group)
    rates = [sum(t.flops for t in per_layer) /
             _per_example_time(ctx, d, _sum_totals(per_layer))
             for d in group]
    state = 0 if ctx.options.offload else 2 + ctx.slots
    return balance.balance_stages(
        [t.flops for t in per_layer], rates,
        [ctx.usable(d) for d in group],
        [t.params * state for t in per_layer],
        [t.act * micro_batch for t in per_layer],
        _stage_inflight(stages, ctx.options.num_micro_batch),
        [d.profile.name for d in group], order_by_memory=False)


def _sum_totals(per_layer: list[_Totals]) -> _Totals:
    """Totals of several layers' totals (no split parts in pipelines)."""
    return _Totals(
        flops=sum(t.flops for t in per_layer),
        bytes=sum(t.bytes for t in per_layer),
        act=sum(t.act for t in per_layer),
        params=sum(t.params for t in per_layer), split_params=0.0,
        split_flops=0.0, split_bytes=0.0, split_act=0.0, alltoall=0.0,
        largest_layer_params=max(t.params for t in per_layer),
        largest_layer_split_params=0.0,
        op_counts=merge_op_counts(t.op_counts for t in per_layer))


def _pipeline_batches(ctx: _Context, groups, cuts, per_layer) -> list[int]:
    """Batch per pipeline, proportional to its throughput."""
    caps = []
    for group, cut in zip(groups, cuts):
        slowest = max(_sum_totals(per_layer[a:b]).flops / max(
            _stage_rate(ctx, d, per_layer), 1e-30)
            for d, (a, b) in zip(group, cut.bounds))
        caps.append(1.0 / slowest)
    return balance.proportional_shares(ctx.global_batch, caps)


def _stage_rate(ctx: _Context, device: ClusterDevice,
                per_layer: list[_Totals]) -> float:
    """Effective FLOP/s of `device` on this model."""
    whole = _sum_totals(per_layer)
    return whole.flops / _per_example_time(ctx, device, whole)


def _micro_batches_time(groups, per_mb: list[list[float]], r: int,
                        micro: int) -> float:
    """Seconds pipeline `r` of `groups` (device lists, one per pipeline)
    spends on its `micro` micro-batches; per_mb[r][s]: seconds of one
    micro-batch on stage s of pipeline r.

    The schedule (GPipe's, 1F1B's) runs micro + stages - 1 slots of the
    slowest stage: its fill and drain leave the other stages idle.  On
    devices that share one host's cores (virtual CPU devices: every
    device's `shared_by` is the number of devices, all on one host), an
    idle stage's cores serve the busy ones, so the step is also bounded
    below by the host's whole work, every pipeline's micro-batches on every
    stage at the shared rate divided among the n sharing devices, and the
    slots by a stage running alone (its share of the host,
    `replica_speedup` / n, gives it all: alone, a slot is per_mb x share):
    the larger of the two."""
    stages = len(groups[r])
    slots = (micro + stages - 1) * max(per_mb[r])
    devices = [d for group in groups for d in group]
    n = devices[0].profile.shared_by
    if n <= 1 or len(devices) != n or len({d.host for d in devices}) > 1 \
            or any(d.profile.shared_by != n for d in devices):
        return slots
    share = replica_speedup(devices[0].profile, n) / n
    work = micro * sum(sum(times) for times in per_mb) / n
    return max(work, slots * share)


def _pipeline_loads(ctx: _Context, groups, cuts, per_layer, batch
                    ) -> list[DeviceLoad]:
    """Per-device loads of a pipeline plan, in device index order."""
    micro, stages = ctx.options.num_micro_batch, len(groups[0])
    inflight = _stage_inflight(stages, micro)
    reads = input_time([groups[0][0]], len(groups) * micro,
                       ctx.global_batch)
    totals = [[_sum_totals(per_layer[x:y]) for x, y in cut.bounds]
              for cut in cuts]
    per_mb = [[ctx.time(d, t.flops * batch[r] / micro,
                        t.bytes * batch[r] / micro, t.op_counts)
               for d, t in zip(group, totals[r])]
              for r, group in enumerate(groups)]
    micro_batches = [_micro_batches_time(groups, per_mb, r, micro)
                     for r in range(len(groups))]
    loads = []
    for s in range(stages):
        members = [group[s] for group in groups]
        bandwidth, _ = _slowest_link(members)
        for r, (group, cut) in enumerate(zip(groups, cuts)):
            part = totals[r][s]
            mb = batch[r] / micro
            compute = micro_batches[r] + \
                ctx.update_time(group[s], part.params) + \
                ctx.session_time(group[s])
            comm = _allreduce_time(members, part.params, bandwidth) + reads
            host = part.params * (2 + ctx.slots) if ctx.options.offload \
                else 0.0
            if ctx.options.offload:
                comm += 3 * part.params / ctx.options.host_link_bandwidth
            params = 2 * part.largest_layer_params if ctx.options.offload \
                else part.params
            loads.append(DeviceLoad(
                device=group[s], batch=batch[r], parameters=params,
                gradients=part.largest_layer_params if ctx.options.offload
                else part.params,
                optimizer=0.0 if ctx.options.offload else
                part.params * ctx.slots,
                activations=part.act * math.ceil(mb) * inflight[s],
                usable=ctx.usable(group[s]), compute_s=compute, comm_s=comm,
                host_bytes=host, host_usable=ctx.options.host_memory_per_device
                if ctx.options.offload else math.inf,
                stage=s, layers=cut.bounds[s], pipeline=r))
    return sorted(loads, key=lambda load: load.device.index)


# --------------------------------------------------------------------------
# plan_cluster.
# --------------------------------------------------------------------------

def _as_model(model: Any, amp_dtype: Any = None) -> ModelSpec:
    """`model` itself, or the ModelSpec of a graph or TrainingView.

    Only a graph needs TensorFlow, so `graph_model` (which imports it) is
    imported here, on that path, and a ModelSpec is planned without it.
    """
    if isinstance(model, ModelSpec):
        return model
    from epl.planner.graph_model import model_from_graph
    if hasattr(model, "taskgraph_of") and hasattr(model, "graph"):
        return model_from_graph(model.graph, view=model, amp_dtype=amp_dtype)
    return model_from_graph(model, amp_dtype=amp_dtype)


def _as_hosts(hosts: Sequence[HostSpec] | str,
              overrides: Mapping[str, Any] | None) -> tuple[HostSpec, ...]:
    """Hosts from a list or a cluster string."""
    if isinstance(hosts, str):
        return tuple(parse_cluster(hosts, overrides))
    hosts = tuple(hosts)
    if not hosts or not all(isinstance(h, HostSpec) for h in hosts):
        raise ClusterError(f"expected HostSpecs or a cluster string, got "
                           f"{hosts!r}")
    return hosts


def _alternatives(ctx: _Context) -> list[Alternative]:
    """Every alternative the options allow, in listing order."""
    opts = ctx.options
    alts = [_data_parallel(ctx, "data-parallel, even split", False, False,
                           False),
            _data_parallel(ctx, "data-parallel, balanced by capability",
                           True, False, False)]
    if opts.try_checkpointing:
        alts.append(_data_parallel(
            ctx, "data-parallel, balanced + gradient checkpointing", True,
            True, False))
    if opts.try_zero:
        alts.append(_data_parallel(ctx, "data-parallel, balanced + ZeRO",
                                   True, False, True))
    if opts.try_zero and opts.try_checkpointing:
        alts.append(_data_parallel(
            ctx, "data-parallel, balanced + ZeRO + gradient checkpointing",
            True, True, True))
    stages = opts.pipeline_stages or (ctx.model.stages
                                      if ctx.model.stages > 1 else None)
    if stages and stages > 1:
        alts.append(_pipeline(ctx, stages, False))
        if opts.try_checkpointing:
            alts.append(_pipeline(ctx, stages, True))
    return alts


def _context(model: ModelSpec, hosts: Sequence[HostSpec], optimizer: str,
             global_batch: int, options: PlanOptions) -> _Context:
    """Validated evaluation context."""
    return _device_context(model, DeviceLayout(hosts), optimizer,
                           global_batch, options)


def _device_context(model: ModelSpec, devices: Sequence[ClusterDevice],
                    optimizer: str, global_batch: int, options: PlanOptions
                    ) -> _Context:
    """Validated evaluation context over `devices` (a DeviceLayout, or a
    list of ClusterDevices)."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) \
            or global_batch < 1:
        raise ConfigError(f"the global batch must be a positive int, got "
                          f"{global_batch!r}")
    return _Context(model=model, devices=devices,
                    optimizer=optimizer,
                    slots=cm.optimizer_slots(optimizer),
                    global_batch=global_batch, options=options,
                    dtype=normalize_dtype(options.compute_dtype or
                                             model.compute_dtype))


def plan_cluster(model: Any, hosts: Sequence[HostSpec] | str,
                 optimizer: str | None = None,
                 global_batch: int | None = None,
                 options: PlanOptions | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 amp_dtype: Any = None) -> ClusterPlan:
    """Plan `model` on the cluster `hosts`.

    Args:
        model: a ModelSpec (layers of numbers), a tf.Graph or GraphDef
            (one layer per TaskGraph, see `model_from_graph`), or an
            epl.ir.graph_view.TrainingView.
        hosts: HostSpecs, or a cluster string ("2x8xV100-32GB,2x8xT4").
        optimizer: "adam", "sgd", "momentum", ...; default: the model's
            (read from a graph's apply ops), else "adam".
        global_batch: examples per step; default the model's batch size,
            else 32 per device.
        options: PlanOptions.
        overrides: `cluster.device_profiles`, when `hosts` is a string.
        amp_dtype: for graphs: the AMP dtype ("float16"), if any.

    Returns:
        ClusterPlan with every alternative and the fastest one that fits.

    Raises:
        ClusterError: the cluster string is bad, or nothing fits; then the
            message gives each device's shortfall under the closest
            alternative, what would help, and why each alternative was
            ruled out.
        ConfigError: bad optimizer, batch or options.
    """
    options = options or PlanOptions()
    spec = _as_model(model, amp_dtype)
    optimizer_given = optimizer or spec.optimizer
    cluster = _as_hosts(hosts, overrides)
    n = sum(h.devices for h in cluster)
    batch = global_batch if global_batch is not None else (
        spec.batch_size or 32 * n)
    ctx = _context(spec, cluster, optimizer_given or "adam", batch, options)
    alts = _alternatives(ctx)
    feasible = [a for a in alts if a.feasible]
    if not feasible:
        raise ClusterError(_nothing_fits(ctx, alts))
    chosen = _choose(feasible)
    return ClusterPlan(spec, cluster, ctx.optimizer, batch, options,
                       tuple(alts), chosen)


def plan_local_devices(model: Any, profiles: Sequence[DeviceProfile],
                       optimizer: str | None = None,
                       global_batch: int | None = None,
                       options: PlanOptions | None = None) -> ClusterPlan:
    """Plan `model` on one worker's devices, whose profiles may differ.

    The same search as `plan_cluster`, over one host holding the devices
    `profiles` in local device order (a HostSpec has one profile, so a
    mixed worker, such as virtual CPU devices with different
    `cluster.device_profiles`, cannot be written as hosts).  The devices
    are evaluated one by one; `ClusterPlan.hosts` is then one HostSpec of
    the first device's profile, for the text only.  This is the plan the
    runtime follows (`epl.planner.local`).
    """
    options = options or PlanOptions()
    spec = _as_model(model)
    profiles = list(profiles)
    if not profiles:
        raise ClusterError("plan_local_devices needs at least one device")
    devices = [ClusterDevice(i, 0, i, p) for i, p in enumerate(profiles)]
    batch = global_batch if global_batch is not None else (
        spec.batch_size or 32 * len(devices))
    ctx = _device_context(spec, devices, optimizer or spec.optimizer or
                          "adam", batch, options)
    alts = _alternatives(ctx)
    feasible = [a for a in alts if a.feasible]
    if not feasible:
        raise ClusterError(_nothing_fits(ctx, alts))
    return ClusterPlan(spec, (HostSpec(profiles[0], len(profiles)),),
                       ctx.optimizer, batch, options, tuple(alts),
                       _choose(feasible))


def _choose(feasible: Sequence[Alternative]) -> Alternative:
    """The simplest alternative within CHOICE_TOLERANCE of the fastest."""
    fastest = min(a.step_time for a in feasible)
    return next(a for a in feasible
                if a.step_time <= fastest * (1 + CHOICE_TOLERANCE))


# --------------------------------------------------------------------------
# Nothing fits.
# --------------------------------------------------------------------------

def _closest(alts: Sequence[Alternative]) -> Alternative | None:
    """The alternative with the smallest worst relative shortfall."""
    candidates = [a for a in alts if a.loads]
    if not candidates:
        return None
    return min(candidates, key=lambda a: (max(
        max(l.shortfall / l.usable, l.host_shortfall / l.host_usable)
        for l in a.loads), alts.index(a)))


def _fits_with(ctx: _Context, **changes: Any) -> bool:
    """Whether some alternative fits after `changes` to the context."""
    trial = dataclasses.replace(ctx, **changes)
    return any(a.feasible for a in _alternatives(trial))


def _remedies(ctx: _Context, closest: Alternative) -> list[str]:
    """What would make the model fit, each checked by re-planning."""
    out = []
    if not ctx.options.offload and _fits_with(
            ctx, options=dataclasses.replace(ctx.options, offload=True)):
        out.append("offloading parameters, gradients and optimizer state "
                   "to host memory (PlanOptions(offload=True), epl-plan "
                   "--offload) makes it fit")
    if not (ctx.options.try_checkpointing and ctx.options.try_zero):
        out.append("gradient checkpointing and ZeRO (not tried: enable them)")
    else:
        out.append(f"gradient checkpointing and ZeRO were tried; the "
                   f"closest plan ({closest.name}) uses "
                   + ("both" if closest.checkpointing and closest.zero else
                      "checkpointing" if closest.checkpointing else
                      "ZeRO" if closest.zero else "neither")
                   + " and is still short")
    if ctx.options.pipeline_stages is None and len(ctx.model.layers) > 1 \
            and not ctx.model.split_units:
        for stages in (2, 4, 8):
            if stages <= len(ctx.model.layers) and _fits_with(
                    ctx, options=dataclasses.replace(
                        ctx.options, pipeline_stages=stages)):
                out.append(f"a pipeline of {stages} stages "
                           f"(PlanOptions(pipeline_stages={stages}), "
                           f"epl-plan --pipeline-stages {stages}) fits")
                break
    more = _more_devices(ctx)
    if more:
        out.append(more)
    smaller = _smaller_batch(ctx)
    if smaller:
        out.append(smaller)
    return out


def _more_devices(ctx: _Context) -> str:
    """"k times the devices would fit" when some small multiple does."""
    hosts = list(ctx.devices.hosts) if isinstance(ctx.devices, DeviceLayout) \
        else _hosts_of(ctx.devices)
    for times in (2, 4, 8, 16, 32, 64):
        if len(ctx.devices) * times > 65536:
            break
        trial = [h for _ in range(times) for h in hosts]
        units = ctx.model.split_units
        if units and units < len(ctx.devices) * times:
            break
        if _fits_with(ctx, devices=DeviceLayout(trial)):
            return (f"more devices: {times}x this cluster "
                    f"({len(ctx.devices) * times} devices) fits, with ZeRO "
                    f"and split layers sharded further and the same global "
                    f"batch")
    return ""


def _hosts_of(devices: Sequence[ClusterDevice]) -> list[HostSpec]:
    """HostSpecs of a device list."""
    counts: dict[int, list[ClusterDevice]] = {}
    for device in devices:
        counts.setdefault(device.host, []).append(device)
    return [HostSpec(members[0].profile, len(members), members[0].network)
            for _, members in sorted(counts.items())]


def _smaller_batch(ctx: _Context) -> str:
    """"a global batch of at most B fits" when a smaller batch does."""
    if ctx.global_batch <= 1 or not _fits_with(ctx, global_batch=1):
        return ""
    low, high = 1, ctx.global_batch - 1
    while low < high:
        mid = (low + high + 1) // 2
        if _fits_with(ctx, global_batch=mid):
            low = mid
        else:
            high = mid - 1
    return f"a smaller global batch: at most {low} examples fit"


def _nothing_fits(ctx: _Context, alts: Sequence[Alternative]) -> str:
    """The ClusterError message when no alternative fits."""
    lines = [f"model {ctx.model.name!r} does not fit on this cluster under "
             f"any plan (global batch {ctx.global_batch}, optimizer "
             f"{ctx.optimizer}, {len(ctx.devices)} devices)."]
    closest = _closest(alts)
    if closest is not None:
        lines.append(f"Closest plan: {closest.name}. Per device:")
        items = []
        for load in closest.loads:
            items.append((load.device.index, load.device.profile.name,
                          _shortfall_text(load)))
        lines += ["  " + line for line in balance.grouped_lines(items)]
        lines.append("What would help:")
        lines += [f"  - {text}" for text in _remedies(ctx, closest)]
    lines.append("Rejected plans:")
    lines += [f"  - {a.name}: {a.reason}" for a in alts]
    return "\n".join(lines)


def _shortfall_text(load: DeviceLoad) -> str:
    """One device's need against its memory."""
    parts = (f"parameters {gb(load.parameters)}, gradients "
             f"{gb(load.gradients)}, optimizer {gb(load.optimizer)}, "
             f"activations {gb(load.activations)}")
    if load.shortfall > 0:
        text = (f"needs {gb(load.total)} with {gb(load.usable)} usable: "
                f"short by {gb(load.shortfall)} ({parts})")
    else:
        text = f"needs {gb(load.total)} with {gb(load.usable)} usable: fits"
    if load.host_shortfall > 0:
        text += (f"; host memory {gb(load.host_bytes)} with "
                 f"{gb(load.host_usable)}: short by "
                 f"{gb(load.host_shortfall)}")
    return text
