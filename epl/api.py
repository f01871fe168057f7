"""EPL's API layer: `epl.init`, `epl.parallelize` (and `epl.Env`, from epl/env.py).

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
from epl.env import Env  # noqa: F401  (EPL's `epl.Env`; defined with the state it reads)
from epl.runtime.cluster import local_cluster
from epl.observability.logs import configure as configure_logging
from epl.parallel import ParallelGraph, parallelize as _parallelize


def init(config: Config | dict | None = None) -> Config:
    """Initialize EPL for this process and return the active (frozen) Config.

    config: an `epl.Config` (frozen by this call), a dict of dotted keys, or
    None for the defaults. Environment variables `EPL_<SECTION>_<KEY>` apply
    where the dict does not set the key. Calling it again with a different
    config makes that one active for the graphs built afterwards (epl/env.py).
    """
    config = env.activate(config)
    env.set_cluster_factory(local_cluster)
    hooks.install()
    configure_logging(config.get("debug.log_level"))
    return config


def parallelize(graph: tf.Graph | None = None,
                replica_weights: list[float] | None = None) -> ParallelGraph:
    """Rewrite `graph` (default: the default graph) for parallel training, once
    (epl/parallel.py); initializes EPL with the defaults if epl.init was not
    called, so that sessions on the graph run the parallel step."""
    if not env.is_initialized():
        init()
    return _parallelize(graph, replica_weights)
