"""The pass framework (epl/passes/manager.py): typed results and their declarations,
passes built from typed options, passes disabled by name, and the modified flag
checked against a graph fingerprint."""
from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf

import epl
from epl import parallel
from epl.errors import ConfigError, PassError
from epl.hooks.record import record_of
from epl.ir.graph_view import TrainingView
from epl.passes.manager import (FingerprintInstrument, GraphPass, PassContext, PassManager,
                                PassResult)
from epl.planner.plan import Plan
from epl.runtime.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class Shape:
    """A toy result: what a toy pass saw."""

    ops: int


@dataclasses.dataclass(frozen=True)
class Other:
    """A result no toy pass declares."""

    value: int


class Counts(GraphPass):
    name = "counts"
    provides = (Shape,)

    def run(self, graph, ctx):
        ctx.provide(Shape(len(graph.get_operations())))
        return PassResult(modified=False)


class Reads(GraphPass):
    name = "reads"
    requires = (Shape,)

    def run(self, graph, ctx):
        ctx.get(Shape)
        return PassResult(modified=False)


class ReadsUndeclared(GraphPass):
    name = "sneaky"

    def run(self, graph, ctx):
        ctx.get(Shape)
        return PassResult(modified=False)


class ProvidesUndeclared(GraphPass):
    name = "leaky"

    def run(self, graph, ctx):
        ctx.provide(Other(1))
        return PassResult(modified=False)


class AddsAConstant(GraphPass):
    """Adds an op; says `modified` as its options tell it to."""

    name = "adds"

    def run(self, graph, ctx):
        with graph.as_default(), tf.device("/device:CPU:0"):
            tf.constant(1.0, name="added")
        return PassResult(modified=self.options)


def _context():
    return PassContext(Cluster("CPU", 1), None)


def test_a_required_result_no_earlier_pass_provides_is_refused_before_anything_runs():
    with pytest.raises(PassError) as err:
        PassManager([Reads(), Counts()])
    assert str(err.value) == (
        "pass 'reads' requires Shape, which no input and no enabled pass before it provides; "
        "the pipeline is ['reads', 'counts'] (off: []). Enable the pass that provides it, or "
        "reorder the pass list.")
    PassManager([Counts(), Reads()])   # in this order it is fine


def test_a_pass_reading_a_result_it_does_not_declare_fails():
    graph = tf.Graph()
    ctx = _context()
    with pytest.raises(PassError) as err:
        PassManager([Counts(), ReadsUndeclared()]).run(graph, ctx)
    assert "pass 'sneaky' read a Shape, which it does not declare (requires none, optional " \
           "none); add it to the pass's declarations" in str(err.value)
    assert ctx.get(Shape) == Shape(0)   # outside a pass (the driver, a test) anything is read


def test_a_pass_providing_a_result_it_does_not_declare_fails():
    with pytest.raises(PassError) as err:
        PassManager([ProvidesUndeclared()]).run(tf.Graph(), _context())
    assert "pass 'leaky' provided a Other, which is not among the types it declares in " \
           "`provides` (none)" in str(err.value)


@pytest.mark.parametrize("claims", [True, False])
def test_the_modified_flag_is_checked_against_the_graph(claims):
    """A pass that adds an op must say modified=True; one that changes nothing False."""
    graph = tf.Graph()
    manager = PassManager([AddsAConstant(claims), Counts()], [FingerprintInstrument()])
    if claims:
        manager.run(graph, _context())   # Counts says modified=False and changes nothing
        return
    with pytest.raises(PassError) as err:
        manager.run(graph, _context())
    assert str(err.value) == (
        "pass 'adds' reported modified=False, but the graph changed; a pass's "
        "PassResult.modified must say whether it changed the graph")


class Claims(Counts):
    """Changes nothing but says it did."""

    name = "claims"

    def run(self, graph, ctx):
        super().run(graph, ctx)
        return PassResult(modified=True)


