"""What a dumped GraphDef holds: EPL's node attributes, op counts, collectives.

The graph-reading half of `epl-dump` (epl/tools/dump.py, the commands and
their text): plain NodeDefs in, plain values out, no TensorFlow (TensorBoard's
protos and dtypes).

EPL's node attributes are read from the NodeDefs, never inferred from op
names: ``_epl_taskgraph`` (ops without it count as "(none)"),
``_epl_phase`` (absent: "(none)"), ``_epl_replica`` and
``_epl_micro_batch`` (absent: 0).  `op_counts` counts a graph's ops by
device, TaskGraph, phase, replica and micro-batch.

`find_collectives` describes every collective op (`Collective`).  A
collective's shape and bytes describe its payload: the shape of input 0
(read from the producer's ``_output_shapes``), else the op's ``shape``
attr, else the op's own first output shape; bytes are the product of the
dims times the dtype size when the shape is fully static (summed over the
inputs for grouped Horovod ops and NcclReduce).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

from tensorboard.compat.proto import graph_pb2, node_def_pb2
from tensorboard.compat.tensorflow_stub import dtypes
from tensorboard.util import tensor_util

from epl.ir.collectives import (COLLECTIVE_OPS, HOROVOD_COLLECTIVES, MULTI_PAYLOAD_OPS,
                                NCCL_COLLECTIVES, NO_PAYLOAD_OPS, V1_COLLECTIVES,
                                V2_COLLECTIVE_INPUTS, V3_COLLECTIVES, is_reduction_node)

NONE_LABEL = "(none)"
UNPLACED_LABEL = "(unplaced)"
PHASE_ORDER = ("forward", "backward", "apply", "other")

Shape = list  # list of dims, None for an unknown dim


# --------------------------------------------------------------------------
# Reading NodeDefs
# --------------------------------------------------------------------------


def _attr_text(node: node_def_pb2.NodeDef, key: str) -> str | None:
    """Return a string (or int) attr of `node` as text, or None if absent."""
    if key not in node.attr:
        return None
    value = node.attr[key]
    kind = value.WhichOneof("value")
    if kind == "s":
        return value.s.decode("utf-8", "replace")
    if kind == "i":
        return str(value.i)
    return None


def _attr_int(node: node_def_pb2.NodeDef, key: str, default: int = 0) -> int:
    """Return an int attr of `node` (also accepting a decimal string)."""
    text = _attr_text(node, key)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        return default


def taskgraph_of(node: node_def_pb2.NodeDef) -> str:
    """Return the node's `_epl_taskgraph`, or "(none)"."""
    return _attr_text(node, "_epl_taskgraph") or NONE_LABEL


def phase_of(node: node_def_pb2.NodeDef) -> str:
    """Return the node's `_epl_phase`, or "(none)"."""
    return _attr_text(node, "_epl_phase") or NONE_LABEL


def device_of(node: node_def_pb2.NodeDef) -> str:
    """Return the node's device, or "(unplaced)"."""
    return node.device or UNPLACED_LABEL


def split_input(name: str) -> tuple[str, int, bool]:
    """Split an input reference into (op name, output index, is_control)."""
    if name.startswith("^"):
        return name[1:], 0, True
    op_name, _, index = name.partition(":")
    return op_name, int(index) if index.isdigit() else 0, False


def _data_inputs(node: node_def_pb2.NodeDef) -> list[str]:
    """Return the node's data (non-control) input references."""
    return [name for name in node.input if not name.startswith("^")]


def _shape_list(proto: Any) -> Shape | None:
    """Convert a TensorShapeProto to a list (None dims), or None if unknown."""
    if proto.unknown_rank:
        return None
    return [dim.size if dim.size >= 0 else None for dim in proto.dim]


def output_shape(node: node_def_pb2.NodeDef | None, index: int) -> Shape | None:
    """Return output `index`'s shape from the `_output_shapes` attr, if any."""
    if node is None or "_output_shapes" not in node.attr:
        return None
    shapes = node.attr["_output_shapes"].list.shape
    return _shape_list(shapes[index]) if index < len(shapes) else None


# --------------------------------------------------------------------------
# Op counts
# --------------------------------------------------------------------------


def ordered_counts(counter: collections.Counter, order: Sequence[str] = ()) -> dict[str, int]:
    """Return counter items: those in `order` first, then sorted, "(none)" last."""
    rank = {key: i for i, key in enumerate(order)}

    def sort_key(key: str) -> tuple:
        return (key in (NONE_LABEL, UNPLACED_LABEL), rank.get(key, len(rank)),
                natural_key(key))

    return {key: counter[key] for key in sorted(counter, key=sort_key)}


