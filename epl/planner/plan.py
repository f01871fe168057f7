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

from epl.cluster import Cluster
from epl.errors import ClusterError
from epl.ir.taskgraph import TaskGraph
from epl.planner.balance import stage_device_order

# stage_device_order is balance's (one order for the search and the runtime), also
# importable from here (graph_passes/auto_stages.py imports it from this module).
__all__ = ["Plan", "make_plan", "split_layout", "stage_device_order"]


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
            device_memory: list[float] | None = None) -> tuple[int, dict, dict]:
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
    if device_memory and len(taskgraphs) > 1 and all(tg.spec.device_count == 1 for tg in taskgraphs):
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


def make_plan(taskgraphs: list[TaskGraph], cluster: Cluster,
              replica_weights: list[float] | None = None, colocate_split: bool = True,
              device_memory: list[float] | None = None) -> Plan:
    """Lay the TaskGraphs out on the cluster; raise ClusterError if they do not fit.

    replica_weights: optional batch shares per replica (positive; normalized).
    colocate_split: `cluster.colocate_split_and_replicate`.
    device_memory: bytes per local device (device profiles): pipeline stages
      then take each replica's devices in order of memory, largest first.
    """
    replicas, devices, split_devices = _layout(taskgraphs, cluster, colocate_split, device_memory)
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
