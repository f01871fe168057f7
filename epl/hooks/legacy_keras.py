"""tf-keras (legacy Keras, `TF_USE_LEGACY_KERAS=1`) in graph mode under EPL:
`compile` / `fit` / `evaluate` / `predict` / `train_on_batch`.

tf-keras's graph-mode training (tf_keras.src.engine.training_v1) builds the training
step in `Model._make_train_function`, from `fit` or `train_on_batch`: the optimizer's
`get_updates` calls `tf.compat.v1.gradients` (recorded by epl.hooks.optimizer) and
applies them. Its backend opens its session earlier (`backend._get_session`: to
initialize the weights, to reset the metrics, for `get_weights` or an `evaluate`
before `fit`). The hooks:

- `Layer.__new__` / `Layer.__call__`: a layer constructed under a scope (or after
  `epl.set_default_strategy`) remembers it, and re-enters it when it is called
  where no scope or default is open: a subclassed model builds its ops when `fit`
  first calls it, after the scopes around its construction closed. Where a scope
  is open at the call, that scope tags the ops, as for any graph-mode code.
- `backend._get_session` opens its session inside `epl.hooks.session.deferring()`,
  so a session opened before the step exists does not fail ("annotations but no
  training step") and is kept;
- `Model._make_train_function`, once the step exists: the model's metric variables
  (Keras metrics are running sums, `aggregation=SUM`) become shared accumulators
  (tf.GraphKeys.METRIC_VARIABLES, as in eager mode, epl/hooks/function.py), the
  layers' updates (`add_update`: batch norm's moving statistics) join
  tf.GraphKeys.UPDATE_OPS, as tf.compat.v1.layers' do (batch_norm.moving_statistics
  chooses their value), the graph is parallelized, and each session opened before
  is moved onto the rewritten graph with its variables' values
  (epl/hooks/late_rewrite.py). A tf-keras optimizer with `epl.split`, and a second
  training step (compile again after fit), are refused before they train.
- `Model._make_predict_function`: on a parallelized graph, predict is the model's
  forward built once more after the rewrite (single-device, inference mode).
- `Model._make_test_function`: evaluate fetches the loss and metrics of the
  rewritten forward (every unit's); one Keras builds after the rewrite (weighted
  unlike fit) is refused.

Keras's backend functions run through callables, which EPL runs through
`Session.run` (epl.hooks.session), so fetches, feeds and the mirrors' sync are the
same as a session script's. What each function computes: docs/tf2.md.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import tensorflow as tf

from epl.env import is_initialized
from epl.errors import ParallelizeError
from epl.ir.annotations import StrategyKind
from epl.hooks import eager_scopes, late_rewrite, session as session_hooks
from epl.hooks.record import record_of
from epl.parallel import needs_parallelize, parallelize

SPEC_ATTR = "_epl_graph_spec"
_SCOPES_OFF = False   # see _no_layer_scopes
_ORIGINAL: dict = {}


def _graph_spec():
    """The strategy whose ops the default graph's ops get now: the innermost open scope,
    else the default strategy (epl.set_default_strategy); None outside both."""
    record = record_of(tf.compat.v1.get_default_graph(), create=False)
    if record is None:
        return None
    return record.scope_stack[-1] if record.scope_stack else record.default_spec


def _layer_new(cls, *args, **kwargs):
    layer = _ORIGINAL["new"](cls, *args, **kwargs)
    spec = _graph_spec() if is_initialized() and not tf.executing_eagerly() else None
    if spec is not None:
        object.__setattr__(layer, SPEC_ATTR, spec)
    return layer


def _scoped_call(original: str):
    """Layer.__call__ (`_ORIGINAL[original]`) that re-enters the layer's scope."""
    call = _ORIGINAL[original]

    @functools.wraps(call)
    def layer_call(self, *args, **kwargs):
        spec = self.__dict__.get(SPEC_ATTR)
        if spec is None or _SCOPES_OFF or tf.executing_eagerly() or not is_initialized() \
                or _graph_spec() is not None:
            return call(self, *args, **kwargs)
        with eager_scopes.traced_scope(spec):
            return call(self, *args, **kwargs)
    return layer_call


