"""Copying ops inside one graph (for replicas and micro-batches).

`clone_ops` copies a list of ops (in creation order, so inputs come first)
under a name prefix, onto the devices `device_fn` gives, with inputs remapped:
a tensor in `input_map` is replaced by its value there, a tensor produced by an
op being copied by that op's copy, any other tensor is shared. Colocation
attributes are dropped (the copy gets an explicit device instead); `extra_attrs`
are set on every copy. Returns old op -> new op.

How the copies are made (the GraphDef-level trick). Creating ops one by one
through the Python API (`Graph._create_op_internal`) costs 80-300 us per op,
most of it Python bookkeeping around a single C call. A rewrite that copies
the model several times creates tens of thousands of ops, so instead
`NodeBatch` writes the new ops as NodeDefs into one GraphDef and adds them all
with one call of TensorFlow's graph importer (the C function behind
`tf.graph_util.import_graph_def`), then creates the Python `Operation` objects
for them in one sweep (about 35 us per op in all). The result is the same
graph as op-by-op creation:

- each new op gets the name `Graph.unique_name` gives it (as op-by-op creation
  does), reserved before the import. The importer renames (appends "_1") only
  a name that is also the name scope of an existing op (the Python API
  allows an op named like an existing scope, the importer does not);
- an input read from an op of the same batch is written as that NodeDef's
  name; an input read from an op already in the graph is written as a
  placeholder name `_epl_input_<i>` that the importer maps onto the existing
  tensor (`TF_ImportGraphDefOptionsAddInputMapping`), and a control input on
  an existing op likewise (`...RemapControlDependency`). Placeholder names
  start with "_", which no op created through the Python API can have, so
  they never clash with a real op;
- the device is written into the NodeDef (no device functions run), and the
  importer runs the same shape inference as op creation does;
- Python-side state (the op's control-dependency and control-flow context) is
  applied as `Graph._add_new_tf_operations` applies it to any imported op
  (`_post_process`).

Constants are not copied per unit where one op serves them all: copiers given
the same `ConstantPool` write one copy of a template `Const` that has no
control inputs per (template, device, replica attribute), and every later copy
of it reads that op (a constant reads nothing, holds no memory that grows and
needs no ordering). Before the pool, a 12-layer encoder with 16 micro-batches
had 19,464 constants, about 17k of them duplicates that TensorFlow's first
step then found and removed again (Grappler's common-subgraph elimination).
"""
from __future__ import annotations

import zlib
from typing import Callable

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util, function_def_to_graph
from tensorflow.python.ops import control_flow_util_v2

from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR

COLOCATION_ATTR = "_class"
_INPUT_PLACEHOLDER = "_epl_input_{}"
# Set on the Python Operation of every op a NodeBatch created with a TaskGraph, a
# phase and a device (tags and devices are never removed): the pass manager's
# adoption of new ops and the verifier skip reading such an op's NodeDef again.
_CREATED_COMPLETE = "_epl_created_complete"


def created_complete(op: tf.Operation) -> bool:
    """True if a NodeBatch created `op` with its TaskGraph, phase and device set."""
    return getattr(op, _CREATED_COMPLETE, False)


