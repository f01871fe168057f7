"""`debug.trace_dir`: Chrome traces of chosen training steps.

When `debug.trace_dir` is set, the session integration asks a `StepTracer`
for run options before each training run (a run that fetches a train op);
for the runs listed in `debug.trace_steps` (counted from 1 per graph; the
default, run 2, is the first one after TensorFlow's warm-up) it runs with
`RunOptions.FULL_TRACE`, then writes TensorFlow's Chrome trace
(`tensorflow.python.client.timeline`) to ``<trace_dir>/step_<n>.json``
(with several workers ``<trace_dir>/rank_<r>/step_<n>.json``). Open it in
chrome://tracing or https://ui.perfetto.dev.

What EPL changes in TensorFlow's trace:
- one process row per device, named by the device ("CPU:1"); the empty
  "Allocators" and "<device> Tensors" rows TensorFlow adds are dropped;
- collectives (by op type, `epl.ir.collectives`) are named after what they
  carry: "EPL all-reduce: hidden1/kernel, hidden1/bias (+4 more) 332.0 KiB".
  What a collective carries is found from the data flow: the variables whose
  update ops its result reaches; a collective that reaches none is named
  after its first consumer, or after itself with "(no consumer)" (a merged
  fetch such as the loss; a device's part of a local reduction whose copy
  only device 0 passes on to Horovod). The op type
  and node name stay in the event's args.

A user's own `options`/`run_metadata` are kept (the trace level is raised
in a copy of the options); the run metadata is read after the run.
"""
from __future__ import annotations

import collections
import json
import logging
import os

import tensorflow as tf
from tensorflow.python.client import timeline

from epl.errors import ConfigError
from epl.ir.collectives import is_collective, is_reduction_to_one_device, payload_bytes

_LOG = logging.getLogger(__name__)
UPDATE_INPUT_DTYPES = (tf.resource,)
MAX_WALK = 5000   # ops visited per collective when looking for the variables it feeds
KIND_WORDS = {"Reduce": "all-reduce", "Allreduce": "all-reduce", "Gather": "all-gather",
              "Allgather": "all-gather", "Bcast": "broadcast", "Broadcast": "broadcast",
              "AllToAll": "all-to-all", "Alltoall": "all-to-all",
              "ReduceScatter": "reduce-scatter", "Reducescatter": "reduce-scatter"}


def trace_steps(config) -> tuple[int, ...]:
    """The runs `debug.trace_steps` asks for; ConfigError unless it is a list of ints >= 1."""
    steps = config.get("debug.trace_steps")
    if not isinstance(steps, (list, tuple)) or not steps or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
        raise ConfigError(
            f"debug.trace_steps must be a non-empty list of training run numbers >= 1 (counted "
            f"from 1 per graph), got {list(steps) if isinstance(steps, tuple) else steps!r}; "
            "e.g. [2, 3]")
    return tuple(sorted(set(steps)))


def make_tracer(config, cluster, graph: tf.Graph) -> "StepTracer | None":
    """The tracer `debug.trace_dir` asks for, or None when it is empty."""
    trace_dir = config.get("debug.trace_dir")
    if not trace_dir:
        return None
    steps = trace_steps(config)
    if cluster.num_workers > 1:
        trace_dir = os.path.join(trace_dir, f"rank_{cluster.worker_rank}")
    return StepTracer(trace_dir, steps, graph)


