"""Annotation: write every op's TaskGraph and Phase onto the graph.

Scopes tag the ops created inside them, and the optimizer hooks tag backward
and apply ops, but ops built outside any scope (and the phase of forward ops)
are only known after analysis (epl.ir.graph_view). This pass writes the
analysed TaskGraph and Phase into each op's `_epl_taskgraph` / `_epl_phase`
attributes, so every later pass, the dumps and the verifier read one source.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR
from epl.pass_manager import GraphPass, PassContext, PassResult


def _set_string(op: tf.Operation, name: str, value: str) -> bool:
    current = op.node_def.attr.get(name)
    if current is not None and current.s.decode() == value:
        return False
    op._set_attr(name, tf.compat.v1.AttrValue(s=value.encode()))
    return True


class AnnotatePass(GraphPass):
    """Tags every op with its resolved TaskGraph and Phase."""

    name = "annotate"
    requires = ()

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view = ctx.view
        changed = 0
        for op in graph.get_operations():
            changed += _set_string(op, TASKGRAPH_ATTR, view.taskgraph_of[op].name)
            changed += _set_string(op, PHASE_ATTR, view.phase_of[op].value)
        counts = {}
        for phase in view.phase_of.values():
            counts[phase.value] = counts.get(phase.value, 0) + 1
        return PassResult(notes=[f"{changed} attributes set; ops by phase {counts}"])
