"""`epl.GraphKeys` and `epl.add_to_collection`: how replicated values are merged.

A tensor computed inside a replicated part has one value per replica. Fetching
it returns replica 0's value unless it is in one of these collections; then the
fetch returns the merge over replicas (and, across workers, over workers): the
batch-share-weighted mean, the sum, or the concatenation along axis 0. Losses
passed to the optimizer are merged as means automatically.
"""
from __future__ import annotations

import tensorflow as tf


class GraphKeys:
    """Collection names understood by EPL (the same names as EPL's)."""

    GLOBAL_MEAN_OBJECTS = "global_mean_objects"
    GLOBAL_SUM_OBJECTS = "global_sum_objects"
    GLOBAL_CONCAT_OBJECTS = "global_concat_objects"
    LOCAL_MEAN_OBJECTS = "local_mean_objects"
    LOCAL_SUM_OBJECTS = "local_sum_objects"
    LOCAL_CONCAT_OBJECTS = "local_concat_objects"


MERGE_KIND = {
    GraphKeys.GLOBAL_MEAN_OBJECTS: "mean", GraphKeys.LOCAL_MEAN_OBJECTS: "mean",
    GraphKeys.GLOBAL_SUM_OBJECTS: "sum", GraphKeys.LOCAL_SUM_OBJECTS: "sum",
    GraphKeys.GLOBAL_CONCAT_OBJECTS: "concat", GraphKeys.LOCAL_CONCAT_OBJECTS: "concat",
}


def add_to_collection(obj: tf.Tensor, key: str) -> None:
    """Add `obj` to the EPL collection `key` of its graph (see GraphKeys)."""
    if key not in MERGE_KIND:
        from epl.errors import ConfigError
        raise ConfigError(f"unknown EPL collection {key!r}; valid: {sorted(MERGE_KIND)}")
    obj.graph.add_to_collection(key, obj)


def merge_requests(graph: tf.Graph) -> dict:
    """tensor -> merge kind ("mean", "sum", "concat") for every collected tensor."""
    requests = {}
    for key, kind in MERGE_KIND.items():
        for obj in graph.get_collection(key):
            if isinstance(obj, tf.Tensor):
                requests.setdefault(obj, kind)
    return requests
