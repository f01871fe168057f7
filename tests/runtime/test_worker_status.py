"""`epl.runtime.worker_status` and `epl.runtime.verdict`: the status server, the probe
of a worker that does not answer, its shared page, and the sentence from every record.

`explain` is a pure function of the records (what each worker's status server
answers, or what the probe found); these tests give it the records of each
failure and check the exact sentence. The server, the probe and the page are
exercised in this process and a child process over real sockets.
"""
import os
import signal
import subprocess
import sys
import textwrap

from epl.runtime import worker_status
from epl.runtime.status_page import StatusPage, read_page
from epl.runtime.verdict import explain
from epl.runtime.worker_status import WorkerStatus, process_state

LABELS = {"allreduce_5.dense_kernel": "all-reduce of the gradients of dense/kernel",
          "allreduce_6.loss_0": "all-reduce of loss:0"}
HEAD = ("worker 0 of 2: the training step at global step 3 did not finish within 8 s "
        "(communication.collective_timeout_s): ")
DENSE = "the all-reduce of the gradients of dense/kernel ('allreduce_5.dense_kernel')"


def _record(phase="running", submitted=(), step=3, age=8.0, **extra):
    record = {"phase": phase, "age_s": age, "step": step, "training_runs": 4, "training": True,
              "collectives": list(LABELS), "submitted": list(submitted), "verdict": None,
              "error": None}
    record.update(extra)
    return record


def _message(records, timeout=8, me=0):
    return explain(me, 2, records, LABELS, timeout).message


def test_stalled_outside_session_run():
    records = {0: _record(submitted=["allreduce_5.dense_kernel"]), 1: _record("idle", age=8.04)}
    verdict = explain(0, 2, records, LABELS, 8)
    assert verdict.message == HEAD + (
        "worker 1 stalled: it is alive but not progressing: it has been outside session.run "
        "for 8.0 s (at global step 3), and did not reach %s (worker 0 waits in it)" % DENSE)
    assert [(rank, how) for rank, how, _ in verdict.culprits] == [(1, "idle")]


def test_stalled_inside_its_run_seen_from_both_sides():
    records = {0: _record(submitted=["allreduce_5.dense_kernel"]), 1: _record(submitted=[])}
    assert _message(records) == HEAD + (
        "worker 1 stalled: it is alive but not progressing: it has been inside its run at "
        "global step 3 for 8.0 s, and did not reach %s (worker 0 waits in it)" % DENSE)
    assert _message(records, me=1).startswith(
        "worker 1 of 2: the training step at global step 3 did not finish within 8 s "
        "(communication.collective_timeout_s): this worker (1) stalled: it is alive")


def test_stalled_between_two_collectives():
    both = ["allreduce_5.dense_kernel", "allreduce_6.loss_0"]
    records = {0: _record(submitted=both), 1: _record(submitted=both[:1])}
    assert _message(records) == HEAD + (
        "worker 1 stalled: it is alive but not progressing: it has been inside its run at "
        "global step 3 for 8.0 s (it submitted %s), and did not reach the all-reduce of loss:0 "
        "('allreduce_6.loss_0') (worker 0 waits in it)" % DENSE)


def test_stopped_worker_with_its_last_record_and_without():
    last = _record("idle", age=8.1, step=None)
    stopped = {"phase": "silent", "how": "stopped",
               "detail": "its process is stopped (SIGSTOP, or a debugger)", "last": last}
    records = {0: _record(submitted=["allreduce_5.dense_kernel"]), 1: stopped}
    verdict = explain(0, 2, records, LABELS, 8)
    assert verdict.message == HEAD + (
        "worker 1 stalled: it is alive but not progressing: its process is stopped (SIGSTOP, "
        "or a debugger); it has been outside session.run for 8.1 s (at global step 3), and did "
        "not reach %s (worker 0 waits in it)" % DENSE)
    assert [(rank, how) for rank, how, _ in verdict.culprits] == [(1, "silent")]
    remote = dict(stopped, how="frozen", last=None,
                  detail="its process accepts connections but answers nothing")
    assert _message({0: records[0], 1: remote}) == HEAD + (
        "worker 1 stalled: it is alive but not progressing: its process accepts connections "
        "but answers nothing; what it was doing is unknown (it runs on another host), and did "
        "not reach %s (worker 0 waits in it)" % DENSE)


