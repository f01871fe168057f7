"""Unit functions: each unit's work on a device as one call of a shared function.

The replicate pass copies the model once per (replica, micro-batch) unit, and
every later pass reads and rewires those copies. What TensorFlow's first step
then does (Grappler's optimizers, placement, executor creation) grows with
every copy: at 16 micro-batches, 2 stages and 12 layers it spent about 25 s on
55,696 ops to train a model plain TensorFlow starts in 2 s (issue 29). This
pass, the last of the training pipeline, hands TensorFlow one definition per
distinct piece of work instead:

- a **group** is the ops of one unit, one phase (its forward copies, or its
  backward ops) and one TaskGraph (a pipeline stage; a split TaskGraph's ops
  are cut by device too): one stage's forward or backward of one micro-batch
  on one replica (`Replication.forward_copies` and `backward_ops`, the
  replicate pass's explicit record, and the ops' TaskGraph tags);
- a group's ops that a function can compute as they are computed outside are
  moved into a library function (a `FunctionDef`, built directly as a proto),
  and a `PartitionedCall` of it on the group's device (the one most of its ops
  are on) takes their place: every reader outside the group reads the call's
  outputs, every control edge on a group op (the pipeline schedule's among
  them) is an edge on the call. Groups of equal structure (the micro-batches of
  a stage, the replicas of a data-parallel model) call one function, so
  TensorFlow optimizes and instantiates it once per device;
- the function is marked `_noinline`, or Grappler's function optimizer would
  inline every call again at the first step.

What a body holds besides the group's stateless ops:
- the group's reads of resource variables on the call's device (`variable_read`:
  a read's only effect is its value, and a call reads no earlier than the copy;
  a variable the offload pass put on the host is read there, outside). Such a
  body is called with `StatefulPartitionedCall`, as tf.function calls one;
- the accumulate pass's adds of the unit's gradients into the running sums
  (`unit_groups`): the backward call takes the sums so far and returns them.
  What starts the sums (the zeros micro-batch 0 adds into) and what finishes them
  at the last micro-batch (x 1/M, the sparse concatenations) stay outside, so
  every micro-batch's backward of a stage calls one function.
  Both were per-unit graph ops before, one per variable and unit each: at 12
  layers and 16 micro-batches 3,184 reads and 2,985 adds of a step's 10,542
  graph ops (bench/startup.py's model); now 3,939 graph ops remain.

What stays outside the function, as the copies are today (so they compute
exactly what they compute without this pass):
- other stateful ops (random ops, assignments, collectives, the input
  pipeline, an embedding's gather): a function call runs its body once per
  call, but a stateful op's effect and order belong to the graph; they and the
  ops of the group they depend on stay per-unit ops (a group's ops that a
  stateful op of the same group reads stay outside, so the call never feeds an
  op that feeds it);
- ops with a resource, variant or reference-typed input or output, ops that
  run functions of their own (v2 control flow), placeholders, a forward
  group's ops computed from constants alone (the session may feed them: a
  scale, a keep probability; a backward group's, autodiff's shape arithmetic,
  are in its body, `_members`), and constants (copied into each body that
  reads them);
- ops that would close a cycle: a call waits for all of its inputs, so two
  groups that read each other's values cannot both be calls. TensorFlow's
  autodiff puts the sums of a residual stream's gradients with the first
  summand, the last stage's, so the last stage's backward holds sums that an
  earlier stage's backward computes and reads; such ops move to the group on
  both sides of them (`_move_between`), and what still closes a cycle stays
  outside with what it reads (`_break_cycles`; the pass's notes count them).

The copies themselves stay in the graph unread (TensorFlow's graph API removes
no op): a session runs only what its fetches need, so they cost nothing at run
time, and a fetch of one of them (the session answers a fetch of a per-replica
tensor with the first unit's copy) computes it from the same inputs. The step's
updates wait for the first unit's copied variable reads (`order_fetched_reads`),
so such a fetch reads the weights the calls read, not the updated ones: one read
per variable of the first unit runs in every step. The
schedule's barriers (NoOps that wait for copies) stay with the copies too; the
calls wait for twins of them (`_twin_barriers`), so the copies still run
without any call: when an op inside a call fails, TensorFlow may report only
the cancellation of the others, and the session runs the copies again to find
the failing op (epl/hooks/session.py). A feed
of a tensor a function now computes would have no effect on the step: the
session refuses it (`UnitFunctions.outlined`, epl/hooks/session.py).

What the first step still pays per unit (measured with `perf` on bench/startup.py's
model, 12 layers, 64 micro-batches, 256 calls, 189,176 ops of which the step runs
5,481 with the initializer; issue 29): the unread copies, which a session with
`place_pruned_graph` converts from the whole GraphDef at every new run signature
(the initializer's run and the first step: the step's ops alone in a fresh graph
took 0.48 s instead of 3.85 s to initialize, and 6.35 s instead of 8.46 s for
the first step). That goes away once the replicate pass stops copying what the
calls replace (each stage's functions built once from the template, only the
calls emitted per unit). TensorFlow's XLA pass `EncapsulateSubgraphsPass`,
registered whether XLA is used or not, converted every call's body into a graph
twice per call node to look for reference variables in it (about 2 s of CPU time
there; a direct function call instead of `PartitionedCall` is looked into the
same way); the calls now wait for a reference variable's op, which answers the
question from their inputs (`ref_scan_marks`).

On by default (`pipeline.unit_functions: False` runs the copies). The calls
compute what the copies compute, but not always with the same rounding:
Grappler's arithmetic optimizer rewrites the session's graph, where it
reassociates a unit's arithmetic together with the ops around it; a call's body
it sees apart. With the session's arithmetic optimizer off, calls and copies
agree bit for bit (and with oneDNN off, TF_ENABLE_ONEDNN_OPTS=0, they differ by
1.2e-7). On one oracle case (tests/passes/test_replicate_oracle.py, the
transformer with uneven replica shares in global batch mode and Adam) the calls'
variables differ from single-device training by 8.9e-6 after 5 steps where the
copies differ by 2.4e-7: one element of ff1 whose gradient is near Adam's
epsilon, which amplifies any reordering (single-device training itself moves
it by 1.1e-6 with the arithmetic optimizer off). The oracle's noise floor
(tests/conftest.py) measures that reordering too, and every oracle test
passes with the calls.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util

from epl.ir import graph_mutation
from epl.ir.annotations import EPL_ATTRS, PHASE_ATTR, TASKGRAPH_ATTR, UNIT_TAGS, Phase, taskgraph_tag
from epl.ir.clone import COLOCATION_ATTR, plain_constant
from epl.ir.consistency import written_variable
from epl.ir.graph_view import (TrainingView, ancestors, output_args, predecessors,
                               successors, topological_order)
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.passes.offload import Offloaded
from epl.passes.pipeline.accumulate import Accumulation
from epl.passes.replication.result import Replication

NOINLINE_ATTR = "_noinline"
# a body that reads variables is called with StatefulPartitionedCall (as tf.function
# calls one): Grappler then neither prunes nor merges its calls as pure computations
CALL_TYPES = ("PartitionedCall", "StatefulPartitionedCall")
_UNSAFE_DTYPES = frozenset((tf.resource.as_datatype_enum, tf.variant.as_datatype_enum))
_REF_OFFSET = 100   # a reference type's enum is its value type's plus 100 (types.proto)
_KEPT_OUT_TYPES = frozenset(("Placeholder", "PlaceholderWithDefault", "PlaceholderV2"))
# attributes a body's node does not take: the colocation, and the mark TensorFlow sets
# on an op given control inputs after it was built (the schedule's edges, which the
# call takes instead; it told the last micro-batch's backward from the middle ones')
_NOT_IN_BODY = frozenset((COLOCATION_ATTR, "_has_manual_control_dependencies"))
# a graph NodeDef's fields a body's node leaves empty: its inputs are written anew, and
# its device, debug information and full type are the graph op's
_NODE_FIELDS_DROPPED = ("input", "device", "experimental_debug_info", "experimental_type")
_ATTRS_NOT_IN_BODY = _NOT_IN_BODY | EPL_ATTRS


@dataclasses.dataclass
class UnitFunctions:
    """What the pass built: calls: one call op per group it outlined; functions: the
    library functions they call (distinct bodies); outlined: every op whose work a
    call now does (its copy stays in the graph, unread); kept: ops left as copies,
    with why; outputs: each copied tensor a call returns -> that output of the call
    (a fetch of it reads the call instead of running the unread copies);
    initialized: (variable op, its VarIsInitializedOp's output) for every variable a
    call reads inside its body (`initialized_check`); twins: each barrier NoOp that
    waits for copies -> the NoOp that waits for the calls instead (`_twin_barriers`);
    ref_marks: the reference variable ops the calls wait for (`ref_scan_marks`), no
    variable of the model."""

    calls: list
    functions: list
    outlined: frozenset
    kept: list
    outputs: dict = dataclasses.field(default_factory=dict)   # copy tensor -> call output
    initialized: list = dataclasses.field(default_factory=list)
    twins: dict = dataclasses.field(default_factory=dict)
    ref_marks: frozenset = frozenset()


class UnitFunctionsPass(GraphPass):
    """Each unit's forward and backward on each device as a call of a shared function."""

    name = "unit_functions"
    off_note = "pipeline.unit_functions is off: the copies run"
    requires = (TrainingView, Replication)
    # each micro-batch's gradient adds join its backward; offloaded variables are read
    # on the host, outside the calls
    optional = (Accumulation, Offloaded)
    provides = (UnitFunctions,)
    after = ("verify",)   # the invariants are checked on the copies, op by op

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        replication = ctx.get(Replication)
        if len(replication.units()) < 2:
            ctx.provide(UnitFunctions([], [], frozenset(), []))
            return PassResult(notes=["one unit: nothing to share"], modified=False)
        split = {taskgraph.name for taskgraph in ctx.get(TrainingView).split_taskgraphs}
        accumulation, offloaded = ctx.find(Accumulation), ctx.find(Offloaded)
        built = outline(graph, unit_groups(replication, split,
                                           accumulation.ops if accumulation else None,
                                           accumulation.kept_out_of_calls()
                                           if accumulation else ()),
                        offloaded.variables if offloaded else frozenset())
        built.initialized = initialized_check(graph, built.calls)
        built.ref_marks = frozenset(ref_scan_marks(graph, built.calls))
        ordered = order_fetched_reads(replication, built)
        ctx.provide(built)
        distinct = len(built.functions)
        notes = [f"{len(built.calls)} unit groups as calls of {distinct} function(s); "
                 f"{len(built.outlined)} copied ops moved into them"]
        if ordered:
            notes.append(f"{ordered} control edge(s): the step's updates wait for the first "
                         "unit's copied variable reads (a fetch of its copies reads the "
                         "variables before the update, as the calls do)")
        notes += built.kept
        return PassResult(added=[op.name for op in built.calls + list(built.twins.values())
                                 + sorted(built.ref_marks, key=lambda op: op._id)],
                          notes=notes,
                          modified=bool(built.calls))


def body_nodes(ops) -> list:
    """The NodeDefs of every unit function that a call among `ops` runs, once per
    function (what a step computes inside its calls, for readers that look at the
    ops a step runs)."""
    names = {op.get_attr("f").name: op.graph for op in ops if op.type in CALL_TYPES}
    nodes = []
    for name, graph in sorted(names.items(), key=lambda item: item[0]):
        function = graph._get_function(name)
        if isinstance(function, LibraryFunction):
            nodes.extend(function.cached_definition.node_def)
    return nodes


def unit_groups(replication: Replication, split_taskgraphs: set,
                accumulation: dict | None = None, kept_out=()) -> list:
    """[(unit, phase, device, ops)]: each unit's forward copies and its backward ops,
    cut by TaskGraph (a pipeline stage), in the replicate pass's order (the
    template's for every unit, so equal groups list their ops alike).

    `accumulation` (the accumulate pass's `Accumulation.ops`: unit -> the adds of
    that micro-batch's gradients into the running sums) joins each unit's backward:
    the call then takes the sums so far and returns them with its gradients added,
    and the adds (one per variable and micro-batch, as many as the model's
    variables times M) are nodes of the shared body instead of ops of the graph.
    What starts and finishes the sums (`kept_out`, the accumulate pass's
    `Accumulation.kept_out_of_calls`: the zeros micro-batch 0 adds into, x 1/M, the
    sparse concatenations) stay graph ops: in the bodies they made the first and the
    last micro-batch's backward functions of their own, two more copies of a stage's
    backward for the first step to optimize. So a stage's backward is one function
    whatever M is (bench/startup.py's encoder), unless units cut it differently (a
    gradient of a shape known only at run time has no zeros to start from: micro-batch
    0's backward is then a function of its own).

    The device of a group is the one most of its ops are on; its call runs the others
    there too. Why by TaskGraph and not by device: TensorFlow's autodiff puts some
    gradient sums (the AddN of an op's gradients that have several readers) on the
    device of the stage that called it, so a stage's backward goes to the last
    stage's device and back; as two calls, the stages' backwards would read each
    other (a cycle). A split TaskGraph's ops are cut by device too: each device
    computes its own shard."""
    groups = []
    for unit in replication.units():
        backward = list(replication.backward_ops.get(unit, []))
        backward += [op for op in (accumulation or {}).get(unit, []) if op not in kept_out]
        for phase, ops in (("forward", list(replication.forward_copies[unit].values())),
                           ("backward", backward)):
            by_key: dict = {}   # (TaskGraph, device or None) -> (members, their devices)
            for op in ops:
                device = op.device   # read once: each read asks TensorFlow
                if not device:
                    continue
                taskgraph = taskgraph_tag(op)
                key = (taskgraph, device if taskgraph in split_taskgraphs else None)
                members, devices = by_key.setdefault(key, ([], collections.Counter()))
                members.append(op)
                devices[device] += 1
            for members, devices in by_key.values():
                groups.append((unit, phase, devices.most_common(1)[0][0], members))
    return groups


def function_safe(op: tf.Operation, type_safe: dict) -> bool:
    """Whether a function computes `op` exactly as the graph does: a stateless op
    with no function of its own and no resource, variant or reference value.

    type_safe: the answer for the op's type alone (stateless, no function attribute,
    no placeholder), cached by type for one rewrite: reading an op's OpDef parses it."""
    safe = type_safe.get(op.type)
    if safe is None:
        safe = type_safe[op.type] = op.type not in _KEPT_OUT_TYPES and \
            not op.op_def.is_stateful and \
            not any(attr.type in ("func", "list(func)") for attr in op.op_def.attr)
    if not safe or plain_constant(op):
        return False
    for tensor in list(op.inputs) + list(op.outputs):
        enum = tensor.dtype.as_datatype_enum
        if enum in _UNSAFE_DTYPES or enum > _REF_OFFSET:
            return False
    return True


def variable_read(op: tf.Operation, device: str, host_variables: frozenset) -> bool:
    """Whether `op` is a read of a resource variable on `device` (the group's: its call
    runs there), which a body computes as the copy does. A variable the offload pass
    put in host memory (`host_variables`) is read on the host: its read stays a graph
    op, and the call gets the value.

    A read is stateful, but its effect is only its value, and the call makes it no
    earlier than the copy would run: a call starts once all of its inputs and
    control inputs are there, which includes everything the copy waited for (the
    schedule's edges among them). Nothing in a step writes a trained variable before
    the update, which reads the gradient that every unit's reads feed; a variable a
    unit writes itself (a batch-norm moving average) is read by the assignment's
    inputs, which `_members` keeps outside with what they read. Before this, each
    unit's reads stayed graph ops: one per variable per unit, 3,184 of the 10,542
    graph ops of a step at 12 layers and 16 micro-batches (bench/startup.py's model)."""
    return op.type == "ReadVariableOp" and op.device == device and \
        op.inputs[0].dtype == tf.resource and op.inputs[0].op not in host_variables


def _members(ops: list, deps: dict, device: str, host_variables: frozenset,
             type_safe: dict, phase: str) -> list:
    """The ops of one group a function can hold: the function-safe ones and the
    variable reads on the group's device (`variable_read`), less those a kept op of
    the group reads (directly or through other members), so the call never feeds
    an op that feeds it, and, in a forward group, less those computed from
    constants alone (a scale or a keep probability the script may feed: a feed
    reaches what stays outside).

    A backward group's ops computed from constants (autodiff's shape arithmetic:
    the InvertPermutation of each transpose's gradient, the shapes of reshapes and
    broadcasts) join its body: they are nothing a script feeds (a feed of one is
    refused, as of any tensor a call computes), and as graph ops they were a third
    of a step's ops, one of each per unit (768 InvertPermutations of 3,848 graph ops
    at 12 layers and 16 micro-batches, bench/startup.py's model)."""
    own, constant = set(ops), set()
    if phase != "backward":
        # computed from constants and waiting for nothing of the group (the
        # schedule's edges from other units may order it)
        for op in topological_order(ops):
            if all(plain_constant(t.op) or t.op in constant for t in op.inputs) and \
                    not any(c in own for c in op.control_inputs):
                constant.add(op)
    safe = [op for op in ops if op not in constant
            and (function_safe(op, type_safe) or variable_read(op, device, host_variables))]
    inside = set(safe)
    read = [dep for op in ops if op not in inside for dep in deps[op] if dep in inside]
    out = _closure(read, inside, deps)
    return [op for op in safe if op not in out]


def _closure(ops: list, inside: set, neighbours: dict) -> set:
    """`ops` and every op of `inside` reached from them through `neighbours` ({op:
    the ops it reads or waits for}: its ancestors; {op: its readers}: its
    descendants), directly or through others of `inside`."""
    found: set = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op not in found:
            found.add(op)
            stack.extend(n for n in neighbours.get(op, ()) if n in inside and n not in found)
    return found


def outline(graph: tf.Graph, groups: list, host_variables: frozenset = frozenset()
            ) -> UnitFunctions:
    """Replace every group that can be one call by a call of its function
    (`host_variables`: the variable ops the offload pass put on the host)."""
    deps = predecessors(graph)
    members, type_safe = {}, {}
    for index, (_, phase, device, ops) in enumerate(groups):
        chosen = _members(ops, deps, device, host_variables, type_safe, phase)
        if len(chosen) > 1:
            members[index] = chosen
    kept = []
    count = len(members)
    members = _move_between(deps, members)
    members, given_up, order = _break_cycles(deps, members)
    if given_up:
        kept.append(f"{given_up} op(s) of {count} groups kept as copies, "
                    f"{count - len(members)} whole group(s): in a call they would close a "
                    "cycle (a group that reads, through ops outside it, a value it computes)")
    group_of = {op: index for index, ops in members.items() for op in ops}
    output_names: dict = {}   # shared by the bodies: _output_suffixes' cache
    bodies = {index: _Body(members[index], group_of, output_names) for index in order}
    # what each group gives the graph: its tensors read by any op outside it
    for op in graph.get_operations():
        own = group_of.get(op)
        for tensor in op.inputs:
            source = group_of.get(tensor.op)
            if source is not None and source != own:
                bodies[source].give(tensor)
    twins = _twin_barriers(graph, group_of)
    registered: dict = {}
    calls, replacement, call_of = [], {}, {}
    for index in order:
        body = bodies[index]
        definition = body.definition()
        key = definition.SerializeToString(deterministic=True)
        name = registered.get(key)
        if name is None:
            name = registered[key] = f"epl_unit_{hashlib.sha1(key).hexdigest()[:16]}"
            definition.signature.name = name
            _register(graph, definition)
        unit, phase, device, _ = groups[index]
        call = _call(graph, name, body, replacement, call_of, twins, device, unit, phase)
        calls.append(call)
        call_of[index] = call
        for position, tensor in enumerate(body.outputs):
            replacement[tensor] = call.outputs[position]
    _rewire(graph, group_of, replacement, call_of, twins)
    return UnitFunctions(calls, sorted(set(registered.values())), frozenset(group_of), kept,
                         replacement, twins=twins)


class _Body:
    """One group's FunctionDef: its members as nodes `n<i>`, the constants they read
    copied in as `c<i>`, every other tensor they read an argument `a<i>`."""

    def __init__(self, ops: list, group_of: dict, output_names: dict):
        self.ops = topological_order(ops)
        self.output_names = output_names
        self.position = {op: i for i, op in enumerate(self.ops)}
        self.group_of = group_of
        self.inputs: list = []           # external tensors, in order of first read
        self._argument: dict = {}
        self._constants: dict = {}       # constant tensor -> its node name
        self.controls: list = []         # external ops some member waits for
        self.outputs: list = []          # member tensors read outside the group
        self.reads_variables = any(op.type == "ReadVariableOp" for op in self.ops)
        self._given: set = set()

    def give(self, tensor: tf.Tensor) -> None:
        if tensor not in self._given:
            self._given.add(tensor)
            self.outputs.append(tensor)

    def definition(self) -> function_pb2.FunctionDef:
        """The FunctionDef (unnamed): equal groups give equal protos."""
        self.outputs.sort(key=lambda t: (self.position[t.op], t.value_index))
        fdef = function_pb2.FunctionDef()
        controls = set()
        position, suffixes, ref = self.position, self.output_names, self._ref
        nodes = fdef.node_def
        for i, op in enumerate(self.ops):
            node = nodes.add()
            # the op's NodeDef parsed once, straight into the body's node, then what a
            # body's node does not take removed: cheaper than copying attr by attr
            node.ParseFromString(op._node_def)   # pylint: disable=protected-access
            node.name = f"n{i}"
            for field in _NODE_FIELDS_DROPPED:
                node.ClearField(field)
            for key in [key for key in node.attr if key in _ATTRS_NOT_IN_BODY]:
                del node.attr[key]
            names = []
            for tensor in op.inputs:
                producer = tensor.op
                inside = position.get(producer)
                names.append(ref(tensor, fdef) if inside is None else
                             f"n{inside}:{_output_suffixes(producer, suffixes)[tensor.value_index]}")
            for control in op.control_inputs:
                inside = position.get(control)
                if inside is not None:
                    names.append(f"^n{inside}")
                elif control not in controls:
                    controls.add(control)
                    self.controls.append(control)
            node.input.extend(names)
        variables = {op.inputs[0]: op for op in self.ops if op.type == "ReadVariableOp"}
        for i, tensor in enumerate(self.inputs):
            arg = fdef.signature.input_arg.add()
            arg.name, arg.type = f"a{i}", tensor.dtype.as_datatype_enum
            # the argument's static shape, as the graph knows it: Grappler's rewrites
            # that depend on shapes (the remapper's fused MatMul + bias add) then rewrite
            # the body as they rewrite the copies
            attrs = fdef.arg_attr[i].attr
            attrs["_output_shapes"].list.shape.add().CopyFrom(tensor.shape.as_proto())
            read = variables.get(tensor)
            if read is not None:   # a variable's handle: the dtype and shape of its value
                attrs["_handle_dtypes"].list.type.append(read.get_attr("dtype").as_datatype_enum)
                attrs["_handle_shapes"].list.shape.add().CopyFrom(read.outputs[0].shape.as_proto())
        for i, tensor in enumerate(self.outputs):
            out = fdef.signature.output_arg.add()
            out.name, out.type = f"o{i}", tensor.dtype.as_datatype_enum
            fdef.ret[out.name] = self._ref(tensor, fdef)
        fdef.attr[NOINLINE_ATTR].b = True
        return fdef

    def _ref(self, tensor: tf.Tensor, fdef) -> str:
        """The FunctionDef input naming `tensor`."""
        op = tensor.op
        position = self.position.get(op)
        if position is not None:
            return f"n{position}:{_output_suffixes(op, self.output_names)[tensor.value_index]}"
        name = self._argument.get(tensor)
        if name is not None:
            return name
        name = self._constants.get(tensor)
        if name is not None:
            return f"{name}:output:0"
        if plain_constant(op):
            name = self._constants[tensor] = f"c{len(self._constants)}"
            node = fdef.node_def.add()
            node.name, node.op = name, "Const"
            attrs = op.node_def.attr   # read once: node_def serializes the op
            node.attr["value"].CopyFrom(attrs["value"])
            node.attr["dtype"].CopyFrom(attrs["dtype"])
            return f"{name}:output:0"
        name = self._argument[tensor] = f"a{len(self.inputs)}"
        self.inputs.append(tensor)
        return name


def _output_suffixes(op: tf.Operation, cache: dict) -> list:
    """The FunctionDef names of `op`'s outputs after the node's name, in order:
    "<output arg>:<index within the arg>". Cached by (op type, number of outputs)
    where those two decide them (at most one output argument of variable width);
    reading an op's OpDef parses it."""
    key = (op.type, len(op.outputs))
    suffixes = cache.get(key)
    if suffixes is None:
        suffixes = [f"{arg.name}:{i}" for arg, size in output_args(op) for i in range(size)]
        if sum(1 for arg in op.op_def.output_arg if arg.number_attr or arg.type_list_attr) <= 1:
            cache[key] = suffixes
    return suffixes


class LibraryFunction:
    """A library function given as a FunctionDef, as `tf.Graph._add_function` takes
    one (its `name` and C function; `cached_definition` as TensorFlow's own function
    objects have it). Registering through a FuncGraph instead would rebuild the proto
    and drop its `_noinline` attribute. It has no `graph`: `Graph.as_graph_def`
    (add_shapes) then leaves its argument shapes alone."""

    def __init__(self, definition: function_pb2.FunctionDef):
        self.name = definition.signature.name
        self.cached_definition = definition
        self._c_func = c_api_util.ScopedTFFunction(
            c_api.TF_FunctionImportFunctionDef(definition.SerializeToString()), self.name)

    @property
    def definition(self) -> function_pb2.FunctionDef:
        """The FunctionDef (what epl/runtime/variable_access.py reads to see that a
        body only reads the variables it is given)."""
        return self.cached_definition


def initialized_check(graph: tf.Graph, calls: list) -> list:
    """[(variable op, a bool tensor: it is initialized)] for every resource variable a
    call reads in its body, built beside the step (nothing in it reads them).

    Why: a read of an uninitialized variable inside a call fails the step with
    another partition's "RecvAsync is cancelled" (tf.errors.CancelledError), and the
    error that names the variable is only logged. The session runs these after a
    cancelled step (epl/hooks/session.py) and raises the FailedPreconditionError
    that names the user's variable instead."""
    variables = sorted({t.op for call in calls if call.type == CALL_TYPES[1]
                        for t in call.inputs if t.dtype == tf.resource}, key=lambda op: op._id)
    checks = []
    with graph_mutation.clean_construction_context(graph):
        for variable in variables:
            check = tf.raw_ops.VarIsInitializedOp(resource=variable.outputs[0],
                                                  name="EPL_INITIALIZED")
            graph_mutation.set_device(check.op, variable.device)
            attrs = variable.node_def.attr
            if TASKGRAPH_ATTR in attrs:
                graph_mutation.set_attr(check.op, TASKGRAPH_ATTR, attrs[TASKGRAPH_ATTR])
            graph_mutation.set_attr(check.op, PHASE_ATTR, attr_value_pb2.AttrValue(
                s=Phase.OTHER.value.encode()))
            checks.append((variable, check))
    return checks


def ref_scan_marks(graph: tf.Graph, calls: list) -> list:
    """One reference-typed variable op (`VariableV2`, a float scalar) on each device the
    calls run on, which every call there waits for; returns them. Its value is never
    read, and the op outputs its reference whether the variable is initialized or not:
    running it costs a lookup per step.

    Why: at every new set of fetches a session runs TensorFlow's XLA pass
    `EncapsulateSubgraphsPass` on the graph it runs, XLA used or not, and the pass
    looks for the ops related to reference variables (tensorflow/compiler/jit/
    xla_cluster_util.cc, `GetNodesRelatedToRefVariables`): an op is related when an
    input (forward) or a reader (backward) is, and otherwise, for an op that calls a
    function, when the function's body holds one. To find out it instantiates the body
    (converting its FunctionDef into a graph) for every call node, in each direction,
    with nothing cached across call nodes: 128 conversions of bodies of 1,300 to 3,000
    nodes for the 64 calls at 24 layers and 16 micro-batches (bench/startup.py's
    encoder), about 1 s of CPU time at the first step. A call that waits for a
    reference-typed op is related from its input, and no body is converted: the first
    step took 4.4-4.8 s instead of 6.0-6.4 s there (one run each, under load).

    What the marking changes: the `_XlaHasReferenceVars` attribute the pass writes on
    the session graph's ops, which only XLA's kernels read, and XLA's automatic
    clustering (`tf_xla_auto_jit`, a session's global_jit_level) leaves the ops related
    to a reference variable out of its clusters: with it on, the ops around the calls
    in the session's graph are not compiled (the bodies, which the function runtime
    optimizes and clusters on their own, are). The variable is in no collection, so
    no initializer, Saver or readiness check sees it."""
    marks = []
    with graph_mutation.clean_construction_context(graph):
        for device in sorted({call.device for call in calls}):
            on_device = [call for call in calls if call.device == device]
            mark = tf.raw_ops.VariableV2(shape=[], dtype=tf.float32,
                                         name="EPL_REF_SCAN_MARK").op
            graph_mutation.set_device(mark, device)
            graph_mutation.set_attr(mark, TASKGRAPH_ATTR,
                                    on_device[0].node_def.attr[TASKGRAPH_ATTR])
            graph_mutation.set_attr(mark, PHASE_ATTR, attr_value_pb2.AttrValue(
                s=Phase.OTHER.value.encode()))
            for call in on_device:
                graph_mutation.add_control_inputs(call, [mark])
            marks.append(mark)
    return marks


def order_fetched_reads(replication: Replication, built: UnitFunctions) -> int:
    """Make every update of the step wait for the first unit's copied variable reads
    that a call replaced; returns how many control edges it added.

    Why: the session answers a fetch of a per-replica tensor with the first unit's
    copy (epl/hooks/session.py), and a copy that no call returns (an activation
    only its own group reads) is computed by the copies, which stay in the graph
    unread. Their reads of the variables were ordered before the step's updates by
    the data they fed (the gradients); outlined, they feed nothing the update
    reads, and TensorFlow's executor may run them after it: `sess.run([train_op,
    pre_activation])` returned, once in about 180 steps on a loaded machine, an
    activation computed from the updated weights, and the gradient check
    (gradient_checkpoint.check_gradients) compared the checkpointed gradients
    with such a copy's. With these edges a fetch reads what the step's own calls
    read, as in single-device TensorFlow. Only the first unit's copies are fetched,
    so the step runs one more read per variable that unit reads, whatever the
    number of units (no more than single-device TensorFlow's own reads).

    The updates are the step's writes of those variables (`written_variable`)
    that wait for a call: the initializers and a Saver's restores run without the
    step and stay as they are. A write the read itself waits for (a control
    dependency the script wrote) keeps its order."""
    if not built.calls or not replication.units():
        return 0
    first = replication.units()[0]
    copied = list(replication.forward_copies.get(first, {}).values()) + \
        list(replication.backward_ops.get(first, []))
    reads = [op for op in copied if op in built.outlined and op.type == "ReadVariableOp"]
    if not reads:
        return 0
    by_variable: dict = {}
    for read in reads:
        by_variable.setdefault(read.inputs[0].op, []).append(read)
    # what the step runs after its calls (the unread copies write nothing)
    step = successors(built.calls, outside=built.outlined)
    before = ancestors(reads)
    edges = 0
    for write in sorted(step, key=lambda op: op._id):
        variable = written_variable(write)
        if variable is None or variable not in by_variable or write in before:
            continue
        waiting = [read for read in by_variable[variable] if read not in write.control_inputs]
        if waiting:
            graph_mutation.add_control_inputs(write, waiting)
            edges += len(waiting)
    return edges


def _register(graph: tf.Graph, definition: function_pb2.FunctionDef) -> None:
    """Add `definition` to the graph's library as it is."""
    graph._add_function(LibraryFunction(definition))


def _call(graph, name, body: _Body, replacement: dict, call_of: dict, twins: dict,
          device: str, unit, phase: str) -> tf.Operation:
    """The PartitionedCall of function `name` for one group, on its device, tagged as its
    members are."""
    inputs = [replacement.get(t, t) for t in body.inputs]
    first = body.ops[0]
    k, m = unit
    with graph_mutation.clean_construction_context(graph):
        call = graph.create_op(
            CALL_TYPES[body.reads_variables], inputs, [t.dtype for t in body.outputs],
            attrs={"f": attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name=name)),
                   "Tin": _types(body.inputs), "Tout": _types(body.outputs),
                   "config_proto": _BODY_CONFIG,
                   # the outputs' shapes are set below from the copies'; without this
                   # TensorFlow's shape inference walks the body for each call as it is
                   # created (about 30 ms a call: 7.9 s of a 12-layer, 64-micro-batch
                   # rewrite), as tf.compat.v1's Defun calls skip it too
                   "_disable_call_shape_inference": attr_value_pb2.AttrValue(b=True)},
            name=f"EPL_UNIT_{k}_{m}_{phase}")
    graph_mutation.set_device(call, device)
    for key in UNIT_TAGS:
        if key in first.node_def.attr:
            graph_mutation.set_attr(call, key, first.node_def.attr[key])
    for out, tensor in zip(call.outputs, body.outputs):
        out.set_shape(tensor.shape)
    controls = [call_of.get(body.group_of.get(c), twins.get(c, c)) for c in body.controls]
    if controls:
        graph_mutation.add_control_inputs(call, controls)
    return call


