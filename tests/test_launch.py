"""`epl-launch`: bad input, the horovodrun command line, output parsing, and
real 2-worker jobs (a good one and one where a worker crashes mid-run).

Horovod must be installed: these tests fail, not skip, without it. Every job
runs in its own process group under a subprocess timeout.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import horovod.tensorflow as hvd  # noqa: F401  (fail, not skip, without Horovod)
import pytest

from tools import epl_launch

BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")
EPL_LAUNCH = os.path.join(BIN, "epl-launch")
JOB_TIMEOUT = 120


# --------------------------------------------------------------------------
# Bad input and the command line (no workers started)
# --------------------------------------------------------------------------


def test_np_larger_than_hosts_allow(capsys):
    assert epl_launch.main(["-np", "4", "-H", "localhost:2", "--", "python", "train.py"]) == 2
    assert capsys.readouterr().err == (
        "epl-launch: -np 4 asks for 4 workers but -H localhost:2 gives 2 slots; "
        "add hosts or slots\n")
    assert epl_launch.main(["-np", "5", "-H", "a:2,b", "python", "train.py"]) == 2
    assert "-np 5 asks for 5 workers but -H a:2,b gives 3 slots" in capsys.readouterr().err


def test_np_larger_than_hosts_allow_console_script():
    assert os.path.exists(EPL_LAUNCH), "epl-launch is not installed: pip install -e ."
    result = subprocess.run([EPL_LAUNCH, "-np", "3", "-H", "localhost:2", "python", "x.py"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "epl-launch: -np 3 asks for 3 workers but -H localhost:2 gives 2 slots; "
        "add hosts or slots")


@pytest.mark.parametrize("argv,message", [
    (["-np", "2"], "no command to run"),
    (["-np", "0", "python"], "-np 0 asks for no workers"),
    (["-np", "2", "-H", "localhost:x", "python"], "has slots 'x', not a whole number"),
    (["-np", "2", "-H", "localhost:0", "python"], "has 0 slots"),
    (["-np", "2", "--virtual-devices", "0", "python"], "--virtual-devices 0"),
    (["-np", "2", "--timeout", "-1", "python"], "--timeout -1"),
])
def test_bad_input(capsys, argv, message):
    assert epl_launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("epl-launch: ") and message in err


def test_horovodrun_command_and_environment(monkeypatch):
    monkeypatch.delenv("EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S", raising=False)
    args = epl_launch._parser().parse_args(["-np", "2", "--virtual-devices", "3", "--",
                                            "python", "train.py", "--lr", "0.1"])
    cmd, env = epl_launch.build(args, environ={})
    assert cmd[0] == HOROVODRUN
    assert cmd[1:5] == ["--gloo", "-np", "2", "-H"] and cmd[5] == "localhost:2"
    assert cmd[-4:] == ["python", "train.py", "--lr", "0.1"]
    # The default stall timeout is communication.collective_timeout_s (300 s).
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "300"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "60"
    assert env["EPL_CLUSTER_VIRTUAL_DEVICES"] == "3"
    assert "EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S" not in env
    args = epl_launch._parser().parse_args(["-np", "2", "--timeout", "20", "python", "t.py"])
    cmd, env = epl_launch.build(args, environ={})
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "20"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "10"
    assert env["EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S"] == "20.0"
    assert "EPL_CLUSTER_VIRTUAL_DEVICES" not in env


HOROVODRUN_FAILURE = """\
[0]<stdout>:step 0 [3. 3. 3.]
[1]<stderr>:I0000 00:00:17 mlir_graph_optimization_pass.cc:437] MLIR V1 optimization pass is not enabled
[1]<stderr>:Traceback (most recent call last):
[1]<stderr>:  File "/tmp/crash.py", line 12, in <module>
[1]<stderr>:    raise RuntimeError("boom")
[1]<stderr>:RuntimeError: boom
[1]<stderr>:W0000 00:00:18 local_rendezvous.cc:412] Local rendezvous is aborting with status: UNKNOWN
Process 1 exit with status code 1.
Terminating remaining workers after failure of Process 1.
[0]<stderr>:Terminated
Process 0 exit with status code 143.
Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 6, in <module>
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 1
"""


def test_output_watcher_names_first_failing_worker_and_its_error():
    watcher = epl_launch.OutputWatcher()
    for line in HOROVODRUN_FAILURE.splitlines():
        watcher.feed(line)
    assert watcher.failure() == (1, 1)
    assert watcher.summary(1) == "epl-launch: worker 1 failed (exit 1): RuntimeError: boom"
    # A worker that failed only because Horovod shut down under it is not the cause,
    # even when horovodrun saw it exit first.
    watcher = epl_launch.OutputWatcher()
    for line in [
            "[1]<stderr>:Traceback (most recent call last):",
            "[1]<stderr>:RuntimeError: boom",
            "[0]<stderr>:Traceback (most recent call last):",
            "[0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: Horovod has been "
            "shut down. This was caused by an exception on one of the ranks",
            "Process 0 exit with status code 1.",
            "Process 1 exit with status code 1."]:
        watcher.feed(line)
    assert watcher.summary(1) == "epl-launch: worker 1 failed (exit 1): RuntimeError: boom"
    # ... also when the cause was terminated (143) while exiting after its peer.
    watcher = epl_launch.OutputWatcher()
    for line in [
            "[1]<stderr>:Traceback (most recent call last):",
            "[1]<stderr>:RuntimeError: boom",
            "[0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: Horovod has been "
            "shut down.",
            "Process 0 exit with status code 1.",
            "Terminating remaining workers after failure of Process 0.",
            "[1]<stderr>:Terminated",
            "Process 1 exit with status code 143."]:
        watcher.feed(line)
    assert watcher.summary(1) == "epl-launch: worker 1 failed (exit 143): RuntimeError: boom"
    # Without horovodrun's per-process lines, its final report is used.
    watcher = epl_launch.OutputWatcher()
    for line in HOROVODRUN_FAILURE.splitlines():
        if not line.startswith("Process ") or line.startswith("Process name"):
            watcher.feed(line)
    assert watcher.failure() == (1, 1)


# --------------------------------------------------------------------------
# Real 2-worker jobs
# --------------------------------------------------------------------------

WORKER_SCRIPT = textwrap.dedent('''
    import os, sys, time
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import horovod.tensorflow as hvd

    hvd.init()
    mode = sys.argv[1]
    print("env", os.environ.get("EPL_CLUSTER_VIRTUAL_DEVICES"),
          os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), flush=True)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3])  # a placeholder: nothing is constant-folded
        total = hvd.allreduce(x, op=hvd.Sum, name="grad")
        with tf.compat.v1.Session() as sess:
            for step in range(5):
                if mode == "crash" and hvd.rank() == 1 and step == 3:
                    raise RuntimeError("boom at step %d" % step)
                value = sess.run(total, {x: np.full(3, hvd.rank() + 1, np.float32)})
                print("step", step, value.tolist(), flush=True)
            if mode == "ok":
                print("tick", time.time(), flush=True)
                time.sleep(2)  # output before this pause must arrive before it ends
                print("tock", flush=True)
''')


def _launch(tmp_path, *args: str) -> tuple[int, list[tuple[float, str]], float]:
    """Run epl-launch on WORKER_SCRIPT; return (exit code, [(arrival time, line)], seconds)."""
    assert os.path.exists(HOROVODRUN), "horovodrun missing: run `make setup` to build Horovod"
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    proc = subprocess.Popen([EPL_LAUNCH, *args[:-1], "--", sys.executable, str(script), args[-1]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    deadline = start + JOB_TIMEOUT
    try:
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(EPL_LAUNCH, JOB_TIMEOUT)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("epl-launch overran %ss:\n%s" % (JOB_TIMEOUT, "\n".join(l for _, l in lines)))
    return proc.returncode, lines, time.monotonic() - start


def test_two_workers_succeed_and_stream_prefixed_output(tmp_path):
    code, lines, _ = _launch(tmp_path, "-np", "2", "--virtual-devices", "2", "--timeout", "30",
                             "ok")
    text = [line for _, line in lines]
    assert code == 0, "\n".join(text)[-4000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:env 2 30" in text
        assert f"[{rank}]<stdout>:step 4 [3.0, 3.0, 3.0]" in text
    # Streamed: "tick" reached us about 2 s before "tock", not all at the end.
    tick = next(t for t, line in lines if line.startswith("[0]<stdout>:tick"))
    tock = next(t for t, line in lines if line.startswith("[0]<stdout>:tock"))
    assert tock - tick > 1.5
    assert not any(line.startswith("epl-launch:") for line in text)


def test_crashing_worker_fails_the_job_naming_rank_and_error(tmp_path):
    code, lines, elapsed = _launch(tmp_path, "-np", "2", "--timeout", "20", "crash")
    text = [line for _, line in lines]
    assert code == 1, "\n".join(text)[-4000:]
    # Exit 1, or 143 when horovodrun terminated it while it was still exiting.
    assert re.fullmatch(r"epl-launch: worker 1 failed \(exit (1|143)\): RuntimeError: boom at step 3",
                        text[-1]), "\n".join(text)[-6000:]
    assert "[1]<stdout>:step 2 [3.0, 3.0, 3.0]" in text  # it did run a few steps
    # The job ends well within the 20 s stall timeout after the crash.
    crashed = next(t for t, line in lines if line.startswith("[1]<stderr>:RuntimeError: boom"))
    assert lines[-1][0] - crashed < 20
    assert elapsed < JOB_TIMEOUT
