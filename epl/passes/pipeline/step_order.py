"""Pipeline schedules as data.

A pipeline with ``S`` stages and ``M`` micro-batches runs ``2 * S * M`` steps:
the forward and the backward of every micro-batch on every stage. A
`Schedule` says, for each stage, the order in which that stage runs its
steps. It is pure data (no TensorFlow): the pipeline pass reads it to add
control edges between the micro-batch copies of a stage's ops, and the
planner reads it to predict memory (micro-batches in flight) and time
(bubbles).

Two schedules, named as in EPL's ``pipeline.strategy`` config key:

- ``"PreferForward"`` (`gpipe_schedule`, GPipe): every stage runs all its
  forwards, then all its backwards. Activations of all ``M`` micro-batches
  are alive at once.
- ``"PreferBackward"`` (`one_f_one_b_schedule`, EPL's default,
  PipeDream-flush / 1F1B): stage ``s`` runs ``min(S - s - 1, M)`` warm-up
  forwards, then alternates one forward and one backward, then drains the
  remaining backwards. At most ``min(S - s, M)`` micro-batches are in flight
  on stage ``s``.

Backwards run in micro-batch order ``0..M-1`` in both schedules. 1F1B has no
choice (micro-batch 0 is the first to come back from the last stage); GPipe's
paper draws them in reverse, which takes no less and no more time, so we
choose the same order as 1F1B. Then the gradients of the micro-batches are
accumulated in the same order under both strategies, and a model gives the
same floating-point update whichever strategy it runs under.

Both schedules are flush schedules (all micro-batches finish before the
weights are updated), so with equal forward and backward times both take
``2 * (M + S - 1)`` step times and waste the same bubble fraction,
``(S - 1) / (M + S - 1)``; 1F1B wins on memory, not on time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Literal

from epl.errors import ConfigError

StepKind = Literal["forward", "backward"]
FORWARD: StepKind = "forward"
BACKWARD: StepKind = "backward"

PREFER_FORWARD = "PreferForward"
PREFER_BACKWARD = "PreferBackward"

Dependency = tuple["Step", "Step"]


@dataclasses.dataclass(frozen=True, order=True)
class Step:
    """One unit of pipeline work: the forward or backward of a micro-batch.

    Attributes:
        stage: pipeline stage index, ``0..S-1``.
        micro_batch: micro-batch index, ``0..M-1``.
        kind: ``"forward"`` or ``"backward"``.
    """

    stage: int
    micro_batch: int
    kind: StepKind

    def __str__(self) -> str:
        """Return the short form used in tables, e.g. ``F0`` or ``B3``."""
        return f"{self.kind[0].upper()}{self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Simulated start and end time of one step (see `Schedule.timeline`)."""

    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The execution order of every pipeline stage.

    Attributes:
        num_stages: number of pipeline stages ``S``.
        num_micro_batches: number of micro-batches ``M``.
        strategy: the name of the schedule (``"PreferForward"``,
            ``"PreferBackward"`` or any label for a hand-built schedule).
        per_stage: ``per_stage[s]`` is the ordered tuple of steps stage ``s``
            runs. Lists are accepted and stored as tuples.
    """

    num_stages: int
    num_micro_batches: int
    strategy: str
    per_stage: tuple[tuple[Step, ...], ...]

    def __post_init__(self) -> None:
        """Freeze `per_stage` into tuples; check there is a row per stage."""
        rows = tuple(tuple(row) for row in self.per_stage)
        object.__setattr__(self, "per_stage", rows)
        if len(rows) != self.num_stages:
            raise ValueError(
                f"per_stage has {len(rows)} rows but num_stages is "
                f"{self.num_stages}; give one row of steps per stage")

    def steps(self, stage: int) -> tuple[Step, ...]:
        """Return the ordered steps of `stage` (``0 <= stage < S``)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(
                f"stage {stage} is out of range; this schedule has stages "
                f"0..{self.num_stages - 1}")
        return self.per_stage[stage]

    def all_steps(self) -> list[Step]:
        """Return every step of the schedule, stage by stage, in order."""
        return [step for row in self.per_stage for step in row]

    def max_in_flight(self, stage: int) -> int:
        """Return the most micro-batches alive at once on `stage`.

        A micro-batch is in flight on a stage from the end of its forward
        there until its backward there; this is how many sets of activations
        the stage must hold at its peak.
        """
        in_flight = peak = 0
        for step in self.steps(stage):
            in_flight += 1 if step.kind == FORWARD else -1
            peak = max(peak, in_flight)
        return peak

    def execution_dependencies(self) -> list[Dependency]:
        """Return (before, after) for consecutive steps on the same stage.

        These are the orderings the schedule itself chooses; the pipeline
        pass turns them into control edges.
        """
        return [(row[i], row[i + 1])
                for row in self.per_stage for i in range(len(row) - 1)]

    def data_dependencies(self) -> list[Dependency]:
        """Return (before, after) for the data flow between steps.

        Forward of (s, m) feeds forward of (s+1, m); backward of (s+1, m)
        feeds backward of (s, m); the last stage's forward of m feeds its
        backward of m. These hold in any schedule; TensorFlow enforces them
        through tensors.
        """
        last = self.num_stages - 1
        pairs: list[Dependency] = []
        for m in range(self.num_micro_batches):
            for s in range(last):
                pairs.append((Step(s, m, FORWARD), Step(s + 1, m, FORWARD)))
                pairs.append((Step(s + 1, m, BACKWARD), Step(s, m, BACKWARD)))
            pairs.append((Step(last, m, FORWARD), Step(last, m, BACKWARD)))
        return pairs

    def dependencies(self) -> list[Dependency]:
        """Return execution then data dependencies, without duplicates."""
        pairs = self.execution_dependencies() + self.data_dependencies()
        return list(dict.fromkeys(pairs))

    def is_valid(self) -> bool:
        """Return whether the schedule is complete and cannot deadlock.

        Complete: each stage's row holds exactly the forward and the backward
        of every micro-batch on that stage, once each. Deadlock-free: the
        union of `dependencies` has no cycle.
        """
        return self._is_complete() and _topological_order(
            self.all_steps(), self.dependencies()) is not None

    def timeline(self, forward_time: float = 1.0,
                 backward_time: float = 2.0) -> dict[Step, StepTime]:
        """Simulate the schedule; return each step's start and end time.

        Every step starts as soon as all its dependencies have ended (so a
        stage runs one step at a time, in its order) and takes
        `forward_time` or `backward_time`. Time starts at 0.

        Raises:
            ValueError: a time is not positive, or the schedule is invalid.
        """
        _check_positive(forward_time=forward_time, backward_time=backward_time)
        order = self._checked_order()
        preds: dict[Step, list[Step]] = {step: [] for step in order}
        for before, after in self.dependencies():
            preds[after].append(before)
        times: dict[Step, StepTime] = {}
        for step in order:
            start = max((times[p].end for p in preds[step]), default=0.0)
            duration = forward_time if step.kind == FORWARD else backward_time
            times[step] = StepTime(start, start + duration)
        return times

    def makespan(self, forward_time: float = 1.0,
                 backward_time: float = 2.0) -> float:
        """Return the simulated time from the first start to the last end."""
        times = self.timeline(forward_time, backward_time)
        return max((t.end for t in times.values()), default=0.0)

    def stage_bubble_fractions(self, forward_time: float = 1.0,
                               backward_time: float = 2.0
                               ) -> tuple[float, ...]:
        """Return, per stage, its idle time divided by the makespan.

        A stage's idle time is the makespan minus the time it spends running
        steps, so it counts the warm-up wait and the drain at the end.
        """
        times = self.timeline(forward_time, backward_time)
        total = max((t.end for t in times.values()), default=0.0)
        if total == 0.0:
            return tuple(0.0 for _ in range(self.num_stages))
        return tuple(
            1.0 - sum(times[s].end - times[s].start for s in row) / total
            for row in self.per_stage)

    def bubble_fraction(self, forward_time: float = 1.0,
                        backward_time: float = 2.0) -> float:
        """Return the mean over stages of `stage_bubble_fractions`.

        With ``forward_time == backward_time`` this is
        ``(S - 1) / (M + S - 1)`` for both built-in schedules.
        """
        fractions = self.stage_bubble_fractions(forward_time, backward_time)
        return sum(fractions) / len(fractions)

    def format_table(self) -> str:
        """Return the schedule as text, one line per stage (``F0 B0 ...``)."""
        return "\n".join(
            f"stage {s}: " + " ".join(str(step) for step in row)
            for s, row in enumerate(self.per_stage))

    def _is_complete(self) -> bool:
        """Return whether each row holds each of its stage's steps once."""
        for s, row in enumerate(self.per_stage):
            expected = {Step(s, m, kind) for m in range(self.num_micro_batches)
                        for kind in (FORWARD, BACKWARD)}
            if len(row) != len(expected) or set(row) != expected:
                return False
        return True

    def _checked_order(self) -> list[Step]:
        """Return a dependency-respecting order of all steps, or raise."""
        order = (_topological_order(self.all_steps(), self.dependencies())
                 if self._is_complete() else None)
        if order is None:
            raise ValueError(
                f"schedule {self.strategy!r} is invalid (a step is missing "
                f"or repeated, or its order deadlocks):\n"
                f"{self.format_table()}")
        return order


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> Schedule:
    """Return the GPipe ("PreferForward") schedule.

    Each stage runs the forwards of micro-batches ``0..M-1``, then their
    backwards in the same order (see the module docstring for why not in
    reverse).
    """
    _check_sizes(num_stages, num_micro_batches)
    rows = tuple(
        tuple(Step(s, m, FORWARD) for m in range(num_micro_batches))
        + tuple(Step(s, m, BACKWARD) for m in range(num_micro_batches))
        for s in range(num_stages))
    return Schedule(num_stages, num_micro_batches, PREFER_FORWARD, rows)


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int) -> Schedule:
    """Return the 1F1B ("PreferBackward", PipeDream-flush) schedule.

    Stage ``s`` runs ``w = min(S - s - 1, M)`` warm-up forwards, then
    ``M - w`` pairs of (next forward, oldest backward), then the ``w``
    remaining backwards.
    """
    _check_sizes(num_stages, num_micro_batches)
    rows = tuple(_one_f_one_b_row(s, num_stages, num_micro_batches)
                 for s in range(num_stages))
    return Schedule(num_stages, num_micro_batches, PREFER_BACKWARD, rows)


