"""Golden structural tests: each pass run alone on a small graph (as TVM's pass tests do).

For every pass of the two pipelines (epl/parallel.py) a small model written the way
TF1 code is (a static-batch placeholder, tf.compat.v1.layers.dense, Adam) is
analysed and planned (`parallel.pass_context`), the passes before the pass under
test run, and then that pass runs alone (`parallel.run_passes`). The test compares
what it added to the graph, counted by op type, with the golden table below, and
checks what it must have changed. A change of a pass's output changes its row:
update the table only after reading the new dump (`epl-dump`) and deciding the new
graph is the intended one.

These histograms are a smoke check: how each pass wired what it built, op by op, is
compared with checked-in dumps in test_pass_wiring.py.
"""
from __future__ import annotations

import collections

import pytest
import tensorflow as tf

import epl
import pass_alone
from epl import parallel
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR
from epl.ir.autodiff import internal_autodiff
from epl.hooks.record import record_of
from epl.errors import PassError
from epl.ir.graph_view import TrainingView
from epl.passes.pipeline.accumulate import Accumulation
from epl.passes.recompute.recompute import Recompute
from epl.passes.replication.result import Replication
from epl.passes.unscale import Unscaling
from epl.passes.zero import ZeroSharding
from wiring_dump import changed_ops

BATCH, FEATURES, HIDDEN, CLASSES = 8, 6, 16, 4

# the passes that reduce over the replicas: TensorFlow's collectives (what GPUs run),
# not the CPU default's sum on one device (tests/passes/test_replicate_structure.py)
COLLECTIVE = {"communication.local_reduction": "collective"}

# pass -> (config, model options)
CASES = {
    "auto_stages": ({"cluster.virtual_devices": 2, "auto.auto_parallel": True,
                     "pipeline.num_stages": 2}, {}),
    "annotate": ({"cluster.virtual_devices": 2}, {}),
    "amp": ({"cluster.virtual_devices": 2, "amp.level": "O1", "amp.loss_scale": 128.0}, {}),
    "recompute": ({"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"}, {}),
    "replicate": ({"cluster.virtual_devices": 2}, {}),
    "consistency": ({"cluster.virtual_devices": 2, "batch_norm.moving_statistics": "mean"},
                    {"batch_norm": True}),
    "accumulate": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}, {}),
    "unscale": ({"cluster.virtual_devices": 2, "amp.level": "O1",
                 "amp.loss_scale": "dynamic"}, {}),
    "schedule": ({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
                 {"stages": True}),
    "zero": ({"cluster.virtual_devices": 2, "zero.level": "v1", **COLLECTIVE}, {}),
    "gradient_comm": ({"cluster.virtual_devices": 2, "communication.max_splits": 0,
                       **COLLECTIVE}, {}),
    "apply_groups": ({"cluster.virtual_devices": 2, "optimizer.num_apply_group": 2}, {}),
    "skip_on_overflow": ({"cluster.virtual_devices": 2, "amp.level": "O1",
                          "amp.loss_scale": "dynamic", **COLLECTIVE}, {}),
    "offload": ({"cluster.virtual_devices": 2, "offload.level": "v0"}, {}),
    "verify": ({"cluster.virtual_devices": 2}, {}),
    "unit_functions": ({"cluster.virtual_devices": 2, "pipeline.unit_functions": True}, {}),
}

