"""The cost of one step on one device: what every alternative's evaluation reads.

Summed layer figures (`Totals`, with gradient checkpointing's recompute and
kept activations), the evaluation context (`Context`: roofline time of
FLOPs and bytes on a device, the optimizer update), and the communication
terms: the link that bounds a ring all-reduce (`slowest_link`,
`cluster_link`) and the expert all-to-all (`alltoall_time`).  The model
these implement is described in `epl.planner.planner`'s docstring.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from epl.planner import roofline as cm
from epl.planner.devices import ClusterDevice, DeviceLayout
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.planner.results import PlanOptions

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
class Totals:
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
    op_counts: tuple[tuple[str, int], ...] = ()
    alltoall_layers: int = 0  # split layers with an expert all-to-all


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


def layer_totals(layers: Sequence[LayerSpec], checkpointing: bool) -> Totals:
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
    return Totals(
        flops=flops, bytes=traffic, act=act,
        params=total("parameter_bytes"),
        split_params=total("split_parameter_bytes"),
        split_flops=split_flops, split_bytes=split_traffic,
        split_act=split_act, alltoall=total("alltoall_bytes_per_example"),
        largest_layer_params=max(l.parameter_bytes for l in layers),
        largest_layer_split_params=max(l.split_parameter_bytes
                                       for l in layers),
        op_counts=merge_op_counts(l.op_counts for l in layers),
        alltoall_layers=sum(1 for l in layers if l.alltoall_bytes_per_example))


def merge_op_counts(parts) -> tuple[tuple[str, int], ...]:
    """Sum several (op type, count) tuples into one, sorted by type."""
    counts: dict[str, int] = {}
    for part in parts:
        for op_type, count in part:
            counts[op_type] = counts.get(op_type, 0) + count
    return tuple(sorted(counts.items()))


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
class Context:
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

    def time(self, device: ClusterDevice, flops: float, nbytes: float,
             op_counts: tuple[tuple[str, int], ...] = ()) -> float:
        """Seconds of (flops, bytes) on `device`: the roofline, plus the
        device's per-op overhead for the ops of `op_counts` ((type, count)
        pairs; `cm.op_overhead_time`)."""
        overhead = cm.op_overhead_time(op_counts, device.profile)
        if flops <= 0 and nbytes <= 0:
            return overhead
        return cm.predict_time(cm.GroupCost(flops=flops, bytes=nbytes),
                               device.profile, self.dtype,
                               self.options.efficiency) + overhead

    def session_time(self, device: ClusterDevice) -> float:
        """Seconds of a step's session run on `device` beyond its ops,
        once per step (`DeviceProfile.step_overhead_s`: measured for the
        CPU, 0 for the GPU table)."""
        return device.profile.step_overhead_s

    def update_time(self, device: ClusterDevice, param_bytes: float) -> float:
        """Seconds of the optimizer update of `param_bytes` on `device`
        (zero under offload: the host runs it): the roofline of its FLOPs
        and bytes, the bytes at the profile's `optimizer_bandwidth` where
        it has one (the CPU's apply kernels move far less than a copy)."""
        if self.options.offload or param_bytes <= 0:
            return 0.0
        cost = optimizer_update_cost(param_bytes,
                                     self.model.parameter_dtype_bytes,
                                     self.optimizer)
        rate = device.profile.optimizer_bandwidth
        if rate > 0:  # a calibrated profile: the apply kernels' own rate
            return max(self.time(device, cost.flops, 0.0), cost.bytes / rate)
        return self.time(device, cost.flops, cost.bytes)


def slowest_link(devices: Sequence[ClusterDevice]) -> tuple[float, str]:
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


def allreduce_time(devices: Sequence[ClusterDevice], nbytes: float,
                   bandwidth: float, n: int | None = None) -> float:
    """Seconds of one step's gradient all-reduce of `nbytes` over
    `devices` (a ring at `bandwidth`, `cm.comm_time`), with the copies
    around it: EPL fuses the gradients into one buffer (a concat in, a
    split out: each reads and writes the buffer, at the slowest device's
    memory bandwidth; counted where the profile has a collective latency,
    i.e. was calibrated) and reduces it in one collective, whose ring steps
    each pay the slowest device's `collective_latency_s`.  `n`: devices in
    the ring, default len(devices) (`devices` may be one representative
    per class of identical devices).  Devices that share a host's cores
    (virtual CPU devices) add, per replica beyond the first, the slowest
    device's `replica_sync_s`: the input reads on device 0 and the waits at
    the all-reduce barrier of replicas taking turns on the same cores,
    measured by `epl.planner.calibration.calibrate_cpu_profile` (0 for the GPU table:
    a GPU's replicas run side by side).  Zero on one device."""
    n = len(devices) if n is None else n
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency = max(d.profile.collective_latency_s for d in devices)
    sync = (n - 1) * max(d.profile.replica_sync_s for d in devices)
    # The copies are counted with the latency, for calibrated profiles
    # only: the GPU table's published figures have neither (a GPU
    # calibration would add both).
    copies = 4 * nbytes / min(d.profile.memory_bandwidth for d in devices) \
        if latency > 0 else 0.0
    return cm.comm_time(nbytes, bandwidth, n, latency) + copies + sync


def input_time(devices: Sequence[ClusterDevice], reads: int,
               examples: int) -> float:
    """Seconds of one step's input reads: `reads` reads from the input
    pipeline (one per replica, or per micro-batch of every pipeline, each
    replica drawing its own batch) of `examples` examples in all.  One
    iterator serves every device, so the reads run one after the other and
    every device waits for its own: each read pays the profile's
    `input_read_s`, each example `input_example_s` (the first device's
    profile: the iterator sits there, as EPL places the input; both
    measured by `epl.planner.calibration.calibrate_cpu_profile`, 0 for the GPU table,
    whose published figures have none)."""
    profile = devices[0].profile
    return reads * profile.input_read_s + examples * profile.input_example_s


def alltoall_time(ctx: Context, totals: Totals, units: Sequence[int],
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


#: Chunk counts (`split.moe_chunks`) the planner tries for the expert
#: dispatch: powers of two up to 8, the overlap degrees Tutel's adaptive
#: pipelining searches.
MOE_CHUNK_CHOICES = (1, 2, 4, 8)
#: Share of the expert all-to-all's bytes the chunked dispatch pipelines: of
#: a split layer's four exchanges per step (dispatch and combine, forward and
#: backward) the dispatch and its gradient, half the bytes.  The combine
#: stays one exchange (epl/passes/split/rewriter.py, `Rewriter.slice_chunks`).
CHUNKED_ALLTOALL_SHARE = 0.5
#: Share of the expert compute the chunked dispatch overlaps: the op that
#: reads the dispatched tokens (the first of an expert FFN's two matmuls,
#: half its FLOPs), forward and backward.
CHUNKED_EXPERT_SHARE = 0.5


def pipelined_time(comm: float, compute: float, chunks: int,
                   chunk_latency: float = 0.0) -> float:
    """Seconds of `comm` then `compute` (one exchange feeding one
    computation) cut into `chunks` equal chunks, the exchange of chunk i+1
    overlapping the computation of chunk i (Tutel's adaptive pipelining,
    FasterMoE's smart scheduling): the busier of the two streams runs
    throughout, and the other one's first (fill) or last (drain) chunk
    sticks out, max(comm, compute) + min(comm, compute) / chunks; each chunk
    past the first pays `chunk_latency` (one more exchange's message
    latency).  chunks = 1: comm + compute, the unchunked exchange."""
    if chunks <= 1:
        return comm + compute
    return max(comm, compute) + min(comm, compute) / chunks + \
        (chunks - 1) * chunk_latency


def alltoall_chunk_latency(ctx: Context, totals: Totals) -> float:
    """Seconds one more dispatch chunk costs per step in message latency:
    every chunked exchange (each split layer's dispatch, forward, and its
    gradient, backward) sends one more message to each of the n - 1 other
    devices, each paying the slowest device's `collective_latency_s` (0 for
    the GPU table's published figures, which have none)."""
    n = len(ctx.devices)
    latency = max(d.profile.collective_latency_s for d in ctx.devices)
    return 2 * totals.alltoall_layers * (n - 1) * latency


def exposed_alltoall_time(ctx: Context, totals: Totals, alltoall: float,
                          expert: float, chunks: int | None = None
                          ) -> tuple[float, int]:
    """(seconds of the expert all-to-all not hidden behind expert compute,
    chunk count) for one step, with the dispatch cut into `chunks` chunks
    (None: the count of `MOE_CHUNK_CHOICES` with the least exposed time, the
    smallest on a tie).

    `alltoall`: the step's whole exchange (`alltoall_time`); `expert`: the
    slowest device's expert compute, which every device waits for.  The
    chunked share (`CHUNKED_ALLTOALL_SHARE`, the dispatch) pipelines with the
    expert op it feeds (`CHUNKED_EXPERT_SHARE` of the compute;
    `pipelined_time`), the rest of the exchange does not overlap.  Chunks = 1
    gives `alltoall`: what the unchunked graph runs.  With nothing to
    exchange (one device) it is (0, 1): chunking cannot help there.
    """
    if alltoall <= 0:
        return 0.0, chunks or 1
    comm = alltoall * CHUNKED_ALLTOALL_SHARE
    compute = expert * CHUNKED_EXPERT_SHARE
    latency = alltoall_chunk_latency(ctx, totals)
    rest = alltoall - comm
    choices = (chunks,) if chunks else MOE_CHUNK_CHOICES
    best = None
    for count in choices:
        exposed = alltoall if count <= 1 else \
            rest + pipelined_time(comm, compute, count, latency) - compute
        if best is None or exposed < best[0] - 1e-15:
            best = (exposed, count)
    return best


def per_example_time(ctx: Context, device: ClusterDevice,
                     totals: Totals) -> float:
    """Seconds per example of the replicated part on `device`."""
    seconds = ctx.time(device, totals.flops, totals.bytes)
    if seconds <= 0:  # a model with only split layers
        seconds = ctx.time(device, totals.split_flops, totals.split_bytes)
    return seconds if seconds > 0 else 1.0 / device.profile.flops(ctx.dtype)


def cluster_link(layout: DeviceLayout) -> tuple[float, str]:
    """`slowest_link` of every device of a cluster of several hosts, from
    its device classes."""
    network = min(c.network.bandwidth for c in layout.classes)
    intra = [c.profile.intra_node_bandwidth for c in layout.classes
             if c.per_host > 1]
    if intra and min(intra) < network:
        return min(intra), "intra-node"
    return network, "inter-node"


def ring_link(ctx: Context) -> float:
    """`slowest_link` of the whole cluster, from its device classes."""
    layout = ctx.devices
    if len(layout.hosts) == 1:
        return slowest_link([c.representative
                             for c in layout.classes])[0]
    return cluster_link(layout)[0]
