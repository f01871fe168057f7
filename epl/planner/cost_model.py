"""Static cost model of a tf.compat.v1 graph: FLOPs and bytes.

Everything here reads op types, attributes and static shapes only -- never
op names -- and runs nothing.

- `op_cost(op)` counts one op's floating-point operations and the bytes it
  reads and writes.
- `graph_cost(graph, group_fn)` sums op costs per group (for example per
  TaskGraph, or per TaskGraph and phase) and adds the bytes of the variables
  each group's ops read.
- `memory_estimate(...)`, the bytes a training step holds per group
  (parameters, gradients, optimizer slots, activations), is in
  `epl.planner.step_memory`, which uses this module's static sizes
  (`Sizer`), variable bytes, phases and group functions.
- `predict_time`, `op_overhead_time` and `comm_time` turn costs into
  seconds on a `epl.planner.profiles.DeviceProfile` (roofline, per-op executor
  overhead and ring all-reduce models);
  they, `GroupCost`, `optimizer_slots` and `checkpointed_bytes` live in
  the TensorFlow-free `epl.planner.roofline` and are re-exported here.

Counting conventions
--------------------
- A multiply-add is two FLOPs: MatMul is 2*M*N*K, Conv2D is
  2*N*Ho*Wo*Cout*Kh*Kw*Cin; their gradient ops (Conv2DBackpropInput/Filter;
  backward MatMuls are plain MatMuls) cost the same as the forward op.
- Elementwise ops cost one FLOP per output element (AddN: n-1); composite
  activations such as GELU are the sum of the ops they are built from.
- Reductions cost one FLOP per input element; Softmax/LogSoftmax five per
  element (max, subtract, exp, sum, divide); SoftmaxCrossEntropyWithLogits
  eight per logit (softmax, log, the backprop subtraction, the weighted sum),
  the sparse variant six.  Pooling costs one FLOP per window element and
  output; FusedBatchNorm seven per element forward and nine backward.
- Gathers (embedding lookups) do no FLOPs; they read the gathered rows and
  the indices and write the rows.
- Optimizer apply ops cost a per-parameter constant (GradientDescent 2,
  Momentum 4, Adam 12, Adagrad 5, RMSProp 10, ...) over the gradient's
  elements and read and write the variable and its slots.
- Ops that only alias or describe tensors (Const, Identity, Reshape, NoOp,
  Placeholder, variable ops, Shape, control flow plumbing) cost nothing.
  Data movement (Transpose, Concat, Slice, Cast, collectives, ...) costs
  bytes but no FLOPs, and so does the tf.data input pipeline (`is_input_op`:
  reading a batch is the device profile's input terms).  Any other op type
  counts its bytes only and is marked not modelled (`OpCost.exact` False;
  `GroupCost.unmodelled_op_types`).
- Bytes read are the sizes of the op's data inputs (resource handles are
  zero bytes); bytes written the sizes of its outputs; dtype sizes from
  tf.DType.size.
- An unknown dimension counts as `unknown_dim` when given (for example the
  batch size) and as 1 otherwise, so that what is known is still counted;
  either way the cost is marked `exact=False`.  An unknown rank counts as
  zero elements.

Phases and groups
-----------------
EPL tags ops with the node attributes `_epl_taskgraph` (the TaskGraph) and
`_epl_phase` ("forward", "backward", "apply"; untagged ops are "other").
`by_taskgraph` and `by_taskgraph_and_phase` are ready-made group functions.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import tensorflow as tf

from epl.ir.annotations import PHASE_ATTR, taskgraph_tag
# The TF-free half (costs as numbers, roofline time, ring all-reduce,
# optimizer slots), re-exported: `epl.planner.roofline`.
from epl.planner.roofline import (APPLY_OPS, DEFAULT_EFFICIENCY,  # noqa: F401
                                  OPTIMIZER_SLOTS, GroupCost,
                                  checkpointed_bytes, comm_time,
                                  op_overhead_time, optimizer_slots,
                                  predict_time)

FORWARD, BACKWARD, APPLY, OTHER = "forward", "backward", "apply", "other"
#: The group key when no group function is given.
ALL = "all"

GroupFn = Callable[[tf.Operation], Hashable]


# --------------------------------------------------------------------------
# Result values.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OpCost:
    """The static cost of one op.

    Attributes:
        flops: floating-point operations.
        bytes_read: bytes of the data inputs the op reads.
        bytes_written: bytes the op writes (0 for ops that only alias).
        output_bytes: static size of the op's outputs, aliases included.
        exact: False when a shape was unknown or the op type is not modelled.
    """

    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    output_bytes: float = 0.0
    exact: bool = True

    @property
    def bytes(self) -> float:
        """Memory traffic: bytes read plus bytes written."""
        return self.bytes_read + self.bytes_written


# --------------------------------------------------------------------------
# Attributes and group functions.
# --------------------------------------------------------------------------

def op_attr(op: tf.Operation, name: str, default: Any = None) -> Any:
    """Value of attribute `name` of `op` (bytes decoded), or `default`."""
    try:
        value = op.get_attr(name)
    except (ValueError, KeyError):
        return default
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return tuple(v.decode() if isinstance(v, bytes) else v for v in value)
    return value


def taskgraph_of(op: tf.Operation) -> Any:
    """The op's `_epl_taskgraph` attribute, or None when untagged."""
    return taskgraph_tag(op)


