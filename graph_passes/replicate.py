"""Replication (data parallelism) and micro-batching among the devices of one worker.

Given the plan's R replicas and M = `pipeline.num_micro_batch` micro-batches,
the unit of copying is a (replica r, micro-batch m) pair. The pass
- slices every batch input along its first dimension into R parts, with the
  plan's per-replica shares (static split when the batch size is known,
  run-time boundaries round(B * cumulative share) otherwise), and each
  replica's part further into M equal micro-batches (one split into R x M
  pieces; M must divide every replica's part, checked before any rewrite);
- copies the forward and backward ops once per (replica, micro-batch), onto
  the replica's devices (TaskGraph t of replica r on the plan's device for t
  in r: with several TaskGraphs these are the pipeline stages), each copy
  reading its slice and tagged with `_epl_replica` = r and, when M > 1,
  `_epl_micro_batch` = m; a constant that TensorFlow folded
  from tf.shape of a static-shaped batch tensor (it holds the global batch
  size) becomes, in each copy, a Shape op of the replica's own tensor;
- mirrors every variable those ops read: replica 0 uses the original variable,
  replica k > 0 a copy on its device; one `sync` op copies the originals into
  the mirrors (the session runs it after initialization or restore), so the
  replicas start identical and stay identical (same reduced gradients, same
  update);
- accumulates, per replica, the M micro-batch gradients of every variable
  into one gradient: (1/M) x their sum, in micro-batch order (each micro-batch
  is 1/M of the replica's part, so this is the gradient of the mean loss over
  the replica's whole part); with M = 1 the replica's gradient is used as is;
- keeps the original apply ops (the optimizer update) as replica 0's update and
  copies them for replicas k > 0; the user's train op also runs their updates
  (once per step, whatever M is);
- merges each loss into the mean over the global batch (sum over every
  (replica, micro-batch) copy of its share of the global batch x its loss),
  which is what fetching the loss returns; a summary op that read the loss
  reads the merged value instead.

Copies (forward, backward, apply, variable mirrors, sync ops) are written as
NodeDefs and added to the graph with one graph import per batch
(epl.ir.clone.NodeBatch explains how), which is several times cheaper than
creating them op by op. The backward ops of every unit are copies of the
user's own backward ops (the ones compute_gradients built for the whole batch,
recorded at gradient time), with the constants TensorFlow folded from the
global batch's static shapes rewritten for the unit's slice
(epl/ir/backward_copy.py says how they are found, from colocation and static
shapes). Where that cannot be done with certainty (a constant that may or may
not be batch-derived, a slice of one row, AMP or gradient checkpointing, which
change the forward after the user's autodiff), the first unit of each slice
shape runs tf.gradients on its forward copy and the others copy its ops; the
pass's notes say which path each unit took and why.

The order in which the micro-batch copies run (the pipeline schedule) is the
"schedule" pass's job (graph_passes/schedule.py); this pass only copies.

Why replica 0 is a copy too: the original forward ops were shape-inferred for
the whole batch, and TensorFlow refuses to feed them a slice with a different
static shape. So the original forward and backward ops stay in the graph as
the template (never run: nothing the train op needs reads them), while the
variables and the update ops stay the originals. This departs from DESIGN.md's
"original ops remain replica 0" only for the forward/backward ops.

Split TaskGraphs (`epl.split`, rewritten at gradient time by
graph_passes/split.py) are not copied: their ops run once, over the global
batch, on their own devices. `_run_with_split` connects them to the replicas
(epl/ir/split_boundary.py: all-gather or all-to-all into the split ops, each
replica's rows out of them) and then runs ONE autodiff over the whole step: of
sum_k share_k x loss_k when the loss is replicated, or of the loss itself when
a split op computes it over the global batch. Every replica's gradient is then
already weighted by its share, so the gradient pass sums them
(`Replication.presummed`); the shards' gradients are complete and are not
reduced, and their updates run once. Gradient checkpointing applies to that
one autodiff (every replica's copy of each chosen checkpoint is kept).

Artifacts for the next passes (ctx.artifacts["replicate"]): the per-replica
(accumulated) copy of every gradient and each replica's weight, and, for the
schedule pass, the forward copies and backward ops of every (replica,
micro-batch).
"""
from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from epl.errors import ParallelizeError
from epl.ir.annotations import (MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR,
                                Phase)
from epl.ir.graph_view import VARIABLE_OP_TYPES, colocation_root, descendants
from epl.ir import recompute
from epl.ir.backward_copy import TemplateBackward
from epl.ir.clone import (NodeBatch, OpCopier, clone_ops, copy_node_def, replace_control_inputs,
                          replace_input)
from epl.graph_keys import merge_requests
from epl.pass_manager import GraphPass, PassContext, PassResult

REPLICA_PREFIX = "EPL_REPLICA_{}"
MICRO_BATCH_PREFIX = "EPL_MICRO_BATCH_{}"
# Summary ops that read a merged tensor (the loss) read the merged value instead.
SUMMARY_TYPES = frozenset({"ScalarSummary", "HistogramSummary", "WriteScalarSummary",
                           "WriteHistogramSummary", "TensorSummary", "TensorSummaryV2",
                           "WriteSummary"})


@dataclasses.dataclass
class Replication:
    """What the replicate pass built, for the passes after it.

    gradients: per trainable gradient, (variable op, [gradient per replica], the
      original gradient); with micro-batches, each replica's gradient is the
      accumulation over its micro-batches.
    weights: per replica, its share of the global batch (float or scalar tensor).
    merged: original tensor -> merged tensor (what a fetch of it returns).
    sync_ops: original variable op -> op copying it into its mirrors (the session runs
      it after a run that wrote the original: initialization, restore, assign).
    mirrors: original variable op -> [variable op per replica].
    replica_maps: per replica, template op -> its copy for micro-batch 0 (forward),
      plus the replica's apply copies (replicas > 0).
    num_micro_batches: M.
    forward_copies: (replica, micro-batch) -> {template forward op: its copy}.
    backward_ops: (replica, micro-batch) -> the backward ops regenerated for that copy,
      and the accumulation ops that add its gradients.
    loss_copies: (replica, micro-batch) -> the copies of the losses.
    presummed: each replica's gradient is already weighted by its batch share
      (split TaskGraphs: one autodiff of the weighted objective), so the
      reduction is a plain sum.
    """

    gradients: list
    weights: list
    merged: dict
    sync_ops: dict
    mirrors: dict
    replica_maps: list
    num_micro_batches: int = 1
    forward_copies: dict = dataclasses.field(default_factory=dict)
    backward_ops: dict = dataclasses.field(default_factory=dict)
    loss_copies: dict = dataclasses.field(default_factory=dict)
    presummed: bool = False
    # split TaskGraphs: (variable op, its one gradient) of every split variable
    # (not reduced over replicas; summed over workers when there are several)
    split_gradients: list = dataclasses.field(default_factory=list)


