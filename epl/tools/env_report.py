"""`epl-env`: what EPL runs on, in one report (as `horovodrun --check-build` and
DeepSpeed's `ds_report`). `epl-launch --check-build` prints the same.

    epl-env [--json]

It reports:

- versions: EPL, Python, TensorFlow (its package: tensorflow, tensorflow-cpu or
  tensorflow[and-cuda]), tf-keras, Keras, TensorBoard, NumPy, Horovod;
- legacy Keras: ``TF_USE_LEGACY_KERAS`` and whether `tf.compat.v1.layers` works
  (it needs tf-keras and the variable set before TensorFlow is imported);
- Horovod as `horovodrun --check-build` lists it: the frameworks it was built
  for (its extension for TensorFlow, PyTorch, MXNet is installed), the
  controllers (MPI, Gloo) and the tensor operations (NCCL, DDL, CCL, MPI,
  Gloo), read in this process from Horovod's TensorFlow extension (one
  import of TensorFlow, where horovodrun starts a process per check), and
  where horovodrun is;
- devices: the CPU cores this process may use, the CPU's vector features
  (/proc/cpuinfo), the devices TensorFlow sees, the GPUs `nvidia-smi -L`
  lists, and TensorFlow's CUDA build;
- whether EPL's GPU path is usable: TensorFlow built with CUDA, sees a GPU,
  and Horovod has NCCL; otherwise which of these is missing (EPL then runs
  on virtual CPU devices).

``--json`` prints the same as one JSON object. Nothing here fails: a missing
package is reported as missing. Exit code 0.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from typing import Any

PROG = "epl-env"
PACKAGES = ("tensorflow", "tensorflow-cpu", "tf-keras", "keras", "tensorboard", "numpy",
            "horovod")
#: Vector features of x86 CPUs that TensorFlow's kernels use, as /proc/cpuinfo names them.
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")
HOROVOD_FRAMEWORKS = {"tensorflow": "TensorFlow", "torch": "PyTorch", "mxnet": "MXNet"}
HOROVOD_OPERATIONS = ("nccl", "ddl", "ccl", "mpi", "gloo")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> dict[str, bool]:
    """{feature: present} for `CPU_FEATURES`, from the first "flags" line of `cpuinfo`
    (all False where the file does not exist)."""
    flags: set[str] = set()
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {feature: feature in flags for feature in CPU_FEATURES}


def _tensorflow() -> dict[str, Any]:
    """TensorFlow's version, CUDA build, devices and whether tf.compat.v1.layers works."""
    from epl.observability.logs import quiet_tensorflow_startup
    try:
        with quiet_tensorflow_startup():
            import tensorflow as tf
    except ImportError as err:
        return {"version": None, "error": str(err)}
    build = dict(tf.sysconfig.get_build_info())
    try:
        tf.compat.v1.layers.dense   # noqa: B018  (Keras 3 raises here)
        layers = True
    except AttributeError:
        layers = False
    return {"version": tf.__version__, "cuda_build": bool(build.get("is_cuda_build")),
            "cuda_version": build.get("cuda_version"), "cudnn_version": build.get("cudnn_version"),
            "devices": [f"{d.device_type}:{d.name.rsplit(':', 1)[-1]}"
                        for d in tf.config.list_physical_devices()],
            "gpus": len(tf.config.list_physical_devices("GPU")),
            "compat_v1_layers": layers}


def _horovod() -> dict[str, Any]:
    """Horovod's version, frameworks, controllers, tensor operations and horovodrun."""
    try:
        import horovod
        import horovod.tensorflow as hvd
    except ImportError as err:
        return {"version": None, "error": str(err)}
    root = os.path.dirname(horovod.__file__)
    frameworks = {name: bool(glob.glob(os.path.join(root, name, "mpi_lib*")))
                  for name in HOROVOD_FRAMEWORKS}
    built = {name: bool(getattr(hvd, f"{name}_built")()) for name in HOROVOD_OPERATIONS}
    runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return {"version": horovod.__version__, "frameworks": frameworks,
            "controllers": {"mpi": built["mpi"], "gloo": built["gloo"]},
            "operations": built, "cuda_built": bool(hvd.cuda_built()),
            "horovodrun": runner if os.path.exists(runner) else shutil.which("horovodrun")}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


