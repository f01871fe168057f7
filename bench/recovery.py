"""Recovery: time from a worker's death to the first training step after the restart,
against a fresh job's start-up.

Two workers (epl-launch on localhost, one device each) train
tests/workers/checkpoint_worker.py under MonitoredTrainingSession, with
checkpoints every 5 steps on rank 0. Two sides, measured in one run of this
script, `--repeats` times each:

- restart: `epl-launch --restarts 1`; worker 1 SIGKILLs itself at global step
  12; the launcher restarts the job, which resumes from the checkpoint of
  step 10. Its time runs from the kill (the worker prints its clock before
  killing itself) to the first step any worker finishes after the restart,
  split into
    detection   kill -> horovodrun reports the worker's exit,
    teardown    -> the failed attempt is over (epl-launch names the failed worker),
    start-up    -> the restarted workers begin to restore (processes, TensorFlow,
                   the graph, its rewrite, the collective check, the session),
    restore     -> the variables are restored and broadcast (EPL's restore event),
    first step  -> the first step after the restore is done;
- fresh: the same job started from nothing (no checkpoint, no kill): from the
  start of epl-launch to its first step.

    python bench/recovery.py [--repeats 3] [--quick]
Prints each side's parts, then:
recovery: restart / fresh start-up = X (median of N; restart R s, fresh F s)
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
_RESTORED = re.compile(r"^epl-launch: restart 1: resumed from global step \d+ \(.* in "
                       r"([\d.]+) s\)$")
JOB_TIMEOUT_S = 300
PARTS = ("detection", "teardown", "start-up", "restore", "first step")


def _launch(launch_args: list[str], worker_args: list[str]) -> tuple[int, list, float]:
    """Run one epl-launch job; return (exit code, [(arrival time, line)], start time)."""
    command = [EPL_LAUNCH, "-np", "2", "--timeout", "60", *launch_args, "--", sys.executable,
               WORKER, *worker_args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    deadline = start + JOB_TIMEOUT_S
    for line in proc.stdout:
        lines.append((time.time(), line.rstrip("\n")))
        if time.time() > deadline:
            proc.kill()
            break
    return proc.wait(), lines, start


def _fail(what: str, lines: list) -> None:
    raise SystemExit("recovery: %s:\n%s" % (what, "\n".join(line for _, line in lines)[-3000:]))


def _arrival(lines: list, pattern: str, what: str) -> tuple[float, re.Match]:
    for arrived, line in lines:
        match = re.search(pattern, line)
        if match:
            return arrived, match
    _fail(what, lines)


def restart(workdir: str) -> dict:
    """The parts of a restart (seconds), from the kill to the first step after it."""
    out, ckpt = os.path.join(workdir, "out"), os.path.join(workdir, "ckpt")
    os.makedirs(out)
    code, lines, _ = _launch(["--restarts", "1"], ["rank0", out, ckpt, str(KILL_AT)])
    if code != 0:
        _fail("the restarted job failed", lines)
    _, kill = _arrival(lines, _KILL.pattern, "the worker did not report its kill")
    killed = float(kill.group(1))
    detected, _ = _arrival(lines, r"^Process 1 exit with status code", "no exit report")
    torn_down, _ = _arrival(lines, r"^epl-launch: worker 1 failed", "no failure line")
    restored, match = _arrival(lines, _RESTORED.pattern, "no restore line")
    restore_s = float(match.group(1))
    steps = [float(t) for _, line in lines for step, t in _STEP.findall(line)
             if float(t) > restored - restore_s and int(step) <= RESUMED_AT]
    if not steps:
        _fail("no step finished after the restart", lines)
    first = min(steps)
    return {"detection": detected - killed, "teardown": torn_down - detected,
            "start-up": restored - restore_s - torn_down, "restore": restore_s,
            "first step": first - restored, "total": first - killed}


def fresh(workdir: str) -> float:
    """Seconds from the start of epl-launch to the first step of a job from scratch."""
    out, ckpt = os.path.join(workdir, "out"), os.path.join(workdir, "ckpt")
    os.makedirs(out)
    code, lines, start = _launch([], ["rank0", out, ckpt])
    if code != 0:
        _fail("the fresh job failed", lines)
    steps = [float(t) for _, line in lines for step, t in _STEP.findall(line) if int(step) == 0]
    if not steps:
        _fail("the fresh job ran no step", lines)
    return min(steps) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat (for the smoke test)")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    restarts, fresh_s = [], []
    for _ in range(repeats):
        for side in ("restart", "fresh"):
            workdir = tempfile.mkdtemp(prefix="epl-recovery-")
            try:
                if side == "restart":
                    parts = restart(workdir)
                    restarts.append(parts)
                    print("restart: %.2f s from the kill to the first step after the restart "
                          "(%s)" % (parts["total"], ", ".join(
                              "%s %.2f s" % (part, parts[part]) for part in PARTS)), flush=True)
                else:
                    fresh_s.append(fresh(workdir))
                    print("fresh: %.2f s from the start of epl-launch to the first step"
                          % fresh_s[-1], flush=True)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    medians = {part: statistics.median(p[part] for p in restarts) for part in PARTS + ("total",)}
    print("restart parts (medians): " + ", ".join("%s %.2f s" % (part, medians[part])
                                                   for part in PARTS))
    total, start = medians["total"], statistics.median(fresh_s)
    print("recovery: restart / fresh start-up = %.2f (median of %d; restart %.2f s, fresh "
          "%.2f s)" % (total / start, repeats, total, start))


if __name__ == "__main__":
    main()
