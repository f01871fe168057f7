"""Pass manager: runs graph passes in order, with instruments around each.

A pass is a class with `name`, `requires` (passes that must have run before
it), `enabled(config)` (whether the config asks for it) and
`run(graph, ctx) -> PassResult`. Passes keep no state: what one pass
hands to the next goes into its own field of the PassContext (`ctx.replication`,
`ctx.amp`, ...), which no other pass writes.
The manager checks every pass's `requires` before running anything, runs the
instruments before and after each pass (dump, timing, invariant checks), and
turns a failure into a PassError that names the pass and the passes before it.
"""
from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any

import tensorflow as tf

from epl.observability.dump_format import rank_dump_dir
from epl.observability.dump_writer import PassDumpWriter
from epl.errors import EPLError, PassError
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.attrs import set_string_attrs
from epl.ir.taskgraph import graph_state


@dataclasses.dataclass
class PassResult:
    """What a pass changed: op names added and removed, and old -> new op names."""

    added: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    op_map: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PassContext:
    """Everything a pass may read: config, plan, cluster, analysis, and the results of
    the passes before it (typed fields, one per result)."""

    config: Any
    plan: Any  # None for the passes before the analysis (GraphPass.before_analysis)
    cluster: Any
    view: Any  # the analysis (TrainingView); the amp pass hands on a new one with its ops
    communicator: Any
    # What the passes hand on, one field per result, each written by one pass only and
    # read by the passes after it (None until its pass ran, or when it is off):
    stages: Any = None          # auto_stages: the StagePartition it applied
    amp: Any = None             # amp: an AmpRewrite (epl/passes/amp.py)
    recompute: Any = None       # recompute: a Recompute (epl/passes/recompute/recompute.py)
    replication: Any = None     # replicate: a Replication (epl/passes/replication/result.py)
    gradient_check: Any = None  # replicate: (plain, checkpointed) gradients of replica 0
    accumulation: Any = None    # accumulate: an Accumulation (epl/passes/pipeline/accumulate.py)
    schedule: Any = None        # schedule: a ScheduleLowering (epl/passes/pipeline/schedule.py)
    unscale: Any = None         # unscale: an Unscaling (epl/passes/unscale.py)
    zero: Any = None            # zero: a ZeroSharding (epl/passes/zero.py)
    reduced: Any = None         # gradient_comm: gradient tensor -> its reduced tensor
    # gradient time (the split pass): its inputs, set by the driver, and its records
    split_loss: Any = None      # the loss compute_gradients was given
    split_plans: Any = None     # TaskGraph name -> SplitPlan
    split_records: Any = None   # split: a SplitRecord per TaskGraph it split (the
    #                             training passes get the graph's, from the driver)
    # pass name -> what its validate() returned: its analysis of the graph as the user
    # built it, which only that pass's run() reads
    validated: dict = dataclasses.field(default_factory=dict)
    timings: dict = dataclasses.field(default_factory=dict)
    passes_run: list = dataclasses.field(default_factory=list)
    passes_off: list = dataclasses.field(default_factory=list)  # not enabled by the config