class StepTracer:
    """Counts training runs; traces the chosen ones and writes their Chrome traces."""

    def __init__(self, trace_dir: str, steps: tuple[int, ...], graph: tf.Graph) -> None:
        self.trace_dir = trace_dir
        self.steps = frozenset(steps)
        self.graph = graph
        self.runs = 0
        self.pending: int | None = None
        self.last_run_traced = False   # the latest run ran with FULL_TRACE (ProgressHook
        #                                leaves it out of samples/s)
        self.written: list[str] = []
        self._labels: dict[str, str] | None = None

    def before_run(self, trains: bool, options, run_metadata):
        """Return (options, run_metadata) for the next run, tracing it if it is chosen."""
        self.pending = None
        self.last_run_traced = False
        if not trains:
            return options, run_metadata
        self.runs += 1
        if self.runs not in self.steps:
            return options, run_metadata
        self.last_run_traced = True
        traced = tf.compat.v1.RunOptions()
        if options is not None:
            traced.CopyFrom(options)
        traced.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
        self.pending = self.runs
        return traced, run_metadata if run_metadata is not None else tf.compat.v1.RunMetadata()

    def after_run(self, run_metadata) -> str | None:
        """Write the trace of the run `before_run` chose (if any); return its path."""
        step, self.pending = self.pending, None
        if step is None or run_metadata is None:
            return None
        if self._labels is None:
            self._labels = collective_labels(self.graph)
        text = chrome_trace(run_metadata.step_stats, self._labels)
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"step_{step}.json")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        self.written.append(path)
        _LOG.info("trace of training run %d written to %s (open it in chrome://tracing or "
                  "ui.perfetto.dev)", step, path)
        return path


def chrome_trace(step_stats, labels: dict[str, str]) -> str:
    """TensorFlow's Chrome trace of `step_stats`, one row per device, collectives named."""
    trace = json.loads(timeline.Timeline(step_stats).generate_chrome_trace_format())
    events = trace.get("traceEvents", [])
    used = {event.get("pid") for event in events if event.get("ph") != "M"}
    kept = []
    for event in events:
        if event.get("ph") == "M":
            if event.get("pid") not in used:
                continue
            name = event.get("args", {}).get("name", "")
            if event.get("name") == "process_name" and name.endswith(" Compute"):
                device = _short_device(name[:-len(" Compute")])
                event["args"]["name"] = device
                index = device.rsplit(":", 1)[-1]
                kept.append({"name": "process_sort_index", "ph": "M", "pid": event["pid"],
                             "args": {"sort_index": int(index) if index.isdigit() else 0}})
        elif event.get("args", {}).get("name") in labels:
            event["name"] = labels[event["args"]["name"]]
        kept.append(event)
    trace["traceEvents"] = kept
    return json.dumps(trace)


def _short_device(device: str) -> str:
    """"/job:localhost/replica:0/task:0/device:CPU:1" -> "CPU:1"."""
    return device.split("device:")[-1] if "device:" in device else device


def _kind(op_type: str) -> str:
    """"CollectiveReduceV2" -> "all-reduce" (the op type when no word matches)."""
    for word, kind in KIND_WORDS.items():
        if word in op_type:
            return kind
    return op_type


def _bytes(num: int | None) -> str:
    if num is None:
        return "? B"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{num} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num} B"


def updated_variables(op: tf.Operation, limit: int = MAX_WALK) -> list[str]:
    """Names of the variables whose updates the outputs of `op` reach, in graph order.

    Walks consumers through data edges; an op with a resource input that
    also consumes the walked value is an update of that variable (its handle
    producer names the variable); the walk does not go past it.
    """
    seen, queue, found = {op}, collections.deque([op]), {}
    while queue and len(seen) < limit:
        current = queue.popleft()
        for output in current.outputs:
            for consumer in output.consumers():
                if consumer in seen:
                    continue
                seen.add(consumer)
                handles = [t for t in consumer.inputs if t.dtype in UPDATE_INPUT_DTYPES]
                if handles and consumer.type != "ReadVariableOp":
                    found.setdefault(handles[0].op.name, handles[0].op._id)
                    continue
                queue.append(consumer)
    return sorted(found, key=found.get)


def collective_labels(graph: tf.Graph) -> dict[str, str]:
    """Node name -> trace label for every collective of `graph` (see the module doc)."""
    labels = {}
    for op in graph.get_operations():
        if not is_collective(op):
            continue
        variables = updated_variables(op)
        if variables:
            what = ", ".join(variables[:3]) + (f" (+{len(variables) - 3} more)"
                                               if len(variables) > 3 else "")
        else:
            consumers = [c for t in op.outputs for c in t.consumers()]
            what = f"into {consumers[0].name}" if consumers else f"{op.name} (no consumer)"
        kind = "all-reduce" if is_reduction_to_one_device(op) else _kind(op.type)
        labels[op.name] = f"EPL {kind}: {what} {_bytes(payload_bytes(op))}"
    return labels
