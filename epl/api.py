"""EPL's API layer: `epl.init`, `epl.parallelize`, `epl.capture` (and `epl.Env`, from
epl/env.py).

Layers, each importing only those below it: this API (and epl/strategies.py,
epl/layers.py) -> session and optimizer integration (epl/hooks/) -> the driver
(epl/parallel.py) -> the passes (epl/passes/) -> planner, runtime and IR ->
config (scripts/import_graph.py checks there is no cycle).

`init(config)` freezes the configuration, makes it the active one
(epl/env.py) and installs the hooks that let a plain training script trigger
EPL: the optimizer hooks (gradient time) and the session hooks (parallelize
time). See epl/env.py for calling it again with another config.

`capture(script, argv)` runs a training script until EPL would parallelize its
graph and returns the graph, EPL's record of it and the script's config, without
rewriting it (what `epl-plan --script` plans): EPL's own session and
parallelize hooks stop the script there while the capture flag is set.

`epl.init` does not refuse eager execution (EPL did): TensorFlow 2 executes
eagerly by default, and both eager programs (tf.function steps, Keras 3 `fit`:
epl/hooks/function.py) and graphs built inside ``with tf.Graph().as_default():``
after `epl.init` are valid uses. Under eager execution it also creates the
virtual CPU devices (`cluster.virtual_devices`) in the eager context, which is
only possible before TensorFlow runs its first op.
"""
from __future__ import annotations

import dataclasses
import os
import runpy
import sys
from collections.abc import Sequence

import tensorflow as tf

from epl import env, hooks
from epl.config import Config
from epl.env import Env  # noqa: F401  (EPL's `epl.Env`; defined with the state it reads)
from epl.errors import CaptureError, ConfigError, EPLError, ParallelizeError
from epl.hooks.record import EAGER_HINT, record_of
from epl.ir.record import GraphRecord
from epl.observability.logs import configure as configure_logging
from epl.parallel import ParallelGraph, parallelize as _parallelize
from epl.runtime.cluster import local_cluster, use_virtual_cpus


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
    env.set_cluster_factory(local_cluster)
    hooks.install()
    configure_logging(config.get("debug.log_level"))
    if tf.executing_eagerly():   # eager TensorFlow 2: tf.function steps run on these
        use_virtual_cpus(int(config.get("cluster.virtual_devices")))
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
    called, so that sessions on the graph run the parallel step. While `capture`
    runs a script, it stops the script instead (env.CaptureStop)."""
    if env.capturing():
        raise env.CaptureStop(graph or tf.compat.v1.get_default_graph())
    if not env.is_initialized():
        init()
    if tf.executing_eagerly() and graph is None:
        raise ParallelizeError(f"epl.parallelize() was called in eager mode. {EAGER_HINT}")
    graph = graph or tf.compat.v1.get_default_graph()
    return _parallelize(graph, record_of(graph), replica_weights)


@dataclasses.dataclass
class Capture:
    """What `capture` returns: the graph a training script built, as EPL would
    parallelize it, EPL's record of it (`GraphRecord`: its TaskGraphs, training steps
    and split records), and the config it was built under (the script's epl.init's;
    the defaults when it did not call it)."""

    graph: tf.Graph
    record: GraphRecord
    config: Config


def capture(script: str, argv: Sequence[str] = ()) -> Capture:
    """Run the training script `script` (with `argv` as its arguments) until EPL would
    parallelize its graph, and return that graph (a `Capture`); EPL's rewrite never runs.

    The script runs as `__main__` in this process (`runpy`), in a fresh default
    graph, with EPL initialized with the defaults first (the script's epl.init
    replaces them), so the optimizer hooks record its training step as in a real
    run. EPL's own session and parallelize hooks stop it (env.CaptureStop) at the
    first session (tf.compat.v1.Session, MonitoredTrainingSession: at its
    Scaffold.finalize, after its hooks' begin()) or `epl.parallelize` on a graph
    EPL would parallelize; sessions on other graphs run. A script that ends (or
    exits with status 0) before that gives the graph it built. Afterwards
    sys.argv and EPL's state (the active config, the capture flag) are as before.
    TensorFlow's own state is the script's: a tf.compat.v1.disable_eager_execution()
    in it stays in effect.

    Raises:
        CaptureError: the file does not exist, the script failed or exited with an
            error status before EPL would parallelize, or it built no graph.
    """
    if not os.path.isfile(script):
        raise CaptureError(f"training script {script!r} does not exist")
    saved_argv, saved_state = sys.argv, env.save_state()
    graph = tf.Graph()
    try:
        env.reset()
        sys.argv = [script, *argv]
        with graph.as_default():
            init()
            env.begin_capture()
            graph = _run_until_parallelize(script, graph)
        record = record_of(graph)
        config = record.config or env.get_config()
    finally:
        sys.argv = saved_argv
        env.restore_state(saved_state)
    if not graph.get_operations():
        raise CaptureError(f"training script {script!r} built no graph before its first "
                           "session")
    return Capture(graph, record, config)


def _run_until_parallelize(script: str, graph: tf.Graph) -> tf.Graph:
    """Run `script`; return the graph EPL's hooks stopped it at (else `graph`)."""
    try:
        runpy.run_path(script, run_name="__main__")
    except env.CaptureStop as stop:
        return stop.graph
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise CaptureError(f"training script {script!r} exited with {exit_.code!r} "
                               "before creating a session") from None
    except EPLError:
        raise
    except Exception as err:  # the script's own failure
        raise CaptureError(f"training script {script!r} failed before creating a session: "
                           f"{type(err).__name__}: {err}") from err
    return graph
