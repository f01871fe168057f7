"""`ProgressHook`: training progress for MonitoredTrainingSession scripts.

A `tf.compat.v1.train.SessionRunHook` that prints (and optionally writes to
TensorBoard) what a user watches while a model trains:

    session ready after 4.1 s (graph rewrite and variable initialization)
    step     1  loss 2.3026  (first step 1.52 s: warm-up, not counted in samples/s)
    step    20  loss 1.4121   13031 samples/s
    ...
    step   200  loss 0.3120   13512 samples/s
    done: 200 steps in 9.3 s (session start 4.1 s, first step 1.52 s, then 13400 samples/s);
      final loss 0.3120   (one line)

- The first step is printed at once; then every `every_n_steps` steps and
  the last step (`last_step`, StopAtStepHook's), whatever the interval.
- samples/s leaves out the warm-up: the session start (EPL's rewrite,
  initialization) and the first step (TensorFlow's graph optimization);
  each line's rate covers the steps since the previous line, and the end
  summary's covers every step after the first.
- The step is the global step when the session was created plus the number
  of runs since (one increment per run; reading the global step in the same
  run as the increment may see either value), or the number of runs when
  the graph has no global step.
- With `output_dir`, every printed step also writes the scalar summaries
  ``samples/sec`` and the fetched tensors, and the session's graph is
  written once after the session is created, which is the parallel graph
  (EPL rewrites the graph when the session is created). With
  ``MonitoredTrainingSession(summary_dir=output_dir, log_step_count_steps=N)``
  TensorFlow's own StepCounterHook adds ``global_step/sec`` to the same
  directory. TensorBoard shows the newest graph of a run: TensorFlow's
  summary writers created before the session (StepCounterHook's,
  CheckpointSaverHook's) write the single-device graph first, and the
  parallel graph written after it replaces it.

The tensors are fetched with every training run, so every worker fetches
the same tensors in the same runs (merged tensors such as the loss are
all-reduced across workers).
"""
from __future__ import annotations

import time
from typing import Callable

import tensorflow as tf
from tensorflow.core.framework import summary_pb2


class ProgressHook(tf.compat.v1.train.SessionRunHook):
    """Prints the step, the fetched tensors and samples/s (see the module doc).

    Args:
      samples_per_step: samples one training run consumes (for samples/s).
      tensors: {label: tensor} fetched with each run and printed ("loss": loss).
      every_n_steps: print every N steps (and the first and last step).
      last_step: the last step of the run (StopAtStepHook's), printed whatever N is.
      output_dir: write samples/sec, the tensors and the graph for TensorBoard here.
      print_fn: where lines go (default: print with flush).

    After the run, `step` is the last step and `values` the last fetched values.
    """

    def __init__(self, samples_per_step: int, tensors: dict | None = None,
                 every_n_steps: int = 100, last_step: int | None = None,
                 output_dir: str | None = None,
                 print_fn: Callable[[str], None] | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.samples_per_step = samples_per_step
        self.tensors = dict(tensors or {})
        self.every_n_steps = every_n_steps
        self.last_step = last_step
        self.output_dir = output_dir
        self.print_fn = print_fn or (lambda line: print(line, flush=True))
        self.step = 0
        self.values: dict = {}
        self._writer = None
        self._global_step = None
        self._times: dict = {}
        self._mark = (0, 0.0)  # (step, time) of the previous printed line after warm-up
        self._runs = 0
        self._first = 0
        self._base = 0

    def begin(self) -> None:
        self._times = {"begin": time.perf_counter()}
        self._global_step = tf.compat.v1.train.get_global_step()
        self._runs = 0

    def after_create_session(self, session, coord) -> None:
        self._base = int(session.run(self._global_step)) if self._global_step is not None else 0
        now = self._times["ready"] = time.perf_counter()
        self.print_fn(f"session ready after {now - self._times['begin']:.1f} s "
                      "(graph rewrite and variable initialization)")
        if self.output_dir:
            # Its own event file (TensorFlow's cached writers were created before the
            # rewrite, with the single-device graph); it sorts after theirs.
            self._writer = tf.compat.v1.summary.FileWriter(
                self.output_dir, graph=session.graph, filename_suffix=".progress")
            self._writer.flush()

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(dict(self.tensors))

    def after_run(self, run_context, run_values) -> None:
        now = time.perf_counter()
        self._runs += 1
        self.step = self._base + self._runs
        self.values = dict(run_values.results)
        if self._runs == 1:
            self._times["first"] = now
            self._first = self.step
            self._mark = (self.step, now)
            first = now - self._times["ready"]
            self.print_fn(f"step {self.step:5d}  {self._format_values()}  (first step "
                          f"{first:.2f} s: warm-up, not counted in samples/s)")
            return
        if self.step % self.every_n_steps == 0 or self.step == self.last_step:
            rate = self._rate(self._mark, (self.step, now))
            self._mark = (self.step, now)
            self.print_fn(f"step {self.step:5d}  {self._format_values()}  {rate:9.0f} samples/s")
            self._summarize(rate)

    def end(self, session) -> None:
        if "first" not in self._times:
            return
        now = time.perf_counter()
        times = self._times
        steady = self._rate((self._first, times["first"]), (self.step, now))
        rate = f"then {steady:.0f} samples/s" if self._runs > 1 else "no steps after it"
        self.print_fn(
            f"done: {self.step} steps in {now - times['begin']:.1f} s (session start "
            f"{times['ready'] - times['begin']:.1f} s, first step "
            f"{times['first'] - times['ready']:.2f} s, {rate}); final {self._format_values(', ')}")
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _rate(self, start: tuple, stop: tuple) -> float:
        steps, seconds = stop[0] - start[0], stop[1] - start[1]
        return steps * self.samples_per_step / seconds if seconds > 0 else float("nan")

    def _format_values(self, separator: str = "  ") -> str:
        return separator.join(f"{label} {float(value):.4f}" for label, value in self.values.items())

    def _summarize(self, rate: float) -> None:
        if self._writer is None:
            return
        values = [summary_pb2.Summary.Value(tag="samples/sec", simple_value=rate)]
        values += [summary_pb2.Summary.Value(tag=label, simple_value=float(value))
                   for label, value in self.values.items()]
        self._writer.add_summary(summary_pb2.Summary(value=values), self.step)
