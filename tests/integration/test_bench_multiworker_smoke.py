"""The multi-worker benchmarks run end to end (smallest settings) and print their ratio."""
import os
import subprocess
import sys

import pytest

from paths import BENCH  # noqa: E402
pytestmark = pytest.mark.multiworker


@pytest.mark.parametrize("script,expected", [
    ("fusion.py", "fusion: EPL fused / EPL unfused = "),
    ("scaling.py", "scaling: 2 workers / 1 worker samples/s = "),
])
def test_multiworker_benchmark_quick(script, expected):
    result = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout
