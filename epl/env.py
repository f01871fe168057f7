"""`epl.init`: the process-wide EPL environment (its config and hooks).

`init(config)` stores the configuration and installs the hooks that let a
plain training script trigger EPL: the optimizer hooks (gradient time) and the
session hooks (parallelize time). Calling it again with an equal config is a
no-op; with a different config it is an error, because graphs already built
were annotated under the first one.
"""
from __future__ import annotations

from epl.config import Config
from epl.errors import ConfigError

_ENV: dict = {"config": None}


def init(config: Config | dict | None = None) -> Config:
    """Initialize EPL for this process and return the active Config.

    config: an `epl.Config`, a dict of dotted keys, or None for the defaults.
    Environment overrides `EPL_<SECTION>_<KEY>` apply in every case.
    """
    if config is None or isinstance(config, dict):
        config = Config(config)
    if not isinstance(config, Config):
        raise ConfigError(
            f"epl.init expects an epl.Config or a dict of dotted keys, got {type(config).__name__}")
    current = _ENV["config"]
    if current is not None:
        if current == config:
            return current
        changed = sorted(k for k, v in config.to_dict().items() if current.to_dict().get(k) != v)
        raise ConfigError(
            "epl.init was already called with a different config (keys that differ: "
            f"{', '.join(changed)}). Call epl.init once per process, before building the model; "
            "to change the config, start a new process.")
    _check_no_step_built()
    from epl import hooks  # local import: hooks import the passes, which import this module
    hooks.install()
    _ENV["config"] = config
    from epl.logs import configure as configure_logging
    configure_logging(config.get("debug.log_level"))
    return config


# Op types of an optimizer's variable updates (TensorFlow's training ops).
_UPDATE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")


def _check_no_step_built() -> None:
    """EPL records the training step when the optimizer builds it; a step built
    before epl.init was not recorded, and EPL would leave it unparallelized (or
    find "no training step"): say so now, naming it."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    updates = [op for op in graph.get_operations() if op.type.startswith(_UPDATE_PREFIXES)]
    if updates:
        raise ConfigError(
            "epl.init() was called after the optimizer built the training step: the default "
            "graph already has %d variable update%s (%s, type %s), made by minimize() or "
            "apply_gradients() before EPL was initialized, so EPL did not record the step. "
            "Call epl.init() first, then build the model and the optimizer step."
            % (len(updates), "" if len(updates) == 1 else "s", updates[0].name, updates[0].type))


def get_config() -> Config:
    """Return the active Config (the defaults if epl.init was not called)."""
    if _ENV["config"] is None:
        return init()
    return _ENV["config"]


def is_initialized() -> bool:
    """True once epl.init has run in this process."""
    return _ENV["config"] is not None


def reset() -> None:
    """Forget the active config (for tests that need several configs in one process)."""
    _ENV["config"] = None
