"""Automatic pipeline stages on a BERT-like model written the way real TF1 code is.

`auto.auto_parallel` with `pipeline.num_stages` cuts an unannotated script
into stages (epl/passes/pipeline/auto_stages.py). The model is tests/bert_like.py
with 4 encoder layers: a static batch from a tf.data pipeline, reshapes built
from get_shape_list, tf.compat.v1.layers.dense, layer norm, an attention mask
read by every layer, and the masked-LM output tied to the embedding table.

Which stage holds which encoder layer is read from the variables the stage's
ops read: the user's own variable scopes `layer_0` .. `layer_3` name them (the
test reads names to check; the partition itself never does). The oracle: the
auto-staged pipeline trains to the same variables and losses as single-device
TensorFlow on the concatenated micro-batches, to the noise-floor tolerance of
tests/bert_like.py (tests/conftest.py explains it).
"""
from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl import env
from epl.errors import PassError
from epl.ir.annotations import TASKGRAPH_ATTR
from epl.hooks.record import record_of
from epl.hooks.session import parallel_graph
from epl.passes.pipeline import auto_stages

import bert_like

LAYERS = 4
CONFIG = bert_like.BertConfig(num_hidden_layers=LAYERS)
MICRO, MICRO_BATCHES, STEPS = 4, 2, 3
EXAMPLES = bert_like.make_examples(96, seed=2)


def build_pretraining_4_layers(batch_size: int, examples: dict, **kwargs):
    """bert_like.build_pretraining with 4 encoder layers (Adam via minimize)."""
    return bert_like.build_pretraining(batch_size, examples, config=CONFIG, **kwargs)


def build_pretraining_custom_4_layers(batch_size: int, examples: dict, **kwargs):
    """bert_like.build_pretraining_custom with 4 encoder layers (tf.gradients, clipping
    and BERT's weight-decay Adam of assign ops)."""
    return bert_like.build_pretraining_custom(batch_size, examples, config=CONFIG, **kwargs)


def _auto_config(stages: int) -> dict:
    return {"cluster.virtual_devices": stages, "auto.auto_parallel": True,
            "pipeline.num_stages": stages, "pipeline.num_micro_batch": MICRO_BATCHES}


def _plan(stages: int, builder=build_pretraining_4_layers) -> tuple:
    """(partition, graph) of the model built under the auto-stage config."""
    env.reset()
    epl.init(epl.Config(_auto_config(stages)))
    with tf.Graph().as_default() as graph:
        builder(MICRO, EXAMPLES)
        partition = auto_stages.plan_stages(graph, record_of(graph), stages)
    return partition, graph


def _variables_read(op: tf.Operation) -> list[str]:
    """Names of the variables whose value `op` reads: through a resource input
    (ReadVariableOp, ResourceGather) or a ReadVariableOp's output."""
    names = []
    for tensor in op.inputs:
        if tensor.op.type == "VarHandleOp":
            names.append(tensor.op.name)
        elif tensor.op.type == "ReadVariableOp" and tensor.op.inputs[0].op.type == "VarHandleOp":
            names.append(tensor.op.inputs[0].op.name)
    return names


def _reads_by_stage(partition) -> dict[int, set[str]]:
    """stage -> names of the variables its ops read."""
    reads = collections.defaultdict(set)
    for op, stage in partition.stage_of.items():
        reads[stage].update(_variables_read(op))
    return dict(reads)


def _layers_by_stage(partition) -> dict[int, set[int]]:
    """stage -> encoder layers (the user's `layer_<i>` scopes) some variable of which
    the stage reads."""
    return {stage: {int(m.group(1)) for name in names
                    if (m := re.match(r"layer_(\d+)/", name))}
            for stage, names in _reads_by_stage(partition).items()}


# --------------------------------------------------------------------------
# The partition
# --------------------------------------------------------------------------


def test_four_layers_in_two_stages_get_two_layers_each():
    """The user's report: stage 0 held the embeddings and every layer (83% of the cost).
    The attention mask crossed every layer boundary, so only cuts inside the last layer
    had one crossing tensor; now the mask (batch-derived) does not count."""
    partition, _ = _plan(2)
    assert _layers_by_stage(partition) == {0: {0, 1}, 1: {2, 3}}, partition.describe()
    reads = _reads_by_stage(partition)
    assert any(name.startswith("embeddings/") for name in reads[0])
    assert not any(name.startswith(("cls/", "pooler/")) for name in reads[0])
    shares = np.array(partition.costs) / sum(partition.costs)
    assert max(shares) / min(shares) < 1.1, partition.describe()


def test_four_layers_in_four_stages_get_one_layer_each():
    partition, _ = _plan(4)
    assert _layers_by_stage(partition) == {i: {i} for i in range(4)}, partition.describe()
    costs = partition.costs
    # the embeddings ride with layer 0 and the heads with layer 3
    assert max(costs) / min(costs) < 1.25, partition.describe()


