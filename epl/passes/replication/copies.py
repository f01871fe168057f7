"""The copies of the model for every unit (replica, micro-batch): forward, backward, update.

- `copy_forwards`: the forward ops once per unit, reading the unit's batch
  (epl/passes/replication/inputs.py) and its replica's variables
  (mirrors.py), on the replica's devices; one import for all units.
- The backward ops of each unit, by the cheapest way that is correct:
  `copy_templates` copies the user's own backward ops (recorded at gradient
  time; epl/passes/replication/backward_copy.py rewrites the constants folded from the batch's
  static shapes when a unit's shapes differ); `copy_backward` copies the
  backward ops of another unit of the same shapes; `regenerate_gradients` runs
  autodiff on the unit's forward copy where neither is possible.
- `copy_apply`: the update ops of replica k > 0, reading its gradients;
  `rewire_replica0_apply`: the user's own update ops become replica 0's;
  `chain_train_ops`: the user's train op runs every replica's update.
- Random ops: a stateful random op with a seed (a graph seed set by
  `tf.compat.v1.set_random_seed`, or an op seed) would draw the same numbers
  in every copy; unit u > 0's copy gets its own seed2, derived from the
  template's seeds and u (`reseed`), so dropout masks differ per replica and
  micro-batch, and the same seeds and layout give the same run. Unit 0 keeps
  the template's seeds. Without any seed every kernel seeds itself.
"""
from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from epl.passes.recompute import checkpoints as recompute
from epl.ir import graph_mutation
from epl.ir.annotations import (MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR, Phase,
                                taskgraph_tag)
from epl.passes.replication.backward_copy import TemplateBackward
from epl.ir.clone import (NodeBatch, OpCopier, clone_ops, give_own_functions,
                          replace_control_inputs, replace_input)
from epl.ir.graph_view import VARIABLE_OP_TYPES, calls_functions, colocation_root
from epl.passes.replication.names import REPLICA_PREFIX, replica_attr, unit_prefix


def copy_forwards(view, plan, units, micro, forward, inputs, mirrors, extra_inputs=None,
                  device_of=None, own_functions: bool = False, pool=None) -> dict:
    """Copy the forward ops for each unit (replica k, micro-batch m), reading its
    batch (`inputs`, a UnitInputs) and replica k's variables, onto replica k's
    devices; one import for all units. Returns {unit: {template op: its copy}}.

    extra_inputs: {template tensor: [its value per replica]} read instead of the
    template tensor (what split ops return to the replicas). device_of: op ->
    device for ops that do not follow their TaskGraph's replica device.
    own_functions: give each unit's copies of v2 control-flow ops their own
    copies of the library functions they run (epl.ir.clone.give_own_functions:
    needed when each unit runs autodiff on its copy).
    A constant in `inputs.shape_constants` (a folded static shape of a
    batch-sized tensor, global mode) becomes a Shape op of the unit's copy of
    that tensor. Copies are named `EPL_REPLICA_<k>/` (plus
    `EPL_MICRO_BATCH_<m>/` when M > 1). pool: a ConstantPool (one copy of
    a constant per replica and device, epl.ir.clone) or None.
    """
    shape_consts = inputs.shape_constants
    shared = view.writes.shared_variables
    batch, sources, copiers = NodeBatch(view.graph), {}, {}
    for unit in units:
        k, m = unit
        input_map = unit_input_map(inputs.tensors, mirrors, k, k * micro + m)
        for tensor, values in (extra_inputs or {}).items():
            input_map[tensor] = values[k]
        attrs = replica_attr(k, m if micro > 1 else None)

        def device_fn(op, k=k):
            var = variable_read(op)
            if var is not None and var in mirrors:  # read where the variable lives
                return mirrors[var][k].device
            if var is not None and var in shared:  # one variable every unit adds into
                return var.device
            if device_of is not None:
                device = device_of(op, k)
                if device is not None:
                    return device
            return plan.device(view.taskgraph_of[op], k)

        copier = copiers[unit] = OpCopier(view.graph, unit_prefix(k, m, micro), device_fn,
                                          input_map, attrs, cache=sources, batch=batch,
                                          stream=k * micro + m, constants=pool)
        for op in forward:
            if op in shape_consts:
                source = shape_consts[op]
                copier.substitute(op, _shape_node(op, copier.input(source), source.dtype,
                                                  copier.new_name(op), device_fn(op), attrs))
            else:
                copier.copy(op)
        copier.close()
    created = batch.commit()
    copies = {unit: copier.result(created) for unit, copier in copiers.items()}
    if own_functions:
        for (k, m), op_map in copies.items():
            for template, copy in op_map.items():
                if calls_functions(template):
                    give_own_functions(copy, f"epl_unit_{k * micro + m}")
    return copies


