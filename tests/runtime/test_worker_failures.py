"""When a worker stalls or leaves: every worker fails within the timeout, naming it.

2 workers under horovodrun (and epl-launch) run tests/workers/stall_worker.py,
which handles no error (it fails the way a user's script does). Worker 1
stalls outside session.run, stalls inside its step (in its input op, before
any collective), or runs one step fewer and exits. The time to failure is
measured from the moment worker 1 stalls (its "stall" line) to the end of the
job, and must be at most communication.collective_timeout_s + 5 s.
"""
import re

import pytest

from multiworker import epl_launch, errors, horovodrun, require_horovod

pytestmark = pytest.mark.multiworker
require_horovod()

TIMEOUT_S = 8
SLACK_S = 5  # the bound: time to failure <= timeout + 5 s

STALLED = {
    "outside": r"worker 1 stalled: it has been outside session\.run for [\d.]+ s \(at global "
               r"step 3\), and did not reach the all-reduce of the gradients of dense/kernel "
               r"\('allreduce_\d+\.dense_kernel'\)",
    "inside": r"(worker 1|this worker \(1\)) stalled inside its run at global step 3 \(running "
              r"for [\d.]+ s\), and did not reach the all-reduce of the gradients of "
              r"dense/kernel \('allreduce_\d+\.dense_kernel'\)",
    "fewer": r"worker 1 left the job after global step 3: its script ended, and did not reach "
             r"the all-reduce of the gradients of dense/kernel \('allreduce_\d+\.dense_kernel'\)",
}


def _check_failure(job, mode, report, how):
    out = job.stdout
    assert job.returncode != 0, out[-3000:]
    assert "rank 0 finished" not in out
    stalled_at, _ = job.first("rank 1 stall ")
    errors_seen = [line for line in job.text if "epl.errors.ClusterError: worker " in line]
    assert errors_seen, errors(out)
    assert any(re.search(STALLED[mode], line) for line in errors_seen), "\n".join(errors_seen)
    seconds = job.end - stalled_at
    report(f"time to failure, worker 1 {mode} ({how}): {seconds:.1f} s "
           f"(collective_timeout_s {TIMEOUT_S} s)")
    assert seconds <= TIMEOUT_S + SLACK_S, "the job ended %.1f s after the stall; its output:\n%s" % (
        seconds, _timeline(job, stalled_at))


def _timeline(job, since: float) -> str:
    """The output from `since` on, each line with its arrival time after `since`
    (traceback frames left out), to tell which part of the failure took the time."""
    return "\n".join("%6.2f s  %s" % (arrived - since, line) for arrived, line in job.lines
                     if arrived >= since and not line.split(":", 1)[-1].startswith("  "))[-4000:]


@pytest.mark.parametrize("mode", ["outside", "inside", "fewer"])
@pytest.mark.parametrize("session", ["session", "monitored"])
def test_stalled_or_leaving_worker_fails_the_job_within_the_timeout(session, mode, report):
    job = horovodrun("stall_worker.py", session, mode, str(TIMEOUT_S), timeout=120)
    _check_failure(job, mode, report, f"{session}, horovodrun")


@pytest.mark.parametrize("mode", ["outside", "inside"])
def test_stalled_worker_under_epl_launch(mode, report):
    job = epl_launch(["-np", "2", "--timeout", str(TIMEOUT_S)],
                     ["stall_worker.py", "monitored", mode, str(TIMEOUT_S)], timeout=120)
    _check_failure(job, mode, report, "monitored, epl-launch")
    last = job.text[-1]
    assert re.fullmatch(r"epl-launch: worker [01] failed \(exit 1\): epl\.errors\.ClusterError: "
                        r"worker [01] of 2: .*", last), last
    assert re.search(STALLED[mode], last), last