def phase_of(op: tf.Operation) -> str:
    """The op's `_epl_phase` attribute; "other" when untagged."""
    return op_attr(op, PHASE_ATTR, OTHER)


def by_taskgraph(op: tf.Operation) -> Any:
    """Group function: the op's TaskGraph."""
    return taskgraph_of(op)


def by_taskgraph_and_phase(op: tf.Operation) -> tuple[Any, str]:
    """Group function: (TaskGraph, phase)."""
    return taskgraph_of(op), phase_of(op)


def single_group(op: tf.Operation) -> str:
    """Group function putting every op in the group `ALL`."""
    return ALL


def as_graph(graph: tf.Graph | tf.compat.v1.GraphDef) -> tf.Graph:
    """`graph` itself, or a new Graph imported from a GraphDef."""
    if isinstance(graph, tf.Graph):
        return graph
    if isinstance(graph, tf.compat.v1.GraphDef):
        imported = tf.Graph()
        with imported.as_default():
            tf.graph_util.import_graph_def(graph, name="")
        return imported
    raise TypeError(f"expected a tf.Graph or GraphDef, got {type(graph)}")


# --------------------------------------------------------------------------
# Static sizes.
# --------------------------------------------------------------------------

class Sizer:
    """Reads static shapes, remembering whether anything was unknown."""

    def __init__(self, unknown_dim: int | None = None) -> None:
        self.unknown_dim = unknown_dim
        self.exact = True

    def dims(self, tensor: tf.Tensor) -> list[int] | None:
        """Static dims of `tensor`; unknown dims substituted, or None."""
        shape = tensor.shape
        if shape.rank is None:
            self.exact = False
            return None
        dims = shape.as_list()
        if any(d is None for d in dims):
            self.exact = False
        fill = self.unknown_dim or 1
        return [fill if d is None else d for d in dims]

    def shape_dims(self, shape: tf.TensorShape) -> list[int] | None:
        """Like `dims` for a TensorShape."""
        return self.dims(_ShapeOnly(tf.TensorShape(shape)))

    def elements(self, tensor: tf.Tensor) -> float:
        """Number of elements of `tensor` (0 for an unknown rank)."""
        dims = self.dims(tensor)
        return 0.0 if dims is None else float(math.prod(dims))

    def nbytes(self, tensor: tf.Tensor) -> float:
        """Bytes of `tensor` (0 for resource, variant and string dtypes)."""
        size = tensor.dtype.base_dtype.size
        return self.elements(tensor) * size if size else 0.0


@dataclasses.dataclass
class _ShapeOnly:
    """A stand-in tensor with only a shape (for variable attr shapes)."""

    shape: tf.TensorShape


