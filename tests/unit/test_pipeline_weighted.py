"""Speed-weighted micro-batch shares of pipeline replicas (``plan/replica_shares.py``, the
speed policy's pipeline path, the controller's failover, launch refusals) and what training with
unequal shares gives: the same model, bit for bit in deterministic mode.

Pure and in-process: no worker process starts.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

import pipeline_models as pm
from conftest import assert_state_close, assert_state_equal
import virtualflow as vf
from virtualflow.backends.inprocess import build_engine
from virtualflow.config.pipeline import Pipeline
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import MembershipController, Rebalance, SpeedPolicy
from virtualflow.plan.pipeline import build_schedule, simulate
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.pipeline.schedules import SCHEDULE_NAMES
from virtualflow.plan.replica_shares import (ReplicaTime, microbatch_rule, per_worker, predict_step_s, replica_blocks,
                                             replica_time, solve_shares, stage_seconds)
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime import breakdown
from virtualflow.runtime.pipeline.local import LocalDriver

from test_membership_policies import FakeLauncher, formed


# -- the pure solver -------------------------------------------------------------------------------
def brute_force(V: int, times: list[ReplicaTime], mins: list[int], multiple: int) -> Fraction | float:
    best = None
    ranges = [range(lo, V + 1, multiple) for lo in mins]
    for counts in itertools.product(*ranges):
        if sum(counts) == V:
            t = predict_step_s(counts, times)
            best = t if best is None else min(best, t)
    return best


def test_the_solver_is_optimal_against_brute_force_of_its_model():
    rng = random.Random(0)
    cases = 0
    for _ in range(400):
        d = rng.randint(1, 4)
        multiple = rng.choice([1, 1, 1, 2, 3])
        mins = [multiple * rng.randint(1, 2) for _ in range(d)]
        V = multiple * rng.randint(sum(mins) // multiple, 16 // multiple + d)
        if V < sum(mins):
            continue
        # exact arithmetic: ties are real ties, so the comparison is exact
        times = [ReplicaTime(Fraction(rng.randint(0, 12), 4), Fraction(rng.randint(1, 12), 4)) for _ in range(d)]
        plan = solve_shares(V, times, minimum=mins, multiple=multiple)
        assert sum(plan.counts) == V and all(c >= lo and c % multiple == 0 for c, lo in zip(plan.counts, mins))
        assert plan.predicted_step_s == predict_step_s(plan.counts, times) == brute_force(V, times, mins, multiple)
        cases += 1
    assert cases > 300


def test_the_bubble_is_paid_whatever_the_share_so_shares_are_not_proportional_to_speed():
    # 3 stages, replica 1 twice as slow: per micro-batch 1 vs 2, bubble (p - 1) stage times.
    fast, slow = replica_time([1.0] * 3), replica_time([2.0] * 3)
    assert (fast.fixed_s, fast.per_mb_s, slow.fixed_s, slow.per_mb_s) == (2.0, 1.0, 4.0, 2.0)
    plan = solve_shares(12, [fast, slow])
    assert plan.counts == [9, 3] and plan.predicted_step_s == 11.0  # equal 6/6: 16; proportional 8/4: 12
    assert predict_step_s([6, 6], [fast, slow]) == 16.0 and predict_step_s([8, 4], [fast, slow]) == 12.0
    # Equal replicas: equal shares (at most one apart, the lower replica first).
    assert solve_shares(7, [fast, fast, fast]).counts == [3, 2, 2]
    # Every replica keeps at least one micro-batch, however slow.
    assert solve_shares(4, [fast, replica_time([100.0])]).counts == [3, 1]
    with pytest.raises(ValueError, match="virtual_nodes=1 cannot be split over 2 pipeline replicas"):
        solve_shares(1, [fast, fast])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_time_model_is_the_simulators_for_equal_stages_and_for_gpipe_at_any_stage_times(name):
    for f, m in itertools.product(([1, 1, 1], [1, 2], [1, 1, 2], [2, 1, 1], [1, 3, 1], [3]), range(1, 9)):
        sim = simulate(build_schedule(name, len(f), m), f, [2 * x for x in f])
        model = replica_time([3 * x for x in f]).time(m)
        if name == "gpipe" or len(set(f)) == 1 or max(f) == f[-1]:
            assert float(sim.step_time) == model, (f, m)
        else:  # 1F1B with the slowest worker before the last: the model is an upper bound
            assert float(sim.step_time) <= model, (f, m)


def test_the_micro_batch_rule_is_the_schedule_factorys():
    for name, p, chunks in itertools.product(SCHEDULE_NAMES, range(1, 5), (1, 2, 3)):
        if chunks > 1 and name != "interleaved_1f1b":
            continue
        lo, step = microbatch_rule(name, p, chunks)
        for m in range(1, 13):
            try:
                build_schedule(name, p, m, chunks, 2)
                ok = True
            except ValueError:
                ok = False
            assert ok == (m >= lo and m % step == 0), (name, p, chunks, m)


def test_a_generations_map_gives_each_replicas_block_and_falls_back_to_equal_blocks():
    blocks = [[0, 1, 2, 3, 4], [5, 6, 7]]
    flat = per_worker(blocks, [3, 2])
    assert flat == [blocks[0]] * 3 + [blocks[1]] * 2
    assert replica_blocks(flat, [3, 2], 8) == blocks
    for bad in (None, flat[:-1], [blocks[0]] * 2 + [blocks[1]] * 3, per_worker([[0, 1, 2], [4, 5, 6, 7]], [3, 2])):
        assert replica_blocks(bad, [3, 2], 8) == contiguous_assignment(8, 2)


def test_a_tensor_parallel_stage_is_paced_by_its_slowest_member_plus_its_collectives():
    # P = 2 stages of T = 2 workers, rank order: stage 0's two members, then stage 1's.
    assert stage_seconds([1.0, 2.0, 1.0, 1.0], tensor=2) == [2.0, 1.0]
    assert replica_time([1.0, 2.0, 1.0, 1.0], tensor=2) == ReplicaTime(1.0, 2.0)
    assert replica_time([1.0, 2.0, 1.0, 1.0], tensor=2, collective_s=0.5) == ReplicaTime(1.5, 2.5)
    # T = 1: every worker is a stage (the one-worker-per-stage model; the collectives do not apply)
    assert replica_time([1.0, 2.0, 1.0, 1.0]) == replica_time([1.0, 2.0, 1.0, 1.0], collective_s=0.5) \
        == ReplicaTime(3.0, 2.0)
    # the grouped model is the simulator's on the stage times (GPipe: exact for any stage times)
    for f, m in itertools.product(([1, 1, 2, 1], [3, 1, 1, 1], [1, 2, 2, 1]), range(1, 6)):
        stages = stage_seconds(f, tensor=2)
        sim = simulate(build_schedule("gpipe", len(stages), m), stages, [2 * x for x in stages])
        assert float(sim.step_time) == replica_time([3 * x for x in f], tensor=2).time(m), (f, m)
    with pytest.raises(ValueError, match=r"tensor=3 must be a positive integer dividing the replica's 4 workers"):
        replica_time([1.0] * 4, tensor=3)


# -- the speed policy and the controller -----------------------------------------------------------
def policy(V: int, **kw) -> SpeedPolicy:
    return SpeedPolicy(virtual_nodes=V, global_batch_size=None, uneven=False, memory_limits={},
                       assign=contiguous_assignment, **kw)


def shares(assignment: list[list[int]], sizes: list[int]) -> list[int]:
    return [len(assignment[sum(sizes[:j])]) for j in range(len(sizes))]


def test_stated_slowdowns_and_a_failed_over_replica_weigh_the_shares():
    p = policy(12, slowdowns={3: 2.0, 4: 2.0, 5: 2.0})
    members = list(range(6))
    equal = p.plan_pipeline_map(members, [1] * 6, [3, 3], balance=False)
    assert shares(equal.assignment, [3, 3]) == [6, 6]
    weighted = p.plan_pipeline_map(members, [1] * 6, [3, 3], balance=True)
    assert shares(weighted.assignment, [3, 3]) == [9, 3] and weighted.predicted_step_s is None  # stated
    # Bamboo: replica 1 lost its middle worker; its first worker runs job stages 0 and 1.
    failed = policy(12).plan_pipeline_map([0, 1, 2, 3, 5], [1, 1, 1, 2, 1], [3, 2], balance=True)
    assert shares(failed.assignment, [3, 2]) == [8, 4]  # (8 + 2) vs 1 + 4 * 2 stage times: 10 / 9 (6/6: 8 / 13)
    # A revert's per-member counts are kept.
    forced = p.plan_pipeline_map(members, [1] * 6, [3, 3], balance=True, counts=[5] * 3 + [7] * 3)
    assert shares(forced.assignment, [3, 3]) == [5, 7]


def test_measured_pipeline_workers_set_the_shares_and_a_drift_rebalances():
    p = policy(12, patience=2)
    members = list(range(4))  # 2 replicas x 2 stages
    plan = p.plan_pipeline_map(members, [1] * 4, [2, 2], balance=True)
    vns = plan.assignment
    assert shares(vns, [2, 2]) == [6, 6]
    p.new_generation(0)
    decision = None
    for k in range(8):  # replica 1's workers take 3x as long per micro-batch
        compute = [0.0] * 4 if k == 0 else [0.06, 0.06, 0.18, 0.18]
        p.observe({"type": "step", "step": k, "step_time_s": 1.2, "compute_s": compute, "members": members,
                   "vns": vns, "vn_sizes": None})
        decision = p.check(0, members, vns, None)
        if isinstance(decision, Rebalance):
            break
    # 0.01 and 0.03 s per micro-batch and stage: replica 0 takes 0.01 (bubble) + 0.01 m, replica 1
    # 0.03 + 0.03 m; 10/2 gives 0.11 s (6/6: 0.21 s, 9/3: 0.12 s)
    assert isinstance(decision, Rebalance) and decision.detail["replica_shares"] == [10, 2]
    assert p.stage_seconds(members)[1] == "measured"
    again = p.plan_pipeline_map(members, [1] * 4, [2, 2], balance=True)
    assert shares(again.assignment, [2, 2]) == [10, 2] and again.predicted_step_s == pytest.approx(0.11)


def test_stated_slowdowns_weigh_the_replicas_of_a_tensor_parallel_grid_by_each_stages_slowest_member():
    # (D, P, T) = (2, 2, 2), replica 1's four workers at slowdown 2. Per stage group: replica 0 takes
    # 1 + m stage times, replica 1 2 + 2 m; 11/5 gives 12 (12/4: 13). The one-worker-per-stage model
    # would read 4 stages per replica (bubble 3 and 6) and give 12/4.
    members = list(range(8))
    slow = {w: 2.0 for w in range(4, 8)}
    plan = policy(16, slowdowns=slow, tensor=2).plan_pipeline_map(members, [1] * 8, [4, 4], balance=True)
    assert shares(plan.assignment, [4, 4]) == [11, 5]
    assert plan.assignment[:4] == [list(range(11))] * 4 and plan.assignment[4:] == [list(range(11, 16))] * 4
    assert solve_shares(16, [replica_time([1.0] * 4), replica_time([2.0] * 4)]).counts == [12, 4]
    # A stage is paced by its slowest member: one slow member weighs as much as a slow group.
    for stated in ({4: 2.0}, {5: 2.0}, {4: 2.0, 5: 2.0}):
        one = policy(12, slowdowns=stated, tensor=2).plan_pipeline_map(members, [1] * 8, [4, 4], balance=True)
        assert shares(one.assignment, [4, 4]) == [8, 4]  # 1 + m vs 1 + 2 m: 9 and 9 (equal 6/6: 13)
    with pytest.raises(ValueError, match=r"tensor=0 must be a positive integer \(Pipeline.tensor"):
        policy(12, tensor=0)


def stage_row(worker: int, compute_s: float) -> dict:
    """A stage's row of the step breakdown: ``compute_s`` of forwards and backwards (1 : 2)."""
    row = {k: 0.0 for k in breakdown.PARTS + ("step_s",) + breakdown.IO_FIELDS}
    row.update(worker=worker, forward_s=compute_s / 3, backward_s=2 * compute_s / 3, step_s=1.0)
    return row


