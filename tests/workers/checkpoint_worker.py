"""Worker script: MonitoredTrainingSession with checkpoints, killed and resumed (under horovodrun).

Every worker trains oracle_worker's MLP (Adam, global step) for STEPS steps
under MonitoredTrainingSession; the batch of each step is a function of the
global step and the rank (`common.step_batch`), so a job resumed from a
checkpoint feeds the same data as one that never stopped.

MODE says who checkpoints (CheckpointSaverHook, every 5 steps):
  rank0  only rank 0 gets a checkpoint_dir (Horovod's convention); the other
         workers get worker 0's values through EPL's broadcast after a restore;
  every  every worker gets its own checkpoint_dir (CKPT_DIR/rank<r>).

KILL_AT (optional): rank KILL_RANK (default 1) SIGKILLs itself when the global
step reaches KILL_AT, before running that step; only in a job that started
from step 0 (a restarted job goes on), unless WHEN is "always".

Each worker writes OUT_DIR/rank<r>.json: the global step it started from, the
steps and losses it ran, and its variables at the end.

Each worker prints "rank R step S <time>" after each step (for bench/recovery.py).

SAVE_FAULT=KIND@STEP[@MARKER] (environment): after global step STEP, rank 0
breaks its next save: "quota" (no file of the process may grow past 100
bytes: RLIMIT_FSIZE, a quota that runs out), "full" (a filler file takes all
the space left on CKPT_DIR's filesystem: meant for a tiny one) or "rmdir"
(CKPT_DIR is removed). With MARKER, only while that file does not exist (it is
created), so that a restarted job saves again.

usage: checkpoint_worker.py MODE OUT_DIR CKPT_DIR [KILL_AT [KILL_RANK [WHEN]]]
"""
import json
import os
import resource
import shutil
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import epl
from common import STEP_BATCH, step_batch
from epl import env
from oracle_worker import build

STEPS = 20
SAVE_EVERY = 5


def checkpoint_dir(mode: str, root: str, rank: int):
    """The checkpoint_dir worker `rank` gives MonitoredTrainingSession (None: none)."""
    if mode == "rank0":
        return root if rank == 0 else None
    if mode == "every":
        return os.path.join(root, f"rank{rank}")
    raise ValueError(f"unknown MODE {mode!r}: rank0 or every")


class _ReadAtEnd(tf.compat.v1.train.SessionRunHook):
    """Records the variables' values when the session ends (after the last step)."""

    def __init__(self, variables, record):
        self.variables, self.record = variables, record

    def end(self, session):
        self.record["variables"] = {v.op.name: np.asarray(value).tolist() for v, value
                                    in zip(self.variables, session.run(self.variables))}


class _BreakNextSave(tf.compat.v1.train.SessionRunHook):
    """SAVE_FAULT: after global step `step`, make the next save fail (see the docstring)."""

    def __init__(self, global_step, root: str):
        kind, step, *marker = os.environ["SAVE_FAULT"].split("@")
        self.global_step, self.root, self.kind, self.step = global_step, root, kind, int(step)
        self.marker = marker[0] if marker else None

    def after_run(self, run_context, run_values):
        if int(run_context.session.run(self.global_step)) != self.step:
            return
        if self.marker:
            if os.path.exists(self.marker):
                return
            open(self.marker, "w").close()
        print(f"rank 0 breaks its next save ({self.kind}) {time.time():.3f}", flush=True)
        if self.kind == "quota":
            resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
        elif self.kind == "rmdir":
            shutil.rmtree(self.root)
        elif self.kind == "full":
            with open(os.path.join(self.root, "filler"), "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:  # no space left on the device
                    pass


def main():
    mode, out_dir, root = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    kill_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    always = len(sys.argv) > 6 and sys.argv[6] == "always"
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 1, "communication.collective_timeout_s": 60}))
    rank = epl.Cluster.current().worker_rank
    record = {"rank": rank, "steps": [], "losses": []}
    with tf.Graph().as_default():
        x, y, loss, train_op, variables = build(STEP_BATCH, True, "adam")
        global_step = variables[-1]
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=STEPS), _ReadAtEnd(variables, record)]
        if os.environ.get("SAVE_FAULT") and rank == 0:
            hooks.append(_BreakNextSave(global_step, checkpoint_dir(mode, root, rank)))
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir(mode, root, rank), save_checkpoint_steps=SAVE_EVERY,
                save_summaries_steps=None, save_summaries_secs=None, hooks=hooks) as sess:
            record["start"] = int(sess.run(global_step))
            while not sess.should_stop():
                step = int(sess.run(global_step))
                if step == kill_at and rank == kill_rank and (always or record["start"] == 0):
                    print(f"rank {rank} kills itself at step {step} {time.time():.3f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                features, labels = step_batch(step, rank)
                value, _ = sess.run([loss, train_op], {x: features, y: labels})
                record["steps"].append(step)
                record["losses"].append(float(value))
                print(f"rank {rank} step {step} {time.time():.3f}", flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    env.reset()


if __name__ == "__main__":
    main()
