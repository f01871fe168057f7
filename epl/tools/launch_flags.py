"""EPL's launcher flags for `epl-launch`: ``--num_workers N --gpu_per_worker K script``.

EasyParallelLibrary's launcher is called as::

    epl-launch --num_workers 2 --gpu_per_worker 1 train.sh

and starts N local workers of K GPUs each, running ``python script`` for a
``.py`` script and ``bash script`` otherwise. `translate_epl_flags` rewrites
such a command line into epl-launch's own options before they are parsed:

- ``--num_workers N`` becomes ``-np N`` (N Horovod workers on this machine,
  or on the hosts of ``-H``);
- ``--gpu_per_worker K``: on a machine without GPUs, ``--virtual-devices K``
  (each worker drives K virtual CPU devices, which stand for its GPUs; a
  script that sets ``cluster.virtual_devices`` in its config dict overrides
  it, as a dict wins over the environment). On a machine with G GPUs each
  worker drives every GPU it sees, and epl-launch does not give workers
  GPUs of their own yet, so only ``--num_workers 1 --gpu_per_worker G`` is
  accepted; anything else is refused with the ways to run it;
- the command: a ``.py`` script becomes ``<this python> script``, a ``.sh``
  script ``bash script`` (EPL's rule); any other command is kept. EPL's
  launcher also appended a log directory to the script's arguments; here the
  script gets only its own arguments, and the workers' output is streamed
  with a rank prefix.

EPL's other launcher flags (``--machine_rank``, ``--machine_list``,
``--task_label``, ``--log_dir``, ``--debug``) are refused, each with what to
use instead, and so is mixing EPL's flags with ``-np`` or
``--virtual-devices``. A command line without EPL's flags is returned as is.

Only the options before the command are read: the words up to ``--`` or up to
the first word that is neither one of EPL's flags nor one of epl-launch's own
options (``-np``, ``-H``, ``--virtual-devices``, ...) and its value.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

#: EPL's flags this module translates, each taking one value.
TRANSLATED = ("--num_workers", "--gpu_per_worker")

#: EPL's other launcher flags -> what to use instead.
REFUSED = {
    "--machine_rank": "start every worker from one epl-launch (horovodrun starts the workers "
                      "on every host of -H)",
    "--machine_list": "give the hosts with -H host1:slots,host2:slots",
    "--task_label": "epl-launch streams every worker's output with a rank prefix; "
                    "--output-dir DIR keeps each rank's output in files of its own",
    "--log_dir": "use --output-dir DIR: epl-launch keeps each rank's output in "
                 "DIR/rank.<r>/stdout and stderr",
    "--debug": "run the script directly (python script.py) to debug one worker",
}

#: epl-launch's own options and how many values each takes (the scan skips them).
OWN_OPTIONS = {"-np": 1, "--num-proc": 1, "-H": 1, "--hosts": 1, "--virtual-devices": 1,
               "--timeout": 1, "--restarts": 1, "--min-np": 1, "--output-dir": 1}


class EplFlagError(ValueError):
    """A bad use of EPL's launcher flags (epl-launch exits 2 with the message)."""


def visible_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """GPUs the workers would see: those of ``CUDA_VISIBLE_DEVICES`` when it is set,
    else those ``nvidia-smi -L`` lists (0 without an NVIDIA driver)."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        # CUDA stops at the first invalid index ("-1" hides every GPU)
        count = 0
        for entry in entries:
            if entry.startswith("-"):
                break
            count += 1
        return count
    from epl.runtime.gpus import nvidia_smi_gpus
    gpus, _ = nvidia_smi_gpus()
    return len(gpus)


def _positive(option: str, text: str) -> int:
    """The value of `option` as an int >= 1, else EplFlagError."""
    try:
        value = int(text)
    except ValueError:
        raise EplFlagError(f"{option} {text}: give a whole number") from None
    if value < 1:
        raise EplFlagError(f"{option} {value}: give 1 or more")
    return value


def _scan(argv: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(epl-launch's options kept, EPL's flags found -> value, the rest of the line)."""
    kept, found = [], {}
    i = 0
    while i < len(argv):
        word = argv[i]
        option, has_value, value = word.partition("=")
        if option in TRANSLATED:
            if not has_value:
                if i + 1 >= len(argv):
                    raise EplFlagError(f"{option} needs a value, e.g. {option} 2")
                value = argv[i + 1]
                i += 1
            if option in found:
                raise EplFlagError(f"{option} is given twice")
            found[option] = value
            i += 1
            continue
        if option in REFUSED:
            raise EplFlagError(f"{option} (EPL's launcher) is not supported: {REFUSED[option]}")
        if option in OWN_OPTIONS:
            count = 0 if has_value else OWN_OPTIONS[option]
            kept.extend(argv[i:i + 1 + count])
            i += 1 + count
            continue
        break
    return kept, found, argv[i:]


def _command(rest: list[str]) -> list[str]:
    """The worker's command in EPL's form: a .py script runs with this Python, a .sh
    script with bash; anything else as given."""
    if rest and rest[0] != "--" and rest[0].startswith("-"):
        raise EplFlagError(f"{rest[0]}: with EPL's launcher flags, only epl-launch's own options "
                           "(-H, --timeout, ...) may come before the script")
    command = rest[1:] if rest[:1] == ["--"] else list(rest)
    if not command:
        raise EplFlagError("no training script; usage: epl-launch --num_workers N "
                           "--gpu_per_worker K script.py [args...]")
    if command[0].endswith(".py"):
        return [sys.executable] + command
    if command[0].endswith(".sh"):
        return ["bash"] + command
    return command


def translate_epl_flags(argv: Sequence[str], gpu_count: int | None = None) -> list[str]:
    """Rewrite EPL's launcher flags in `argv` (epl-launch's arguments) into epl-launch's.

    gpu_count: GPUs on this machine (default: `visible_gpu_count()`, read only
    when ``--gpu_per_worker`` is given). Returns `argv` unchanged when it has
    none of EPL's flags; raises EplFlagError (see the module docstring).
    """
    argv = list(argv)
    kept, found, rest = _scan(argv)
    if not found:
        return argv
    missing = [option for option in TRANSLATED if option not in found]
    if missing:
        raise EplFlagError(f"EPL's launcher flags go together: add {missing[0]} (usage: "
                           "epl-launch --num_workers N --gpu_per_worker K script.py)")
    workers = _positive("--num_workers", found["--num_workers"])
    per_worker = _positive("--gpu_per_worker", found["--gpu_per_worker"])
    for option in kept:
        if option.partition("=")[0] in ("-np", "--num-proc", "--virtual-devices"):
            raise EplFlagError(f"{option.partition('=')[0]} and EPL's --num_workers/"
                               "--gpu_per_worker say the same thing; give one of them")
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    devices: list[str] = []
    if gpus == 0:
        devices = ["--virtual-devices", str(per_worker)]
    elif (workers, per_worker) != (1, gpus):
        raise EplFlagError(
            f"--num_workers {workers} --gpu_per_worker {per_worker}: this machine has {gpus} "
            "GPU(s), and epl-launch gives every worker all the GPUs it sees (it does not give "
            f"workers GPUs of their own yet). Use --num_workers 1 --gpu_per_worker {gpus} (one "
            "worker driving every GPU), or CUDA_VISIBLE_DEVICES to show one worker "
            f"{per_worker} GPU(s).")
    return ["-np", str(workers)] + devices + kept + ["--"] + _command(rest)