def _prod(values: Iterable[int] | None) -> float:
    """Product of `values`; 0 when they are unknown (None)."""
    return 0.0 if values is None else float(math.prod(values))


# --------------------------------------------------------------------------
# Op families.
# --------------------------------------------------------------------------

NO_COST_OPS = frozenset({
    "Const", "HostConst", "Identity", "IdentityN", "NoOp", "Placeholder",
    "PlaceholderWithDefault", "VarHandleOp", "_VarHandlesOp", "VariableV2",
    "Variable", "TemporaryVariable", "VarIsInitializedOp",
    "IsVariableInitialized", "ReadVariableOp", "_ReadVariablesOp",
    "DestroyResourceOp", "Reshape", "Squeeze", "ExpandDims", "Shape",
    "ShapeN", "Size", "Rank", "StopGradient", "PreventGradient", "Snapshot",
    "EnsureShape", "CheckNumerics", "Enter", "Exit", "Merge", "Switch",
    "NextIteration", "LoopCond", "ControlTrigger", "BroadcastGradientArgs",
    "Assert", "Print", "PrintV2", "StringFormat", "_Arg", "_Retval",
    "SaveV2", "RestoreV2", "MergeV2Checkpoints", "ShardedFilename",
    "StringJoin", "TensorSummaryV2", "ScalarSummary", "HistogramSummary",
    "MergeSummary",
})

VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable",
                          "TemporaryVariable"})

#: The input pipeline: tf.data's datasets and iterators (TensorSliceDataset,
#: BatchDatasetV2, OneShotIterator, IteratorGetNext, ...; by op type). They
#: count no FLOPs: what reading a batch costs is the device profile's
#: `input_read_s` and `input_example_s`.
_INPUT_OP_RE = re.compile(r"^(?:\w*Dataset\w*|\w*Iterator\w*|"
                          r"Optional(?:GetValue|HasValue|FromValue|None))$")


def is_input_op(op_type: str) -> bool:
    """Whether `op_type` belongs to the tf.data input pipeline."""
    return bool(_INPUT_OP_RE.match(op_type))

#: Ops whose output is (a view of) their first input: same buffer.
ALIAS_OPS = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze",
                       "ExpandDims", "StopGradient", "PreventGradient",
                       "Snapshot", "EnsureShape", "CheckNumerics", "Enter",
                       "Exit", "Switch", "ReadVariableOp"})

DATA_MOVEMENT_OPS = frozenset({
    "Transpose", "ConjugateTranspose", "ConcatV2", "Concat", "Slice",
    "StridedSlice", "StridedSliceGrad", "ResourceStridedSliceAssign", "Pad",
    "PadV2", "MirrorPad", "Tile", "Pack", "Unpack", "Split", "SplitV",
    "Cast", "Bitcast", "OneHot", "Fill", "ZerosLike", "OnesLike", "Range",
    "ReverseV2", "BroadcastTo", "InvertPermutation", "Where", "DynamicStitch",
    "ParallelDynamicStitch", "TensorScatterUpdate", "Assign",
    "AssignVariableOp", "Unique", "SpaceToDepth", "DepthToSpace",
    "SpaceToBatchND", "BatchToSpaceND", "_Send", "_Recv", "_HostSend",
    "_HostRecv", "CollectiveReduce", "CollectiveReduceV2",
    "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastSend",
    "CollectiveBcastRecv", "CollectiveBcastSendV2", "CollectiveBcastRecvV2",
    "CollectiveAllToAllV2", "CollectiveAllToAllV3", "NcclAllReduce",
    "HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
    "HorovodAlltoall", "RandomShuffle",
})