def natural_key(text: str) -> tuple:
    """Sort key that orders embedded integers numerically ("CPU:2" < "CPU:10")."""
    parts, digits, buffer = [], "", ""
    for char in text:
        if char.isdigit():
            if buffer:
                parts.append((1, buffer, 0))
                buffer = ""
            digits += char
        else:
            if digits:
                parts.append((0, "", int(digits)))
                digits = ""
            buffer += char
    if digits:
        parts.append((0, "", int(digits)))
    if buffer:
        parts.append((1, buffer, 0))
    return tuple(parts)


def op_counts(graph_def: graph_pb2.GraphDef) -> dict[str, dict[str, int]]:
    """Count a graph's ops by device, TaskGraph, phase, replica and micro-batch.

    Returns {"device": {...}, "taskgraph": {...}, "phase": {...},
    "replica": {...}, "micro_batch": {...}} with string keys.
    """
    counters = {key: collections.Counter() for key in
                ("device", "taskgraph", "phase", "replica", "micro_batch")}
    for node in graph_def.node:
        counters["device"][device_of(node)] += 1
        counters["taskgraph"][taskgraph_of(node)] += 1
        counters["phase"][phase_of(node)] += 1
        counters["replica"][str(_attr_int(node, "_epl_replica"))] += 1
        counters["micro_batch"][str(_attr_int(node, "_epl_micro_batch"))] += 1
    return {"device": ordered_counts(counters["device"]),
            "taskgraph": ordered_counts(counters["taskgraph"]),
            "phase": ordered_counts(counters["phase"], PHASE_ORDER),
            "replica": ordered_counts(counters["replica"]),
            "micro_batch": ordered_counts(counters["micro_batch"])}


# --------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    """One collective op of a graph and what it moves.

    `group` is "horovod" for Horovod ops, "nccl ..." for NCCL ops, and
    "key=K size=S instance=I" (unknown parts as "?") for TF collectives.
    `shape` holds None for unknown dims and is None for an unknown rank;
    `bytes` is None unless every payload shape is static.
    """

    kind: str
    name: str
    device: str
    group: str
    group_key: int | None
    group_size: int | None
    instance_key: int | None
    dtype: str | None
    shape: Shape | None
    bytes: int | None
    num_tensors: int
    taskgraph: str
    phase: str

    def to_json(self) -> dict[str, Any]:
        """Return this collective as a JSON-ready dict."""
        return dataclasses.asdict(self)


class _GraphIndex:
    """Name -> NodeDef lookup with helpers to resolve constant inputs."""

    def __init__(self, graph_def: graph_pb2.GraphDef) -> None:
        self.nodes = {node.name: node for node in graph_def.node}

    def producer(self, reference: str) -> tuple[node_def_pb2.NodeDef | None, int]:
        """Return the node producing `reference` and its output index."""
        name, index, _ = split_input(reference)
        return self.nodes.get(name), index

    def const_value(self, reference: str, hops: int = 8) -> Any:
        """Return the value of a Const input (through Identity ops), or None."""
        node, _ = self.producer(reference)
        while node is not None and node.op in ("Identity", "Snapshot") and hops > 0:
            inputs = _data_inputs(node)
            node = self.nodes.get(split_input(inputs[0])[0]) if inputs else None
            hops -= 1
        if node is None or node.op not in ("Const", "HostConst"):
            return None
        try:
            return tensor_util.make_ndarray(node.attr["value"].tensor)
        except (TypeError, ValueError):
            return None

    def const_int(self, node: node_def_pb2.NodeDef, position: int) -> int | None:
        """Return data input `position` of `node` as an int if it is a scalar Const."""
        inputs = _data_inputs(node)
        if position >= len(inputs):
            return None
        value = self.const_value(inputs[position])
        if value is None or getattr(value, "size", 0) != 1:
            return None
        return int(value.reshape(-1)[0])

    def input_shape(self, node: node_def_pb2.NodeDef, position: int) -> Shape | None:
        """Return the shape of data input `position` from its `_output_shapes`."""
        inputs = _data_inputs(node)
        if position >= len(inputs):
            return None
        producer, index = self.producer(inputs[position])
        return output_shape(producer, index)


def _dtype_of(node: node_def_pb2.NodeDef) -> dtypes.DType | None:
    """Return the collective's element type from attr "T", or None (TensorBoard's
    copy of TensorFlow's dtypes: no TensorFlow needed)."""
    if "T" not in node.attr or node.attr["T"].WhichOneof("value") != "type":
        return None
    try:
        return dtypes.as_dtype(node.attr["T"].type)
    except TypeError:
        return None


