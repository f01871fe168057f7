"""Check, before the first training step, that every worker built the same collectives.

Horovod matches collectives across workers by name, in whatever order the
workers submit them. When workers build different graphs (one has an extra
layer, a different dtype, a different shape), training does not fail: it
hangs in a collective that no peer ever submits, or crashes deep inside
Horovod with a message about a tensor the user never named. This module turns
that into one clear error, raised on every worker, before any step runs:

- `collective_fingerprint(graph)` lists the graph's cross-worker collectives
  (the Horovod ops) in creation order, each as a small JSON-able dict.
- `check_collectives_agree(graph, timeout_s)` exchanges the fingerprints of
  all workers (a Horovod all-gather in a separate, tiny graph and session, so
  the training graph is not touched) and compares them on every worker. All
  workers see the same lists, so all of them reach the same verdict: either
  every worker returns the fingerprint, or every worker raises `ClusterError`
  naming the first collective that differs.

The exchange is bounded by `timeout_s` (`call_with_timeout`: Horovod's ops
cannot be cancelled, so the wait runs in a helper thread): a worker that never
reaches the check makes the others raise `ClusterError` instead of hanging.

Collectives among the local devices of one worker (TensorFlow collective ops,
NCCL) are not cross-worker and are not part of the fingerprint.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from epl.errors import ClusterError
from epl.runtime import config_check, worker_status
from epl.runtime.horovod_comm import collective_label
from epl.runtime.horovod_comm import horovod

# Horovod's graph-mode op types, i.e. the collectives between workers.
HOROVOD_COLLECTIVE_TYPES = (
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
    "HorovodAllgather",
    "HorovodBroadcast",
    "HorovodAlltoall",
    "HorovodReducescatter",
    "HorovodGroupedReducescatter",
)

# Ops whose first dimension may differ between workers (Horovod allows it).
_RAGGED_FIRST_DIM = ("HorovodAllgather", "HorovodAlltoall")
# Ops whose every input is a payload tensor (the others: input 0 only).
_GROUPED = ("HorovodGroupedAllreduce", "HorovodGroupedReducescatter")

# Names of the check's own collectives (the same on every worker).
_CHECK_LENGTHS = "epl_collective_check_lengths"
_CHECK_BYTES = "epl_collective_check_bytes"


def _shape(tensor: tf.Tensor) -> list[int | None] | None:
    """The static shape of `tensor` as a list (None for unknown dims), or None if the rank is unknown."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    return [dim if dim is None else int(dim) for dim in shape.as_list()]


def _group(op: tf.Operation) -> str | int:
    """"all" for Horovod's global process set, else the process set id."""
    try:
        set_id = op.get_attr("process_set_id")
    except ValueError:
        return "all"
    return "all" if int(set_id) == 0 else int(set_id)


def collective_fingerprint(graph: tf.Graph) -> list[dict[str, Any]]:
    """The cross-worker collectives of `graph` in creation order.

    Each entry is ``{"index", "kind", "name", "dtype", "shape", "group",
    "inputs"}``: the position in the list, the Horovod op type, the op name
    (Horovod matches collectives by name), the dtype name and static shape of
    input 0 (a list, None for an unknown dim; None for an unknown rank),
    ``"all"`` or the Horovod process set id, and ``[dtype, shape]`` of every
    payload input (all inputs of grouped ops, input 0 otherwise), so that a
    grouped all-reduce that gained or lost a tensor is caught too.
    """
    entries = []
    for op in graph.get_operations():  # creation order
        if op.type not in HOROVOD_COLLECTIVE_TYPES:
            continue
        payload = list(op.inputs) if op.type in _GROUPED else list(op.inputs[:1])
        first = payload[0] if payload else None
        entries.append({
            "index": len(entries),
            "kind": op.type,
            "name": op.name,
            "dtype": first.dtype.name if first is not None else None,
            "shape": _shape(first) if first is not None else None,
            "group": _group(op),
            "inputs": [[t.dtype.name, _shape(t)] for t in payload],
            "label": collective_label(op),
        })
    return entries


