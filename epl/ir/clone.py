"""Copying ops inside one graph (for replicas and micro-batches).

`clone_ops` copies a list of ops (in creation order, so inputs come first)
under a name prefix, onto the devices `device_fn` gives, with inputs remapped:
a tensor in `input_map` is replaced by its value there, a tensor produced by an
op being copied by that op's copy, any other tensor is shared. Colocation
attributes are dropped (the copy gets an explicit device instead); `extra_attrs`
are set on every copy. Returns old op -> new op.
"""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

COLOCATION_ATTR = "_class"


def _mapped(tensor: tf.Tensor, input_map: dict, op_map: dict) -> tf.Tensor:
    if tensor in input_map:
        return input_map[tensor]
    copy = op_map.get(tensor.op)
    return copy.outputs[tensor.value_index] if copy is not None else tensor


def clone_op(op: tf.Operation, inputs: list[tf.Tensor], name: str, device: str,
             extra_attrs: dict | None = None) -> tf.Operation:
    """Create a copy of `op` with `inputs`, called `name`, on `device`."""
    attrs = {k: v for k, v in op.node_def.attr.items() if k != COLOCATION_ATTR}
    attrs.update(extra_attrs or {})
    new = op.graph._create_op_internal(
        op.type, inputs, [out.dtype for out in op.outputs], input_types=list(op._input_types),
        name=name, attrs=attrs, op_def=op.op_def, compute_device=False)
    new._set_device(device)
    return new


def clone_ops(ops: list[tf.Operation], prefix: str, device_fn: Callable[[tf.Operation], str],
              input_map: dict | None = None, extra_attrs: dict | None = None,
              known: dict | None = None) -> dict:
    """Copy `ops` (creation order) under `prefix`; return {old op: new op}.

    known: copies made earlier (old op -> new op) that inputs should resolve to.
    """
    input_map = input_map or {}
    op_map: dict = dict(known or {})
    for op in ops:
        inputs = [_mapped(t, input_map, op_map) for t in op.inputs]
        op_map[op] = clone_op(op, inputs, f"{prefix}/{op.name}", device_fn(op), extra_attrs)
    copies = {op: op_map[op] for op in ops}
    for op, new in copies.items():
        controls = [op_map.get(c, c) for c in op.control_inputs]
        if controls:
            new._add_control_inputs(controls)
    return copies


def replace_input(op: tf.Operation, old: tf.Tensor, new: tf.Tensor) -> None:
    """Make `op` read `new` wherever it read `old`."""
    for index, tensor in enumerate(op.inputs):
        if tensor is old:
            op._update_input(index, new)


def replace_control_inputs(op: tf.Operation, mapping: dict) -> None:
    """Replace control inputs of `op` found in `mapping` (old op -> new op)."""
    controls = list(op.control_inputs)
    if any(c in mapping for c in controls):
        op._remove_all_control_inputs()
        op._add_control_inputs([mapping.get(c, c) for c in controls])
