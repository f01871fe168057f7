"""Pipeline parallelism and gradient accumulation: the oracle and the user's view.

The model is a tiny transformer encoder (one attention block and a ReLU MLP
per layer, a classifier on the mean-pooled output), annotated with
consecutive `epl.replicate(device_count=1, name="stage_<s>")` scopes: layer i
in stage i * S // L, the head in the last stage. The central oracle: k steps
of the pipelined graph (S stages, M micro-batches, either schedule, possibly
replicated) give the same variables and per-step losses as single-device
training on the whole batch.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import epl
from conftest import assert_same_training as assert_same  # same variables and losses
from epl import env
from epl.errors import ClusterError, PassError
from epl.ir.annotations import MICRO_BATCH_ATTR, PHASE_ATTR, REPLICA_ATTR, TASKGRAPH_ATTR
from epl.hooks.record import record_of
from epl.hooks.session import parallel_graph
from epl.passes.pipeline import auto_stages
from epl.planner import worker_planner
from paths import EXAMPLES  # noqa: E402

SEQ, D_MODEL, D_FF, NUM_CLASSES, BATCH = 4, 8, 16, 4, 8
STEPS = 3
STRATEGIES = ["PreferBackward", "PreferForward"]


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


def encoder_layer(x, index: int, rng: np.random.RandomState):
    """One encoder layer: single-head self-attention and a ReLU MLP, residuals,
    a parameter-free layer norm. Variables are created here, in the layer's stage."""
    def var(name, shape):
        value = (rng.randn(*shape) / np.sqrt(shape[0])).astype(np.float32)
        return tf.compat.v1.get_variable(f"layer{index}/{name}", initializer=value)

    wq, wo = var("wq", [D_MODEL, D_MODEL]), var("wo", [D_MODEL, D_MODEL])
    w1, w2 = var("ff1", [D_MODEL, D_FF]), var("ff2", [D_FF, D_MODEL])
    query = tf.einsum("bsd,de->bse", x, wq)
    attention = tf.nn.softmax(tf.einsum("bsd,btd->bst", query, x) / np.float32(np.sqrt(D_MODEL)))
    h = x + tf.einsum("bsd,de->bse", tf.einsum("bst,btd->bsd", attention, x), wo)
    mean, variance = tf.nn.moments(h, axes=[-1], keepdims=True)
    h = (h - mean) * tf.math.rsqrt(variance + 1e-5)
    return h + tf.einsum("bsf,fd->bsd", tf.nn.relu(tf.einsum("bsd,df->bsf", h, w1)), w2)


def encoder_head(h, labels, rng):
    """Mean-pool and classify; returns the mean softmax cross-entropy."""
    value = (rng.randn(D_MODEL, NUM_CLASSES) / np.sqrt(D_MODEL)).astype(np.float32)
    w = tf.compat.v1.get_variable("head", initializer=value)
    logits = tf.matmul(tf.reduce_mean(h, axis=1), w)
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def make_batch(batch: int = BATCH, seed: int = 0):
    """Features [batch, SEQ, D_MODEL] and one-hot labels that depend on them."""
    rng = np.random.RandomState(100 + seed)
    features = rng.randn(batch, SEQ, D_MODEL).astype(np.float32)
    labels = np.eye(NUM_CLASSES, dtype=np.float32)[np.argmax(features[:, 0, :NUM_CLASSES], 1)]
    return features, labels


@dataclasses.dataclass
class Encoder:
    """Handles of a built encoder training graph."""

    graph: tf.Graph
    loss: tf.Tensor
    train_op: tf.Operation
    feed: dict
    features: tf.Tensor
    summary: tf.Tensor


