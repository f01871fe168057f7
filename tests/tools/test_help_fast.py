"""`--help` of every example and CLI answers before TensorFlow is imported (issue 28,
item 3: under 2 s; importing TensorFlow alone takes 5-20 s), and TensorFlow's start-up
lines are kept quiet where EPL imports it."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

from epl.observability.logs import tensorflow_line_hidden
from paths import EXAMPLES, ROOT

CLIS = {"epl-dump": "epl.tools.dump", "epl-plan": "epl.tools.plan",
        "epl-launch": "epl.tools.launch", "epl-env": "epl.tools.env_report"}

PROBE = """
import importlib, io, contextlib, runpy, sys
examples, clis = sys.argv[1].split(","), sys.argv[2].split(",")
for path in examples:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as exit_:
        code = exit_.code
    print(path.rsplit("/", 1)[-1], code, "usage:" in out.getvalue(), "tensorflow" in sys.modules)
for module in clis:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = importlib.import_module(module).main(["--help"])
    print(module, code, "usage:" in out.getvalue(), "tensorflow" in sys.modules)
"""


def test_help_of_examples_and_clis_imports_no_tensorflow():
    examples = sorted(glob.glob(os.path.join(EXAMPLES, "*.py")))
    result = subprocess.run([sys.executable, "-c", PROBE, ",".join(examples),
                             ",".join(CLIS.values())], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert result.returncode == 0, result.stderr
    expected = [f"{os.path.basename(p)} 0 True False" for p in examples] + \
        [f"{module} 0 True False" for module in CLIS.values()]
    assert result.stdout.splitlines() == expected


def test_tensorflow_start_up_lines_are_hidden_as_tf_cpp_min_log_level_says():
    notice = ("WARNING: All log messages before absl::InitializeLog() is called are written "
              "to STDERR\n")
    info = "I0000 00:00:1796229532.334134    2391 port.cc:153] oneDNN custom operations are on.\n"
    warning = "W0000 00:00:1796229532.334134    2391 foo.cc:12] something\n"
    assert [tensorflow_line_hidden(line, 1) for line in (notice, info, warning)] == [
        True, True, False]
    assert [tensorflow_line_hidden(line, 2) for line in (notice, info, warning)] == [
        True, True, True]
    assert not any(tensorflow_line_hidden(line, 0) for line in (notice, info, warning))
    assert not tensorflow_line_hidden("Traceback (most recent call last):\n", 3)


def test_quiet_import_of_tensorflow_prints_none_of_its_start_up_lines():
    script = ("import sys\nfrom epl.observability.logs import quiet_tensorflow_startup\n"
              "with quiet_tensorflow_startup():\n    import tensorflow as tf\n"
              "print('kept', file=sys.stderr)\ntf.constant(1.0)\n")
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(environ, PYTHONPATH=ROOT), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "kept\n"
