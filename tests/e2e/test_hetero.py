"""The heterogeneous VN solver: optimal against brute force, limits respected, clear errors."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetero_reference import brute_force, brute_force_uneven
from virtualflow.plan.hetero import InfeasibleAssignment, blocks, predict_step_s, solve


def test_optimal_on_every_small_case():
    # Every worker count 1..5, V up to 16, speeds drawn from a grid with ties and big ratios; both
    # with zero counts allowed (the default) and with every worker forced to run a VN.
    rng = random.Random(0)
    grid = [0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 20.0]
    cases = zeros = 0
    for min_vns in (0, 1):
        for n in range(1, 6):
            for V in range(max(1, n * min_vns), 17):
                for _ in range(6 if n > 2 else 10):
                    t = [rng.choice(grid) * rng.uniform(0.9, 1.1) for _ in range(n)]
                    plan = solve(V, t, min_vns=min_vns)
                    assert sum(plan.counts) == V and min(plan.counts) >= min_vns
                    assert plan.predicted_step_s == pytest.approx(brute_force(V, t, min_vns), rel=1e-12)
                    assert plan.predicted_step_s == pytest.approx(predict_step_s(plan.counts, t), rel=1e-12)
                    cases += 1
                    zeros += min(plan.counts) == 0
    assert cases > 1000 and zeros > 200  # zero counts are really exercised (252 here)


def test_exhaustive_integer_speeds_two_and_three_workers():
    for t in itertools.product([1, 2, 3, 5, 9], repeat=3):
        for V in range(1, 13):
            assert solve(V, list(t)).predicted_step_s == brute_force(V, list(t))
            if V >= 3:
                assert solve(V, list(t), min_vns=1).predicted_step_s == brute_force(V, list(t), min_vns=1)
    for t in itertools.product([1, 2, 7], repeat=2):
        for V in range(1, 10):
            assert solve(V, list(t)).predicted_step_s == brute_force(V, list(t))


def test_a_very_slow_worker_gets_no_vn_when_that_is_faster():
    # {1,1,1,8} at V=16: forcing a VN onto the slow worker makes it the bottleneck (8 t);
    # leaving it out gives 6-5-5-0 (6 t), the optimum.
    plan = solve(16, [1.0, 1.0, 1.0, 8.0])
    assert plan.counts == [6, 5, 5, 0] and plan.predicted_step_s == 6.0
    assert solve(16, [1.0, 1.0, 1.0, 8.0], min_vns=1).predicted_step_s == 8.0
    assert plan.blocks() == [list(range(6)), list(range(6, 11)), list(range(11, 16)), []]
    # The benchmark's case: V=24, the slow worker's VN slightly slower than 8 fast ones.
    assert solve(24, [21.2, 21.3, 21.1, 170.4]).counts == [8, 8, 8, 0]
    # Once it gets faster (a probe measured it), it is given VNs again.
    assert solve(24, [21.2, 21.3, 21.1, 40.0]).counts[3] > 0
    # Zero counts only where they help: equal workers all work.
    assert solve(8, [1.0, 1.0, 1.0]).counts == [3, 3, 2]


def test_known_answers_and_blocks():
    plan = solve(16, [1.0, 1.0, 3.0, 3.0])
    assert plan.counts == [6, 6, 2, 2] and plan.predicted_step_s == 6.0
    assert solve(8, [1.0, 1.0], reduction_s=0.5).predicted_step_s == 4.5
    assert blocks([2, 1, 3]) == [[0, 1], [2], [3, 4, 5]]
    assert blocks([2, 0, 1]) == [[0, 1], [], [2]]
    assert predict_step_s([6, 6, 2, 2], [1, 1, 3, 3]) == 6
    # Ties go to the lower rank: deterministic.
    assert solve(5, [1.0, 1.0]).counts == [3, 2]


def test_memory_limit_and_infeasible_inputs_name_the_limit():
    with pytest.raises(InfeasibleAssignment, match=r"worker 1 can hold VN batches of at most 8 samples.*B/V = 16"):
        solve(4, [1.0, 1.0], vn_batch=16, memory_limits=[None, 8])
    assert solve(4, [1.0, 1.0], vn_batch=8, memory_limits=[None, 8]).counts == [2, 2]
    # With zero counts allowed, fewer VNs than workers is a valid map; with min_vns=1 it is not.
    assert solve(2, [1.0, 1.0, 1.0]).counts == [1, 1, 0]
    with pytest.raises(InfeasibleAssignment, match="virtual_nodes=2 is smaller than the 3 workers x min_vns=1"):
        solve(2, [1.0, 1.0, 1.0], min_vns=1)
    with pytest.raises(ValueError, match=r"time_per_vn\[1\]=0"):
        solve(4, [1.0, 0])
    with pytest.raises(ValueError, match="min_vns=-1"):
        solve(4, [1.0], min_vns=-1)


# -- a member with no VN: the engine, over a real gloo group (one thread per worker) -----------
import datetime
import threading

import torch
import torch.distributed as dist
from torch import nn

import virtualflow as vf
from conftest import assert_state_equal
from vn_reference import deterministic_reference
import jobs
from virtualflow.comm.groups import Group, make_group
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.engine import BatchLoader, VNEngine


def _bn_net() -> nn.Module:
    # BatchNorm (running statistics and batch counters) but no dropout: the threads share the
    # process's random generator, which only matters for layers that draw from it. (SGD, not
    # Adam: Adam turns the rounding noise in the near-zero gradient of the bias before a
    # BatchNorm into full-size steps, so default mode could not be compared with a tolerance.)
    return nn.Sequential(nn.Linear(jobs.FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def _bn_job(batchnorm: str) -> vf.Job:
    # Paced (4 ms of sleep per VN): a probe (one VN) then surely fits in the idle member's wait
    # for the others' 3+ VNs, whatever the load on the cores, so probes follow PROBE_EVERY.
    return vf.Job(name="bn", model=_bn_net, optimizer=jobs.sgd, loss=jobs.paced_cross_entropy,
                  dataset=jobs.classification_data, global_batch_size=48, virtual_nodes=8,
                  batchnorm=batchnorm, lr_scheduler=jobs.step_lr, seed=4)


def _engine(job: vf.Job, deterministic: bool) -> VNEngine:
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    ds = job.build_dataset()
    plan = DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed)
    return VNEngine(model, opt, job.lr_scheduler(opt), job.loss, plan, BatchLoader(ds, None), seed=job.seed,
                    batchnorm=job.batchnorm, deterministic=deterministic, device=torch.device("cpu"))


def _train_in_threads(job: vf.Job, assignment: list[list[int]], steps: int, deterministic: bool):
    """Each worker's final state and per-step compute_s, one engine per thread."""
    n = len(assignment)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    out: list = [None] * n
    errors: list = []
    # Built here, one after another: the initial weights come from the process's generator,
    # which the threads share (the real workers build theirs in separate processes).
    engines = [_engine(job, deterministic) for _ in range(n)]

    def body(rank: int) -> None:
        try:
            eng = engines[rank]
            # A store client per thread: one client's blocking waits would stall the other's.
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))
            group = make_group(client, 0, rank, n, 60.0, torch.device("cpu")) if n > 1 else Group(0, 0, 1, None)
            eng.set_membership(group, assignment)
            compute = [eng.step(s).compute_s for s in range(steps)]
            out[rank] = ({k: v.detach().clone() for k, v in eng.model.state_dict().items()}, compute)
            group.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(o is not None for o in out), "a worker thread did not finish in 120 s"
    return out


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("batchnorm", ["mean", "first"])
@pytest.mark.parametrize("assignment", [[[0, 1, 2, 3, 4], [], [5, 6, 7]], [[], list(range(8))]],
                         ids=["middle-idle", "rank0-idle"])
