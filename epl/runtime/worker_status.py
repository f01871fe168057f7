"""Where every worker is, so that a failed step names the worker that stalled or left.

When a multi-worker step does not finish, the waiting workers know only that
their collective has no partner. To say which worker is at fault, each
worker keeps a small record of where it is and serves it to the others:

- `WorkerStatus` (one per process): the phase (inside a session run or not,
  since when), the run's cross-worker collectives, the ones this worker has
  handed to Horovod in the current run (`mark_submitted`, called by the
  progress marker epl.runtime.horovod_comm puts before each collective), the
  number of training runs, and a way to read the global step.
- A status server (a daemon thread, one TCP socket) answers each peer's
  question with that record as one line of JSON; the global step is read
  then, with a concurrent run on the worker's own session (a variable read,
  which does not wait for the stalled collective). The addresses are
  exchanged by the collective check before the first step
  (epl.runtime.collective_check).
- A worker that leaves (its script ends, or it raises) tells the others why,
  from an `atexit` hook; a worker that stops the job after a timeout tells
  them its verdict first.

`explain(...)` turns the records of every worker into one sentence: who is
behind (not inside a run; inside its run but short of collectives the others
submitted; gone), at which step, and the first collective it did not reach,
by what it carries (the user's variable or tensor names).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

_CONNECT_TIMEOUT_S = 2.0
_READ_STEP_TIMEOUT_S = 1.0


class WorkerStatus:
    """This worker's record and its status server."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rank: int | None = None
        self.size = 1
        self.phase = "idle"        # idle | running | exited | failed
        self.since = time.time()
        self.training_runs = 0     # training runs started by this process
        self.run: dict[str, Any] = {"training": False, "collectives": [], "submitted": []}
        self.step_reader: Callable[[], int] | None = None
        self.last_step: int | None = None
        self.verdict: str | None = None  # the error this worker stopped the job with
        self.error: str | None = None    # the exception its script ended with
        self.peers: dict[int, tuple[str, int]] = {}
        self.departed: dict[int, dict] = {}  # what peers said when they left
        self.address: tuple[str, int] | None = None
        self._server: socket.socket | None = None

    # -- this worker's record ------------------------------------------------

    def begin_run(self, collectives: list[tuple[str, str]], training: bool,
                  step_reader: Callable[[], int] | None) -> None:
        """A session run with cross-worker `collectives` ([(op name, label)]) starts."""
        with self.lock:
            if training:
                self.training_runs += 1
            self.phase, self.since = "running", time.time()
            self.run = {"training": training, "collectives": list(collectives), "submitted": []}
            if step_reader is not None:
                self.step_reader = step_reader

    def end_run(self) -> None:
        """The run ended (finished or failed)."""
        with self.lock:
            if self.phase == "running":
                self.phase, self.since = "idle", time.time()

    def mark_submitted(self, name: str) -> None:
        """This worker hands collective `name` to Horovod in the current run."""
        with self.lock:
            if self.phase == "running":
                self.run["submitted"].append(name)

    def read_step(self) -> int | None:
        """The global step now (a bounded concurrent read), else the last one read."""
        reader = self.step_reader
        if reader is None:
            return self.last_step
        box: dict = {}

        def target():
            try:
                box["step"] = int(reader())
            except Exception:  # the session is closed or has no global step
                pass

        thread = threading.Thread(target=target, name="epl-read-step", daemon=True)
        thread.start()
        thread.join(_READ_STEP_TIMEOUT_S)
        if "step" in box:
            self.last_step = box["step"]
        return self.last_step

    def snapshot(self, read_step: bool = True) -> dict[str, Any]:
        """This worker's record as a JSON-able dict."""
        step = self.read_step() if read_step else self.last_step
        with self.lock:
            return {"rank": self.rank, "pid": os.getpid(), "phase": self.phase,
                    "age_s": round(time.time() - self.since, 3), "step": step,
                    "training_runs": self.training_runs, "training": self.run["training"],
                    "collectives": [name for name, _ in self.run["collectives"]],
                    "submitted": list(self.run["submitted"]), "verdict": self.verdict,
                    "error": self.error}

    # -- the server and the peers -------------------------------------------

    def start(self, rank: int, size: int) -> tuple[str, int]:
        """Start the status server (once); return the address peers reach it at."""
        with self.lock:
            self.rank, self.size = rank, size
            if self.address is not None:
                return self.address
            host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
            local = host in ("localhost", "127.0.0.1")
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1" if local else "0.0.0.0", 0))
            server.listen(16)
            self._server = server
            self.address = ("127.0.0.1" if local else host, server.getsockname()[1])
        threading.Thread(target=self._serve, name="epl-worker-status", daemon=True).start()
        atexit.register(self.leave)
        return self.address

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(_CONNECT_TIMEOUT_S)
                    request = _read_line(conn)
                    if request.startswith("bye "):
                        record = json.loads(request[4:])
                        with self.lock:
                            self.departed[int(record["rank"])] = record
                        conn.sendall(b"ok\n")
                    else:
                        conn.sendall(json.dumps(self.snapshot()).encode() + b"\n")
                except (OSError, ValueError, KeyError):
                    continue

    def set_peers(self, addresses: dict[int, tuple[str, int]]) -> None:
        """The status server address of every worker (index = rank)."""
        with self.lock:
            self.peers = {int(r): (str(h), int(p)) for r, (h, p) in addresses.items()}

    def query_peers(self) -> dict[int, dict | None]:
        """Every other worker's record (None for a worker that does not answer:
        its process is gone), or what it said when it left."""
        results: dict[int, dict | None] = {}
        threads = []

        def ask(rank, address):
            try:
                with socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S) as conn:
                    conn.settimeout(_CONNECT_TIMEOUT_S + _READ_STEP_TIMEOUT_S)
                    conn.sendall(b"status\n")
                    results[rank] = json.loads(_read_line(conn))
            except (OSError, ValueError):
                results[rank] = None

        for rank, address in sorted(self.peers.items()):
            if rank == self.rank:
                continue
            thread = threading.Thread(target=ask, args=(rank, address), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(_CONNECT_TIMEOUT_S + _READ_STEP_TIMEOUT_S + 0.5)
        with self.lock:
            departed = dict(self.departed)
        for rank in self.peers:
            if rank != self.rank and results.get(rank) is None:
                results[rank] = departed.get(rank)  # what it said when it left, if anything
        return results

    def fail(self, verdict: str) -> None:
        """This worker stops the job with `verdict`: tell the others now."""
        with self.lock:
            self.verdict = verdict
        self._tell_peers("failed")

    def leave(self) -> None:
        """At exit: tell the others this worker leaves (after which step, and why)."""
        if self.phase in ("exited", "failed"):
            return
        error = getattr(sys, "last_value", None)  # an uncaught exception ends the script
        self._tell_peers("exited", None if error is None else "it raised %s: %s" % (
            type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip()
            else ""))

    def _tell_peers(self, phase: str, error: str | None = None) -> None:
        if not self.peers:
            return
        with self.lock:
            self.phase, self.since, self.error = phase, time.time(), error
        record = self.snapshot(read_step=False)
        line = b"bye " + json.dumps(record).encode() + b"\n"
        threads = []

        def tell(address):
            try:
                with socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S) as conn:
                    conn.settimeout(_CONNECT_TIMEOUT_S)
                    conn.sendall(line)
                    _read_line(conn)
            except OSError:
                pass

        for rank, address in self.peers.items():
            if rank != self.rank:
                thread = threading.Thread(target=tell, args=(address,), daemon=True)
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join(_CONNECT_TIMEOUT_S)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


