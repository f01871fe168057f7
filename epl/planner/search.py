"""The plan search: the pipeline alternative, the listing, and the choice.

`plan_cluster` evaluates the alternatives the options allow (data-parallel
even and balanced, with gradient checkpointing and ZeRO, evaluated by
`epl.planner.data_parallel`; pipelines, evaluated here), chooses the
simplest feasible one within `CHOICE_TOLERANCE` of the fastest, and
returns a `ClusterPlan`; when nothing fits, the ClusterError says why and
what would help (each remedy checked by re-planning).  Costs come from
`epl.planner.step_cost`, shares from `epl.planner.balance`, stage cuts
from `epl.planner.stage_cuts`, the
text from `epl.planner.explain`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from epl.errors import ClusterError, ConfigError
from epl.planner import balance, stage_cuts
from epl.planner import roofline as cm
from epl.planner.balance import gb
from epl.planner.data_parallel import data_parallel_alternative
from epl.planner.devices import ClusterDevice, DeviceLayout
from epl.planner.explain import explain_text, plan_dict
from epl.planner.model_spec import ModelSpec
from epl.planner.results import (CHOICE_TOLERANCE, Alternative, DeviceLoad,
                                 PlanOptions, memory_reason)
from epl.planner.step_cost import (Context, Totals, allreduce_time,
                                   per_example_time, input_time,
                                   merge_op_counts, slowest_link, layer_totals)
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
# Pipeline alternative.
# --------------------------------------------------------------------------

def _pipeline(ctx: Context, stages: int, checkpointing: bool
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
    order = stage_cuts.stage_device_order(
        [ctx.usable(d) for d in devices],
        [1.0 / per_example_time(ctx, d, layer_totals(layers, False))
         for d in devices])
    groups = [[devices[order[s * replicas + r]] for s in range(stages)]
              for r in range(replicas)]
    per_layer = [layer_totals([l], checkpointing) for l in layers]
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
    reason = memory_reason(loads)
    return Alternative(name, tuple(loads), not reason, reason, checkpointing,
                       pipeline_stages=stages, num_micro_batch=micro)


def _pipeline_precheck(ctx: Context, stages: int) -> str:
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


def _cut_pipeline(ctx: Context, group: list[ClusterDevice],
                  per_layer: list[Totals], micro_batch: int
                  ) -> stage_cuts.StageCuts:
    """Stage cuts of one pipeline for micro-batches of `micro_batch`."""
    stages = len(group)
    rates = [sum(t.flops for t in per_layer) /
             per_example_time(ctx, d, _sum_totals(per_layer))
             for d in group]
    state = 0 if ctx.options.offload else 2 + ctx.slots
    return stage_cuts.balance_stages(
        [t.flops for t in per_layer], rates,
        [ctx.usable(d) for d in group],
        [t.params * state for t in per_layer],
        [t.act * micro_batch for t in per_layer],
        _stage_inflight(stages, ctx.options.num_micro_batch),
        [d.profile.name for d in group], order_by_memory=False)


def _sum_totals(per_layer: list[Totals]) -> Totals:
    """Totals of several layers' totals (no split parts in pipelines)."""
    return Totals(
        flops=sum(t.flops for t in per_layer),
        bytes=sum(t.bytes for t in per_layer),
        act=sum(t.act for t in per_layer),
        params=sum(t.params for t in per_layer), split_params=0.0,
        split_flops=0.0, split_bytes=0.0, split_act=0.0, alltoall=0.0,
        largest_layer_params=max(t.params for t in per_layer),
        largest_layer_split_params=0.0,
        op_counts=merge_op_counts(t.op_counts for t in per_layer))


def _pipeline_batches(ctx: Context, groups, cuts, per_layer) -> list[int]:
    """Batch per pipeline, proportional to its throughput."""
    caps = []
    for group, cut in zip(groups, cuts):
        slowest = max(_sum_totals(per_layer[a:b]).flops / max(
            _stage_rate(ctx, d, per_layer), 1e-30)
            for d, (a, b) in zip(group, cut.bounds))
        caps.append(1.0 / slowest)
    return balance.proportional_shares(ctx.global_batch, caps)


def _stage_rate(ctx: Context, device: ClusterDevice,
                per_layer: list[Totals]) -> float:
    """Effective FLOP/s of `device` on this model."""
    whole = _sum_totals(per_layer)
    return whole.flops / per_example_time(ctx, device, whole)


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


def _pipeline_loads(ctx: Context, groups, cuts, per_layer, batch
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
        bandwidth, _ = slowest_link(members)
        for r, (group, cut) in enumerate(zip(groups, cuts)):
            part = totals[r][s]
            mb = batch[r] / micro
            compute = micro_batches[r] + \
                ctx.update_time(group[s], part.params) + \
                ctx.session_time(group[s])
            comm = allreduce_time(members, part.params, bandwidth) + reads
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

def as_model(model: Any, amp_dtype: Any = None) -> ModelSpec:
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


def _alternatives(ctx: Context) -> list[Alternative]:
    """Every alternative the options allow, in listing order."""
    opts = ctx.options
    alts = [data_parallel_alternative(ctx, "data-parallel, even split", False, False,
                           False),
            data_parallel_alternative(ctx, "data-parallel, balanced by capability",
                           True, False, False)]
    if opts.try_checkpointing:
        alts.append(data_parallel_alternative(
            ctx, "data-parallel, balanced + gradient checkpointing", True,
            True, False))
    if opts.try_zero:
        alts.append(data_parallel_alternative(ctx, "data-parallel, balanced + ZeRO",
                                   True, False, True))
    if opts.try_zero and opts.try_checkpointing:
        alts.append(data_parallel_alternative(
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
             global_batch: int, options: PlanOptions) -> Context:
    """Validated evaluation context."""
    return _device_context(model, DeviceLayout(hosts), optimizer,
                           global_batch, options)


def _device_context(model: ModelSpec, devices: Sequence[ClusterDevice],
                    optimizer: str, global_batch: int, options: PlanOptions
                    ) -> Context:
    """Validated evaluation context over `devices` (a DeviceLayout, or a
    list of ClusterDevices)."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) \
            or global_batch < 1:
        raise ConfigError(f"the global batch must be a positive int, got "
                          f"{global_batch!r}")
    return Context(model=model, devices=devices,
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
    spec = as_model(model, amp_dtype)
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
    spec = as_model(model)
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


def _fits_with(ctx: Context, **changes: Any) -> bool:
    """Whether some alternative fits after `changes` to the context."""
    trial = dataclasses.replace(ctx, **changes)
    return any(a.feasible for a in _alternatives(trial))


def _remedies(ctx: Context, closest: Alternative) -> list[str]:
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


def _more_devices(ctx: Context) -> str:
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


def _smaller_batch(ctx: Context) -> str:
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


def _nothing_fits(ctx: Context, alts: Sequence[Alternative]) -> str:
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
