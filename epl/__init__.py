"""EPL: Whale-style hybrid parallelism for TensorFlow graph-mode training.

Add scopes to an ordinary tf.compat.v1 training script:

    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(device_count=1):
        loss = model(features, labels)
    train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)

The first session on the graph (or epl.parallelize()) rewrites it.

The names below are loaded when first used (PEP 562), so that importing one of
EPL's low-level modules (epl.errors, epl.ir.*) does not import the whole API
and, through it, every layer above that module (scripts/import_graph.py), and
importing a TensorFlow-free part (epl.planner.profiles, epl.planner.planner: what
`epl-plan --model` runs) does not import TensorFlow.
"""
import importlib

__version__ = "0.1.0"
VERSION = __version__  # EPL's name

# public name -> the module that defines it
_EXPORTS = {
    "Cluster": "epl.runtime.cluster",
    "Config": "epl.config",
    "Env": "epl.env", "init": "epl.api", "parallelize": "epl.api", "capture": "epl.api",
    "EPLError": "epl.errors", "ConfigError": "epl.errors", "ScopeError": "epl.errors",
    "ClusterError": "epl.errors", "ParallelizeError": "epl.errors", "PassError": "epl.errors",
    "CaptureError": "epl.errors",
    "CheckpointError": "epl.errors",
    "GraphKeys": "epl.graph_keys", "add_to_collection": "epl.graph_keys",
    "get_all_collections": "epl.graph_keys", "get_collection": "epl.graph_keys",
    "replicate": "epl.strategies", "set_default_strategy": "epl.strategies",
    "split": "epl.strategies",
}
_SUBMODULES = ("layers",)   # epl.layers.dense / embedding / moe ...

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["VERSION"]


def __getattr__(name: str):
    """Load a public name (or the `layers` module) on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"epl.{name}")
    else:
        raise AttributeError(f"module 'epl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
