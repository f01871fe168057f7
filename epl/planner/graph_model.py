"""A training graph as a `ModelSpec`: one layer per TaskGraph (TensorFlow).

`model_from_graph` measures a tf.Graph / GraphDef with the static cost and
memory models (`epl.planner.cost_model`, `epl.planner.step_memory`): per TaskGraph, forward + backward FLOPs, bytes
and activation bytes per example, parameter bytes, and the op types the
cost model does not know (`ModelSpec.unknown_op_types`).  `infer_optimizer`
reads the optimizer from the graph's apply ops.  This is the part of the
planner that needs TensorFlow; `epl.planner.planner` imports it only when
it is given a graph.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import tensorflow as tf

from epl.planner import cost_model as cm
from epl.planner import step_memory
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.planner.roofline import normalize_dtype

_SLOT_OPTIMIZER = {0: "sgd", 1: "momentum", 2: "adam", 3: "centeredrmsprop"}
#: Optimizer apply op types, as cost_model reads them.
_APPLY_TYPE = re.compile(r"^(?:Resource)?(?:Sparse)?Apply(\w+)$")


# --------------------------------------------------------------------------
# From a TensorFlow graph.
# --------------------------------------------------------------------------

def infer_optimizer(graph: Any) -> str | None:
    """The optimizer name ("adam", "sgd", ...) behind the graph's apply ops.

    Reads op types only (ResourceApplyAdam -> "adam"); None when the graph
    has no apply op.  Optimizers with the same slot count map to one name.
    """
    graph = cm.as_graph(graph)
    for op in graph.get_operations():
        match = _APPLY_TYPE.match(op.type)
        if match and match.group(1) in cm.APPLY_OPS:
            slots = cm.APPLY_OPS[match.group(1)][1]
            return _SLOT_OPTIMIZER.get(slots, "adam")
    return None


def _trainable_variable_ops(graph: Any) -> list:
    """Trained variables of a graph without a TRAINABLE_VARIABLES collection:
    the variables apply ops update (their first input), else every
    floating-point variable."""
    updated = {}
    for op in graph.get_operations():
        match = _APPLY_TYPE.match(op.type)
        if match and op.inputs:
            var = cm.variable_op(op.inputs[0])
            if var is not None:
                updated[var.name] = var
    if updated:
        return list(updated.values())
    return [op for op in graph.get_operations() if op.type in cm.VARIABLE_OPS
            and tf.as_dtype(op.get_attr("dtype")).base_dtype.is_floating]


def _tagged_phases(graph: Any) -> bool:
    """Whether any op carries EPL's phase attribute."""
    return any(cm.PHASE_ATTR in op.node_def.attr
               for op in graph.get_operations())


def _analysed_view(graph: Any, record: Any):
    """The TrainingView of a graph EPL recorded a training step on (`record`, its
    epl.ir.record.GraphRecord), or None."""
    from epl.errors import EPLError
    from epl.ir.graph_view import analyze
    if record is None or not record.train_steps:
        return None
    try:
        return analyze(graph, record)
    except EPLError:
        return None


def _static_batch(graph: Any) -> int | None:
    """The batch size of the graph's batch inputs, if static."""
    from epl.errors import ParallelizeError
    from epl.ir.graph_view import find_batch_inputs
    try:
        return find_batch_inputs(set(graph.get_operations()))[1]
    except ParallelizeError:
        return None


class _Measure:
    """Costs of a graph at unknown_dim 1 and 2, per (group, phase)."""

    def __init__(self, values: Mapping[int, Mapping], batch: int | None):
        self.values = values
        self.batch = batch

    def per_example(self, key: Hashable, attr: str) -> float:
        """Per-example figure: the slope in the unknown batch dimension,
        else the static batch's total divided by the batch."""
        one = _field(self.values[1].get(key), attr)
        two = _field(self.values[2].get(key), attr)
        slope = two - one
        if slope > 0:
            return slope
        return one / self.batch if self.batch else one


def _field(value: Any, attr: str) -> float:
    """getattr(value, attr) or 0 when the group is absent."""
    return float(getattr(value, attr)) if value is not None else 0.0


