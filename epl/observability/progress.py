"""`ProgressHook`: training progress for MonitoredTrainingSession scripts.

A `tf.compat.v1.train.SessionRunHook` that prints (and optionally writes to
TensorBoard) what a user watches while a model trains, as numbers of the job
(every worker together):

    session ready after 4.1 s (graph rewrite and variable initialization); global batch 512
      (2 workers x 4 replicas x 64)
    step     1  loss 2.3026  (first step 1.52 s: warm-up, not counted in samples/s)
    step    20  loss 1.4121   13031 samples/s
    ...
    step   200  loss 0.3120   13512 samples/s
    done: 200 steps in 9.3 s (session start 4.1 s, first step 1.52 s, then 13400 samples/s);
      final loss 0.3120   (each of these is one line)

- Samples per step: `batch_size` is the script's batch (EPL's batch contract:
  one replica's micro-batch under the default `io.batch_mode: "replica"`,
  the worker's whole batch under "global"); the hook reads the replicas and
  micro-batches from the parallel graph once the session exists
  (`epl.observability.summary.JobBatch`). Or give `samples_per_step`, what
  one training run of this worker consumes. With several workers the job's
  samples per step are the sum of every worker's, exchanged once when the
  session is created (a Horovod all-gather: every worker needs a
  ProgressHook, as every worker already fetches the same tensors).
- samples/s is the job's; `per_worker=True` adds each worker's share
  ("(6500 per worker)"). Rank 0 prints (and writes TensorBoard), the others
  are quiet, as Horovod scripts print on rank 0; `all_ranks=True` (default:
  the config's `debug.log_all_ranks`) prints on every worker.
- The first step is printed at once; then every `every_n_steps` steps and
  the last step (`last_step`, StopAtStepHook's), whatever the interval.
- samples/s leaves out the warm-up: the session start (EPL's rewrite,
  initialization) and the first step (TensorFlow's graph optimization), and
  every run `debug.trace_dir` traced (a full trace slows its run several
  times); each line's rate covers the steps since the previous line, the end
  summary's every step after the first.
- The step is the global step when the session was created plus the number
  of runs since (one increment per run; reading the global step in the same
  run as the increment may see either value), or the number of runs when
  the graph has no global step.
- With `output_dir`, every printed step also writes the scalar summaries
  ``samples/sec``, ``global_step/sec`` and the fetched tensors, and the
  session's graph is written once after the session is created: the
  parallel graph (EPL rewrites the graph when the session is created), with
  constants over 1 KiB left out (the dataset a `from_tensor_slices` input
  holds; dtype and shape kept, as in `debug.dump_dir`'s dumps). Give
  MonitoredTrainingSession no `summary_dir` for the same directory: its
  StepCounterHook's writer, created before the rewrite, would add the
  single-device graph (with the dataset) as a second graph event, and
  TensorBoard's loaders disagree on which of two graphs they show. With
  ProgressHook's alone the directory holds one graph, the parallel one.

The tensors are fetched with every training run, so every worker fetches
the same tensors in the same runs (merged tensors such as the loss are
all-reduced across workers).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.core.util import event_pb2

from epl.env import get_config
from epl.hooks.record import record_of
from epl.observability.dump_format import elide_large_constants
from epl.observability.summary import JobBatch, job_batch
from epl.runtime.collective_check import exchange_bytes

# what the job's samples per step exchange waits for, named in its timeout's error
_EXCHANGE_WAIT = ("ProgressHook's exchange of every worker's samples per step (give every "
                  "worker a ProgressHook: each runs the same training loop)")


class _Window:
    """Steps and seconds since a mark, less the runs left out of the rate (traced)."""

    def __init__(self, step: int, now: float) -> None:
        self.step, self.start = step, now
        self.left_out_steps, self.left_out_s = 0, 0.0

    def leave_out(self, seconds: float) -> None:
        self.left_out_steps += 1
        self.left_out_s += seconds

    def rate(self, step: int, now: float, samples_per_step: float) -> float:
        steps = step - self.step - self.left_out_steps
        seconds = now - self.start - self.left_out_s
        return steps * samples_per_step / seconds if seconds > 0 and steps > 0 else float("nan")

    def steps_per_s(self, step: int, now: float) -> float:
        return self.rate(step, now, 1.0)


class ProgressHook(tf.compat.v1.train.SessionRunHook):
    """Prints the step, the fetched tensors and the job's samples/s (see the module doc).

    Args:
      samples_per_step: samples one training run of this worker consumes; or
        give `batch_size` instead.
      tensors: {label: tensor} fetched with each run and printed ("loss": loss).
      every_n_steps: print every N steps (and the first and last step).
      last_step: the last step of the run (StopAtStepHook's), printed whatever N is.
      output_dir: write samples/sec, global_step/sec, the tensors and the parallel
        graph for TensorBoard here (worker 0).
      print_fn: where lines go (default: print with flush).
      batch_size: the script's batch (EPL's batch contract); the hook counts the
        units of a step from the parallel graph.
      per_worker: also print each worker's share of samples/s.
      all_ranks: print on every worker (default: `debug.log_all_ranks`).

    After the run, `step` is the last step, `values` the last fetched values,
    `samples_per_step` the job's samples per step and `batch` its JobBatch
    (None when `samples_per_step` was given).
    """

    def __init__(self, samples_per_step: int | None = None, tensors: dict | None = None,
                 every_n_steps: int = 100, last_step: int | None = None,
                 output_dir: str | None = None,
                 print_fn: Callable[[str], None] | None = None, *,
                 batch_size: int | None = None, per_worker: bool = False,
                 all_ranks: bool | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if (samples_per_step is None) == (batch_size is None):
            raise ValueError("give ProgressHook one of samples_per_step (what one run of this "
                             "worker consumes) and batch_size (the script's batch), got "
                             f"samples_per_step={samples_per_step}, batch_size={batch_size}")
        self.worker_samples = samples_per_step
        self.batch_size = batch_size
        self.tensors = dict(tensors or {})
        self.every_n_steps = every_n_steps
        self.last_step = last_step
        self.output_dir = output_dir
        self.print_fn = print_fn or (lambda line: print(line, flush=True))
        self.per_worker = per_worker
        self.all_ranks = all_ranks
        self.step = 0
        self.values: dict = {}
        self.samples_per_step = float(samples_per_step or 0)
        self.batch: JobBatch | None = None
        self._rank, self._workers, self._prints, self._tracer = 0, 1, True, None
        self._writer = None
        self._global_step = None
        self._times: dict = {}
        self._window = self._steady = None
        self._runs = 0
        self._first = 0
        self._base = 0
        self._run_start = 0.0

    def begin(self) -> None:
        self._times = {"begin": time.perf_counter()}
        self._global_step = tf.compat.v1.train.get_global_step()
        self._runs = 0

    def after_create_session(self, session, coord) -> None:
        self._base = int(session.run(self._global_step)) if self._global_step is not None else 0
        self._job_numbers(session.graph)
        now = self._times["ready"] = time.perf_counter()
        batch = f"; global batch {self.batch.describe()}" if self.batch is not None else ""
        self._print(f"session ready after {now - self._times['begin']:.1f} s "
                    f"(graph rewrite and variable initialization){batch}")
        if self.output_dir and self._prints and self._rank == 0:
            # Its own event file, holding the parallel graph (the only graph event when
            # MonitoredTrainingSession gets no summary_dir for this directory).
            self._writer = tf.compat.v1.summary.FileWriter(self.output_dir,
                                                           filename_suffix=".progress")
            graph_def = session.graph.as_graph_def(add_shapes=True)
            elide_large_constants(graph_def)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(),
                                                   graph_def=graph_def.SerializeToString()))
            self._writer.flush()

    def _job_numbers(self, graph) -> None:
        """Workers, rank, the tracer and the job's samples per step, from the parallel graph."""
        record = record_of(graph, create=False)
        result = record.result if record is not None else None
        config = (record.config if record is not None else None) or get_config()
        if result is not None:
            self._rank, self._workers = result.cluster.worker_rank, result.cluster.num_workers
            self._tracer = result.tracer
        all_ranks = config.get("debug.log_all_ranks") if self.all_ranks is None else self.all_ranks
        self._prints = self._rank == 0 or bool(all_ranks)
        if self.batch_size is not None:
            counted = job_batch(result, config) if result is not None else \
                JobBatch(1, 1, 1, "replica", None)
            self.batch = dataclasses.replace(counted, batch=self.batch_size)
            self.worker_samples = self.batch.per_worker
        self.samples_per_step = float(self._sum_over_workers(self.worker_samples))

    def _sum_over_workers(self, samples: int) -> int:
        """The job's samples per step: every worker's, summed (one exchange)."""
        if self._workers == 1:
            return samples
        timeout = float(get_config().get("communication.collective_timeout_s"))
        values = exchange_bytes(str(int(samples)).encode(), timeout, _EXCHANGE_WAIT)
        return sum(int(value) for value in values)

    def before_run(self, run_context):
        self._run_start = time.perf_counter()
        return tf.compat.v1.train.SessionRunArgs(dict(self.tensors))

    def after_run(self, run_context, run_values) -> None:
        now = time.perf_counter()
        self._runs += 1
        self.step = self._base + self._runs
        self.values = dict(run_values.results)
        if self._runs == 1:
            self._times["first"] = now
            self._first = self.step
            self._window, self._steady = _Window(self.step, now), _Window(self.step, now)
            first = now - self._times["ready"]
            self._print(f"step {self.step:5d}  {self._format_values()}  (first step "
                        f"{first:.2f} s: warm-up, not counted in samples/s)")
            return
        traced = self._tracer is not None and self._tracer.last_run_traced
        if traced:
            for window in (self._window, self._steady):
                window.leave_out(now - self._run_start)
        if self.step % self.every_n_steps == 0 or self.step == self.last_step:
            rate = self._window.rate(self.step, now, self.samples_per_step)
            steps_per_s = self._window.steps_per_s(self.step, now)
            left_out = self._window.left_out_steps
            self._window = _Window(self.step, now)
            note = f"  ({left_out} traced run{'' if left_out == 1 else 's'} not counted)" \
                if left_out else ""
            self._print(f"step {self.step:5d}  {self._format_values()}  "
                        f"{self._rate_text(rate, 9)}{note}")
            self._summarize(rate, steps_per_s)

    def end(self, session) -> None:
        if "first" not in self._times:
            return
        now = time.perf_counter()
        times = self._times
        steady = self._steady.rate(self.step, now, self.samples_per_step)
        rate = f"then {self._rate_text(steady)}" if self._runs > 1 else "no steps after it"
        self._print(
            f"done: {self.step} steps in {now - times['begin']:.1f} s (session start "
            f"{times['ready'] - times['begin']:.1f} s, first step "
            f"{times['first'] - times['ready']:.2f} s, {rate}); final {self._format_values(', ')}")
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _print(self, line: str) -> None:
        if self._prints:
            self.print_fn(line)

    def _rate_text(self, rate: float, width: int = 0) -> str:
        """"13031 samples/s", with each worker's share when per_worker is set."""
        text = f"{rate:{width}.0f} samples/s"
        if self.per_worker and self._workers > 1:
            text += f" ({rate / self._workers:.0f} per worker)"
        return text

    def _format_values(self, separator: str = "  ") -> str:
        return separator.join(f"{label} {float(value):.4f}" for label, value in self.values.items())

    def _summarize(self, rate: float, steps_per_s: float) -> None:
        if self._writer is None:
            return
        values = [summary_pb2.Summary.Value(tag="samples/sec", simple_value=rate),
                  summary_pb2.Summary.Value(tag="global_step/sec", simple_value=steps_per_s)]
        values += [summary_pb2.Summary.Value(tag=label, simple_value=float(value))
                   for label, value in self.values.items()]
        self._writer.add_summary(summary_pb2.Summary(value=values), self.step)
