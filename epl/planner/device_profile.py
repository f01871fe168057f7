"""The device values of the planner: `DeviceProfile`, `HostNetwork`, `HostSpec`.

A `DeviceProfile` is a small immutable value the planner reads: peak FLOP/s
per dtype, memory size, memory bandwidth and the bandwidth of the links to
other devices in the same host and to other hosts.  This module holds the
value types, the units they are written in, and the parsing of their field
values (numbers or strings with units, `parse_quantity`, `parse_seconds`),
which config overrides and profile files use.  It sits below both
`epl.planner.profiles` (the table of built-in profiles, overrides,
detection, cluster strings) and `epl.planner.calibration` (the CPU
micro-benchmark that measures the "CPU" profile), which re-use it; the
conventions behind the figures are in `epl.planner.profiles`' docstring.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from epl.errors import ClusterError, ConfigError
from epl.planner.roofline import normalize_dtype

GiB = 1 << 30
GB = 10**9
TFLOPS = 10**12

#: Default inter-node bandwidth: one 100 Gb/s NIC per host, in bytes/s.
DEFAULT_INTER_NODE_BANDWIDTH = 100e9 / 8
#: Gb/s (network rates are quoted in bits) in bytes/s.
GBIT_S = 1e9 / 8

#: The dtype keys every built-in profile provides.
STANDARD_DTYPES = ("float32", "float16", "bfloat16", "float64")

#: The name of the profile measured on this machine (`epl.planner.calibration`).
CPU_PROFILE_NAME = "CPU"


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device can compute, hold and move.

    The CPU's measured fields come from `epl.planner.calibration` (its
    `_step_costs`, `_replica_sync` and `_input_costs` named below);
    `virtual_cpu_profiles` and `replica_speedup` are `epl.planner.profiles`'.

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
            Measured for the CPU (`epl.planner.calibration.calibrate_cpu_profile`); 0 for the GPU
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
        values = validated_fields(fields, context=f"profile {self.name!r}")
        values["name"] = name
        if "peak_flops" in values:
            values["peak_flops"] = merge_flops(self.peak_flops,
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
# Field values and overrides.
# --------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceProfile))
OVERRIDE_FIELDS = tuple(f for f in _FIELDS if f != "name")
#: Fields with a default (0: not modelled) that a new profile may leave out.
_OPTIONAL_FIELDS = ("op_overhead_s", "collective_latency_s",
                    "op_type_overhead_s", "optimizer_bandwidth",
                    "replica_sync_s", "input_read_s", "input_example_s",
                    "replica_concurrency", "host_cores", "step_overhead_s",
                    "shared_by")
REQUIRED_FIELDS = tuple(f for f in OVERRIDE_FIELDS
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


def validated_fields(fields: Mapping[str, Any], context: str) -> dict:
    """Check override field names and parse their values."""
    unknown = sorted(set(fields) - set(OVERRIDE_FIELDS))
    if unknown:
        raise ConfigError(
            f"{context}: unknown device profile field(s) {unknown}; valid "
            f"fields are {list(OVERRIDE_FIELDS)} (and 'base' in "
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


def merge_flops(base: Mapping[str, float],
                 new: Mapping[str, float] | float) -> dict[str, float]:
    """Merge a peak_flops override into `base` (a number sets every dtype)."""
    if isinstance(new, Mapping):
        return {**base, **new}
    return {dtype: new for dtype in (base or STANDARD_DTYPES)}
