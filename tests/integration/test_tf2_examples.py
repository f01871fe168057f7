"""The TensorFlow 2 examples and bench/keras_dp.py run (few steps), in Keras 3 processes,
as `make run EXAMPLE=...` runs them (with TF_USE_LEGACY_KERAS=1 set: the scripts drop it)."""
from __future__ import annotations

import os
import subprocess
import sys

import tf2_oracle
from paths import BENCH, EXAMPLES


def _run(path: str, args: list[str]) -> str:
    environ = dict(tf2_oracle.keras3_env(), TF_USE_LEGACY_KERAS="1")   # as the Makefile
    proc = subprocess.run([sys.executable, path] + args, env=environ, capture_output=True,
                          text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def test_keras_fit_example_trains_two_pipelines():
    output = _run(os.path.join(EXAMPLES, "keras_fit.py"),
                  ["--steps", "6", "--epochs", "2", "--batch", "32"])
    assert "2 replicas x 2 stages (stage_0, stage_1), 4 micro-batches per step" in output
    assert "done: 6 steps" in output


def test_tf2_custom_loop_example_restores_its_checkpoint_single_device(tmp_path):
    output = _run(os.path.join(EXAMPLES, "tf2_custom_loop.py"),
                  ["--steps", "3", "--log-every", "1", "--devices", "2", "--ckpt", str(tmp_path)])
    assert "split groups: classifier over CPU:0, CPU:1" in output
    assert "restored into a single-device model: same values" in output


def test_keras_dp_bench_quick_prints_ratio_line():
    output = _run(os.path.join(BENCH, "keras_dp.py"), ["--quick"])
    last = [line for line in output.splitlines() if line.startswith("keras_dp:")]
    assert last and last[-1].startswith(
        "keras_dp: EPL/MirroredStrategy Keras fit step time ratio = ")
    assert last[-1].endswith("(target <= 1.0)")