def gpu_path(tensorflow: dict, horovod: dict) -> tuple[bool, str]:
    """(usable, why): EPL's GPU path needs TensorFlow built with CUDA that sees a GPU,
    and Horovod with NCCL (between workers)."""
    missing = []
    if not tensorflow.get("cuda_build"):
        missing.append("TensorFlow is not built with CUDA (the CPU package)")
    elif not tensorflow.get("gpus"):
        missing.append("TensorFlow sees no GPU")
    if not (horovod.get("operations") or {}).get("nccl"):
        missing.append("Horovod has no NCCL")
    if missing:
        return False, "; ".join(missing) + ": EPL runs on virtual CPU devices"
    return True, f"{tensorflow['gpus']} GPU(s), Horovod with NCCL"


def report() -> dict[str, Any]:
    """The report as one JSON-ready dict (see the module doc)."""
    import epl
    from epl.runtime.gpus import nvidia_smi_gpus
    tensorflow, horovod = _tensorflow(), _horovod()
    smi, smi_reason = nvidia_smi_gpus()
    usable, why = gpu_path(tensorflow, horovod)
    return {
        "epl": epl.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "legacy_keras": {"TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS"),
                         "tf_keras": _version("tf-keras"),
                         "compat_v1_layers": tensorflow.get("compat_v1_layers")},
        "tensorflow": tensorflow, "horovod": horovod,
        "cpu": {"cores": _cores(), "features": cpu_features()},
        "nvidia_smi": {"gpus": smi, "note": smi_reason},
        "gpu_path": {"usable": usable, "why": why},
    }


def _mark(value: Any) -> str:
    return "[X]" if value else "[ ]"


def format_report(info: dict[str, Any]) -> str:
    """The text of `epl-env` (one line per item, horovodrun --check-build's marks)."""
    packages = info["packages"]
    tf_info, hvd_info, keras = info["tensorflow"], info["horovod"], info["legacy_keras"]
    lines = [f"EPL {info['epl']} on Python {info['python']} ({info['platform']})", "",
             "Packages:"]
    lines += [f"    {name:<16} {version or 'not installed'}" for name, version in packages.items()]
    layers = {True: "works", False: "fails (Keras 3): install tf-keras and set "
              "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported",
              None: "unknown (no TensorFlow)"}[keras["compat_v1_layers"]]
    lines += ["", "Legacy Keras:",
              f"    TF_USE_LEGACY_KERAS={keras['TF_USE_LEGACY_KERAS'] or '(unset)'}; "
              f"tf-keras {keras['tf_keras'] or 'not installed'}; tf.compat.v1.layers {layers}"]
    lines += ["", f"Horovod {hvd_info.get('version') or 'not importable: ' + hvd_info['error']}"]
    if hvd_info.get("version"):
        lines += ["    Available Frameworks:"]
        lines += [f"        {_mark(hvd_info['frameworks'][k])} {label}"
                  for k, label in HOROVOD_FRAMEWORKS.items()]
        lines += ["    Available Controllers:",
                  f"        {_mark(hvd_info['controllers']['mpi'])} MPI",
                  f"        {_mark(hvd_info['controllers']['gloo'])} Gloo",
                  "    Available Tensor Operations:"]
        lines += [f"        {_mark(hvd_info['operations'][k])} {k.upper() if k != 'gloo' else 'Gloo'}"
                  for k in HOROVOD_OPERATIONS]
        lines += [f"    horovodrun: {hvd_info['horovodrun'] or 'not found'}"]
    cpu = info["cpu"]
    features = [name for name, present in cpu["features"].items() if present]
    lines += ["", "Devices:",
              f"    CPU cores this process may use: {cpu['cores']}; features: "
              f"{' '.join(features) or 'none of ' + ' '.join(CPU_FEATURES)}"]
    if tf_info.get("version"):
        cuda = (f"built with CUDA {tf_info['cuda_version']}, cuDNN {tf_info['cudnn_version']}"
                if tf_info["cuda_build"] else "built without CUDA")
        lines += [f"    TensorFlow {tf_info['version']} ({cuda}) sees: "
                  f"{', '.join(tf_info['devices']) or 'no device'}"]
    else:
        lines += [f"    TensorFlow not importable: {tf_info['error']}"]
    lines += [f"    nvidia-smi: {info['nvidia_smi']['note']}"]
    usable = info["gpu_path"]
    lines += ["", f"GPU path: {'usable' if usable['usable'] else 'not usable'} ({usable['why']})"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `epl-env`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="What EPL runs on, in one report (as `horovodrun "
        "--check-build` and DeepSpeed's `ds_report`). `epl-launch --check-build` "
        "prints the same.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `epl-env`; returns 0."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    info = report()
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
