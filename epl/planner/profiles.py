"""Device capability profiles: what a device can compute, hold and move.

A `DeviceProfile` is a small immutable value the planner reads: peak FLOP/s
per dtype, memory size, memory bandwidth and the bandwidth of the links to
other devices in the same host and to other hosts.  This module holds

- a table of common accelerators with their published datasheet figures
  (dense math, no structured sparsity), plus a "CPU" profile measured on
  this machine by a short micro-benchmark;
- name normalisation and aliases (`get_profile`), with config overrides from
  `cluster.device_profiles`;
- `detect_profile`, which maps TensorFlow device names and physical device
  descriptions to profiles;
- `parse_cluster`, which reads cluster strings such as "2x8xV100-32GB,2x8xT4"
  or "2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps" (with each host's network);
- `virtual_cpu_profiles`, which lets tests make virtual CPU devices stand for
  a mixed cluster.

Conventions and decisions
-------------------------
- `peak_flops` keys are dtype names: "float32", "float16", "bfloat16" and
  "float64" for every built-in profile; GPUs from Ampere on also carry
  "tensorfloat32" (TF32 tensor-core math, which TensorFlow uses for float32
  matmuls and convolutions by default on those GPUs).  "float32" is the
  CUDA-core FP32 figure, which is the conservative choice; pass
  dtype="tensorfloat32" to `DeviceProfile.flops` where TF32 is known to be on.
- "float16" on Volta/Turing and "float16"/"bfloat16" from Ampere on are the
  dense tensor-core figures.  GPUs without bfloat16 hardware (P100, V100, T4)
  list bfloat16 at their float32 rate: TensorFlow computes it by conversion.
- Memory sizes are the nominal capacities in GiB (NVIDIA's "GB" for HBM and
  GDDR capacities are binary); slightly less is usable once the runtime has
  taken its share, so the planner should keep some headroom.
- Memory bandwidths are the datasheet figures in decimal bytes per second.
- Link bandwidths are per direction, which is what a ring all-reduce uses:
  half of the bidirectional totals on NVIDIA's datasheets (NVLink, PCIe).
- A profile's inter-node bandwidth is the rate of one network interface
  (NIC) of its host, 100 Gb/s (12.5 GB/s) for every profile: a typical RDMA
  NIC.  A host's network is a `HostNetwork`: NICs x rate, by default one NIC
  at the profile's inter_node_bandwidth.  Cluster strings give it per token
  ("2x8xA100-80GB@8x200Gbps"); `cluster.device_profiles` can change the
  per-NIC default of a profile.  Published figures for common servers (per
  host, compute fabric only, storage and management NICs not counted):
  NVIDIA DGX A100: 8 x 200 Gb/s HDR InfiniBand (eight single-port
  ConnectX-6 VPI, one per GPU; DGX A100 datasheet and User Guide
  DU-09821-001, "Component Specifications"; the storage/management NICs are
  extra); NVIDIA DGX-1 with V100: 4 x 100 Gb/s EDR InfiniBand (NVIDIA DGX-1
  with Tesla V100 System Architecture white paper: "four 100 Gb InfiniBand
  network interface cards"); NVIDIA DGX-2 (16 x V100): 8 x 100 Gb/s EDR
  InfiniBand (DGX-2 datasheet); T4 servers: at most 100 Gb/s per host, e.g.
  Google Cloud N1 VMs with T4 GPUs "up to 100 Gbps"
  (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth) and AWS
  g4dn.12xlarge (4 x T4) 50 Gbps (AWS Batch user guide, GPU jobs).
- Aliases choose the variant with the smaller memory where one name covers
  several ("V100" -> "V100-16GB", "A100" -> "A100-40GB") so that a plan made
  with the alias never needs more memory than the device has; "H100" ->
  "H100-80GB" (SXM5), "H200" -> "H200-141GB" (SXM), "P100" -> "P100-16GB".
- The CPU profile is measured once per process by a TensorFlow
  micro-benchmark (`calibrate_cpu_profile`: per-op overhead, matmul rate,
  memory bandwidth, the collectives' latency and bandwidth); different
  processes (and different Horovod workers) may measure slightly different
  figures.  Where every worker must reach the same plan, write the profile
  once (``epl-plan --calibrate --output FILE``) and give it as
  `cluster.device_profiles`, which skips the measurement.  A configured
  "CPU" profile describes the whole machine; virtual CPU devices share it.
- `op_overhead_s` and `collective_latency_s` are 0 for the GPU table (its
  published datasheet figures have none); see `DeviceProfile`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from epl.errors import ClusterError, ConfigError
# normalize_dtype lives in roofline (below both this module and the graph
# model, which needs it too); it is re-exported here.
from epl.planner.roofline import DEFAULT_EFFICIENCY, normalize_dtype  # noqa: F401

GiB = 1 << 30
GB = 10**9
TFLOPS = 10**12

#: Default inter-node bandwidth: one 100 Gb/s NIC per host, in bytes/s.
DEFAULT_INTER_NODE_BANDWIDTH = 100e9 / 8
#: Gb/s (network rates are quoted in bits) in bytes/s.
GBIT_S = 1e9 / 8
#: PCIe 3.0 x16, per direction (datasheets quote 32 GB/s bidirectional).
PCIE3_X16 = 16 * GB
#: PCIe 4.0 x16, per direction (datasheets quote 64 GB/s bidirectional).
PCIE4_X16 = 32 * GB
#: NVLink 2 on V100 SXM2: 300 GB/s total, 150 GB/s per direction.
NVLINK2_V100 = 150 * GB
#: NVLink 3 on A100 SXM4: 600 GB/s total, 300 GB/s per direction.
NVLINK3_A100 = 300 * GB
#: NVLink 4 on H100/H200 SXM: 900 GB/s total, 450 GB/s per direction.
NVLINK4_H100 = 450 * GB
#: NVLink bridge of H100 PCIe and H100 NVL cards: 600 GB/s, 300 per direction.
NVLINK4_BRIDGE_H100 = 300 * GB

#: The dtype keys every built-in profile provides.
STANDARD_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device can compute, hold and move.

    Attributes:
        name: the profile's name, e.g. "V100-32GB".
        peak_flops: dtype name -> peak dense FLOP/s, e.g. {"float32": 15.7e12}.
        memory_bytes: device memory in bytes.
        memory_bandwidth: device memory bandwidth in bytes/s.
        intra_node_bandwidth: per-direction bandwidth to another device of
            the same host (NVLink or PCIe) in bytes/s.
        inter_node_bandwidth: per-direction network bandwidth to another
            host in bytes/s.
        op_overhead_s: seconds each op of a step costs on top of its
            roofline time (launch, executor scheduling, allocation).
            Measured for the CPU (`calibrate_cpu_profile`); 0 for the GPU
            table, which keeps its published figures.  A GPU calibration
            would go here: the same chain-of-N-tiny-ops fit as the CPU's,
            run on the GPU (kernel launch and executor dispatch, a few
            microseconds per op), written by ``epl-plan --calibrate`` for
            that device and given through `cluster.device_profiles`.
        op_type_overhead_s: op type -> seconds an op of that type costs on
            top of op_overhead_s: kernels with a large fixed cost (on the
            CPU, oneDNN's small batched matmuls, einsums, transposes and
            softmaxes cost tens of microseconds whatever their size).
            Measured for the CPU; empty for the GPU table.
        optimizer_bandwidth: bytes/s the optimizer's apply ops read and
            write (variable, slots, gradient); 0: memory_bandwidth.
            Measured for the CPU (Adam's kernel moves a few GB/s where a
            copy moves tens); 0 for the GPU table.
        collective_latency_s: seconds per step of a ring collective among
            this host's devices (2 (n - 1) steps per all-reduce), on top of
            its bytes at intra_node_bandwidth.  Measured for the CPU; 0 for
            the GPU table (NCCL's latency, microseconds, would be measured
            by the same all-reduce fit on the GPUs).
        replica_sync_s: seconds per step each data-parallel replica beyond
            the first adds when the replicas' devices share one host's
            cores (virtual CPU devices): the input reads on device 0 that
            every replica waits for and the waits at the all-reduce
            barrier, on top of the replicas' work and the all-reduce's
            ring.  Measured for the CPU (`_replica_sync`); 0 for the GPU
            table (a GPU has its own cores: its replicas run side by side).
        input_read_s: seconds of one read from the input pipeline (one
            IteratorGetNext of a tf.data pipeline of in-memory slices,
            shuffled and batched, as the examples build it), beyond its
            examples; every replica (every micro-batch of every pipeline)
            reads its own batch per step, and the reads run one after the
            other on the input's device.  Measured for the CPU
            (`_input_costs`); 0 for the GPU table.
        input_example_s: seconds per example such a read takes (the
            slices gathered into the batch).  Measured for the CPU; 0 for
            the GPU table.
        replica_concurrency: how many times one replica's rate the
            replicas of a data-parallel step on `REPLICA_SYNC_DEVICES`
            virtual devices reach together (`_replica_sync`): the rates
            above are one executor's alone; virtual devices get this
            concurrency's share (`virtual_cpu_profiles`).  1 for the GPU
            table (unused: a GPU is not split into virtual devices).
        step_overhead_s: seconds a training step's session run costs
            beyond its ops (the run's dispatch and the executor's start and
            end), once per step.  Measured for the CPU (`_step_costs`); 0
            for the GPU table (a GPU calibration would fit it the same way,
            from the same reference steps run on the GPU).
        shared_by: how many virtual devices share this device's cores (n
            for `virtual_cpu_profiles`' share of the CPU among n; 1: its
            own).  Work on devices that share cores is not idle when one of
            them waits: a pipeline's bubble on one gives the cores to the
            others (`epl.planner.search`'s pipeline time).
        host_cores: the cores this process may run on
            (os.sched_getaffinity) when the profile was measured: the
            concurrency of n replicas is interpolated on the cores they can
            use (`replica_speedup`).
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    op_overhead_s: float = 0.0
    collective_latency_s: float = 0.0
    op_type_overhead_s: dict[str, float] = dataclasses.field(
        default_factory=dict)
    optimizer_bandwidth: float = 0.0
    replica_sync_s: float = 0.0
    input_read_s: float = 0.0
    input_example_s: float = 0.0
    replica_concurrency: float = 1.0
    host_cores: int = 1
    step_overhead_s: float = 0.0
    shared_by: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "op_type_overhead_s",
                           dict(self.op_type_overhead_s))

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())),
                     self.memory_bytes, self.memory_bandwidth,
                     self.intra_node_bandwidth, self.inter_node_bandwidth,
                     self.op_overhead_s, self.collective_latency_s,
                     tuple(sorted(self.op_type_overhead_s.items())),
                     self.optimizer_bandwidth, self.replica_sync_s,
                     self.input_read_s, self.input_example_s,
                     self.replica_concurrency, self.host_cores,
                     self.step_overhead_s, self.shared_by))

    def flops(self, dtype: Any = "float32") -> float:
        """Peak FLOP/s for `dtype` ("float16", "bf16", ... or a tf.DType).

        Raises ConfigError naming the dtypes the profile knows when it has no
        figure for `dtype`.
        """
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ConfigError(
                f"device profile {self.name!r} has no peak FLOP/s for dtype "
                f"{key!r}; it knows {sorted(self.peak_flops)}. Add one with "
                f"cluster.device_profiles: {{{self.name!r}: "
                f"{{'peak_flops': {{{key!r}: <FLOP/s>}}}}}}")
        return float(self.peak_flops[key])

    def with_overrides(self, **fields: Any) -> "DeviceProfile":
        """Return a copy with `fields` replaced.

        `peak_flops` given as a dict is merged into this profile's (so one
        dtype can be changed alone); given as a number it sets every dtype
        this profile lists.  Sizes may be numbers or strings with units
        ("32GiB", "900GB/s", "100Gb/s", "15.7TFLOPS").  Unknown field names
        raise ConfigError listing the valid ones.
        """
        fields = dict(fields)
        name = fields.pop("name", self.name)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a profile name must be a non-empty string, "
                              f"got {name!r}")
        values = _validated_fields(fields, context=f"profile {self.name!r}")
        values["name"] = name
        if "peak_flops" in values:
            values["peak_flops"] = _merge_flops(self.peak_flops,
                                                values["peak_flops"])
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        """The profile as a JSON-friendly dict (the form overrides accept)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HostNetwork:
    """A host's network to other hosts: `nics` interfaces of `nic_bandwidth`.

    Attributes:
        nics: network interfaces (NICs) the host's devices use to reach
            other hosts (the compute fabric; storage NICs do not count).
        nic_bandwidth: per-direction bytes/s of one NIC.
    """

    nics: int
    nic_bandwidth: float

    def __post_init__(self) -> None:
        if isinstance(self.nics, bool) or not isinstance(self.nics, int) \
                or self.nics < 1:
            raise ClusterError(f"a host network needs at least one NIC, got "
                               f"{self.nics!r}")
        if isinstance(self.nic_bandwidth, bool) or not isinstance(
                self.nic_bandwidth, (int, float)) or \
                not 0 < self.nic_bandwidth < float("inf"):
            raise ClusterError(f"a NIC's bandwidth must be a positive number "
                               f"of bytes/s, got {self.nic_bandwidth!r}")
        object.__setattr__(self, "nic_bandwidth", float(self.nic_bandwidth))

    @property
    def bandwidth(self) -> float:
        """Per-direction bytes/s of all the host's NICs together."""
        return self.nics * self.nic_bandwidth

    def __str__(self) -> str:
        """"8 x 200 Gb/s (200.0 GB/s)"."""
        return (f"{self.nics} x {self.nic_bandwidth / GBIT_S:g} Gb/s "
                f"({self.bandwidth / GB:.1f} GB/s)")


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One host of a cluster: `devices` devices of one `profile`.

    `network` is the host's network to other hosts; None (the default)
    stands for one NIC at the profile's inter_node_bandwidth and is
    replaced by that HostNetwork, so that HostSpec(p, 8) equals
    HostSpec(p, 8, HostNetwork(1, p.inter_node_bandwidth)).
    """

    profile: DeviceProfile
    devices: int
    network: HostNetwork | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ClusterError(
                f"a host needs at least one device, got {self.devices!r}")
        if self.network is None:
            object.__setattr__(self, "network", HostNetwork(
                1, self.profile.inter_node_bandwidth))
        elif not isinstance(self.network, HostNetwork):
            raise ClusterError(f"a host's network must be a HostNetwork, got "
                               f"{self.network!r}")

    @property
    def network_bandwidth(self) -> float:
        """Per-direction bytes/s of the host's network (all its NICs)."""
        return self.network.bandwidth


