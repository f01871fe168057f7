"""Automatic mixed precision, level O1 (`amp.level: "O1"`): the forward rewrite.

Runs on the template forward graph, before the replicate pass: every replica's
forward copy then computes in low precision and its backward, which replicate
rebuilds by autodiff of that copy, follows for free.

- Compute-heavy ops (COMPUTE_HEAVY_TYPES: matrix products and convolutions,
  chosen by op type) whose float arguments are float32 are rebuilt in
  `amp.dtype` (float16 or bfloat16): each float32 input is cast down, the op
  runs in low precision and its outputs are cast back to float32, so every
  other op (softmax, layer norm, losses, reductions) stays in float32, and
  the variables (the master weights), their gradients and the optimizer state
  stay float32. Autodiff of a Cast is a Cast the other way: the gradient
  products run in low precision too, and the gradients arrive in float32.
- An op with no low-precision kernel registered for its device type (read
  from TensorFlow's kernel registry, e.g. BatchMatMulV3 in float16 on CPU)
  stays in float32; the pass names each such op in its notes (the
  `debug.dump_dir` JSON summary of pass "amp") and logs a warning.
- Loss scaling: the gradients are computed with `grad_loss` = the loss scale
  (autodiff starts from scale instead of 1, i.e. the gradient of
  scale x loss), so small float16 gradients do not flush to zero; the fetched
  loss is unchanged. `amp.loss_scale` a number: that fixed scale.
  `"dynamic"` (the default): a float32 scale variable, starting at 2**15,
  halved on a step whose gradients overflow and doubled after
  DYNAMIC_GROWTH_STEPS finite steps in a row. The unscaling, the overflow
  check that every replica and worker agrees on, and the skipping of
  overflowed steps are the unscale and skip_on_overflow passes'
  (epl/passes/unscale.py, epl/passes/skip_on_overflow.py), after the
  gradients exist per replica.

The loss-scale state variables are global variables (saved in checkpoints made
by a Saver built after parallelization) and are also initialized by any
initializer of the model's own variables built before it.
"""
from __future__ import annotations

import logging
import dataclasses

import tensorflow as tf
from tensorflow.python.framework import kernels

from epl.errors import ParallelizeError
from epl.ir import graph_mutation
from epl.ir.annotations import PHASE_ATTR, TASKGRAPH_ATTR, Phase
from epl.ir.graph_view import TrainingView, input_args
from epl.passes.manager import GraphPass, PassContext, PassResult
from epl.planner.step_memory import AMP_LOW_PRECISION_TYPES
from epl.planner.plan import Plan

# the one list of op types AMP lowers, shared with the planner's memory model
_LOG = logging.getLogger(__name__)
COMPUTE_HEAVY_TYPES = AMP_LOW_PRECISION_TYPES
DYNAMIC_INITIAL_SCALE = 2.0 ** 15
DYNAMIC_GROWTH_STEPS = 2000
SCOPE = "EPL_AMP"


@dataclasses.dataclass
class AmpRewrite:
    """What the amp pass did, for the unscale and skip_on_overflow passes.

    scale: the loss scale this step uses (one read shared by every replica), or None.
    scale_var / good_steps_var: the dynamic scale's state (None for a fixed scale).
    converted: template op -> its low-precision replacement.
    fallbacks: ops kept in float32, each with the reason.
    """

    dtype: tf.DType
    scale: tf.Tensor | None
    scale_var: tf.Variable | None
    good_steps_var: tf.Variable | None
    converted: dict
    fallbacks: list


def _float_type_attrs(op: tf.Operation) -> list[str]:
    """The op's type attributes set to float32 (the ones AMP lowers)."""
    names = {arg.type_attr for arg in list(op.op_def.input_arg) + list(op.op_def.output_arg)
             if arg.type_attr}
    return sorted(name for name in names if op.get_attr(name) == tf.float32)


