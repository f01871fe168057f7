"""`epl-launch`: bad input, the horovodrun command line, output parsing, and
real 2-worker jobs (a good one, one where a worker crashes mid-run, one where
a worker exits with SystemExit('message'), and restarts from a checkpoint).

Horovod must be installed: these tests fail, not skip, without it. Every job
runs through tests/multiworker.py (its own process group, a timeout).
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import horovod.tensorflow as hvd  # noqa: F401  (fail, not skip, without Horovod)
import pytest

from multiworker import (EPL_LAUNCH, HOROVODRUN, assert_matches_plain, epl_launch, errors,
                         run_job, worker_module)
from epl.tools import launch as launcher
from epl.tools import launch_output
from paths import BENCH  # noqa: E402

JOB_TIMEOUT = 120


# --------------------------------------------------------------------------
# Bad input and the command line (no workers started)
# --------------------------------------------------------------------------


def test_np_larger_than_hosts_allow(capsys):
    assert launcher.main(["-np", "4", "-H", "localhost:2", "--", "python", "train.py"]) == 2
    assert capsys.readouterr().err == (
        "epl-launch: -np 4 asks for 4 workers but -H localhost:2 gives 2 slots; "
        "add hosts or slots\n")
    assert launcher.main(["-np", "5", "-H", "a:2,b", "python", "train.py"]) == 2
    assert "-np 5 asks for 5 workers but -H a:2,b gives 3 slots" in capsys.readouterr().err


def test_np_larger_than_hosts_allow_console_script():
    assert os.path.exists(EPL_LAUNCH), "epl-launch is not installed: run `make setup`"
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
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("epl-launch: ") and message in err


def test_horovodrun_command_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S", raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    args = launcher.parse_command_line(["-np", "2", "--virtual-devices", "3", "--",
                                        "python", str(script), "--lr", "0.1"])
    cmd, env = launcher.build(args, environ={})
    assert cmd[0] == HOROVODRUN
    assert cmd[1:5] == ["--gloo", "-np", "2", "-H"] and cmd[5] == "localhost:2"
    # A bare `python` is the interpreter epl-launch was installed with.
    assert cmd[-4:] == [sys.executable, str(script), "--lr", "0.1"]
    # The default stall timeout is communication.collective_timeout_s (300 s).
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "300"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "60"
    assert env["EPL_CLUSTER_VIRTUAL_DEVICES"] == "3"
    assert "EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S" not in env
    args = launcher.parse_command_line(["-np", "2", "--timeout", "20", "python", str(script)])
    cmd, env = launcher.build(args, environ={})
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "20"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "10"
    assert env["EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S"] == "20.0"
    assert "EPL_CLUSTER_VIRTUAL_DEVICES" not in env


def test_horovodrun_options_are_passed_on(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    args = launcher.parse_command_line([
        "-np", "2", "--timeline-filename", "/tmp/t.json", "--verbose", "--timeout", "9",
        "--log-level=INFO", "--restarts", "1", "python", str(script), "--steps", "3"])
    assert args.horovod_args == ["--timeline-filename", "/tmp/t.json", "--verbose",
                                 "--log-level=INFO"]
    assert args.command == ["python", str(script), "--steps", "3"]
    assert (args.np, args.timeout, args.restarts) == (2, 9.0, 1)
    cmd, _ = launcher.build(args, environ={})
    position = cmd.index("--timeline-filename")
    assert cmd[position:position + 4] == ["--timeline-filename", "/tmp/t.json", "--verbose",
                                          "--log-level=INFO"]
    assert cmd[-4:] == [sys.executable, str(script), "--steps", "3"]


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "no-such-program-epl", "x"],
     "epl-launch: no-such-program-epl: no such program on PATH; give the program and its "
     "arguments, e.g. epl-launch -np 2 python train.py\n"),
    (["-np", "2", "./no/such/binary"],
     "epl-launch: ./no/such/binary: no such program; give the program and its arguments, e.g. "
     "epl-launch -np 2 python train.py\n"),
    (["-np", "2", "python", "no_such_script.py"],
     "epl-launch: script no_such_script.py not found (in %s): every worker would fail with "
     "\"can't open file\"\n" % os.getcwd()),
    (["-np", "2", "--restarts", "-1", "python"], "epl-launch: --restarts -1: give 0 or more\n"),
    (["-np", "2", "--min-np", "1", "python"],
     "epl-launch: --min-np 1 only applies to restarts; add --restarts N\n"),
    (["-np", "2", "--restarts", "1", "--min-np", "3", "python"],
     "epl-launch: --min-np 3: give a number of workers from 1 to -np (2)\n"),
])
def test_bad_command_lines_exact_errors(capsys, argv, message):
    assert launcher.main(argv) == 2
    assert capsys.readouterr().err == message


def test_missing_script_through_the_console_script(tmp_path):
    result = subprocess.run([EPL_LAUNCH, "-np", "2", "python", "missing.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "epl-launch: script missing.py not found (in %s): every worker would fail with \"can't "
        "open file\"" % tmp_path)


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
    watcher = launcher.OutputWatcher()
    for line in HOROVODRUN_FAILURE.splitlines():
        watcher.feed(line)
    assert watcher.failure() == (1, 1)
    assert watcher.summary(1) == "epl-launch: worker 1 failed (exit 1): RuntimeError: boom"
    # A worker that failed only because Horovod shut down under it is not the cause,
    # even when horovodrun saw it exit first.
    watcher = launcher.OutputWatcher()
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
    watcher = launcher.OutputWatcher()
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
    assert watcher.summary(1) == "epl-launch: worker 1 failed: RuntimeError: boom"
    assert watcher.cause(*watcher.failure()) == "RuntimeError: boom"
    # A worker that exited with SystemExit('message') prints only the message; its peer,
    # failing in consequence, exited first and horovodrun terminated it (143).
    watcher = launcher.OutputWatcher()
    for line in [
            "[1]<stderr>:W0000 00:00:17.1 some_file.cc:12] a TensorFlow log line",
            "[1]<stderr>:bad shard 3 at step 3",
            "[0]<stderr>:Traceback (most recent call last):",
            "[0]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: Graph execution error:",
            "[0]<stderr>:Horovod has been shut down. This was caused by an exception on one of the ranks",
            "Process 0 exit with status code 1.",
            "[1]<stderr>:Terminated",
            "Process 1 exit with status code 143."]:
        watcher.feed(line)
    assert watcher.summary(1) == "epl-launch: worker 1 failed: bad shard 3 at step 3"
    # A worker killed by a signal: the signal is the cause.
    watcher = launcher.OutputWatcher()
    for line in ["[1]<stderr>:Traceback (most recent call last):", "[1]<stderr>:OldError: x",
                 "Process 1 exit with status code 137."]:
        watcher.feed(line)
    assert watcher.summary(1) == "epl-launch: worker 1 failed (exit 137): killed by SIGKILL"
    assert watcher.cause(1, 137) == "killed by SIGKILL"
    # A worker that raised and was then terminated (a signal exit) is reported by its
    # exception, never as a bare signal.
    watcher = launcher.OutputWatcher()
    for line in ["[1]<stderr>:Traceback (most recent call last):", "[1]<stderr>:ValueError: x",
                 "Process 1 exit with status code -15."]:
        watcher.feed(line)
    assert watcher.summary(1) == "epl-launch: worker 1 failed: ValueError: x"
    assert watcher.cause(1, -15) == "ValueError: x"
    # Without horovodrun's per-process lines, its final report is used.
    watcher = launcher.OutputWatcher()
    for line in HOROVODRUN_FAILURE.splitlines():
        if not line.startswith("Process ") or line.startswith("Process name"):
            watcher.feed(line)
    assert watcher.failure() == (1, 1)


def test_output_watcher_blames_the_worker_epl_found_at_fault():
    """The worker that waited raised ClusterError and exited first (1); the stalled one
    was terminated (143): the culprit named by the waiter's event is the one that failed."""
    event = json.dumps({"event": "culprits", "message": "m", "culprits": [
        {"rank": 1, "how": "silent", "text": "stalled: it is alive but not progressing: its "
                                             "process is stopped (SIGSTOP, or a debugger)"}]})
    watcher = launcher.OutputWatcher()
    for line in ["[0]<stderr>:epl-launch-event: " + event,
                 "[0]<stderr>:Traceback (most recent call last):",
                 "[0]<stderr>:epl.errors.ClusterError: worker 0 of 2: ... worker 1 stalled: ...",
                 "Process 0 exit with status code 1.",
                 "Process 1 exit with status code 143."]:
        watcher.feed(line)
    assert watcher.failure() == (1, 143)
    assert watcher.summary(1) == (
        "epl-launch: worker 1 failed (stalled, reported by worker 0): epl.errors.ClusterError: "
        "worker 0 of 2: ... worker 1 stalled: ...")
    assert watcher.cause(1, 143) == (
        "stalled: it is alive but not progressing: its process is stopped (SIGSTOP, or a "
        "debugger) (reported by worker 0)")
    # A worker at fault that raised an error of its own (a save that failed) is reported
    # by that error, even when the peers said it left.
    watcher = launcher.OutputWatcher()
    event = json.dumps({"event": "culprits", "message": "m", "culprits": [
        {"rank": 0, "how": "left", "text": "left the job after global step 10: it raised X"}]})
    for line in ["[1]<stderr>:epl-launch-event: " + event,
                 "[0]<stderr>:Traceback (most recent call last):",
                 "[0]<stderr>:epl.errors.CheckpointError: saving the checkpoint c failed",
                 "Process 1 exit with status code 1.", "Process 0 exit with status code 143."]:
        watcher.feed(line)
    assert watcher.summary(1) == (
        "epl-launch: worker 0 failed: epl.errors.CheckpointError: saving the checkpoint c failed")


