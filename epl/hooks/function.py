"""tf.function training steps in eager TensorFlow 2: record the step while it is traced,
rewrite the traced graph with the training passes, build the function from the result.

Where EPL hooks in. TensorFlow 2.21 traces a `tf.function` into a FuncGraph
(tensorflow/python/eager/polymorphic_function/tracing_compilation.py) and, before
it builds the ConcreteFunction that runs it, applies every transform registered in
`transform.FUNC_GRAPH_TRANSFORMS` to the finished graph. EPL registers one
(`install`); each trace gets it, so a retrace for a new input signature is
rewritten too.

What it records during the trace (gradient time, as in graph mode):
- `tf.GradientTape.gradient` inside a trace, under epl.init, computes the gradients
  with `tf.compat.v1.gradients` colocated with their forward ops (the tape has no
  colocation, and each backward op must inherit its forward op's TaskGraph); the
  gradients hook records the call as a candidate step (epl/hooks/optimizer.py).
  The values are the tape's: the same symbolic gradients.
- A Keras optimizer's apply tags its ops "apply" and names their writes the train
  op (epl/hooks/keras.py); updates written by hand (`v.assign_sub(lr * g)`) are
  found from the gradients, as for graph-mode `tf.gradients`.
- Scopes entered inside the trace tag ops through the FuncGraph's attribute scope;
  Keras layers constructed under an eager scope re-enter it when called.

At the end of a trace with a step that updates variables (`rewrite`):
1. lower the FuncGraph to a plain graph (epl/ir/func_graph.py: captured variables
   become variable ops) and record the step on it;
2. run the training pipeline on it (epl.parallel.parallelize) under the batch
   contract of the trace (`batch_mode_of`);
3. create the passes' new variables eagerly (epl/runtime/eager_state.py: mirrors,
   shards, loss scale) and renumber the collective keys process-wide;
4. raise the result into the FuncGraph: the outputs return the merged values
   (the loss is the mean over the global batch), the control outputs run every
   replica's update and each unit's stateful forward ops (BatchNormalization's
   moving averages, metrics), a prologue copies the user's variables into the
   copies when they were written since the last sync, and an epilogue counts the
   step's own updates.
A traced function without a training step that writes a variable counts one
write per call (the epilogue's increment), so the steps resync after it.

The batch contract of a traced step: an iterator's `get_next()` inside the step
is drawn once per unit (io.batch_mode "replica", the default: R x M script
batches per call, in unit order), or once and cut (io.batch_mode "global");
a tensor passed in as an argument (what Keras `fit` passes its train step) is
the step's whole batch, cut into R x M units. Both: refused unless global.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import tensorflow as tf
from tensorflow.python.eager import backprop
from tensorflow.python.eager.polymorphic_function import transform
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from epl.hooks import eager_scopes
from epl.env import get_config, is_initialized
from epl.errors import ClusterError, EPLError, ParallelizeError
from epl.hooks import keras as keras_hooks
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase, StrategyKind
from epl.ir.autodiff import inside_internal_autodiff
from epl.ir.func_graph import (IMPORT_SCOPE, WRITE_TYPES_PREFIXES, Lowered, captured_variables, lower,
                               raise_into, writes_captured_variable)
from epl.ir.graph_view import (ITERATOR_OUTPUT_TYPES, PLACEHOLDER_TYPES, ancestors, descendants,
                               find_batch_inputs, variable_written)
from epl.hooks.record import record_of
from epl.ir.record import GraphRecord
from epl.ir.taskgraph import TrainStep
from epl.parallel import parallelize, run_gradient_time_pipeline
from epl.passes import gradient_flow
from epl.passes.replication.forward_state import order_forward_state
from epl.passes.replication.inputs import GLOBAL_MODE, REPLICA_MODE, batch_mode
from epl.passes.split.layouts import SplitRecord
from epl.passes.split.split import CapturedSplitVariable
from epl.runtime import eager_state
from epl.runtime.cluster import local_cluster
from epl.runtime.communicators import make_communicator

_ORIGINAL: dict = {}


# --------------------------------------------------------------------------
# gradient time: the tape
# --------------------------------------------------------------------------


def _tape_gradient(self, target, sources, output_gradients=None,
                   unconnected_gradients=tf.UnconnectedGradients.NONE):
    """GradientTape.gradient; inside a trace under epl.init, colocated tf.gradients."""
    graph = tf.compat.v1.get_default_graph()
    if (not is_initialized() or tf.executing_eagerly() or inside_internal_autodiff()
            or not isinstance(graph, func_graph_module.FuncGraph)):
        return _ORIGINAL["gradient"](self, target, sources, output_gradients,
                                     unconnected_gradients)
    keras_hooks.install()   # the optimizer's apply that follows (a Keras imported late)
    flat_sources = [_as_tf_variable(s) for s in tf.nest.flatten(sources)]
    targets = tf.nest.flatten(target)
    _split_before_autodiff(graph, targets, flat_sources)
    grad_ys = None if output_gradients is None else tf.nest.flatten(output_gradients)
    grads = tf.compat.v1.gradients(targets if len(targets) > 1 else targets[0], flat_sources,
                                   grad_ys=grad_ys, colocate_gradients_with_ops=True,
                                   unconnected_gradients=unconnected_gradients)
    return tf.nest.pack_sequence_as(sources, grads)


def _split_before_autodiff(graph, targets: list, sources: list) -> None:
    """epl.split in a traced step: run the split pass on the finished forward, before
    its gradients are built (as graph mode does at compute_gradients). The step's
    variables are the user's eager variables, captured: the pass reads each that a
    rule needs sharded whole and cuts its value onto the split devices (slice mode,
    epl.passes.split.split.CapturedSplitVariable), so the layer's compute,
    activations and gradients are split, and the variable, its whole gradient and
    its optimizer state stay the user's."""
    record = record_of(graph, create=False)
    if record is None or not record.unsplit_taskgraphs():
        return
    if len(targets) != 1:
        raise ParallelizeError(
            f"the tf.function training step takes the gradient of {len(targets)} targets "
            "with epl.split in the model: the split pass rewrites the forward of one loss. "
            "Sum the losses into one tensor before tape.gradient.")
    names = {id(v.handle): v.name.split(":")[0] for v in list(graph.variables) + sources
             if getattr(v, "handle", None) is not None}
    captured = {}
    for name, variable in captured_variables(graph).items():
        op = graph.get_operation_by_name(name)
        captured[op] = CapturedSplitVariable(op, names.get(id(variable.handle), name),
                                             variable.dtype, variable.shape, variable.device)
    with _tensors_by_identity():
        run_gradient_time_pipeline(graph, record, targets[0], captured)