def model_from_graph(graph: Any, view: Any = None,
                     trainable_vars: Any = None, amp_dtype: Any = None,
                     name: str = "graph", record: Any = None) -> ModelSpec:
    """Describe a training graph as a ModelSpec: one layer per TaskGraph.

    Args:
        graph: tf.Graph or GraphDef with forward, backward and apply ops
            (EPL's `_epl_taskgraph` / `_epl_phase` attributes where
            present).
        view: its epl.ir.graph_view.TrainingView (phases, TaskGraphs and
            batch size from the analysis); analysed from `record` when None.
        trainable_vars: the trained variables; default the graph's
            collection, else the variables its apply ops update.
        amp_dtype: float16/bfloat16 when training under AMP (halves float32
            activations; peak FLOP/s of that dtype).
        name: the model's label.
        record: the graph's epl.ir.record.GraphRecord (what EPL recorded while
            the graph was built), which the view is analysed from when `view` is
            None; the view's split records size the split dimension.

    Returns:
        ModelSpec: per TaskGraph (in order), forward+backward FLOPs, bytes
        and activation bytes per example (the slope in the unknown batch
        dimension, or the static batch's figures divided by the batch),
        checkpointed activations and replicated parameter bytes; the
        optimizer its apply ops use.  The update's cost is left to the
        planner.
    """
    graph = cm.as_graph(graph)
    if view is None:
        view = _analysed_view(graph, record)
    group_fn, phase_fn, order = _group_functions(graph, view)
    batch = view.global_batch_size if view is not None else \
        _static_batch(graph)
    pair = lambda op: (group_fn(op), phase_fn(op))  # noqa: E731
    costs = _Measure({u: cm.graph_cost(graph, pair, unknown_dim=u)
                      for u in (1, 2)}, batch)
    variables = trainable_vars
    if variables is None and not graph.get_collection(
            "trainable_variables"):
        variables = _trainable_variable_ops(graph)
    memory = {ck: _Measure({u: step_memory.memory_estimate(
        graph, variables, "sgd", group_fn=group_fn, checkpointing=ck,
        amp_dtype=amp_dtype, phase_fn=phase_fn, unknown_dim=u)
        for u in (1, 2)}, batch) for ck in (False, True)}
    split_names = {tg.name for tg in getattr(view, "split_taskgraphs", [])} \
        if view is not None else set()
    layers = tuple(_graph_split_layer(key, costs, memory) if key in split_names
                   else _graph_layer(key, stage, costs, memory)
                   for stage, key in enumerate(order))
    split_units = _split_dimension(split_names, getattr(view, "split_records", ()))
    # the figures come from the step's phases; initializers, savers (cm.OTHER) do not count
    costed = [c for (_, phase), c in costs.values[1].items() if phase != cm.OTHER]
    exact = all(c.exact for c in costed)
    unknown = _unknown_op_types(costed)
    notes = [] if exact else ["some shapes or op types were not known to "
                              "the cost model; figures are estimates"]
    if not _tagged_phases(graph) and view is None:
        notes.append("the graph has no EPL phase tags: activation memory "
                     "is not estimated (build it under epl.init)")
    dtype = normalize_dtype(amp_dtype) if amp_dtype else "float32"
    trained = graph.get_collection("trainable_variables") or variables or []
    return ModelSpec(name=name, layers=layers, compute_dtype=dtype,
                     batch_size=batch, exact=exact, notes=tuple(notes),
                     optimizer=infer_optimizer(graph), split_units=split_units,
                     unknown_op_types=unknown,
                     model_layers=model_layer_names([_op_name(v) for v in trained]))


def _op_name(variable: Any) -> str:
    """The op name of a tf.Variable or variable op."""
    return variable.op.name if hasattr(variable, "op") else variable.name


def model_layer_names(variable_names: list[str]) -> tuple[str, ...]:
    """The model's layers as its variables' scopes name them, in order of their first
    variable: the first scope below the scopes all variables share ("hidden1" for
    "hidden1/kernel"; a variable in no scope of its own is a layer by itself; when
    every variable is in the same innermost scope, that scope is the one layer).

    For reports only (the planner places TaskGraphs): a name is the label a layer
    built with tf.compat.v1.layers, Keras or variable_scope gives its variables."""
    parts = [name.split("/") for name in variable_names]
    if not parts:
        return ()
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    if shared and all(len(p) == shared + 1 for p in parts):
        return (parts[0][shared - 1],)   # one layer: every variable sits in its scope
    names: list[str] = []
    for path in parts:
        if path[shared] not in names:
            names.append(path[shared])
    return tuple(names)


def _unknown_op_types(groups: Any) -> tuple[tuple[str, int], ...]:
    """(op type, count) of the op types without a cost formula over the
    groups' GroupCosts, most frequent first (then by name)."""
    counts: dict[str, int] = {}
    for group in groups:
        for name in group.unmodelled_op_types:
            counts[name] = counts.get(name, 0) + group.op_types.get(name, 0)
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _graph_split_layer(key: Hashable, costs: _Measure,
                       memory: Mapping[bool, _Measure]) -> LayerSpec:
    """The LayerSpec of a split TaskGraph (epl.split): all of it is the split part.

    Its FLOPs and bytes are summed over the shards (each device does its
    shard's share for every example), its parameters are the whole of the
    sharded variables.
    """
    fwd, bwd = (key, cm.FORWARD), (key, cm.BACKWARD)
    return LayerSpec(
        name=str(key),
        split_flops_per_example=costs.per_example(fwd, "flops")
        + costs.per_example(bwd, "flops"),
        split_bytes_per_example=costs.per_example(fwd, "bytes")
        + costs.per_example(bwd, "bytes"),
        split_activation_bytes_per_example=memory[False].per_example(
            key, "activations"),
        split_parameter_bytes=_field(memory[False].values[1].get(key),
                                     "parameters"),
        op_counts=_op_counts(key, costs))


