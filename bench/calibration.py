"""Calibration of the planner: predicted against measured step time, per example.

    python bench/calibration.py            # every example, 3 runs each
    python bench/calibration.py --runs 5 --only m6_mini

Each example under examples/ is captured as `epl-plan --script` captures it
(`epl.capture`), planned on its virtual CPU devices
with the measured CPU profile (`epl.planner.profiles.virtual_cpu_profiles`), and run
as a subprocess with small settings; its step time is read from its
"samples/s" lines (the first interval, with the warm-up, left out).  Each
example runs `--runs` times; the measured step time is the median over the
runs of each run's median.  One line per example:

    ratio predicted/measured [<example>, <n> virtual CPU devices, batch <b>]: <r>
      (predicted <p> ms, measured <m> ms; target 0.7-1.3)

Target: every ratio within 0.7-1.3 (the planner within 30% of the measured
step).  These small steps are dominated by TensorFlow's fixed and per-op
costs, which the cost model takes from the CPU profile's micro-benchmark
(`epl.planner.calibration.calibrate_cpu_profile`: a step's fixed cost, per-op cost,
costly-kernel cost, FLOP rate and optimizer rate fitted on reference
training steps that are none of the examples, the local collectives'
latency and bandwidth, the input reads, and the sync time each
data-parallel replica beyond the first adds on the shared cores,
`replica_sync_s`); the CPU profile is
measured in this process before each run (the prediction and the
measurement are medians over the runs), since a shared machine's load
moves both.  The figures are in docs/planner.md ("Planner calibration"); the last line
counts the examples inside and outside the target.
No unit test asserts these ratios (measured times): they are this bench's
figures.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from epl.planner.graph_model import model_from_graph  # noqa: E402
from epl.planner.planner import PlanOptions, plan_cluster  # noqa: E402
from epl.planner.profiles import HostSpec, cpu_profile, virtual_cpu_profiles  # noqa: E402
import epl  # noqa: E402

EXAMPLES_DIR = os.path.join(ROOT, "examples")
#: predicted/measured within this range meets the target.
TARGET = (0.7, 1.3)


@dataclasses.dataclass(frozen=True)
class Example:
    """One example to calibrate on: script name, its arguments, the global
    batch of a step (the examples' --batch is one replica's micro-batch, EPL's
    contract) and the virtual devices it runs on."""

    script: str
    argv: tuple[str, ...]
    batch: int
    devices: int


EXAMPLES = (
    Example("train_mlp", ("--steps", "60", "--log-every", "10"), 256, 4),
    Example("large_classifier", ("--steps", "24", "--classes", "20000",
                                 "--batch", "8", "--log-every", "4"), 32, 4),
    Example("m6_mini", ("--steps", "24", "--batch", "4", "--log-every", "4"),
            16, 4),
    Example("bert_pipeline", ("--steps", "30", "--log-every", "5"), 32, 2),
)


def script_path(example: Example) -> str:
    """The example's file."""
    return os.path.join(EXAMPLES_DIR, f"{example.script}.py")


def measured_step_time(example: Example) -> float:
    """Median seconds per step of one run of the example, from its
    "samples/s" lines (the first interval, with the warm-up, left out).

    Raises:
        RuntimeError: the example failed or printed fewer than 3 rates.
    """
    result = subprocess.run([sys.executable, script_path(example),
                             *example.argv], capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{example.script} failed:\n{result.stderr[-3000:]}")
    rates = [float(v) for v in
             re.findall(r"(\d+(?:\.\d+)?) samples/s", result.stdout)]
    if len(rates) < 3:
        raise RuntimeError(f"{example.script} printed {len(rates)} samples/s "
                           f"line(s), need 3:\n{result.stdout[-3000:]}")
    return statistics.median(example.batch / rate for rate in rates[1:])


def captured_model(example: Example):
    """(ModelSpec, num_micro_batch) of the example, captured as `epl-plan
    --script` captures it."""
    with contextlib.redirect_stdout(io.StringIO()):  # the script's own lines
        captured = epl.capture(script_path(example), list(example.argv))
    return (model_from_graph(captured.graph, name=example.script, record=captured.record),
            captured.config.get("pipeline.num_micro_batch"))


def predicted_step_time(example: Example, captured=None) -> float:
    """The planner's step time for the example's strategy on its virtual
    CPU devices with the CPU profile measured now (`cpu_profile` is
    re-measured): identical devices, so the even data-parallel split, or
    the pipeline a model with annotated stages builds.  `captured`: the
    example's `captured_model`, captured here when None."""
    model, micro = captured or captured_model(example)
    cpu_profile.cache_clear()
    hosts = [HostSpec(virtual_cpu_profiles(example.devices)[0],
                      example.devices)]
    plan = plan_cluster(model, hosts, global_batch=example.batch,
                        options=PlanOptions(num_micro_batch=micro))
    name = f"pipeline, {model.stages} stages" if model.stages > 1 \
        else "data-parallel, even split"
    return plan.alternative(name).step_time


def calibrate(example: Example, runs: int) -> tuple[float, float]:
    """(predicted, measured) seconds per step, each the median over `runs`
    rounds of a prediction with the CPU profile measured just before and a
    run of the example: on a shared machine the load moves within
    minutes, and each prediction is made under the load its run sees."""
    captured = captured_model(example)
    predicted, measured = [], []
    for _ in range(runs):
        predicted.append(predicted_step_time(example, captured))
        measured.append(measured_step_time(example))
    return statistics.median(predicted), statistics.median(measured)


def ratio_line(example: Example, predicted: float, measured: float) -> str:
    """The bench's line for one example."""
    return (f"ratio predicted/measured [{example.script}, {example.devices} "
            f"virtual CPU devices, batch {example.batch}]: "
            f"{predicted / measured:.3f} (predicted {predicted * 1e3:.2f} ms, "
            f"measured {measured * 1e3:.2f} ms; target "
            f"{TARGET[0]}-{TARGET[1]})")


def main(argv: list[str] | None = None) -> int:
    """Print one ratio line per example and the count inside the target;
    returns 0 (the target is reported, not enforced)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3,
                        help="runs per example (median of their medians)")
    parser.add_argument("--only", action="append", default=[],
                        help="calibrate only this example (repeatable)")
    args = parser.parse_args(argv)
    chosen = [e for e in EXAMPLES if not args.only or e.script in args.only]
    inside = 0
    for example in chosen:
        predicted, measured = calibrate(example, args.runs)
        print(ratio_line(example, predicted, measured), flush=True)
        inside += TARGET[0] <= predicted / measured <= TARGET[1]
    print(f"{inside} of {len(chosen)} examples within the target "
          f"{TARGET[0]}-{TARGET[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