def units_per_step(stages: int) -> int:
    """(replica, micro-batch) units per step of an EPL run of `stages` one-device stages
    with the current config under io.batch_mode 'replica' (1 without EPL or in
    'global' mode): the script's batch is then BATCH // units, and the feed holds
    all BATCH rows, so every run consumes the reference's batch."""
    if not env.is_initialized() or env.get_config().get("io.batch_mode") != "replica":
        return 1
    config = env.get_config()
    if not stages and config.get("auto.auto_parallel"):
        stages = int(config.get("pipeline.num_stages") or 1)
    replicas = max(1, int(config.get("cluster.virtual_devices")) // max(stages, 1))
    return replicas * int(config.get("pipeline.num_micro_batch"))


def build_encoder(layers: int = 4, stages: int = 0, optimizer: str = "sgd",
                  annotate: str = "scope", batch: int = BATCH, stage_of_layer=None,
                  units: int | None = None) -> Encoder:
    """Build the encoder in the default graph.

    batch: the rows a step consumes; units: see `units_per_step` (its default).
    stages: 0 for no annotation; otherwise S stage scopes (layer i in stage
    stage_of_layer(i), default i * S // layers; the head in the last stage).
    annotate: "scope" (`with epl.replicate(...)`) or "default"
    (`epl.set_default_strategy` switched between layers, minimize() called
    while the last stage is still the default).
    """
    rng = np.random.RandomState(0)
    features_np, labels_np = make_batch(batch)
    rows = batch // (units_per_step(stages) if units is None else units)
    features = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, D_MODEL], name="features")
    labels = tf.compat.v1.placeholder(tf.float32, [rows, NUM_CLASSES], name="labels")
    global_step = tf.compat.v1.train.get_or_create_global_step()
    stage_of_layer = stage_of_layer or (lambda i: i * stages // layers)

    def stage(s):
        if not stages:
            return contextlib.nullcontext()
        strategy = epl.replicate(device_count=1, name=f"stage_{s}")
        if annotate == "default":
            epl.set_default_strategy(strategy)
            return contextlib.nullcontext()
        return strategy

    h = features
    for i in range(layers):
        with stage(stage_of_layer(i)):
            h = encoder_layer(h, i, rng)
    with stage(stages - 1):
        loss = encoder_head(h, labels, rng)
    summary = tf.compat.v1.summary.scalar("loss", loss)
    opt = (tf.compat.v1.train.GradientDescentOptimizer(0.1) if optimizer == "sgd"
           else tf.compat.v1.train.AdamOptimizer(0.01))
    train_op = opt.minimize(loss, global_step=global_step)
    if stages and annotate == "default":
        epl.set_default_strategy(None)
    return Encoder(tf.compat.v1.get_default_graph(), loss, train_op,
                   {features: features_np, labels: labels_np}, features, summary)


@dataclasses.dataclass
class Trained:
    losses: list
    variables: dict
    graph: tf.Graph


def _session_config():
    """Grappler off: these graphs are tiny, and its first-run rewrite is most of a step."""
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def train_encoder(steps: int = STEPS, grappler: bool = False, **build_kwargs) -> Trained:
    """Build in a fresh graph, train `steps` steps; return losses and variables."""
    with tf.Graph().as_default() as graph:
        built = build_encoder(**build_kwargs)
        with tf.compat.v1.Session(config=None if grappler else _session_config()) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([built.train_op, built.loss], built.feed)[1])
                      for _ in range(steps)]
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    return Trained(losses, values, graph)


_REFERENCES: dict = {}


def reference(layers: int, optimizer: str) -> Trained:
    """Single-device training of the unannotated encoder (EPL reset), cached."""
    key = (layers, optimizer)
    if key not in _REFERENCES:
        env.reset()
        _REFERENCES[key] = train_encoder(layers=layers, optimizer=optimizer)
    env.reset()
    return _REFERENCES[key]


def _attr(op, name):
    attr = op.node_def.attr.get(name)
    if attr is None:
        return None
    return attr.s.decode() if attr.WhichOneof("value") == "s" else attr.i


# --------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------

ORACLE = [(stages, micro, strategy, optimizer)
          for stages in (2, 4) for micro in (1, 2, 4)
          # With one micro-batch both schedules are the same table (F0 B0 on every stage).
          for strategy in (STRATEGIES if micro > 1 else STRATEGIES[:1])
          for optimizer in ("sgd", "adam")]


@pytest.mark.parametrize("stages,micro,strategy,optimizer", ORACLE)
def test_pipeline_matches_single_device(epl_env, stages, micro, strategy, optimizer):
    expected = reference(stages, optimizer)
    epl_env({"cluster.virtual_devices": stages, "pipeline.num_micro_batch": micro,
             "pipeline.strategy": strategy, "debug.check_invariants": True})
    result = train_encoder(layers=stages, stages=stages, optimizer=optimizer)
    parallel = parallel_graph(result.graph)
    assert parallel.plan.num_replicas == 1
    assert [tg.name for tg in parallel.view.taskgraphs] == [f"stage_{s}" for s in range(stages)]
    assert_same(result, expected)


def test_one_micro_batch_schedules_are_the_same_table():
    from epl.passes.pipeline.step_order import make_schedule
    for stages in (2, 4):
        tables = {make_schedule(s, stages, 1).per_stage for s in STRATEGIES}
        assert len(tables) == 1


