"""ZeRO stage 1 (`zero.level: "v1"`): optimizer state and update sharded over replicas.

`zero.level: "v0"` (EPL's level that partitions only the optimizer states and
all-reduces whole gradients) runs this same sharding: the same updates, with
less gradient memory and traffic (a reduce-scatter instead of an all-reduce).

With N data-parallel replicas in all (R local replicas on each of W workers,
N = R x W), every replica keeps its full copy of the parameters (as in plain
data parallelism) but only 1/N of each optimizer slot (Adam's moments,
momentum accumulators), and runs only 1/N of each update. Per trainable
variable v with n elements (S = ceil(n / N) elements per shard, the flat
vector zero-padded to N x S):

1. each replica's (accumulated) gradient is flattened, weighted by its share
   of the global batch (as gradient_comm does; not with
   `communication.gradients_reduce_method: sum`), padded, and
   reduce-scattered (`Communicator.reduce_scatter`: TensorFlow collectives
   among local devices, Horovod across workers): replica j gets the sum of
   shard j only;
2. replica j copies shard j of its parameter into a shard-sized working
   variable and runs the optimizer's own update op on it, with its shard of
   every slot and the reduced gradient shard (the update op is the
   optimizer's, cloned with shard-sized inputs, so any optimizer whose update
   is one op reading the variable, its slots and the gradient works: SGD,
   Momentum, Adam, Adagrad, RMSProp...);
3. the updated shards are all-gathered (`Communicator.all_gather`, the
   inverse order of reduce_scatter) and written back into every replica's
   parameter copy.

Every op that waited for the replica's original update op (the optimizer's
"finish" ops: Adam's beta powers, the global step increment) waits for the
write-back instead; the original update ops and the replicas' full-size slot
mirrors are no longer run, so they are never initialized and take no memory
(the original update op moves to the host with the slots it names, see _detach).
Shard index of replica k on worker w: w x R + (position of k's device among
the variable's replica devices, sorted by name).

Checkpoints. The original (single-device) slot variables keep their names and
full shapes and stay in the graph as the checkpoint copies: after a run that
writes them (initialization, restore) the session loads every shard from them
(the sync ops the replicate pass introduced, replaced here for slots), and
before a run that reads them (a Saver's save) it gathers the shards into them
(`ZeroSharding.gather_ops`, run by the session). They live on the host device
and are not touched by a training step.

Bad input, refused before any rewrite (`validate`): a split (tensor-parallel)
TaskGraph; gradients processed between compute_gradients and apply_gradients
(clipping by global norm needs every replica to see the whole reduced
gradient, which ZeRO never materializes); sparse gradients; reference
(non-resource) variables; a variable updated by several ops or with state of
another shape.

Measuring: `optimizer_state_bytes(graph, train_ops)` sums, per device, the
bytes of the optimizer-state variables a training step reads: the variables an
update op takes as a handle besides the one it updates.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tensorflow as tf

from epl.errors import ParallelizeError, PassError
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.clone import replace_control_inputs
from epl.ir.graph_view import VARIABLE_OP_TYPES, TrainingView, ancestors
from epl.passes.gradient_flow import ReplicaGradients
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.replication.result import Replication
from epl.passes.zero_region import Region, find_region, shard_region
from epl.planner.plan import Plan
from epl.runtime.variable_access import writes_variable

SCOPE = "EPL_ZERO"


@dataclasses.dataclass
class ZeroSharding:
    """What the ZeRO pass built, for the passes after it and for the session.

    reduced: variable op name -> 1 for every variable whose gradient this pass
      reduced (gradient_comm skips them; verify counts them).
    shards: original variable op -> per replica, {original slot variable op:
      its shard variable op} (plus the working parameter shard under the
      variable itself).
    gather_ops: original slot variable op -> op that gathers its shards into it.
    num_shards: N, the data-parallel replicas over all workers.
    sync_ops: original slot variable op -> op that writes it into its shards (the
      session runs it after a restore, beside the replicate pass's sync ops).
    """

    reduced: dict
    shards: dict
    gather_ops: dict
    num_shards: int
    sync_ops: dict = dataclasses.field(default_factory=dict)


def _is_apply(op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(PHASE_ATTR)
    return attr is not None and attr.s.decode() == Phase.APPLY.value


def _handle_inputs(op: tf.Operation) -> list[tuple[int, tf.Operation]]:
    """(input index, variable op) of every variable handle (resource or ref) `op` takes."""
    return [(i, t.op) for i, t in enumerate(op.inputs)
            if t.op.type in VARIABLE_OP_TYPES and (t.dtype == tf.resource or t.dtype._is_ref_dtype)]


def _handles_of(op: tf.Operation) -> list[tf.Operation]:
    """The variable ops whose handles `op` takes, in input order."""
    return [var for _, var in _handle_inputs(op)]


def _updates(var: tf.Operation) -> list[tf.Operation]:
    """Apply-phase ops that take `var`'s handle as their first input and write it."""
    return [c for c in var.outputs[0].consumers()
            if _is_apply(c) and c.inputs and c.inputs[0] is var.outputs[0]
            and c.type not in ("ReadVariableOp", "VarIsInitializedOp", "Identity")]


def _var_shape(var: tf.Operation) -> tf.TensorShape:
    if var.type == "VarHandleOp":
        return tf.TensorShape(var.get_attr("shape"))
    return var.outputs[0].shape


def _var_dtype(var: tf.Operation) -> tf.DType:
    return tf.as_dtype(var.get_attr("dtype")).base_dtype


def optimizer_state_bytes(graph: tf.Graph, train_ops) -> dict[str, int]:
    """Per device, bytes of the optimizer state a training step reads.

    Optimizer state: every variable an update op (an op one step runs that
    takes a variable handle as its first input and writes it) takes as a
    further handle: Adam's moments, momentum accumulators, and ZeRO's shards of
    them. Read from the placed graph (the variable ops' devices and shapes).
    """
    step = ancestors(train_ops)
    state: set[tf.Operation] = set()
    for op in step:
        handles = _handle_inputs(op)
        # an update: it writes the handle it takes first (a read or a gather does not)
        if handles and handles[0][0] == 0 and writes_variable(op, 0):
            state.update(var for _, var in handles[1:])
    totals: dict[str, int] = {}
    for var in state:
        shape = _var_shape(var)
        size = int(np.prod(shape.as_list())) * _var_dtype(var).size
        totals[var.device] = totals.get(var.device, 0) + size
    return totals


class ProcessedGradients(ParallelizeError):
    """The update of a variable is not one op reading its gradient (gradient processing,
    or an optimizer of several ops): the update region is sharded instead
    (epl/passes/zero_region.py)."""


def _check(view, level: str) -> list:
    """Per trainable gradient (gradient, variable op, its update op, slot variable ops).

    level: zero.level as set ('v0' runs as 'v1', epl/config.py), for the messages.
    Raises ParallelizeError naming what ZeRO cannot shard, why, and the fix.
    """
    entries = []
    split_vars = set(getattr(view, "split_variables", []))
    for grad, var in view.gradients:
        if var in split_vars:  # epl.split variables are sharded already (not replicated)
            continue
        if isinstance(grad, tf.IndexedSlices):
            raise ParallelizeError(
                f"zero.level {level!r} cannot shard the sparse gradient of {var.name} (an embedding "
                "lookup): its rows are gathered, not reduced. Set "
                "communication.sparse_as_dense: True to reduce it as a dense tensor.")
        if var.type != "VarHandleOp":
            raise ParallelizeError(
                f"zero.level {level!r} needs resource variables, but {var.name} is a reference "
                f"variable ({var.type}). Create variables with use_resource=True (or call "
                "tf.compat.v1.enable_resource_variables()).")
        if not _var_shape(var).is_fully_defined():
            raise ParallelizeError(
                f"zero.level {level!r} needs static variable shapes; {var.name} has shape "
                f"{_var_shape(var)}.")
        updates = _updates(var)
        if len(updates) != 1 or not any(t is grad for t in updates[0].inputs):
            # what processes it, as analysed (the user's ops between compute_gradients and
            # apply_gradients carry no phase tag before the annotate pass runs)
            readers = [c for c in grad.consumers() if view.phase_of.get(c) == Phase.APPLY]
            what = ", ".join(f"{c.name} ({c.type})" for c in readers[:4]) or "nothing"
            raise ProcessedGradients(
                f"the gradient of {var.name} is read by {what}, not by one update op")
        update = updates[0]
        slots = []
        for _, state in _handle_inputs(update)[1:]:
            if _var_shape(state) != _var_shape(var):
                raise ParallelizeError(
                    f"zero.level {level!r} cannot shard the update {update.name} ({update.type}) of "
                    f"{var.name}: it also uses {state.name} of shape {_var_shape(state)}, not the "
                    f"variable's shape {_var_shape(var)}. Use an optimizer whose state has the "
                    "shape of the variable (SGD, Momentum, Adam, Adagrad, RMSProp).")
            slots.append(state)
        entries.append((grad, var, update, slots))
    return entries


class ZeroPass(GraphPass):
    """Shards optimizer slots and updates over the data-parallel replicas (zero.level v1)."""

    name = "zero"
    requires = (TrainingView, Plan, Replication, ReplicaGradients)   # reduces the gradients
    provides = (ZeroSharding,)
    after = ("accumulate", "unscale")   # as they left them

    off_note = "zero.level is off"

    def validate(self, graph: tf.Graph, ctx: PassContext):
        """The variables to shard, from the template (run() reads them: after the
        replicate pass the gradients no longer feed the updates directly): one update
        op per variable, or else the update region (gradient processing, an optimizer
        of several ops; epl/passes/zero_region.py)."""
        view, level = ctx.get(TrainingView), self.options.level
        try:
            return _check(view, level)
        except ProcessedGradients:
            return find_region(view, level)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        replication = ctx.get(Replication)
        comm = ctx.communicator
        replicas, workers = ctx.get(Plan).num_replicas, comm.num_workers
        total = replicas * workers
        if total == 1:
            ctx.provide(ZeroSharding({}, {}, {}, 1))
            logging.getLogger(__name__).warning(
                "zero.level %r: one data-parallel replica in all, nothing to shard.",
                self.options.level)
            return PassResult(notes=["one data-parallel replica: nothing to shard"],
                              modified=False)
        rank = comm.worker_rank
        entries = ctx.validated.get(self.name)
        if entries is None:   # the caller did not validate (a pass run alone)
            raise PassError("the zero pass reads what its validate() found on the graph as the "
                            "user built it: validate the pipeline before running it")
        grads_of = {var: grads for var, grads, _ in ctx.get(ReplicaGradients).entries}
        method = self.options.reduce_method
        if replication.presummed:  # split models: gradients already weighted by batch share
            method = "sum"
        before = set(graph.get_operations())
        result = ZeroSharding({}, {}, {}, total)
        slot_shards: dict = {}  # slot op -> [shard var per replica]
        if isinstance(entries, Region):
            slot_shards = shard_region(graph, entries, replication, grads_of,
                                       replication.weights, method, comm, rank, replicas,
                                       workers, _TagNewOps, _shard_variable, _read)
            result.reduced.update({var.name: 1 for var in entries.params})
            for op in entries.ops:   # a one-op update takes the slots, which move to the host
                if op.type.startswith("ResourceApply") and _handles_of(op):
                    _detach(op, _handles_of(op)[0], ctx.cluster.host_device)
            entries = []
        split_vars = set(ctx.get(TrainingView).split_variables)   # sharded by epl.split: left alone
        entries = [entry for entry in entries if entry[1] not in split_vars]
        for grad, var, update, slots in entries:
            mirrors = replication.mirrors[var]
            updates = [update] + [replication.replica_maps[k][update] for k in range(1, replicas)]
            built = self._shard_one(graph, var, slots, mirrors, replication.mirrors, updates,
                                    grads_of[var], replication.weights, method, comm, rank,
                                    replicas, workers)
            result.shards[var] = built
            result.reduced[var.name] = 1
            if slots:
                _detach(update, var, ctx.cluster.host_device)
            for slot in slots:
                slot_shards[slot] = [b[slot] for b in built]
        for slot, shards in slot_shards.items():
            sync, gather = self._checkpoint_ops(slot, shards, comm, ctx.cluster.host_device,
                                                rank, replicas, workers)
            result.sync_ops[slot] = sync
            result.gather_ops[slot] = gather
            _to_host(slot, ctx.cluster.host_device)  # the checkpoint copy
        ctx.provide(result)
        added = [op.name for op in graph.get_operations() if op not in before]
        return PassResult(added=added, notes=[
            f"{len(entries)} variables: optimizer state and update sharded over {total} replicas "
            f"({replicas} local x {workers} workers), {len(slot_shards)} slot variables"])

    # -- one variable --------------------------------------------------------
    @staticmethod
    def _shard_one(graph, var, slots, mirrors, all_mirrors, updates, grads, weights, method,
                   comm, rank, replicas, workers) -> list[dict]:
        """Reduce-scatter, sharded update and all-gather of one variable; returns, per
        replica, {var: working parameter shard, slot: slot shard}."""
        shape = _var_shape(var)
        n = shape.num_elements()
        total = replicas * workers
        size = -(-n // total)
        padded = size * total
        dtype = _var_dtype(var)
        devices = [m.device for m in mirrors]
        order = sorted(range(replicas), key=lambda k: devices[k])  # collective rank order
        position = {k: i for i, k in enumerate(order)}
        flats = []
        for k in order:
            with _TagNewOps(graph, var, k), tf.device(devices[k]), tf.name_scope(SCOPE):
                flat = tf.reshape(grads[k], [-1])
                if method != "sum":
                    flat = flat * tf.cast(weights[k], flat.dtype)
                flats.append(tf.pad(flat, [[0, padded - n]]) if padded > n else flat)
        scattered = comm.reduce_scatter(flats, [devices[k] for k in order])
        built, new_shards = [], [None] * replicas
        for k in range(replicas):
            index = rank * replicas + position[k]
            with _TagNewOps(graph, var, k), tf.device(devices[k]), tf.name_scope(SCOPE):
                shards = {state: _shard_variable(state, k, size, dtype, devices[k])
                          for state in [var] + slots}
                full = tf.reshape(_read(mirrors[k], dtype), [-1])
                if padded > n:
                    full = tf.pad(full, [[0, padded - n]])
                load = tf.raw_ops.AssignVariableOp(resource=shards[var].outputs[0],
                                                   value=full[index * size:(index + 1) * size])
                handle_map = {mirrors[k].outputs[0]: shards[var].outputs[0]}
                handle_map.update({all_mirrors[s][k].outputs[0]: shards[s].outputs[0] for s in slots})
                handle_map[grads[k]] = scattered[position[k]]
                update = updates[k]
                inputs = [handle_map.get(t, t) for t in update.inputs]
                attrs = {key: value for key, value in update.node_def.attr.items() if key != "_class"}
                sharded = graph._create_op_internal(
                    update.type, inputs, [o.dtype for o in update.outputs],
                    input_types=list(update._input_types), name=f"{update.name}_shard",
                    attrs=attrs, op_def=update.op_def, compute_device=False)
                graph_mutation.set_device(sharded, devices[k])
                graph_mutation.add_control_inputs(sharded, [load] + list(update.control_inputs))
                with tf.control_dependencies([sharded]):
                    new_shards[k] = _read(shards[var], dtype)
            built.append(shards)
        gathered = comm.all_gather([new_shards[k] for k in order], [devices[k] for k in order])
        for k in range(replicas):
            with _TagNewOps(graph, var, k), tf.device(devices[k]), tf.name_scope(SCOPE):
                value = gathered[position[k]]
                value = tf.reshape(value[:n] if padded > n else value, shape)
                write = tf.raw_ops.AssignVariableOp(resource=mirrors[k].outputs[0], value=value)
            for waiting in list(updates[k]._control_outputs):
                replace_control_inputs(waiting, {updates[k]: write})
        return built

    @staticmethod
    def _checkpoint_ops(slot, shards, comm, host, rank, replicas, workers):
        """(op loading every shard from the original slot, op gathering them into it)."""
        graph = slot.graph
        devices = [s.device for s in shards]
        order = sorted(range(replicas), key=lambda k: devices[k])
        dtype = _var_dtype(slot)
        shape = _var_shape(slot)
        n = shape.num_elements()
        size = _var_shape(shards[0]).num_elements()
        with tf.name_scope(f"{SCOPE}_SYNC"):
            with _TagNewOps(graph, slot, 0), tf.device(host):
                value = _read(slot, dtype)
                assigns = []
                if comm.num_workers > 1:  # every worker starts from worker 0's state
                    value = comm.workers_broadcast(value, 0)
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=slot.outputs[0], value=value))
                flat = tf.reshape(value, [-1])
                if size * replicas * workers > n:
                    flat = tf.pad(flat, [[0, size * replicas * workers - n]])
            for i, k in enumerate(order):
                index = rank * replicas + i
                with _TagNewOps(graph, slot, k), tf.device(devices[k]):
                    assigns.append(tf.raw_ops.AssignVariableOp(
                        resource=shards[k].outputs[0], value=flat[index * size:(index + 1) * size]))
            with _TagNewOps(graph, slot, 0), tf.device(host):
                sync = tf.group(*assigns)
        with tf.name_scope(f"{SCOPE}_GATHER"):
            reads = []
            for k in order:
                with _TagNewOps(graph, slot, k), tf.device(devices[k]):
                    reads.append(_read(shards[k], dtype))
            gathered = comm.all_gather(reads, [devices[k] for k in order])
            # every member of a collective must run, or the others wait forever
            with _TagNewOps(graph, slot, 0), tf.device(host), tf.control_dependencies(gathered[1:]):
                gather = tf.raw_ops.AssignVariableOp(
                    resource=slot.outputs[0], value=tf.reshape(gathered[0][:n], shape))
        return sync, gather


