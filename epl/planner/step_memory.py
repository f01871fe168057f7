"""Static memory model of a tf.compat.v1 training graph: what a step holds.

`memory_estimate(...)` estimates per group the bytes of parameters,
gradients, optimizer slots and activations kept for the backward pass
(`MemoryEstimate`); `activation_tensors` finds those activations, and
`amp_low_precision_activations` the ones AMP O1 keeps in low precision
(`AMP_LOW_PRECISION_TYPES`, the op types epl/passes/amp.py casts down).
Like `epl.planner.cost_model`, whose static sizes, variable bytes, phases
and group functions it uses, it reads op types, attributes and static
shapes only -- never op names -- and runs nothing.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import tensorflow as tf

from epl.errors import ConfigError
from epl.planner.cost_model import (APPLY, BACKWARD, VARIABLE_OPS, GroupFn,
                                    Sizer, as_graph, phase_of,
                                    single_group, source_tensor,
                                    variable_bytes)
from epl.planner.roofline import checkpointed_bytes, optimizer_slots


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes one group holds during a training step.

    Attributes:
        parameters: bytes of the trainable variables in the group.
        gradients: bytes of their (dense) gradients.
        optimizer_slots: bytes of the optimizer's slot variables.
        activations: bytes of forward tensors kept for the backward pass.
        exact: False when a shape was unknown.
    """

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_slots: float = 0.0
    activations: float = 0.0
    exact: bool = True

    @property
    def total(self) -> float:
        """Sum of all four parts."""
        return (self.parameters + self.gradients + self.optimizer_slots
                + self.activations)


# AMP O1 (epl/passes/amp.py) runs these op types in low precision; their
# gradients are products of the same kinds (plus the filter/input backprops).
AMP_LOW_PRECISION_TYPES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv3DBackpropInputV2", "Einsum"})
AMP_GRADIENT_TYPES = AMP_LOW_PRECISION_TYPES | frozenset({
    "Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput"})


def amp_low_precision_activations(graph: tf.Graph,
                                  phase_fn: Callable[[tf.Operation], str] = phase_of
                                  ) -> set:
    """Activation tensors AMP O1 keeps in low precision for the backward pass.

    Under O1 a product's inputs are cast down before it runs, and its gradient
    reads the low-precision casts; a forward tensor that only such gradients
    read is kept in low precision, one that any other backward op reads (a
    ReLU output read by ReluGrad) stays float32.
    """
    readers: dict = defaultdict(set)
    for op in graph.get_operations():
        if phase_fn(op) == BACKWARD:
            for tensor in op.inputs:
                readers[source_tensor(tensor)].add(op.type)
    return {t for t, types in readers.items() if types <= AMP_GRADIENT_TYPES}


def _amp_factor(amp_dtype: Any) -> float:
    """Factor applied to float32 activation bytes under AMP."""
    if amp_dtype is None:
        return 1.0
    try:
        dtype = tf.as_dtype(amp_dtype)
    except TypeError as err:
        raise ConfigError(f"amp_dtype must be float16 or bfloat16, got "
                          f"{amp_dtype!r}") from err
    if dtype == tf.float32:
        return 1.0
    if dtype not in (tf.float16, tf.bfloat16):
        raise ConfigError(f"amp_dtype must be float16 or bfloat16, got "
                          f"{amp_dtype!r}")
    return 0.5


def activation_tensors(graph: tf.Graph,
                       phase_fn: Callable[[tf.Operation], str] = phase_of
                       ) -> list[tf.Tensor]:
    """Forward tensors the backward pass reads, in graph order.

    A tensor counts when a backward-phase op consumes it (directly or through
    alias ops such as Identity/Reshape) and it is produced by an op outside
    the backward and apply phases ("forward", or untagged such as the
    input pipeline) that is not a variable or a constant.  Each buffer is
    counted once: aliases resolve to the tensor they view.
    """
    order = {op: i for i, op in enumerate(graph.get_operations())}
    found: dict[tuple[int, int], tf.Tensor] = {}
    for op in graph.get_operations():
        if phase_fn(op) != BACKWARD:
            continue
        for tensor in op.inputs:
            source = source_tensor(tensor)
            if _is_activation(source, phase_fn):
                found[order[source.op], source.value_index] = source
    return [found[key] for key in sorted(found)]


def _is_activation(tensor: tf.Tensor,
                   phase_fn: Callable[[tf.Operation], str]) -> bool:
    """Whether `tensor` is a forward buffer (not a parameter or constant)."""
    op = tensor.op
    return (phase_fn(op) not in (BACKWARD, APPLY)
            and op.type not in VARIABLE_OPS
            and op.type not in ("Const", "HostConst")
            and tensor.dtype.base_dtype != tf.resource)