@pytest.mark.parametrize("micro,optimizer", [(1, "adam"), (2, "sgd"), (2, "adam"), (4, "adam")])
def test_pipeline_with_data_parallelism(epl_env, micro, optimizer):
    """4 devices, 2 stages: two replicas of the 2-stage pipeline, with no change to the script."""
    expected = reference(2, optimizer)
    epl_env({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": micro,
             "debug.check_invariants": True})
    result = train_encoder(layers=2, stages=2, optimizer=optimizer, grappler=micro == 2)
    plan = parallel_graph(result.graph).plan
    assert plan.num_replicas == 2
    assert plan.devices == {"stage_0": ["/device:CPU:0", "/device:CPU:2"],
                            "stage_1": ["/device:CPU:1", "/device:CPU:3"]}
    assert_same(result, expected)


def test_default_strategy_stages_with_minimize_inside(epl_env):
    """Stages marked with set_default_strategy; minimize() runs while stage_1 is the
    default, yet each backward and update op follows its forward op / variable."""
    expected = reference(2, "adam")
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2})
    result = train_encoder(layers=2, stages=2, optimizer="adam", annotate="default")
    assert_same(result, expected)
    updates = [op for op in result.graph.get_operations() if op.type == "ResourceApplyAdam"]
    by_device = collections.Counter(op.device for op in updates)
    assert by_device == {"/device:CPU:0": 4, "/device:CPU:1": 5}  # 4 layer-0 weights; layer 1 + head


# --------------------------------------------------------------------------
# Structure: stages on their devices, micro-batch copies, one accumulation, one apply
# --------------------------------------------------------------------------


def _parallelize(config, **build_kwargs):
    env.reset()
    epl.init(epl.Config({"debug.check_invariants": True, **config}))
    graph = tf.Graph()
    with graph.as_default():
        built = build_encoder(**build_kwargs)
        result = epl.parallelize(graph)
    return graph, built, result


def test_stages_micro_batches_and_one_apply_per_step():
    graph, built, result = _parallelize({"cluster.virtual_devices": 4,
                                         "pipeline.num_micro_batch": 2},
                                        layers=2, stages=2, optimizer="sgd")
    stage_device = {("stage_0", 0): "/device:CPU:0", ("stage_1", 0): "/device:CPU:1",
                    ("stage_0", 1): "/device:CPU:2", ("stage_1", 1): "/device:CPU:3"}
    units = collections.defaultdict(int)
    for op in graph.get_operations():
        phase, replica = _attr(op, PHASE_ATTR), _attr(op, REPLICA_ATTR)
        micro = _attr(op, MICRO_BATCH_ATTR)
        if phase in ("forward", "backward") and replica is not None and micro is not None:
            assert op.device == stage_device[(_attr(op, TASKGRAPH_ATTR), replica)], op.name
            if op.type == "Const" and not op.control_inputs:
                continue
            units[(replica, micro, phase)] += 1
    assert set(units) == {(r, m, p) for r in (0, 1) for m in (0, 1)
                          for p in ("forward", "backward")}
    forward_counts = {n for (r, m, p), n in units.items() if p == "forward"}
    assert len(forward_counts) == 1  # every (replica, micro-batch) copies the same forward ops
    # but the constants: one copy per replica and device, which both micro-batches read
    for replica in (0, 1):
        constants = [op for op in result.replication.forward_copies[(replica, 1)].values()
                     if op.type == "Const" and not op.control_inputs]
        assert constants and {_attr(op, MICRO_BATCH_ATTR) for op in constants} == {0}
    # One update per variable per replica per step, on the variable's stage device.
    updates = [op for op in graph.get_operations() if op.type == "ResourceApplyGradientDescent"]
    assert len(updates) == 2 * 9
    from epl.ir.graph_view import ancestors
    needed = ancestors([built.train_op])
    assert set(updates) <= needed
    # One accumulation of the two micro-batch gradients per variable per replica, on the
    # variable's stage device, and every update needs them.
    adds = [op for op in graph.get_operations() if op.type in ("AddN", "AddV2")
            and op.name.startswith("EPL_ACCUMULATE")]
    # Each micro-batch adds its gradient into the sum so far, micro-batch 0 into zeros.
    assert collections.Counter(op.device for op in adds) == {
        "/device:CPU:0": 8, "/device:CPU:2": 8, "/device:CPU:1": 10, "/device:CPU:3": 10}
    for add in adds:
        assert len(add.inputs) == 2 and {t.op.device for t in add.inputs} == {add.device}
        micro = _attr(add, MICRO_BATCH_ATTR)
        total, gradient = add.inputs
        assert _attr(gradient.op, MICRO_BATCH_ATTR) == micro
        if micro == 0:
            assert total.op.type == "Fill" and _attr(total.op, MICRO_BATCH_ATTR) == 0
        else:
            assert total.op in adds and _attr(total.op, MICRO_BATCH_ATTR) == micro - 1
    # every add runs: as an op the update needs, or as a node of a unit function's
    # call (the default: each micro-batch's adds are in its backward call)
    assert set(adds) <= needed | result.outlined
    assert set(adds) & result.outlined
    # Micro-batch copies read their own quarter of the feed (every unit's batch),
    # at the script's own shape.
    widened = result.feeds[built.features].widened
    assert widened.shape[0] == BATCH and built.features.shape[0] == BATCH // 4
    slices = [op for op in graph.get_operations() if op.type in ("Split", "SplitV")
              and widened in op.inputs]
    assert len(slices) == 1 and slices[0].outputs[0].shape[0] == BATCH // 4


