"""The sentence that says why a multi-worker run failed, from every worker's record.

`explain(me, size, records, labels, timeout_s)` is a pure function of what
each worker's status server answered (epl.runtime.worker_status), or what was
found about a worker that did not answer. It names every worker that is
behind and what it was last doing:

- a worker outside session.run, or inside its run short of collectives the
  others submitted: it stalled, alive but not progressing;
- a worker that does not answer: stopped (SIGSTOP, a debugger) or frozen,
  also alive but not progressing, with what it was last doing when its shared
  page is readable (same host);
- a worker whose process is gone, or that left the job (its script ended or
  raised);

with its step and the first collective it did not reach, by what it carries
(the user's variable or tensor names). `Verdict.culprits` lists the same
workers for the launcher (it restarts because of them).
"""
from __future__ import annotations

import dataclasses

ALIVE = "it is alive but not progressing"


@dataclasses.dataclass
class Verdict:
    """message: the whole sentence; culprits: [(rank, how, what happened to it, without
    its name: "stalled: it is alive but not progressing: ...")]."""

    message: str
    culprits: list


def _step_words(record: dict, fallback: dict | None = None) -> str:
    for source in (record, fallback or {}):
        if source.get("step") is not None:
            return "global step %d" % source["step"]
    return "training run #%d of the process" % record.get("training_runs", 0)


def _missing(record: dict, pending: list[str]) -> list[str]:
    """The pending collectives `record`'s worker has not submitted in its current run."""
    if record.get("phase") not in ("running", "failed"):
        return list(pending)
    done = set(record.get("submitted") or [])
    return [name for name in pending if name not in done]


def _state(record: dict) -> dict:
    """The record that says where a worker was: its answer, else its last shared page."""
    if record.get("phase") in ("gone", "silent"):
        return record.get("last") or {}
    return record


def _culprits(records: dict[int, dict], pending: list[str]) -> list[tuple]:
    """[(rank, how, missing collectives)] for every worker that is behind.

    how: "gone" (its process is gone), "left" (it exited), "silent" (it does not
    answer: stopped or frozen), "idle" (not inside a run), "behind" (inside its
    run, short of collectives the others submitted). A worker that stopped the
    job after a timeout is a witness, not a culprit.
    """
    out = []
    for rank in sorted(records):
        record = records[rank]
        phase = record.get("phase")
        if phase in ("gone", "silent"):
            out.append((rank, phase, _missing(_state(record), pending)))
        elif phase == "exited":
            out.append((rank, "left", list(pending)))
        elif phase == "idle":
            out.append((rank, "idle", list(pending)))
        else:  # inside its run, or stopped the job after its own wait ran out
            missing = _missing(record, pending)
            if missing:
                out.append((rank, "behind", missing))
    return out


def _doing(record: dict, mine: dict, labels: dict[str, str]) -> str:
    """What a worker was doing, from its record: outside session.run for how long,
    or inside its run (and which collectives it had submitted)."""
    age = record.get("age_s", 0.0)
    where = _step_words(record, mine)
    if record.get("phase") == "idle":
        return "it has been outside session.run for %.1f s (at %s)" % (age, where)
    text = "it has been inside its run at %s for %.1f s" % (where, age)
    done = record.get("submitted") or []
    if done:
        text += " (it submitted %s)" % _collectives(done[-1:], labels)
    return text


def _culprit_text(rank: int, how: str, missing: list[str], me: int, records: dict,
                  labels: dict[str, str]) -> str:
    """What happened to culprit `rank`, without its name: "stalled: ...", "left the job: ..."."""
    record = records[rank]
    mine = records[me]
    last = _state(record)
    if how == "gone":
        text = "left the job: %s" % (record.get("detail") or "its process is gone")
        if last:
            text += " (when last seen, %s)" % _doing(last, mine, labels)
    elif how == "left":
        text = "left the job after %s: %s" % (_step_words(record), record.get(
            "error") or "its script ended")
    elif how == "silent":
        text = "stalled: %s: %s" % (ALIVE, record.get("detail"))
        text += "; %s" % _doing(last, mine, labels) if last else \
            "; what it was doing is unknown (it runs on another host)"
    else:
        text = "stalled: %s: %s" % (ALIVE, _doing(record, mine, labels))
    if missing:
        text += ", and did not reach %s" % _collectives(missing[:1], labels)
    return text


def explain(me: int, size: int, records: dict[int, dict], labels: dict[str, str],
            timeout_s: float | None) -> Verdict:
    """Why worker `me`'s current run failed.

    records: every worker's record (`WorkerStatus.snapshot`, its own included;
    for a worker that did not answer, what `WorkerStatus.query_peers` found);
    labels: this run's collectives (op name -> what they carry, in words);
    timeout_s: the limit that ran out, or None when the run failed because
    Horovod was shut down.
    """
    mine = records[me]
    order = list(mine.get("collectives") or [])
    submitted = set()
    for record in records.values():
        state = _state(record)
        if state.get("phase") in ("running", "failed"):
            submitted.update(state.get("submitted") or [])
    pending = [name for name in order if name in submitted] or order
    what = ("the training step at %s" % _step_words(mine) if mine.get("training")
            else "a run with cross-worker collectives")
    head = "worker %d of %d: %s %s" % (me, size, what, (
        "did not finish within %g s (communication.collective_timeout_s)" % timeout_s
        if timeout_s is not None else "failed: Horovod was shut down"))
    culprits = _culprits(records, pending)
    if not culprits:
        stoppers = [r for r, rec in sorted(records.items()) if r != me
                    and rec.get("phase") == "failed" and rec.get("verdict")]
        if stoppers:
            return Verdict("%s: worker %d stopped the job: %s" % (
                head, stoppers[0], records[stoppers[0]]["verdict"]), [])
        return Verdict("%s: every worker is inside its run and submitted the same collectives "
                       "(%s); none is known to be behind" % (head, _collectives(pending, labels)),
                       [])
    parts = [(rank, how, _culprit_text(rank, how, missing, me, records, labels))
             for rank, how, missing in culprits]
    waiting = [str(r) for r in sorted(records) if r not in {c[0] for c in culprits}]
    tail = " (worker%s %s wait%s in it)" % ("s" if len(waiting) > 1 else "", ", ".join(waiting),
                                            "" if len(waiting) > 1 else "s") if waiting else ""
    return Verdict("%s: %s%s" % (head, "; ".join(
        "%s %s" % ("this worker (%d)" % rank if rank == me else "worker %d" % rank, text)
        for rank, _, text in parts), tail), parts)


def _collectives(names: list[str], labels: dict[str, str]) -> str:
    if not names:
        return "no collective"
    return ", ".join("the %s ('%s')" % (labels.get(n, "collective"), n) for n in names)
