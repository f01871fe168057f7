"""TensorFlow's private graph mutations, in one place.

The passes rewrite a finished `tf.Graph` in place: they retag, re-place and
rewire ops that TensorFlow's public API treats as immutable once created. The
only way to do that is through `tf.Operation`'s private methods, which every
pass reaches through this module (and `epl.ir.attrs` for tagging many ops at
once), so a TensorFlow upgrade that changes them is fixed here alone.
Building new ops from existing ones (the private op-creation and control-flow
calls of copying) stays in `epl.ir.clone`, the one module that copies ops.

Since every change to an existing op goes through here, a reader that wants to
know which ops changed since it last looked (the graph dumps of
`debug.dump_dir`, which re-serialize only those) asks `track_changes(graph)`
for the set of their ids (`op._id`); nothing is recorded for graphs nobody
tracks.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable

import tensorflow as tf

# graph -> ids of its ops changed through this module since the tracker cleared the set
_CHANGED: "weakref.WeakKeyDictionary[tf.Graph, set[int]]" = weakref.WeakKeyDictionary()


def track_changes(graph: tf.Graph) -> set[int]:
    """Start (or go on) recording the ids (`op._id`) of the ops of `graph` whose NodeDef
    this module or `epl.ir.attrs` changes; returns the live set (the caller clears it)."""
    return _CHANGED.setdefault(graph, set())


def changes_of(graph: tf.Graph) -> set[int] | None:
    """The live set `track_changes` returned for `graph`, or None when it is not tracked."""
    return _CHANGED.get(graph) if _CHANGED else None


def _changed(op: tf.Operation) -> None:
    if _CHANGED:
        ids = _CHANGED.get(op.graph)
        if ids is not None:
            ids.add(op._id)


def set_attr(op: tf.Operation, name: str, value: tf.compat.v1.AttrValue) -> None:
    """Set node attribute `name` of `op` to `value` (an AttrValue)."""
    op._set_attr(name, value)
    _changed(op)


def clear_attr(op: tf.Operation, name: str) -> None:
    """Remove attribute `name` from `op`'s NodeDef."""
    op._clear_attr(name)
    _changed(op)


def set_device(op: tf.Operation, device: str) -> None:
    """Place `op` on `device` (a device string; "" clears it)."""
    op._set_device(device)
    _changed(op)


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Make input `index` of `op` read `tensor` instead."""
    op._update_input(index, tensor)
    _changed(op)


def add_control_inputs(op: tf.Operation, ops: Iterable[tf.Operation]) -> None:
    """Make `op` run after each of `ops` (control edges)."""
    op._add_control_inputs(list(ops))
    _changed(op)


def remove_all_control_inputs(op: tf.Operation) -> None:
    """Drop every control edge into `op`."""
    op._remove_all_control_inputs()
    _changed(op)


def rewire_consumers(tensor: tf.Tensor, replacement: tf.Tensor,
                     consumers: Iterable[tf.Operation] | None = None) -> None:
    """Make every input that reads `tensor` read `replacement` instead.

    consumers: the ops to rewire (default: every consumer of `tensor` now). A pass
    that inserts a stage after a tensor takes the consumers before it builds the
    stage, so the stage's own ops keep reading the tensor.
    """
    for consumer in list(tensor.consumers()) if consumers is None else consumers:
        for index, inp in enumerate(consumer.inputs):
            if inp is tensor:
                consumer._update_input(index, replacement)
                _changed(consumer)


@contextlib.contextmanager
def clean_construction_context(graph: tf.Graph):
    """Build EPL's ops at the top level: no user scopes, devices, colocations,
    attribute scopes or control deps (the driver around the passes, the passes that
    build ops with the TensorFlow API, the late rewrite)."""
    saved_attrs = graph._attr_scope_map
    graph._attr_scope_map = {}
    try:
        with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
                tf.device(None), graph.colocate_with(None, ignore_existing=True):
            yield
    finally:
        graph._attr_scope_map = saved_attrs
