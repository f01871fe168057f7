"""Replicas around split TaskGraphs (`epl.split`): the replicate pass's split connection.

The split pass (epl/passes/split/split.py) rewrote each split TaskGraph at
gradient time into per-device ops ("split ops"), reading shards of the split
variables. The replicate pass connects them to the data-parallel replicas and
then runs ONE autodiff over the whole step (`global_gradients`): of
sum_u share_u x loss_u when the loss is replicated, or of the loss itself
when a split op computes it over the global batch. Every replica's gradient
is then already weighted by its share, so the gradient pass sums them
(`Replication.presummed`); the shards' gradients are complete and are not
reduced, and their updates run once. Gradient checkpointing applies to that
one autodiff (every replica's copy of each chosen checkpoint is kept).

How the split ops meet the replicas depends on `io.batch_mode`:
- "replica": every replica reads a batch of the script's size, so the split
  ops, built for that size, are copied per replica like the replicated ops
  (`replica_split_copies`): replica k's copy of a split op runs on the split
  op's own device, reads replica k's copies of replicated tensors and the
  shared shards (not mirrored). TensorFlow moves each replica's rows to the
  shard devices (the all-gather of tensor parallelism); an expert dispatch
  slice runs on the replica's device, so each expert device receives only its
  experts' slice of every replica's tokens, and the combine concat of expert
  outputs runs on the replica's device: the all-to-all and back.
- "global": the split ops run once over the script's whole batch; the
  replicas' slices are exchanged with them through epl/passes/split/boundary.py
  (all-gather or all-to-all in, each replica's rows out).
"""
from __future__ import annotations

import functools

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.passes.recompute import checkpoints as recompute
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.clone import replace_input
from epl.ir.graph_view import colocation_root, topological_order
from epl.passes.split.boundary import SplitBoundary
from epl.passes.replication import copies
from epl.passes.replication import inputs as batch_inputs
from epl.passes.replication.result import Copies


def check_split_supported(view, micro: int, reduce_method: str) -> None:
    """What the split path does not combine with yet, each with what to do instead
    (micro: pipeline.num_micro_batch; reduce_method: communication.gradients_reduce_method)."""
    if not view.split_ops:
        return
    names = ", ".join(tg.spec.describe() for tg in view.split_taskgraphs)
    problems = []
    if micro > 1:
        problems.append("pipeline.num_micro_batch > 1 (micro-batches)")
    if reduce_method == "sum":
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


