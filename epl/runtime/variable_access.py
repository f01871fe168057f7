"""Which variables a run writes: the session runs the replica/worker sync only after a write.

A run outside the training step that writes an original variable
(initialization, a restore, a user's assign) must be followed by the sync
that copies it into the replicas' mirrors and, with several workers,
broadcasts worker 0's value. A run that only reads (a Saver's save, a hook
reading the global step) must not: with several workers the sync is a
collective, and a read that only some workers make (rank 0's
CheckpointSaverHook) would start a sync the others never join.

`writes_variable(op, index)` decides for one op input that carries a variable
(a resource handle or a reference):

- reference inputs: the op's own input type says it (`Assign` takes a
  `float32_ref`; an op that only reads gets the value);
- resource inputs: ops of `READ_ONLY_TYPES` read; functional ops (`If`,
  `While`, `Case`, `PartitionedCall`, ... : every op with function attributes)
  write only if some function body writes the argument the input becomes,
  decided by the same rules inside the body (through `Identity`, nested
  functions included); every other op is taken as a write (an unknown op is
  synced rather than left out of sync).
"""
from __future__ import annotations

import tensorflow as tf

# Op types that read a variable without changing it.
READ_ONLY_TYPES = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized",
                             "Identity", "VariableShape", "ResourceGather", "ResourceGatherNd",
                             "DestroyResourceOp", "SaveV2", "Save", "SaveSlices"})
# Inside a function body: ops that pass a handle on unchanged (their consumers decide).
_FORWARDING_TYPES = frozenset({"Identity", "IdentityN"})


def writes_variable(op: tf.Operation, index: int) -> bool:
    """True if `op` may change the variable its input `index` carries."""
    tensor = op.inputs[index]
    if tensor.dtype._is_ref_dtype:
        return op._input_types[index]._is_ref_dtype
    if tensor.dtype != tf.resource or op.type in READ_ONLY_TYPES:
        return False
    functions = _function_names(op.node_def)
    if not functions:
        return True
    return _functions_write(op.graph, functions, len(op.inputs), index, set())


def _function_names(node_def) -> list[str]:
    """Names of the functions a node calls (its func and list(func) attributes)."""
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(f.name for f in value.list.func)
    return names


def _functions_write(graph: tf.Graph, names: list[str], num_inputs: int, index: int,
                     seen: set) -> bool:
    """Whether any of the functions `names`, called with `num_inputs` inputs, writes
    the argument input `index` becomes. A function's arguments are the op's last
    inputs (`If` and `Case` take a predicate or branch index first)."""
    for name in names:
        definition = _definition(graph, name)
        if definition is None:
            return True  # not in the graph's library: assume the worst
        args = definition.signature.input_arg
        position = index - (num_inputs - len(args))
        if position < 0:
            continue  # the predicate / branch index: not an argument
        if (name, position) in seen:
            continue
        seen.add((name, position))
        if _body_writes(graph, definition, args[position].name, seen):
            return True
    return False


def _definition(graph: tf.Graph, name: str):
    function = graph._get_function(name)
    if function is None:
        return None
    return function.definition


def _body_writes(graph: tf.Graph, definition, arg_name: str, seen: set) -> bool:
    """Whether a FunctionDef body writes the variable its argument `arg_name` carries."""
    nodes = list(definition.node_def)
    carriers = {arg_name}  # body tensor names that hold the handle
    changed = True
    while changed:  # forwarding ops may come in any order in the FunctionDef
        changed = False
        for node in nodes:
            if node.op in _FORWARDING_TYPES and node.name not in carriers and \
                    any(_source(i) in carriers for i in node.input):
                carriers.add(node.name)
                changed = True
    for node in nodes:
        positions = [k for k, name in enumerate(node.input)
                     if not name.startswith("^") and _source(name) in carriers]
        if not positions or node.op in READ_ONLY_TYPES or node.op in _FORWARDING_TYPES:
            continue
        functions = _function_names(node)
        if not functions:
            return True
        data_inputs = [name for name in node.input if not name.startswith("^")]
        if any(_functions_write(graph, functions, len(data_inputs), k, seen) for k in positions):
            return True
    return False


def _source(name: str) -> str:
    """The node (or argument) a FunctionDef input string refers to: "node:out:0" -> "node"."""
    return name.split(":", 1)[0]