class GraphPass(abc.ABC):
    """A graph rewrite. Subclasses set `name` and `requires` and implement run().

    `enabled(config)` says whether the config asks for this pass at all (ZeRO,
    AMP, offload, apply groups are opt-in); the manager runs neither `validate`
    nor `run` of a pass that is not enabled, and records `off_note` for it.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    off_note: str = "not enabled by the config"
    # True for a pass that runs on the graph as the user built it, before the driver
    # analyses it and plans (ctx.view and ctx.plan are None): it may only retag ops,
    # which the analysis then reads (the automatic stages). Such passes come first.
    before_analysis: bool = False

    def enabled(self, config: Any) -> bool:
        """True if `config` asks for this pass (default: always)."""
        return True

    def validate(self, graph: tf.Graph, ctx: PassContext) -> Any:
        """Raise an EPLError if this pass cannot run on `graph` (changes nothing).

        The manager validates every pass before running any, so bad input is
        reported before the graph is touched. What it returns (its analysis of the
        untouched graph, or None) is `ctx.validated[name]` for this pass's run().
        """

    @abc.abstractmethod
    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        """Analyse, then rewrite `graph`; return what changed."""


class Instrument:
    """Hooks called around every pass (default: do nothing)."""

    def before(self, graph_pass: GraphPass | None, graph: tf.Graph, ctx: PassContext) -> None:
        """Called before a pass (graph_pass None: before the first one)."""

    def after(self, graph_pass: GraphPass, graph: tf.Graph, ctx: PassContext,
              result: PassResult, duration_s: float) -> None:
        """Called after a pass succeeded."""


class TimingInstrument(Instrument):
    """Records each pass's duration in ctx.timings (seconds)."""

    def after(self, graph_pass, graph, ctx, result, duration_s):
        ctx.timings[graph_pass.name] = duration_s


class DumpInstrument(Instrument):
    """Writes the graph before the first pass and after each pass (debug.dump_dir).

    The format is epl.observability.dump_format's; with several workers each writes
    `dump_dir`/rank_<r>.
    """

    def __init__(self, dump_dir: str, first_index: int = 0):
        """first_index: index of the first dump (after dumps written at gradient time)."""
        self.dump_dir = dump_dir
        self.first_index = first_index
        self._writer = PassDumpWriter()   # serializes only what changed since the last pass

    def before(self, graph_pass, graph, ctx):
        # the graph the passes receive (once: the driver runs the passes before the
        # analysis, then the others, on one context)
        if graph_pass is None and not ctx.passes_run and not ctx.passes_off:
            name = "input" if self.first_index == 0 else "gradients"
            self._write(self.first_index, name, graph,
                        {"duration_s": 0.0, "passes_before": []}, ctx)

    def after(self, graph_pass, graph, ctx, result, duration_s):
        ran = graph_pass.name not in ctx.passes_off  # a pass that ran is the last of passes_run
        summary = {"duration_s": duration_s, "added": result.added, "removed": result.removed,
                   "op_map": result.op_map, "notes": result.notes,
                   "passes_before": list(ctx.passes_run[:-1] if ran else ctx.passes_run)}
        index = self.first_index + len(ctx.passes_run) + len(ctx.passes_off)
        self._write(index, graph_pass.name, graph, summary, ctx)

    def _write(self, index, name, graph, summary, ctx=None):
        cluster = getattr(ctx, "cluster", None)
        directory = self.dump_dir if cluster is None else \
            rank_dump_dir(self.dump_dir, cluster.worker_rank, cluster.num_workers)
        self._writer.write(directory, index, name, graph, summary)


