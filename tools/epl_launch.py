"""`epl-launch`: start an EPL training script on N workers (Horovod over Gloo).

::

    epl-launch -np N [-H host1:slots,host2:slots] [--virtual-devices K]
               [--timeout S] [--] command args...

EPL's own form, ``epl-launch --num_workers N --gpu_per_worker K script``, is
rewritten into these options first (`tools/epl_launch_flags.py`).

It wraps ``horovodrun --gloo`` (the one next to this Python, else the one on
PATH) and adds what EPL's process model needs:

- ``-H`` defaults to ``localhost:N``; before anything starts, ``-np`` is
  checked against the total slots of ``-H`` (a host without ``:slots`` has
  one), and a request for more workers than slots exits with code 2.
- ``--virtual-devices K`` sets ``EPL_CLUSTER_VIRTUAL_DEVICES=K`` for every
  worker (the number of virtual CPU devices a worker drives on a machine
  without accelerators).
- ``--timeout S`` (default: ``communication.collective_timeout_s``, from
  ``EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S`` if set, else EPL's default of
  300 s) bounds how long a collective may wait for its peers: Horovod's
  stall check warns after min(60, S/2) s and shuts Horovod down after S s,
  so a stalled collective fails every worker instead of hanging forever.
  With ``--timeout`` given, ``EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S`` is set
  for the workers as well, so EPL's own bounded waits (the collective check,
  `epl.runtime.collective_check.call_with_timeout`) use the same limit. The
  run as a whole is not bounded. Caveat, measured with Horovod 0.28.1 (Gloo,
  TF graph mode): its stall check runs but did not report or shut down a
  worker waiting on a collective its peer never submits; a worker that dies
  is handled by horovodrun itself (it terminates the others at once), and
  EPL's own waits are bounded by `call_with_timeout`.
- Output is streamed line by line, with horovodrun's per-worker prefix
  (``[rank]<stdout>:`` / ``[rank]<stderr>:``); workers run with
  ``PYTHONUNBUFFERED=1``.
- When a worker fails, the exit code is non-zero and the last line names the
  failing worker, its exit code and its last error line::

      epl-launch: worker 1 failed (exit 1): RuntimeError: boom

Bad input (no command, -np < 1, a malformed -H, more workers than slots,
no horovodrun) prints ``epl-launch: <problem>`` on stderr and exits 2.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Mapping, Sequence

try:  # tools.* from a checkout, epl_tools.* when installed
    from .epl_launch_flags import EplFlagError, translate_epl_flags
except ImportError:  # run as a script: python tools/epl_launch.py
    from epl_launch_flags import EplFlagError, translate_epl_flags

PROG = "epl-launch"
_TIMEOUT_KEY = "communication.collective_timeout_s"

# horovodrun's worker prefix, optionally after a timestamp: "[1]<stderr>:text".
_PREFIXED = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)$")
# horovodrun's own reports about worker exits.
_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_FIRST_NAME = re.compile(r"^Process name: (\d+)\s*$")
_FIRST_CODE = re.compile(r"^Exit code: (-?\d+)\s*$")
# Horovod's own ERROR log lines (printed on stdout): "[2026-01-01 12:00:00.0: E file.cc:1] ..."
_HOROVOD_ERROR = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:.]+: E ")
# What a worker prints when it fails only because a peer failed first.
_SECONDARY = re.compile(r"Horovod has been shut down|Connection reset by peer|"
                        r"Connection closed by peer")
# A line that looks like an error: a Python exception line, or a fatal message.
_ERROR_LINE = re.compile(
    r"(^\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b)|Error|Exception|"
    r"\berror\b|FATAL|Fatal|Aborted|Segmentation fault|core dumped|Killed")


class LaunchError(Exception):
    """Bad input to epl-launch (exit code 2)."""


def default_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``communication.collective_timeout_s``: the environment's value, else EPL's default."""
    from epl import config

    spec = next(s for s in config.schema() if s.key == _TIMEOUT_KEY)
    text = (os.environ if environ is None else environ).get(spec.env_var)
    if text:
        try:
            value = float(text)
        except ValueError:
            raise LaunchError("%s=%r is not a number of seconds" % (spec.env_var, text)) from None
        if value > 0:
            return value
    return float(spec.default)