def _twin_barriers(graph: tf.Graph, group_of: dict) -> dict:
    """{NoOp: its twin for the calls}: every NoOp outside the groups that waits for a
    member, directly or through other such NoOps (the pipeline schedule's barriers).

    The original keeps waiting for the copies, the twin waits for the calls, and
    everything but the copies reads the twin (`_rewire`). So the copies, unread in
    the graph, still run alone as they did before the pass, without a call among what
    they need: the session runs them again to find the error a cancelled step hid
    (epl/hooks/session.py, `_cancelled_cause`). The twins get their control inputs
    in `_rewire`, once the calls exist."""
    waiting: list = []
    found: set = set()
    candidates = [op for op in graph.get_operations()
                  if op.type == "NoOp" and op not in group_of and op.control_inputs]
    changed = True
    while changed:
        changed = False
        for op in candidates:
            if op not in found and any(c in group_of or c in found for c in op.control_inputs):
                found.add(op)
                waiting.append(op)
                changed = True
    twins = {}
    with graph_mutation.clean_construction_context(graph):
        for op in waiting:
            twin = graph.create_op("NoOp", [], [], name=f"{op.name}_calls")
            graph_mutation.set_device(twin, op.device)
            for key in EPL_ATTRS:
                if key in op.node_def.attr:
                    graph_mutation.set_attr(twin, key, op.node_def.attr[key])
            twins[op] = twin
    return twins


