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
from epl.ir.attrs import string_attr_setter
from epl.pass_manager import GraphPass, PassContext, PassResult


class AnnotatePass(GraphPass):
    """Tags every op with its resolved TaskGraph and Phase."""

    name = "annotate"
    requires = ()

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view = ctx.view
        changed = 0
        with string_attr_setter(graph) as set_string:
            for op in graph.get_operations():
                tags = view.tags[op]
                taskgraph, phase = view.taskgraph_of[op].name, view.phase_of[op].value
                if tags.taskgraph != taskgraph:
                    set_string(op, TASKGRAPH_ATTR, taskgraph.encode())
                    changed += 1
                if tags.phase != phase:
                    set_string(op, PHASE_ATTR, phase.encode())
                    changed += 1
        counts = {}
        for phase in view.phase_of.values():
            counts[phase.value] = counts.get(phase.value, 0) + 1
        return PassResult(notes=[f"{changed} attributes set; ops by phase {counts}"])
