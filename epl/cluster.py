"""Cluster: the devices this worker drives, and how many workers there are.

A worker is one process (one Horovod rank). It drives its local devices in one
TensorFlow graph: its GPUs where there are any, otherwise N virtual CPU devices
created through the session config (`device_count={"CPU": N}`), N from
`cluster.virtual_devices`. Workers beyond this one are filled in by the
multi-worker runtime (rank and size come from Horovod when it is running).
"""
from __future__ import annotations

import dataclasses
import os

import tensorflow as tf
from tensorflow.python.eager import context


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The local devices of this worker and its place among the workers.

    device_type: "GPU" or "CPU".
    num_local_devices: devices this worker drives.
    worker_rank / num_workers: this worker's index and the worker count.
    """

    device_type: str
    num_local_devices: int
    worker_rank: int = 0
    num_workers: int = 1

    @staticmethod
    def current() -> "Cluster":
        """The Cluster of this worker under the active EPL config."""
        from epl.env import get_config
        return local_cluster(get_config())

    @property
    def local_devices(self) -> list[str]:
        """Device strings of the local devices, in order."""
        return [f"/device:{self.device_type}:{i}" for i in range(self.num_local_devices)]

    @property
    def host_device(self) -> str:
        """Where input pipelines and host-side ops run."""
        return "/device:CPU:0"

    def session_config(self, base: tf.compat.v1.ConfigProto | None = None) -> tf.compat.v1.ConfigProto:
        """Return a copy of `base` that creates this worker's devices.

        On a CPU-only worker it asks for `num_local_devices` virtual CPU devices;
        soft placement is left as the user set it. On a GPU worker without a
        `base`, it starts from what tf.compat.v1.Session uses without a config:
        the eager context's, which holds tf.config's logical GPUs and memory
        growth.
        """
        config = tf.compat.v1.ConfigProto()
        if base is not None:
            config.CopyFrom(base)
        elif self.device_type == "GPU":
            config.CopyFrom(context.context().config)
        if self.device_type == "CPU" and config.device_count.get("CPU", 1) < self.num_local_devices:
            config.device_count["CPU"] = self.num_local_devices
        return config


def physical_gpu_count() -> int:
    """The physical GPUs TensorFlow sees (0 without a GPU runtime)."""
    try:
        return len(tf.config.list_physical_devices("GPU"))
    except Exception:  # pragma: no cover - no GPU runtime at all
        return 0


def _gpu_count() -> int:
    """The GPU devices this worker drives: one per physical GPU, or one per
    logical GPU where `tf.config.set_logical_device_configuration` splits a
    physical one (read without initializing the runtime)."""
    try:
        return sum(len(tf.config.get_logical_device_configuration(gpu) or [gpu])
                   for gpu in tf.config.list_physical_devices("GPU"))
    except Exception:  # pragma: no cover - no GPU runtime at all
        return 0


def use_logical_gpus(count: int, memory_limit_mb: int) -> None:
    """Split the first physical GPU into `count` logical GPUs of `memory_limit_mb`.

    Call it before TensorFlow initializes its devices (TensorFlow raises
    RuntimeError after). EPL then drives them as `count` local GPU devices,
    with collectives over TensorFlow's ring (NCCL refuses a GPU twice; see
    `epl.runtime.communicators.local_communication_hint`): how a machine with
    one GPU stands for several, as virtual CPU devices do on a CPU.
    Raises ClusterError when TensorFlow sees no GPU.
    """
    from epl.errors import ClusterError
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise ClusterError("use_logical_gpus: TensorFlow sees no GPU to split")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
                  for _ in range(count)])


def _horovod_rank_size() -> tuple[int, int]:
    """Rank and size when launched by horovodrun (or epl-launch), else (0, 1)."""
    if os.environ.get("HOROVOD_RANK") is None and os.environ.get("OMPI_COMM_WORLD_RANK") is None:
        return 0, 1
    from epl.runtime.horovod_comm import horovod
    hvd = horovod()
    return hvd.rank(), hvd.size()


def local_cluster(config) -> Cluster:
    """Build the Cluster of this worker from the EPL config.

    GPUs if TensorFlow sees any (one process per GPU set is the launcher's job),
    else `cluster.virtual_devices` virtual CPU devices.
    """
    rank, size = _horovod_rank_size()
    gpus = _gpu_count()
    if gpus:
        return Cluster("GPU", gpus, rank, size)
    return Cluster("CPU", int(config.get("cluster.virtual_devices")), rank, size)
