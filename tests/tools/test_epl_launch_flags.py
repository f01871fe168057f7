"""EPL's launcher flags (`epl-launch --num_workers N --gpu_per_worker K script`): the
translation into epl-launch's own options, its refusals, and one real 2-worker job in
EPL's form whose workers read EPL's names (epl.Env, epl.Cluster(worker_hosts=...)).

Horovod must be installed for the job: it fails, not skips, without it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import horovod.tensorflow as hvd  # noqa: F401  (fail, not skip, without Horovod)
import pytest

from epl.tools import launch as epl_launch
from epl.tools.launch_flags import EplFlagError, translate_epl_flags, visible_gpu_count

EPL_LAUNCH = os.path.join(os.path.dirname(sys.executable), "epl-launch")
from paths import ROOT  # noqa: E402
JOB_TIMEOUT = 180


@pytest.mark.parametrize("argv, expected", [
    # EPL's documented form (docs/en/quick_start.md, tutorials/ddp.md): a .sh or .py script
    (["--num_workers", "2", "--gpu_per_worker", "1", "scripts/train_dp.sh"],
     ["-np", "2", "--virtual-devices", "1", "--", "bash", "scripts/train_dp.sh"]),
    (["--num_workers=1", "--gpu_per_worker=2", "train.py", "--steps", "3"],
     ["-np", "1", "--virtual-devices", "2", "--", sys.executable, "train.py", "--steps", "3"]),
    # epl-launch's own options may come along, before the script; -- is kept meaningful
    (["--gpu_per_worker", "4", "-H", "a:1,b:1", "--num_workers", "2", "--timeout", "30", "--",
      "python", "train.py", "--num_workers", "9"],
     ["-np", "2", "--virtual-devices", "4", "-H", "a:1,b:1", "--timeout", "30", "--",
      "python", "train.py", "--num_workers", "9"]),
    # not EPL's form: untouched, even with EPL's flag names after the command starts
    (["-np", "2", "python", "train.py", "--num_workers", "3"],
     ["-np", "2", "python", "train.py", "--num_workers", "3"]),
])
def test_translation_without_gpus(argv, expected):
    assert translate_epl_flags(argv, gpu_count=0) == expected


def test_translation_with_gpus():
    assert translate_epl_flags(["--num_workers", "1", "--gpu_per_worker", "8", "run.sh"],
                               gpu_count=8) == ["-np", "1", "--", "bash", "run.sh"]
    with pytest.raises(EplFlagError) as err:
        translate_epl_flags(["--num_workers", "2", "--gpu_per_worker", "1", "run.sh"], gpu_count=2)
    assert str(err.value) == (
        "--num_workers 2 --gpu_per_worker 1: this machine has 2 GPU(s), and epl-launch gives "
        "every worker all the GPUs it sees (it does not give workers GPUs of their own yet). Use "
        "--num_workers 1 --gpu_per_worker 2 (one worker driving every GPU), or "
        "CUDA_VISIBLE_DEVICES to show one worker 1 GPU(s).")


@pytest.mark.parametrize("argv, message", [
    (["--num_workers", "2", "train.py"],
     "EPL's launcher flags go together: add --gpu_per_worker (usage: epl-launch --num_workers "
     "N --gpu_per_worker K script.py)"),
    (["--num_workers", "0", "--gpu_per_worker", "1", "train.py"], "--num_workers 0: give 1 or more"),
    (["--num_workers", "two", "--gpu_per_worker", "1", "x.py"], "--num_workers two: give a whole number"),
    (["--num_workers", "2", "--gpu_per_worker"], "--gpu_per_worker needs a value, e.g. --gpu_per_worker 2"),
    (["--num_workers", "2", "--num_workers", "3", "--gpu_per_worker", "1", "x.py"],
     "--num_workers is given twice"),
    (["--num_workers", "2", "--gpu_per_worker", "1"],
     "no training script; usage: epl-launch --num_workers N --gpu_per_worker K script.py [args...]"),
    (["-np", "2", "--num_workers", "2", "--gpu_per_worker", "1", "x.py"],
     "-np and EPL's --num_workers/--gpu_per_worker say the same thing; give one of them"),
    (["--virtual-devices=2", "--num_workers", "2", "--gpu_per_worker", "1", "x.py"],
     "--virtual-devices and EPL's --num_workers/--gpu_per_worker say the same thing; give one "
     "of them"),
    (["--num_workers", "2", "--gpu_per_worker", "1", "--verbose", "x.py"],
     "--verbose: with EPL's launcher flags, only epl-launch's own options (-H, --timeout, ...) "
     "may come before the script"),
    (["--num_workers", "2", "--gpu_per_worker", "1", "--machine_list", "a:1,b:1", "x.py"],
     "--machine_list (EPL's launcher) is not supported: give the hosts with -H "
     "host1:slots,host2:slots"),
    (["--log_dir=/tmp/x", "--num_workers", "2", "--gpu_per_worker", "1", "x.py"],
     "--log_dir (EPL's launcher) is not supported: use --output-dir DIR: epl-launch keeps "
     "each rank's output in DIR/rank.<r>/stdout and stderr"),
])
def test_refusals(argv, message):
    with pytest.raises(EplFlagError) as err:
        translate_epl_flags(argv, gpu_count=0)
    assert str(err.value) == message


def test_refusal_through_epl_launch_main(capsys):
    assert epl_launch.main(["--num_workers", "2", "x.py"]) == 2
    assert capsys.readouterr().err == (
        "epl-launch: EPL's launcher flags go together: add --gpu_per_worker (usage: epl-launch "
        "--num_workers N --gpu_per_worker K script.py)\n")


def test_visible_gpu_count_follows_cuda_visible_devices():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,2,3"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == 1   # CUDA stops at -1


WORKER = textwrap.dedent('''
    import tensorflow as tf
    import epl
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config())
    cluster = epl.Env.get().cluster
    hosts = ",".join("localhost:%d" % i for i in range(cluster.worker_num))
    with epl.Cluster(worker_hosts=hosts, worker_index=cluster.worker_index) as stated:
        assert stated == cluster, (stated, cluster)
    print("worker %d of %d: %d devices here, %d in all" % (
        cluster.worker_index, cluster.worker_num, cluster.gpu_num_per_worker,
        cluster.total_gpu_num), flush=True)
''')


def test_epl_form_job_two_workers_of_three_devices(tmp_path):
    """`epl-launch --num_workers 2 --gpu_per_worker 3 worker.py` on this CPU machine: 2
    Horovod workers, each driving 3 virtual CPU devices, as EPL's Env and Cluster say."""
    assert os.path.exists(EPL_LAUNCH), "epl-launch is not installed: pip install -e ."
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EPL_")}
    environ.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([EPL_LAUNCH, "--num_workers", "2", "--gpu_per_worker", "3",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=environ, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("epl-launch overran %ss:\n%s" % (JOB_TIMEOUT, out))
    assert proc.returncode == 0, out
    said = sorted(line.partition("<stdout>:")[2].strip() for line in out.splitlines()
                  if "worker " in line and " devices here" in line)
    assert said == ["worker 0 of 2: 3 devices here, 6 in all",
                    "worker 1 of 2: 3 devices here, 6 in all"], out
