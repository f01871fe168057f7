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

import collections

import tensorflow as tf

from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.attrs import set_string_attrs
from epl.ir.graph_view import TrainingView
from epl.passes.manager import GraphPass, PassContext, PassResult


def _differing_tags(ops, view):
    """(op, attribute, value) for every tag of `ops` that differs from the analysis."""
    phases = {phase: phase.value for phase in Phase}
    for op in ops:
        tags = view.tags[op]
        taskgraph, phase = view.taskgraph_of[op].name, phases[view.phase_of[op]]
        if tags.taskgraph != taskgraph:
            yield op, TASKGRAPH_ATTR, taskgraph.encode()
        if tags.phase != phase:
            yield op, PHASE_ATTR, phase.encode()


class AnnotatePass(GraphPass):
    """Tags every op with its resolved TaskGraph and Phase."""

    name = "annotate"
    requires = (TrainingView,)

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        view = ctx.get(TrainingView)
        changed = set_string_attrs(graph, _differing_tags(graph.get_operations(), view))
        counts = {phase.value: n for phase, n in collections.Counter(view.phase_of.values()).items()}
        return PassResult(notes=[f"{changed} attributes set; ops by phase {counts}"],
                          modified=changed > 0)
