"""The hardware-aware planner: who does how much, and whether it fits.

`plan_cluster(model, hosts, optimizer, global_batch, options)` takes a model
(a tf.Graph / GraphDef / analysed TrainingView, or a `ModelSpec` describing
the model as a list of layer costs), a cluster (a list of
`epl.planner.profiles.HostSpec`, or a cluster string such as "2x8xV100-32GB,2x8xT4")
and returns a `ClusterPlan`: for each alternative it considered, the work,
memory and predicted time of every device, and whether it fits; the fastest
alternative that fits is chosen.  `ClusterPlan.explain()` is what `epl-plan`
prints.

Alternatives
------------
- data-parallel, even split: every device holds a replica and gets
  global_batch / n examples.
- data-parallel, balanced by capability: batch shares proportional to each
  device's predicted examples/s, moved off devices that would run out of
  memory (`epl.planner.balance.balance_batch`).
- the balanced plan with gradient checkpointing, with ZeRO, and with both.
- pipeline: when the model has several annotated stages (TaskGraphs) or
  `PlanOptions.pipeline_stages` is set: stages cut by `balance_stages` over
  the model's layers, earlier stages on devices with more memory, pipelines
  replicated over the remaining devices and given batch shares by their
  throughput.
A model with split (expert) layers shards those layers' units (experts) over
all devices; each device runs its experts on the tokens sent to them (the
MoE layer dispatches every example's capacity slots to every expert, so a
device receives tokens in proportion to its experts).  Even: as many experts
per device.  Balanced: the plan tries expert placements from the even one to
the one proportional to the devices' speed on the experts' work
(`_split_placements`), and for each the batch balanced by capability and, for
a model with an expert all-to-all, batches between it and the even split or
the batch that follows the experts (`_blended_batches`); it keeps the one
with the shortest predicted step.
Balancing compute alone is not enough there: the fast hosts' larger batches
send more tokens across the network.  This departs from the design's balancing rule
(the Whale paper's: load proportional to capability) for such models only;
the candidates include the capability-proportional assignment, so the
search never predicts a slower step than the rule.

The model of one device
-----------------------
- Memory: parameters, gradients (as large as the parameters), optimizer
  slots (`cost_model.optimizer_slots` per parameter, in the parameters'
  dtype) and activations kept for the backward pass.  ZeRO (stage 1, as
  epl/passes/zero.py builds it) divides the optimizer slots and the update
  of replicated parameters by the number of data-parallel devices; each
  device keeps its full gradients and adds a working copy of its parameter
  shard (1/n of the parameters).  Gradient checkpointing keeps about sqrt(n)
  activations (`cost_model.checkpointed_bytes`) and recomputes the forward
  pass once more.  Offload keeps parameters, gradients and optimizer state
  in host memory (checked against `host_memory_per_device`); the device
  holds a double-buffered copy of the largest layer's parameters and one
  layer's gradients, and the optimizer update runs on the host.
- A device may use `usable_fraction` of its memory (the runtime and CUDA
  context take the rest).
- Compute: `cost_model.predict_time` (roofline at `efficiency` of peak) of
  the device's FLOPs and bytes: its examples' forward and backward, its
  experts' share, and the optimizer update of the parameters it updates.
  With an expert all-to-all every split layer's exchange is a barrier, so
  the step pays the slowest device's replicated work plus the slowest
  device's expert work; a device done early waits (`DeviceLoad.wait_s`).
  On top of the roofline: the device's per-op costs (`op_overhead_s`, and
  `op_type_overhead_s` for costly kernels) and, once per step, its session
  run's fixed cost (`step_overhead_s`); measured for the CPU, 0 for the
  GPU table.
- Communication: a ring all-reduce of the replicated gradients over the
  data-parallel devices (`cost_model.comm_time`) at the bandwidth of the
  link that bounds the ring (`slowest_link`); the expert all-to-all
  (dispatch and combine, forward and backward; `alltoall_time`): each
  device's tokens go to every device in proportion to its experts, within
  the host over each device's intra-node link, to other hosts through the
  host's network; one exchange that every device waits for, as long as its
  busiest link; offload traffic over
  `host_link_bandwidth` (parameters in for the forward and the backward,
  gradients out).  Communication is not overlapped with compute, so
  predicted step times are upper bounds.
- The network: each host has `HostSpec.network`, k NICs of some rate (from
  the cluster string, "8xA100@8x200Gbps"; by default one NIC at the
  profile's inter_node_bandwidth, 100 Gb/s).  Its bandwidth is k x rate per
  direction.  A ring all-reduce across hosts crosses every host boundary;
  with k NICs per host NCCL runs k rings side by side, one per NIC, so the
  crossings go k times faster: the ring runs at the slowest host's network
  bandwidth (or at the slowest intra-node link of a host holding several
  of the ring's devices, if that is slower).  In the all-to-all, each host
  sends and receives its own devices' traffic with other hosts through its
  own NICs (both directions at once); the busiest host binds.  The
  network's latency, congestion and
  topology (switch tiers, oversubscription) are not modelled.
- Pipeline: a step takes (micro-batches + stages - 1) x the slowest stage's
  time per micro-batch (GPipe/1F1B bubble); on virtual devices that share
  one host's cores (`DeviceProfile.shared_by`) a stage's idle slots give
  the cores to the others, so the step is the larger of the host's whole
  work at the devices' combined rate and the slots of a stage running
  alone (`search._micro_batches_time`).  Stage s keeps
  min(stages - s, micro-batches) micro-batches' activations alive; the
  activations sent between stages are not counted.

The chosen plan is the simplest (earliest listed) feasible alternative whose
predicted step time is within 3% of the fastest one's (`CHOICE_TOLERANCE`, a
simplicity margin): the model is not precise enough to prefer ZeRO or
checkpointing for a smaller gain; explain() says so next to a faster
alternative that was not chosen.

Groups of identical devices
---------------------------
Devices of the same profile on hosts with the same device count and network
form a `DeviceClass` (`epl.planner.devices`); the cluster is a
`DeviceLayout` that makes a `ClusterDevice` only when asked.  Data-parallel
alternatives of models without split layers are computed once per class
(`_grouped_data_parallel`): the batch shares are the same exact quotas and
rounding as device by device (`balance.grouped_proportional_shares`), so a
class is one or two `DeviceLoad` rows with a `count`; where an assignment
would not fit (examples would move one by one) the per-device computation
runs, as it does for split layers (at most as many devices as experts) and
pipelines.  `Alternative.rows` holds the rows, `Alternative.loads` one load
per device (expanded on first use).  Everything is deterministic: the same inputs give the same
plan and text.

Where the code is
-----------------
- `epl.planner.model_spec`: the model as numbers (LayerSpec, ModelSpec);
  `epl.planner.graph_model`: a graph's ModelSpec (needs TensorFlow).
- `epl.planner.results`: PlanOptions, DeviceLoad, Alternative.
- `epl.planner.step_cost`: the cost of one step on one device (compute,
  memory, all-reduce and all-to-all terms).
- `epl.planner.data_parallel`: the data-parallel alternatives (each
  device's state, expert placements, batch shares and loads).
- `epl.planner.search`: the pipeline alternative, `plan_cluster`, the
  choice, ClusterPlan, and the message when nothing fits.
- `epl.planner.explain`: the report text and JSON of a ClusterPlan.
- `epl.planner.local`: the runtime bridge (`local_*`, used by
  epl/parallel.py).
- `epl.planner.balance`: shares and shards over plain numbers;
  `epl.planner.stage_cuts`: pipeline stage cuts over plain numbers.
This module re-exports the names callers import from `epl.planner.planner`.
"""
from __future__ import annotations

