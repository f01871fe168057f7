"""tf-keras (legacy Keras) in graph mode under EPL: compile / fit / evaluate / predict /
train_on_batch, as Keras users write them, against the same script without EPL.

Each case builds a model in its own tf.Graph (Sequential, functional or subclassed),
compiles it with a legacy Keras optimizer and fits numpy arrays. The batch Keras
feeds is the worker's global batch: EPL cuts it into replicas x micro-batches, so
single-device training of the same script is the oracle. After fit, the weights,
fit's logged loss and metric, `evaluate`, `predict` and a `train_on_batch` equal the
script's without EPL (AMP within its rounding). Keras opens its session before fit
builds the training step (to initialize the weights, for `get_weights`, an
`evaluate` or a `load_weights` before fit): those cases check that EPL moves that
session onto the rewritten graph with its values (epl/hooks/late_rewrite.py).
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from conftest import ATOL, NOISE_FACTOR, RTOL

keras = tf.keras   # tf-keras: the tests run with TF_USE_LEGACY_KERAS=1 (tests/conftest.py)

ROWS, FEATURES, CLASSES, BATCH = 64, 8, 3, 16
AMP_TOLERANCE = dict(rtol=1e-2, atol=1e-3)   # as tests/integration/test_batch_semantics.py

# name -> EPL config
STRATEGIES = {
    "dp": {"cluster.virtual_devices": 2},
    "ga": {"cluster.virtual_devices": 1, "pipeline.num_micro_batch": 2},
    "pipeline": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    "gpipe": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
              "pipeline.strategy": "PreferForward"},
    "gc": {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"},
    "amp": {"cluster.virtual_devices": 2, "amp.level": "O1", "amp.loss_scale": 256.0},
    "zero": {"cluster.virtual_devices": 2, "zero.level": "v1"},
    "zero_v1": {"cluster.virtual_devices": 2, "zero.level": "v1"},
    "auto_stages": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2,
                    "auto.auto_parallel": True, "pipeline.num_stages": 2},
    "split": {"cluster.virtual_devices": 2},
}
# epl.split updates shards as tf.compat.v1.train optimizers build the update: with it the
# model is compiled with one (a tf-keras optimizer is refused, see below); "zero_v1" is
# ZeRO with one (and "zero" with tf-keras's Adam)
V1_OPTIMIZER_STRATEGIES = ("zero_v1", "split")


def data(seed: int = 0, reverse_batches: bool = False):
    """(features, labels); `reverse_batches`: the rows of every batch in reverse order
    (the same training in exact arithmetic: the reference's noise floor)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(ROWS, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, ROWS).astype(np.int64)
    if reverse_batches:
        order = np.arange(ROWS).reshape(-1, BATCH)[:, ::-1].ravel()
        x, y = x[order], y[order]
    return x, y


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _stage(use_epl: bool, stages: bool, index: int):
    """Between layers, as EPL scripts mark pipeline stages (set_default_strategy)."""
    if use_epl and stages:
        epl.set_default_strategy(epl.replicate(1, name=f"stage_{index}"))


def sequential(use_epl: bool, stages: bool):
    scope = epl.replicate(1) if use_epl and not stages else contextlib.nullcontext()
    with scope:
        model = keras.Sequential()
        model.add(keras.Input(shape=(FEATURES,)))
        _stage(use_epl, stages, 0)
        model.add(keras.layers.Dense(32, activation="relu", kernel_initializer=_init(1)))
        model.add(keras.layers.Dense(32, activation="tanh", kernel_initializer=_init(2)))
        _stage(use_epl, stages, 1)
        model.add(keras.layers.Dense(CLASSES, kernel_initializer=_init(3)))
    if use_epl and stages:
        epl.set_default_strategy(None)
    return model


def functional(use_epl: bool, stages: bool):
    inputs = keras.Input(shape=(FEATURES,))
    with (epl.replicate(1) if use_epl and not stages else contextlib.nullcontext()):
        _stage(use_epl, stages, 0)
        hidden = keras.layers.Dense(32, activation="relu", kernel_initializer=_init(1))(inputs)
        hidden = keras.layers.LayerNormalization()(hidden)
        _stage(use_epl, stages, 1)
        residual = keras.layers.Dense(32, activation="relu", kernel_initializer=_init(2))(hidden)
        hidden = keras.layers.Add()([hidden, residual])
        outputs = keras.layers.Dense(CLASSES, kernel_initializer=_init(3))(hidden)
    if use_epl and stages:
        epl.set_default_strategy(None)
    return keras.Model(inputs, outputs)


class Classifier(keras.Model):
    """A subclassed model: its ops are built when fit first calls it, after the scopes
    around its layers' construction have closed."""

    def __init__(self, use_epl: bool, stages: bool):
        super().__init__()
        with (epl.replicate(1) if use_epl and not stages else contextlib.nullcontext()):
            _stage(use_epl, stages, 0)
            self.body = [keras.layers.Dense(32, activation="relu", kernel_initializer=_init(1)),
                         keras.layers.Dense(32, activation="relu", kernel_initializer=_init(2))]
            _stage(use_epl, stages, 1)
            self.head = keras.layers.Dense(CLASSES, kernel_initializer=_init(3))
        if use_epl and stages:
            epl.set_default_strategy(None)

    def call(self, x):
        for layer in self.body:
            x = layer(x)
        return self.head(x)


def split_head(use_epl: bool, stages: bool):
    """A functional model whose classifier is split over 2 devices (epl.split)."""
    del stages
    inputs = keras.Input(shape=(FEATURES,))
    with (epl.replicate(1) if use_epl else contextlib.nullcontext()):
        hidden = keras.layers.Dense(32, activation="relu", kernel_initializer=_init(1))(inputs)
    with (epl.split(2) if use_epl else contextlib.nullcontext()):
        outputs = keras.layers.Dense(CLASSES * 2, kernel_initializer=_init(3))(hidden)
    return keras.Model(inputs, outputs)


MODELS = {"sequential": sequential, "functional": functional, "split_head": split_head,
          "subclassed": lambda use_epl, stages: Classifier(use_epl, stages)}
OPTIMIZER = {"keras": lambda: keras.optimizers.legacy.Adam(0.01),
             "v1": lambda: tf.compat.v1.train.AdamOptimizer(0.01)}


def compiled(model_name: str, use_epl: bool, stages: bool, optimizer: str = "keras"):
    model = MODELS[model_name](use_epl, stages)
    model.compile(optimizer=OPTIMIZER[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def run(model_name: str, use_epl: bool, stages: bool, before_fit: str = "", epochs: int = 2,
        weights_in: str | None = None, reverse_batches: bool = False,
        optimizer: str = "keras", dataset: bool = False) -> dict:
    """Build, compile and fit in a graph of its own; what the script sees. `dataset`:
    fit and evaluate take a tf.data dataset of the batches instead of arrays."""
    x, y = data(reverse_batches=reverse_batches)

    def batches():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    x_predict = data()[0][:40]
    out = {}
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1)
        if before_fit == "own_session":   # as TF1 scripts with Keras did
            tf.compat.v1.keras.backend.set_session(tf.compat.v1.Session())
        model = compiled(model_name, use_epl, stages, optimizer)
        if weights_in:
            model.load_weights(weights_in)
        if before_fit == "get_weights":
            out["before"] = model.get_weights()
        elif before_fit == "evaluate":
            out["before"] = model.evaluate(batches(), verbose=0) if dataset else \
                model.evaluate(x, y, batch_size=BATCH, verbose=0)
        elif before_fit == "predict":
            out["before"] = model.predict(x_predict, batch_size=BATCH, verbose=0)
        if dataset:
            history = model.fit(batches(), epochs=epochs, verbose=0)
        else:
            history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
        out["history"] = [history.history["loss"], history.history["accuracy"]]
        out["evaluate"] = model.evaluate(batches(), verbose=0) if dataset else \
            model.evaluate(x, y, batch_size=BATCH, verbose=0)
        out["predict"] = model.predict(x_predict, batch_size=20, verbose=0)
        out["weights"] = model.get_weights()
        out["train_on_batch"] = model.train_on_batch(x[:BATCH], y[:BATCH])
        out["weights_after"] = model.get_weights()
        out["model"] = model
    return out


def assert_same(result: dict, reference: dict, tolerance: dict, floor: dict | None = None) -> None:
    """Every value the script saw equals the reference's, within `tolerance` plus
    NOISE_FACTOR x the reference's noise floor (`noise_floor`) where one is given."""
    for key in ("before", "history", "evaluate", "predict", "weights", "train_on_batch",
                "weights_after"):
        if key not in reference:
            continue
        got, want = _listed(result[key]), _listed(reference[key])
        assert len(got) == len(want), key
        for index, (a, b) in enumerate(zip(got, want)):
            allowed = dict(tolerance)
            if floor is not None:
                allowed["atol"] = tolerance["atol"] + NOISE_FACTOR * floor[key][index]
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       err_msg=f"{key}[{index}]", **allowed)


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def noise_floor(reference: dict, again: dict) -> dict:
    """Per value, the largest difference between the reference and the same training
    with every batch's rows reversed (what summation order alone changes)."""
    return {key: [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                  for a, b in zip(_listed(reference[key]), _listed(again[key]))]
            for key in reference if key != "model"}


CASES = ["sequential:dp", "functional:dp", "subclassed:dp", "sequential:ga",
         "subclassed:pipeline", "functional:pipeline", "sequential:gpipe", "functional:gc",
         "sequential:amp", "functional:zero", "functional:zero_v1", "split_head:split",
         "functional:auto_stages"]


@pytest.mark.parametrize("case", CASES)
def test_fit_matches_the_script_without_epl(epl_env, case):
    model_name, strategy = case.split(":")
    stages = strategy in ("pipeline", "gpipe")
    optimizer = "v1" if strategy in V1_OPTIMIZER_STRATEGIES else "keras"
    reference = run(model_name, use_epl=False, stages=False, optimizer=optimizer)
    floor = noise_floor(reference, run(model_name, use_epl=False, stages=False,
                                       reverse_batches=True, optimizer=optimizer))
    epl_env(STRATEGIES[strategy])
    result = run(model_name, use_epl=True, stages=stages, optimizer=optimizer)
    tolerance = AMP_TOLERANCE if strategy == "amp" else dict(rtol=RTOL, atol=ATOL)
    assert_same(result, reference, tolerance, floor)
    graph = result["model"].outputs[0].graph
    from epl.hooks.session import parallel_graph
    parallel = parallel_graph(graph)
    assert parallel is not None, "fit did not parallelize the graph"
    devices = {op.device for op in graph.get_operations() if op.type == "MatMul" and op.device}
    assert len(devices) == 2 or strategy == "ga", devices
    if strategy.startswith("zero"):   # the optimizer state is sharded
        assert any(op.type == "VarHandleOp" and "EPL_ZERO" in op.name
                   for op in graph.get_operations())


@pytest.mark.parametrize("before_fit", ["get_weights", "evaluate", "predict", "own_session"])
def test_a_session_keras_opened_before_fit_is_moved_onto_the_parallel_graph(epl_env, before_fit):
    reference = run("sequential", use_epl=False, stages=False, before_fit=before_fit)
    floor = noise_floor(reference, run("sequential", use_epl=False, stages=False,
                                       before_fit=before_fit, reverse_batches=True))
    epl_env(STRATEGIES["pipeline"])
    result = run("sequential", use_epl=True, stages=True, before_fit=before_fit)
    assert_same(result, reference, dict(rtol=RTOL, atol=ATOL), floor)


@pytest.mark.parametrize("before_fit", ["", "evaluate"])
def test_fit_on_a_dataset_matches_the_script_without_epl(epl_env, before_fit):
    """fit (and evaluate before it) on a tf.data dataset: tf-keras feeds each batch
    from the iterator's next element (a tensor connection), which EPL runs as a fed
    batch; the iterator Keras initialized before fit built the step is initialized
    again in the session on the rewritten graph."""
    reference = run("sequential", use_epl=False, stages=False, dataset=True, before_fit=before_fit)
    floor = noise_floor(reference, run("sequential", use_epl=False, stages=False, dataset=True,
                                       before_fit=before_fit, reverse_batches=True))
    epl_env(STRATEGIES["pipeline"])
    result = run("sequential", use_epl=True, stages=True, dataset=True, before_fit=before_fit)
    assert_same(result, reference, dict(rtol=RTOL, atol=ATOL), floor)


def test_compiling_again_after_fit_is_refused(epl_env):
    """A second compile after fit built (and EPL rewrote) the training step would train
    replica 0's copy on its share of the batch: refused, saying what to do."""
    epl_env(STRATEGIES["dp"])
    x, y = data()
    with tf.Graph().as_default():
        model = compiled("sequential", use_epl=True, stages=False)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        model.compile(optimizer=keras.optimizers.legacy.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with pytest.raises(epl.ParallelizeError, match="compiled again after EPL parallelized"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize("direction", ["epl_to_plain", "plain_to_epl"])
def test_weights_go_across_layouts(epl_env, tmp_path, direction):
    """save_weights after one epoch under one layout, load_weights under the other.
    EPL to plain: the loaded weights are the single-device ones after one epoch.
    Plain to EPL: loaded before fit (into the session Keras opened early), one more
    epoch equals the same epoch without EPL from the same file."""
    path = str(tmp_path / "weights.h5")
    x, y = data()
    if direction == "epl_to_plain":
        epl_env(STRATEGIES["pipeline"])
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1)
        model = compiled("functional", use_epl=direction == "epl_to_plain",
                         stages=direction == "epl_to_plain")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        model.save_weights(path)
    epl.env.reset()
    if direction == "epl_to_plain":
        reference = run("functional", use_epl=False, stages=False, epochs=1)
        floor = noise_floor(reference, run("functional", use_epl=False, stages=False, epochs=1,
                                           reverse_batches=True))
        with tf.Graph().as_default():
            plain = compiled("functional", use_epl=False, stages=False)
            plain.load_weights(path)
            loaded = {"weights": plain.get_weights()}
        assert_same(loaded, {"weights": reference["weights"]}, dict(rtol=RTOL, atol=ATOL), floor)
    else:
        reference = run("functional", use_epl=False, stages=False, epochs=1, weights_in=path)
        floor = noise_floor(reference, run("functional", use_epl=False, stages=False, epochs=1,
                                           weights_in=path, reverse_batches=True))
        epl_env(STRATEGIES["pipeline"])
        result = run("functional", use_epl=True, stages=True, epochs=1, weights_in=path)
        assert_same(result, reference, dict(rtol=RTOL, atol=ATOL), floor)


def test_callbacks_checkpoint_earlystopping_tensorboard(epl_env, tmp_path):
    """ModelCheckpoint (weights), EarlyStopping and TensorBoard run under EPL; the
    checkpoint of the best epoch loads into a model without EPL and predicts what the
    EPL model predicted after that epoch."""
    x, y = data()
    path = str(tmp_path / "ckpt.h5")
    epl_env(STRATEGIES["dp"])
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1)
        model = compiled("sequential", use_epl=True, stages=False)
        callbacks = [keras.callbacks.ModelCheckpoint(path, save_weights_only=True),
                     keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0),
                     keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
        history = model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                            callbacks=callbacks)
        # min_delta=10 counts no epoch as an improvement: training stops after epoch 2
        assert len(history.history["loss"]) == 2
        predicted = model.predict(x, batch_size=BATCH, verbose=0)
    assert os.listdir(str(tmp_path / "tb")), "TensorBoard wrote nothing"
    epl.env.reset()
    with tf.Graph().as_default():
        plain = compiled("sequential", use_epl=False, stages=False)
        plain.load_weights(path)
        np.testing.assert_allclose(plain.predict(x, batch_size=BATCH, verbose=0), predicted,
                                   rtol=RTOL, atol=ATOL)


