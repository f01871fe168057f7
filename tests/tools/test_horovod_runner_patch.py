"""scripts/patch_horovod_runner.py: horovodrun ends a failed job without a 5 s wait.

horovodrun stops a remaining worker's shell by freezing it (SIGSTOP), sending
it SIGTERM and waiting up to 5 s; unpatched, a frozen shell never acts on the
SIGTERM, so it is killed (SIGKILL) only after the 5 s. The patched runner
continues the shell, which then acts on its SIGTERM at once; and it continues
a stopped worker after its SIGTERM, which it would ignore for 5 s as well.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from paths import SCRIPTS  # noqa: E402
sys.path.insert(0, SCRIPTS)
from patch_horovod_runner import (CHILD_PATCHED, CHILD_TERMINATE, EARLIER_PATCHES,  # noqa: E402
                                  PATCHED, SHELL_TERMINATE, installed_path, patch)


def test_the_installed_horovod_is_patched():
    with open(installed_path(), encoding="utf-8") as f:
        text = f.read()
    hint = "run `make setup` (scripts/build_horovod.sh patches horovodrun)"
    assert PATCHED in text or any(earlier in text for earlier in EARLIER_PATCHES), hint
    assert CHILD_PATCHED in text, hint


def test_patch_is_idempotent_and_refuses_a_source_it_does_not_know():
    source = "def terminate_executor_shell_and_children(pid):\n" + CHILD_TERMINATE + \
        SHELL_TERMINATE
    once = patch(source)
    assert "p.terminate()\n        p.resume()\n" in once
    assert "child.terminate()\n" in once and "            child.resume()\n" in once
    assert patch(once) == once
    earlier = once.replace(PATCHED, EARLIER_PATCHES[0])   # patched before the script moved
    assert earlier != once and patch(earlier) == once
    with pytest.raises(ValueError) as info:
        patch("def f():\n    pass\n")
    assert str(info.value) == (
        "expected the shell's terminate in terminate_executor_shell_and_children once in "
        "safe_shell_exec.py, found it 0 times; is this Horovod 0.28.1?")
    with pytest.raises(ValueError) as info:
        patch("def f():\n" + SHELL_TERMINATE)
    assert str(info.value) == (
        "expected the children's terminate in terminate_executor_shell_and_children once in "
        "safe_shell_exec.py, found it 0 times; is this Horovod 0.28.1?")


def test_a_shell_still_there_at_the_teardown_acts_on_its_sigterm(tmp_path):
    """The teardown's worst case, made certain: the shell's worker is gone and the
    shell itself is still alive when horovodrun freezes it. The stand-in shell
    records the SIGTERM it acts on; unpatched it would be SIGKILLed after 5 s
    instead, and record nothing."""
    from horovod.runner.common.util.safe_shell_exec import terminate_executor_shell_and_children
    mark = tmp_path / "got-sigterm"
    shell = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import signal, sys, time
        def on_term(signum, frame):
            open({str(mark)!r}, "w").write("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout.readline() == "ready\n"
        terminate_executor_shell_and_children(shell.pid)
    finally:
        shell.kill()
        shell.wait()
    assert mark.exists(), "the stopped shell was killed (SIGKILL) instead of acting on SIGTERM"
    assert mark.read_text() == "SIGTERM"


def test_a_stopped_worker_acts_on_its_sigterm(tmp_path):
    """A worker stopped by SIGSTOP (the stall EPL reports) under a live shell: the
    patched teardown continues it after its SIGTERM, so it acts on it (and records
    it); unpatched it would be SIGKILLed after 5 s instead, and record nothing."""
    from horovod.runner.common.util.safe_shell_exec import terminate_executor_shell_and_children
    mark = tmp_path / "worker-got-sigterm"
    worker = textwrap.dedent(f"""\
        import os, signal, sys
        def on_term(signum, frame):
            open({str(mark)!r}, "w").write("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        """)
    shell = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {worker!r}])
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout.readline() == "ready\n"
        import time
        import psutil
        child = psutil.Process(shell.pid).children()[0]
        deadline = time.monotonic() + 30
        while child.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        terminate_executor_shell_and_children(shell.pid)
    finally:
        shell.kill()
        shell.wait()
    assert mark.exists(), "the stopped worker was killed (SIGKILL) instead of acting on SIGTERM"
