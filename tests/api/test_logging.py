"""EPL's logging: the "epl" logger hierarchy, debug.log_level, and the parallel-graph summary."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import epl
from epl.observability import logs
from epl.errors import ConfigError


class _Records(logging.Handler):
    """Collects the records of one logger (whatever its propagation)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture()
def epl_records():
    """The records the "epl" logger gets at INFO during the test; its state restored after."""
    logger = logging.getLogger("epl")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    handler = _Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.handlers[:] = saved[2]
    logger.setLevel(saved[0])
    logger.propagate = saved[1]


def test_every_module_logs_under_epl():
    """Every module is inside the package, so logging.getLogger(__name__) is under "epl"."""
    from epl.passes import amp
    from epl.passes.split import rewriter
    assert amp._LOG.name == "epl.passes.amp" and rewriter._LOG.name == "epl.passes.split.rewriter"
    root = logging.getLogger("epl")
    assert amp._LOG.parent in (root, logging.getLogger("epl.passes"))


def _pipeline_summary(epl_env, records) -> list[str]:
    """Parallelize a 2-stage model on 4 devices with 2 micro-batches; return the summary lines."""
    epl_env({"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2})
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        x = tf.constant(rng.rand(16, 8).astype(np.float32))
        y = tf.constant(rng.rand(16, 1).astype(np.float32))
        with epl.replicate(device_count=1, name="stage_0"):
            hidden = tf.compat.v1.layers.dense(x, 16, name="hidden")
        with epl.replicate(device_count=1, name="stage_1"):
            loss = tf.reduce_mean((tf.compat.v1.layers.dense(hidden, 1, name="out") - y) ** 2)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        epl.parallelize(graph)
    [record] = [r for r in records if r.name == "epl.parallel"]
    assert record.levelno == logging.INFO
    return record.getMessage().splitlines()


def test_parallelize_logs_a_summary_at_info(epl_env, epl_records):
    lines = _pipeline_summary(epl_env, epl_records)
    assert re.fullmatch(r"parallel graph ready in \d+\.\d\d s \(1 worker, 4 local CPU"
                        r" devices\)", lines[0]), lines[0]
    assert lines[1:6] == [
        # the constant batch of 16 is each unit's: 2 replicas x 2 micro-batches of 16
        "  global batch per step: 64 (2 replicas x 2 micro-batches x 16)",
        "  2 replicas x 2 stages (stage_0, stage_1), 2 micro-batches per step, schedule"
        " PreferBackward, batch shares even",
        "  replica 0: CPU:0, CPU:1 | replica 1: CPU:2, CPU:3",
        "  split groups: none",
        # one all-reduce per stage of that stage's fused gradients, summed on one CPU
        # device (communication.local_reduction "auto") over both replicas' buckets:
        # stage 0: 2 x (8x16 + 16 floats = 576 B), stage 1: 2 x (16 + 1 floats = 68 B)
        "  collectives per step: 2 (1.3 KiB): AddN (all-reduce on one device) 2 (1.3 KiB)"]
    # the slowest pass always, up to four more taking 5 ms or more, then the rest
    assert re.fullmatch(r"  passes: ([a-z_]+ \d+\.\d\d s, ){1,5}others \d+\.\d\d s", lines[6]), \
        lines[6]
    assert len(lines) == 7


def test_no_summary_is_built_below_info(epl_env, epl_records):
    logging.getLogger("epl").setLevel(logging.WARNING)
    epl_env({"cluster.virtual_devices": 2})
    with tf.Graph().as_default() as graph:
        with epl.replicate(device_count=1):
            loss = tf.reduce_mean(tf.compat.v1.layers.dense(tf.ones([4, 2]), 1))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        epl.parallelize(graph)
    assert not epl_records


def test_debug_log_level_attaches_one_handler(epl_env, epl_records, capsys, monkeypatch):
    logger = logging.getLogger("epl")
    epl_env({"debug.log_level": "info"})
    epl_env({"debug.log_level": "DEBUG"})
    assert len([h for h in logger.handlers if isinstance(h, logs._EPLHandler)]) == 1
    assert logger.level == logging.DEBUG and logger.propagate
    monkeypatch.setattr(logging.getLogger(), "handlers", [])   # an unconfigured application
    logging.getLogger("epl.test").info("hello %s", "there")
    assert capsys.readouterr().err.endswith(" EPL INFO epl.test: hello there\n")
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    logging.getLogger("epl.test").info("quiet")   # the application's handlers print it
    assert capsys.readouterr().err == ""


def test_bad_log_level_is_a_clear_error(epl_env):
    with pytest.raises(ConfigError) as error:
        epl_env({"debug.log_level": "LOUD"})
    assert str(error.value) == ("Invalid value 'LOUD' for config key 'debug.log_level':"
                                " expected one of ['', 'DEBUG', 'INFO', 'WARNING', 'ERROR'].")
    with pytest.raises(ConfigError) as error:
        logs.configure("LOUD")
    assert str(error.value) == ("debug.log_level must be one of DEBUG, INFO, WARNING, ERROR"
                                " or '', got 'LOUD'")


def test_job_batch_is_workers_x_replicas_x_micro_batches_x_batch():
    from epl.observability.summary import JobBatch
    job = JobBatch(workers=2, replicas=2, micro_batches=4, batch_mode="replica", batch=8)
    assert (job.units_per_worker, job.per_worker, job.global_batch) == (8, 64, 128)
    assert job.describe() == "128 (2 workers x 2 replicas x 4 micro-batches x 8)"
    assert JobBatch(1, 4, 1, "replica", 64).describe() == "256 (4 replicas x 64)"
    assert JobBatch(1, 4, 1, "replica", None).describe() == "? (4 replicas x the script's batch)"
    sliced = JobBatch(2, 4, 1, "global", 64)
    assert (sliced.per_worker, sliced.global_batch) == (64, 128)
    assert sliced.describe() == ("128 (2 workers x 64, each cut into 4 replicas; "
                                 "io.batch_mode 'global')")


def test_summary_of_several_workers_is_the_jobs_and_printed_by_worker_0():
    from epl.observability.summary import (CollectiveTotals, JobBatch, ParallelSummary,
                                           format_summary, prints_here)
    from epl.runtime.cluster import Cluster
    summary = ParallelSummary(1, 2, "CPU", 2, 2, ["replicate_0"], 1, "", (0.5, 0.5),
                              [["CPU:0"], ["CPU:1"]], [], CollectiveTotals(), CollectiveTotals(),
                              0.5, {"replicate": 0.4}, JobBatch(2, 2, 1, "replica", 64),
                              "/tmp/d/rank_1")
    lines = format_summary(summary)
    assert lines[:3] == ["parallel graph ready in 0.50 s (2 workers x 2 local CPU devices)",
                         "  global batch per step: 256 (2 workers x 2 replicas x 64)",
                         "  2 replicas x 1 stage on each worker, 1 micro-batch per step, "
                         "batch shares even"]
    assert "  collectives per step (each worker): none" in lines
    assert lines[-1] == "  dump of every pass: /tmp/d/rank_1 (epl-dump /tmp/d/rank_1)"
    quiet, loud = epl.Config(), epl.Config({"debug.log_all_ranks": True})
    assert prints_here(Cluster("CPU", 2, 0, 2), quiet)
    assert not prints_here(Cluster("CPU", 2, 1, 2), quiet)
    assert prints_here(Cluster("CPU", 2, 1, 2), loud)
