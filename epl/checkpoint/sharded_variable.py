"""Sharded variables: one logical variable held as k shards on k devices.

A variable created under `epl.split(k)` is replaced, when the split pass runs
(epl/passes/split/split.py), by k shard variables, each on its device and each
holding a contiguous slice of the full tensor along one axis. The shards:
- start from the slices of the full variable's initial value (the same numbers
  a single-device run starts from);
- carry TensorFlow's `SaveSliceInfo`, so a `tf.compat.v1.train.Saver` saves
  them as ONE tensor under the full variable's name and full shape, and a
  checkpoint written under any split restores under any other, or in a plain
  single-device script;
- are what is stored: they replace the full variable in the global, local
  (and so the initializers, `report_uninitialized_variables` and the default
  Saver see what exists), as TensorFlow's own partitioned variables do.

The user's variable object stays the user's view of the whole (`SplitView`):
it keeps its place in the trainable and model-variable collections (so
`tf.compat.v1.trainable_variables()` lists the user's variables, under their
single-device names), and everything that reads it reads the full
single-device value, assembled from the shards: `sess.run(v)`, `v.eval()`,
`tf.identity(v)` or any op built on `v` after the split, `v.read_value()`,
`tf.gather(v, ids)`. `v.initializer` initializes the shards,
`v.is_initialized()` checks them, `v.assign(value)` (and `assign_add`,
`assign_sub`) writes each shard its slice, and a Saver given the view (a
var_list of trainable variables) saves and restores its shards. The full
variable's own storage is never initialized, so it takes no memory. The
shards stay reachable: `shards_of(v)` and `sharded_of(v)` (the ShardedVariable
record: axis, sizes, offsets). An optimizer given the view (minimize's default
var_list reads the trainable collection) trains its shards
(epl/hooks/optimizer.py maps views to shards before autodiff).

A split group that spans several workers holds only this worker's shards:
reading its view is refused with an error saying so (read its shards).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl.errors import ParallelizeError



@dataclasses.dataclass
class ShardedVariable:
    """A logical variable held as shards.

    name: the full variable's name (what checkpoints use).
    full_shape: the logical shape.
    axis: the axis the shards cut.
    sizes: each shard's extent along `axis` (they sum to full_shape[axis],
      unless the split group spans workers: then these are this worker's).
    shards: the shard variables, in order (shard j on devices[j]).
    """

    name: str
    full_shape: tuple
    axis: int
    sizes: tuple
    shards: list
    offsets: tuple = ()   # where each shard starts along `axis`


def _shard_slice(full_shape, axis, offset, size):
    begin = [0] * len(full_shape)
    extent = list(full_shape)
    begin[axis], extent[axis] = offset, size
    return begin, extent


def _set_slice_info(shard, full_name, full_shape, begin, extent) -> None:
    shard._set_save_slice_info(tf.compat.v1.Variable.SaveSliceInfo(
        full_name, list(full_shape), begin, extent))


def _replace_in_collections(graph: tf.Graph, old, new: list) -> None:
    """Shards where the full variable is stored (global, local), the user's variable
    where it is listed for the user (trainable, model variables)."""
    stored = (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    for key in (tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES,):  # a trainable Variable adds itself
        ref = graph.get_collection_ref(key)
        ref[:] = [v for v in ref if not any(v is shard for shard in new)]
    for key in stored:
        ref = graph.get_collection_ref(key)
        if any(v is old for v in ref):
            index = next(i for i, v in enumerate(ref) if v is old)
            ref[index:index + 1] = new


def shard_existing(variable, axis: int, sizes: list[int], devices: list[str],
                   host_device: str, attrs, offsets: list[int] | None = None) -> ShardedVariable:
    """Replace `variable` (a full tf.Variable) by shards along `axis` on `devices`.

    Shard j's initial value is slice j of the full variable's initial value
    (computed on `host_device`); `attrs(j)` (TaskGraph, slot) are set on the
    ops. offsets: where each shard starts along `axis` (default: one after the
    other from 0; a split group spanning workers holds only its own shards,
    which start further on).
    """
    graph = variable.graph
    full_shape = tuple(variable.shape.as_list())
    full_name = variable.op.name
    if offsets is None:
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    shards = []
    for j, (size, device, offset) in enumerate(zip(sizes, devices, offsets)):
        begin, extent = _shard_slice(full_shape, axis, offset, size)
        with graph._attr_scope(attrs(j)):
            with tf.device(host_device), graph.name_scope(None):
                initial = tf.slice(variable.initial_value, begin, extent,
                                   name=f"{full_name}/EPL_SHARD_{j}_initial")
            with tf.device(device), graph.name_scope(None):
                shard = tf.compat.v1.Variable(
                    initial, name=f"{full_name}/part_{j}", trainable=variable.trainable,
                    dtype=variable.dtype.base_dtype,
                    use_resource=variable.op.type == "VarHandleOp", collections=[])
        _set_slice_info(shard, full_name, full_shape, begin, extent)
        shards.append(shard)
    _replace_in_collections(graph, variable, shards)
    sharded = ShardedVariable(full_name, full_shape, axis, tuple(sizes), shards, tuple(offsets))
    make_view(variable, sharded, host_device, attrs(None))
    return sharded


# --------------------------------------------------------------------------
# the user's variable: a view of its shards
# --------------------------------------------------------------------------


class SplitView:
    """Mixed into the class of a user's variable whose storage the split pass sharded.

    The object stays the user's `tf.Variable` (same name, shape, dtype, and the
    same Python object the user holds); what reads or writes it goes to its
    shards (see the module docstring). `make_view` sets it up.
    """

    _epl_sharded: ShardedVariable
    _epl_full: tf.Tensor | None          # the value `sess.run(v)` and `v.eval()` fetch
    _epl_initializer: tf.Operation
    _epl_refusal: str | None             # why the whole cannot be read (spanning groups)

    # -- reads -------------------------------------------------------------------
    def _epl_whole(self) -> tf.Tensor:
        """A new read of the full value: the shards' values concatenated."""
        if self._epl_refusal:
            raise ParallelizeError(self._epl_refusal)
        sharded = self._epl_sharded
        with tf.name_scope(f"{sharded.name.split('/')[-1]}_EPL_FULL"):
            parts = []
            for shard in sharded.shards:
                with tf.device(shard.device):   # a read runs where its shard is
                    parts.append(shard.value())
            return tf.concat(parts, axis=sharded.axis)

    def value(self):
        return self._epl_whole()

    def read_value(self):
        return tf.identity(self._epl_whole())

    def _read_variable_op(self, no_copy=False):   # resource variables: value reads
        del no_copy
        return self._epl_whole()

    def _as_graph_element(self):
        if self._epl_full is None:
            raise ParallelizeError(self._epl_refusal)
        return self._epl_full

    def eval(self, session=None):
        return self._as_graph_element().eval(session=session)

    def sparse_read(self, indices, name=None):
        return tf.gather(self._epl_whole(), indices, name=name)

    def gather_nd(self, indices, name=None):
        return tf.gather_nd(self._epl_whole(), indices, name=name)

    # -- initialization ----------------------------------------------------------
    @property
    def initializer(self):
        return self._epl_initializer

    def initialized_value(self):
        with tf.compat.v1.init_scope():
            return tf.compat.v1.cond(self.is_initialized(), self.read_value,
                                     lambda: self.initial_value)

    def is_initialized(self, name=None):
        shards = self._epl_sharded.shards
        return tf.reduce_all(tf.stack([tf.compat.v1.is_variable_initialized(s) for s in shards]),
                             name=name)

    # -- writes ------------------------------------------------------------------
    def _epl_write(self, method: str, value, use_locking, name, read_value):
        """Each shard's `method` with its slice of `value` (the full shape)."""
        if self._epl_refusal:
            raise ParallelizeError(self._epl_refusal)
        sharded = self._epl_sharded
        value = tf.convert_to_tensor(value, dtype=self.dtype.base_dtype)
        if not self.shape.is_compatible_with(value.shape):
            raise ValueError(f"cannot {method} a value of shape {value.shape} to variable "
                             f"{sharded.name} of shape {self.shape}")
        pieces = tf.split(value, list(sharded.sizes), axis=sharded.axis)
        with tf.name_scope(name or f"{sharded.name.split('/')[-1]}_EPL_{method}"):
            writes = [getattr(shard, method)(piece, use_locking=use_locking, read_value=False)
                      for shard, piece in zip(sharded.shards, pieces)]
            done = tf.group(*writes)
        if not read_value:
            return done
        with tf.control_dependencies([done]):
            return self.read_value()

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._epl_write("assign", value, use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._epl_write("assign_add", delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._epl_write("assign_sub", delta, use_locking, name, read_value)

    def _ref(self):   # reference variables: there is no one buffer to refer to
        raise ParallelizeError(
            f"variable {self._epl_sharded.name} is split by epl.split into "
            f"{len(self._epl_sharded.shards)} shards and has no single reference tensor (an op "
            "taking a reference, such as tf.compat.v1.assign, would write storage that is never "
            "used). Use the variable's own methods (assign, assign_add, assign_sub), which write "
            "every shard, or its shards (epl.checkpoint.sharded_variable.shards_of(variable)).")

    def _epl_refuse_write(self, method: str):
        raise ParallelizeError(
            f"variable {self._epl_sharded.name} is split by epl.split into "
            f"{len(self._epl_sharded.shards)} shards along axis {self._epl_sharded.axis}: "
            f"Variable.{method} is not supported on it. Use assign (it writes every shard its "
            "slice), or apply the update to its shards (epl.checkpoint.sharded_variable.shards_of(variable)).")

    def _serialize_to_tensors(self):   # object-based checkpoints (tf.train.Checkpoint)
        return {"VARIABLE_VALUE": self.read_value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"], read_value=False)


def _refusing(method: str):
    def refuse(self, *args, **kwargs):
        del args, kwargs
        self._epl_refuse_write(method)
    refuse.__name__ = method
    return refuse


# writes by index or handle that would reach the unused full storage
for _method in ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min",
                "scatter_mul", "scatter_div", "scatter_nd_update", "scatter_nd_add",
                "scatter_nd_sub", "scatter_nd_max", "scatter_nd_min", "batch_scatter_update",
                "count_up_to"):
    setattr(SplitView, _method, _refusing(_method))


_VIEW_CLASSES: dict = {}


def _view_class(cls: type) -> type:
    """The SplitView subclass of a variable class (one per class)."""
    if issubclass(cls, SplitView):
        return cls
    if cls not in _VIEW_CLASSES:
        _VIEW_CLASSES[cls] = type(f"Split{cls.__name__}", (SplitView, cls),
                                  {"__doc__": SplitView.__doc__})
    return _VIEW_CLASSES[cls]


def make_view(variable, sharded: ShardedVariable, host_device: str, attrs=None) -> None:
    """Turn the user's `variable` into a view of `sharded` (see SplitView).

    Builds, on `host_device`, the full value that `sess.run(variable)` fetches
    and the initializer of the shards; attrs: node attributes for those ops (the
    TaskGraph). A split group spanning workers (the shards do not cover the
    variable) gets a view whose reads are refused, naming the rows this worker holds.
    """
    graph = variable.graph
    covered = sum(sharded.sizes) == sharded.full_shape[sharded.axis]
    variable.__class__ = _view_class(type(variable))
    variable._epl_sharded = sharded
    variable._epl_refusal = None if covered else (
        f"variable {sharded.name} (shape {list(sharded.full_shape)}) is split by epl.split over "
        f"several workers; this worker holds only entries {sharded.offsets[0]} to "
        f"{sharded.offsets[-1] + sharded.sizes[-1]} of axis {sharded.axis}, so it cannot read "
        "the whole variable. Read this worker's shards (epl.checkpoint.sharded_variable.shards_of("
        "variable)), or save a checkpoint on every worker.")
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
            graph._attr_scope(attrs or {}):
        with tf.device(host_device):
            variable._epl_full = variable._epl_whole() if covered else None
        variable._epl_initializer = tf.group(*[s.initializer for s in sharded.shards],
                                             name=f"{sharded.name}/EPL_SHARDS_INIT")


def sharded_of(variable) -> ShardedVariable | None:
    """The ShardedVariable behind a user's variable the split pass sharded (else None)."""
    return getattr(variable, "_epl_sharded", None) if isinstance(variable, SplitView) else None


def shards_of(variable) -> list:
    """The shard variables holding `variable` (in order), or [variable] when it is not split."""
    sharded = sharded_of(variable)
    return list(sharded.shards) if sharded is not None else [variable]


def expand_views(var_list) -> list:
    """`var_list` with every split variable replaced by its shards (order kept)."""
    out = []
    for var in var_list:
        out.extend(shards_of(var))
    return out


# --------------------------------------------------------------------------
# savers given the user's variables
# --------------------------------------------------------------------------

_SAVER_ORIGINAL: dict = {}


def install_saver_support() -> None:
    """Let tf.compat.v1.train.Saver take views (idempotent).

    A Saver built from a var_list (a list, e.g. trainable_variables(), or a
    dict of names) saves and restores a view's shards, each as its slice of the
    full variable (one checkpoint entry under the single-device name and full
    shape). Any other object passes through unchanged.
    """
    from tensorflow.python.training.saving import saveable_object_util as util
    if _SAVER_ORIGINAL:
        return
    _SAVER_ORIGINAL["op_list_to_dict"] = util.op_list_to_dict
    _SAVER_ORIGINAL["saveable_objects_for_op"] = util.saveable_objects_for_op

    def op_list_to_dict(op_list, convert_variable_to_tensor=True):
        if isinstance(op_list, (list, tuple, set)):
            op_list = expand_views(tf.nest.flatten(list(op_list)))
        return _SAVER_ORIGINAL["op_list_to_dict"](op_list, convert_variable_to_tensor)

    def saveable_objects_for_op(op, name):
        if sharded_of(op) is not None:
            op = shards_of(op)
        return _SAVER_ORIGINAL["saveable_objects_for_op"](op, name)

    util.op_list_to_dict = op_list_to_dict
    util.saveable_objects_for_op = saveable_objects_for_op


def full_values(session, graph: tf.Graph) -> dict:
    """Values of every global variable of `graph` by checkpoint name, shards reassembled.

    A sharded variable's shards are put back into one array of its full shape
    (as a checkpoint holds it); where this worker holds only some shards (a
    split group spanning workers) the other entries are NaN.
    """
    import numpy as np
    out = {}
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    for variable, value in zip(variables, session.run(variables)):
        info = getattr(variable, "_save_slice_info", None)
        if info is None:
            out[variable.op.name] = value
            continue
        full = out.setdefault(info.full_name, np.full(info.full_shape, np.nan, value.dtype))
        full[tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))] = value
    return out
