"""What `epl-launch` reads in horovodrun's output: who failed first, and why.

`OutputWatcher.feed(line)` takes horovodrun's output line by line (each
worker's lines prefixed ``[rank]<stdout>:`` / ``[rank]<stderr>:``, horovodrun's
own reports of worker exits, and the events workers send to the launcher
with EPL_LAUNCH_EVENTS). `failure()` says which worker failed first and
`summary()` writes epl-launch's last line:

- a worker that EPL found at fault (it stalled, was stopped, or left: the
  workers that waited for it report it, epl.runtime.guarded_run) is the one
  that failed, whichever worker exited first;
- otherwise the first worker that failed on its own: not one that failed only
  because a peer did (Horovod shut down under it) and not one horovodrun
  terminated (SIGTERM, exit 143) while it was failing;
- its error is its last Python exception, else its last error-looking line,
  else its last line on stderr (``SystemExit('message')`` prints only the
  message); a signal is named only when the worker left no error of its own.

`RankFiles` keeps every rank's full output in files (``--output-dir``).
"""
from __future__ import annotations

import json
import os
import re
import signal

PROG = "epl-launch"
EVENT = "epl-launch-event: "  # what workers print for the launcher (EPL_LAUNCH_EVENTS=1)

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


def signal_name(code: int | None) -> str | None:
    """The signal an exit code stands for (137 -> "SIGKILL", -9 -> "SIGKILL"), or None."""
    if code is None:
        return None
    number = code - 128 if code > 128 else -code if code < 0 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _terminated(code: int | None) -> bool:
    """horovodrun's SIGTERM ended the worker (it stops the others when one fails)."""
    return signal_name(code) == "SIGTERM"


def parse_line(line: str) -> tuple[int, str, str] | None:
    """(rank, "stdout" or "stderr", text) of a worker's prefixed line, else None."""
    match = _PREFIXED.search(line)
    return (int(match.group(1)), match.group(2), match.group(3)) if match else None


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
        # workers EPL found at fault: rank -> (how, what happened, the reporting rank)
        self.culprits: dict[int, tuple[str, str, int]] = {}
        self.last_own_line: str | None = None  # horovodrun's own last line (not a worker's)

    def feed(self, line: str) -> None:
        """Take one output line (without the newline)."""
        parsed = parse_line(line)
        if parsed:
            self._worker_line(*parsed)
            return
        if line.strip():
            self.last_own_line = line.strip()
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

    def _worker_line(self, rank: int, stream: str, raw: str) -> None:
        text = raw.strip()
        if text.startswith(EVENT):
            self._event(rank, text[len(EVENT):])
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

    def _event(self, rank: int, payload: str) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        event["rank"] = rank
        self.events.append(event)
        if event.get("event") == "culprits":
            for culprit in event.get("culprits") or []:
                try:
                    culprit_rank = int(culprit["rank"])
                except (KeyError, TypeError, ValueError):
                    continue
                self.culprits.setdefault(culprit_rank, (str(culprit.get("how", "")), str(
                    culprit.get("text", "")), rank))

    def error_of(self, rank: int) -> str | None:
        """The error of `rank`: its last Python exception, else its last error-looking line,
        else the last line it wrote on stderr (``SystemExit('message')`` prints the message)."""
        return self.last_exception.get(rank) or self.last_error.get(rank) or \
            self.last_line.get(rank)

    def _code(self, rank: int) -> int | None:
        codes = dict(self.exits)
        if rank in codes:
            return codes[rank]
        return self.first_failed[1] if self.first_failed[0] == rank else None

    def found_at_fault(self, rank: int | None) -> bool:
        """True when EPL's report on `rank` (it stalled, left) is its cause: it did not
        fail on its own (no exit code of its own: still running, exited 0, terminated
        by horovodrun, or it ended on EPL's timeout that names it too). A worker killed
        by SIGKILL, or one that raised its own error, is reported as such."""
        if rank not in self.culprits:
            return False
        own = self.last_exception.get(rank)
        if own and "ClusterError" not in own:  # it raised an error of its own: its cause
            return False
        code = self._code(rank)
        return code is None or code == 0 or _terminated(code) or own is not None

    def failure(self) -> tuple[int | None, int | None]:
        """(rank, exit code) of the worker that failed first, as far as the output tells.

        A worker EPL found at fault comes first. Then workers that failed on their
        own; those that only failed because a peer did (Horovod shut down under
        them, or horovodrun terminated them: SIGTERM) come last.
        """
        if self.culprits:
            rank = min(self.culprits)
            return rank, self._code(rank)
        failed = [(rank, code) for rank, code in self.exits if code != 0]  # in exit order
        for rank, code in failed:  # the first failure that is not a consequence of another
            if rank not in self.secondary and not _terminated(code):
                return rank, code
        # A worker that raised but was terminated while exiting because a peer,
        # failing in consequence, exited first.
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
        """Why worker `rank` failed, in words: what EPL found (it stalled, left), the
        signal that killed it, or its error (with its exit code when it chose one)."""
        if self.found_at_fault(rank):
            how, text, reporter = self.culprits[rank]
            return "%s (reported by worker %d)" % (text, reporter)
        name = signal_name(code)
        error = self.error_of(rank) if rank is not None else None
        if name and not (_terminated(code) and error):
            return "killed by %s" % name
        if _terminated(code) or code is None:
            return error or "no error line in its output"
        return "exit %d%s" % (code, ": " + error if error else "")

    def summary(self, returncode: int) -> str:
        """The final line for a failed run."""
        rank, code = self.failure()
        if rank is None:
            if self.last_own_line and not self.exits:  # no worker started: its own error
                return "%s: horovodrun failed (exit %d) before starting any worker: %s" % (
                    PROG, returncode, self.last_own_line)
            return "%s: horovodrun failed (exit %d) and no worker reported an error" % (
                PROG, returncode)
        if self.found_at_fault(rank):
            how, text, reporter = self.culprits[rank]
            error = self.error_of(reporter)
            return "%s: worker %d failed (%s, reported by worker %d): %s" % (
                PROG, rank, text.split(":", 1)[0], reporter, error or text)
        name = signal_name(code)
        error = self.error_of(rank)
        if name and not (_terminated(code) and error):  # SIGKILL, SIGSEGV: no error of its own
            return "%s: worker %d failed (exit %d): killed by %s" % (PROG, rank, code, name)
        if error is None:
            others = {r: self.error_of(r) for r in set(self.last_error) | set(self.last_exception)
                      if r != rank}
            error = "no error line in its output" + (
                " (worker %d: %s)" % min(others.items()) if others else "")
        if _terminated(code) or code is None:  # horovodrun stopped it while it was failing
            return "%s: worker %d failed: %s" % (PROG, rank, error)
        return "%s: worker %d failed (exit %d): %s" % (PROG, rank, code, error)


