"""The hardware-aware planner: who does how much, and whether it fits.

`plan_cluster(model, hosts, optimizer, global_batch, options)` takes a model
(a tf.Graph / GraphDef / analysed TrainingView, or a `ModelSpec` describing
the model as a list of layer costs), a cluster (a list of
`epl.profiles.HostSpec`, or a cluster string such as "2x8xV100-32GB,2x8xT4")
and returns a `ClusterPlan`: for each alternative it considered, the work,
memory and predicted time of every device, and whether it fits; the fastest
alternative that fits is chosen.  `ClusterPlan.explain()` is what `epl-plan`
prints.

Alternatives
------------
- data-parallel, even split: every device holds a replica and gets
  global_batch / n examples.
- data-parallel, balanced by capability: batch shares proportional to each
  device's predicted examples/s, moved off devices that would run out of
  memory (`epl.planner.balance.balance_batch`).
- the balanced plan with gradient checkpointing, with ZeRO, and with both.
- pipeline: when the model has several annotated stages (TaskGraphs) or
  `PlanOptions.pipeline_stages` is set: stages cut by `balance_stages` over
  the model's layers, earlier stages on devices with more memory, pipelines
  replicated over the remaining devices and given batch shares by their
  throughput.
A model with split (expert) layers shards those layers' units (experts) over
all devices; each device runs its experts on the tokens sent to them (the
MoE layer dispatches every example's capacity slots to every expert, so a
device receives tokens in proportion to its experts).  Even: as many experts
per device.  Balanced: the plan tries expert placements from the even one to
the one proportional to the devices' speed on the experts' work
(`_split_placements`), and for each the batch balanced by capability and, for
a model with an expert all-to-all, batches between it and the even split or
the batch that follows the experts (`_blended_batches`); it keeps the one
with the shortest predicted step.
Balancing compute alone is not enough there: the fast hosts' larger batches
send more tokens across the network.  This departs from DESIGN.md's rule
(the Whale paper's: load proportional to capability) for such models only;
the candidates include the capability-proportional assignment, so the
search never predicts a slower step than the rule.

The model of one device
-----------------------
- Memory: parameters, gradients (as large as the parameters), optimizer
  slots (`cost_model.optimizer_slots` per parameter, in the parameters'
  dtype) and activations kept for the backward pass.  ZeRO (stage 1, as
  graph_passes/zero.py builds it) divides the optimizer slots and the update
  of replicated parameters by the number of data-parallel devices; each
  device keeps its full gradients and adds a working copy of its parameter
  shard (1/n of the parameters).  Gradient checkpointing keeps about sqrt(n)
  activations (`cost_model.checkpointed_bytes`) and recomputes the forward
  pass once more.  Offload keeps parameters, gradients and optimizer state
  in host memory (checked against `host_memory_per_device`); the device
  holds a double-buffered copy of the largest layer's parameters and one
  layer's gradients, and the optimizer update runs on the host.
- A device may use `usable_fraction` of its memory (the runtime and CUDA
  context take the rest).
- Compute: `cost_model.predict_time` (roofline at `efficiency` of peak) of
  the device's FLOPs and bytes: its examples' forward and backward, its
  experts' share, and the optimizer update of the parameters it updates.
  With an expert all-to-all every split layer's exchange is a barrier, so
  the step pays the slowest device's replicated work plus the slowest
  device's expert work; a device done early waits (`DeviceLoad.wait_s`).
- Communication: a ring all-reduce of the replicated gradients over the
  data-parallel devices (`cost_model.comm_time`) at the bandwidth of the
  link that bounds the ring (`_slowest_link`); the expert all-to-all
  (dispatch and combine, forward and backward; `_alltoall_time`): each
  device's tokens go to every device in proportion to its experts, within
  the host over each device's intra-node link, to other hosts through the
  host's network; one exchange that every device waits for, as long as its
  busiest link; offload traffic over
  `host_link_bandwidth` (parameters in for the forward and the backward,
  gradients out).  Communication is not overlapped with compute, so
  predicted step times are upper bounds.
- The network: each host has `HostSpec.network`, k NICs of some rate (from
  the cluster string, "8xA100@8x200Gbps"; by default one NIC at the
  profile's inter_node_bandwidth, 100 Gb/s).  Its bandwidth is k x rate per
  direction.  A ring all-reduce across hosts crosses every host boundary;
  with k NICs per host NCCL runs k rings side by side, one per NIC, so the
  crossings go k times faster: the ring runs at the slowest host's network
  bandwidth (or at the slowest intra-node link of a host holding several
  of the ring's devices, if that is slower).  In the all-to-all, each host
  sends and receives its own devices' traffic with other hosts through its
  own NICs (both directions at once); the busiest host binds.  The
  network's latency, congestion and
  topology (switch tiers, oversubscription) are not modelled.
- Pipeline: a step takes (micro-batches + stages - 1) x the slowest stage's
  time per micro-batch (GPipe/1F1B bubble), stage s keeps
  min(stages - s, micro-batches) micro-batches' activations alive; the
  activations sent between stages are not counted.

The chosen plan is the simplest (earliest listed) feasible alternative whose
predicted step time is within 3% of the fastest one's (`CHOICE_TOLERANCE`, a
simplicity margin): the model is not precise enough to prefer ZeRO or
checkpointing for a smaller gain; explain() says so next to a faster
alternative that was not chosen.

Groups of identical devices
---------------------------
Devices of the same profile on hosts with the same device count and network
form a `DeviceClass` (`epl.planner.devices`); the cluster is a
`DeviceLayout` that makes a `ClusterDevice` only when asked.  Data-parallel
alternatives of models without split layers are computed once per class
(`_grouped_data_parallel`): the batch shares are the same exact quotas and
rounding as device by device (`balance.grouped_proportional_shares`), so a
class is one or two `DeviceLoad` rows with a `count`; where an assignment
would not fit (examples would move one by one) the per-device computation
runs, as it does for split layers (at most as many devices as experts) and
pipelines.  `Alternative.rows` holds the rows, `Alternative.loads` one load
per device (expanded on first use).  Everything is deterministic: the same inputs give the same
plan and text.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from epl.errors import ClusterError, ConfigError
from epl.planner import balance
from epl.planner import roofline as cm
from epl.planner.balance import GiB, gb, index_ranges
from epl.planner.devices import (ClusterDevice, DeviceClass,  # noqa: F401 (re-exported)
                                 DeviceLayout, Runs, cluster_devices,
                                 merge_runs, runs_count, runs_text)
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.profiles import (PCIE3_X16, DeviceProfile, HostNetwork, HostSpec,
                          normalize_dtype, parse_cluster)

#: Usable share of a device's memory (the runtime and CUDA context take
#: some; profiles.py asks the planner to keep headroom).
DEFAULT_USABLE_FRACTION = 0.95
#: Host memory per device: a typical 8-GPU server with 1.5 TiB of RAM.
DEFAULT_HOST_MEMORY_PER_DEVICE = 1.5 * (1 << 40) / 8
#: Apply-op name (cost_model.APPLY_OPS) behind each optimizer name.
_APPLY_OP_OF = {
    "sgd": "GradientDescent", "gradientdescent": "GradientDescent",
    "momentum": "Momentum", "nesterov": "Momentum", "adam": "Adam",
    "adamw": "Adam", "lazyadam": "Adam", "adamax": "AdaMax", "nadam": "Adam",
    "lamb": "Adam", "adagrad": "Adagrad", "rmsprop": "RMSProp",
    "centeredrmsprop": "CenteredRMSProp", "adadelta": "Adadelta",
    "ftrl": "Ftrl",
}


# --------------------------------------------------------------------------
# Model descriptions.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Totals:
    """Summed figures of some layers (per example or per step)."""

    flops: float
    bytes: float
    act: float
    params: float
    split_params: float
    split_flops: float
    split_bytes: float
    split_act: float
    alltoall: float
    largest_layer_params: float
    largest_layer_split_params: float


def _checkpointed(layers: Sequence[LayerSpec]) -> tuple[float, float]:
    """(replicated, split) activation bytes per example under checkpointing."""
    given = sum(l.checkpointed_activation_bytes_per_example or 0.0
                for l in layers)
    free = [l.activation_bytes_per_example + l.split_activation_bytes_per_example
            for l in layers if l.checkpointed_activation_bytes_per_example is None]
    kept = given + (cm.checkpointed_bytes(free) if free else 0.0)
    full = sum(l.activation_bytes_per_example
               + l.split_activation_bytes_per_example for l in layers)
    split = sum(l.split_activation_bytes_per_example for l in layers)
    ratio = kept / full if full else 0.0
    return kept - split * ratio, split * ratio


def _totals(layers: Sequence[LayerSpec], checkpointing: bool) -> _Totals:
    """Sum `layers`; with checkpointing, add the recompute and cut activations."""
    def total(field: str) -> float:
        return float(sum(getattr(l, field) for l in layers))

    flops, split_flops = total("flops_per_example"), total(
        "split_flops_per_example")
    act, split_act = total("activation_bytes_per_example"), total(
        "split_activation_bytes_per_example")
    if checkpointing:
        flops += sum(l.flops_per_example / 3 if l.recompute_flops_per_example
                     is None else l.recompute_flops_per_example
                     for l in layers)
        split_flops += split_flops / 3
        act, split_act = _checkpointed(layers)
    traffic, split_traffic = total("bytes_per_example"), total(
        "split_bytes_per_example")
    if checkpointing:  # the recomputed forward moves its bytes again
        traffic, split_traffic = traffic * 4 / 3, split_traffic * 4 / 3
    return _Totals(
        flops=flops, bytes=traffic, act=act,
        params=total("parameter_bytes"),
        split_params=total("split_parameter_bytes"),
        split_flops=split_flops, split_bytes=split_traffic,
        split_act=split_act, alltoall=total("alltoall_bytes_per_example"),
        largest_layer_params=max(l.parameter_bytes for l in layers),
        largest_layer_split_params=max(l.split_parameter_bytes
                                       for l in layers))


# --------------------------------------------------------------------------
# Devices and options.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How the planner models the devices and what it may try.

    Attributes:
        efficiency: fraction of peak FLOP/s a step reaches.
        usable_fraction: fraction of device memory a plan may use.
        offload: keep parameters, gradients and optimizer state in host
            memory.
        host_memory_per_device: host bytes available per device (offload).
        host_link_bandwidth: device <-> host bytes/s (offload traffic).
        pipeline_stages: stages to try a pipeline with (None: the model's
            annotated stages when it has several).
        num_micro_batch: micro-batches per pipeline step.
        try_checkpointing / try_zero: consider those alternatives.
        compute_dtype: overrides the model's compute dtype (e.g. "float16").
    """

    efficiency: float = cm.DEFAULT_EFFICIENCY
    usable_fraction: float = DEFAULT_USABLE_FRACTION
    offload: bool = False
    host_memory_per_device: float = DEFAULT_HOST_MEMORY_PER_DEVICE
    host_link_bandwidth: float = float(PCIE3_X16)
    pipeline_stages: int | None = None
    num_micro_batch: int = 4
    try_checkpointing: bool = True
    try_zero: bool = True
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.usable_fraction <= 1:
            raise ConfigError(f"usable_fraction must be in (0, 1], got "
                              f"{self.usable_fraction!r}")
        if self.num_micro_batch < 1:
            raise ConfigError(f"num_micro_batch must be >= 1, got "
                              f"{self.num_micro_batch!r}")
        if self.pipeline_stages is not None and self.pipeline_stages < 1:
            raise ConfigError(f"pipeline_stages must be >= 1, got "
                              f"{self.pipeline_stages!r}")