def _comparable(entry: dict[str, Any]) -> dict[str, Any]:
    """The parts of an entry that must be equal on every worker."""
    kind = entry.get("kind")

    def norm(shape):
        if shape is None or kind not in _RAGGED_FIRST_DIM:
            return shape
        return shape[1:]  # all-gather / all-to-all: the first dim may differ

    return {
        "kind": kind,
        "name": entry.get("name"),
        "dtype": entry.get("dtype"),
        "shape": norm(entry.get("shape")),
        "group": entry.get("group"),
        "inputs": [[dtype, norm(shape)] for dtype, shape in entry.get("inputs", [])],
    }


def describe(entry: dict[str, Any]) -> str:
    """One collective in words: ``HorovodAllreduce 'name' float32 [4, 3]``, after what
    it carries when EPL labelled it: ``the broadcast of w1 (HorovodBroadcast ...)``."""
    shape = entry.get("shape")
    label = entry.get("label")
    prefix = "the %s (" % label if label and label != entry.get("name") else ""
    text = prefix + "%s '%s' %s %s" % (entry.get("kind"), entry.get("name"), entry.get("dtype"),
                              "<unknown rank>" if shape is None else
                              "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]")
    inputs = entry.get("inputs") or []
    if entry.get("kind") in _GROUPED:
        text += " (%d tensors: %s)" % (len(inputs), ", ".join(
            "%s %s" % (dtype, "<unknown rank>" if shape is None else
                       "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]")
            for dtype, shape in inputs))
    if entry.get("group", "all") != "all":
        text += " in process set %s" % entry.get("group")
    return text + (")" if prefix else "")


_ADVICE = ("; every worker must build the same graph (same layers, strategy scopes and "
           "config, no branches on the rank) so that Horovod can match its collectives by name")


def first_difference(fingerprints: list[list[dict[str, Any]]]) -> str | None:
    """Compare the fingerprints of all workers (index = rank); return the error message or None.

    Every worker is compared with worker 0; the message names the first
    collective index that differs, for the lowest rank that differs, with
    both workers' versions, or says which worker has fewer collectives.
    """
    reference = fingerprints[0]
    for rank in range(1, len(fingerprints)):
        other = fingerprints[rank]
        for index in range(min(len(reference), len(other))):
            if _comparable(reference[index]) != _comparable(other[index]):
                return ("collectives differ between workers: collective #%d is %s on worker 0 "
                        "but %s on worker %d (workers 0 and %d have %d and %d collectives)%s"
                        % (index, describe(reference[index]), describe(other[index]), rank,
                           rank, len(reference), len(other), _ADVICE))
        if len(reference) != len(other):
            longer, shorter = (0, rank) if len(reference) > len(other) else (rank, 0)
            longer_list = fingerprints[longer]
            index = len(fingerprints[shorter])
            return ("collectives differ between workers: worker %d has fewer collectives "
                    "(%d) than worker %d (%d); the first one worker %d lacks is collective "
                    "#%d, %s on worker %d%s"
                    % (shorter, len(fingerprints[shorter]), longer, len(longer_list), shorter,
                       index, describe(longer_list[index]), longer, _ADVICE))
    return None