#: FLOPs per output element.
ELEMENTWISE_OPS = {op: 1 for op in (
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan",
    "FloorDiv", "FloorMod", "TruncateDiv", "Maximum", "Minimum", "Neg",
    "Abs", "Sign", "Square", "Sqrt", "Rsqrt", "Reciprocal", "Inv", "Exp",
    "Expm1", "Log", "Log1p", "Pow", "Tanh", "Sigmoid", "Relu", "Relu6",
    "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign", "Erf", "Erfc",
    "Sin", "Cos", "Floor", "Ceil", "Round", "Rint", "ClipByValue", "BiasAdd",
    "BiasAddV1", "Select", "SelectV2", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr",
    "LogicalNot", "IsFinite", "IsNan", "ReluGrad", "Relu6Grad", "EluGrad",
    "SeluGrad", "LeakyReluGrad", "SoftplusGrad", "SoftsignGrad", "TanhGrad",
    "SigmoidGrad", "SqrtGrad", "RsqrtGrad", "ReciprocalGrad", "Cumsum",
    "Cumprod", "RandomUniform", "RandomStandardNormal", "TruncatedNormal",
    "StatelessRandomUniformV2", "StatelessRandomNormalV2",
    "StatelessTruncatedNormalV2", "AssignAddVariableOp",
    "AssignSubVariableOp", "AssignAdd", "AssignSub",
)}
ELEMENTWISE_OPS.update({"SquaredDifference": 2, "FusedBatchNorm": 7,
                        "FusedBatchNormV2": 7, "FusedBatchNormV3": 7,
                        "FusedBatchNormGrad": 9, "FusedBatchNormGradV2": 9,
                        "FusedBatchNormGradV3": 9})

#: FLOPs per element of the first input.
REDUCTION_OPS = {op: 1 for op in (
    "Sum", "Mean", "Max", "Min", "Prod", "ArgMax", "ArgMin", "All", "Any",
    "EuclideanNorm", "BiasAddGrad", "UnsortedSegmentSum",
    "UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd",
    "SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin")}
REDUCTION_OPS.update({"L2Loss": 2, "Softmax": 5, "LogSoftmax": 5,
                      "SoftmaxCrossEntropyWithLogits": 8,
                      "SparseSoftmaxCrossEntropyWithLogits": 6})

GATHER_OPS = frozenset({"Gather", "GatherV2", "ResourceGather", "GatherNd",
                        "ResourceGatherNd"})

#: One FLOP per element of the updates (last input).
SCATTER_OPS = frozenset({
    "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterMax",
    "ScatterMin", "ScatterUpdate", "ResourceScatterAdd",
    "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMax", "ResourceScatterMin", "ResourceScatterUpdate",
    "TensorScatterAdd", "TensorScatterSub", "ScatterNdAdd",
    "ResourceScatterNdAdd", "ResourceScatterNdUpdate"})

#: Apply-op optimizer name -> (FLOPs per updated element, slot variables).
_APPLY_RE = re.compile(r"^(?:Resource)?(?:Sparse)?Apply(\w+)$")

_CONV_FULL = frozenset({"Conv2D", "Conv3D", "_FusedConv2D"})
_CONV_BACKPROP_INPUT = frozenset({"Conv2DBackpropInput",
                                  "Conv3DBackpropInputV2"})
_CONV_BACKPROP_FILTER = frozenset({"Conv2DBackpropFilter",
                                   "Conv3DBackpropFilterV2"})
_DEPTHWISE = {"DepthwiseConv2dNative": "forward",
              "DepthwiseConv2dNativeBackpropInput": "input",
              "DepthwiseConv2dNativeBackpropFilter": "filter"}
_POOL_OPS = {"MaxPool": 0, "AvgPool": 0, "MaxPool3D": 0, "AvgPool3D": 0,
             "MaxPoolGrad": 2, "AvgPoolGrad": 1, "MaxPool3DGrad": 2,
             "AvgPool3DGrad": 1}  # op -> input whose elements set the work


# --------------------------------------------------------------------------
# FLOP formulas.
# --------------------------------------------------------------------------

def _matmul_flops(op: tf.Operation, s: Sizer) -> float:
    """2*M*N*K for MatMul (transpose_a/b honoured)."""
    a_dims = s.dims(op.inputs[0])
    if a_dims is None:
        return 0.0
    k = a_dims[0] if op_attr(op, "transpose_a", False) else a_dims[1]
    return 2.0 * s.elements(op.outputs[0]) * k