# --------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    """What one device does and holds under one alternative.

    Bytes are on the device unless named host; times are seconds per step.
    One DeviceLoad may stand for `count` identical devices that do the
    same (`runs`: their indices; `device`: the first of them): the planner
    computes a group of identical devices once.
    """

    device: ClusterDevice
    batch: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    usable: float
    compute_s: float
    comm_s: float
    wait_s: float = 0.0  # idle at the expert all-to-all barriers
    host_bytes: float = 0.0
    host_usable: float = math.inf
    shards: int | None = None
    stage: int | None = None
    layers: tuple[int, int] | None = None
    count: int = 1  # devices this row stands for (identical ones)
    runs: Runs = ()  # their indices, when count > 1 or given

    @property
    def device_runs(self) -> Runs:
        """Indices of the devices this row stands for, as (first, end) runs."""
        return self.runs or ((self.device.index, self.device.index + 1),)

    @property
    def total(self) -> float:
        """Device bytes: parameters + gradients + optimizer + activations."""
        return self.parameters + self.gradients + self.optimizer + \
            self.activations

    @property
    def shortfall(self) -> float:
        """Bytes over the usable device memory (0 when it fits)."""
        return max(self.total - self.usable, 0.0)

    @property
    def host_shortfall(self) -> float:
        """Bytes over the usable host memory (0 when it fits)."""
        return max(self.host_bytes - self.host_usable, 0.0)

    @property
    def fits(self) -> bool:
        """Whether the device (and its host share) holds everything."""
        slack = 1e-9 * max(self.usable, 1.0)
        return self.total <= self.usable + slack and \
            self.host_bytes <= self.host_usable + slack

    @property
    def step_s(self) -> float:
        """Compute, waiting for slower devices, and communication time."""
        return self.compute_s + self.wait_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One candidate plan.

    Attributes:
        name: e.g. "data-parallel, balanced by capability".
        rows: the intended assignment (also when rejected): one DeviceLoad
            per device, or per group of identical devices doing the same
            (`DeviceLoad.count`); `loads` has one per device.
        feasible: every device fits.
        reason: why it was rejected ("" when feasible).
        checkpointing / zero / pipeline_stages: what it uses.
        num_micro_batch: micro-batches per step (pipelines).
        layout: the cluster's DeviceLayout (to expand grouped rows).
    """

    name: str
    rows: tuple[DeviceLoad, ...]
    feasible: bool
    reason: str = ""
    checkpointing: bool = False
    zero: bool = False
    pipeline_stages: int = 1
    num_micro_batch: int = 1
    layout: Any = dataclasses.field(default=None, compare=False, repr=False)

    @functools.cached_property
    def loads(self) -> tuple[DeviceLoad, ...]:
        """One DeviceLoad per device, in device index order (grouped rows
        expanded: for a huge cluster, use `rows`)."""
        if all(row.count == 1 and not row.runs for row in self.rows):
            return self.rows
        out = []
        for row in self.rows:
            for first, end in row.device_runs:
                out += [dataclasses.replace(row, device=self.layout[i],
                                            count=1, runs=())
                        for i in range(first, end)]
        return tuple(sorted(out, key=lambda load: load.device.index))

    @property
    def step_time(self) -> float:
        """Predicted seconds per step (the slowest device)."""
        return max(load.step_s for load in self.rows) if self.rows \
            else math.inf

    @property
    def batch_runs(self) -> list[tuple[int, int]]:
        """Per data-parallel replica batch sizes as (size, replicas) runs in
        device order (what `batch_sizes` lists one by one)."""
        parts = sorted((first, end, row.batch) for row in self.rows
                       if row.stage in (None, 0)
                       for first, end in row.device_runs)
        runs: list[list[int]] = []
        for first, end, batch in parts:
            if runs and runs[-1][0] == batch:
                runs[-1][1] += end - first
            else:
                runs.append([batch, end - first])
        return [(size, count) for size, count in runs]

    @property
    def batch_sizes(self) -> list[int]:
        """Per data-parallel replica batch sizes (one per device for data
        parallelism; one per pipeline, from its first stage, for pipelines).
        """
        return [size for size, count in self.batch_runs
                for _ in range(count)]


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
        return _explain(self)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (`epl-plan --json`): the model, the
        chosen plan with one row per group of identical devices, every
        alternative with its predicted step time or the constraint that
        ruled it out, the choice rule and the unknown op types.  Bytes are
        plain numbers of bytes, times seconds."""
        return _plan_dict(self)


# --------------------------------------------------------------------------
# Evaluation context.
# --------------------------------------------------------------------------

def optimizer_update_cost(parameter_bytes: float, dtype_bytes: int,
                          optimizer: str) -> cm.GroupCost:
    """FLOPs and bytes of one optimizer update of `parameter_bytes`."""
    slots = cm.optimizer_slots(optimizer)
    key = re.sub(r"[^a-z0-9]", "", str(optimizer).lower())
    key = re.sub(r"optimizer$", "", key) or key
    per_element = cm.APPLY_OPS.get(_APPLY_OP_OF.get(key, ""), (2 + 4 * slots,
                                                                slots))[0]
    elements = parameter_bytes / dtype_bytes
    return cm.GroupCost(flops=elements * per_element,
                        bytes=parameter_bytes * (3 + 2 * slots))


@dataclasses.dataclass
class _Context:
    """What every alternative's evaluation reads."""

    model: ModelSpec
    devices: list[ClusterDevice]
    optimizer: str
    slots: int
    global_batch: int
    options: PlanOptions
    dtype: str

    def usable(self, device: ClusterDevice) -> float:
        """Bytes a plan may use on `device`."""
        return device.profile.memory_bytes * self.options.usable_fraction

    def time(self, device: ClusterDevice, flops: float, nbytes: float
             ) -> float:
        """Roofline seconds of (flops, bytes) on `device`."""
        if flops <= 0 and nbytes <= 0:
            return 0.0
        return cm.predict_time(cm.GroupCost(flops=flops, bytes=nbytes),
                               device.profile, self.dtype,
                               self.options.efficiency)

    def update_time(self, device: ClusterDevice, param_bytes: float) -> float:
        """Seconds of the optimizer update of `param_bytes` on `device`
        (zero under offload: the host runs it)."""
        if self.options.offload or param_bytes <= 0:
            return 0.0
        cost = optimizer_update_cost(param_bytes,
                                     self.model.parameter_dtype_bytes,
                                     self.optimizer)
        return self.time(device, cost.flops, cost.bytes)


