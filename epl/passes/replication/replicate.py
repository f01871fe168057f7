"""Replication (data parallelism) and micro-batching among the devices of one worker.

Given the plan's R replicas and M = `pipeline.num_micro_batch` micro-batches,
the unit of copying is a (replica k, micro-batch m) pair, u = k x M + m. The
pass, in order (each step in the module named after it, under
epl/passes/replication/):

1. input (`inputs.py`): what each unit reads as its batch and what it weighs
   in the global batch. By default (`io.batch_mode` "replica", EPL's
   contract) the script's batch is one unit's batch: each unit draws its own
   from the user's tf.data iterator, or reads its rows of a feed that holds
   every unit's batch, so the script's static shapes stay valid. Opt-in
   ("global"): the script's batch is the worker's whole batch, sliced.
2. variables (`mirrors.py`): replica 0 uses the user's variables, replica
   k > 0 a mirror of each on its device; `sync` ops copy the originals into
   the mirrors (the session runs them after initialization or restore).
3. copies (`copies.py`): the forward ops once per unit on the replica's
   devices (TaskGraph t of replica k on the plan's device for t in k: with
   several TaskGraphs these are the pipeline stages), tagged `_epl_replica` =
   k and, when M > 1, `_epl_micro_batch` = m; then each unit's backward ops
   (the user's own backward ops copied, or autodiff of the unit's forward
   copy where that is not possible; the pass's notes say which and why).
4. split connection (`split_connection.py`), for models with `epl.split`
   TaskGraphs: the split ops meet the replicas and one autodiff covers the
   whole step.
5. the shared ending (`_finish`): the update ops of replicas k > 0 are copies
   of the user's (replica 0 keeps the originals, rewired to its gradients; with
   micro-batches, to micro-batch 0's, which the accumulate pass then replaces by
   the sum over micro-batches, epl/passes/pipeline/accumulate.py),
   the user's train op runs every replica's update, and each loss is merged
   (`merge.py`) into the mean over the global batch, which is what fetching
   the loss returns.

What each unit's backward keeps for recomputation is the recompute pass's
choice (epl/passes/recompute/recompute.py), which this pass builds the backward with;
adding the micro-batch gradients is the accumulate pass's job, and the order in
which the micro-batch copies run (the pipeline schedule) the schedule pass's
(epl/passes/pipeline/schedule.py); this pass only copies.

Why replica 0 is a copy too: in global mode the original forward ops were
shape-inferred for the whole batch, and TensorFlow refuses to feed them a
slice with a different static shape; in both modes the original forward and
backward ops stay in the graph as the template (never run: nothing the train
op needs reads them), while the variables and the update ops stay the
originals. This departs from the original design's "original ops remain replica 0" only
for the forward/backward ops.

Results for the next passes: a `Replication` (every unit's gradients, the
gradient each replica's updates read, each replica's weight, the merged
fetches, the sync ops, the feeds to redirect and, for the schedule pass, the
forward copies and backward ops of every unit), the gradients each replica's
updates read (`ReplicaGradients`, the start of the gradient flow) and, with
gradient_checkpoint.check_gradients, a `GradientCheck`.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import REPLICA_ATTR, Phase
from epl.ir.clone import ConstantPool, NodeBatch, with_dynamic_rows
from epl.ir.graph_view import TrainingView, colocation_root, topological_order
from epl.passes.amp import AmpRewrite
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.recompute.recompute import Recompute
from epl.passes.replication import copies
from epl.passes.replication import inputs as batch_inputs
from epl.passes.replication import split_connection
from epl.passes.replication.backward_copy import functional_backward
from epl.passes.replication.merge import merge_fetches, merge_split_losses
from epl.passes.replication.mirrors import mirror_variables, sync_ops, write_local_sync
from epl.passes.replication.result import Copies, GradientCheck, Replication, Setup
from epl.passes.split.split import SplitRecords
from epl.planner.plan import Plan


class ReplicatePass(GraphPass):
    """Copies the model once per (replica, micro-batch) and gives each its batch."""

    name = "replicate"
    requires = (TrainingView, Plan)
    # copies AMP's casts; builds the backward with recompute's checkpoints; connects
    # the split TaskGraphs the split pass rewrote at gradient time
    optional = (AmpRewrite, Recompute, SplitRecords)
    provides = (Replication, ReplicaGradients, GradientCheck)
    after = ("annotate", "amp", "recompute")

    def supports_uneven_shares(self, view) -> bool:
        """Whether replicas of `view` can take different shares of the batch under this
        pass's batch mode (the planner's uneven shares apply only then)."""
        return batch_inputs.supports_uneven_shares(view, self.options.batch_mode)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        """Checks the batch and the split layout."""
        view, plan, options = ctx.get(TrainingView), ctx.get(Plan), self.options
        split_connection.check_split_supported(view, options.num_micro_batch,
                                               options.reduce_method)
        micro, mode = options.num_micro_batch, options.batch_mode
        sizes = batch_inputs.check_batch(view, plan, micro, mode)
        if mode == batch_inputs.GLOBAL_MODE and sizes is not None:
            batch_inputs.check_sliced_shapes(view, [s // micro for s in sizes])

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        before = set(graph.get_operations())
        view, plan = ctx.get(TrainingView), ctx.get(Plan)
        recompute = ctx.find(Recompute)
        check = recompute is not None and recompute.check_gradients
        setup = self._prepare(graph, ctx, view, plan, recompute)
        if view.split_ops:
            records = ctx.find(SplitRecords)
            built = split_connection.connect(view, plan, ctx.communicator,
                                             list(records.records) if records else [],
                                             check, setup)
        else:
            built = self._replicate(graph, view, plan, ctx.find(AmpRewrite) is not None,
                                    check, setup)
        return self._finish(graph, ctx, view, plan, setup, built, before)

    # -- steps 1 and 2 -----------------------------------------------------------
    def _prepare(self, graph, ctx, view, plan, recompute) -> Setup:
        """Place the originals, give every unit its batch, mirror the variables."""
        micro, mode = self.options.num_micro_batch, self.options.batch_mode
        sizes = batch_inputs.check_batch(view, plan, micro, mode)
        checkpoints = recompute.checkpoints if recompute is not None else {}
        # inputs before readers: creation order is not enough once autodiff added inputs
        # to a forward op (v2 control flow's gradient gives the forward While the
        # accumulators of its intermediates; a traced step's updates read the Identity ops
        # that replaced a Keras optimizer's IdentityN, made after them)
        forward = topological_order(
            [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD])
        apply_ops = topological_order(
            [op for op in view.replica_ops if view.phase_of[op] == Phase.APPLY])
        devices = {op: plan.device(view.taskgraph_of[op], 0) for op in view.replica_ops}
        _place(graph, view, plan)
        unit_inputs = batch_inputs.build_unit_inputs(view, plan, micro, mode, ctx.communicator,
                                                     ctx.cluster.host_device, sizes)
        mirrors = mirror_variables(view, plan)
        return Setup(micro, mode, forward, apply_ops, devices, unit_inputs, mirrors, checkpoints)

    # -- step 3 (no split TaskGraph) -------------------------------------------------
    @staticmethod
    def _replicate(graph, view, plan, amp_on: bool, check_gradients: bool,
                   setup: Setup) -> Copies:
        """Forward and backward copies of every unit; each replica's updates will read
        its micro-batch 0's gradients (the accumulate pass adds the others)."""
        micro = setup.micro
        slices, mirrors, checkpoints = setup.inputs.tensors, setup.mirrors, setup.checkpoints
        all_units = [(k, m) for k in range(plan.num_replicas) for m in range(micro)]
        # v2 control flow in the backward: its functions belong to the autodiff that
        # built them, so every unit runs its own autodiff, on functions of its own
        each_own = functional_backward(view, view.steps)
        # one copy of each constant per replica and device, read by all its micro-batches
        pool = ConstantPool(REPLICA_ATTR)
        forward_copies = copies.copy_forwards(view, plan, all_units, micro, setup.forward,
                                              setup.inputs, mirrors, own_functions=each_own,
                                              pool=pool)
        copied, autodiff_reasons = copies.copy_templates(view, plan, amp_on, checkpoints,
                                                         all_units, micro, forward_copies, slices,
                                                         mirrors, pool=pool)
        gradients, backward_ops, unit_gradients = [], {}, {}
        check = None
        built_by_shape: dict = {}  # unit shapes -> (unit, its gradients, its backward ops)
        for k in range(plan.num_replicas):
            per_micro = []
            for m in range(micro):
                unit = (k, m)
                first = len(graph.get_operations())
                key = copies.slice_shapes(slices, k * micro + m)
                if unit in copied:  # the user's backward ops, copied (cheap)
                    per_micro.append(copied[unit][0])
                elif key in built_by_shape and not each_own:  # same shapes: copy (cheap)
                    source, source_grads, source_ops = built_by_shape[key]
                    per_micro.append(copies.copy_backward(
                        view, plan, source, unit, micro, source_grads, source_ops,
                        forward_copies[source], forward_copies[unit], slices, mirrors,
                        pool=pool))
                else:  # first unit of these shapes: autodiff of its loss copy
                    per_micro.append(copies.regenerate_gradients(
                        view, plan, unit, micro, forward_copies[unit], mirrors, checkpoints))
                    built_by_shape[key] = (unit, per_micro[-1], graph.get_operations()[first:])
                backward_ops[unit] = copied[unit][1] if unit in copied \
                    else copies.backward_only(graph.get_operations()[first:],
                                              forward_copies[unit])
                unit_gradients[unit] = per_micro[-1]
                if checkpoints and unit == (0, 0) and check_gradients:
                    # gradients without checkpointing, never run by the train op: the
                    # session compares them with the checkpointed ones before step 1
                    check = (copies.regenerate_gradients(
                        view, plan, unit, micro, forward_copies[unit], mirrors), per_micro[-1])
            gradients.append(per_micro[0])
        rebuilt = len(built_by_shape)
        notes = [f"backward ops: copied from the template for {len(copied)} unit(s), autodiff "
                 f"for {rebuilt}" + (f" ({'; '.join(autodiff_reasons)})" if rebuilt else "")]
        if micro > 1:
            notes.append(f"{micro} micro-batches per replica; each replica's updates read "
                         "micro-batch 0's gradients until the accumulate pass")
        return Copies(forward_copies, gradients, backward_ops, notes,
                      unit_gradients=unit_gradients, gradient_check=check)

    # -- step 5: the shared ending ---------------------------------------------------
    @staticmethod
    def _finish(graph, ctx, view, plan, setup: Setup, built: Copies, before: set) -> PassResult:
        """Update copies, the train op, merged fetches, sync ops and the results."""
        micro = setup.micro
        replicas, mirrors, unit_inputs = plan.num_replicas, setup.mirrors, setup.inputs
        forward_copies, gradients = built.forward_copies, built.gradients
        workers = ctx.communicator.num_workers
        split_vars = set(view.split_variables)
        replica_maps = [dict(forward_copies[(k, 0)]) for k in range(replicas)]
        # the update copies of replicas k > 0 (made before the originals are rewired)
        # and, with one worker and no split, the sync ops: one import
        # a split variable's sparse gradient is computed once, for every replica (its
        # rows are complete: not gathered by the gradient pass); every replica's update
        # ops that read it (a Keras 3 optimizer's slot updates) read that one
        split_sparse = {}
        for (orig, var), new in zip(view.gradients, gradients[0]):
            if var in split_vars and isinstance(orig, tf.IndexedSlices):
                split_sparse[orig.values] = with_dynamic_rows(new.values, orig.values)
                split_sparse[orig.indices] = with_dynamic_rows(new.indices, orig.indices)
        batch = NodeBatch(graph)
        copiers = {k: copies.copy_apply(view, plan, k, setup.apply_ops, unit_inputs.tensors,
                                        mirrors, replica_maps[k], gradients[k], micro, batch,
                                        split_sparse)
                   for k in range(1, replicas)}
        local_sync = write_local_sync(mirrors, batch) \
            if workers == 1 and not view.split_ops else None
        created = batch.commit()
        for k, copier in copiers.items():
            replica_maps[k].update(copier.result(created))
        gradient_map = {**copies.gradient_map(view, gradients[0]), **split_sparse}
        copies.rewire_replica0_apply(setup.apply_ops + view.split_apply_ops, replica_maps[0],
                                     gradient_map)
        copies.chain_train_ops(view, replica_maps)
        units = [forward_copies[(k, m)] for k in range(replicas) for m in range(micro)]
        merged = merge_fetches(graph, view, units, unit_inputs.unit_weights, setup.devices,
                               ctx.communicator)
        records = ctx.find(SplitRecords)
        spanning = split_connection.spanning_groups(list(records.records) if records else [])
        local_split = [v for v in view.split_variables
                       if view.taskgraph_of[v].name not in spanning]
        if view.split_ops and workers > 1:
            # split groups within a worker are data-parallel across workers
            split_connection.reduce_split_gradients_over_workers(
                view, gradients[0], ctx.communicator, set(local_split))
            merged.update(merge_split_losses(view, units, unit_inputs.replica_weights,
                                             ctx.communicator, spanning))
        if local_sync is not None:
            syncs = {var: created[name] for var, name in local_sync.items()}
        else:  # every worker holds the same shards of a group within a worker: broadcast
            syncs = sync_ops({**mirrors, **{v: [v] for v in local_split}}, ctx.communicator)
        per_gradient = [(var, [gradients[k][i] for k in range(replicas)], grad)
                        for i, (grad, var) in enumerate(view.gradients) if var not in split_vars]
        split_gradients = [(var, grad) for (_, var), grad in zip(view.gradients, gradients[0])
                           if var in split_vars and grad is not None]
        loss_copies = {unit: [fmap[t.op].outputs[t.value_index] for t in view.losses
                              if t.op in fmap] for unit, fmap in forward_copies.items()}
        ctx.provide(Replication(
            per_gradient, unit_inputs.replica_weights, merged, syncs, mirrors, replica_maps,
            micro, forward_copies, built.backward_ops, loss_copies, built.presummed,
            split_gradients, dict(unit_inputs.feeds), list(unit_inputs.draws),
            built.unit_gradients or {(k, 0): gradients[k] for k in range(replicas)},
            list(unit_inputs.micro_scales), list(unit_inputs.unit_weights),
            dict(unit_inputs.tensors)))
        ctx.provide(ReplicaGradients(list(per_gradient), list(split_gradients)))
        if built.gradient_check is not None:
            ctx.provide(GradientCheck(*built.gradient_check))
        added = [op.name for op in graph.get_operations() if op not in before]
        op_map = {op.name: [forward_copies[u][op].name for u in sorted(forward_copies)
                            if op in forward_copies[u]]
                  + [m[op].name for m in replica_maps[1:] if op in m and op not in replica_maps[0]]
                  for op in view.replica_ops}
        notes = [f"{replicas} replicas, shares {list(plan.replica_weights)}",
                 _batch_note(setup, view, replicas)] + built.notes
        return PassResult(added=added, op_map=op_map, notes=notes)


