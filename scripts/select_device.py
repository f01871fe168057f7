#!/usr/bin/env python3
"""Which build `make setup` installs on this machine: "cpu" or "gpu".

The first rule that applies decides:

1. ``EPL_DEVICE=cpu`` or ``EPL_DEVICE=gpu`` (any case, surrounding blanks
   ignored) forces the kind.  Any other non-empty value is an error that
   names the value and the valid ones.
2. "gpu" where the NVIDIA driver answers: ``nvidia-smi -L`` exits 0 within
   30 seconds and lists at least one GPU (a line starting with "GPU ").
3. "cpu" otherwise: no nvidia-smi on PATH, or it fails (no driver loaded, a
   driver/library version mismatch), hangs, or lists no GPU.

What each kind installs (Makefile, `scripts/build_horovod.sh`):
- cpu: requirements-cpu.txt (tensorflow-cpu) and Horovod with Gloo only;
- gpu: requirements-gpu.txt (tensorflow[and-cuda], which brings the CUDA,
  cuDNN and NCCL libraries as pip packages) and Horovod with
  HOROVOD_GPU_OPERATIONS=NCCL.

Standard library only (with epl.runtime.gpus): the Makefile runs it with the system Python, before
the virtual environment exists.

usage: select_device.py             print the kind ("cpu" or "gpu")
       select_device.py --explain   print the kind, and why on stderr
exit status 2 with a message on stderr for a bad EPL_DEVICE.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# the repository root: the GPU query is epl.runtime.gpus (standard library only)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from epl.runtime.gpus import NVIDIA_SMI_TIMEOUT_S, nvidia_smi_gpus  # noqa: E402,F401

KINDS = ("cpu", "gpu")
ENV_VAR = "EPL_DEVICE"


class DeviceChoiceError(ValueError):
    """EPL_DEVICE holds something other than "cpu" or "gpu"."""


def select_device(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(kind, reason): "cpu" or "gpu" by the rules in the module docstring.

    Raises DeviceChoiceError for an EPL_DEVICE value other than cpu/gpu.
    """
    environ = os.environ if environ is None else environ
    forced = environ.get(ENV_VAR, "").strip()
    if forced:
        kind = forced.lower()
        if kind not in KINDS:
            raise DeviceChoiceError(
                f"{ENV_VAR}={forced!r} is not a device kind; use {ENV_VAR}=cpu "
                f"(tensorflow-cpu, Horovod with Gloo) or {ENV_VAR}=gpu "
                f"(tensorflow[and-cuda], Horovod with NCCL), or unset it to "
                f"choose by whether nvidia-smi finds a GPU")
        return kind, f"{ENV_VAR}={forced} forces it"
    gpus, reason = nvidia_smi_gpus()
    return ("gpu" if gpus else "cpu"), reason


def main(argv: list[str] | None = None) -> int:
    """Print the kind (and with --explain the reason on stderr)."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--explain"]):
        print("usage: select_device.py [--explain]", file=sys.stderr)
        return 2
    try:
        kind, reason = select_device()
    except DeviceChoiceError as err:
        print(f"select_device: {err}", file=sys.stderr)
        return 2
    print(kind)
    if args:
        print(f"select_device: {kind}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