def parse_hosts(hosts: str) -> list[tuple[str, int]]:
    """``"a:2,b:4"`` -> ``[("a", 2), ("b", 4)]``; a host without ``:slots`` has one slot."""
    out = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise LaunchError("-H %s has an empty host entry; write host1:slots,host2:slots" % hosts)
        name, sep, slots = part.rpartition(":")
        if not sep:
            name, slots = part, "1"
        if not name:
            raise LaunchError("-H %s: %r has no host name; write host:slots" % (hosts, part))
        try:
            count = int(slots)
        except ValueError:
            raise LaunchError("-H %s: %r has slots %r, not a whole number; write host:slots"
                              % (hosts, part, slots)) from None
        if count < 1:
            raise LaunchError("-H %s: %r has %d slots; every host needs at least 1"
                              % (hosts, part, count))
        out.append((name, count))
    return out


def find_horovodrun() -> str:
    """horovodrun next to this Python (the venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which("horovodrun")
    if found:
        return found
    raise LaunchError("horovodrun is not next to %s nor on PATH; run `make setup` (it builds "
                      "Horovod with tools/build_horovod.sh)" % sys.executable)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a command on N EPL workers through horovodrun --gloo.")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                        help="number of workers")
    parser.add_argument("-H", "--hosts", dest="hosts", default=None,
                        help="host1:slots,host2:slots (default localhost:N)")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="virtual CPU devices per worker (sets EPL_CLUSTER_VIRTUAL_DEVICES)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a collective may stall before Horovod shuts down "
                             "(default: communication.collective_timeout_s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    return parser


def build(args: argparse.Namespace, environ: Mapping[str, str] | None = None
          ) -> tuple[list[str], dict[str, str]]:
    """The horovodrun command line and the environment for it (and its workers)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no command to run; usage: epl-launch -np N [-H hosts] -- command args...")
    if args.np < 1:
        raise LaunchError("-np %d asks for no workers; give -np 1 or more" % args.np)
    hosts = args.hosts or "localhost:%d" % args.np
    slots = sum(count for _, count in parse_hosts(hosts))
    if args.np > slots:
        raise LaunchError("-np %d asks for %d workers but -H %s gives %d slot%s; add hosts or slots"
                          % (args.np, args.np, hosts, slots, "" if slots == 1 else "s"))
    if args.virtual_devices is not None and args.virtual_devices < 1:
        raise LaunchError("--virtual-devices %d: a worker needs at least 1 device"
                          % args.virtual_devices)
    if args.timeout is not None and not args.timeout > 0:
        raise LaunchError("--timeout %g: give a positive number of seconds" % args.timeout)
    timeout = args.timeout if args.timeout is not None else default_timeout(environ)
    shutdown_s = max(1, int(math.ceil(timeout)))
    warning_s = max(1, min(60, shutdown_s // 2))

    env = dict(os.environ if environ is None else environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(warning_s)
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(shutdown_s)
    env.pop("HOROVOD_STALL_CHECK_DISABLE", None)
    if args.virtual_devices is not None:
        env["EPL_CLUSTER_VIRTUAL_DEVICES"] = str(args.virtual_devices)
    if args.timeout is not None:
        env["EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S"] = repr(float(args.timeout))
    cmd = [find_horovodrun(), "--gloo", "-np", str(args.np), "-H", hosts,
           "--stall-check-warning-time-seconds", str(warning_s),
           "--stall-check-shutdown-time-seconds", str(shutdown_s)] + command
    return cmd, env


class OutputWatcher:
    """Reads horovodrun's output: each worker's last error line and who failed first."""

    def __init__(self):
        self.last_error: dict[int, str] = {}      # last error-looking line per rank
        self.last_exception: dict[int, str] = {}  # last Python exception line per rank
        self._in_traceback: set[int] = set()
        self.secondary: set[int] = set()  # ranks that only failed because a peer did
        self.exits: list[tuple[int, int]] = []  # (rank, code) in the order reported
        self.first_failed: tuple[int | None, int | None] = (None, None)
        self._pending_name: int | None = None

    def feed(self, line: str) -> None:
        """Take one output line (without the newline)."""
        match = _PREFIXED.search(line)
        if match:
            rank, stream, raw = int(match.group(1)), match.group(2), match.group(3)
            text = raw.strip()
            if _SECONDARY.search(text):
                self.secondary.add(rank)
            if stream == "stdout":
                if _HOROVOD_ERROR.match(text):  # Horovod logs to stdout
                    self.last_error[rank] = text
                return
            if text.startswith("Traceback (most recent call last)"):
                self._in_traceback.add(rank)
                return
            if rank in self._in_traceback and raw[:1] not in (" ", "\t") and text:
                # The first unindented line after a traceback is the exception.
                self._in_traceback.discard(rank)
                self.last_exception[rank] = text
                return
            if rank not in self._in_traceback and text and _ERROR_LINE.search(text):
                self.last_error[rank] = text
            return
        match = _EXIT.match(line)
        if match:
            self.exits.append((int(match.group(1)), int(match.group(2))))
            return
        match = _FIRST_NAME.match(line)
        if match:
            self._pending_name = int(match.group(1))
            return
        match = _FIRST_CODE.match(line)
        if match and self._pending_name is not None:
            self.first_failed = (self._pending_name, int(match.group(1)))
            self._pending_name = None

    def error_of(self, rank: int) -> str | None:
        """The error line of `rank`: its last Python exception, else its last error-looking line."""
        return self.last_exception.get(rank) or self.last_error.get(rank)

    def failure(self) -> tuple[int | None, int | None]:
        """(rank, exit code) of the worker that failed first, as far as the output tells.

        Workers that only failed because a peer did (Horovod shut down under
        them, or horovodrun terminated them: exit 143) come last.
        """
        failed = [(rank, code) for rank, code in self.exits if code != 0]  # in exit order
        for rank, code in failed:  # the first failure that is not a consequence of another
            if rank not in self.secondary and code != 143:
                return rank, code
        # A worker that raised but was terminated while exiting (143) because a
        # peer, failing in consequence, exited first.
        codes = dict(failed)
        if self.first_failed[0] is not None:
            codes.setdefault(self.first_failed[0], self.first_failed[1])
        for rank in sorted(set(self.last_exception) | set(self.last_error),
                           key=lambda r: (r in self.secondary, r not in codes, r)):
            if rank not in self.secondary:
                return rank, codes.get(rank)
        if failed:
            return failed[0]
        if self.first_failed[0] is not None:
            return self.first_failed
        if self.last_exception or self.last_error:
            return min(set(self.last_exception) | set(self.last_error)), None
        return None, None

    def summary(self, returncode: int) -> str:
        """The final line for a failed run."""
        rank, code = self.failure()
        if rank is None:
            return "%s: horovodrun failed (exit %d) and no worker reported an error" % (
                PROG, returncode)
        error = self.error_of(rank)
        if error is None:
            others = {r: self.error_of(r) for r in set(self.last_error) | set(self.last_exception)
                      if r != rank}
            error = ("no error line in its output" if not others else
                     "no error line in its output (worker %d: %s)" % next(iter(sorted(others.items()))))
        return "%s: worker %d failed (exit %s): %s" % (
            PROG, rank, "?" if code is None else code, error)


def run(cmd: Sequence[str], env: dict[str, str], out=None) -> int:
    """Run horovodrun, stream its output to `out`, return the exit code for epl-launch."""
    out = out or sys.stdout
    watcher = OutputWatcher()
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, bufsize=1, text=True, errors="replace")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            watcher.feed(line.rstrip("\r\n"))
        returncode = proc.wait()
    except BaseException:  # Ctrl-C or a kill of this process: take horovodrun down with us
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if returncode == 0 and not any(code != 0 for _, code in watcher.exits):
        return 0  # error-looking lines of a successful job are not failures
    rank, code = watcher.failure()
    print(watcher.summary(returncode), file=out, flush=True)
    if code is not None and 0 < code < 256:
        return code
    return returncode if 0 < returncode < 256 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `epl-launch`; returns the exit code."""
    parser = _parser()
    try:  # EPL's --num_workers/--gpu_per_worker, rewritten into this launcher's options
        argv = translate_epl_flags(list(sys.argv[1:] if argv is None else argv))
    except EplFlagError as err:
        print("%s: %s" % (PROG, err), file=sys.stderr, flush=True)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's own usage errors exit 2 already
        return int(exc.code or 0)
    try:
        cmd, env = build(args)
    except LaunchError as err:
        print("%s: %s" % (PROG, err), file=sys.stderr, flush=True)
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM to epl-launch takes horovodrun (and with it the workers) down too.
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return run(cmd, env)
    except KeyboardInterrupt:
        print("%s: interrupted; workers stopped" % PROG, file=sys.stderr, flush=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm(signum, frame):  # pragma: no cover - exercised by hand
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
