"""When a worker stalls or leaves: every worker fails within the timeout, naming it.

2 workers under horovodrun and epl-launch run tests/workers/stall_worker.py,
which handles no error (it fails the way a user's script does). Worker 1
stalls in one of the ways a worker stops making progress: it sleeps in Python
between two steps (outside), blocks in I/O inside its step before any
collective (inside), sleeps inside its step after one collective and before
the next (between), is stopped by SIGSTOP (stopped); or it runs one step fewer
and exits (fewer). The time to failure is measured from the moment worker 1
stalls (its "stall" line) to the end of the job (under epl-launch --restarts:
to the line that names the failed worker), and must be at most
communication.collective_timeout_s + 5 s (the bound EPL documents). The
message must name worker 1, what it was doing, for how long (at least the
timeout less 1 s, where it stalled before the others started to wait), and the
collective it did not reach.
"""
import re

import pytest

from multiworker import epl_launch, errors, horovodrun, require_horovod

pytestmark = pytest.mark.multiworker
require_horovod()

TIMEOUT_S = 8
SLACK_S = 5  # the bound: time to failure <= timeout + 5 s

KERNEL = r"the all-reduce of the gradients of dense/kernel \('allreduce_\d+\.dense_kernel'\)"
ALIVE = r"stalled: it is alive but not progressing: "
STALLED = {
    "outside": r"worker 1 %sit has been outside session\.run for (?P<age>[\d.]+) s \(at global "
               r"step 3\), and did not reach %s" % (ALIVE, KERNEL),
    "inside": r"(worker 1|this worker \(1\)) %sit has been inside its run at global step 3 for "
              r"(?P<age>[\d.]+) s, and did not reach %s" % (ALIVE, KERNEL),
    "between": r"(worker 1|this worker \(1\)) %sit has been inside its run at global step 3 for "
               r"[\d.]+ s \(it submitted %s\), and did not reach the all-reduce of the gradients "
               r"of dense/bias \('allreduce_\d+\.dense_bias'\)" % (ALIVE, KERNEL),
    "stopped": r"worker 1 %sits process is stopped \(SIGSTOP, or a debugger\); it has been "
               r"outside session\.run for (?P<age>[\d.]+) s \(at global step 3\), and did not "
               r"reach %s" % (ALIVE, KERNEL),
    "fewer": r"worker 1 left the job after global step 3: its script ended, and did not reach "
             + KERNEL,
}


def _stalled_at(job) -> float:
    stalled_at, _ = job.first("rank 1 stall ")
    return stalled_at


def _check_message(job, mode, pattern=None):
    errors_seen = [line for line in job.text if "epl.errors.ClusterError: worker " in line]
    assert errors_seen, errors(job.stdout)
    found = [m for m in (re.search(pattern or STALLED[mode], line) for line in errors_seen) if m]
    assert found, "\n".join(errors_seen)
    age = found[0].groupdict().get("age")
    if age is not None:  # it had stalled for the whole wait
        assert float(age) >= TIMEOUT_S - 1, found[0].group(0)


def _check_bound(seconds, job, stalled_at, mode, how, report):
    report(f"time to failure, worker 1 {mode} ({how}): {seconds:.1f} s "
           f"(collective_timeout_s {TIMEOUT_S} s)")
    assert seconds <= TIMEOUT_S + SLACK_S, (
        "the job ended %.1f s after the stall; its output:\n%s" % (seconds,
                                                                  _timeline(job, stalled_at)))


def _timeline(job, since: float) -> str:
    """The output from `since` on, each line with its arrival time after `since`
    (traceback frames left out), to tell which part of the failure took the time."""
    return "\n".join("%6.2f s  %s" % (arrived - since, line) for arrived, line in job.lines
                     if arrived >= since and not line.split(":", 1)[-1].startswith("  "))[-4000:]


@pytest.mark.parametrize("session,mode", [
    ("session", "outside"), ("monitored", "outside"), ("session", "inside"),
    ("monitored", "inside"), ("monitored", "between"), ("session", "stopped"),
    ("monitored", "stopped"), ("session", "fewer"), ("monitored", "fewer")])
def test_stalled_or_leaving_worker_fails_the_job_within_the_timeout(session, mode, report):
    job = horovodrun("stall_worker.py", session, mode, str(TIMEOUT_S), timeout=120)
    assert job.returncode != 0, job.stdout[-3000:]
    assert "rank 0 finished" not in job.stdout
    _check_message(job, mode)
    stalled_at = _stalled_at(job)
    _check_bound(job.end - stalled_at, job, stalled_at, mode, f"{session}, horovodrun", report)


@pytest.mark.parametrize("mode", ["outside", "inside", "between", "stopped"])
def test_epl_launch_restarts_because_of_the_stalled_worker(mode, tmp_path, report):
    """epl-launch --restarts: the job is restarted because of worker 1 (not because of the
    worker that waited for it and exited first), and the restarted job finishes (worker 1
    stalls only once: tests/workers/stall_worker.py's MARKER)."""
    job = epl_launch(["-np", "2", "--timeout", str(TIMEOUT_S), "--restarts", "1"],
                     ["stall_worker.py", "monitored", mode, str(TIMEOUT_S),
                      str(tmp_path / "stalled-once")], timeout=240)
    assert job.returncode == 0, errors(job.stdout)
    _check_message(job, mode)
    log = [line for line in job.text if line.startswith("epl-launch:")]
    assert re.fullmatch(r"epl-launch: worker 1 failed \(stalled, reported by worker [01]\): "
                        r"epl\.errors\.ClusterError: worker [01] of 2: .*", log[0]), log
    assert re.search(STALLED[mode], log[0]), log[0]
    assert re.fullmatch(r"epl-launch: restart 1 of 1 after worker 1 failed \(stalled: it is "
                        r"alive but not progressing: .* \(reported by worker [01]\)\): "
                        r"starting 2 workers again \(-H localhost:2\)", log[1]), log
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} finished" in job.text
    stalled_at = _stalled_at(job)
    failed_at, _ = job.first("epl-launch: worker 1 failed")
    _check_bound(failed_at - stalled_at, job, stalled_at, mode, "monitored, epl-launch --restarts",
                 report)


def test_min_np_drops_the_stalled_workers_slot(tmp_path):
    """Two hosts (both this machine, by two names): worker 1, on host 127.0.0.1, is
    stopped; the restart gives up 127.0.0.1's slot, not localhost's (worker 0's, which
    waited and exited first). Seen from another host, a stopped worker is one that
    accepts connections and answers nothing."""
    job = epl_launch(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--timeout", str(TIMEOUT_S),
                      "--restarts", "1", "--min-np", "1"],
                     ["stall_worker.py", "session", "stopped", str(TIMEOUT_S),
                      str(tmp_path / "stalled-once")], timeout=240)
    assert job.returncode == 0, errors(job.stdout)
    _check_message(job, "stopped", r"worker 1 %sits process accepts connections but answers "
                   r"nothing \(none of its threads gets to run\); what it was doing is unknown "
                   r"\(it runs on another host\), and did not reach %s" % (ALIVE, KERNEL))
    restart = [line for line in job.text if line.startswith("epl-launch: restart 1 of 1")]
    assert restart and restart[0].endswith("starting 1 worker again (-H localhost:1)"), restart
    assert "[0]<stdout>:rank 0 finished" in job.text
