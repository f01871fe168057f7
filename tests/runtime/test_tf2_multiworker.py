"""TensorFlow 2 programs on 2 Horovod workers x 2 virtual devices (horovodrun, Gloo).

tests/workers/tf2_multiworker_worker.py: Keras 3 fit, and a tf.function step (also with
a split classifier, and a transformer with split embeddings and classifier) drawing
from an iterator, each worker on its half of every global batch; after 3 steps
every worker's variables equal single-device training on the whole global
batches. And tf-keras fit in graph mode (tests/workers/legacy_keras_multiworker_worker.py).
Fails, not skips, without Horovod.
"""
import json

import pytest

from conftest import NOISE_FACTOR
from multiworker import errors, horovodrun, require_horovod

pytestmark = pytest.mark.multiworker
require_horovod()


def test_two_workers_fit_and_custom_loop_match_single_device(tmp_path):
    result = horovodrun("tf2_multiworker_worker.py", str(tmp_path), timeout=400)
    assert result.returncode == 0, errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(record[mode] for mode in ("fit", "iterator", "split")) < 1e-5, record
        # split embeddings: each variable within the oracle's tolerance of its noise floor
        for i, (difference, floor) in enumerate(record["split_embedding"]):
            assert difference <= max(1e-5, NOISE_FACTOR * floor), (i, record)


def test_two_workers_legacy_keras_fit_matches_single_device(tmp_path):
    """tf-keras fit in graph mode (tests/workers/legacy_keras_multiworker_worker.py):
    every worker's weights and fit's logged loss (the job's: the mean over the global
    batch) equal the script without EPL on the whole global batches."""
    result = horovodrun("legacy_keras_multiworker_worker.py", str(tmp_path), timeout=400)
    assert result.returncode == 0, errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["weights"] < 1e-5 and record["loss"] < 1e-5, record