@contextlib.contextmanager
def _tensors_by_identity():
    """Tensors of a function being traced compare and hash by identity, as a plain
    graph's do (the passes key their tables by tensor); TensorFlow makes them
    unhashable, with elementwise ==, while a FuncGraph is built."""
    saved = tf.Tensor._USE_EQUALITY
    tf.Tensor._USE_EQUALITY = False
    try:
        yield
    finally:
        tf.Tensor._USE_EQUALITY = saved


def _as_tf_variable(source):
    """A Keras 3 variable's tf.Variable (what its ops read); anything else as it is."""
    value = getattr(source, "value", None)
    if not isinstance(source, tf.Variable) and isinstance(value, tf.Variable):
        return value
    return source


# --------------------------------------------------------------------------
# the end of a trace
# --------------------------------------------------------------------------


def _transform(func_graph) -> None:
    """FUNC_GRAPH_TRANSFORMS entry: rewrite a training step; count writes of others.
    Branches and bodies of control flow (TensorFlow applies the transforms to them
    too) are left to the function around them."""
    if not is_initialized() or isinstance(func_graph, ControlFlowFuncGraph):
        return
    eager_scopes.note_eager_use()
    state = record_of(func_graph, create=False)
    if state is not None and state.train_steps and _updates(func_graph, state):
        if _creates_variables(func_graph):
            _refuse_if_run(func_graph)
        else:
            rewrite(func_graph, state)
        return
    captured = set(captured_variables(func_graph))
    writes = [op for op in func_graph.get_operations() if writes_captured_variable(op, captured)]
    if writes:
        _count_writes(func_graph, writes)


def _creates_variables(func_graph) -> bool:
    """True for the trace of a first call that created variables (a Keras optimizer
    building its slots in the step): TensorFlow lifts their initializers out of it
    and traces the step again, and that trace is the one EPL rewrites."""
    with tf.init_scope():
        return not all(bool(resource_variable_ops.var_is_initialized_op(v.handle))
                       for v in captured_variables(func_graph).values())