class RankFiles:
    """Every rank's full output in ``DIR/rank.<r>/stdout`` and ``.../stderr`` (the layout
    of horovodrun's --output-filename), and horovodrun's and epl-launch's own lines in
    ``DIR/launcher.log``. Files are appended to across restarts; each attempt after
    the first starts with a line ``epl-launch: restart N``."""

    def __init__(self, directory: str, num_proc: int):
        self.directory = directory
        self.width = len(str(max(num_proc - 1, 0)))
        self.files: dict[tuple[int, str], object] = {}
        self.attempt_note: str | None = None
        self._noted: set[tuple[int, str]] = set()
        os.makedirs(directory, exist_ok=True)
        self.launcher = open(os.path.join(directory, "launcher.log"), "a", encoding="utf-8")

    def new_attempt(self, note: str) -> None:
        """The next lines belong to a restarted attempt (`note` heads each file's part)."""
        self.attempt_note = note
        self._noted = set()

    def write(self, line: str) -> None:
        """One output line (with or without its newline)."""
        line = line.rstrip("\r\n")
        parsed = parse_line(line)
        if parsed is None:
            self.launcher.write(line + "\n")
            self.launcher.flush()
            return
        rank, stream, text = parsed
        if text.strip().startswith(EVENT):
            return
        key = (rank, stream)
        f = self.files.get(key)
        if f is None:
            folder = os.path.join(self.directory, "rank.%0*d" % (self.width, rank))
            os.makedirs(folder, exist_ok=True)
            f = self.files[key] = open(os.path.join(folder, stream), "a", encoding="utf-8")
        if self.attempt_note and key not in self._noted:
            self._noted.add(key)
            f.write(self.attempt_note + "\n")
        f.write(text + "\n")
        f.flush()

    def close(self) -> None:
        """Close every file."""
        for f in self.files.values():
            f.close()
        self.launcher.close()
