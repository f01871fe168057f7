"""`epl.GraphKeys` and EPL's collections: how replicated values are merged.

A tensor computed inside a replicated part has one value per replica. Fetching
it returns replica 0's value unless it is in one of these collections; then the
fetch returns the merge over replicas (and, across workers, over workers): the
batch-share-weighted mean, the sum, or the concatenation along axis 0. Losses
passed to the optimizer are merged as means automatically.

`add_to_collection(tensors, key)` takes a tensor or a list of tensors (EPL's
form); `get_collection(key)` returns the tensors of one key and
`get_all_collections()` one list per key of `GraphKeys.ALL_COLLECTION_KEYS`,
in that order, for the default graph (or the graph given). Unlike EPL, they
work before `epl.init` too (EPL ignored them there with a warning): the
collections belong to the tf.Graph.
"""
from __future__ import annotations

import tensorflow as tf

from epl.errors import ConfigError


class GraphKeys:
    """Collection names understood by EPL (the same names as EPL's)."""

    GLOBAL_CONCAT_OBJECTS = "global_concat_objects"
    GLOBAL_MEAN_OBJECTS = "global_mean_objects"
    GLOBAL_SUM_OBJECTS = "global_sum_objects"
    LOCAL_CONCAT_OBJECTS = "local_concat_objects"
    LOCAL_MEAN_OBJECTS = "local_mean_objects"
    LOCAL_SUM_OBJECTS = "local_sum_objects"
    # every key, in EPL's order (get_all_collections returns one list per key in it)
    ALL_COLLECTION_KEYS = [
        GLOBAL_CONCAT_OBJECTS, GLOBAL_MEAN_OBJECTS, GLOBAL_SUM_OBJECTS,
        LOCAL_CONCAT_OBJECTS, LOCAL_MEAN_OBJECTS, LOCAL_SUM_OBJECTS,
    ]


MERGE_KIND = {
    GraphKeys.GLOBAL_MEAN_OBJECTS: "mean", GraphKeys.LOCAL_MEAN_OBJECTS: "mean",
    GraphKeys.GLOBAL_SUM_OBJECTS: "sum", GraphKeys.LOCAL_SUM_OBJECTS: "sum",
    GraphKeys.GLOBAL_CONCAT_OBJECTS: "concat", GraphKeys.LOCAL_CONCAT_OBJECTS: "concat",
}


def _check_key(key: str, caller: str) -> None:
    """Raise ConfigError unless `key` is one of EPL's collection keys."""
    if key not in MERGE_KIND:
        raise ConfigError(f"{caller}: unknown EPL collection {key!r}; valid: "
                          f"{', '.join(GraphKeys.ALL_COLLECTION_KEYS)} (epl.GraphKeys)")


def add_to_collection(tensors: tf.Tensor | list[tf.Tensor], key: str) -> None:
    """Add a tensor, or each tensor of a list (or tuple), to the EPL collection `key`
    of its graph (see GraphKeys).

    Raises ConfigError for an unknown key or an element that is not a tf.Tensor
    (a variable, an op), naming it; nothing is added then.
    """
    _check_key(key, "epl.add_to_collection")
    items = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    for item in items:
        if not isinstance(item, tf.Tensor):
            hint = (" (for a variable, add its value: tf.identity(v))"
                    if isinstance(item, tf.Variable) else "")
            raise ConfigError(f"epl.add_to_collection takes tf.Tensor objects (or a list of "
                              f"them); got {item!r} ({type(item).__name__}){hint}")
    for item in items:
        item.graph.add_to_collection(key, item)


def get_collection(key: str, graph: tf.Graph | None = None) -> list[tf.Tensor]:
    """The tensors in EPL collection `key` of `graph` (default: the default graph),
    in the order they were added."""
    _check_key(key, "epl.get_collection")
    graph = graph or tf.compat.v1.get_default_graph()
    return list(graph.get_collection(key))


def get_all_collections(graph: tf.Graph | None = None) -> list[list[tf.Tensor]]:
    """One list of tensors per key of `GraphKeys.ALL_COLLECTION_KEYS`, in that order."""
    return [get_collection(key, graph) for key in GraphKeys.ALL_COLLECTION_KEYS]


def merge_requests(graph: tf.Graph) -> dict:
    """tensor -> merge kind ("mean", "sum", "concat") for every collected tensor."""
    requests = {}
    for key, kind in MERGE_KIND.items():
        for obj in graph.get_collection(key):
            if isinstance(obj, tf.Tensor):
                requests.setdefault(obj, kind)
    return requests