def _get_session(*args, **kwargs):
    with session_hooks.deferring():
        return _ORIGINAL["get_session"](*args, **kwargs)


def _make_train_function(self):
    if is_initialized() and not tf.executing_eagerly():
        _refuse_keras_optimizer(self)
        _refuse_second_step(self)
    _ORIGINAL["make_train_function"](self)
    if not is_initialized() or tf.executing_eagerly():
        return
    graph = self.total_loss.graph if getattr(self, "total_loss", None) is not None \
        else tf.compat.v1.get_default_graph()
    record = record_of(graph, create=False)
    if not needs_parallelize(record):
        return
    metric_variables = [v for metric in self.metrics for v in metric.variables]
    known = set(graph.get_collection(tf.compat.v1.GraphKeys.METRIC_VARIABLES))
    for variable in metric_variables:
        if variable not in known:
            graph.add_to_collection(tf.compat.v1.GraphKeys.METRIC_VARIABLES, variable)
    update_ops = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    for update in self.get_updates_for(None) + self.get_updates_for(self.inputs):
        if update not in update_ops:   # a layer's add_update: batch norm's moving statistics
            graph.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
    sessions = session_hooks.early_sessions(graph)
    optimizer = self.optimizer.variables() if hasattr(self.optimizer, "variables") else []
    variables = late_rewrite.known_variables(
        graph, list(self.variables) + metric_variables + list(optimizer))
    states = [late_rewrite.read_state(s, variables) for s in sessions]
    result = parallelize(graph, record)
    self.predict_function = None   # one made before reads replica 0's rows: rebuilt
    for session, state in zip(sessions, states):
        late_rewrite.move_session(session, result, state, session_hooks.session_callables(session),
                                  session_hooks.session_resources(session))


def _refuse_keras_optimizer(model) -> None:
    """epl.split needs the optimizer's update as tf.compat.v1.train optimizers build it
    (per variable, through apply_gradients, recorded by epl.hooks.optimizer, which
    updates the shards): a tf-keras optimizer updates the whole split variable.
    Refused before the first step."""
    from tf_keras.src.optimizers.legacy import optimizer_v2
    if not isinstance(getattr(model, "optimizer", None), optimizer_v2.OptimizerV2):
        return
    graph = model.outputs[0].graph if getattr(model, "outputs", None) else \
        tf.compat.v1.get_default_graph()
    record = record_of(graph, create=False)
    if record is not None and any(tg.spec.kind == StrategyKind.SPLIT for tg in record.taskgraphs):
        raise ParallelizeError(
            f"epl.split with a tf-keras optimizer ({type(model.optimizer).__name__}) in graph "
            "mode: EPL updates a split variable's shards only as a tf.compat.v1.train "
            "optimizer builds the update (a tf-keras optimizer updates the whole variable). "
            "Compile with the tf.compat.v1.train optimizer of the same algorithm, e.g. "
            "model.compile(optimizer=tf.compat.v1.train.AdamOptimizer(0.001), ...), or "
            "drop epl.split.")


def _refuse_second_step(model) -> None:
    """compile called again after fit built and EPL rewrote the training step: the new
    step would train replica 0's forward copy on its share of the batch only."""
    if getattr(model, "train_function", None) is not None or not getattr(model, "outputs", None):
        return
    if session_hooks.parallel_graph(model.outputs[0].graph) is not None:
        raise ParallelizeError(
            "the model was compiled again after EPL parallelized its graph (fit built the "
            "first training step): EPL rewrites one training step per graph, and a step "
            "built after the rewrite would train one replica on its share of the batch. "
            "Build and compile the model once, or rebuild it in a new graph "
            "(tf.keras.backend.clear_session()) before compiling it again.")