def test_restarter_drops_the_slots_of_the_workers_at_fault():
    args = launcher.parse_command_line(["-np", "3", "-H", "a:1,b:1,c:1", "--restarts", "1",
                                        "--min-np", "1", "python", "x.py"], horovod={})
    out = io.StringIO()
    restarter = launcher.Restarter(args, out)
    watcher = launcher.OutputWatcher()
    event = json.dumps({"event": "culprits", "message": "m", "culprits": [
        {"rank": 1, "how": "idle", "text": "stalled: it is alive but not progressing: x"}]})
    for line in ["[0]<stderr>:epl-launch-event: " + event, "Process 0 exit with status code 1.",
                 "Process 1 exit with status code 143.", "Process 2 exit with status code 143."]:
        watcher.feed(line)
    assert restarter.next_attempt(watcher)
    assert (args.np, args.hosts) == (2, "a:1,c:1")  # worker 1's host b, not worker 0's a
    assert out.getvalue() == (
        "epl-launch: restart 1 of 1 after worker 1 failed (stalled: it is alive but not "
        "progressing: x (reported by worker 0)): starting 2 workers again (-H a:1,c:1)\n")


def test_rank_files_keep_every_ranks_output(tmp_path):
    files = launch_output.RankFiles(str(tmp_path), 12)
    for line in ["[0]<stdout>:step 1", "[11]<stderr>:W0000 a log line", "Process 11 exit with "
                 "status code 1.", "[0]<stderr>:epl-launch-event: {}", "[0]<stdout>:step 2\n"]:
        files.write(line)
    files.new_attempt("epl-launch: restart 1")
    files.write("[0]<stdout>:step 1")
    files.close()
    assert (tmp_path / "rank.00" / "stdout").read_text() == (
        "step 1\nstep 2\nepl-launch: restart 1\nstep 1\n")
    assert (tmp_path / "rank.11" / "stderr").read_text() == "W0000 a log line\n"
    assert not (tmp_path / "rank.00" / "stderr").exists()  # the event is the launcher's
    assert (tmp_path / "launcher.log").read_text() == "Process 11 exit with status code 1.\n"


