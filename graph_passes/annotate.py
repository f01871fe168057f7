"""Annotation: write every op's TaskGraph and Phase onto the graph.

Scopes tag the ops created inside them, and the optimizer hooks tag backward
and apply ops, but ops built outside any scope (and the phase of forward ops)
are only known after analysis (epl.ir.graph_view). This pass writes the
analysed TaskGraph and Phase into each op's `_epl_taskgraph` / `_epl_phase`
attributes, so every later pass, the dumps and the verifier read one source.

It runs first, on the graph analysis read, so it compares with the attribute
values analysis read (`view.tags`) instead of reading every NodeDef again, and
writes only the attributes that differ.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR
from epl.pass_manager import GraphPass, PassContext, PassResult


def _string_attr(value: str) -> tf.compat.v1.AttrValue:
    return tf.compat.v1.AttrValue(s=value.encode())


class AnnotatePass(GraphPass):
    """Tags every op with its resolved TaskGraph and Phase."""

    name = "annotate"
    requires = ()

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view = ctx.view
        values: dict = {}  # one AttrValue per distinct string
        changed = 0
        for op in graph.get_operations():
            tags = view.tags[op]
            for attr, current, wanted in ((TASKGRAPH_ATTR, tags.taskgraph, view.taskgraph_of[op].name),
                                          (PHASE_ATTR, tags.phase, view.phase_of[op].value)):
                if current != wanted:
                    value = values.get(wanted)
                    if value is None:
                        value = values[wanted] = _string_attr(wanted)
                    op._set_attr(attr, value)
                    changed += 1
        counts = {}
        for phase in view.phase_of.values():
            counts[phase.value] = counts.get(phase.value, 0) + 1
        return PassResult(notes=[f"{changed} attributes set; ops by phase {counts}"])
