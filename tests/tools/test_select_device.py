"""The setup's choice of build by machine (scripts/select_device.py, Makefile,
scripts/build_horovod.sh), exercised on CPU with a fake nvidia-smi on PATH."""
import os
import subprocess
import sys
import textwrap

import pytest

from paths import ROOT, SCRIPTS  # noqa: E402
sys.path.insert(0, SCRIPTS)

import select_device  # noqa: E402  (scripts/ is not a package)

BAD_KIND = ("EPL_DEVICE='tpu' is not a device kind; use EPL_DEVICE=cpu (tensorflow-cpu, "
            "Horovod with Gloo) or EPL_DEVICE=gpu (tensorflow[and-cuda], Horovod with NCCL), "
            "or unset it to choose by whether nvidia-smi finds a GPU")
H200_LINE = "GPU 0: NVIDIA H200 (UUID: GPU-0f1e2d3c-0000-1111-2222-333344445555)"
SYSTEM_PATH = "/usr/bin:/bin"


def fake_nvidia_smi(folder, body: str) -> str:
    """A folder holding an executable `nvidia-smi` running the shell `body`; returns it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvidia-smi")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return str(folder)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """`machine(body=None)`: PATH without nvidia-smi, or with a fake one running `body`."""
    def make(body=None):
        path = SYSTEM_PATH
        if body is not None:
            path = fake_nvidia_smi(tmp_path / "bin", body) + ":" + SYSTEM_PATH
        monkeypatch.setenv("PATH", path)
        return path
    monkeypatch.delenv("EPL_DEVICE", raising=False)
    return make


def test_no_nvidia_smi_is_cpu(machine):
    machine()
    assert select_device.select_device() == (
        "cpu", "nvidia-smi is not on PATH (no NVIDIA driver installed)")


def test_nvidia_smi_listing_a_gpu_is_gpu(machine):
    machine(f"echo '{H200_LINE}'")
    kind, reason = select_device.select_device()
    assert kind == "gpu"
    assert reason.endswith(f"nvidia-smi -L lists 1 GPU(s): {H200_LINE}")


@pytest.mark.parametrize("body, reason_end", [
    ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; "
     "exit 9",
     "nvidia-smi -L exited with status 9: NVIDIA-SMI has failed because it couldn't "
     "communicate with the NVIDIA driver."),
    ("echo 'No devices were found'; exit 6",
     "nvidia-smi -L exited with status 6: No devices were found"),
    ("exit 0", "nvidia-smi -L lists no GPU"),
])
def test_failing_or_empty_nvidia_smi_is_cpu(machine, body, reason_end):
    machine(body)
    kind, reason = select_device.select_device()
    assert kind == "cpu"
    assert reason.endswith(reason_end)


def test_hanging_nvidia_smi_is_no_gpu(machine):
    machine("sleep 20")
    gpus, reason = select_device.nvidia_smi_gpus(timeout_s=0.5)
    assert gpus == []
    assert reason.endswith("nvidia-smi -L did not answer within 0.5 s")


@pytest.mark.parametrize("value, body, kind", [
    ("gpu", None, "gpu"), (" GPU ", None, "gpu"), ("cpu", f"echo '{H200_LINE}'", "cpu"),
])
def test_epl_device_forces_the_kind(machine, monkeypatch, value, body, kind):
    machine(body)
    monkeypatch.setenv("EPL_DEVICE", value)
    assert select_device.select_device() == (kind, f"EPL_DEVICE={value.strip()} forces it")


def test_bad_epl_device_is_an_error_naming_it(machine, monkeypatch):
    machine()
    monkeypatch.setenv("EPL_DEVICE", "tpu")
    with pytest.raises(select_device.DeviceChoiceError) as info:
        select_device.select_device()
    assert str(info.value) == BAD_KIND
    cli = _run([sys.executable, "scripts/select_device.py"])
    assert (cli.returncode, cli.stdout, cli.stderr) == (2, "", f"select_device: {BAD_KIND}\n")


def test_cli_prints_the_kind_and_explains(machine):
    machine(f"echo '{H200_LINE}'")
    cli = _run([sys.executable, "scripts/select_device.py", "--explain"])
    assert (cli.returncode, cli.stdout) == (0, "gpu\n")
    assert cli.stderr.startswith("select_device: gpu: ")
    assert _run([sys.executable, "scripts/select_device.py", "--bogus"]).returncode == 2


def _run(command, **kwargs):
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          **kwargs)


# ---------------------------------------------------------------- Makefile --

def _make_dry_run(path: str, target: str = "setup") -> list[str]:
    """The commands `make -n -B TARGET` would run with PATH=path (nothing runs)."""
    env = {k: v for k, v in os.environ.items() if k != "EPL_DEVICE"}
    env["PATH"] = path
    result = _run(["make", "-n", "-B", "--no-print-directory", target,
                   f"PY={sys.executable}"], env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_cpu_machine_setup_installs_what_it_always_did(machine):
    commands = _make_dry_run(machine())
    installs = [c for c in commands if "pip install" in c or "build_horovod" in c]
    vpy = ".venv/bin/python"
    assert installs == [
        f"{vpy} -m pip install -q --upgrade pip wheel setuptools",
        f"{vpy} -m pip install -q -r requirements.txt -r requirements-cpu.txt",
        f"{vpy} -m pip install -q --no-deps -r requirements-nodeps.txt",
        f"EPL_DEVICE=cpu bash scripts/build_horovod.sh {vpy}",
        f"{vpy} -m pip install -q --no-deps --no-build-isolation -e .",
    ]
    # The GPU TensorFlow is removed only where it is installed (never on a CPU-only venv).
    assert f"if {vpy} -m pip show -q tensorflow >/dev/null 2>&1; then \\" in commands
    assert commands[-1] == "touch .venv/.epl-installed-cpu"
    # requirements.txt + requirements-cpu.txt pin exactly what requirements.txt alone did.
    assert _pins("requirements.txt") + _pins("requirements-cpu.txt") == [
        "numpy>=1.26,<2.5", "protobuf>=5.28,<7", "pytest==9.0.3", "tensorboard==2.21.0",
        "tensorflow-cpu==2.21.0"]
    assert _pins("requirements-nodeps.txt") == ["tf-keras==2.21.0"]


def test_gpu_machine_setup_installs_cuda_tensorflow_and_nccl_horovod(machine):
    commands = _make_dry_run(machine(f"echo '{H200_LINE}'"))
    vpy = ".venv/bin/python"
    assert f"{vpy} -m pip install -q -r requirements.txt -r requirements-gpu.txt" in commands
    assert f"EPL_DEVICE=gpu bash scripts/build_horovod.sh {vpy}" in commands
    assert f"if {vpy} -m pip show -q tensorflow-cpu >/dev/null 2>&1; then \\" in commands
    assert commands[-1] == "touch .venv/.epl-installed-gpu"
    assert _pins("requirements-gpu.txt") == ["tensorflow[and-cuda]==2.21.0"]


def test_gpu_check_target_fails_first_on_a_machine_without_gpus(machine):
    commands = _make_dry_run(machine(), "gpu-check")
    assert commands[0] == f"{sys.executable} scripts/gpu_check.py --preflight"


def _pins(name: str) -> list[str]:
    with open(os.path.join(ROOT, name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


# ------------------------------------------------------ scripts/build_horovod.sh --

# A stand-in for the environment's Python: answers the questions build_horovod.sh
# asks (TensorFlow version, is Horovod installed, where is nvidia.nccl), records the
# environment of `pip wheel` (the Horovod build) and writes an empty wheel.
FAKE_PYTHON = """\
#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
log = os.environ["FAKE_LOG"]
if args[:1] == ["-c"]:
    code = args[1]
    if "import horovod" in code and "assert" in code:
        sys.exit(1)                       # not installed yet
    if "import horovod" in code:
        print("build_horovod: Horovod 0.28.1 (fake)")
        sys.exit(0)
    if "tensorflow" in code:
        print("2.21.0")
    elif "nvidia.nccl" in code:
        print(os.environ.get("FAKE_NCCL", ""))
    else:
        exec(code)
    sys.exit(0)
