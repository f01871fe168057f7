"""Backward ops of a replica copied from the user's backward ops, not rebuilt by autodiff.

The user's `compute_gradients` built the backward ops of the whole batch (the
"template"); the optimizer hook records them (`TrainStep.backward_ops`). A
replica (or micro-batch) computes the same function on a slice, so its
backward ops are the template's, reading the replica's forward copies, slices
and variables, with one difference: TensorFlow's gradient functions fold
static shapes into constants (`tf.shape(x)` of a fully defined x becomes a
Const, `reduce_mean`'s gradient divides by a constant element count), and the
template's constants hold the global batch. Running tf.gradients again for
every slice shape gives the right constants but costs as much as the user's
whole autodiff (creating every op through the Python API); copying the
template as NodeDefs (epl.ir.clone) is several times cheaper. This module
does the copy and rewrites the batch-derived constants.

Which constants are batch-derived, read from shapes, never from names:
gradients are colocated with their forward op (the optimizer hook forces
`colocate_gradients_with_ops`), so each backward Const names its forward op F
in its colocation group. For the copy of F, the static shapes of F's inputs
and outputs are known (the forward copy was shape-inferred on the slice).
Where a template shape S differs from the copy's shape S', a constant of F's
gradient is rewritten when its value is
- a shape vector equal to S, position by position, except for positions that
  hold 1 (a reduced dimension kept, as reduce gradients build it): the
  positions equal to S take S';
- a scalar equal to S's element count: the count of S';
- a scalar equal to an input's element count divided by an output's (the
  divisor of a mean's gradient): the same ratio for the copy.
A constant that matches two rules with different results, or matches none but
holds a number that changed between the template and the copy (a dimension or
element count of any forward tensor), cannot be told apart from a coincidence:
the copy is then not made, and the caller runs autodiff (always correct). So
is a slice of one row when the template's batch is larger (broadcasting
gradients then reduce differently). Import runs TensorFlow's shape inference
on every copied op, so a constant that still held the wrong shape would fail
the copy (the graph is left unchanged) rather than the training step.

The gates are not copied. With `gate_gradients=GATE_OP` (the TF1 optimizers'
default) autodiff passes the gradients of every op with several inputs through
`tf.tuple`: a NoOp waiting for them all and one Identity per gradient waiting
for the NoOp. They order, and compute nothing; TensorFlow's own graph optimizer
(Grappler's dependency optimizer) removes them again before the first step.
Copied once per unit they were a quarter of a pipeline's graph (a 12-layer
encoder with 16 micro-batches: 17k of 73k ops) and of Grappler's time, so a copy
reads the gradient itself (`gates`: a NoOp with no data input that waits for
stateless ops only, whose copied control outputs are Identities of tensors it
waits for, each with that NoOp as its only control input and waited for by
such gates only; any other shape is copied as it is).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from epl.ir.clone import ConstantPool, OpCopier, copy_node_def
from epl.ir.annotations import Phase
from epl.ir.graph_view import calls_functions, colocation_root

_NUMERIC = frozenset({tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64})


class TemplateBackward:
    """The template's backward ops and their numeric constants, read once per pass."""

    def __init__(self, view, steps):
        replica = set(view.replica_ops)
        self.ops = [op for step in steps for op in step.backward_ops
                    if op in replica and view.phase_of[op] == Phase.BACKWARD]
        self.grads = [g for step in steps for g, _ in step.grads_and_vars if g is not None]
        self.gate_noops, self.gate_identities = gates(self.ops)
        self.constants = []  # (op, value, forward op it is colocated with or None)
        self._sources: dict = {}  # what OpCopier reads from each op, read once for every copy
        for op in self.ops:
            if op.type == "Const" and op.outputs[0].dtype in _NUMERIC:
                value = tf.make_ndarray(op.get_attr("value"))
                if value.ndim <= 1:
                    self.constants.append((op, value, colocation_root(op)))

    @staticmethod
    def unusable(view, steps, amp_ran: bool, checkpoints: dict) -> str | None:
        """Why the template cannot be copied for this graph (None: it can)."""
        if amp_ran:
            return "the amp pass lowered forward ops after the template's autodiff"
        if any(checkpoints.get(id(step)) for step in steps):
            return "gradient checkpointing recomputes the forward pass inside the backward"
        if any(not step.backward_ops for step in steps):
            return "a step's backward ops were not recorded at gradient time"
        if functional_backward(view, steps):
            return ("the backward runs v2 control flow, whose functions refer to the "
                    "template's ops; each unit runs its own autodiff")
        return None

    def constant_values(self, forward_map: dict) -> tuple[dict, str | None]:
        """({template Const: its value for the copy}, None), or ({}, why not)."""
        try:
            changed = _changed_numbers(forward_map)
            values = {}
            for op, value, forward_op in self.constants if changed else ():
                copy = forward_map.get(forward_op) if forward_op is not None else None
                candidates = _rewrites(value, forward_op, copy) if copy is not None else set()
                if len(candidates) > 1:
                    raise _NotCopyable(f"constant {op.name} matches several batch-derived values")
                if candidates:
                    values[op] = np.asarray(candidates.pop(), dtype=value.dtype).reshape(value.shape)
                elif any(_as_number(v) in changed for v in value.reshape(-1)):
                    raise _NotCopyable(f"constant {op.name} holds {value.tolist()}, which may be "
                                       "derived from the batch size")
        except _NotCopyable as why:
            return {}, str(why)
        return values, None

    def write(self, batch, prefix: str, device_fn, input_map: dict, attrs: dict,
              forward_map: dict, constants: dict, stream: int = 0,
              pool: ConstantPool | None = None) -> OpCopier:
        """Write the template's copy under `prefix` into `batch` (a NodeBatch several
        copies may share); after the batch's commit, `gradients` reads it.
        stream: the copy's random stream (epl.ir.clone.reseed). pool: constants
        shared with the other units' copies (epl.ir.clone.ConstantPool)."""
        copier = OpCopier(batch.graph, prefix, device_fn, input_map, attrs, known=forward_map,
                          cache=self._sources, batch=batch, stream=stream, constants=pool)
        for op in self.ops:
            if op in self.gate_noops:
                continue
            if op in self.gate_identities:
                copier.alias(op, op.inputs[0])
                continue
            value = constants.get(op)
            if value is None:
                copier.copy(op)
                continue
            node = copy_node_def(op, "", device_fn(op), attrs)
            node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
            copier.copy_constant(op, node)
        copier.close()
        return copier

    def gradients(self, copier: OpCopier, created: dict, input_map: dict,
                  forward_map: dict) -> tuple[list, list]:
        """(the copy's gradients in template order, its ops in creation order; a
        pooled constant another unit's copy wrote is not one of its ops)."""
        op_map = copier.result(created)
        shared = copier.shared()

        def mapped(tensor):
            if isinstance(tensor, tf.IndexedSlices):
                return tf.IndexedSlices(mapped(tensor.values), mapped(tensor.indices),
                                        None if tensor.dense_shape is None
                                        else mapped(tensor.dense_shape))
            if tensor in input_map:
                return input_map[tensor]
            if tensor.op in self.gate_identities:
                return mapped(tensor.op.inputs[0])
            copy = op_map.get(tensor.op) or forward_map.get(tensor.op)
            return copy.outputs[tensor.value_index] if copy is not None else tensor
        return [mapped(g) for g in self.grads], [op_map[op] for op in self.ops
                                                 if op in op_map and op not in shared]