def _refuse_if_run(func_graph) -> None:
    """Make the trace fail if it runs: TensorFlow runs a variable-creating trace only when
    it cannot lift the initializers out of it, and it would train single-device."""
    with func_graph.as_default():
        refusal = tf.debugging.Assert(tf.constant(False), [tf.constant(
            "EPL: this tf.function creates variables on its first call with initial values "
            "TensorFlow cannot compute outside the function, so it would run that call "
            "unparallelized. Create the variables before the first call: build the model "
            "(call it once, or model.build(input_shape)) and the optimizer "
            "(optimizer.build(model.trainable_variables)).")])
    func_graph.control_outputs.append(refusal)


def _updates(func_graph, state) -> bool:
    """True if a recorded step's gradients (or a Keras optimizer) update a variable."""
    for step in state.train_steps:
        if step.train_op is not None:
            return True
        if any(_writes(op) for op in descendants(_flat_gradients(step))):
            return True
    return False


def _writes(op: tf.Operation) -> bool:
    """True for an op that writes the variable whose handle is its first input."""
    return op.type.startswith(WRITE_TYPES_PREFIXES) and bool(op.inputs) \
        and op.inputs[0].dtype == tf.resource


def _flat_gradients(step) -> list:
    """The tensors of a step's gradients (a sparse one's values and indices)."""
    return [t for grad, _ in step.grads_and_vars if grad is not None
            for t in gradient_flow.tensors_of(grad)]


def _count_writes(func_graph, writes: list) -> None:
    """A function that writes variables outside the steps: each call counts one write
    (epl/runtime/eager_state.py), after its writes."""
    with func_graph.as_default(), tf.control_dependencies(writes):
        bump = eager_state.generation().assign_add(1, read_value=False)
    func_graph.control_outputs.append(bump if isinstance(bump, tf.Operation) else bump.op)


@dataclasses.dataclass
class _StandIn:
    """A variable of the lowered graph as the passes read a TrainStep's variables."""

    op: tf.Operation


def rewrite(func_graph, state) -> None:
    """Steps 1-4 of the module docstring, on a trace whose step updates variables."""
    config = get_config()
    cluster = local_cluster(config)
    _check_eager_devices(cluster.num_local_devices)
    lowered = lower(func_graph)
    graph = lowered.graph
    record = _record_on(lowered, state, config)
    _unbundle_identity_n(graph, record)
    record.forward_writes = _forward_state_writes(lowered, record)
    _join_forward_state(lowered, record, func_graph.variables)
    mode = batch_mode_of(record, config)
    if mode == GLOBAL_MODE:
        _unfold_batch_shapes(graph, record)
        _unbake_reshape_batch(graph, record)
    # pipeline.unit_functions stays off here: the rewritten graph is raised back into
    # the FuncGraph from the copies (outputs read unit 0's copies), which the pass
    # leaves unread; a traced step keeps its copies (epl/passes/unit_functions.py)
    record.rewrite_config = config.updated({"io.batch_mode": mode,
                                            "pipeline.unit_functions": False})
    record.rewrite_config.freeze()
    try:
        result = parallelize(graph, record)
    except EPLError as err:
        raise _in_user_terms(err, lowered, func_graph.variables) from None
    order_forward_state(result.view, result.replication.forward_copies,
                        result.replication.num_micro_batches)
    eager_state.relocate_collective_keys(graph)
    step_state = eager_state.StepState()
    _build(func_graph, lowered, result, step_state)
    step_state.graph = graph   # its library functions stay registered (raise_into)
    func_graph._epl_step_state = step_state   # lives as long as the function


EAGER_REMEDY = (
    "In a tf.function step, a variable every replica should add its part into (a count or "
    "total over the global batch) is created with "
    "tf.Variable(..., aggregation=tf.VariableAggregation.SUM), as Keras 3 metrics create "
    "theirs.")


def _user_variables(lowered: Lowered, variables) -> dict:
    """{name of a variable op of the lowered graph: the user's tf.Variable it stands for},
    for the variables the trace accessed (FuncGraph.variables), matched by handle."""
    by_handle = {id(v.handle): v for v in variables}
    return {name: by_handle[id(captured.handle)] for name, captured in lowered.variables.items()
            if id(captured.handle) in by_handle}


