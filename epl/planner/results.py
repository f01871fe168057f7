"""The planner's result values: options in, alternatives out.

`PlanOptions` says how the planner models the devices and what it may try;
`DeviceLoad` is what one device (or a group of identical devices) does and
holds under one alternative; `Alternative` is one candidate plan, and
`memory_reason` the text of the constraint that rules its loads out.  The search
(`epl.planner.search`) builds them; `ClusterPlan` (the search's answer) lives
there too, because it also renders itself (`epl.planner.explain`).
Nothing here computes a cost.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from epl.errors import ConfigError
from epl.planner import roofline as cm
from epl.planner.balance import GiB, gb
from epl.planner.devices import ClusterDevice, Runs
from epl.planner.profiles import PCIE3_X16

#: some; profiles.py asks the planner to keep headroom).
DEFAULT_USABLE_FRACTION = 0.95
#: Host memory per device: a typical 8-GPU server with 1.5 TiB of RAM.
DEFAULT_HOST_MEMORY_PER_DEVICE = 1.5 * (1 << 40) / 8

#: Alternatives within this fraction of the fastest count as equally fast;
#: the simplest of them (earliest in listing order) is chosen.
CHOICE_TOLERANCE = 0.03


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
        moe_chunks: chunks the expert dispatch is cut into (`split.moe_chunks`);
            None: each alternative takes the count of
            `epl.planner.step_cost.MOE_CHUNK_CHOICES` its cost model predicts
            fastest (`DeviceLoad.moe_chunks` says which).
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
    moe_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.moe_chunks is not None and (
                isinstance(self.moe_chunks, bool)
                or not isinstance(self.moe_chunks, int) or self.moe_chunks < 1):
            raise ConfigError(f"moe_chunks (split.moe_chunks) must be an int >= 1 "
                              f"or None (the planner chooses), got "
                              f"{self.moe_chunks!r}")
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
    moe_chunks: int = 1  # chunks of the expert dispatch (split.moe_chunks)
    host_bytes: float = 0.0
    host_usable: float = math.inf
    shards: int | None = None
    stage: int | None = None
    layers: tuple[int, int] | None = None
    pipeline: int | None = None  # which pipeline (replica) a stage belongs to
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


def memory_reason(loads: Sequence[DeviceLoad]) -> str:
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