def _slowest_link(devices: Sequence[ClusterDevice]) -> tuple[float, str]:
    """(bytes/s, "inter-node" or "intra-node") that bounds a ring all-reduce
    over `devices`.

    Within one host: the slowest device's intra-node link.  Across hosts:
    NCCL runs one ring per NIC, each crossing every host boundary through
    its own NIC, so the crossings go at the host's whole network bandwidth
    (NICs x rate); the slowest host's network binds, unless the intra-node
    link of a host with several of the devices is slower still.
    """
    per_host: dict[int, int] = {}
    for device in devices:
        per_host[device.host] = per_host.get(device.host, 0) + 1
    if len(per_host) == 1:
        return min(d.profile.intra_node_bandwidth for d in devices), \
            "intra-node"
    network = min(d.network.bandwidth for d in devices)
    intra = [d.profile.intra_node_bandwidth for d in devices
             if per_host[d.host] > 1]
    if intra and min(intra) < network:
        return min(intra), "intra-node"
    return network, "inter-node"


def _alltoall_time(ctx: _Context, totals: _Totals, units: Sequence[int],
                   batch: Sequence[int]) -> float:
    """Seconds of one step's expert all-to-all (every split layer's dispatch
    and combine, forward and backward); every device waits for all of it.

    A device's tokens go to device e in proportion to e's experts, u_e / U
    (the MoE layer sends every example's capacity slots for every expert):
    a host holding many experts keeps more of its own tokens.  Per
    example, A bytes travel (`alltoall`).
    - Within host h (U_h experts): device d sends b_d A (U_h - u_d) / U to
      its host's other devices and receives (B_h - b_d) A u_d / U from them,
      both at once, over its intra-node link.
    - Across hosts: host h sends B_h A (U - U_h) / U and receives
      (B - B_h) A U_h / U through its own network (all its NICs, each
      direction at its full bandwidth).
    The exchange takes as long as its busiest link, on whichever host.
    """
    units_total = sum(units)
    if len(ctx.devices) <= 1 or not totals.alltoall or not units_total:
        return 0.0
    per_unit = totals.alltoall / units_total
    host_units: dict[int, int] = {}
    host_batch: dict[int, int] = {}
    for device, u, b in zip(ctx.devices, units, batch):
        host_units[device.host] = host_units.get(device.host, 0) + u
        host_batch[device.host] = host_batch.get(device.host, 0) + b
    total_batch = sum(batch)
    seconds = 0.0
    for device, u, b in zip(ctx.devices, units, batch):
        h = device.host
        sent = b * per_unit * (host_units[h] - u)
        received = (host_batch[h] - b) * per_unit * u
        seconds = max(seconds, max(sent, received)
                      / device.profile.intra_node_bandwidth)
    networks = {d.host: d.network.bandwidth for d in ctx.devices}
    for h, bandwidth in networks.items():
        sent = host_batch[h] * per_unit * (units_total - host_units[h])
        received = (total_batch - host_batch[h]) * per_unit * host_units[h]
        seconds = max(seconds, max(sent, received) / bandwidth)
    return seconds


