"""Run one training pass alone on a graph, as the driver would (for the pass tests).

`run_alone(build, config, name)` builds a graph with `build()`, analyses and plans it
with the driver's `parallel.pass_context` (which runs the before-analysis passes:
auto_stages), validates every pass on the graph as the user built it (as
`parallelize` does), runs the passes before `name` that the config enables, and
then `name` alone. It returns the graph, what it held just before the pass (its
ops' NodeDefs and fingerprint), the context and the pass's `PassResult`.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl import parallel
from epl.hooks.record import record_of
from epl.ir.autodiff import internal_autodiff
from epl.passes.manager import Instrument, PassContext, PassManager, graph_fingerprint
from wiring_dump import snapshot


@dataclasses.dataclass
class Alone:
    """A pass run alone: the graph, the ops the script built, their NodeDefs and the
    graph's fingerprint just before the pass, the context after it, and its
    PassResult (None for a pass that was off, or one pass_context ran)."""

    graph: tf.Graph
    user: frozenset
    before: dict
    fingerprint: str
    ctx: PassContext
    result: object

    def unchanged(self) -> bool:
        """True if the pass left the graph as it found it (the fingerprint)."""
        return graph_fingerprint(self.graph) == self.fingerprint


class _Results(Instrument):
    """Keeps the PassResult of each pass (the manager's instruments see them)."""

    def __init__(self):
        self.results: dict = {}

    def after(self, graph_pass, graph, ctx, result, duration_s):
        self.results[graph_pass.name] = result


def run_alone(build, config, name: str, prepare=None) -> Alone:
    """Build a graph with `build()`, run the passes of `config`'s training pipeline
    before pass `name`, then `name` alone.

    prepare(graph, ctx): called after the earlier passes, before the snapshot (a
    test that hands the pass a graph those passes could not have made).
    A pass that runs before the analysis (auto_stages) is run by `pass_context`,
    alone; its result is then None (pass_context keeps its instruments).
    """
    graph = tf.Graph()
    with graph.as_default():
        build()
        user = frozenset(graph.get_operations())
        pipeline = parallel.training_pipeline(config)
        first, _ = parallel.before_analysis(pipeline)
        alone = [p for p in first if p.name == name]
        if alone:
            before, fingerprint = snapshot(graph), graph_fingerprint(graph)
            ctx, _, _ = parallel.pass_context(graph, record_of(graph), alone)
            return Alone(graph, user, before, fingerprint, ctx, None)
        ctx, instruments, passes = parallel.pass_context(graph, record_of(graph), pipeline)
        index = [p.name for p in passes].index(name)
        results = _Results()
        with internal_autodiff():
            # every pass validates the graph as the user built it, as in parallelize()
            PassManager(passes, available=ctx.available).validate(graph, ctx)
            parallel.run_passes(graph, ctx, passes[:index], instruments, validate=False)
            if prepare is not None:
                prepare(graph, ctx)
            before, fingerprint = snapshot(graph), graph_fingerprint(graph)
            parallel.run_passes(graph, ctx, [passes[index]], instruments + [results],
                                validate=False)
    return Alone(graph, user, before, fingerprint, ctx, results.results.get(name))