@pytest.mark.parametrize("tensor", [1, 2])
def test_measured_stage_breakdowns_set_the_shares_and_a_drift_rebalances(tensor):
    """A pipelined job's step reports carry no ``compute_s``: each stage's compute comes from the
    breakdown (of the step before), one row per stage (tensor rank 0 of a tensor-parallel one).
    2 replicas x 2 stages (x T): replica 1's stages take 3x as long per micro-batch."""
    p = policy(12, patience=2, tensor=tensor)
    n = 4 * tensor
    members = [10 + w for w in range(n)]  # worker ids are not ranks
    sizes = [2 * tensor] * 2
    plan = p.plan_pipeline_map(members, [1] * n, sizes, balance=True)
    vns = plan.assignment
    assert shares(vns, sizes) == [6, 6]
    p.new_generation(0)
    decision, measured = None, []
    for k in range(8):
        rows = None if k == 0 else [stage_row(w, (0.06 if r < n // 2 else 0.18)) for r, w in enumerate(members)
                                   if r % tensor == 0]
        measured.append(p.observe({"type": "step", "step": k, "step_time_s": 1.2, "compute_s": None,
                                   "members": members, "vns": vns, "vn_sizes": None, "breakdown": rows}))
        decision = p.check(0, members, vns, None)
        if isinstance(decision, Rebalance):
            break
    assert all(measured)  # every report is folded in (the first one, warm-up, is not measured)
    # 0.01 and 0.03 s per micro-batch and stage: 10/2 gives 0.11 s (6/6: 0.21 s, 9/3: 0.12 s)
    assert isinstance(decision, Rebalance) and decision.detail["replica_shares"] == [10, 2]
    assert p.stage_seconds(members) == ([pytest.approx(0.01)] * (n // 2) + [pytest.approx(0.03)] * (n // 2),
                                        "measured")
    again = p.plan_pipeline_map(members, [1] * n, sizes, balance=True)
    assert shares(again.assignment, sizes) == [10, 2] and again.predicted_step_s == pytest.approx(0.11)


def test_the_breakdowns_of_a_real_pipeline_measure_every_stage():
    """The rows the stage engines really report (the in-process driver, 2 replicas x 2 stages), as
    a worker puts them in its step report: every stage measured, in seconds per micro-batch."""
    from virtualflow.backends.inprocess import train_local

    job = pm.mlp_job(Pipeline(stages=2), virtual_nodes=8)
    _, history = train_local(job, 5, replicas=2, deterministic=True)
    p = policy(8, min_observations=1)
    members = [7, 8, 9, 10]
    vns = p.plan_pipeline_map(members, [1] * 4, [2, 2], balance=True).assignment
    p.new_generation(0)
    assert p.stage_seconds(members)[1] == "stated"
    for k, h in enumerate(history):
        rows = None if h.breakdown is None else [{"worker": w, **row} for w, row in zip(members, h.breakdown)]
        assert p.observe({"type": "step", "step": k, "step_time_s": 0.1, "compute_s": None, "members": members,
                          "vns": vns, "vn_sizes": None, "breakdown": rows})
    seconds, source = p.stage_seconds(members)
    assert source == "measured" and all(x > 0 for x in seconds)
    assert p.obs == {w: 3 for w in members}  # steps 1-3 (step 0 is warm-up; step 4's breakdown rides in no report)


def test_the_controller_publishes_a_rebalance_measured_from_the_stage_breakdowns():
    """The membership controller (a fake launcher, no process) of a (2, 1, 2) grid with balance:
    equal shares at first (nothing stated), then the measured breakdowns (replica 1 3x slower)
    make the speed policy decide a rebalance at a step boundary, which the controller publishes
    as a new generation whose map gives every member of a replica its block."""
    coord = Coordinator(total_steps=100, run_dir=None)
    events = []
    coord.event = lambda kind, **f: events.append((kind, f))  # type: ignore[method-assign]
    ctl = MembershipController(coord, FakeLauncher(), vf.LaunchOptions(workers=4, steps=100, balance=True),
                               virtual_nodes=8, clock=lambda: 0.0, stages=2, tensor=2, rebalance_patience=2)
    ctl.start()
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(4)] + [formed(0, list(range(4)))])
    assert ctl.generation == 0 and shares(ctl.assignment, [2, 2]) == [4, 4]
    for k in range(10):
        rows = None if k == 0 else [stage_row(0, 0.04), stage_row(2, 0.12)]
        ctl.tick([{"type": "step", "worker": 0, "step": k, "generation": 0, "step_time_s": 0.5, "compute_s": None,
                   "members": list(range(4)), "vns": ctl.assignment, "vn_sizes": None, "breakdown": rows}])
        if ctl.generation > 0:
            break
    assert ctl.generation == 1 and ctl.change_in_flight.kind == "rebalance"
    # 0.01 vs 0.03 s per micro-batch (P = 1: no bubble): 6/2 gives 0.06 s (4/4: 0.12 s)
    assert ctl.assignment == [list(range(6))] * 2 + [[6, 7]] * 2
    assert ctl.predicted_step_s == pytest.approx(0.06)


def test_balance_on_a_tensor_parallel_grid_passes_the_launch_checks():
    from virtualflow.launching.composition import check_pipeline_balance

    for opts in (vf.LaunchOptions(workers=4, steps=1, balance=True),
                 vf.LaunchOptions(workers=4, steps=1, slowdowns=[1, 1, 2, 2])):
        check_pipeline_balance(Pipeline(stages=1, tensor=2), opts)  # no refusal


def pipelined_controller(**options):
    coord = Coordinator(total_steps=100, run_dir=None)
    coord.event = lambda kind, **f: None  # type: ignore[method-assign]
    launcher = FakeLauncher()
    ctl = MembershipController(coord, launcher, vf.LaunchOptions(workers=6, steps=100, **options), virtual_nodes=12,
                               clock=lambda: 0.0, stages=3, redundancy=True)
    ctl.start()
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(6)] + [formed(0, list(range(6)))])
    return ctl, launcher