def test_horovodrun_options_are_read_from_its_help():
    options = launcher.horovodrun_options()
    assert options["--timeline-filename"] == 1 and options["--verbose"] == 0
    assert options["-np"] == 1 and options["--blacklist-cooldown-range"] == 2
    assert launcher.parse_help_options(
        "usage: x [-h] [--a A]\n\noptions:\n  -h, --help  show\n  --a A, -a A  value\n"
        "  --many M [M ...]\n                        help\n  --flag\n") == {
        "-h": 0, "--help": 0, "--a": 1, "-a": 1, "--many": -1, "--flag": 0}


def test_unknown_option_goes_to_horovodrun_which_refuses_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    out = io.StringIO()
    args = launcher.parse_command_line(["-np", "2", "--no-such-flag", "python", str(script)])
    assert args.horovod_args == ["--no-such-flag"]
    cmd, env = launcher.build(args)
    code, _ = launcher.run(cmd, env, out=out)
    assert code == 2
    assert out.getvalue().splitlines()[-1] == (
        "epl-launch: horovodrun failed (exit 2) before starting any worker: horovodrun: error: "
        "unrecognized arguments: --no-such-flag")


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
                if mode == "exit" and hvd.rank() == 1 and step == 3:
                    raise SystemExit("bad shard 3 at step 3")
                value = sess.run(total, {x: np.full(3, hvd.rank() + 1, np.float32)})
                print("step", step, value.tolist(), flush=True)
            if mode == "ok":
                print("tick", time.time(), flush=True)
                time.sleep(2)  # output before this pause must arrive before it ends
                print("tock", flush=True)