def test_a_member_with_no_vn_trains_the_same_weights(deterministic, batchnorm, assignment):
    job = _bn_job(batchnorm)
    steps = 10
    ref = _train_in_threads(job, [list(range(8))], steps, deterministic)[0][0]
    runs = _train_in_threads(job, assignment, steps, deterministic)
    idle = next(r for r, a in enumerate(assignment) if not a)
    for state, _ in runs:
        # Every member, the idle one included (BatchNorm statistics and batch counters too),
        # holds the same state: bit-identical to each other in both modes (same reduced values).
        assert_state_equal(state, runs[0][0])
    if deterministic:
        assert_state_equal(runs[idle][0], ref)  # the fixed tree: bit-identical to one worker
    else:
        from conftest import assert_state_close

        assert_state_close(runs[idle][0], ref, rtol=1e-5, atol=1e-6)
    # The idle member's speed stays measured: its probes show up in its compute_s slot (a step
    # reports the previous step's times), at least every PROBE_EVERY steps after the first.
    probes = [s for s, c in enumerate(runs[idle][1]) if c[idle] > 0]
    assert probes and probes[0] == 1
    assert all(b - a <= 4 for a, b in zip(probes, probes[1:])) and probes[-1] >= steps - 4
    assert all(c[idle] == 0 for s, c in enumerate(runs[idle][1]) if s not in probes)


