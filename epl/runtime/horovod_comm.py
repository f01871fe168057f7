"""Collectives between workers through Horovod (Gloo on CPU, NCCL on GPU).

`HorovodCommunicator` holds one tensor per worker (the worker's already
locally-reduced value) and calls Horovod's graph-mode ops.

Names. Horovod matches collectives across workers by op name, and its
timeline shows that name. Each collective is named
``<kind>_<n>.<what it carries>``: n from a deterministic counter (the same
graph built on every worker gets the same names in the same order), then the
caller's `label` (the user's variables or tensor it carries, e.g.
``allreduce_3.dense_kernel__dense_bias`` for a fused bucket of two
gradients), cut to fit. The label itself, in words, is stored on the op as
the `COLLECTIVE_ATTR` node attribute, where error messages read it
(`collective_label`).

Progress markers. Before each collective a small host op
(`epl.runtime.worker_status.mark_submitted`) records that this worker has
handed the collective to Horovod in the current run: when a step times out,
the workers compare what they submitted and name the one that stalled and the
collective it did not reach (epl.runtime.worker_status).
"""
from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from epl.errors import ClusterError
from epl.ir import graph_mutation
from epl.ir.annotations import COLLECTIVE_ATTR
from epl.runtime import worker_status

_MAX_LABEL_CHARS = 80


def horovod():
    """Import and initialize horovod.tensorflow, or explain how to get it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:  # pragma: no cover - CI builds Horovod
        raise ClusterError(
            "multi-worker training needs Horovod, which is not importable here "
            f"({err}). Run `make setup` (it builds Horovod with scripts/build_horovod.sh).") from err
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def collective_label(op: tf.Operation) -> str:
    """What the collective `op` carries, in words (its op name if EPL did not label it)."""
    try:
        return op.get_attr(COLLECTIVE_ATTR).decode()
    except ValueError:
        return op.name


def op_name(kind: str, count: int, label: str | None) -> str:
    """``<kind>_<count>.<label as an op-name fragment>`` (no "/": Horovod drops scopes)."""
    name = f"{kind}_{count}"
    if not label:
        return name
    fragment = re.sub(r"[^A-Za-z0-9_.\-]", "_", label.replace("/", "_"))
    if len(fragment) > _MAX_LABEL_CHARS:
        fragment = fragment[:_MAX_LABEL_CHARS].rstrip("_.-") + "_etc"
    return f"{name}.{fragment}"


def names_label(names: list[str], limit: int = 3) -> str:
    """``a, b and 3 more`` for a list of variable or tensor names."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return "%s and %d more" % (", ".join(names[:limit]), len(names) - limit)


def names_fragment(names: list[str], limit: int = 3) -> str:
    """The op-name form of `names_label`: ``a__b__c__and_3_more``."""
    names = list(names)
    parts = names[:limit] + ([f"and_{len(names) - limit}_more"] if len(names) > limit else [])
    return "__".join(parts)


