"""The driver: run the planner and the passes once per graph, on its record.

`parallelize(graph, record)` is called by the session hooks (first session on
the graph, or MonitoredTrainingSession's Scaffold.finalize) or through
`epl.parallelize()`, with the graph's `GraphRecord` (epl/ir/record.py: what
construction and gradient time saw; the hooks keep it). It builds the training
pipeline from the config (`training_pipeline(config)`, every rewrite a pass of
its own, each built from its typed options, epl/passes/options.py) and runs it
in two parts around the analysis: the passes that only retag the graph as the
user built it (`GraphPass.before_analysis`: the automatic stages,
epl/passes/pipeline/auto_stages.py), then the analysis and the plan (both may
raise before any op is added), then every other pass. The result, a
`ParallelGraph`, goes into the record: what the session integration needs
(fetch remapping, replica sync).

What the passes hand each other are typed results (epl/passes/manager.py); the
driver gives them their inputs the same way (the record, this worker's
planner, the analysis, the plan, the gradient-time split records) and reads
their results through the same interface. See docs/architecture.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from epl.env import get_config
from epl.errors import ConfigError, ParallelizeError, PassError
from epl.ir.autodiff import internal_autodiff
from epl.ir.graph_mutation import clean_construction_context
from epl.ir.graph_view import TrainingView, analyze, has_training_step
from epl.ir.record import GraphRecord
from epl.observability.summary import format_summary, prints_here, summarize
from epl.observability.trace import make_tracer
from epl.passes.annotate import AnnotatePass
from epl.passes.amp import AmpPass
from epl.passes.apply_groups import ApplyGroupsPass
from epl.passes.consistency import ConsistencyPass
from epl.passes.gradient_comm import GradientCommPass
from epl.passes.manager import (DumpInstrument, FingerprintInstrument, PassContext, PassManager,
                                TimingInstrument)
from epl.passes.offload import OffloadPass
from epl.passes.options import pass_options
from epl.passes.pipeline.accumulate import AccumulatePass
from epl.passes.pipeline.auto_stages import AutoStagesPass, StagePartition
from epl.passes.pipeline.schedule import SchedulePass
from epl.passes.recompute.recompute import RecomputePass
from epl.passes.replication.origins import copy_origins
from epl.passes.replication.replicate import ReplicatePass
from epl.passes.replication.result import GradientCheck, Replication
from epl.passes.skip_on_overflow import SkipOnOverflowPass
from epl.passes.split.split import SplitInputs, SplitPass, SplitRecords
from epl.passes.unit_functions import UnitFunctions, UnitFunctionsPass
from epl.passes.unscale import UnscalePass
from epl.passes.verify import InvariantInstrument, VerifyPass
from epl.passes.zero import ZeroPass, ZeroSharding
from epl.planner.plan import Plan
from epl.planner.worker_planner import WorkerPlanner
from epl.runtime.cluster import Cluster, local_cluster
from epl.runtime.collective_check import check_collectives_agree
from epl.runtime.communicators import make_communicator

# The passes, in pipeline order: (name, class). Their options come from
# epl/passes/options.py; debug.disabled_passes may name any of them.
GRADIENT_TIME_PASSES = (("split", SplitPass),)
TRAINING_PASSES = (
    ("auto_stages", AutoStagesPass), ("annotate", AnnotatePass), ("amp", AmpPass),
    ("recompute", RecomputePass), ("replicate", ReplicatePass), ("consistency", ConsistencyPass),
    ("accumulate", AccumulatePass),
    ("unscale", UnscalePass), ("schedule", SchedulePass), ("zero", ZeroPass),
    ("gradient_comm", GradientCommPass), ("apply_groups", ApplyGroupsPass),
    ("skip_on_overflow", SkipOnOverflowPass), ("offload", OffloadPass), ("verify", VerifyPass),
    ("unit_functions", UnitFunctionsPass))


def _build(entries, config) -> list:
    """The passes of `entries`, each with its options from `config`, those named by
    debug.disabled_passes marked off."""
    options = pass_options(config)
    disabled = set(config.get("debug.disabled_passes"))
    known = {name for name, _ in GRADIENT_TIME_PASSES + TRAINING_PASSES}
    unknown = sorted(disabled - known)
    if unknown:
        raise ConfigError(f"debug.disabled_passes names {unknown}, which are no passes; the "
                          f"passes are {[name for name, _ in GRADIENT_TIME_PASSES + TRAINING_PASSES]}")
    passes = []
    for name, cls in entries:
        graph_pass = cls(options[name])
        graph_pass.disabled_by_name = name in disabled
        passes.append(graph_pass)
    return passes


def gradient_time_pipeline(config) -> list:
    """The passes that run at gradient time, on the finished forward graph, before
    autodiff (docs/architecture.md, "Data flow", step 2)."""
    return _build(GRADIENT_TIME_PASSES, config)


def training_pipeline(config) -> list:
    """The training passes, in order (docs/architecture.md, "Passes"); each rewrite is one
    pass, built from its options in `config`.

    auto_stages retags the graph as the user built it (before the analysis); then
    the forward is lowered (amp), the backward's checkpoints chosen (recompute),
    the model copied per (replica, micro-batch) (replicate), and the gradients
    flow one way (epl/passes/gradient_flow.py): accumulated over micro-batches,
    unscaled right after the backward, reduced (zero, gradient_comm), and at the
    end of the step an overflowed update skipped (skip_on_overflow).

    Unscale comes before zero rather than after it: ZeRO reduce-scatters the
    gradients itself, and every reduction reads unscaled gradients.
    """
    return _build(TRAINING_PASSES, config)


def _instruments(config, continues: bool = False) -> list:
    """The instruments `config` asks for: timing always; dumps (debug.dump_dir; continues:
    after the same graph's gradient-time dumps); invariant and modified-flag checks
    (debug.check_invariants)."""
    instruments = [TimingInstrument()]
    if config.get("debug.dump_dir"):
        instruments.append(DumpInstrument(config.get("debug.dump_dir"), continues))
    if config.get("debug.check_invariants"):
        instruments += [InvariantInstrument(), FingerprintInstrument()]
    return instruments


def config_of(record: GraphRecord):
    """The config `record`'s graph is rewritten under: the record's rewrite_config when
    its maker gave one, else the active one, which must be the one the graph was
    annotated under.

    Raises ParallelizeError for a graph EPL annotated under an earlier `epl.init`
    config that differs from the active one.
    """
    if record.rewrite_config is not None:
        return record.rewrite_config
    config = get_config()
    built_under = record.config
    if built_under is not None and built_under != config:
        old, new = built_under.to_dict(), config.to_dict()
        changed = ", ".join(sorted(key for key in new if old[key] != new[key]))
        raise ParallelizeError(
            "this graph was built under an earlier epl.init config, and epl.init was called "
            f"again since with a different one (keys that differ: {changed}). EPL rewrites a "
            "graph under the config it was built with: create the graph's session (or call "
            "epl.parallelize) before calling epl.init again, or build the graph after the "
            "epl.init whose config it should use.")
    return config


def run_gradient_time_pipeline(graph: tf.Graph, record: GraphRecord, loss: tf.Tensor,
                               captured: dict | None = None) -> None:
    """Run `gradient_time_pipeline` on `graph` (its record `record`, its loss `loss`);
    called by the optimizer hooks (epl.hooks.optimizer) when the graph has split
    TaskGraphs not split yet, and by the tape hook of a traced tf.function step
    (epl.hooks.function; `captured`: its eager variables, SplitInputs). The split
    pass's records go into the record."""
    config = config_of(record)
    cluster = local_cluster(config)
    ctx = PassContext(cluster, make_communicator(cluster, config),
                      inputs=(record, WorkerPlanner(cluster, config), SplitInputs(loss, captured)))
    fallback = record.taskgraphs[0].name
    with graph.as_default(), internal_autodiff():
        PassManager(gradient_time_pipeline(config), _instruments(config), ctx.available,
                    fallback_taskgraph=fallback).run(graph, ctx)
    records = ctx.find(SplitRecords)
    if records is not None:
        record.splits.extend(records.records)


def before_analysis(passes: list) -> tuple[list, list]:
    """(the leading passes that run before the analysis, the rest).

    Raises:
        PassError: a pass marked `before_analysis` comes after one that is not (it
        could not run on the graph as the user built it).
    """
    count = next((i for i, p in enumerate(passes) if not p.before_analysis), len(passes))
    late = [p.name for p in passes[count:] if p.before_analysis]
    if late:
        raise PassError(f"pass(es) {late} run before the analysis, but come after "
                        f"{passes[count].name!r} in the pipeline {[p.name for p in passes]}. "
                        "Move them to the front of the pass list.")
    return list(passes[:count]), list(passes[count:])


@dataclasses.dataclass
class ParallelGraph:
    """A parallelized graph and what running it needs.

    fetch_map: user tensor -> tensor a fetch of it returns (merged losses).
    sync_ops: original variable op -> op that copies it into its mirrors.
    """

    graph: tf.Graph
    plan: Plan
    cluster: Cluster
    view: TrainingView
    fetch_map: dict
    sync_ops: dict
    timings: dict
    timeout_s: float = 300.0
    # gradient_checkpoint.check_gradients: (gradients without checkpointing,
    # gradients with it) of replica 0, compared by the session before the first
    # training step; the largest absolute difference is kept here.
    gradient_check: tuple | None = None
    gradient_check_max_diff: float | None = None
    # zero.level: original slot variable op -> op gathering its shards into it; the
    # session runs it before a run that reads the original (a Saver's save).
    gather_ops: dict = dataclasses.field(default_factory=dict)
    # io.batch_mode "replica": user's static-batch placeholder -> FeedRedirect (the
    # session moves a feed of it onto EPL's placeholder of every unit's rows)
    feeds: dict = dataclasses.field(default_factory=dict)
    # debug.trace_dir: the StepTracer the session asks before each run (None: no traces).
    tracer: object = None
    # a session runs the run graph, what its runs need (epl/runtime/run_graph.py), unless
    # debug.whole_graph_sessions asks for the whole graph
    run_graph: bool = True
    # the replicate pass's record (epl/passes/replication/result.py): every unit's copies
    # and the mirrors; the session feeds every copy of a fed tensor, and answers a fetch
    # of a per-replica tensor with the first unit's copy; the tf.function integration
    # (epl/hooks/function.py) rebuilds a traced function from it
    replication: object = None
    # the copies whose work a unit function's call does (epl/passes/unit_functions.py):
    # a feed of one of them would not reach the step, so the session refuses it
    outlined: frozenset = frozenset()
    # and each copied tensor a call returns -> the call's output (what a fetch reads)
    unit_outputs: dict = dataclasses.field(default_factory=dict)
    # the reference variable ops the calls wait for (unit_functions.ref_scan_marks):
    # never read, in no collection, no variable of the model
    ref_marks: frozenset = frozenset()
    # (variable op, is-initialized tensor) for each variable a call reads in its body:
    # the session asks them after a cancelled step (UnitFunctions.initialized)
    initialized: list = dataclasses.field(default_factory=list)
    # the graph's op count once rewritten: a fetch of a newer op was built afterwards
    ops_after_rewrite: int = 0
    # EPL's copy (op or resource name) -> (the user's op it stands for, its unit), for
    # run-time errors in the user's terms (epl.passes.replication.origins)
    origins: dict = dataclasses.field(default_factory=dict)
    # (pass name, first, end): graph.get_operations()[first:end] are the ops that pass
    # added (PassContext.op_spans); a run-time error names EPL's own ops (not copies) by it
    pass_spans: list = dataclasses.field(default_factory=list)

    def session_config(self, base=None):
        """The session config that creates this graph's devices, with one round of
        TensorFlow's graph optimizer (Grappler) unless `base` asks for a number, and
        placement of each run's pruned graph.

        Grappler runs its optimizers over the whole graph in two rounds by default,
        and on a rewritten graph, which holds a copy of the model per (replica,
        micro-batch) unit, that is most of the first step: 12 layers, 16
        micro-batches, 87,663 ops, 32 of the first step's 39 s (bench/startup.py,
        with and without --no-grappler). The second round changed little there (it
        merged 1,151 duplicate nodes) and cost about 9 s; with one round the first
        step took 30 s and the steady step did not change.

        By default a session places the whole graph at its first run, the copies the
        unit functions replaced (unread now) included, and copies it again for each
        new set of fetches; `place_pruned_graph` places only what the run reads. At 12
        layers and 16 micro-batches that took the initializer's run from 6.8 s to 1.4 s
        and the first step from 14.8 s to 6.4 s. Placing less changes which of two
        unordered ops runs first, so the annotate pass orders the one such pair
        scripts rely on (a hand-written global-step increment after the learning
        rate's read of it)."""
        config = self.cluster.session_config(base)
        rewrite = config.graph_options.rewrite_options
        if rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS:
            rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        config.graph_options.place_pruned_graph = True
        return config


def needs_parallelize(record: GraphRecord | None) -> bool:
    """True if EPL annotated the graph of `record` (scopes or an optimizer step) and has
    not rewritten it yet."""
    if record is None or record.parallelized:
        return False
    if record.taskgraphs or any(not step.from_gradients for step in record.train_steps):
        return True
    # only tf.gradients calls: a training step if their gradients update variables
    return bool(record.train_steps) and has_training_step(record)


def parallelize(graph: tf.Graph, record: GraphRecord,
                replica_weights: list[float] | None = None) -> ParallelGraph:
    """Rewrite `graph` (whose record is `record`) for parallel training, once.

    replica_weights: per-replica shares of the global batch (default: even, or
    the planner's). Returns the ParallelGraph (also kept in the record); a second
    call returns the first result.
    """
    if record.parallelized:
        return record.result
    with _cyclic_gc_paused(), internal_autodiff():   # EPL's autodiff is not a user step
        return _parallelize(graph, record, replica_weights)


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector (reference counting still frees objects).

    Speed: the rewrite creates hundreds of thousands of objects that live as
    long as the graph (ops, tensors, protos); their allocation can trigger a
    full collection, which traverses every object of the process (0.3-0.5 s
    on a 24-layer transformer when one falls inside the rewrite) and frees
    next to nothing. Cyclic garbage made meanwhile is collected once the
    collector runs again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def pass_context(graph: tf.Graph, record: GraphRecord, passes: list,
                 replica_weights: list[float] | None = None) -> tuple[PassContext, list, list]:
    """Run the passes of `passes` that come before the analysis (the automatic stages),
    then analyse and plan `graph` (its record `record`).

    Returns the PassContext the other passes run on (holding the analysis, the plan
    and the split records as inputs), the instruments the config asks for (timing,
    dumps, invariant checks), and the passes left to run.
    """
    config = config_of(record)   # the config the graph was built under
    cluster = local_cluster(config)
    planner = WorkerPlanner(cluster, config)
    instruments = _instruments(config, continues=bool(record.splits))
    ctx = PassContext(cluster, make_communicator(cluster, config),
                      inputs=(record, planner, SplitRecords(tuple(record.splits))))
    first, rest = before_analysis(passes)
    fallback = record.taskgraphs[0].name if record.taskgraphs else "default"
    PassManager(first, instruments, ctx.available, fallback_taskgraph=fallback).run(graph, ctx)
    stages = ctx.find(StagePartition)
    view = analyze(graph, record, stages.taskgraphs if stages is not None else None,
                   str(config.get("io.batch_mode")))
    # the runtime Plan from the hardware-aware planner's ClusterPlan of this worker's
    # devices (batch shares, each stage's device), so the dry run and the real run agree
    # uneven shares only where the replicate pass can give replicas different batches
    replicate = next((p for p in rest if isinstance(p, ReplicatePass)), None)
    plan = planner.plan(view.taskgraphs + view.split_taskgraphs, view, replica_weights,
                        replicate is None or replicate.supports_uneven_shares(view))
    ctx.provide(view)
    ctx.provide(plan)
    return ctx, instruments, rest


def run_passes(graph: tf.Graph, ctx: PassContext, passes: list, instruments: list,
               validate: bool = True) -> None:
    """Run `passes` on `graph` (after the passes ctx ran or found off), building EPL's ops
    at the top level of the graph, unfinalized meanwhile if it was finalized.
    validate=False: the caller validated these passes (PassManager.validate) before
    the graph was rewritten."""
    finalized = graph.finalized
    if finalized:
        graph._unsafe_unfinalize()
    try:
        with clean_construction_context(graph):
            manager = PassManager(passes, instruments, ctx.available,
                                  done=ctx.passes_run + ctx.passes_off,
                                  fallback_taskgraph=ctx.get(TrainingView).taskgraphs[0].name)
            manager.run(graph, ctx, validate=validate)
    finally:
        if finalized:
            graph.finalize()


def _parallelize(graph: tf.Graph, record: GraphRecord,
                 replica_weights: list[float] | None) -> ParallelGraph:
    """parallelize() once the graph is known to need it: analyse, plan, run the passes."""
    start = time.perf_counter()
    config = config_of(record)
    ctx, instruments, rest = pass_context(graph, record, training_pipeline(config),
                                          replica_weights)
    run_passes(graph, ctx, rest, instruments)
    cluster, plan = ctx.cluster, ctx.get(Plan)
    view = ctx.get(TrainingView)   # the amp pass hands on a view with its lowered ops
    if cluster.num_workers > 1:  # before anything runs: mismatched graphs fail here, not hang
        check_collectives_agree(graph, float(config.get("communication.collective_timeout_s")),
                                config)
    replication = ctx.get(Replication)
    zero = ctx.find(ZeroSharding)
    check = ctx.find(GradientCheck)
    result = ParallelGraph(graph, plan, cluster, view, dict(replication.merged),
                           {**replication.sync_ops, **(zero.sync_ops if zero else {})},
                           dict(ctx.timings),
                           float(config.get("communication.collective_timeout_s")),
                           (check.reference, check.checkpointed) if check else None)
    if zero is not None:
        result.gather_ops = dict(zero.gather_ops)
    result.feeds = dict(replication.feeds)
    result.tracer = make_tracer(config, cluster, graph)
    result.run_graph = not config.get("debug.whole_graph_sessions")
    result.replication = replication
    functions = ctx.find(UnitFunctions)
    if functions is not None:
        result.outlined, result.unit_outputs = functions.outlined, dict(functions.outputs)
        result.initialized = list(functions.initialized)
        result.ref_marks = functions.ref_marks
        if result.gradient_check is not None:   # the checkpointed gradients the step computes
            reference, checkpointed = result.gradient_check
            result.gradient_check = (reference, [None if g is None else
                                                 functions.outputs.get(g, g)
                                                 for g in checkpointed])
    result.ops_after_rewrite = len(graph.get_operations())
    result.origins = copy_origins(replication)
    result.pass_spans = list(ctx.op_spans)
    record.result = result
    _log_summary(result, ctx, config, time.perf_counter() - start)
    return result


def _log_summary(result: ParallelGraph, ctx: PassContext, config, rewrite_s: float) -> None:
    """Log what parallelize built (epl.observability.summary) at INFO through the "epl" logger."""
    logger = logging.getLogger(__name__)
    if not logger.isEnabledFor(logging.INFO) or not prints_here(result.cluster, config):
        return
    summary = summarize(result.graph, result.plan, result.cluster, result.view, config,
                        ctx.timings, rewrite_s, list(result.fetch_map.values()))
    logger.info("%s", "\n".join(format_summary(summary)))
