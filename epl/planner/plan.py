"""Plan: where each TaskGraph's replicas go and how the batch is shared.

`make_plan` turns the TaskGraphs, the cluster and the config into a Plan. The
layout: one replica of the model spans the sum of its replicated TaskGraphs'
`device_count`s; the local devices are cut into that many replicas; TaskGraph t
of replica r runs on the first device of its slice of replica r's devices.
A split TaskGraph (`epl.split(k)`) is not replicated: it spans k devices, the
first k of the worker, shared with the replicas
(`cluster.colocate_split_and_replicate`, and always when the worker has no
device to spare), or else the last k, the replicas taking the others.
Batch shares default to even; the hardware-aware planner (device profiles)
supplies uneven shares, and tests may pass their own.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from epl.runtime.cluster import Cluster
from epl.errors import ClusterError, ParallelizeError
from epl.ir.taskgraph import TaskGraph
from epl.planner import local
from epl.planner.stage_cuts import stage_device_order

# stage_device_order is epl.planner.stage_cuts' (one order for the search and the
# runtime), also importable from here.
__all__ = ["Plan", "SplitPlan", "make_local_plan", "make_plan", "shard_sizes", "split_layout",
           "stage_device_order"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel layout of one worker.

    num_replicas: model replicas on this worker.
    devices: TaskGraph name -> device of each replica (index = replica).
    replica_weights: share of the global batch per replica (sums to 1).
    """

    num_replicas: int
    devices: dict
    replica_weights: tuple[float, ...]
    split_devices: dict = dataclasses.field(default_factory=dict)  # split TaskGraph -> devices

    def device(self, taskgraph: TaskGraph, replica: int) -> str:
        """Device of `taskgraph` in `replica`."""
        return self.devices[taskgraph.name][replica]

    @property
    def even(self) -> bool:
        """True when every replica gets the same share of the batch."""
        first = self.replica_weights[0]
        return all(math.isclose(w, first, rel_tol=1e-12) for w in self.replica_weights)

    def batch_sizes(self, global_batch: int) -> list[int]:
        """Integer per-replica batch sizes summing to `global_batch`.

        Boundaries are round(global_batch * cumulative share), the same rule the
        graph uses when the batch size is only known at run time.
        """
        bounds = [0]
        total = 0.0
        for weight in self.replica_weights:
            total += weight
            bounds.append(int(round(global_batch * total)))
        bounds[-1] = global_batch
        return [b - a for a, b in zip(bounds, bounds[1:])]


def _is_split(taskgraph: TaskGraph) -> bool:
    return taskgraph.spec.kind.value == "split"


