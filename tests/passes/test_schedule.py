"""Tests of epl.passes.pipeline.step_order: pipeline schedules as data (pure Python)."""

import itertools

import pytest

from epl.errors import ConfigError
from epl.passes.pipeline.step_order import (
    Schedule,
    Step,
    gpipe_schedule,
    make_schedule,
    one_f_one_b_schedule,
)

SIZES = list(itertools.product(range(1, 5), range(1, 9)))
BUILDERS = [gpipe_schedule, one_f_one_b_schedule]


def parse_row(stage: int, text: str) -> tuple[Step, ...]:
    """Turn ``"F0 F1 B0"`` into the steps of `stage`."""
    kinds = {"F": "forward", "B": "backward"}
    return tuple(Step(stage, int(tok[1:]), kinds[tok[0]])
                 for tok in text.split())


def table(schedule: Schedule) -> list[str]:
    """Return the schedule's rows as ``"F0 F1 B0"`` strings."""
    return [" ".join(str(step) for step in row) for row in schedule.per_stage]


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_each_step_exactly_once(builder, num_stages, num_micro_batches):
    schedule = builder(num_stages, num_micro_batches)
    assert len(schedule.per_stage) == num_stages
    for s in range(num_stages):
        row = schedule.steps(s)
        expected = {Step(s, m, kind) for m in range(num_micro_batches)
                    for kind in ("forward", "backward")}
        assert len(row) == 2 * num_micro_batches
        assert set(row) == expected


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_forward_before_backward_on_each_stage(builder, num_stages,
                                               num_micro_batches):
    schedule = builder(num_stages, num_micro_batches)
    for s in range(num_stages):
        row = schedule.steps(s)
        for m in range(num_micro_batches):
            assert (row.index(Step(s, m, "forward"))
                    < row.index(Step(s, m, "backward")))


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_schedules_are_valid(builder, num_stages, num_micro_batches):
    assert builder(num_stages, num_micro_batches).is_valid()


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_backwards_run_in_micro_batch_order(builder, num_stages,
                                            num_micro_batches):
    schedule = builder(num_stages, num_micro_batches)
    for s in range(num_stages):
        order = [st.micro_batch for st in schedule.steps(s)
                 if st.kind == "backward"]
        assert order == list(range(num_micro_batches))


@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_one_f_one_b_in_flight(num_stages, num_micro_batches):
    schedule = one_f_one_b_schedule(num_stages, num_micro_batches)
    for s in range(num_stages):
        assert schedule.max_in_flight(s) <= num_stages - s
        assert schedule.max_in_flight(s) == min(num_stages - s,
                                                num_micro_batches)


@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_gpipe_in_flight(num_stages, num_micro_batches):
    schedule = gpipe_schedule(num_stages, num_micro_batches)
    for s in range(num_stages):
        assert schedule.max_in_flight(s) == num_micro_batches


def test_gpipe_table_two_stages_four_micro_batches():
    schedule = gpipe_schedule(2, 4)
    assert table(schedule) == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 F3 B0 B1 B2 B3",
    ]
    assert schedule.per_stage == (
        parse_row(0, "F0 F1 F2 F3 B0 B1 B2 B3"),
        parse_row(1, "F0 F1 F2 F3 B0 B1 B2 B3"),
    )
    assert schedule.strategy == "PreferForward"


def test_one_f_one_b_table_two_stages_four_micro_batches():
    schedule = one_f_one_b_schedule(2, 4)
    assert schedule.per_stage == (
        parse_row(0, "F0 F1 B0 F2 B1 F3 B2 B3"),
        parse_row(1, "F0 B0 F1 B1 F2 B2 F3 B3"),
    )
    assert schedule.strategy == "PreferBackward"


def test_one_f_one_b_fewer_micro_batches_than_stages():
    schedule = one_f_one_b_schedule(4, 2)
    assert table(schedule) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_format_table():
    assert one_f_one_b_schedule(2, 2).format_table() == (
        "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1")


def test_make_schedule_dispatches():
    assert make_schedule("PreferForward", 3, 5) == gpipe_schedule(3, 5)
    assert make_schedule("PreferBackward", 3, 5) == one_f_one_b_schedule(3, 5)


def test_make_schedule_unknown_strategy():
    with pytest.raises(ValueError) as info:
        make_schedule("Interleaved", 2, 4)
    assert isinstance(info.value, ConfigError)
    assert str(info.value) == (
        "unknown pipeline strategy 'Interleaved'; valid strategies are "
        "'PreferForward', 'PreferBackward'")


