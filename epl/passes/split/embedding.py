"""Split rule for embedding lookups (epl/passes/split/split.py describes the pass).

GatherV2 / ResourceGather with a vocabulary-split table: each id is looked up
on the shard that owns it (dynamic partition and stitch, so sparse gradients
touch only real rows).

In a traced tf.function step (slice mode) the lookup is left unsplit: the table is
the user's whole eager variable there, and cutting its value onto the devices would
turn its IndexedSlices gradient into a dense one (the cut's gradient is a Concat);
the table is reported kept whole (SplitUnshardedVariableWarning), with why.
"""
from __future__ import annotations

import tensorflow as tf

from epl.passes.split.layouts import Full, Pending, Sharded, is_full
from epl.passes.split.rewriter import Rewriter, as_sharded, handle_input
from epl.passes.split.rules import rule


@rule("GatherV2", "ResourceGather")
def _embedding(rw: Rewriter, op, layouts):
    """Vocabulary-split table: each id is looked up on the shard that owns it."""
    if op.type == "ResourceGather":
        variable = handle_input(op, rw.variables)
        if variable is None or op.get_attr("batch_dims") != 0:
            return None
        table = Pending(variable, _read_of(rw, variable))
        ids = op.inputs[1]
        ids_layout = layouts[1]
    else:
        params, ids, axis = op.inputs
        if not isinstance(layouts[0], (Pending, Sharded)) or op.get_attr("batch_dims") != 0:
            return None
        axis_value = tf.get_static_value(axis)
        if axis_value is None or int(axis_value) != 0:
            return None
        table = layouts[0]
        ids_layout = layouts[1]
    if not is_full(ids_layout):
        return None
    if isinstance(table, Pending) and rw.slice_reads:
        rw.keep_whole(table.variable.op, (
            f"in a tf.function training step EPL runs its lookup {op.name} unsplit: the "
            "table stays the user's whole eager variable, so a vocabulary split would save "
            "no memory, and the table's gradient stays the IndexedSlices single-device "
            "training gives it (the layers after the lookup are split as usual)"))
        return None
    rw.refuse_across_workers(f"the embedding lookup {op.name} would need every worker's ids")
    if isinstance(table, Pending):
        what = (f"vocabulary ({table.variable.shape[0]} rows) of embedding table "
                f"{table.variable.op.name}")
        sharded = as_sharded(rw, table, None, 0, None, what)
    else:
        sharded = table
    if sharded is None:
        return None
    shards = rw.sharded[table.variable.op].shards if isinstance(table, Pending) else None
    ids_value = rw.value(ids_layout, ids)
    offsets = [sum(sharded.sizes[:j]) for j in range(rw.k)]
    with rw.gathering(op.name):
        flat = tf.reshape(ids_value, [-1])
        owner = tf.add_n([tf.cast(flat >= offset, tf.int32) for offset in offsets[1:]]) \
            if rw.k > 1 else tf.zeros_like(flat, tf.int32)
        positions = tf.range(tf.size(flat))
        ids_of = tf.dynamic_partition(flat, owner, rw.k)
        positions_of = tf.dynamic_partition(positions, owner, rw.k)
    rows = []
    for j in range(rw.k):
        with rw.on(j):
            local = ids_of[j] - tf.cast(offsets[j], ids_of[j].dtype)
            source = shards[j] if shards else sharded.parts[j]
            rows.append(tf.gather(source, local))
    with rw.gathering(op.name):
        stitched = tf.dynamic_stitch(positions_of, rows)
        out_shape = tf.concat([tf.shape(ids_value), tf.shape(stitched)[1:]], axis=0)
        result = tf.reshape(stitched, out_shape)
        result.set_shape(op.outputs[0].shape)
    return [Full(result)]


def _read_of(rw: Rewriter, variable):
    """A value read of `variable` the walk has seen (so sharding the table also
    gives that read's other consumers the shards), else its handle."""
    for consumer in variable.op.outputs[0].consumers():
        if consumer.outputs and consumer.outputs[0] in rw.layouts:
            return consumer.outputs[0]
    return variable.op.outputs[0]