def _per_example_time(ctx: _Context, device: ClusterDevice,
                      totals: _Totals) -> float:
    """Seconds per example of the replicated part on `device`."""
    seconds = ctx.time(device, totals.flops, totals.bytes)
    if seconds <= 0:  # a model with only split layers
        seconds = ctx.time(device, totals.split_flops, totals.split_bytes)
    return seconds if seconds > 0 else 1.0 / device.profile.flops(ctx.dtype)


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
    # ZeRO stage 1 as graph_passes/zero.py builds it: full gradients, slots and
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


def _ring_link(ctx: _Context) -> float:
    """`_slowest_link` of the whole cluster, from its device classes."""
    layout = ctx.devices
    if len(layout.hosts) == 1:
        return _slowest_link([c.representative
                              for c in layout.classes])[0]
    return _cluster_link(layout)[0]


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
    comm = cm.comm_time(totals.params, _ring_link(ctx), n) + \
        state.offload_traffic / ctx.options.host_link_bandwidth
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
                                   batch * totals.bytes)
                + ctx.update_time(device, state.update_bytes),
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
    """
    devices, n = ctx.devices, len(ctx.devices)
    bandwidth, _ = _slowest_link(devices)
    allreduce = cm.comm_time(totals.params, bandwidth, n)
    alltoall = _alltoall_time(ctx, totals, units, batch)
    dense, expert = [], []
    for device, u, b in zip(devices, units, batch):
        share = u / ctx.model.split_units if ctx.model.split_units else 0.0
        tokens = ctx.global_batch * share
        dense.append(ctx.time(device, b * totals.flops, b * totals.bytes))
        expert.append(ctx.time(device, tokens * totals.split_flops,
                               tokens * totals.split_bytes))
    barrier = _barriers(ctx, totals)
    loads = []
    for device, u, state, b, d, e in zip(devices, units, states, batch,
                                         dense, expert):
        compute = d + e + ctx.update_time(device, state.update_bytes)
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
            shards=u if ctx.model.split_units else None))
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
        largest_layer_split_params=0.0)


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


def _pipeline_loads(ctx: _Context, groups, cuts, per_layer, batch
                    ) -> list[DeviceLoad]:
    """Per-device loads of a pipeline plan, in device index order."""
    micro, stages = ctx.options.num_micro_batch, len(groups[0])
    inflight = _stage_inflight(stages, micro)
    loads = []
    for s in range(stages):
        members = [group[s] for group in groups]
        bandwidth, _ = _slowest_link(members)
        for r, (group, cut) in enumerate(zip(groups, cuts)):
            a, b = cut.bounds[s]
            part = _sum_totals(per_layer[a:b])
            mb = batch[r] / micro
            per_mb = [ctx.time(d, _sum_totals(per_layer[x:y]).flops * mb,
                               _sum_totals(per_layer[x:y]).bytes * mb)
                      for d, (x, y) in zip(group, cut.bounds)]
            compute = (micro + stages - 1) * max(per_mb) + ctx.update_time(
                group[s], part.params)
            comm = cm.comm_time(part.params, bandwidth, len(groups))
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
                stage=s, layers=(a, b)))
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
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) \
            or global_batch < 1:
        raise ConfigError(f"the global batch must be a positive int, got "
                          f"{global_batch!r}")
    return _Context(model=model, devices=DeviceLayout(hosts),
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


#: Alternatives within this fraction of the fastest count as equally fast;
#: the simplest of them (earliest in listing order) is chosen.
CHOICE_TOLERANCE = 0.03


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


# --------------------------------------------------------------------------
# explain().
# --------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    """Seconds as milliseconds: one decimal, or 3 significant digits below
    10 ms."""
    ms = seconds * 1e3
    if ms == 0 or ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.3g}"


def _flops_text(flops: float) -> str:
    """"70.2 GFLOP", "812 kFLOP"..."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"),
                        (1e6, "MFLOP"), (1e3, "kFLOP")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(nbytes: float) -> str:
    """Bytes in the binary unit that suits the value: "0", "512 B",
    "3.2 KiB", "419.3 MiB", "30.4 GiB", "1.5 TiB" (one decimal, the
    figure below 1024 of its unit)."""
    if nbytes <= 0:
        return "0"
    value, unit = float(nbytes), 0
    while value >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{value:.0f} B"
    if round(value, 1) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {_BINARY_UNITS[unit]}"