def test_split_with_a_tf_keras_optimizer_is_refused_before_step_0(epl_env):
    epl_env(STRATEGIES["split"])
    x, y = data()
    with tf.Graph().as_default():
        model = compiled("split_head", use_epl=True, stages=False)
        with pytest.raises(epl.ParallelizeError, match="tf.compat.v1.train.AdamOptimizer"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def _convnet(use_epl: bool):
    """A small convnet with BatchNormalization, as the Keras examples write one."""
    with (epl.replicate(1) if use_epl else contextlib.nullcontext()):
        inputs = keras.Input(shape=(6, 6, 1))
        hidden = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=_init(1))(inputs)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Flatten()(hidden)
        outputs = keras.layers.Dense(CLASSES, kernel_initializer=_init(2))(hidden)
    return keras.Model(inputs, outputs)


def _images(reverse_halves: bool = False):
    rng = np.random.RandomState(3)
    x = rng.randn(ROWS, 6, 6, 1).astype(np.float32)
    y = rng.randint(0, CLASSES, ROWS).astype(np.int64)
    if reverse_halves:   # the same per-replica batches, rows in another order
        order = np.arange(ROWS).reshape(-1, BATCH // 2)[:, ::-1].ravel()
        x, y = x[order], y[order]
    return x, y


def _per_replica_reference(reverse_halves: bool = False) -> list:
    """Single-device training on the replicas' rows: each half of a fed batch
    normalized with its own statistics (BatchNormalization in training mode), the
    gradient of the mean of the halves' losses, the moving statistics moved by the
    first half's (batch_norm.moving_statistics 'replica0')."""
    x, y = _images(reverse_halves)
    with tf.Graph().as_default():
        model = _convnet(False)
        features = tf.compat.v1.placeholder(tf.float32, [BATCH, 6, 6, 1])
        labels = tf.compat.v1.placeholder(tf.int64, [BATCH])
        lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
        losses, moving = [], None
        for index, rows in enumerate(halves):
            part = features[rows]
            losses.append(lossf(labels[rows], model(part, training=True)))
            if index == 0:
                moving = model.get_updates_for(part)
        optimizer = keras.optimizers.legacy.Adam(0.01)
        train = optimizer.get_updates(loss=(losses[0] + losses[1]) / 2,
                                      params=model.trainable_weights)
        session = tf.compat.v1.keras.backend.get_session()
        for start in range(0, ROWS, BATCH):
            session.run([train, moving], {features: x[start:start + BATCH],
                                          labels: y[start:start + BATCH]})
        return model.get_weights()


def test_batch_norm_convnet_matches_training_on_each_replicas_rows(epl_env):
    """BatchNormalization under data parallelism normalizes each replica's rows with
    their own statistics (as MirroredStrategy without SyncBatchNormalization): fit
    equals single-device training on the replicas' rows (`_per_replica_reference`)."""
    reference = _per_replica_reference()
    floor = noise_floor({"weights": reference}, {"weights": _per_replica_reference(True)})
    epl_env(STRATEGIES["dp"])
    x, y = _images()
    with tf.Graph().as_default():
        model = _convnet(True)
        model.compile(optimizer=keras.optimizers.legacy.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        weights = model.get_weights()
    assert_same({"weights": weights}, {"weights": reference}, dict(rtol=RTOL, atol=ATOL), floor)


def _fit_weighted(use_epl: bool, validation_weights: bool, reverse_batches: bool = False) -> dict:
    """fit with sample weights, validation data and a learning-rate schedule."""
    x, y = data()
    weights = np.random.RandomState(5).rand(ROWS).astype(np.float32)
    if reverse_batches:   # the same training: the reference's noise floor
        order = np.arange(ROWS).reshape(-1, BATCH)[:, ::-1].ravel()
        x, y, weights = x[order], y[order], weights[order]
    split = ROWS * 3 // 4
    validation = (x[split:], y[split:]) + ((weights[split:],) if validation_weights else ())
    with tf.Graph().as_default():
        model = compiled("sequential", use_epl, stages=use_epl)
        history = model.fit(x[:split], y[:split], sample_weight=weights[:split],
                            batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            validation_data=validation,
                            callbacks=[keras.callbacks.LearningRateScheduler(
                                lambda epoch, lr: lr * 0.5)])
        return {"history": [history.history[key] for key in sorted(history.history)],
                "weights": model.get_weights()}


def test_sample_weights_validation_and_a_schedule_match_the_script_without_epl(epl_env):
    reference = _fit_weighted(False, True)
    floor = noise_floor(reference, _fit_weighted(False, True, reverse_batches=True))
    epl_env(STRATEGIES["pipeline"])
    result = _fit_weighted(True, True)
    assert_same(result, reference, dict(rtol=RTOL, atol=ATOL), floor)


def test_validation_weighted_unlike_fit_is_refused(epl_env):
    """fit with sample weights, validation without: Keras builds the validation loss
    after the rewrite, on one replica's rows; refused, saying what to give."""
    epl_env(STRATEGIES["pipeline"])
    with pytest.raises(epl.ParallelizeError, match="validation_data=\\(x, y, sample_weight\\)"):
        _fit_weighted(True, False)
