"""Names and tags of the replicate pass's copies.

A unit's copies are named `EPL_REPLICA_<k>/<template name>` (plus
`EPL_MICRO_BATCH_<m>/` when there are several micro-batches) and tagged with
`_epl_replica` = k and `_epl_micro_batch` = m.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir.annotations import MICRO_BATCH_ATTR, REPLICA_ATTR

REPLICA_PREFIX = "EPL_REPLICA_{}"
MICRO_BATCH_PREFIX = "EPL_MICRO_BATCH_{}"


def replica_attr(k: int, micro_batch: int | None = None) -> dict:
    """The tags of replica k's copies (and of micro-batch `micro_batch`'s)."""
    attrs = {REPLICA_ATTR: tf.compat.v1.AttrValue(i=k)}
    if micro_batch is not None:
        attrs[MICRO_BATCH_ATTR] = tf.compat.v1.AttrValue(i=micro_batch)
    return attrs


def unit_attr(k: int, m: int, micro: int) -> dict:
    """The tags of unit (k, m) when there are `micro` micro-batches."""
    return replica_attr(k, m if micro > 1 else None)


def unit_prefix(replica: int, micro_batch: int, micro: int) -> str:
    """Name prefix of a unit's copies."""
    prefix = REPLICA_PREFIX.format(replica)
    return prefix if micro == 1 else f"{prefix}/{MICRO_BATCH_PREFIX.format(micro_batch)}"