def regenerate_gradients(view, plan, unit, micro, forward_map, mirrors,
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
        tag_backward(graph.get_operations()[first:], k, plan.device(view.taskgraphs[0], k),
                     m if micro > 1 else None)
        grads_out.extend(grads)
    return grads_out


def backward_only(new_ops: list, forward_map: dict) -> list:
    """The ops a unit's autodiff created, less those that feed its forward copies,
    which are retagged forward: v2 control flow's gradient gives the forward While
    the accumulators of its intermediates as new inputs (run before the loss, so
    the pipeline schedule must not order them after the forward)."""
    created = set(new_ops)
    stack = [t.op for op in forward_map.values() for t in op.inputs if t.op in created]
    feeding = set()
    while stack:   # the new ops a forward copy reads, and what they read of the new ops
        op = stack.pop()
        if op not in feeding:
            feeding.add(op)
            stack.extend(t.op for t in op.inputs if t.op in created)
    if not feeding:
        return list(new_ops)
    phase = tf.compat.v1.AttrValue(s=Phase.FORWARD.value.encode())
    for op in feeding:
        graph_mutation.set_attr(op, PHASE_ATTR, phase)
    return [op for op in new_ops if op not in feeding]


def copy_templates(view, plan, amp_on: bool, checkpoints, units, micro, forward_copies, slices,
                   mirrors, pool=None) -> tuple[dict, list]:
    """The template's backward ops copied for every unit they can be copied for
    (reading the unit's forward copies, slices and variables, batch-derived
    constants rewritten), in one import.

    Returns ({unit: (its gradients, its backward ops)}, [why autodiff is needed
    for the other units]).
    """
    why_not = TemplateBackward.unusable(view, view.steps, amp_on,
                                        checkpoints)
    if why_not:
        return {}, [why_not]
    template = TemplateBackward(view, view.steps)
    constants_by_shape, reasons, writers = {}, [], {}
    batch = NodeBatch(view.graph)
    for unit in units:
        k, m = unit
        key = slice_shapes(slices, k * micro + m)
        if key not in constants_by_shape:
            constants_by_shape[key] = template.constant_values(forward_copies[unit])
            if constants_by_shape[key][1]:
                reasons.append(constants_by_shape[key][1])
        constants, why_not = constants_by_shape[key]
        if why_not:
            continue
        input_map = unit_input_map(slices, mirrors, k, k * micro + m)
        devices = {plan.device(tg, 0): plan.device(tg, k) for tg in view.taskgraphs}
        writers[unit] = (template.write(
            batch, unit_prefix(k, m, micro),
            lambda op, devices=devices: devices.get(op.device, op.device),
            input_map, replica_attr(k, m if micro > 1 else None), forward_copies[unit],
            constants, stream=k * micro + m, pool=pool), input_map)
    try:
        created = batch.commit()
    except (ValueError, tf.errors.InvalidArgumentError) as err:  # shape inference refused it
        return {}, reasons + [f"copying the template failed: {str(err).splitlines()[0]}"]
    return {unit: template.gradients(copier, created, input_map, forward_copies[unit])
            for unit, (copier, input_map) in writers.items()}, reasons


def copy_backward(view, plan, source, unit, micro, source_grads, source_ops,
                  source_forward, forward_map, slices, mirrors, pool=None) -> list:
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
    op_map = clone_ops(source_ops, unit_prefix(k, m, micro),
                       lambda op: devices.get(op.device, op.device), input_map,
                       replica_attr(k, m if micro > 1 else None), known=known,
                       stream=k * micro + m, constants=pool)

    def mapped(tensor):
        if tensor is None:
            return None
        if isinstance(tensor, tf.IndexedSlices):
            return tf.IndexedSlices(mapped(tensor.values), mapped(tensor.indices),
                                    mapped(tensor.dense_shape))
        copy = op_map.get(tensor.op) or known.get(tensor.op)
        return copy.outputs[tensor.value_index] if copy is not None else input_map.get(tensor, tensor)
    return [mapped(g) for g in source_grads]


def copy_apply(view, plan, k, apply_ops, slices, mirrors, forward_map, grads, micro: int,
               batch: NodeBatch, shared_sparse: dict | None = None) -> OpCopier:
    """Write the copies of the update (apply) ops for replica k > 0 (reading its
    gradients, micro-batch 0's until the accumulate pass) into `batch`; the returned copier's `result` maps
    them once the batch is committed. shared_sparse: {original values or indices:
    what every replica reads instead} of sparse gradients computed once for all
    replicas (split variables')."""
    input_map = unit_input_map(slices, mirrors, k, k * micro)
    input_map.update(gradient_map(view, grads))
    input_map.update(shared_sparse or {})
    copier = OpCopier(view.graph, REPLICA_PREFIX.format(k),
                      lambda op: plan.device(view.taskgraph_of[op], k), input_map,
                      replica_attr(k), known=forward_map, batch=batch)
    for op in apply_ops:
        copier.copy(op)
    copier.close()
    return copier


def rewire_replica0_apply(apply_ops, forward_map, grads_and_map) -> None:
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


def chain_train_ops(view, replica_maps) -> None:
    """The user's train op also runs every other replica's update."""
    for train_op in view.train_ops:
        copies = [m[train_op] for m in replica_maps[1:] if train_op in m]
        if copies:
            graph_mutation.add_control_inputs(train_op, copies)


def variable_read(op: tf.Operation) -> tf.Operation | None:
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


def gradient_map(view, grads) -> dict:
    """Original dense gradient tensors -> this replica's gradients.

    Sparse gradients (IndexedSlices) are not mapped: the update ops keep
    reading the original's values and indices, whose static shapes are those
    of the whole batch, until the gradient pass feeds them every replica's
    gathered rows (which have that same shape).
    """
    return {orig: new for (orig, _), new in zip(view.gradients, grads)
            if not isinstance(orig, tf.IndexedSlices)}


def tag_backward(ops, replica: int, fallback_device: str, micro_batch: int | None = None) -> None:
    """Phase, replica, micro-batch, TaskGraph and device of regenerated backward ops."""
    phase = tf.compat.v1.AttrValue(s=Phase.BACKWARD.value.encode())
    replica_attr = tf.compat.v1.AttrValue(i=replica)
    micro_attr = None if micro_batch is None else tf.compat.v1.AttrValue(i=micro_batch)
    for op in ops:
        graph_mutation.set_attr(op, PHASE_ATTR, phase)
        graph_mutation.set_attr(op, REPLICA_ATTR, replica_attr)
        if micro_attr is not None:
            graph_mutation.set_attr(op, MICRO_BATCH_ATTR, micro_attr)
        producers = [t.op for t in op.inputs] + list(op.control_inputs)
        # the replica's own ops first: an op every replica shares (a fed placeholder
        # that is not copied) sits on replica 0's device
        source = colocation_root(op) or next(
            (producer for producer in producers if _int_attr(producer, REPLICA_ATTR) == replica),
            None) or next(
            (producer for producer in producers
             if taskgraph_tag(producer) is not None), None)
        taskgraph = taskgraph_tag(source) if source is not None else None
        if taskgraph is not None:
            graph_mutation.set_attr(op, TASKGRAPH_ATTR, tf.compat.v1.AttrValue(s=taskgraph.encode()))
        graph_mutation.set_device(
            op, source.device if source is not None and source.device else fallback_device)


def _int_attr(op: tf.Operation, name: str) -> int | None:
    """op's int attribute `name`, or None."""
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


def slice_shapes(slices: dict, index: int) -> tuple:
    """The static shapes of unit `index`'s slices (None where unknown): units with
    equal shapes can share one autodiff."""
    return tuple(tuple(parts[index].shape.as_list()) if parts[index].shape.rank is not None
                 else None for parts in slices.values())


def unit_input_map(slices: dict, mirrors: dict, k: int, index: int) -> dict:
    """What a copy for replica k reads instead of the template's inputs: slice
    `index` of each batch input and replica k's copy of each variable."""
    input_map = {t: parts[index] for t, parts in slices.items()}
    input_map.update({var.outputs[0]: copies[k].outputs[0] for var, copies in mirrors.items()})
    return input_map