def _batch_matmul_flops(op: tf.Operation, s: Sizer) -> float:
    """2*batch*M*N*K for BatchMatMul/V2/V3 (adj_x/adj_y honoured)."""
    a_dims = s.dims(op.inputs[0])
    if a_dims is None:
        return 0.0
    k = a_dims[-2] if op_attr(op, "adj_x", False) else a_dims[-1]
    return 2.0 * s.elements(op.outputs[0]) * k


def _conv_flops(op: tf.Operation, s: Sizer) -> float:
    """2 * output positions * Cout * (Kh*Kw*Cin) for convs and their grads."""
    kind = op.type
    if kind in _CONV_FULL:
        filter_dims = s.dims(op.inputs[1])
        return 2.0 * s.elements(op.outputs[0]) * _prod_head(filter_dims)
    if kind in _CONV_BACKPROP_INPUT:
        filter_dims = s.dims(op.inputs[1])
        return 2.0 * s.elements(op.inputs[2]) * _prod_head(filter_dims)
    filter_dims = s.dims(op.outputs[0])  # the filter gradient
    return 2.0 * s.elements(op.inputs[2]) * _prod_head(filter_dims)


def _prod_head(filter_dims: list[int] | None) -> float:
    """Product of all filter dims but the last (Kh*Kw*Cin)."""
    return 0.0 if filter_dims is None else _prod(filter_dims[:-1])


def _depthwise_flops(op: tf.Operation, s: Sizer) -> float:
    """2 * output elements * Kh * Kw for depthwise convs and their grads."""
    kind = _DEPTHWISE[op.type]
    if kind == "forward":
        filter_dims, work = s.dims(op.inputs[1]), s.elements(op.outputs[0])
    elif kind == "input":
        filter_dims, work = s.dims(op.inputs[1]), s.elements(op.inputs[2])
    else:
        filter_dims, work = s.dims(op.outputs[0]), s.elements(op.inputs[2])
    spatial = None if filter_dims is None else filter_dims[:-2]
    return 2.0 * work * _prod(spatial)


def _pool_flops(op: tf.Operation, s: Sizer) -> float:
    """One FLOP per window element per output (inputs for the grads)."""
    work = s.elements(op.inputs[_POOL_OPS[op.type]]) \
        if _POOL_OPS[op.type] else s.elements(op.outputs[0])
    return work * _prod(op_attr(op, "ksize", (1,)))


def _einsum_flops(op: tf.Operation, s: Sizer) -> float:
    """2 * product of every label's size (one FLOP per element for 1 input)."""
    equation = op_attr(op, "equation", "").replace(" ", "")
    operands = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for labels, tensor in zip(operands, op.inputs):
        dims = s.dims(tensor)
        if dims is None:
            return 0.0
        for label, size in _einsum_labels(labels, dims).items():
            sizes[label] = max(size, sizes.get(label, 1))  # broadcasting
    factor = 2.0 if len(operands) > 1 else 1.0
    return factor * _prod(sizes.values())


def _einsum_labels(labels: str, dims: list[int]) -> dict[str, int]:
    """label -> size for one einsum operand.

    The dims an ellipsis stands for get positional labels counted from the
    right, so that broadcast batch dims of different operands line up.
    """
    if "..." not in labels:
        return dict(zip(labels, dims))
    head, tail = labels.split("...")
    count = len(dims) - len(head) - len(tail)
    names = list(head) + [f"...{count - 1 - i}" for i in range(count)] + \
        list(tail)
    return dict(zip(names, dims))


def _elementwise_flops(op: tf.Operation, s: Sizer) -> float:
    """Per-output-element FLOPs (AddN: n-1 per element)."""
    if op.type == "AddN":
        return (len(op.inputs) - 1) * s.elements(op.outputs[0])
    return ELEMENTWISE_OPS[op.type] * s.elements(op.outputs[0])


def _reduction_flops(op: tf.Operation, s: Sizer) -> float:
    """Per-input-element FLOPs."""
    return REDUCTION_OPS[op.type] * s.elements(op.inputs[0])


def _scatter_flops(op: tf.Operation, s: Sizer) -> float:
    """One FLOP per update element."""
    return s.elements(op.inputs[-1])


