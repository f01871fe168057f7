"""`epl-launch`: start an EPL training script on N workers (Horovod over Gloo).

::

    epl-launch -np N [-H host1:slots,host2:slots] [--virtual-devices K]
               [--timeout S] [--restarts R [--min-np M]] [--output-dir DIR]
               [horovodrun options] [--] command args...

EPL's own form, ``epl-launch --num_workers N --gpu_per_worker K script``, is
rewritten into these options first (`epl/tools/launch_flags.py`).

It wraps ``horovodrun --gloo`` and adds what EPL's process model needs.
horovodrun runs in a helper process that stays up between restarts
(epl/tools/launch_runner.py: horovodrun checks its build by importing
TensorFlow, 4 s, once per process), through horovodrun's own entry point.

- ``-H`` defaults to ``localhost:N``; before anything starts, ``-np`` is
  checked against the total slots of ``-H`` (a host without ``:slots`` has
  one), and a request for more workers than slots exits with code 2.
- Options epl-launch does not know are horovodrun's (``--timeline-filename
  FILE``, ``--verbose``, ...): how many values each takes is read from
  ``horovodrun --help`` (its public surface), and they are passed on to it; an
  option its help does not list is passed on too, for horovodrun to accept or
  reject (its value must then be written ``--option=value``). horovodrun's
  elastic ``--min-np`` is replaced by epl-launch's (below).
- A bare ``python`` (or ``python3``) command runs with the interpreter
  epl-launch was installed with, so the commands of the docs work without
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
  ``PYTHONUNBUFFERED=1``. ``--output-dir DIR`` also keeps every rank's full
  output, unprefixed, in ``DIR/rank.<r>/stdout`` and ``DIR/rank.<r>/stderr``
  (horovodrun's ``--output-filename`` layout), appended to across restarts,
  and horovodrun's and epl-launch's own lines in ``DIR/launcher.log``.
- When a worker fails, the exit code is the failing worker's (1 when
  horovodrun had to terminate it while it was failing) and the last line names
  the failing worker and its error (epl/tools/launch_output.py): a worker EPL
  found at fault (it stalled, was stopped, or left: reported by the workers
  that waited for it), else its last Python exception, the signal that
  killed it, or the last line it wrote (``SystemExit('message')`` prints only
  the message); the exit code only when the worker chose it::

      epl-launch: worker 1 failed (exit 1): RuntimeError: boom
      epl-launch: worker 1 failed (stalled, reported by worker 0): epl.errors.ClusterError: ...

- ``--restarts R``: when the job fails (a worker died or raised), stop the
  others (horovodrun does) and start the job again, up to R times. A script
  that checkpoints (MonitoredTrainingSession with a ``checkpoint_dir``, or its
  own Saver) resumes from its last checkpoint; EPL's checkpoints hold
  single-device names and shapes, so they restore under any number of
  workers. Every restart is logged: the worker that failed, the cause, and,
  once a worker restored a checkpoint, the global step it resumed from::

      epl-launch: worker 1 failed (exit 137): killed by SIGKILL
      epl-launch: restart 1 of 3 after worker 1 failed (killed by SIGKILL): starting 2 workers again (-H localhost:2)
      epl-launch: restart 1: resumed from global step 10 (worker 0 restored /ckpt/model.ckpt-10 in 0.05 s)

- ``--min-np M`` (with ``--restarts``; default: ``-np``): the failed worker's
  slot (the slot of every worker EPL found at fault) is given up (one slot
  fewer on its host, as Horovod Elastic drops a failed host) and the job
  restarts with the workers left, as long as there are at least M; without it
  the job restarts at its full size. With fewer workers the global batch is
  smaller (each worker feeds its own batch).

Bad input (no command, -np < 1, a malformed -H, more workers than slots, a
missing command or script, no horovodrun) prints ``epl-launch: <problem>`` on
stderr and exits 2; an option horovodrun refuses ends the job with
horovodrun's own error (exit 2).
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

from epl.tools.launch_flags import EplFlagError, translate_epl_flags
from epl.tools.launch_output import EVENT, PROG, OutputWatcher, RankFiles
from epl.tools.launch_runner import HorovodRunner

_TIMEOUT_KEY = "communication.collective_timeout_s"

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
                "--timeout": 1, "--restarts": 1, "--min-np": 1, "--output-dir": 1, "-h": 0,
                "--help": 0}
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
CHECK_BUILD = ("--check-build", "-cb")   # `epl-launch --check-build [--json]`: epl-env


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of epl-launch's own options (horovodrun's pass through)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a command on N EPL workers through horovodrun --gloo. "
        "Options not listed here are horovodrun's and are passed on to it.",
        usage="%(prog)s -np N [-H hosts] [--virtual-devices K] [--timeout S] [--restarts R "
              "[--min-np M]] [--output-dir DIR] [horovodrun options] [--] command args...")
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
    parser.add_argument("--output-dir", default=None,
                        help="keep every rank's full output in DIR/rank.<r>/stdout and "
                             "DIR/rank.<r>/stderr (and horovodrun's own lines in "
                             "DIR/launcher.log), appended to across restarts")
    return parser


_HELP_OPTION = re.compile(r"^\s{1,8}(-[^\s,]+(?: [^\s,]+)*(?:, -[^\s,]+(?: [^\s,]+)*)*)"
                          r"(?:\s{2,}|$)")
_HOROVOD_OPTIONS: dict[str, int] = {}


def parse_help_options(text: str) -> dict[str, int]:
    """The options an argparse ``--help`` text lists, and how many values each takes
    (-1: a variable number). ``  -np NUM_PROC, --num-proc NUM_PROC  help`` gives
    {"-np": 1, "--num-proc": 1}; ``  --verbose`` {"--verbose": 0}."""
    counts: dict[str, int] = {}
    in_usage = False
    for line in text.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage:
            if line.strip():
                continue
            in_usage = False
        match = _HELP_OPTION.match(line)
        if not match:
            continue
        for spec in match.group(1).split(", "):
            words = spec.split(" ")
            values = words[1:]
            counts[words[0]] = -1 if any("..." in v or v.startswith("[") for v in values) \
                else len(values)
    return counts


def horovodrun_options() -> dict[str, int]:
    """horovodrun's options and how many values each takes, from ``horovodrun --help``
    (read once per process)."""
    if not _HOROVOD_OPTIONS:
        try:
            result = subprocess.run([find_horovodrun(), "--help"], capture_output=True,
                                    text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise LaunchError("cannot run horovodrun --help to read its options (%s)" % err) \
                from None
        _HOROVOD_OPTIONS.update(parse_help_options(result.stdout))
    return dict(_HOROVOD_OPTIONS)


def split_argv(argv: Sequence[str], horovod: Mapping[str, int] | None = None
               ) -> tuple[list[str], list[str], list[str]]:
    """(epl-launch's options, horovodrun's options, the command) of a command line.

    The command starts after ``--`` or at the first word that is not an option
    or an option's value. horovod: horovodrun's options and their value counts
    (default: `horovodrun_options()`, read only when an option is not epl-launch's).
    An option horovodrun does not list is passed on alone (with its value when
    written ``--option=value``), for horovodrun to accept or reject.
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
        count = horovod.get(option, 0)
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
    output_dir = getattr(args, "output_dir", None)
    if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise LaunchError("--output-dir %s is a file; give a directory (it is created if "
                          "missing)" % output_dir)
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
    args = build_parser().parse_args(own)
    args.horovod_args, args.command = passed, command
    return args


def run(cmd: Sequence[str], env: dict[str, str], out=None, on_event=None,
        runner: HorovodRunner | None = None, files: RankFiles | None = None
        ) -> tuple[int, OutputWatcher]:
    """Run horovodrun's command line `cmd` (in `runner`, a helper kept between
    attempts; a new one if None), stream its output to `out` (and `files`); return
    (exit code for epl-launch, the watcher that read the output). on_event(event):
    called for each event a worker reports (EPL_LAUNCH_EVENTS), as it arrives."""
    out = out or sys.stdout
    watcher = OutputWatcher()
    own = runner is None
    runner = runner or HorovodRunner()
    try:
        for line in runner.run(cmd, env):
            seen = len(watcher.events)
            watcher.feed(line.rstrip("\r\n"))
            if files is not None:
                files.write(line)
            if EVENT in line:
                for event in watcher.events[seen:]:
                    if on_event is not None:
                        on_event(event)
                continue  # for the launcher, not the user
            out.write(line)
            out.flush()
    except BaseException:  # Ctrl-C or a kill of this process: take horovodrun down with us
        runner.interrupt()
        raise
    finally:
        if own:
            runner.close()
    returncode = runner.returncode if runner.returncode is not None else 1
    if returncode == 0 and not any(code != 0 for _, code in watcher.exits):
        return 0, watcher  # error-looking lines of a successful job are not failures
    rank, code = watcher.failure()
    summary = watcher.summary(returncode)
    print(summary, file=out, flush=True)
    if files is not None:
        files.write(summary)
    if watcher.found_at_fault(rank) or code is None or not 0 < code < 256 or code == 143:
        # found at fault while another worker exited, or horovodrun terminated it
        # while it was failing: its own code is lost
        return (returncode if 0 < returncode < 256 else 1), watcher
    return code, watcher


def _rank_host(hosts: list[tuple[str, int]], rank: int) -> int:
    """Index in `hosts` of the host that runs `rank` (horovodrun fills hosts in order)."""
    for index, (_, slots) in enumerate(hosts):
        if rank < slots:
            return index
        rank -= slots
    return len(hosts) - 1


class Restarter:
    """The restart loop of ``--restarts``: the hosts and size of the next attempt, and its log."""

    def __init__(self, args: argparse.Namespace, out=None, files: RankFiles | None = None):
        self.args, self.out, self.files = args, out or sys.stdout, files
        self.restarts = args.restarts or 0
        self.min_np = args.np if args.min_np is None else args.min_np
        self.hosts = parse_hosts(args.hosts or "localhost:%d" % args.np)
        self.attempt = 0
        self._announced = False

    def _print(self, text: str) -> None:
        line = "%s: %s" % (PROG, text)
        print(line, file=self.out, flush=True)
        if self.files is not None:
            self.files.write(line)

    def on_event(self, event: dict) -> None:
        """Log the step a restarted job resumed from (the first worker that restored)."""
        if self.attempt and not self._announced and event.get("event") == "restored":
            self._announced = True
            seconds = event.get("seconds")
            self._print("restart %d: resumed from global step %s (worker %s restored %s%s)" % (
                self.attempt, event.get("global_step", "?"), event.get("rank", "?"),
                event.get("checkpoint") or "a checkpoint",
                " in %.2f s" % seconds if isinstance(seconds, (int, float)) else ""))

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
            # every worker found at fault gives up its slot (the highest ranks first,
            # so that each rank still names its host)
            for failed in sorted(set(watcher.culprits) | {rank}, reverse=True):
                index = _rank_host(self.hosts, failed)
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
        if self.files is not None:
            self.files.new_attempt("%s: restart %d" % (PROG, self.attempt))
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
    files = RankFiles(args.output_dir, args.np) if args.output_dir else None
    restarter = Restarter(args, files=files)
    runner = HorovodRunner()
    try:
        while True:
            code, watcher = run(cmd, env, on_event=restarter.on_event, runner=runner,
                                files=files)
            if code == 0:
                return 0
            if not restarter.next_attempt(watcher):
                return code
            cmd, env = build(args)
    except KeyboardInterrupt:
        print("%s: interrupted; workers stopped" % PROG, file=sys.stderr, flush=True)
        return 130
    finally:
        runner.close()
        if files is not None:
            files.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm(signum, frame):  # pragma: no cover - exercised by hand
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
