"""Communicators: the collectives passes use, behind one interface.

`HierarchicalCommunicator` is what passes get on every worker: among the
worker's devices it uses `LocalCommunicator`; with several workers it reduces
locally, all-reduces the local result across workers through Horovod
(epl.runtime.horovod_comm), and lets every local device read the result
(TensorFlow copies it to each device: the local broadcast).


Passes never call TensorFlow collectives or Horovod directly: they ask a
`Communicator` for an all-reduce among a group of tensors (one per device).
`LocalCommunicator` implements it among the devices of one worker with
TensorFlow's collective ops (CollectiveReduce, CollectiveGather,
CollectiveBcastSend/Recv). Keys: every distinct device set gets a group key,
every collective call a fresh instance key, both allocated per graph so that
the same graph built twice gets the same keys (which is what makes collectives
line up across processes).

Implementation (the ops' `communication_hint`, `local_communication_hint`):
NCCL among distinct physical GPUs, TensorFlow's ring among logical GPUs that
share a physical one (NCCL refuses two members on one GPU; TensorFlow's
MirroredStrategy falls back the same way), TensorFlow's default ("auto") on
CPU devices. An all-reduce among CPU devices (`communication.local_reduction`
"auto" or "one_device") is no collective: the sum on the first device, which
every other device reads (what MirroredStrategy does among CPUs), faster than a
ring between devices that share one memory. The local NCCL collectives need no ordering of their own: in one
process TensorFlow's NCCL manager launches a collective on every member's
stream at once, when its last member arrives, so every device sees the same
order.
"""
from __future__ import annotations

import abc
import dataclasses

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from epl.ir.annotations import REDUCED_ATTR
from epl.runtime.cluster import physical_gpu_count
from epl.runtime.collective_check import exchange_bytes
from epl.runtime.horovod_comm import HorovodCommunicator


@dataclasses.dataclass
class KeyAllocator:
    """Deterministic group and instance keys for one graph."""

    groups: dict = dataclasses.field(default_factory=dict)
    next_instance: int = 1

    def group_key(self, devices: tuple[str, ...]) -> int:
        """The group key of a device set (stable for the same set)."""
        if devices not in self.groups:
            self.groups[devices] = len(self.groups) + 1
        return self.groups[devices]

    def instance_key(self) -> int:
        """A fresh instance key."""
        key = self.next_instance
        self.next_instance += 1
        return key


