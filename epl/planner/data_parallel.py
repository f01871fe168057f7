"""The data-parallel alternatives: each device's state, batch and experts.

`data_parallel_alternative` evaluates one data-parallel alternative (even or
balanced by capability, with gradient checkpointing and ZeRO as asked): per
group of identical devices where that gives the per-device answer, else
device by device, trying the candidate expert placements and batch blends
and keeping the fastest assignment that fits.  The search
(`epl.planner.search`) lists the alternatives and chooses among them; costs
come from `epl.planner.step_cost`, shares and shards from
`epl.planner.balance`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from epl.errors import ClusterError
from epl.planner import balance
from epl.planner.devices import ClusterDevice, DeviceLayout, runs_count
from epl.planner.results import Alternative, DeviceLoad, memory_reason
from epl.planner.step_cost import (Context, Totals, alltoall_time,
                                   allreduce_time, per_example_time,
                                   ring_link, slowest_link, layer_totals,
                                   exposed_alltoall_time, input_time)


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


def _device_state(ctx: Context, totals: Totals, units: int, n: int,
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


def _barriers(ctx: Context, totals: Totals) -> bool:
    """Whether the devices meet at an expert all-to-all in every split
    layer (then the replicated and the expert work are balanced apart)."""
    return bool(totals.alltoall) and len(ctx.devices) > 1 and \
        ctx.model.split_units > 0


def _split_time(ctx: Context, device: ClusterDevice, totals: Totals
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


def _split_placements(ctx: Context, totals: Totals, caps: list[float],
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
    it sends (`alltoall_time`); when the two shares differ, the hosts
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
        speed = [1.0 / (per_example_time(ctx, d, totals) + seconds)
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


def data_parallel_alternative(ctx: Context, name: str, balanced: bool,
                   checkpointing: bool, zero: bool) -> Alternative:
    """Evaluate one data-parallel alternative: per group of identical
    devices where that gives the per-device answer (`_grouped_data_parallel`),
    else device by device (`_per_device_data_parallel`)."""
    grouped = _grouped_data_parallel(ctx, name, balanced, checkpointing, zero)
    if grouped is not None:
        return grouped
    return _per_device_data_parallel(ctx, name, balanced, checkpointing, zero)




def _grouped_data_parallel(ctx: Context, name: str, balanced: bool,
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
    totals = layer_totals(ctx.model.layers, checkpointing)
    reps = [c.representative for c in classes]
    state = _device_state(ctx, totals, 0, n, zero)
    fixed = state.parameters + state.gradients + state.optimizer + \
        state.activations
    members = [c.runs for c in classes]
    if balanced:
        caps = [1.0 / per_example_time(ctx, d, totals) for d in reps]
        busy = [ctx.update_time(d, state.update_bytes) for d in reps]
        limits = balance.unit_limits([fixed] * len(reps),
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
    comm = allreduce_time(reps, totals.params, ring_link(ctx), n) + \
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
    reason = memory_reason(rows)
    return Alternative(name, tuple(rows), not reason, reason, checkpointing,
                       zero, layout=layout)


def _per_device_data_parallel(ctx: Context, name: str, balanced: bool,
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
    totals = layer_totals(ctx.model.layers, checkpointing)
    # Capability is compute speed: the all-to-all is one exchange every
    # device waits for (`alltoall_time`), not a per-device cost to balance.
    caps = [1.0 / per_example_time(ctx, d, totals) for d in devices]
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
            reason = memory_reason(loads)
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


def _busy_time(ctx: Context, device: ClusterDevice, totals: Totals,
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


def _batch_sizes(ctx: Context, devices: Sequence[ClusterDevice],
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


def _dp_loads(ctx: Context, totals: Totals, units: list[int],
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
    bandwidth, _ = slowest_link(devices)
    allreduce = allreduce_time(devices, totals.params, bandwidth) + \
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
        ctx, totals, alltoall_time(ctx, totals, units, batch), max(expert),
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