if args[:3] == ["-m", "pip", "download"]:
    dest = args[args.index("-d") + 1]
    src = os.path.join(dest, "horovod-0.28.1")
    os.makedirs(os.path.join(src, "horovod", "tensorflow"))
    with open(os.path.join(src, "horovod", "tensorflow", "CMakeLists.txt"), "w") as f:
        f.write("list(APPEND SOURCES xla_mpi_ops.cc)\\nlist(APPEND SOURCES mpi_ops.cc)\\n")
    with open(os.path.join(src, "horovod", "tensorflow", "mpi_ops.cc"), "w") as f:
        f.write(os.environ["FAKE_MPI_OPS"])
    subprocess.run(["tar", "-czf", os.path.join(dest, "horovod-0.28.1.tar.gz"), "-C", dest,
                    "horovod-0.28.1"], check=True)
    sys.exit(0)
if args[:3] == ["-m", "pip", "wheel"]:
    src = args[-3]
    with open(os.path.join(src, "horovod", "tensorflow", "CMakeLists.txt")) as f:
        cmake = f.read()
    with open(os.path.join(src, "horovod", "tensorflow", "mpi_ops.cc")) as f:
        mpi_ops = f.read()
    with open(log, "w") as f:
        json.dump({{"env": {{k: v for k, v in os.environ.items()
                             if k.startswith(("HOROVOD", "LDFLAGS"))}},
                   "cmake": cmake, "mpi_ops": mpi_ops, "path": os.environ["PATH"]}}, f)
    out = args[args.index("-w") + 1]
    open(os.path.join(out, "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"), "w").close()
    sys.exit(0)
if args[0].endswith("patch_horovod_runner.py"):  # patches the installed Horovod: recorded only
    with open(log + ".runner", "a") as f:
        f.write("patched\\n")
    sys.exit(0)
