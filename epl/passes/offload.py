"""Weight offload, level v0 (`offload.level: "v0"`): variables live in host memory.

Every variable a training step uses (the weights of every replica, the
optimizer state, ZeRO's shards, the global step) is placed on the host device
(`Cluster.host_device`, the worker's CPU:0), together with every op that takes
its handle (reads, the optimizer's update ops, initializers, the conds of the
skip_on_overflow pass) and every op colocated with it. The forward and backward ops
stay on the compute devices: a weight is read on the host and TensorFlow copies
the value to the device that computes with it (and the gradient back to the
host for the update). Between steps the device holds no weights and no
optimizer state; as in the planner's model of offload (epl/planner/planner.py),
the optimizer update runs on the host. Within a step TensorFlow sends a weight
as soon as its read has run, and the forward and backward both use it, so the
device may hold copies of all of a replica's weights during the step: v0 does
not order the copies to keep only a layer or two on the device, which the
planner's model assumes (a double-buffered largest layer).

Variables that share an op with these (the full-size slot mirrors ZeRO no longer
runs, which are never initialized and hold no memory) move with them: TensorFlow
places the whole graph, and an op's handles must all be on one device.

Runs after every pass that creates variables or ops that take their handles
(replicate, zero, skip_on_overflow).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.ir import graph_mutation
from epl.ir.graph_view import VARIABLE_OP_TYPES, TrainingView, ancestors
from epl.passes.manager import GraphPass, PassContext, PassResult


def offloaded_ops(graph: tf.Graph, variables: set) -> list[tf.Operation]:
    """Ops that must live where `variables` live: consumers of their handles and ops
    colocated with them (read from inputs and colocation groups, not names)."""
    names = {f"loc:@{var.name}".encode() for var in variables}
    handles = {var.outputs[0] for var in variables}
    return [op for op in graph.get_operations()
            if op not in variables and (any(t in handles for t in op.inputs)
                                        or names & set(op.colocation_groups()))]


@dataclasses.dataclass(frozen=True)
class Offloaded:
    """What the offload pass placed on the host: `variables`, the variable ops (their
    reads stay host ops: the unit_functions pass leaves them out of the calls)."""

    host: str
    variables: frozenset


class OffloadPass(GraphPass):
    """Places the step's variables and the ops on their handles on the host device."""

    name = "offload"
    requires = (TrainingView,)
    provides = (Offloaded,)
    after = ("replicate", "zero", "skip_on_overflow")  # moves what those built

    off_note = "offload.level is off"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        host = ctx.cluster.host_device
        variables = {op for op in ancestors(ctx.get(TrainingView).train_ops)
                     if op.type in VARIABLE_OP_TYPES}
        while True:  # an op taking two handles needs both on one device (even if never run)
            following = offloaded_ops(graph, variables)
            more = {t.op for op in following for t in op.inputs
                    if t.op.type in VARIABLE_OP_TYPES} - variables
            if not more:
                break
            variables |= more
        moved = [op for op in sorted(variables, key=lambda op: op._id) if op.device != host]
        modified = bool(moved) or any(op.device != host for op in following)
        for op in variables:
            graph_mutation.set_device(op, host)
        for op in following:
            graph_mutation.set_device(op, host)
        ctx.provide(Offloaded(host, frozenset(variables)))
        return PassResult(notes=[f"{len(variables)} variables on {host} ({len(moved)} moved), "
                                 f"{len(following)} ops on their handles follow them"],
                          modified=modified)
