"""Sharded variables: one logical variable held as k shards on k devices.

A variable created under `epl.split(k)` is replaced, when the split pass runs
(graph_passes/split.py), by k shard variables, each on its device and each
holding a contiguous slice of the full tensor along one axis. The shards:
- start from the slices of the full variable's initial value (the same numbers
  a single-device run starts from);
- carry TensorFlow's `SaveSliceInfo`, so a `tf.compat.v1.train.Saver` saves
  them as ONE tensor under the full variable's name and full shape, and a
  checkpoint written under any split restores under any other, or in a plain
  single-device script;
- replace the full variable in the global and trainable collections (the
  full variable stays in the graph, unused and never initialized, so it never
  takes memory).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError

SHARD_ATTR = "_epl_shard"  # int: the slot (shard index) of an op built by the split pass


@dataclasses.dataclass
class ShardedVariable:
    """A logical variable held as shards.

    name: the full variable's name (what checkpoints use).
    full_shape: the logical shape.
    axis: the axis the shards cut.
    sizes: each shard's extent along `axis` (they sum to full_shape[axis],
      unless the split group spans workers: then these are this worker's).
    shards: the shard variables, in order (shard j on devices[j]).
    """

    name: str
    full_shape: tuple
    axis: int
    sizes: tuple
    shards: list
    offsets: tuple = ()   # where each shard starts along `axis`


def shard_sizes(dim: int, count: int, weights=None, what: str = "dimension",
                must_divide: bool = False) -> list[int]:
    """Split `dim` into `count` positive integer extents.

    weights: relative shares (capability-weighted plans); None = even. With
    even shares (or `must_divide`) `dim` must be divisible by `count`; the
    error says which dimension and how to fix it. Uneven shares are rounded
    on cumulative boundaries (round(dim * cumulative share)), each at least 1.
    """
    if dim < count:
        raise ParallelizeError(
            f"cannot split a {what} of size {dim} over {count} devices: every device needs at "
            f"least one row. Use epl.split(device_count<={dim}).")
    even = weights is None or all(abs(w - weights[0]) < 1e-12 for w in weights)
    if even or must_divide:
        if dim % count:
            raise ParallelizeError(
                f"the {what} of size {dim} is not divisible by the split degree {count}, and "
                "its shards must be even. Use a size divisible by "
                f"{count}, or epl.split(device_count=d) with d dividing {dim}.")
        if even:
            return [dim // count] * count
    total = float(sum(weights))
    bounds, cumulative = [0], 0.0
    for j, weight in enumerate(weights):
        cumulative += weight / total
        bound = dim if j == count - 1 else int(round(dim * cumulative))
        bound = max(bound, bounds[-1] + 1)
        bound = min(bound, dim - (count - 1 - j))
        bounds.append(bound)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _shard_slice(full_shape, axis, offset, size):
    begin = [0] * len(full_shape)
    extent = list(full_shape)
    begin[axis], extent[axis] = offset, size
    return begin, extent


def _set_slice_info(shard, full_name, full_shape, begin, extent) -> None:
    shard._set_save_slice_info(tf.compat.v1.Variable.SaveSliceInfo(
        full_name, list(full_shape), begin, extent))


def _replace_in_collections(graph: tf.Graph, old, new: list) -> None:
    """Put the shards where the full variable was (and nowhere else)."""
    for key in (tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES,):  # a trainable Variable adds itself
        ref = graph.get_collection_ref(key)
        ref[:] = [v for v in ref if not any(v is shard for shard in new)]
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES,
                tf.compat.v1.GraphKeys.LOCAL_VARIABLES, tf.compat.v1.GraphKeys.MODEL_VARIABLES):
        ref = graph.get_collection_ref(key)
        if any(v is old for v in ref):
            index = next(i for i, v in enumerate(ref) if v is old)
            ref[index:index + 1] = new


def shard_existing(variable, axis: int, sizes: list[int], devices: list[str],
                   host_device: str, attrs, offsets: list[int] | None = None) -> ShardedVariable:
    """Replace `variable` (a full tf.Variable) by shards along `axis` on `devices`.

    Shard j's initial value is slice j of the full variable's initial value
    (computed on `host_device`); `attrs(j)` (TaskGraph, slot) are set on the
    ops. offsets: where each shard starts along `axis` (default: one after the
    other from 0; a split group spanning workers holds only its own shards,
    which start further on).
    """
    graph = variable.graph
    full_shape = tuple(variable.shape.as_list())
    full_name = variable.op.name
    if offsets is None:
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    shards = []
    for j, (size, device, offset) in enumerate(zip(sizes, devices, offsets)):
        begin, extent = _shard_slice(full_shape, axis, offset, size)
        with graph._attr_scope(attrs(j)):
            with tf.device(host_device), graph.name_scope(None):
                initial = tf.slice(variable.initial_value, begin, extent,
                                   name=f"{full_name}/EPL_SHARD_{j}_initial")
            with tf.device(device), graph.name_scope(None):
                shard = tf.compat.v1.Variable(
                    initial, name=f"{full_name}/part_{j}", trainable=variable.trainable,
                    dtype=variable.dtype.base_dtype,
                    use_resource=variable.op.type == "VarHandleOp", collections=[])
        _set_slice_info(shard, full_name, full_shape, begin, extent)
        shards.append(shard)
    _replace_in_collections(graph, variable, shards)
    return ShardedVariable(full_name, full_shape, axis, tuple(sizes), shards, tuple(offsets))


def full_values(session, graph: tf.Graph) -> dict:
    """Values of every global variable of `graph` by checkpoint name, shards reassembled.

    A sharded variable's shards are put back into one array of its full shape
    (as a checkpoint holds it); where this worker holds only some shards (a
    split group spanning workers) the other entries are NaN.
    """
    import numpy as np
    out = {}
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    for variable, value in zip(variables, session.run(variables)):
        info = getattr(variable, "_save_slice_info", None)
        if info is None:
            out[variable.op.name] = value
            continue
        full = out.setdefault(info.full_name, np.full(info.full_shape, np.nan, value.dtype))
        full[tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))] = value
    return out