def split_layout(taskgraphs: list[TaskGraph], cluster: Cluster,
                 colocate: bool = True) -> tuple[int, dict]:
    """(devices left to the replicas, {split TaskGraph name: this worker's devices of it}).

    A split group of exactly (local devices x workers) devices spans every
    worker: each worker holds its local devices' slots (rank order).
    """
    available = cluster.num_local_devices
    split = [tg for tg in taskgraphs if _is_split(tg)]
    if not split:
        return available, {}
    widest = max(split, key=lambda tg: tg.spec.device_count)
    k = widest.spec.device_count
    if k > available and k == available * cluster.num_workers:
        # the group spans every worker: this worker holds `available` of its slots
        return available, {tg.name: tuple(cluster.local_devices[:tg.spec.device_count
                                                                 // cluster.num_workers])
                           for tg in split}
    if k > available:
        raise ClusterError(
            f"{widest.spec.describe()} splits over {k} devices but this worker has {available} "
            f"{cluster.device_type} device(s) (and {cluster.num_workers} worker(s) hold "
            f"{available * cluster.num_workers} in all). Use device_count <= {available} (a "
            f"group within each worker) or = {available * cluster.num_workers} (a group over "
            "every worker's devices), or add devices (on CPU: cluster.virtual_devices).")
    per_replica = sum(tg.spec.device_count for tg in taskgraphs if not _is_split(tg)) or 1
    if not colocate and available - k >= per_replica:
        usable, first = available - k, available - k
    else:
        usable, first = available, 0
    return usable, {tg.name: tuple(cluster.local_devices[first:first + tg.spec.device_count])
                    for tg in split}


def _layout(taskgraphs: list[TaskGraph], cluster: Cluster, colocate: bool = True,
            device_memory: list[float] | None = None,
            stage_devices: list[list[int]] | None = None) -> tuple[int, dict, dict]:
    available, split_devices = split_layout(taskgraphs, cluster, colocate)
    replicated = [tg for tg in taskgraphs if not _is_split(tg)]
    if not replicated:
        raise ClusterError("the model has no replicated part: every TaskGraph is epl.split.")
    taskgraphs = replicated
    per_replica = sum(tg.spec.device_count for tg in taskgraphs)
    widest = max(taskgraphs, key=lambda tg: tg.spec.device_count)
    if widest.spec.device_count > available or per_replica > available:
        raise ClusterError(
            f"{widest.spec.describe()} needs {per_replica} device(s) per replica "
            f"(all TaskGraphs: {', '.join(f'{tg.name}={tg.spec.device_count}' for tg in taskgraphs)}) "
            f"but this worker has {available} {cluster.device_type} device(s). Lower device_count, "
            "or add devices (on CPU: cluster.virtual_devices).")
    if available % per_replica:
        raise ClusterError(
            f"one replica spans {per_replica} device(s) "
            f"({', '.join(f'{tg.name}={tg.spec.device_count}' for tg in taskgraphs)}), which does "
            f"not divide the {available} {cluster.device_type} devices of this worker. Choose "
            f"device_count values whose sum divides {available}.")
    replicas = available // per_replica
    devices = {}
    if stage_devices is not None:
        _check_stage_devices(stage_devices, replicas, len(taskgraphs), available)
        for placement in stage_devices:
            for tg, index in zip(taskgraphs, placement):
                devices.setdefault(tg.name, []).append(cluster.local_devices[index])
    elif device_memory and len(taskgraphs) > 1 and all(tg.spec.device_count == 1 for tg in taskgraphs):
        for r in range(replicas):   # pipeline stages: earlier stages on devices with more memory
            base = r * per_replica
            order = stage_device_order(device_memory[base:base + per_replica])
            for i, tg in enumerate(taskgraphs):
                devices.setdefault(tg.name, []).append(cluster.local_devices[base + order[i]])
    else:
        offset = 0
        for tg in taskgraphs:
            devices[tg.name] = [cluster.local_devices[r * per_replica + offset]
                                for r in range(replicas)]
            offset += tg.spec.device_count
    for name, split in split_devices.items():   # template ops of a split TaskGraph
        devices[name] = [split[0]] * replicas
    return replicas, devices, split_devices


def _check_stage_devices(stage_devices: list[list[int]], replicas: int, stages: int,
                         available: int) -> None:
    """Raise ClusterError unless `stage_devices` gives each of `replicas` replicas
    one distinct local device per stage."""
    used = [i for placement in stage_devices for i in placement]
    if len(stage_devices) != replicas or any(len(p) != stages for p in stage_devices) \
            or sorted(used) != sorted(set(used)) or any(not 0 <= i < available for i in used):
        raise ClusterError(
            f"stage_devices={stage_devices} must give each of the {replicas} replicas "
            f"{stages} distinct local device indices below {available}.")


def make_plan(taskgraphs: list[TaskGraph], cluster: Cluster,
              replica_weights: list[float] | None = None, colocate_split: bool = True,
              device_memory: list[float] | None = None,
              stage_devices: list[list[int]] | None = None) -> Plan:
    """Lay the TaskGraphs out on the cluster; raise ClusterError if they do not fit.

    replica_weights: optional batch shares per replica (positive; normalized).
    colocate_split: `cluster.colocate_split_and_replicate`.
    device_memory: bytes per local device (device profiles): pipeline stages
      then take each replica's devices in order of memory, largest first.
    stage_devices: per replica, the local device index of each replicated
      TaskGraph (in order), as the planner's ClusterPlan lays them out
      (`epl.planner.local.local_plan`); overrides device_memory.
    """
    replicas, devices, split_devices = _layout(taskgraphs, cluster, colocate_split, device_memory,
                                               stage_devices)
    if replica_weights is None:
        weights = tuple(1.0 / replicas for _ in range(replicas))
    else:
        weights = tuple(float(w) for w in replica_weights)
        if len(weights) != replicas or any(not w > 0 for w in weights):
            raise ClusterError(
                f"replica_weights={list(replica_weights)} must hold {replicas} positive numbers, "
                f"one per replica ({replicas} replicas on {cluster.num_local_devices} devices).")
        total = sum(weights)
        weights = tuple(w / total for w in weights)
    return Plan(replicas, devices, weights, split_devices)


def make_local_plan(taskgraphs: list[TaskGraph], view: Any, cluster: Cluster,
                    config: Any, replica_weights: list[float] | None = None,
                    uneven: bool = True) -> Plan:
    """The runtime Plan of this worker, derived from the planner's ClusterPlan.

    Where `epl.planner.local.local_layout` applies (device profiles set, the
    model single-device TaskGraphs), the batch shares and each stage's device
    are the local ClusterPlan's, so the dry run and the real run agree; else
    as `make_plan` with `local_replica_weights` and stages by device memory.
    replica_weights: shares given by the caller; they win over the planner's.
    uneven: False where the batch mode cannot give replicas different batch
      sizes (`supports_uneven_shares`): even shares, the planner's devices.
    """
    profiles = local.local_profiles(cluster, config)
    colocate = bool(config.get("cluster.colocate_split_and_replicate"))
    layout = local.local_layout(view, cluster, config)
    if layout is None:
        weights = replica_weights if replica_weights is not None or not uneven \
            else local.local_replica_weights(view, cluster, config)
        return make_plan(list(taskgraphs), cluster, weights, colocate,
                         [p.memory_bytes for p in profiles] if profiles
                         else None)
    weights = replica_weights if replica_weights is not None else \
        list(layout.replica_weights) if uneven else None
    return make_plan(list(taskgraphs), cluster, weights, colocate,
                     stage_devices=[list(p) for p in layout.stage_devices])


def shard_sizes(dim: int, count: int, weights=None, what: str = "dimension",
                must_divide: bool = False) -> list[int]:
    """Split `dim` into `count` positive integer extents.

    weights: relative shares (capability-weighted plans); None = even. With
    even shares (or `must_divide`) `dim` must be divisible by `count`; the
    error says which dimension and how to fix it. Uneven shares are rounded
    on cumulative boundaries (round(dim * cumulative share)), each at least 1.
    """
    if dim < count:
        raise ParallelizeError(
            f"cannot split a {what} of size {dim} over {count} devices: every device needs at "
            f"least one row. Use epl.split(device_count<={dim}).")
    even = weights is None or all(abs(w - weights[0]) < 1e-12 for w in weights)
    if even or must_divide:
        if dim % count:
            raise ParallelizeError(
                f"the {what} of size {dim} is not divisible by the split degree {count}, and "
                "its shards must be even. Use a size divisible by "
                f"{count}, or epl.split(device_count=d) with d dividing {dim}.")
        if even:
            return [dim // count] * count
    total = float(sum(weights))
    bounds, cumulative = [0], 0.0
    for j, weight in enumerate(weights):
        cumulative += weight / total
        bound = dim if j == count - 1 else int(round(dim * cumulative))
        bound = max(bound, bounds[-1] + 1)
        bound = min(bound, dim - (count - 1 - j))
        bounds.append(bound)
    return [b - a for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Where one split TaskGraph goes: this worker's devices and each slot's share.

    A split group may span workers: it then has `num_slots` slots in all,
    this worker holding slots first_slot .. first_slot + len(devices) - 1.
    """

    devices: tuple
    weights: tuple | None = None   # None: even shards (else one weight per slot)
    first_slot: int = 0
    num_slots: int | None = None   # None: len(devices) (the group is this worker's)

    @property
    def spans_workers(self) -> bool:
        """True when other workers hold some of the group's slots."""
        return (self.num_slots or len(self.devices)) > len(self.devices)

    def _all_sizes(self, dim: int, what: str, must_divide: bool) -> list[int]:
        return shard_sizes(dim, self.num_slots or len(self.devices), self.weights, what,
                           must_divide)

    def sizes(self, dim: int, what: str, must_divide: bool = False) -> list[int]:
        """Extents of `dim` on this worker's slots (see `shard_sizes`)."""
        sizes = self._all_sizes(dim, what, must_divide)
        return sizes[self.first_slot:self.first_slot + len(self.devices)]

    def offsets(self, dim: int) -> list[int]:
        """Where this worker's slots start along a dimension of `dim` entries."""
        sizes = self._all_sizes(dim, "dimension", False)
        return [sum(sizes[:self.first_slot + j]) for j in range(len(self.devices))]
