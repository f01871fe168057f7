#!/usr/bin/env python3
"""Make horovodrun end a failed job at once, not 5 s late (Horovod 0.28.1's runner).

When one worker fails, horovodrun stops the others with
``terminate_executor_shell_and_children`` (horovod/runner/common/util/
safe_shell_exec.py). For the shell that runs each remaining worker it:

1. sends SIGTERM to the shell's children (the worker) and waits for them;
2. freezes the shell with SIGSTOP, so that it cannot start anything new;
3. kills whatever children are left;
4. sends the shell SIGTERM and waits up to ``GRACEFUL_TERMINATION_TIME_S``
   (5 s) for it to exit, then sends SIGKILL.

A process stopped by SIGSTOP does not act on a SIGTERM until it is continued
(only SIGKILL ends a stopped process). So whenever the shell is still there at
step 2 (its worker died, and the shell had not yet reaped it, printed
"Terminated" and exited: the scheduler decides), step 4 always waits the full
5 s. A job whose first worker failed within its timeout then ends 5 s late.
CI once saw that much (tests/runtime/test_worker_failures.py, on a loaded 2-core
machine): a stalled worker's job ended 13.3 s after the stall instead of the
usual 8.3 s.

The patch continues the shell (SIGCONT) right after its SIGTERM, so that the
shell acts on it at once. The freeze still does its job: the children left
were killed at step 3, and the pending SIGTERM is taken before the shell runs
anything else. A shell that ignores SIGTERM is still killed after the 5 s.

The same holds for the worker itself at step 1: a worker that is stopped (a
SIGSTOP, the very stall EPL reports, tests/runtime/test_worker_failures.py)
ignores its SIGTERM for the full 5 s of step 1's wait, and is only killed at
step 3. The second patch continues each child after its SIGTERM as well.

scripts/build_horovod.sh runs this with the environment's Python after every
install of Horovod (built, from the wheel cache, or already there). It patches
that environment's Horovod in place, and does nothing when it is already patched.
usage: patch_horovod_runner.py [PATH/TO/safe_shell_exec.py]
Exits with an error naming what it did not find if the source differs from
Horovod 0.28.1's.
"""
from __future__ import annotations

import importlib.util
import os
import sys

SHELL_TERMINATE = """    # Kill shell itself.
    try:
        p.terminate()
    except psutil.NoSuchProcess:
        pass
"""

PATCHED = """    # Kill shell itself.
    # EPL (scripts/patch_horovod_runner.py): the shell is stopped (SIGSTOP above); a
    # stopped process acts on SIGTERM only once continued, so continue it.
    try:
        p.terminate()
        p.resume()
    except psutil.NoSuchProcess:
        pass
"""

CHILD_TERMINATE = """    for child in p.children():
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
"""

CHILD_PATCHED = """    for child in p.children():
        try:
            child.terminate()
            # EPL (scripts/patch_horovod_runner.py): a stopped worker acts on SIGTERM
            # only once continued.
            child.resume()
        except psutil.NoSuchProcess:
            pass
"""

# the same patch as written before this script moved from tools/ to scripts/
EARLIER_PATCHES = (PATCHED.replace("scripts/patch_horovod_runner.py", "tools/patch_horovod_runner.py"),)


def patch(text: str) -> str:
    """The patched safe_shell_exec.py source (unchanged if already patched; an earlier
    patch's comment brought up to date); ValueError naming a missing anchor."""
    return _patch_children(_patch_shell(text))


def _patch_shell(text: str) -> str:
    if PATCHED in text:
        return text
    for earlier in EARLIER_PATCHES:
        if earlier in text:
            return text.replace(earlier, PATCHED)
    if text.count(SHELL_TERMINATE) != 1:
        raise ValueError("expected the shell's terminate in terminate_executor_shell_and_children "
                         f"once in safe_shell_exec.py, found it {text.count(SHELL_TERMINATE)} "
                         "times; is this Horovod 0.28.1?")
    return text.replace(SHELL_TERMINATE, PATCHED)


def _patch_children(text: str) -> str:
    if CHILD_PATCHED in text:
        return text
    if text.count(CHILD_TERMINATE) != 1:
        raise ValueError("expected the children's terminate in "
                         "terminate_executor_shell_and_children once in safe_shell_exec.py, "
                         f"found it {text.count(CHILD_TERMINATE)} times; is this Horovod 0.28.1?")
    return text.replace(CHILD_TERMINATE, CHILD_PATCHED)


def installed_path() -> str:
    """safe_shell_exec.py of the Horovod this Python imports (without importing it)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("Horovod is not installed in %s" % sys.executable)
    return os.path.join(list(spec.submodule_search_locations)[0],
                        "runner", "common", "util", "safe_shell_exec.py")


def main(argv: list[str]) -> int:
    """Patch the file named by argv[0] (default: the installed Horovod's) in place."""
    if len(argv) > 1:
        print(__doc__.split("\n\n")[-2], file=sys.stderr)
        return 2
    try:
        path = argv[0] if argv else installed_path()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        patched = patch(text)
    except (OSError, ValueError) as err:
        print(f"patch_horovod_runner: {err}", file=sys.stderr)
        return 1
    if patched != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(patched)
        print(f"patch_horovod_runner: patched {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