def call_with_timeout(fn: Callable[[], Any], timeout_s: float,
                      message: str | Callable[[], str]) -> Any:
    """Return ``fn()``, or raise `ClusterError(message)` if it takes over `timeout_s` seconds
    (`message` may be a function, called then, that writes the message).

    Horovod's ops cannot be cancelled (a session deadline,
    ``RunOptions.timeout_in_ms``, still waits for them to finish), so the
    wait is bounded from the calling thread while ``fn`` runs in a daemon
    helper thread; on timeout that thread is left behind (Horovod's shutdown
    at process exit aborts its pending collective). Exceptions of ``fn`` are
    re-raised in the caller.
    """
    result: dict[str, Any] = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the calling thread
            result["error"] = err

    thread = threading.Thread(target=target, name="epl-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ClusterError(message() if callable(message) else message)
    if "error" in result:
        raise result["error"]
    return result["value"]


def _exchange(payload: bytes, timeout_s: float, waiting_for: str = "check_collectives_agree",
              what: str = "graph fingerprints") -> list[bytes]:
    """All-gather `payload` (bytes of any length) from every worker; index = rank.
    waiting_for: what the others did not reach, for the timeout's message; what:
    what is exchanged, for the message of a failed exchange."""

    hvd = horovod()
    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:CPU:0"):
        # Placeholders, not constants: Grappler would fold a collective on
        # constants, i.e. run it while optimizing the graph.
        data = tf.compat.v1.placeholder(tf.uint8, [None], name="fingerprint_bytes")
        length = tf.compat.v1.placeholder(tf.int64, [1], name="fingerprint_length")
        all_lengths = hvd.allgather(length, name=_CHECK_LENGTHS, ignore_name_scope=True)
        all_data = hvd.allgather(data, name=_CHECK_BYTES, ignore_name_scope=True)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 1})
    sess = tf.compat.v1.Session(graph=graph, config=config)
    feed = {data: np.frombuffer(payload, dtype=np.uint8),
            length: np.array([len(payload)], dtype=np.int64)}
    try:
        lengths, blob = call_with_timeout(
            lambda: sess.run([all_lengths, all_data], feed_dict=feed), timeout_s,
            "collective check timed out after %gs on worker %d of %d: some worker did not "
            "reach %s (it crashed, hangs, or runs a different program); "
            "see the other workers' output" % (timeout_s, hvd.rank(), hvd.size(), waiting_for))
    except tf.errors.OpError as err:
        first = err.message.strip().splitlines()[0] if err.message else type(err).__name__
        raise ClusterError(
            "collective check failed on worker %d of %d while exchanging %s with Horovod: %s"
            % (hvd.rank(), hvd.size(), what, first)) from err
    sess.close()
    blob = bytes(np.asarray(blob, dtype=np.uint8))
    out, start = [], 0
    for size in np.asarray(lengths).tolist():
        out.append(blob[start:start + int(size)])
        start += int(size)
    return out


def exchange_bytes(payload: bytes, timeout_s: float,
                   waiting_for: str = "check_collectives_agree") -> list[bytes]:
    """All-gather `payload` (bytes) from every worker, outside any training graph;
    `waiting_for` names the exchange in the error when some worker never reaches it."""
    return _exchange(payload, timeout_s, waiting_for)


def check_collectives_agree(graph: tf.Graph, timeout_s: float = 300.0,
                            config=None) -> list[dict[str, Any]]:
    """Check that every worker runs the same EPL version and config, and that every
    worker's `graph` has the same cross-worker collectives.

    Call it once on every worker, after the graph is final (after
    parallelization) and before the first training step. It is itself a
    collective: every worker must call it. With one worker it only returns
    the fingerprint. Returns the fingerprint when all workers agree; raises
    `ClusterError` on every worker otherwise (the same message everywhere:
    the EPL versions, then the config keys that differ (epl.runtime.config_check),
    then the first collective), or when the exchange does not finish within
    `timeout_s` seconds. The exchange also gives every worker the others'
    status servers (epl.runtime.worker_status). config: the graph's Config
    (default: the active one).
    """
    from epl.env import get_config

    fingerprint = collective_fingerprint(graph)
    hvd = horovod()
    if hvd.size() == 1:
        return fingerprint
    worker_status.STATUS.start(hvd.rank(), hvd.size())
    mine = {"format": config_check.RECORD_FORMAT, "epl_version": config_check.epl_version(),
            "config": config_check.compared_config(config or get_config()),
            "status": worker_status.STATUS.identity(), "collectives": fingerprint}
    payload = json.dumps(mine, sort_keys=True, separators=(",", ":")).encode("utf-8")
    blobs = _exchange(payload, timeout_s)
    if len(blobs) != hvd.size():
        raise ClusterError("collective check got %d fingerprints from %d workers"
                           % (len(blobs), hvd.size()))
    records = [_read_record(blob, rank, mine["epl_version"]) for rank, blob in enumerate(blobs)]
    message = config_check.difference(records) or first_difference(
        [record["collectives"] for record in records])
    if message is not None:
        raise ClusterError(message)
    worker_status.STATUS.set_peers({rank: record["status"] for rank, record in enumerate(records)})
    return fingerprint


