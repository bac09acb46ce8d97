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


# -- end to end: emulated unequal workers ----------------------------------------------------
import json
import os
import time

import virtualflow as vf
from conftest import assert_state_equal
import jobs


def _events(run_dir, kind):
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


@pytest.mark.slow
def test_heterogeneous_map_trains_bit_identical_weights_and_follows_a_straggler(run_dir):
    job = jobs.elastic_job()
    handle = vf.launch(job, workers=2, steps=1_000_000, slowdowns=[1, 3], deterministic=True, run_dir=run_dir)
    deadline = time.monotonic() + 120
    while handle.status()["generation"] < 1:  # the profiler's first measurements rebalance 4/4
        assert time.monotonic() < deadline and not handle.done
        time.sleep(0.02)
    vns = {w["id"]: len(w["vns"]) for w in handle.status()["workers"]}
    assert vns[0] > vns[1]  # the fast worker runs more virtual nodes
    # A straggler appears: worker 0 becomes 5x slow. The map must follow within a bounded
    # number of steps (observations + patience + the boundary), without stopping the job.
    while handle.status()["generation"] != handle.status()["formed_generation"]:
        time.sleep(0.02)
    handle.set_slowdown(0, 5.0)
    step0, gen0 = handle.status()["step"], handle.status()["generation"]
    while True:
        st = handle.status()
        counts = {w["id"]: len(w["vns"]) for w in st["workers"]}
        if st["generation"] > gen0 and counts[0] < counts[1]:
            break
        assert st["step"] - step0 < 40, "no rebalance within 40 steps of the slowdown"
        assert time.monotonic() < deadline + 120 and not handle.done
        time.sleep(0.02)
    result = handle.stop()
    ref = vf.train(job.replace(loss=jobs.cross_entropy), workers=1, steps=result.steps, deterministic=True)
    assert_state_equal(result.state_dict, ref.state_dict)
    kinds = [e["reason"] for e in _events(run_dir, "generation")]
    assert kinds[0] == "start" and set(kinds[1:]) == {"rebalance"}


def test_memory_limit_below_the_vn_batch_is_refused_before_start():
    with pytest.raises(ValueError, match=r"worker 1 can hold VN batches of at most 2 samples.*B/V = 4"):
        vf.launch(jobs.regression_job(), workers=2, steps=3,
                  worker_specs=[vf.WorkerSpec(), vf.WorkerSpec(memory_limit=2)])
    with pytest.raises(ValueError, match="slowdown=0.5 must be a number >= 1"):
        vf.WorkerSpec(slowdown=0.5)
    with pytest.raises(ValueError, match="slowdowns has 1 values for workers=2"):
        vf.launch(jobs.regression_job(), workers=2, steps=3, slowdowns=[2.0])