@pytest.mark.parametrize("stages", [2, 4])
def test_each_cut_sends_the_hidden_state_and_the_mask(stages):
    """One activation per cut (the layer's output, read by the next layer's query, key
    and value projections and its residual); the attention mask, computed from the
    batch alone, is sent along as a batch-derived tensor."""
    partition, _ = _plan(stages)
    assert [len(tensors) for tensors in partition.crossing] == [1] * (stages - 1)
    for i, (hidden,) in enumerate(partition.crossing):
        layer = (i + 1) * LAYERS // stages
        readers = {re.match(r"layer_(\d+)/", name).group(1)
                   for c in hidden.consumers() for name in _variables_read(c)}
        assert readers == {str(layer)}, (i, hidden.name, readers)
        assert len(hidden.consumers()) >= 4   # query, key, value and the residual add
    masks = {tensor for tensors in partition.batch_crossing for tensor in tensors}
    assert len(masks) == 1 and all(len(t) == 1 for t in partition.batch_crossing)
    (mask,) = masks
    assert mask.shape.as_list() == [MICRO, bert_like.SEQ_LEN, bert_like.SEQ_LEN]
    assert "(and batch-derived " + mask.name + ")" in partition.describe()


def test_the_custom_training_step_gets_the_same_partition():
    """tf.gradients with BERT's optimizer does not change the forward cut."""
    partition, _ = _plan(2, build_pretraining_custom_4_layers)
    assert _layers_by_stage(partition) == {0: {0, 1}, 1: {2, 3}}, partition.describe()


def test_batch_derived_ops_run_in_the_stage_that_reads_them():
    """Each layer's mask adder (computed from the mask only) runs in its layer's stage;
    the label one-hot of the masked-LM loss runs in the last stage."""
    partition, _ = _plan(2)
    stage_of = partition.stage_of
    (mask,) = partition.batch_crossing[0]
    for adder_input in mask.consumers():
        users = [c for out in adder_input.outputs for c in out.consumers()]
        later = [stage_of[c] for c in users if c in stage_of]
        assert stage_of[adder_input] == min(later), adder_input.name
    one_hots = [op for op in stage_of if op.type == "OneHot"]
    # the token-type one-hot feeds the embeddings, the label one-hots the two losses
    assert sorted(stage_of[op] for op in one_hots) == [0, 1, 1]


# --------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------


@pytest.mark.parametrize("builder, stages", [(build_pretraining_4_layers, 2),
                                             (build_pretraining_custom_4_layers, 2),
                                             (build_pretraining_4_layers, 4)],
                         ids=["adam-2-stages", "bert-optimizer-2-stages", "adam-4-stages"])
def test_auto_stages_train_like_single_device(builder, stages):
    """The auto-staged pipeline (one replica, 2 micro-batches of MICRO) equals
    single-device training on the 2 batches concatenated."""
    config = {**_auto_config(stages), "debug.check_invariants": True}
    result = bert_like.train(builder, MICRO, EXAMPLES, config, STEPS)
    graph = result[2]
    parallel = parallel_graph(graph)
    assert [tg.name for tg in parallel.view.taskgraphs] == [f"stage_{i}" for i in range(stages)]
    assert parallel.plan.num_replicas == 1
    layer_stage = {}
    for var in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES):
        m = re.match(r"layer_(\d+)/", var.op.name)
        if m:
            layer_stage.setdefault(int(m.group(1)), set()).add(
                var.op.node_def.attr[TASKGRAPH_ATTR].s.decode())
    assert layer_stage == {i: {f"stage_{i * stages // LAYERS}"} for i in range(LAYERS)}
    bert_like.assert_matches(result, bert_like.reference(builder, MICRO_BATCHES * MICRO,
                                                         EXAMPLES, STEPS))


# --------------------------------------------------------------------------
# Refusal
# --------------------------------------------------------------------------


def test_more_stages_than_places_to_cut_is_refused():
    """A two-layer MLP has 9 forward ops computed from the batch and the weights, so 8
    places to cut; 10 stages need 9. The session refuses as it is created."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": 10, "auto.auto_parallel": True,
                         "pipeline.num_stages": 10}))
    with tf.Graph().as_default():
        features = tf.compat.v1.placeholder(tf.float32, [8, 6])
        labels = tf.compat.v1.placeholder(tf.float32, [8, 4])
        hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu)
        logits = tf.compat.v1.layers.dense(hidden, 4)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(PassError) as info:
            tf.compat.v1.Session()
    assert str(info.value) == "pass 'auto_stages' rejected the graph before any rewrite: " + (
        "pipeline.num_stages=10: the model has fewer than 9 places where at most 4 activation "
        "tensors cross between consecutive ops (9 forward ops computed from the batch and the "
        "weights). Lower pipeline.num_stages, or mark the stages with "
        "epl.replicate(device_count=1, name='stage_<i>') scopes.")
