"""Multi-worker data parallelism under horovodrun (Gloo on localhost).

These tests need Horovod (built by `make setup`); they fail, not skip, when it
is missing. Each job is 2 workers (x 1 or 2 virtual CPU devices), started
through tests/multiworker.py, which kills a job that overruns its timeout so
a hang fails the test instead of stalling CI.
"""
import json
import re

import numpy as np
import pytest

from multiworker import assert_matches_plain, errors, horovodrun, require_horovod, worker_module

pytestmark = pytest.mark.multiworker
require_horovod()


def _horovodrun(script: str, *args: str, timeout: int = 180):
    """2 workers on SCRIPT (kept for the tests of other modules that import it)."""
    return horovodrun(script, *args, timeout=timeout)


_errors = errors


@pytest.mark.parametrize("optimizer,sizes,mode", [
    ("sgd", "8,8", "replica"), ("adam", "8,8", "replica"), ("adam", "12,4", "replica"),
    ("adam", "8,8", "global"), ("adam", "12,4", "global")])
def test_two_workers_match_single_device(tmp_path, optimizer, sizes, mode):
    """io.batch_mode "replica": each worker's script batch is one replica's (half of its
    rows; "12,4": workers with different batch sizes); "global": the worker's rows, sliced."""
    result = _horovodrun("oracle_worker.py", optimizer, sizes, str(tmp_path), mode)
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        np.testing.assert_allclose(record["losses"], record["ref_losses"], rtol=1e-5)
        assert max(record["errors"]) < 1e-5


def test_initial_values_broadcast_from_worker_0(tmp_path):
    result = _horovodrun("broadcast_worker.py", str(tmp_path))
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    rank0, rank1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    np.testing.assert_array_equal(rank0["initial"], rank1["initial"])
    np.testing.assert_allclose(rank0["after"], rank1["after"], rtol=1e-6)
    assert not np.allclose(rank0["initial"], rank0["after"])


