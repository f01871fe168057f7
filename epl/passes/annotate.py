"""Annotation: write every op's TaskGraph and Phase onto the graph.

Scopes tag the ops created inside them, and the optimizer hooks tag backward
and apply ops, but ops built outside any scope (and the phase of forward ops)
are only known after analysis (epl.ir.graph_view). This pass writes the
analysed TaskGraph and Phase into each op's `_epl_taskgraph` / `_epl_phase`
attributes, so every later pass, the dumps and the verifier read one source.

It runs first, on the graph analysis read, so it compares with the attribute
values analysis read (`view.tags`) instead of reading every NodeDef again, and
writes only the attributes that differ.

It also writes the one order analysis found missing between the step's own ops
(`TrainingView.write_orders`): a hand-written update of a variable waits for the
reads of it the script built before it (a learning rate decayed by the global step
that the script increments by hand), so that every replica, on any placement, reads
the value the script's order means (TensorFlow leaves the two unordered).
"""
from __future__ import annotations

import collections
import logging

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.attrs import set_string_attrs
from epl.ir.graph_view import TrainingView
from epl.passes.manager import GraphPass, PassContext, PassResult

_LOG = logging.getLogger(__name__)


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
        for read, write in view.write_orders:
            graph_mutation.add_control_inputs(write, [read])
            _LOG.warning("%s writes a variable that %s, built before it, reads in the same step, "
                         "and nothing orders the two: TensorFlow may run either first. EPL runs "
                         "the read first, in the order the script built them (as tf.function "
                         "does); add tf.control_dependencies to choose another order.",
                         write.name, read.name)
        counts = {phase.value: n for phase, n in collections.Counter(view.phase_of.values()).items()}
        notes = [f"{changed} attributes set; ops by phase {counts}"]
        notes += [f"{write.name} (a hand-written update) waits for {read.name}, which reads its "
                  "variable and was built before it" for read, write in view.write_orders]
        return PassResult(notes=notes, modified=changed > 0 or bool(view.write_orders))