class NodeBatch:
    """New ops of one graph, written as NodeDefs and added in one import.

    Usage: `name = batch.add(node_def)` for each new op (inputs written with
    `batch.ref(tensor)`, `batch.control_ref(op)` or `batch.output(name, i)`),
    then `ops = batch.commit()`: {NodeDef name: new tf.Operation}.
    """

    def __init__(self, graph: tf.Graph):
        self.graph = graph
        self.nodes: list = []      # NodeDefs, still editable until commit()
        self._inputs: dict = {}    # existing tensor -> placeholder name
        self._controls: dict = {}  # existing op -> placeholder name
        self.created: dict | None = None  # commit()'s result, once committed

    def new_name(self, name: str) -> str:
        """Reserve the graph's unique name for `name` (as op creation would)."""
        return self.graph.unique_name(name)

    def add(self, node_def: node_def_pb2.NodeDef) -> str:
        """Add a new op; `node_def.name` must come from `new_name`. Returns that name."""
        self.nodes.append(node_def)
        return node_def.name

    @staticmethod
    def output(name: str, index: int) -> str:
        """NodeDef input naming output `index` of the batch's op `name`."""
        return f"{name}:{index}"

    def ref(self, tensor: tf.Tensor) -> str:
        """NodeDef input naming an existing tensor of the graph."""
        key = self._inputs.get(tensor)
        if key is None:
            key = self._inputs[tensor] = _INPUT_PLACEHOLDER.format(len(self._inputs) + len(self._controls))
        return f"{key}:0"

    def control_ref(self, op: tf.Operation) -> str:
        """NodeDef control input naming an existing op of the graph."""
        key = self._controls.get(op)
        if key is None:
            key = self._controls[op] = _INPUT_PLACEHOLDER.format(len(self._inputs) + len(self._controls))
        return f"^{key}"

    def commit(self) -> dict:
        """Add every NodeDef to the graph; return {name: tf.Operation}."""
        if not self.nodes:
            return {}
        graph = self.graph
        graph_def = graph_pb2.GraphDef()
        graph_def.node.extend(self.nodes)
        scoped = c_api_util.ScopedTFImportGraphDefOptions()
        options = scoped.options
        c_api.TF_ImportGraphDefOptionsSetPrefix(options, "")
        c_api.TF_ImportGraphDefOptionsSetUniquifyNames(options, True)
        c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
        for tensor, key in self._inputs.items():
            c_api.TF_ImportGraphDefOptionsAddInputMapping(options, key, 0, tensor._as_tf_output())
        for op, key in self._controls.items():
            c_api.TF_ImportGraphDefOptionsRemapControlDependency(options, key, op._c_op)
        for node in self.nodes:
            c_api.TF_ImportGraphDefOptionsAddReturnOperation(options, node.name)
        graph._check_not_finalized()
        with graph._mutation_lock():
            buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
            try:
                with graph._c_graph.get() as c_graph:
                    results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options)
                results = c_api_util.ScopedTFImportGraphDefResults(results)
            finally:
                c_api.TF_DeleteBuffer(buffer)
            created = c_api.TF_ImportGraphDefResultsReturnOperations(results.results)
            ops = [graph._create_op_from_tf_operation(c_op, compute_device=False)
                   for c_op in created]
            _post_process(graph, ops)
            for node, op in zip(self.nodes, ops):
                if node.device and TASKGRAPH_ATTR in node.attr and PHASE_ATTR in node.attr:
                    setattr(op, _CREATED_COMPLETE, True)
            self.created = {node.name: op for node, op in zip(self.nodes, ops)}
            return self.created


def _post_process(graph: tf.Graph, ops: list) -> None:
    """What `Graph._add_new_tf_operations` does after creating imported ops, done only
    where it can change something: the control dependencies of an enclosing
    `tf.control_dependencies` block, and the control-flow context (TF1 while/cond)
    of an enclosing one. Outside both (how the passes run) neither applies, and
    skipping the per-op checks saves about a third of the import's Python time.
    (`_add_new_tf_operations` also scans every op of the graph for new ones; the
    importer already returned exactly ours.)"""
    if graph._current_control_dependencies():
        for op in ops:
            graph_mutation.add_control_inputs(op, graph._control_dependencies_for_inputs(op.inputs))
    if graph._get_control_flow_context() is not None:
        for op in ops:
            op._control_flow_post_processing()


def copy_node_def(op: tf.Operation, name: str, device: str, extra_attrs: dict | None = None
                  ) -> node_def_pb2.NodeDef:
    """`op`'s NodeDef renamed `name`, on `device`, without colocation or inputs
    (the caller appends them), with `extra_attrs` set."""
    node = node_def_pb2.NodeDef()
    node.CopyFrom(op.node_def)
    node.name = name
    node.device = device
    del node.input[:]
    if COLOCATION_ATTR in node.attr:
        del node.attr[COLOCATION_ATTR]
    for key, value in (extra_attrs or {}).items():
        node.attr[key].CopyFrom(value)
    return node