def _num_bytes(shape: Shape | None, dtype: dtypes.DType | None) -> int | None:
    """Return the byte size of a fully static shape of `dtype`, else None."""
    if shape is None or dtype is None or any(dim is None for dim in shape):
        return None
    if dtype.name in ("string", "resource", "variant"):
        return None
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.size


def _group_ids(index: _GraphIndex, node: node_def_pb2.NodeDef) -> tuple:
    """Return (group_key, group_size, instance_key) of a TF collective."""
    if node.op in V1_COLLECTIVES:
        return tuple(node.attr[key].i if key in node.attr else None
                     for key in ("group_key", "group_size", "instance_key"))
    if node.op in V2_COLLECTIVE_INPUTS:
        size_at, key_at, instance_at = V2_COLLECTIVE_INPUTS[node.op]
        return (index.const_int(node, key_at), index.const_int(node, size_at),
                index.const_int(node, instance_at))
    if node.op in V3_COLLECTIVES:
        inputs = _data_inputs(node)
        init, _ = index.producer(inputs[1]) if len(inputs) > 1 else (None, 0)
        if init is not None and init.op == "CollectiveInitializeCommunicator":
            return index.const_int(init, 0), index.const_int(init, 2), None
    return None, None, None


def _group_label(node: node_def_pb2.NodeDef, ids: tuple) -> str:
    """Return the printable group of a collective."""
    if is_reduction_node(node):
        return f"one-device size={len(_data_inputs(node))}"
    if node.op in HOROVOD_COLLECTIVES:
        return "horovod"
    if node.op in NCCL_COLLECTIVES:
        shared = _attr_text(node, "shared_name")
        size = node.attr["num_devices"].i if "num_devices" in node.attr else None
        parts = [f"size={size if size is not None else '?'}"]
        return " ".join(["nccl"] + parts + ([f"shared={shared}"] if shared else []))
    key, size, instance = ("?" if value is None else value for value in ids)
    return f"key={key} size={size} instance={instance}"


def _payload_shapes(index: _GraphIndex, node: node_def_pb2.NodeDef) -> list[Shape | None]:
    """Return the shapes of the tensors a collective moves (see the module docstring)."""
    if node.op in MULTI_PAYLOAD_OPS or is_reduction_node(node):
        return [index.input_shape(node, i) for i in range(len(_data_inputs(node)))]
    if node.op not in NO_PAYLOAD_OPS and _data_inputs(node):
        shape = index.input_shape(node, 0)
        if shape is not None:
            return [shape]
    if "shape" in node.attr and node.attr["shape"].WhichOneof("value") == "shape":
        return [_shape_list(node.attr["shape"].shape)]
    if node.op == "CollectiveBcastRecvV2":
        inputs = _data_inputs(node)
        value = index.const_value(inputs[3]) if len(inputs) > 3 else None
        if value is not None:
            return [[int(dim) for dim in value.reshape(-1)]]
    return [output_shape(node, 0)]


def _make_collective(index: _GraphIndex, node: node_def_pb2.NodeDef) -> Collective:
    """Describe one collective NodeDef."""
    ids = _group_ids(index, node)
    dtype = _dtype_of(node)
    shapes = _payload_shapes(index, node)
    sizes = [_num_bytes(shape, dtype) for shape in shapes]
    total = sum(sizes) if sizes and None not in sizes else None
    return Collective(
        kind=node.op, name=node.name, device=device_of(node),
        group=_group_label(node, ids), group_key=ids[0], group_size=ids[1],
        instance_key=ids[2], dtype=dtype.name if dtype is not None else None,
        shape=shapes[0] if shapes else None, bytes=total,
        num_tensors=len(shapes), taskgraph=taskgraph_of(node), phase=phase_of(node))


def find_collectives(graph_def: graph_pb2.GraphDef) -> list[Collective]:
    """Return every collective op of `graph_def`, in graph order.

    Recognises TF collectives V1/V2/V3, NCCL ops and Horovod ops by op type, and
    a local all-reduce summed on one device by its AddN's attribute.
    """
    index = _GraphIndex(graph_def)
    return [_make_collective(index, node) for node in graph_def.node
            if node.op in COLLECTIVE_OPS or is_reduction_node(node)]
