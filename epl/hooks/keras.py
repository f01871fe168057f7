"""Keras 3 (the TensorFlow backend) under EPL: layers remember their scope, optimizers
record their updates.

- `Layer.__new__`: a layer constructed eagerly under an EPL scope (or after an eager
  `epl.set_default_strategy`) remembers that scope (`epl.hooks.eager_scopes.eager_spec`).
- `Layer.__call__`: a layer that remembers a scope re-enters it when it is called while
  a function is traced (Keras `fit` traces its train step; a custom loop's
  `tf.function`), so the ops it builds carry the scope's TaskGraph. The innermost
  layer's scope wins; a layer without one keeps its caller's.
- `BaseOptimizer.apply` (what `apply_gradients` calls): inside a trace, its ops are
  tagged "apply" and the variables it writes (the weights, the slots, the iteration
  count) are grouped into the train op of the step the gradients were recorded for
  (epl/hooks/function.py rewrites that step when the trace ends).

Only Keras 3 (`import keras`) is hooked, and only once it is imported (`install`
is called by epl.init, by every scope entered eagerly and by the first gradient of
a trace); legacy tf-keras layers in graph mode are graph-mode code.
"""
from __future__ import annotations

import functools
import sys

import tensorflow as tf

from epl.hooks import eager_scopes
from epl.env import is_initialized
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, Phase
from epl.ir.func_graph import WRITE_TYPES_PREFIXES
from epl.hooks.record import record_of

SPEC_ATTR = "_epl_spec"
_ORIGINAL: dict = {}


def _layer_new(cls, *args, **kwargs):
    # __new__, not __init__: Keras reads each layer class's __init__ signature (its
    # config), which a wrapper would hide
    layer = _ORIGINAL["new"](cls, *args, **kwargs)
    spec = eager_scopes.eager_spec() if tf.executing_eagerly() else None
    if spec is not None:
        object.__setattr__(layer, SPEC_ATTR, spec)
    return layer


def _layer_call(self, *args, **kwargs):
    spec = self.__dict__.get(SPEC_ATTR)
    if spec is None or tf.executing_eagerly() or not is_initialized():
        return _ORIGINAL["call"](self, *args, **kwargs)
    with eager_scopes.traced_scope(spec):
        return _ORIGINAL["call"](self, *args, **kwargs)


def _optimizer_apply(self, grads, trainable_variables=None):
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or not is_initialized():
        return _ORIGINAL["apply"](self, grads, trainable_variables)
    state = record_of(graph, create=False)
    first = len(graph.get_operations())
    result = _ORIGINAL["apply"](self, grads, trainable_variables)
    new = graph.get_operations()[first:]
    phase = tf.compat.v1.AttrValue(s=Phase.APPLY.value.encode())
    for op in new:
        if PHASE_ATTR not in op.node_def.attr:
            graph_mutation.set_attr(op, PHASE_ATTR, phase)
    step = _open_step(state)
    writes = [op for op in new if op.type.startswith(WRITE_TYPES_PREFIXES)
              and op.inputs and op.inputs[0].dtype == tf.resource]
    if step is not None and writes:
        with tf.control_dependencies(writes):
            step.train_op = tf.raw_ops.NoOp(name="EPL_KERAS_APPLY")
    return result


def _open_step(state):
    """The latest recorded step of the graph without a train op (the gradients this
    apply received were recorded for it), or None."""
    if state is None:
        return None
    for step in reversed(state.train_steps):
        if step.train_op is None:
            return step
    return None


def install() -> None:
    """Wrap Keras 3's Layer.__new__/__call__ and BaseOptimizer.apply, if Keras 3 is
    imported (idempotent; a later call hooks a Keras imported since)."""
    if _ORIGINAL or "keras.src.layers.layer" not in sys.modules:
        return
    from keras.src.layers.layer import Layer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    _ORIGINAL.update(new=Layer.__new__, call=Layer.__call__, apply=BaseOptimizer.apply)
    Layer.__new__ = staticmethod(functools.wraps(_ORIGINAL["new"])(_layer_new))
    Layer.__call__ = tf.autograph.experimental.do_not_convert(
        functools.wraps(_ORIGINAL["call"])(_layer_call))
    BaseOptimizer.apply = tf.autograph.experimental.do_not_convert(
        functools.wraps(_ORIGINAL["apply"])(_optimizer_apply))