def clone_op(op: tf.Operation, inputs: list[tf.Tensor], name: str, device: str,
             extra_attrs: dict | None = None) -> tf.Operation:
    """Create a copy of `op` with `inputs`, called `name`, on `device`."""
    attrs = {k: v for k, v in op.node_def.attr.items() if k != COLOCATION_ATTR}
    attrs.update(extra_attrs or {})
    new = op.graph._create_op_internal(
        op.type, inputs, [out.dtype for out in op.outputs], input_types=list(op._input_types),
        name=name, attrs=attrs, op_def=op.op_def, compute_device=False)
    graph_mutation.set_device(new, device)
    return new


def plain_constant(op: tf.Operation) -> bool:
    """A Const with no control inputs (none inside TF1 control flow): one copy of it
    serves every unit of a replica on a device, and it needs no ordering."""
    return op.type == "Const" and not op.control_inputs


class ConstantPool:
    """One copy of each shareable constant per (template, device, replica attribute),
    for the copiers of one rewrite (see the module docstring).

    An entry is (the NodeBatch that writes it, its NodeDef name); once that batch
    has committed, later batches read the created op.
    """

    def __init__(self, replica_attr: str):
        self.replica_attr = replica_attr   # the attribute that tells the replicas apart
        self._entries: dict = {}


    def key(self, op: tf.Operation, node: node_def_pb2.NodeDef) -> tuple:
        replica = node.attr.get(self.replica_attr)
        return op, node.device, replica.SerializeToString() if replica is not None else b""

    def get(self, key: tuple):
        return self._entries.get(key)

    def put(self, key: tuple, batch: "NodeBatch", name: str) -> None:
        self._entries[key] = (batch, name)