_num = size_text


def _table(plan: ClusterPlan, alt: Alternative) -> list[str]:
    """The per-device table of `alt`, identical rows collapsed."""
    offload = plan.options.offload
    split = plan.model.split_units > 0
    pipeline = alt.pipeline_stages > 1
    header = ["devices", "hosts", "profile", "batch"]
    header += ["shards"] if split else []
    header += ["stage", "layers"] if pipeline else []
    header += ["params", "grads", "optim", "activ", "total/usable"]
    header += ["host/usable"] if offload else []
    header += ["compute ms", "comm ms"]
    wait = any(load.wait_s for load in alt.rows)
    header += ["wait ms"] if wait else []
    header += ["count"]
    rows: dict[tuple, list[tuple[int, int]]] = {}
    for load in alt.rows:
        row = [load.device.profile.name, str(load.batch)]
        row += [str(load.shards)] if split else []
        if pipeline:
            a, b = load.layers
            row += [str(load.stage), f"{a}-{b - 1}"]
        row += [_num(load.parameters), _num(load.gradients),
                _num(load.optimizer), _num(load.activations),
                f"{_num(load.total)}/{_num(load.usable)}"]
        row += [f"{_num(load.host_bytes)}/{_num(load.host_usable)}"] \
            if offload else []
        row += [_ms(load.compute_s), _ms(load.comm_s)]
        row += [_ms(load.wait_s)] if wait else []
        rows.setdefault(tuple(row), []).extend(load.device_runs)
    layout = alt.layout if alt.layout is not None else \
        DeviceLayout(plan.hosts)
    body = []
    for row, runs in rows.items():
        runs = merge_runs(runs)
        body.append([runs_text(runs), runs_text(layout.host_runs(runs)),
                     *row, str(runs_count(runs))])
    return _columns([header] + body)