_BUILDERS = {
    PREFER_FORWARD: gpipe_schedule,
    PREFER_BACKWARD: one_f_one_b_schedule,
}
STRATEGIES: tuple[str, ...] = tuple(_BUILDERS)


def make_schedule(strategy: str, num_stages: int,
                  num_micro_batches: int) -> Schedule:
    """Return the schedule named by `strategy` (EPL's ``pipeline.strategy``).

    Raises:
        ConfigError (a ValueError): unknown `strategy`, or a size below 1.
    """
    builder = _BUILDERS.get(strategy)
    if builder is None:
        raise ConfigError(
            f"unknown pipeline strategy {strategy!r}; valid strategies are "
            f"{', '.join(repr(name) for name in STRATEGIES)}")
    return builder(num_stages, num_micro_batches)


def _one_f_one_b_row(stage: int, num_stages: int,
                     num_micro_batches: int) -> tuple[Step, ...]:
    """Return stage `stage`'s 1F1B step order."""
    warm_up = min(num_stages - stage - 1, num_micro_batches)
    row = [Step(stage, m, FORWARD) for m in range(warm_up)]
    for i in range(num_micro_batches - warm_up):
        row.append(Step(stage, warm_up + i, FORWARD))
        row.append(Step(stage, i, BACKWARD))
    row.extend(Step(stage, m, BACKWARD)
               for m in range(num_micro_batches - warm_up, num_micro_batches))
    return tuple(row)


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    """Raise ConfigError unless both sizes are integers of at least 1."""
    for name, value in (("num_stages", num_stages),
                        ("num_micro_batches", num_micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{name} must be an integer >= 1, got {value!r}")


def _check_positive(**times: float) -> None:
    """Raise ValueError unless every named time is a positive number."""
    for name, value in times.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def _topological_order(nodes: Sequence[Step],
                       edges: Iterable[Dependency]) -> list[Step] | None:
    """Return `nodes` so that every edge points forward; None on a cycle.

    Edges that mention a node outside `nodes` make the order impossible and
    also return None.
    """
    known = set(nodes)
    successors: dict[Step, list[Step]] = {node: [] for node in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for before, after in edges:
        if before not in known or after not in known:
            return None
        successors[before].append(after)
        indegree[after] += 1
    ready = [node for node in nodes if indegree[node] == 0]
    order: list[Step] = []
    while ready:
        node = ready.pop()
        order.append(node)
        for nxt in successors[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return order if len(order) == len(nodes) else None