def _in_user_terms(err: EPLError, lowered: Lowered, variables) -> EPLError:
    """`err` of the lowered graph's rewrite with the user's variable names for the
    lowered graph's variable ops, and, for a write EPL cannot keep consistent, the
    remedy of an eager program; an error of the same type."""
    message = str(err)
    users = _user_variables(lowered, variables)
    for name in sorted(users, key=len, reverse=True):
        message = message.replace(f"variable {name} ",
                                  f"variable {users[name].name.split(':')[0]} ")
    if "would hold a different value on each replica" in message:
        message = f"{message} {EAGER_REMEDY}"
    return type(err)(message)


def _check_eager_devices(count: int) -> None:
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if len(devices) < count:
        raise ClusterError(
            f"EPL plans {count} local devices (cluster.virtual_devices) but TensorFlow has "
            f"{len(devices)} ({', '.join(d.name for d in devices)}): the eager context was "
            "initialized before epl.init could create the virtual devices. Call epl.init() "
            "before TensorFlow runs its first op (before creating any tensor, variable or "
            "model).")


def _record_on(lowered: Lowered, state, config) -> GraphRecord:
    """The record of the lowered graph: the FuncGraph's TaskGraphs and steps, each step
    with its train op (the group of its updates)."""
    graph = lowered.graph
    target = GraphRecord(config=config)
    for taskgraph in state.taskgraphs:
        target.add_taskgraph(taskgraph.spec)
    target.splits.extend(_lowered_split(lowered, split) for split in state.splits)
    handles = {id(v.handle): name for name, v in lowered.variables.items()}
    for step in state.train_steps:
        pairs = []
        for grad, var in step.grads_and_vars:
            name = handles.get(id(getattr(_as_tf_variable(var), "handle", None)))
            if name is None:
                continue
            pairs.append((_lowered_gradient(lowered, grad), _StandIn(graph.get_operation_by_name(name))))
        recorded = TrainStep(
            loss=lowered.tensor(step.loss), grads_and_vars=pairs,
            gradient_kwargs=dict(step.gradient_kwargs),
            backward_ops=[lowered.op(op) for op in step.backward_ops],
            from_gradients=True)
        updates = _step_updates(graph, recorded, step, lowered)
        if updates:
            with graph.as_default():
                recorded.train_op = tf.group(*updates, name="EPL_TRAIN_STEP")
            graph_mutation.set_attr(recorded.train_op, PHASE_ATTR,
                                    tf.compat.v1.AttrValue(s=Phase.APPLY.value.encode()))
            replicated = [tg for tg in target.taskgraphs if tg.spec.kind != StrategyKind.SPLIT]
            if replicated and len(replicated) < len(target.taskgraphs):
                # the group of every replica's update belongs to a replicated TaskGraph
                # (copied per replica, each copy chained to it), not to the latest
                # TaskGraph among its updates, which may be a split one (run once)
                graph_mutation.set_attr(recorded.train_op, TASKGRAPH_ATTR, tf.compat.v1.AttrValue(
                    s=replicated[0].name.encode()))
            recorded.derived_train_op = step.train_op is None
        target.train_steps.append(recorded)
    return target


def _unbundle_identity_n(graph: tf.Graph, record: GraphRecord) -> int:
    """Replace each IdentityN the gradients pass through (a Keras 3 optimizer's apply
    passes all of them through one) by one Identity per tensor: the same values, but
    each update then reads its own gradient's op, so it belongs to its variable's
    TaskGraph (epl.ir.graph_view resolves an op's TaskGraph from its inputs' ops;
    through one IdentityN every update would take the latest TaskGraph of all the
    gradients, a split one's: run once, for every replica). Returns how many."""
    flat = [t for step in record.train_steps for t in _flat_gradients(step)]
    bundles = [op for op in descendants(flat) if op.type == "IdentityN"]
    for op in sorted(bundles, key=lambda o: o._id):
        attrs = {k: v for k, v in op.node_def.attr.items() if k.startswith("_epl")}
        with graph.as_default(), graph._attr_scope(attrs), tf.device(op.device), \
                graph.name_scope(None), tf.control_dependencies(op.control_inputs):
            singles = [tf.identity(t, name=f"{op.name}_{i}") for i, t in enumerate(op.inputs)]
        for output, single in zip(op.outputs, singles):
            graph_mutation.rewire_consumers(output, single)
    return len(bundles)


