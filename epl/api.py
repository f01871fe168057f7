"""EPL's API layer: `epl.init`, `epl.parallelize` and `epl.Env`.

Layers, each importing only those below it: this API (and epl/strategies.py,
epl/layers.py) -> session and optimizer integration (epl/hooks/) -> the driver
(epl/parallel.py) -> the passes (epl/passes/) -> planner, runtime and IR ->
config (scripts/import_graph.py checks there is no cycle).

`init(config)` freezes the configuration, makes it the active one
(epl/env.py) and installs the hooks that let a plain training script trigger
EPL: the optimizer hooks (gradient time) and the session hooks (parallelize
time). See epl/env.py for calling it again with another config.

`epl.init` does not refuse eager execution (EPL did): TensorFlow 2 executes
eagerly by default and building the model inside ``with
tf.Graph().as_default():`` after `epl.init` is a valid use. The first thing
that needs graph mode (a strategy scope, `epl.parallelize`) refuses eager
mode with the fix.
"""
from __future__ import annotations

import tensorflow as tf

from epl import env, hooks
from epl.config import Config
from epl.errors import ConfigError, ParallelizeError
from epl.hooks.record import EAGER_HINT, record_of
from epl.observability.logs import configure as configure_logging
from epl.parallel import ParallelGraph, parallelize as _parallelize
from epl.runtime.cluster import local_cluster


def init(config: Config | dict | None = None) -> Config:
    """Initialize EPL for this process and return the active (frozen) Config.

    config: an `epl.Config` (frozen by this call), a dict of dotted keys, or
    None for the defaults. Environment variables `EPL_<SECTION>_<KEY>` apply
    where the dict does not set the key. Calling it again with a different
    config makes that one active for the graphs built afterwards (epl/env.py).
    """
    config = env.frozen(config)
    if env.switches_config(config):
        _check_no_step_built()
    config = env.activate(config)
    hooks.install()
    configure_logging(config.get("debug.log_level"))
    return config


# Op types of an optimizer's variable updates (TensorFlow's training ops).
_UPDATE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")


def _check_no_step_built() -> None:
    """EPL records the training step when the optimizer builds it; a step built
    before epl.init was not recorded, and EPL would leave it unparallelized (or
    find "no training step"): say so now, naming it."""
    graph = tf.compat.v1.get_default_graph()
    record = record_of(graph, create=False)
    if record is not None and record.train_steps:   # EPL recorded it (an earlier init)
        return
    updates = [op for op in graph.get_operations() if op.type.startswith(_UPDATE_PREFIXES)]
    if updates:
        raise ConfigError(
            "epl.init() was called after the optimizer built the training step: the default "
            "graph already has %d variable update%s (%s, type %s), made by minimize() or "
            "apply_gradients() before EPL was initialized, so EPL did not record the step. "
            "Call epl.init() first, then build the model and the optimizer step."
            % (len(updates), "" if len(updates) == 1 else "s", updates[0].name, updates[0].type))


def parallelize(graph: tf.Graph | None = None,
                replica_weights: list[float] | None = None) -> ParallelGraph:
    """Rewrite `graph` (default: the default graph) for parallel training, once
    (epl/parallel.py); initializes EPL with the defaults if epl.init was not
    called, so that sessions on the graph run the parallel step."""
    if not env.is_initialized():
        init()
    if tf.executing_eagerly() and graph is None:
        raise ParallelizeError(f"epl.parallelize() was called in eager mode. {EAGER_HINT}")
    graph = graph or tf.compat.v1.get_default_graph()
    return _parallelize(graph, record_of(graph), replica_weights)


class Env:
    """EPL's runtime environment, as EPL's `epl.Env` (`Env.get().config`, `.cluster`)."""

    _instance: "Env | None" = None

    @classmethod
    def get(cls) -> "Env":
        """The process's Env (one per process)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @property
    def config(self) -> Config | None:
        """The active Config (frozen), or None before epl.init."""
        return env.get_config() if env.is_initialized() else None

    @property
    def cluster(self):
        """This worker's `epl.Cluster`: the one entered with ``with epl.Cluster(...)``
        since the last epl.init, else the one the runtime uses (read when asked: the
        GPUs TensorFlow sees or `cluster.virtual_devices`, and Horovod's rank and
        size); None before epl.init when none was entered."""
        if env.entered_cluster() is not None:
            return env.entered_cluster()
        if not env.is_initialized():
            return None
        return local_cluster(env.get_config())

    @property
    def is_ready(self) -> bool:
        """True once epl.init has run (EPL's name)."""
        return env.is_initialized()

    def __repr__(self) -> str:
        """The active config's changes and the cluster."""
        return f"Env(config={self.config!r}, cluster={self.cluster!r})"