class Communicator(abc.ABC):
    """Collectives over a group of tensors, one per participating device."""

    @abc.abstractmethod
    def all_reduce(self, tensors: list[tf.Tensor], devices: list[str], op: str = "sum") -> list[tf.Tensor]:
        """Reduce `tensors` (one per device, same shape) and return the result on each device.

        op: "sum" or "mean".
        """

    @abc.abstractmethod
    def all_gather(self, tensors: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
        """Concatenate `tensors` along axis 0 and return the whole on each device."""

    @abc.abstractmethod
    def broadcast(self, tensor: tf.Tensor, devices: list[str]) -> list[tf.Tensor]:
        """Copy `tensor` (held by devices[0]) to every device."""

    def reduce_scatter(self, tensors: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
        """Sum `tensors`; device i gets the i-th of len(devices) equal slices along axis 0."""
        reduced = self.all_reduce(tensors, devices, op="sum")
        outputs = []
        for i, (tensor, device) in enumerate(zip(reduced, devices)):
            with tf.device(device):
                outputs.append(tf.split(tensor, len(devices), axis=0)[i])
        return outputs

    def all_to_all(self, tensors: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
        """Device i sends slice j (of len(devices) equal slices along axis 0) of its
        tensor to device j; device j gets the slices it received, in device order."""
        pieces = []
        for tensor, device in zip(tensors, devices):
            with tf.device(device):
                pieces.append(tf.split(tensor, len(devices), axis=0))
        outputs = []
        for j, device in enumerate(devices):
            with tf.device(device):  # TensorFlow moves each slice to its destination device
                outputs.append(tf.concat([parts[j] for parts in pieces], axis=0))
        return outputs


#: The communication hints TensorFlow's collective ops accept.
COMMUNICATION_HINTS = ("auto", "ring", "nccl")


def local_communication_hint(device_type: str, num_local_devices: int,
                             physical_gpus: int) -> str:
    """The `communication_hint` of a worker's local collectives.

    device_type: the worker's device type ("GPU" or "CPU");
    num_local_devices: how many devices it drives (logical GPUs count one
    each); physical_gpus: the physical GPUs it sees.

    Returns "nccl" when the devices are distinct physical GPUs, "ring" when
    they are logical GPUs sharing physical ones (more devices than physical
    GPUs), "auto" (TensorFlow's choice) for CPU devices.
    """
    if device_type != "GPU":
        return "auto"
    return "nccl" if num_local_devices <= physical_gpus else "ring"


class LocalCommunicator(Communicator):
    """Collectives among this worker's devices with TensorFlow collective ops.

    communication_hint: "auto", "ring" or "nccl" (`local_communication_hint`
    chooses it for a cluster), given to every collective op.
    """

    def __init__(self, keys: KeyAllocator | None = None, timeout_s: float = 0.0,
                 communication_hint: str = "auto", reduce_to_one_device: bool = False):
        if communication_hint not in COMMUNICATION_HINTS:
            raise ValueError(f"communication_hint must be one of {COMMUNICATION_HINTS}, "
                             f"got {communication_hint!r}")
        self.keys = keys or KeyAllocator()
        self.timeout_s = timeout_s
        self.communication_hint = communication_hint
        self.reduce_to_one_device = reduce_to_one_device

    def all_reduce(self, tensors, devices, op="sum"):
        if len(tensors) == 1:
            return list(tensors)
        if self.reduce_to_one_device:
            return self._reduce_to_one_device(tensors, devices, op)
        final_op = {"sum": "Id", "mean": "Div"}[op]
        group_key = self.keys.group_key(tuple(devices))
        instance_key = self.keys.instance_key()
        outputs = []
        for tensor, device in zip(tensors, devices):
            with tf.device(device):
                outputs.append(collective_ops.all_reduce(
                    tensor, len(devices), group_key, instance_key, "Add", final_op,
                    communication_hint=self.communication_hint, timeout=self.timeout_s))
        return outputs

    @staticmethod
    def _reduce_to_one_device(tensors, devices, op):
        """The sum (or mean) on devices[0], read by every other device: what
        MirroredStrategy does among CPU devices (`ReductionToOneDevice`). Devices of one
        host's memory need no ring: a collective's chunked exchange between two virtual
        CPUs took 1.7 ms for 800,000 floats where the sum and a copy took 0.7 ms. The sum
        carries REDUCED_ATTR: `epl.ir.collectives` counts it as an all-reduce, and its
        output is the same on every replica (`epl.ir.consistency`)."""
        graph = tensors[0].graph
        with tf.device(devices[0]):
            with graph._attr_scope({REDUCED_ATTR: tf.compat.v1.AttrValue(b=True)}):
                total = tf.add_n(list(tensors))
            if op == "mean":
                total = total / tf.cast(len(tensors), total.dtype)
        outputs = [total]
        for device in devices[1:]:
            with tf.device(device):
                outputs.append(tf.identity(total))
        return outputs

    def all_gather(self, tensors, devices):
        if len(tensors) == 1:
            return list(tensors)
        group_key = self.keys.group_key(tuple(devices))
        instance_key = self.keys.instance_key()
        outputs = []
        for tensor, device in zip(tensors, devices):
            with tf.device(device):
                outputs.append(collective_ops.all_gather(
                    tensor, len(devices), group_key, instance_key,
                    communication_hint=self.communication_hint, timeout=self.timeout_s))
        return outputs

    def broadcast(self, tensor, devices):
        if len(devices) == 1:
            return [tensor]
        group_key = self.keys.group_key(tuple(devices))
        instance_key = self.keys.instance_key()
        outputs = []
        with tf.device(devices[0]):
            outputs.append(collective_ops.broadcast_send(
                tensor, tensor.shape, tensor.dtype, len(devices), group_key, instance_key,
                communication_hint=self.communication_hint, timeout=self.timeout_s))
        for device in devices[1:]:
            with tf.device(device):
                outputs.append(collective_ops.broadcast_recv(
                    tensor.shape, tensor.dtype, len(devices), group_key, instance_key,
                    communication_hint=self.communication_hint, timeout=self.timeout_s))
        return outputs


class HierarchicalCommunicator(Communicator):
    """Local collectives, then Horovod across workers when there are several."""

    def __init__(self, local: LocalCommunicator, cross=None):
        self.local = local
        self.cross = cross

    @property
    def num_workers(self) -> int:
        """How many workers take part."""
        return self.cross.size if self.cross is not None else 1

    @property
    def worker_rank(self) -> int:
        """This worker's rank among them (0 with one worker)."""
        return self.cross.rank if self.cross is not None else 0

    # Worker-level collectives: one tensor per worker, on the device it is on (the
    # passes call these, never the Horovod communicator itself). With one worker
    # each returns its input.

    def workers_all_reduce(self, tensor: tf.Tensor, op: str = "sum",
                           label: str | None = None) -> tf.Tensor:
        """`tensor` reduced (op "sum", "mean" or "max") over every worker's tensor."""
        if self.cross is None:
            return tensor
        return self.cross.all_reduce(tensor, op, label=label)

    def workers_all_gather(self, tensor: tf.Tensor, label: str | None = None) -> tf.Tensor:
        """Every worker's `tensor` concatenated along axis 0, in rank order."""
        if self.cross is None:
            return tensor
        return self.cross.all_gather(tensor, label=label)

    def workers_broadcast(self, tensor: tf.Tensor, root: int = 0,
                          label: str | None = None) -> tf.Tensor:
        """Worker `root`'s `tensor`, on every worker."""
        if self.cross is None:
            return tensor
        return self.cross.broadcast(tensor, root, label=label)

    def all_reduce(self, tensors, devices, op="sum", label=None, fragment=None):
        """As Communicator.all_reduce; `label` (and its op-name `fragment`): what the
        tensors carry, for the cross-worker collective (epl.runtime.horovod_comm)."""
        if self.cross is None:
            return self.local.all_reduce(tensors, devices, op)
        local = self.local.all_reduce(tensors, devices, "sum")
        # Every member of a local collective must run, or the others wait forever:
        # the cross-worker step reads device 0's result after all of them.
        with tf.device(devices[0]), tf.control_dependencies(local[1:]):
            total = self.cross.all_reduce(tf.identity(local[0]), "sum", label=label,
                                          fragment=fragment)
            if op == "mean":
                total = total / tf.cast(len(devices) * self.num_workers, total.dtype)
        return [total] * len(devices)

    def all_gather(self, tensors, devices, label=None):
        local = self.local.all_gather(tensors, devices) if len(tensors) > 1 else list(tensors)
        if self.cross is None:
            return local
        with tf.device(devices[0]), tf.control_dependencies(local[1:]):
            total = self.cross.all_gather(tf.identity(local[0]), label=label)
        return [total] * len(devices)

    def reduce_scatter(self, tensors, devices, label=None):
        """Sum over every device of every worker; local device r of worker w gets
        slice w * R + r of R * W equal slices along axis 0 (R local devices, W
        workers): the order `all_gather` concatenates in, so the two are inverses.

        Across workers each local device reduce-scatters its own part through
        Horovod: local reduce-scatter first (the rows every worker's slice r
        needs), then a cross-worker reduce-scatter of that part.
        """
        if self.cross is None:
            return self.local.reduce_scatter(tensors, devices)
        workers, local = self.num_workers, len(devices)
        outputs = []
        interleaved = []
        for tensor, device in zip(tensors, devices):
            with tf.device(device):  # rows [w, r, ...] -> [r, w, ...]: device r's part first
                grid = tf.reshape(tensor, [workers, local, -1])
                interleaved.append(tf.reshape(tf.transpose(grid, [1, 0, 2]), [local, -1]))
        parts = self.local.reduce_scatter(interleaved, devices)
        for part, tensor, device in zip(parts, tensors, devices):
            rows = tensor.shape[0] // (workers * local)
            with tf.device(device):
                mine = self.cross.reduce_scatter(tf.reshape(part, [workers, -1]), "sum",
                                                 label=label)
                outputs.append(tf.reshape(mine, [rows] + tensor.shape.as_list()[1:]))
        return outputs

    def broadcast(self, tensor, devices, label=None):
        if self.cross is not None:
            with tf.device(devices[0]):
                tensor = self.cross.broadcast(tensor, 0, label=label)
        return [tensor] * len(devices)

    def sum_over_workers(self, tensor: tf.Tensor) -> tf.Tensor:
        """Sum of a per-worker scalar over workers (itself with one worker).

        A value known when the graph is built (a static batch size) is
        exchanged once, now, outside the training graph: a Horovod op on
        constant inputs would be constant-folded by Grappler, i.e. run while
        TensorFlow optimizes the graph, at a moment that differs per worker.
        """
        if self.cross is None:
            return tensor
        static = tf.get_static_value(tensor)
        if static is None:
            return self.cross.all_reduce(tensor, "sum")
        values = exchange_bytes(repr(float(static)).encode(), self.local.timeout_s or 300.0)
        return tf.constant(sum(float(v.decode()) for v in values), dtype=tensor.dtype)


def reduces_to_one_device(cluster, config) -> bool:
    """Whether the worker's local all-reduces sum on one device
    (`communication.local_reduction`; "auto": on CPU devices)."""
    choice = str(config.get("communication.local_reduction"))
    if choice == "auto":
        return cluster.device_type != "GPU"
    return choice == "one_device"


def make_communicator(cluster, config) -> HierarchicalCommunicator:
    """This worker's communicator: collectives among its local devices (NCCL among
    physical GPUs, ring otherwise; all-reduces summed on one device among CPU devices,
    `reduces_to_one_device`), plus Horovod when it is one of several workers."""
    hint = local_communication_hint(cluster.device_type, cluster.num_local_devices,
                                    physical_gpu_count() if cluster.device_type == "GPU" else 0)
    local = LocalCommunicator(timeout_s=float(config.get("communication.collective_timeout_s")),
                              communication_hint=hint,
                              reduce_to_one_device=reduces_to_one_device(cluster, config))
    cross = HorovodCommunicator() if cluster.num_workers > 1 else None
    return HierarchicalCommunicator(local, cross)
