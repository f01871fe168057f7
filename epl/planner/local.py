"""The runtime bridge: the planner's answers for this worker's devices.

What `epl.parallelize` (epl/parallel.py) and `epl.planner.plan` ask the
planner at run time: the local devices' profiles (`local_profiles`, from
`cluster.device_profiles`), the batch share of each local replica
(`local_replica_weights`) and the shard sizes of a split TaskGraph
(`local_shard_weights`), in the dtype training computes in
(`local_compute_dtype`).  Without `cluster.device_profiles` every answer is
None: even shares.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from epl.planner import profiles as profiles_lib
from epl.errors import ClusterError
from epl.planner import balance
from epl.planner import roofline as cm
from epl.planner.balance import index_ranges
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.planner.results import Alternative, PlanOptions
from epl.planner.search import ClusterPlan, as_model, plan_local_devices
from epl.planner.step_cost import layer_totals
from epl.planner.profiles import DeviceProfile, normalize_dtype

def replica_weights_for_local_devices(model: Any,
                                      profiles: Sequence[DeviceProfile],
                                      global_batch: int | None = None,
                                      optimizer: str | None = None,
                                      device_counts: Sequence[int] | None
                                      = None,
                                      options: PlanOptions | None = None
                                      ) -> list[float]:
    """Batch shares of the local replicas from their devices' profiles.

    Args:
        model: a TrainingView (preferred: phases, TaskGraphs and batch size
            come from the analysis), a tf.Graph/GraphDef or a ModelSpec.
        profiles: one profile per local device, in device order (e.g.
            `epl.planner.profiles.virtual_cpu_profiles(n, cluster.device_profiles)`).
        global_batch: the global batch size; default the model's static
            batch.  When unknown, shares follow capability alone (no
            memory check, not rounded to whole examples).
        optimizer: default read from the graph's apply ops, else "adam".
        device_counts: devices per replica of each TaskGraph, in order
            (default from the view's TaskGraph specs, else 1); the layout is
            epl.planner.plan's: replica r spans the devices
            r*k .. r*k+k-1 with k = sum(device_counts).
        options: PlanOptions (efficiency, usable memory, ...).

    Returns:
        One positive weight per replica, summing to 1: the balanced batch
        sizes divided by the global batch.  A replica spanning several
        devices runs at the speed of the sum of its TaskGraphs' times on
        their devices, and is limited by its tightest device's memory.

    Raises:
        ClusterError: the devices do not divide into replicas, or the batch
            fits nowhere (per-device shortfall and what would help).
    """
    options = options or PlanOptions()
    view = model if hasattr(model, "taskgraph_of") else None
    spec = as_model(model)
    optimizer = optimizer or spec.optimizer
    counts = list(device_counts or (
        [tg.spec.device_count for tg in view.taskgraphs] if view else [1]))
    per_replica = sum(counts)
    if per_replica < 1 or len(profiles) % per_replica:
        raise ClusterError(
            f"{len(profiles)} local devices do not divide into replicas of "
            f"{per_replica} device(s)")
    replicas = len(profiles) // per_replica
    groups = _replica_layers(spec, counts)
    batch = global_batch or spec.batch_size
    caps, per_example, fixed, usable, names = [], [], [], [], []
    slots = cm.optimizer_slots(optimizer or "adam")
    dtype = normalize_dtype(options.compute_dtype or spec.compute_dtype)
    for r in range(replicas):
        devices = profiles[r * per_replica:(r + 1) * per_replica]
        seconds, tight = 0.0, None
        for offset, layers in groups:
            profile = devices[offset]
            totals = layer_totals(layers, False)
            seconds += cm.predict_time(
                cm.GroupCost(flops=totals.flops, bytes=totals.bytes),
                profile, dtype, options.efficiency) if totals.flops or \
                totals.bytes else 0.0
            room = profile.memory_bytes * options.usable_fraction
            state = totals.params * (2 + slots)
            ratio = (room - state) / totals.act if totals.act else math.inf
            if tight is None or ratio < tight[0]:
                tight = (ratio, totals.act, state, room, profile.name)
        caps.append(1.0 / seconds if seconds > 0 else 1.0)
        per_example.append(tight[1])
        fixed.append(tight[2])
        usable.append(tight[3])
        names.append(tight[4])
    if not batch:
        total = sum(caps)
        return [c / total for c in caps]
    # Every replica of the layout must get at least one example: a slow
    # device that is not worth its share still gets one.
    shares = balance.balance_batch(batch, caps, per_example, fixed, usable,
                                   names, minimum=1 if batch >= len(caps) else 0)
    if any(size == 0 for size in shares.sizes):
        raise ClusterError(
            f"the balanced plan gives replica(s) "
            f"{index_ranges([i for i, s in enumerate(shares.sizes) if not s])}"
            f" no examples of the global batch of {batch} "
            f"(sizes {list(shares.sizes)}); use a larger global batch or "
            f"fewer devices")
    return [size / batch for size in shares.sizes]


def _replica_layers(spec: ModelSpec, counts: list[int]
                    ) -> list[tuple[int, list[LayerSpec]]]:
    """(device offset within a replica, layers) per TaskGraph/stage.

    Layers are matched to TaskGraphs by their stage index; a model with
    fewer stages than TaskGraphs puts everything on the first device.
    """
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    by_stage: dict[int, list[LayerSpec]] = {}
    for layer in spec.layers:
        stage = layer.stage if layer.stage < len(counts) else 0
        by_stage.setdefault(stage, []).append(layer)
    return [(offsets[stage], layers) for stage, layers in
            sorted(by_stage.items())]


def local_replica_weights(view: Any, cluster: Any, config: Any
                          ) -> list[float] | None:
    """What epl.parallelize passes to make_plan as replica_weights.

    None (even shares) unless `cluster.device_profiles` is configured;
    then the batch shares of the runtime alternative of the local
    ClusterPlan (`local_layout`) where the model is one (data parallel) or
    several (pipeline) single-device TaskGraphs, else those of
    `replica_weights_for_local_devices`.  None as well when every replica
    gets the same share.
    """
    profiles = local_profiles(cluster, config)
    if profiles is None:
        return None
    if len(set(profiles)) == 1:
        return None
    layout = local_layout(view, cluster, config)
    if layout is not None:
        weights = list(layout.replica_weights)
    else:
        weights = replica_weights_for_local_devices(
            view, profiles, view.global_batch_size,
            options=PlanOptions(compute_dtype=local_compute_dtype(config)))
    first = weights[0]
    if all(math.isclose(w, first, rel_tol=1e-12) for w in weights):
        return None
    return weights


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """What the runtime takes from the local ClusterPlan.

    Attributes:
        plan: the ClusterPlan of this worker's devices (`plan_local_devices`).
        alternative: its alternative with the script's structure (the one
            the runtime builds, whichever the search would choose).
        replica_weights: batch share per replica (sums to 1).
        stage_devices: per replica, the local device index of each stage
            (TaskGraph), in order.
    """

    plan: ClusterPlan
    alternative: Alternative
    replica_weights: tuple[float, ...]
    stage_devices: tuple[tuple[int, ...], ...]


def runtime_alternative_name(stages: int) -> str:
    """The alternative whose structure the runtime builds: a pipeline of
    `stages` stages, or balanced data parallelism (gradient checkpointing and
    ZeRO are the config's choice, not the planner's)."""
    return f"pipeline, {stages} stages" if stages > 1 else \
        "data-parallel, balanced by capability"


def local_layout(view: Any, cluster: Any, config: Any) -> LocalLayout | None:
    """The runtime layout derived from the ClusterPlan of this worker's devices.

    None unless `cluster.device_profiles` is set and the model is K >= 1
    single-device replicated TaskGraphs and no split one (pipeline stages,
    or plain data parallelism), with a known global batch.  Then
    `plan_local_devices` plans the view on the local profiles, with the
    pipeline stages and micro-batches of the config and neither
    checkpointing nor ZeRO; the runtime alternative
    (`runtime_alternative_name`) gives each replica's batch and, for a
    pipeline, which device runs each stage of each pipeline (the order and
    grouping the dry run reports, `stage_cuts.stage_device_order` over the
    whole worker).  So `epl-plan` and the real run cannot disagree, but for
    one example given to each replica the search leaves without any
    (`_at_least_one_each`: every replica of the layout draws a batch).

    Raises:
        ClusterError: the runtime alternative gives a replica no example, or
            has no assignment (the pipeline cannot be laid out).
    """
    profiles = local_profiles(cluster, config)
    taskgraphs = list(view.taskgraphs)
    if profiles is None or list(getattr(view, "split_taskgraphs", [])) or \
            not taskgraphs or \
            any(tg.spec.device_count != 1 for tg in taskgraphs) or \
            not view.global_batch_size:
        return None
    stages = len(taskgraphs)
    spec = as_model(view)
    if stages > 1 and len(spec.layers) != stages:
        return None  # the runtime cannot move layers across the user's stages
    options = PlanOptions(
        compute_dtype=local_compute_dtype(config),
        pipeline_stages=stages if stages > 1 else None,
        num_micro_batch=int(config.get("pipeline.num_micro_batch") or 1),
        try_checkpointing=False, try_zero=False)
    plan = plan_local_devices(spec, profiles, None, view.global_batch_size,
                              options)
    alternative = plan.alternative(runtime_alternative_name(stages))
    if not alternative.rows:
        raise ClusterError(f"the local plan has no assignment for "
                           f"{alternative.name}: {alternative.reason}")
    return _layout_of(plan, alternative, stages)


def _layout_of(plan: ClusterPlan, alternative: Alternative, stages: int
               ) -> LocalLayout:
    """Batch shares and stage devices of `alternative`, per replica."""
    if stages == 1:
        batches = [load.batch for load in alternative.loads]
        placement = [(load.device.index,) for load in alternative.loads]
    else:
        replicas = len(alternative.loads) // stages
        slots = [[-1] * stages for _ in range(replicas)]
        batches = [0] * replicas
        for load in alternative.loads:
            slots[load.pipeline][load.stage] = load.device.index
            batches[load.pipeline] = load.batch
        placement = [tuple(row) for row in slots]
    batches = _at_least_one_each(batches)
    if any(size < 1 for size in batches):
        raise ClusterError(
            f"the local plan ({alternative.name}) gives replica(s) "
            f"{index_ranges([i for i, s in enumerate(batches) if s < 1])} no "
            f"examples of the global batch of {plan.global_batch} (sizes "
            f"{batches}); use a larger global batch or fewer devices")
    total = sum(batches)
    return LocalLayout(plan, alternative,
                       tuple(size / total for size in batches),
                       tuple(placement))


def _at_least_one_each(batches: list[int]) -> list[int]:
    """`batches` with one example moved from the largest share to each empty
    one, where the batch allows: the search may leave a slow device idle,
    but every replica of the runtime's layout draws a batch (the one place
    the runtime departs from the ClusterPlan, by one example per replica)."""
    sizes = list(batches)
    if sum(sizes) < len(sizes):
        return sizes
    for i, size in enumerate(sizes):
        if size < 1:
            donor = max(range(len(sizes)), key=lambda j: (sizes[j], -j))
            sizes[donor] -= 1
            sizes[i] = 1
    return sizes


def local_compute_dtype(config: Any) -> str:
    """The dtype the local devices' matmuls run in: `amp.dtype` when
    mixed precision is on (`amp.level`), else float32.  Peak FLOP/s differ
    by dtype and by device differently (an A100 is 1.2x a V100 in float32,
    2.5x in float16), so the shares must use the one training runs in."""
    if config.get("amp.level"):
        return normalize_dtype(config.get("amp.dtype"))
    return "float32"


def local_profiles(cluster: Any, config: Any) -> list[DeviceProfile] | None:
    """Profiles of this worker's devices, or None unless `cluster.device_profiles` is set."""
    overrides = config.get("cluster.device_profiles") or {}
    if not overrides:
        return None
    n = cluster.num_local_devices
    if cluster.device_type == "CPU":
        return profiles_lib.virtual_cpu_profiles(n, overrides)
    return [_gpu_profile(i, overrides) for i in range(n)]


def local_shard_weights(cluster: Any, config: Any, devices: Sequence[str]
                        ) -> list[float] | None:
    """Capability weights of a split TaskGraph's devices (the split pass's shard sizes).

    None (even shards) unless `cluster.device_profiles` makes the devices
    differ; then each device's share is proportional to its peak FLOP/s in
    the dtype it computes in (`local_compute_dtype`; a shard's work grows
    with its size), the Whale paper's capability-proportional split.
    """
    profiles = local_profiles(cluster, config)
    if profiles is None:
        return None
    dtype = local_compute_dtype(config)
    chosen = [profiles[int(device.rsplit(":", 1)[1])] for device in devices]
    total_flops = sum(p.flops(dtype) for p in chosen)
    weights = [p.flops(dtype) / total_flops for p in chosen]
    if all(math.isclose(w, weights[0], rel_tol=1e-12) for w in weights):
        return None
    return weights


def _gpu_profile(index: int, overrides: Mapping[str, Any]) -> DeviceProfile:
    """The profile of local GPU `index` (from TensorFlow's device details)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[index]) \
        if index < len(gpus) else {}
    return profiles_lib.detect_profile(f"/device:GPU:{index}",
                                       details.get("device_name", ""),
                                       overrides)
