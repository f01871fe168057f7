"""The pass framework: passes, their typed results, the context, the manager.

A pass (`GraphPass`) is a class with a `name`, typed options given to its
constructor (`epl/passes/options.py` reads them from the config, once, for the
whole pipeline), and a `run(graph, ctx) -> PassResult`. What passes hand each
other are *results keyed by type* (docs/architecture.md, "Passes"):

- `provides`: the result types the pass may write (`ctx.provide(value)`); a type may
  be provided by several passes in turn, and readers get the latest (the
  gradients flow that way: `ReplicaGradients` is provided by replicate, then
  accumulate, then unscale);
- `requires`: the result types it reads and cannot do without
  (`ctx.get(Type)`); `optional`: those it reads when the pass providing them
  ran (`ctx.find(Type)`, None otherwise);
- `after`: names of passes that must run before it for another reason than a
  result (it rewrites what they built).

The driver puts the run's inputs into the context the same way (the analysis,
`TrainingView`; the `Plan`; the gradient-time `SplitRecords`; ...), so an input
is a result type like any other. The manager checks, before anything runs, that
every required type is provided by an input or an enabled earlier pass, and
every `after` pass comes earlier; while a pass runs, a read or write of a type
it does not declare is an error (a pass cannot depend on a result silently).

Passes keep no state and read no config: their options are values. A pass
that is off (its options say so, or `debug.disabled_passes` names it) stays in
the list, marked off: the manager runs neither its `validate` nor its `run` and
records its `off_note` (the dump shows it). Under `debug.check_invariants` the
`FingerprintInstrument` checks each pass's `PassResult.modified` against a
fingerprint of the graph before and after it.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import time
from typing import Any, TypeVar

import tensorflow as tf

from epl.errors import EPLError, PassError
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.attrs import set_string_attrs
from epl.ir.clone import created_complete
from epl.observability.dump_format import next_dump_index, rank_dump_dir
from epl.observability.dump_writer import PassDumpWriter

T = TypeVar("T")


@dataclasses.dataclass
class PassResult:
    """What a pass changed: op names added and removed, old -> new op names, notes,
    and whether it changed the graph at all (checked under debug.check_invariants)."""

    added: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    op_map: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    modified: bool = True


class PassContext:
    """One pipeline run's inputs and the passes' results, keyed by type.

    cluster, communicator: this worker's devices and its collectives (every pass may
    use them). inputs: the driver's values (the analysis, the plan, the gradient-time
    records, ...), each keyed by its type. `get`, `find` and `provide` are how passes
    read and write results; the manager checks them against what the running pass
    declares. `timings`, `passes_run`, `passes_off`, `validated` and `op_spans` are the
    manager's bookkeeping.
    """

    def __init__(self, cluster: Any, communicator: Any, inputs: tuple = ()):
        self.cluster = cluster
        self.communicator = communicator
        self._results: dict[type, Any] = {}
        self._running: GraphPass | None = None
        self.timings: dict[str, float] = {}
        self.passes_run: list[str] = []
        self.passes_off: list[str] = []
        # pass name -> what its validate() returned (its analysis of the graph as the
        # user built it), which only that pass's run() reads
        self.validated: dict[str, Any] = {}
        # (pass name, first, end): the ops graph.get_operations()[first:end] are the ones
        # that pass added (run-time errors name EPL's own ops by the pass that made them)
        self.op_spans: list[tuple[str, int, int]] = []
        for value in inputs:
            self._results[type(value)] = value

    @property
    def available(self) -> set:
        """The result types held now."""
        return set(self._results)

    def get(self, kind: type[T]) -> T:
        """The latest result of type `kind`; PassError when there is none (its pass
        is off) or the running pass does not declare it."""
        self._check_read(kind, optional=False)
        if kind not in self._results:
            raise PassError(f"no {kind.__name__} result: the pass that provides it did not "
                            f"run (passes run: {self.passes_run or 'none'}, off: "
                            f"{self.passes_off or 'none'})")
        return self._results[kind]

    def find(self, kind: type[T]) -> T | None:
        """The latest result of type `kind`, or None when none was provided."""
        self._check_read(kind, optional=True)
        return self._results.get(kind)

    def provide(self, value: Any) -> None:
        """Store `value` as the latest result of its type."""
        running = self._running
        if running is not None and type(value) not in running.provides:
            raise PassError(f"pass {running.name!r} provided a {type(value).__name__}, which is "
                            f"not among the types it declares in `provides` "
                            f"({_names(running.provides)})")
        self._results[type(value)] = value

    def _check_read(self, kind: type, optional: bool) -> None:
        running = self._running
        if running is None:   # the driver, a test or an instrument: reads anything
            return
        declared = running.requires + running.optional + running.provides
        if kind not in declared:
            raise PassError(f"pass {running.name!r} read a {kind.__name__}, which it does not "
                            f"declare (requires {_names(running.requires)}, optional "
                            f"{_names(running.optional)}); add it to the pass's declarations")


def _names(types: tuple) -> str:
    return ", ".join(t.__name__ for t in types) or "none"


class GraphPass(abc.ABC):
    """A graph rewrite. Subclasses set `name` and the declarations, take their options
    in the constructor and implement run() (see the module docstring)."""

    name: str = ""
    requires: tuple[type, ...] = ()
    optional: tuple[type, ...] = ()
    provides: tuple[type, ...] = ()
    after: tuple[str, ...] = ()
    off_note: str = "not enabled by the config"
    # True for a pass that runs on the graph as the user built it, before the driver
    # analyses it and plans (no TrainingView or Plan yet): it may only retag ops, which
    # the analysis then reads (the automatic stages). Such passes come first.
    before_analysis: bool = False

    def __init__(self, options: Any = None):
        self.options = options
        self.disabled_by_name = False   # debug.disabled_passes (set by the pipeline builder)

    @property
    def enabled(self) -> bool:
        """True if this pass runs: its options ask for it (`options.enabled`, default
        True) and debug.disabled_passes does not name it."""
        return not self.disabled_by_name and bool(getattr(self.options, "enabled", True))

    def why_off(self) -> str:
        """The note recorded for a pass that is off."""
        if self.disabled_by_name:
            return "disabled by debug.disabled_passes"
        return self.off_note

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
        """Called after a pass succeeded (or was found off)."""


class TimingInstrument(Instrument):
    """Records each pass's duration in ctx.timings (seconds)."""

    def after(self, graph_pass, graph, ctx, result, duration_s):
        ctx.timings[graph_pass.name] = duration_s