def test_the_failed_over_replica_gets_a_smaller_share_with_balance():
    ctl, launcher = pipelined_controller(balance=True)
    assert shares(ctl.assignment, [3, 3]) == [6, 6]
    launcher.codes[4] = -9  # replica 1's middle worker
    ctl.tick([])
    assert ctl.change_in_flight.kind == "failover" and ctl.members == [0, 1, 2, 3, 5]
    assert shares(ctl.assignment, [3, 2]) == [8, 4]
    # Without balance the shares stay equal, as before.
    ctl, launcher = pipelined_controller()
    launcher.codes[4] = -9
    ctl.tick([])
    assert shares(ctl.assignment, [3, 2]) == [6, 6]


def test_slowdowns_weigh_the_first_generation():
    ctl, _ = pipelined_controller(slowdowns=[1, 1, 1, 2, 2, 2])
    assert shares(ctl.assignment, [3, 3]) == [9, 3]
    assert ctl.assignment[0] == list(range(9)) and ctl.assignment[5] == [9, 10, 11]


def test_what_weighted_shares_cannot_do_is_refused_at_launch_naming_the_knob():
    job = pm.mlp_job(Pipeline(stages=2, schedule="2bw"), virtual_nodes=8)
    with pytest.raises(ValueError, match=r"balance .*Pipeline.schedule='2bw'"):
        vf.launch(job, workers=4, steps=2, slowdowns=[1, 1, 2, 2])
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=8)
    with pytest.raises(ValueError, match=r"uneven_vn_sizes=True \(--uneven-vn-sizes\)"):
        vf.launch(job, workers=4, steps=2, uneven_vn_sizes=True)
    job = pm.mlp_job(Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2), virtual_nodes=8)
    with pytest.raises(ValueError, match=r"interleaved_1f1b with chunks=2"):
        vf.launch(job, workers=4, steps=2, balance=True)


