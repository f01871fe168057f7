"""The split pass's regions: which ops and variables each split TaskGraph rewrites
(epl/passes/split/split.py describes the pass).

`follow_inputs` (the untagged ops on the
path to the loss that follow a TaskGraph, and so belong to its region) and
`owned_variables` (the variables each split TaskGraph shards).
"""
from __future__ import annotations

import tensorflow as tf

from epl.ir.annotations import taskgraph_tag
from epl.ir.graph_view import VARIABLE_OP_TYPES


def follow_inputs(path: set, taskgraphs: list) -> dict:
    """Untagged ops on the path to the loss -> the TaskGraph they will follow.

    An op built outside every scope takes the latest TaskGraph among its inputs
    (epl/ir/graph_view.py); one that follows a split TaskGraph (a loss or weight
    decay added outside the split scope to what the split part computed) is part
    of that TaskGraph's region: rewritten and placed with it.
    """
    index = {tg.name: tg.index for tg in taskgraphs}
    resolved: dict = {}      # op on the path -> its TaskGraph name (tagged or followed)
    followers: dict = {}
    for op in sorted(path, key=lambda o: o._id):   # creation order: inputs first
        name = taskgraph_tag(op)
        if name is None and op.type not in VARIABLE_OP_TYPES:
            names = [resolved[t.op] for t in op.inputs if t.op in resolved]
            if names:
                name = followers[op] = max(names, key=lambda n: index.get(n, -1))
        if name is not None:
            resolved[op] = name
    return followers


def owned_variables(graph: tf.Graph, tagged_of: dict, plans: dict) -> dict:
    """TaskGraph name -> {variable op: tf.Variable} of the variables each split
    TaskGraph shards: those created in it, except a variable whose every use is in
    one other split TaskGraph on the same devices, which that one shards (weights
    created under one epl.split scope, e.g. in a layer's build(), and used under
    another, in its call(), as FastNN's MoE layer does)."""
    owned = {name: _region_variables(graph, tagged) for name, tagged in tagged_of.items()}
    for name, variables in owned.items():
        for variable_op in list(variables):
            users = _user_taskgraphs(variable_op)
            if len(users) != 1:
                continue
            (user,) = users
            if user != name and user in owned and plans.get(user) == plans.get(name):
                owned[user][variable_op] = variables.pop(variable_op)
    return owned


def owned_captured_variables(captured: dict, tagged_of: dict) -> dict:
    """owned_variables for a traced tf.function step, whose variables are captured eager
    variables (`captured`: {capture placeholder op: CapturedSplitVariable}) created
    outside the graph: a split TaskGraph owns each variable whose every use in the
    step is in it."""
    owned: dict = {name: {} for name in tagged_of}
    for op, variable in captured.items():
        users = _user_taskgraphs(op)
        if len(users) == 1:
            (user,) = users
            if user in owned:
                owned[user][op] = variable
    return owned


def _user_taskgraphs(variable_op: tf.Operation) -> set:
    """TaskGraph names (None: untagged) of the ops that use the values of a variable."""
    users = set()
    for consumer in variable_op.outputs[0].consumers():
        if consumer.type in ("ReadVariableOp", "Identity", "ResourceGather"):
            users.update(taskgraph_tag(op) for out in consumer.outputs for op in out.consumers())
            if consumer.type == "ResourceGather":
                users.add(taskgraph_tag(consumer))
    return users


def _region_variables(graph: tf.Graph, tagged: list) -> dict:
    """Variable op -> tf.Variable for the variables created inside the TaskGraph."""
    ops = {op for op in tagged if op.type in VARIABLE_OP_TYPES}
    found = {}
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
        for variable in graph.get_collection(key):
            if getattr(variable, "op", None) in ops:
                found[variable.op] = variable
    return found
