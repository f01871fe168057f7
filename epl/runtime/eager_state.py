"""The state of parallelized tf.function steps, created eagerly outside the functions.

A traced training step that EPL rewrote (epl/hooks/function.py) runs on the
user's variables (replica 0's) and on variables the passes added: each replica's
mirror of a variable, ZeRO's shards, AMP's loss scale. A function cannot create
variables each time it runs, so each is an eager `tf.Variable` made here, on its
device, and the rewritten function captures its handle (`new_variable`). A
mirror is shared by every trace that mirrors the same variable onto the same
device (`mirror`): a retrace for a new input signature reuses the replicas it
already has.

Keeping the copies equal to the user's variables. A replica's mirror must hold
the user's value whenever a step starts. The step keeps it so itself (every
replica applies the same update), but the user's variable can also be written
outside it: a checkpoint restore, `model.load_weights`, `set_weights`, an
`assign`, another tf.function (an evaluation that updates metrics), or a step of
another trace. Each such write counts one in a process-wide generation counter
(`bump`; eager writes through the hooks installed by `install`, functions
through the increment epl/hooks/function.py adds to every traced function that
writes a variable); each rewritten step keeps the generation its copies were last
synced at (`StepState.synced`) and, at its start, copies the user's values into
its copies when the two differ, then counts its own updates as a write (other
traces of the same variables resync). Reads of the user's variables never sync
anything: after training they hold the trained values and save as
single-device checkpoints.

Collective keys. TensorFlow's collective ops in functions run with the group
and instance keys built into them, process-wide: two functions may not use one
instance key for different collectives. The passes number the keys per graph;
`relocate_collective_keys` renumbers a rewritten step's keys from one process-wide
allocator, groups by their device sets.
"""
from __future__ import annotations

import functools
import weakref

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from epl.ir import graph_mutation
from epl.runtime.communicators import KeyAllocator

HOST = "/device:CPU:0"
_STATE = {"generation": None}
_KEYS = KeyAllocator()
# id(handle of a user variable) -> weak reference to the handle, for the variables some
# step mirrors (a variable is known by its handle: the tensor a function captures)
_MIRRORED: dict = {}
# (id(handle of a user variable), device) -> the mirror (an eager tf.Variable)
_MIRRORS: dict = {}
_ORIGINAL_METHODS: dict = {}
# ResourceVariable methods that write the variable (the eager writes `install` counts)
_WRITE_METHODS = ("assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub",
                  "scatter_update", "scatter_max", "scatter_min", "scatter_mul", "scatter_div",
                  "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update",
                  "batch_scatter_update", "_restore_from_tensors")


def generation() -> tf.Variable:
    """The process-wide write generation (an int64 variable on the host)."""
    if _STATE["generation"] is None:
        with tf.init_scope(), tf.device(HOST):
            _STATE["generation"] = tf.Variable(0, dtype=tf.int64, trainable=False,
                                               name="EPL_generation")
    return _STATE["generation"]


def bump() -> None:
    """Count a write of a user's variable outside the steps (eager)."""
    generation().assign_add(1)


def new_variable(op: tf.Operation, name: str, initial=None) -> tf.Variable:
    """An eager variable standing for `op` (a VarHandleOp of a rewritten graph): its
    dtype, shape and device, holding `initial` (default: zeros, for state a sync
    fills in before the first step)."""
    dtype, shape = op.get_attr("dtype"), tf.TensorShape(op.get_attr("shape"))
    with tf.init_scope(), tf.device(op.device or HOST):
        value = tf.zeros(shape, dtype) if initial is None else tf.cast(initial, dtype)
        return tf.Variable(value, trainable=False, name=name, shape=shape)


def mirror(handle, op: tf.Operation) -> tf.Variable:
    """The mirror of the user's variable (known by its eager `handle`) on `op`'s device
    (created once per device, shared by every trace); `op` is the mirror's VarHandleOp
    in a rewritten graph."""
    key = (id(handle), op.device)
    found = _MIRRORS.get(key)
    if found is None or _MIRRORED.get(id(handle), lambda: None)() is not handle:
        found = new_variable(op, "EPL_mirror")
        _MIRRORS[key] = found
        _MIRRORED[id(handle)] = weakref.ref(handle, functools.partial(_forget, id(handle)))
    return found


def _forget(key: int, _ref) -> None:
    _MIRRORED.pop(key, None)
    for mirror_key in [k for k in _MIRRORS if k[0] == key]:
        del _MIRRORS[mirror_key]


def is_mirrored(variable) -> bool:
    """True if some rewritten step keeps copies of `variable` (a ResourceVariable)."""
    handle = getattr(variable, "_handle", None)
    ref = _MIRRORED.get(id(handle))
    return ref is not None and ref() is handle


class StepState:
    """What one rewritten trace keeps alive: its eager variables and the generation its
    copies were last synced at (-1: never, so the first call syncs). `created` counts
    the rewritten traces of the process."""

    created = 0
    names: list = []   # the names of every state variable the rewritten traces created

    def __init__(self):
        StepState.created += 1
        self.variables: dict = {}     # name of the VarHandleOp in the rewritten graph -> variable
        self.graph = None             # the rewritten graph (it owns functions the step calls)
        with tf.init_scope(), tf.device(HOST):
            self.synced = tf.Variable(-1, dtype=tf.int64, trainable=False, name="EPL_synced")


def relocate_collective_keys(graph: tf.Graph) -> int:
    """Renumber the group and instance keys of `graph`'s collective ops from the
    process-wide allocator (module docstring); returns how many ops changed."""
    members: dict = {}
    for op in graph.get_operations():
        if "instance_key" in op.node_def.attr and "group_key" in op.node_def.attr:
            members.setdefault(op.get_attr("group_key"), []).append(op)
    instances: dict = {}
    changed = 0
    for key, ops in members.items():
        group = _KEYS.group_key(tuple(sorted({op.device for op in ops})))
        for op in ops:
            old = op.get_attr("instance_key")
            if old not in instances:
                instances[old] = _KEYS.instance_key()
            graph_mutation.set_attr(op, "group_key", tf.compat.v1.AttrValue(i=group))
            graph_mutation.set_attr(op, "instance_key", tf.compat.v1.AttrValue(i=instances[old]))
            changed += 1
    return changed


def install() -> None:
    """Count eager writes of mirrored variables (their ResourceVariable write methods:
    assign, scatter, restore from a checkpoint) in the generation; idempotent."""
    if _ORIGINAL_METHODS:
        return
    for cls in _variable_classes(resource_variable_ops.BaseResourceVariable):
        for name in _WRITE_METHODS:
            original = cls.__dict__.get(name)   # each class that defines its own
            if original is not None:
                _ORIGINAL_METHODS[(cls, name)] = original
                setattr(cls, name, _counting(original))


def _variable_classes(base) -> list:
    """`base` and every subclass of it (ResourceVariable redefines the write methods)."""
    found, stack = [], [base]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


def _counting(method):
    @functools.wraps(method)
    def write(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if _MIRRORED and not tf.inside_function() and is_mirrored(self):
            bump()
        return result
    return tf.autograph.experimental.do_not_convert(write)