def global_gradients(view, plan, step, forward_copies, weights, mirrors,
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
    tag_global_backward(backward, plan.device(view.taskgraphs[0], 0))
    per_replica = []
    for k in range(plan.num_replicas):
        row = []
        for _, var in view.gradients:
            position = index.get((var, k), index.get((var, None)))
            row.append(grads[position] if position is not None else None)
        per_replica.append(row)
    return per_replica, backward


def reduce_split_gradients_over_workers(view, gradients, communicator, split_vars: set) -> None:
    """Every worker holds all shards of a split group within a worker: sum
    each shard's gradient (of `split_vars`) over the workers (it is already
    weighted by the worker's batch share) and make every reader of the gradient
    read the sum (the shard's update, and in an eager step, where the variable
    stays whole, the optimizer's ops that compute its update from the gradient:
    a Keras optimizer's moments); sparse gradients are gathered."""
    with tf.name_scope("EPL_SPLIT_WORKERS"):
        for (_, var), grad in zip(view.gradients, gradients):
            if var not in split_vars or grad is None:
                continue
            parts = (grad.values, grad.indices) if isinstance(grad, tf.IndexedSlices) \
                else (grad,)
            readers = list(dict.fromkeys(op for part in parts for op in part.consumers()))
            if isinstance(grad, tf.IndexedSlices):
                with tf.device(grad.values.device):
                    pairs = ((grad.values, communicator.workers_all_gather(grad.values)),
                             (grad.indices, communicator.workers_all_gather(grad.indices)))
            else:
                with tf.device(grad.device):
                    pairs = ((grad, communicator.workers_all_reduce(grad, "sum")),)
            for old, new in pairs:
                for op in readers:
                    replace_input(op, old, new)


def checkpoint_copies(template: list, forward_copies: dict, replicas: int) -> list:
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


def refuse_spanning_outputs(view, outputs: dict, spanning: set) -> None:
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


def tag_global_backward(ops, fallback_device: str) -> None:
    """Phase, TaskGraph, replica and device of the ops of the one global autodiff.

    Each op follows the forward op it is colocated with (or its first tagged
    input): its TaskGraph, its replica (absent for split ops) and its device.
    """
    phase = tf.compat.v1.AttrValue(s=Phase.BACKWARD.value.encode())
    for op in ops:
        graph_mutation.set_attr(op, PHASE_ATTR, phase)
        source = colocation_root(op) or next(
            (producer for producer in [t.op for t in op.inputs] + list(op.control_inputs)
             if TASKGRAPH_ATTR in producer.node_def.attr), None)
        if source is None:
            graph_mutation.set_device(op, fallback_device)
            continue
        for name in (TASKGRAPH_ATTR, REPLICA_ATTR):
            if name in source.node_def.attr:
                graph_mutation.set_attr(op, name, source.node_def.attr[name])
        graph_mutation.set_device(op, source.device or fallback_device)


def spanning_groups(records) -> set:
    """Names of the split TaskGraphs that span every worker (records: the split
    pass's SplitRecord list)."""
    return {r.taskgraph for r in records if r.spans_workers}


def connect(view, plan, communicator, records: list, check_gradients: bool, setup):
    """Copy the replicated TaskGraphs per replica, connect them with the split ops
    (per `io.batch_mode`, see the module docstring) and run the one autodiff.

    records: the split pass's SplitRecords; check_gradients: also build the
    gradients without checkpointing (gradient_checkpoint.check_gradients).
    Returns the replicate pass's `Copies`.
    """
    replicas = plan.num_replicas
    units = [(k, 0) for k in range(replicas)]
    spanning = spanning_groups(records)
    first_stage = view.taskgraphs[0]
    weights = setup.inputs.replica_weights
    if setup.mode == batch_inputs.REPLICA_MODE:
        if spanning and communicator.num_workers > 1:
            raise ParallelizeError(
                f"the split group(s) {sorted(spanning)} span every worker, which EPL supports "
                "with io.batch_mode 'global' only (the group computes over the whole batch of "
                "every worker at once). Set io.batch_mode to 'global', or use a split group "
                "within one worker (device_count <= the devices of one worker).")
        forward_copies = replica_split_copies(view, plan, setup, records,
                                              lambda k: plan.device(first_stage, k))
        note = (f"split TaskGraphs {[tg.name for tg in view.split_taskgraphs]} copied per "
                f"replica onto {dict(plan.split_devices)}; {len(view.split_variables)} split "
                "variables shared by the copies")
    else:
        boundary = SplitBoundary(view, plan, weights, records,
                                 lambda k: plan.device(first_stage, k))
        outputs = boundary.outputs_to_replicas(setup.forward)
        refuse_spanning_outputs(view, outputs, spanning)
        forward_copies = copies.copy_forwards(view, plan, units, 1, setup.forward, setup.inputs,
                                              setup.mirrors, extra_inputs=outputs)
        bypassed = boundary.connect_inputs({k: forward_copies[(k, 0)] for k in range(replicas)})
        note = (f"split TaskGraphs {[tg.name for tg in view.split_taskgraphs]} run once on "
                f"{dict(plan.split_devices)}; {len(view.split_variables)} split variables; "
                f"{len(bypassed)} dispatch slices became all-to-all exchanges")
    step = view.steps[0]
    kept = checkpoint_copies(setup.checkpoints.get(id(step), []), forward_copies, replicas)
    # a loss computed by a split group over every worker is already the global mean
    multi_worker = communicator.num_workers > 1 and \
        view.taskgraph_of[step.loss.op].name not in spanning
    gradients, backward = global_gradients(view, plan, step, forward_copies, weights,
                                           setup.mirrors, multi_worker, kept)
    check = None
    if kept and check_gradients:
        # gradients without checkpointing (never run by the train op): the session
        # compares them with the checkpointed ones before the first step
        plain, _ = global_gradients(view, plan, step, forward_copies, weights, setup.mirrors,
                                    multi_worker)
        check = (plain[0], gradients[0])
    return Copies(forward_copies, gradients, {(0, 0): backward}, [note], presummed=True,
                  gradient_check=check)


def replica_split_copies(view, plan, setup, records: list, replica_device) -> dict:
    """Replica mode: the replicated forward ops and the split ops, copied per replica.

    A split op's copy runs on the split op's device and reads the replica's
    copies of its replicated inputs and the shared shards; dispatch slices and
    combine concats run on the replica's device (`replica_device(k)`), so only
    each device's share of the tokens travels (all-to-all).
    """
    on_replica = {t.op for record in records for t in record.slicers} | \
        {t.op for record in records for t in record.gathers}
    split_set = set(view.split_ops)
    ops = topological_order(setup.forward + view.split_ops)

    def device_of(op, k):
        if op in on_replica:
            return replica_device(k)
        if op in split_set:
            return op.device
        return None

    return copies.copy_forwards(view, plan, [(k, 0) for k in range(plan.num_replicas)], 1, ops,
                                setup.inputs, setup.mirrors, device_of=device_of)