def _lowered_split(lowered: Lowered, split: SplitRecord) -> SplitRecord:
    """The split pass's record of a TaskGraph of the trace, on the lowered graph. Its
    variables stay the user's (slice mode): none was replaced by shards. Each
    variable the split ops alone read (cut onto the devices, or whole: an embedding
    table) is tagged with the split TaskGraph in the lowered graph, so that the
    analysis takes it for a split variable (updated once, not mirrored)."""
    tensor, op = lowered.tensor, lowered.op
    for sharded in split.sliced:
        graph_mutation.set_attr(lowered.graph.get_operation_by_name(sharded), TASKGRAPH_ATTR,
                                tf.compat.v1.AttrValue(s=split.taskgraph.encode()))
    return SplitRecord(
        split.taskgraph, split.plan,
        slicers={tensor(t): dataclasses.replace(s, source=tensor(s.source))
                 for t, s in split.slicers.items()},
        gathers={tensor(t): ([tensor(p) for p in parts], axis)
                 for t, (parts, axis) in split.gathers.items()},
        replaced={op(o) for o in split.replaced}, ops=[op(o) for o in split.ops],
        fallbacks=list(split.fallbacks), unsharded=list(split.unsharded),
        sliced=list(split.sliced))


def _lowered_gradient(lowered: Lowered, grad):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(lowered.tensor(grad.values), lowered.tensor(grad.indices),
                                None if grad.dense_shape is None
                                else lowered.tensor(grad.dense_shape))
    return lowered.tensor(grad)


def _step_updates(graph, recorded: TrainStep, step, lowered: Lowered) -> list:
    """The variable writes of a step: those a Keras optimizer's apply made (its train
    op's inputs), and those computed from the gradients."""
    updates = []
    if step.train_op is not None:
        updates.extend(lowered.op(op) for op in step.train_op.control_inputs)
    for op in sorted(descendants(_flat_gradients(recorded)), key=lambda o: o._id):
        if variable_written(op) is not None and op not in updates:
            updates.append(op)
    return updates


def _forward_state_writes(lowered: Lowered, record: GraphRecord) -> list:
    """The control outputs of the trace (its stateful ops, which run on every call) that
    write a variable outside the step's update: state the forward pass advances
    (Keras 3's dropout-seed generators) and metrics, which every replica and
    micro-batch updates as a step of its own would (epl.ir.graph_view): a metric's
    `update_state(loss)` adds each unit's loss and counts each unit."""
    graph = lowered.graph
    steps = [s for s in record.train_steps if s.train_op is not None]
    updates = ancestors([s.train_op for s in steps])
    return [op for op in (graph.get_operation_by_name(n) for n in lowered.control_outputs)
            if op not in updates and _writes(op)]


def _join_forward_state(lowered: Lowered, record: GraphRecord, variables) -> None:
    """Give the forward state writes of a traced step what a graph-mode script gives its
    own, so that the consistency analysis (epl/ir/consistency.py) treats them alike:
    - the step's train op runs them (as `tf.control_dependencies(UPDATE_OPS)` does);
    - a write of a variable its maker declared summed over replicas
      (`tf.VariableAggregation.SUM`: a Keras 3 metric's total and count) makes the
      variable a shared accumulator (tf.GraphKeys.METRIC_VARIABLES): every unit adds
      its part into the one variable;
    - a write that sets (does not add to) its variable from a value computed from the
      batch but not from a loss (BatchNormalization's moving averages) is a moving
      statistic (tf.GraphKeys.UPDATE_OPS), kept equal on every replica by
      `batch_norm.moving_statistics`;
    - writes that read no batch (Keras 3's dropout-seed state) are the same on every
      replica: each unit runs its copy, micro-batch after micro-batch
      (epl.passes.replication.forward_state);
    - any other (an add of batch values to a variable not declared summed, a write
      computed from the loss) is the analysis's to decide, as in a graph-mode script:
      a value from the loss reads the merged loss, the rest is refused.
    variables: the tf.Variables the trace accessed (FuncGraph.variables)."""
    graph = lowered.graph
    steps = [s for s in record.train_steps if s.train_op is not None]
    if not record.forward_writes or not steps:
        return
    inputs, _ = find_batch_inputs(ancestors(_losses(record)))
    from_batch = descendants(inputs)
    from_loss = descendants([t for op in _losses(record) for t in op.outputs])
    users = _user_variables(lowered, variables)
    for op in record.forward_writes:
        variable = op.inputs[0].op
        eager = users.get(variable.name)
        if eager is not None and eager.aggregation == tf.VariableAggregation.SUM:
            if variable.outputs[0] not in graph.get_collection(
                    tf.compat.v1.GraphKeys.METRIC_VARIABLES):
                graph.add_to_collection(tf.compat.v1.GraphKeys.METRIC_VARIABLES,
                                        variable.outputs[0])
        elif op.type == "AssignVariableOp" and op in from_batch and op not in from_loss:
            graph.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, op)
    graph_mutation.add_control_inputs(steps[0].train_op, list(record.forward_writes))