def _op_counts(key: Hashable, costs: _Measure) -> tuple[tuple[str, int], ...]:
    """(op type, count) of one replica of TaskGraph `key` per step: its
    forward, backward and apply groups' ops, by type (sorted)."""
    counts: dict[str, int] = {}
    for phase in (cm.FORWARD, cm.BACKWARD, cm.APPLY):
        group = costs.values[1].get((key, phase))
        for op_type, count in (group.op_types if group else {}).items():
            counts[op_type] = counts.get(op_type, 0) + count
    return tuple(sorted(counts.items()))


def _split_dimension(split_names: set, split_records) -> int:
    """Units of the split dimension (the smallest over the split TaskGraphs): the full
    extent of the axis the split pass sharded (classes, experts), from its records."""
    if not split_names:
        return 0
    extents = [sum(v.sizes) for record in split_records
               if record.taskgraph in split_names for v in record.variables.values()]
    return min(extents) if extents else 0


def _graph_layer(key: Hashable, stage: int, costs: _Measure,
                 memory: Mapping[bool, _Measure]) -> LayerSpec:
    """The LayerSpec of one TaskGraph."""
    fwd, bwd = (key, cm.FORWARD), (key, cm.BACKWARD)
    return LayerSpec(
        name=str(key) if key is not None else "model",
        flops_per_example=costs.per_example(fwd, "flops")
        + costs.per_example(bwd, "flops"),
        bytes_per_example=costs.per_example(fwd, "bytes")
        + costs.per_example(bwd, "bytes"),
        recompute_flops_per_example=costs.per_example(fwd, "flops"),
        activation_bytes_per_example=memory[False].per_example(
            key, "activations"),
        checkpointed_activation_bytes_per_example=memory[True].per_example(
            key, "activations"),
        parameter_bytes=_field(memory[False].values[1].get(key),
                               "parameters"),
        stage=stage, op_counts=_op_counts(key, costs))


def _group_functions(graph: Any, view: Any
                     ) -> tuple[Callable, Callable, list[Hashable]]:
    """(op -> TaskGraph key, op -> phase, TaskGraph keys in order)."""
    if view is not None:
        taskgraph_of, phase_of = view.taskgraph_of, view.phase_of

        def group_fn(op):
            taskgraph = taskgraph_of.get(op)
            return taskgraph.name if taskgraph is not None else \
                view.taskgraphs[0].name

        def phase_fn(op):
            phase = phase_of.get(op)
            return phase.value if phase is not None else cm.OTHER

        return group_fn, phase_fn, [tg.name for tg in view.taskgraphs] + [
            tg.name for tg in getattr(view, "split_taskgraphs", [])]
    order: list[Hashable] = []
    for op in graph.get_operations():
        key = cm.taskgraph_of(op)
        if key is not None and key not in order:
            order.append(key)
    phase_fn = _structural_phases(graph)
    if not order:
        return (lambda op: None), phase_fn, [None]
    resolved = _structural_taskgraphs(graph, order)
    return (lambda op: resolved[op]), phase_fn, order


def _structural_taskgraphs(graph: Any, order: list[Hashable]
                           ) -> dict[Any, Hashable]:
    """op -> TaskGraph for a graph without an EPL analysis.

    The `_epl_taskgraph` attribute where set; else the TaskGraph of the op
    it is colocated with (backward and apply ops); else the latest
    TaskGraph among its inputs; else the first (graph_view's rules).
    """
    from epl.ir.graph_view import colocation_root
    rank = {key: i for i, key in enumerate(order)}
    resolved: dict[Any, Hashable] = {}
    for op in graph.get_operations():
        key = cm.taskgraph_of(op)
        if key is None:
            root = colocation_root(op)
            key = resolved.get(root) if root is not None else None
        if key is None:
            producers = [resolved[t.op] for t in op.inputs
                         if t.op in resolved]
            key = max(producers, key=rank.__getitem__) if producers \
                else order[0]
        resolved[op] = key
    return resolved


def _structural_phases(graph: Any) -> Callable:
    """op -> phase for a graph without an EPL analysis (e.g. a GraphDef).

    Ops tagged "backward"/"apply" keep their tag, as do untagged optimizer
    apply ops ("apply").  With backward tags present, the untagged ops the
    backward ops need (data inputs, transitively: the forward pass, the
    loss and the input pipeline) are "forward" and the rest (initializers,
    savers) "other"; with none, every untagged op counts as forward.
    """
    phases: dict[Any, str] = {}
    backward = []
    for op in graph.get_operations():
        tag = cm.phase_of(op)
        if tag in (cm.BACKWARD, cm.APPLY):
            phases[op] = tag
            backward += [op] if tag == cm.BACKWARD else []
        elif _APPLY_TYPE.match(op.type):
            phases[op] = cm.APPLY
    if not backward:
        return lambda op: phases.get(op, cm.FORWARD)
    stack = [t.op for op in backward for t in op.inputs]
    while stack:
        op = stack.pop()
        if op in phases:
            continue
        phases[op] = cm.FORWARD
        stack.extend(t.op for t in op.inputs)
    return lambda op: phases.get(op, cm.OTHER)