def test_probes_of_a_much_slower_idle_member_are_spaced_by_their_cost():
    """A probe that outlasts the wait is spaced so its delay costs <= PROBE_BUDGET of the step."""
    from virtualflow.runtime.engine import PROBE_BUDGET, PROBE_EVERY, probe_due

    def first_due(estimate_s, idle_s, **kw):
        return next(n for n in range(1, 100_000) if probe_due(n, estimate_s, idle_s, **kw))

    # Fits in the wait: every PROBE_EVERY steps.
    assert [probe_due(n, 0.010, 0.100) for n in range(1, PROBE_EVERY + 1)] == [False] * (PROBE_EVERY - 1) + [True]
    assert first_due(0.100, 0.100) == PROBE_EVERY
    # 1 s longer than a 0.1 s wait: 1 / (PROBE_BUDGET x 0.1) = 500 steps apart, and the delay a
    # probe adds, amortised over them, is PROBE_BUDGET of the wait.
    assert first_due(1.100, 0.100) == 500
    assert (1.100 - 0.100) / first_due(1.100, 0.100) == pytest.approx(PROBE_BUDGET * 0.100)
    assert first_due(0.150, 0.100) == max(PROBE_EVERY, math.ceil(0.050 / (PROBE_BUDGET * 0.100))) == 25
    # After a speed change (a burst), probes that fit in the wait run at once; longer ones do not.
    assert probe_due(1, 0.050, 0.100, burst=2)
    assert not probe_due(1, 0.150, 0.100, burst=2)
    # Wait not measured yet (the first step): no probe, however long ago the last one was.
    assert not probe_due(10_000, 0.010, 0.0)
    # Nothing measured yet (no forward run, or no estimate): probe now.
    assert probe_due(1, 0.010, 0.0, ran_forward=False)
    assert probe_due(1, 0.0, 0.100)


