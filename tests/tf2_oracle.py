"""The TensorFlow 2 oracle's checks, for the tests of eager programs under EPL.

Keras 3 programs need a process of their own (no TF_USE_LEGACY_KERAS, and the
virtual devices created before TensorFlow's first op), so `run_cases` runs the
worker tests/workers/tf2_worker.py once for many cases and returns its record, and
`assert_matches` holds one case to the oracle: after the steps, every variable
(weights, optimizer-independent state such as batch-norm moving averages and the
dropout seed) and the logged running loss equal single-device training on the
batches the units consumed, within the tolerance of tests/conftest.py (ATOL,
RTOL, NOISE_FACTOR x the reference's noise floor).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from conftest import ATOL, NOISE_FACTOR, RTOL
from paths import ROOT, WORKERS

AMP_TOLERANCE = dict(rtol=1e-2, atol=1e-3)   # as tests/integration/test_batch_semantics.py


def keras3_env() -> dict:
    """The environment of a Keras 3 process: this one's without TF_USE_LEGACY_KERAS."""
    environ = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environ.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([ROOT, WORKERS]))
    return environ


def run_worker(script: str, args: list[str], timeout: float = 900) -> str:
    """Run tests/workers/<script> with `args` in a Keras 3 process; its output, or an
    AssertionError with the output when it fails."""
    proc = subprocess.run([sys.executable, os.path.join(WORKERS, script)] + args,
                          env=keras3_env(), capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed (exit {proc.returncode}):\n{output[-6000:]}"
    return output


def run_cases(cases: list[str], out: str) -> dict:
    """Run the oracle worker on `cases` ("model:mode:strategy"); its record."""
    run_worker("tf2_worker.py", ["--cases", ",".join(cases), "--out", out])
    with np.load(out) as record:
        return {key: record[key] for key in record.files}


def _variables(record: dict, prefix: str) -> list:
    count = len([k for k in record if k.startswith(f"{prefix}/var_")])
    return [record[f"{prefix}/var_{i}"] for i in range(count)]


def assert_matches(record: dict, case: str, amp: bool = False,
                   loss_floor: bool = False) -> None:
    """The oracle for one case of the record (module docstring); with `amp`, 90% of
    every float variable's elements within float16's tolerance (or the noise floor's,
    where a gradient near zero makes Adam's update noise: an attention key's bias), as
    the graph-mode AMP tests hold. With `loss_floor`, the logged losses too are held
    to NOISE_FACTOR x their noise floor (the reference's losses against the reversed
    reference's), for a case that adds a gradient up in another order than the
    reference does (a split op over the whole batch: one sum where the reference adds
    the units'), where Adam turns the rounding of a near-zero gradient into an update
    that moves the next loss as the reversed reference's moves."""
    assert int(record[f"{case}/rewrites"]) >= 1, f"{case}: EPL rewrote no traced step"
    reference = str(record[f"{case}/reference"])
    got, want = _variables(record, case), _variables(record, reference)
    noise = _variables(record, reference + "/reversed")
    assert len(got) == len(want)
    for i, (value, expected, other) in enumerate(zip(got, want, noise)):
        floor = float(np.max(np.abs(other.astype(np.float64) - expected))) if value.size else 0.0
        if amp and value.dtype.kind == "f":
            close = np.isclose(value, expected, rtol=AMP_TOLERANCE["rtol"],
                               atol=max(AMP_TOLERANCE["atol"], NOISE_FACTOR * floor))
            assert close.mean() >= 0.9, f"{case}: variable {i}"
            continue
        np.testing.assert_allclose(value, expected, rtol=RTOL,
                                   atol=max(ATOL, NOISE_FACTOR * floor),
                                   err_msg=f"{case}: variable {i}")
    losses, expected = record[f"{case}/losses"], record[f"{reference}/losses"]
    assert len(losses) == len(expected), (losses, expected)
    atol = 1e-5
    if loss_floor:
        floor = float(np.max(np.abs(record[f"{reference}/reversed/losses"] - expected)))
        atol = max(atol, NOISE_FACTOR * floor)
    np.testing.assert_allclose(losses, expected, **(AMP_TOLERANCE if amp else
                                                    dict(rtol=RTOL, atol=atol)),
                               err_msg=f"{case}: logged losses")
