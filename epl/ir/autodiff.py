"""Whose autodiff is running: the user's (recorded as a candidate training step by
epl.hooks.optimizer) or EPL's own (the passes, an optimizer's compute_gradients),
which is never recorded."""
from __future__ import annotations

import contextlib
import threading

_DEPTH = threading.local()


@contextlib.contextmanager
def internal_autodiff():
    """Inside: tf.gradients calls are EPL's (or an optimizer's), not user steps."""
    depth = getattr(_DEPTH, "depth", 0)
    _DEPTH.depth = depth + 1
    try:
        yield
    finally:
        _DEPTH.depth = depth


def inside_internal_autodiff() -> bool:
    """True inside `internal_autodiff`."""
    return getattr(_DEPTH, "depth", 0) > 0
