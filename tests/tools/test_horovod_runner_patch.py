"""scripts/patch_horovod_runner.py: horovodrun ends a failed job without a 5 s wait.

horovodrun stops a remaining worker's shell by freezing it (SIGSTOP), sending
it SIGTERM and waiting up to 5 s; unpatched, a frozen shell never acts on the
SIGTERM, so it is killed (SIGKILL) only after the 5 s. The patched runner
continues the shell, which then acts on its SIGTERM at once.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from paths import SCRIPTS  # noqa: E402
sys.path.insert(0, SCRIPTS)
from patch_horovod_runner import EARLIER_PATCHES, PATCHED, SHELL_TERMINATE, installed_path, patch  # noqa: E402


def test_the_installed_horovod_is_patched():
    with open(installed_path(), encoding="utf-8") as f:
        assert PATCHED in f.read(), "run `make setup` (scripts/build_horovod.sh patches horovodrun)"


def test_patch_is_idempotent_and_refuses_a_source_it_does_not_know():
    source = "def terminate_executor_shell_and_children(pid):\n" + SHELL_TERMINATE
    once = patch(source)
    assert "p.terminate()\n        p.resume()\n" in once
    assert patch(once) == once
    earlier = once.replace(PATCHED, EARLIER_PATCHES[0])   # patched before the script moved
    assert earlier != once and patch(earlier) == once
    with pytest.raises(ValueError) as info:
        patch("def f():\n    pass\n")
    assert str(info.value) == (
        "expected the shell's terminate in terminate_executor_shell_and_children once in "
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