def test_fetched_loss_and_summary_are_whole_batch_means(epl_env):
    """The fetched loss and a summary of it are the mean over the whole batch
    (all micro-batches), computed from the copies that train, not from the template."""
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 4})
    with tf.Graph().as_default() as graph:
        built = build_encoder(layers=2, stages=2)
        with tf.compat.v1.Session(config=_session_config()) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            loss, summary = sess.run([built.loss, built.summary], built.feed)
    env.reset()
    with tf.Graph().as_default():
        plain = build_encoder(layers=2)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected = sess.run(plain.loss, plain.feed)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    value = tf.compat.v1.Summary.FromString(summary).value[0].simple_value
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    from epl.ir.graph_view import ancestors
    summary_inputs = ancestors([graph.get_tensor_by_name(built.summary.name).op])
    assert not any(op in summary_inputs for op in parallel_graph(graph).view.replica_ops
                   if op.type == "Einsum")  # the template forward does not run


# --------------------------------------------------------------------------
# Gradient accumulation without a pipeline (one TaskGraph, M > 1)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("model,micro,replicas,optimizer,inputs", [
    ("mlp", 2, 1, "sgd", "placeholder"),
    ("mlp", 4, 1, "adam", "placeholder"),
    ("transformer", 4, 1, "adam", "placeholder"),
    ("mlp", 2, 2, "adam", "placeholder"),
    ("mlp", 2, 2, "sgd", "dynamic"),
    ("mlp", 2, 1, "adam", "dataset"),
])
def test_gradient_accumulation_matches_whole_batch(models, epl_env, model, micro, replicas,
                                                   optimizer, inputs):
    expected = models.single_device(steps=3, model=model, optimizer=optimizer, inputs=inputs)
    epl_env({"cluster.virtual_devices": replicas, "pipeline.num_micro_batch": micro,
             "debug.check_invariants": True})
    result = models.train(3, model=model, optimizer=optimizer, inputs=inputs)
    assert parallel_graph(result.graph).plan.num_replicas == replicas
    models.assert_same_training(result, expected)


def test_gradient_accumulation_with_uneven_replicas(models, epl_env):
    """Replica shares 3:1 (6 and 2 examples), 2 micro-batches each (3+3, 1+1)."""
    expected = models.single_device(steps=3, model="mlp", optimizer="sgd")
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
             "io.batch_mode": "global"})   # uneven shares slice one batch
    result = models.train(3, replica_weights=[3, 1], model="mlp", optimizer="sgd")
    models.assert_same_training(result, expected)


@pytest.mark.parametrize("shares", ["equal", "known_at_run_time"])
def test_every_micro_batch_adds_its_gradient_alike(shares):
    """Micro-batch 0 adds its gradient into zeros as every later micro-batch adds its own
    into the sum so far: each does the same work (so one unit function serves every
    micro-batch's backward), and the sum is the weighted sum of the gradients."""
    from epl.passes.pipeline.accumulate import accumulate
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(4)]
    weights = [0.25] * 4 if shares == "equal" else [0.1, 0.2, 0.3, 0.4]
    graph = tf.Graph()
    with graph.as_default():
        per_micro = [[tf.identity(tf.constant(v))] for v in values]
        scales = None if shares == "equal" else [
            tf.compat.v1.placeholder_with_default(np.float32(w), []) for w in weights]
        finishing, starting = set(), set()
        total, ops_of = accumulate(per_micro, 0, scales, finishing, starting)
        with tf.compat.v1.Session() as sess:
            summed = sess.run(total[0])
    assert "Fill" in {op.type for op in starting} and starting <= set(ops_of[0])
    work = [sorted(op.type for op in ops_of[m] if op not in starting | finishing)
            for m in range(4)]
    assert all(w == work[0] for w in work) and "AddV2" in work[0], work
    expected = sum(np.float32(w) * v for w, v in zip(weights, values))
    # should TensorFlow's optimizer reorder the 4 float32 adds, each rounds by at most
    # half an ulp of its sum: below 2 with run-time shares (1.2e-7 each), below 8 and
    # then x 1/4 with equal ones (4.8e-7 / 4 each): at most 5e-7, whatever the CPU
    np.testing.assert_allclose(summed, expected, rtol=0, atol=1e-6)


