"""Recovery: time from a worker's death to the first training step after the restart.

Two workers (epl-launch on localhost, one device each) train
tests/workers/checkpoint_worker.py under MonitoredTrainingSession, with
checkpoints every 5 steps on rank 0; worker 1 SIGKILLs itself at global step
12. Two sides, measured in one run of this script, `--repeats` times each:

- automatic: `epl-launch --restarts 1`: the launcher restarts the job, which
  resumes from the checkpoint of step 10;
- manual: `epl-launch` without restarts; the moment it exits, this script
  starts the same job again (a user who restarts at once, the best a manual
  restart can do).

Each side's time runs from the kill (the worker prints its clock before
killing itself) to the first step any worker finishes after the restart (the
workers print their clock after each step). Both start from the same
checkpoint and redo the same steps, so the difference is the restart itself.

    python bench/recovery.py [--repeats 3] [--quick]
Prints: recovery: automatic / manual restart time = X (median of N; automatic A s, manual M s)
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "..", "tests", "workers", "checkpoint_worker.py")
EPL_LAUNCH = os.path.join(os.path.dirname(sys.executable), "epl-launch")
KILL_AT = 12
RESUMED_AT = 10  # the last checkpoint before the kill (checkpoint_worker saves every 5 steps)
_KILL = re.compile(r"rank 1 kills itself at step %d ([\d.]+)" % KILL_AT)
_STEP = re.compile(r"rank \d step (\d+) ([\d.]+)")
JOB_TIMEOUT_S = 300


def _launch(launch_args: list[str], worker_args: list[str]) -> tuple[int, str]:
    """Run one epl-launch job; return (exit code, output)."""
    command = [EPL_LAUNCH, "-np", "2", "--timeout", "60", *launch_args, "--", sys.executable,
               WORKER, *worker_args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, timeout=JOB_TIMEOUT_S)
    return result.returncode, result.stdout


def _kill_time(output: str) -> float:
    match = _KILL.search(output)
    if match is None:
        raise SystemExit("recovery: the worker did not report its kill:\n" + output[-3000:])
    return float(match.group(1))


def _first_step_after(output: str, since: float) -> float:
    """Clock of the first step of the restarted job: the step of the checkpoint it
    resumes from, finished after `since` (the kill); steps the other worker
    finished just before it was stopped are later steps and do not count."""
    times = [float(t) for step, t in _STEP.findall(output)
             if float(t) > since and int(step) <= RESUMED_AT]
    if not times:
        raise SystemExit("recovery: no step finished after the restart:\n" + output[-3000:])
    return min(times)


def automatic(workdir: str) -> float:
    """Seconds from the kill to the first step after epl-launch --restarts restarted the job."""
    out, ckpt = os.path.join(workdir, "out"), os.path.join(workdir, "ckpt")
    os.makedirs(out)
    code, output = _launch(["--restarts", "1"], ["rank0", out, ckpt, str(KILL_AT)])
    if code != 0:
        raise SystemExit("recovery: the restarted job failed:\n" + output[-3000:])
    killed = _kill_time(output)
    return _first_step_after(output, killed) - killed


def manual(workdir: str) -> float:
    """Seconds from the kill to the first step of the same job started again at once."""
    out, ckpt = os.path.join(workdir, "out"), os.path.join(workdir, "ckpt")
    os.makedirs(out)
    code, first = _launch([], ["rank0", out, ckpt, str(KILL_AT)])
    if code == 0:
        raise SystemExit("recovery: the job was not killed:\n" + first[-3000:])
    killed = _kill_time(first)
    code, second = _launch([], ["rank0", out, ckpt])
    if code != 0:
        raise SystemExit("recovery: the restarted job failed:\n" + second[-3000:])
    return _first_step_after(second, killed) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat (for the smoke test)")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    times = {"automatic": [], "manual": []}
    for _ in range(repeats):
        for side, measure in (("automatic", automatic), ("manual", manual)):
            workdir = tempfile.mkdtemp(prefix="epl-recovery-")
            try:
                times[side].append(measure(workdir))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            print("%s: %.2f s from the kill to the first step after the restart"
                  % (side, times[side][-1]), flush=True)
    auto, hand = statistics.median(times["automatic"]), statistics.median(times["manual"])
    print("recovery: automatic / manual restart time = %.2f (median of %d; automatic %.2f s, "
          "manual %.2f s)" % (auto / hand, repeats, auto, hand))


if __name__ == "__main__":
    main()