class OpCopier:
    """Copies ops into a NodeBatch, resolving inputs as `clone_ops` describes.

    copy(op) writes op's copy; substitute(op, node_def) writes another op in
    its place (its inputs from `inputs()`); commit() adds them to the graph and
    returns {old op: new op}. Used directly when a copy needs a substitute op
    (epl/passes/replication/replicate.py), otherwise through `clone_ops`.
    """

    def __init__(self, graph: tf.Graph, prefix: str, device_fn: Callable[[tf.Operation], str],
                 input_map: dict | None = None, extra_attrs: dict | None = None,
                 known: dict | None = None, cache: dict | None = None,
                 batch: NodeBatch | None = None, stream: int = 0,
                 constants: ConstantPool | None = None):
        # several copiers may write into one NodeBatch (one import for all of them,
        # which saves the importer's fixed cost per call): then call close() on
        # each, commit the batch once, and read each copier's ops with result()
        self.batch = batch if batch is not None else NodeBatch(graph)
        self.prefix = prefix
        self.device_fn = device_fn
        self.input_map = input_map or {}
        self.extra_attrs = extra_attrs
        self.known = known or {}
        self.stream = stream  # random-number stream of the copies (`reseed`)
        # op -> (its NodeDef without name, device and inputs; its inputs; its control
        # inputs): what copying reads from an op, read once when the same ops are
        # copied for several replicas (pass the same dict to each copier)
        self.cache = {} if cache is None else cache
        self._names: dict = {}  # old op -> its copy's NodeDef name
        self._order: list = []  # (old op, new NodeDef, old op's control inputs)
        self.constants = constants  # shared constants (ConstantPool) or None
        self._aliases: dict = {}  # old op -> the old tensor its copy's readers read instead
        self._pooled: dict = {}  # old op -> (batch, name) of the pooled constant it reads

    def _source(self, op: tf.Operation) -> tuple:
        source = self.cache.get(op)
        if source is None:
            source = self.cache[op] = (copy_node_def(op, "", ""), tuple(op.inputs),
                                       tuple(op.control_inputs))
        return source

    def input(self, tensor: tf.Tensor) -> str:
        """NodeDef input for what the copy of a reader of `tensor` reads."""
        if tensor in self.input_map:
            return self.batch.ref(self.input_map[tensor])
        name = self._names.get(tensor.op)
        if name is not None:
            return self.batch.output(name, tensor.value_index)
        alias = self._aliases.get(tensor.op)
        if alias is not None:
            return self.input(alias)
        pooled = self._pooled.get(tensor.op)
        if pooled is not None:   # a constant an earlier batch wrote
            return self.batch.ref(self._committed(pooled).outputs[tensor.value_index])
        known = self.known.get(tensor.op)
        return self.batch.ref(known.outputs[tensor.value_index] if known is not None else tensor)

    def control_input(self, op: tf.Operation) -> str:
        name = self._names.get(op)
        if name is not None:
            return f"^{name}"
        return self.batch.control_ref(self.known.get(op, op))

    def copy(self, op: tf.Operation) -> None:
        """Write the copy of `op` (its inputs' producers must be written first)."""
        template, inputs, _ = self._source(op)
        node = node_def_pb2.NodeDef()
        node.CopyFrom(template)
        node.device = self.device_fn(op)
        for key, value in (self.extra_attrs or {}).items():
            node.attr[key].CopyFrom(value)
        if self.constants is not None and plain_constant(op):
            self._pool(op, node, self.constants.key(op, node))
            return
        node.name = self.new_name(op)
        if self.stream:
            reseed(node, self.stream)
        node.input.extend(self.input(t) for t in inputs)
        self._add(op, node)

    def copy_constant(self, op: tf.Operation, node: node_def_pb2.NodeDef) -> None:
        """Write `node`, a Const with another value than `op` (its template), as `op`'s
        copy; shared through the ConstantPool with every copy of the same value."""
        if self.constants is None or not plain_constant(op):
            node.name = self.new_name(op)
            self._add(op, node)
            return
        value = node.attr["value"].SerializeToString()
        self._pool(op, node, self.constants.key(op, node) + (value,))

    def _pool(self, op: tf.Operation, node: node_def_pb2.NodeDef, key: tuple) -> None:
        """Read the pooled copy for `key`, or write `node` (unnamed yet) as it."""
        entry = self.constants.get(key)
        if entry is not None:   # another unit's copy serves this one
            if entry[0] is self.batch:
                self._names[op] = entry[1]
            else:
                self._pooled[op] = entry
            return
        node.name = self.new_name(op)
        self.constants.put(key, self.batch, node.name)
        self._add(op, node)

    def alias(self, op: tf.Operation, tensor: tf.Tensor) -> None:
        """Copy nothing for `op` (an Identity of `tensor` no op waits for): readers of
        its output read the copy of `tensor` (or what `tensor` maps to)."""
        self._aliases[op] = tensor

    def substitute(self, op: tf.Operation, node: node_def_pb2.NodeDef) -> None:
        """Write `node` (named by `new_name`, inputs filled in) as the copy of `op`."""
        self._add(op, node)

    def new_name(self, op: tf.Operation) -> str:
        """The name `op`'s copy gets."""
        return self.batch.new_name(f"{self.prefix}/{op.name}")

    def _add(self, op: tf.Operation, node: node_def_pb2.NodeDef) -> None:
        self._names[op] = self.batch.add(node)
        self._order.append((op, node))

    def close(self) -> None:
        """Resolve the control inputs (done last, so they may point forward)."""
        for op, node in self._order:
            node.input.extend(self.control_input(c) for c in self._source(op)[2])

    def result(self, created: dict) -> dict:
        """{old op: new op} from the batch's commit() result (a pooled constant
        maps to the one copy every unit reads)."""
        copies = {op: created[node.name] for op, node in self._order}
        for op, name in self._names.items():
            if op not in copies:   # pooled in this batch by another copier
                copies[op] = created[name]
        for op, entry in self._pooled.items():
            copies[op] = self._committed(entry)
        return copies

    def shared(self) -> set:
        """The old ops whose copy is a pooled constant another copier wrote."""
        own = {op for op, _ in self._order}
        return {op for op in self._names if op not in own} | set(self._pooled)

    def _committed(self, entry: tuple) -> tf.Operation:
        """The op a pooled constant of an earlier, committed batch became."""
        batch, name = entry
        return batch.created[name]

    def commit(self) -> dict:
        """Add the copies to the graph (one import); return {old op: new op}."""
        self.close()
        return self.result(self.batch.commit())