class DumpInstrument(Instrument):
    """Writes the graph before the first pass and after each pass (debug.dump_dir).

    The format is epl.observability.dump_format's; with several workers each writes
    `dump_dir`/rank_<r>. The instrument keeps its own index: a new dump starts at
    0 ("input"); with `continues` (parallelize time after gradient-time dumps of the
    same graph) it goes on after the last entry of the directory's manifest, and
    its first dump is "gradients".
    """

    def __init__(self, dump_dir: str, continues: bool = False):
        self.dump_dir = dump_dir
        self.continues = continues
        self._next: int | None = None
        self._writer = PassDumpWriter()   # serializes only what changed since the last pass

    def before(self, graph_pass, graph, ctx):
        if graph_pass is None and self._next is None:   # the graph the passes receive
            self._next = next_dump_index(self._directory(ctx)) if self.continues else 0
            self._write("gradients" if self._next else "input", graph,
                        {"duration_s": 0.0, "passes_before": []}, ctx)

    def after(self, graph_pass, graph, ctx, result, duration_s):
        ran = graph_pass.name not in ctx.passes_off  # a pass that ran is the last of passes_run
        summary = {"duration_s": duration_s, "added": result.added, "removed": result.removed,
                   "op_map": result.op_map, "notes": result.notes,
                   "passes_before": list(ctx.passes_run[:-1] if ran else ctx.passes_run)}
        self._write(graph_pass.name, graph, summary, ctx)

    def _directory(self, ctx) -> str:
        cluster = getattr(ctx, "cluster", None)
        return self.dump_dir if cluster is None else \
            rank_dump_dir(self.dump_dir, cluster.worker_rank, cluster.num_workers)

    def _write(self, name, graph, summary, ctx):
        self._writer.write(self._directory(ctx), self._next, name, graph, summary)
        self._next += 1


def graph_fingerprint(graph: tf.Graph) -> str:
    """A digest of the whole graph (every NodeDef, its inputs, attributes and device)."""
    data = graph.as_graph_def().SerializeToString(deterministic=True)
    return hashlib.sha256(data).hexdigest()


class FingerprintInstrument(Instrument):
    """debug.check_invariants: a pass's `modified` flag agrees with the graph.

    A pass that says it changed nothing must leave the fingerprint as it was, and a
    pass that says it changed the graph must change it (a pass that found nothing to
    do says modified=False)."""

    def __init__(self):
        self._before: str | None = None

    def before(self, graph_pass, graph, ctx):
        if graph_pass is not None and graph_pass.enabled:
            self._before = graph_fingerprint(graph)

    def after(self, graph_pass, graph, ctx, result, duration_s):
        if graph_pass.name in ctx.passes_off:
            return
        changed = graph_fingerprint(graph) != self._before
        if changed != result.modified:
            raise PassError(
                f"pass {graph_pass.name!r} reported modified={result.modified}, but the graph "
                f"{'changed' if changed else 'is unchanged'}; a pass's PassResult.modified "
                "must say whether it changed the graph")


