"""Job-level output under several workers (issue 28, item 1): examples/train_mlp.py on 2
workers of 2 virtual devices under horovodrun. Worker 0 prints the summary and the
progress for the job (global batch 2 workers x 2 replicas x 64 = 256); worker 1 is quiet.
"""
from __future__ import annotations

import os
import re

import pytest

from multiworker import errors, horovodrun, require_horovod
from paths import EXAMPLES

pytestmark = pytest.mark.multiworker
require_horovod()


def test_rank_0_prints_the_jobs_numbers_for_two_workers():
    job = horovodrun(os.path.join(EXAMPLES, "train_mlp.py"), "--steps", "6", "--log-every", "3",
                     env={"EPL_CLUSTER_VIRTUAL_DEVICES": "2"}, timeout=240)
    assert job.returncode == 0, errors(job.stdout)
    rank0 = [line.split(">:", 1)[1] for line in job.text if line.startswith("[0]<")]
    rank1 = [line.split(">:", 1)[1] for line in job.text if line.startswith("[1]<")]
    assert "train_mlp: 6 steps, global batch 256 (2 workers x 2 replicas x 64); building the " \
           "graph" in rank0
    [ready] = [line for line in rank0 if "parallel graph ready" in line]
    assert re.search(r"parallel graph ready in \d+\.\d\d s \(2 workers x 2 local CPU devices\)$",
                     ready), ready
    assert "  global batch per step: 256 (2 workers x 2 replicas x 64)" in rank0
    [session] = [line for line in rank0 if line.startswith("session ready")]
    assert session.endswith("; global batch 256 (2 workers x 2 replicas x 64)"), session
    steps = [int(m.group(1)) for m in (re.match(r"step +(\d+)  loss \d+\.\d{4}", line)
                                       for line in rank0) if m]
    assert steps == [1, 3, 6]
    assert sum("samples/s" in line for line in rank0) == 4   # first step, 3, 6, done
    quiet = [line for line in rank1 if any(word in line for word in (
        "samples/s", "parallel graph ready", "session ready", "global batch", "train_mlp:"))]
    assert quiet == []
