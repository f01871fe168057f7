"""A traced tf.function's graph (a FuncGraph) as a plain tf.Graph for the passes, and back.

Why a copy instead of rewriting the FuncGraph in place: the passes were built
and are tested on graph-mode training graphs, whose variables are `VarHandleOp`s
(mirrored, sharded, placed, read by op type). In a FuncGraph the variables are
captured resource handles (placeholders fed with the eager variable's handle at
call time), the outputs are Identity ops with control edges on every stateful op
(automatic control dependencies), and new per-device state cannot be created in
the graph at all. `lower` makes the graph the passes expect: each captured
variable becomes a `VarHandleOp` of the variable's dtype, shape and device under
the placeholder's name, the output Identities and their control NoOps are left
out (what the function returns is recorded as tensors of the copy instead), and
everything else (automatic control edges between stateful ops, the function
library, colocation) is kept as it is. After the passes, `raise_into` imports
what the new outputs and control outputs need back into the FuncGraph, each
placeholder and variable of the copy mapped onto a tensor of the FuncGraph (the
function's own placeholders, or captures of eager variables the caller made for
the passes' new variables). The FuncGraph's original ops stay, unused: a
function runs only what its outputs and control outputs need (TensorFlow prunes
the rest of a function's body, stateful ops included).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tensorflow.python.ops import handle_data_util

from epl.ir.graph_view import ancestors

# op types that write the resource (variable) whose handle is their first input
WRITE_TYPES_PREFIXES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                        "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                        "ResourceStridedSliceAssign")
IMPORT_SCOPE = "epl"


# op types that take a variable's handle (what tells a captured variable from another
# captured resource, such as an iterator)
_VARIABLE_CONSUMERS = ("ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                       "AssignSubVariableOp", "ResourceGather", "ResourceGatherNd",
                       "VariableShape", "VarIsInitializedOp", "ResourceApply",
                       "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign")


@dataclasses.dataclass(frozen=True)
class CapturedVariable:
    """A variable a FuncGraph captures: its eager handle (the tensor the function is fed
    at call time), dtype, shape and device."""

    handle: object
    dtype: tf.DType
    shape: tf.TensorShape
    device: str


def captured_variables(func_graph) -> dict:
    """{name of a placeholder that captures a variable's handle: CapturedVariable}.

    A captured resource handle is a variable's when an op of the graph uses it as one
    (a read, an assign, an optimizer's apply); its dtype and shape are those of the
    handle's data (what the variable recorded on it)."""
    found = {}
    for external, internal in func_graph.captures:
        if internal.dtype != tf.resource or not any(
                c.type.startswith(_VARIABLE_CONSUMERS) for c in internal.consumers()):
            continue
        data = handle_data_util.get_resource_handle_data(internal)
        if not data.is_set or len(data.shape_and_type) != 1:
            continue
        entry = data.shape_and_type[0]
        found[internal.op.name] = CapturedVariable(
            external, tf.as_dtype(entry.dtype), tf.TensorShape(entry.shape), external.device)
    return found


def writes_captured_variable(op: tf.Operation, captured: set) -> bool:
    """True if `op` writes one of the captured variables (`captured`: placeholder names),
    or passes one's handle to a stateful op that may (a function call, control flow)."""
    handles = [t for t in op.inputs if t.dtype == tf.resource and t.op.name in captured]
    if not handles:
        return False
    if op.type.startswith(WRITE_TYPES_PREFIXES):
        return True
    return op.type not in ("ReadVariableOp", "ResourceGather", "VariableShape",
                           "VarIsInitializedOp") and op.op_def.is_stateful


@dataclasses.dataclass
class Lowered:
    """A FuncGraph lowered for the passes.

    graph: the plain tf.Graph copy.
    variables: {name of a VarHandleOp of the copy: the CapturedVariable it stands for}.
    outputs: per output of the FuncGraph, the tensor of the copy it returns.
    control_outputs: names of the FuncGraph's control outputs (ops of the copy).
    """

    graph: tf.Graph
    variables: dict
    outputs: list
    control_outputs: list

    def tensor(self, tensor: tf.Tensor) -> tf.Tensor:
        """The copy's tensor for a tensor of the FuncGraph."""
        return self.graph.get_tensor_by_name(tensor.name)

    def op(self, op: tf.Operation) -> tf.Operation:
        """The copy's op for an op of the FuncGraph."""
        return self.graph.get_operation_by_name(op.name)


def lower(func_graph) -> Lowered:
    """Copy `func_graph` into a plain tf.Graph the passes can rewrite (module docstring)."""
    variables = captured_variables(func_graph)
    graph_def = func_graph.as_graph_def()
    output_ops = {t.op.name for t in func_graph.outputs}
    nodes = {node.name: node for node in graph_def.node}
    dropped = set(output_ops)
    for name in output_ops:   # the NoOps automatic control dependencies hang outputs on
        for inp in nodes[name].input:
            source = inp[1:] if inp.startswith("^") else None
            if source and nodes[source].op == "NoOp" and _only_feeds(source, output_ops, graph_def):
                dropped.add(source)
    kept = []
    for node in graph_def.node:
        if node.name in dropped:
            continue
        if node.name in variables:
            _as_var_handle(node, variables[node.name])
        kept.append(node)
    del graph_def.node[:]
    graph_def.node.extend(kept)
    canonical_increments(graph_def)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    outputs = [graph.get_tensor_by_name(t.op.inputs[0].name) if t.op.name in dropped
               and t.op.inputs else graph.get_tensor_by_name(t.name) for t in func_graph.outputs]
    control = [op.name for op in func_graph.control_outputs if op.name not in dropped]
    return Lowered(graph, variables, outputs, control)


_INCREMENTS = {"AddV2": "AssignAddVariableOp", "Add": "AssignAddVariableOp",
               "Sub": "AssignSubVariableOp"}


def canonical_increments(graph_def) -> int:
    """Rewrite each `AssignVariableOp(v, Add(ReadVariableOp(v), x))` (how Keras 3 writes
    `variable.assign_add(x)`: a read, an add, an assign) into `AssignAddVariableOp(v, x)`
    in place (same name, so every reference to the op holds), and likewise for Sub
    (the read first). The same update, since nothing writes v between its read and its
    assign (automatic control dependencies order them); as an increment, every replica
    can add into one variable (a metric's total and count: a shared accumulator of the
    consistency analysis, epl/ir/consistency.py). Returns how
    many were rewritten."""
    nodes = {node.name: node for node in graph_def.node}

    def source(name: str):
        base = name.split(":")[0]
        return nodes.get(base), name

    changed = 0
    for node in graph_def.node:
        if node.op != "AssignVariableOp" or len(node.input) < 2:
            continue
        value, _ = source(node.input[1])
        if value is None or value.op not in _INCREMENTS:
            continue
        operands = [source(i) for i in value.input[:2]]
        for position, (operand, name) in enumerate(operands):
            if position == 1 and value.op == "Sub":
                break   # x - v is no decrement of v
            if operand is not None and operand.op == "ReadVariableOp" \
                    and operand.input and operand.input[0] == node.input[0]:
                node.op = _INCREMENTS[value.op]
                node.input[1] = operands[1 - position][1]
                for attr in list(node.attr):
                    if attr not in ("dtype",) and not attr.startswith("_"):
                        del node.attr[attr]
                changed += 1
                break
    return changed


def _only_feeds(name: str, consumers: set, graph_def) -> bool:
    """True if node `name` is an input (data or control) of `consumers` only."""
    for node in graph_def.node:
        if node.name in consumers:
            continue
        if any(inp.lstrip("^").split(":")[0] == name for inp in node.input):
            return False
    return True


def _as_var_handle(node, variable: CapturedVariable) -> None:
    """Turn a capture placeholder's NodeDef into a VarHandleOp standing for `variable`."""
    colocation = node.attr["_class"] if "_class" in node.attr else None
    node.op = "VarHandleOp"
    node.attr.clear()
    node.attr["dtype"].type = variable.dtype.base_dtype.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(variable.shape.as_proto())
    node.attr["shared_name"].s = f"epl_lowered/{node.name}".encode()
    node.attr["container"].s = b""
    if colocation is not None:
        node.attr["_class"].CopyFrom(colocation)
    node.device = variable.device
    del node.input[:]


def _drop_colocation_outside(node, names: set, inputs: dict) -> None:
    """Drop the colocation entries (`_class`: loc:@op) of `node` that name an op the
    import leaves out (the passes placed every op they need on a device already)."""
    if "_class" not in node.attr:
        return
    kept = [g for g in node.attr["_class"].list.s if not g.startswith(b"loc:@")
            or (g[5:].decode() in names and g[5:].decode() not in inputs)]
    if not kept:
        del node.attr["_class"]
    elif len(kept) != len(node.attr["_class"].list.s):
        del node.attr["_class"].list.s[:]
        node.attr["_class"].list.s.extend(kept)


def raise_into(func_graph, graph: tf.Graph, tensors: list, ops: list, inputs: dict
               ) -> tuple[list, list]:
    """Import into `func_graph` the ops of `graph` that `tensors` and `ops` need.

    inputs: {op name of `graph`: tensor of `func_graph`} for the sources the import
    reads instead of copying (placeholders, variable handles); they are not copied.
    Returns the imported counterparts of `tensors` and `ops`. The caller keeps `graph`
    alive as long as the function: the library functions the passes built in it (the
    cond of a run-time assertion, each unit's copies of control flow) are registered
    in the eager context for as long as `graph` holds them.
    """
    needed = ancestors([t.op for t in tensors] + list(ops))
    names = {op.name for op in needed}
    source = graph.as_graph_def()
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(source.versions)
    input_map = {}
    for node in source.node:
        if node.name not in names:
            continue
        if node.name in inputs:
            input_map[f"{node.name}:0"] = inputs[node.name]
            continue
        copy = graph_def.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(i for i in node.input
                          if not (i.startswith("^") and i[1:] in inputs))
        _drop_colocation_outside(copy, names, inputs)
    _copy_called_functions(graph_def, source.library)
    unmapped = [op.name for op in needed if op.type in ("Placeholder", "VarHandleOp")
                 and op.name not in inputs]
    if unmapped:
        raise ValueError(f"raise_into: sources of the rewritten graph with no tensor of the "
                         f"function to read: {unmapped[:5]}")
    wanted = [t.name for t in tensors] + [op.name for op in ops]
    with func_graph.as_default():
        imported = tf.graph_util.import_graph_def(
            graph_def, input_map=input_map, return_elements=wanted, name=IMPORT_SCOPE)
    return imported[:len(tensors)], imported[len(tensors):]


def _called(attrs) -> set:
    """The function names a NodeDef's attributes (func, list(func)) name."""
    found = set()
    for value in attrs.values():
        if value.HasField("func"):
            found.add(value.func.name)
        found.update(f.name for f in value.list.func)
    return found


def _copy_called_functions(graph_def, library) -> None:
    """Put into `graph_def`'s library the functions of `library` its nodes call, and the
    functions those call: only those, so that each traced function owns only what it
    runs (TensorFlow removes a function's library from the eager context with it)."""
    functions = {f.signature.name: f for f in library.function}
    wanted, stack = set(), []
    for node in graph_def.node:
        stack.extend(_called(node.attr) | ({node.op} & set(functions)))
    while stack:
        name = stack.pop()
        if name in wanted or name not in functions:
            continue
        wanted.add(name)
        for node in functions[name].node_def:
            stack.extend(_called(node.attr) | ({node.op} & set(functions)))
    graph_def.library.function.extend(functions[n] for n in sorted(wanted))
    graph_def.library.gradient.extend(g for g in library.gradient if g.function_name in wanted)
