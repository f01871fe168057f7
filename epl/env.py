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

`epl.Env` (epl/api.py) is EPL's runtime view of this state.
"""
from __future__ import annotations

from epl.config import Config
from epl.errors import ConfigError

_ENV: dict = {"config": None, "cluster": None, "defaults": None}


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