def _read_record(blob: bytes, rank: int, version: str) -> dict[str, Any]:
    """Worker `rank`'s record of the collective check, or ClusterError saying that it
    comes from another EPL (a record this one cannot read)."""
    try:
        record = json.loads(blob.decode("utf-8"))
        if record.get("format") == config_check.RECORD_FORMAT:
            for key in ("epl_version", "config", "status", "collectives"):
                record[key]  # noqa: B018  (present)
            return record
        other = record.get("epl_version") if isinstance(record, dict) else None
    except (ValueError, AttributeError, KeyError, TypeError):
        other = None
    raise ClusterError(
        "worker %d sent a collective-check record that EPL %s cannot read: it runs another "
        "EPL version (%s); install the same EPL on every host" % (
            rank, version, "EPL %s" % other if other else "one older than 0.1.0's record format"))


def run_difference(records: list[dict[str, Any]], labels: dict[str, str]) -> str | None:
    """Compare what every worker is about to run (index = rank): ``{"fetches": [names],
    "collectives": [op names]}``. Returns the error message, or None when every
    worker runs the same cross-worker collectives (fetches that need none may differ)."""
    reference = records[0]
    for rank in range(1, len(records)):
        other = records[rank]
        if other["collectives"] == reference["collectives"]:
            continue

        def only(a, b, key):
            return [x for x in a[key] if x not in b[key]]

        def words(names):
            return ", ".join("the %s ('%s')" % (labels.get(n, "collective"), n)
                             for n in names) or "none"

        fetched = []
        for r, a, b in ((0, reference, other), (rank, other, reference)):
            extra = only(a, b, "fetches")
            if extra:
                fetched.append("fetched on worker %d only: %s" % (r, ", ".join(extra)))
        runs = []
        for r, a, b in ((0, reference, other), (rank, other, reference)):
            extra = only(a, b, "collectives")
            if extra:
                runs.append("collectives on worker %d only: %s" % (r, words(extra)))
        if not runs:
            runs.append("the same collectives in a different order")
        return ("workers 0 and %d run different cross-worker collectives in the same "
                "session.run: worker 0 fetches [%s], worker %d fetches [%s]; %s. Every worker "
                "must fetch the tensors merged over workers (the loss, EPL's merge collections) "
                "and the training ops in the same runs; fetches that need no collective (a "
                "hook's global step) may differ"
                % (rank, ", ".join(reference["fetches"]), rank, ", ".join(other["fetches"]),
                   "; ".join(fetched + runs)))
    return None


def check_run_agrees(fetches: list[str], collectives: list[tuple[str, str]],
                     timeout_s: float, graph: tf.Graph | None = None) -> None:
    """Before a session run whose cross-worker collectives this worker has not run
    before: compare them (and the fetches that lead to them) with every other
    worker's, so that different fetches fail on every worker before the step
    instead of hanging in it. collectives: [(op name, what it carries)].
    Every worker must call it at the same point (it is itself a collective).
    graph: where the other workers' collectives are looked up to name them."""

    hvd = horovod()
    if hvd.size() == 1:
        return
    payload = json.dumps({"fetches": list(fetches), "collectives": [n for n, _ in collectives]},
                         separators=(",", ":")).encode("utf-8")
    blobs = _exchange(payload, timeout_s, "the same session.run (the first run of these "
                      "fetches: %s)" % ", ".join(fetches), "the fetches of a session.run")
    records = [json.loads(b.decode("utf-8")) for b in blobs]
    labels = dict(collectives)
    for record in records:
        for name in record["collectives"]:
            if name not in labels and graph is not None:
                try:
                    labels[name] = collective_label(graph.get_operation_by_name(name))
                except KeyError:
                    pass
    message = run_difference(records, labels)
    if message is not None:
        raise ClusterError(message)