STATUS = WorkerStatus()


def mark_submitted(name: str) -> None:
    """Called by the progress marker before collective `name` (epl.runtime.horovod_comm)."""
    STATUS.mark_submitted(name)


# -- the verdict ----------------------------------------------------------------


def _step_words(record: dict) -> str:
    if record.get("step") is not None:
        return "global step %d" % record["step"]
    return "training run #%d of the process" % record.get("training_runs", 0)


def _missing(record: dict | None, pending: list[str]) -> list[str]:
    """The pending collectives `record`'s worker has not submitted in its current run."""
    if record is None or record.get("phase") not in ("running", "failed"):
        return list(pending)
    done = set(record.get("submitted") or [])
    return [name for name in pending if name not in done]


def _culprits(records: dict[int, dict | None], pending: list[str]) -> list[tuple]:
    """[(rank, how, missing collectives)] for every worker that is behind.

    how: "gone" (no answer), "left" (it exited), "idle" (not inside a run),
    "behind" (inside its run, short of collectives the others submitted).
    A worker that stopped the job after a timeout is a witness, not a culprit.
    """
    out = []
    for rank in sorted(records):
        record = records[rank]
        if record is None:
            out.append((rank, "gone", list(pending)))
        elif record.get("phase") == "exited":
            out.append((rank, "left", list(pending)))
        elif record.get("phase") == "idle":
            out.append((rank, "idle", list(pending)))
        else:  # inside its run, or stopped the job after its own wait ran out
            missing = _missing(record, pending)
            if missing:
                out.append((rank, "behind", missing))
    return out


