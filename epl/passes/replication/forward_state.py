"""State the forward pass writes (moving averages, random-seed state), micro-batch by micro-batch.

Some forward ops write variables: BatchNormalization's moving mean and variance,
Keras 3's random-seed state (each dropout draws its seed from a variable and
advances it), a counter read back later. Each replica holds its own copy of such
a variable (its mirror; replica 0 the user's), but the micro-batches of one
replica share it, and their copies of the forward would read and write it in
whatever order the executor picks: moving averages and dropout masks would
depend on the timing.

`order_forward_state` makes them run as single-device training on the replica's
micro-batches in order would: every op of micro-batch m + 1 that reads or writes
such a variable waits for every op of micro-batch m that does. Each micro-batch
then sees the state its predecessor left (its own dropout masks, the moving
averages updated once per micro-batch), and after the step the replica's copy
holds the state after its last micro-batch. The forward's other ops are not
ordered, and neither are variables the forward only adds to (the order does not
change a sum).
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import Phase

# Ops that add to (or subtract from) the resource variable whose handle is their first input.
INCREMENT_TYPES = frozenset({"AssignAddVariableOp", "AssignSubVariableOp"})


def forward_written(view) -> list[tf.Operation]:
    """The mirrored variables the template's forward ops write (other than by adding)."""
    mirrored = set(view.variables)
    written = []
    for op in view.replica_ops:
        if view.phase_of.get(op) != Phase.FORWARD or not op.inputs:
            continue
        handle = op.inputs[0]
        if handle.dtype == tf.resource and handle.op in mirrored and op.type.startswith(
                ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                 "ResourceScatter")) and handle.op not in written:
            if op.type in INCREMENT_TYPES and all(
                    c.type in INCREMENT_TYPES for c in handle.consumers()
                    if c in view.replica_ops):
                continue   # adds only: the order does not change the sum
            written.append(handle.op)
    return written


def order_forward_state(view, forward_copies: dict, micro: int) -> int:
    """Add the control edges of the module docstring; returns how many ops wait."""
    if micro <= 1:
        return 0
    replicas = 1 + max(k for k, _ in forward_copies)
    ordered = 0
    for variable in forward_written(view):
        touching = [op for op in view.replica_ops if any(t.op is variable for t in op.inputs)
                    and view.phase_of.get(op) == Phase.FORWARD]
        for k in range(replicas):
            previous = [forward_copies[(k, 0)][op] for op in touching]
            for m in range(1, micro):
                current = [forward_copies[(k, m)][op] for op in touching]
                for op in current:
                    graph_mutation.add_control_inputs(op, previous)
                ordered += len(current)
                previous = current
    return ordered