class _TagNewOps:
    """Context manager: ops created inside get `source`'s TaskGraph, phase apply and replica k."""

    def __init__(self, graph: tf.Graph, source: tf.Operation, replica: int):
        self.graph, self.source, self.replica = graph, source, replica

    def __enter__(self):
        self.first = len(self.graph.get_operations())
        return self

    def __exit__(self, *exc):
        phase = tf.compat.v1.AttrValue(s=Phase.APPLY.value.encode())
        for op in self.graph.get_operations()[self.first:]:
            if TASKGRAPH_ATTR in self.source.node_def.attr:
                graph_mutation.set_attr(op, TASKGRAPH_ATTR,
                                        self.source.node_def.attr[TASKGRAPH_ATTR])
            graph_mutation.set_attr(op, PHASE_ATTR, phase)
            graph_mutation.set_attr(op, REPLICA_ATTR, tf.compat.v1.AttrValue(i=self.replica))
        return False


def _to_host(slot: tf.Operation, host: str) -> None:
    """Place an original slot variable, the ops on its handle and its initial value
    on the host. Optimizers create slots colocated with their variable (the `_class`
    attribute); that colocation is dropped, or TensorFlow would keep them together."""
    groups = set(slot.colocation_groups()) - {f"loc:@{slot.name}".encode()}
    users = [slot] + list(slot.outputs[0].consumers())
    inputs = [t.op for op in users[1:] for t in op.inputs
              if t.op is not slot and groups & set(t.op.colocation_groups())
              and all(c in users for c in t.consumers())]
    for op in users + inputs:
        if groups & set(op.colocation_groups()):
            graph_mutation.clear_attr(op, "_class")
        graph_mutation.set_device(op, host)


