"""Small immutable values that describe how a part of the model is parallelized.

A `StrategySpec` is what a scope (`epl.replicate`, `epl.split`) says about the
ops created inside it. The node attributes below carry that information on the
graph itself: EPL never reads meaning from op names.
"""
from __future__ import annotations

import dataclasses
import enum

# Node attributes EPL sets on ops. Attribute names that start with "_" are
# allowed on any op and are ignored by TensorFlow's kernels.
TASKGRAPH_ATTR = "_epl_taskgraph"   # string: the TaskGraph the op belongs to
PHASE_ATTR = "_epl_phase"           # string: a Phase value
REPLICA_ATTR = "_epl_replica"       # int: replica index (absent = replica 0)
MICRO_BATCH_ATTR = "_epl_micro_batch"  # int: micro-batch index (absent = 0)
# Every other node attribute EPL sets, declared here so that one module lists them
# all; the modules that write them import their names from here.
SHARD_ATTR = "_epl_shard"           # int: the slot (shard index) of an op the split pass built
SPLIT_REPLACED_ATTR = "_epl_split_replaced"  # bool: an op the split pass replaced (never runs)
COLLECTIVE_ATTR = "_epl_collective"  # string on Horovod ops: what they carry, in words
# bool on the AddN that sums a local all-reduce on one device (LocalCommunicator on
# CPU devices, epl.runtime.communicators): its output is the same on every replica
REDUCED_ATTR = "_epl_reduced"
RECOMPUTE_ATTR = "_epl_recompute"    # bool: a recomputed (gradient checkpointing) forward copy
RECOMPUTE_SHAPE_ATTR = "_epl_recompute_shape"  # bool: Shape op recompute added on a forward tensor
SCHEDULE_EDGE_ATTR = "_epl_schedule_edge"  # string on pipeline barrier NoOps: "F1->B0"
DUMP_ELIDED_ATTR = "_epl_dump_elided"  # int, in dumps only: bytes of a constant left out
# The tags that say where an op belongs (what a unit function's call carries for its ops)
UNIT_TAGS = (TASKGRAPH_ATTR, PHASE_ATTR, REPLICA_ATTR, MICRO_BATCH_ATTR)
EPL_ATTRS = frozenset((TASKGRAPH_ATTR, PHASE_ATTR, REPLICA_ATTR, MICRO_BATCH_ATTR, SHARD_ATTR,
                       SPLIT_REPLACED_ATTR, COLLECTIVE_ATTR, REDUCED_ATTR, RECOMPUTE_ATTR,
                       RECOMPUTE_SHAPE_ATTR, SCHEDULE_EDGE_ATTR, DUMP_ELIDED_ATTR))


def taskgraph_tag(op) -> str | None:
    """The TaskGraph a `tf.Operation` is tagged with (`TASKGRAPH_ATTR`), None when
    untagged. Code that reads the op's NodeDef anyway (the analysis,
    epl/ir/graph_view.py) takes the tag from there.

    Speed (TensorFlow 2.21, per op): `op.node_def` serializes the NodeDef, about
    1.5 us for most ops but 21 us for a 256 x 256 constant, whose value it holds;
    `op.get_attr` reads the one attribute in 3.4 us, 8 us when it is missing (the
    error it raises). So a constant's tag is read alone, every other op's from its
    NodeDef."""
    if op.type == "Const":
        try:
            return op.get_attr(TASKGRAPH_ATTR).decode()
        except ValueError:
            return None
    attr = op.node_def.attr.get(TASKGRAPH_ATTR)
    return attr.s.decode() if attr is not None else None


class Phase(str, enum.Enum):
    """Which part of a training step an op belongs to."""

    FORWARD = "forward"     # computes the loss from inputs and variables
    BACKWARD = "backward"   # created by the optimizer's compute_gradients
    APPLY = "apply"         # updates variables (apply_gradients) or processes gradients
    OTHER = "other"         # input pipelines, initializers, savers, summaries


class StrategyKind(str, enum.Enum):
    """The two Whale annotations."""

    REPLICATE = "replicate"
    SPLIT = "split"


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """What a strategy scope asks for.

    kind: replicate or split.
    device_count: devices one replica of this part spans.
    name: the TaskGraph name (unique per graph).
    """

    kind: StrategyKind
    device_count: int
    name: str

    def describe(self) -> str:
        """Return the scope as a user would write it, for error messages."""
        return f"epl.{self.kind.value}(device_count={self.device_count}, name={self.name!r})"