@pytest.mark.parametrize("strategy", ["PreferForward", "PreferBackward"])
@pytest.mark.parametrize("stages,micro,message", [
    (0, 4, "num_stages must be an integer >= 1, got 0"),
    (-1, 4, "num_stages must be an integer >= 1, got -1"),
    (2, 0, "num_micro_batches must be an integer >= 1, got 0"),
    (2, 2.0, "num_micro_batches must be an integer >= 1, got 2.0"),
    (True, 2, "num_stages must be an integer >= 1, got True"),
])
def test_make_schedule_bad_sizes(strategy, stages, micro, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        make_schedule(strategy, stages, micro)


def test_steps_out_of_range():
    with pytest.raises(ValueError, match="stage 2 is out of range; this "
                                         "schedule has stages 0..1"):
        gpipe_schedule(2, 2).steps(2)


def test_per_stage_row_count_checked():
    with pytest.raises(ValueError, match="per_stage has 1 rows but "
                                         "num_stages is 2"):
        Schedule(2, 1, "custom", (parse_row(0, "F0 B0"),))


def test_dependencies_two_stages_one_micro_batch():
    f0, b0 = Step(0, 0, "forward"), Step(0, 0, "backward")
    f1, b1 = Step(1, 0, "forward"), Step(1, 0, "backward")
    schedule = gpipe_schedule(2, 1)
    assert schedule.execution_dependencies() == [(f0, b0), (f1, b1)]
    assert schedule.data_dependencies() == [(f0, f1), (b1, b0), (f1, b1)]
    assert schedule.dependencies() == [(f0, b0), (f1, b1), (f0, f1),
                                       (b1, b0)]


def test_execution_dependencies_are_consecutive_pairs():
    schedule = one_f_one_b_schedule(3, 4)
    pairs = schedule.execution_dependencies()
    assert len(pairs) == 3 * (2 * 4 - 1)
    for before, after in pairs:
        row = schedule.steps(before.stage)
        assert row.index(after) == row.index(before) + 1


def test_deadlocking_order_is_invalid():
    # Stage 0 waits for B(1,0) before F(0,1); stage 1 runs F1 before B0,
    # which needs F(0,1): a cycle.
    schedule = Schedule(2, 2, "custom", [
        parse_row(0, "F0 B0 F1 B1"),
        parse_row(1, "F0 F1 B0 B1"),
    ])
    assert not schedule.is_valid()
    with pytest.raises(ValueError, match="schedule 'custom' is invalid"):
        schedule.timeline()


def test_backward_before_forward_is_invalid():
    assert not Schedule(1, 1, "custom", [parse_row(0, "B0 F0")]).is_valid()


def test_missing_or_repeated_step_is_invalid():
    assert not Schedule(1, 2, "custom", [parse_row(0, "F0 B0 F1")]).is_valid()
    assert not Schedule(1, 1, "custom",
                        [parse_row(0, "F0 F0 B0")]).is_valid()


def test_hand_built_valid_schedule():
    schedule = Schedule(2, 2, "custom", [
        parse_row(0, "F0 F1 B1 B0"),
        parse_row(1, "F0 F1 B1 B0"),
    ])
    assert schedule.is_valid()


def test_timeline_gpipe_two_stages():
    times = gpipe_schedule(2, 2).timeline(forward_time=1, backward_time=2)
    spans = {str(step) + f"@{step.stage}": (t.start, t.end)
             for step, t in times.items()}
    assert spans == {
        "F0@0": (0, 1), "F1@0": (1, 2), "B0@0": (5, 7), "B1@0": (7, 9),
        "F0@1": (1, 2), "F1@1": (2, 3), "B0@1": (3, 5), "B1@1": (5, 7),
    }


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_timeline_respects_dependencies(builder, num_stages,
                                        num_micro_batches):
    schedule = builder(num_stages, num_micro_batches)
    times = schedule.timeline(forward_time=1, backward_time=2)
    assert set(times) == set(schedule.all_steps())
    for before, after in schedule.dependencies():
        assert times[before].end <= times[after].start
    for step, t in times.items():
        assert t.end - t.start == (1 if step.kind == "forward" else 2)


@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_gpipe_bubble_matches_analytic(num_stages, num_micro_batches):
    schedule = gpipe_schedule(num_stages, num_micro_batches)
    expected = (num_stages - 1) / (num_micro_batches + num_stages - 1)
    per_stage = schedule.stage_bubble_fractions(1, 1)
    assert per_stage == pytest.approx([expected] * num_stages)
    assert schedule.bubble_fraction(1, 1) == pytest.approx(expected)


@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
def test_one_f_one_b_bubble_equals_gpipe(num_stages, num_micro_batches):
    gpipe = gpipe_schedule(num_stages, num_micro_batches)
    one_f_one_b = one_f_one_b_schedule(num_stages, num_micro_batches)
    assert one_f_one_b.bubble_fraction(1, 1) == pytest.approx(
        gpipe.bubble_fraction(1, 1))


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("num_stages,num_micro_batches", SIZES)
@pytest.mark.parametrize("forward_time,backward_time",
                         [(1, 1), (1, 2), (2, 1), (0.5, 3)])
def test_makespan_of_flush_schedules(builder, num_stages, num_micro_batches,
                                     forward_time, backward_time):
    schedule = builder(num_stages, num_micro_batches)
    assert schedule.makespan(forward_time, backward_time) == pytest.approx(
        (num_micro_batches + num_stages - 1) * (forward_time + backward_time))


def test_single_stage_has_no_bubble():
    assert gpipe_schedule(1, 3).bubble_fraction() == 0.0
    assert one_f_one_b_schedule(1, 3).stage_bubble_fractions() == (0.0,)


@pytest.mark.parametrize("forward_time,backward_time,name", [
    (0, 1, "forward_time"), (1, -2, "backward_time")])
def test_timeline_rejects_non_positive_times(forward_time, backward_time,
                                             name):
    with pytest.raises(ValueError, match=f"^{name} must be > 0"):
        gpipe_schedule(2, 2).timeline(forward_time, backward_time)


def test_schedule_is_frozen_and_hashable():
    schedule = one_f_one_b_schedule(2, 2)
    with pytest.raises(AttributeError):
        schedule.num_stages = 3
    assert hash(schedule) == hash(one_f_one_b_schedule(2, 2))
    assert isinstance(schedule.per_stage, tuple)
    assert all(isinstance(row, tuple) for row in schedule.per_stage)