# -- training with unequal shares ---------------------------------------------------------------------
def train_with_shares(job: vf.Job, blocks: list[list[int]], steps: int, deterministic: bool):
    """The job's pipeline replicas in this process, replica ``j`` running ``blocks[j]``."""
    pipeline = job.pipeline
    dataset = job.build_dataset()
    import torch

    torch.manual_seed(job.seed)
    bounds = resolve_bounds(pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, pipeline, bounds, r % pipeline.stages, dataset=dataset, deterministic=deterministic,
                            device=torch.device("cpu"), eager_every_wait=False)
               for r in range(pipeline.stages * len(blocks))]
    driver = LocalDriver(engines)
    driver.set_layout(blocks)
    history = []
    for t in range(steps):
        history += driver.run(t, 1)
    state = {}
    for e in engines[: pipeline.stages]:
        state.update({k: v.detach().clone() for k, v in e.model.state_dict().items()})
    return state, history


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
def test_unequal_shares_train_the_single_worker_model(schedule):
    """Replica 1 emulated 2x slower gets 3 of 12 micro-batches: deterministic mode is bit-identical
    to the unpipelined deterministic run on one worker (the VN-id tree does not depend on the
    shares), default mode equal within float tolerance."""
    job = pm.mlp_job(Pipeline(stages=3, schedule=schedule), virtual_nodes=12, bn=True)
    plan = solve_shares(12, [replica_time([1.0] * 3), replica_time([2.0] * 3)])
    assert plan.counts == [9, 3]
    steps = 3
    for deterministic in (True, False):
        state, history = train_with_shares(job, plan.blocks(), steps, deterministic)
        ref_state, ref_losses = pm.unpipelined(job, steps, deterministic)
        if deterministic:
            assert_state_equal(state, ref_state)
            assert [h.loss for h in history] == ref_losses
        else:
            assert_state_close(state, ref_state)


