"""The hang-free collective check (`epl.runtime.collective_check`).

Unit tests build tiny graphs with Horovod ops in this process; the job tests
run 2 workers under `horovodrun --gloo` (some through `epl-launch`) on scripts
written to tmp_path. Horovod must be installed: these tests fail, not skip,
without it. Every job is bounded by a subprocess timeout.
"""
from __future__ import annotations

import json
import sys
import textwrap
import time

import horovod.tensorflow as hvd  # noqa: F401  (fail, not skip, without Horovod)
import pytest
import tensorflow as tf

from epl.errors import ClusterError
from epl.runtime.collective_check import (call_with_timeout, check_collectives_agree,
                                          collective_fingerprint, first_difference)
from epl.runtime.horovod_comm import horovod
from multiworker import EPL_LAUNCH, HOROVODRUN, require_horovod, run_job

JOB_TIMEOUT = 120


def _run(command: list[str], timeout: float = JOB_TIMEOUT) -> tuple[int, str, float]:
    """(exit code, output, seconds) of a job (tests/multiworker.run_job)."""
    require_horovod()
    job = run_job(command, timeout)
    return job.returncode, job.stdout, job.elapsed


# --------------------------------------------------------------------------
# In-process: fingerprint and comparison
# --------------------------------------------------------------------------


def _graph_with_collectives():
    hvd_mod = horovod()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        y = tf.compat.v1.placeholder(tf.float64, [None, 2])
        hvd_mod.allreduce(x, op=hvd_mod.Sum, name="ar")
        tf.matmul(x, x, transpose_b=True)  # not a collective
        hvd_mod.grouped_allreduce([x, tf.compat.v1.placeholder(tf.float32, [5])],
                                  op=hvd_mod.Sum, name="gar")
        hvd_mod.allgather(y, name="ag")
        hvd_mod.broadcast(x, 0, name="bc")
    return graph


def test_fingerprint_lists_horovod_ops_in_creation_order():
    fingerprint = collective_fingerprint(_graph_with_collectives())
    assert [(e["index"], e["kind"], e["name"]) for e in fingerprint] == [
        (0, "HorovodAllreduce", "ar"), (1, "HorovodGroupedAllreduce", "gar"),
        (2, "HorovodAllgather", "ag"), (3, "HorovodBroadcast", "bc")]
    assert fingerprint[0]["dtype"] == "float32" and fingerprint[0]["shape"] == [4, 3]
    assert fingerprint[0]["group"] == "all"
    assert fingerprint[1]["inputs"] == [["float32", [4, 3]], ["float32", [5]]]
    assert fingerprint[2]["dtype"] == "float64" and fingerprint[2]["shape"] == [None, 2]
    json.dumps(fingerprint)  # serializable as is


def test_single_worker_check_returns_fingerprint():
    graph = _graph_with_collectives()
    assert check_collectives_agree(graph, timeout_s=10) == collective_fingerprint(graph)


def _entry(index, name="ar", kind="HorovodAllreduce", dtype="float32", shape=(4, 3)):
    return {"index": index, "kind": kind, "name": name, "dtype": dtype, "shape": list(shape),
            "group": "all", "inputs": [[dtype, list(shape)]]}


def test_first_difference_messages():
    same = [_entry(0), _entry(1, "b")]
    assert first_difference([same, same]) is None
    message = first_difference([same, [_entry(0), _entry(1, "b", dtype="float16")]])
    assert message.startswith(
        "collectives differ between workers: collective #1 is HorovodAllreduce 'b' float32 "
        "[4, 3] on worker 0 but HorovodAllreduce 'b' float16 [4, 3] on worker 1")
    message = first_difference([same, same + [_entry(2, "extra", shape=(2,))]])
    assert message.startswith(
        "collectives differ between workers: worker 0 has fewer collectives (2) than worker 1 "
        "(3); the first one worker 0 lacks is collective #2, HorovodAllreduce 'extra' float32 "
        "[2] on worker 1")
    # All-gather inputs may differ in their first dimension only.
    gather = [_entry(0, "ag", kind="HorovodAllgather", shape=(3, 2))]
    assert first_difference([gather, [_entry(0, "ag", kind="HorovodAllgather", shape=(5, 2))]]) is None
    assert first_difference([gather, [_entry(0, "ag", kind="HorovodAllgather", shape=(3, 4))]])


def test_call_with_timeout():
    assert call_with_timeout(lambda: 7, 5, "late") == 7
    with pytest.raises(ClusterError, match="^too slow$"):
        call_with_timeout(lambda: time.sleep(3), 0.2, "too slow")
    with pytest.raises(ClusterError, match="^written when it ran out$"):  # a message function
        call_with_timeout(lambda: time.sleep(3), 0.2, lambda: "written when it ran out")
    with pytest.raises(ValueError, match="inner"):
        call_with_timeout(lambda: (_ for _ in ()).throw(ValueError("inner")), 5, "late")


# --------------------------------------------------------------------------
# 2 workers under horovodrun
# --------------------------------------------------------------------------

