"""`epl-launch`: start an EPL training script on N workers (Horovod over Gloo).

::

    epl-launch -np N [-H host1:slots,host2:slots] [--virtual-devices K]
               [--timeout S] [--restarts R [--min-np M]] [horovodrun options]
               [--] command args...

EPL's own form, ``epl-launch --num_workers N --gpu_per_worker K script``, is
rewritten into these options first (`epl/tools/launch_flags.py`).

It wraps ``horovodrun --gloo`` (the one next to this Python, else the one on
PATH) and adds what EPL's process model needs:

- ``-H`` defaults to ``localhost:N``; before anything starts, ``-np`` is
  checked against the total slots of ``-H`` (a host without ``:slots`` has
  one), and a request for more workers than slots exits with code 2.
- Options epl-launch does not know are horovodrun's (``--timeline-filename
  FILE``, ``--verbose``, ...): they are checked against horovodrun's own
  parser and passed on to it. horovodrun's elastic ``--min-np`` is replaced by
  epl-launch's (below).
- A bare ``python`` (or ``python3``) command runs with the interpreter
  epl-launch was installed with, so the README's commands work without
  activating the virtual environment. On a job whose hosts are all this
  machine, a command or script that does not exist is refused before any
  worker starts (exit 2).
- ``--virtual-devices K`` sets ``EPL_CLUSTER_VIRTUAL_DEVICES=K`` for every
  worker (the number of virtual CPU devices a worker drives on a machine
  without accelerators).
- ``--timeout S`` (default: ``communication.collective_timeout_s``, from
  ``EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S`` if set, else EPL's default of
  300 s) bounds how long a step may wait for the other workers: EPL's own
  bounded runs fail after S s, naming the worker that stalled or left (see
  epl.runtime.guarded_run), and Horovod's stall check (warning after
  min(60, S/2) s, shutdown after S s) backs it up. With ``--timeout`` given,
  ``EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S`` is set for the workers as well.
  The run as a whole is not bounded.
- Output is streamed line by line, with horovodrun's per-worker prefix
  (``[rank]<stdout>:`` / ``[rank]<stderr>:``); workers run with
  ``PYTHONUNBUFFERED=1``.
- When a worker fails, the exit code is the failing worker's (1 when
  horovodrun had to terminate it while it was failing) and the last line names
  the failing worker, its exit code and its error: its last Python exception,
  the signal that killed it, or the last line it wrote
  (``SystemExit('message')`` prints only the message)::

      epl-launch: worker 1 failed (exit 1): RuntimeError: boom

- ``--restarts R``: when the job fails (a worker died or raised), stop the
  others (horovodrun does) and start the job again, up to R times. A script
  that checkpoints (MonitoredTrainingSession with a ``checkpoint_dir``, or its
  own Saver) resumes from its last checkpoint; EPL's checkpoints hold
  single-device names and shapes, so they restore under any number of
  workers. Every restart is logged: the worker that failed, the cause, and,
  once a worker restored a checkpoint, the global step it resumed from::

      epl-launch: worker 1 failed (exit 137): killed by SIGKILL
      epl-launch: restart 1 of 3: starting 2 workers again (-H localhost:2)
      epl-launch: restart 1: resumed from global step 10 (worker 0 restored /ckpt/model.ckpt-10)

- ``--min-np M`` (with ``--restarts``; default: ``-np``): a failed worker's
  slot is given up (one slot fewer on its host, as Horovod Elastic drops a
  failed host) and the job restarts with the workers left, as long as there
  are at least M; without it the job restarts at its full size. With fewer
  workers the global batch is smaller (each worker feeds its own batch).

Bad input (no command, -np < 1, a malformed -H, more workers than slots, an
option neither epl-launch nor horovodrun knows, a missing command or script,
no horovodrun) prints ``epl-launch: <problem>`` on stderr and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Mapping, Sequence

from epl.tools.launch_flags import EplFlagError, translate_epl_flags

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
# TensorFlow's / absl's log lines ("I0000 00:00:17.5 file.cc:1] ...", "WARNING: All log ...").
_LOG_LINE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:[\d.]+|WARNING: All log messages|"
                       r"WARNING:tensorflow:|INFO:tensorflow:|Terminated$)")
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
                      "Horovod with scripts/build_horovod.sh)" % sys.executable)


# epl-launch's own options and how many values each takes.
_OWN_OPTIONS = {"-np": 1, "--num-proc": 1, "-H": 1, "--hosts": 1, "--virtual-devices": 1,
                "--timeout": 1, "--restarts": 1, "--min-np": 1, "-h": 0, "--help": 0}
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
CHECK_BUILD = ("--check-build", "-cb")   # `epl-launch --check-build [--json]`: epl-env
_EVENT = "epl-launch-event: "  # what workers print for the launcher (EPL_LAUNCH_EVENTS=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a command on N EPL workers through horovodrun --gloo. "
        "Options not listed here are horovodrun's and are passed on to it.",
        usage="%(prog)s -np N [-H hosts] [--virtual-devices K] [--timeout S] [--restarts R "
              "[--min-np M]] [horovodrun options] [--] command args...")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                        help="number of workers")
    parser.add_argument("-H", "--hosts", dest="hosts", default=None,
                        help="host1:slots,host2:slots (default localhost:N)")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="virtual CPU devices per worker (sets EPL_CLUSTER_VIRTUAL_DEVICES)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a step may wait for the other workers before the job "
                             "fails (default: communication.collective_timeout_s)")
    parser.add_argument("--restarts", type=int, default=0,
                        help="restart the job up to R times when it fails (it resumes from "
                             "its last checkpoint)")
    parser.add_argument("--min-np", type=int, default=None,
                        help="with --restarts: go on without failed workers, down to M "
                             "(default: restart at -np)")
    return parser


def horovodrun_options() -> dict[str, int]:
    """horovodrun's options and how many values each takes (from its own parser)."""
    try:
        from horovod.runner import launch
    except ImportError as err:
        raise LaunchError("Horovod is not importable here (%s); run `make setup` (it builds "
                          "Horovod with scripts/build_horovod.sh)" % err) from None

    class _Captured(Exception):
        pass

    captured = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        captured["parser"] = self
        raise _Captured

    argparse.ArgumentParser.parse_args = capture
    try:
        launch.parse_args()
    except _Captured:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    parser = captured.get("parser")
    if parser is None:  # pragma: no cover - a Horovod whose runner changed
        return {}
    counts = {}
    for option, action in parser._option_string_actions.items():
        nargs = action.nargs
        counts[option] = 1 if nargs is None else nargs if isinstance(nargs, int) else -1
    return counts


