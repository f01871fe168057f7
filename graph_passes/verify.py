"""Verification: invariants every parallel graph must satisfy.

Checked after the last pass (and after every pass when debug.check_invariants
is set, which the tests do):
- every op has a TaskGraph attribute and a device;
- the graph has no cycles (data and control edges);
- exactly one reduction per trainable gradient (once the gradient pass ran);
- the train ops need none of the template ops (the original forward/backward
  ops that the replicas were copied from), so no work is done twice.
A violation raises PassError naming every offending op.
"""
from __future__ import annotations

import tensorflow as tf

from epl.errors import PassError
from epl.ir.annotations import TASKGRAPH_ATTR, Phase
from epl.ir.graph_view import ancestors
from epl.pass_manager import GraphPass, Instrument, PassContext, PassResult

MAX_LISTED = 10


def _describe(op: tf.Operation) -> str:
    shape = op.outputs[0].shape if op.outputs else "()"
    attr = op.node_def.attr.get(TASKGRAPH_ATTR)
    taskgraph = attr.s.decode() if attr is not None else "none"
    return f"{op.name} (type {op.type}, shape {shape}, TaskGraph {taskgraph}, device {op.device or 'unset'})"


def _fail(what: str, ops, fix: str) -> None:
    listed = "; ".join(_describe(op) for op in ops[:MAX_LISTED])
    more = f" and {len(ops) - MAX_LISTED} more" if len(ops) > MAX_LISTED else ""
    raise PassError(f"invariant violated: {what}: {listed}{more}. {fix}")


def check_tagged_and_placed(graph: tf.Graph) -> None:
    """Every op has a TaskGraph and a device."""
    bad = [op for op in graph.get_operations()
           if TASKGRAPH_ATTR not in op.node_def.attr or not op.device]
    if bad:
        _fail("ops without a TaskGraph or a device", bad,
              "Ops created after parallelization are not placed by EPL; build the whole "
              "model before the first session.")


def check_acyclic(graph: tf.Graph) -> None:
    """The graph (data and control edges) has no cycle."""
    ops = graph.get_operations()
    indegree = {op: len(op.inputs) + len(op.control_inputs) for op in ops}
    consumers = {op: [] for op in ops}
    for op in ops:
        for producer in [t.op for t in op.inputs] + list(op.control_inputs):
            consumers[producer].append(op)
    ready = [op for op in ops if indegree[op] == 0]
    done = 0
    while ready:
        op = ready.pop()
        done += 1
        for consumer in consumers[op]:
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                ready.append(consumer)
    if done != len(ops):
        _fail("the graph has a cycle through these ops", [op for op in ops if indegree[op] > 0],
              "A stage reads a tensor computed by a later stage; check the order of the scopes.")


def check_one_reduction_per_gradient(ctx: PassContext) -> None:
    """Each trainable gradient is reduced exactly once."""
    replication = ctx.artifacts.get("replicate")
    reduced = ctx.artifacts.get("gradient_comm")
    if replication is None or reduced is None:
        return
    missing = [var for var, _, _ in replication.gradients if var.name not in reduced]
    if missing:
        _fail("gradients without a reduction", missing, "This is an EPL bug; please report it.")


def check_no_template_work(ctx: PassContext) -> None:
    """The train ops run no template op (no forward/backward work done twice)."""
    replication = ctx.artifacts.get("replicate")
    if replication is None:
        return
    template = set(replication.replica_maps[0]) | {
        op for op in ctx.view.replica_ops if ctx.view.phase_of[op] == Phase.BACKWARD}
    needed = ancestors(ctx.view.train_ops)
    bad = sorted(template & needed, key=lambda op: op._id)
    if bad:
        _fail("the train op still needs original (template) ops", bad,
              "This is an EPL bug; please report it.")


class InvariantInstrument(Instrument):
    """Checks the structural invariants after every pass."""

    def after(self, graph_pass, graph, ctx, result, duration_s):
        if "replicate" in ctx.passes_run:  # the replicate pass places the ops
            check_tagged_and_placed(graph)
        check_acyclic(graph)


class VerifyPass(GraphPass):
    """Checks all invariants on the final graph."""

    name = "verify"
    requires = ("annotate",)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        check_tagged_and_placed(graph)
        check_acyclic(graph)
        check_one_reduction_per_gradient(ctx)
        check_no_template_work(ctx)
        return PassResult(notes=["invariants hold"])
