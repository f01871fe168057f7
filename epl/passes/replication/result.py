"""The values the replicate pass's modules hand each other, and its artifact.

`Setup` (input and variables, built first), `Copies` (what the path with or
without split TaskGraphs built), and the pass's results: `Replication` (what
the passes after it read) and `GradientCheck`.
"""
from __future__ import annotations

import dataclasses

from epl.passes.replication.inputs import UnitInputs


@dataclasses.dataclass
class Replication:
    """What the replicate pass built, for the passes after it.

    gradients: per trainable gradient, (variable op, [gradient per replica], the
      original gradient): what each replica's updates read; with micro-batches,
      micro-batch 0's (the accumulate pass replaces it by the sum over them).
    weights: per replica, its share of the global batch (float or scalar tensor).
    merged: original tensor -> merged tensor (what a fetch of it returns).
    sync_ops: original variable op -> op copying it into its mirrors (the session runs
      it after a run that wrote the original: initialization, restore, assign).
    mirrors: original variable op -> [variable op per replica].
    replica_maps: per replica, template op -> its copy for micro-batch 0 (forward),
      plus the replica's apply copies (replicas > 0).
    num_micro_batches: M.
    forward_copies: (replica, micro-batch) -> {template forward op: its copy}.
    backward_ops: (replica, micro-batch) -> the backward ops regenerated for that copy
      (the accumulate pass's ops are its own result, an Accumulation).
    loss_copies: (replica, micro-batch) -> the copies of the losses.
    presummed: each replica's gradient is already weighted by its batch share
      (split TaskGraphs: one autodiff of the weighted objective), so the
      reduction is a plain sum.
    split_gradients: (variable op, its one gradient) of every split variable
      (not reduced over replicas; summed over workers when there are several).
    feeds: user's placeholder -> inputs.FeedRedirect (the session moves its feed).
    draws: the ops that draw the step's batches from the user's iterators.
    unit_gradients: (replica, micro-batch) -> that unit's gradients, aligned with
      view.gradients (what the accumulate pass adds).
    micro_scales: per replica, per micro-batch, its share of the replica's examples.
    unit_weights: per unit (replica-major), its share of the global batch.
    unit_batches: template batch tensor -> what each unit reads in its place.
    """

    gradients: list
    weights: list
    merged: dict
    sync_ops: dict
    mirrors: dict
    replica_maps: list
    num_micro_batches: int = 1
    forward_copies: dict = dataclasses.field(default_factory=dict)
    backward_ops: dict = dataclasses.field(default_factory=dict)
    loss_copies: dict = dataclasses.field(default_factory=dict)
    presummed: bool = False
    split_gradients: list = dataclasses.field(default_factory=list)
    feeds: dict = dataclasses.field(default_factory=dict)
    draws: list = dataclasses.field(default_factory=list)
    unit_gradients: dict = dataclasses.field(default_factory=dict)
    micro_scales: list = dataclasses.field(default_factory=list)
    unit_weights: list = dataclasses.field(default_factory=list)
    unit_batches: dict = dataclasses.field(default_factory=dict)

    def units(self) -> list:
        """Every (replica, micro-batch) unit, replica-major (global batch order)."""
        return sorted(self.forward_copies)

    def copy_in(self, tensor, unit: tuple):
        """What unit `unit` has in place of the template forward `tensor` (None: no copy)."""
        copy = self.forward_copies.get(unit, {}).get(tensor.op)
        return None if copy is None else copy.outputs[tensor.value_index]

    def replica_op(self, op, replica: int):
        """Replica `replica`'s copy of the update op `op` (replica 0: `op` itself)."""
        return op if replica == 0 else self.replica_maps[replica].get(op)

    def copies_of(self, tensor) -> list:
        """Every copy of the template `tensor` the passes made: each unit's forward copy
        and each replica's copy of an update op (for feeds that must reach them all)."""
        found = [c for c in (self.copy_in(tensor, u) for u in self.units()) if c is not None]
        for op_map in self.replica_maps[1:]:
            copy = op_map.get(tensor.op)
            if copy is not None and all(copy is not c.op for c in found):
                found.append(copy.outputs[tensor.value_index])
        return found


@dataclasses.dataclass
class Setup:
    """What both paths start from (steps 1 and 2): the template's forward and
    apply ops, each op's replica-0 device, the units' inputs and the mirrors."""

    micro: int
    mode: str
    forward: list
    apply_ops: list
    devices: dict
    inputs: UnitInputs
    mirrors: dict
    checkpoints: dict


@dataclasses.dataclass
class Copies:
    """What one path (with or without split TaskGraphs) built for the shared ending.

    forward_copies: unit -> {template op: its copy}; gradients: per replica, its
    gradients aligned with view.gradients (micro-batch 0's); backward_ops: unit -> its
    backward ops; unit_gradients: unit -> its gradients (empty: one per replica).
    """

    forward_copies: dict
    gradients: list
    backward_ops: dict
    notes: list
    presummed: bool = False
    unit_gradients: dict = dataclasses.field(default_factory=dict)
    gradient_check: tuple | None = None   # (plain, checkpointed) gradients of replica 0


@dataclasses.dataclass(frozen=True)
class GradientCheck:
    """gradient_checkpoint.check_gradients: replica 0's gradients without checkpointing
    (never run by the train op) and with it, which the session compares before the
    first training step."""

    reference: list
    checkpointed: list
