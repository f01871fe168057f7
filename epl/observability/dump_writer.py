"""The graph dumps of `debug.dump_dir`, written after every pass at a small cost.

`PassDumpWriter` is what the pass manager's dump instrument writes through:
for each pass it serializes the graph (`GraphSerializer`) and hands the bytes
to `epl.observability.dump_format.write_serialized_pass`, which writes the
files and the manifest. It logs where the dumps go (INFO, once per writer)
and each pass's file (DEBUG).

Speed: `tf.Graph.as_graph_def(add_shapes=True)` after every pass cost about
three times the rewrite itself on `examples/bert_pipeline.py` (every op's
NodeDef parsed and its output shapes converted to protos, after every one of
15 passes). `GraphSerializer` keeps each op's serialized NodeDef and
re-serializes only the ops created since the last dump and those whose
NodeDef changed since (every change EPL makes to an existing op goes through
`epl.ir.graph_mutation`, which records them for tracked graphs); a pass that
changed nothing is not serialized at all. One change TensorFlow makes on its
own is not followed: `tf.control_dependencies` sets the bookkeeping
attribute `_has_manual_control_dependencies` (no effect on what runs) on the
ops it is given, so an op dumped before a pass used it so may lack it. Output-shape attributes are built
once per distinct list of shapes. The bytes are those of the GraphDef
`as_graph_def(add_shapes=True)` gives, with large constants elided
(`dump_format.elide_node_constants`), up to notation: the order of the
nodes and of each op's control inputs (which `as_graph_def` sorts by name),
and "x:0" for an input rewired to x (`as_graph_def` writes "x"); and the
library's functions are `as_graph_def()`'s, without the shape attributes
add_shapes puts on them (on the ops of the graph they are there). A
GraphDef is a concatenation of its nodes' encodings, its function library's
and its versions'. The library is taken from `as_graph_def` again only when
functions were added. A graph with v2 control flow or function calls
(`AUTODIFF_REWRITTEN`: TensorFlow's autodiff rewrites those ops and their
functions itself, not through EPL) is serialized whole after every pass.
"""
from __future__ import annotations

import logging

import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as c_api

from epl.ir import graph_mutation
from epl.observability.dump_format import (MAX_CONSTANT_BYTES, elide_node_constants,
                                           write_serialized_pass)

_LOG = logging.getLogger(__name__)
_NODE_TAG = b"\x0a"       # GraphDef field 1 (node), length-delimited
_LIBRARY_TAG = b"\x12"    # GraphDef field 2 (library)
_VERSIONS_TAG = b"\x22"   # GraphDef field 4 (versions)
_ATTR_TAG = b"\x2a"       # NodeDef field 5 (attr), one map entry {1: key, 2: AttrValue}
#: Op types whose NodeDef (and functions) TensorFlow's autodiff changes itself.
AUTODIFF_REWRITTEN = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                                "StatelessCase", "PartitionedCall", "StatefulPartitionedCall"})