def test_dynamic_batch_not_divisible_fails_at_run_time(models, epl_env):
    epl_env({"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 3})
    with tf.Graph().as_default():
        built = models.build(model="mlp", inputs="dynamic")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="split evenly over 1 replicas x 3 micro-batches"):
                sess.run(built.train_op, built.feed)


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


def test_micro_batches_that_do_not_divide_the_batch():
    epl.init(epl.Config({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 3,
                         "io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=2, stages=2)
        ops_before = len(graph.get_operations())
        with pytest.raises(PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == ops_before
    assert str(err.value) == (
        "pass 'replicate' rejected the graph before any rewrite: pipeline.num_micro_batch=3 "
        "does not divide the batch: the per-replica batch sizes [8] (global batch 8 over 1 "
        "replica(s); inputs: features:0, labels:0) cannot each be cut into 3 equal "
        "micro-batches. Use a global batch size divisible by 3 (1 replica(s) x 3 "
        "micro-batches), or a pipeline.num_micro_batch that divides every replica's batch.")


def test_micro_batches_times_replicas_must_divide_the_batch():
    epl.init(epl.Config({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 8,
                         "io.batch_mode": "global"}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=2, stages=2)
        with pytest.raises(PassError, match=r"per-replica batch sizes \[4, 4\] .* cannot each "
                                            r"be cut into 8 equal micro-batches\. Use a global "
                                            r"batch size divisible by 16 \(2 replica"):
            epl.parallelize(graph)


def test_stages_that_form_a_cycle():
    """Stage 1 feeding stage 0's forward: the stage_0 scope is re-entered after stage_1."""
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        features = tf.compat.v1.placeholder(tf.float32, [BATCH, SEQ, D_MODEL], name="features")
        labels = tf.compat.v1.placeholder(tf.float32, [BATCH, NUM_CLASSES], name="labels")
        with epl.replicate(device_count=1, name="stage_0"):
            h = encoder_layer(features, 0, rng)
        with epl.replicate(device_count=1, name="stage_1"):
            h = encoder_layer(h, 1, rng)
        with epl.replicate(device_count=1, name="stage_0"):
            h = tf.nn.relu(h, name="late_relu")
        with epl.replicate(device_count=1, name="stage_1"):
            loss = encoder_head(h, labels, rng)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        producer = h.op.inputs[0].op
        ops_before = len(graph.get_operations())
        with pytest.raises(PassError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == ops_before
    assert str(err.value) == (
        "pass 'schedule' rejected the graph before any rewrite: the pipeline stages form a "
        "cycle: late_relu (type Relu, shape (8, 4, 8), TaskGraph stage_0, device unset) in "
        f"stage 0 (stage_0) reads {producer.name}:0 computed by {producer.name} (type AddV2, "
        "shape (8, 4, 8), TaskGraph stage_1, device unset) in the later stage 1 (stage_1), so "
        "stage 1 feeds stage 0's forward. Stages are the strategy scopes in the order they "
        "were first opened; a stage may only read tensors of itself or of earlier stages. "
        "Move the op into the later stage's scope, or reorder the scopes.")


def test_more_stages_than_devices():
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=4, stages=4)
        ops_before = len(graph.get_operations())
        with pytest.raises(ClusterError) as err:
            epl.parallelize(graph)
        assert len(graph.get_operations()) == ops_before
    assert str(err.value) == (
        "epl.replicate(device_count=1, name='stage_0') needs 4 device(s) per replica "
        "(all TaskGraphs: stage_0=1, stage_1=1, stage_2=1, stage_3=1) but this worker has 2 "
        "CPU device(s). Lower device_count, or add devices (on CPU: cluster.virtual_devices).")


def test_stage_without_trainable_variables_is_allowed(epl_env):
    """Stage 0 holds only a parameter-free transform of the input; it has no backward."""
    def build(scoped):
        rng = np.random.RandomState(0)
        features_np, labels_np = make_batch()
        rows = BATCH // units_per_step(2)
        features = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, D_MODEL])
        labels = tf.compat.v1.placeholder(tf.float32, [rows, NUM_CLASSES])
        scope = (lambda s: epl.replicate(device_count=1, name=f"stage_{s}")) if scoped \
            else (lambda s: contextlib.nullcontext())
        with scope(0):
            h = tf.tanh(features * 2.0)
        with scope(1):
            loss = encoder_head(encoder_layer(h, 0, rng), labels, rng)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        return loss, train_op, {features: features_np, labels: labels_np}

    def run(scoped):
        with tf.Graph().as_default() as graph:
            loss, train_op, feed = build(scoped)
            with tf.compat.v1.Session(config=_session_config()) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                losses = [float(sess.run([train_op, loss], feed)[1]) for _ in range(STEPS)]
                variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                return Trained(losses, dict(zip([v.op.name for v in variables],
                                                sess.run(variables))), graph)

    expected = run(False)
    epl_env({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
             "debug.check_invariants": True})
    result = run(True)
    assert_same(result, expected)
    view = parallel_graph(result.graph).view
    stage_0 = view.taskgraphs[0]
    assert not [v for v in view.variables if view.taskgraph_of[v] is stage_0]


def test_variable_shared_by_two_stages(epl_env):
    """A projection created in stage 0 and read again (transposed) in stage 1, like
    tied input/output embeddings: the read runs on stage 0's device."""
    def run(scoped):
        rng = np.random.RandomState(0)
        features_np, labels_np = make_batch()
        scope = (lambda s: epl.replicate(device_count=1, name=f"stage_{s}")) if scoped \
            else (lambda s: contextlib.nullcontext())
        with tf.Graph().as_default() as graph:
            rows = BATCH // units_per_step(2)
            features = tf.compat.v1.placeholder(tf.float32, [rows, SEQ, D_MODEL])
            labels = tf.compat.v1.placeholder(tf.float32, [rows, NUM_CLASSES])
            with scope(0):
                value = (rng.randn(D_MODEL, D_MODEL) * 0.3).astype(np.float32)
                proj = tf.compat.v1.get_variable("proj", initializer=value)
                h = encoder_layer(tf.einsum("bsd,de->bse", features, proj), 0, rng)
            with scope(1):
                logits = tf.reduce_mean(tf.einsum("bsd,ed->bse", h, proj), 1)[:, :NUM_CLASSES]
                loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
                    labels=labels, logits=logits))
            train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
            with tf.compat.v1.Session(config=_session_config()) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                feed = {features: features_np, labels: labels_np}
                losses = [float(sess.run([train_op, loss], feed)[1]) for _ in range(STEPS)]
                variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                return Trained(losses, dict(zip([v.op.name for v in variables],
                                                sess.run(variables))), graph)

    expected = run(False)
    epl_env({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2,
             "debug.check_invariants": True})
    assert_same(run(True), expected)


# --------------------------------------------------------------------------
# Automatic stage partition
# --------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
def test_auto_stages_cut_at_layer_boundaries_balanced(stages):
    epl.init(epl.Config({"cluster.virtual_devices": 4, "auto.auto_parallel": True,
                         "pipeline.num_stages": stages}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=4)
        partition = auto_stages.plan_stages(graph, record_of(graph), stages)
    assert partition.num_stages == stages
    assert all(len(tensors) == 1 for tensors in partition.crossing)  # one tensor per cut
    # Each cut is a layer output (the residual sum) that the next layer's einsums read,
    # and with 4 identical layers the cuts fall after every 4 / stages layers.
    cuts = [tensor for (tensor,) in partition.crossing]
    for tensor in cuts:
        assert tensor.op.type == "AddV2"
        assert any(c.type == "Einsum" for c in tensor.consumers())
    for i, tensor in enumerate(cuts):
        readers = {v.name.split("/")[0] for c in tensor.consumers() for v in _variables_read(c)}
        assert readers == {f"layer{(i + 1) * 4 // stages}"}, readers
    costs = partition.costs
    assert max(costs) / min(costs) < 1.15, partition.describe()


def _variables_read(op):
    """Variable ops whose values `op` reads (through a ReadVariableOp)."""
    return [t.op.inputs[0].op for t in op.inputs
            if t.op.type == "ReadVariableOp" and t.op.inputs[0].op.type == "VarHandleOp"]


def test_auto_stages_train_like_single_device(epl_env):
    expected = reference(4, "adam")
    epl_env({"cluster.virtual_devices": 2, "auto.auto_parallel": True,
             "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2,
             "debug.check_invariants": True})
    result = train_encoder(layers=4, optimizer="adam")
    parallel = parallel_graph(result.graph)
    assert [tg.name for tg in parallel.view.taskgraphs] == ["stage_0", "stage_1"]
    by_stage = collections.Counter(_attr(op, TASKGRAPH_ATTR) for op in result.graph.get_operations()
                                   if op.type == "ResourceApplyAdam")
    assert by_stage == {"stage_0": 8, "stage_1": 9}  # layers 0-1 | layers 2-3 and the head
    assert_same(result, expected)


def test_auto_stages_keep_user_stages():
    """With stage scopes in the script, auto.auto_parallel leaves them alone."""
    epl.init(epl.Config({"cluster.virtual_devices": 4, "auto.auto_parallel": True,
                         "pipeline.num_stages": 4}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=2, stages=2)
        assert auto_stages.keeps_own_stages(record_of(graph).taskgraphs)


# --------------------------------------------------------------------------
# The example
# --------------------------------------------------------------------------


def test_bert_example_trains_and_prints_progress(capsys):
    import os
    import re
    import sys
    sys.path.insert(0, EXAMPLES)
    import bert_pipeline
    last = bert_pipeline.main(["--steps", "4", "--layers", "2", "--hidden", "16", "--heads", "2",
                               "--vocab", "17", "--seq-len", "8", "--batch", "8",
                               "--micro-batches", "2", "--log-every", "2"])
    out = capsys.readouterr().out
    assert "2 stages x 2 micro-batches (PreferBackward) on 2 device(s)" in out
    assert re.search(r"^step +4  loss \d+\.\d+  masked-token accuracy \d\.\d+", out, re.M), out
    assert last["step"] == 4 and np.isfinite(last["loss"])


# --------------------------------------------------------------------------
# Stages sized to their devices (cluster.device_profiles)
# --------------------------------------------------------------------------

FAST_SLOW = {"CPU:0": {"peak_flops": {"float32": 3e11}}, "CPU:1": {"peak_flops": {"float32": 1e11}}}


def test_auto_stages_give_the_faster_device_the_longer_stage():
    from epl.planner import profiles as profiles_lib
    epl.init(epl.Config({"cluster.virtual_devices": 2, "auto.auto_parallel": True,
                         "pipeline.num_stages": 2}))
    with tf.Graph().as_default() as graph:
        build_encoder(layers=4)
        even = auto_stages.plan_stages(graph, record_of(graph), 2)
        speeds = worker_planner.stage_speeds(2, profiles_lib.virtual_cpu_profiles(2, FAST_SLOW))
        sized = auto_stages.plan_stages(graph, record_of(graph), 2, speeds=speeds)
    assert speeds == pytest.approx([1.0, 1 / 3])
    assert max(even.costs) / min(even.costs) < 1.15
    # stage 0 (on the 3x faster device) takes about three times the work of stage 1
    assert sized.costs[0] / sized.costs[1] > 2.0, sized.describe()
    time_even = max(even.costs[0] / speeds[0], even.costs[1] / speeds[1])
    time_sized = max(sized.costs[0] / speeds[0], sized.costs[1] / speeds[1])
    assert time_sized < 0.75 * time_even


def test_earlier_stages_go_to_devices_with_more_memory(epl_env):
    gib = 2 ** 30
    profiles = {"CPU:0": {"memory_bytes": 8 * gib}, "CPU:1": {"memory_bytes": 32 * gib},
                "CPU:2": {"memory_bytes": 8 * gib}, "CPU:3": {"memory_bytes": 32 * gib}}
    expected = reference(4, "sgd")
    epl_env({"cluster.virtual_devices": 4, "auto.auto_parallel": True,
             "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2,
             "cluster.device_profiles": profiles, "debug.check_invariants": True})
    result = train_encoder(layers=4, optimizer="sgd")
    plan = parallel_graph(result.graph).plan
    assert plan.devices["stage_0"] == ["/device:CPU:1", "/device:CPU:3"]
    assert plan.devices["stage_1"] == ["/device:CPU:0", "/device:CPU:2"]
    assert_same(result, expected)


def test_stages_sized_to_devices_train_like_single_device(epl_env):
    expected = reference(4, "adam")
    epl_env({"cluster.virtual_devices": 2, "auto.auto_parallel": True,
             "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2,
             "cluster.device_profiles": FAST_SLOW, "debug.check_invariants": True})
    result = train_encoder(layers=4, optimizer="adam")
    by_stage = collections.Counter(_attr(op, TASKGRAPH_ATTR) for op in result.graph.get_operations()
                                   if op.type == "ResourceApplyAdam")
    assert by_stage["stage_0"] > by_stage["stage_1"]   # the fast device holds more layers
    assert_same(result, expected)


# --------------------------------------------------------------------------
# Embeddings (sparse gradients) and AMP in pipeline stages
# --------------------------------------------------------------------------


def _embedding_pipeline(scoped: bool, rows: int):
    """An embedding lookup of a variable in stage 0 (a sparse gradient, accumulated
    over micro-batches as indexed slices), dense layers after it."""
    scope = (lambda s: epl.replicate(device_count=1, name=f"stage_{s}")) if scoped \
        else (lambda s: contextlib.nullcontext())
    rng = np.random.RandomState(5)
    ids = tf.compat.v1.placeholder(tf.int32, [rows, 6])
    labels = tf.compat.v1.placeholder(tf.float32, [rows, NUM_CLASSES])
    with scope(0):
        table = tf.compat.v1.get_variable(
            "table", initializer=(rng.randn(30, D_MODEL) * 0.5).astype(np.float32))
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
        h = tf.compat.v1.layers.dense(h, D_FF, activation=tf.tanh, name="hidden",
                                      kernel_initializer=tf.constant_initializer(
                                          rng.randn(D_MODEL, D_FF) * 0.3))
    with scope(1):
        logits = tf.compat.v1.layers.dense(h, NUM_CLASSES, name="logits",
                                           kernel_initializer=tf.constant_initializer(
                                               rng.randn(D_FF, NUM_CLASSES) * 0.3))
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits))
    data = np.random.RandomState(6)
    feed = {ids: data.randint(0, 30, (BATCH, 6)),
            labels: np.eye(NUM_CLASSES, dtype=np.float32)[data.randint(0, NUM_CLASSES, BATCH)]}
    return loss, feed


def _train_embedding_pipeline(config):
    env.reset()
    if config is not None:
        epl.init(epl.Config({"debug.check_invariants": True, **config}))
    rows = BATCH // units_per_step(2)
    with tf.Graph().as_default() as graph:
        loss, feed = _embedding_pipeline(config is not None, rows)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        with tf.compat.v1.Session(config=_session_config()) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [float(sess.run([train_op, loss], feed)[1]) for _ in range(STEPS)]
            variables = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                         if not v.op.name.startswith("EPL_")]
            values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    env.reset()
    return Trained(losses, values, graph)


@pytest.mark.parametrize("devices,strategy", [(2, "PreferBackward"), (2, "PreferForward"),
                                              (4, "PreferBackward")])
def test_embedding_in_a_stage_with_the_default_config(devices, strategy):
    """A tf.gather/embedding_lookup of a variable in a pipeline stage trains like one
    device without communication.sparse_as_dense: its sparse gradient is accumulated
    over the micro-batches (and gathered over the pipelines) as indexed slices."""
    expected = _train_embedding_pipeline(None)
    result = _train_embedding_pipeline({"cluster.virtual_devices": devices,
                                        "pipeline.num_micro_batch": 2,
                                        "pipeline.strategy": strategy})
    assert_same(result, expected)
    assert isinstance(parallel_graph(result.graph).view.gradients[0][0], tf.IndexedSlices)


@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_amp_with_pipeline_stages(loss_scale):
    """AMP O1 with two stages and micro-batches (fixed and dynamic loss scale): the
    lowered stages run on their devices, within float16's tolerance of one device."""
    expected = _train_embedding_pipeline(None)
    result = _train_embedding_pipeline({"cluster.virtual_devices": 2,
                                        "pipeline.num_micro_batch": 2, "amp.level": "O1",
                                        "amp.loss_scale": loss_scale})
    # Adam moves a weight whose gradient is near zero by about the learning rate
    # whatever the gradient's rounding (tests/passes/test_amp.py): 90% of each variable's
    # elements within float16's tolerance, all within learning rate x steps
    for name, value in expected.variables.items():
        if "power" in name or not np.issubdtype(np.asarray(value).dtype, np.floating):
            continue
        actual = result.variables[name]
        assert np.isclose(actual, value, rtol=1e-2, atol=1e-3).mean() >= 0.9, name
        assert np.max(np.abs(actual - value)) <= 0.01 * STEPS, name
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-2, atol=1e-3)
    matmuls = [op for op in result.graph.get_operations() if op.type == "MatMul"
               and op.get_attr("T") == tf.float16 and "_epl_replica" in op.node_def.attr]
    assert {op.device for op in matmuls} == {"/device:CPU:0", "/device:CPU:1"}
