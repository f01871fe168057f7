"""scripts/gpu_check.py on a machine without GPUs: the message, the preflight, and
the checks' own code rehearsed on virtual CPU devices (nothing here runs on a GPU)."""
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from paths import ROOT, SCRIPTS  # noqa: E402
sys.path.insert(0, SCRIPTS)

import gpu_check  # noqa: E402

NO_DRIVER = "nvidia-smi is not on PATH (no NVIDIA driver installed)"


def _run(args, path="/usr/bin:/bin"):
    env = dict(os.environ, PATH=path, PYTHONPATH=ROOT, TF_USE_LEGACY_KERAS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_without_gpu_it_says_so_and_fails():
    for args in ([], ["--preflight"]):
        result = _run(args)
        assert result.returncode == 1
        assert result.stdout == (f"gpu-check: no NVIDIA GPU on this machine ({NO_DRIVER}); "
                                 f"the GPU checks need one. Nothing was run.\n")


def test_a_driver_that_fails_is_no_gpu(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate "
                   "with the NVIDIA driver.\"\nexit 9\n")
    smi.chmod(0o755)
    result = _run(["--preflight"], f"{tmp_path}:/usr/bin:/bin")
    assert result.returncode == 1
    assert result.stdout.startswith("gpu-check: no NVIDIA GPU on this machine (")
    assert "-L exited with status 9: NVIDIA-SMI has failed" in result.stdout


def test_preflight_passes_where_nvidia_smi_lists_a_gpu(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    result = _run(["--preflight"], f"{tmp_path}:/usr/bin:/bin")
    assert (result.returncode, result.stdout) == (0, "")


def test_oracles_rehearsed_on_cpu_pass():
    result = _run(["--cpu-rehearsal", "--only", "dp_oracle", "split_oracle", "pipeline_oracle"])
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split(" (")[0] for line in lines[:3]] == [
        "gpu-check dp_oracle: PASS", "gpu-check split_oracle: PASS",
        "gpu-check pipeline_oracle: PASS"]
    assert lines[-1] == "gpu-check: 3 passed, 0 failed, 0 skipped"


def test_the_oracle_fails_a_run_that_differs(epl_env):
    """fp16 gradient compression changes the result by ~1e-3, far above the float32
    noise floor: the oracle must call that a failure."""
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    y = np.random.RandomState(1).randn(8, 2).astype(np.float32)

    def build(features, labels):
        import epl
        with epl.replicate(1) if gpu_check._epl_on() else gpu_check._nothing():
            out = tf.matmul(tf.nn.tanh(tf.matmul(features, gpu_check._variable("a", [4, 8], 1))),
                            gpu_check._variable("b", [8, 2], 2))
            return tf.reduce_mean(tf.square(out - labels))
    same = gpu_check.oracle(build, {"cluster.virtual_devices": 2}, x, y, 2)
    assert same["ok"], same["details"]
    differs = gpu_check.oracle(build, {"cluster.virtual_devices": 2, "communication.fp16": True},
                               x, y, 2)
    assert not differs["ok"], differs["details"]


def test_scaled_error_names_mismatched_variables():
    import pytest
    with pytest.raises(AssertionError, match=r"variables differ: \['a'\] vs \['b'\]"):
        gpu_check.scaled_error({"a": np.ones(2)}, {"b": np.ones(2)})
    assert gpu_check.scaled_error({"a": np.array([1.0, 2.5])}, {"a": np.array([1.0, 2.0])}) \
        == 0.25