def adopt_new_ops(graph: tf.Graph, first_new: int, fallback_taskgraph: str,
                  host_device: str) -> None:
    """Give ops a pass added without tags the TaskGraph, phase and device of an input.

    Passes tag and place the ops that matter (copies carry their original's
    attributes); helper ops (slices, casts, groups) inherit from their first
    tagged input, or fall back to `fallback_taskgraph`, phase "other" and
    `host_device`.

    Speed: ops a NodeBatch created tagged and placed (most of them: copies written
    as NodeDefs) are skipped without reading their NodeDef (epl.ir.clone.created_complete);
    any other op's NodeDef is read once (its tags and device are remembered, and
    updated when the op is adopted), and the tags are written together through
    epl.ir.attrs.set_string_attrs.
    """
    fallback_tg = fallback_taskgraph.encode()
    known: dict = {}  # op -> [TaskGraph or None, phase or None, device] as read or adopted

    def read(op: tf.Operation) -> list:
        found = known.get(op)
        if found is None:
            node = op.node_def
            attrs = node.attr
            found = known[op] = [attrs[TASKGRAPH_ATTR].s if TASKGRAPH_ATTR in attrs else None,
                                 attrs[PHASE_ATTR].s if PHASE_ATTR in attrs else None, node.device]
        return found

    tags = []  # (op, attribute, value) to write
    for op in graph.get_operations()[first_new:]:
        if created_complete(op):
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
            mine[2] = theirs[2] or host_device
            graph_mutation.set_device(op, mine[2])
    set_string_attrs(graph, tags)


class PassManager:
    """Runs an explicit list of passes over one graph.

    passes: run in this order. available: the result types the context holds
    before the first of them (the driver's inputs, and what passes that ran
    earlier on the same context provided). done: names of passes that already
    ran on that context (a pass test runs a pipeline's prefix, then the pass under
    test alone); they count for `after`. fallback_taskgraph: the TaskGraph given to
    an op a pass added untagged, with no tagged input.
    """

    def __init__(self, passes: list[GraphPass], instruments: list[Instrument] | None = None,
                 available: tuple | set = (), done: tuple | list = (),
                 fallback_taskgraph: str = "default"):
        self.passes = list(passes)
        self.instruments = list(instruments or [])
        self.fallback_taskgraph = fallback_taskgraph
        self._check_declarations(set(available), list(done))

    def _check_declarations(self, available: set, done: list) -> None:
        names = [p.name for p in self.passes]
        for graph_pass in self.passes:
            missing = [r for r in graph_pass.after if r not in done]
            if missing:
                raise PassError(f"pass {graph_pass.name!r} must run after {missing}; the "
                                f"pipeline is {names}. Reorder the pass list.")
            if graph_pass.enabled:
                absent = [t for t in graph_pass.requires if t not in available]
                if absent:
                    raise PassError(
                        f"pass {graph_pass.name!r} requires {_names(tuple(absent))}, which no "
                        f"input and no enabled pass before it provides; the pipeline is "
                        f"{names} (off: {[p.name for p in self.passes if not p.enabled]}). "
                        "Enable the pass that provides it, or reorder the pass list.")
                available.update(graph_pass.provides)
            done.append(graph_pass.name)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        """Validate every enabled pass on `graph` before any of them rewrites it."""
        for graph_pass in self.passes:
            if not graph_pass.enabled:
                continue
            ctx._running = graph_pass
            try:
                ctx.validated[graph_pass.name] = graph_pass.validate(graph, ctx)
            except EPLError as err:
                raise PassError(f"pass {graph_pass.name!r} rejected the graph before any "
                                f"rewrite: {err}") from err
            finally:
                ctx._running = None

    def run(self, graph: tf.Graph, ctx: PassContext, validate: bool = True) -> PassContext:
        """Validate every pass (unless `validate` is False: the caller validated the
        whole pipeline before running its first part), then run them in order; return
        the context."""
        if validate:
            self.validate(graph, ctx)
        for instrument in self.instruments:
            instrument.before(None, graph, ctx)
        for graph_pass in self.passes:
            for instrument in self.instruments:
                instrument.before(graph_pass, graph, ctx)
            if not graph_pass.enabled:
                ctx.passes_off.append(graph_pass.name)
                off = PassResult(notes=[graph_pass.why_off()], modified=False)
                for instrument in self.instruments:
                    instrument.after(graph_pass, graph, ctx, off, 0.0)
                continue
            result, duration = self._run_one(graph_pass, graph, ctx)
            ctx.passes_run.append(graph_pass.name)
            for instrument in self.instruments:
                instrument.after(graph_pass, graph, ctx, result, duration)
        return ctx

    def _run_one(self, graph_pass: GraphPass, graph: tf.Graph, ctx: PassContext):
        first_new = len(graph.get_operations())
        start = time.perf_counter()
        ctx._running = graph_pass
        try:
            result = graph_pass.run(graph, ctx)
        except EPLError as err:
            raise PassError(
                f"pass {graph_pass.name!r} failed (passes run before it: "
                f"{ctx.passes_run or 'none'}): {err}") from err
        finally:
            ctx._running = None
        duration = time.perf_counter() - start
        ctx.op_spans.append((graph_pass.name, first_new, len(graph.get_operations())))
        adopt_new_ops(graph, first_new, self.fallback_taskgraph, ctx.cluster.host_device)
        return result, duration