# --------------------------------------------------------------------------
# The table of built-in profiles.
# --------------------------------------------------------------------------

def _gpu(name: str, flops_tera: dict[str, float], memory_gib: float,
         bandwidth_gbs: float, intra: float) -> DeviceProfile:
    """Build a GPU profile from datasheet units (TFLOPS, GiB, GB/s)."""
    return DeviceProfile(
        name=name,
        peak_flops={k: v * TFLOPS for k, v in flops_tera.items()},
        memory_bytes=float(memory_gib * GiB),
        memory_bandwidth=float(bandwidth_gbs * GB),
        intra_node_bandwidth=float(intra),
        inter_node_bandwidth=DEFAULT_INTER_NODE_BANDWIDTH)


# NVIDIA Tesla P100 PCIe 16GB datasheet: 9.3 TFLOPS FP32, 18.7 TFLOPS FP16,
# 4.7 TFLOPS FP64, 16 GB CoWoS HBM2 at 732 GB/s, PCIe Gen3 x16 (no NVLink on
# the PCIe card; the SXM2 card has 10.6 TFLOPS FP32 and NVLink).
_P100 = {"float32": 9.3, "float16": 18.7, "bfloat16": 9.3, "float64": 4.7}
# NVIDIA V100 (SXM2) datasheet: 15.7 TFLOPS FP32, 125 TFLOPS tensor (FP16),
# 7.8 TFLOPS FP64, 16 or 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s.
_V100 = {"float32": 15.7, "float16": 125.0, "bfloat16": 15.7, "float64": 7.8}
# NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS mixed FP16/FP32 tensor,
# 16 GB GDDR6 at 320 GB/s, PCIe Gen3 x16.  FP64 is not on the datasheet;
# Turing runs it at 1/32 of FP32 (0.25 TFLOPS).
_T4 = {"float32": 8.1, "float16": 65.0, "bfloat16": 8.1, "float64": 0.25}
# NVIDIA A10 datasheet: 31.2 TFLOPS FP32, 62.5 TFLOPS TF32, 125 TFLOPS BF16
# and FP16 tensor (dense; 250 with sparsity), 24 GB GDDR6 at 600 GB/s,
# PCIe Gen4 x16.  FP64 is not on the datasheet; GA102 runs it at 1/64 of
# FP32 (0.49 TFLOPS).
_A10 = {"float32": 31.2, "tensorfloat32": 62.5, "float16": 125.0,
        "bfloat16": 125.0, "float64": 0.49}
# NVIDIA A100 (SXM4) datasheet: 19.5 TFLOPS FP32, 156 TFLOPS TF32, 312
# TFLOPS BF16/FP16 tensor (dense), 9.7 TFLOPS FP64; 40 GB HBM2 at 1,555 GB/s
# or 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s.
_A100 = {"float32": 19.5, "tensorfloat32": 156.0, "float16": 312.0,
         "bfloat16": 312.0, "float64": 9.7}
# Hopper figures are NVIDIA's datasheets' with sparsity halved (the
# datasheets mark the tensor-core figures "with sparsity"):
# - NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100,
#   columns "H100 SXM" and "H100 NVL"): SXM 34 TFLOPS FP64, 67 FP32, 989 TF32
#   and 1,979 BF16/FP16 tensor, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s;
#   NVL 30 FP64, 60 FP32, 835 TF32 and 1,671 BF16/FP16 tensor, 94 GB HBM3 at
#   3.9 TB/s, NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s.
# - NVIDIA H100 PCIe product brief PB-11133-001_v02 (November 2022): 26
#   TFLOPS FP64, 51 FP32, 756 TF32 and 1,513 BF16/FP16 tensor, 80 GB HBM2e at
#   2 TB/s, NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s.
# - NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200,
#   columns "H200 SXM" and "H200 NVL"): the H100's compute (SXM: 67 FP32 ...;
#   NVL: 60 FP32, 835 TF32, 1,671 BF16/FP16), 141 GB HBM3e at 4.8 TB/s; SXM
#   NVLink 900 GB/s, NVL NVLink bridge 900 GB/s per GPU.
# NVL and PCIe cards talk over the NVLink bridge only within their bridged
# pair (or four); the profiles use the bridge rate.
_H100 = {"float32": 67.0, "tensorfloat32": 494.5, "float16": 989.5,
         "bfloat16": 989.5, "float64": 34.0}