def _detach(update: tf.Operation, var: tf.Operation, host: str) -> None:
    """Let the original (no longer run) update op sit on the host with the slots.

    TensorFlow places every op of the graph, run or not, and an op's variable
    handles must all be on one device: the original slots move to the host
    (checkpoint copies), so the original update op, which takes them, moves too,
    reading a never-initialized full-size stand-in for the parameter instead of
    the parameter itself (which stays on its device).
    """
    with tf.device(host), tf.name_scope(SCOPE):
        stand_in = tf.raw_ops.VarHandleOp(dtype=_var_dtype(var), shape=_var_shape(var),
                                          shared_name=f"{SCOPE}/{var.name}/unused",
                                          name=f"{var.name.replace(':', '_')}_unused")
    for name in (TASKGRAPH_ATTR, PHASE_ATTR):
        if name in var.node_def.attr:
            graph_mutation.set_attr(stand_in.op, name, var.node_def.attr[name])
    graph_mutation.update_input(update, 0, stand_in)
    graph_mutation.set_device(update, host)


def _shard_variable(state: tf.Operation, replica: int, size: int, dtype: tf.DType,
                    device: str) -> tf.Operation:
    """A resource variable of `size` elements holding replica `replica`'s shard of `state`."""
    name = f"{state.name}/shard_{replica}"
    handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[size], shared_name=f"{SCOPE}/{name}",
                                    name=name.replace(":", "_"))
    graph_mutation.set_device(handle.op, device)
    return handle.op


def _read(var: tf.Operation, dtype: tf.DType) -> tf.Tensor:
    return tf.raw_ops.ReadVariableOp(resource=var.outputs[0], dtype=dtype)