from typing import Any

from epl.planner.devices import (ClusterDevice, DeviceClass, DeviceLayout,
                                 cluster_devices)
from epl.planner.explain import size_text, unknown_op_text
from epl.planner.local import (local_compute_dtype, local_profiles,
                               local_replica_weights, local_shard_weights,
                               replica_weights_for_local_devices)
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.planner.results import (CHOICE_TOLERANCE,
                                 DEFAULT_HOST_MEMORY_PER_DEVICE,
                                 DEFAULT_USABLE_FRACTION, Alternative,
                                 DeviceLoad, PlanOptions)
from epl.planner.search import ClusterPlan, plan_cluster
from epl.planner.step_cost import optimizer_update_cost

__all__ = [
    "CHOICE_TOLERANCE", "DEFAULT_HOST_MEMORY_PER_DEVICE",
    "DEFAULT_USABLE_FRACTION", "Alternative", "ClusterDevice", "ClusterPlan",
    "DeviceClass", "DeviceLayout", "DeviceLoad", "LayerSpec", "ModelSpec",
    "PlanOptions", "cluster_devices", "local_compute_dtype",
    "local_profiles", "local_replica_weights", "local_shard_weights",
    "optimizer_update_cost", "plan_cluster",
    "replica_weights_for_local_devices", "size_text", "unknown_op_text",
]

#: Names that moved to `epl.planner.graph_model` (they need TensorFlow),
#: still importable from here for existing callers.
_GRAPH_NAMES = ("model_from_graph", "infer_optimizer")


def __getattr__(name: str) -> Any:
    """`model_from_graph` and `infer_optimizer`, from `graph_model`, on
    first use (importing this module must not import TensorFlow)."""
    if name in _GRAPH_NAMES:
        from epl.planner import graph_model
        return getattr(graph_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
