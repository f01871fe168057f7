"""The process-wide EPL state: the active config (and an entered cluster).

`activate(config)` freezes the configuration and makes it the active one;
`epl.init` (epl/api.py) does that and installs the hooks. This module holds
state only and imports nothing above the IR, so every layer may read it.

Calling it again, as EPL's own tests do between graphs, replaces the active
config (an equal config changes nothing). Graphs are annotated at
construction and gradient time and rewritten at parallelize time, all under
the config active when they were built: each graph's record keeps the config
it was made under (epl/ir/record.py), so a graph that EPL had already
annotated but not yet parallelized when `init` switched to a different config
is refused at parallelize time (epl/parallel.py), with the keys that differ and
the fix; graphs parallelized before, and graphs built after, are not
affected.

`epl.init` does not refuse eager execution (EPL did): TensorFlow 2 executes
eagerly by default and building the model inside ``with
tf.Graph().as_default():`` after `epl.init` is a valid use. The first thing
that needs graph mode (a strategy scope, `epl.parallelize`) refuses eager
mode with the fix.

`Env` is EPL's runtime view of this state (`epl.Env`, and `from epl.env import
Env` as in EPL). Its cluster is built by the function `epl.init` registers
(`set_cluster_factory`: the runtime's `local_cluster`), so that this module
imports nothing from the runtime.
"""
from __future__ import annotations

from epl.config import Config
from epl.errors import ConfigError

_ENV: dict = {"config": None, "cluster": None, "defaults": None, "cluster_factory": None,
              "capturing": False}


def frozen(config: Config | dict | None = None) -> Config:
    """`config` as the frozen Config `activate` would make active.

    config: an `epl.Config` (frozen by this call), a dict of dotted keys, or
    None for the defaults. Environment variables `EPL_<SECTION>_<KEY>` apply
    where the dict does not set the key.
    """
    if config is None or isinstance(config, dict):
        config = Config(config)
    if not isinstance(config, Config):
        raise ConfigError(
            f"epl.init expects an epl.Config or a dict of dotted keys, got {type(config).__name__}")
    config.freeze()
    return config


def switches_config(config: Config) -> bool:
    """True if activating the frozen `config` changes the active config."""
    return _ENV["config"] is None or _ENV["config"] != config


def activate(config: Config | dict | None = None) -> Config:
    """Make `config` (see `frozen`) the active one and return it; `epl.init`
    (epl/api.py) does this and installs the hooks. Activating a different config
    makes that one active for the graphs built afterwards (see the module docstring).
    """
    config = frozen(config)
    current = _ENV["config"]
    if current is not None and current == config:
        return current
    _ENV["config"] = config
    _ENV["cluster"] = None
    return config


def get_config() -> Config:
    """Return the active Config (the defaults, frozen, if epl.init was not called)."""
    if _ENV["config"] is None:
        if _ENV["defaults"] is None:
            _ENV["defaults"] = Config()
            _ENV["defaults"].freeze()
        return _ENV["defaults"]
    return _ENV["config"]


def is_initialized() -> bool:
    """True once epl.init has run in this process."""
    return _ENV["config"] is not None


def reset() -> None:
    """Forget the active config and cluster (for tests that need several configs in one
    process)."""
    _ENV["config"] = None
    _ENV["cluster"] = None


def enter_cluster(cluster) -> None:
    """Make `cluster` the one `Env.get().cluster` returns until the next epl.init."""
    _ENV["cluster"] = cluster


def entered_cluster():
    """The cluster entered with ``with epl.Cluster(...)`` since the last init, or None."""
    return _ENV["cluster"]


class CaptureStop(BaseException):
    """Raised by EPL's session and parallelize hooks while `epl.capture` runs a script,
    where EPL would parallelize `graph`: the script stops there, before the rewrite.
    A BaseException, so the script's own `except Exception` does not catch it."""

    def __init__(self, graph) -> None:
        super().__init__("epl.capture stops the script where EPL would parallelize its graph")
        self.graph = graph


def capturing() -> bool:
    """True while `epl.capture` runs a script (the hooks then raise CaptureStop)."""
    return _ENV["capturing"]


def save_state() -> dict:
    """This module's state (the active config, cluster, capture flag), for `restore_state`."""
    return dict(_ENV)


def restore_state(saved: dict) -> None:
    """Make the state `save_state` returned the current one again."""
    _ENV.update(saved)


def begin_capture() -> None:
    """Set the capture flag (`epl.capture`; `restore_state` clears it again)."""
    _ENV["capturing"] = True


def set_cluster_factory(factory) -> None:
    """Register `factory(config) -> Cluster`, which builds this worker's cluster for
    `Env.cluster` (epl.init registers the runtime's `local_cluster`)."""
    _ENV["cluster_factory"] = factory


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
        return get_config() if is_initialized() else None

    @property
    def cluster(self):
        """This worker's `epl.Cluster`: the one entered with ``with epl.Cluster(...)``
        since the last epl.init, else the one the runtime uses (read when asked: the
        GPUs TensorFlow sees or `cluster.virtual_devices`, and Horovod's rank and
        size); None before epl.init when none was entered."""
        if entered_cluster() is not None:
            return entered_cluster()
        factory = _ENV["cluster_factory"]
        if not is_initialized() or factory is None:
            return None
        return factory(get_config())

    @property
    def is_ready(self) -> bool:
        """True once epl.init has run (EPL's name)."""
        return is_initialized()

    def __repr__(self) -> str:
        """The active config's changes and the cluster."""
        return f"Env(config={self.config!r}, cluster={self.cluster!r})"