def _select_checkpoints(view, config) -> dict:
    """Per recorded step (by id), the template tensors gradient checkpointing keeps.

    gradient_checkpoint.type "collection": the tensors of the "checkpoints"
    collection (an empty collection, or a tensor off the path from the
    variables to the loss, is an error); "auto": bottleneck tensors chosen by
    epl.ir.recompute, limited to the first TaskGraphs up to
    gradient_checkpoint.end_taskgraph when that is set. Empty when off.
    """
    kind = config.get("gradient_checkpoint.type")
    if not kind:
        return {}
    end = int(config.get("gradient_checkpoint.end_taskgraph"))
    selected = {}
    for step in view.steps:
        xs = [v.op.outputs[0] for g, v in step.grads_and_vars if g is not None]
        if kind == "collection":
            selected[id(step)] = recompute.select_checkpoints_collection(view.graph, step.loss, xs)
        else:
            keep = None if end < 0 else (
                lambda op: op in view.taskgraph_of and view.taskgraph_of[op].index <= end)
            selected[id(step)] = recompute.select_checkpoints_auto(step.loss, xs, candidate_filter=keep)
    return selected


def _slice_shapes(slices: dict, index: int) -> tuple:
    """The static shapes of unit `index`'s slices (None where unknown): units with
    equal shapes can share one autodiff."""
    return tuple(tuple(parts[index].shape.as_list()) if parts[index].shape.rank is not None
                 else None for parts in slices.values())


def _unit_inputs(slices: dict, mirrors: dict, k: int, index: int) -> dict:
    """What a copy for replica k reads instead of the template's inputs: slice
    `index` of each batch input and replica k's copy of each variable."""
    input_map = {t: parts[index] for t, parts in slices.items()}
    input_map.update({var.outputs[0]: copies[k].outputs[0] for var, copies in mirrors.items()})
    return input_map


def _replica_attr(k: int, micro_batch: int | None = None) -> dict:
    attrs = {REPLICA_ATTR: tf.compat.v1.AttrValue(i=k)}
    if micro_batch is not None:
        attrs[MICRO_BATCH_ATTR] = tf.compat.v1.AttrValue(i=micro_batch)
    return attrs


def num_micro_batches(config) -> int:
    """`pipeline.num_micro_batch` (at least 1)."""
    return max(1, int(config.get("pipeline.num_micro_batch")))