# -- end to end: emulated unequal workers ----------------------------------------------------
import json
import os
import time


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
    # A straggler appears: worker 0 becomes 10x slow. The map must follow within a bounded
    # number of steps (observations + patience + the boundary), without stopping the job. (At
    # 5x, on a busy machine, the speed model's noise pooled worker 0's ~40 ms a VN with worker
    # 1's ~22 ms as one speed: the first rebalance went to 4-4 only, and the next, a third
    # faster, waited 31-130 steps for the noise margin; at 10x it is 1-7 after 11 steps.)
    while handle.status()["generation"] != handle.status()["formed_generation"]:
        time.sleep(0.02)
    handle.set_slowdown(0, 10.0)
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
    ref = deterministic_reference(job.replace(loss=jobs.cross_entropy), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
    kinds = [e["reason"] for e in _events(run_dir, "generation")]
    assert kinds[0] == "start" and set(kinds[1:]) == {"rebalance"}


@pytest.mark.slow
def test_a_worker_too_slow_to_help_gets_no_vn_trains_bit_identical_weights_and_comes_back(run_dir):
    # Worker 1 is 16x slow: one VN of it (~80 ms) outlasts worker 0's eight (~40 ms), so the
    # solver leaves it without VNs; it stays a member. When it gets fast again, its probes show
    # it and the map gives it VNs back, within a bounded number of steps. Two workers, so that
    # giving VNs back predicts nearly half the step (8 VNs -> 4): a gain far above the
    # rebalance's hysteresis (threshold + 3 standard errors of the speeds), which grows with the
    # machine's noise; on a busy machine a gain of a quarter (8 VNs on 3 workers: 4 -> 3) did not
    # clear it.
    job = jobs.elastic_job()
    handle = vf.launch(job, workers=2, steps=1_000_000, slowdowns=[1, 16], deterministic=True, run_dir=run_dir)
    deadline = time.monotonic() + 120

    def counts():
        st = handle.status()
        return st, {w["id"]: len(w["vns"]) for w in st["workers"] if w["rank"] is not None}

    while True:
        st, c = counts()
        if st["generation"] >= 1 and st["generation"] == st["formed_generation"] and c.get(1) == 0:
            break
        assert time.monotonic() < deadline and not handle.done, st
        time.sleep(0.02)
    assert c == {0: 8, 1: 0}
    step0 = st["step"]
    while handle.status()["step"] < step0 + 10:  # a few steps with an idle member
        time.sleep(0.02)
    handle.set_slowdown(1, 1.0)
    step0, gen0 = handle.status()["step"], handle.status()["generation"]
    while True:
        st, c = counts()
        if st["generation"] > gen0 and c.get(1, 0) > 0:
            break
        assert st["step"] - step0 < 150, f"worker 1 got no VN back within 150 steps: {st}"
        assert time.monotonic() < deadline + 60 and not handle.done
        time.sleep(0.02)
    result = handle.stop()
    ref = deterministic_reference(job.replace(loss=jobs.cross_entropy), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
    maps = [[len(a) for a in e["assignment"]] for e in _events(run_dir, "generation")]
    assert maps[0] == [4, 4] and [8, 0] in maps and maps[-1][1] > 0


def test_memory_limit_below_the_vn_batch_is_refused_before_start():
    with pytest.raises(ValueError, match=r"worker 1 can hold VN batches of at most 2 samples.*B/V = 4"):
        vf.launch(jobs.regression_job(), workers=2, steps=3,
                  worker_specs=[vf.WorkerSpec(), vf.WorkerSpec(memory_limit=2)])
    with pytest.raises(ValueError, match="slowdown=0.5 must be a number >= 1"):
        vf.WorkerSpec(slowdown=0.5)
    with pytest.raises(ValueError, match="slowdowns has 1 values for workers=2"):
        vf.launch(jobs.regression_job(), workers=2, steps=3, slowdowns=[2.0])


def test_uneven_solver_is_optimal_against_brute_force_and_respects_memory():
    from virtualflow.plan.hetero import solve_uneven

    rng = random.Random(1)
    for _ in range(60):
        n = rng.choice([1, 2, 3])
        V = rng.randint(n, 6)
        B = rng.randint(V, 14)
        a = [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)]
        b = [rng.choice([0.1, 0.2, 0.5]) for _ in range(n)]
        mem = [rng.choice([None, 2, 3, 5]) for _ in range(n)]
        best = brute_force_uneven(V, B, a, b, mem)
        if best == float("inf"):
            with pytest.raises(InfeasibleAssignment):
                solve_uneven(V, B, a, b, memory_limits=mem)
            continue
        plan = solve_uneven(V, B, a, b, memory_limits=mem)
        assert plan.predicted_step_s == pytest.approx(best, abs=1e-9)
        assert sum(plan.counts) == V and sum(plan.samples) == B and sum(plan.vn_sizes) == B
        for i, m in enumerate(mem):
            own = plan.vn_sizes[sum(plan.counts[:i]) : sum(plan.counts[: i + 1])]
            assert min(own) >= 1 and (m is None or max(own) <= m)


def test_uneven_sizes_give_the_fast_worker_more_samples():
    from virtualflow.plan.hetero import solve_uneven

    # Worker 1 is 3x slower per sample; with equal VN counts forced by V=2 it gets smaller VNs.
    plan = solve_uneven(2, 64, [0.0, 0.0], [1.0, 3.0])
    assert plan.counts == [1, 1] and plan.samples == [48, 16] and plan.vn_sizes == [48, 16]


def test_data_plan_with_uneven_vn_sizes_covers_the_batch_exactly():
    from virtualflow.plan.data import DataPlan

    plan = DataPlan(100, 20, 4, seed=3)
    even = [plan.vn_indices(5, v) for v in range(4)]
    plan.set_vn_sizes([8, 8, 2, 2])
    uneven = [plan.vn_indices(5, v) for v in range(4)]
    assert [len(x) for x in uneven] == [8, 8, 2, 2]
    assert torch_equal_cat(even, uneven)
    with pytest.raises(ValueError, match="summing to global_batch_size=20"):
        plan.set_vn_sizes([8, 8, 2, 1])


def torch_equal_cat(a, b) -> bool:
    import torch

    return torch.equal(torch.cat(a), torch.cat(b))


@pytest.mark.slow
def test_uneven_vn_sizes_give_the_fast_worker_bigger_vns_and_the_same_gradient(run_dir):
    job = jobs.paced_regression_job()
    handle = vf.launch(job, workers=2, steps=1_000_000, slowdowns=[1, 3], uneven_vn_sizes=True, run_dir=run_dir)
    deadline = time.monotonic() + 120
    while handle.status()["generation"] < 1 or handle.status()["generation"] != handle.status()["formed_generation"]:
        assert time.monotonic() < deadline and not handle.done
        time.sleep(0.02)
    step = handle.status()["step"]
    while handle.status()["step"] < step + 5:
        time.sleep(0.02)
    result = handle.stop()
    sizes = _events(run_dir, "generation")[-1]["vn_sizes"]
    assert sizes is not None and sum(sizes) == 64
    vns = _events(run_dir, "generation")[-1]["assignment"]
    fast = sum(sizes[v] for v in vns[0])
    assert fast > 40  # the 3x faster worker takes most of the global batch
    # No BatchNorm or dropout: the step is the exact mean gradient over B for any VN sizes.
    # vf.train(job.replace(loss=jobs.mse), workers=1, steps=result.steps): the worker's engine, in this process
    from conftest import assert_state_close
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.grid_threads import Generation, train_threads

    ref = train_threads(job.replace(loss=jobs.mse), [Generation(members=(0,), steps=result.steps)],
                        options=WorkerOptions(deterministic=False, breakdown=False))
    assert_state_close(result.state_dict, ref.state["model"], rtol=1e-5, atol=1e-6)
