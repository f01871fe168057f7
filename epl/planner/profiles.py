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

The value types (`DeviceProfile`, `HostNetwork`, `HostSpec`) and the parsing
of their field values live in `epl.planner.device_profile`, and the CPU
micro-benchmark (`calibrate_cpu_profile`, `cpu_profile`, `profile_file`) in
`epl.planner.calibration`; both are re-exported here.

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
import re
from collections.abc import Mapping
from typing import Any

from epl.errors import ClusterError, ConfigError
# The CPU micro-benchmark lives in its own module; its public names are
# re-exported here.
from epl.planner.calibration import (  # noqa: F401
    CALIBRATION_DEVICES, KERNEL_CLASSES, RATE_DEVICES, REFERENCE_STEPS, REPLICA_SYNC_DEVICES,
    StepCosts, calibrate_cpu_profile, cpu_profile, profile_file)
# The value types and their field parsing live in device_profile (below both
# this module and the calibration); they are re-exported here.
from epl.planner.device_profile import (  # noqa: F401
    CPU_PROFILE_NAME, DEFAULT_INTER_NODE_BANDWIDTH, GB, GBIT_S, OVERRIDE_FIELDS,
    REQUIRED_FIELDS, STANDARD_DTYPES, TFLOPS, DeviceProfile, GiB, HostNetwork, HostSpec,
    merge_flops, parse_quantity, parse_seconds, validated_fields)
# normalize_dtype lives in roofline (below both this module and the graph
# model, which needs it too); it is re-exported here.
from epl.planner.roofline import DEFAULT_EFFICIENCY, normalize_dtype  # noqa: F401

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
# Named profiles and overrides.
# --------------------------------------------------------------------------

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
        return None, {f: getattr(spec, f) for f in OVERRIDE_FIELDS}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected a profile name or a dict of "
                          f"fields, got {spec!r}")
    fields = dict(spec)
    base = fields.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{where}: 'base' must name a profile, got {base!r}")
    return base, validated_fields(fields, where)


def _from_spec(key: str, spec: Any, overrides: Mapping | None,
               resolving: tuple[str, ...]) -> DeviceProfile:
    """Build the profile named `key` from its cluster.device_profiles entry."""
    base, fields = _spec_fields(key, spec)
    if base is None and _builtin_name(key) and \
            not set(REQUIRED_FIELDS) <= set(fields):
        base = _builtin_name(key)  # overriding some fields of a known one
    if base is None:
        missing = [f for f in REQUIRED_FIELDS if f not in fields]
        if missing:
            raise ConfigError(
                f"cluster.device_profiles[{key!r}] defines a new profile but "
                f"lacks field(s) {missing}; give them or a 'base' profile "
                f"to start from, e.g. {{'base': 'A100-40GB', ...}}")
        fields["peak_flops"] = merge_flops({}, fields["peak_flops"])
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