def explain(me: int, size: int, records: dict[int, dict | None], labels: dict[str, str],
            timeout_s: float | None) -> str:
    """One sentence on why worker `me`'s current run failed.

    records: every worker's record (`WorkerStatus.snapshot`; its own included;
    None for a worker that did not answer); labels: this run's collectives
    (op name -> what they carry, in words); timeout_s: the limit that ran
    out, or None when the run failed because Horovod was shut down.
    """
    mine = records[me] or {}
    order = list(mine.get("collectives") or [])
    submitted = set()
    for record in records.values():
        if record is not None and record.get("phase") in ("running", "failed"):
            submitted.update(record.get("submitted") or [])
    pending = [name for name in order if name in submitted] or order
    what = ("the training step at %s" % _step_words(mine) if mine.get("training")
            else "a run with cross-worker collectives")
    head = "worker %d of %d: %s %s" % (me, size, what, (
        "did not finish within %g s (communication.collective_timeout_s)" % timeout_s
        if timeout_s is not None else "failed: Horovod was shut down"))
    culprits = _culprits(records, pending)
    if not culprits:
        stoppers = [r for r, rec in sorted(records.items()) if r != me and rec is not None
                    and rec.get("phase") == "failed" and rec.get("verdict")]
        if stoppers:
            return "%s: worker %d stopped the job: %s" % (head, stoppers[0],
                                                           records[stoppers[0]]["verdict"])
        return ("%s: every worker is inside its run and submitted the same collectives (%s); "
                "none is known to be behind" % (head, _collectives(pending, labels)))
    parts = []
    for rank, how, missing in culprits:
        record = records[rank] or {}
        who = "this worker (%d)" % rank if rank == me else "worker %d" % rank
        if how == "gone":
            text = "%s left the job: its process is gone" % who
        elif how == "left":
            text = "%s left the job after %s: %s" % (who, _step_words(record), record.get(
                "error") or "its script ended")
        elif how == "idle":
            text = "%s stalled: it has been outside session.run for %.1f s (at %s)" % (
                who, record.get("age_s", 0.0), _step_words(record))
        else:
            text = "%s stalled inside its run at %s (running for %.1f s)" % (
                who, _step_words(record), record.get("age_s", 0.0))
        if missing:
            text += ", and did not reach %s" % _collectives(missing[:1], labels)
        parts.append(text)
    waiting = [str(r) for r in sorted(records) if r not in {c[0] for c in culprits}]
    tail = " (worker%s %s wait%s in it)" % ("s" if len(waiting) > 1 else "", ", ".join(waiting),
                                            "" if len(waiting) > 1 else "s") if waiting else ""
    return "%s: %s%s" % (head, "; ".join(parts), tail)


def _collectives(names: list[str], labels: dict[str, str]) -> str:
    if not names:
        return "no collective"
    return ", ".join("the %s ('%s')" % (labels.get(n, "collective"), n) for n in names)
