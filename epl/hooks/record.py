"""Where each graph's record is kept: the one registry of EPL's per-graph state.

The hooks (scopes, optimizer, session) find the `GraphRecord` of the graph they
act on here, and hand it on explicitly: to the driver (`parallelize(graph,
record)`), and through it to the analysis, the planner and the passes, none of
which looks a record up. Records are weakly keyed by graph (a tf.Graph or a
traced FuncGraph), so a graph's record goes with it.
"""
from __future__ import annotations

import weakref

import tensorflow as tf

from epl import env
from epl.errors import ScopeError
from epl.ir.record import GraphRecord

EAGER_HINT = ("EPL rewrites TensorFlow graphs: call tf.compat.v1.disable_eager_execution() at the "
              "start of the script, or build the model inside `with tf.Graph().as_default():`.")

_RECORDS: "weakref.WeakKeyDictionary[tf.Graph, GraphRecord]" = weakref.WeakKeyDictionary()


def record_of(graph: tf.Graph, create: bool = True) -> GraphRecord | None:
    """The record of `graph`; a new one (under the active config) when `create` is true."""
    record = _RECORDS.get(graph)
    if record is None and create:
        record = GraphRecord(config=env.get_config() if env.is_initialized() else None)
        _RECORDS[graph] = record
    return record


def check_graph_mode(what: str) -> None:
    """Raise ScopeError when TensorFlow is executing eagerly."""
    if tf.executing_eagerly():
        raise ScopeError(f"{what} was used in eager mode. {EAGER_HINT}")


def default_graph_record(what: str) -> tuple[tf.Graph, GraphRecord]:
    """(the default graph, its record) for a scope `what` (refused in eager mode)."""
    check_graph_mode(what)
    graph = tf.compat.v1.get_default_graph()
    return graph, record_of(graph)