def gates(ops: list) -> tuple[set, set]:
    """The gates of `tf.tuple` among `ops` (the module docstring): (the NoOps, their
    Identities). A gate's NoOp waits for stateless ops only (dropping it skips no
    side effect), the tensors its Identities pass on among them; an Identity may be
    waited for by other gates' NoOps only (autodiff passes a gradient unchanged
    through an add, whose gate then waits for the previous gate's Identity)."""
    members = set(ops)
    candidates = {}
    for op in ops:
        if (op.type != "NoOp" or op.inputs or not op.control_inputs
                or any(c.op_def.is_stateful for c in op.control_inputs)):
            continue
        outs = [o for o in op._control_outputs if o in members]
        if (outs and all(o.type == "Identity" and list(o.control_inputs) == [op] for o in outs)
                and {o.inputs[0].op for o in outs} <= set(op.control_inputs)):
            candidates[op] = outs
    changed = True
    while changed:   # an Identity some other op waits for keeps its gate
        changed = False
        for noop, outs in list(candidates.items()):
            if any(c not in candidates for o in outs for c in o._control_outputs):
                del candidates[noop]
                changed = True
    return set(candidates), {o for outs in candidates.values() for o in outs}


def functional_backward(view, steps) -> bool:
    """True if a step's backward calls functions (the gradient of v2 control flow):
    their bodies colocate with, and read, the forward ops of the autodiff that
    built them, so no other unit can copy them."""
    return any(calls_functions(op) for step in steps for op in step.backward_ops
               if view.phase_of.get(op) == Phase.BACKWARD)


