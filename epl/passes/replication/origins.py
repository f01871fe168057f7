"""Which of the user's ops each of the replicate pass's copies stands for.

An error TensorFlow raises at run time names the op it failed in, and under
EPL that is often a copy (`EPL_REPLICA_1/out/MatMul/ReadVariableOp`, a
variable's mirror `EPL_REPLICA_1/out/kernel`, a unit's draw
`EPL_FEED/IteratorGetNext`). `copy_origins(replication)` lists, from the
pass's own artifact (not from the names), every copy with the user's op it
was made from and the unit it belongs to, so that the session can say the
error in the user's terms (epl.runtime.run_errors).
"""
from __future__ import annotations

from epl.passes.replication.result import Replication


def _unit_words(replica: int, micro_batch: int | None) -> str:
    if micro_batch is None:
        return "replica %d" % replica
    return "replica %d, micro-batch %d" % (replica, micro_batch)


def copy_origins(replication: Replication) -> dict[str, tuple[str, str]]:
    """{copy op name (and a mirror's resource name): (the user's op or resource name,
    "replica k" or "replica k, micro-batch m")}."""
    micro = replication.num_micro_batches
    origins: dict[str, tuple[str, str]] = {}
    for k, op_map in enumerate(replication.replica_maps):
        for template, copy in op_map.items():
            if copy is not template:
                origins[copy.name] = (template.name, _unit_words(k, None))
    for (k, m), op_map in replication.forward_copies.items():
        for template, copy in op_map.items():
            if copy is not template:
                origins[copy.name] = (template.name, _unit_words(k, m if micro > 1 else None))
    for var, mirrors in replication.mirrors.items():
        for k, mirror in enumerate(mirrors):
            if mirror is var:
                continue
            origins[mirror.name] = (var.name, _unit_words(k, None))
            try:
                shared = mirror.get_attr("shared_name").decode()
                original = var.get_attr("shared_name").decode() or var.name
            except ValueError:
                continue
            if shared:
                origins[shared] = (original, _unit_words(k, None))
    _draw_origins(replication, origins)
    return origins


def _draw_origins(replication: Replication, origins: dict) -> None:
    """Each unit's draw (GetNext) from a user's iterator: the first draw on an
    iterator is the user's own op (the pass lists them unit by unit)."""
    first: dict = {}
    units: dict = {}
    for draw in replication.draws:
        # a further unit's draw reads the iterator through an optional
        source = draw.inputs[0].op if draw.type == "OptionalGetValue" else draw
        iterator = tuple(source.inputs)
        if iterator not in first:
            first[iterator] = draw
            units[iterator] = 0
            continue
        units[iterator] += 1
        unit = units[iterator]
        micro = max(replication.num_micro_batches, 1)
        words = _unit_words(unit // micro, unit % micro if micro > 1 else None)
        origins[draw.name] = (first[iterator].name, words)
