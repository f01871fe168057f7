"""What EPL did to a graph, in a few lines: the summary logged at parallelize time.

`summarize(graph, plan, cluster, view, config, timings, rewrite_s, fetches)`
consumes the results of parallelize (the plan, the cluster, the analysis and
the pass timings) and the parallel graph itself, and produces a
`ParallelSummary`; `format_summary` turns it into the lines `epl.parallel`
logs at INFO through the "epl" logger:

    parallel graph ready in 1.23 s (2 workers x 4 local CPU devices)
      global batch per step: 512 (2 workers x 4 replicas x 64)
      4 replicas x 1 stage on each worker, 1 micro-batch per step, batch shares even
      replica 0: CPU:0 | replica 1: CPU:1 | ...
      split groups: none
      collectives per step: 1 (1.1 MiB): CollectiveReduceV2 1 (1.1 MiB)
      collectives when fetched (merged tensors): 1 (4 B): CollectiveReduceV2 1 (4 B)
      passes: replicate 0.61 s, gradient_comm 0.20 s, ...

The numbers are the job's: the global batch is workers x replicas x
micro-batches x the script's batch (`JobBatch`, EPL's batch contract; with
`io.batch_mode: "global"` the script's batch is each worker's). With several
workers only worker 0 logs the summary (`prints_here`), unless
`debug.log_all_ranks` is set, as Horovod scripts print on rank 0.

Collectives per step are the collective ops (by type, `epl.ir.collectives`)
that the training ops need (ancestors of the view's train ops); those only
a merged fetch (the loss) needs are counted apart. Bytes are what each
collective sends per run on this worker (static shapes; "?" when a shape is
dynamic).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.ir.collectives import is_collective, is_reduction_to_one_device, payload_bytes
from epl.ir.graph_view import ancestors
from epl.observability.dump_format import rank_dump_dir


@dataclasses.dataclass
class CollectiveTotals:
    """Collectives of one kind of run: count and bytes, overall and per op type.

    bytes is None when some collective's payload shape is not static.
    """

    count: int = 0
    bytes: int | None = 0
    by_type: dict = dataclasses.field(default_factory=dict)  # type -> [count, bytes or None]

    def add(self, op: tf.Operation) -> None:
        """Count collective `op`."""
        size = payload_bytes(op)
        self.count += 1
        self.bytes = None if self.bytes is None or size is None else self.bytes + size
        kind = "AddN (all-reduce on one device)" if is_reduction_to_one_device(op) else op.type
        entry = self.by_type.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] = None if entry[1] is None or size is None else entry[1] + size


@dataclasses.dataclass(frozen=True)
class JobBatch:
    """The batch of one training step of the job, by EPL's batch contract.

    batch: the script's batch (the static first dimension of its batch inputs; None
    when dynamic): one (replica, micro-batch) unit's under io.batch_mode "replica",
    the worker's under "global". Every worker is taken to feed a batch of that size.
    """

    workers: int
    replicas: int
    micro_batches: int
    batch_mode: str
    batch: int | None

    @property
    def units_per_worker(self) -> int:
        """Batches of the script's size one step of a worker draws."""
        return self.replicas * self.micro_batches if self.batch_mode == "replica" else 1

    @property
    def per_worker(self) -> int | None:
        """Examples one step of a worker trains on (None when the batch is dynamic)."""
        return None if self.batch is None else self.batch * self.units_per_worker

    @property
    def global_batch(self) -> int | None:
        """Examples one step of the job trains on (None when the batch is dynamic)."""
        return None if self.batch is None else self.workers * self.per_worker

    def describe(self) -> str:
        """"256 (2 workers x 2 replicas x 64)": the global batch and its factors (a factor
        of one worker or one micro-batch left out); "global" mode says how it is cut."""
        batch = "the script's batch" if self.batch is None else str(self.batch)
        total = "?" if self.batch is None else str(self.global_batch)
        workers = [_plural(self.workers, "worker")] if self.workers > 1 else []
        units = [_plural(self.replicas, "replica")] + (
            [_plural(self.micro_batches, "micro-batch")] if self.micro_batches > 1 else [])
        if self.batch_mode == "replica":
            return f"{total} ({' x '.join(workers + units + [batch])})"
        return (f"{total} ({' x '.join(workers + [batch])}, each cut into "
                f"{' x '.join(units)}; io.batch_mode 'global')")


def job_batch(result, config) -> JobBatch:
    """The JobBatch of a ParallelGraph `result` parallelized under `config`."""
    return JobBatch(result.cluster.num_workers, result.plan.num_replicas,
                    int(config.get("pipeline.num_micro_batch")), str(config.get("io.batch_mode")),
                    result.view.global_batch_size)


def prints_here(cluster, config) -> bool:
    """True on the worker that prints the job's summary and progress: worker 0, or
    every worker with debug.log_all_ranks."""
    return cluster.worker_rank == 0 or bool(config.get("debug.log_all_ranks"))


@dataclasses.dataclass
class ParallelSummary:
    """What parallelize built on this worker (see the module doc)."""

    worker_rank: int
    num_workers: int
    device_type: str
    num_local_devices: int
    replicas: int
    stages: list[str]
    micro_batches: int
    schedule: str
    replica_weights: tuple
    replica_devices: list[list[str]]   # per replica: the device of each stage
    split_groups: list[tuple[str, list[str]]]
    per_step: CollectiveTotals
    when_fetched: CollectiveTotals
    rewrite_s: float
    pass_s: dict
    batch: JobBatch | None = None
    dump_dir: str = ""