# pass -> (op types it adds, with their counts; how many existing ops it changes:
# retagged, re-placed, rewired or given control edges; wiring_dump.changed_ops). Two
# replicas of the MLP (hidden 6x16, logits 16x4, Adam), the pipeline case with two stages.
GOLDEN: dict[str, tuple[dict[str, int], int]] = {
    "auto_stages": ({}, 51),   # tags the forward ops with their stage
    "annotate": ({}, 167),   # tags every op with its TaskGraph and phase
    "amp": ({"Cast": 6, "Const": 1, "MatMul": 2}, 2),
    "recompute": ({}, 0),   # chooses the checkpoints only (test_recompute_chooses_...)
    # (the gradients' tf.tuple gates are not copied: epl/passes/replication/backward_copy.py)
    "replicate": ({"AddN": 1, "AssignAddVariableOp": 1, "AssignVariableOp": 17, "BiasAdd": 4,
                   "BiasAddGrad": 4, "Const": 23, "ExpandDims": 2, "Fill": 2,
                   "MatMul": 12, "Mean": 2, "Mul": 6, "NoOp": 16, "Placeholder": 2,
                   "ReadVariableOp": 33, "RealDiv": 2, "Relu": 2, "ReluGrad": 2, "Reshape": 2,
                   "ResourceApplyAdam": 4, "SparseSoftmaxCrossEntropyWithLogits": 2, "Split": 2,
                   "Tile": 2, "VarHandleOp": 15}, 167),
    # per replica and variable (4): micro-batch 0's zeros (Fill of a shape and a zero)
    # and its add into them, micro-batch 1's add and the scaling by 1/2; the updates
    # read the sum
    "accumulate": ({"AddV2": 16, "Const": 24, "Fill": 8, "Mul": 8}, 8),
    # x 1/scale and a non-finite count per gradient of each replica; the updates read it
    "unscale": ({"Cast": 8, "Const": 9, "IsFinite": 8, "LogicalNot": 8, "Mul": 8,
                 "RealDiv": 1, "Sum": 8}, 8),
    # barriers of the two micro-batches' schedule (the ops the barriers wait for, marked
    # by TensorFlow's _has_manual_control_dependencies only, do not count as changed);
    # the changed ops wait for one: micro-batch 0's zeros among them (4 Fills)
    "schedule": ({"NoOp": 6}, 12),
    "zero": ({"AssignVariableOp": 40, "CollectiveGather": 24, "CollectiveReduce": 8,
              "Const": 152, "Mul": 8, "NoOp": 24, "ReadVariableOp": 40, "Reshape": 40,
              "ResourceApplyAdam": 8, "Split": 8, "StridedSlice": 32, "VarHandleOp": 28}, 44),
    "gradient_comm": ({"CollectiveReduce": 2, "ConcatV2": 2, "Const": 12, "Reshape": 8,
                       "SplitV": 2}, 8),
    "apply_groups": ({}, 6),   # control edges between the update groups
    # the counts summed over replicas, the 12 updates under tf.cond, the scale's update
    "skip_on_overflow": ({"AddN": 2, "AddV2": 1, "AssignVariableOp": 2, "CollectiveReduce": 2,
                          "Const": 8, "Equal": 2, "GreaterEqual": 1, "Identity": 13, "If": 12,
                          "LogicalAnd": 1, "LogicalNot": 1, "Maximum": 1, "Mul": 2, "NoOp": 1,
                          "ReadVariableOp": 3, "SelectV2": 3}, 9),
    "offload": ({}, 51),   # variables and the ops on their handles moved to the host
    # batch norm's two moving statistics: the mean over the two units (weight x part,
    # summed), read by each replica's write of them (4); the units' backward ops, built
    # under control_dependencies(UPDATE_OPS), no longer wait for the writes (71)
    "consistency": ({"AddN": 2, "Const": 4, "Mul": 4}, 75),
    "verify": ({}, 0),     # checks only
    # per replica, its forward and its backward as one call each (the forward reads the
    # variables in its body: a StatefulPartitionedCall); the update ops and the loss's
    # merge read the calls (changed); per variable a call reads (4 per replica), whether
    # it is initialized, asked only after a cancelled step; the 4 updates wait for the
    # first replica's copied reads (changed: a fetch of its copies reads the old weights);
    # per device, the reference variable op its calls wait for (ref_scan_marks)
    "unit_functions": ({"PartitionedCall": 2, "StatefulPartitionedCall": 2,
                        "VarIsInitializedOp": 8, "VariableV2": 2}, 13),
}


def _build(stages: bool = False, batch_norm: bool = False) -> tf.Tensor:
    """An MLP classifier (one or two pipeline stages; batch norm after the hidden
    layer, its UPDATE_OPS run by the train op) with Adam; returns the loss."""
    features = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="features")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
    first = epl.replicate(device_count=1, name="stage_0") if stages else epl.replicate(1)
    with first:
        hidden = tf.compat.v1.layers.dense(features, HIDDEN, activation=tf.nn.relu,
                                           name="hidden")
        if batch_norm:
            hidden = tf.compat.v1.layers.batch_normalization(hidden, training=True)
    second = epl.replicate(device_count=1, name="stage_1") if stages else first
    with second:
        logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        tf.compat.v1.train.AdamOptimizer(0.01).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return loss