# Each scenario builds a tiny graph of Horovod ops whose shape may depend on
# the rank, runs the check, and records "ok" or the ClusterError message.
# Every worker raises the same error, so the workers stay in step and can go
# on to the next scenario in the same job.
SCENARIOS_SCRIPT = textwrap.dedent('''
    import json, sys
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    from epl.errors import ClusterError
    from epl.runtime.collective_check import check_collectives_agree
    from epl.runtime.horovod_comm import horovod

    hvd = horovod()
    rank = hvd.rank()

    def build(scenario):
        graph = tf.Graph()
        with graph.as_default():
            odd = rank == 1
            dtype = tf.float64 if (scenario == "dtype" and odd) else tf.float32
            shape = [5, 3] if (scenario == "shape" and odd) else [4, 3]
            hvd.allreduce(tf.compat.v1.placeholder(dtype, shape), op=hvd.Sum, name="grad_w1")
            if scenario == "extra" and odd:  # one worker has an extra layer
                hvd.allreduce(tf.compat.v1.placeholder(tf.float32, [2]), op=hvd.Sum,
                              name="grad_extra")
            hvd.allreduce(tf.compat.v1.placeholder(tf.float32, [3]), op=hvd.Sum, name="grad_b1")
            if scenario == "trailing" and not odd:
                hvd.allgather(tf.compat.v1.placeholder(tf.float32, [None, 2]), name="metrics")
        return graph

    results = {}
    for scenario in sys.argv[2:]:
        try:
            results[scenario] = ["ok", len(check_collectives_agree(build(scenario), timeout_s=60))]
        except ClusterError as err:
            results[scenario] = ["error", str(err)]
    with open("%s/rank%d.json" % (sys.argv[1], rank), "w") as f:
        json.dump(results, f)
''')


@pytest.mark.multiworker
def test_two_workers_check_scenarios(tmp_path):
    script = tmp_path / "scenarios.py"
    script.write_text(SCENARIOS_SCRIPT)
    code, out, _ = _run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
                         str(script), str(tmp_path), "match", "extra", "dtype", "shape",
                         "trailing", "match"])
    assert code == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # every worker reaches the same verdict
    results = ranks[0]
    assert results["match"] == ["ok", 2]
    assert results["extra"] == ["error", (
        "collectives differ between workers: collective #1 is HorovodAllreduce 'grad_b1' "
        "float32 [3] on worker 0 but HorovodAllreduce 'grad_extra' float32 [2] on worker 1 "
        "(workers 0 and 1 have 2 and 3 collectives); every worker must build the same graph "
        "(same layers, strategy scopes and config, no branches on the rank) so that Horovod "
        "can match its collectives by name")]
    assert results["dtype"][1].startswith(
        "collectives differ between workers: collective #0 is HorovodAllreduce 'grad_w1' "
        "float32 [4, 3] on worker 0 but HorovodAllreduce 'grad_w1' float64 [4, 3] on worker 1")
    assert results["shape"][1].startswith(
        "collectives differ between workers: collective #0 is HorovodAllreduce 'grad_w1' "
        "float32 [4, 3] on worker 0 but HorovodAllreduce 'grad_w1' float32 [5, 3] on worker 1")
    assert results["trailing"][1].startswith(
        "collectives differ between workers: worker 1 has fewer collectives (2) than worker 0 "
        "(3); the first one worker 1 lacks is collective #2, HorovodAllgather 'metrics' "
        "float32 [?, 2] on worker 0")


# A training script whose workers build different graphs: without the check,
# worker 0 would wait forever in 'grad_b1' while worker 1 waits in 'grad_extra'.
TRAIN_SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    from epl.runtime.collective_check import check_collectives_agree
    from epl.runtime.horovod_comm import horovod

    hvd = horovod()
    mode = sys.argv[1]
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [3])
        total = hvd.allreduce(x, op=hvd.Sum, name="grad_w1")
        if mode == "extra_layer" and hvd.rank() == 1:
            total += hvd.allreduce(x * 2, op=hvd.Sum, name="grad_extra")
        total += hvd.allreduce(x, op=hvd.Sum, name="grad_b1")
        if mode == "late" and hvd.rank() == 1:
            time.sleep(120)  # never reaches the check in time
        try:
            check_collectives_agree(graph, timeout_s=float(sys.argv[2]))
        except Exception as err:  # record it, then fail like any training script
            with open("%s/rank%d.err" % (sys.argv[3], hvd.rank()), "w") as f:
                f.write("%s: %s" % (type(err).__name__, err))
            raise
        with tf.compat.v1.Session() as sess:
            for step in range(3):
                print("step", step, sess.run(total, {x: np.ones(3, np.float32)}), flush=True)
''')


@pytest.mark.multiworker
def test_different_graphs_fail_fast_on_every_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    code, out, elapsed = _run([EPL_LAUNCH, "-np", "2", "--timeout", "20", "--", sys.executable,
                               str(script), "extra_layer", "60", str(tmp_path)])
    assert code == 1, out[-4000:]
    message = ("collectives differ between workers: collective #1 is HorovodAllreduce "
               "'grad_b1' float32 [3] on worker 0 but HorovodAllreduce 'grad_extra' float32 [3] "
               "on worker 1")
    for rank in (0, 1):  # every worker got the same error
        assert (tmp_path / f"rank{rank}.err").read_text().startswith(f"ClusterError: {message}")
    last = out.strip().splitlines()[-1]
    assert last.startswith("epl-launch: worker ") and f"epl.errors.ClusterError: {message}" in last
    assert "step 0" not in out  # no training step ran
    assert elapsed < 60


@pytest.mark.multiworker
def test_worker_that_never_reaches_the_check_times_out(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    code, out, elapsed = _run([EPL_LAUNCH, "-np", "2", "--timeout", "20", "--", sys.executable,
                               str(script), "late", "3", str(tmp_path)])
    assert code == 1, out[-4000:]
    assert out.strip().splitlines()[-1] == (
        "epl-launch: worker 0 failed (exit 1): epl.errors.ClusterError: collective check timed "
        "out after 3s on worker 0 of 2: some worker did not reach check_collectives_agree (it "
        "crashed, hangs, or runs a different program); see the other workers' output")
    assert elapsed < 60