@pytest.mark.parametrize("mode,expected", [
    ("extra_layer", "collectives differ between workers: collective #3 is the broadcast of w2 "
                    "(HorovodBroadcast 'EPL_SYNC/broadcast_4.w2' float32 [4, 1]) on worker 0 but "
                    "the broadcast of extra (HorovodBroadcast 'EPL_SYNC/broadcast_4.extra' "
                    "float32 [4, 4]) on worker 1"),
    ("shape", "collectives differ between workers: collective #2 is the broadcast of w1 "
              "(HorovodBroadcast 'EPL_SYNC/broadcast_3.w1' float32 [3, 4]) on worker 0 but the "
              "broadcast of w1 (HorovodBroadcast 'EPL_SYNC/broadcast_3.w1' float32 [3, 6]) on "
              "worker 1"),
    ("fetch", "workers 0 and 1 run different cross-worker collectives in the same session.run: "
              "worker 0 fetches [Mean:0, GradientDescent], worker 1 fetches [GradientDescent]; "
              "fetched on worker 0 only: Mean:0; collectives on worker 0 only: the all-reduce of "
              "Mean:0 ('EPL_MERGED/allreduce_2.Mean_0'). Every worker must fetch the tensors "
              "merged over workers (the loss, EPL's merge collections) and the training ops in "
              "the same runs; fetches that need no collective (a hook's global step) may differ"),
])
def test_workers_with_different_graphs_fail_clearly(mode, expected):
    result = _horovodrun("mismatch_worker.py", mode, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "trained" not in out
    for rank in (0, 1):
        assert f"EPL-ERROR rank {rank}: {expected}" in out, _errors(out)


_SAME_CONFIG = ("Every worker must use the same config (the same epl.Config dict and EPL_* "
                "environment variables); only cluster.virtual_devices, cluster.run_visible_devices, "
                "cluster.device_profiles, communication.collective_timeout_s and debug.* may differ")


@pytest.mark.parametrize("args,expected", [
    (["config", "pipeline.num_micro_batch=2"],
     "workers run with different configs: worker 1 has pipeline.num_micro_batch 2, worker 0 has "
     "1. " + _SAME_CONFIG),
    (["config", 'amp.level="O1",io.batch_mode="global",communication.fusion_threshold_mb=64'],
     'workers run with different configs: worker 1 has amp.level "O1", worker 0 has ""; worker '
     "1 has communication.fusion_threshold_mb 64.0, worker 0 has 1e-06; worker 1 has "
     'io.batch_mode "global", worker 0 has "replica". ' + _SAME_CONFIG),
    (["version"], "workers run different EPL versions: worker 1 runs EPL 0.0.9, worker 0 runs "
                  "EPL 0.1.0; install the same EPL on every host"),
])
def test_workers_with_different_configs_or_versions_stop_before_step_0(args, expected):
    """A config key (or several) set on worker 1 only, or another EPL version: every
    worker stops when the graph is built, naming the keys and both values."""
    result = _horovodrun("mismatch_worker.py", *args, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "trained" not in out
    for rank in (0, 1):
        assert f"EPL-ERROR rank {rank}: {expected}" in out, _errors(out)


@pytest.mark.parametrize("optimizer,sizes", [("sgd", "8,8"), ("adam", "12,4")])
def test_split_taskgraph_with_two_workers_matches_single_device(tmp_path, optimizer, sizes):
    """epl.split(2) over each worker's devices, data-parallel across the 2 workers."""
    result = _horovodrun("split_worker.py", optimizer, sizes, str(tmp_path))
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        np.testing.assert_allclose(record["losses"], record["ref_losses"], rtol=1e-5)
        assert max(record["errors"].values()) < 1e-5, record["errors"]


@pytest.mark.parametrize("optimizer,sizes", [("sgd", "8,8"), ("adam", "12,4")])
def test_split_group_spanning_two_workers_matches_single_device(tmp_path, optimizer, sizes):
    """epl.split(4) over 2 workers x 2 devices: each worker holds half of the classifier."""
    result = _horovodrun("split_worker.py", optimizer, sizes, str(tmp_path), "4")
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        np.testing.assert_allclose(record["losses"], record["ref_losses"], rtol=1e-5)
        assert max(record["errors"].values()) < 1e-5, record["errors"]
        assert record["held"]["classifier/kernel"] == 0.5
        if optimizer == "adam":
            assert record["held"]["classifier/kernel/Adam"] == 0.5
        assert record["held"]["body/kernel"] == 1.0


def test_split_group_spanning_workers_must_compute_the_loss(tmp_path):
    result = _horovodrun("split_worker.py", "sgd", "8,8", str(tmp_path), "4", "loss-outside",
                         timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for rank in (0, 1):
        assert (f"EPL-ERROR rank {rank}: pass 'split' failed (passes run before it: none): "
                "epl.split over 4 devices spans several workers, and classifier/add:0 (sharded) "
                "is read where the whole tensor is needed, so it would have to be gathered "
                "whole") in out, _errors(out)


@pytest.mark.parametrize("mode", ["rank0", "every"])
def test_checkpoints_kill_at_step_12_and_resume_from_10_match_plain_tensorflow(tmp_path, mode,
                                                                              report):
    """MonitoredTrainingSession with a checkpoint_dir on rank 0 only (Horovod's convention:
    the restore reaches the other worker through EPL's broadcast) or on every rank;
    worker 1 is SIGKILLed at global step 12; the job started again resumes from the
    checkpoint of step 10 and ends at step 20 with the variables of plain TensorFlow
    trained 20 steps on the same data (and of plain TensorFlow resumed from that
    checkpoint)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    killed = horovodrun("checkpoint_worker.py", mode, str(out), str(ckpt), "12")
    assert killed.returncode != 0, errors(killed.stdout)
    assert "rank 1 kills itself at step 12" in killed.stdout, errors(killed.stdout)
    assert not list(out.iterdir())  # nobody finished
    resumed = horovodrun("checkpoint_worker.py", mode, str(out), str(ckpt))
    assert resumed.returncode == 0, errors(resumed.stdout)
    common = worker_module("common")

    def batches(step):
        return [common.step_batch(step, rank) for rank in (0, 1)]

    saved = ckpt if mode == "rank0" else ckpt / "rank0"
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["start"] == 10 and record["steps"] == list(range(10, 20)), record["steps"]
        worst = assert_matches_plain(record["variables"], batches, 0, 20)
        report(f"checkpoint {mode}, rank {rank}: kill at 12, resume from 10 vs plain TF 20 "
               f"steps: largest difference {worst:.2f} x the noise-floor tolerance")
        assert_matches_plain(record["variables"], batches, 10, 20, str(saved / "model.ckpt-10"))


def test_moving_statistics_metrics_and_zero_clipping_across_two_workers(tmp_path):
    """2 workers x 2 replicas: batch norm's moving statistics follow their rule over the
    job's 4 units and are the same on both workers; tf.compat.v1.metrics (update ops in
    GLOBAL_MEAN_OBJECTS, value ops) are the job's global batch's; ZeRO with BERT's
    optimizer (clip_by_global_norm, assign ops) equals single-device training."""
    result = _horovodrun("consistency_worker.py", str(tmp_path), timeout=240)
    assert result.returncode == 0, _errors(result.stdout + result.stderr)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        reference = record["reference"]
        for rule in ("replica0", "mean"):
            run, expected = record[rule], record[f"{rule}_expected"]
            for key in ("moving_mean", "moving_variance"):
                np.testing.assert_allclose(run[key], expected[key], rtol=1e-5, err_msg=key)
                np.testing.assert_allclose(run[key], records[0][rule][key], rtol=0, atol=0)
            np.testing.assert_allclose(run["updates"], reference["updates"], rtol=1e-5)
            np.testing.assert_allclose(run["values"], reference["values"], rtol=1e-5)
        np.testing.assert_allclose(record["mean"]["moving_mean"], reference["moving_mean"],
                                   rtol=1e-5)
        zero, plain = record["zero"], record["zero_reference"]
        np.testing.assert_allclose(zero["losses"], plain["losses"], rtol=1e-5)
        for name, value in plain["variables"].items():
            np.testing.assert_allclose(zero["variables"][name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