def run_alone(epl_env, name: str):
    """(graph, ops the pass added, ops it changed, the context) for pass `name`
    (pass_alone.run_alone: the passes before it that its config enables, then it)."""
    config, options = CASES[name]
    alone = pass_alone.run_alone(lambda: _build(**options), epl_env(config), name)
    added, changed = changed_ops(alone.graph, alone.before)
    return alone.graph, added, changed, alone.ctx


def _counts(ops) -> dict[str, int]:
    return dict(sorted(collections.Counter(op.type for op in ops).items()))


def test_every_pass_has_a_case():
    """Each training pass has its golden case (a new pass needs one)."""
    assert [p.name for p in parallel.training_pipeline(epl.Config())] == list(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_pass_alone_adds_its_golden_ops(epl_env, name):
    graph, added, changed, ctx = run_alone(epl_env, name)
    assert ctx.passes_run[-1] == name, "the pass is enabled by its case's config"
    assert (_counts(added), len(changed)) == GOLDEN[name]
    for op in added:   # EPL's ops are tagged and placed like every other op
        assert TASKGRAPH_ATTR in op.node_def.attr and PHASE_ATTR in op.node_def.attr
        assert op.device, op.name


def test_recompute_chooses_forward_checkpoints(epl_env):
    """The recompute pass adds no op: it chooses, on the template, the forward tensors
    each step's backward keeps, which the replicate pass builds the backward with."""
    graph, _, _, ctx = run_alone(epl_env, "recompute")
    kept = [t for tensors in ctx.get(Recompute).checkpoints.values() for t in tensors]
    assert kept and all(ctx.get(TrainingView).phase_of[t.op].value == "forward" for t in kept)


def run_pipeline(epl_env, config: dict):
    """The context after the whole training pipeline ran on the MLP under `config`."""
    config = epl_env(config)
    graph = tf.Graph()
    with graph.as_default():
        _build()
        ctx, instruments, passes = parallel.pass_context(graph, record_of(graph),
                                                         parallel.training_pipeline(config))
        with internal_autodiff():
            parallel.run_passes(graph, ctx, passes, instruments)
    return ctx


def test_gradients_flow_one_way(epl_env):
    """Micro-batches and a dynamic loss scale: each replica's updates read the unscaled
    sum of its micro-batch gradients, and the reduction reads that, never the raw one."""
    ctx = run_pipeline(epl_env, {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
                                 "amp.level": "O1", "amp.loss_scale": "dynamic"})
    raw = ctx.get(Replication).gradients
    summed = ctx.get(Accumulation).gradients.entries
    unscaled = ctx.get(Unscaling).gradients.entries
    for (_, micro0, _), (_, sums, _), (_, final, _) in zip(raw, summed, unscaled):
        for first, total, result in zip(micro0, sums, final):
            # the raw gradient feeds only the accumulation, the sum only the unscaling
            assert all(c.type == "AddV2" for c in first.consumers())
            assert [c for c in total.consumers() if c.type != "Mul"] == []
            assert result.consumers() and any(c.type != "Mul" for c in result.consumers())


def test_a_pass_that_is_off_changes_nothing(epl_env):
    """zero.level off: the zero pass is not enabled; it neither validates nor runs, and
    its dump entry says why (its `off_note`)."""
    ctx = run_pipeline(epl_env, {"cluster.virtual_devices": 2})
    assert ctx.passes_off == ["auto_stages", "amp", "recompute", "accumulate", "unscale", "zero",
                              "apply_groups", "skip_on_overflow", "offload"]
    assert "unit_functions" in ctx.passes_run   # on by default (pipeline.unit_functions)
    assert "zero" not in ctx.passes_run and ctx.find(ZeroSharding) is None


def test_split_pass_alone_shards_the_layer(epl_env):
    """The gradient-time pipeline (the split pass) on a column-split dense layer over two
    devices, run directly on the forward graph: per-device copies of the layer's ops and
    its variable as two shards."""
    epl_env({"cluster.virtual_devices": 2})
    graph = tf.Graph()
    with graph.as_default():
        features = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES])
        labels = tf.compat.v1.placeholder(tf.int32, [BATCH])
        with epl.split(device_count=2):
            logits = tf.compat.v1.layers.dense(features, CLASSES, use_bias=False, name="cls")
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits))
        before = set(graph.get_operations())
        parallel.run_gradient_time_pipeline(graph, record_of(graph), loss)
    added = [op for op in graph.get_operations() if op not in before]
    assert _counts(added) == SPLIT_GOLDEN
    assert {op.device for op in added if op.type == "MatMul"} == {"/device:CPU:0",
                                                                 "/device:CPU:1"}
    assert [record.taskgraph for record in record_of(graph).splits]


