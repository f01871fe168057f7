"""What a fetch of a replicated tensor returns: the loss over the global batch, merged.

The user's loss (and every tensor of an EPL merge collection,
`epl.add_to_collection`) exists once per unit (replica, micro-batch); a fetch
of the original returns their merge: the mean over the global batch (each
unit's value weighted by its share), or their sum or concatenation as the
collection asks, over every worker when there are several.
"""
from __future__ import annotations

import tensorflow as tf

from epl.graph_keys import merge_requests
from epl.ir.clone import replace_input, with_dynamic_rows
from epl.ir.consistency import SUMMARY_TYPES  # summaries read merged values

# Summaries of one value: they read a merged value of the tensor's own shape only (the
# others take any shape: a histogram, an image batch or a text of every replica's rows).
_SCALAR_SUMMARY_TYPES = frozenset({"ScalarSummary", "WriteScalarSummary"})


def merge_fetches(graph, view, unit_maps, weights, devices, communicator) -> dict:
    """Merged value of each loss and each tensor in an EPL merge collection.

    unit_maps: per (replica, micro-batch) copy, in global batch order, its
    forward op map; weights: each copy's share of the global batch. Ops
    outside the replicated model and summary ops (tf.compat.v1.summary of
    the loss) that read an original tensor read the merged one instead.
    """
    requests = {loss: "mean" for loss in view.losses}
    requests.update({t: kind for t, kind in merge_requests(graph).items() if t not in requests})
    merged = {}
    for tensor, kind in requests.items():
        parts = _unit_parts(tensor, unit_maps)
        if parts is None:
            continue
        with tf.device(devices.get(tensor.op, "/device:CPU:0")), tf.name_scope("EPL_MERGED"):
            merged[tensor] = merge_parts(parts, weights, kind, communicator, tensor.name)
        if tensor.op not in unit_maps[0]:
            continue  # a batch input: EPL's own slicing and the ops outside read unit 0's
        same_shape = tensor.shape == merged[tensor].shape
        for consumer in list(tensor.consumers()):
            if _reads_merged(consumer, devices, same_shape):
                with tf.device(merged[tensor].device), tf.name_scope("EPL_MERGED"):
                    value = merged[tensor] if same_shape else with_dynamic_rows(merged[tensor],
                                                                                tensor)
                replace_input(consumer, tensor, value)
    return merged


def _reads_merged(consumer, devices, same_shape: bool) -> bool:
    """Whether `consumer` of a merged tensor reads the merged value: an op outside the
    replicated model (of the same shape), or a summary (a scalar one of the same
    shape; a histogram, image, audio or text summary of any: every replica's rows)."""
    if consumer.type in SUMMARY_TYPES:
        return same_shape or consumer.type not in _SCALAR_SUMMARY_TYPES
    return consumer not in devices and same_shape


def _unit_parts(tensor: tf.Tensor, unit_maps) -> list[tf.Tensor] | None:
    """What each unit has in place of `tensor`: its copy's output for a forward tensor;
    for a batch input (an iterator's batch, a placeholder; EPL's collections_test puts
    `IteratorGetNext` outputs in GLOBAL_CONCAT_OBJECTS) the input a copied consumer
    reads in each unit. None when no unit has it."""
    if tensor.op in unit_maps[0]:
        return [m[tensor.op].outputs[tensor.value_index] for m in unit_maps]
    for consumer in tensor.consumers():
        if all(consumer in m for m in unit_maps):
            index = next(i for i, t in enumerate(consumer.inputs) if t is tensor)
            return [m[consumer].inputs[index] for m in unit_maps]
    return None


def merge_parts(parts: list[tf.Tensor], weights: list, kind: str, communicator,
                label: str | None = None) -> tf.Tensor:
    """Merge per-replica values; across workers too (every worker must fetch it).
    label: the merged tensor's name (it names the cross-worker collective)."""
    if kind == "concat":
        return communicator.workers_all_gather(tf.concat(parts, axis=0), label=label)
    if kind == "sum":
        local = tf.add_n(parts)
    else:  # weights are shares of the global batch, so the sum over workers is the mean
        local = tf.add_n([tf.cast(w, p.dtype) * p for w, p in zip(weights, parts)])
    return communicator.workers_all_reduce(local, "sum", label=label)


def merge_split_losses(view, units, weights, communicator, spanning: set) -> dict:
    """A loss computed by a split group within a worker covers this worker's
    batch: the fetched value is the mean over every worker's batch (each
    weighted by its share). A group over every worker computed the global
    mean already."""
    merged = {}
    with tf.name_scope("EPL_MERGED"):
        for loss in view.losses:
            if loss.op in units[0] or view.taskgraph_of[loss.op].name in spanning:
                continue
            with tf.device(loss.device):
                share = tf.add_n([tf.cast(w, loss.dtype) for w in weights])
                merged[loss] = communicator.workers_all_reduce(share * loss, "sum",
                                                               label=loss.name)
    return merged