def _short_device(device: str) -> str:
    """"/device:CPU:1" -> "CPU:1" (other strings unchanged)."""
    return device.split("device:")[-1] if "device:" in device else device


def summarize(graph: tf.Graph, plan, cluster, view, config, timings: dict, rewrite_s: float,
              fetches=()) -> ParallelSummary:
    """Return the `ParallelSummary` of a parallelized graph.

    fetches: tensors a fetch is redirected to (merged losses); collectives
    only they need are counted as "when fetched".
    """
    stages = [tg.name for tg in view.taskgraphs]
    replica_devices = [[_short_device(plan.devices[name][r]) for name in stages
                        if name in plan.devices] for r in range(plan.num_replicas)]
    split_groups = [(tg.name, [_short_device(d) for d in plan.split_devices.get(tg.name, ())])
                    for tg in view.split_taskgraphs]
    step = ancestors(list(view.train_ops))
    fetched = ancestors([t.op for t in fetches]) - step if fetches else set()
    per_step, when_fetched = CollectiveTotals(), CollectiveTotals()
    for op in graph.get_operations():
        if is_collective(op):
            if op in step:
                per_step.add(op)
            elif op in fetched:
                when_fetched.add(op)
    micro = int(config.get("pipeline.num_micro_batch"))
    schedule = str(config.get("pipeline.strategy")) if len(stages) > 1 and micro > 1 else ""
    batch = JobBatch(cluster.num_workers, plan.num_replicas, micro,
                     str(config.get("io.batch_mode")), view.global_batch_size)
    dump_dir = str(config.get("debug.dump_dir") or "")
    if dump_dir:
        dump_dir = rank_dump_dir(dump_dir, cluster.worker_rank, cluster.num_workers)
    return ParallelSummary(
        cluster.worker_rank, cluster.num_workers, cluster.device_type, cluster.num_local_devices,
        plan.num_replicas, stages, micro, schedule, tuple(plan.replica_weights),
        replica_devices, split_groups, per_step, when_fetched, rewrite_s, dict(timings),
        batch, dump_dir)


def _bytes(num: int | None) -> str:
    """A byte count with a binary unit ("1.5 MiB"), or "?" when unknown."""
    if num is None:
        return "?"
    value, unit = float(num), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{num} B" if unit == "B" else f"{value:.1f} {unit}"


def _totals(totals: CollectiveTotals) -> str:
    """"3 (1.1 MiB): CollectiveReduceV2 2 (1.0 MiB), ..." or "none"."""
    if not totals.count:
        return "none"
    kinds = ", ".join(f"{kind} {count} ({_bytes(size)})"
                      for kind, (count, size) in sorted(totals.by_type.items()))
    return f"{totals.count} ({_bytes(totals.bytes)}): {kinds}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('h') else 's'}"


def format_summary(summary: ParallelSummary) -> list[str]:
    """The text lines of a summary (the first line is the headline)."""
    s = summary
    shares = "even" if len(set(round(w, 12) for w in s.replica_weights)) <= 1 else \
        ", ".join(f"{w:.3f}" for w in s.replica_weights)
    devices = f"{s.num_local_devices} local {s.device_type} device" \
        f"{'' if s.num_local_devices == 1 else 's'}"
    where = f"{s.num_workers} workers x {devices}" if s.num_workers > 1 else f"1 worker, {devices}"
    each = " on each worker" if s.num_workers > 1 else ""
    lines = [f"parallel graph ready in {s.rewrite_s:.2f} s ({where})"]
    if s.batch is not None:
        lines.append(f"  global batch per step: {s.batch.describe()}")
    lines.append(f"  {_plural(s.replicas, 'replica')} x {_plural(len(s.stages), 'stage')}"
                 f"{' (' + ', '.join(s.stages) + ')' if len(s.stages) > 1 else ''}{each}, "
                 f"{_plural(s.micro_batches, 'micro-batch')} per step"
                 f"{', schedule ' + s.schedule if s.schedule else ''}, batch shares {shares}")
    if s.replica_devices and any(s.replica_devices):
        lines.append("  " + " | ".join(f"replica {r}: {', '.join(devices)}"
                                       for r, devices in enumerate(s.replica_devices)))
    groups = "; ".join(f"{name} over {', '.join(devices)}" for name, devices in s.split_groups)
    lines.append(f"  split groups: {groups or 'none'}")
    lines.append(f"  collectives per step{' (each worker)' if s.num_workers > 1 else ''}: "
                 f"{_totals(s.per_step)}")
    if s.when_fetched.count:
        lines.append(f"  collectives when fetched (merged tensors): {_totals(s.when_fetched)}")
    slowest = sorted(s.pass_s.items(), key=lambda item: -item[1])
    shown = slowest[:1] + [(name, sec) for name, sec in slowest[1:5] if sec >= 0.005]
    rest = sum(sec for name, sec in slowest) - sum(sec for _, sec in shown)
    lines.append("  passes: " + ", ".join([f"{name} {sec:.2f} s" for name, sec in shown]
                                          + [f"others {rest:.2f} s"]))
    if s.dump_dir:
        lines.append(f"  dump of every pass: {s.dump_dir} (epl-dump {s.dump_dir})")
    return lines
