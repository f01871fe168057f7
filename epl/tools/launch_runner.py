"""horovodrun, kept running between the attempts of one `epl-launch` job.

Before it starts any worker, every ``horovodrun --gloo`` checks that Horovod
was built with Gloo by importing ``horovod.tensorflow`` (and with it
TensorFlow) in a child process: 4 s on a 2-core machine, in front of every
start and every restart. horovodrun's Python entry point,
``horovod.runner.launch.run_commandline`` (what the ``horovodrun`` console
script calls), caches that check for the life of its process. So epl-launch
runs horovodrun's attempts in one helper process (`HorovodRunner`, this
module run as ``python -m epl.tools.launch_runner``): the first attempt pays
for the check, restarts do not.

Protocol: epl-launch writes one JSON line per attempt, ``{"argv": [horovodrun's
command line], "env": {the environment}}``, on the helper's stdin. The helper
runs it with that environment and command line, exactly as the console script
would (the workers' prefixed output and horovodrun's own lines on its stdout
and stderr, which epl-launch reads), then writes its exit code after
`SENTINEL` on a line of its own. horovodrun's final error (the first process
that failed) is printed as its lines, without the traceback. A SIGTERM ends
the attempt the way it ends horovodrun (horovodrun stops the workers), and the
helper exits once its stdin is closed or its parent is gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, Mapping, Sequence

SENTINEL = "\x1eepl-launch-runner exit "


class HorovodRunner:
    """epl-launch's side: the helper process and one attempt at a time."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "epl.tools.launch_runner"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1, text=True,
                errors="replace", env=env)
        return self.proc

    def run(self, argv: Sequence[str], env: Mapping[str, str]) -> Iterator[str]:
        """Run one attempt; yield its output lines (with their newline); afterwards
        `returncode` holds horovodrun's exit code."""
        proc = self._start()
        self.returncode = None
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env)}) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(SENTINEL):
                self.returncode = int(line[len(SENTINEL):])
                return
            yield line
        self.returncode = proc.wait() or 1  # the helper itself died

    def interrupt(self) -> None:
        """Stop the attempt under way (horovodrun stops its workers) and the helper."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        self.close(timeout=10)

    def close(self, timeout: float = 10) -> None:
        """End the helper (after its attempt, if one is running)."""
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.proc = None


def _attempt(argv: list[str], env: dict[str, str]) -> int:
    """Run horovodrun's entry point on `argv` with `env`; return its exit code."""
    from horovod.runner.launch import run_commandline

    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    try:
        run_commandline()
        return 0
    except SystemExit as exc:  # horovodrun's own usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except RuntimeError as err:  # "... The first process to do so was: Process name: ..."
        print(str(err), flush=True)
        return 1
    except Exception as err:  # noqa: BLE001 - reported like horovodrun's own exit
        print("horovodrun: %s: %s" % (type(err).__name__, err), flush=True)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # horovodrun set its own
            signal.signal(signum, signal.SIG_DFL)


def _exit_with_parent() -> None:
    """End this helper (as a SIGTERM: horovodrun stops its workers) when epl-launch is gone."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="epl-launch-parent", daemon=True).start()


def main() -> int:
    """The helper's loop: one attempt per line of stdin."""
    _exit_with_parent()
    for line in sys.stdin:
        request = json.loads(line)
        code = _attempt(request["argv"], request["env"])
        sys.stderr.flush()
        sys.stdout.write("%s%d\n" % (SENTINEL, code))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