def split_argv(argv: Sequence[str], horovod: Mapping[str, int] | None = None
               ) -> tuple[list[str], list[str], list[str]]:
    """(epl-launch's options, horovodrun's options, the command) of a command line.

    The command starts after ``--`` or at the first word that is not an option
    or an option's value. horovod: horovodrun's options and their value counts
    (default: `horovodrun_options()`, read only when an option is not epl-launch's).
    """
    own, passed, argv = [], [], list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return own, passed, argv[i + 1:]
        if not word.startswith("-") or word == "-":
            return own, passed, argv[i:]
        option = word.split("=", 1)[0]
        if option in _OWN_OPTIONS:
            count = 0 if "=" in word else _OWN_OPTIONS[option]
            own.extend(argv[i:i + 1 + count])
            i += 1 + count
            continue
        if horovod is None:
            horovod = horovodrun_options()
        count = horovod.get(option)
        if count is None:
            raise LaunchError("%s is neither an epl-launch option nor a horovodrun option (see "
                              "epl-launch --help and horovodrun --help)" % option)
        if "=" in word:
            count = 0
        elif count < 0:
            raise LaunchError("horovodrun's %s takes a variable number of values; write it as "
                              "%s=VALUE" % (option, option))
        passed.extend(argv[i:i + 1 + count])
        i += 1 + count
    return own, passed, []


