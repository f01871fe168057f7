"""One session run of a multi-worker graph: compared first, bounded, explained when it fails.

`guarded_run` is what the session integration (epl.hooks.session) wraps
every run of a multi-worker graph in:

1. Before the first run of a new set of cross-worker collectives, the workers
   compare what they are about to run (`check_run_agrees`: the collectives
   and the fetches that lead to them), so that different fetches fail on every
   worker before the step instead of hanging in it.
2. The run is bounded by `communication.collective_timeout_s`
   (`call_with_timeout`: Horovod's ops cannot be cancelled). When it runs
   out, the worker asks every other worker where it is
   (epl.runtime.worker_status), names the worker that stalled or left, the
   step and the collective it did not reach, tells the others this verdict,
   and shuts Horovod down: the pending collective then fails at once on every
   worker, so closing the session (a `with` block, MonitoredTrainingSession's
   close) does not wait for it, and the script exits as it would on any error.
3. A run that fails because Horovod was shut down under it (a worker left the
   job, or another stopped it) gets the same explanation instead of
   TensorFlow's "Graph execution error".
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
from typing import Any, Callable

import tensorflow as tf

from epl.errors import ClusterError
from epl.runtime import worker_status
from epl.runtime.collective_check import call_with_timeout, check_run_agrees
from epl.runtime.horovod_comm import horovod
from epl.runtime.verdict import Verdict, explain

_SHUTDOWN_GRACE_S = 5.0
# After the verdict, the exit must not wait for a collective that never completes:
# how long the process may take to exit on its own before it is ended (os._exit).
_EXIT_GRACE_S = 0.5


def guarded_run(run: Callable[[], Any], *, timeout_s: float,
                collectives: list[tuple[str, str]], training: bool,
                step_reader: Callable[[], int] | None, fetch_names: list[str],
                agreed: set, graph: tf.Graph | None = None) -> Any:
    """Return ``run()`` (one session run of a multi-worker graph), or raise ClusterError.

    collectives: the run's cross-worker collectives, [(op name, what it
    carries)], in creation order; training: whether it is a training step;
    step_reader: reads the global step (None: the graph has none);
    fetch_names: the user's fetches, for the comparison's message; agreed: the
    collective sets already compared (updated); graph: the graph run (to name
    the other workers' collectives).
    """

    hvd = horovod()
    status = worker_status.STATUS
    key = tuple(name for name, _ in collectives)
    if key and key not in agreed:
        check_run_agrees(fetch_names, collectives, timeout_s, graph)
        agreed.add(key)
    status.begin_run(collectives, training, step_reader)
    labels = dict(collectives)
    try:
        return call_with_timeout(run, timeout_s, lambda: _stop(hvd, status, labels, timeout_s))
    except tf.errors.OpError as err:
        verdict = _explain_shutdown(hvd, status, labels)
        if verdict is None:
            raise
        status.fail(verdict.message, skip=_unreachable(verdict))
        _announce(verdict)
        _quick_exit_ready()
        raise ClusterError(verdict.message) from err
    finally:
        status.end_run()


def _records(hvd, status) -> dict[int, dict]:
    records = status.query_peers()
    records[hvd.rank()] = status.snapshot()
    return records


def _stop(hvd, status, labels: dict[str, str], timeout_s: float) -> str:
    """The run timed out: explain, tell the others, shut Horovod down; return the message.

    The run is left behind, stuck in its collective (Horovod's ops cannot be
    cancelled): closing its session and Horovod's own shutdown at exit would
    wait for it (for as long as Gloo's timeout when a peer is stopped), so the
    session close skips it and the process exits at once after the script's
    error (`_exit_promptly`)."""
    verdict = explain(hvd.rank(), hvd.size(), _records(hvd, status), labels, timeout_s)
    silent = _unreachable(verdict)
    status.fail(verdict.message, skip=silent)
    _announce(verdict)
    status.abandoned = True
    _shutdown(hvd, 0.2 if silent else _SHUTDOWN_GRACE_S)
    _quick_exit_ready()
    _exit_promptly()
    return verdict.message


def _unreachable(verdict: Verdict) -> set[int]:
    """The culprits that cannot hear anything (stopped, frozen, gone)."""
    return {rank for rank, how, _ in verdict.culprits if how in ("silent", "gone")}


def _announce(verdict: Verdict) -> None:
    """Under epl-launch (EPL_LAUNCH_EVENTS), tell the launcher which workers are at
    fault, so that it restarts because of them (and --min-np drops their slots)."""
    if os.environ.get("EPL_LAUNCH_EVENTS") and verdict.culprits:
        event = {"event": "culprits", "message": verdict.message,
                 "culprits": [{"rank": rank, "how": how, "text": text}
                              for rank, how, text in verdict.culprits]}
        print("epl-launch-event: " + json.dumps(event), file=sys.stderr, flush=True)


def _explain_shutdown(hvd, status, labels: dict[str, str]) -> Verdict | None:
    """The run failed with a TensorFlow error: the explanation if a peer left or
    stopped the job (Horovod was shut down under this run), else None."""
    records = _records(hvd, status)
    departed = ("exited", "failed", "gone")
    peers = {rank: record for rank, record in records.items() if rank != hvd.rank()}
    if not any(record.get("phase") in departed for record in peers.values()):
        return None  # this worker's own error (a bad feed, ...): TensorFlow's message stands
    mine = dict(records[hvd.rank()])
    mine["phase"] = "running"  # it was, until Horovod went away
    records[hvd.rank()] = mine
    # Only departures count here: the peers still inside their step are waiting for us.
    records = {rank: record for rank, record in records.items()
               if rank == hvd.rank() or record.get("phase") in departed}
    return explain(hvd.rank(), hvd.size(), records, labels, None)


def _shutdown(hvd, wait_s: float) -> None:
    """Shut Horovod down (waiting at most `wait_s`): every pending collective fails at
    once, here and on the other workers, so nothing waits for the one that will never
    complete. (With a stopped peer, Horovod's background loop is blocked in a Gloo
    receive and its shutdown waits for Gloo's timeout: it goes on in the background.)"""
    thread = threading.Thread(target=hvd.shutdown, name="epl-horovod-shutdown", daemon=True)
    thread.start()
    thread.join(wait_s)


def _quick_exit_ready() -> None:
    """The job is failing: make this process's exit quick. Python's last garbage
    collection at exit walks every object of TensorFlow's modules and of the graph
    (a second or more); frozen objects are skipped (`gc.freeze`). A script that
    catches the error and goes on only keeps these objects for good."""
    gc.freeze()


def _exit_promptly() -> None:
    """At exit, end the process `_EXIT_GRACE_S` after the atexit handlers start, if
    they are still running then: Horovod's own shutdown handler waits for the
    abandoned collective. (The script's error has been printed by then.)"""
    import atexit

    def arm():
        def end():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        timer = threading.Timer(_EXIT_GRACE_S, end)
        timer.daemon = True
        timer.start()

    atexit.register(arm)
