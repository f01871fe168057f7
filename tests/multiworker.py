"""Running jobs of several workers in tests: the one horovodrun / epl-launch helper.

Every multi-worker test starts its workers through `run_job` (directly, or
through `horovodrun` / `epl_launch`): the job runs in its own process group,
its output is read line by line with the time each line arrived, and a job
that overruns its timeout is killed (the whole group) and fails the test
instead of stalling CI.

Horovod must be installed: `require_horovod` fails (never skips) without it.
Tests that start workers carry the `multiworker` mark (pytest.ini).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")
EPL_LAUNCH = os.path.join(BIN, "epl-launch")
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
JOB_TIMEOUT = 180


def require_horovod() -> None:
    """Fail (not skip) when Horovod or horovodrun is missing."""
    import horovod.tensorflow  # noqa: F401  (ImportError fails the test)
    assert os.path.exists(HOROVODRUN), "horovodrun missing: run `make setup` to build Horovod"


@dataclasses.dataclass
class Job:
    """A finished job: exit code, output lines with their arrival times, and timings."""

    returncode: int
    lines: list  # [(time.time() when the line arrived, line without its newline)]
    start: float  # time.time() when the job started
    elapsed: float  # seconds from start to exit

    @property
    def stdout(self) -> str:
        """The whole output (stdout and stderr together)."""
        return "".join(line + "\n" for _, line in self.lines)

    stderr = ""  # merged into stdout

    @property
    def text(self) -> list[str]:
        """The output lines."""
        return [line for _, line in self.lines]

    @property
    def end(self) -> float:
        """time.time() when the job exited."""
        return self.start + self.elapsed

    def first(self, needle: str) -> tuple[float, str]:
        """(arrival time, line) of the first line containing `needle`; fails the test if none."""
        for arrived, line in self.lines:
            if needle in line:
                return arrived, line
        pytest.fail("no output line contains %r:\n%s" % (needle, errors(self.stdout)))


def run_job(command: list[str], timeout: float = JOB_TIMEOUT, env: dict | None = None) -> Job:
    """Run `command` in its own process group, streaming its output; kill the whole
    group and fail the test if it overruns `timeout` seconds."""
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    environ.update(env or {})
    start, clock = time.time(), time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=environ, start_new_session=True, errors="replace")
    lines: list = []
    timer = _Killer(proc, timeout)
    try:
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
        proc.wait()
    finally:
        timer.cancel()
    elapsed = time.monotonic() - clock
    if timer.fired:
        pytest.fail("job overran %ss (hang?): %s\n%s" % (
            timeout, " ".join(command), "\n".join(line for _, line in lines)[-4000:]))
    return Job(proc.returncode, lines, start, elapsed)


class _Killer:
    """Kills a process group after `timeout` seconds unless cancelled."""

    def __init__(self, proc: subprocess.Popen, timeout: float):
        import threading
        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(timeout, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self):
        self.fired = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self):
        self._timer.cancel()


def worker_script(script: str) -> str:
    """The path of `script`: a name in tests/workers/, or any path."""
    return script if os.path.isabs(script) else os.path.join(WORKERS, script)


def horovodrun(script: str, *args: str, np: int = 2, timeout: float = JOB_TIMEOUT,
               env: dict | None = None, python: str = sys.executable) -> Job:
    """`horovodrun --gloo -np NP -H localhost:NP python SCRIPT ARGS...` on this machine."""
    require_horovod()
    return run_job([HOROVODRUN, "--gloo", "-np", str(np), "-H", f"localhost:{np}", python,
                    worker_script(script), *args], timeout, env)


def epl_launch(launch_args: list[str], command: list[str], timeout: float = JOB_TIMEOUT,
               env: dict | None = None) -> Job:
    """`epl-launch LAUNCH_ARGS -- COMMAND` (a script name in tests/workers/ runs with
    this Python)."""
    require_horovod()
    assert os.path.exists(EPL_LAUNCH), "epl-launch is not installed: run `make setup`"
    if command and command[0].endswith(".py"):
        command = [sys.executable, worker_script(command[0]), *command[1:]]
    return run_job([EPL_LAUNCH, *launch_args, "--", *command], timeout, env)


def errors(out: str) -> str:
    """The error-looking lines of a job's output (for assertion messages)."""
    keep = [line for line in out.splitlines()
            if "Error" in line or "Mismatch" in line or "epl-launch" in line or "EPL" in line]
    return "\n".join(keep)[-4000:]