_H100_NVL = {"float32": 60.0, "tensorfloat32": 417.5, "float16": 835.5,
             "bfloat16": 835.5, "float64": 30.0}
_H100_PCIE = {"float32": 51.0, "tensorfloat32": 378.0, "float16": 756.5,
              "bfloat16": 756.5, "float64": 26.0}

_TABLE: dict[str, DeviceProfile] = {p.name: p for p in (
    _gpu("P100-16GB", _P100, 16, 732, PCIE3_X16),
    _gpu("V100-16GB", _V100, 16, 900, NVLINK2_V100),
    _gpu("V100-32GB", _V100, 32, 900, NVLINK2_V100),
    _gpu("T4", _T4, 16, 320, PCIE3_X16),
    _gpu("A10", _A10, 24, 600, PCIE4_X16),
    _gpu("A100-40GB", _A100, 40, 1555, NVLINK3_A100),
    _gpu("A100-80GB", _A100, 80, 2039, NVLINK3_A100),
    _gpu("H100-80GB", _H100, 80, 3350, NVLINK4_H100),
    _gpu("H100-PCIe", _H100_PCIE, 80, 2000, NVLINK4_BRIDGE_H100),
    _gpu("H100-NVL", _H100_NVL, 94, 3900, NVLINK4_BRIDGE_H100),
    _gpu("H200-141GB", _H100, 141, 4800, NVLINK4_H100),
    _gpu("H200-NVL", _H100_NVL, 141, 4800, NVLINK4_H100),
)}

CPU_PROFILE_NAME = "CPU"

_ALIASES = {
    "P100": "P100-16GB",
    "V100": "V100-16GB",
    "A100": "A100-40GB",
    "H100": "H100-80GB",
    "H100-SXM": "H100-80GB",
    "H200": "H200-141GB",
    "H200-SXM": "H200-141GB",
}


def known_profiles() -> list[str]:
    """Names of the built-in profiles (the table plus "CPU")."""
    return sorted(_TABLE) + [CPU_PROFILE_NAME]


def _key(name: str) -> str:
    """Normalised lookup key: upper case, no punctuation, "32G" == "32GB"."""
    key = re.sub(r"[^A-Z0-9]", "", name.upper())
    return re.sub(r"(\d)G(?=$|[A-Z])(?!B)", r"\1GB", key)


_BY_KEY = {_key(n): n for n in [*_TABLE, CPU_PROFILE_NAME]}
_BY_KEY.update({_key(alias): target for alias, target in _ALIASES.items()})


def _builtin_name(name: str) -> str | None:
    """The built-in profile `name` stands for, or None."""
    return _BY_KEY.get(_key(name))


def _builtin(name: str) -> DeviceProfile:
    """A built-in profile by canonical name (measures the CPU if needed)."""
    if name == CPU_PROFILE_NAME:
        return cpu_profile()
    return _TABLE[name]


# --------------------------------------------------------------------------
# The CPU micro-benchmark (calibration).
# --------------------------------------------------------------------------

#: Virtual CPU devices the collectives' part of the calibration runs on.
CALIBRATION_DEVICES = 2
#: Virtual CPU devices the rates (per-op costs, matmul and optimizer rates)
#: are measured on: one executor alone, as one replica runs; how many times
#: that several replicas reach together is measured apart
#: (`replica_concurrency`).
RATE_DEVICES = 1
#: Timed session runs per measurement (the median is kept).
_CALIBRATION_RUNS = 7
#: Rounds of the figures measured more than once (the median is kept).
_CALIBRATION_ROUNDS = 5
#: Timed runs of each reference training step per round.
_STEP_RUNS = 25
#: Bytes all-reduced per collective in the collective fit.
_COLLECTIVE_BYTES = (4 << 10, 1 << 20)


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return mean_y - slope * mean_x, slope


def _median(values) -> float:
    """The median of an odd number of values (the middle one)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class _Bench:
    """Times graphs built by a function of one count, on virtual CPU devices.

    Runs go through tf.compat.v1 sessions with `device_count` CPUs, with
    Grappler and the classic graph optimizer's constant folding and common
    subexpression elimination off, so the ops run as built (a chain of tiny
    ops would be folded away, and identical ops merged, otherwise); with
    as_built=False, in a session configured as a training script's (the
    reference training steps: Grappler fuses a step's ops as it does a
    user's).

    A fit's points are timed interleaved: every point's session is opened
    and warmed up first, then the runs go round the points `_CALIBRATION_RUNS`
    times, and each point keeps its median.  On a shared machine the load
    changes within seconds; interleaved, every point sees the same load, so
    a change moves the line up or down rather than tilting it (timed one
    point after the other, a fitted slope moved 3x between two calls).
    The examples' step times are medians too, taken under the same load.
    """

    def __init__(self, tf: Any, as_built: bool = True) -> None:
        self.tf = tf
        self.as_built = as_built

    def _config(self, devices: int) -> Any:
        """The session config: `devices` CPUs; the graph as built, or
        (as_built=False) optimized as a training script's session runs it."""
        tf = self.tf
        config = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
        if not self.as_built:
            return config
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        options = config.graph_options.optimizer_options
        options.opt_level = tf.compat.v1.OptimizerOptions.L0
        options.do_common_subexpression_elimination = False
        options.do_constant_folding = False
        return config

    def times(self, builds: list, devices: int,
              runs: int = _CALIBRATION_RUNS) -> list[float]:
        """Median seconds of one run of each graph that a function of
        `builds` returns, timed interleaved, `runs` runs each."""
        tf = self.tf
        sessions, fetches = [], []
        try:
            for build in builds:
                graph = tf.Graph()
                with graph.as_default():
                    fetches.append(build())
                    init = tf.compat.v1.global_variables_initializer()
                sessions.append(tf.compat.v1.Session(
                    graph=graph, config=self._config(devices)))
                sessions[-1].run(init)
                for _ in range(2):  # warm-up
                    sessions[-1].run(fetches[-1])
            samples: list[list[float]] = [[] for _ in builds]
            for _ in range(runs):
                for session, fetch, times in zip(sessions, fetches, samples):
                    start = time.perf_counter()
                    session.run(fetch)
                    times.append(time.perf_counter() - start)
        finally:
            for session in sessions:
                session.close()
        return [_median(t) for t in samples]

    def line(self, build, counts: tuple[int, ...], devices: int
             ) -> tuple[float, float]:
        """(intercept, slope) of run time over `counts` of `build`."""
        seconds = self.times([functools.partial(build, c) for c in counts],
                             devices)
        return _fit_line(list(zip(counts, seconds)))

    def slope(self, build, counts: tuple[int, ...], devices: int) -> float:
        """Seconds per unit of count: the slope of run time over `counts`."""
        return max(self.line(build, counts, devices)[1], 1e-12)


#: The training steps the step costs are fitted on (`_step_costs`):
#: ("mlp", width, layers, batch) and ("transformer", blocks, einsum).  Tiny
#: MLPs (the per-op and the fixed cost), MLPs of training widths at two
#: batches (the matmul rate apart from the optimizer's bytes, which grow
#: with the width but not the batch), a wide layer at batch 1 (the
#: optimizer's bytes, with few FLOPs) and stacks of transformer blocks
#: (layer norm, self-attention, a feed-forward layer: the costly kernels)
#: with matmul dense layers or, as BERT-style code writes them, einsums.
#: None of them is an example's model.
REFERENCE_STEPS = (("mlp", 16, 2, 8), ("mlp", 16, 10, 8),
                   ("mlp", 256, 2, 64), ("mlp", 256, 2, 256),
                   ("mlp", 512, 2, 32), ("mlp", 1024, 1, 1),
                   ("transformer", 1, False), ("transformer", 4, False),
                   ("transformer", 1, True), ("transformer", 4, True))
#: Classes of op types whose cost in a training step is fitted on top of
#: op_overhead_s, one cost per class: kernels with a large fixed cost on the
#: CPU, tens of microseconds in a step whatever their size -- oneDNN's
#: batched matmuls, transposes and softmaxes (attention), einsums (dense
#: layers written as einsums, expert dispatch), and reductions (Eigen's
#: parallel reductions: bias gradients, means, layer norms).
KERNEL_CLASSES = (("BatchMatMulV2", "Transpose", "Softmax"), ("Einsum",),
                  ("Sum", "Mean"))
#: Shape of the transformer blocks: batch, sequence, model width, heads.
_TRANSFORMER = (4, 32, 64, 4)


