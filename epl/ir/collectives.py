"""Collective ops recognised by type, and the bytes they move.

One list of op types shared by the parallel-graph summary (`epl.observability.summary`),
the trace (`epl.observability.trace`) and `epl-dump`: TensorFlow's collective ops
(V1, V2, V3), NCCL's and Horovod's. A collective is recognised by its op
type only, never by its name; and a local all-reduce summed on one device (CPU
devices, `epl.runtime.communicators.LocalCommunicator`) by its AddN's
`REDUCED_ATTR` (`is_reduction_to_one_device`), its payload every replica's tensor.

Payload: the tensors a collective sends, i.e. its data inputs that are not
group/instance keys or sizes: input 0, or every input for the grouped ops
(`HorovodGroupedAllreduce`, `NcclReduce`); a receive (`CollectiveBcastRecv*`)
sends nothing. Bytes are counted only for fully static shapes.

The module imports no TensorFlow (epl-dump reads the op types without it).
"""
from __future__ import annotations

from typing import Any

from epl.ir.annotations import REDUCED_ATTR

V1_COLLECTIVES = frozenset({"CollectiveReduce", "CollectiveGather",
                            "CollectiveBcastSend", "CollectiveBcastRecv"})
# Op type -> input positions of (group_size, group_key, instance_key).
V2_COLLECTIVE_INPUTS = {
    "CollectiveReduceV2": (1, 2, 3), "CollectiveGatherV2": (1, 2, 3),
    "CollectiveBcastSendV2": (1, 2, 3), "CollectiveBcastRecvV2": (0, 1, 2),
    "CollectiveAllToAllV2": (1, 2, 3), "CollectiveReduceScatterV2": (1, 2, 3),
}
V3_COLLECTIVES = frozenset({"CollectiveReduceV3", "CollectiveAllToAllV3"})
NCCL_COLLECTIVES = frozenset({"NcclAllReduce", "NcclReduce", "NcclBroadcast",
                              "_NcclReduceSend", "_NcclReduceRecv",
                              "_NcclBroadcastSend", "_NcclBroadcastRecv"})
HOROVOD_COLLECTIVES = frozenset({
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
    "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
    "HorovodGroupedReducescatter"})
MULTI_PAYLOAD_OPS = frozenset({"HorovodGroupedAllreduce",
                               "HorovodGroupedReducescatter", "NcclReduce"})
NO_PAYLOAD_OPS = frozenset({"CollectiveBcastRecv", "CollectiveBcastRecvV2",
                            "_NcclBroadcastRecv", "_NcclReduceRecv"})
COLLECTIVE_OPS = (V1_COLLECTIVES | frozenset(V2_COLLECTIVE_INPUTS) | V3_COLLECTIVES
                  | NCCL_COLLECTIVES | HOROVOD_COLLECTIVES)


def is_reduction_to_one_device(op: Any) -> bool:
    """True if `op` (a tf.Operation) is the sum of a local all-reduce on one device."""
    return op.type == "AddN" and REDUCED_ATTR in op.node_def.attr


def is_reduction_node(node: Any) -> bool:
    """is_reduction_to_one_device of a NodeDef (epl-dump reads GraphDefs)."""
    return node.op == "AddN" and REDUCED_ATTR in node.attr


def is_collective(op: Any) -> bool:
    """True if `op` (a tf.Operation) is a collective (by op type), or a local
    all-reduce's sum on one device."""
    return op.type in COLLECTIVE_OPS or is_reduction_to_one_device(op)


def payload_tensors(op: Any) -> list:
    """The tensors collective `op` sends (see the module doc)."""
    if op.type in NO_PAYLOAD_OPS or not op.inputs:
        return []
    if op.type in MULTI_PAYLOAD_OPS or is_reduction_to_one_device(op):
        return list(op.inputs)
    return [op.inputs[0]]


def payload_bytes(op: Any) -> int | None:
    """Bytes collective `op` (a tf.Operation) sends per run, or None when a shape is not
    static."""
    total = 0
    for tensor in payload_tensors(op):
        count = tensor.shape.num_elements()
        if count is None or tensor.dtype.name in ("string", "resource", "variant"):
            return None
        total += count * tensor.dtype.size
    return total
