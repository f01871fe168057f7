"""Where every worker is, so that a failed step names the worker that stalled or left.

When a multi-worker step does not finish, the waiting workers know only that
their collective has no partner. To say which worker is at fault, each
worker keeps a small record of where it is and serves it to the others:

- `WorkerStatus` (one per process): the phase (inside a session run or not,
  since when), the run's cross-worker collectives, the ones this worker has
  handed to Horovod in the current run (`mark_submitted`, called by the
  progress marker epl.runtime.horovod_comm puts before each collective), the
  number of training runs, and a way to read the global step. The record is
  also kept in shared memory (epl.runtime.status_page), where the workers on
  the same host read it when this one cannot answer (stopped, frozen, killed).
- A status server (a daemon thread, one TCP socket) answers each peer's
  question with that record as one line of JSON; the global step is read
  then, with a concurrent run on the worker's own session (a variable read,
  which does not wait for the stalled collective). The addresses (with each
  worker's host and process id) are exchanged by the collective check before
  the first step (epl.runtime.collective_check).
- A peer that does not answer is probed (`WorkerStatus.query_peers`): a
  process that is gone (its port refuses connections, or no such process on
  this host), one that is stopped (process state T: SIGSTOP, a debugger), or
  one whose port accepts connections but that answers nothing (alive, not
  progressing).
- A worker that leaves (its script ends, or it raises) tells the others why,
  from an `atexit` hook; a worker that stops the job after a timeout tells
  them its verdict first.

The sentence that names the culprit is written by epl.runtime.verdict.
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

from epl.runtime.status_page import StatusPage, read_page

_CONNECT_TIMEOUT_S = 1.0
_ANSWER_TIMEOUT_S = 2.0     # a live peer answers in milliseconds (its step read: at most 1 s)
_READ_STEP_TIMEOUT_S = 1.0
_TELL_TIMEOUT_S = 1.0


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
        self.peers: dict[int, dict] = {}     # rank -> {"address", "host", "pid"}
        self.departed: dict[int, dict] = {}  # what peers said when they left
        self.address: tuple[str, int] | None = None
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self.abandoned = False  # a run was left behind, stuck in a collective (guarded_run)
        self._given: list | None = None  # the last run's collectives, and their names
        self._names: list[str] = []
        self._server: socket.socket | None = None
        self._page: StatusPage | None = None

    # -- this worker's record ------------------------------------------------

    def begin_run(self, collectives: list[tuple[str, str]], training: bool,
                  step_reader: Callable[[], int] | None) -> None:
        """A session run with cross-worker `collectives` ([(op name, label)]) starts."""
        with self.lock:
            if training:
                self.training_runs += 1
            self.phase, self.since = "running", time.time()
            if collectives is not self._given:  # a plan's runs hand the same list each time
                self._given, self._names = collectives, [name for name, _ in collectives]
            self.run = {"training": training, "collectives": collectives, "submitted": []}
            if step_reader is not None:
                self.step_reader = step_reader
            self._publish()

    def end_run(self) -> None:
        """The run ended (finished or failed)."""
        with self.lock:
            if self.phase == "running":
                self.phase, self.since = "idle", time.time()
                self._publish()

    def mark_submitted(self, name: str) -> None:
        """This worker hands collective `name` to Horovod in the current run."""
        with self.lock:
            if self.phase == "running":
                self.run["submitted"].append(name)
                if self._page is not None:
                    self._page.mark(name)

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
            with self.lock:
                self.last_step = box["step"]
                self._publish()
        return self.last_step

    def snapshot(self, read_step: bool = True) -> dict[str, Any]:
        """This worker's record as a JSON-able dict."""
        step = self.read_step() if read_step else self.last_step
        with self.lock:
            record = self._record()
            record["step"] = step
            return record

    def _record(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "phase": self.phase,
                "age_s": round(time.time() - self.since, 3), "since": self.since,
                "step": self.last_step, "training_runs": self.training_runs,
                "training": self.run["training"],
                "collectives": list(self._names) if self.run["collectives"] else [],
                "submitted": list(self.run["submitted"]), "verdict": self.verdict,
                "error": self.error}

    def _publish(self) -> None:
        """Copy the record into the shared-memory page (the lock is held)."""
        if self._page is not None:
            record = {"rank": self.rank, "pid": os.getpid(), "phase": self.phase,
                      "since": self.since, "step": self.last_step,
                      "training_runs": self.training_runs, "training": self.run["training"],
                      "verdict": self.verdict, "error": self.error}
            self._page.write(record, self._names)
            for name in self.run["submitted"]:
                self._page.mark(name)

    # -- the server and the peers -------------------------------------------

    def start(self, rank: int, size: int) -> tuple[str, int]:
        """Start the status server and the shared page (once); return the address
        peers reach the server at."""
        with self.lock:
            self.rank, self.size = rank, size
            if self.address is not None:
                return self.address
            local = self.host in ("localhost", "127.0.0.1")
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1" if local else "0.0.0.0", 0))
            server.listen(16)
            self._server = server
            self.address = ("127.0.0.1" if local else self.host, server.getsockname()[1])
            try:
                self._page = StatusPage()
            except OSError:  # no shared memory: peers only get what this worker answers
                self._page = None
            self._publish()
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

    def identity(self) -> dict[str, Any]:
        """What the others need to reach this worker: its server, host and process id."""
        return {"address": list(self.address or ("", 0)), "host": self.host, "pid": os.getpid()}

    def set_peers(self, identities: dict[int, dict]) -> None:
        """Every worker's `identity()` (index = rank)."""
        with self.lock:
            self.peers = {int(r): {"address": (str(i["address"][0]), int(i["address"][1])),
                                   "host": str(i.get("host", "")), "pid": int(i.get("pid", 0))}
                          for r, i in identities.items()}

    def query_peers(self) -> dict[int, dict]:
        """Every other worker's record: its answer, what it said when it left, or for
        a worker that does not answer, what its probe found (phase "gone" or
        "silent", with its last record from its shared page when it is on this host)."""
        results: dict[int, dict] = {}
        threads = []
        for rank, peer in sorted(self.peers.items()):
            if rank != self.rank:
                thread = threading.Thread(target=lambda r=rank, p=peer: results.__setitem__(
                    r, self._ask(p)), daemon=True)
                thread.start()
                threads.append(thread)
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S + _ANSWER_TIMEOUT_S + 0.5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            departed = dict(self.departed)
        for rank, peer in self.peers.items():
            if rank == self.rank:
                continue
            if rank in departed:  # what it said when it left
                results[rank] = departed[rank]
            elif results.get(rank) is None:
                results[rank] = {"phase": "silent", "how": "frozen",
                                 "detail": "it did not answer in time"}
        return results

    def _ask(self, peer: dict) -> dict:
        """The peer's answer, or what a probe finds about it (`_silent`)."""
        local = peer["host"] == self.host and peer["pid"] > 0
        state = _local_state(peer, local, quiet=False)
        if state is not None:
            return state
        try:
            conn = socket.create_connection(peer["address"], timeout=_CONNECT_TIMEOUT_S)
        except ConnectionRefusedError:
            return _silent("gone", "its process is gone (its status port is closed)", peer,
                           local)
        except OSError as err:
            return _silent("unreachable", "its host does not answer (%s)" % err, peer, local)
        with conn:
            try:
                conn.settimeout(_ANSWER_TIMEOUT_S)
                conn.sendall(b"status\n")
                line = _read_line(conn)
                if line:
                    return json.loads(line)
            except (OSError, ValueError):
                pass
        return _local_state(peer, local, quiet=True) or _silent(
            "frozen", "its process accepts connections but answers nothing (none of its "
            "threads gets to run)", peer, local)

    def fail(self, verdict: str, skip: set[int] = frozenset()) -> None:
        """This worker stops the job with `verdict`: tell the others now (not those in
        `skip`: they cannot hear it)."""
        with self.lock:
            self.verdict = verdict
        self._tell_peers("failed", skip=skip)

    def leave(self) -> None:
        """At exit: tell the others this worker leaves (after which step, and why)."""
        if self.phase not in ("exited", "failed"):
            error = getattr(sys, "last_value", None)  # an uncaught exception ends the script
            self._tell_peers("exited", None if error is None else "it raised %s: %s" % (
                type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip()
                else ""))
        if self._page is not None:
            self._page.close()

    def _tell_peers(self, phase: str, error: str | None = None,
                    skip: set[int] = frozenset()) -> None:
        if not self.peers:
            return
        with self.lock:
            if not (phase == "failed" and self.phase == "running"):  # still the run's age
                self.since = time.time()
            self.phase, self.error = phase, error
            self._publish()
        record = self.snapshot(read_step=False)
        line = b"bye " + json.dumps(record).encode() + b"\n"
        threads = []

        def tell(address):
            try:
                with socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S) as conn:
                    conn.settimeout(_TELL_TIMEOUT_S)
                    conn.sendall(line)
                    _read_line(conn)
            except OSError:
                pass

        for rank, peer in self.peers.items():
            if rank != self.rank and rank not in skip:
                thread = threading.Thread(target=tell, args=(peer["address"],), daemon=True)
                thread.start()
                threads.append(thread)
        deadline = time.monotonic() + _TELL_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _local_state(peer: dict, local: bool, quiet: bool) -> dict | None:
    """For a peer on this host, what its process state says when that is enough to
    know it will not answer (gone, stopped; quiet, i.e. it did not answer: also
    blocked in the kernel), else None."""
    if not local:
        return None
    state = process_state(peer["pid"])
    if state in (None, "Z", "X"):
        return _silent("gone", "its process is gone", peer, local)
    if state in ("T", "t"):
        return _silent("stopped", "its process is stopped (SIGSTOP, or a debugger)", peer, local)
    if quiet and state == "D":
        return _silent("frozen", "its process is blocked in the kernel (uninterruptible I/O, "
                       "process state D)", peer, local)
    return None


def _silent(how: str, detail: str, peer: dict, local: bool) -> dict:
    """The record of a peer that does not answer: how (gone, stopped, frozen,
    unreachable), in words, and its last record from its shared page."""
    last = read_page(peer["pid"]) if local else None
    if last is not None and last.get("since"):
        last["age_s"] = round(time.time() - float(last["since"]), 3)
    return {"phase": "gone" if how == "gone" else "silent", "how": how, "detail": detail,
            "last": last}


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` on this host (``/proc/<pid>/stat``: R, S, D,
    T, t, Z, ...), or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"   # no /proc (not Linux): alive, state unknown
    return text[text.rfind(")") + 2:].split(" ", 1)[0] or "?"


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
