"""What the multi-worker oracle scripts share (they run as scripts: this folder is on sys.path).

Each worker builds the same global batch, trains on its own rows of it, and
writes its record for the test to read.
"""
import json
import os

import numpy as np

import epl


def global_batch(sizes: list[int], classes: int, features: int = 6):
    """(features [sum(sizes), features], integer labels) of the whole global batch."""
    rng = np.random.RandomState(0)
    total = sum(sizes)
    return (rng.randn(total, features).astype(np.float32),
            rng.randint(0, classes, total).astype(np.int64))


def my_rows(sizes: list[int]) -> tuple[int, slice]:
    """(this worker's rank, its rows of the global batch); call after epl.init."""
    rank = epl.Cluster.current().worker_rank
    start = sum(sizes[:rank])
    return rank, slice(start, start + sizes[rank])


def write_record(out_dir: str, rank: int, record: dict) -> None:
    """The worker's results as OUT_DIR/rank<R>.json."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


STEP_BATCH = 8  # rows each worker feeds per step (checkpoint and restart scripts)


def step_batch(step: int, rank: int, rows: int = STEP_BATCH, classes: int = 3, features: int = 6):
    """The batch worker `rank` feeds at global step `step`: a pure function of both,
    so a job resumed from a checkpoint feeds what a job that never stopped would."""
    rng = np.random.RandomState(1000 * step + rank)
    return (rng.randn(rows, features).astype(np.float32),
            rng.randint(0, classes, rows).astype(np.int64))