def test_a_failed_over_replica_with_its_smaller_share_trains_the_undisturbed_model():
    """Bamboo, 2 replicas x 3 stages: replica 1 failed over (its first worker runs job stages 0
    and 1) and, weighted by stages run, gets 3 of 8 micro-batches: deterministic mode is bit for
    bit the undisturbed job's with equal shares (the in-process harness of
    ``tests/e2e/test_bamboo_replicas.py``: each job stage reduced over its workers in replica order)."""
    import torch

    from test_bamboo import assert_same, engines_of, job
    from test_bamboo_replicas import LayoutDriver, merged_engine

    j = job(3)
    short = ((0, 1), (2,))
    members = [0, 1, 2, 3, 5]
    plan = policy(j.virtual_nodes).plan_pipeline_map(members, [1, 1, 1, 2, 1], [3, 2], balance=True)
    blocks = replica_blocks(plan.assignment, [3, 2], j.virtual_nodes)
    assert [len(b) for b in blocks] == [5, 3]  # (5 + 2) vs 1 + 3 * 2 stage times (4/4: 6 vs 9)
    dataset = j.build_dataset()
    bounds = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    ref, ref_driver = engines_of(j, 2, True)  # undisturbed, equal shares
    workers = [(build_engine(j, j.pipeline, bounds, r, dataset=dataset, deterministic=True,
                             device=torch.device("cpu")), 0, r, (r,)) for r in range(3)]
    workers += [(merged_engine(j, short, pos, dataset, True), 1, pos, short[pos]) for pos in range(2)]
    for e, rep, *_ in workers:
        e.set_layout(rep, blocks)
    driver = LayoutDriver(workers, j.virtual_nodes)
    for t in range(3):
        ref_driver.run(t, 1)
        driver.run(t)
    want = {}
    for e in ref[:3]:
        want.update(e.model.state_dict())
    for e, rep, pos, _ in workers:
        for k, v in e.model.state_dict().items():
            assert_same(v, want[k], f"replica {rep} worker {pos} {k}")
