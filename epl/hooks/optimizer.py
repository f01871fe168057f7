"""Gradient time: what EPL records when the optimizer builds the training step.

`compute_gradients` runs with gradients colocated with their forward ops (so
each backward op points at its forward op through its colocation group, which
is how it inherits the forward op's TaskGraph) and tags every op it creates
with phase "backward". `apply_gradients` tags its ops with phase "apply". Both
record the step (loss, gradients, train op) in the graph's GraphState.

The user's own `tf.gradients` / `tf.compat.v1.gradients` (BERT's
optimization.py, EPL's set_default_scope_test: gradients, clipping, then an
optimizer whose apply_gradients is overridden with its own assign ops) is
recorded too, colocated, as a candidate step: analysis
(epl.ir.graph_view.derive_train_op) confirms it when its gradients feed
variable updates and finds the op that runs them (the train op); otherwise
(a gradient penalty inside the loss) it stays part of the forward pass.
EPL's own autodiff (`internal_autodiff`) is never recorded.
"""
from __future__ import annotations

import functools
import inspect

import tensorflow as tf

from epl.env import get_config, is_initialized
from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, Phase, StrategyKind
from epl.ir.autodiff import inside_internal_autodiff, internal_autodiff
from epl.hooks.record import check_graph_mode, record_of
from epl.ir.taskgraph import TrainStep
from epl.parallel import run_gradient_time_pipeline
from epl.checkpoint.sharded_variable import expand_views, sharded_of

_Optimizer = tf.compat.v1.train.Optimizer
_ORIGINAL = {}
def _phase_attr(phase: Phase) -> tf.compat.v1.AttrValue:
    return tf.compat.v1.AttrValue(s=phase.value.encode())


def _tag_new_ops(graph: tf.Graph, first: int, phase: Phase) -> None:
    """Set the phase attr on every op created since op count `first`."""
    value = _phase_attr(phase)
    for op in graph.get_operations()[first:]:
        if PHASE_ATTR not in op.node_def.attr:
            graph_mutation.set_attr(op, PHASE_ATTR, value)


