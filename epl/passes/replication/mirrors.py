"""Every replica's own copy of the variables it reads, and the ops that keep them equal.

Replica 0 uses the user's variables; replica k > 0 gets a mirror of each
variable the replicated ops read, on its own device (`mirror_variables`). A
`sync` op per variable copies the original into its mirrors (`sync_ops`); the
session runs it after a run that wrote the original (initialization, restore,
an assign), so the replicas start identical and stay identical (same reduced
gradients, same update). With several workers the value is worker 0's
(broadcast), written into the original too.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from epl.ir.clone import NodeBatch, copy_node_def
from epl.passes.replication.names import REPLICA_PREFIX, replica_attr


def mirror_variables(view, plan) -> dict:
    """original variable op -> [variable op per replica] (index 0: the original).

    The mirrors are added to the graph in one batch (epl.ir.clone.NodeBatch).
    """
    batch = NodeBatch(view.graph)
    names = {}
    for var in view.variables:
        for k in range(1, plan.num_replicas):
            attrs = replica_attr(k)
            shared = var.get_attr("shared_name").decode() or var.name
            attrs["shared_name"] = tf.compat.v1.AttrValue(s=f"{REPLICA_PREFIX.format(k)}/{shared}".encode())
            name = batch.new_name(f"{REPLICA_PREFIX.format(k)}/{var.name}")
            names[(var, k)] = batch.add(copy_node_def(
                var, name, plan.device(view.taskgraph_of[var], k), attrs))
    created = batch.commit()
    return {var: [var] + [created[names[(var, k)]] for k in range(1, plan.num_replicas)]
            for var in view.variables}


def sync_ops(mirrors, communicator) -> dict:
    """original variable op -> op copying its value into its mirrors.

    With several workers the value is worker 0's (broadcast), written into
    the original too, so workers that initialized with different random
    seeds start identical.
    """
    if communicator.num_workers == 1:
        return local_sync_ops(mirrors)
    sync = {}
    with tf.name_scope("EPL_SYNC"):
        for var, copies in mirrors.items():
            with tf.device(var.device):
                value = communicator.workers_broadcast(_read(var), 0, label=var.name)
                assigns = [_assign(var, value)]
            for copy in copies[1:]:
                with tf.device(copy.device):
                    assigns.append(_assign(copy, value))
            with tf.device(var.device):
                sync[var] = tf.group(*assigns)
    return sync


def local_sync_ops(mirrors: dict) -> dict:
    """`sync_ops` with one worker: per variable with mirrors, read the original
    (on its device), assign the value to every mirror (on the mirror's device),
    and a NoOp on the original's device that runs the assigns. The same ops as
    `_read`, `_assign` and tf.group build, written as NodeDefs and added in one
    batch (epl.ir.clone.NodeBatch): there is one such op group per variable.
    """
    if not mirrors:
        return {}
    batch = NodeBatch(next(iter(mirrors)).graph)
    groups = write_local_sync(mirrors, batch)
    created = batch.commit()
    return {var: created[name] for var, name in groups.items()}


def write_local_sync(mirrors: dict, batch: NodeBatch) -> dict:
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
