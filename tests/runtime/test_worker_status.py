"""`epl.runtime.worker_status`: the verdict from every worker's record, and the status server.

`explain` is a pure function of the records (what each worker's status server
answers); these tests give it the records of each failure and check the exact
sentence. The server is exercised in this process over a real socket.
"""
from epl.runtime import worker_status
from epl.runtime.worker_status import WorkerStatus, explain

LABELS = {"allreduce_5.dense_kernel": "all-reduce of the gradients of dense/kernel",
          "allreduce_6.loss_0": "all-reduce of loss:0"}
HEAD = ("worker 0 of 2: the training step at global step 3 did not finish within 8 s "
        "(communication.collective_timeout_s): ")


def _record(phase="running", submitted=(), step=3, age=8.0, **extra):
    record = {"phase": phase, "age_s": age, "step": step, "training_runs": 4, "training": True,
              "collectives": list(LABELS), "submitted": list(submitted), "verdict": None,
              "error": None}
    record.update(extra)
    return record


def test_stalled_outside_session_run():
    records = {0: _record(submitted=["allreduce_5.dense_kernel"]), 1: _record("idle", age=8.04)}
    assert explain(0, 2, records, LABELS, 8) == HEAD + (
        "worker 1 stalled: it has been outside session.run for 8.0 s (at global step 3), and "
        "did not reach the all-reduce of the gradients of dense/kernel "
        "('allreduce_5.dense_kernel') (worker 0 waits in it)")


def test_stalled_inside_its_run_seen_from_both_sides():
    records = {0: _record(submitted=["allreduce_5.dense_kernel"]), 1: _record(submitted=[])}
    assert explain(0, 2, records, LABELS, 8) == HEAD + (
        "worker 1 stalled inside its run at global step 3 (running for 8.0 s), and did not "
        "reach the all-reduce of the gradients of dense/kernel ('allreduce_5.dense_kernel') "
        "(worker 0 waits in it)")
    assert explain(1, 2, records, LABELS, 8).startswith(
        "worker 1 of 2: the training step at global step 3 did not finish within 8 s "
        "(communication.collective_timeout_s): this worker (1) stalled inside its run")


def test_left_and_gone():
    mine = _record(submitted=["allreduce_5.dense_kernel"])
    left = _record("exited", step=3, error="it raised ValueError: bad batch")
    assert explain(0, 2, {0: mine, 1: left}, LABELS, None) == (
        "worker 0 of 2: the training step at global step 3 failed: Horovod was shut down: "
        "worker 1 left the job after global step 3: it raised ValueError: bad batch, and did "
        "not reach the all-reduce of the gradients of dense/kernel ('allreduce_5.dense_kernel') "
        "(worker 0 waits in it)")
    assert explain(0, 2, {0: mine, 1: None}, LABELS, None).endswith(
        "worker 1 left the job: its process is gone, and did not reach the all-reduce of the "
        "gradients of dense/kernel ('allreduce_5.dense_kernel') (worker 0 waits in it)")


def test_nobody_behind_and_a_peer_that_stopped_the_job():
    both = ["allreduce_5.dense_kernel"]
    records = {0: _record(submitted=both), 1: _record(submitted=both)}
    assert explain(0, 2, records, LABELS, 8) == HEAD + (
        "every worker is inside its run and submitted the same collectives (the all-reduce of "
        "the gradients of dense/kernel ('allreduce_5.dense_kernel')); none is known to be behind")
    records[1] = _record("failed", submitted=both, verdict="worker 1 of 2: it was worker 2")
    assert explain(0, 2, records, LABELS, None).endswith(
        "worker 1 stopped the job: worker 1 of 2: it was worker 2")


def test_status_server_answers_and_hears_goodbyes():
    status, peer = WorkerStatus(), WorkerStatus()
    address = status.start(0, 2)
    peer_address = peer.start(1, 2)
    status.begin_run([("allreduce_5.dense_kernel", "x")], True, lambda: 7)
    status.mark_submitted("allreduce_5.dense_kernel")
    peer.set_peers({0: address, 1: peer_address})
    answer = peer.query_peers()[0]
    assert (answer["phase"], answer["step"], answer["submitted"]) == (
        "running", 7, ["allreduce_5.dense_kernel"])
    status.set_peers({0: address, 1: peer_address})
    status.fail("worker 0 of 2: stopped")
    assert peer.departed[0]["phase"] == "failed"
    assert peer.departed[0]["verdict"] == "worker 0 of 2: stopped"
    status._server.close()
    status_gone = peer.query_peers()[0]  # no answer: what it said when it left
    assert status_gone["verdict"] == "worker 0 of 2: stopped"
    peer._server.close()
    assert worker_status.STATUS is not status
