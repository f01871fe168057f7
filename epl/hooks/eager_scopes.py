"""Strategy scopes entered eagerly (TensorFlow 2's default), for tf.function training steps.

A scope entered while TensorFlow executes eagerly, outside every trace, has no
graph to tag: it annotates the Keras layers constructed inside it instead. The
layer remembers the scope (`eager_spec`, read by epl/hooks/keras.py when it is
constructed) and re-enters it (`traced_scope`) whenever it is called while a
function is traced, so the ops it builds there carry the TaskGraph. Scopes
entered inside a trace are graph-mode scopes on the FuncGraph (epl/strategies.py).
An eager scope inside which no layer was constructed and no function was traced
annotated nothing: leaving it raises ScopeError with the two ways that work
(`EAGER_SCOPE_HINT`).
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import tensorflow as tf

from epl.env import is_initialized
from epl.errors import ScopeError
from epl.hooks.record import record_of
from epl.ir.annotations import TASKGRAPH_ATTR, StrategyKind, StrategySpec

EAGER_SCOPE_HINT = (
    "In eager TensorFlow 2, EPL parallelizes tf.function training steps: open the scope inside "
    "the tf.function (around the ops it annotates), or around the construction of the Keras "
    "layers the function calls (each layer re-enters its scope when it is called in the "
    "trace); or build a graph-mode program (tf.compat.v1.disable_eager_execution()).")


class _EagerScopes:
    """The scopes entered eagerly, innermost last, and the default set eagerly with
    set_default_strategy; `uses` counts what they annotated (Keras layers constructed,
    functions traced) so that leaving an unused one can say so."""

    def __init__(self):
        self.stack: list[StrategySpec] = []
        self.default: StrategySpec | None = None
        self.uses = 0
        # called when a scope is entered eagerly (epl.hooks installs the Keras layer
        # hooks through it, so that the layers of a Keras imported after epl.init
        # remember their scope); None until epl.init
        self.on_enter = None


_EAGER = _EagerScopes()


def eager_now() -> bool:
    """True when TensorFlow executes eagerly outside every trace."""
    return tf.executing_eagerly()


def taskgraph_attr(name: str) -> tf.compat.v1.AttrValue:
    """The AttrValue that tags an op with TaskGraph `name`."""
    return tf.compat.v1.AttrValue(s=name.encode())


def register(record, spec: StrategySpec) -> None:
    """Add `spec`'s TaskGraph to `record` (a GraphRecord); a name reused with another
    strategy is an error."""
    existing = record.taskgraph(spec.name)
    if existing is not None and existing.spec != spec:
        raise ScopeError(
            f"{spec.describe()} reuses the name of {existing.spec.describe()}; a TaskGraph name "
            "can be reused only with the same strategy. Pick a different name.")
    if existing is None and spec.kind == StrategyKind.SPLIT and spec.device_count == 1:
        _warn_split_on_one_device(spec)
    record.add_taskgraph(spec)


def _warn_split_on_one_device(spec: StrategySpec) -> None:
    """Warn (SplitFallbackWarning, and the "epl" logger) that a split TaskGraph of one
    device splits nothing: its variables stay whole on that device (EPL said nothing)."""
    from epl.passes.split.rewriter import SplitFallbackWarning

    message = (f"{spec.describe()} spans one device, so nothing under it is split: its "
               "variables (expert weights, a classifier) stay whole on one device. Give "
               "device_count >= 2 (e.g. the worker's device count) to split them.")
    logging.getLogger(__name__).warning("%s", message)
    warnings.warn(message, SplitFallbackWarning, stacklevel=4)


def on_eager_enter(callback) -> None:
    """Call `callback()` whenever a scope is entered (or a default set) eagerly."""
    _EAGER.on_enter = callback


def _entering(what: str) -> None:
    if not is_initialized() or _EAGER.on_enter is None:
        raise ScopeError(
            f"{what} was used in eager mode before epl.init(): call epl.init() first (it "
            "creates the devices EPL trains on, before TensorFlow runs its first op), then "
            "build the model.")
    _EAGER.on_enter()


def enter(spec: StrategySpec) -> int:
    """Open `spec` eagerly; returns the use count to hand to `leave`."""
    if _EAGER.stack:
        raise ScopeError(
            f"{spec.describe()} was opened inside {_EAGER.stack[-1].describe()}; strategy "
            "scopes cannot be nested. Close the outer scope first and put the two parts in "
            "consecutive scopes (e.g. the body under epl.replicate, then the classifier "
            "under epl.split).")
    _entering(spec.describe())
    _EAGER.stack.append(spec)
    return _EAGER.uses


def leave(spec: StrategySpec, uses_when_entered: int, failed: bool) -> None:
    """Close the innermost eager scope; refuse one that annotated nothing."""
    _EAGER.stack.pop()
    if _EAGER.uses == uses_when_entered and not failed:
        raise ScopeError(
            f"{spec.describe()} was used in eager mode around code that built nothing EPL "
            "can parallelize (no Keras layer was constructed inside it and no tf.function "
            f"was traced). {EAGER_SCOPE_HINT}")


def set_default(spec: StrategySpec | None) -> None:
    """set_default_strategy called eagerly: the Keras layers constructed from now on
    belong to `spec` (None clears it)."""
    if spec is not None:
        _entering("epl.set_default_strategy")
    _EAGER.default = spec


def eager_spec() -> StrategySpec | None:
    """The strategy a Keras layer constructed now (eagerly) belongs to: the innermost
    eager scope, else the eager default; None outside both. Counts as a use."""
    spec = _EAGER.stack[-1] if _EAGER.stack else _EAGER.default
    if spec is not None:
        _EAGER.uses += 1
    return spec


def note_eager_use() -> None:
    """A function was traced while eager scopes are open (they annotate its ops through
    the layers it calls, or through the function's own scopes)."""
    if _EAGER.stack:
        _EAGER.uses += 1


@contextlib.contextmanager
def traced_scope(spec: StrategySpec):
    """Tag the ops created inside with `spec`'s TaskGraph on the default graph (the
    FuncGraph being traced), registering it there; used when a layer constructed
    under an eager scope is called in a trace. Unlike entering a Strategy it may
    nest: the innermost layer's scope wins, and a layer without one keeps its
    caller's."""
    graph = tf.compat.v1.get_default_graph()
    register(record_of(graph), spec)
    with graph._attr_scope({TASKGRAPH_ATTR: taskgraph_attr(spec.name)}):
        yield