def has_kernel(op_type: str, device_type: str, type_attrs: list[str], dtype: tf.DType) -> bool:
    """True if TensorFlow registered a kernel of `op_type` on `device_type` that
    accepts `dtype` for every one of `type_attrs`."""
    for kernel in kernels.get_registered_kernels_for_op(op_type).kernel:
        if kernel.device_type != device_type:
            continue
        allowed = {c.name: set(c.allowed_values.list.type) for c in kernel.constraint}
        if all(dtype.as_datatype_enum in allowed.get(attr, {dtype.as_datatype_enum})
               for attr in type_attrs):
            return True
    return False


def _device_type(device: str) -> str:
    return tf.DeviceSpec.from_string(device).device_type or "CPU"


class AmpPass(GraphPass):
    """Lowers compute-heavy forward ops to amp.dtype and sets up loss scaling."""

    name = "amp"
    requires = (TrainingView, Plan)
    # the lowered ops take the place of the ops they replace in the view the passes
    # after this one read
    provides = (AmpRewrite, TrainingView)
    after = ("annotate",)

    def validate(self, graph: tf.Graph, ctx: PassContext) -> None:
        setting = self.options.loss_scale
        view = ctx.get(TrainingView)
        if setting is None:
            return
        for step in view.steps:
            if step.loss.shape.rank != 0:
                raise ParallelizeError(
                    f"amp loss scaling needs a scalar loss, but {step.loss.name} has shape "
                    f"{step.loss.shape}. Minimize the mean over examples (tf.reduce_mean).")
        if setting != "dynamic":
            return
        refs = [var for _, var in view.gradients if var.type != "VarHandleOp"]
        if refs:
            raise ParallelizeError(
                f"amp.loss_scale 'dynamic' skips the update of a step whose gradients overflow, "
                f"which needs resource variables, but {refs[0].name} is a reference variable "
                f"({refs[0].type}). Create variables with use_resource=True (or call "
                "tf.compat.v1.enable_resource_variables()), or set a fixed amp.loss_scale.")

    off_note = "amp.level is off"

    def run(self, graph: tf.Graph, ctx: PassContext) -> PassResult:
        options, view, plan = self.options, ctx.get(TrainingView), ctx.get(Plan)
        dtype = tf.as_dtype(options.dtype)
        converted, fallbacks = {}, []
        replacement: dict = {}  # template op -> ops standing in for it (creation order)
        for op in [op for op in view.replica_ops if view.phase_of[op] == Phase.FORWARD]:
            if op.type not in COMPUTE_HEAVY_TYPES:
                continue
            attrs = _float_type_attrs(op)
            if not attrs:
                continue
            device = plan.device(view.taskgraph_of[op], 0)
            if not has_kernel(op.type, _device_type(device), attrs, dtype):
                reason = (f"{op.name} ({op.type}) kept in float32: no {dtype.name} kernel on "
                          f"{_device_type(device)}")
                fallbacks.append(reason)
                _LOG.warning("amp: %s", reason)
                continue
            replacement[op] = self._lower(graph, view, op, attrs, dtype)
            converted[op] = replacement[op][-2]
            if options.debug_log:
                _LOG.info("amp: %s (%s) runs in %s", op.name, op.type, dtype.name)
        view = self._lowered_view(view, replacement)
        ctx.provide(view)
        setting = options.loss_scale
        scale, scale_var, good_var = self._loss_scale(graph, view, setting, ctx.cluster.host_device)
        ctx.provide(AmpRewrite(dtype, scale, scale_var, good_var, converted, fallbacks))
        notes = [f"{len(converted)} ops in {dtype.name}, loss scale {setting}"]
        notes += fallbacks
        return PassResult(added=[o.name for ops in replacement.values() for o in ops],
                          op_map={op.name: [o.name for o in ops] for op, ops in replacement.items()},
                          notes=notes)

    # -- rewrite -------------------------------------------------------------
    @staticmethod
    def _lower(graph, view, op, attrs, dtype) -> list[tf.Operation]:
        """Build op in `dtype` between casts; forward consumers read the float32 result.

        Returns the new ops in creation order (casts of inputs, the op, casts back).
        """
        first = len(graph.get_operations())
        low_args = _low_precision_inputs(op, attrs)
        with tf.device(op.device), tf.name_scope(SCOPE):
            inputs = [tf.cast(t, dtype) if low else t for t, low in zip(op.inputs, low_args)]
            new_attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
            for name in attrs:
                new_attrs[name] = tf.compat.v1.AttrValue(type=dtype.as_datatype_enum)
            out_types = [dtype if out.dtype == tf.float32 else out.dtype for out in op.outputs]
            low = graph._create_op_internal(op.type, inputs, out_types, name=f"{SCOPE}/{op.name}",
                                            attrs=new_attrs, op_def=op.op_def, compute_device=False)
            graph_mutation.set_device(low, op.device)
            if op.control_inputs:
                graph_mutation.add_control_inputs(low, op.control_inputs)
            outputs = [tf.cast(out, tf.float32) if out.dtype == dtype and old.dtype == tf.float32
                       else out for out, old in zip(low.outputs, op.outputs)]
        new_ops = graph.get_operations()[first:]
        for new in new_ops:
            for name in (TASKGRAPH_ATTR, PHASE_ATTR):
                if name in op.node_def.attr:
                    graph_mutation.set_attr(new, name, op.node_def.attr[name])
        for old, new in zip(op.outputs, outputs):
            for consumer in list(old.consumers()):
                if consumer not in new_ops and view.phase_of.get(consumer) == Phase.FORWARD:
                    for index, tensor in enumerate(consumer.inputs):
                        if tensor is old:
                            graph_mutation.update_input(consumer, index, new)
        return new_ops

    @staticmethod
    def _lowered_view(view, replacement: dict):
        """A new TrainingView in which the lowered ops take the place of the ops they
        replace (the passes after this one read it); the driver's analysis itself is
        left as it was."""
        ops = []
        phase_of, taskgraph_of, step_ops = dict(view.phase_of), dict(view.taskgraph_of), \
            set(view.step_ops)
        for op in view.replica_ops:
            if op in replacement:
                for new in replacement[op]:
                    phase_of[new] = Phase.FORWARD
                    taskgraph_of[new] = view.taskgraph_of[op]
                    step_ops.add(new)
                ops.extend(replacement[op])
            else:
                ops.append(op)
        return dataclasses.replace(view, phase_of=phase_of, taskgraph_of=taskgraph_of,
                                   step_ops=step_ops, replica_ops=ops)

    @staticmethod
    def _loss_scale(graph, view, setting, host):
        """The scale tensor every replica's autodiff starts from (and its state)."""
        if setting is None:
            return None, None, None
        scale_var = good_var = None
        with tf.device(host), tf.name_scope(SCOPE + "/"):  # EPL_AMP/loss_scale, EPL_AMP/good_steps
            if setting == "dynamic":
                scale_var = tf.compat.v1.Variable(DYNAMIC_INITIAL_SCALE, dtype=tf.float32,
                                                  trainable=False, use_resource=True,
                                                  name="loss_scale")
                good_var = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False,
                                                 use_resource=True, name="good_steps")
                scale = scale_var.read_value()
                _initialized_with_model(graph, [scale_var, good_var])
            else:
                scale = tf.constant(setting, tf.float32, name="loss_scale")
        for step in view.steps:
            loss = step.loss
            with tf.device(host), tf.name_scope(SCOPE):
                initial = tf.cast(scale, loss.dtype)  # scalar losses (validate)
                user = step.gradient_kwargs.get("grad_loss")
                step.gradient_kwargs = {**step.gradient_kwargs,
                                        "grad_loss": initial * user if user is not None else initial}
        return scale, scale_var, good_var


def _low_precision_inputs(op: tf.Operation, attrs: list[str]) -> list[bool]:
    """Per input of `op`: is its argument typed by one of `attrs` (cast it down)."""
    flags = []
    for arg, width in input_args(op):
        flags.extend([arg.type_attr in attrs] * width)
    return flags


def _initialized_with_model(graph: tf.Graph, variables) -> None:
    """Make the initializers of `variables` run with the model's own initializers
    (an initializer op built before parallelization does not list them), and add
    them to the global variables (savers and initializers built later do)."""
    model_vars = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                  if v not in variables]
    for var in model_vars:
        graph_mutation.add_control_inputs(var.initializer, [v.initializer for v in variables])