def _losses(record: GraphRecord) -> list:
    """The loss ops of the record's training steps."""
    return [step.loss.op for step in record.train_steps if step.train_op is not None]


def batch_mode_of(record: GraphRecord, config) -> str:
    """The io.batch_mode the lowered step runs under (module docstring): the configured
    one when its batch comes from an iterator, "global" when it is passed in."""
    losses = _losses(record)
    inputs, _ = find_batch_inputs(ancestors(losses))
    drawn = [t for t in inputs if t.op.type in ITERATOR_OUTPUT_TYPES]
    passed = [t for t in inputs if t.op.type in PLACEHOLDER_TYPES]
    configured = batch_mode(config)
    if not passed:
        return configured
    if drawn and configured == REPLICA_MODE:
        raise ParallelizeError(
            "the tf.function training step reads its batch both from an iterator "
            f"({', '.join(t.name for t in drawn[:3])}) and from tensors passed in "
            f"({', '.join(t.name for t in passed[:3])}): with io.batch_mode 'replica' every "
            "replica and micro-batch draws its own batch from the iterator, but a tensor "
            "passed in is one batch that EPL cuts among them. Pass all of the batch in, "
            "draw all of it from the iterator, or set io.batch_mode to 'global'.")
    return GLOBAL_MODE


def _unfold_batch_shapes(graph: tf.Graph, record: GraphRecord) -> int:
    """Replace each constant holding the static shape of a batch input (what `tf.shape(x)`
    of a static-shaped `x` folds into while the function is traced, as Keras's
    sample counts read it) by a Shape op of that input, so that each unit reads the
    shape of its own cut of the batch. Returns how many were replaced."""
    inputs, batch = find_batch_inputs(ancestors(_losses(record)))
    shapes = {tuple(t.shape.as_list()): t for t in inputs
              if t.op.type in PLACEHOLDER_TYPES and t.shape.is_fully_defined()}
    if batch is None or not shapes:
        return 0
    replaced = 0
    for op in graph.get_operations():
        if op.type != "Const" or op.outputs[0].dtype not in (tf.int32, tf.int64) \
                or op.outputs[0].shape.rank != 1 or not op.outputs[0].consumers():
            continue
        value = tuple(int(v) for v in tf.make_ndarray(op.get_attr("value")).reshape(-1))
        source = shapes.get(value)
        if source is None or value[0] != batch:
            continue
        with graph.as_default(), tf.device(op.device), graph.name_scope(None):
            shape = tf.raw_ops.Shape(input=source, out_type=op.outputs[0].dtype,
                                     name=f"{op.name}_unfolded")
        graph_mutation.rewire_consumers(op.outputs[0], shape)
        replaced += 1
    return replaced