def _body_config() -> attr_value_pb2.AttrValue:
    """The session config a call optimizes its body with (its `config_proto`): one
    round of Grappler, as the session's (epl.parallel.ParallelGraph.session_config),
    without constant folding and the arithmetic optimizer. Why: these two rewrite
    arithmetic (fold constants into it, merge chains of additions into one sum in
    another order), and what they find inside a body (the body's own constants, a
    residual stream's gradient sums now on one device) differs from what they find
    among the copies; the 4-stage encoder of tests/passes/test_pipeline.py then
    differed from the copies by one float32 ulp in its gradients, which Adam made
    2-5e-6 in its variables after 3 steps. Without them the calls compute bit for
    bit what the copies compute there (tests/passes/test_unit_functions.py); not
    everywhere: the session's own arithmetic optimizer rewrites the copies
    together with the ops around them (the module docstring)."""
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrite.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    rewrite.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    return attr_value_pb2.AttrValue(s=config.SerializeToString())


_BODY_CONFIG = _body_config()


def _types(tensors: list) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
        type=[t.dtype.as_datatype_enum for t in tensors]))


def _rewire(graph, group_of: dict, replacement: dict, call_of: dict, twins: dict) -> None:
    """Every op outside the groups (the calls and the barriers with twins excepted)
    reads the calls' outputs and waits for the calls instead of their members, and for
    the twins instead of the barriers (`_twin_barriers`); each twin waits for what its
    barrier waits for, calls for members and twins for barriers."""
    calls = set(call_of.values())
    skipped = calls | set(twins.values())
    for op in graph.get_operations():
        if op in group_of or op in skipped:
            continue
        for index, tensor in enumerate(op.inputs):
            new = replacement.get(tensor)
            if new is not None:
                graph_mutation.update_input(op, index, new)
        controls = op.control_inputs
        twin = twins.get(op)
        if twin is not None or any(c in group_of or c in twins for c in controls):
            mapped = []
            for control in controls:
                control = call_of.get(group_of.get(control), twins.get(control, control))
                if control not in mapped:
                    mapped.append(control)
            if twin is not None:   # the barrier itself stays with the copies
                graph_mutation.add_control_inputs(twin, mapped)
            else:
                graph_mutation.remove_all_control_inputs(op)
                graph_mutation.add_control_inputs(op, mapped)


