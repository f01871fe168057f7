"""The TensorFlow-free half of the cost model: costs as numbers, and time.

`epl.planner.cost_model` reads graphs (and so needs TensorFlow); this module
holds what the planner needs once a model is numbers, so that planning a
built-in analytic model (``epl-plan --model``) never imports TensorFlow:

- `GroupCost`, the summed cost of a group of ops;
- `predict_time` (roofline), `op_overhead_time` (per-op executor cost) and
  `comm_time` (ring all-reduce), seconds on an
  `epl.planner.profiles.DeviceProfile`;
- `optimizer_slots` / `OPTIMIZER_SLOTS` and `APPLY_OPS` (per-parameter
  FLOPs and slots of optimizer apply ops);
- `checkpointed_bytes`, activations kept under gradient checkpointing.

`epl.planner.cost_model` re-exports all of them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from epl.errors import ConfigError

#: Default fraction of peak FLOP/s a training step reaches (typical MFU).
DEFAULT_EFFICIENCY = 0.5

#: Optimizer apply op (without Resource/Sparse/Apply) -> (FLOPs per
#: parameter element, slot variables).
APPLY_OPS = {
    "GradientDescent": (2, 0), "ProximalGradientDescent": (4, 0),
    "Momentum": (4, 1), "KerasMomentum": (4, 1), "Adam": (12, 2),
    "AdamWithAmsgrad": (14, 3), "AdaMax": (12, 2), "Adagrad": (5, 1),
    "AdagradV2": (6, 1), "ProximalAdagrad": (8, 1), "AdagradDA": (10, 2),
    "RMSProp": (10, 2), "CenteredRMSProp": (14, 3), "Adadelta": (12, 2),
    "Ftrl": (15, 2), "FtrlV2": (16, 2), "AddSign": (8, 1),
    "PowerSign": (8, 1),
}


#: Other spellings of the dtype names profiles key their FLOP/s by.
_DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "single": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64", "f64": "float64", "double": "float64",
    "tf32": "tensorfloat32",
}


def normalize_dtype(dtype: Any) -> str:
    """Canonical dtype name for `dtype` (str or anything with `.name`)."""
    name = getattr(dtype, "name", dtype)
    if not isinstance(name, str):
        raise ConfigError(f"expected a dtype name or tf.DType, got {dtype!r}")
    name = name.strip().lower()
    return _DTYPE_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """The summed cost of one group of ops.

    Attributes:
        flops: total FLOPs.
        bytes: total memory traffic (bytes read plus written).
        parameter_bytes: bytes of the distinct variables the group's ops
            read or write (in an apply-phase group this includes the
            optimizer's slot variables).
        num_ops: number of ops in the group.
        op_types: op type -> count.
        exact: every op's cost was exact.
        unmodelled_op_types: op types the model has no formula for.
    """

    flops: float = 0.0
    bytes: float = 0.0
    parameter_bytes: float = 0.0
    num_ops: int = 0
    op_types: Mapping[str, int] = dataclasses.field(default_factory=dict)
    exact: bool = True
    unmodelled_op_types: tuple[str, ...] = ()


#: Slot variables per parameter for each optimizer.
OPTIMIZER_SLOTS = {
    "sgd": 0, "gradientdescent": 0, "momentum": 1, "nesterov": 1,
    "adam": 2, "adamw": 2, "lazyadam": 2, "adamax": 2, "nadam": 2,
    "adagrad": 1, "rmsprop": 2, "centeredrmsprop": 3, "adadelta": 2,
    "ftrl": 2, "lamb": 2,
}


def optimizer_slots(optimizer: str) -> int:
    """Slot variables per parameter for `optimizer` ("adam", "AdamOptimizer",
    "sgd", ...).  Raises ConfigError for an optimizer it does not know."""
    key = re.sub(r"[^a-z0-9]", "", str(optimizer).lower())
    key = re.sub(r"optimizer$", "", key) or key
    if key not in OPTIMIZER_SLOTS:
        raise ConfigError(
            f"unknown optimizer {optimizer!r} for the memory estimate; known: "
            f"{sorted(OPTIMIZER_SLOTS)}")
    return OPTIMIZER_SLOTS[key]


def checkpointed_bytes(sizes: list[float]) -> float:
    """Bytes kept with gradient checkpointing over tensors of `sizes`.

    The n tensors (in forward order) are cut into ceil(sqrt(n)) contiguous
    segments; the first tensor of each segment is kept, and during the
    backward pass one segment at a time is recomputed, so the peak is the
    kept tensors plus the largest segment's other tensors.
    """
    n = len(sizes)
    if n <= 1:
        return float(sum(sizes))
    length = math.ceil(n / math.ceil(math.sqrt(n)))
    segments = [sizes[i:i + length] for i in range(0, n, length)]
    kept = sum(segment[0] for segment in segments)
    return float(kept + max(sum(segment[1:]) for segment in segments))


# --------------------------------------------------------------------------
# Time.
# --------------------------------------------------------------------------

def predict_time(cost: Any, profile: Any,
                 dtype: Any = "float32",
                 efficiency: float = DEFAULT_EFFICIENCY,
                 memory_efficiency: float = 1.0) -> float:
    """Roofline time in seconds of `cost` on a device of `profile`.

    max(flops / (peak_flops[dtype] * efficiency),
        bytes / (memory_bandwidth * memory_efficiency)).
    `cost` is a GroupCost or cost_model.OpCost (anything with `flops`
    and `bytes`); `profile` is an epl.planner.profiles.DeviceProfile.
    """
    if not 0 < efficiency <= 1 or not 0 < memory_efficiency <= 1:
        raise ConfigError(f"efficiencies must be in (0, 1], got "
                          f"{efficiency!r} and {memory_efficiency!r}")
    compute = cost.flops / (profile.flops(dtype) * efficiency)
    memory = cost.bytes / (profile.memory_bandwidth * memory_efficiency)
    return max(compute, memory)


def op_overhead_time(ops: Any, profile: Any) -> float:
    """Seconds some ops cost on `profile`'s device beyond their roofline
    time (the executor's per-op launch and scheduling, and the fixed cost
    of kernels such as small batched matmuls).

    `ops` is a number of ops, each costing `DeviceProfile.op_overhead_s`,
    or (op type, count) pairs, each op costing op_overhead_s plus
    `DeviceProfile.op_type_overhead_s` of its type.  0 for profiles
    without these figures, such as the GPU table's.
    """
    base = getattr(profile, "op_overhead_s", 0.0)
    if isinstance(ops, (int, float)):
        return ops * base if ops > 0 else 0.0
    extra = getattr(profile, "op_type_overhead_s", {}) or {}
    return sum(count * (base + extra.get(op_type, 0.0))
               for op_type, count in ops)


def comm_time(nbytes: float, bandwidth: float, n: int,
              latency: float = 0.0) -> float:
    """Seconds for a ring all-reduce of `nbytes` among `n` devices.

    2 * (n - 1) / n * nbytes / bandwidth, plus 2 * (n - 1) * latency for
    the ring's steps; zero for n <= 1.  `bandwidth` is per direction, in
    bytes/s (e.g. a profile's intra_node_bandwidth).
    """
    if n <= 1:
        return 0.0
    if bandwidth <= 0:
        raise ConfigError(f"bandwidth must be positive, got {bandwidth!r}")
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
