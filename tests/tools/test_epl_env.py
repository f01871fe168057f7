"""`epl-env` and `epl-launch --check-build` (issue 28, item 4): the environment report."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import horovod
import horovod.tensorflow as hvd
import tensorflow as tf

from epl.tools import env_report
from epl.tools.env_report import cpu_features, format_report, gpu_path, report

BIN = os.path.dirname(sys.executable)


def test_report_says_what_this_machine_has():
    info = report()
    assert info["tensorflow"]["version"] == tf.__version__
    assert info["tensorflow"]["cuda_build"] == tf.test.is_built_with_cuda()
    assert info["tensorflow"]["gpus"] == len(tf.config.list_physical_devices("GPU"))
    assert info["packages"]["horovod"] == importlib.metadata.version("horovod")
    assert info["horovod"]["version"] == horovod.__version__
    assert info["horovod"]["controllers"] == {"mpi": bool(hvd.mpi_built()),
                                              "gloo": bool(hvd.gloo_built())}
    assert info["horovod"]["operations"]["nccl"] == bool(hvd.nccl_built())
    assert info["horovod"]["frameworks"]["tensorflow"] is True
    # the tests run with TF_USE_LEGACY_KERAS=1 (tests/conftest.py): v1 layers work
    assert info["legacy_keras"] == {"TF_USE_LEGACY_KERAS": "1",
                                    "tf_keras": importlib.metadata.version("tf-keras"),
                                    "compat_v1_layers": True}
    assert info["cpu"]["cores"] == len(os.sched_getaffinity(0))
    text = format_report(info)
    assert f"    {'[X]' if hvd.gloo_built() else '[ ]'} Gloo" in text
    assert "tf.compat.v1.layers works" in text
    assert text.splitlines()[-1].startswith("GPU path: ")


def test_cpu_features_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\nflags : avx512f\n")
    features = cpu_features(str(cpuinfo))
    assert [name for name, present in features.items() if present] == [
        "sse4_2", "avx", "avx2", "fma"]
    assert not any(cpu_features(str(tmp_path / "missing")).values())


def test_gpu_path_names_what_is_missing():
    assert gpu_path({"cuda_build": True, "gpus": 2}, {"operations": {"nccl": True}}) == (
        True, "2 GPU(s), Horovod with NCCL")
    assert gpu_path({"cuda_build": False}, {"operations": {"nccl": False}}) == (
        False, "TensorFlow is not built with CUDA (the CPU package); Horovod has no NCCL: EPL "
               "runs on virtual CPU devices")
    assert gpu_path({"cuda_build": True, "gpus": 0}, {"operations": {"nccl": True}}) == (
        False, "TensorFlow sees no GPU: EPL runs on virtual CPU devices")
    assert gpu_path({"cuda_build": True, "gpus": 1}, {"version": None}) == (
        False, "Horovod has no NCCL: EPL runs on virtual CPU devices")


def test_epl_launch_check_build_prints_the_report_without_np():
    """horovodrun's --check-build habit: no -np needed; --json passes through."""
    result = subprocess.run([os.path.join(BIN, "epl-launch"), "--check-build", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert set(info) == {"epl", "python", "platform", "packages", "legacy_keras", "tensorflow",
                         "horovod", "cpu", "nvidia_smi", "gpu_path"}
    assert info["tensorflow"]["version"] == tf.__version__
    assert not any("port.cc" in line or "absl::InitializeLog" in line
                   for line in result.stderr.splitlines())   # TensorFlow's start-up lines


def test_main_json_and_text(capsys):
    assert env_report.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epl"] == __import__("epl").__version__
    assert env_report.main([]) == 0
    assert capsys.readouterr().out.startswith("EPL ")
