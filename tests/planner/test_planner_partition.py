"""The one stage-partition DP and the one stage order (epl.planner.stage_cuts)."""
from __future__ import annotations

import itertools
import random

import pytest

from epl.errors import ClusterError
from epl.planner import plan, stage_cuts
from epl.planner.stage_cuts import min_max_partition, stage_device_order


def _brute(costs, stages, speeds, cuts, weights, fits):
    """Every partition: (slowest stage, total weight) of the best, and the set
    of partitions reaching it."""
    n = len(costs)
    weight_of = dict(zip(cuts, weights))
    best, winners = None, []
    for chosen in itertools.combinations(cuts, stages - 1):
        bounds = list(zip((0,) + chosen, chosen + (n,)))
        if fits and not all(fits(s, a, b) for s, (a, b) in enumerate(bounds)):
            continue
        key = (max(sum(costs[a:b]) / speeds[s]
                   for s, (a, b) in enumerate(bounds)),
               sum(weight_of[c] for c in chosen))
        if best is None or key < best:
            best, winners = key, [bounds]
        elif key == best:
            winners.append(bounds)
    return best, winners


def _key(costs, bounds, speeds, cuts, weights):
    weight_of = dict(zip(cuts, weights))
    return (max(sum(costs[a:b]) / speeds[s] for s, (a, b) in enumerate(bounds)),
            sum(weight_of[b] for _, b in bounds[:-1]))


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    stages = rng.randint(1, min(n, 4))
    costs = [float(rng.randint(1, 6)) for _ in range(n)]  # integers: many ties
    speeds = [rng.choice([1.0, 2.0, 0.5]) for _ in range(stages)]
    cuts = sorted(rng.sample(range(1, n), rng.randint(stages - 1, n - 1)))
    weights = [rng.randint(0, 3) for _ in cuts]
    limit = rng.choice([None, sum(costs) * 0.6])
    fits = None if limit is None else (
        lambda s, a, b: sum(costs[a:b]) <= limit)
    got = min_max_partition(costs, stages, speeds=speeds, allowed_cuts=cuts,
                            cut_weights=weights, fits=fits)
    best, winners = _brute(costs, stages, speeds, cuts, weights, fits)
    if best is None:
        assert got is None
        return
    assert got in winners
    assert _key(costs, got, speeds, cuts, weights) == best


def test_partition_defaults_cut_every_boundary_ties_to_the_earliest_last_stage():
    # [1, 1, 1, 1] into 2: only (0,2),(2,4) reaches 2; into 3: max 2, and the
    # last stage starts as early as it can.
    assert min_max_partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert min_max_partition([1, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    assert min_max_partition([5.0], 1) == [(0, 1)]


def test_partition_speeds_give_a_faster_device_a_longer_stage():
    assert min_max_partition([1.0] * 6, 2, speeds=[2.0, 1.0]) == [(0, 4), (4, 6)]


def test_partition_cut_weights_break_ties_in_the_slowest_stage():
    # 3 stages: the first is the 10 alone; cuts {1, 2} and {1, 3} both reach
    # 10, the lighter cut wins; without weights the last stage starts earlier
    costs = [10.0, 1.0, 1.0, 1.0]
    assert min_max_partition(costs, 3, allowed_cuts=[1, 2, 3],
                             cut_weights=[1, 3, 1]) == [(0, 1), (1, 3), (3, 4)]
    assert min_max_partition(costs, 3) == [(0, 1), (1, 2), (2, 4)]


def test_partition_fits_and_too_few_cuts():
    assert min_max_partition([1, 1, 1], 3, allowed_cuts=[1]) is None
    assert min_max_partition([1, 1], 3) is None
    assert min_max_partition([1, 1, 1], 2, fits=lambda s, a, b: b - a == 1
                             ) is None
    assert min_max_partition([4, 1, 1], 2, fits=lambda s, a, b: s == 1 or
                             b - a == 1) == [(0, 1), (1, 3)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_cuts=[2, 1]), "allowed cuts must be increasing"),
    (dict(allowed_cuts=[0]), "allowed cuts must be increasing"),
    (dict(allowed_cuts=[1], cut_weights=[1, 2]), "2 cut weights for 1"),
    (dict(speeds=[1.0, 0.0]), "stage speeds must be positive"),
])
def test_partition_bad_inputs(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        min_max_partition([1.0, 1.0, 1.0], 2, **kwargs)


def test_stage_device_order_memory_then_speed_then_index():
    assert stage_device_order([16.0, 32.0, 32.0, 16.0]) == [1, 2, 0, 3]
    assert stage_device_order([16.0, 32.0, 32.0, 16.0],
                              [1.0, 1.0, 2.0, 3.0]) == [2, 1, 3, 0]
    with pytest.raises(ClusterError, match="2 memory figures but 1"):
        stage_device_order([1.0, 2.0], [1.0])


def test_one_stage_device_order():
    assert plan.stage_device_order is stage_cuts.stage_device_order


def test_balance_stages_unchanged_on_ties():
    cuts = stage_cuts.balance_stages([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert cuts.bounds == ((0, 1), (1, 2), (2, 4))