def _varint(value: int) -> bytes:
    """Protocol buffers' base-128 varint encoding of `value` (>= 0)."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(tag: bytes, data: bytes) -> bytes:
    return tag + _varint(len(data)) + data


def _function_count(graph: tf.Graph) -> int:
    """How many library functions `graph` has (-1 when TensorFlow no longer says)."""
    functions = getattr(graph, "_functions", None)
    return -1 if functions is None else len(functions)


def _full_graph_def(graph: tf.Graph):
    """`as_graph_def(add_shapes=True)` with large constants elided."""
    graph_def = graph.as_graph_def(add_shapes=True)
    for node in graph_def.node:
        elide_node_constants(node)
    for function in graph_def.library.function:
        for node in function.node_def:
            elide_node_constants(node)
    return graph_def


class GraphSerializer:
    """Serializes one tf.Graph for successive dumps (see the module doc).

    `serialize()` returns (bytes of the GraphDef, number of ops), or (None,
    number of ops) when nothing changed since the previous call.
    """

    def __init__(self, graph: tf.Graph) -> None:
        self.graph = graph
        self._changed = graph_mutation.track_changes(graph)
        self._nodes: list[bytes] = []            # each op's node field
        self._shape_entries: list[bytes] = []    # each op's encoded _output_shapes entry
        self._position: dict[int, int] = {}      # op._id -> its index in _nodes
        self._op_at: list[tf.Operation] = []     # the op at each index
        self._ops = 0                            # ops of the graph serialized so far
        self._functions = None                   # function count the library is of
        self._library = b""
        self._shapes: dict[tuple, bytes] = {}    # output shapes -> their encoded entry
        self._whole = False                      # serialize whole from now on

    def serialize(self) -> tuple[bytes | None, int]:
        """The graph's bytes now (None: unchanged since the last call) and its op count."""
        ops = self.graph.get_operations()
        new = ops[self._ops:]
        self._whole = self._whole or _function_count(self.graph) < 0 or any(
            op.type in AUTODIFF_REWRITTEN for op in new)
        if self._whole:
            self._changed.clear()
            self._ops = len(ops)
            graph_def = _full_graph_def(self.graph)
            return graph_def.SerializeToString(deterministic=True), len(graph_def.node)
        if self._functions is not None and not new and not self._changed:
            return None, len(self._nodes)
        if self._functions != _function_count(self.graph):
            self._take_whole_graph()    # the first time, or when functions were added
        else:
            for op_id in self._changed:
                position = self._position.get(op_id)
                if position is not None:   # passes change inputs, devices, attributes
                    self._nodes[position] = self._node_field(     # of ops, not their shapes
                        self._op_at[position], self._shape_entries[position])
            for op in new:
                shapes = self._output_shapes(op) if op.outputs else b""
                self._position[op._id] = len(self._nodes)
                self._nodes.append(self._node_field(op, shapes))
                self._shape_entries.append(shapes)
                self._op_at.append(op)
        self._changed.clear()
        self._ops = len(ops)
        versions = self.graph.graph_def_versions.SerializeToString(deterministic=True)
        return (b"".join(self._nodes) + self._library + _field(_VERSIONS_TAG, versions),
                len(self._nodes))

    def _take_whole_graph(self) -> None:
        """Every node and the library from one `as_graph_def()` (its output shapes
        added here, once per distinct list)."""
        self._functions = _function_count(self.graph)
        graph_def = self.graph.as_graph_def()
        by_name = {op.name: op for op in self.graph.get_operations()}
        self._op_at = [by_name[node.name] for node in graph_def.node]
        self._nodes, self._shape_entries = [], []
        for node, op in zip(graph_def.node, self._op_at):
            elide_node_constants(node)
            shapes = self._output_shapes(op) if op.outputs else b""
            self._nodes.append(_field(_NODE_TAG, node.SerializeToString(deterministic=True)
                                      + shapes))
            self._shape_entries.append(shapes)
        self._position = {op._id: i for i, op in enumerate(self._op_at)}
        for function in graph_def.library.function:
            for node in function.node_def:
                elide_node_constants(node)
        library = graph_def.library.SerializeToString(deterministic=True)
        self._library = _field(_LIBRARY_TAG, library) if library else b""

    def _node_field(self, op: tf.Operation, shapes: bytes) -> bytes:
        """The encoded node field of `op`: its NodeDef, large constants elided, with the
        encoded `_output_shapes` entry `shapes`."""
        node = _node_def_bytes(op)
        if len(node) > MAX_CONSTANT_BYTES:   # perhaps a large constant: elide it
            node_def = tf.compat.v1.NodeDef.FromString(node)
            if elide_node_constants(node_def):
                node = node_def.SerializeToString(deterministic=True)
        return _field(_NODE_TAG, node + shapes)

    def _output_shapes(self, op: tf.Operation) -> bytes:
        """The encoded `_output_shapes` attribute entry of `op` (one per distinct list)."""
        shapes = [t.shape for t in op.outputs]
        key = tuple(None if s.rank is None else tuple(s.as_list()) for s in shapes)
        found = self._shapes.get(key)
        if found is None:
            value = tf.compat.v1.AttrValue()
            value.list.shape.extend([s.as_proto() for s in shapes])
            entry = _field(b"\x0a", b"_output_shapes") + \
                _field(b"\x12", value.SerializeToString(deterministic=True))
            found = self._shapes[key] = _field(_ATTR_TAG, entry)
        return found


def _node_def_bytes(op: tf.Operation) -> bytes:
    """The serialized NodeDef of `op`, straight from TensorFlow's C graph (`op.node_def`
    without parsing it into Python)."""
    buffer = c_api.TF_NewBuffer()
    try:
        c_api.TF_OperationToNodeDef(op._c_op, buffer)
        return c_api.TF_GetBuffer(buffer)
    finally:
        c_api.TF_DeleteBuffer(buffer)


class PassDumpWriter:
    """Writes one dump directory's passes (one writer per parallelize or gradient time)."""

    def __init__(self) -> None:
        self._serializers: dict = {}
        self._announced = False

    def write(self, dump_dir: str, index: int, pass_name: str, graph: tf.Graph,
              summary: dict) -> str:
        """Write the graph after pass `pass_name` (`index`) and its summary into
        `dump_dir`; returns the graph file's path."""
        serializer = self._serializers.get(graph)
        if serializer is None:
            serializer = self._serializers[graph] = GraphSerializer(graph)
        data, num_ops = serializer.serialize()
        path = write_serialized_pass(dump_dir, index, pass_name, data, num_ops, summary)
        if not self._announced:
            self._announced = True
            _LOG.info("writing a graph dump after every pass to %s (read it with: epl-dump %s)",
                      dump_dir, dump_dir)
        _LOG.debug("dump of pass %d (%s): %s%s", index, pass_name, path,
                   " (unchanged)" if data is None else f", {len(data)} bytes, {num_ops} ops")
        return path
