"""Wiring goldens: what each pass builds, op by op, compared with a checked-in dump.

For every pass of the two pipelines (epl/parallel.py: split at gradient time; the
training passes), a small Before graph written the way TF1 code is (static-shape
placeholders, tf.compat.v1.layers, a tf.compat.v1.train optimizer) is analysed and
planned by the driver (`parallel.pass_context`), the passes before the pass under
test that its config enables run, and then that pass runs alone (pass_alone.py).
The split pass runs as the optimizer hooks run it, on the forward graph. The
canonical text of what a pass added and changed (wiring_dump.py: every such op's
name with EPL's unique suffixes normalized, type, device, tags, data and control
inputs, sorted) is compared with `goldens/<pass>.txt`.

A changed golden is a changed rewrite. Read the diff the failure prints; if the new
wiring is the intended one, rewrite the goldens and commit them with the change:

    .venv/bin/python -m pytest -q tests/passes/test_pass_wiring.py --update-goldens
    (or EPL_UPDATE_GOLDENS=1 .venv/bin/python -m pytest -q tests/passes/test_pass_wiring.py)

Each pass also has a negative case: a Before graph it must refuse, with the exact
message, or, for a pass that refuses nothing, one it must leave unchanged
(modified=False, the graph's fingerprint as before; for a pass that is off under a
config, the manager's record of it off and the graph untouched).

The op-type histograms of test_pass_golden.py stay as a smoke check.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import tensorflow as tf

import epl
from epl import parallel
from epl.errors import PassError
from epl.hooks.record import record_of
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR
from epl.ir.graph_view import TrainingView
from epl.passes.annotate import AnnotatePass
from epl.passes.recompute.recompute import Recompute
from epl.passes.replication.result import Replication
from pass_alone import run_alone
from wiring_dump import canonical_names, check_golden, dump_changes, snapshot

BATCH, FEATURES, HIDDEN, CLASSES = 4, 3, 4, 2


# --------------------------------------------------------------------------
# Before graphs
# --------------------------------------------------------------------------


def _inputs(batch: int = BATCH):
    features = tf.compat.v1.placeholder(tf.float32, [batch, FEATURES], name="features")
    labels = tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
    return features, labels


def _xent(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def _momentum():
    return tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)


def classifier(optimizer=_sgd, bias: bool = True, global_step: bool = False,
               resource: bool = True, batch: int = BATCH, clip: bool = False) -> None:
    """features -> dense logits -> mean softmax cross entropy, under
    epl.replicate(1, name="model"), minimized by `optimizer()` (with a global step;
    clip: compute_gradients, clip_by_norm of each gradient, apply_gradients)."""
    features, labels = _inputs(batch)
    with tf.compat.v1.variable_scope("", use_resource=resource), \
            epl.replicate(device_count=1, name="model"):
        logits = tf.compat.v1.layers.dense(features, CLASSES, use_bias=bias, name="logits")
        loss = _xent(labels, logits)
    step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
    opt = optimizer()
    if clip:
        grads, variables = zip(*opt.compute_gradients(loss))
        grads = [tf.clip_by_norm(g, 1.0) for g in grads]
        opt.apply_gradients(zip(grads, variables), global_step=step)
    else:
        opt.minimize(loss, global_step=step)


def mlp(collect: bool = False, global_step: bool = False) -> None:
    """A hidden ReLU layer and the logits under epl.replicate(1, name="model"), SGD;
    collect: the hidden activation goes into the 'checkpoints' collection."""
    features, labels = _inputs()
    with epl.replicate(device_count=1, name="model"):
        hidden = tf.compat.v1.layers.dense(features, HIDDEN, activation=tf.nn.relu, name="hidden")
        if collect:
            tf.compat.v1.add_to_collection("checkpoints", hidden)
        loss = _xent(labels, tf.compat.v1.layers.dense(hidden, CLASSES, name="logits"))
    step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
    _sgd().minimize(loss, global_step=step)


def batch_norm_classifier(last_max: bool = False) -> None:
    """Batch norm over the features, then the classifier, under epl.replicate(1,
    name="model"); SGD after batch norm's UPDATE_OPS (as TF1 scripts write it).
    last_max: the step also stores the batch's largest feature in a variable (a
    write of a per-replica value no reduction makes consistent)."""
    features, labels = _inputs()
    with tf.compat.v1.variable_scope("", use_resource=True), \
            epl.replicate(device_count=1, name="model"):
        normed = tf.compat.v1.layers.batch_normalization(features, training=True, name="bn")
        logits = tf.compat.v1.layers.dense(normed, CLASSES, name="logits")
        loss = _xent(labels, logits)
        writes = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        if last_max:
            seen = tf.compat.v1.get_variable("last_max", [], trainable=False,
                                             initializer=tf.compat.v1.zeros_initializer())
            writes.append(seen.assign(tf.reduce_max(features), name="store_last_max"))
    with tf.control_dependencies(writes):
        _sgd().minimize(loss)


def unannotated_mlp() -> None:
    """The MLP written without any scope."""
    features, labels = _inputs()
    hidden = tf.compat.v1.layers.dense(features, HIDDEN, activation=tf.nn.relu, name="hidden")
    logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits")
    _sgd().minimize(_xent(labels, logits))


def weight_decay_outside() -> None:
    """The classifier (no bias) with an L2 penalty on its kernel added outside the scope."""
    features, labels = _inputs()
    with epl.replicate(device_count=1, name="model"):
        logits = tf.compat.v1.layers.dense(features, CLASSES, use_bias=False, name="logits")
        loss = _xent(labels, logits)
    kernel = tf.compat.v1.trainable_variables()[0]
    _sgd().minimize(loss + 0.01 * tf.nn.l2_loss(kernel))


def two_stages(cycle: bool = False) -> None:
    """Two pipeline stages (stage_0: the hidden layer; stage_1: the logits and the loss),
    SGD with the default gradient gating (GATE_OP: autodiff's gate NoOps,
    `<op>_grad/tuple/group_deps`, have control inputs only; each follows the stage of
    the ops it waits for).
    cycle: stage_0's scope, reopened, reads stage_1's logits (a stage cycle)."""
    features, labels = _inputs()
    with epl.replicate(device_count=1, name="stage_0"):
        hidden = tf.compat.v1.layers.dense(features, HIDDEN, activation=tf.nn.relu,
                                           name="hidden")
    with epl.replicate(device_count=1, name="stage_1"):
        logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits")
    if cycle:
        with epl.replicate(device_count=1, name="stage_0"):
            logits = logits * 2.0
    with epl.replicate(device_count=1, name="stage_1"):
        loss = _xent(labels, logits)
    _sgd().minimize(loss)


DEVICES2 = {"cluster.virtual_devices": 2}
# the passes that reduce over the replicas: TensorFlow's collectives (what GPUs run),
# not the CPU default's sum on one device (tests/passes/test_replicate_structure.py)
COLLECTIVE = {"communication.local_reduction": "collective"}
ONE_DEVICE = {"cluster.virtual_devices": 1}
AMP = {"amp.level": "O1", "amp.loss_scale": 128.0}
DYNAMIC = {"amp.level": "O1", "amp.loss_scale": "dynamic"}


@dataclasses.dataclass(frozen=True)
class Case:
    """A pass's Before graph (`build`) and config; `prepare(graph, ctx)` hands the pass
    a graph the passes before it could not have made (pass_alone.run_alone)."""

    config: dict
    build: Callable[[], None]
    prepare: Callable | None = None


# pass -> its golden case (the training pipeline, in order; split has its own test)
CASES = {
    "auto_stages": Case({**DEVICES2, "auto.auto_parallel": True, "pipeline.num_stages": 2},
                        unannotated_mlp),
    "annotate": Case(DEVICES2, weight_decay_outside),
    "amp": Case({**DEVICES2, **AMP}, classifier),
    "recompute": Case({**DEVICES2, "gradient_checkpoint.type": "collection"},
                      lambda: mlp(collect=True)),
    "replicate": Case(DEVICES2, lambda: classifier(global_step=True)),
    "consistency": Case({**DEVICES2, "batch_norm.moving_statistics": "mean"},
                        batch_norm_classifier),
    "accumulate": Case({**ONE_DEVICE, "pipeline.num_micro_batch": 2}, classifier),
    "unscale": Case({**DEVICES2, **DYNAMIC}, lambda: classifier(bias=False)),
    "schedule": Case({**DEVICES2, "pipeline.num_micro_batch": 2}, two_stages),
    "zero": Case({**DEVICES2, **COLLECTIVE, "zero.level": "v1"},
                 lambda: classifier(_momentum, bias=False)),
    "gradient_comm": Case({**DEVICES2, **COLLECTIVE}, classifier),
    "apply_groups": Case({**ONE_DEVICE, "optimizer.num_apply_group": 2},
                         lambda: mlp(global_step=True)),
    "skip_on_overflow": Case({**DEVICES2, **COLLECTIVE, **DYNAMIC},
                             lambda: classifier(bias=False)),
    "offload": Case({**DEVICES2, **COLLECTIVE, "offload.level": "v0"},
                    lambda: classifier(bias=False)),
    "verify": Case(DEVICES2, classifier),
    # two stages, two micro-batches: each unit's stage forward and backward as a call
    "unit_functions": Case({**DEVICES2, "pipeline.num_micro_batch": 2,
                            "pipeline.unit_functions": True}, two_stages),
}


def _title(name: str, config: dict) -> str:
    return f"pass {name}; config {dict(sorted(config.items()))}"


def _handed_on(name: str, alone) -> str:
    """What a pass that changes no op hands on, by canonical name (recompute: the
    forward tensors each step's backward keeps)."""
    if name != "recompute":
        return ""
    names = canonical_names(alone.graph, alone.user)
    kept = sorted(names[t.op] + (f":{t.value_index}" if t.value_index else "")
                  for tensors in alone.ctx.get(Recompute).checkpoints.values() for t in tensors)
    return "".join(f"# keeps {tensor}\n" for tensor in kept)


def wiring(epl_env, name: str) -> str:
    """The canonical dump of pass `name` run alone on its case's Before graph."""
    case = CASES[name]
    alone = run_alone(case.build, epl_env(case.config), name, case.prepare)
    if name != "auto_stages":   # pass_context runs it (and keeps the record of it)
        assert alone.ctx.passes_run[-1] == name, "the case's config enables the pass"
    return dump_changes(alone.graph, alone.before, _title(name, case.config), alone.user) + \
        _handed_on(name, alone)


def _column_split() -> tf.Tensor:
    """Vocab-parallel logits: a dense layer and its softmax cross entropy under
    epl.split over two devices; returns the loss."""
    features, labels = _inputs()
    with epl.split(device_count=2, name="classifier"):
        logits = tf.compat.v1.layers.dense(features, 2 * CLASSES, use_bias=False, name="cls")
        return _xent(labels, logits)


def _expert_tokens() -> tf.Tensor:
    """Tokens [batch, experts 4, capacity 4, d] through an expert matmul split over the
    experts (split.moe_chunks cuts the capacity axis); returns the loss."""
    tokens = tf.compat.v1.placeholder(tf.float32, [BATCH, 4, 4, FEATURES], name="tokens")
    with epl.split(device_count=2, name="experts"):
        experts = tf.compat.v1.get_variable("experts", [4, FEATURES, HIDDEN])
        out = tf.matmul(tokens, experts)
    return tf.reduce_mean(out)


def split_wiring(epl_env, config: dict, build) -> str:
    """The canonical dump of the gradient-time pipeline (the split pass) run, as the
    optimizer hooks run it before autodiff, on the forward graph `build()` makes."""
    epl_env(config)
    graph = tf.Graph()
    with graph.as_default():
        loss = build()
        before = snapshot(graph)
        parallel.run_gradient_time_pipeline(graph, record_of(graph), loss)
    return dump_changes(graph, before, _title("split", config), set(before))


# --------------------------------------------------------------------------
# goldens
# --------------------------------------------------------------------------


def test_every_pass_has_a_golden_and_a_negative_case():
    """A new pass needs both (CASES and REFUSALS or UNCHANGED below)."""
    config = epl.Config()
    names = [p.name for p in parallel.training_pipeline(config)]
    assert names == list(CASES)
    assert [p.name for p in parallel.gradient_time_pipeline(config)] == ["split"]
    assert sorted(set(REFUSALS) | set(UNCHANGED)) == sorted(names + ["split"])
    assert not set(REFUSALS) & set(UNCHANGED)


@pytest.mark.parametrize("name", list(CASES))
def test_pass_wiring_matches_its_golden(epl_env, update_goldens, name):
    check_golden(name, wiring(epl_env, name), update_goldens)


def test_split_wiring_matches_its_golden(epl_env, update_goldens):
    check_golden("split", split_wiring(epl_env, DEVICES2, _column_split), update_goldens)


def test_a_dump_is_the_same_when_built_again(epl_env):
    """No ids, addresses or counters in a dump: the same case built twice in one
    process (other op ids, another collective key allocator) dumps the same text."""
    assert wiring(epl_env, "zero") == wiring(epl_env, "zero")


def test_canonical_names_do_not_depend_on_creation_order():
    """EPL's scopes made unique in creation order (EPL_X, EPL_X_1) dump the same
    whichever op was built first: the names are told apart by what the ops compute."""
    def dump(scales):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
            before = snapshot(graph)
            for scale in scales:
                with tf.name_scope("EPL_SCALE"):
                    tf.multiply(x, scale, name="mul")
        return dump_changes(graph, before, user_ops=set(before))

    text = dump([2.0, 3.0])
    assert text == dump([3.0, 2.0])
    assert "EPL_SCALE_1" not in text and "+ EPL_SCALE/mul#1: Mul" in text


def test_an_updated_golden_then_passes(tmp_path):
    """--update-goldens writes what the next run compares with; a different dump then
    fails with its diff."""
    text = "# pass x\n+ a: NoOp @/device:CPU:0 []\n"
    check_golden("x", text, update=True, directory=str(tmp_path))
    check_golden("x", text, update=False, directory=str(tmp_path))
    with pytest.raises(AssertionError) as err:
        check_golden("x", text.replace("CPU:0", "CPU:1"), update=False,
                     directory=str(tmp_path))
    assert "-+ a: NoOp @/device:CPU:0 []\n++ a: NoOp @/device:CPU:1 []" in str(err.value)


# --------------------------------------------------------------------------
# negative cases: refusals
# --------------------------------------------------------------------------


def _refused(name: str, config: dict, build, prepare=None) -> Callable:
    """The message of the PassError that running `name` alone on `build()` raises."""
    def message(epl_env) -> str:
        with pytest.raises(PassError) as err:
            run_alone(build, epl_env(config), name, prepare)
        return str(err.value)
    return message


def _split_refused(epl_env) -> str:
    with pytest.raises(PassError) as err:
        split_wiring(epl_env, {**DEVICES2, "split.moe_chunks": 3}, _expert_tokens)
    return str(err.value)


def _call_a_template_op(graph: tf.Graph, ctx) -> None:
    """What a broken pass might leave: the train op waits for a template op (an original
    the replicas were copied from), so a step would also run the template's work."""
    template = sorted(ctx.get(Replication).replica_maps[0], key=lambda op: op._id)
    matmul = next(op for op in template if op.type == "MatMul")
    graph_mutation.add_control_inputs(ctx.get(TrainingView).train_ops[0], [matmul])


def _before_any(name: str) -> str:
    return f"pass {name!r} rejected the graph before any rewrite: "


# pass -> (its error message for a Before graph it must refuse, the exact message)
REFUSALS = {
    "split": (
        _split_refused,
        "pass 'split' failed (passes run before it: none): split.moe_chunks=3 must divide "
        "the tokens' capacity axis 2 of tokens:0 (shape [4, 4, 4, 3]), the input of MatMul "
        "(BatchMatMulV2), which has 4 entries. Set split.moe_chunks to a divisor of 4 (1: no "
        "chunks), or give the tokens a static capacity divisible by it."),
    "auto_stages": (
        _refused("auto_stages", {**DEVICES2, "auto.auto_parallel": True,
                                 "pipeline.num_stages": 20}, unannotated_mlp),
        _before_any("auto_stages") + "pipeline.num_stages=20: the model has fewer than 19 "
        "places where at most 4 activation tensors cross between consecutive ops (7 forward "
        "ops computed from the batch and the weights). Lower pipeline.num_stages, or mark the "
        "stages with epl.replicate(device_count=1, name='stage_<i>') scopes."),
    "amp": (
        _refused("amp", {**DEVICES2, **DYNAMIC}, lambda: classifier(resource=False)),
        _before_any("amp") + "amp.loss_scale 'dynamic' skips the update of a step whose "
        "gradients overflow, which needs resource variables, but logits/kernel is a reference "
        "variable (VariableV2). Create variables with use_resource=True (or call "
        "tf.compat.v1.enable_resource_variables()), or set a fixed amp.loss_scale."),
    "recompute": (
        _refused("recompute", {**DEVICES2, "gradient_checkpoint.type": "collection"}, mlp),
        _before_any("recompute") + "gradient_checkpoint.type is 'collection' but the "
        "'checkpoints' collection is empty: add tensors with "
        "tf.compat.v1.add_to_collection('checkpoints', t) or use type 'auto'"),
    "replicate": (
        _refused("replicate", {**DEVICES2, "io.batch_mode": "global"},
                 lambda: classifier(batch=5)),
        _before_any("replicate") + "the global batch of 5 examples cannot be split evenly "
        "over 2 replicas (io.batch_mode 'global'; inputs: features:0, labels:0). Use a global "
        "batch size divisible by 2, or io.batch_mode 'replica' (the default: the script's "
        "batch is one replica's micro-batch)."),
    "consistency": (
        _refused("consistency", DEVICES2, lambda: batch_norm_classifier(last_max=True)),
        _before_any("consistency") + "variable last_max would hold a different value on "
        "each replica: store_last_max (AssignVariableOp, in the training step) writes it, and "
        "its value is computed from the batch input features:0, without a reduction over the "
        "replicas. EPL keeps every replica's copy of a variable equal (docs/consistency.md). "
        "Remedy: compute the value from the loss, or add "
        "the tensor it is computed from to an EPL merge collection (epl.add_to_collection(t, "
        "epl.GraphKeys.GLOBAL_MEAN_OBJECTS) for a mean over examples, GLOBAL_SUM_OBJECTS for a "
        "sum or count), so the write reads its value over the global batch; for a moving "
        "statistic like batch norm's, add the write to tf.compat.v1.GraphKeys.UPDATE_OPS "
        "(batch_norm.moving_statistics then chooses the value); for a streaming metric, create "
        "its variables in tf.compat.v1.GraphKeys.METRIC_VARIABLES and only add to them."),
    "schedule": (
        _refused("schedule", {**DEVICES2, "pipeline.num_micro_batch": 2},
                 lambda: two_stages(cycle=True)),
        _before_any("schedule") + "the pipeline stages form a cycle: mul (type Mul, shape "
        "(4, 2), TaskGraph stage_0, device unset) in stage 0 (stage_0) reads logits/BiasAdd:0 "
        "computed by logits/BiasAdd (type BiasAdd, shape (4, 2), TaskGraph stage_1, device "
        "unset) in the later stage 1 (stage_1), so stage 1 feeds stage 0's forward. Stages "
        "are the strategy scopes in the order they were first opened; a stage may only read "
        "tensors of itself or of earlier stages. Move the op into the later stage's scope, or "
        "reorder the scopes."),
    "zero": (
        _refused("zero", {**DEVICES2, "zero.level": "v1"},
                 lambda: classifier(_momentum, bias=False, clip=True)),
        _before_any("zero") + "zero.level 'v1' cannot shard clip_by_norm/Sum (Sum) in the "
        "update of logits/kernel: ZeRO computes the gradient processing and the update on 1/N "
        "of each variable, element by element, and sums over the replicas only what adds up "
        "over elements (the squared norms of clip_by_global_norm). Compute the processing from "
        "those (tf.clip_by_global_norm, scaling by a scalar), or turn ZeRO off (zero.level '')."),
    "verify": (
        _refused("verify", DEVICES2, classifier, _call_a_template_op),
        "pass 'verify' failed (passes run before it: ['annotate', 'replicate', 'consistency', "
        "'schedule', 'gradient_comm']): invariant violated: the train op still needs "
        "original (template) ops: logits/MatMul/ReadVariableOp (type ReadVariableOp, shape (3, 2), TaskGraph model, "
        "device /device:CPU:0); logits/MatMul (type MatMul, shape (4, 2), TaskGraph model, "
        "device /device:CPU:0). This is an EPL bug; please report it."),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_pass_refuses_a_graph_it_cannot_rewrite(epl_env, name):
    message, expected = REFUSALS[name]
    assert message(epl_env) == expected


# --------------------------------------------------------------------------
# negative cases: passes that refuse nothing leave a graph with nothing to do unchanged
# --------------------------------------------------------------------------


def annotated_classifier() -> None:
    """The classifier as EPL's annotate pass left it (every op tagged with its analysed
    TaskGraph and phase), as a graph annotated and exported earlier would be."""
    classifier()
    graph = tf.compat.v1.get_default_graph()
    ctx, instruments, passes = parallel.pass_context(graph, record_of(graph), [AnnotatePass()])
    parallel.run_passes(graph, ctx, passes, instruments)


# pass -> (its case, whether the config turns it off)
UNCHANGED = {
    "annotate": (Case(DEVICES2, annotated_classifier), False),
    # one micro-batch: nothing to add (the pass is off)
    "accumulate": (Case(DEVICES2, classifier), True),
    # no loss scale to undo (amp off)
    "unscale": (Case(DEVICES2, classifier), True),
    # one replica: nothing to reduce
    "gradient_comm": (Case(ONE_DEVICE, classifier), False),
    # one update per replica: one group, no edge
    "apply_groups": (Case({**DEVICES2, "optimizer.num_apply_group": 2},
                          lambda: classifier(bias=False)), False),
    # a fixed scale: no step to skip (the pass is off)
    "skip_on_overflow": (Case({**DEVICES2, **AMP}, classifier), True),
    # one device: the variables are on the host already
    "offload": (Case({**ONE_DEVICE, "offload.level": "v0"}, classifier), False),
    # one device, one micro-batch: one unit, nothing to share
    "unit_functions": (Case({**ONE_DEVICE, "pipeline.unit_functions": True}, classifier), False),
}


@pytest.mark.parametrize("name", list(UNCHANGED))
def test_pass_with_nothing_to_do_leaves_the_graph_unchanged(epl_env, name):
    case, off = UNCHANGED[name]
    alone = run_alone(case.build, epl_env(case.config), name, case.prepare)
    assert (alone.ctx.passes_off if off else alone.ctx.passes_run)[-1] == name
    assert alone.result.modified is False
    assert alone.unchanged(), dump_changes(alone.graph, alone.before, user_ops=alone.user)


def test_gate_ops_run_with_the_stage_they_gate(epl_env):
    """GATE_OP's gate NoOps (control inputs only) follow the stage of the ops they wait
    for: every backward op with no data input sits on the device of its control inputs,
    so no stage's backward waits on a gate placed on another stage's device."""
    epl_env({**DEVICES2, "pipeline.num_micro_batch": 2})
    graph = tf.Graph()
    with graph.as_default():
        two_stages()
        epl.parallelize(graph)
    gates = [op for op in graph.get_operations() if not op.inputs and op.control_inputs
             and op.get_attr(PHASE_ATTR) == b"backward"]
    assert gates
    for gate in gates:
        devices = {c.device for c in gate.control_inputs}
        if len(devices) == 1:
            assert gate.device in devices, (gate.name, gate.device, devices)