# Vocab-parallel logits: each device's matmul, the distributed softmax cross entropy
# (max, sum of exponentials and the label's logit exchanged between shards), two shards.
SPLIT_GOLDEN: dict[str, int] = {
    "AddN": 2, "AddV2": 1, "AssignVariableOp": 2, "Cast": 2, "ConcatV2": 1, "Const": 26,
    "Exp": 2, "Log": 1, "MatMul": 2, "Max": 3, "Mul": 2, "NoOp": 3, "OneHot": 2, "Pack": 1,
    "ReadVariableOp": 6, "Slice": 2, "StopGradient": 1, "StridedSlice": 2, "Sub": 5, "Sum": 4,
    "VarHandleOp": 2, "VarIsInitializedOp": 2}


def _split_experts(epl_env, chunks: int) -> dict[str, int]:
    """Op types the split pass adds for one expert matmul (tokens [B, E=4, capacity 4,
    d], weight [E, d, h]) over two devices with split.moe_chunks=`chunks`."""
    epl_env({"cluster.virtual_devices": 2, "split.moe_chunks": chunks})
    graph = tf.Graph()
    with graph.as_default():
        tokens = tf.compat.v1.placeholder(tf.float32, [BATCH, 4, 4, FEATURES])
        with epl.split(device_count=2):
            experts = tf.compat.v1.get_variable("experts", [4, FEATURES, HIDDEN])
            out = tf.matmul(tokens, experts)
        loss = tf.reduce_mean(out)   # outside the scope: the combine concat
        before = set(graph.get_operations())
        parallel.run_gradient_time_pipeline(graph, record_of(graph), loss)
    return _counts(op for op in graph.get_operations() if op not in before)


def test_split_pass_chunked_expert_dispatch(epl_env):
    """split.moe_chunks=2: the dispatch is two slices per device (one per chunk of the
    capacity axis) instead of one, each feeding its own expert matmul, and each device
    concatenates its chunks back (the other Slice and ConcatV2 ops: the variable's
    shards and their view, the combine)."""
    assert _split_experts(epl_env, 1) == SPLIT_EXPERTS_GOLDEN
    assert _split_experts(epl_env, 2) == {**SPLIT_EXPERTS_GOLDEN, "BatchMatMulV2": 4,
                                          "ConcatV2": 4, "Const": 16, "Slice": 6}


SPLIT_EXPERTS_GOLDEN: dict[str, int] = {
    "AssignVariableOp": 2, "BatchMatMulV2": 2, "ConcatV2": 2, "Const": 10, "NoOp": 3,
    "ReadVariableOp": 6, "Slice": 4, "VarHandleOp": 2, "VarIsInitializedOp": 2}


def test_a_before_analysis_pass_after_another_is_refused():
    """A pass that runs on the graph as the user built it (auto_stages) must come
    before every pass that needs the analysis; the driver says which and how to fix."""
    pipeline = parallel.training_pipeline(epl.Config())
    moved = pipeline[1:3] + pipeline[:1] + pipeline[3:]
    with pytest.raises(PassError) as err:
        parallel.before_analysis(moved)
    assert str(err.value) == (
        "pass(es) ['auto_stages'] run before the analysis, but come after 'annotate' in the "
        f"pipeline {[p.name for p in moved]}. Move them to the front of the pass list.")
    first, rest = parallel.before_analysis(pipeline)
    assert [p.name for p in first] == ["auto_stages"] and rest == pipeline[1:]
