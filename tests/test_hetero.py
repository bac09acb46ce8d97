"""The heterogeneous VN solver: optimal against brute force, limits respected, clear errors."""

from __future__ import annotations

import itertools
import random

import pytest

from virtualflow.plan.hetero import InfeasibleAssignment, blocks, brute_force, predict_step_s, solve


def test_optimal_on_every_small_case():
    # Every worker count 1..5, V up to 16, speeds drawn from a grid with ties and big ratios.
    rng = random.Random(0)
    grid = [0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    cases = 0
    for n in range(1, 6):
        for V in range(n, 17):
            for _ in range(6 if n > 2 else 10):
                t = [rng.choice(grid) * rng.uniform(0.9, 1.1) for _ in range(n)]
                plan = solve(V, t)
                assert sum(plan.counts) == V and min(plan.counts) >= 1
                assert plan.predicted_step_s == pytest.approx(brute_force(V, t), rel=1e-12)
                cases += 1
    assert cases > 500


def test_exhaustive_integer_speeds_two_and_three_workers():
    for t in itertools.product([1, 2, 3, 5], repeat=3):
        for V in range(3, 13):
            assert solve(V, list(t)).predicted_step_s == brute_force(V, list(t))


def test_known_answers_and_blocks():
    plan = solve(16, [1.0, 1.0, 3.0, 3.0])
    assert plan.counts == [6, 6, 2, 2] and plan.predicted_step_s == 6.0
    assert solve(8, [1.0, 1.0], reduction_s=0.5).predicted_step_s == 4.5
    assert blocks([2, 1, 3]) == [[0, 1], [2], [3, 4, 5]]
    assert predict_step_s([6, 6, 2, 2], [1, 1, 3, 3]) == 6
    # Ties go to the lower rank: deterministic.
    assert solve(5, [1.0, 1.0]).counts == [3, 2]


def test_memory_limit_and_infeasible_inputs_name_the_limit():
    with pytest.raises(InfeasibleAssignment, match=r"worker 1 can hold VN batches of at most 8 samples.*B/V = 16"):
        solve(4, [1.0, 1.0], vn_batch=16, memory_limits=[None, 8])
    assert solve(4, [1.0, 1.0], vn_batch=8, memory_limits=[None, 8]).counts == [2, 2]
    with pytest.raises(InfeasibleAssignment, match="virtual_nodes=2 is smaller than the 3 workers"):
        solve(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"time_per_vn\[1\]=0"):
        solve(4, [1.0, 0])