def compute_gradients(self, loss, var_list=None, gate_gradients=_Optimizer.GATE_OP,
                      aggregation_method=None, colocate_gradients_with_ops=False,
                      grad_loss=None):
    """Optimizer.compute_gradients, colocated and tagged; records the step."""
    if not is_initialized():
        return _ORIGINAL["compute_gradients"](
            self, loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
    del colocate_gradients_with_ops  # always colocated: backward ops follow forward ops
    check_graph_mode("Optimizer.compute_gradients under EPL")
    graph = loss.graph
    var_list = split_before_autodiff(graph, loss, var_list)
    first = len(graph.get_operations())
    with internal_autodiff():
        grads_and_vars = _ORIGINAL["compute_gradients"](
            self, loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method, colocate_gradients_with_ops=True,
            grad_loss=grad_loss)
    sparse_as_dense = bool(get_config().get("communication.sparse_as_dense"))
    if sparse_as_dense:
        grads_and_vars = [(_densify(g), v) for g, v in grads_and_vars]
    _tag_new_ops(graph, first, Phase.BACKWARD)
    kwargs = dict(gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                  grad_loss=grad_loss, sparse_as_dense=sparse_as_dense)
    record_of(graph).train_steps.append(
        TrainStep(loss=loss, grads_and_vars=list(grads_and_vars), gradient_kwargs=kwargs,
                  backward_ops=graph.get_operations()[first:]))
    return grads_and_vars


def split_before_autodiff(graph: tf.Graph, loss: tf.Tensor, var_list):
    """Run the split pass (epl/passes/split/split.py) on the finished forward graph,
    when the graph has split TaskGraphs not split yet.

    Returns the variables to differentiate: var_list (None: the trainable
    collection and trainable resource variables, as the optimizer reads them)
    with every variable the split pass sharded replaced by its shards
    (epl.checkpoint.sharded_variable: the user's variable object is a view of its
    shards), also for an optimizer created after an earlier split. A graph
    without split variables gets var_list unchanged.
    """
    record = record_of(graph)
    if record.unsplit_taskgraphs():
        run_gradient_time_pipeline(graph, record, loss)
    if not record.splits:
        return var_list
    if var_list is None:
        var_list = (graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
                    + graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
    return expand_views(tf.nest.flatten(var_list))


def _densify(grad):
    """A dense gradient for an IndexedSlices one (communication.sparse_as_dense)."""
    if isinstance(grad, tf.IndexedSlices):
        with tf.compat.v1.colocate_with(grad.values):
            return tf.convert_to_tensor(grad)
    return grad


def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Optimizer.apply_gradients, tagged as the apply phase; records the train op."""
    if not is_initialized():
        return _ORIGINAL["apply_gradients"](self, grads_and_vars, global_step=global_step, name=name)
    grads_and_vars = tuple(shard_pairs(grads_and_vars))
    graph = _graph_of(grads_and_vars)
    if record_of(graph).parallelized:
        raise ParallelizeError(
            "Optimizer.apply_gradients was called on a graph EPL has already rewritten (its "
            "first session, epl.parallelize, or tf-keras's fit): a training step built after "
            "the rewrite would train one replica's copy on its share of the batch, not the "
            "parallel model. Build every training step before the first session.")
    first = len(graph.get_operations())
    train_op = _ORIGINAL["apply_gradients"](self, grads_and_vars, global_step=global_step, name=name)
    _tag_new_ops(graph, first, Phase.APPLY)
    record = record_of(graph)
    step = _matching_step(record, grads_and_vars)
    if step is None:
        step = TrainStep(loss=None, grads_and_vars=list(grads_and_vars))
        record.train_steps.append(step)
    step.train_op = train_op if isinstance(train_op, tf.Operation) else train_op.op
    return train_op


def _graph_of(grads_and_vars) -> tf.Graph:
    for grad, var in grads_and_vars:
        if grad is not None:
            return grad.graph
    return tf.compat.v1.get_default_graph()


def _matching_step(record, grads_and_vars):
    """The recorded step whose gradients the apply call updates its variables with
    (latest first): one whose variables it updates, from values computed from that
    step's gradients. An apply call fed from other values (the accumulators of an
    accumulate-then-apply wrapper, read in a later session.run) is a step of its own."""
    applied = {id(v) for _, v in grads_and_vars}
    for step in reversed(record.train_steps):
        if step.train_op is None and {id(v) for _, v in step.grads_and_vars} & applied \
                and _computed_from(grads_and_vars, step):
            return step
    return None


def _computed_from(grads_and_vars, step) -> bool:
    """True if a gradient of the apply call is one of `step`'s gradients or is computed
    from one (clipping, scaling) through data edges. Only ops created since the step's
    autodiff are searched (its gradients are among them)."""
    targets = set()
    for grad, _ in step.grads_and_vars:
        for tensor in ([grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices)
                       else [grad] if grad is not None else []):
            targets.add(tensor.op)
    if not targets:
        return False
    first = min(op._id for op in targets)
    stack = []
    for grad, _ in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            stack += [grad.values.op, grad.indices.op]
        elif isinstance(grad, tf.Tensor):
            stack.append(grad.op)
    seen = set()
    while stack:
        op = stack.pop()
        if op in targets:
            return True
        if op in seen or op._id < first:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return False


def _user_gradients(original, *args, **kwargs):
    """tf.gradients / tf.compat.v1.gradients as the user calls them, recorded.

    Gradients are colocated with their forward ops (as compute_gradients'),
    and the call is recorded as a candidate training step: the loss (`ys`, one
    scalar), the (gradient, variable) pairs of the `xs` that are variables, the
    ops it created and how it was called.
    """
    if not is_initialized() or inside_internal_autodiff() or tf.executing_eagerly():
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    if "colocate_gradients_with_ops" in call:
        call["colocate_gradients_with_ops"] = True
    ys, xs = call["ys"], call["xs"]
    graph = tf.compat.v1.get_default_graph()
    loss = ys[0] if isinstance(ys, (list, tuple)) and len(ys) == 1 else ys
    variables = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    if isinstance(loss, tf.Tensor) and _has_split(graph):   # split the forward first
        split_before_autodiff(graph, loss, variables)
        call["xs"] = expand_views(variables)
    first = len(graph.get_operations())
    with internal_autodiff():
        grads = original(*bound.args, **bound.kwargs)
    sparse_as_dense = bool(get_config().get("communication.sparse_as_dense"))
    if sparse_as_dense:   # as compute_gradients: the script gets (and reduces) dense ones
        grads = [_densify(g) for g in grads]
    differentiated = (list(call["xs"]) if isinstance(call["xs"], (list, tuple))
                      else [call["xs"]])   # tf.gradients(y, x) takes one tensor too
    pairs = [(g, x) for g, x in zip(grads, differentiated) if isinstance(x, tf.Variable)]
    backward = graph.get_operations()[first:]   # not the concatenation of shards' gradients
    grads = _whole_gradients(grads, variables, differentiated)
    if isinstance(loss, tf.Tensor) and pairs:
        grad_ys = call.get("grad_ys")
        kwargs_ = dict(gate_gradients=_Optimizer.GATE_OP if call.get("gate_gradients")
                       else _Optimizer.GATE_NONE,
                       aggregation_method=call.get("aggregation_method"),
                       grad_loss=grad_ys[0] if isinstance(grad_ys, (list, tuple)) else grad_ys,
                       sparse_as_dense=sparse_as_dense)
        record_of(graph).train_steps.append(TrainStep(
            loss=loss, grads_and_vars=pairs, gradient_kwargs=kwargs_,
            backward_ops=backward, from_gradients=True))
    return grads


def _has_split(graph: tf.Graph) -> bool:
    """Whether the graph has epl.split TaskGraphs (whose forward the split pass rewrites
    before autodiff)."""
    record = record_of(graph, create=False)
    return any(tg.spec.kind == StrategyKind.SPLIT for tg in (record.taskgraphs if record else ()))


def _whole_gradients(grads: list, variables: list, differentiated: list) -> list:
    """What tf.gradients returns for the script's `variables` (one gradient each) from the
    gradients of `differentiated` (the variables with every split one replaced by its
    shards): a split variable's gradient is its shards' gradients along the split axis."""
    if len(differentiated) == len(variables):
        return grads
    record = record_of(tf.compat.v1.get_default_graph())
    out, position = [], 0
    for variable in variables:
        sharded = sharded_of(variable)
        count = len(sharded.shards) if sharded is not None else 1
        mine = grads[position:position + count]
        position += count
        if sharded is None or any(g is None for g in mine):
            out.append(mine[0] if sharded is None else None)
            continue
        whole = _concat_gradients(mine, sharded)
        record.shard_gradients[_key(whole)] = list(zip(mine, sharded.shards))
        out.append(whole)
    return out


def _key(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _concat_gradients(parts: list, sharded):
    """The whole gradient from its shards' (dense: concatenated along the split axis;
    sparse: rows of the full table, offset by each shard's start)."""
    with tf.compat.v1.colocate_with(None, ignore_existing=True), tf.name_scope("EPL_SHARD_GRADS"):
        if all(isinstance(p, tf.IndexedSlices) for p in parts) and sharded.axis == 0:
            offsets = sharded.offsets or tuple(sum(sharded.sizes[:j]) for j in range(len(parts)))
            return tf.IndexedSlices(
                tf.concat([p.values for p in parts], axis=0),
                tf.concat([p.indices + tf.cast(o, p.indices.dtype)
                           for p, o in zip(parts, offsets)], axis=0),
                tf.constant(list(sharded.full_shape), dtype=tf.int64))
        dense = [tf.convert_to_tensor(p) for p in parts]
        return tf.concat(dense, axis=sharded.axis)


def shard_pairs(grads_and_vars) -> list:
    """`grads_and_vars` with each (gradient, split variable) pair replaced by its shards'
    pairs: the shards' own gradients where the gradient is the one tf.gradients
    returned, else the gradient cut along the split axis (after clipping)."""
    out, known = [], None
    for grad, var in grads_and_vars:
        sharded = sharded_of(var) if var is not None else None
        if sharded is None or grad is None:
            out.append((grad, var))
            continue
        known = known if known is not None else record_of(_key(grad).graph).shard_gradients
        if _key(grad) in known:
            out.extend(known[_key(grad)])
        else:
            dense = tf.convert_to_tensor(grad)
            out.extend(zip(tf.split(dense, list(sharded.sizes), axis=sharded.axis),
                           sharded.shards))
    return out


def install() -> None:
    """Wrap the tf.compat.v1 Optimizer methods and tf.gradients (idempotent)."""
    if _ORIGINAL:
        return
    _ORIGINAL["compute_gradients"] = _Optimizer.compute_gradients
    _ORIGINAL["apply_gradients"] = _Optimizer.apply_gradients
    _Optimizer.compute_gradients = functools.wraps(_ORIGINAL["compute_gradients"])(compute_gradients)
    _Optimizer.apply_gradients = functools.wraps(_ORIGINAL["apply_gradients"])(apply_gradients)
    for module in _gradients_modules():
        original = module.gradients
        _ORIGINAL[f"gradients:{module.__name__}"] = original
        # never converted by autograph when a tf.function calls it
        module.gradients = tf.autograph.experimental.do_not_convert(functools.wraps(original)(
            functools.partial(_user_gradients, original)))


def _gradients_modules() -> list:
    """Every TensorFlow API module whose `gradients` is tf.gradients or
    tf.compat.v1.gradients. `tf.compat.v1` is not one module: tf-keras calls
    `tf.compat.v1.gradients` through `tensorflow.compat.v2`, whose `compat.v1` is
    another module object (tensorflow._api.v2.compat.v2.compat.v1) than
    `tensorflow.compat.v1`; each alias is wrapped so that every caller is recorded."""
    originals = {tf.gradients, tf.compat.v1.gradients}
    modules = [tf, tf.compat.v1, tf.compat.v2, tf.compat.v2.compat.v1, tf.compat.v1.compat.v1,
               tf.compat.v1.compat.v2]
    out = []
    for module in modules:
        if module not in out and getattr(module, "gradients", None) in originals:
            out.append(module)
    return out
