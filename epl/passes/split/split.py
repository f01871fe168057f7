"""Tensor and expert parallelism: the split pass (runs at gradient time).

docs/architecture.md, "Data flow", step 2: when the optimizer's compute_gradients is
called, the forward graph is finished but has no gradients yet. This pass
rewrites, for every `epl.split(k)` TaskGraph, the ops of that TaskGraph on the
path to the loss into per-device ops on the TaskGraph's k devices ("slots");
autodiff then runs on the rewritten graph, so every gradient follows its
shard. At parallelize time the replicate pass connects the split ops to the
data-parallel replicas (epl/passes/replication/replicate.py, "split TaskGraphs").

How it works: sharding propagation in creation order. Every tensor of the
region has a layout:
- full (the tensor as the single-device graph computes it; the default),
- `Sharded(parts, axis, sizes)`: slot j holds the slice j along `axis`,
- `Partial(parts)`: slot j holds a full-shaped partial sum; the value is the sum,
- `Pending(variable)`: the read of a variable created in the region, not yet
  sharded; the first op that needs it sharded decides the axis ("the axis the
  layer needs") and the variable becomes a ShardedVariable
  (epl/checkpoint/sharded_variable.py; the user's variable object becomes a view that
  reads the full value from the shards).
The region: the TaskGraph's ops on the path to the loss, and the ops built
outside every scope that follow it (their latest input TaskGraph is this one,
as graph_view resolves them: a loss or weight decay added after the split
part). Its variables: those created under the scope, and those created under
another split scope on the same devices and used only here (weights built in
a layer's build() under one epl.split and used in its call() under another,
as FastNN's MoE layer does). Reads of a sharded variable anywhere else (off
the path, or in a replicated part) read the shards concatenated.
A rule, registered per op type (`@rule("MatMul")`), maps the input layouts of
one op to per-slot ops and output layouts. An op whose inputs are all full is
left alone. An op with a sharded input and no rule (or a rule that does not
cover that combination) is not split: its sharded inputs are gathered into the
full tensor first, and the pass warns, naming the op and its type (the
"fallbacks" in the record). Where a sharded or partial tensor is read outside
the rewritten ops (the loss outside the scope, a metric) it is gathered
(concat) or summed there. Rules:
- MatMul: a column-split weight (input full, output sharded on its last axis);
  a row-split weight (input sharded on the contracted axis, output partial:
  the one collective of a column layer followed by a row layer).
- BatchMatMulV2/V3 with an [experts, m, n] weight: the weight is split along
  its expert axis (the expert count must be divisible by k), the input is
  sliced along the same experts (dispatch), the output stays sharded by
  expert and is concatenated back where it leaves the region (combine). With
  data-parallel replicas around it the replicate pass turns the dispatch and
  the combine into all-to-all exchanges.
- BiasAdd and elementwise ops on sharded tensors (biases and scales are split
  along with the tensor they are added to); sums of partial tensors; a
  Reshape that keeps the sharded last axis whole ([N, V] -> [B, S, V]).
- GatherV2/ResourceGather (embedding lookup) with a vocabulary-split table:
  each id is looked up on the shard that owns it (dynamic partition and
  stitch, so sparse gradients touch only real rows).
- SparseSoftmaxCrossEntropyWithLogits / SoftmaxCrossEntropyWithLogits over
  vocabulary-split logits: distributed max and sum of exponentials and the
  label logit from the shard that owns it; the logits are never gathered.
- Einsum (tf.einsum), by equation labels: the split label is the label a
  sharded operand is split along, or, for a variable no rule has sharded yet,
  the label it shares with another operand and the output (the expert axis:
  "egcm,emh->egch" splits e, whole experts per device, the tokens sliced to
  match: the dispatch), else its first label only it and the output have (a
  column split: "bsd,dh->bsh" splits h, "bsd,dnh->bsnh" splits the heads n).
  Operands with the label are split along it, the others read whole on every
  device; the output is sharded along the label when it keeps it and partial
  sums when the label is contracted (the expert combine "gsec,egcm->gsm", a
  row split "bsh,hd->bsd", an attention output projection "bqnh,nhd->bqd").
  An einsum of partial sums with whole operands stays partial (it is linear).
- Softmax / LogSoftmax over rows split along another axis (attention scores
  split by heads); L2Loss of a split tensor or weight (weight decay): partial
  sums of squares.

A variable created under epl.split that no rule shards (a bias added to the
summed result of a row-split layer, a weight read only by ops without a rule,
or only outside the scope) stays whole on the first device, with a
`SplitUnshardedVariableWarning` (a SplitFallbackWarning, also logged to the
"epl" logger) naming it and why (the record's `unsharded`).

Shard sizes come from the split plan (`SplitPlan`): even by default, or
capability-weighted (epl.planner.planner.local_shard_weights) when device
profiles say the devices differ. The pass records what it built on the graph's
state (`SplitRecord`): the sharded variables, the dispatch slices and combine
concats the replicate pass rewires, the replaced ops, the fallbacks and the
variables kept whole.

This module is the pass itself (SplitPass); its parts are the other modules of
epl/passes/split/ (listed in its __init__.py). Importing it registers every rule.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import SPLIT_REPLACED_ATTR, taskgraph_tag
from epl.ir.graph_view import ancestors, descendants, find_batch_inputs
from epl.ir.record import GraphRecord
from epl.passes.manager import GraphPass, PassContext, PassResult
# the rule families: importing them registers their rules
from epl.passes.split import einsum, elementwise, embedding, matmul, softmax  # noqa: F401
from epl.passes.split.layouts import SplitRecord
from epl.passes.split.region import follow_inputs, owned_captured_variables, owned_variables
from epl.passes.split.rewriter import Rewriter
from epl.planner.worker_planner import WorkerPlanner


@dataclasses.dataclass(frozen=True)
class SplitInputs:
    """The split pass's input at gradient time: the loss compute_gradients was given.

    captured: for a traced tf.function step (epl/hooks/function.py), {capture
    placeholder op: CapturedSplitVariable} of the eager variables the step reads;
    None for a graph-mode graph, whose variables are its own ops."""

    loss: tf.Tensor
    captured: dict | None = None


@dataclasses.dataclass(frozen=True)
class CapturedSplitVariable:
    """An eager variable as the split pass reads it in a traced step: the placeholder
    that captures its handle (`op`), its name, dtype, shape and device. Such a
    variable is not replaced by shards (the user's eager variable, which Keras, the
    optimizer and checkpoints hold, stays what is trained): where a rule needs it
    sharded, its value is read whole and cut onto the split devices
    (Rewriter.slice_reads), so the layer's compute, activations and gradients are
    split, and the variable's gradient is whole."""

    op: tf.Operation
    name: str
    dtype: tf.DType
    shape: tf.TensorShape
    device: str
    trainable: bool = True


