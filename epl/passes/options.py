"""Every pass's options, read from the config once: the only place passes' keys are read.

`pass_options(config)` turns the typed config (epl/config.py's schema) into one
frozen options value per pass; the driver builds each pass with its value
(`epl.parallel.training_pipeline(config)`), and no pass reads the config. A
pass is *off* when its options say `enabled=False` (the manager then records
its `off_note`), or when `debug.disabled_passes` names it (as TVM's
`disabled_pass`; epl.parallel refuses a name that is no pass).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class AutoStagesOptions:
    """auto.auto_parallel with pipeline.num_stages >= 2: cut the model into stages."""

    enabled: bool
    num_stages: int


@dataclasses.dataclass(frozen=True)
class AmpOptions:
    """amp.level set: lower compute-heavy forward ops to `dtype`; loss_scale is None (no
    scaling), "dynamic", or the fixed scale; debug_log logs every lowered op."""

    enabled: bool
    dtype: str
    loss_scale: float | str | None
    debug_log: bool


@dataclasses.dataclass(frozen=True)
class RecomputeOptions:
    """gradient_checkpoint.type ("collection" or "auto"), its end_taskgraph, and
    check_gradients (compare with and without checkpointing before step 1)."""

    enabled: bool
    kind: str
    end_taskgraph: int
    check_gradients: bool


@dataclasses.dataclass(frozen=True)
class ReplicateOptions:
    """pipeline.num_micro_batch (at least 1), io.batch_mode, and the gradient reduction
    (communication.gradients_reduce_method: split TaskGraphs need "mean")."""

    num_micro_batch: int
    batch_mode: str
    reduce_method: str
    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class ConsistencyOptions:
    """batch_norm.moving_statistics: "replica0" or "mean" (epl/passes/consistency.py)."""

    moving_statistics: str
    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class AccumulateOptions:
    """On with more than one micro-batch."""

    enabled: bool


@dataclasses.dataclass(frozen=True)
class UnscaleOptions:
    """On with AMP (every AMP step is loss-scaled)."""

    enabled: bool


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """pipeline.strategy: "PreferBackward" (1F1B) or "PreferForward" (GPipe)."""

    strategy: str
    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class ZeroOptions:
    """zero.level set ("v1"; "v0" runs as "v1"), with the gradient reduction method."""

    enabled: bool
    level: str
    reduce_method: str


@dataclasses.dataclass(frozen=True)
class GradientCommOptions:
    """How gradients are reduced: the method ("mean"/"sum"), fp16 compression's scale
    (None: off), and the fusion buckets (bytes per bucket, at most max_splits)."""

    reduce_method: str
    fp16_scale: float | None
    fusion_threshold_bytes: float
    max_splits: int
    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class ApplyGroupsOptions:
    """optimizer.num_apply_group > 1: run the updates in that many groups."""

    enabled: bool
    groups: int


@dataclasses.dataclass(frozen=True)
class SkipOnOverflowOptions:
    """On with AMP and a dynamic loss scale."""

    enabled: bool


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """offload.level "v0": variables and their updates on the host."""

    enabled: bool


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """The final invariant check (always on)."""

    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class UnitFunctionsOptions:
    """pipeline.unit_functions: each unit's stage work as a call of a shared function."""

    enabled: bool


@dataclasses.dataclass(frozen=True)
class SplitOptions:
    """split.moe_chunks: chunks of the expert dispatch's capacity axis."""

    moe_chunks: int
    enabled: bool = True


MB = 2 ** 20


def _loss_scale(config: Any) -> float | str | None:
    """None (AMP off), "dynamic", or the fixed scale."""
    if not config.get("amp.level"):
        return None
    value = config.get("amp.loss_scale")
    return "dynamic" if isinstance(value, str) else float(value)


def pass_options(config: Any) -> dict[str, Any]:
    """{pass name: its options} for every pass of both pipelines, from `config`."""
    micro = max(1, config.get("pipeline.num_micro_batch"))
    amp_on = bool(config.get("amp.level"))
    loss_scale = _loss_scale(config)
    reduce_method = config.get("communication.gradients_reduce_method")
    zero_level = config.get("zero.level")
    num_stages = config.get("pipeline.num_stages") or 1   # None: unset (EPL's default)
    groups = config.get("optimizer.num_apply_group")
    checkpoint_kind = config.get("gradient_checkpoint.type")
    return {
        "split": SplitOptions(config.get("split.moe_chunks")),
        "auto_stages": AutoStagesOptions(
            bool(config.get("auto.auto_parallel")) and num_stages > 1, num_stages),
        "annotate": None,
        "amp": AmpOptions(amp_on, config.get("amp.dtype"), loss_scale,
                          config.get("amp.debug_log")),
        "recompute": RecomputeOptions(bool(checkpoint_kind), checkpoint_kind,
                                      config.get("gradient_checkpoint.end_taskgraph"),
                                      config.get("gradient_checkpoint.check_gradients")),
        "replicate": ReplicateOptions(micro, config.get("io.batch_mode"), reduce_method),
        "consistency": ConsistencyOptions(config.get("batch_norm.moving_statistics")),
        "accumulate": AccumulateOptions(micro > 1),
        "unscale": UnscaleOptions(amp_on),
        "schedule": ScheduleOptions(config.get("pipeline.strategy")),
        "zero": ZeroOptions(bool(zero_level), zero_level, reduce_method),
        "gradient_comm": GradientCommOptions(
            reduce_method,
            config.get("communication.fp16_scale") if config.get("communication.fp16") else None,
            config.get("communication.fusion_threshold_mb") * MB,
            config.get("communication.max_splits")),
        "apply_groups": ApplyGroupsOptions(groups > 1, groups),
        "skip_on_overflow": SkipOnOverflowOptions(loss_scale == "dynamic"),
        "offload": OffloadOptions(config.get("offload.level") == "v0"),
        "verify": VerifyOptions(),
        "unit_functions": UnitFunctionsOptions(bool(config.get("pipeline.unit_functions"))),
    }
