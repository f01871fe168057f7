"""Cluster: the devices this worker drives, and how many workers there are.

A worker is one process (one Horovod rank). It drives its local devices in one
TensorFlow graph: its GPUs where there are any, otherwise N virtual CPU devices
created through the session config (`device_count={"CPU": N}`), N from
`cluster.virtual_devices`. Workers beyond this one are filled in by the
multi-worker runtime (rank and size come from Horovod when it is running).

EPL's form, ``epl.Cluster(worker_hosts="h1:port,h2:port", worker_index=i)``
(also as ``with epl.Cluster(...):``), describes the workers of the job. Here
Horovod starts the workers and says how many there are and which one this is,
so the stated hosts are checked against that (their count and this worker's
index) instead of starting TensorFlow servers: a mismatch is a ClusterError
saying how to launch the job. Without ``worker_hosts`` it is this worker's
cluster, as the runtime sees it. EPL's names are properties: `worker_num`,
`worker_index`, `gpu_num_per_worker`, `total_gpu_num`, `available_devices`
(on a CPU-only worker the "GPUs" are the virtual CPU devices that stand for
them).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import tensorflow as tf
from tensorflow.python.eager import context

from epl.env import enter_cluster, get_config
from epl.errors import ClusterError
from epl.runtime.horovod_comm import horovod

_EPL_LAYOUTS = ("all", "auto", None)   # EPL's automatic device layouts
_DEFAULT = object()   # EPL's default layout ("all"), told apart from an explicit one


@dataclasses.dataclass(frozen=True, init=False)
class Cluster:
    """The local devices of this worker and its place among the workers.

    device_type: "GPU" or "CPU".
    num_local_devices: devices this worker drives.
    worker_rank / num_workers: this worker's index and the worker count.
    hosts: the worker hosts given in EPL's form (not compared).

    `Cluster(device_type, num_local_devices, worker_rank=0, num_workers=1)`
    states a cluster; `Cluster()` or EPL's keywords (`worker_hosts`,
    `ps_hosts`, `job_name`, `worker_index`, `layout`) give this worker's
    cluster as the runtime sees it, checked against the hosts given.
    """

    device_type: str
    num_local_devices: int
    worker_rank: int = 0
    num_workers: int = 1
    hosts: tuple = dataclasses.field(default=(), compare=False, repr=False)

    def __init__(self, device_type: str | None = None, num_local_devices: int | None = None,
                 worker_rank: int = 0, num_workers: int = 1, *,
                 worker_hosts: str | None = None, ps_hosts: str | None = None,
                 job_name: str = "worker", worker_index: int = 0, layout=_DEFAULT) -> None:
        """See the class docstring; EPL's keywords are refused with a stated device type."""
        epl_form = (worker_hosts is not None or ps_hosts is not None or job_name != "worker"
                    or worker_index != 0 or layout is not _DEFAULT)
        if device_type is not None:
            if device_type not in ("CPU", "GPU"):
                raise ClusterError(
                    f"Cluster({device_type!r}, ...): the first argument is the device type, "
                    "'CPU' or 'GPU'; for EPL's list of workers write "
                    "epl.Cluster(worker_hosts='host1:port,host2:port', worker_index=i).")
            if epl_form:
                raise ClusterError(
                    "Cluster: give either a device type and count or EPL's keywords "
                    "(worker_hosts, ps_hosts, job_name, worker_index, layout), not both.")
            if num_local_devices is None:
                raise ClusterError(f"Cluster({device_type!r}): give the number of local devices "
                                   "too, e.g. Cluster('CPU', 4).")
            fields = (device_type, int(num_local_devices), int(worker_rank), int(num_workers), ())
        else:
            if num_local_devices is not None or worker_rank != 0 or num_workers != 1:
                raise ClusterError("Cluster: give the device type with the device count, e.g. "
                                   "Cluster('CPU', 4, worker_rank=0, num_workers=2).")
            fields = _epl_cluster_fields(worker_hosts, ps_hosts, job_name, worker_index,
                                         "all" if layout is _DEFAULT else layout)
        for name, value in zip(("device_type", "num_local_devices", "worker_rank",
                                "num_workers", "hosts"), fields):
            object.__setattr__(self, name, value)

    # EPL's names --------------------------------------------------------------
    @property
    def worker_num(self) -> int:
        """EPL's name for the number of workers."""
        return self.num_workers

    @property
    def worker_index(self) -> int:
        """EPL's name for this worker's index (its Horovod rank)."""
        return self.worker_rank

    @property
    def gpu_num_per_worker(self) -> int:
        """EPL's name for the devices each worker drives (GPUs, or virtual CPU devices)."""
        return self.num_local_devices

    @property
    def total_gpu_num(self) -> int:
        """EPL's name for the devices of all workers (workers x devices per worker)."""
        return self.num_local_devices * self.num_workers

    @property
    def available_devices(self) -> list[str]:
        """EPL's name for this worker's devices (`local_devices`: "/device:GPU:0", ...)."""
        return self.local_devices

    def __enter__(self) -> "Cluster":
        """`with epl.Cluster(...)`: `epl.Env.get().cluster` is this cluster until the next
        epl.init (it stays after the block, as in EPL)."""
        enter_cluster(self)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        """Nothing to undo (EPL keeps the cluster in its Env)."""

    @staticmethod
    def current() -> "Cluster":
        """The Cluster of this worker under the active EPL config."""
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
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise ClusterError("use_logical_gpus: TensorFlow sees no GPU to split")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
                  for _ in range(count)])