if args[0].endswith(".py"):                # scripts/select_device.py, scripts/patch_horovod_tf.py
    sys.exit(subprocess.run([{python!r}] + args).returncode)
sys.exit(0)                               # pip install ...
"""


@pytest.fixture
def horovod_build(tmp_path):
    """`horovod_build(kind_env, path)`: run build_horovod.sh with a fake Python; returns
    (result, record of the Horovod build or None, cache folder)."""
    from patch_horovod_tf import DECLARATION, INCLUDES_END
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)

    def run(extra_env, path):
        log = tmp_path / "build.json"
        env = {"PATH": path, "HOME": str(tmp_path), "FAKE_LOG": str(log),
               "EPL_WHEEL_CACHE": str(tmp_path / "cache"),
               "FAKE_MPI_OPS": "x\n" + DECLARATION + "#if 1\n" + INCLUDES_END + "y\n",
               **extra_env}
        result = _run(["bash", "scripts/build_horovod.sh", str(python)], env=env)
        record = None
        if log.exists():
            import json
            record = json.loads(log.read_text())
        return result, record, tmp_path / "cache"
    return run


def test_cpu_build_never_switches_to_nccl(horovod_build, tmp_path):
    """A CUDA compiler on PATH, an NCCL and HOROVOD_GPU_OPERATIONS=NCCL in the
    caller's environment do not make the cpu build an NCCL one."""
    tools = tmp_path / "cuda" / "bin"
    tools.mkdir(parents=True)
    (tools / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    (tools / "nvcc").chmod(0o755)
    path = f"{tools}:{SYSTEM_PATH}"
    result, record, cache = horovod_build(
        {"EPL_DEVICE": "cpu", "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_HOME": "/x"}, path)
    assert result.returncode == 0, result.stderr
    assert not any(k.startswith(("HOROVOD_GPU", "HOROVOD_NCCL", "HOROVOD_CUDA"))
                   for k in record["env"])
    assert record["env"]["HOROVOD_WITH_GLOO"] == "1"
    assert "xla_mpi_ops.cc" not in record["cmake"]
    assert "AsGpuStreamValue(Stream* stream);" in record["mpi_ops"]  # not patched for cpu
    assert [p.name for p in cache.iterdir()] == ["tf-2.21.0-cp311"]
    # horovodrun's teardown is patched after the install (scripts/patch_horovod_runner.py)
    assert (tmp_path / "build.json.runner").read_text() == "patched\n"


def test_gpu_build_uses_pip_nccl_and_keys_the_cache_by_kind(horovod_build, tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "include").mkdir()
    (cuda / "include" / "cuda_runtime.h").write_text("")
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4'\n"
                                       "echo 'Build cuda_12.4'\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    nccl = tmp_path / "site-packages" / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    smi = fake_nvidia_smi(tmp_path / "smi",
                          'case "$1" in --query-gpu=compute_cap) echo 9.0; echo 9.0;; '
                          f"*) echo '{H200_LINE}';; esac")
    result, record, cache = horovod_build(
        {"CUDA_HOME": str(cuda), "FAKE_NCCL": str(nccl)}, f"{smi}:{SYSTEM_PATH}")
    assert result.returncode == 0, result.stderr
    env = record["env"]
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_CUDA_HOME"] == str(cuda)
    assert env["HOROVOD_NCCL_INCLUDE"] == str(nccl / "include")
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert env["LDFLAGS"].startswith("-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib")
    assert record["path"].startswith(f"{cuda}/bin:")
    assert "AsGpuStreamValue(Stream* stream);" not in record["mpi_ops"]
    assert "platform_specific_handle().stream" in record["mpi_ops"]
    assert [p.name for p in cache.iterdir()] == ["tf-2.21.0-cp311-gpu-nccl-sm90"]
    assert "gpu build: nvcc Cuda compilation tools, release 12.4" in result.stderr


def test_gpu_build_with_a_bad_cuda_home_says_so(horovod_build, tmp_path):
    result, record, _ = horovod_build({"EPL_DEVICE": "gpu", "CUDA_HOME": str(tmp_path / "no")},
                                      SYSTEM_PATH)
    assert result.returncode == 1 and record is None
    assert result.stderr.strip().endswith(f"build_horovod: CUDA_HOME={tmp_path / 'no'} has no bin/nvcc")


def test_patch_refuses_a_source_it_does_not_know(tmp_path):
    from patch_horovod_tf import patch
    with pytest.raises(ValueError) as info:
        patch("int main() {}\n")
    assert str(info.value) == ("expected the AsGpuStreamValue declaration once in mpi_ops.cc, "
                               "found it 0 times; is this Horovod 0.28.1?")
    source = textwrap.dedent("""\
        #include "tensorflow/stream_executor/stream.h"
        #endif // TENSORFLOW_VERSION >= 2011000000
        """)
    from patch_horovod_tf import DECLARATION
    patched = patch(DECLARATION + source)
    assert patched.startswith(source)
    assert "inline GpuStreamHandle AsGpuStreamValue(Stream* stream)" in patched