def _local_hosts() -> set[str]:
    import socket
    return {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def resolve_command(command: list[str], hosts: list[tuple[str, int]]) -> list[str]:
    """The command the workers run: a bare ``python`` becomes this interpreter; on
    a job of this machine only, a missing program or script is an error now."""
    command = list(command)
    if _PYTHON.match(command[0]):
        command[0] = sys.executable
    if not all(name in _local_hosts() for name, _ in hosts):
        return command  # the program may exist only on the other hosts
    program = command[0]
    found = (os.path.isfile(program) and os.access(program, os.X_OK)) if os.sep in program \
        else shutil.which(program) is not None
    if not found:
        raise LaunchError("%s: no such program%s; give the program and its arguments, e.g. "
                          "epl-launch -np 2 python train.py"
                          % (program, "" if os.sep in program else " on PATH"))
    if os.path.basename(program).startswith("python") and len(command) > 1 \
            and not command[1].startswith("-") and not os.path.isfile(command[1]):
        raise LaunchError("script %s not found (in %s): every worker would fail with \"can't "
                          "open file\"" % (command[1], os.getcwd()))
    return command


def build(args: argparse.Namespace, environ: Mapping[str, str] | None = None
          ) -> tuple[list[str], dict[str, str]]:
    """The horovodrun command line and the environment for it (and its workers).

    args: epl-launch's parsed options, with ``command`` (the worker's command)
    and ``horovod_args`` (horovodrun options passed on) set.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no command to run; usage: epl-launch -np N [-H hosts] -- command "
                          "args...")
    if args.np < 1:
        raise LaunchError("-np %d asks for no workers; give -np 1 or more" % args.np)
    hosts = args.hosts or "localhost:%d" % args.np
    parsed_hosts = parse_hosts(hosts)
    slots = sum(count for _, count in parsed_hosts)
    if args.np > slots:
        raise LaunchError("-np %d asks for %d workers but -H %s gives %d slot%s; add hosts or slots"
                          % (args.np, args.np, hosts, slots, "" if slots == 1 else "s"))
    if args.virtual_devices is not None and args.virtual_devices < 1:
        raise LaunchError("--virtual-devices %d: a worker needs at least 1 device"
                          % args.virtual_devices)
    if args.timeout is not None and not args.timeout > 0:
        raise LaunchError("--timeout %g: give a positive number of seconds" % args.timeout)
    restarts = getattr(args, "restarts", 0) or 0
    min_np = getattr(args, "min_np", None)
    if restarts < 0:
        raise LaunchError("--restarts %d: give 0 or more" % restarts)
    if min_np is not None and not restarts:
        raise LaunchError("--min-np %d only applies to restarts; add --restarts N" % min_np)
    if min_np is not None and not 1 <= min_np <= args.np:
        raise LaunchError("--min-np %d: give a number of workers from 1 to -np (%d)"
                          % (min_np, args.np))
    command = resolve_command(command, parsed_hosts)
    timeout = args.timeout if args.timeout is not None else default_timeout(environ)
    shutdown_s = max(1, int(math.ceil(timeout)))
    warning_s = max(1, min(60, shutdown_s // 2))

    env = dict(os.environ if environ is None else environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(warning_s)
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(shutdown_s)
    env["EPL_LAUNCH_EVENTS"] = "1"
    env.pop("HOROVOD_STALL_CHECK_DISABLE", None)
    if args.virtual_devices is not None:
        env["EPL_CLUSTER_VIRTUAL_DEVICES"] = str(args.virtual_devices)
    if args.timeout is not None:
        env["EPL_COMMUNICATION_COLLECTIVE_TIMEOUT_S"] = repr(float(args.timeout))
    cmd = [find_horovodrun(), "--gloo", "-np", str(args.np), "-H", hosts,
           "--stall-check-warning-time-seconds", str(warning_s),
           "--stall-check-shutdown-time-seconds", str(shutdown_s)] + \
        list(getattr(args, "horovod_args", [])) + command
    return cmd, env


def parse_command_line(argv: Sequence[str], horovod: Mapping[str, int] | None = None
                       ) -> argparse.Namespace:
    """epl-launch's options, ``horovod_args`` and ``command`` from a command line."""
    own, passed, command = split_argv(argv, horovod)
    args = _parser().parse_args(own)
    args.horovod_args, args.command = passed, command
    return args


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
        self.last_line: dict[int, str] = {}  # last line each rank wrote on stderr (not a log line)
        self.events: list[dict] = []  # what workers reported to the launcher (EPL_LAUNCH_EVENTS)

    def feed(self, line: str) -> None:
        """Take one output line (without the newline)."""
        match = _PREFIXED.search(line)
        if match:
            rank, stream, raw = int(match.group(1)), match.group(2), match.group(3)
            text = raw.strip()
            if text.startswith(_EVENT):
                self._event(rank, text[len(_EVENT):])
                return
            if _SECONDARY.search(text):
                self.secondary.add(rank)
            if stream == "stdout":
                if _HOROVOD_ERROR.match(text):  # Horovod logs to stdout
                    self.last_error[rank] = text
                return
            if text and not _LOG_LINE.match(text) and raw[:1] not in (" ", "\t"):
                self.last_line[rank] = text
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

    def _event(self, rank: int, payload: str) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict):
            event["rank"] = rank
            self.events.append(event)

    def error_of(self, rank: int) -> str | None:
        """The error of `rank`: its last Python exception, else its last error-looking line,
        else the last line it wrote on stderr (``SystemExit('message')`` prints the message)."""
        return self.last_exception.get(rank) or self.last_error.get(rank) or \
            self.last_line.get(rank)

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
        # ... or that exited with SystemExit('message') (no traceback: only its last line).
        for tier in (self.last_exception, self.last_error, self.last_line):
            for rank in sorted(tier, key=lambda r: (r not in codes, r)):
                if rank not in self.secondary:
                    return rank, codes.get(rank)
        if failed:
            return failed[0]
        if self.first_failed[0] is not None:
            return self.first_failed
        if self.last_exception or self.last_error:
            return min(set(self.last_exception) | set(self.last_error)), None
        return None, None

    def cause(self, rank: int | None, code: int | None) -> str:
        """Why worker `rank` failed, in words: the signal that killed it, else its
        exit code and error."""
        if _signal_name(code) and code != 143:
            return "killed by %s" % _signal_name(code)
        error = self.error_of(rank) if rank is not None else None
        return "exit %s%s" % ("?" if code is None else code, ": " + error if error else "")

    def summary(self, returncode: int) -> str:
        """The final line for a failed run."""
        rank, code = self.failure()
        if rank is None:
            return "%s: horovodrun failed (exit %d) and no worker reported an error" % (
                PROG, returncode)
        if _signal_name(code) and code != 143:  # SIGKILL, SIGSEGV, ...: no error line of its own
            return "%s: worker %d failed (exit %d): killed by %s" % (PROG, rank, code,
                                                                   _signal_name(code))
        error = self.error_of(rank)
        if error is None:
            others = {r: self.error_of(r) for r in set(self.last_error) | set(self.last_exception)
                      if r != rank}
            error = ("no error line in its output" if not others else
                     "no error line in its output (worker %d: %s)" % next(iter(sorted(others.items()))))
        return "%s: worker %d failed (exit %s): %s" % (
            PROG, rank, "?" if code is None else code, error)


