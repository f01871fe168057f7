"""Parallelize time: run the planner and the passes once per graph.

`parallelize(graph)` is called by the session hooks (first session on the
graph, or MonitoredTrainingSession's Scaffold.finalize) or explicitly by the
user. It runs the training pipeline (`training_pipeline()`, every rewrite a
pass of its own) in two parts around the analysis: the passes that only retag
the graph as the user built it (`GraphPass.before_analysis`: the automatic
stages, epl/passes/pipeline/auto_stages.py), then the analysis and the plan (both may
raise before any op is added), then every other pass. It stores a
`ParallelGraph` on the graph's state: what the session integration needs
(fetch remapping, replica sync).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import tensorflow as tf

from epl.runtime.cluster import Cluster, local_cluster
from epl.env import config_for, get_config
from epl.errors import ParallelizeError, PassError
from epl.ir.autodiff import internal_autodiff
from epl.ir.graph_view import TrainingView, analyze, has_training_step
from epl.ir.taskgraph import graph_state
from epl.passes.manager import DumpInstrument, PassContext, PassManager, TimingInstrument
from epl.planner.plan import Plan, make_local_plan, split_layout
from epl.planner.planner import local_shard_weights
from epl.passes.replication.origins import copy_origins
from epl.runtime.collective_check import check_collectives_agree
from epl.runtime.communicators import make_communicator
from epl.observability.trace import make_tracer
from epl.strategies import EAGER_HINT
from epl.observability.summary import format_summary, summarize
from epl.passes.pipeline.accumulate import AccumulatePass
from epl.passes.amp import AmpPass
from epl.passes.annotate import AnnotatePass
from epl.passes.apply_groups import ApplyGroupsPass
from epl.passes.pipeline.auto_stages import AutoStagesPass
from epl.passes.gradient_comm import GradientCommPass
from epl.passes.offload import OffloadPass
from epl.passes.recompute.recompute import RecomputePass
from epl.passes.replication.replicate import ReplicatePass
from epl.passes.replication.inputs import batch_mode, supports_uneven_shares
from epl.passes.pipeline.schedule import SchedulePass
from epl.passes.skip_on_overflow import SkipOnOverflowPass
from epl.passes.split.split import SplitPass, SplitPlan
from epl.passes.unscale import UnscalePass
from epl.passes.verify import InvariantInstrument, VerifyPass
from epl.passes.zero import ZeroPass


def gradient_time_pipeline() -> list:
    """The passes that run at gradient time, on the finished forward graph, before
    autodiff (DESIGN.md, "Data flow", step 2)."""
    return [SplitPass()]


def run_gradient_time_pipeline(graph: tf.Graph, loss: tf.Tensor) -> None:
    """Run `gradient_time_pipeline` on `graph` (whose loss is `loss`), with the split
    plans of its split TaskGraphs (devices, shard weights); called by the optimizer
    hooks (epl.hooks.optimizer) when the graph has split TaskGraphs not split yet."""
    state = graph_state(graph)
    config = get_config()
    cluster = local_cluster(config)
    _, devices = split_layout(state.taskgraphs, cluster,
                              bool(config.get("cluster.colocate_split_and_replicate")))
    plans = {}
    for taskgraph in state.taskgraphs:
        devs = devices.get(taskgraph.name)
        if devs is None:
            continue
        if taskgraph.spec.device_count > len(devs):   # the group spans every worker (even shards)
            plans[taskgraph.name] = SplitPlan(tuple(devs), None, cluster.worker_rank * len(devs),
                                              taskgraph.spec.device_count)
        else:
            weights = local_shard_weights(cluster, config, devs)
            plans[taskgraph.name] = SplitPlan(tuple(devs),
                                              None if weights is None else tuple(weights))
    ctx = PassContext(config, None, cluster, None, make_communicator(cluster, config),
                      split_loss=loss, split_plans=plans)
    instruments = [TimingInstrument()]
    if config.get("debug.dump_dir"):
        instruments.append(DumpInstrument(config.get("debug.dump_dir")))
    with graph.as_default(), internal_autodiff():
        PassManager(gradient_time_pipeline(), instruments).run(graph, ctx)
    passes = len(ctx.passes_run) + len(ctx.passes_off)
    state.dumps_written = 1 + passes if config.get("debug.dump_dir") else 0


def training_pipeline() -> list:
    """The training passes, in order (DESIGN.md, "Data flow"); each rewrite is one pass.

    auto_stages retags the graph as the user built it (before the analysis); then
    the forward is lowered (amp), the backward's checkpoints chosen (recompute),
    the model copied per (replica, micro-batch) (replicate), and the gradients
    flow one way (epl/passes/gradient_flow.py): accumulated over micro-batches,
    unscaled right after the backward, reduced (zero, gradient_comm), and at the
    end of the step an overflowed update skipped (skip_on_overflow).

    Unscale comes before zero rather than after it: ZeRO reduce-scatters the
    gradients itself, and every reduction reads unscaled gradients.
    """
    return [AutoStagesPass(), AnnotatePass(), AmpPass(), RecomputePass(), ReplicatePass(),
            AccumulatePass(), UnscalePass(), SchedulePass(), ZeroPass(), GradientCommPass(),
            ApplyGroupsPass(), SkipOnOverflowPass(), OffloadPass(), VerifyPass()]


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
    # every output of the ops that draw a step's batches from the user's iterators
    # (gradient_check feeds them to the first step: the check consumes no input)
    drawn: tuple = ()
    # debug.trace_dir: the StepTracer the session asks before each run (None: no traces).
    tracer: object = None
    # EPL's copy (op or resource name) -> (the user's op it stands for, its unit), for
    # run-time errors in the user's terms (epl.passes.replication.origins)
    origins: dict = dataclasses.field(default_factory=dict)

    def session_config(self, base=None):
        """The session config that creates this graph's devices."""
        return self.cluster.session_config(base)


