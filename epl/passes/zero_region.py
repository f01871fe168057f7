"""ZeRO for updates of many ops: gradient processing and the optimizer's ops on shards.

The zero pass (epl/passes/zero.py) shards an update that is one op per variable
(ResourceApplyAdam reading the reduced gradient). Real optimizers do more: Google
BERT's optimization.py clips the gradients by their global norm, then updates with
its own assign ops (AdamWeightDecayOptimizer). This module shards that whole
*update region*: the apply-phase ops of the step computed from the gradients and from
the values of the variables being trained and their optimizer state.

Each tensor of the region is either *sharded* (it has its variable's shape and is
computed element by element, so replica j computes shard j of it: a flat vector of
S = ceil(n / N) elements), or *global* (a scalar the same on every replica). The ops:
- a read of a trained variable: replica j's shard of its value (a slice of the
  replica's full copy); a read of its optimizer state: the replica's state shard;
- element-wise ops (ELEMENTWISE_TYPES) on shards and scalars: the same op on shards;
- an IdentityN (Keras optimizers pass all gradients through one): the same op on
  shards, each output following its own input's param;
- a sum over every element of a sharded tensor (`L2Loss`, `Sum` over all axes: the
  squared norms `clip_by_global_norm` adds): each replica's sum over its shard,
  all-reduced over the replicas and workers (DeepSpeed's clipping under ZeRO; the
  zero padding adds nothing);
- ops on global tensors only (the norm's square root, the clipping scale): the
  same op on each replica's copy of its inputs;
- writes: of a trained variable's value (assign, assign_add, assign_sub) the
  replica's new shard, all-gathered into every replica's full copy at the end; of
  optimizer state, the state shard; a one-op update (`ResourceApply*`) on the
  replica's working shard of the variable and its state shards, as the zero pass
  does.
Anything else that reads a sharded tensor is refused with the op named
(`RegionError`), and so is a sharded tensor the step reads outside the region.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import Phase
from epl.ir.clone import replace_control_inputs, replace_input
from epl.ir.graph_view import VARIABLE_OP_TYPES, topological_order, variable_written

# Element-wise op types (unary and binary, broadcasting only against scalars).
ELEMENTWISE_TYPES = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "Neg", "Abs", "Sign", "Square", "Sqrt", "Rsqrt", "Exp", "Log",
    "Reciprocal", "Tanh", "Sigmoid", "Identity", "Cast", "Floor", "Ceil", "Round", "SelectV2",
    "Select", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "IsFinite", "ZerosLike", "OnesLike", "ClipByValue", "AddN"})
# Identities of several tensors at once (Keras optimizers pass their gradients through
# one tf.identity_n): output i is input i, so output i follows input i's param.
PASS_THROUGH_TYPES = frozenset({"IdentityN"})
# Sums over every element: their shards' sums add up to the whole's.
SUM_TYPES = frozenset({"L2Loss", "Sum"})
_WRITE_VALUE = {"AssignVariableOp": "assign", "AssignAddVariableOp": "add",
                "AssignSubVariableOp": "sub", "Assign": "assign", "AssignAdd": "add",
                "AssignSub": "sub"}


class RegionError(ParallelizeError):
    """An update region ZeRO cannot shard (the message names the op and the remedy)."""


@dataclasses.dataclass
class Region:
    """The update region of a graph (module docstring).

    ops: the region's template ops, inputs first. params: trained variable op -> its
    template gradient tensor. owner: variable op (a param or its state) -> the param
    whose shape and sharding it shares. sharded: template tensor -> the param its
    shards follow; other region tensors are global. inputs: op -> its inputs as the
    user built them (the passes before zero rewire the originals' inputs to replica
    0's tensors).
    """

    ops: list
    params: dict
    owner: dict
    sharded: dict
    inputs: dict = dataclasses.field(default_factory=dict)
    param_of: dict = dataclasses.field(default_factory=dict)   # op -> the param it tags with


def _reads(op: tf.Operation) -> tf.Operation | None:
    """The variable a ReadVariableOp (or a reference variable's Identity) reads."""
    if op.type in ("ReadVariableOp", "Identity") and op.inputs \
            and op.inputs[0].op.type in VARIABLE_OP_TYPES:
        return op.inputs[0].op
    return None


def _handles(op: tf.Operation) -> list:
    return [t.op for t in op.inputs if t.op.type in VARIABLE_OP_TYPES
            and (t.dtype == tf.resource or t.dtype._is_ref_dtype)]


def _shape_of(var: tf.Operation) -> tf.TensorShape:
    if var.type == "VarHandleOp":
        return tf.TensorShape(var.get_attr("shape"))
    return var.outputs[0].shape


def find_region(view, level: str) -> Region:
    """The update region of `view`'s step (module docstring); RegionError when a part of
    it cannot be sharded. level: zero.level as set, for the messages."""
    params = {var: grad for grad, var in view.gradients}
    apply = {op for op in view.step_ops if view.phase_of.get(op) == Phase.APPLY}
    owner = {var: var for var in params}   # sparse gradients: refused by the zero pass
    region = _grow(apply, params, owner)
    while True:   # the optimizer state: what the region writes besides the params
        found = {}
        for op in sorted(region, key=lambda o: o.name):   # the same order on every worker
            written = variable_written(op)
            states = (_handles(op)[1:] if op.type.startswith("ResourceApply") else []) + (
                [written] if written is not None and written not in owner else [])
            for state in states:
                if state in owner or state in found:
                    continue
                param = _param_of(op, region, params, owner)
                if param is None or _shape_of(state) != _shape_of(param):
                    raise RegionError(
                        f"zero.level {level!r} cannot shard {op.name} ({op.type}): it updates "
                        f"{state.name} of shape {_shape_of(state)}, which is no trained "
                        "variable's state of the same shape. Use an optimizer whose state has "
                        "the shape of its variable (SGD, Momentum, Adam, Adagrad, RMSProp, "
                        "BERT's AdamWeightDecay), or turn ZeRO off (zero.level '').")
                found[state] = param
        if not found:
            break
        owner.update(found)
        region = _grow(apply, params, owner)
    ordered = topological_order(region)
    sharded = _classify(ordered, params, owner, level)
    _check_outside(view, region, sharded, level)
    first = next(iter(params))
    return Region(ordered, params, owner, sharded, {op: tuple(op.inputs) for op in ordered},
                  {op: _param_of(op, region, params, owner) or first for op in ordered})


def _param_of(op: tf.Operation, region: set, params: dict, owner: dict):
    """The trained variable an update op belongs to: the variable of a one-op update's
    first handle, or the one param whose gradient or value its value input is computed
    from element by element (not through a sum over elements: every gradient reaches
    each update through the global norm); None when there is not exactly one."""
    if op.type.startswith("ResourceApply"):
        return owner.get(_handles(op)[0])
    gradient_of = {id(grad): var for var, grad in params.items()}
    found, stack, seen = set(), list(op.inputs)[1:], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in gradient_of:
            found.add(gradient_of[id(tensor)])
        elif _reads(tensor.op) in owner:
            found.add(owner[_reads(tensor.op)])
        elif tensor.op in region and tensor.op.type in PASS_THROUGH_TYPES:
            stack.append(tensor.op.inputs[tensor.value_index])
        elif tensor.op in region and tensor.op.type not in SUM_TYPES:
            stack.extend(tensor.op.inputs)
    return found.pop() if len(found) == 1 else None


def _grow(apply: set, params: dict, owner: dict) -> set:
    """The apply-phase ops computed from the gradients and from reads of the region's
    variables, and the writes of those variables."""
    seeds = [op for op in apply if _reads(op) in owner]
    stack = [c for grad in params.values() for c in grad.consumers()] + seeds
    region = set()
    while stack:
        op = stack.pop()
        if op in region or op not in apply:
            continue
        region.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
    return region


def _classify(ordered: list, params: dict, owner: dict, level: str) -> dict:
    """template tensor -> the param its shards follow, for the sharded region tensors."""
    sharded = {grad: var for var, grad in params.items()}
    for op in ordered:
        read = _reads(op)
        inputs = [sharded.get(t) for t in op.inputs]
        follows = [p for p in inputs if p is not None]
        if read is not None and read in owner:
            sharded[op.outputs[0]] = owner[read]
        elif not follows or op.type in SUM_TYPES and _sums_everything(op):
            continue   # global (or a sum of a shard: global once summed over replicas)
        elif op.type in _WRITE_VALUE or op.type.startswith("ResourceApply"):
            continue
        elif op.type in PASS_THROUGH_TYPES:
            for index, out in enumerate(op.outputs):
                if inputs[index] is not None:
                    sharded[out] = inputs[index]
        elif op.type in ELEMENTWISE_TYPES and len({_shape_of(p) for p in follows}) == 1 and all(
                sharded.get(t) is not None or t.shape.rank == 0 for t in op.inputs):
            for out in op.outputs:
                sharded[out] = follows[0]
        else:
            raise RegionError(
                f"zero.level {level!r} cannot shard {op.name} ({op.type}) in the update of "
                f"{follows[0].name}: ZeRO computes the gradient processing and the update on "
                "1/N of each variable, element by element, and sums over the replicas only "
                "what adds up over elements (the squared norms of clip_by_global_norm). "
                "Compute the processing from those (tf.clip_by_global_norm, scaling by a "
                "scalar), or turn ZeRO off (zero.level '').")
    return sharded


def _sums_everything(op: tf.Operation) -> bool:
    """An L2Loss, or a Sum over every axis without keep_dims."""
    if op.type == "L2Loss":
        return True
    axes = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    return axes is not None and rank is not None and not op.get_attr("keep_dims") and \
        sorted(int(a) % max(rank, 1) for a in list(axes.reshape(-1))) == list(range(rank))


def _check_outside(view, region: set, sharded: dict, level: str) -> None:
    """No step op outside the region reads a sharded tensor (it never exists whole)."""
    for tensor, param in sharded.items():
        for consumer in tensor.consumers():
            if consumer not in region and consumer in view.step_ops \
                    and view.phase_of.get(consumer) == Phase.APPLY:
                raise RegionError(
                    f"zero.level {level!r} cannot shard the update of {param.name}: "
                    f"{consumer.name} ({consumer.type}) reads {tensor.name}, which ZeRO only "
                    "computes in shards. Read its norm (a sum over elements) instead, or turn "
                    "ZeRO off (zero.level '').")


@dataclasses.dataclass
class _Layout:
    """How one param's flat vector is cut: n elements, S per shard, N shards in all."""

    n: int
    size: int
    total: int

    @property
    def padded(self) -> int:
        return self.size * self.total


def shard_region(graph: tf.Graph, region: Region, replication, grads_of: dict, weights: list,
                 method: str, comm, rank: int, replicas: int, workers: int, tag, shard_variable,
                 read) -> dict:
    """Build every replica's sharded region (module docstring); return, per state
    variable op, its shard variable op per replica (for the checkpoint copies).

    grads_of: param -> [its gradient on each replica] (the flow's latest); weights:
    each replica's share of the global batch; tag(graph, var, k): a context tagging the
    ops built inside with var's TaskGraph, phase apply and replica k; shard_variable and
    read: the zero pass's helpers."""
    total = replicas * workers
    layouts = {p: _Layout(_shape_of(p).num_elements(), -(-_shape_of(p).num_elements() // total),
                          total) for p in region.params}
    devices = [replication.mirrors[next(iter(region.params))][k].device for k in range(replicas)]
    order = sorted(range(replicas), key=lambda k: devices[k])   # the collectives' rank order
    position = {k: i for i, k in enumerate(order)}
    index = {k: rank * replicas + position[k] for k in range(replicas)}
    built = [dict() for _ in range(replicas)]       # per replica: template tensor -> value
    done_ops = [dict() for _ in range(replicas)]    # per replica: template op -> built op
    states = {s: region.owner[s] for s in sorted(region.owner, key=lambda o: o.name)
              if s not in region.params}   # by name: every worker builds the same collectives
    state_shards = {s: [None] * replicas for s in states}
    current = [dict() for _ in range(replicas)]     # per replica: param -> its shard value now
    for param, layout in layouts.items():
        _scatter_gradient(graph, param, layout, grads_of[param], weights, method, comm, devices,
                          order, region, built, tag)
        for k in range(replicas):
            with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
                flat = _flat(read(replication.mirrors[param][k], param.get_attr("dtype")), layout)
                current[k][param] = flat[index[k] * layout.size:(index[k] + 1) * layout.size]
    for state, param in states.items():
        for k in range(replicas):
            with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
                state_shards[state][k] = shard_variable(state, k, layouts[param].size,
                                                        tf.as_dtype(state.get_attr("dtype")),
                                                        devices[k])
    for op in region.ops:
        param = region.param_of[op]
        if op.type in SUM_TYPES and region.sharded.get(region.inputs[op][0]) is not None:
            partial = []
            for k in range(replicas):
                with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
                    partial.append(_clone(graph, op, [built[k].get(t, t)
                                                      for t in region.inputs[op]],
                                          devices[k], done_ops[k]))
            summed = comm.all_reduce([partial[k].outputs[0] for k in order],
                                     [devices[k] for k in order], op="sum")
            for k in range(replicas):
                built[k][op.outputs[0]] = summed[position[k]]
                done_ops[k][op] = summed[position[k]].op
            continue
        for k in range(replicas):
            with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
                _build_one(graph, op, k, param, region, replication, built, done_ops, current,
                           state_shards, layouts, index, devices, read)
    _write_back(graph, region, replication, current, layouts, comm, devices, order, position,
                done_ops, tag)
    return state_shards


def _flat(value: tf.Tensor, layout: _Layout) -> tf.Tensor:
    flat = tf.reshape(value, [-1])
    return tf.pad(flat, [[0, layout.padded - layout.n]]) if layout.padded > layout.n else flat


def _scatter_gradient(graph, param, layout, grads, weights, method, comm, devices, order,
                      region, built, tag) -> None:
    """Each replica's gradient weighted by its share, reduce-scattered: replica j's
    value of the template gradient is shard j of the sum."""
    flats = []
    for k in order:
        with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
            flat = tf.reshape(grads[k], [-1])
            if method != "sum":
                flat = flat * tf.cast(weights[k], flat.dtype)
            flats.append(_flat(flat, layout))
    scattered = comm.reduce_scatter(flats, [devices[k] for k in order])
    for i, k in enumerate(order):
        built[k][region.params[param]] = scattered[i]


def _build_one(graph, op, k, param, region, replication, built, done_ops, current, state_shards,
               layouts, index, devices, read) -> None:
    """Replica k's sharded version of one region op (module docstring)."""
    copy = op if k == 0 else replication.replica_maps[k].get(op, op)
    template_inputs = region.inputs[op]

    def value(tensor):
        if tensor in built[k]:
            return built[k][tensor]
        # what replica k's copy reads there now (the passes before rewired it)
        return copy.inputs[template_inputs.index(tensor)]

    variable = _reads(op)
    if variable is not None and variable in region.params:
        built[k][op.outputs[0]] = current[k][variable]
        return
    if variable is not None and variable in state_shards:
        new = read(state_shards[variable][k], tf.as_dtype(variable.get_attr("dtype")))
        _wait(new.op, op, done_ops[k])
        built[k][op.outputs[0]], done_ops[k][op] = new, new.op
        return
    written = variable_written(op)
    if op.type in _WRITE_VALUE and written is not None:
        new_value = value(template_inputs[1])
        if written in region.params:
            mode, now = _WRITE_VALUE[op.type], current[k][written]
            current[k][written] = new_value if mode == "assign" else (
                now + new_value if mode == "add" else now - new_value)
            done_ops[k][op] = current[k][written].op
            return
        raw = {"assign": tf.raw_ops.AssignVariableOp, "add": tf.raw_ops.AssignAddVariableOp,
               "sub": tf.raw_ops.AssignSubVariableOp}[_WRITE_VALUE[op.type]]
        new = raw(resource=state_shards[written][k].outputs[0], value=new_value)
        _wait(new, op, done_ops[k])
        done_ops[k][op] = new
        return
    if op.type.startswith("ResourceApply"):
        _one_op_update(graph, op, template_inputs, k, param, value, current, state_shards,
                       layouts, devices, done_ops, read)
        return
    new = _clone(graph, op, [value(t) for t in template_inputs], devices[k], done_ops[k])
    done_ops[k][op] = new
    for out, new_out in zip(op.outputs, new.outputs):
        built[k][out] = new_out


def _one_op_update(graph, op, template_inputs, k, param, value, current, state_shards, layouts,
                   devices, done_ops, read) -> None:
    """A ResourceApply* op on a working shard of the param (loaded with its current
    shard value) and the state shards; the param's shard is then the working shard."""
    dtype = tf.as_dtype(param.get_attr("dtype"))
    working = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[layouts[param].size],
                                     shared_name=f"EPL_ZERO/{param.name}/work_{k}",
                                     name=f"{param.name}/work_{k}".replace(":", "_"))
    graph_mutation.set_device(working.op, devices[k])
    load = tf.raw_ops.AssignVariableOp(resource=working, value=current[k][param])
    handles = {param: working}
    handles.update({s: shards[k].outputs[0] for s, shards in state_shards.items()})
    inputs = []
    for tensor in template_inputs:
        var = tensor.op if tensor.op.type in VARIABLE_OP_TYPES else None
        inputs.append(handles[var] if var is not None and var in handles else value(tensor))
    new = _clone(graph, op, inputs, devices[k], done_ops[k])
    graph_mutation.add_control_inputs(new, [load])
    with tf.control_dependencies([new]):
        current[k][param] = read(working.op, dtype)
    done_ops[k][op] = new


def _clone(graph, op, inputs, device, done: dict) -> tf.Operation:
    """`op` with `inputs` on `device`, waiting for the region ops it waited for."""
    attrs = {key: val for key, val in op.node_def.attr.items() if key != "_class"}
    new = graph._create_op_internal(op.type, inputs, [o.dtype for o in op.outputs],
                                    name=op.name, attrs=attrs, op_def=op.op_def,
                                    compute_device=False)
    graph_mutation.set_device(new, device)
    _wait(new, op, done)
    return new


def _wait(new: tf.Operation, op: tf.Operation, done: dict) -> None:
    controls = [done[c] for c in op.control_inputs if c in done]
    if controls:
        graph_mutation.add_control_inputs(new, controls)


def _write_back(graph, region, replication, current, layouts, comm, devices, order, position,
                done_ops, tag) -> None:
    """Every param's new shards all-gathered into each replica's full copy; the ops that
    waited for a replica's region wait for its write-backs (and its state writes)."""
    replicas = len(devices)
    finished = [[] for _ in range(replicas)]
    for param, layout in layouts.items():
        gathered = comm.all_gather([current[k][param] for k in order], [devices[k] for k in order])
        for k in range(replicas):
            with tag(graph, param, k), tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
                full = gathered[position[k]]
                full = tf.reshape(full[:layout.n] if layout.padded > layout.n else full,
                                  _shape_of(param))
                finished[k].append(tf.raw_ops.AssignVariableOp(
                    resource=replication.mirrors[param][k].outputs[0], value=full))
    template_ops = set(region.ops)
    for k in range(replicas):
        finished[k] += [new for op, new in done_ops[k].items() if variable_written(op)
                        or op.type.startswith("ResourceApply")]
        with tf.device(devices[k]), tf.name_scope("EPL_ZERO"):
            done = tf.group(*finished[k])
        copies = {(op if k == 0 else replication.replica_maps[k].get(op)): done
                  for op in template_ops if variable_written(op) is not None
                  or op.type.startswith("ResourceApply")}
        copies.pop(None, None)
        members = set(op if k == 0 else replication.replica_maps[k].get(op) for op in template_ops)
        waiting = {w for copy in copies for w in copy._control_outputs if w not in members}
        for waiter in waiting:
            replace_control_inputs(waiter, copies)
        for op in template_ops:   # global values the step reads outside the region
            copy, new = (op if k == 0 else replication.replica_maps[k].get(op)), done_ops[k].get(op)
            if copy is None or new is None or len(new.outputs) != len(op.outputs):
                continue
            for out, template_out, new_out in zip(copy.outputs, op.outputs, new.outputs):
                if template_out not in region.sharded:
                    for reader in [c for c in out.consumers() if c not in members]:
                        replace_input(reader, out, new_out)
