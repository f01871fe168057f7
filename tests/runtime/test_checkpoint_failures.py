"""A save that fails mid-run: the job ends with the path and the reason, and keeps the
last good checkpoint, from which a restart resumes.

tests/workers/checkpoint_worker.py saves every 5 steps on rank 0; SAVE_FAULT
breaks its second save (step 10): a quota that runs out (RLIMIT_FSIZE: no file
of the process may grow past 100 bytes, which works on any Linux machine), or a
disk that fills up (a real 4 MiB tmpfs, mounted in a user namespace where the
machine allows it).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from multiworker import (assert_matches_plain, epl_launch, errors, run_job, worker_module,
                         worker_script)

pytestmark = pytest.mark.multiworker


def _batches(ranks):
    common = worker_module("common")
    return lambda step: [common.step_batch(step, rank) for rank in ranks]


def test_save_failing_mid_run_ends_the_job_and_the_restart_resumes_from_the_last_good_one(
        tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = epl_launch(["-np", "2", "--timeout", "60", "--restarts", "1"],
                     ["checkpoint_worker.py", "rank0", str(out), str(ckpt)], timeout=300,
                     env={"SAVE_FAULT": "quota@7@%s" % (tmp_path / "broken-once")})
    assert job.returncode == 0, errors(job.stdout)
    log = [line for line in job.text if line.startswith("epl-launch:")]
    assert re.fullmatch(
        r"epl-launch: worker 0 failed( \(exit 1\))?: epl\.errors\.CheckpointError: worker 0 of 2, "
        r"at global step 10: saving the checkpoint %s failed: a file-size limit was reached \(a "
        r"quota; TensorFlow: %s_temp/[\w.-]+\.tempstate\d+; File too large\)\. The last good "
        r"checkpoint, %s, is intact \(%s names it\): a restarted job resumes from it\." % tuple(
            re.escape(str(p)) for p in (ckpt / "model.ckpt-10", ckpt / "model.ckpt-10",
                                        ckpt / "model.ckpt-5", ckpt / "checkpoint")),
        log[0]), "\n".join(log)
    assert re.match(r"epl-launch: restart 1 of 1 after worker 0 failed \((exit 1: )?"
                    r"epl\.errors\.CheckpointError: worker 0 of 2, at global step 10: saving",
                    log[1]), log[1]
    assert log[2].startswith("epl-launch: restart 1: resumed from global step 5 (worker 0 "
                             "restored %s in " % (ckpt / "model.ckpt-5")), log[2]
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["start"] == 5 and record["steps"] == list(range(5, 20))
        assert_matches_plain(record["variables"], _batches((0, 1)), 5, 20,
                             str(ckpt / "model.ckpt-5"))


def _tmpfs_command(size: str, mount_point: str, command: list[str]) -> list[str] | None:
    """`command` run in a user and mount namespace with a tmpfs of `size` at
    `mount_point`, or None where this machine does not allow it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "-rm", "sh", "-c", "mount -t tmpfs -o size=%s tmpfs %s"
                            % (size, mount_point)], capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    script = "mount -t tmpfs -o size=%s tmpfs %s && exec \"$@\"" % (size, mount_point)
    return [unshare, "-rm", "sh", "-c", script, "sh", *command]


def test_save_on_a_disk_that_fills_up_names_the_path_and_keeps_the_last_good_one(tmp_path):
    """A real full disk (ENOSPC): a 4 MiB tmpfs that a filler file fills after the first
    save. Where user namespaces are not allowed, the quota case above covers the path."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    ckpt = disk / "ckpt"
    check = (ckpt / "model.ckpt-5").as_posix()
    command = _tmpfs_command("4m", str(disk), [
        sys.executable, worker_script("checkpoint_worker.py"), "rank0", str(out), str(ckpt)])
    if command is None:
        why = ("this machine allows no tmpfs in a user namespace (unshare -rm, util-linux); "
               "test_save_failing_mid_run_... covers a failing save")
        if os.environ.get("CI"):   # .ci/run sets it: CI must run every test
            pytest.fail(f"{why}, but CI must run this test: allow user namespaces "
                        "(sysctl kernel.unprivileged_userns_clone=1) or install util-linux")
        pytest.skip(why)
    # the tmpfs is gone when the namespace ends: the worker's own CheckpointError says
    # whether the last good checkpoint is intact (epl.checkpoint.damage read it)
    job = run_job(command, 300, env={"SAVE_FAULT": "full@7"})
    assert job.returncode == 1, job.stdout[-3000:]
    errors_seen = [line for line in job.text if line.startswith("epl.errors.CheckpointError: ")]
    assert errors_seen, job.stdout[-3000:]
    assert re.fullmatch(
        r"epl\.errors\.CheckpointError: at global step 10: saving the checkpoint %s failed: the "
        r"disk is full \(TensorFlow: .*No space left on device\)\. The last good checkpoint, "
        r"%s, is intact \(%s names it\): a restarted job resumes from it\." % (
            re.escape((ckpt / "model.ckpt-10").as_posix()), re.escape(check),
            re.escape((ckpt / "checkpoint").as_posix())), errors_seen[0]), errors_seen[0]