def parallel_graph(graph: tf.Graph) -> ParallelGraph | None:
    """The ParallelGraph of `graph`, or None if it was not parallelized."""
    state = graph_state(graph, create=False)
    return state.result if state is not None and state.parallelized else None


def needs_parallelize(graph: tf.Graph) -> bool:
    """True if EPL annotated `graph` (scopes or an optimizer step) and has not run yet."""
    state = graph_state(graph, create=False)
    if state is None or state.parallelized:
        return False
    if state.taskgraphs or any(not step.from_gradients for step in state.train_steps):
        return True
    # only tf.gradients calls: a training step if their gradients update variables
    return bool(state.train_steps) and has_training_step(state)


@contextlib.contextmanager
def _clean_construction_context(graph: tf.Graph):
    """Build EPL's ops at the top level: no user scopes, devices or control deps."""
    saved_attrs = graph._attr_scope_map
    graph._attr_scope_map = {}
    try:
        with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
                tf.device(None), graph.colocate_with(None, ignore_existing=True):
            yield
    finally:
        graph._attr_scope_map = saved_attrs


def parallelize(graph: tf.Graph | None = None, replica_weights: list[float] | None = None) -> ParallelGraph:
    """Rewrite `graph` (default: the default graph) for parallel training, once.

    replica_weights: per-replica shares of the global batch (default: even, or
    the planner's). Returns the ParallelGraph; a second call returns the first result.
    """
    if tf.executing_eagerly() and graph is None:
        raise ParallelizeError(f"epl.parallelize() was called in eager mode. {EAGER_HINT}")
    graph = graph or tf.compat.v1.get_default_graph()
    state = graph_state(graph)
    if state.parallelized:
        return state.result
    with _cyclic_gc_paused(), internal_autodiff():   # EPL's autodiff is not a user step
        return _parallelize(graph, state, replica_weights)


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


def pass_context(graph: tf.Graph, state, passes: list,
                 replica_weights: list[float] | None = None) -> tuple[PassContext, list, list]:
    """Run the passes of `passes` that come before the analysis (the automatic stages),
    then analyse and plan `graph` (its GraphState `state`).

    Returns the PassContext the other passes run on, the instruments the config asks
    for (timing, dumps, invariant checks), and the passes left to run.
    """
    config = config_for(graph)   # the config the graph was built under (epl.env)
    cluster = local_cluster(config)
    instruments = [TimingInstrument()]
    if config.get("debug.dump_dir"):
        instruments.append(DumpInstrument(config.get("debug.dump_dir"), state.dumps_written))
    if config.get("debug.check_invariants"):
        instruments.append(InvariantInstrument())
    # what the split pass did at gradient time (kept on the graph between the two times)
    ctx = PassContext(config, None, cluster, None, make_communicator(cluster, config),
                      split_records=list(state.splits))
    first, rest = before_analysis(passes)
    PassManager(first, instruments).run(graph, ctx)   # only retags: nothing to unfinalize
    ctx.view = analyze(graph, state)
    # the runtime Plan from the hardware-aware planner's ClusterPlan of this worker's
    # devices (batch shares, each stage's device), so the dry run and the real run agree
    ctx.plan = make_local_plan(ctx.view.taskgraphs + ctx.view.split_taskgraphs, ctx.view,
                               cluster, config, replica_weights,
                               supports_uneven_shares(ctx.view, batch_mode(config)))
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
        with _clean_construction_context(graph):
            manager = PassManager(passes, instruments, after=ctx.passes_run + ctx.passes_off)
            manager.run(graph, ctx, validate=validate)
    finally:
        if finalized:
            graph.finalize()


def _parallelize(graph: tf.Graph, state, replica_weights: list[float] | None) -> ParallelGraph:
    """parallelize() once the graph is known to need it: analyse, plan, run the passes."""
    start = time.perf_counter()
    ctx, instruments, rest = pass_context(graph, state, training_pipeline(), replica_weights)
    config, cluster, plan = ctx.config, ctx.cluster, ctx.plan
    run_passes(graph, ctx, rest, instruments)
    view = ctx.view   # the amp pass hands on a view with its lowered ops
    if cluster.num_workers > 1:  # before anything runs: mismatched graphs fail here, not hang
        check_collectives_agree(graph, float(config.get("communication.collective_timeout_s")))
    replication = ctx.replication
    result = ParallelGraph(graph, plan, cluster, view, dict(replication.merged),
                           {**replication.sync_ops, **(ctx.zero.sync_ops if ctx.zero else {})},
                           dict(ctx.timings),
                           float(config.get("communication.collective_timeout_s")),
                           ctx.gradient_check)
    zero = ctx.zero
    if zero is not None:
        result.gather_ops = dict(zero.gather_ops)
    result.feeds = dict(replication.feeds)
    result.drawn = tuple(t for op in replication.draws for t in op.outputs)
    result.tracer = make_tracer(config, cluster, graph)
    result.origins = copy_origins(replication)
    state.parallelized = True
    state.result = result
    _log_summary(result, ctx, config, time.perf_counter() - start)
    return result


def _log_summary(result: ParallelGraph, ctx: PassContext, config, rewrite_s: float) -> None:
    """Log what parallelize built (epl.observability.summary) at INFO through the "epl" logger."""
    logger = logging.getLogger(__name__)
    if not logger.isEnabledFor(logging.INFO):
        return
    summary = summarize(result.graph, result.plan, result.cluster, result.view, config,
                        ctx.timings, rewrite_s, list(result.fetch_map.values()))
    logger.info("%s", "\n".join(format_summary(summary)))