def use_virtual_cpus(count: int) -> bool:
    """Give the eager context `count` virtual CPU devices (eager TensorFlow 2 programs:
    tf.function steps run on the context's devices, as a graph's session runs on the
    ConfigProto's). Only possible before TensorFlow initializes its devices; returns
    False when they are already initialized with fewer (the first step then refuses,
    epl/hooks/function.py), True when they are (or already were) enough. GPU machines
    keep their GPUs."""
    if count <= 1 or physical_gpu_count():
        return True
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or []
    if len(current) >= count:
        return True
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    except RuntimeError:   # the devices were initialized before
        return len(tf.config.list_logical_devices("CPU")) >= count
    return True


def _horovod_rank_size() -> tuple[int, int]:
    """Rank and size when launched by horovodrun (or epl-launch), else (0, 1)."""
    if not _under_horovod():
        return 0, 1
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
    devices = int(config.get("cluster.virtual_devices"))
    warn_if_more_virtual_devices_than_cores(devices)
    return Cluster("CPU", devices, rank, size)


_WARNED_DEVICE_COUNTS: set = set()


def usable_cores() -> int:
    """The CPU cores this process may run on (os.sched_getaffinity where it exists)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


def warn_if_more_virtual_devices_than_cores(devices: int) -> None:
    """Warn (the "epl" logger, once per count and process) when `devices` virtual CPU
    devices exceed the cores this worker may use: they share the cores, so each runs
    slower and the step does not get faster with more of them."""
    cores = usable_cores()
    if devices <= cores or devices in _WARNED_DEVICE_COUNTS:
        return
    _WARNED_DEVICE_COUNTS.add(devices)
    logging.getLogger(__name__).warning(
        "cluster.virtual_devices is %d, more than the %d CPU core%s this worker may use: the "
        "devices share the cores, so a step is no faster than with %d (the numbers are the "
        "same)", devices, cores, "" if cores == 1 else "s", cores)


def _split_hosts(hosts: str, what: str) -> list[str]:
    """"h1:p1,h2:p2" -> ["h1:p1", "h2:p2"]; an empty entry is a ClusterError."""
    if not isinstance(hosts, str):
        raise ClusterError(f"Cluster({what}={hosts!r}): give the hosts as one string, "
                           "'host1:port,host2:port'.")
    entries = [entry.strip() for entry in hosts.split(",")]
    if not all(entries):
        raise ClusterError(f"Cluster({what}={hosts!r}) has an empty host entry; write "
                           "'host1:port,host2:port'.")
    return entries


def _epl_cluster_fields(worker_hosts, ps_hosts, job_name, worker_index, layout) -> tuple:
    """The fields of EPL's `Cluster(worker_hosts=..., ...)`: this worker's cluster, checked
    against the stated hosts. EPL counts parameter-server hosts as workers after the
    worker hosts, and a "ps" task's index after theirs."""
    if layout not in _EPL_LAYOUTS:
        raise ClusterError(
            f"Cluster(layout={layout!r}): EPL's planner places the TaskGraphs on devices; "
            "only EPL's automatic layouts are accepted ('all', 'auto' or None).")
    if job_name not in ("worker", "ps"):
        raise ClusterError(f"Cluster(job_name={job_name!r}): the job is 'worker' (or 'ps', "
                           "whose hosts EPL counts as workers).")
    detected = local_cluster(get_config())
    hosts: list[str] = []
    if worker_hosts is None:
        if ps_hosts is not None or worker_index != 0 or job_name != "worker":
            raise ClusterError("Cluster: ps_hosts, job_name and worker_index describe the "
                               "worker_hosts list; give worker_hosts='host1:port,...' too.")
        return (detected.device_type, detected.num_local_devices, detected.worker_rank,
                detected.num_workers, ())
    hosts = _split_hosts(worker_hosts, "worker_hosts")
    workers = len(hosts)
    if ps_hosts:
        hosts += _split_hosts(ps_hosts, "ps_hosts")
    if isinstance(worker_index, bool) or not isinstance(worker_index, int):
        raise ClusterError(f"Cluster(worker_index={worker_index!r}): give the index as an int.")
    index = worker_index + (workers if job_name == "ps" else 0)
    if not 0 <= index < len(hosts):
        raise ClusterError(f"Cluster(worker_index={worker_index!r}) is not a position in the "
                           f"{len(hosts)} hosts given (0 to {len(hosts) - 1}).")
    if (len(hosts), index) != (detected.num_workers, detected.worker_rank):
        launched = ("not launched by horovodrun or epl-launch (1 worker)"
                    if detected.num_workers == 1 and not _under_horovod() else
                    f"launched as worker {detected.worker_rank} of {detected.num_workers}")
        raise ClusterError(
            f"Cluster(worker_hosts=...) lists {len(hosts)} worker(s) and says this is worker "
            f"{index}, but this process was {launched}. EPL's workers are Horovod's: start "
            f"the job with `epl-launch -np {len(hosts)} -H <host:slots,...> python script.py` "
            "(or horovodrun), which sets the worker count and each worker's index; the ports "
            "in worker_hosts are not used.")
    return (detected.device_type, detected.num_local_devices, detected.worker_rank,
            detected.num_workers, tuple(hosts))


def _under_horovod() -> bool:
    """True when this process was started by horovodrun (or epl-launch)."""
    return os.environ.get("HOROVOD_RANK") is not None or \
        os.environ.get("OMPI_COMM_WORLD_RANK") is not None