def _unbake_reshape_batch(graph: tf.Graph, record: GraphRecord) -> int:
    """Write -1 for the leading dimension of the constant target shapes of Reshapes of
    batch-derived tensors where that dimension is a multiple of the batch (Keras 3's
    Flatten and Reshape layers build `[batch, ...]`, a Dense on a sequence reshapes to
    `[batch * steps, units]` and back, from the static shape the trace saw): the same
    reshape, and one that each unit's cut of the batch can run. Returns how many
    targets changed."""
    inputs, batch = find_batch_inputs(ancestors(_losses(record)))
    if not batch:
        return 0
    derived = descendants(inputs)
    changed = 0
    for op in graph.get_operations():
        if op.type != "Reshape" or op.inputs[1].op.type != "Const" or op not in derived:
            continue
        data, target = op.inputs[0], op.inputs[1].op
        value = tf.make_ndarray(target.get_attr("value"))
        if value.ndim != 1 or not len(value) or value[0] < batch or value[0] % batch \
                or -1 in value or not data.shape.rank or data.shape[0] is None \
                or data.shape[0] % batch \
                or any(c.type != "Reshape" for c in target.outputs[0].consumers()):
            continue
        value = value.copy()
        value[0] = -1
        graph_mutation.set_attr(target, "value", tf.compat.v1.AttrValue(
            tensor=tf.make_tensor_proto(value)))
        changed += 1
    return changed


# --------------------------------------------------------------------------
# raising the rewritten graph into the function
# --------------------------------------------------------------------------


def _build(func_graph, lowered: Lowered, result, step_state) -> None:
    """Step 4: outputs, control outputs, prologue and epilogue of the rewritten step."""
    graph = lowered.graph
    replication = result.replication
    copies = _copies_by_template(replication.forward_copies)
    outputs = [result.fetch_map.get(t, t) for t in lowered.outputs]
    outputs = [_unit0(t, replication.forward_copies) for t in outputs]
    trains = list(result.view.train_ops)
    extra = _kept_control_outputs(lowered, result, copies)
    _detach_templates(graph, [t.op for t in outputs] + trains + extra, copies,
                      replication.forward_copies)
    inputs = _inputs(func_graph, lowered, result, step_state)
    new_outputs, new_ops = raise_into(func_graph, graph, outputs, trains + extra, inputs)
    new_trains = new_ops[:len(trains)]
    with func_graph.as_default():
        prologue = _prologue(graph, result, inputs, step_state)
        if prologue is not None:
            _after(prologue, func_graph, {t.ref() for t in inputs.values()})
        with tf.control_dependencies(new_trains):
            after = eager_state.generation().assign_add(1)
            synced = step_state.synced.assign(after, read_value=False)
    finals = new_ops + [synced if isinstance(synced, tf.Operation) else synced.op]
    for op, tensor in zip([t.op for t in func_graph.outputs], new_outputs):
        graph_mutation.update_input(op, 0, tensor)
        graph_mutation.remove_all_control_inputs(op)
        graph_mutation.add_control_inputs(op, finals)
    func_graph.control_outputs[:] = finals


def _copies_by_template(forward_copies: dict) -> dict:
    """{template op: [its copy in every unit]}."""
    copies: dict = {}
    for unit in sorted(forward_copies):
        for template, copy in forward_copies[unit].items():
            copies.setdefault(template, []).append(copy)
    return copies


def _unit0(tensor: tf.Tensor, forward_copies: dict) -> tf.Tensor:
    """Unit 0's copy of a template tensor (what a returned tensor of the model, such as
    the logits, returns: replica 0's, as a fetch in graph mode); others as they are."""
    first = forward_copies.get((0, 0), {})
    copy = first.get(tensor.op)
    return copy.outputs[tensor.value_index] if copy is not None else tensor


def _kept_control_outputs(lowered: Lowered, result, copies: dict) -> list:
    """The ops of the lowered graph that replace the FuncGraph's control outputs: every
    unit's copy of a stateful forward op (its moving averages, metric updates), and the
    stateful ops outside the training step as they are; the step's own updates run
    under the train op."""
    graph, view = lowered.graph, result.view
    kept = []
    for name in lowered.control_outputs:
        op = graph.get_operation_by_name(name)
        if op in copies:
            kept.extend(copies[op])
        elif op not in view.step_ops and view.phase_of.get(op) not in (
                Phase.FORWARD, Phase.BACKWARD, Phase.APPLY):
            kept.append(op)
    return kept