@dataclasses.dataclass(frozen=True)
class SplitRecords:
    """The SplitRecord of every TaskGraph the split pass rewrote (its result at gradient
    time; the driver hands the graph's records to the training passes as an input)."""

    records: tuple


class SplitPass(GraphPass):
    """Rewrites each split TaskGraph's forward ops into per-device ops (gradient time).

    Reads the loss (SplitInputs), the graph's record (its TaskGraphs, and the split
    TaskGraphs an earlier gradient-time run rewrote) and the worker's planner (each
    split TaskGraph's devices and shard weights); provides the SplitRecords of the
    TaskGraphs it rewrote, which the caller adds to the record.
    """

    name = "split"
    requires = (SplitInputs, GraphRecord, WorkerPlanner)
    provides = (SplitRecords,)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        record_of_graph = ctx.get(GraphRecord)
        loss = ctx.get(SplitInputs).loss
        todo = record_of_graph.unsplit_taskgraphs()
        plans = ctx.get(WorkerPlanner).split_plans(todo)
        before = set(graph.get_operations())
        path = ancestors([loss.op])
        records, notes = [], []
        tagged_of = {tg.name: [] for tg in todo}
        followers = follow_inputs(path, record_of_graph.taskgraphs)
        for op in graph.get_operations():
            name = taskgraph_tag(op) or followers.get(op)
            if name in tagged_of:
                tagged_of[name].append(op)
        captured = ctx.get(SplitInputs).captured
        owned = owned_variables(graph, tagged_of, plans) if captured is None else \
            owned_captured_variables(captured, tagged_of)
        for taskgraph in todo:
            tagged = tagged_of[taskgraph.name]
            region = [op for op in tagged if op in path]
            if not region:
                continue
            variables = owned[taskgraph.name]
            record = SplitRecord(taskgraph.name, plans[taskgraph.name])
            rewriter = Rewriter(graph, taskgraph.name, record.plan, ctx.cluster.host_device, record,
                                variables, ctx.communicator, self.options.moe_chunks,
                                slice_reads=captured is not None)
            batch_derived = set()
            if rewriter.spanning:
                batch_inputs, _ = find_batch_inputs(path)
                batch_derived = descendants(batch_inputs) | {t.op for t in batch_inputs}
            with graph.name_scope(None), graph.control_dependencies(None):
                rewriter.run(region, batch_derived)
                rewriter.finish(set(region))
            # slice mode: every variable the split ops alone read (cut or kept whole, as
            # an embedding table is) is a split variable, updated once
            record.sliced = [variable_op.name for variable_op in
                             (variables if captured is not None else rewriter.sliced)]
            for variable_op, sharded in ({} if captured is not None else rewriter.sharded).items():
                graph_mutation.set_attr(variable_op, SPLIT_REPLACED_ATTR,
                                        tf.compat.v1.AttrValue(b=True))
            records.append(record)
            notes.append(f"{taskgraph.name}: {len(record.variables)} variable(s) sharded over "
                         f"{len(record.plan.devices)} devices "
                         f"({', '.join(f'{n} axis {v.axis} sizes {list(v.sizes)}' for n, v in record.variables.items())})"
                         + (f"; unsplit fallbacks: {', '.join(record.fallbacks)}"
                            if record.fallbacks else "")
                         + (f"; kept whole: {'; '.join(record.unsharded)}"
                            if record.unsharded else ""))
        ctx.provide(SplitRecords(tuple(records)))
        added = [op.name for op in graph.get_operations() if op not in before]
        replaced = sorted(op.name for record in records for op in record.replaced)
        if replaced:  # they stay in the graph (TensorFlow cannot delete ops) and never run
            notes.append(f"replaced, never run: {', '.join(replaced)}")
        return PassResult(added=added, notes=notes)
