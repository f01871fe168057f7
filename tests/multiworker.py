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
    """`epl-launch LAUNCH_ARGS -- COMMAND` (a script name in tests/workers/ runs with this Python)."""
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