class HorovodCommunicator:
    """All-reduce, all-gather, broadcast, reduce-scatter and all-to-all between workers.

    Every method takes an optional `label`: what the tensor carries, in the
    user's terms ("gradients of dense/kernel, dense/bias", "loss"); it names
    the Horovod op and appears in error messages.
    """

    def __init__(self):
        self.hvd = horovod()
        self._count = 0

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.hvd.rank()

    @property
    def size(self) -> int:
        """Number of workers."""
        return self.hvd.size()

    def _call(self, kind: str, label: str | None, tensor: tf.Tensor, build,
              fragment: str | None = None):
        """Create one collective, `build(name, tensor)`, with its progress marker.

        The collective reads `tensor` through an Identity, which the marker
        waits for: a pass that later rewires the collective's input (to a
        replica's copy) rewires the Identity, and the marker follows it. The
        collective does not wait for the marker (it is handed to Horovod at
        once); its result does, so the marker always runs.
        """
        self._count += 1
        name = op_name(kind, self._count, fragment if fragment is not None else label)
        tensor = tf.identity(tensor)
        marker = _progress_marker(name, tensor)
        result = build(name, tensor)
        first = result[0] if isinstance(result, (list, tuple)) else result
        op = _horovod_op(first)
        if op is not None:
            words = "%s of %s" % (_KIND_WORDS.get(kind, kind), label) if label else kind
            graph_mutation.set_attr(op, COLLECTIVE_ATTR, tf.compat.v1.AttrValue(s=words.encode()))
        with tf.control_dependencies([marker]):
            marked = tf.identity(first)
        if isinstance(result, tuple):
            return (marked,) + tuple(result[1:])
        if isinstance(result, list):
            return [marked] + list(result[1:])
        return marked

    def all_reduce(self, tensor: tf.Tensor, op: str = "sum", label: str | None = None,
                   fragment: str | None = None) -> tf.Tensor:
        """Sum, mean or max (op "sum", "mean", "max") of `tensor` over workers."""
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average, "max": self.hvd.Max}[op]
        return self._call("allreduce", label, tensor, lambda name, t: self.hvd.allreduce(
            t, op=hvd_op, name=name, ignore_name_scope=True), fragment)

    def all_gather(self, tensor: tf.Tensor, label: str | None = None,
                   fragment: str | None = None) -> tf.Tensor:
        """Concatenation over workers along axis 0 (first dims may differ)."""
        return self._call("allgather", label, tensor, lambda name, t: self.hvd.allgather(
            t, name=name, ignore_name_scope=True), fragment)

    def broadcast(self, tensor: tf.Tensor, root_rank: int = 0, label: str | None = None,
                  fragment: str | None = None) -> tf.Tensor:
        """`tensor` of worker `root_rank`, on every worker."""
        return self._call("broadcast", label, tensor, lambda name, t: self.hvd.broadcast(
            t, root_rank, name=name, ignore_name_scope=True), fragment)

    def reduce_scatter(self, tensor: tf.Tensor, op: str = "sum", label: str | None = None,
                       fragment: str | None = None) -> tf.Tensor:
        """Reduce over workers, then give worker r the r-th slice along axis 0."""
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average}[op]
        return self._call("reducescatter", label, tensor, lambda name, t: self.hvd.reducescatter(
            t, op=hvd_op, name=name, ignore_name_scope=True), fragment)

    def all_to_all(self, tensor: tf.Tensor, splits: tf.Tensor | None = None,
                   label: str | None = None, fragment: str | None = None) -> tf.Tensor:
        """Send slice i of `tensor` (axis 0, `splits` rows each) to worker i."""
        result = self._call("alltoall", label, tensor, lambda name, t: self.hvd.alltoall(
            t, splits=splits, name=name, ignore_name_scope=True), fragment)
        return result[0] if isinstance(result, tuple) else result


_KIND_WORDS = {"allreduce": "all-reduce", "allgather": "all-gather", "broadcast": "broadcast",
               "reducescatter": "reduce-scatter", "alltoall": "all-to-all"}


def _horovod_op(tensor: tf.Tensor, depth: int = 3) -> tf.Operation | None:
    """The Horovod op that produced `tensor`, through the few ops Horovod's
    Python wrappers add after it (e.g. the division of an Average)."""
    frontier = [tensor.op]
    for _ in range(depth + 1):
        for op in frontier:
            if op.type.startswith("Horovod"):
                return op
        frontier = [t.op for op in frontier for t in op.inputs]
    return None


def _progress_marker(name: str, tensor: tf.Tensor) -> tf.Operation:
    """A host op that runs when `tensor` is ready and records that this worker
    submits collective `name` (epl.runtime.worker_status.mark_submitted)."""

    def mark():
        worker_status.mark_submitted(name)
        return np.int64(0)

    with tf.device("/device:CPU:0"), tf.control_dependencies([tensor.op]):
        return tf.numpy_function(mark, [], tf.int64, stateful=True,
                                 name=f"EPL_submit_{name.split('.', 1)[0]}").op