def _dense(tf: Any, x: Any, units: int, name: str, einsum: bool = False
           ) -> Any:
    """x @ kernel + bias, as tf.compat.v1 code writes a dense layer (an
    einsum over the last axis with einsum=True)."""
    kernel = tf.compat.v1.get_variable(
        f"{name}/kernel", [int(x.shape[-1]), units],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    bias = tf.compat.v1.get_variable(
        f"{name}/bias", [units], initializer=tf.compat.v1.zeros_initializer())
    if einsum:
        return tf.einsum("bsd,du->bsu", x, kernel) + bias
    if len(x.shape) > 2:
        return tf.tensordot(x, kernel, 1) + bias
    return tf.matmul(x, kernel) + bias


def _reference_loss(tf: Any, kind: str, *params: int) -> Any:
    """The loss of one of `REFERENCE_STEPS`, its input a variable's value
    (the input pipeline's costs are measured apart, `_input_costs`)."""
    if kind == "mlp":
        width, layers, batch = params
        x = tf.Variable(tf.ones([batch, width]), trainable=False).read_value()
        for i in range(layers):
            x = tf.nn.relu(_dense(tf, x, width, f"layer_{i}"))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros([batch], tf.int32), logits=x))
    blocks, einsum = params
    batch, length, width, heads = _TRANSFORMER
    x = tf.Variable(tf.ones([batch, length, width]) / 8,
                    trainable=False).read_value()

    def layer_norm(t, name):
        gamma = tf.compat.v1.get_variable(
            f"{name}/gamma", [width], initializer=tf.compat.v1.ones_initializer())
        beta = tf.compat.v1.get_variable(
            f"{name}/beta", [width], initializer=tf.compat.v1.zeros_initializer())
        mean, variance = tf.nn.moments(t, axes=[-1], keepdims=True)
        return (t - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta

    def split_heads(t):  # [B, L, D] -> [B, H, L, D/H]
        return tf.transpose(tf.reshape(
            t, [batch, length, heads, width // heads]), [0, 2, 1, 3])
    for i in range(blocks):
        h = layer_norm(x, f"block_{i}/ln_attention")
        q, k, v = tf.split(_dense(tf, h, 3 * width, f"block_{i}/qkv", einsum), 3, -1)
        scores = tf.matmul(split_heads(q), split_heads(k), transpose_b=True)
        context = tf.matmul(tf.nn.softmax(scores / (width // heads) ** 0.5),
                            split_heads(v))
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]),
                             [batch, length, width])
        x = x + _dense(tf, context, width, f"block_{i}/out", einsum)
        h = layer_norm(x, f"block_{i}/ln_ffn")
        h = tf.nn.relu(_dense(tf, h, 2 * width, f"block_{i}/ffn_in", einsum))
        x = x + _dense(tf, h, width, f"block_{i}/ffn_out", einsum)
    return tf.reduce_mean(tf.square(x))


def _reference_step(tf: Any, step: tuple):
    """build(): the Adam training step of `step` (one of REFERENCE_STEPS):
    the ops tf.compat.v1.train.AdamOptimizer builds (the gradients, each
    variable's two slots and its ResourceApplyAdam), built as EPL's own
    autodiff and raw apply kernels so that EPL's optimizer hooks, when EPL
    is initialised in this process, record no training step (a session on
    a recorded step would be parallelized)."""
    from epl.ir.autodiff import internal_autodiff

    def build():
        loss = _reference_loss(tf, *step)
        variables = tf.compat.v1.trainable_variables()
        with internal_autodiff():
            grads = tf.gradients(loss, variables)
        updates = []
        for var, grad in zip(variables, grads):
            m, v = (tf.Variable(tf.zeros(var.shape), trainable=False)
                    for _ in range(2))
            updates.append(tf.raw_ops.ResourceApplyAdam(
                var=var.handle, m=m.handle, v=v.handle, beta1_power=0.9,
                beta2_power=0.999, lr=1e-3, beta1=0.9, beta2=0.999,
                epsilon=1e-7, grad=grad))
        return tf.group(*updates)
    return build


def _step_terms(tf: Any, step: tuple) -> list[float]:
    """What the planner counts in one of `REFERENCE_STEPS`, the terms of
    `_step_costs`' fit: [1 (the fixed cost), ops, FLOPs, the optimizer's
    bytes, then each of `KERNEL_CLASSES`' ops].  The ops are the forward,
    backward and apply ops `epl.planner.graph_model.model_from_graph` counts
    (as the planner counts an example's); the FLOPs
    `epl.planner.cost_model.graph_cost`'s;
    the optimizer's bytes Adam's (variable, slots and gradient in, variable
    and slots out: 3 + 2 x 2 times the parameter bytes)."""
    from epl.planner import cost_model
    from epl.planner.graph_model import model_from_graph
    with tf.Graph().as_default() as graph:
        _reference_step(tf, step)()
    spec = model_from_graph(graph)
    counts: dict[str, int] = {}
    for layer in spec.layers:
        for op_type, count in layer.op_counts:
            counts[op_type] = counts.get(op_type, 0) + count
    params = sum(layer.parameter_bytes for layer in spec.layers)
    return [1.0, float(sum(counts.values())),
            cost_model.graph_cost(graph)[cost_model.ALL].flops,
            params * (3 + 2 * cost_model.optimizer_slots("adam")),
            *(float(sum(counts.get(t, 0) for t in types))
              for types in KERNEL_CLASSES)]


#: Smallest value of each coefficient of the step fit (seconds per unit of
#: its term): a term the noise drives to zero or below is held at this (an
#: op costs at least 1 ns; FLOPs and bytes at most 1 PFLOP/s and 10 TB/s).
#: The per-op cost is small beside the kernel classes and the fixed cost
#: (0-0.2 us fitted here), so noise can take it to the floor.
_FIT_FLOORS = (0.0, 1e-9, 1e-15, 1e-13) + (0.0,) * len(KERNEL_CLASSES)


def _fit_nonnegative(rows: list[list[float]], times: list[float],
                     floors: tuple[float, ...]) -> list[float]:
    """Least-squares coefficients c of times ~ rows @ c, each at least its
    floor: a coefficient the fit puts below its floor is held there and the
    others are fitted again (an active set), so that noise cannot give a
    negative cost."""
    import numpy as np
    a, y = np.asarray(rows, float), np.asarray(times, float)
    fixed: dict[int, float] = {}
    while True:
        free = [j for j in range(a.shape[1]) if j not in fixed]
        rest = y - sum(a[:, j] * v for j, v in fixed.items())
        coef = np.linalg.lstsq(a[:, free], rest, rcond=None)[0] if free \
            else []
        low = [(c - floors[j], j) for c, j in zip(coef, free)
               if c < floors[j]]
        if not low:
            out = [0.0] * a.shape[1]
            for j, v in fixed.items():
                out[j] = v
            for c, j in zip(coef, free):
                out[j] = float(c)
            return out
        fixed[min(low)[1]] = floors[min(low)[1]]


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What a training step costs on this CPU, fitted by `_step_costs`.

    Attributes:
        fixed_s: seconds of a session run of a training step beyond its ops.
        op_s: seconds per counted op.
        flop_rate: FLOP/s of the step's counted FLOPs.
        optimizer_bandwidth: bytes/s of the optimizer's apply ops.
        kernel_s: op type -> seconds per op beyond op_s, for the types of
            `KERNEL_CLASSES` (one cost per class).
    """

    fixed_s: float
    op_s: float
    flop_rate: float
    optimizer_bandwidth: float
    kernel_s: dict[str, float]


def _step_costs(terms: list[list[float]], seconds: list[float]
                ) -> StepCosts:
    """The step costs fitted on the `REFERENCE_STEPS`' terms
    (`_step_terms`) and measured seconds per step: time = fixed + ops x
    op_s + FLOPs / flop_rate + optimizer bytes / optimizer_bandwidth +
    each kernel class's ops x its cost, least squares with no cost below
    zero."""
    fixed, op, per_flop, per_byte, *kernels = _fit_nonnegative(
        terms, seconds, _FIT_FLOORS)
    return StepCosts(fixed_s=fixed, op_s=op, flop_rate=1.0 / per_flop,
                     optimizer_bandwidth=1.0 / per_byte,
                     kernel_s={t: cost for types, cost in
                               zip(KERNEL_CLASSES, kernels) for t in types})


def _all_reduces(tf: Any, nbytes: int, devices: int):
    """build(n): n chained all-reduces of `nbytes` over `devices` devices
    (TensorFlow's collective ops, as EPL's local gradient reduction)."""
    from tensorflow.python.ops import collective_ops

    def build(n: int):
        outs = []
        for d in range(devices):
            with tf.device(f"/device:CPU:{d}"):
                x = tf.Variable(tf.ones([nbytes // 4])).read_value()
                for c in range(n):
                    x = collective_ops.all_reduce(x, devices, 1, 1 + c, "Add",
                                                  "Id")
                outs.append(x)
        return tf.group(*outs)
    return build


_COPY_BYTES = 32 << 20
_COPY_SECONDS = 0.05


def _best_rate(work: float, run, seconds: float) -> float:
    """Best observed `work` per second of `run()` over about `seconds`."""
    run()  # warm up (thread pools, page faults)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            return work / max(best, 1e-9)


def _measure_copy_bandwidth() -> float:
    """Memory bandwidth in B/s from a 32 MiB numpy copy (read + write)."""
    import numpy as np
    src = np.ones(_COPY_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    return _best_rate(2.0 * _COPY_BYTES, lambda: np.copyto(dst, src),
                      _COPY_SECONDS)


def _replica_steps(tf: Any, devices: int, real: bool, width: int = 256,
                   layers: int = 2):
    """build(batch): `devices` replicas of a 2-layer `width`-wide MLP's
    training step (matmuls, their gradients, the SGD apply kernel), one per
    virtual device.  real=True builds the structure of a data-parallel
    step: every replica reads its batch from one input pipeline
    (`_input_dataset`) whose iterator sits on device 0 (as EPL places the
    input), and the replicas'
    gradients are fused (concat) and all-reduced in one collective (split
    back) before the apply; real=False the same replicas independently,
    each on a constant batch of its own."""
    from tensorflow.python.ops import collective_ops

    def build(batch: int):
        if real:
            with tf.device("/device:CPU:0"):
                iterator = tf.compat.v1.data.make_one_shot_iterator(
                    _input_dataset(tf, batch, width))
        trains = []
        for d in range(devices):
            if real:
                with tf.device("/device:CPU:0"):
                    x, _ = iterator.get_next()
            with tf.device(f"/device:CPU:{d}"):
                if not real:
                    x = tf.ones([batch, width])
                weights = [tf.Variable(tf.ones([width, width]) / width)
                           for _ in range(layers)]
                values = [w.read_value() for w in weights]
                for value in values:
                    x = tf.nn.relu(tf.matmul(x, value))
                grads = tf.gradients(tf.reduce_sum(x), values)
                if real and devices > 1:
                    flat = collective_ops.all_reduce(
                        tf.concat([tf.reshape(g, [-1]) for g in grads], 0),
                        devices, 1, 1, "Add", "Id")
                    grads = [tf.reshape(g, [width, width])
                             for g in tf.split(flat, layers)]
                trains += [tf.raw_ops.ResourceApplyGradientDescent(
                    var=w.handle, alpha=0.01, delta=g)
                    for w, g in zip(weights, grads)]
        return tf.group(*trains)
    return build


#: Per-replica batches of the replica-step fit.
_REPLICA_BATCHES = (16, 128)
#: Virtual devices of the replica-step fit: more replicas than a small
#: host has cores, so that the fit sees them take turns.
REPLICA_SYNC_DEVICES = 4


#: Examples held by the input pipeline of the input and replica fits.
_INPUT_EXAMPLES = 4096
#: Batches of the input-read fit.
_INPUT_BATCHES = (8, 256)


def _input_dataset(tf: Any, batch: int, width: int) -> Any:
    """The input pipeline the examples build: in-memory slices (float
    features of `width`, an int64 label), shuffled over all of them,
    repeated and batched."""
    import numpy as np
    rng = np.random.RandomState(0)
    features = rng.randn(_INPUT_EXAMPLES, width).astype(np.float32)
    labels = rng.randint(0, 10, _INPUT_EXAMPLES).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.shuffle(_INPUT_EXAMPLES, seed=0).repeat().batch(
        batch, drop_remainder=True)


def _input_costs(bench: "_Bench", tf: Any) -> tuple[float, float]:
    """(seconds per read, seconds per example) of reads from
    `_input_dataset` (64 features): the line of a session run's time over
    the batch read, less the time of a run of nothing (a NoOp: the
    session's own fixed cost), timed interleaved."""
    def reads(batch: int):
        with tf.device("/device:CPU:0"):
            return tf.group(*tf.compat.v1.data.make_one_shot_iterator(
                _input_dataset(tf, batch, 64)).get_next())
    times = bench.times([tf.no_op] + [functools.partial(reads, b)
                                      for b in _INPUT_BATCHES], 1)
    intercept, slope = _fit_line(list(zip(_INPUT_BATCHES, times[1:])))
    return max(intercept - times[0], 0.0), max(slope, 0.0)


def _replica_sync(bench: "_Bench", tf: Any, devices: int, latency: float,
                  link: float, memory_bandwidth: float, read: float
                  ) -> tuple[float, float]:
    """(sync seconds, concurrency) of data-parallel replicas on `devices`
    virtual devices.

    Sync seconds: per step, what each replica beyond the first adds to a
    data-parallel step on `devices` virtual devices, beyond its own work
    and the all-reduce's ring: `devices` replicas of a real data-parallel
    step (`_replica_steps`, real=True) against the same replicas run
    independently (real=False), timed interleaved at two batches.

    The extra fixed time of the real step (the difference of the two
    lines' intercepts) less the all-reduce the planner predicts for its
    gradients (`roofline.comm_time` at `link` and `latency`, with the
    fusion copies at `memory_bandwidth`) and less the replicas' input
    reads (`read` seconds each, `input_read_s`), per replica beyond the
    first: the replicas' waits at the all-reduce barrier.

    Concurrency: how many times one replica's rate the `devices` replicas
    of the real step reach together, `devices` times the per-example time
    (the slope over the batch) of one replica alone (the same step on one
    device) over the per-example time of the `devices` replicas (1: they
    take turns on the shared cores; up to the host's cores where they ran
    side by side).
    """
    from epl.planner import roofline
    steps = [_replica_steps(tf, devices, False),
             _replica_steps(tf, devices, True), _replica_steps(tf, 1, True)]
    times = bench.times([functools.partial(step, b) for step in steps
                         for b in _REPLICA_BATCHES], devices, runs=_STEP_RUNS)
    span = _REPLICA_BATCHES[1] - _REPLICA_BATCHES[0]
    free_fixed = times[0] - (times[1] - times[0]) / span * \
        _REPLICA_BATCHES[0]
    real_fixed = times[2] - (times[3] - times[2]) / span * \
        _REPLICA_BATCHES[0]
    nbytes = 2 * 256 * 256 * 4.0  # the two layers' float32 gradients
    allreduce = roofline.comm_time(nbytes, link, devices, latency) + \
        4 * nbytes / memory_bandwidth
    sync = max(real_fixed - free_fixed - allreduce - devices * read, 0.0) \
        / (devices - 1)
    concurrency = devices * max(times[5] - times[4], 1e-12) / \
        max(times[3] - times[2], 1e-12)
    return sync, min(max(concurrency, 1e-3), float(devices))


def calibrate_cpu_profile(progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Measure this machine's "CPU" profile with TensorFlow (~30 s on 2 cores).

    progress(line), when given, is told as each round starts and before the fit.

    Needs TensorFlow (imported here, so that planning on the GPU table
    never loads it).  The rates are one executor's alone, measured on
    `RATE_DEVICES` (one) device, as one replica runs; what several replicas
    on virtual devices reach together is `replica_concurrency`:

    - The step costs (`_step_costs`): the training steps of
      `REFERENCE_STEPS` (small MLPs and transformer stacks with Adam,
      none of them an example's model) are timed on one device in a
      session as a training script opens it (Grappler on), and the
      planner's own counts of each step (its ops, FLOPs, optimizer bytes
      and costly kernels, `_step_terms`) fitted to the times by least
      squares.  A step's kernels cost far more than the same kernels in a
      chain: a chain of 64x256x256 matmuls ran at 180 GFLOP/s where a
      training step's ran at 140, Adam's apply moved 40 GB/s alone, and
      softmaxes and batched matmuls in a chain cost 22-25 us, in a step
      about 45 (this machine); fitted, the costs are the step's.  They give
      - step_overhead_s: the fixed cost of a step's session run;
      - op_overhead_s: seconds per counted op;
      - peak_flops: the float32 rate of the steps' FLOPs, divided by
        `epl.planner.roofline.DEFAULT_EFFICIENCY` so that the planner's
        default efficiency predicts that rate; float16 and bfloat16 at the
        float32 rate, float64 at half;
      - optimizer_bandwidth: the bytes Adam's apply ops move per second;
      - op_type_overhead_s: the types of `KERNEL_CLASSES`, each class's
        fitted cost of one such kernel beyond op_overhead_s.
      The steps are timed in five rounds spread through the calibration,
      each step's median kept: on a shared machine a round samples the load
      of under a second, which flips between states 2x apart.
    - memory_bandwidth: a 32 MiB numpy copy (read + write).
    - replica_sync_s: the median of five rounds of `_replica_sync` on
      `REPLICA_SYNC_DEVICES` devices (a real data-parallel step's extra
      fixed time per replica, beyond its work, its input read and the
      all-reduce's ring).
    - input_read_s and input_example_s: reads of a shuffled, batched
      pipeline of in-memory slices (`_input_costs`), the session's own
      fixed cost (a NoOp's run) taken off.
    - intra_node_bandwidth and collective_latency_s: chained all-reduces
      of 4 KiB and 1 MiB over `CALIBRATION_DEVICES` virtual devices; the
      small one's time over its 2 (n - 1) ring steps is the latency, the
      bytes every device sends (2 (n - 1) / n of the buffer each) over the
      extra time of the large one the bandwidth of the whole CPU
      (`virtual_cpu_profiles` divides it among the devices, which share it).

    Memory is the machine's RAM; inter-node bandwidth the 100 Gb/s default.
    """
    import tensorflow as tf

    bench, k, one = _Bench(tf), CALIBRATION_DEVICES, RATE_DEVICES
    as_run = _Bench(tf, as_built=False)
    steps = [_reference_step(tf, step) for step in REFERENCE_STEPS]
    rounds, syncs = [], []
    say = progress or (lambda line: None)
    for round_ in range(_CALIBRATION_ROUNDS):
        say(f"calibrating the CPU profile: round {round_ + 1} of {_CALIBRATION_ROUNDS} "
            f"({len(steps)} reference training steps"
            f"{', memory, collectives and input reads' if round_ == 0 else ''}, replica sync)")
        rounds.append(as_run.times(steps, one, runs=_STEP_RUNS))
        if round_ == 0:
            bandwidth = _measure_copy_bandwidth()
            small, large = (bench.slope(_all_reduces(tf, b, k), (1, 5), k)
                            for b in _COLLECTIVE_BYTES)
            latency = small / (2 * (k - 1))
            moved = 2 * (k - 1) * (_COLLECTIVE_BYTES[1] - _COLLECTIVE_BYTES[0])
            link = moved / max(large - small, 1e-12)
            read, per_example = _input_costs(bench, tf)
        syncs.append(_replica_sync(bench, tf, REPLICA_SYNC_DEVICES, latency,
                                   link, bandwidth, read))
    say("calibrating the CPU profile: fitting the step costs")
    costs = _step_costs([_step_terms(tf, step) for step in REFERENCE_STEPS],
                        [_median(times) for times in zip(*rounds)])
    fp32 = costs.flop_rate / DEFAULT_EFFICIENCY
    return DeviceProfile(
        name=CPU_PROFILE_NAME,
        peak_flops={"float32": fp32, "float16": fp32, "bfloat16": fp32,
                    "float64": fp32 / 2},
        memory_bytes=float(_total_ram_bytes()),
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=link,
        inter_node_bandwidth=DEFAULT_INTER_NODE_BANDWIDTH,
        op_overhead_s=costs.op_s,
        collective_latency_s=latency,
        op_type_overhead_s=costs.kernel_s,
        optimizer_bandwidth=costs.optimizer_bandwidth,
        step_overhead_s=costs.fixed_s,
        replica_sync_s=_median(sync for sync, _ in syncs),
        replica_concurrency=_median(c for _, c in syncs),
        host_cores=_host_cores(), input_read_s=read,
        input_example_s=per_example)


def _total_ram_bytes() -> int:
    """This machine's physical memory in bytes (os.sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """The "CPU" profile of this machine, measured once per process
    (`calibrate_cpu_profile`, ~30 s, imports TensorFlow).  To skip the
    measurement (and have every worker plan with the same figures), write
    a profile file with ``epl-plan --calibrate --output FILE`` and give it
    as `cluster.device_profiles` or ``epl-plan --profiles FILE``."""
    return calibrate_cpu_profile()


def profile_file(profile: DeviceProfile) -> dict[str, dict[str, Any]]:
    """{name: fields}: the JSON object ``epl-plan --profiles`` and
    `cluster.device_profiles` accept, defining `profile` in full."""
    fields = profile.to_dict()
    name = fields.pop("name")
    return {name: fields}


# --------------------------------------------------------------------------
# Field values and overrides.
# --------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceProfile))
_OVERRIDE_FIELDS = tuple(f for f in _FIELDS if f != "name")
#: Fields with a default (0: not modelled) that a new profile may leave out.
_OPTIONAL_FIELDS = ("op_overhead_s", "collective_latency_s",
                    "op_type_overhead_s", "optimizer_bandwidth",
                    "replica_sync_s", "input_read_s", "input_example_s",
                    "replica_concurrency", "host_cores", "step_overhead_s",
                    "shared_by")
_REQUIRED_FIELDS = tuple(f for f in _OVERRIDE_FIELDS
                         if f not in _OPTIONAL_FIELDS)
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PREFIX = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "KI": 2.0**10, "MI": 2.0**20, "GI": 2.0**30, "TI": 2.0**40,
           "PI": 2.0**50}
_UNITS = {  # field kind -> unit suffixes and the factor each stands for
    "bytes": {"": 1, "B": 1},
    "rate": {"": 1, "B/S": 1, "BPS": 1, "BIT/S": 1 / 8, "BITS/S": 1 / 8},
    "flops": {"": 1, "FLOPS": 1, "FLOP/S": 1},
}
_FIELD_KIND = {"op_overhead_s": "seconds", "collective_latency_s": "seconds",
               "replica_sync_s": "seconds", "input_read_s": "seconds",
               "input_example_s": "seconds",
               "replica_concurrency": "number", "host_cores": "count",
               "step_overhead_s": "seconds", "shared_by": "count",
               "op_type_overhead_s": "seconds by op type",
               "optimizer_bandwidth": "rate or zero",
               "memory_bytes": "bytes", "memory_bandwidth": "rate",
               "intra_node_bandwidth": "rate",
               "inter_node_bandwidth": "rate", "peak_flops": "flops"}


def parse_quantity(value: Any, kind: str, where: str) -> float:
    """A positive number from `value`: a number or a string with units.

    kind is "bytes" ("16GiB", "16GB"), "rate" ("900GB/s", "100Gb/s" -- a
    lower-case "b" in a rate means bits) or "flops" ("15.7TFLOPS").
    Raises ConfigError naming `where` for anything else.
    """
    bad = ConfigError(f"{where}: expected a positive number, got {value!r}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        number = _parse_unit_string(value, kind, where)
    else:
        raise bad
    if not number > 0 or number == float("inf"):
        raise bad
    return number


_SECONDS = {"": 1.0, "S": 1.0, "MS": 1e-3, "US": 1e-6, "NS": 1e-9}


def parse_seconds(value: Any, where: str) -> float:
    """A non-negative duration in seconds from a number or a string with a
    unit ("3.5us", "0.2 ms", "1e-6"); 0 means "not modelled".  Raises
    ConfigError naming `where` for anything else."""
    bad = ConfigError(f"{where}: expected a non-negative number of seconds "
                      f"or a string such as '3.5us', got {value!r}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", value.strip())
        if not match or match.group(2).upper() not in _SECONDS:
            raise bad
        number = float(match.group(1)) * _SECONDS[match.group(2).upper()]
    else:
        raise bad
    if not 0 <= number < float("inf"):
        raise bad
    return number


def _parse_unit_string(text: str, kind: str, where: str) -> float:
    """Parse "<number><prefix><unit>" into a float (see `parse_quantity`)."""
    match = re.fullmatch(_NUMBER + r"\s*([kKmMgGtTpP]?)(i?)([a-zA-Z/]*)",
                         text.strip())
    if match:
        number, prefix, binary, unit = match.groups()
        if kind == "rate" and re.fullmatch(r"b(ps|/s)?", unit):
            unit = "bit/s"  # "Gb/s", "Gbps": bits
        prefix_key = (prefix + binary).upper()
        factor = _UNITS[kind].get(unit.upper())
        if prefix_key in _PREFIX and factor is not None:
            return float(number) * _PREFIX[prefix_key] * factor
    examples = {"bytes": "17179869184, '16GiB', '16GB'",
                "rate": "9e11, '900GB/s', '100Gb/s'",
                "flops": "15.7e12, '15.7TFLOPS'"}[kind]
    raise ConfigError(f"{where}: cannot read {text!r}; expected a number or "
                      f"a string such as {examples}")


def _validated_fields(fields: Mapping[str, Any], context: str) -> dict:
    """Check override field names and parse their values."""
    unknown = sorted(set(fields) - set(_OVERRIDE_FIELDS))
    if unknown:
        raise ConfigError(
            f"{context}: unknown device profile field(s) {unknown}; valid "
            f"fields are {list(_OVERRIDE_FIELDS)} (and 'base' in "
            f"cluster.device_profiles, naming a profile to start from)")
    values = {}
    for field, value in fields.items():
        where = f"{context}, field {field!r}"
        if field == "peak_flops":
            values[field] = _parse_flops(value, where)
        elif _FIELD_KIND[field] == "seconds by op type":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: expected a mapping of op type "
                                  f"to seconds, got {value!r}")
            values[field] = {str(k): parse_seconds(v, f"{where}[{k!r}]")
                             for k, v in value.items()}
        elif _FIELD_KIND[field] == "rate or zero":
            values[field] = 0.0 if value == 0 and not isinstance(
                value, bool) else parse_quantity(value, "rate", where)
        elif _FIELD_KIND[field] == "seconds":
            values[field] = parse_seconds(value, where)
        elif _FIELD_KIND[field] in ("number", "count"):
            if isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not 0 < value < float("inf") or (
                    _FIELD_KIND[field] == "count" and value != int(value)):
                raise ConfigError(f"{where}: expected a positive "
                                  f"{'whole ' if _FIELD_KIND[field] == 'count' else ''}"
                                  f"number, got {value!r}")
            values[field] = int(value) if _FIELD_KIND[field] == "count" \
                else float(value)
        else:
            values[field] = parse_quantity(value, _FIELD_KIND[field], where)
    return values


def _parse_flops(value: Any, where: str) -> dict[str, float] | float:
    """peak_flops override: a dtype -> FLOP/s mapping or one number."""
    if isinstance(value, Mapping):
        return {normalize_dtype(k): parse_quantity(v, "flops",
                                                   f"{where}[{k!r}]")
                for k, v in value.items()}
    return parse_quantity(value, "flops", where)


def _merge_flops(base: Mapping[str, float],
                 new: Mapping[str, float] | float) -> dict[str, float]:
    """Merge a peak_flops override into `base` (a number sets every dtype)."""
    if isinstance(new, Mapping):
        return {**base, **new}
    return {dtype: new for dtype in (base or STANDARD_DTYPES)}


def _how_to_add() -> str:
    """The hint every unknown-profile error ends with."""
    return ("add one under the config key cluster.device_profiles, either "
            "from a known profile, e.g. {'MyGPU': {'base': 'A100-40GB', "
            "'memory_bytes': '24GiB'}}, or with every field: {'MyGPU': "
            "{'peak_flops': {'float32': 2e13, 'float16': 1.5e14}, "
            "'memory_bytes': 2.4e10, 'memory_bandwidth': 9e11, "
            "'intra_node_bandwidth': 3.2e10, 'inter_node_bandwidth': "
            "1.25e10}}")


def _unknown_profile(name: str, overrides: Mapping | None) -> ClusterError:
    """The ClusterError for a profile name nobody defines."""
    custom = sorted(overrides or {})
    extra = f"; configured in cluster.device_profiles: {custom}" if custom \
        else ""
    return ClusterError(
        f"unknown device profile {name!r}. Known profiles: "
        f"{known_profiles()}; aliases: {sorted(_ALIASES)}{extra}. To use "
        f"another device, {_how_to_add()}")


def _find_override(name: str, overrides: Mapping | None):
    """(override key, spec) for `name` in `overrides`, or None."""
    if not overrides:
        return None
    wanted = {_key(name)}
    builtin = _builtin_name(name)
    if builtin:
        wanted.add(_key(builtin))
    for key in overrides:
        if isinstance(key, str) and _key(key) in wanted:
            return key, overrides[key]
    return None


def _spec_fields(key: str, spec: Any) -> tuple[str | None, dict]:
    """(base name or None, field dict) of one cluster.device_profiles entry."""
    where = f"cluster.device_profiles[{key!r}]"
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, DeviceProfile):
        return None, {f: getattr(spec, f) for f in _OVERRIDE_FIELDS}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected a profile name or a dict of "
                          f"fields, got {spec!r}")
    fields = dict(spec)
    base = fields.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{where}: 'base' must name a profile, got {base!r}")
    return base, _validated_fields(fields, where)


def _from_spec(key: str, spec: Any, overrides: Mapping | None,
               resolving: tuple[str, ...]) -> DeviceProfile:
    """Build the profile named `key` from its cluster.device_profiles entry."""
    base, fields = _spec_fields(key, spec)
    if base is None and _builtin_name(key) and \
            not set(_REQUIRED_FIELDS) <= set(fields):
        base = _builtin_name(key)  # overriding some fields of a known one
    if base is None:
        missing = [f for f in _REQUIRED_FIELDS if f not in fields]
        if missing:
            raise ConfigError(
                f"cluster.device_profiles[{key!r}] defines a new profile but "
                f"lacks field(s) {missing}; give them or a 'base' profile "
                f"to start from, e.g. {{'base': 'A100-40GB', ...}}")
        fields["peak_flops"] = _merge_flops({}, fields["peak_flops"])
        return DeviceProfile(name=key, **fields)
    start = _resolve(base, overrides, resolving + (key,))
    return dataclasses.replace(start.with_overrides(**fields), name=key)


def _resolve(name: str, overrides: Mapping | None,
             resolving: tuple[str, ...] = ()) -> DeviceProfile:
    """Look `name` up in overrides, then in the built-in table."""
    if not isinstance(name, str) or not name.strip():
        raise ClusterError(f"a device profile name must be a non-empty "
                           f"string, got {name!r}")
    found = _find_override(name, overrides)
    if found and found[0] not in resolving:
        return _from_spec(found[0], found[1], overrides, resolving)
    if found:
        if _builtin_name(name):  # "A100" overriding itself from its base
            return _builtin(_builtin_name(name))
        chain = " -> ".join(resolving + (found[0],))
        raise ConfigError(f"cluster.device_profiles: 'base' entries form a "
                          f"cycle: {chain}")
    builtin = _builtin_name(name)
    if builtin is None:
        raise _unknown_profile(name, overrides)
    return _builtin(builtin)


def get_profile(name: str,
                overrides: Mapping[str, Any] | None = None) -> DeviceProfile:
    """The profile called `name` (case-insensitive; aliases allowed).

    Args:
        name: a built-in profile ("V100-32GB", "a100", "T4", "CPU", ...) or
            a key of `overrides`.
        overrides: the `cluster.device_profiles` config value: profile name
            (new or existing) -> dict of fields, optionally with "base"
            naming the profile to start from, or a plain string naming
            another profile.  An entry for an existing name changes only the
            fields it gives.

    Returns:
        The DeviceProfile; entries of `overrides` take precedence.

    Raises:
        ClusterError: `name` is neither built in nor configured (the message
            lists the known profiles and how to add one).
        ConfigError: an override has unknown fields or bad values.
    """
    return _resolve(name, overrides)


# --------------------------------------------------------------------------
# Detection from TensorFlow device names.
# --------------------------------------------------------------------------

# (pattern over the upper-cased GPU model name, profile); first match wins.
# The model names are those TensorFlow's device details and nvidia-smi give,
# e.g. "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3" (SXM),
# "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A10G",
# "Tesla V100-SXM2-32GB", "Tesla T4", "Tesla P100-PCIE-16GB".  Word
# boundaries keep other models out: "NVIDIA GH200 480GB" (Grace Hopper),
# "NVIDIA RTX A1000", "NVIDIA T400" match nothing and are reported as unknown.
_GPU_PATTERNS = (
    (r"\bH200\b.*\bNVL\b", "H200-NVL"),
    (r"\bH200\b", "H200-141GB"),
    (r"\bH100\b.*\bNVL\b", "H100-NVL"),
    (r"\bH100\b.*\bPCIE\b", "H100-PCIe"),
    (r"\bH100\b", "H100-80GB"),
    (r"\bA100\b.*\b80\s*GB?\b", "A100-80GB"),
    (r"\bA100\b", "A100-40GB"),
    (r"\bA10G?\b", "A10"),
    (r"\bT4\b", "T4"),
    (r"\bV100S?\b.*\b32\s*GB?\b", "V100-32GB"),
    (r"\bV100S?\b", "V100-16GB"),
    (r"\bP100\b", "P100-16GB"),
)


def _device_type(device_name: str) -> str:
    """"CPU", "GPU", ... from "/job:w/replica:0/task:0/device:GPU:0" etc."""
    match = re.search(r"(?:^|[/:])(?:device:)?([A-Za-z_]+):\d+\s*$",
                      device_name.strip())
    if match:
        return match.group(1).upper()
    return device_name.strip().upper()


def _gpu_model(description: str) -> str:
    """The model name in a TF physical device description."""
    match = re.search(r"name:\s*([^,]+)", description)
    return (match.group(1) if match else description).strip()


def _stated_memory_gb(model: str) -> int | None:
    """The memory size a model name states ("...-16GB", "80GB HBM3"), or None."""
    sizes = re.findall(r"(?<![0-9])([0-9]+)\s*GB\b", model.upper())
    return int(sizes[-1]) if sizes else None


def gpu_profile_name(model: str) -> str:
    """The built-in profile of the GPU model `model`, e.g. "NVIDIA H200".

    Raises ClusterError saying why for a model no pattern covers, and for
    one whose name states another memory size than the profile it matches
    (a "Tesla P100-PCIE-12GB" is not a P100-16GB: planning it with 16 GiB
    would overcommit its memory).
    """
    upper = model.upper()
    for pattern, name in _GPU_PATTERNS:
        if re.search(pattern, upper):
            stated = _stated_memory_gb(model)
            if stated is not None and stated != round(
                    _TABLE[name].memory_bytes / GiB):
                raise ClusterError(
                    f"GPU model {model!r} states {stated} GB of memory, but "
                    f"the profile its name matches, {name!r}, has "
                    f"{_TABLE[name].memory_bytes / GiB:g} GiB")
            return name
    raise ClusterError(f"no built-in profile matches the GPU model "
                       f"{model!r}")


def detect_profile(device_name: str, physical_description: str = "",
                   overrides: Mapping[str, Any] | None = None
                   ) -> DeviceProfile:
    """Map a TensorFlow device to its profile.

    Args:
        device_name: e.g. "/device:GPU:0", "/job:worker/task:1/device:CPU:0".
        physical_description: TensorFlow's physical_device_desc, e.g.
            "device: 0, name: Tesla V100-SXM2-32GB, pci bus id: 0000:00:04.0,
            compute capability: 7.0", or just a model name such as
            "NVIDIA A100-SXM4-80GB" (what
            tf.config.experimental.get_device_details gives as
            "device_name").
        overrides: `cluster.device_profiles`; an entry whose name equals the
            device's model name (or the profile it maps to) wins.

    Returns:
        The profile: "CPU" for CPU devices, the matching table entry for a
        known GPU model (`gpu_profile_name`; an A10G maps to "A10", the
        nearest entry).

    Raises:
        ClusterError: the device type or GPU model is not known; the message
            says why and how to add a profile for it.
    """
    kind = _device_type(device_name)
    if kind in ("CPU", "XLA_CPU"):
        return get_profile(CPU_PROFILE_NAME, overrides)
    if kind not in ("GPU", "XLA_GPU"):
        raise ClusterError(f"device {device_name!r} has type {kind!r}; EPL "
                           f"plans for CPU and GPU devices only")
    model = _gpu_model(physical_description)
    if model and _find_override(model, overrides):
        return get_profile(model, overrides)
    if not model:
        why = "TensorFlow gave no model name for it"
    else:
        try:
            return get_profile(gpu_profile_name(model), overrides)
        except ClusterError as err:
            why = str(err)
    raise ClusterError(
        f"cannot tell which profile GPU {device_name!r} ({model!r}) has: "
        f"{why}; known profiles: {known_profiles()}. To plan for it, "
        f"{_how_to_add().replace('MyGPU', model or 'MyGPU')}")


# --------------------------------------------------------------------------
# Cluster strings.
# --------------------------------------------------------------------------

_CLUSTER_FORM = ("expected comma-separated tokens of the form "
                 "[HOSTS x] [DEVICES_PER_HOST x] PROFILE [@ [NICS x] RATE], "
                 "e.g. '2x8xV100-32GB,2x8xT4', '8xA100', 'V100' or "
                 "'2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps'; RATE is one "
                 "NIC's rate in Gbps or Gb/s (bits) or GBps or GB/s (bytes), "
                 "NICS defaults to 1")
_TOKEN = re.compile(r"\s*(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?(.*?)\s*$")
#: A host network after "@": [NICS x] RATE with a G-prefixed unit; the case
#: of "b" tells bits ("Gbps", "Gb/s") from bytes ("GBps", "GB/s").
_NETWORK = re.compile(r"\s*(?:(\d+)\s*[xX*]\s*)?"
                      r"(([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
                      r"[gG]([bB])(?:[pP][sS]|/[sS]))\s*$")
_NETWORK_FORM = ("a host network is [NICS x] RATE after '@', e.g. "
                 "'@8x200Gbps', '@4x100Gb/s', '@25GB/s'")


def _caret_error(spec: str, start: int, end: int, why: str) -> ClusterError:
    """A ClusterError quoting `spec` with carets under spec[start:end]."""
    marks = " " * start + "^" * max(end - start, 1)
    return ClusterError(f"cannot parse cluster spec {spec!r}:\n  {spec}\n"
                        f"  {marks}\n{why}\n{_CLUSTER_FORM}")


def _parse_token(spec: str, start: int, token: str,
                 overrides: Mapping | None) -> list[HostSpec]:
    """HostSpecs of one token that starts at `start` in `spec`."""
    hosts_part, at, network_part = token.partition("@")
    stripped = hosts_part.strip()
    if not stripped:
        if at:
            first = start + token.index("@")
            raise _caret_error(spec, first, first + len(token.strip()),
                               f"token {token.strip()!r} names no profile "
                               f"before '@'")
        raise _caret_error(spec, start, start + len(token), "empty token")
    first = start + hosts_part.index(stripped[0])
    match = _TOKEN.fullmatch(hosts_part)
    counts = [int(c) for c in match.group(1, 2) if c is not None]
    name, name_at = match.group(3), start + match.start(3)
    if not name or name.isdigit() or re.match(r"\d+\s*[xX*]", name):
        raise _caret_error(spec, first, first + len(stripped),
                           f"token {stripped!r} is not "
                           f"[HOSTS x] [DEVICES_PER_HOST x] PROFILE")
    if any(c < 1 for c in counts):
        raise _caret_error(spec, first, name_at,
                           f"counts must be at least 1 in {stripped!r}")
    try:
        profile = get_profile(name, overrides)
    except ClusterError as err:
        raise _caret_error(spec, name_at, name_at + len(name),
                           str(err)) from None
    network = _parse_network(spec, start + len(hosts_part) + 1,
                             network_part) if at else None
    hosts, devices = ([1, 1] + counts)[-2:]
    return [HostSpec(profile, devices, network) for _ in range(hosts)]


def _parse_network(spec: str, start: int, text: str) -> HostNetwork:
    """The HostNetwork of the text after a token's "@" (at `start`)."""
    stripped = text.strip()
    if not stripped:
        raise _caret_error(spec, start - 1, start,
                           f"no network after '@'; {_NETWORK_FORM}")
    first = start + text.index(stripped[0])
    if "@" in text:
        second = start + text.index("@")
        raise _caret_error(spec, second, second + 1,
                           f"a token has at most one '@' (before its hosts' "
                           f"network); {_NETWORK_FORM}")
    match = _NETWORK.fullmatch(text)
    if match is None:
        raise _caret_error(spec, first, first + len(stripped),
                           f"cannot read the host network {stripped!r}; "
                           f"{_NETWORK_FORM}")
    nics = int(match.group(1)) if match.group(1) is not None else 1
    if nics < 1:
        raise _caret_error(spec, first, start + match.start(2),
                           f"a host needs at least one NIC, got {nics} in "
                           f"{stripped!r}")
    rate = float(match.group(3)) * (GBIT_S if match.group(4) == "b" else GB)
    if not 0 < rate < float("inf"):
        raise _caret_error(spec, start + match.start(2), start + match.end(2),
                           f"a NIC's rate must be positive, got "
                           f"{match.group(2)!r}")
    return HostNetwork(nics, rate)


def parse_cluster(spec: str, overrides: Mapping[str, Any] | None = None
                  ) -> list[HostSpec]:
    """Read a cluster description into one HostSpec per host.

    Args:
        spec: comma-separated tokens "HxDxPROFILE" (H hosts with D devices
            each), "DxPROFILE" (one host with D devices) or "PROFILE" (one
            host with one device); "x", "X" or "*" separate the counts.
            E.g. "2x8xV100-32GB,2x8xT4" is four hosts.  A token may end
            with the network of each of its hosts, "@NxRATE" (N NICs of
            RATE each) or "@RATE" (one NIC): RATE is a number with "Gbps"
            or "Gb/s" (gigabits per second) or "GBps" or "GB/s" (gigabytes
            per second); the letters are case-insensitive except "b" (bits)
            and "B" (bytes).  E.g. "2x8xA100-80GB@8x200Gbps,2x8xT4@100Gbps".
            Without one, a host has one NIC at its profile's
            inter_node_bandwidth.
        overrides: `cluster.device_profiles`, see `get_profile`.

    Returns:
        The hosts in the order given.

    Raises:
        ClusterError: a token does not parse, names an unknown profile or
            has a bad network; the message quotes the spec with carets
            under the bad part and gives the accepted form.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ClusterError(f"empty cluster spec {spec!r}; {_CLUSTER_FORM}")
    hosts: list[HostSpec] = []
    start = 0
    for token in spec.split(","):
        hosts.extend(_parse_token(spec, start, token, overrides))
        start += len(token) + 1
    return hosts


# --------------------------------------------------------------------------
# Virtual CPU devices.
# --------------------------------------------------------------------------

def _cpu_share(n: int, overrides: Mapping | None = None) -> DeviceProfile:
    """The "CPU" profile (the configured one, else the measured one) shared
    among `n` virtual devices, which share its cores, memory and memory
    bus.  The profile's rates are one executor's alone (measured on one
    device); the n replicas together reach `replica_speedup` times that,
    so each device gets speedup / n of it: FLOP/s, memory bandwidth and the
    optimizer's rate times speedup / n, the per-op overheads times
    n / speedup.  Memory and the collectives' bandwidth (measured across
    devices, the whole host's) are divided by n; the collective latency,
    the replicas' sync time (`replica_sync_s`, measured per replica on the
    shared cores), the input reads' costs (one input pipeline serves
    every device) and the step's session cost (one run per step) stay;
    `shared_by` is n."""
    cpu = get_profile(CPU_PROFILE_NAME, overrides) \
        if _find_override(CPU_PROFILE_NAME, overrides) else cpu_profile()
    if n == 1:
        return cpu
    share = replica_speedup(cpu, n) / n
    return dataclasses.replace(
        cpu,
        name=f"{cpu.name}/{n}",
        peak_flops={k: v * share for k, v in cpu.peak_flops.items()},
        memory_bytes=cpu.memory_bytes / n,
        memory_bandwidth=cpu.memory_bandwidth * share,
        intra_node_bandwidth=cpu.intra_node_bandwidth / n,
        inter_node_bandwidth=cpu.inter_node_bandwidth,
        op_overhead_s=cpu.op_overhead_s / share,
        collective_latency_s=cpu.collective_latency_s,
        op_type_overhead_s={t: v / share for t, v in
                            cpu.op_type_overhead_s.items()},
        optimizer_bandwidth=cpu.optimizer_bandwidth * share, shared_by=n)


def replica_speedup(cpu: DeviceProfile, n: int) -> float:
    """How many times one replica's rate `n` replicas on virtual devices of
    the host `cpu` describes reach together: 1 for one; for more, linear in
    the cores they can use, min(n, host_cores), through 1 at one core and
    the measured `replica_concurrency` at the cores the measurement's
    `REPLICA_SYNC_DEVICES` replicas could use (each further core adding as
    much as the measured ones did on average), never above the cores used;
    more replicas than cores take turns, so it holds past them."""
    if n <= 1:
        return 1.0
    used = min(n, cpu.host_cores)
    measured = min(REPLICA_SYNC_DEVICES, cpu.host_cores)
    if measured <= 1:  # measured on one core: nothing to interpolate on
        return cpu.replica_concurrency
    return min(1.0 + (cpu.replica_concurrency - 1.0) * (used - 1)
               / (measured - 1), float(used))


def _host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _device_override(index: int, overrides: Mapping | None):
    """(key, spec) of the override for virtual device CPU:index, or None."""
    for key, spec in (overrides or {}).items():
        if isinstance(key, str) and _device_type(key) == "CPU" and \
                re.search(rf":{index}\s*$", key):
            return key, spec
    return None


def virtual_cpu_profiles(n: int, overrides: Mapping[str, Any] | None = None
                         ) -> list[DeviceProfile]:
    """Profiles of `n` virtual CPU devices (CPU:0 .. CPU:n-1).

    Args:
        n: the number of virtual CPU devices.
        overrides: `cluster.device_profiles`; keys "CPU:i" (or
            "/device:CPU:i") map virtual device i to a profile name
            ("V100-32GB") or a field dict (with optional "base"; the result
            is named "CPU:i").  Other keys define named profiles as in
            `get_profile`.

    Returns:
        One profile per device.  A device without an entry gets the
        "CPU" profile -- the configured one if there is one (e.g. a file
        from ``epl-plan --calibrate``), otherwise the measured one -- split
        evenly among the n devices (`_cpu_share`; named "CPU/n"), since
        virtual devices share one host's cores and memory.
    """
    if not isinstance(n, int) or n < 1:
        raise ClusterError(f"need at least one virtual CPU device, got {n!r}")
    return [_virtual_cpu(i, n, overrides) for i in range(n)]


def _virtual_cpu(index: int, n: int, overrides: Mapping | None
                 ) -> DeviceProfile:
    """The profile of virtual device CPU:index among `n`."""
    found = _device_override(index, overrides)
    if found is None:
        return _cpu_share(n, overrides)
    key, spec = found
    if isinstance(spec, DeviceProfile):
        return spec
    if isinstance(spec, str):
        return get_profile(spec, overrides)
    base, fields = _spec_fields(key, spec)
    start = get_profile(base, overrides) if base else _cpu_share(n, overrides)
    return dataclasses.replace(start.with_overrides(**fields),
                               name=f"CPU:{index}")