class ReplicatePass(GraphPass):
    """Copies the model once per (replica, micro-batch) and slices the global batch."""

    name = "replicate"
    requires = ("annotate",)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        self._check_split_supported(ctx.view, ctx)
        self._check_batch(ctx.view, ctx.plan, num_micro_batches(ctx.config))
        # raises for an empty or off-path collection; run() reuses the selection
        ctx.artifacts["checkpoints"] = _select_checkpoints(ctx.view, ctx.config)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        if ctx.view.split_ops:
            return self._run_with_split(graph, ctx)
        view, plan = ctx.view, ctx.plan
        micro = num_micro_batches(ctx.config)
        checkpoints = ctx.artifacts.get("checkpoints") or _select_checkpoints(view, ctx.config)
        before = set(graph.get_operations())
        forward, apply_ops, devices, shape_consts, slices, weights, mirrors = \
            self._prepare(graph, ctx, micro)
        replica_maps, gradients = [], []
        backward_ops, loss_copies = {}, {}
        built_by_shape: dict = {}  # slice shapes -> (unit, its gradients, its backward ops)
        all_units = [(k, m) for k in range(plan.num_replicas) for m in range(micro)]
        forward_copies = self._copy_forwards(view, plan, all_units, micro, forward, slices,
                                             mirrors, shape_consts)
        copied, autodiff_reasons = self._copy_templates(view, plan, ctx, checkpoints, all_units,
                                                        micro, forward_copies, slices, mirrors)
        for k in range(plan.num_replicas):
            per_micro = []
            for m in range(micro):
                unit = (k, m)
                forward_map = forward_copies[unit]
                first = len(graph.get_operations())
                key = _slice_shapes(slices, k * micro + m)
                if unit in copied:  # the user's backward ops, copied (cheap)
                    per_micro.append(copied[unit][0])
                elif key in built_by_shape:  # same shapes: copy that unit's backward (cheap)
                    source, source_grads, source_ops = built_by_shape[key]
                    per_micro.append(self._copy_backward(
                        view, plan, source, unit, micro, source_grads, source_ops,
                        forward_copies[source], forward_map, slices, mirrors))
                else:  # first unit of these shapes: autodiff of its loss copy
                    per_micro.append(self._regenerate_gradients(view, plan, unit, micro,
                                                                forward_map, mirrors, checkpoints))
                    built_by_shape[key] = (unit, per_micro[-1], graph.get_operations()[first:])
                backward_ops[unit] = copied[unit][1] if unit in copied \
                    else graph.get_operations()[first:]
                if checkpoints and unit == (0, 0) and \
                        ctx.config.get("gradient_checkpoint.check_gradients"):
                    # gradients without checkpointing, never run by the train op: the
                    # session compares them with the checkpointed ones before step 1
                    ctx.artifacts["gradient_check"] = (self._regenerate_gradients(
                        view, plan, unit, micro, forward_map, mirrors), per_micro[-1])
                loss_copies[unit] = [forward_map[t.op].outputs[t.value_index]
                                     for t in view.losses if t.op in forward_map]
            accumulated, accumulate_ops = _accumulate(per_micro, k)
            gradients.append(accumulated)
            for m, ops in accumulate_ops.items():
                backward_ops[(k, m)] = backward_ops[(k, m)] + ops
            replica_maps.append(dict(forward_copies[(k, 0)]))
        # the update copies of replicas k > 0 (made before the originals are rewired) and,
        # with one worker, the sync ops: one import
        batch = NodeBatch(graph)
        copiers = {k: self._copy_apply(view, plan, k, apply_ops, slices, mirrors, replica_maps[k],
                                       gradients[k], micro, batch)
                   for k in range(1, plan.num_replicas)}
        local_sync = _write_local_sync(mirrors, batch) if ctx.communicator.cross is None else None
        created = batch.commit()
        for k, copier in copiers.items():
            replica_maps[k].update(copier.result(created))
        self._rewire_replica0_apply(apply_ops, replica_maps[0], _gradient_map(view, gradients[0]))
        self._chain_train_ops(view, replica_maps)
        units = [forward_copies[(k, m)] for k in range(plan.num_replicas) for m in range(micro)]
        unit_weights = [w if micro == 1 else w * (1.0 / micro) for w in weights for _ in range(micro)]
        merged = self._merge_fetches(graph, view, units, unit_weights, devices, ctx.communicator)
        sync_ops = self._sync_ops(mirrors, ctx.communicator) if local_sync is None else \
            {var: created[name] for var, name in local_sync.items()}
        per_gradient = [(var, [gradients[k][i] for k in range(plan.num_replicas)], grad)
                        for i, (grad, var) in enumerate(view.gradients)]
        ctx.artifacts[self.name] = Replication(per_gradient, weights, merged, sync_ops, mirrors,
                                               replica_maps, micro, forward_copies, backward_ops,
                                               loss_copies)
        added = [op.name for op in graph.get_operations() if op not in before]
        op_map = {op.name: [forward_copies[u][op].name for u in sorted(forward_copies)
                            if op in forward_copies[u]]
                  + [m[op].name for m in replica_maps[1:] if op in m and op not in replica_maps[0]]
                  for op in view.replica_ops}
        notes = [f"{plan.num_replicas} replicas, shares {list(plan.replica_weights)}"]
        rebuilt = len(built_by_shape)
        notes.append(f"backward ops: copied from the template for "
                     f"{len(copied)} unit(s), autodiff for {rebuilt}"
                     + (f" ({'; '.join(autodiff_reasons)})" if rebuilt else ""))
        if micro > 1:
            notes.append(f"{micro} micro-batches per replica, gradients accumulated")
        return PassResult(added=added, op_map=op_map, notes=notes)

    def _prepare(self, graph, ctx, micro: int):
        """What both paths start from: (forward ops, apply ops, op -> replica 0's
        device, folded shape constants, batch slices, batch shares, mirrors),
        with the originals placed and the variables mirrored."""
        view, plan = ctx.view, ctx.plan
        sizes = self._check_batch(view, plan, micro)
        shape_consts = self._shape_constants(view)
        forward = [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]
        apply_ops = [op for op in view.replica_ops if view.phase_of[op] == Phase.APPLY]
        devices = {op: plan.device(view.taskgraph_of[op], 0) for op in view.replica_ops}
        self._place(graph, view, plan)
        slices, weights = self._slice_batch(view, plan, sizes, ctx.cluster.host_device, micro)
        weights = self._global_weights(view, weights, ctx.communicator, ctx.cluster.host_device)
        mirrors = self._mirror_variables(view, plan)
        return forward, apply_ops, devices, shape_consts, slices, weights, mirrors

    # -- split TaskGraphs -------------------------------------------------------
    @staticmethod
    def _check_split_supported(view, ctx) -> None:
        """What the split path does not combine with yet, each with what to do instead."""
        if not view.split_ops:
            return
        names = ", ".join(tg.spec.describe() for tg in view.split_taskgraphs)
        problems = []
        if num_micro_batches(ctx.config) > 1:
            problems.append("pipeline.num_micro_batch > 1 (micro-batches)")
        if ctx.config.get("communication.gradients_reduce_method") == "sum":
            problems.append('communication.gradients_reduce_method "sum"')
        if len(view.steps) != 1:
            problems.append(f"{len(view.steps)} optimizer steps (one is supported)")
        grad_loss = [step.gradient_kwargs.get("grad_loss") for step in view.steps]
        if any(g is not None and tf.convert_to_tensor(g).shape.rank != 0 for g in grad_loss):
            problems.append("compute_gradients(grad_loss=...) with a non-scalar grad_loss")
        if problems:
            raise ParallelizeError(
                f"split TaskGraph(s) {names} cannot be combined with: {'; '.join(problems)}. "
                "Turn these off for models with epl.split, or replicate the split part instead.")

    def _run_with_split(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        """Replicas around split TaskGraphs: copy, connect, one global autodiff."""
        from epl.ir.split_boundary import SplitBoundary
        from epl.ir.taskgraph import graph_state
        view, plan = ctx.view, ctx.plan
        self._check_split_supported(view, ctx)
        before = set(graph.get_operations())
        forward, apply_ops, devices, shape_consts, slices, weights, mirrors = \
            self._prepare(graph, ctx, 1)
        first_stage = view.taskgraphs[0]
        records = graph_state(graph).splits
        spanning = {r.taskgraph for r in records if r.spans_workers}  # groups over every worker
        boundary = SplitBoundary(view, plan, weights, records,
                                 lambda k: plan.device(first_stage, k))
        inputs = dict(slices)
        outputs = boundary.outputs_to_replicas(forward)
        _refuse_spanning_outputs(view, outputs, spanning)
        inputs.update(outputs)
        forward_copies = self._copy_forwards(view, plan, [(k, 0) for k in range(plan.num_replicas)],
                                             1, forward, inputs, mirrors, shape_consts)
        bypassed = boundary.connect_inputs({k: forward_copies[(k, 0)]
                                            for k in range(plan.num_replicas)})
        step = view.steps[0]
        checkpoints = ctx.artifacts.get("checkpoints") or _select_checkpoints(view, ctx.config)
        kept = _checkpoint_copies(checkpoints.get(id(step), []), forward_copies,
                                  plan.num_replicas)
        # a loss computed by a split group over every worker is already the global mean
        multi_worker = ctx.communicator.num_workers > 1 and \
            view.taskgraph_of[step.loss.op].name not in spanning
        gradients, backward = self._global_gradients(view, plan, step, forward_copies, weights,
                                                     mirrors, multi_worker, kept)
        if kept and ctx.config.get("gradient_checkpoint.check_gradients"):
            # gradients without checkpointing (never run by the train op): the session
            # compares them with the checkpointed ones before the first step
            plain, _ = self._global_gradients(view, plan, step, forward_copies, weights,
                                              mirrors, multi_worker)
            ctx.artifacts["gradient_check"] = (plain[0], gradients[0])
        replica_maps = [dict(forward_copies[(k, 0)]) for k in range(plan.num_replicas)]
        batch = NodeBatch(graph)
        copiers = {k: self._copy_apply(view, plan, k, apply_ops, slices, mirrors, replica_maps[k],
                                       gradients[k], 1, batch)
                   for k in range(1, plan.num_replicas)}
        created = batch.commit()
        for k, copier in copiers.items():
            replica_maps[k].update(copier.result(created))
        gradient_map = _gradient_map(view, gradients[0])
        split_vars = set(view.split_variables)
        for (orig, var), new in zip(view.gradients, gradients[0]):
            if var in split_vars and isinstance(orig, tf.IndexedSlices):
                gradient_map[orig.values] = new.values
                gradient_map[orig.indices] = new.indices
        self._rewire_replica0_apply(apply_ops + view.split_apply_ops, replica_maps[0], gradient_map)
        self._chain_train_ops(view, replica_maps)
        units = [forward_copies[(k, 0)] for k in range(plan.num_replicas)]
        merged = self._merge_fetches(graph, view, units, weights, devices, ctx.communicator)
        cross = ctx.communicator.cross
        local_split = [v for v in view.split_variables
                       if view.taskgraph_of[v].name not in spanning]
        if cross is not None:  # split groups within a worker are data-parallel across workers
            self._reduce_split_gradients_over_workers(view, gradients[0], cross, set(local_split))
            merged.update(_merge_split_losses(view, units, weights, cross, spanning))
        # every worker holds the same shards of a group within a worker: broadcast them;
        # a group over every worker holds different shards on each
        sync_ops = self._sync_ops({**mirrors, **{v: [v] for v in local_split}}, ctx.communicator)
        per_gradient = [(var, [gradients[k][i] for k in range(plan.num_replicas)], grad)
                        for i, (grad, var) in enumerate(view.gradients) if var not in split_vars]
        loss_copies = {(k, 0): [forward_copies[(k, 0)][t.op].outputs[t.value_index]
                                for t in view.losses if t.op in forward_copies[(k, 0)]]
                       for k in range(plan.num_replicas)}
        split_gradients = [(var, grad) for (_, var), grad in zip(view.gradients, gradients[0])
                           if var in split_vars and grad is not None]
        ctx.artifacts[self.name] = Replication(per_gradient, weights, merged, sync_ops, mirrors,
                                               replica_maps, 1, forward_copies,
                                               {(0, 0): backward}, loss_copies, presummed=True,
                                               split_gradients=split_gradients)
        added = [op.name for op in graph.get_operations() if op not in before]
        op_map = {op.name: [forward_copies[u][op].name for u in sorted(forward_copies)]
                  for op in forward}
        notes = [f"{plan.num_replicas} replicas, shares {list(plan.replica_weights)}",
                 f"split TaskGraphs {[tg.name for tg in view.split_taskgraphs]} run once on "
                 f"{dict(plan.split_devices)}; {len(view.split_variables)} split variables; "
                 f"{len(bypassed)} dispatch slices became all-to-all exchanges"]
        return PassResult(added=added, op_map=op_map, notes=notes)

    @staticmethod
    def _reduce_split_gradients_over_workers(view, gradients, cross, split_vars: set) -> None:
        """Every worker holds all shards of a split group within a worker: sum
        each shard's gradient (of `split_vars`) over the workers (it is already
        weighted by the worker's batch share) and make its update read the sum;
        sparse gradients are gathered."""
        with tf.name_scope("EPL_SPLIT_WORKERS"):
            for (_, var), grad in zip(view.gradients, gradients):
                if var not in split_vars or grad is None:
                    continue
                readers = view.split_apply_ops
                if isinstance(grad, tf.IndexedSlices):
                    with tf.device(grad.values.device):
                        pairs = ((grad.values, cross.all_gather(grad.values)),
                                 (grad.indices, cross.all_gather(grad.indices)))
                else:
                    with tf.device(grad.device):
                        pairs = ((grad, cross.all_reduce(grad, "sum")),)
                for old, new in pairs:
                    for op in readers:
                        replace_input(op, old, new)

    @staticmethod
    def _global_gradients(view, plan, step, forward_copies, weights, mirrors,
                          multi_worker: bool = False, checkpoints: list | None = None):
        """One autodiff of the weighted objective over every replica and split op.

        checkpoints: forward tensors gradient checkpointing keeps (every
        replica's copies of the chosen template tensors); None or empty: plain
        autodiff. Returns ([per replica: gradients aligned with
        view.gradients], backward ops).
        """
        graph = view.graph
        loss = step.loss
        if loss.op in forward_copies[(0, 0)]:
            copies = [forward_copies[(k, 0)][loss.op].outputs[loss.value_index]
                      for k in range(plan.num_replicas)]
            with tf.name_scope("EPL_OBJECTIVE"):
                objective = tf.add_n([tf.cast(w, c.dtype) * c for w, c in zip(weights, copies)])
        elif multi_worker:  # computed by split ops over this worker's whole batch
            objective = tf.add_n([tf.cast(w, loss.dtype) for w in weights]) * loss
        else:  # computed by split ops over the global batch
            objective = loss
        pairs = [(g, v) for g, v in step.grads_and_vars if g is not None]
        targets, index = [], {}
        for _, var in pairs:
            if var.op in mirrors:
                for k, copy in enumerate(mirrors[var.op]):
                    index[(var.op, k)] = len(targets)
                    targets.append(copy.outputs[0])
            else:
                index[(var.op, None)] = len(targets)
                targets.append(var.op.outputs[0])
        kwargs = step.gradient_kwargs
        gate = kwargs.get("gate_gradients", tf.compat.v1.train.Optimizer.GATE_OP)
        first = len(graph.get_operations())
        gradient_fn = tf.compat.v1.gradients
        if checkpoints:
            gradient_fn = functools.partial(recompute.checkpointed_gradients,
                                            checkpoints=checkpoints)
        grads = gradient_fn(
            objective, targets, grad_ys=kwargs.get("grad_loss"),   # a scalar (AMP's loss scale)
            gate_gradients=gate == tf.compat.v1.train.Optimizer.GATE_OP,
            aggregation_method=kwargs.get("aggregation_method"), colocate_gradients_with_ops=True)
        if gate == tf.compat.v1.train.Optimizer.GATE_GRAPH:
            grads = tf.tuple(grads)
        if kwargs.get("sparse_as_dense"):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        backward = graph.get_operations()[first:]
        _tag_global_backward(backward, plan.device(view.taskgraphs[0], 0))
        per_replica = []
        for k in range(plan.num_replicas):
            row = []
            for _, var in view.gradients:
                position = index.get((var, k), index.get((var, None)))
                row.append(grads[position] if position is not None else None)
            per_replica.append(row)
        return per_replica, backward

    # -- analysis -----------------------------------------------------------
    @staticmethod
    def _check_batch(view, plan, micro: int = 1) -> list[int] | None:
        """Per-replica batch sizes (None for a dynamic batch); raise on a bad split.

        Every replica's part must split into `micro` equal micro-batches.
        """
        batch = view.global_batch_size
        if batch is None:
            return None
        if plan.even and batch % plan.num_replicas:
            raise ParallelizeError(
                f"the global batch of {batch} examples cannot be split evenly over "
                f"{plan.num_replicas} replicas (inputs: {', '.join(t.name for t in view.batch_inputs)}). "
                f"Use a global batch size divisible by {plan.num_replicas}.")
        sizes = plan.batch_sizes(batch)
        if min(sizes) < 1:
            raise ParallelizeError(
                f"the global batch of {batch} examples leaves a replica with no examples "
                f"(per-replica sizes {sizes}). Use a global batch of at least "
                f"{plan.num_replicas} examples.")
        if any(size % micro for size in sizes):
            replicas = plan.num_replicas
            raise ParallelizeError(
                f"pipeline.num_micro_batch={micro} does not divide the batch: the per-replica "
                f"batch sizes {sizes} (global batch {batch} over {replicas} replica(s); inputs: "
                f"{', '.join(t.name for t in view.batch_inputs)}) cannot each be cut into {micro} "
                f"equal micro-batches. Use a global batch size divisible by {replicas * micro} "
                f"({replicas} replica(s) x {micro} micro-batches), or a pipeline.num_micro_batch "
                f"that divides every replica's batch.")
        return sizes

    @staticmethod
    def _shape_constants(view) -> dict:
        """Forward constants holding the static shape of a batch-sized tensor -> that tensor.

        TensorFlow folds tf.shape(t) into a Const when t's shape is fully
        defined (library code does this too: softmax_cross_entropy_with_logits
        reshapes its result to such a folded shape), which bakes the global
        batch size into the graph. Each replica must use the shape of its own
        slice instead. A constant matches t when it is an integer vector equal
        to t's static shape, t's first dimension is the global batch and t is a
        batch input or a forward op computed from one; t is the latest such
        tensor created before the constant (tf.shape folds an existing tensor).
        Read from values and shapes, never from names.
        """
        batch = view.global_batch_size
        if batch is None:
            return {}
        forward = {op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD}
        derived = descendants(view.batch_inputs, within=forward)
        latest: dict = {}
        for tensor in view.batch_inputs:
            if tensor.shape.is_fully_defined():
                latest.setdefault(tuple(tensor.shape.as_list()), tensor)
        found = {}
        for op in view.graph.get_operations():  # creation order
            if op in forward and op.type == "Const" and op.outputs[0].dtype in (tf.int32, tf.int64) \
                    and op.outputs[0].shape.rank == 1:
                value = tuple(int(v) for v in tf.make_ndarray(op.get_attr("value")).reshape(-1))
                if value and value[0] == batch and value in latest:
                    found[op] = latest[value]
            if op in derived:
                for tensor in op.outputs:
                    shape = tensor.shape
                    if shape.rank and shape.is_fully_defined() and shape[0] == batch:
                        latest[tuple(shape.as_list())] = tensor
        return found

    # -- rewrite ------------------------------------------------------------
    @staticmethod
    def _place(graph, view, plan) -> None:
        """Originals on replica 0's devices; everything else where it belongs."""
        replica = set(view.replica_ops) | set(view.variables)
        split = {tg.name for tg in view.split_taskgraphs}  # split ops keep their devices
        mirrored = set(view.variables)
        for op in graph.get_operations():
            taskgraph = view.taskgraph_of.get(op)
            if taskgraph is not None and taskgraph.name in split and op not in mirrored:
                continue
            if op in replica or (op in view.taskgraph_of and op.type in ("VarHandleOp", "VariableV2")):
                op._set_device(plan.device(view.taskgraph_of[op], 0))
        for op in view.replica_ops:  # a variable read by a later stage is read where it lives
            var = _variable_read(op)
            if var is not None:
                op._set_device(var.device)
        for op in graph.get_operations():
            if op not in replica and not op.device:
                root = colocation_root(op)
                op._set_device(root.device if root is not None and root.device else "/device:CPU:0")

    @staticmethod
    def _slice_batch(view, plan, sizes, host, micro: int = 1):
        """Return ({batch tensor: [slice per unit]}, [weight per replica]).

        A unit is a (replica k, micro-batch m) pair, at index k * micro + m:
        replica k's part of the batch cut into `micro` equal consecutive slices.
        """
        replicas = plan.num_replicas
        units = replicas * micro
        slices = {}
        with tf.device(host), tf.name_scope("EPL_BATCH_SLICES"):
            if sizes is not None:
                weights = [s / view.global_batch_size for s in sizes]
                unit_sizes = [s // micro for s in sizes for _ in range(micro)]
                for tensor in view.batch_inputs:
                    slices[tensor] = tf.split(tensor, unit_sizes, axis=0) if units > 1 else [tensor]
                return slices, weights
            first = view.batch_inputs[0]
            batch = tf.shape(first, out_type=tf.int64)[0]
            if plan.even:
                what = (f"{replicas} replicas" if micro == 1
                        else f"{replicas} replicas x {micro} micro-batches")
                check = tf.debugging.Assert(
                    tf.equal(batch % units, 0),
                    [f"EPL: the global batch cannot be split evenly over {what}; "
                     "batch size:", batch])
                with tf.control_dependencies([check]):
                    unit_bounds = [batch * u // units for u in range(units + 1)]
                bounds = unit_bounds[::micro]
            else:
                cumulative = [sum(plan.replica_weights[:k]) for k in range(replicas + 1)]
                bounds = [tf.cast(tf.round(tf.cast(batch, tf.float64) * c), tf.int64)
                          for c in cumulative[:-1]] + [batch]
                unit_bounds = _micro_bounds(bounds, micro)
            weights = [tf.cast(bounds[k + 1] - bounds[k], tf.float32) / tf.cast(batch, tf.float32)
                       for k in range(replicas)]
            for tensor in view.batch_inputs:
                slices[tensor] = [tensor[unit_bounds[u]:unit_bounds[u + 1]] for u in range(units)]
        return slices, weights

    @staticmethod
    def _global_weights(view, weights, communicator, host) -> list:
        """Shares of the global batch when several workers each slice their own batch.

        The global batch is the concatenation of the workers' batches, which may
        differ in size: each replica's share is its rows over the sum of every
        worker's rows (one scalar all-reduce per step).
        """
        if communicator.num_workers == 1:
            return weights
        with tf.device(host), tf.name_scope("EPL_BATCH_SLICES"):
            local = tf.cast(tf.shape(view.batch_inputs[0])[0], tf.float32)
            share = local / communicator.sum_over_workers(local)
            return [tf.cast(w, tf.float32) * share for w in weights]

    @staticmethod
    def _mirror_variables(view, plan) -> dict:
        """original variable op -> [variable op per replica] (index 0: the original).

        The mirrors are added to the graph in one batch (epl.ir.clone.NodeBatch).
        """
        batch = NodeBatch(view.graph)
        names = {}
        for var in view.variables:
            for k in range(1, plan.num_replicas):
                attrs = _replica_attr(k)
                shared = var.get_attr("shared_name").decode() or var.name
                attrs["shared_name"] = tf.compat.v1.AttrValue(s=f"{REPLICA_PREFIX.format(k)}/{shared}".encode())
                name = batch.new_name(f"{REPLICA_PREFIX.format(k)}/{var.name}")
                names[(var, k)] = batch.add(copy_node_def(
                    var, name, plan.device(view.taskgraph_of[var], k), attrs))
        created = batch.commit()
        return {var: [var] + [created[names[(var, k)]] for k in range(1, plan.num_replicas)]
                for var in view.variables}

    @staticmethod
    def _copy_forwards(view, plan, units, micro, forward, slices, mirrors, shape_consts) -> dict:
        """Copy the forward ops for each unit (replica k, micro-batch m), reading its
        slice and replica k's variables, onto replica k's devices; one import for
        all units. Returns {unit: {template op: its copy}}.

        A constant in `shape_consts` (a folded static shape of a batch-sized
        tensor) becomes a Shape op of the unit's copy of that tensor. Copies are
        named `EPL_REPLICA_<k>/` (plus `EPL_MICRO_BATCH_<m>/` when M > 1).
        """
        batch, sources, copiers = NodeBatch(view.graph), {}, {}
        for unit in units:
            k, m = unit
            input_map = _unit_inputs(slices, mirrors, k, k * micro + m)
            attrs = _replica_attr(k, m if micro > 1 else None)

            def device_fn(op, k=k):
                var = _variable_read(op)
                if var is not None and var in mirrors:  # read where the variable lives
                    return mirrors[var][k].device
                return plan.device(view.taskgraph_of[op], k)

            copier = copiers[unit] = OpCopier(view.graph, _prefix(k, m, micro), device_fn,
                                              input_map, attrs, cache=sources, batch=batch)
            for op in forward:
                if op in shape_consts:
                    source = shape_consts[op]
                    copier.substitute(op, _shape_node(op, copier.input(source), source.dtype,
                                                      copier.new_name(op), device_fn(op), attrs))
                else:
                    copier.copy(op)
            copier.close()
        created = batch.commit()
        return {unit: copier.result(created) for unit, copier in copiers.items()}

    @staticmethod
    def _regenerate_gradients(view, plan, unit, micro, forward_map, mirrors,
                              checkpoints: dict | None = None) -> list:
        """Autodiff of a unit's loss copy, as compute_gradients did for the original.

        The original backward ops were built for the whole batch (gradient
        functions fold static shapes into constants), so each (replica,
        micro-batch) gets its own backward ops, colocated with its forward copies
        (so on the stage devices of their forward ops).
        """
        k, m = unit
        grads_out = []
        graph = view.graph
        for step in view.steps:
            pairs = [(g, v) for g, v in step.grads_and_vars if g is not None]
            if not pairs:
                continue
            loss = forward_map[step.loss.op].outputs[step.loss.value_index]
            targets = [mirrors[v.op][k].outputs[0] if v.op in mirrors else v.op.outputs[0]
                       for _, v in pairs]
            first = len(graph.get_operations())
            kwargs = step.gradient_kwargs
            gate = kwargs.get("gate_gradients", tf.compat.v1.train.Optimizer.GATE_OP)
            gradient_fn = tf.compat.v1.gradients
            if checkpoints:  # gradient checkpointing: keep only these, recompute the rest
                kept = [forward_map[t.op].outputs[t.value_index]
                        for t in checkpoints.get(id(step), []) if t.op in forward_map]
                gradient_fn = functools.partial(recompute.checkpointed_gradients, checkpoints=kept)
            grads = gradient_fn(
                loss, targets, grad_ys=kwargs.get("grad_loss"),
                gate_gradients=gate == tf.compat.v1.train.Optimizer.GATE_OP,
                aggregation_method=kwargs.get("aggregation_method"),
                colocate_gradients_with_ops=True)
            if gate == tf.compat.v1.train.Optimizer.GATE_GRAPH:
                grads = tf.tuple(grads)
            if kwargs.get("sparse_as_dense"):
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            _tag_backward(graph.get_operations()[first:], k, plan.device(view.taskgraphs[0], k),
                          m if micro > 1 else None)
            grads_out.extend(grads)
        return grads_out

    @staticmethod
    def _copy_templates(view, plan, ctx, checkpoints, units, micro, forward_copies, slices,
                        mirrors) -> tuple[dict, list]:
        """The template's backward ops copied for every unit they can be copied for
        (reading the unit's forward copies, slices and variables, batch-derived
        constants rewritten), in one import.

        Returns ({unit: (its gradients, its backward ops)}, [why autodiff is needed
        for the other units]).
        """
        why_not = TemplateBackward.unusable(view, view.steps, ctx.artifacts.get("amp") is not None,
                                            checkpoints)
        if why_not:
            return {}, [why_not]
        template = TemplateBackward(view, view.steps)
        constants_by_shape, reasons, writers = {}, [], {}
        batch = NodeBatch(view.graph)
        for unit in units:
            k, m = unit
            key = _slice_shapes(slices, k * micro + m)
            if key not in constants_by_shape:
                constants_by_shape[key] = template.constant_values(forward_copies[unit])
                if constants_by_shape[key][1]:
                    reasons.append(constants_by_shape[key][1])
            constants, why_not = constants_by_shape[key]
            if why_not:
                continue
            input_map = _unit_inputs(slices, mirrors, k, k * micro + m)
            devices = {plan.device(tg, 0): plan.device(tg, k) for tg in view.taskgraphs}
            writers[unit] = (template.write(
                batch, _prefix(k, m, micro), lambda op, devices=devices: devices.get(op.device, op.device),
                input_map, _replica_attr(k, m if micro > 1 else None), forward_copies[unit],
                constants), input_map)
        try:
            created = batch.commit()
        except (ValueError, tf.errors.InvalidArgumentError) as err:  # shape inference refused it
            return {}, reasons + [f"copying the template failed: {str(err).splitlines()[0]}"]
        return {unit: template.gradients(copier, created, input_map, forward_copies[unit])
                for unit, (copier, input_map) in writers.items()}, reasons

    @staticmethod
    def _copy_backward(view, plan, source, unit, micro, source_grads, source_ops,
                       source_forward, forward_map, slices, mirrors) -> list:
        """Copy the backward ops of `source` (a unit whose slices have the same
        shapes) for `unit`, reading `unit`'s forward copies, slices and variables.

        Autodiff is the costly part of the rewrite; backward ops built for one
        slice shape are valid for every slice of that shape, so only the first
        unit of each shape runs tf.gradients.
        """
        (k0, m0), (k, m) = source, unit
        known = {copy: forward_map[orig] for orig, copy in source_forward.items()
                 if orig in forward_map}
        input_map = {parts[k0 * micro + m0]: parts[k * micro + m] for parts in slices.values()}
        input_map.update({copies[k0].outputs[0]: copies[k].outputs[0]
                          for copies in mirrors.values()})
        devices = {}
        for taskgraph in view.taskgraphs:
            devices[plan.device(taskgraph, k0)] = plan.device(taskgraph, k)
        op_map = clone_ops(source_ops, _prefix(k, m, micro),
                           lambda op: devices.get(op.device, op.device), input_map,
                           _replica_attr(k, m if micro > 1 else None), known=known)

        def mapped(tensor):
            if tensor is None:
                return None
            if isinstance(tensor, tf.IndexedSlices):
                return tf.IndexedSlices(mapped(tensor.values), mapped(tensor.indices),
                                        mapped(tensor.dense_shape))
            copy = op_map.get(tensor.op) or known.get(tensor.op)
            return copy.outputs[tensor.value_index] if copy is not None else input_map.get(tensor, tensor)
        return [mapped(g) for g in source_grads]

    @staticmethod
    def _copy_apply(view, plan, k, apply_ops, slices, mirrors, forward_map, grads, micro: int,
                    batch: NodeBatch) -> OpCopier:
        """Write the copies of the update (apply) ops for replica k > 0 (reading its
        accumulated gradients) into `batch`; the returned copier's `result` maps
        them once the batch is committed."""
        input_map = _unit_inputs(slices, mirrors, k, k * micro)
        input_map.update(_gradient_map(view, grads))
        copier = OpCopier(view.graph, REPLICA_PREFIX.format(k),
                          lambda op: plan.device(view.taskgraph_of[op], k), input_map,
                          _replica_attr(k), known=forward_map, batch=batch)
        for op in apply_ops:
            copier.copy(op)
        copier.close()
        return copier

    @staticmethod
    def _rewire_replica0_apply(apply_ops, forward_map, grads_and_map) -> None:
        """Original apply ops read replica 0's copies and gradients, not the template."""
        gradient_map = grads_and_map
        for op in apply_ops:
            for tensor in list(op.inputs):
                new = gradient_map.get(tensor)
                if new is None and tensor.op in forward_map:
                    new = forward_map[tensor.op].outputs[tensor.value_index]
                if new is not None:
                    replace_input(op, tensor, new)
            replace_control_inputs(op, forward_map)

    @staticmethod
    def _chain_train_ops(view, replica_maps) -> None:
        """The user's train op also runs every other replica's update."""
        for train_op in view.train_ops:
            copies = [m[train_op] for m in replica_maps[1:] if train_op in m]
            if copies:
                train_op._add_control_inputs(copies)

    @staticmethod
    def _merge_fetches(graph, view, unit_maps, weights, devices, communicator) -> dict:
        """Merged value of each loss and each tensor in an EPL merge collection.

        unit_maps: per (replica, micro-batch) copy, in global batch order, its
        forward op map; weights: each copy's share of the global batch. Ops
        outside the replicated model and summary ops (tf.compat.v1.summary of
        the loss) that read an original tensor read the merged one instead.
        """
        requests = {loss: "mean" for loss in view.losses}
        requests.update({t: kind for t, kind in merge_requests(graph).items() if t not in requests})
        merged = {}
        for tensor, kind in requests.items():
            if tensor.op not in unit_maps[0]:
                continue
            parts = [m[tensor.op].outputs[tensor.value_index] for m in unit_maps]
            with tf.device(devices.get(tensor.op, "/device:CPU:0")), tf.name_scope("EPL_MERGED"):
                merged[tensor] = _merge(parts, weights, kind, communicator, tensor.name)
            for consumer in list(tensor.consumers()):
                if (consumer not in devices or consumer.type in SUMMARY_TYPES) \
                        and tensor.shape == merged[tensor].shape:
                    replace_input(consumer, tensor, merged[tensor])
        return merged

    @staticmethod
    def _sync_ops(mirrors, communicator) -> dict:
        """original variable op -> op copying its value into its mirrors.

        With several workers the value is worker 0's (broadcast), written into
        the original too, so workers that initialized with different random
        seeds start identical.
        """
        cross = communicator.cross
        if cross is None:
            return _local_sync_ops(mirrors)
        sync = {}
        with tf.name_scope("EPL_SYNC"):
            for var, copies in mirrors.items():
                with tf.device(var.device):
                    value = cross.broadcast(_read(var), 0, label=var.name)
                    assigns = [_assign(var, value)]
                for copy in copies[1:]:
                    with tf.device(copy.device):
                        assigns.append(_assign(copy, value))
                with tf.device(var.device):
                    sync[var] = tf.group(*assigns)
        return sync


def _variable_read(op: tf.Operation) -> tf.Operation | None:
    """The variable op whose handle (resource or ref) `op` takes as an input, if any.

    TensorFlow places such an op on the variable's device; when a later
    pipeline stage reads a variable of an earlier one (tied embeddings), the
    read runs on the variable's device and its value travels to the stage.
    """
    for tensor in op.inputs:
        if tensor.op.type in VARIABLE_OP_TYPES and (tensor.dtype == tf.resource
                                                    or tensor.dtype._is_ref_dtype):
            return tensor.op
    return None


def _micro_bounds(bounds: list, micro: int) -> list:
    """Run-time boundaries of every (replica, micro-batch) slice from the replicas' ones.

    Each replica's rows are cut into `micro` equal slices; an Assert fails the
    step when a replica's row count is not divisible by `micro`.
    """
    if micro == 1:
        return list(bounds)
    sizes = [bounds[k + 1] - bounds[k] for k in range(len(bounds) - 1)]
    check = tf.debugging.Assert(
        tf.reduce_all(tf.equal(tf.stack(sizes) % micro, 0)),
        [f"EPL: pipeline.num_micro_batch={micro} does not divide every replica's batch; "
         "per-replica batch sizes:", tf.stack(sizes)])
    with tf.control_dependencies([check]):
        unit_bounds = [bounds[k] + size * m // micro
                       for k, size in enumerate(sizes) for m in range(micro)]
    return unit_bounds + [bounds[-1]]


def _accumulate(per_micro: list[list], replica: int) -> tuple[list, dict]:
    """One gradient per variable from the gradients of every micro-batch.

    per_micro[m][i] is micro-batch m's gradient of variable i. The result is
    (1/M) x the sum over m in micro-batch order (every micro-batch holds 1/M of
    the replica's examples, so this is the gradient of the mean loss over the
    replica's part), on the device of micro-batch 0's gradient, tagged with its
    TaskGraph, phase "backward" and the replica.

    The sum is a chain of adds, ((g0 + g1) + g2) + ..., not one AddN, and the
    add of g_m is tagged as micro-batch m's work (`_epl_micro_batch` = m; the
    final scaling is micro-batch M - 1's): the schedule pass puts it into that
    micro-batch's backward step, so g_m is freed as soon as it is added and the
    accumulator costs one gradient's memory whatever M is. (The step's control
    edges also keep Grappler from merging the chain back into one AddN, which
    would keep every micro-batch's gradient alive until the last one.) Sparse
    gradients (tf.IndexedSlices) are concatenated, with scaled values, at the
    last micro-batch.

    Returns (gradients, {m: ops added for micro-batch m}).
    """
    micro = len(per_micro)
    if micro == 1:
        return per_micro[0], {}
    scale = 1.0 / micro
    accumulated, ops_of = [], {m: [] for m in range(micro)}
    for parts in zip(*per_micro):
        first = parts[0]
        if first is None:
            accumulated.append(None)
            continue
        source = first.values.op if isinstance(first, tf.IndexedSlices) else first.op
        graph = source.graph

        def tagged(m, build):
            start = len(graph.get_operations())
            with tf.device(source.device), tf.name_scope("EPL_ACCUMULATE"):
                result = build()
            for new in graph.get_operations()[start:]:
                for name in (TASKGRAPH_ATTR, PHASE_ATTR):
                    if name in source.node_def.attr:
                        new._set_attr(name, source.node_def.attr[name])
                new._set_attr(REPLICA_ATTR, tf.compat.v1.AttrValue(i=replica))
                new._set_attr(MICRO_BATCH_ATTR, tf.compat.v1.AttrValue(i=m))
                ops_of[m].append(new)
            return result

        if isinstance(first, tf.IndexedSlices):
            total = tagged(micro - 1, lambda: tf.IndexedSlices(
                tf.concat([p.values for p in parts], axis=0) * tf.cast(scale, first.dtype),
                tf.concat([p.indices for p in parts], axis=0), first.dense_shape))
        else:
            total = parts[0]
            for m in range(1, micro):
                total = tagged(m, lambda t=total, p=parts[m]: t + p)
            total = tagged(micro - 1, lambda t=total: t * tf.cast(scale, first.dtype))
        accumulated.append(total)
    return accumulated, ops_of


def _gradient_map(view, grads) -> dict:
    """Original dense gradient tensors -> this replica's gradients.

    Sparse gradients (IndexedSlices) are not mapped: the update ops keep
    reading the original's values and indices, whose static shapes are those
    of the whole batch, until the gradient pass feeds them every replica's
    gathered rows (which have that same shape).
    """
    return {orig: new for (orig, _), new in zip(view.gradients, grads)
            if not isinstance(orig, tf.IndexedSlices)}


def _prefix(replica: int, micro_batch: int, micro: int) -> str:
    """Name prefix of a unit's copies."""
    prefix = REPLICA_PREFIX.format(replica)
    return prefix if micro == 1 else f"{prefix}/{MICRO_BATCH_PREFIX.format(micro_batch)}"


def _tag_backward(ops, replica: int, fallback_device: str, micro_batch: int | None = None) -> None:
    """Phase, replica, micro-batch, TaskGraph and device of regenerated backward ops."""
    phase = tf.compat.v1.AttrValue(s=Phase.BACKWARD.value.encode())
    replica_attr = tf.compat.v1.AttrValue(i=replica)
    micro_attr = None if micro_batch is None else tf.compat.v1.AttrValue(i=micro_batch)
    for op in ops:
        op._set_attr(PHASE_ATTR, phase)
        op._set_attr(REPLICA_ATTR, replica_attr)
        if micro_attr is not None:
            op._set_attr(MICRO_BATCH_ATTR, micro_attr)
        source = colocation_root(op) or next(
            (producer for producer in [t.op for t in op.inputs] + list(op.control_inputs)
             if _string_attr(producer, TASKGRAPH_ATTR) is not None), None)
        taskgraph = _string_attr(source, TASKGRAPH_ATTR) if source is not None else None
        if taskgraph is not None:
            op._set_attr(TASKGRAPH_ATTR, tf.compat.v1.AttrValue(s=taskgraph))
        op._set_device(source.device if source is not None and source.device else fallback_device)


def _checkpoint_copies(template: list, forward_copies: dict, replicas: int) -> list:
    """The tensors to keep for the chosen template checkpoints: every replica's copy
    of a replicated one, the tensor itself for one computed by split ops."""
    kept = []
    for tensor in template:
        if tensor.op in forward_copies[(0, 0)]:
            kept.extend(forward_copies[(k, 0)][tensor.op].outputs[tensor.value_index]
                        for k in range(replicas))
        else:
            kept.append(tensor)
    return kept


def _refuse_spanning_outputs(view, outputs: dict, spanning: set) -> None:
    """A split group over every worker must end in the loss (its values cover the
    global batch, which no replica reads back)."""
    bad = [t for t in outputs if view.taskgraph_of[t.op].name in spanning]
    if bad:
        raise ParallelizeError(
            f"the split group(s) {sorted(spanning)} span every worker, and replicated ops read "
            f"their result(s) {', '.join(t.name for t in bad[:5])}: across workers a split "
            "group must compute the loss itself (e.g. a classifier with its softmax "
            "cross-entropy and mean inside the split scope). Move those ops into the split "
            "scope, or use a split group within one worker.")


def _merge_split_losses(view, units, weights, cross, spanning: set) -> dict:
    """A loss computed by a split group within a worker covers this worker's
    batch: the fetched value is the mean over every worker's batch (each
    weighted by its share). A group over every worker computed the global
    mean already."""
    merged = {}
    with tf.name_scope("EPL_MERGED"):
        for loss in view.losses:
            if loss.op in units[0] or view.taskgraph_of[loss.op].name in spanning:
                continue
            with tf.device(loss.device):
                share = tf.add_n([tf.cast(w, loss.dtype) for w in weights])
                merged[loss] = cross.all_reduce(share * loss, "sum", label=loss.name)
    return merged


def _tag_global_backward(ops, fallback_device: str) -> None:
    """Phase, TaskGraph, replica and device of the ops of the one global autodiff.

    Each op follows the forward op it is colocated with (or its first tagged
    input): its TaskGraph, its replica (absent for split ops) and its device.
    """
    phase = tf.compat.v1.AttrValue(s=Phase.BACKWARD.value.encode())
    for op in ops:
        op._set_attr(PHASE_ATTR, phase)
        source = colocation_root(op) or next(
            (producer for producer in [t.op for t in op.inputs] + list(op.control_inputs)
             if TASKGRAPH_ATTR in producer.node_def.attr), None)
        if source is None:
            op._set_device(fallback_device)
            continue
        for name in (TASKGRAPH_ATTR, REPLICA_ATTR):
            if name in source.node_def.attr:
                op._set_attr(name, source.node_def.attr[name])
        op._set_device(source.device or fallback_device)


def _string_attr(op: tf.Operation, name: str) -> bytes | None:
    """op's string attribute `name`, or None (read alone: op.node_def would
    serialize the whole NodeDef, constant values included)."""
    try:
        return op.get_attr(name)
    except ValueError:
        return None


def _shape_node(const: tf.Operation, source: str, source_dtype: tf.DType, name: str, device: str,
                copy_attrs: dict) -> node_def_pb2.NodeDef:
    """NodeDef of a Shape op of `source` (a NodeDef input of dtype `source_dtype`)
    standing in for the folded shape constant `const`."""
    attrs = {k: v for k, v in const.node_def.attr.items() if k in (TASKGRAPH_ATTR, PHASE_ATTR)}
    attrs.update(copy_attrs)
    node = node_def_pb2.NodeDef(name=name, op="Shape", device=device, input=[source])
    for key, value in attrs.items():
        node.attr[key].CopyFrom(value)
    node.attr["out_type"].type = const.outputs[0].dtype.as_datatype_enum
    node.attr["T"].type = source_dtype.as_datatype_enum
    return node


def _merge(parts: list[tf.Tensor], weights: list, kind: str, communicator,
           label: str | None = None) -> tf.Tensor:
    """Merge per-replica values; across workers too (every worker must fetch it).
    label: the merged tensor's name (it names the cross-worker collective)."""
    cross = communicator.cross
    if kind == "concat":
        local = tf.concat(parts, axis=0)
        return cross.all_gather(local, label=label) if cross is not None else local
    if kind == "sum":
        local = tf.add_n(parts)
    else:  # weights are shares of the global batch, so the sum over workers is the mean
        local = tf.add_n([tf.cast(w, p.dtype) * p for w, p in zip(weights, parts)])
    return cross.all_reduce(local, "sum", label=label) if cross is not None else local


def _local_sync_ops(mirrors: dict) -> dict:
    """`_sync_ops` with one worker: per variable with mirrors, read the original
    (on its device), assign the value to every mirror (on the mirror's device),
    and a NoOp on the original's device that runs the assigns. The same ops as
    `_read`, `_assign` and tf.group build, written as NodeDefs and added in one
    batch (epl.ir.clone.NodeBatch): there is one such op group per variable.
    """
    if not mirrors:
        return {}
    batch = NodeBatch(next(iter(mirrors)).graph)
    groups = _write_local_sync(mirrors, batch)
    created = batch.commit()
    return {var: created[name] for var, name in groups.items()}


def _write_local_sync(mirrors: dict, batch: NodeBatch) -> dict:
    """Write `_local_sync_ops`'s ops into `batch`; {variable op: its NoOp's name}."""
    groups = {}
    for var, copies in mirrors.items():
        if len(copies) == 1:
            continue
        resource = var.type == "VarHandleOp"
        dtype = var.get_attr("dtype")
        value = batch.add(_node(batch, "ReadVariableOp" if resource else "Identity", var.device,
                                [batch.ref(var.outputs[0])], **(
                                    {"dtype": dtype} if resource else {"T": dtype})))
        assigns = []
        for copy in copies[1:]:
            inputs = [batch.ref(copy.outputs[0]), batch.output(value, 0)]
            assigns.append(batch.add(
                _node(batch, "AssignVariableOp", copy.device, inputs, dtype=dtype) if resource else
                _node(batch, "Assign", copy.device, inputs, T=dtype, validate_shape=True,
                      use_locking=True)))
        groups[var] = batch.add(_node(batch, "NoOp", var.device, [f"^{a}" for a in assigns],
                                      name="group_deps"))
    return groups


def _node(batch: NodeBatch, op_type: str, device: str, inputs: list[str], name: str | None = None,
          **attrs) -> node_def_pb2.NodeDef:
    """A NodeDef named `EPL_SYNC/<name or op_type>` (made unique) with `inputs` and
    `attrs` (tf.DType or bool values); the importer fills in default attributes."""
    node = node_def_pb2.NodeDef(name=batch.new_name(f"EPL_SYNC/{name or op_type}"), op=op_type,
                                device=device, input=inputs)
    for key, value in attrs.items():
        if isinstance(value, bool):
            node.attr[key].b = value
        else:
            node.attr[key].type = tf.as_dtype(value).as_datatype_enum
    return node


def _read(var: tf.Operation) -> tf.Tensor:
    if var.type == "VarHandleOp":
        return tf.raw_ops.ReadVariableOp(resource=var.outputs[0], dtype=var.get_attr("dtype"))
    return tf.identity(var.outputs[0])


def _assign(var: tf.Operation, value: tf.Tensor) -> tf.Operation:
    if var.type == "VarHandleOp":
        return tf.raw_ops.AssignVariableOp(resource=var.outputs[0], value=value)
    return tf.compat.v1.assign(var.outputs[0], value).op
