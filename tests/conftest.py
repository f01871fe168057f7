"""Shared fixtures and model builders for the EPL tests.

- `report(line)`: a figure printed at the end of the test log.
- `epl_env(config_dict)`: resets EPL and initializes it with `config_dict`
  (an autouse fixture resets EPL after every test, so hooks are inert again).
- `update_goldens`: True under `pytest --update-goldens` (or EPL_UPDATE_GOLDENS=1):
  the wiring goldens (tests/passes/test_pass_wiring.py) are rewritten, not compared.
- `models`: tiny models with numpy-generated initial values, and `train()`,
  which builds a model in its own `tf.Graph`, trains it for a few steps and
  returns the fetched losses and the final variable values. With EPL reset it
  is the single-device reference; after `epl_env(...)` it is the EPL run.

Every graph is built inside `with tf.Graph().as_default():`; nothing here
disables eager execution for the process.
"""
from __future__ import annotations

import dataclasses
import os
import types

# tf.compat.v1.layers (legacy Keras, tf-keras) needs this before TensorFlow is imported.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# The structural invariants (epl/passes/verify.py) are checked after every pass in
# every test, and in the workers the tests start (they inherit the environment); a
# test that sets debug.check_invariants in its config dict overrides this.
os.environ.setdefault("EPL_DEBUG_CHECK_INVARIANTS", "1")

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import epl
from epl import env

BATCH = 8
NUM_CLASSES = 4
MLP_IN, MLP_HIDDEN = 6, 16
SEQ, D_MODEL, HEADS, D_FF = 4, 8, 2, 16


# --------------------------------------------------------------------------
# EPL environment
# --------------------------------------------------------------------------


_REPORTED: list[str] = []


@pytest.fixture
def report():
    """`report(line)`: a figure for the end of the test log (a "reported
    figures" section, shown for passing tests too), e.g. the planner's
    calibration ratios."""
    return _REPORTED.append