def _detach_templates(graph: tf.Graph, roots: list, copies: dict, forward_copies: dict) -> None:
    """Make nothing the rewritten step runs depend on a template forward op (they run on
    the script's batch as one copy more): a data input from one reads unit 0's copy, a
    control input on one waits for every unit's copy instead."""
    templates = set(copies)
    copied = {copy for per_unit in copies.values() for copy in per_unit}
    changed = True
    while changed:
        changed = False
        for op in ancestors(roots):
            if op in templates or op in copied:
                continue
            for index, tensor in enumerate(op.inputs):
                if tensor.op in templates:
                    graph_mutation.update_input(op, index, _unit0(tensor, forward_copies))
                    changed = True
            controls = op.control_inputs
            if any(c in templates for c in controls):
                replaced = [x for c in controls for x in (copies[c] if c in templates else [c])]
                graph_mutation.remove_all_control_inputs(op)
                graph_mutation.add_control_inputs(op, replaced)
                changed = True


def _inputs(func_graph, lowered: Lowered, result, step_state) -> dict:
    """{op name of the rewritten graph: the FuncGraph tensor the import reads for it}:
    the function's placeholders; the user's variables (their captures); every
    variable the passes added, created eagerly and captured."""
    graph = lowered.graph
    placeholders = {op.name: op.outputs[0] for op in func_graph.get_operations()
                    if op.type == "Placeholder"}
    mirrors = {}
    for original, per_replica in result.replication.mirrors.items():
        for op in per_replica[1:]:
            mirrors[op.name] = lowered.variables.get(original.name)
    initial = _initial_values(graph)
    inputs = {}
    for op in graph.get_operations():
        if op.type == "Placeholder" and op.name in placeholders:
            inputs[op.name] = placeholders[op.name]
        elif op.type == "VarHandleOp":
            if op.name in lowered.variables:
                inputs[op.name] = placeholders[op.name]
                continue
            user = mirrors.get(op.name)
            variable = eager_state.mirror(user.handle, op) if user is not None else \
                eager_state.new_variable(op, f"EPL/{op.name}", initial.get(op.name))
            step_state.variables[op.name] = variable
            eager_state.StepState.names.append(op.name)
            with func_graph.as_default():
                inputs[op.name] = func_graph.capture(variable.handle)
    return inputs


def _initial_values(graph: tf.Graph) -> dict:
    """{variable op name: its initial value} for the passes' variables created with a
    constant initial value (AMP's loss scale)."""
    values = {}
    with graph.as_default():
        for variable in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            value = tf.get_static_value(variable.initial_value)
            if value is not None:
                values[variable.op.name] = value
    return values


def _prologue(graph: tf.Graph, result, inputs: dict, step_state):
    """The op that copies the user's variables into the copies (the sync ops of the
    rewritten graph, in a cond) when a write happened since this step last synced: on
    any worker, with several (the sync broadcasts worker 0's values, so every worker
    runs it or none)."""
    syncs = list(result.sync_ops.values())
    if not syncs:
        return None
    stale = tf.not_equal(eager_state.generation().read_value(), step_state.synced.read_value())
    if result.cluster.num_workers > 1:   # the sync broadcasts from worker 0: all or none
        communicator = make_communicator(result.cluster, get_config())
        with tf.device(result.cluster.host_device):
            stale = communicator.workers_all_reduce(tf.cast(stale, tf.int32), "max",
                                                    label="EPL sync needed") > 0

    def sync():
        branch = tf.compat.v1.get_default_graph()
        captured = {name: branch.capture(tensor) for name, tensor in inputs.items()}
        _, copied = raise_into(branch, graph, [], syncs, captured)
        with tf.control_dependencies(copied):
            return tf.constant(True)

    return tf.cond(stale, sync, lambda: tf.constant(False)).op


def _after(prologue: tf.Operation, func_graph, handles: set) -> None:
    """Every op of the rewritten step (the ops imported under epl/) that takes a variable
    handle waits for the prologue."""
    for op in func_graph.get_operations():
        if op.name.startswith(IMPORT_SCOPE + "/") and any(t.ref() in handles for t in op.inputs):
            graph_mutation.add_control_inputs(op, [prologue])


# --------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------


def install() -> None:
    """Register the trace transform and wrap GradientTape.gradient (idempotent)."""
    if _ORIGINAL:
        return
    _ORIGINAL["gradient"] = backprop.GradientTape.gradient
    backprop.GradientTape.gradient = tf.autograph.experimental.do_not_convert(
        functools.wraps(_ORIGINAL["gradient"])(_tape_gradient))
    transform.FUNC_GRAPH_TRANSFORMS.append(_transform)
    eager_state.install()