def adopt_new_ops(graph: tf.Graph, ctx: PassContext, first_new: int) -> None:
    """Give ops a pass added without tags the TaskGraph, phase and device of an input.

    Passes tag and place the ops that matter (copies carry their original's
    attributes); helper ops (slices, casts, groups) inherit from their first
    tagged input, or fall back to the first TaskGraph, phase "other" and the
    host device.

    Speed: each op's NodeDef is read once (its tags and device are remembered,
    and updated when the op is adopted), and the tags are written together
    through epl.ir.attrs.set_string_attrs.
    """
    if ctx.view is not None:
        fallback_tg = ctx.view.taskgraphs[0].name.encode()
    else:  # gradient time (the split pass): no view yet
        fallback_tg = graph_state(graph).taskgraphs[0].name.encode()
    known: dict = {}  # op -> [TaskGraph or None, phase or None, device] as read or adopted

    def read(op: tf.Operation) -> list:
        found = known.get(op)
        if found is None:
            node = op.node_def
            attrs = node.attr
            found = known[op] = [attrs[TASKGRAPH_ATTR].s if TASKGRAPH_ATTR in attrs else None,
                                 attrs[PHASE_ATTR].s if PHASE_ATTR in attrs else None, node.device]
        return found

    complete = graph_state(graph).created_complete  # tagged and placed when created
    tags = []  # (op, attribute, value) to write
    for op in graph.get_operations()[first_new:]:
        if op in complete:
            continue
        mine = read(op)
        if mine[0] is not None and mine[2]:
            continue
        source = next((t.op for t in list(op.inputs) + [c.outputs[0] for c in op.control_inputs
                                                        if c.outputs]
                       if read(t.op)[0] is not None), None)
        theirs = read(source) if source is not None else [None, None, ""]
        if mine[0] is None:
            mine[0] = theirs[0] if source is not None else fallback_tg
            mine[1] = theirs[1] if theirs[1] is not None else Phase.OTHER.value.encode()
            tags += [(op, TASKGRAPH_ATTR, mine[0]), (op, PHASE_ATTR, mine[1])]
        if not mine[2]:
            mine[2] = theirs[2] or ctx.cluster.host_device
            graph_mutation.set_device(op, mine[2])
    set_string_attrs(graph, tags)


class PassManager:
    """Runs an explicit list of passes over one graph."""

    def __init__(self, passes: list[GraphPass], instruments: list[Instrument] | None = None,
                 after: tuple[str, ...] | list[str] = ()):
        """passes: run in this order. after: names of passes that already ran on the
        context this manager will be given (a pass test runs a pipeline's prefix, then
        the pass under test alone); they count for `requires`."""
        self.passes = list(passes)
        self.instruments = list(instruments or [])
        self._check_requires(list(after))

    def _check_requires(self, seen: list[str]) -> None:
        for graph_pass in self.passes:
            missing = [r for r in graph_pass.requires if r not in seen]
            if missing:
                raise PassError(
                    f"pass {graph_pass.name!r} requires {missing} to run before it; the pipeline "
                    f"is {[p.name for p in self.passes]}. Reorder the pass list.")
            seen.append(graph_pass.name)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        """Validate every enabled pass on `graph` before any of them rewrites it."""
        for graph_pass in self.passes:
            if not graph_pass.enabled(ctx.config):
                continue
            try:
                ctx.validated[graph_pass.name] = graph_pass.validate(graph, ctx)
            except EPLError as err:
                raise PassError(f"pass {graph_pass.name!r} rejected the graph before any "
                                f"rewrite: {err}") from err

    def run(self, graph: tf.Graph, ctx: PassContext, validate: bool = True) -> PassContext:
        """Validate every pass (unless `validate` is False: the caller validated the
        whole pipeline before running its first part), then run them in order; return
        the context."""
        if validate:
            self.validate(graph, ctx)
        enabled = {graph_pass.name: graph_pass.enabled(ctx.config) for graph_pass in self.passes}
        for instrument in self.instruments:
            instrument.before(None, graph, ctx)
        for graph_pass in self.passes:
            for instrument in self.instruments:
                instrument.before(graph_pass, graph, ctx)
            if not enabled[graph_pass.name]:
                ctx.passes_off.append(graph_pass.name)
                off = PassResult(notes=[graph_pass.off_note])
                for instrument in self.instruments:
                    instrument.after(graph_pass, graph, ctx, off, 0.0)
                continue
            first_new = len(graph.get_operations())
            start = time.perf_counter()
            try:
                result = graph_pass.run(graph, ctx)
            except EPLError as err:
                raise PassError(
                    f"pass {graph_pass.name!r} failed (passes run before it: "
                    f"{ctx.passes_run or 'none'}): {err}") from err
            duration = time.perf_counter() - start
            adopt_new_ops(graph, ctx, first_new)
            ctx.passes_run.append(graph_pass.name)
            for instrument in self.instruments:
                instrument.after(graph_pass, graph, ctx, result, duration)
        return ctx
