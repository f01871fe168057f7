"""Strategy scopes: `epl.replicate`, `epl.split`, `epl.set_default_strategy`.

Entering a scope registers a TaskGraph on the default graph and tags every op
created inside it with the node attribute `_epl_taskgraph` (through the graph's
attribute scope, never through op names). Scopes do not nest.

That holds in graph mode and while a `tf.function` is traced (the default graph
is then the function's FuncGraph). Entered eagerly (TensorFlow 2's default,
outside any trace), a scope annotates the Keras layers constructed inside it
(epl/hooks/eager_scopes.py).
"""
from __future__ import annotations

import contextlib
import itertools

import tensorflow as tf

from epl.errors import ScopeError
from epl.hooks import eager_scopes
from epl.hooks.eager_scopes import register as _register, taskgraph_attr
from epl.hooks.record import default_graph_record
from epl.ir.annotations import TASKGRAPH_ATTR, StrategyKind, StrategySpec

_AUTO_NAMES = itertools.count()
# TensorFlow's error for tf.compat.v1.layers (and other tf-keras APIs) under Keras 3,
# and what to do about it.
KERAS_3_MESSAGE = "is not available with Keras 3"
LEGACY_KERAS_HINT = ("EPL: tf.compat.v1.layers needs legacy Keras: install tf-keras (the same "
                     "version as TensorFlow) and set TF_USE_LEGACY_KERAS=1 in the environment "
                     "before TensorFlow is imported, e.g. `TF_USE_LEGACY_KERAS=1 python "
                     "train.py` (docs/legacy-layers.md).")


class Strategy:
    """A strategy scope. Use it with `with`, or pass it to set_default_strategy."""

    def __init__(self, kind: StrategyKind, device_count: int, name: str | None):
        if not isinstance(device_count, int) or isinstance(device_count, bool) or device_count < 1:
            raise ScopeError(
                f"epl.{kind.value}(device_count={device_count!r}): device_count must be a "
                "positive integer (the number of devices one replica of this part spans).")
        if name is not None and (not isinstance(name, str) or not name):
            raise ScopeError(f"epl.{kind.value}(name={name!r}): name must be a non-empty string.")
        self.spec = StrategySpec(kind, device_count,
                                 name or f"{kind.value}_{next(_AUTO_NAMES)}")
        self._stack = None
        self._record = None
        self._eager_uses = None   # the use count when entered eagerly (None: not eager)

    def __enter__(self) -> "Strategy":
        if eager_scopes.eager_now():
            self._eager_uses = eager_scopes.enter(self.spec)
            return self
        graph, state = default_graph_record(self.spec.describe())
        if state.scope_stack:
            outer = state.scope_stack[-1]
            raise ScopeError(
                f"{self.spec.describe()} was opened inside {outer.describe()}; strategy scopes "
                "cannot be nested. Close the outer scope first and put the two parts in "
                "consecutive scopes (e.g. the body under epl.replicate, then the classifier "
                "under epl.split).")
        _register(state, self.spec)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(graph._attr_scope({TASKGRAPH_ATTR: taskgraph_attr(self.spec.name)}))
        state.scope_stack.append(self.spec)
        self._record = state
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._eager_uses is not None:
            uses, self._eager_uses = self._eager_uses, None
            eager_scopes.leave(self.spec, uses, exc_type is not None)
            if exc is not None:
                add_legacy_keras_hint(exc)
            return
        self._record.scope_stack.pop()
        self._record = None
        self._stack.close()
        self._stack = None
        if exc is not None:
            add_legacy_keras_hint(exc)


def add_legacy_keras_hint(exc: BaseException) -> None:
    """Add `LEGACY_KERAS_HINT` as a note to TensorFlow's "not available with Keras 3"
    error (a tf.compat.v1.layers call without legacy Keras), once."""
    if isinstance(exc, AttributeError) and KERAS_3_MESSAGE in str(exc) and \
            LEGACY_KERAS_HINT not in getattr(exc, "__notes__", ()):
        exc.add_note(LEGACY_KERAS_HINT)


def replicate(device_count: int = 1, name: str | None = None) -> Strategy:
    """Data parallelism: ops inside are replicated; each replica spans `device_count` devices."""
    return Strategy(StrategyKind.REPLICATE, device_count, name)


def split(device_count: int = 1, name: str | None = None) -> Strategy:
    """Tensor/expert parallelism: what is inside is split over `device_count` devices."""
    return Strategy(StrategyKind.SPLIT, device_count, name)


def set_default_strategy(strategy: Strategy | None) -> None:
    """Tag every op created from now on (outside explicit scopes) with `strategy`.

    Calling it again switches the default (how EPL scripts mark pipeline stages
    layer by layer); None clears it. Explicit scopes still take precedence.
    """
    if eager_scopes.eager_now():
        if strategy is not None and not isinstance(strategy, Strategy):
            raise ScopeError("epl.set_default_strategy expects epl.replicate(...) or "
                             f"epl.split(...), got {type(strategy).__name__}")
        eager_scopes.set_default(None if strategy is None else strategy.spec)
        return
    graph, state = default_graph_record("epl.set_default_strategy")
    if state.default_scope_exit is not None:
        state.default_scope_exit.close()
        state.default_scope_exit = None
    state.default_spec = None
    if strategy is None:
        return
    if not isinstance(strategy, Strategy):
        raise ScopeError("epl.set_default_strategy expects epl.replicate(...) or epl.split(...), "
                         f"got {type(strategy).__name__}")
    _register(state, strategy.spec)
    stack = contextlib.ExitStack()
    stack.enter_context(graph._attr_scope({TASKGRAPH_ATTR: taskgraph_attr(strategy.spec.name)}))
    state.default_scope_exit = stack
    state.default_spec = strategy.spec