def run(cmd: Sequence[str], env: dict[str, str], out=None, on_event=None
        ) -> tuple[int, OutputWatcher]:
    """Run horovodrun, stream its output to `out`; return (exit code for epl-launch,
    the watcher that read the output). on_event(event): called for each event a
    worker reports (EPL_LAUNCH_EVENTS), as it arrives."""
    out = out or sys.stdout
    watcher = OutputWatcher()
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, bufsize=1, text=True, errors="replace")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen = len(watcher.events)
            watcher.feed(line.rstrip("\r\n"))
            if _EVENT in line:
                for event in watcher.events[seen:]:
                    if on_event is not None:
                        on_event(event)
                continue  # for the launcher, not the user
            out.write(line)
            out.flush()
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
        return 0, watcher  # error-looking lines of a successful job are not failures
    rank, code = watcher.failure()
    print(watcher.summary(returncode), file=out, flush=True)
    if code == 143:  # horovodrun terminated it while it was failing: its own code is lost
        return 1, watcher
    if code is not None and 0 < code < 256:
        return code, watcher
    return (returncode if 0 < returncode < 256 else 1), watcher


def _signal_name(code: int | None) -> str | None:
    """The signal an exit code stands for (137 -> "SIGKILL", -9 -> "SIGKILL"), or None."""
    if code is None:
        return None
    number = code - 128 if code > 128 else -code if code < 0 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _rank_host(hosts: list[tuple[str, int]], rank: int) -> int:
    """Index in `hosts` of the host that runs `rank` (horovodrun fills hosts in order)."""
    for index, (_, slots) in enumerate(hosts):
        if rank < slots:
            return index
        rank -= slots
    return len(hosts) - 1


