"""Apply groups: bound the update's temporary memory (optimizer.num_apply_group).

With `optimizer.num_apply_group: N > 1` the variable updates of each replica
are split into N groups, in variable order (an update that depends on others,
like the optimizer's finish ops, after them), and group g + 1 runs only after
every update of group g: at most one group's temporaries (for Adam: the new
moments and the step) are live at a time. An update op is an apply-phase op
that writes a variable, read from the op's registered definition (its first
input is a resource handle or a reference), never from its name.
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, REPLICA_ATTR, Phase
from epl.ir.graph_view import VARIABLE_OP_TYPES, TrainingView, ancestors
from epl.passes.manager import GraphPass, PassContext, PassResult


def _is_update(op: tf.Operation) -> bool:
    attr = op.node_def.attr.get(PHASE_ATTR)
    if attr is None or attr.s.decode() != Phase.APPLY.value or not op.inputs:
        return False
    first = op.inputs[0]
    writes = first.dtype == tf.resource or first.dtype._is_ref_dtype
    return writes and first.op.type in VARIABLE_OP_TYPES and \
        op.type not in ("ReadVariableOp", "Identity", "VarIsInitializedOp")


def update_groups(graph: tf.Graph, groups: int, train_ops) -> dict[int, list[list[tf.Operation]]]:
    """Per replica, the update ops a step runs, cut into `groups` consecutive groups."""
    step = ancestors(train_ops)
    by_replica: dict[int, list[tf.Operation]] = {}
    for op in graph.get_operations():
        if op in step and _is_update(op):
            replica = op.node_def.attr[REPLICA_ATTR].i if REPLICA_ATTR in op.node_def.attr else 0
            by_replica.setdefault(replica, []).append(op)
    cut = {}
    for replica, ops in by_replica.items():
        ops = _dependency_order(ops)
        size = -(-len(ops) // groups)
        cut[replica] = [ops[i:i + size] for i in range(0, len(ops), size)]
    return cut


def _dependency_order(ops: list[tf.Operation]) -> list[tf.Operation]:
    """`ops` (creation order) reordered so an op comes after every op of the list it
    depends on (the optimizer's finish ops wait for the updates; passes such as ZeRO
    add updates after them), creation order otherwise. Groups are then cut from
    this order, so no group waits for a later one (no cycle)."""
    members = set(ops)
    before = {op: (ancestors([op]) & members) - {op} for op in ops}
    ordered, placed = [], set()
    while len(ordered) < len(ops):
        ready = next(op for op in ops if op not in placed and before[op] <= placed)
        ordered.append(ready)
        placed.add(ready)
    return ordered


class ApplyGroupsPass(GraphPass):
    """Orders the updates in optimizer.num_apply_group groups per replica."""

    name = "apply_groups"
    requires = (TrainingView,)
    after = ("gradient_comm",)   # groups the updates with their reductions in place

    off_note = "optimizer.num_apply_group is 1: nothing to do"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        groups = self.options.groups
        edges = 0
        for replica_groups in update_groups(graph, groups, ctx.get(TrainingView).train_ops).values():
            for earlier, later in zip(replica_groups, replica_groups[1:]):
                for op in later:
                    graph_mutation.add_control_inputs(op, earlier)
                    edges += len(earlier)
        return PassResult(notes=[f"{edges} control edges for {groups} apply groups"],
                          modified=edges > 0)