def _columns(rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def _cluster_line(plan: ClusterPlan) -> str:
    """"Cluster: 2 hosts, 8 devices (...); slowest link ..."."""
    layout = DeviceLayout(plan.hosts)
    groups: list[list] = []
    for h, host in enumerate(plan.hosts):
        if groups and groups[-1][1] == host.profile.name and \
                groups[-1][2] == host.devices:
            groups[-1][0].append(h)
        else:
            groups.append([[h], host.profile.name, host.devices])
    parts = [f"host{'s' if len(hs) > 1 else ''} {index_ranges(hs)}: "
             f"{count} x {name}" for hs, name, count in groups]
    bandwidth, kind = _slowest_link([c.representative for c in layout.classes]
                                    ) if len(plan.hosts) == 1 else \
        _cluster_link(layout)
    return (f"Cluster: {len(plan.hosts)} host(s), {len(layout)} devices "
            f"({'; '.join(parts)}); slowest link {bandwidth / 1e9:.1f} GB/s "
            f"({kind})")


def _cluster_link(layout: DeviceLayout) -> tuple[float, str]:
    """`_slowest_link` of every device of a cluster of several hosts, from
    its device classes."""
    network = min(c.network.bandwidth for c in layout.classes)
    intra = [c.profile.intra_node_bandwidth for c in layout.classes
             if c.per_host > 1]
    if intra and min(intra) < network:
        return min(intra), "intra-node"
    return network, "inter-node"


def _network_line(plan: ClusterPlan) -> str:
    """"Network per host: hosts 0-1: 8 x 200 Gb/s (200.0 GB/s); ..."."""
    groups: list[tuple[list[int], HostNetwork]] = []
    for h, host in enumerate(plan.hosts):
        if groups and groups[-1][1] == host.network:
            groups[-1][0].append(h)
        else:
            groups.append(([h], host.network))
    parts = [f"host{'s' if len(hs) > 1 else ''} {index_ranges(hs)}: "
             f"{network}" for hs, network in groups]
    unused = "; one host: not used" if len(plan.hosts) == 1 else ""
    return f"Network per host: {'; '.join(parts)}{unused}"


def _model_line(plan: ClusterPlan) -> str:
    """One line describing the model."""
    m = plan.model
    params = m.num_parameters
    count = f"{params / 1e12:.2f} T" if params >= 1e12 else \
        f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    split = f", {m.split_units} experts per split layer" if m.split_units \
        else ""
    size = size_text(m.parameter_bytes)
    return (f"Model: {m.name}: {len(m.layers)} layer(s), {count} parameters "
            f"({size}){split}; "
            f"{_flops_text(m.flops_per_example)} per example (forward + "
            f"backward); optimizer {plan.optimizer}; global batch "
            f"{plan.global_batch}; compute dtype "
            f"{plan.options.compute_dtype or m.compute_dtype}"
            + ("; parameters and optimizer state offloaded to host memory"
               if plan.options.offload else ""))


def _alternative_line(plan: ClusterPlan, alt: Alternative) -> str:
    """One line per alternative: time and verdict."""
    if alt is plan.chosen:
        verdict = "chosen"
    elif alt.feasible:
        ratio = alt.step_time / plan.chosen.step_time
        verdict = f"fits, not chosen: {ratio:.2f}x the chosen step time"
        if alt.step_time < plan.chosen.step_time:
            verdict += (f" (within the {CHOICE_TOLERANCE:.0%} simplicity "
                        f"margin: a plan listed earlier is chosen unless "
                        f"a later one is more than {CHOICE_TOLERANCE:.0%} "
                        f"faster)")
    else:
        verdict = f"rejected: {alt.reason}"
    time = f"{_ms(alt.step_time)} ms" if alt.feasible else "-"
    return f"  {alt.name:<58} {time:>12}  {verdict}"


def _explain(plan: ClusterPlan) -> str:
    """The text of ClusterPlan.explain()."""
    chosen = plan.chosen
    lines = [_model_line(plan), _cluster_line(plan), _network_line(plan),
             ""]
    slowest = max(chosen.rows, key=lambda load: load.step_s)
    wait = f", waiting {_ms(slowest.wait_s)} ms" if slowest.wait_s else ""
    lines.append(f"Chosen plan: {chosen.name}: predicted step "
                 f"{_ms(chosen.step_time)} ms (slowest device: compute "
                 f"{_ms(slowest.compute_s)} ms{wait}, communication "
                 f"{_ms(slowest.comm_s)} ms)")
    if chosen.pipeline_stages > 1:
        lines.append(f"  {chosen.num_micro_batch} micro-batches per step; "
                     f"earlier stages on devices with more memory")
    lines.append(f"  batch sizes per replica: {_batch_summary(chosen)}")
    lines.append("")
    lines += _table(plan, chosen)
    lines.append("")
    lines.append("Alternatives (predicted step time):")
    lines += [_alternative_line(plan, alt) for alt in plan.alternatives]
    notes = list(plan.model.notes)
    if chosen.pipeline_stages > 1:
        notes.append("pipeline: the activations sent between stages are "
                     "not counted in communication")
    if any(load.wait_s for load in chosen.rows):
        notes.append("wait: every split layer's all-to-all is a barrier, so "
                     "a device idles until the slowest device's replicated "
                     "work, and then its expert work, is done")
    if plan.options.offload:
        notes.append("offload: params and grads on the device are working "
                     "buffers (the largest layer's, parameters double-"
                     "buffered); host GB holds parameters, gradients and "
                     "optimizer state; the optimizer update runs on the "
                     "host; comm includes host <-> device copies at "
                     f"{plan.options.host_link_bandwidth / 1e9:.0f} GB/s")
    if plan.model.unknown_op_types:
        notes.append("op types the cost model does not know (their bytes "
                     "are counted, no FLOPs): " + unknown_op_text(plan.model))
    notes.append("sizes in binary units (KiB, MiB, GiB); usable = "
                 f"{plan.options.usable_fraction:.0%} of device memory; "
                 f"compute at {plan.options.efficiency:.0%} of peak; "
                 "communication not overlapped with compute")
    lines.append("")
    lines += [f"Note: {note}" for note in notes]
    return "\n".join(lines)


def unknown_op_text(model: ModelSpec) -> str:
    """"Foo x3, Bar x1": the model's unknown op types with their counts."""
    return ", ".join(f"{name} x{count}"
                     for name, count in model.unknown_op_types)


def _batch_summary(alt: Alternative) -> str:
    """Batch sizes as "86 x4, 42 x4" (runs of equal values)."""
    runs = alt.batch_runs
    return ", ".join(f"{s} x{c}" if c > 1 else str(s) for s, c in runs) + \
        f" (sum {sum(s * c for s, c in runs)})"


# --------------------------------------------------------------------------
# Local replica weights (for epl.parallelize).
# --------------------------------------------------------------------------

def replica_weights_for_local_devices(model: Any,
                                      profiles: Sequence[DeviceProfile],
                                      global_batch: int | None = None,
                                      optimizer: str | None = None,
                                      device_counts: Sequence[int] | None
                                      = None,
                                      options: PlanOptions | None = None
                                      ) -> list[float]:
    """Batch shares of the local replicas from their devices' profiles.

    Args:
        model: a TrainingView (preferred: phases, TaskGraphs and batch size
            come from the analysis), a tf.Graph/GraphDef or a ModelSpec.
        profiles: one profile per local device, in device order (e.g.
            `epl.profiles.virtual_cpu_profiles(n, cluster.device_profiles)`).
        global_batch: the global batch size; default the model's static
            batch.  When unknown, shares follow capability alone (no
            memory check, not rounded to whole examples).
        optimizer: default read from the graph's apply ops, else "adam".
        device_counts: devices per replica of each TaskGraph, in order
            (default from the view's TaskGraph specs, else 1); the layout is
            epl.planner.plan's: replica r spans the devices
            r*k .. r*k+k-1 with k = sum(device_counts).
        options: PlanOptions (efficiency, usable memory, ...).

    Returns:
        One positive weight per replica, summing to 1: the balanced batch
        sizes divided by the global batch.  A replica spanning several
        devices runs at the speed of the sum of its TaskGraphs' times on
        their devices, and is limited by its tightest device's memory.

    Raises:
        ClusterError: the devices do not divide into replicas, or the batch
            fits nowhere (per-device shortfall and what would help).
    """
    options = options or PlanOptions()
    view = model if hasattr(model, "taskgraph_of") else None
    spec = _as_model(model)
    optimizer = optimizer or spec.optimizer
    counts = list(device_counts or (
        [tg.spec.device_count for tg in view.taskgraphs] if view else [1]))
    per_replica = sum(counts)
    if per_replica < 1 or len(profiles) % per_replica:
        raise ClusterError(
            f"{len(profiles)} local devices do not divide into replicas of "
            f"{per_replica} device(s)")
    replicas = len(profiles) // per_replica
    groups = _replica_layers(spec, counts)
    batch = global_batch or spec.batch_size
    caps, per_example, fixed, usable, names = [], [], [], [], []
    slots = cm.optimizer_slots(optimizer or "adam")
    dtype = normalize_dtype(options.compute_dtype or spec.compute_dtype)
    for r in range(replicas):
        devices = profiles[r * per_replica:(r + 1) * per_replica]
        seconds, tight = 0.0, None
        for offset, layers in groups:
            profile = devices[offset]
            totals = _totals(layers, False)
            seconds += cm.predict_time(
                cm.GroupCost(flops=totals.flops, bytes=totals.bytes),
                profile, dtype, options.efficiency) if totals.flops or \
                totals.bytes else 0.0
            room = profile.memory_bytes * options.usable_fraction
            state = totals.params * (2 + slots)
            ratio = (room - state) / totals.act if totals.act else math.inf
            if tight is None or ratio < tight[0]:
                tight = (ratio, totals.act, state, room, profile.name)
        caps.append(1.0 / seconds if seconds > 0 else 1.0)
        per_example.append(tight[1])
        fixed.append(tight[2])
        usable.append(tight[3])
        names.append(tight[4])
    if not batch:
        total = sum(caps)
        return [c / total for c in caps]
    # Every replica of the layout must get at least one example: a slow
    # device that is not worth its share still gets one.
    shares = balance.balance_batch(batch, caps, per_example, fixed, usable,
                                   names, minimum=1 if batch >= len(caps) else 0)
    if any(size == 0 for size in shares.sizes):
        raise ClusterError(
            f"the balanced plan gives replica(s) "
            f"{index_ranges([i for i, s in enumerate(shares.sizes) if not s])}"
            f" no examples of the global batch of {batch} "
            f"(sizes {list(shares.sizes)}); use a larger global batch or "
            f"fewer devices")
    return [size / batch for size in shares.sizes]


def _replica_layers(spec: ModelSpec, counts: list[int]
                    ) -> list[tuple[int, list[LayerSpec]]]:
    """(device offset within a replica, layers) per TaskGraph/stage.

    Layers are matched to TaskGraphs by their stage index; a model with
    fewer stages than TaskGraphs puts everything on the first device.
    """
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    by_stage: dict[int, list[LayerSpec]] = {}
    for layer in spec.layers:
        stage = layer.stage if layer.stage < len(counts) else 0
        by_stage.setdefault(stage, []).append(layer)
    return [(offsets[stage], layers) for stage, layers in
            sorted(by_stage.items())]


def local_replica_weights(view: Any, cluster: Any, config: Any
                          ) -> list[float] | None:
    """What epl.parallelize passes to make_plan as replica_weights.

    None (even shares) unless `cluster.device_profiles` is configured;
    then the local devices' profiles (virtual CPU devices through
    `virtual_cpu_profiles`, GPUs through `detect_profile`) give the shares
    of `replica_weights_for_local_devices`.  None as well when every
    replica gets the same share.
    """
    profiles = local_profiles(cluster, config)
    if profiles is None:
        return None
    if len(set(profiles)) == 1:
        return None
    weights = replica_weights_for_local_devices(
        view, profiles, view.global_batch_size,
        options=PlanOptions(compute_dtype=local_compute_dtype(config)))
    first = weights[0]
    if all(math.isclose(w, first, rel_tol=1e-12) for w in weights):
        return None
    return weights


def local_compute_dtype(config: Any) -> str:
    """The dtype the local devices' matmuls run in: `amp.dtype` when
    mixed precision is on (`amp.level`), else float32.  Peak FLOP/s differ
    by dtype and by device differently (an A100 is 1.2x a V100 in float32,
    2.5x in float16), so the shares must use the one training runs in."""
    if config.get("amp.level"):
        return normalize_dtype(config.get("amp.dtype"))
    return "float32"


def local_profiles(cluster: Any, config: Any) -> list[DeviceProfile] | None:
    """Profiles of this worker's devices, or None unless `cluster.device_profiles` is set."""
    from epl import profiles as profiles_lib
    overrides = config.get("cluster.device_profiles") or {}
    if not overrides:
        return None
    n = cluster.num_local_devices
    if cluster.device_type == "CPU":
        return profiles_lib.virtual_cpu_profiles(n, overrides)
    return [_gpu_profile(i, overrides) for i in range(n)]


def local_shard_weights(cluster: Any, config: Any, devices: Sequence[str]
                        ) -> list[float] | None:
    """Capability weights of a split TaskGraph's devices (the split pass's shard sizes).

    None (even shards) unless `cluster.device_profiles` makes the devices
    differ; then each device's share is proportional to its peak FLOP/s in
    the dtype it computes in (`local_compute_dtype`; a shard's work grows
    with its size), the Whale paper's capability-proportional split.
    """
    profiles = local_profiles(cluster, config)
    if profiles is None:
        return None
    dtype = local_compute_dtype(config)
    chosen = [profiles[int(device.rsplit(":", 1)[1])] for device in devices]
    total_flops = sum(p.flops(dtype) for p in chosen)
    weights = [p.flops(dtype) / total_flops for p in chosen]
    if all(math.isclose(w, weights[0], rel_tol=1e-12) for w in weights):
        return None
    return weights


def _gpu_profile(index: int, overrides: Mapping[str, Any]) -> DeviceProfile:
    """The profile of local GPU `index` (from TensorFlow's device details)."""
    import tensorflow as tf

    from epl import profiles as profiles_lib
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[index]) \
        if index < len(gpus) else {}
    return profiles_lib.detect_profile(f"/device:GPU:{index}",
                                       details.get("device_name", ""),
                                       overrides)