def _contracted_edges(deps: dict, group_of: dict):
    """{node: [nodes it reads or waits for]} of the graph with each group one node
    (its index; any other op is itself)."""
    edges: dict = {}
    for op, inputs in deps.items():
        node = group_of.get(op, op)
        out = edges.setdefault(node, set())
        for dep in inputs:
            dep = group_of.get(dep, dep)
            if dep is not node:
                out.add(dep)
    return edges


def _users(deps: dict) -> dict:
    """{op: the ops that read it or wait for it}."""
    users: dict = {}
    for op, inputs in deps.items():
        for dep in inputs:
            users.setdefault(dep, []).append(op)
    return users


def _move_between(deps: dict, members: dict) -> dict:
    """`members` with the ops of a group that lie on a path from another group back to
    that group moved into it, for every two groups on one cycle (repeated while any
    move; what is left of a cycle, `_break_cycles` breaks). Of the two groups, the one
    with fewer such ops gives them up (ties: the earlier group's), so every unit makes
    the same move whatever order its cycles are found in: before, the 2-stage encoder
    of tests/passes/test_pipeline.py moved a stage's weight gradients to the next stage
    in three micro-batches and that stage's residual sum back in the last (one more
    function).

    Why: TensorFlow's autodiff puts the sum of an op's gradients (an AddN) with the
    first of its summands, so the residual stream's gradient sums of every layer
    follow the first, the head's, onto the last stage: the last stage's backward
    holds sums that an earlier stage's backward computes the summands of and reads.
    As two calls, the stages' backwards would wait for each other; moved, those sums
    run in the earlier stage's call, on its device, beside their inputs and
    readers."""
    members = {index: list(ops) for index, ops in members.items()}
    users = _users(deps)
    for _ in range(8):
        group_of = {op: index for index, ops in members.items() for op in ops}
        moved = False
        for component in _components(_contracted_edges(deps, group_of)):
            indices = sorted(node for node in component if isinstance(node, int))
            for position, first in enumerate(indices):
                for second in indices[position + 1:]:
                    # either group's ops between the other's could move; the fewer move
                    moves = [(len(between), source, target, between)
                             for source, target in ((first, second), (second, first))
                             for between in [_between(members, group_of, deps, users,
                                                      source, target)] if between]
                    if not moves:
                        continue
                    _, source, target, between = min(moves, key=lambda move: move[0])
                    members[source] = [op for op in members[source] if op not in between]
                    members[target] += sorted(between, key=lambda op: op._id)
                    for op in between:
                        group_of[op] = target
                    moved = True
        if not moved:
            break
    return {index: ops for index, ops in members.items() if len(ops) > 1}