def pytest_addoption(parser):
    """--update-goldens: rewrite the pass wiring goldens (tests/passes/goldens/)."""
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/passes/goldens/*.txt with this run's dumps "
                          "(tests/passes/test_pass_wiring.py) instead of comparing")


@pytest.fixture
def update_goldens(request) -> bool:
    """True when the goldens are to be rewritten (--update-goldens, or EPL_UPDATE_GOLDENS=1)."""
    return bool(request.config.getoption("--update-goldens")) or \
        os.environ.get("EPL_UPDATE_GOLDENS") == "1"


def pytest_terminal_summary(terminalreporter):
    """Print the lines the tests gave `report`."""
    if _REPORTED:
        terminalreporter.section("reported figures")
        for line in _REPORTED:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _reset_epl_after_test():
    """Every test starts and ends with EPL un-initialized (hooks inert)."""
    env.reset()
    yield
    env.reset()


@pytest.fixture
def epl_env():
    """Return `init(config_dict=None)`: reset EPL, then epl.init with the dict."""
    def init(config_dict: dict | None = None) -> epl.Config:
        env.reset()
        return epl.init(epl.Config(dict(config_dict or {})))
    return init


# --------------------------------------------------------------------------
# Data and initial values (numpy, fixed seeds)
# --------------------------------------------------------------------------


def make_data(model: str, seed: int = 0, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """(features, one-hot labels) of one global batch for `model`."""
    rng = np.random.RandomState(100 + seed)
    shape = [batch, MLP_IN] if model.startswith("mlp") else [batch, SEQ, D_MODEL]
    features = rng.randn(*shape).astype(np.float32)
    labels = np.eye(NUM_CLASSES, dtype=np.float32)[rng.randint(0, NUM_CLASSES, batch)]
    return features, labels


def make_params(model: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial values of every trainable variable of `model`, by variable name."""
    rng = np.random.RandomState(seed)

    def dense(n_in, n_out):
        return (rng.randn(n_in, n_out) / np.sqrt(n_in)).astype(np.float32)

    def bias(n):
        return (0.1 * rng.randn(n)).astype(np.float32)

    if model.startswith("mlp"):
        return {"w1": dense(MLP_IN, MLP_HIDDEN), "b1": bias(MLP_HIDDEN),
                "w2": dense(MLP_HIDDEN, MLP_HIDDEN), "b2": bias(MLP_HIDDEN),
                "w3": dense(MLP_HIDDEN, NUM_CLASSES), "b3": bias(NUM_CLASSES)}
    return {"wq": dense(D_MODEL, D_MODEL), "wk": dense(D_MODEL, D_MODEL),
            "wv": dense(D_MODEL, D_MODEL), "wo": dense(D_MODEL, D_MODEL),
            "ln1_gamma": (1 + bias(D_MODEL)).astype(np.float32), "ln1_beta": bias(D_MODEL),
            "ff1": dense(D_MODEL, D_FF), "ff1_b": bias(D_FF),
            "ff2": dense(D_FF, D_MODEL), "ff2_b": bias(D_MODEL),
            "ln2_gamma": (1 + bias(D_MODEL)).astype(np.float32), "ln2_beta": bias(D_MODEL),
            "head": dense(D_MODEL, NUM_CLASSES), "head_b": bias(NUM_CLASSES)}


# --------------------------------------------------------------------------
# Models (raw TF ops; the batch dimension is never baked into a constant)
# --------------------------------------------------------------------------


def _variables(params: dict, use_resource: bool = True) -> dict:
    return {name: tf.compat.v1.get_variable(name, initializer=value, use_resource=use_resource)
            for name, value in params.items()}


def mlp_loss(features, labels, params, use_resource: bool = True):
    """Two hidden ReLU layers and a softmax cross-entropy; returns the mean loss."""
    v = _variables(params, use_resource)
    h = tf.nn.relu(tf.matmul(features, v["w1"]) + v["b1"])
    h = tf.nn.relu(tf.matmul(h, v["w2"]) + v["b2"])
    logits = tf.matmul(h, v["w3"]) + v["b3"]
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def mlp_folded_shapes_loss(features, labels, params, use_resource: bool = True):
    """The MLP written with tf.shape of static-shaped batch tensors, which TensorFlow
    folds into constants holding the global batch size (EPL must use each
    replica's own shapes): a reshape to tf.shape(h), sparse softmax
    cross-entropy, and a sum divided by tf.shape(features)[0]."""
    v = _variables(params, use_resource)
    h = tf.nn.relu(tf.matmul(features, v["w1"]) + v["b1"])
    h = tf.reshape(tf.reshape(h, [-1]), tf.shape(h))
    h = tf.nn.relu(tf.matmul(h, v["w2"]) + v["b2"])
    logits = tf.matmul(h, v["w3"]) + v["b3"]
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.argmax(labels, axis=1), logits=logits)
    return tf.reduce_sum(per_example) / tf.cast(tf.shape(features)[0], tf.float32)


def _layer_norm(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta


def _dense_3d(x, w, b=None):
    """[batch, seq, n_in] x [n_in, n_out] through a 2-D matmul (reshape with -1)."""
    n_in, n_out = w.shape.as_list()
    y = tf.matmul(tf.reshape(x, [-1, n_in]), w)
    if b is not None:
        y = y + b
    return tf.reshape(y, [-1, SEQ, n_out])


def transformer_loss(features, labels, params, use_resource: bool = True):
    """One 2-head self-attention block + MLP (post layer norm), mean-pooled, classifier."""
    v = _variables(params, use_resource)
    head_dim = D_MODEL // HEADS

    def heads(t):  # [B, T, D] -> [B, H, T, D/H]
        return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, head_dim]), [0, 2, 1, 3])

    q, k, val = (heads(_dense_3d(features, v[n])) for n in ("wq", "wk", "wv"))
    scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(head_dim).astype(np.float32)
    attended = tf.matmul(tf.nn.softmax(scores, axis=-1), val)
    attended = tf.reshape(tf.transpose(attended, [0, 2, 1, 3]), [-1, SEQ, D_MODEL])
    x = _layer_norm(features + _dense_3d(attended, v["wo"]), v["ln1_gamma"], v["ln1_beta"])
    ff = _dense_3d(tf.nn.relu(_dense_3d(x, v["ff1"], v["ff1_b"])), v["ff2"], v["ff2_b"])
    x = _layer_norm(x + ff, v["ln2_gamma"], v["ln2_beta"])
    logits = tf.matmul(tf.reduce_mean(x, axis=1), v["head"]) + v["head_b"]
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))


LOSSES = {"mlp": mlp_loss, "mlp_folded": mlp_folded_shapes_loss,
          "transformer": transformer_loss}


def make_optimizer(name: str):
    """A fresh tf.compat.v1.train optimizer: "sgd" or "adam"."""
    if name == "sgd":
        return tf.compat.v1.train.GradientDescentOptimizer(0.1)
    return tf.compat.v1.train.AdamOptimizer(0.01)


# --------------------------------------------------------------------------
# Building and training
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    """Handles of a built training graph."""

    graph: tf.Graph
    loss: tf.Tensor
    train_op: tf.Operation
    global_step: tf.Variable
    feed: dict
    features: tf.Tensor | None = None
    labels: tf.Tensor | None = None


def build(model: str = "mlp", optimizer: str = "sgd", inputs: str = "placeholder",
          seed: int = 0, loss_scale: float = 1.0, use_resource: bool = True,
          scope: bool = True, batch: int = BATCH, units: int | None = None,
          chunks: int = 1) -> Built:
    """Build `model` in the current default graph and return its handles.

    batch: the rows one training step consumes (the single-device batch).
    units: how many (replica, micro-batch) units an EPL run splits a step into
      under io.batch_mode 'replica' (EPL's contract: the script's batch is one
      unit's): the script's batch is then batch // units rows, and a step
      still consumes the same `batch` rows as the single-device reference (a
      feed holds all of them, replica-major; a dataset yields them in order,
      batch // units at a time). 1 for the reference and for 'global' mode;
      default `default_units()`.
    inputs: "placeholder" (static batch), "dynamic" (placeholder with a None
      batch dimension, fed every row), "dataset" (a one-shot iterator over a
      dataset repeating the same `batch` rows) or "constant" (tf.constant
      features and labels of all `batch` rows: every unit's batch is that
      constant, which leaves the mean loss unchanged, so `units` is ignored).
    loss_scale: the optimizer minimizes loss * loss_scale (the fetched loss is unscaled).
    scope: build the model under `epl.replicate(device_count=1)` (only when
      EPL is initialized); otherwise EPL's implicit replicate applies.
    chunks: compute the loss as the mean of the losses of `chunks` equal parts
      of the batch (the same function, another summation order: the noise
      floor the oracle's tolerance is derived from).
    """
    graph = tf.compat.v1.get_default_graph()
    x_np, y_np = make_data(model, seed, batch)
    units = default_units() if units is None else units
    rows = batch if inputs == "constant" else batch // units
    feed = {}
    if inputs in ("placeholder", "dynamic"):
        lead = [None] if inputs == "dynamic" else [rows]
        features = tf.compat.v1.placeholder(tf.float32, lead + list(x_np.shape[1:]), name="features")
        labels = tf.compat.v1.placeholder(tf.float32, lead + [NUM_CLASSES], name="labels")
        feed = {features: x_np, labels: y_np}
    elif inputs == "dataset":
        dataset = tf.data.Dataset.from_tensor_slices((x_np, y_np)).batch(rows).repeat()
        features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    elif inputs == "constant":
        features, labels = tf.constant(x_np, name="features"), tf.constant(y_np, name="labels")
    else:
        raise ValueError(inputs)
    global_step = tf.compat.v1.train.get_or_create_global_step()

    def model_loss():
        params = make_params(model, seed)
        if chunks == 1:
            return LOSSES[model](features, labels, params, use_resource)
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                         reuse=tf.compat.v1.AUTO_REUSE):
            parts = zip(tf.split(features, chunks), tf.split(labels, chunks))
            return tf.add_n([LOSSES[model](x, y, params, use_resource) for x, y in parts]) / chunks

    if scope and env.is_initialized():
        with epl.replicate(device_count=1, name="model"):
            loss = model_loss()
    else:
        loss = model_loss()
    objective = loss * loss_scale if loss_scale != 1.0 else loss
    train_op = make_optimizer(optimizer).minimize(objective, global_step=global_step)
    return Built(graph, loss, train_op, global_step, feed, features, labels)


def variable_values(sess, graph: tf.Graph) -> dict[str, np.ndarray]:
    """Values of every global variable of `graph`, by op name."""
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


@dataclasses.dataclass
class TrainResult:
    """What `train` returns."""

    losses: list
    variables: dict
    global_step: int
    graph: tf.Graph
    noise: dict | None = None   # the noise floor (single-device references only)


def default_units() -> int:
    """The units (replica, micro-batch) per step of an EPL run of one-device replicas
    with the current config: cluster.virtual_devices x pipeline.num_micro_batch
    under io.batch_mode 'replica', 1 under 'global' or without EPL."""
    if not env.is_initialized():
        return 1
    config = env.get_config()
    if config.get("io.batch_mode") != "replica":
        return 1
    return int(config.get("cluster.virtual_devices")) * int(config.get("pipeline.num_micro_batch"))


def train(steps: int = 5, replica_weights=None, units: int | None = None,
          session_config=None, **build_kwargs) -> TrainResult:
    """Build (see `build`) in a fresh graph and train for `steps` steps.

    units: see `build`; default `default_units()` (one-device replicas; tests
    of pipeline stages or split models give theirs). With replica_weights,
    epl.parallelize(graph, replica_weights=...) runs before the session is created.
    session_config: the session's ConfigProto (default: TensorFlow's).
    """
    units = default_units() if units is None else units
    with tf.Graph().as_default() as graph:
        built = build(units=units, **build_kwargs)
        if replica_weights is not None:
            epl.parallelize(graph, replica_weights=replica_weights)
        with tf.compat.v1.Session(config=session_config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([built.train_op, built.loss], built.feed)[1] for _ in range(steps)]
            return TrainResult([float(l) for l in losses], variable_values(sess, graph),
                               int(sess.run(built.global_step)), graph)


# The oracle's tolerance (docs/architecture.md, "Tests"; the design rule: tolerances come from a measured noise floor).
# EPL computes the same function as single-device training in another order (per
# replica and micro-batch, then a weighted reduction), so the two differ by float
# rounding, and how far depends on the CPU's kernels (AVX2 and AVX-512 sum in
# different orders) and on the optimizer (Adam divides by the root of tiny second
# moments and amplifies it). The floor is measured on the machine running the test:
# the same single-device training, in plain TF, with the loss computed as the mean
# of the losses of two halves of the batch (another summation order of the same
# function), and with Grappler's arithmetic optimizer off (TensorFlow's own
# reassociation of the same graph: EPL's unit functions are optimized apart from
# the ops around them, so it cannot reassociate across their boundary, and Adam
# amplifies that wherever a gradient element is near its epsilon: 1e-6 in a
# transformer's ff1 after 5 steps, 5x the two-halves floor on an AVX-512 CPU;
# scripts/oracle_reorderings.py measures both). An element of EPL's result must be within
#     atol + rtol * |reference|,  atol = max(ATOL, NOISE_FACTOR * floor)
# of the reference, where floor is the largest difference either reordering made in
# that variable (or in the per-step losses). ATOL and RTOL alone are what the suite
# held on the machine it was written on; NOISE_FACTOR leaves room for EPL's own
# reordering being several times the two-halves one, and no more: a real bug (a
# wrong share, a missing micro-batch) moves the result by orders of magnitude
# beyond the floor, and the SGD tests, whose floor is near zero, stay tight.
RTOL, ATOL, NOISE_FACTOR = 1e-5, 1e-6, 10.0


def assert_same_training(result: TrainResult, reference: TrainResult,
                         rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same variables (names and values) and the same per-step losses, within the
    tolerance above (the reference's noise floor when it has one)."""
    noise = getattr(reference, "noise", None) or {}
    assert sorted(result.variables) == sorted(reference.variables)
    for name, value in reference.variables.items():
        np.testing.assert_allclose(
            result.variables[name], value, rtol=rtol,
            atol=max(atol, NOISE_FACTOR * noise.get(name, 0.0)), err_msg=f"variable {name}")
    np.testing.assert_allclose(result.losses, reference.losses, rtol=rtol,
                               atol=max(atol, NOISE_FACTOR * noise.get("<losses>", 0.0)),
                               err_msg="per-step losses")


def arithmetic_optimizer_off():
    """A session ConfigProto with Grappler's arithmetic optimizer off (one of the
    noise floor's reorderings)."""
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.arithmetic_optimization = \
        rewriter_config_pb2.RewriterConfig.OFF
    return config


def noise_floor(reference: TrainResult, **kwargs) -> dict:
    """{variable name (and "<losses>"): the largest difference between `reference`
    and the same single-device training with the batch's loss summed in two halves,
    or with Grappler's arithmetic optimizer off}."""
    floor: dict = {}
    for other in ({"chunks": 2}, {"session_config": arithmetic_optimizer_off()}):
        env.reset()
        reordered = train(units=1, **other, **kwargs)
        for name, value in reference.variables.items():
            floor[name] = max(floor.get(name, 0.0),
                              float(np.max(np.abs(reordered.variables[name] - value))))
        floor["<losses>"] = max(floor.get("<losses>", 0.0), float(
            np.max(np.abs(np.array(reordered.losses) - reference.losses))))
    return floor


@pytest.fixture(scope="session")
def models():
    """The builders above, for tests: models.build, models.train, models.assert_same_training, ..."""
    return types.SimpleNamespace(
        BATCH=BATCH, make_data=make_data, make_params=make_params, build=build, train=train,
        variable_values=variable_values, assert_same_training=assert_same_training,
        make_optimizer=make_optimizer, single_device=_single_device, LOSSES=LOSSES)


_REFERENCE_CACHE: dict = {}


def _single_device(**kwargs) -> TrainResult:
    """The single-device reference run (EPL reset), cached per arguments.

    EPL is left un-initialized afterwards; call epl_env(...) after this.
    """
    key = tuple(sorted(kwargs.items()))
    if key not in _REFERENCE_CACHE:
        env.reset()
        reference = train(units=1, **kwargs)
        reference.noise = noise_floor(reference, **kwargs)
        _REFERENCE_CACHE[key] = reference
    env.reset()
    return _REFERENCE_CACHE[key]
