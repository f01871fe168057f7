"""Collectives between workers through Horovod (Gloo on CPU, NCCL on GPU).

`HorovodCommunicator` holds one tensor per worker (the worker's already
locally-reduced value) and calls Horovod's graph-mode ops. Horovod matches
collectives across workers by op name, so names are derived from a
deterministic counter: the same graph built on every worker gets the same
names in the same order.
"""
from __future__ import annotations

import tensorflow as tf

from epl.errors import ClusterError


def horovod():
    """Import and initialize horovod.tensorflow, or explain how to get it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:  # pragma: no cover - CI builds Horovod
        raise ClusterError(
            "multi-worker training needs Horovod, which is not importable here "
            f"({err}). Run `make setup` (it builds Horovod with tools/build_horovod.sh).") from err
    if not hvd.is_initialized():
        hvd.init()
    return hvd


class HorovodCommunicator:
    """All-reduce, all-gather, broadcast, reduce-scatter and all-to-all between workers."""

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

    def _name(self, kind: str) -> str:
        self._count += 1
        return f"EPL_{kind}_{self._count}"

    def all_reduce(self, tensor: tf.Tensor, op: str = "sum") -> tf.Tensor:
        """Sum (or mean) of `tensor` over workers."""
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average}[op]
        return self.hvd.allreduce(tensor, op=hvd_op, name=self._name("allreduce"),
                                  ignore_name_scope=True)

    def grouped_all_reduce(self, tensors: list[tf.Tensor], op: str = "sum") -> list[tf.Tensor]:
        """All-reduce several tensors in one Horovod request."""
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average}[op]
        return self.hvd.grouped_allreduce(tensors, op=hvd_op, name=self._name("grouped_allreduce"),
                                          ignore_name_scope=True)

    def all_gather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Concatenation over workers along axis 0 (first dims may differ)."""
        return self.hvd.allgather(tensor, name=self._name("allgather"), ignore_name_scope=True)

    def broadcast(self, tensor: tf.Tensor, root_rank: int = 0) -> tf.Tensor:
        """`tensor` of worker `root_rank`, on every worker."""
        return self.hvd.broadcast(tensor, root_rank, name=self._name("broadcast"),
                                  ignore_name_scope=True)

    def reduce_scatter(self, tensor: tf.Tensor, op: str = "sum") -> tf.Tensor:
        """Reduce over workers, then give worker r the r-th slice along axis 0."""
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average}[op]
        return self.hvd.reducescatter(tensor, op=hvd_op, name=self._name("reducescatter"),
                                      ignore_name_scope=True)

    def all_to_all(self, tensor: tf.Tensor, splits: tf.Tensor | None = None) -> tf.Tensor:
        """Send slice i of `tensor` (axis 0, `splits` rows each) to worker i."""
        result = self.hvd.alltoall(tensor, splits=splits, name=self._name("alltoall"),
                                   ignore_name_scope=True)
        return result[0] if isinstance(result, tuple) else result
