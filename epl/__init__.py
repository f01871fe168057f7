"""EPL: Whale-style hybrid parallelism for TensorFlow graph-mode training.

Add scopes to an ordinary tf.compat.v1 training script:

    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(device_count=1):
        loss = model(features, labels)
    train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)

The first session on the graph (or epl.parallelize()) rewrites it.
"""
import importlib
from typing import Any

# Public names -> the module that defines them.  They are imported on first
# use (PEP 562), so that importing a TensorFlow-free part of EPL
# (epl.profiles, epl.planner.planner: what `epl-plan --model` runs) does not
# import TensorFlow; `import epl; epl.replicate(...)` and
# `from epl import replicate` work as before.
_LAZY = {
    "Cluster": "epl.cluster", "Config": "epl.config", "Env": "epl.env",
    "init": "epl.env", "ClusterError": "epl.errors",
    "ConfigError": "epl.errors", "EPLError": "epl.errors",
    "ParallelizeError": "epl.errors", "PassError": "epl.errors",
    "ScopeError": "epl.errors", "GraphKeys": "epl.graph_keys",
    "add_to_collection": "epl.graph_keys",
    "get_all_collections": "epl.graph_keys",
    "get_collection": "epl.graph_keys", "parallelize": "epl.parallel",
    "replicate": "epl.strategies", "set_default_strategy": "epl.strategies",
    "split": "epl.strategies",
}
_SUBMODULES = ("layers",)  # epl.layers.dense / embedding / moe ...


def __getattr__(name: str) -> Any:
    """A public name of EPL, imported from its module on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"epl.{name}")
    else:
        raise AttributeError(f"module 'epl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, lazy ones included."""
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = ["Cluster", "Config", "init", "replicate", "split", "set_default_strategy", "parallelize",
           "layers",
           "GraphKeys", "add_to_collection", "EPLError", "ConfigError", "ScopeError",
           "ClusterError", "ParallelizeError", "PassError",
           "Env", "get_collection", "get_all_collections", "VERSION"]
__version__ = "0.1.0"
VERSION = __version__  # EPL's name