# --------------------------------------------------------------------------
# The oracle of the checkpoint and restart tests: plain TensorFlow on the data
# the workers fed
# --------------------------------------------------------------------------


def worker_module(name: str):
    """Import tests/workers/<name>.py under a private module name (the worker
    scripts import each other as top-level modules, e.g. `common`)."""
    import importlib.util
    key = "epl_test_workers_" + name
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, os.path.join(WORKERS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def plain_training(batches, start: int, stop: int, checkpoint: str | None = None,
                   combine: str = "concat") -> dict:
    """Variables of oracle_worker's MLP (Adam 0.05, global step) trained in plain
    TensorFlow (EPL not initialized) from global step `start` to `stop`.

    batches(step) -> [(features, labels) of each worker at that step]: exactly
    what the workers fed. The model starts from its fixed initial values, or
    from `checkpoint` (a checkpoint EPL wrote: single-device names and shapes).
    combine: "concat", the single-device gradient of the concatenated batch
    (the oracle); "mean", the workers' gradients weighted by their rows and
    summed (another summation order: the noise floor).
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(1)  # oracle_worker.build's initial values
    init = {"w1": rng.randn(6, 8).astype(np.float32) * 0.5, "b1": np.zeros(8, np.float32),
            "w2": rng.randn(8, 3).astype(np.float32) * 0.5}
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        variables = [tf.compat.v1.get_variable(n, initializer=v) for n, v in init.items()]
        w1, b1, w2 = variables
        logits = tf.matmul(tf.nn.tanh(tf.matmul(x, w1) + b1), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.AdamOptimizer(0.05)
        grads = [g for g, _ in opt.compute_gradients(loss, variables)]
        fed = [tf.compat.v1.placeholder(tf.float32, v.shape) for v in variables]
        train = opt.apply_gradients(list(zip(fed, variables)), global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            if checkpoint is not None:
                tf.compat.v1.train.Saver().restore(sess, checkpoint)
            assert int(sess.run(step)) == start, (int(sess.run(step)), start)
            for k in range(start, stop):
                parts = batches(k)
                if combine == "concat":
                    values = sess.run(grads, {x: np.concatenate([p[0] for p in parts]),
                                              y: np.concatenate([p[1] for p in parts])})
                else:
                    total = sum(len(p[1]) for p in parts)
                    each = [sess.run(grads, {x: p[0], y: p[1]}) for p in parts]
                    values = [sum(np.float32(len(p[1]) / total) * g[i] for p, g in zip(parts, each))
                              for i in range(len(variables))]
                sess.run(train, dict(zip(fed, values)))
            names = [v.op.name for v in variables] + ["global_step"]
            return dict(zip(names, sess.run(variables + [step])))


def assert_matches_plain(variables: dict, batches, start: int, stop: int,
                         checkpoint: str | None = None) -> float:
    """`variables` (name -> value, from an EPL job) equal plain training on the same
    data (`plain_training`, "concat"), within a tolerance derived from the noise
    floor: 10 x the largest difference between the "concat" and "mean" plain runs
    (two summation orders of the same arithmetic), plus 4 float32 ulps of the
    values. Returns the largest difference found, relative to the tolerance."""
    import numpy as np

    oracle = plain_training(batches, start, stop, checkpoint, "concat")
    other = plain_training(batches, start, stop, checkpoint, "mean")
    worst = 0.0
    for name, expected in oracle.items():
        got = np.asarray(variables[name])
        floor = float(np.max(np.abs(np.asarray(other[name], np.float64) - expected)))
        tolerance = 10 * floor + 4 * float(np.finfo(np.float32).eps) * float(
            np.max(np.abs(expected)))
        diff = float(np.max(np.abs(got - expected)))
        assert diff <= tolerance, (name, diff, tolerance, floor)
        worst = max(worst, diff / tolerance if tolerance else 0.0)
    return worst