def reseed(node: node_def_pb2.NodeDef, stream: int) -> None:
    """Give the copy of a seeded stateful random op its own random stream.

    A random op (attrs `seed`, `seed2`) with a seed set (a graph seed from
    tf.compat.v1.set_random_seed, or an op seed) draws the same numbers in
    every copy. For stream > 0 its seed2 becomes a hash of (seed, seed2,
    stream): different per stream, the same in every run. Stream 0 and ops
    with no seed at all (every kernel then seeds itself) are left alone.
    """
    if stream <= 0 or "seed2" not in node.attr or "seed" not in node.attr:
        return
    seed, seed2 = node.attr["seed"].i, node.attr["seed2"].i
    if seed == 0 and seed2 == 0:
        return
    node.attr["seed2"].i = (zlib.crc32(f"{seed}:{seed2}:{stream}".encode()) & 0x7FFFFFFF) or 1


def clone_ops(ops: list[tf.Operation], prefix: str, device_fn: Callable[[tf.Operation], str],
              input_map: dict | None = None, extra_attrs: dict | None = None,
              known: dict | None = None, stream: int = 0,
              constants: ConstantPool | None = None) -> dict:
    """Copy `ops` (creation order) under `prefix`; return {old op: new op}.

    known: copies made earlier (old op -> new op) that inputs should resolve to.
    stream: the copies' random stream (`reseed`). constants: a ConstantPool
    shared with other copies (a pooled constant maps to the one shared op).
    """
    if not ops:
        return {}
    copier = OpCopier(ops[0].graph, prefix, device_fn, input_map, extra_attrs, known,
                      stream=stream, constants=constants)
    for op in ops:
        copier.copy(op)
    return copier.commit()


def give_own_functions(op: tf.Operation, suffix: str) -> None:
    """Point `op` (a copy of a v2 control-flow op: If, While, Case, a call) at
    copies of the library functions it runs, named `<function>_<suffix>`.

    Why: autodiff of v2 control flow rewrites the functions of the op it
    differentiates (a While gains outputs for the intermediates its gradient
    needs) and names the rewrite after the function; copies that shared one
    function would each add a different rewrite under the same name. The
    copies' functions are the same definitions under new names."""
    for attr in op.op_def.attr:
        if attr.type == "func":
            name = op.get_attr(attr.name).name
            op._set_func_attr(attr.name, _function_copy(op.graph, name, suffix))
        elif attr.type == "list(func)":
            names = [f.name for f in op.get_attr(attr.name)]
            op._set_func_list_attr(attr.name, [_function_copy(op.graph, n, suffix) for n in names])


def _function_copy(graph: tf.Graph, name: str, suffix: str) -> str:
    """The name of a copy of library function `name`, added to `graph` once."""
    new_name = f"{name}_{suffix}"
    if graph._get_function(new_name) is None:
        definition = function_pb2.FunctionDef()
        definition.CopyFrom(graph._get_function(name).cached_definition)
        definition.signature.name = new_name
        with graph.as_default():
            func_graph = function_def_to_graph.function_def_to_graph(definition)
            control_flow_util_v2.create_new_tf_function(func_graph)
    return new_name


def with_dynamic_rows(tensor: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """`tensor`, or when its static first dimension differs from `like`'s, the same
    value with that dimension unknown (TensorFlow's edge update merges the static
    shapes of the old and the new input, so a reader inferred for `like`'s rows
    cannot read more rows otherwise). A PlaceholderWithDefault that is never fed
    is an identity with the shape it declares."""
    if tensor.shape.is_compatible_with(like.shape) or tensor.shape.rank is None:
        return tensor
    shape = [None] + tensor.shape.as_list()[1:]
    return tf.compat.v1.placeholder_with_default(tensor, shape, name="EPL_ROWS")


def replace_input(op: tf.Operation, old: tf.Tensor, new: tf.Tensor) -> None:
    """Make `op` read `new` wherever it read `old`."""
    for index, tensor in enumerate(op.inputs):
        if tensor is old:
            graph_mutation.update_input(op, index, new)


def replace_control_inputs(op: tf.Operation, mapping: dict) -> None:
    """Replace control inputs of `op` found in `mapping` (old op -> new op)."""
    controls = list(op.control_inputs)
    if any(c in mapping for c in controls):
        graph_mutation.remove_all_control_inputs(op)
        graph_mutation.add_control_inputs(op, [mapping.get(c, c) for c in controls])