#: Names that moved to `epl.planner.graph_model` (they need TensorFlow),
#: still importable from here for existing callers.
_GRAPH_NAMES = ("model_from_graph", "infer_optimizer")


def __getattr__(name: str) -> Any:
    """`model_from_graph` and `infer_optimizer`, from `graph_model`, on
    first use (importing this module must not import TensorFlow)."""
    if name in _GRAPH_NAMES:
        from epl.planner import graph_model
        return getattr(graph_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _row_dict(layout: DeviceLayout, load: DeviceLoad) -> dict:
    """One row of the JSON table."""
    runs = merge_runs(load.device_runs)
    row = {"devices": runs_text(runs),
           "hosts": runs_text(layout.host_runs(runs)),
           "count": runs_count(runs), "profile": load.device.profile.name,
           "batch": load.batch, "shards": load.shards, "stage": load.stage,
           "layers": list(load.layers) if load.layers else None,
           "parameter_bytes": load.parameters,
           "gradient_bytes": load.gradients,
           "optimizer_bytes": load.optimizer,
           "activation_bytes": load.activations,
           "total_bytes": load.total, "usable_bytes": load.usable,
           "compute_s": load.compute_s, "comm_s": load.comm_s,
           "wait_s": load.wait_s, "step_s": load.step_s, "fits": load.fits}
    if load.host_bytes or math.isfinite(load.host_usable):
        row["host_bytes"] = load.host_bytes
        row["host_usable_bytes"] = load.host_usable
    return row


def _plan_dict(plan: ClusterPlan) -> dict:
    """ClusterPlan.as_dict()."""
    layout = plan.chosen.layout if plan.chosen.layout is not None else \
        DeviceLayout(plan.hosts)
    m = plan.model
    alternatives = []
    for alt in plan.alternatives:
        entry = {"name": alt.name, "feasible": alt.feasible,
                 "step_time_s": alt.step_time if alt.feasible else None,
                 "chosen": alt is plan.chosen}
        if alt.feasible:
            entry["ratio_to_chosen"] = alt.step_time / plan.chosen.step_time
        else:
            entry["rejected_because"] = alt.reason
        alternatives.append(entry)
    return {
        "model": {"name": m.name, "layers": len(m.layers),
                  "parameters": m.num_parameters,
                  "parameter_bytes": m.parameter_bytes,
                  "flops_per_example": m.flops_per_example,
                  "split_units": m.split_units,
                  "compute_dtype": plan.options.compute_dtype
                  or m.compute_dtype, "exact": m.exact,
                  "unknown_op_types": {name: count for name, count
                                       in m.unknown_op_types},
                  "notes": list(m.notes)},
        "cluster": {"hosts": len(plan.hosts), "devices": len(layout),
                    "groups": [{"devices": runs_text(c.runs),
                                "hosts": runs_text(layout.host_runs(c.runs)),
                                "count": c.count, "profile": c.profile.name,
                                "devices_per_host": c.per_host,
                                "network_bytes_per_s": c.network.bandwidth}
                               for c in layout.classes]},
        "optimizer": plan.optimizer, "global_batch": plan.global_batch,
        "chosen": {"name": plan.chosen.name,
                   "step_time_s": plan.chosen.step_time,
                   "batch_sizes": [{"batch": size, "replicas": count}
                                   for size, count in plan.chosen.batch_runs],
                   "rows": [_row_dict(layout, row)
                            for row in plan.chosen.rows]},
        "choice_rule": {"simplicity_margin": CHOICE_TOLERANCE,
                        "rule": "the earliest listed alternative that fits "
                                "and is within the margin of the fastest "
                                "one's step time"},
        "alternatives": alternatives,
    }
