"""The NVIDIA GPUs of this machine, as `nvidia-smi -L` lists them (standard library only).

`scripts/select_device.py` (which build `make setup` installs) runs it with the
system Python before the virtual environment exists; `epl.tools.launch_flags`
counts the GPUs the workers would see with it.
"""
from __future__ import annotations

import shutil
import subprocess

NVIDIA_SMI_TIMEOUT_S = 30


def nvidia_smi_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[list[str], str]:
    """The GPUs `nvidia-smi -L` lists, and a one-line account of the query.

    Returns (lines such as "GPU 0: NVIDIA H200 (UUID: GPU-...)", reason); the
    list is empty when nvidia-smi is missing, fails, times out or lists none,
    and the reason says which.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi is not on PATH (no NVIDIA driver installed)"
    try:
        result = subprocess.run([exe, "-L"], capture_output=True, text=True,
                                timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [], f"{exe} -L did not answer within {timeout_s:g} s"
    except OSError as err:
        return [], f"{exe} -L could not run: {err}"
    if result.returncode != 0:
        said = (result.stdout + result.stderr).strip().splitlines()
        return [], (f"{exe} -L exited with status {result.returncode}"
                    + (f": {said[0]}" if said else ""))
    gpus = [line.strip() for line in result.stdout.splitlines()
            if line.strip().startswith("GPU ")]
    if not gpus:
        return [], f"{exe} -L lists no GPU"
    return gpus, f"{exe} -L lists {len(gpus)} GPU(s): {gpus[0]}"