def test_a_pass_claiming_a_change_it_did_not_make_fails():
    with pytest.raises(PassError) as err:
        PassManager([Claims()], [FingerprintInstrument()]).run(tf.Graph(), _context())
    assert str(err.value) == (
        "pass 'claims' reported modified=True, but the graph is unchanged; a pass's "
        "PassResult.modified must say whether it changed the graph")


def _mlp(groups: int = 1):
    """A TF1 MLP classifier with a static batch, tf.compat.v1.layers and Adam."""
    features = tf.compat.v1.placeholder(tf.float32, [8, 6], name="features")
    labels = tf.compat.v1.placeholder(tf.int32, [8], name="labels")
    with epl.replicate(1):
        hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu)
        logits = tf.compat.v1.layers.dense(hidden, 4)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
    return loss


def test_every_pass_is_built_from_its_options(epl_env):
    """The pipeline's passes carry typed options read from the config once; a pass
    whose options say it is off is in the list, marked off."""
    config = epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 3,
                      "optimizer.num_apply_group": 2, "pipeline.strategy": "PreferForward"})
    passes = {p.name: p for p in parallel.training_pipeline(config)}
    assert passes["replicate"].options.num_micro_batch == 3
    assert passes["accumulate"].enabled and passes["apply_groups"].options.groups == 2
    assert passes["schedule"].options.strategy == "PreferForward"
    assert not passes["zero"].enabled and not passes["amp"].enabled


def _update_edges(config: dict) -> int:
    """Control edges between the Adam updates of the MLP parallelized under `config`."""
    epl.init(epl.Config(config))
    graph = tf.Graph()
    with graph.as_default():
        _mlp()
        epl.parallelize(graph)
    updates = [op for op in graph.get_operations() if op.type == "ResourceApplyAdam"]
    return sum(1 for op in updates for c in op.control_inputs if c.type == "ResourceApplyAdam")


def test_a_pass_disabled_by_name_is_off_and_the_rewrite_runs_without_it(epl_env):
    """debug.disabled_passes: the pass neither validates nor runs; the parallel graph
    is built without it (no apply-group control edges between the updates)."""
    config = {"cluster.virtual_devices": 2, "optimizer.num_apply_group": 2}
    assert _update_edges(config) > 0
    assert _update_edges({**config, "debug.disabled_passes": ["apply_groups"]}) == 0


def test_disabling_a_pass_that_another_needs_is_refused(epl_env):
    epl_env({"cluster.virtual_devices": 2, "amp.level": "O1",
             "debug.disabled_passes": ["amp"]})
    graph = tf.Graph()
    with graph.as_default():
        _mlp()
        with pytest.raises(PassError) as err:
            epl.parallelize(graph)
    assert str(err.value).startswith(
        "pass 'unscale' requires AmpRewrite, which no input and no enabled pass before it "
        "provides;")
    assert record_of(graph).result is None


def test_disabling_a_pass_that_does_not_exist_is_refused(epl_env):
    config = epl_env({"debug.disabled_passes": ["replicat"]})
    with pytest.raises(ConfigError) as err:
        parallel.training_pipeline(config)
    assert str(err.value).startswith("debug.disabled_passes names ['replicat'], which are no "
                                     "passes; the passes are ['split', 'auto_stages', ")


def test_a_pass_placed_before_one_it_must_follow_is_refused(epl_env):
    """zero reduces the gradients as accumulate and unscale left them: it must come
    after both, whether they are on or off."""
    config = epl_env({"cluster.virtual_devices": 2})
    passes = parallel.training_pipeline(config)
    names = [p.name for p in passes]
    zero = passes.pop(names.index("zero"))
    passes.insert(names.index("accumulate"), zero)
    with pytest.raises(PassError) as err:
        PassManager(passes[1:], available={TrainingView, Plan})
    assert str(err.value).startswith("pass 'zero' must run after ['accumulate', 'unscale']; the "
                                     "pipeline is ['annotate', 'amp', 'recompute', 'replicate', "
                                     "'consistency', "
                                     "'zero', ")