class Restarter:
    """The restart loop of ``--restarts``: the hosts and size of the next attempt, and its log."""

    def __init__(self, args: argparse.Namespace, out=None):
        self.args, self.out = args, out or sys.stdout
        self.restarts = args.restarts or 0
        self.min_np = args.np if args.min_np is None else args.min_np
        self.hosts = parse_hosts(args.hosts or "localhost:%d" % args.np)
        self.attempt = 0
        self._announced = False

    def _print(self, text: str) -> None:
        print("%s: %s" % (PROG, text), file=self.out, flush=True)

    def on_event(self, event: dict) -> None:
        """Log the step a restarted job resumed from (the first worker that restored)."""
        if self.attempt and not self._announced and event.get("event") == "restored":
            self._announced = True
            self._print("restart %d: resumed from global step %s (worker %s restored %s)" % (
                self.attempt, event.get("global_step", "?"), event.get("rank", "?"),
                event.get("checkpoint") or "a checkpoint"))

    def next_attempt(self, watcher: OutputWatcher) -> bool:
        """After a failed attempt: set up the next one and log it; False if none is left."""
        if self.attempt and not self._announced:
            self._print("restart %d: no worker restored a checkpoint; the job started from "
                        "scratch (give MonitoredTrainingSession a checkpoint_dir)" % self.attempt)
        if self.attempt >= self.restarts:
            if self.restarts:
                self._print("no restarts left (--restarts %d)" % self.restarts)
            return False
        rank, code = watcher.failure()
        cause = watcher.cause(rank, code)
        np_ = self.args.np
        if self.min_np < self.args.np and rank is not None:
            index = _rank_host(self.hosts, rank)
            name, slots = self.hosts[index]
            self.hosts[index] = (name, slots - 1)
            self.hosts = [(n, c) for n, c in self.hosts if c > 0]
            np_ = min(self.args.np, sum(c for _, c in self.hosts))
            if np_ < self.min_np:
                self._print("cannot restart: %d worker%s left, fewer than --min-np %d" % (
                    np_, "" if np_ == 1 else "s", self.min_np))
                return False
        self.attempt += 1
        self._announced = False
        self.args.np = np_
        self.args.hosts = ",".join("%s:%d" % h for h in self.hosts)
        self._print("restart %d of %d after worker %s failed (%s): starting %d worker%s again "
                    "(-H %s)" % (self.attempt, self.restarts, "?" if rank is None else rank, cause,
                                 np_, "" if np_ == 1 else "s", self.args.hosts))
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `epl-launch`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in CHECK_BUILD:   # horovodrun's --check-build: EPL's own report
        from epl.tools.env_report import main as env_report
        return env_report(argv[1:])
    try:  # EPL's --num_workers/--gpu_per_worker, rewritten into this launcher's options
        argv = translate_epl_flags(argv)
    except EplFlagError as err:
        print("%s: %s" % (PROG, err), file=sys.stderr, flush=True)
        return 2
    try:
        try:
            args = parse_command_line(argv)
        except SystemExit as exc:  # argparse's own usage errors exit 2 already
            return int(exc.code or 0)
        cmd, env = build(args)
    except LaunchError as err:
        print("%s: %s" % (PROG, err), file=sys.stderr, flush=True)
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM to epl-launch takes horovodrun (and with it the workers) down too.
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    restarter = Restarter(args)
    try:
        while True:
            code, watcher = run(cmd, env, on_event=restarter.on_event)
            if code == 0:
                return 0
            if not restarter.next_attempt(watcher):
                return code
            cmd, env = build(args)
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