def _make_test_function(self):
    """evaluate (and fit's validation) on a parallelized graph fetch the loss and metrics
    the rewritten forward computes over every unit. Keras builds them anew when the
    sample weighting differs from fit's (fit with sample_weight, validation without):
    such a loss, built after the rewrite, would read one unit's rows. Refused."""
    _ORIGINAL["make_test_function"](self)
    function = getattr(self, "test_function", None)
    result = session_hooks.parallel_graph(self.outputs[0].graph) if function is not None \
        and getattr(self, "outputs", None) else None
    if result is None:
        return
    late = [t for t in getattr(function, "outputs", []) if isinstance(t, tf.Tensor)
            and t.graph is result.graph and t.op._id > result.ops_after_rewrite]
    if late:
        self.test_function = None
        raise ParallelizeError(
            f"evaluate (or fit's validation) needs {late[0].name}, a loss or metric Keras "
            "built after EPL parallelized the graph (its sample weighting differs from "
            "fit's: fit with sample_weight or class_weight, evaluate without), which would "
            "read one replica's rows. Give the evaluation sample weights as fit had them "
            "(validation_data=(x, y, sample_weight), evaluate(x, y, sample_weight=...)), or "
            "evaluate a model built without EPL scopes from the saved weights.")


def _make_predict_function(self):
    """predict on a parallelized graph: the model's forward built once more, after the
    rewrite, on the fed inputs (single-device, in inference mode, on the variables
    replica 0 trains, which every replica equals). The rewritten forward cannot
    serve: each of its copies reads its unit's rows, and a pipeline's copies wait
    for the backward of the micro-batch before (1F1B), which needs the targets."""
    graph = self._feed_inputs[0].graph if getattr(self, "_feed_inputs", None) else None
    result = session_hooks.parallel_graph(graph) if graph is not None else None
    if result is None or getattr(self, "predict_function", None) is not None:
        return _ORIGINAL["make_predict_function"](self)
    from tf_keras.src import backend
    inputs = list(self._feed_inputs)
    with graph.as_default(), _no_layer_scopes(), tf.name_scope("EPL_PREDICT"):
        outputs = self(inputs if len(inputs) > 1 else inputs[0], training=False)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    self.predict_function = backend.function(inputs, outputs, name="predict_function",
                                             **getattr(self, "_function_kwargs", {}))


@contextlib.contextmanager
def _no_layer_scopes():
    """Layers called inside do not re-enter their scopes (ops built after the rewrite
    belong to no TaskGraph)."""
    global _SCOPES_OFF
    saved, _SCOPES_OFF = _SCOPES_OFF, True
    try:
        yield
    finally:
        _SCOPES_OFF = saved


def install() -> None:
    """Wrap tf-keras's Layer.__new__/__call__, backend._get_session and
    training_v1.Model._make_train_function,
    when legacy Keras is in use (TF_USE_LEGACY_KERAS set, or tf_keras imported);
    idempotent."""
    if _ORIGINAL:
        return
    if "tf_keras" not in sys.modules and os.environ.get("TF_USE_LEGACY_KERAS", "").lower() \
            not in ("1", "true", "yes"):
        return
    try:
        from tf_keras.src import backend
        from tf_keras.src.engine import base_layer, base_layer_v1, training_v1
    except ImportError:   # TF_USE_LEGACY_KERAS without tf-keras: TensorFlow says so itself
        return
    _ORIGINAL.update(get_session=backend._get_session,
                     make_train_function=training_v1.Model._make_train_function,
                     make_predict_function=training_v1.Model._make_predict_function,
                     make_test_function=training_v1.Model._make_test_function,
                     new=base_layer.Layer.__new__, call=base_layer.Layer.__call__,
                     call_v1=base_layer_v1.Layer.__call__)
    base_layer.Layer.__new__ = staticmethod(functools.wraps(_ORIGINAL["new"])(_layer_new))
    # graph mode swaps a layer's class to base_layer_v1.Layer (version_utils), whose
    # __call__ is its own
    base_layer.Layer.__call__ = _scoped_call("call")
    base_layer_v1.Layer.__call__ = _scoped_call("call_v1")
    backend._get_session = functools.wraps(_ORIGINAL["get_session"])(_get_session)
    training_v1.Model._make_train_function = functools.wraps(
        _ORIGINAL["make_train_function"])(_make_train_function)
    training_v1.Model._make_predict_function = functools.wraps(
        _ORIGINAL["make_predict_function"])(_make_predict_function)
    training_v1.Model._make_test_function = functools.wraps(
        _ORIGINAL["make_test_function"])(_make_test_function)
