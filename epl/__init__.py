"""EPL: Whale-style hybrid parallelism for TensorFlow graph-mode training.

Add scopes to an ordinary tf.compat.v1 training script:

    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(device_count=1):
        loss = model(features, labels)
    train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)

The first session on the graph (or epl.parallelize()) rewrites it.
"""
from epl.cluster import Cluster
from epl.config import Config
from epl.env import Env, init
from epl.errors import (ClusterError, ConfigError, EPLError, ParallelizeError, PassError,
                        ScopeError)
from epl.graph_keys import GraphKeys, add_to_collection, get_all_collections, get_collection
from epl.parallel import parallelize
from epl.strategies import replicate, set_default_strategy, split
from epl import layers  # noqa: E402  (epl.layers.dense / embedding / moe ...)

__all__ = ["Cluster", "Config", "init", "replicate", "split", "set_default_strategy", "parallelize",
           "layers",
           "GraphKeys", "add_to_collection", "EPLError", "ConfigError", "ScopeError",
           "ClusterError", "ParallelizeError", "PassError",
           "Env", "get_collection", "get_all_collections", "VERSION"]
__version__ = "0.1.0"
VERSION = __version__  # EPL's name