_FLOPS: dict[str, Callable[[tf.Operation, Sizer], float]] = {
    "MatMul": _matmul_flops, "_FusedMatMul": _matmul_flops,
    "BatchMatMul": _batch_matmul_flops, "BatchMatMulV2": _batch_matmul_flops,
    "BatchMatMulV3": _batch_matmul_flops, "Einsum": _einsum_flops,
    "AddN": _elementwise_flops,
}
_FLOPS.update({t: _conv_flops for t in
               _CONV_FULL | _CONV_BACKPROP_INPUT | _CONV_BACKPROP_FILTER})
_FLOPS.update({t: _depthwise_flops for t in _DEPTHWISE})
_FLOPS.update({t: _pool_flops for t in _POOL_OPS})
_FLOPS.update({t: _elementwise_flops for t in ELEMENTWISE_OPS})
_FLOPS.update({t: _reduction_flops for t in REDUCTION_OPS})
_FLOPS.update({t: _scatter_flops for t in SCATTER_OPS})
_FLOPS.update({t: lambda op, s: 0.0 for t in DATA_MOVEMENT_OPS})


# --------------------------------------------------------------------------
# op_cost.
# --------------------------------------------------------------------------

def _output_bytes(op: tf.Operation, s: Sizer) -> float:
    """Static bytes of all of the op's outputs."""
    return sum(s.nbytes(t) for t in op.outputs)


def _input_bytes(op: tf.Operation, s: Sizer) -> float:
    """Static bytes of all of the op's data inputs."""
    return sum(s.nbytes(t) for t in op.inputs)


def _gather_cost(op: tf.Operation, s: Sizer, out: float) -> OpCost:
    """Gathered rows plus indices read, rows written, no FLOPs."""
    indices = s.nbytes(op.inputs[1])
    return OpCost(0.0, out + indices, out, out, s.exact)


def _apply_cost(op: tf.Operation, s: Sizer, out: float) -> OpCost:
    """An optimizer apply op: per-element FLOPs; variable and slots r/w."""
    name = _APPLY_RE.match(op.type).group(1)
    flops_per, slots = APPLY_OPS.get(name, (4, 1))
    grad = _apply_grad_input(op)
    elements = s.elements(grad)
    state = elements * grad.dtype.base_dtype.size * (1 + slots)
    return OpCost(flops_per * elements, state + s.nbytes(grad), state, out,
                  s.exact and name in APPLY_OPS)


def _apply_grad_input(op: tf.Operation) -> tf.Tensor:
    """The gradient input of an apply op (named "grad" or "delta")."""
    names = [arg.name for arg in op.op_def.input_arg]
    for wanted in ("grad", "delta"):
        if wanted in names:
            return op.inputs[names.index(wanted)]
    return max(op.inputs, key=lambda t: t.shape.num_elements() or 0)


def op_cost(op: tf.Operation, unknown_dim: int | None = None) -> OpCost:
    """The static cost of `op` from its type, attributes and static shapes.

    Args:
        op: an operation of a tf.compat.v1 graph.
        unknown_dim: size to assume for unknown dimensions (e.g. the batch
            size); unknown dimensions count as 1 when it is None.

    Returns:
        OpCost with FLOPs, bytes read/written and output bytes; `exact` is
        False when a shape was unknown or the op type is not modelled.
    """
    s = Sizer(unknown_dim)
    if op.type in NO_COST_OPS:
        return OpCost(output_bytes=_output_bytes(op, s), exact=s.exact)
    out = _output_bytes(op, s)
    if op.type in GATHER_OPS:
        return _gather_cost(op, s, out)
    if _APPLY_RE.match(op.type):
        return _apply_cost(op, s, out)
    formula = _FLOPS.get(op.type)
    # Ops with no outputs (resource updates such as AssignAddVariableOp) write in place.
    flops = formula(op, s) if formula and op.outputs else 0.0
    return OpCost(flops, _input_bytes(op, s), out, out,
                  s.exact and (formula is not None or is_input_op(op.type)))


