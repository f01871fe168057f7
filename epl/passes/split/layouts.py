"""The split pass's layouts and its record (epl/passes/split/split.py describes the pass).

A layout says how the split TaskGraph's devices ("slots") hold one tensor of
the region: `Sharded` (slot j holds slice j along an axis), `Partial` (slot j
holds a partial sum), `Full` (the value, recomputed by the pass) or `Pending`
(the read of a region variable no rule has sharded yet); None, or `is_full`,
means whole. `SplitRecord` is what the pass built for one split TaskGraph,
with its dispatch slices (`Slicer`).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.planner.plan import SplitPlan


@dataclasses.dataclass
class Sharded:
    """Slot j holds slice j of the value along `axis` (extents `sizes`)."""

    parts: list
    axis: int
    sizes: tuple


@dataclasses.dataclass
class Partial:
    """Slot j holds a partial sum; the value is the sum over slots."""

    parts: list


@dataclasses.dataclass
class Full:
    """The value, recomputed by the pass (replaces the original tensor)."""

    tensor: tf.Tensor


@dataclasses.dataclass
class Pending:
    """The read of a region variable that no rule has sharded yet."""

    variable: object
    read: tf.Tensor


@dataclasses.dataclass
class Slicer:
    """A dispatch slice: a slot reads `source`[offset:offset+size] along `axis`
    (and, for one chunk of a chunked dispatch, `chunk` = (axis, offset, size):
    the chunk's tokens along their capacity axis, `split.moe_chunks`)."""

    source: tf.Tensor
    axis: int
    offset: int
    size: int
    chunk: tuple | None = None


@dataclasses.dataclass
class SplitRecord:
    """What the split pass built for one split TaskGraph (kept on the GraphState).

    variables: full variable name -> ShardedVariable.
    slicers: slot tensor -> Slicer (dispatch: the replicate pass may feed the
      slot from every replica's rows directly, an all-to-all).
    gathers: full tensor -> (parts, axis) (combine: concat of the shards).
    replaced: ops the pass replaced (never run).
    ops: the ops the region runs (per-slot ops and ops left unsplit).
    fallbacks: "op (type)" of ops with a sharded input that ran unsplit.
    unsharded: "variable: why" for variables created in the TaskGraph that stay whole.
    sliced: slice mode (a traced tf.function step): the names of the variable ops the
      TaskGraph owns (its ops alone read them), each read whole, and cut onto the
      slots where a rule splits it (never replaced by shards): split variables,
      updated once, not mirrored.
    """

    taskgraph: str
    plan: SplitPlan
    variables: dict = dataclasses.field(default_factory=dict)
    slicers: dict = dataclasses.field(default_factory=dict)
    gathers: dict = dataclasses.field(default_factory=dict)
    replaced: set = dataclasses.field(default_factory=set)
    ops: list = dataclasses.field(default_factory=list)
    fallbacks: list = dataclasses.field(default_factory=list)
    unsharded: list = dataclasses.field(default_factory=list)
    sliced: list = dataclasses.field(default_factory=list)

    @property
    def spans_workers(self) -> bool:
        """The split group spans several workers (each holds some shards)."""
        return self.plan.spans_workers


def is_full(layout) -> bool:
    """The layout reads as whole: full (None, Full) or a variable read not yet sharded."""
    return layout is None or isinstance(layout, Full) or (isinstance(layout, Pending))
