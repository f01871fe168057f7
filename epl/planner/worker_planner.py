"""The planner as one worker's runtime asks it: the one entry for local plans.

`WorkerPlanner(cluster, config)` answers, for this worker's devices, everything
the rest of EPL needs from the planner at run time, so that no caller re-derives
the device layout rule (epl/planner/plan.py) or the devices' profiles:

- `plan(...)`: the runtime Plan (replicas, each TaskGraph's devices, batch shares),
  from the hardware-aware planner's ClusterPlan where device profiles are set
  (`epl.planner.plan.make_local_plan`); the driver asks it after the analysis;
- `split_plans(taskgraphs)`: each split TaskGraph's devices and shard weights, for
  the split pass at gradient time;
- `stage_speeds(num_stages)`: each pipeline stage's device speed, for the
  automatic stages (epl/passes/pipeline/auto_stages.py);
- `profiles()`: the local devices' profiles (None unless cluster.device_profiles is set).
"""
from __future__ import annotations

from typing import Any

from epl.planner import local, stage_cuts
from epl.planner.plan import Plan, SplitPlan, make_local_plan, split_layout


class WorkerPlanner:
    """This worker's planning entry (see the module docstring).

    cluster: the worker's epl.Cluster; config: the epl.Config the graph is rewritten
    under (its cluster.* and amp.* keys shape the plans).
    """

    def __init__(self, cluster: Any, config: Any):
        self.cluster = cluster
        self.config = config

    def profiles(self) -> list | None:
        """Profiles of this worker's devices, or None unless cluster.device_profiles is set."""
        return local.local_profiles(self.cluster, self.config)

    def plan(self, taskgraphs: list, view: Any, replica_weights: list[float] | None = None,
             uneven: bool = True) -> Plan:
        """The runtime Plan of this worker for `taskgraphs` (replicated, then split) of
        the analysed graph `view`; replica_weights win over the planner's shares;
        uneven False: the batch mode cannot give replicas different batch sizes."""
        return make_local_plan(list(taskgraphs), view, self.cluster, self.config,
                               replica_weights, uneven)

    def split_plans(self, taskgraphs: list) -> dict[str, SplitPlan]:
        """{TaskGraph name: its SplitPlan} for every split TaskGraph of `taskgraphs` that
        has devices on this worker: the devices, and the shard weights (even unless
        device profiles make the devices differ); a group over every worker's devices
        holds this worker's slots of it (even shards)."""
        colocate = bool(self.config.get("cluster.colocate_split_and_replicate"))
        _, devices = split_layout(taskgraphs, self.cluster, colocate)
        plans = {}
        for taskgraph in taskgraphs:
            devs = devices.get(taskgraph.name)
            if devs is None:
                continue
            if taskgraph.spec.device_count > len(devs):   # the group spans every worker
                plans[taskgraph.name] = SplitPlan(tuple(devs), None,
                                                  self.cluster.worker_rank * len(devs),
                                                  taskgraph.spec.device_count)
            else:
                weights = local.local_shard_weights(self.cluster, self.config, devs)
                plans[taskgraph.name] = SplitPlan(tuple(devs),
                                                  None if weights is None else tuple(weights))
        return plans

    def stage_speeds(self, num_stages: int) -> list[float] | None:
        """Relative FLOP/s of the device each of `num_stages` stages runs on
        (`stage_speeds` with this worker's profiles)."""
        return stage_speeds(num_stages, self.profiles())


def stage_speeds(num_stages: int, profiles: list | None) -> list[float] | None:
    """Relative FLOP/s of the device each stage runs on (the slowest over replicas), or
    None when there are no profiles or all stages get the same speed.

    The plan gives replica r the devices r*K .. r*K+K-1 and, within them, stage i
    the i-th by memory (epl.planner.stage_cuts.stage_device_order).
    """
    if not profiles or len(profiles) < num_stages:
        return None
    replicas = len(profiles) // num_stages
    speeds = [min(profiles[r * num_stages + stage_cuts.stage_device_order(
        [p.memory_bytes for p in profiles[r * num_stages:(r + 1) * num_stages]])[i]]
        .flops("float32") for r in range(replicas)) for i in range(num_stages)]
    if all(abs(s - speeds[0]) <= 1e-12 * speeds[0] for s in speeds):
        return None
    top = max(speeds)
    return [s / top for s in speeds]