''')


def _launch(tmp_path, *args: str):
    """epl-launch ARGS[:-1] -- python WORKER_SCRIPT ARGS[-1]: the job (tests/multiworker.Job)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    return run_job([EPL_LAUNCH, *args[:-1], "--", sys.executable, str(script), args[-1]],
                   JOB_TIMEOUT)


@pytest.mark.multiworker
def test_two_workers_succeed_and_stream_prefixed_output(tmp_path):
    job = _launch(tmp_path, "-np", "2", "--virtual-devices", "2", "--timeout", "30", "ok")
    text = job.text
    assert job.returncode == 0, "\n".join(text)[-4000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:env 2 30" in text
        assert f"[{rank}]<stdout>:step 4 [3.0, 3.0, 3.0]" in text
    # Streamed: "tick" reached us about 2 s before "tock", not all at the end.
    tick, _ = job.first("[0]<stdout>:tick")
    tock, _ = job.first("[0]<stdout>:tock")
    assert tock - tick > 1.5
    assert not any(line.startswith("epl-launch:") for line in text)


@pytest.mark.multiworker
def test_crashing_worker_fails_the_job_naming_rank_and_error(tmp_path):
    job = _launch(tmp_path, "-np", "2", "--timeout", "20", "crash")
    text = job.text
    assert job.returncode == 1, "\n".join(text)[-4000:]
    # (exit 1), or no exit code when horovodrun terminated it while it was still exiting.
    assert re.fullmatch(r"epl-launch: worker 1 failed( \(exit 1\))?: RuntimeError: boom at step 3",
                        text[-1]), "\n".join(text)[-6000:]
    assert "[1]<stdout>:step 2 [3.0, 3.0, 3.0]" in text  # it did run a few steps
    # The job ends well within the 20 s stall timeout after the crash.
    crashed, _ = job.first("[1]<stderr>:RuntimeError: boom")
    assert job.end - crashed < 20
    assert job.elapsed < JOB_TIMEOUT


@pytest.mark.multiworker
def test_output_dir_keeps_every_ranks_output_across_restarts(tmp_path):
    """--output-dir: each rank's whole output in DIR/rank.<r>/{stdout,stderr}, unprefixed,
    both attempts of a job restarted once (worker 1 crashes in each)."""
    logs = tmp_path / "logs"
    job = _launch(tmp_path, "-np", "2", "--timeout", "20", "--restarts", "1", "--output-dir",
                  str(logs), "crash")
    assert job.returncode == 1, "\n".join(job.text)[-4000:]
    stdout = (logs / "rank.0" / "stdout").read_text().splitlines()
    assert stdout.count("step 2 [3.0, 3.0, 3.0]") == 2
    assert stdout.index("epl-launch: restart 1") > stdout.index("step 2 [3.0, 3.0, 3.0]")
    stderr = (logs / "rank.1" / "stderr").read_text().splitlines()
    assert stderr.count("RuntimeError: boom at step 3") == 2
    launcher_log = (logs / "launcher.log").read_text()
    assert re.search(r"^epl-launch: restart 1 of 1 after worker 1 failed", launcher_log, re.M)
    assert launcher_log.rstrip().splitlines()[-1] == "epl-launch: no restarts left (--restarts 1)"


@pytest.mark.multiworker
def test_worker_exiting_with_a_message_is_quoted(tmp_path):
    job = _launch(tmp_path, "-np", "2", "--timeout", "20", "exit")
    assert job.returncode == 1, "\n".join(job.text)[-4000:]
    assert re.fullmatch(r"epl-launch: worker 1 failed( \(exit 1\))?: bad shard 3 at step 3",
                        job.text[-1]), "\n".join(job.text)[-4000:]
    exited, _ = job.first("[1]<stderr>:bad shard 3 at step 3")
    # the job ends within the collective timeout (--timeout 20) plus 5 s of slack, the
    # bound EPL documents for a failure (tests/runtime/test_worker_failures.py)
    assert job.end - exited <= 20 + 5


@pytest.mark.multiworker
def test_missing_script_fails_before_any_worker_starts(tmp_path):
    job = run_job([EPL_LAUNCH, "-np", "2", "python", str(tmp_path / "missing.py")], 60)
    assert job.returncode == 2
    assert job.text == ["epl-launch: script %s not found (in %s): every worker would fail with "
                        "\"can't open file\"" % (tmp_path / "missing.py", os.getcwd())]
    assert job.elapsed < 10


@pytest.mark.multiworker
def test_horovod_timeline_names_collectives_after_the_variables(tmp_path):
    """--timeline-filename goes to horovodrun; Horovod's timeline shows the gradients'
    all-reduce under the variables it carries (w1, b1, w2), not EPL_allreduce_N."""
    timeline = tmp_path / "timeline.json"
    job = epl_launch(["-np", "2", "--timeout", "60", "--timeline-filename", str(timeline)],
                     ["oracle_worker.py", "sgd", "8,8", str(tmp_path)])
    assert job.returncode == 0, errors(job.stdout)
    names = set(re.findall(r'"name": ?"([^"]+)"', timeline.read_text()))
    assert any(re.fullmatch(r"allreduce_\d+\.w2__b1__w1", n) for n in names), sorted(names)[:40]
    assert any(re.fullmatch(r"broadcast_\d+\.w1", n) for n in names), sorted(names)[:40]
    assert not any(n.startswith("EPL_allreduce") for n in names)


# --------------------------------------------------------------------------
# --restarts: a killed worker, the job restarted from the last checkpoint
# --------------------------------------------------------------------------


def _batches(ranks):
    common = worker_module("common")
    return lambda step: [common.step_batch(step, rank) for rank in ranks]


@pytest.mark.multiworker
def test_restart_after_a_kill_finishes_from_the_last_checkpoint(tmp_path, report):
    """Worker 1 is SIGKILLed at global step 12 of 20; epl-launch --restarts restarts the
    job, which resumes from the checkpoint of step 10 and finishes 20 steps, with the
    numbers of plain TensorFlow resumed from that checkpoint."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = epl_launch(["-np", "2", "--timeout", "60", "--restarts", "2"],
                     ["checkpoint_worker.py", "rank0", str(out), str(ckpt), "12"], timeout=300)
    assert job.returncode == 0, errors(job.stdout)
    log = [re.sub(r" in \d+\.\d\d s\)$", " in SECONDS s)", line) for line in job.text
           if line.startswith("epl-launch:")]
    assert log == ["epl-launch: worker 1 failed (exit 137): killed by SIGKILL",
                   "epl-launch: restart 1 of 2 after worker 1 failed (killed by SIGKILL): "
                   "starting 2 workers again (-H localhost:2)",
                   "epl-launch: restart 1: resumed from global step 10 (worker 0 restored %s in "
                   "SECONDS s)" % (ckpt / "model.ckpt-10")], "\n".join(log)
    killed, _ = job.first("rank 1 kills itself at step 12")
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["start"] == 10 and record["steps"] == list(range(10, 20))
        assert_matches_plain(record["variables"], _batches((0, 1)), 10, 20,
                             str(ckpt / "model.ckpt-10"))
    resumed, _ = job.first("restart 1: resumed from")
    report(f"epl-launch --restarts: kill at step 12 -> restored step 10 after "
           f"{resumed - killed:.1f} s; job of 20 steps done {job.end - killed:.1f} s after "
           "the kill")


@pytest.mark.multiworker
def test_restart_with_fewer_workers_under_min_np(tmp_path):
    """--min-np 1: the failed worker's slot is given up; the job goes on with worker 0
    alone from the checkpoint of step 10 (its own batch per step: a smaller global batch)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = epl_launch(["-np", "2", "--timeout", "60", "--restarts", "1", "--min-np", "1"],
                     ["checkpoint_worker.py", "rank0", str(out), str(ckpt), "12"], timeout=300)
    assert job.returncode == 0, errors(job.stdout)
    assert ("epl-launch: restart 1 of 1 after worker 1 failed (killed by SIGKILL): starting 1 "
            "worker again (-H localhost:1)") in job.text
    assert not (out / "rank1.json").exists()
    record = json.loads((out / "rank0.json").read_text())
    assert record["start"] == 10 and record["steps"] == list(range(10, 20))
    assert_matches_plain(record["variables"], _batches((0,)), 10, 20, str(ckpt / "model.ckpt-10"))


@pytest.mark.multiworker
def test_no_restarts_left_fails_the_job(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = epl_launch(["-np", "2", "--timeout", "60", "--restarts", "1", "--min-np", "2"],
                     ["checkpoint_worker.py", "rank0", str(out), str(ckpt), "12", "1", "always"],
                     timeout=300)
    assert job.returncode == 137, errors(job.stdout)
    assert [line for line in job.text if line.startswith("epl-launch:")][-1] == \
        "epl-launch: no restarts left (--restarts 1)"


@pytest.mark.multiworker
def test_recovery_benchmark_quick(report):
    """bench/recovery.py runs end to end (one repeat) and prints its ratio."""
    bench = os.path.join(BENCH, "recovery.py")
    job = run_job([sys.executable, bench, "--quick"], 600)
    assert job.returncode == 0, job.stdout[-3000:]
    line = next(line for line in job.text if line.startswith("recovery: "))
    assert re.fullmatch(r"recovery: restart / fresh start-up = [\d.]+ \(median of 1; "
                        r"restart [\d.]+ s, fresh [\d.]+ s\)", line), line
    parts = next(line for line in job.text if line.startswith("restart parts (medians): "))
    assert re.fullmatch(r"restart parts \(medians\): detection [\d.]+ s, teardown [\d.]+ s, "
                        r"start-up [\d.]+ s, restore [\d.]+ s, first step [\d.]+ s", parts), parts
    report(parts)
    report(line)