def _between(members: dict, group_of: dict, deps: dict, users: dict, source: int,
             target: int) -> set:
    """The ops of group `source` on a path from group `target` back to `target`."""
    inside = set(members[source])
    entering = [op for op in members[source] if any(group_of.get(d) == target for d in deps[op])]
    leaving = [op for op in members[source]
               if any(group_of.get(u) == target for u in users.get(op, ()))]
    return _closure(entering, inside, users) & _closure(leaving, inside, deps)


def _break_cycles(deps: dict, members: dict) -> tuple[dict, int, list]:
    """`members` with no group on a cycle of the graph with every group contracted
    (a call waits for all of its inputs, so a group that reads, through ops outside
    it, a value it computes itself cannot be one call).

    A group on a cycle gives up the members that feed the cycle's other nodes,
    with the members those read (they become ops of their own, which compute what
    they computed): what is left reads nothing that reads it. Repeated until no
    cycle is left; a group left with one member or none is kept as copies.
    Returns (the groups, how many members were given up)."""
    members = {index: list(ops) for index, ops in members.items()}
    users = _users(deps)
    given_up = 0
    while True:
        group_of = {op: index for index, ops in members.items() for op in ops}
        edges = _contracted_edges(deps, group_of)
        components = _components(edges)
        cyclic = [component for component in components if len(component) > 1]
        if not cyclic:
            return members, given_up, [node for component in components for node in component
                                       if isinstance(node, int)]
        for component in cyclic:
            nodes = set(component)
            for index in [n for n in component if isinstance(n, int)]:
                inside = set(members[index])
                feeding = [op for op in members[index]
                           if any(group_of.get(r, r) in nodes and group_of.get(r, r) != index
                                  for r in users.get(op, ()))]
                out = _closure(feeding, inside, deps)
                given_up += len(out)
                members[index] = [op for op in members[index] if op not in out]
                if len(members[index]) < 2:
                    given_up += len(members[index])
                    del members[index]


def _components(edges: dict) -> list:
    """Strongly connected components (Tarjan's, iterative)."""
    index_of, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index_of:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index_of[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            advanced = False
            for dep in deps:
                if dep not in index_of:
                    index_of[dep] = low[dep] = counter
                    counter += 1
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(edges.get(dep, ()))))
                    advanced = True
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index_of[dep])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member is node:
                        break
                components.append(component)
    return components