class _NotCopyable(Exception):
    """The template's constants cannot be rewritten with certainty for this copy."""


def _as_number(value):
    """A numpy scalar as a Python number (floats that are whole compare equal to ints)."""
    number = value.item()
    return int(number) if isinstance(number, float) and number.is_integer() else number


def _static(tensors) -> list:
    """Static shapes (None where not fully defined)."""
    shapes = [t._shape_tuple() for t in tensors]  # a tuple, without building a TensorShape
    return [s if s is not None and None not in s else None for s in shapes]


def _shape_pairs(template: tf.Operation, copy: tf.Operation) -> tuple[list, list]:
    """([(template shape, copy shape)] of the inputs, the same of the outputs).

    A copy may be another op than its template (a folded shape constant
    becomes a Shape op of the slice): inputs are paired only when both have
    the same number of them."""
    inputs = []
    if len(template.inputs) == len(copy.inputs):
        inputs = list(zip(_static(template.inputs), _static(copy.inputs)))
    return inputs, list(zip(_static(template.outputs), _static(copy.outputs)))


def _changed_numbers(forward_map: dict) -> set:
    """Every dimension and element count of a forward tensor that differs between
    the template and its copy (the numbers a batch-derived constant may hold)."""
    changed = set()
    for template, copy in forward_map.items():
        inputs, outputs = _shape_pairs(template, copy)
        for old, new in inputs + outputs:
            if old is None or old == new:
                continue
            if new is None or len(new) != len(old):
                changed.update(old)  # unknown in the copy: every dimension is suspect
            else:
                if any(b == 1 != a for a, b in zip(old, new)):
                    raise _NotCopyable(f"{copy.name} has a dimension of 1 where the template "
                                       "has more (gradients of broadcasts reduce differently)")
                changed.update(a for a, b in zip(old, new) if a != b)
            changed.add(int(np.prod(old)))
    return changed


def _rewrites(value: np.ndarray, template: tf.Operation, copy: tf.Operation) -> set:
    """The values `value` (a constant of template's gradient) takes for the copy."""
    inputs, outputs = _shape_pairs(template, copy)
    pairs = inputs + outputs
    results = set()
    flat = [_as_number(v) for v in value.reshape(-1)]
    for old, new in pairs:
        if old is None or old == new:
            continue
        if new is None or len(new) != len(old):
            raise _NotCopyable(f"{copy.name} has no static shape to rewrite constants with")
        if value.ndim == 1 and len(flat) == len(old) and \
                all(v == a or v == 1 for v, a in zip(flat, old)) and \
                any(v == a != b for v, a, b in zip(flat, old, new)):
            results.add(tuple(b if v == a else v for v, a, b in zip(flat, old, new)))
        if value.ndim == 0 and flat[0] == int(np.prod(old)):
            results.add(int(np.prod(new)))
    if value.ndim == 0:  # a mean's divisor: input count // output count
        for old_in, new_in in inputs:
            for old_out, new_out in outputs:
                if None in (old_in, new_in, old_out, new_out):
                    continue
                ratio = int(np.prod(old_in)) // max(int(np.prod(old_out)), 1)
                new_ratio = int(np.prod(new_in)) // max(int(np.prod(new_out)), 1)
                if flat[0] == ratio and ratio != new_ratio:
                    results.add(new_ratio)
    return results