def is_modelled(op_type: str) -> bool:
    """Whether the cost model has a formula for ops of type `op_type`."""
    return (op_type in NO_COST_OPS or op_type in GATHER_OPS
            or op_type in _FLOPS or is_input_op(op_type)
            or bool(_APPLY_RE.match(op_type)
                    and _APPLY_RE.match(op_type).group(1) in APPLY_OPS))


# --------------------------------------------------------------------------
# Variables.
# --------------------------------------------------------------------------

def source_tensor(tensor: tf.Tensor) -> tf.Tensor:
    """Follow alias ops (Identity, Reshape, ReadVariableOp, ...) upstream."""
    seen = set()
    while tensor.op.type in ALIAS_OPS and tensor.op.inputs and \
            id(tensor) not in seen:
        seen.add(id(tensor))
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
    return tensor


def variable_op(tensor: tf.Tensor) -> tf.Operation | None:
    """The variable op (VarHandleOp, VariableV2, ...) behind `tensor`.

    Follows alias ops such as ReadVariableOp and Identity; None when the
    tensor does not come from a variable.
    """
    source = source_tensor(tensor).op
    return source if source.type in VARIABLE_OPS else None


def variable_bytes(var_op: tf.Operation, unknown_dim: int | None = None
                   ) -> tuple[float, bool]:
    """(bytes, exact) of the variable created by `var_op` (shape x dtype)."""
    s = Sizer(unknown_dim)
    dims = s.shape_dims(var_op.get_attr("shape"))
    dtype = tf.as_dtype(var_op.get_attr("dtype")).base_dtype
    return _prod(dims) * dtype.size, s.exact


# --------------------------------------------------------------------------
# graph_cost.
# --------------------------------------------------------------------------

@dataclasses.dataclass
class _Accumulator:
    """Mutable running totals for one group."""

    flops: float = 0.0
    bytes: float = 0.0
    exact: bool = True
    types: Counter = dataclasses.field(default_factory=Counter)
    variables: dict = dataclasses.field(default_factory=dict)

    def add(self, op: tf.Operation, cost: OpCost) -> None:
        """Add one op and its cost."""
        self.flops += cost.flops
        self.bytes += cost.bytes
        self.exact = self.exact and cost.exact
        self.types[op.type] += 1

    def freeze(self, unknown_dim: int | None) -> GroupCost:
        """The GroupCost of everything added so far."""
        sizes = [variable_bytes(v, unknown_dim)
                 for v in self.variables.values()]
        unmodelled = sorted(t for t in self.types if not is_modelled(t))
        return GroupCost(
            flops=self.flops, bytes=self.bytes,
            parameter_bytes=sum(size for size, _ in sizes),
            num_ops=sum(self.types.values()), op_types=dict(self.types),
            exact=self.exact and all(exact for _, exact in sizes),
            unmodelled_op_types=tuple(unmodelled))


def graph_cost(graph: tf.Graph | tf.compat.v1.GraphDef,
               group_fn: GroupFn | None = None,
               unknown_dim: int | None = None) -> dict[Hashable, GroupCost]:
    """Sum op costs per group.

    Args:
        graph: a tf.compat.v1 Graph or a GraphDef (imported first).
        group_fn: op -> group key (e.g. `by_taskgraph`,
            `by_taskgraph_and_phase`); default: every op in group `ALL`.
        unknown_dim: size assumed for unknown dimensions (see `op_cost`).

    Returns:
        group key -> GroupCost, in order of first appearance.  A group's
        parameter_bytes are the bytes of the distinct variables its ops read
        or write (through ReadVariableOp/Identity and similar aliases).
    """
    graph = as_graph(graph)
    group_fn = group_fn or single_group
    groups: dict[Hashable, _Accumulator] = defaultdict(_Accumulator)
    for op in graph.get_operations():
        acc = groups[group_fn(op)]
        acc.add(op, op_cost(op, unknown_dim))
        for tensor in op.inputs:
            var = variable_op(tensor)
            if var is not None:
                acc.variables[var.name] = var
    return {key: acc.freeze(unknown_dim) for key, acc in groups.items()}