def test_left_and_gone():
    mine = _record(submitted=["allreduce_5.dense_kernel"])
    left = _record("exited", step=3, error="it raised ValueError: bad batch")
    assert _message({0: mine, 1: left}, None) == (
        "worker 0 of 2: the training step at global step 3 failed: Horovod was shut down: "
        "worker 1 left the job after global step 3: it raised ValueError: bad batch, and did "
        "not reach %s (worker 0 waits in it)" % DENSE)
    gone = {"phase": "gone", "how": "gone", "detail": "its process is gone",
            "last": _record("running", age=0.3)}
    assert _message({0: mine, 1: gone}, None).endswith(
        "worker 1 left the job: its process is gone (when last seen, it has been inside its "
        "run at global step 3 for 0.3 s), and did not reach %s (worker 0 waits in it)" % DENSE)


def test_nobody_behind_and_a_peer_that_stopped_the_job():
    both = ["allreduce_5.dense_kernel"]
    records = {0: _record(submitted=both), 1: _record(submitted=both)}
    assert _message(records) == HEAD + (
        "every worker is inside its run and submitted the same collectives (%s); none is "
        "known to be behind" % DENSE)
    records[1] = _record("failed", submitted=both, verdict="worker 1 of 2: it was worker 2")
    assert _message(records, None).endswith(
        "worker 1 stopped the job: worker 1 of 2: it was worker 2")


def test_status_server_answers_and_hears_goodbyes():
    status, peer = WorkerStatus(), WorkerStatus()
    status.start(0, 2)
    peer.start(1, 2)
    status.begin_run([("allreduce_5.dense_kernel", "x")], True, lambda: 7)
    status.mark_submitted("allreduce_5.dense_kernel")
    peer.set_peers({0: status.identity(), 1: peer.identity()})
    answer = peer.query_peers()[0]
    assert (answer["phase"], answer["step"], answer["submitted"]) == (
        "running", 7, ["allreduce_5.dense_kernel"])
    status.set_peers({0: status.identity(), 1: peer.identity()})
    status.fail("worker 0 of 2: stopped")
    assert peer.departed[0]["phase"] == "failed"
    assert peer.departed[0]["verdict"] == "worker 0 of 2: stopped"
    status._server.close()
    status_gone = peer.query_peers()[0]  # no answer: what it said when it left
    assert status_gone["verdict"] == "worker 0 of 2: stopped"
    peer._server.close()
    assert worker_status.STATUS is not status


def test_shared_page_round_trip(tmp_path):
    page = StatusPage(str(tmp_path))
    page.write({"phase": "running", "since": 1.0}, ["a", "b", "c"])
    page.mark("c")
    page.mark("a")
    assert read_page(os.getpid(), str(tmp_path)) == {
        "phase": "running", "since": 1.0, "collectives": ["a", "b", "c"], "submitted": ["a", "c"]}
    page.write({"phase": "idle", "since": 2.0}, [])
    assert read_page(os.getpid(), str(tmp_path))["phase"] == "idle"
    page.close()
    assert read_page(os.getpid(), str(tmp_path)) is None


PEER = textwrap.dedent('''
    import json, os, signal, sys, time
    from epl.runtime.worker_status import WorkerStatus
    status = WorkerStatus()
    status.start(1, 2)
    status.begin_run([("allreduce_5.dense_kernel", "x")], True, None)
    print(json.dumps(status.identity()), flush=True)
    if sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
''')


def _peer(mode):
    child = subprocess.Popen([sys.executable, "-c", PEER, mode], stdout=subprocess.PIPE,
                             text=True)
    import json
    return child, json.loads(child.stdout.readline())


def test_probe_of_a_stopped_and_of_a_killed_worker():
    """A peer on this host that does not answer: stopped (its state T; its shared page
    still says where it was) or gone (killed), each told apart at once."""
    import time
    me = WorkerStatus()
    me.start(0, 2)
    child, identity = _peer("stop")
    try:
        deadline = time.monotonic() + 30
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        me.set_peers({0: me.identity(), 1: identity})
        record = me.query_peers()[1]
        assert (record["phase"], record["how"]) == ("silent", "stopped")
        assert record["last"]["phase"] == "running" and record["last"]["rank"] == 1
        child.send_signal(signal.SIGKILL)
        child.wait()
        record = me.query_peers()[1]
        assert (record["phase"], record["how"]) == ("gone", "gone")
        assert record["last"]["phase"] == "running"  # a killed worker leaves its page
    finally:
        child.kill()
        child.wait()
        me._server.close()
