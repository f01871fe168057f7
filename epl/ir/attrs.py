"""Setting string attributes on many ops of one graph.

Speed: `Operation._set_attr` serializes its AttrValue into a fresh TF_Buffer
and enters the graph's C context on every call (about 4.5 us). Passes that tag
thousands of ops call `set_string_attrs` once instead, which serializes each
distinct value once and enters the C context once, leaving only the C call
(about 1.8 us) per attribute. The attributes written are the same.
"""
from __future__ import annotations

from typing import Iterable

import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as c_api

from epl.ir import graph_mutation


def set_string_attrs(graph: tf.Graph, assignments: Iterable[tuple[tf.Operation, str, bytes]]) -> int:
    """For each (op, name, value) of `assignments` (ops of `graph`), set op's string
    attribute `name` to `value`, in order. Returns how many were set."""
    buffers: dict = {}  # value -> TF_Buffer holding its serialized AttrValue
    count = 0
    changed = graph_mutation.changes_of(graph)   # tracked for the dumps (or None)
    try:
        with graph._c_graph.get() as c_graph:
            for op, name, value in assignments:
                buffer = buffers.get(value)
                if buffer is None:
                    data = tf.compat.v1.AttrValue(s=value).SerializeToString()
                    buffer = buffers[value] = c_api.TF_NewBufferFromString(data)
                c_api.SetAttr(c_graph, op._c_op, name, buffer)
                count += 1
                if changed is not None:
                    changed.add(op._id)
    finally:
        for buffer in buffers.values():
            c_api.TF_DeleteBuffer(buffer)
    return count