def _activation_bytes(tensors: list[tf.Tensor], s: Sizer,
                      amp: float, checkpointing: bool, low: set = frozenset()) -> float:
    """Bytes of one group's activation tensors (`low`: those AMP keeps in low precision)."""
    sizes = [s.nbytes(t) * (amp if t.dtype.base_dtype == tf.float32 and t in low else 1)
             for t in tensors]
    return checkpointed_bytes(sizes) if checkpointing else float(sum(sizes))


def _variable_ops(graph: tf.Graph, trainable_vars: Iterable[Any] | None
                  ) -> list[tf.Operation]:
    """The variable ops of `trainable_vars` (default: graph's trainables)."""
    if trainable_vars is None:
        trainable_vars = graph.get_collection(
            tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    ops = []
    for var in trainable_vars:
        op = var if isinstance(var, tf.Operation) else var.op
        if op.graph is not graph:  # a GraphDef import of the same graph
            op = graph.get_operation_by_name(op.name)
        ops.append(op)
    return ops


def memory_estimate(graph: tf.Graph | tf.compat.v1.GraphDef,
                    trainable_vars: Iterable[Any] | None,
                    optimizer: str,
                    group_fn: GroupFn | None = None,
                    checkpointing: bool = False,
                    zero_shards: int = 1,
                    amp_dtype: Any = None,
                    phase_fn: Callable[[tf.Operation], str] = phase_of,
                    unknown_dim: int | None = None,
                    ) -> dict[Hashable, MemoryEstimate]:
    """Estimate per group the memory a training step holds.

    Args:
        graph: the training graph (Graph or GraphDef), with backward ops.
        trainable_vars: the trained variables (tf.Variable or their ops);
            None means the graph's TRAINABLE_VARIABLES collection.
        optimizer: "sgd", "momentum", "adam", "adagrad", "rmsprop", ... (or
            the class name, e.g. "AdamOptimizer"); sets slots per parameter.
        group_fn: op -> group key; default one group `ALL`.  Parameters,
            gradients and slots belong to the group of the variable's op;
            activations to the group of the op producing them.
        checkpointing: keep only ~sqrt(n) activations plus one recomputed
            segment (see `checkpointed_bytes`), per group.
        zero_shards: ZeRO: optimizer slots are divided by this many shards.
        amp_dtype: float16/bfloat16 halves the bytes of the float32
            activations that only gradients of products read (AMP O1 keeps
            their low-precision casts, `amp_low_precision_activations`);
            parameters, gradients and slots stay float32.
        phase_fn: op -> phase; default reads the `_epl_phase` attribute.
            With no backward-phase ops, activations are zero.
        unknown_dim: size assumed for unknown dimensions (e.g. batch size).

    Returns:
        group key -> MemoryEstimate.  Assumptions: gradients are dense and
        as large as their variables; activations are the forward tensors
        that backward ops read (see `activation_tensors`), all alive at the
        start of the backward pass; temporary buffers inside ops, the
        optimizer's scalar accumulators and framework overhead are ignored.
    """
    if not isinstance(zero_shards, int) or zero_shards < 1:
        raise ConfigError(f"zero_shards must be a positive int, got "
                          f"{zero_shards!r}")
    graph = as_graph(graph)
    group_fn = group_fn or single_group
    slots, amp = optimizer_slots(optimizer), _amp_factor(amp_dtype)
    parts: dict[Hashable, dict[str, Any]] = defaultdict(
        lambda: {"params": 0.0, "acts": [], "exact": True})
    for var_op in _variable_ops(graph, trainable_vars):
        size, exact = variable_bytes(var_op, unknown_dim)
        part = parts[group_fn(var_op)]
        part["params"] += size
        part["exact"] &= exact
    for tensor in activation_tensors(graph, phase_fn):
        parts[group_fn(tensor.op)]["acts"].append(tensor)
    low = amp_low_precision_activations(graph, phase_fn) if amp != 1.0 else set()
    return {key: _group_memory(part, slots, zero_shards, amp, checkpointing,
                               unknown_dim, low)
            for key, part in parts.items()}


def _group_memory(part: dict[str, Any], slots: int, zero_shards: int,
                  amp: float, checkpointing: bool,
                  unknown_dim: int | None, low: set = frozenset()) -> MemoryEstimate:
    """The MemoryEstimate of one group's collected parts."""
    s = Sizer(unknown_dim)
    activations = _activation_bytes(part["acts"], s, amp, checkpointing, low)
    params = part["params"]
    return MemoryEstimate(
        parameters=params, gradients=params,
        optimizer_slots=params * slots / zero_shards,
        activations=activations, exact=part["exact"] and s.exact)