def _batch_note(setup: Setup, view, replicas: int) -> str:
    """One line on the batch contract: what one step consumes on this worker."""
    units = replicas * setup.micro
    batch = view.global_batch_size
    size = "?" if batch is None else str(batch)
    if setup.mode == batch_inputs.REPLICA_MODE:
        total = "?" if batch is None else str(batch * units)
        return (f"io.batch_mode 'replica': each of {units} unit(s) (replicas x micro-batches) "
                f"reads a batch of {size}; {total} examples per step on this worker")
    return (f"io.batch_mode 'global': the batch of {size} is sliced into {units} unit(s) "
            "(replicas x micro-batches)")


def _place(graph, view, plan) -> None:
    """Originals on replica 0's devices; everything else where it belongs."""
    replica = set(view.replica_ops) | set(view.variables)
    split = {tg.name for tg in view.split_taskgraphs}  # split ops keep their devices
    mirrored = set(view.variables)
    for op in graph.get_operations():
        taskgraph = view.taskgraph_of.get(op)
        if taskgraph is not None and taskgraph.name in split and op not in mirrored \
                and op.device:   # split ops keep their devices; the script's others follow
            continue
        if op in replica or (op in view.taskgraph_of and op.type in ("VarHandleOp", "VariableV2")):
            graph_mutation.set_device(op, plan.device(view.taskgraph_of[op], 0))
    for op in view.replica_ops:  # a variable read by a later stage is read where it lives
        var = copies.variable_read(op)
        if var is not None:
            graph_mutation.set_device(op, var.device)
    for op in graph.get_operations():
        if op not in replica and not op.device:
            root = colocation_root(op)
            taskgraph = view.taskgraph_of.get(op)
            if root is not None and root.device:
                graph_mutation.set_device(op, root.device)
            elif taskgraph is not None and taskgraph.name in plan.devices and \
                    view.phase_of.get(op) in (Phase.FORWARD, Phase.BACKWARD, Phase.APPLY):
                # a step op the step no longer runs (one the amp pass replaced): with its
                # stage, where the template ops colocated with it are
                graph_mutation.set_device(op, plan.device(taskgraph, 0))
            else:
                graph_mutation.set_device(op, "/device:CPU:0")
