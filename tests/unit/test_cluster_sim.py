"""The round-based mechanism and the discrete-event simulator (virtualflow.cluster.mechanism/simulator)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from virtualflow.cluster import Allocation, Cluster, JobSpec, PolicyInput, ThroughputTable, gavel_data_dir, get_policy
from virtualflow.cluster.mechanism import MechanismConfig, RoundMechanism
from virtualflow.cluster.metrics import summarize, write_summary
from virtualflow.cluster.simulator import SimClock, SimConfig, simulate
from virtualflow.cluster.traces import generate_jobs


@pytest.fixture(scope="module")
def gavel() -> ThroughputTable:
    return ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json")


def toy_table() -> ThroughputTable:
    # a: 2 steps/s on v100, 1 on k80; b: 3 on v100, 1 on k80 (single GPU); e: elastic, 1/2/4 GPUs.
    return ThroughputTable.from_dict({
        "a": {"v100": {1: 2.0}, "k80": {1: 1.0}},
        "b": {"v100": {1: 3.0}, "k80": {1: 1.0}},
        "e": {"v100": {1: 1.0, 2: 2.0, 4: 4.0}, "k80": {1: 0.5, 2: 1.0, 4: 2.0}},
    })


class Fixed:
    """A policy with a fixed allocation for named job ids (test helper)."""

    name = "fixed"

    def __init__(self, X: dict[int, list[float]], gpus: dict[int, int] | None = None):
        self.X, self.gpus = X, gpus or {}

    def allocate(self, inp: PolicyInput) -> Allocation:
        ids = [j.job_id for j in inp.jobs]
        return Allocation(rows=[(i,) for i in ids], X=np.array([self.X[i] for i in ids], dtype=float),
                          gpus={j.job_id: self.gpus.get(j.job_id, j.scale_factor) for j in inp.jobs})


# ---------------------------------------------------------------------------------------- by hand


@pytest.mark.parametrize("restart_cost_s", [45.0, 0.0])
def test_two_jobs_two_types_by_hand(restart_cost_s):
    """fifo on 1 v100 + 1 k80 (one GPU per server), rounds of 360 s.

    t=0: A (1000 steps) arrives, alone: fifo puts it on its fastest type, v100 (2/s).
    t=100: B (600 steps) arrives mid-round and waits for the next round.
    t=360: recompute: A keeps v100 (lease extended, no cost), B starts on k80 (1/s).
    t=500: A finishes (1000 / 2). JCT_A = 500.
    t=720: B has 360 steps, 240 left; recompute: B alone moves to v100 (3/s), paying a
           checkpoint-restart: finishes at 720 + restart + 240 / 3 = 800 + restart. JCT_B = that - 100.
    """
    cluster = Cluster(gpus={"v100": 1, "k80": 1}, gpus_per_server={"v100": 1, "k80": 1},
                      prices={"v100": 3.0, "k80": 1.0})
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=1, total_steps=1000.0, arrival_s=0.0),
            JobSpec(job_id=1, job_type="b", scale_factor=1, total_steps=600.0, arrival_s=100.0)]
    clock = SimClock()
    cfg = SimConfig(mechanism=MechanismConfig(round_s=360.0, restart_cost_s=restart_cost_s), check_allocations=True)
    r = simulate(jobs, cluster, toy_table(), get_policy("fifo"), cfg, clock=clock)
    assert r.jct_s.tolist() == pytest.approx([500.0, 700.0 + restart_cost_s], abs=1e-9)
    assert r.restarts.tolist() == [0, 1]
    assert r.lost_s.tolist() == pytest.approx([0.0, restart_cost_s])
    assert r.rounds == 3 and clock.now() == pytest.approx(1080.0)
    # GPU-seconds held: A 500 on v100; B 360 on k80, then 45 + 80 on v100.
    np.testing.assert_allclose(r.gpu_s, [[500.0, 0.0], [restart_cost_s + 80.0, 360.0]], atol=1e-9)
    s = summarize(r)
    assert s["makespan_s"] == pytest.approx(800.0 + restart_cost_s)
    assert s["cost_usd"] == pytest.approx(((500.0 + restart_cost_s + 80.0) * 3.0 + 360.0 * 1.0) / 3600.0)
    assert s["utilisation"] == pytest.approx((940.0 + restart_cost_s) / (2 * 1080.0))


def test_elastic_resize_costs_by_hand():
    """One elastic job alone on 4 v100s, told to use 2 GPUs then 4: the second round is an in-place
    resize (1.5 s) — or a checkpoint-restart (45 s) when resizing by restart."""
    cluster = Cluster(gpus={"v100": 4, "k80": 4}, gpus_per_server={"v100": 4, "k80": 4})
    job = JobSpec(job_id=0, job_type="e", scale_factor=4, min_gpus=1, total_steps=2000.0)
    for mode, cost in (("in_place", 1.5), ("restart", 45.0)):
        mech = RoundMechanism(cluster, MechanismConfig(elastic_resize=mode))
        mech.set_allocation(Allocation(rows=[(0,)], X=np.array([[1.0, 0.0]]), gpus={0: 2}), elastic={0: True})
        p1 = mech.plan_round({0}).placements[0]
        mech.end_round()
        mech.set_allocation(Allocation(rows=[(0,)], X=np.array([[1.0, 0.0]]), gpus={0: 4}), elastic={0: True})
        p2 = mech.plan_round({0}).placements[0]
        assert (p1.change, p1.gpus, p1.cost_s) == ("start", 2, 0.0)
        assert (p2.change, p2.gpus, p2.cost_s) == ("resize", 4, cost)
    # Through the simulator: 2 GPUs (2/s) for one round = 720 steps, then 4 GPUs (4/s) after 1.5 s.
    policy = _Switching()
    r = simulate([job], cluster, toy_table(), policy, SimConfig(recompute="every_round"))
    assert r.finish_s[0] == pytest.approx(360.0 + 1.5 + (2000.0 - 720.0) / 4.0)
    assert (r.resizes[0], r.restarts[0]) == (1, 0)


class _Switching:
    name = "switching"

    def __init__(self):
        self.calls = 0

    def allocate(self, inp: PolicyInput) -> Allocation:
        self.calls += 1
        return Allocation(rows=[(0,)], X=np.array([[1.0, 0.0]]), gpus={0: 2 if self.calls == 1 else 4})


# ---------------------------------------------------------------------------------------- invariants


def test_conservation_every_job_runs_exactly_its_steps(gavel):
    cluster = Cluster.parse("v100=8,p100=8,k80=8")
    jobs = generate_jobs(gavel, num_jobs=40, rate_per_hour=3.0, seed=3)
    r = simulate(jobs, cluster, gavel, get_policy("las"), SimConfig(check_allocations=True))
    total = np.array([j.total_steps for j in jobs])
    assert np.isfinite(r.finish_s).all()
    assert np.array_equal(r.steps_run, total)
    # Progress is throughput x time: steps are bounded by what the held GPU time could produce.
    T = np.array([[gavel.throughput(j.job_type, t, j.scale_factor) for t in cluster.types] for j in jobs])
    g = np.array([j.scale_factor for j in jobs])[:, None]
    held_steps = (r.gpu_s / g * T).sum(axis=1)
    assert np.all(held_steps >= total * (1 - 1e-9))
    assert np.all(held_steps - r.lost_s * T.max(axis=1) <= total * (1 + 1e-9))
    # No job finishes faster than alone on its fastest type.
    assert np.all(r.jct_s >= r.isolated_s * (1 - 1e-9))
    assert np.all(r.finish_s >= r.arrival_s)


def test_same_seed_same_results(gavel):
    cluster = Cluster.parse("v100=8,p100=8,k80=8")

    def run(seed):
        jobs = generate_jobs(gavel, num_jobs=30, rate_per_hour=2.0, seed=seed)
        return simulate(jobs, cluster, gavel, get_policy("las"), SimConfig(window=(5, 25)))

    a, b, c = run(1), run(1), run(2)
    assert np.array_equal(a.finish_s, b.finish_s) and np.array_equal(a.restarts, b.restarts)
    assert summarize(a) | {"policy_solve_s": 0} == summarize(b) | {"policy_solve_s": 0}
    assert not np.array_equal(a.finish_s, c.finish_s)


def test_mechanism_never_oversubscribes_and_places_jobs_whole(gavel):
    cluster = Cluster.parse("v100=8,p100=8,k80=8", gpus_per_server=4)
    rng = np.random.default_rng(0)
    for trial in range(3):
        jobs = generate_jobs(gavel, num_jobs=40, rate_per_hour=0.0, seed=trial)
        inp = PolicyInput(jobs=jobs, cluster=cluster, table=gavel)
        mech = RoundMechanism(cluster)
        active = {j.job_id for j in jobs}
        alloc = get_policy("las").allocate(inp)
        mech.set_allocation(alloc)
        by_id = {j.job_id: j for j in jobs}
        for rnd in range(60):
            if rnd % 20 == 19:  # some jobs leave, the allocation changes
                active -= set(rng.choice(sorted(active), 5, replace=False).tolist())
                inp = PolicyInput(jobs=[by_id[i] for i in sorted(active)], cluster=cluster, table=gavel)
                alloc = get_policy("las").allocate(inp)
                mech.set_allocation(alloc)
            plan = mech.plan_round(active)
            assert plan.placements  # the checks below must see jobs placed, not pass on an empty round
            per_server: dict[tuple[str, int], int] = {}
            for jid, p in plan.placements.items():
                assert jid in active
                assert p.gpus == by_id[jid].scale_factor == sum(n for _, n in p.servers)  # whole job
                assert len(p.servers) == math.ceil(p.gpus / 4)  # consolidated: fewest servers
                for s, n in p.servers:
                    per_server[(p.acc_type, s)] = per_server.get((p.acc_type, s), 0) + n
            for t in cluster.types:
                assert plan.used[t] <= cluster.gpus[t]
                assert sum(p.gpus for p in plan.placements.values() if p.acc_type == t) == plan.used[t]
            assert all(v <= 4 for v in per_server.values())
            mech.end_round()


def test_received_shares_converge_to_the_allocation():
    """Six one-GPU jobs time-share 2 v100 + 2 k80 under a fixed allocation: over many rounds the
    fraction of rounds each job gets on each type approaches X."""
    cluster = Cluster(gpus={"v100": 2, "k80": 2}, gpus_per_server={"v100": 1, "k80": 1})
    X = np.array([[0.5, 0.0], [0.3, 0.2], [0.2, 0.4], [0.4, 0.3], [0.1, 0.6], [0.5, 0.5]])
    assert np.all(X.sum(axis=0) <= 2) and np.all(X.sum(axis=1) <= 1)
    mech = RoundMechanism(cluster)
    mech.set_allocation(Allocation(rows=[(i,) for i in range(6)], X=X, gpus={i: 1 for i in range(6)}))
    got = np.zeros_like(X)
    rounds = 2000
    for _ in range(rounds):
        plan = mech.plan_round(set(range(6)))
        for jid, p in plan.placements.items():
            got[jid, cluster.types.index(p.acc_type)] += 1
        mech.end_round()
    assert np.abs(got / rounds - X).max() < 0.01


def test_lease_extension_and_preemption_costs():
    """2 v100 (one server): A has X=1, B and C X=0.5 each. A keeps its GPU round after round
    (lease extended: "kept", no cost, also across a policy recomputation); B and C share the
    other GPU, and every return after a preemption is a checkpoint-restart ("resume", 45 s),
    while a row that runs two rounds in a row keeps its lease at no cost."""
    cluster = Cluster(gpus={"v100": 2, "k80": 1})
    cfg = MechanismConfig(restart_cost_s=45.0)
    mech = RoundMechanism(cluster, cfg)
    alloc = Allocation(rows=[(0,), (1,), (2,)], X=np.array([[1.0, 0.0], [0.5, 0.0], [0.5, 0.0]]),
                       gpus={0: 1, 1: 1, 2: 1})
    mech.set_allocation(alloc)
    ran: dict[int, list[int]] = {0: [], 1: [], 2: []}
    rounds = 12
    for rnd in range(rounds):
        if rnd == 6:
            mech.set_allocation(alloc)  # a policy recomputation with the same answer: counters reset
        plan = mech.plan_round({0, 1, 2})
        assert set(plan.placements) in ({0, 1}, {0, 2})
        for jid, p in plan.placements.items():
            before = ran[jid]
            want = ("start", 0.0) if not before else ("kept", 0.0) if before[-1] == rnd - 1 else ("resume", 45.0)
            assert (p.change, p.cost_s) == want, (rnd, jid, p)
            before.append(rnd)
        mech.end_round()
    assert ran[0] == list(range(rounds))  # never preempted, never restarted
    assert len(ran[1]) == len(ran[2]) == rounds // 2
    assert any(ran[1][i + 1] > ran[1][i] + 1 for i in range(len(ran[1]) - 1))  # B was preempted and resumed
    # Through the simulator: A (X=1) runs 2000 s without a break; B and C pay 45 s per resume.
    table = ThroughputTable.from_dict({"m": {"v100": {1: 1.0}, "k80": {1: 0.0}}})
    jobs = [JobSpec(job_id=i, job_type="m", scale_factor=1, total_steps=steps)
            for i, steps in enumerate([2000.0, 1000.0, 1000.0])]
    r = simulate(jobs, cluster, table, Fixed({0: [1.0, 0.0], 1: [0.5, 0.0], 2: [0.5, 0.0]}),
                 SimConfig(mechanism=cfg))
    assert r.finish_s[0] == pytest.approx(2000.0) and r.restarts[0] == 0 and r.lost_s[0] == 0.0
    assert r.restarts[1] >= 1 and r.restarts[2] >= 1
    np.testing.assert_allclose(r.lost_s, 45.0 * r.restarts)
    np.testing.assert_array_equal(r.steps_run, [2000.0, 1000.0, 1000.0])


def test_consolidated_placement_best_fit_and_fragmentation():
    """(1) Best fit: 7 GPUs as servers of 4 + 3; the 3-GPU job (visited first) takes the 3-GPU
    server, so the 4-GPU job still fits (first fit would split or block it). (2) An 8-GPU job
    takes two whole servers. (3) Fragmentation: two 3-GPU leases leave 1 + 1 free GPUs; a 2-GPU
    job waits (counted) instead of being split, and later gets one server: nobody waits forever."""
    mech = RoundMechanism(Cluster(gpus={"v100": 7}, gpus_per_server={"v100": 4}))
    mech.set_allocation(Allocation(rows=[(0,), (1,)], X=np.ones((2, 1)), gpus={0: 3, 1: 4}))
    plan = mech.plan_round({0, 1})
    assert plan.placements[0].servers == ((1, 3),) and plan.placements[1].servers == ((0, 4),)
    assert plan.skipped_fragmented == 0

    cluster = Cluster(gpus={"v100": 8}, gpus_per_server={"v100": 4})
    mech = RoundMechanism(cluster)
    mech.set_allocation(Allocation(rows=[(0,)], X=np.ones((1, 1)), gpus={0: 8}))
    assert mech.plan_round({0}).placements[0].servers == ((0, 4), (1, 4))

    # (3) with the counters starting at the allocation (priority 1 for all: lease holders first).
    mech = RoundMechanism(cluster, MechanismConfig.lease_first())
    mech.set_allocation(Allocation(rows=[(0,), (1,)], X=np.ones((2, 1)), gpus={0: 3, 1: 3}))
    first = mech.plan_round({0, 1})
    assert sorted(p.servers for p in first.placements.values()) == [((0, 3),), ((1, 3),)]
    mech.end_round()
    mech.set_allocation(Allocation(rows=[(0,), (1,), (2,)], X=np.array([[0.5], [0.5], [1.0]]),
                                   gpus={0: 3, 1: 3, 2: 2}))
    second = mech.plan_round({0, 1, 2})
    assert set(second.placements) == {0, 1} and second.skipped_fragmented == 1
    assert all(p.change == "kept" for p in second.placements.values())
    mech.end_round()
    ran = False
    for _ in range(3):
        plan = mech.plan_round({0, 1, 2})
        if 2 in plan.placements:
            assert len(plan.placements[2].servers) == 1
            ran = True
            break
        mech.end_round()
    assert ran


def test_policy_jct_gain_and_outputs(gavel, tmp_path):
    """Heterogeneity-aware LAS beats the agnostic one on Gavel's table (a small, fast instance)."""
    cluster = Cluster.parse("v100=4,p100=4,k80=4")
    jobs = generate_jobs(gavel, num_jobs=60, rate_per_hour=1.0, seed=0, multi_gpu=False)
    res = {p: simulate(jobs, cluster, gavel, get_policy(p), SimConfig(window=(10, 50)))
           for p in ("las_agnostic", "las")}
    s = {p: summarize(r) for p, r in res.items()}
    assert s["las"]["unfinished"] == s["las_agnostic"]["unfinished"] == 0
    assert s["las"]["avg_jct_s"] < s["las_agnostic"]["avg_jct_s"]
    paths = write_summary(res["las"], str(tmp_path / "out"))
    assert open(paths["summary"]).read().startswith("{")
    assert len(open(paths["jobs"]).read().splitlines()) == 60


# ---------------------------------------------------------------------------------------- metrics


def test_metrics_by_hand(tmp_path, monkeypatch):
    """summarize() on a result written by hand: JCT statistics over the window only (unfinished
    jobs counted, not averaged), makespan, utilisation, cost, SLO violations, FTF ratios,
    restarts/resizes; write_summary's JSON, JSONL and CDF plot; the JCT-vs-load plot. Plotting
    is library code: it must neither pick a matplotlib backend nor go through pyplot."""
    import json
    import sys

    import matplotlib

    def no_backend_change(*args, **kwargs):
        raise AssertionError(f"library code called matplotlib.use{args}")

    monkeypatch.setattr(matplotlib, "use", no_backend_change)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing pyplot now fails

    from virtualflow.cluster.metrics import plot_jct_vs_load
    from virtualflow.cluster.simulator import SimResult

    cluster = Cluster(gpus={"v100": 2, "k80": 2}, prices={"v100": 3.0, "k80": 1.0})
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=1, total_steps=1.0, slo_s=100.0),
            JobSpec(job_id=1, job_type="a", scale_factor=1, total_steps=1.0, slo_s=100.0),
            JobSpec(job_id=2, job_type="e", scale_factor=2, min_gpus=1, total_steps=1.0, slo_s=1000.0,
                    arrival_s=100.0),
            JobSpec(job_id=3, job_type="b", scale_factor=1, total_steps=1.0, slo_s=500.0, arrival_s=200.0)]
    r = SimResult(jobs=jobs, cluster=cluster, policy="hand", arrival_s=np.array([0.0, 0.0, 100.0, 200.0]),
                  finish_s=np.array([400.0, 150.0, 300.0, np.nan]), steps_run=np.array([1.0, 1.0, 1.0, 0.5]),
                  restarts=np.array([5, 1, 0, 2]), resizes=np.array([0, 0, 2, 0]),
                  lost_s=np.array([225.0, 45.0, 3.0, 90.0]),
                  gpu_s=np.array([[400.0, 0.0], [0.0, 150.0], [400.0, 0.0], [0.0, 300.0]]),
                  contention=np.array([1.0, 2.0, 3.0, 2.0]), isolated_s=np.array([100.0, 50.0, 200.0, 100.0]),
                  end_s=600.0, rounds=2, solves=2, solve_s=0.01, skipped_fragmented=0, window=(1, 4))
    s = summarize(r)
    assert (s["window_jobs"], s["finished"], s["unfinished"]) == (3, 2, 1)
    assert s["avg_jct_s"] == pytest.approx(175.0) and s["median_jct_s"] == pytest.approx(175.0)
    assert s["p99_jct_s"] == pytest.approx(150.0 + 0.99 * 50.0)
    assert s["avg_jct_h"] == pytest.approx(175.0 / 3600)
    assert s["makespan_s"] == pytest.approx(400.0)  # every finished job, window or not
    assert s["utilisation"] == pytest.approx(1250.0 / (4 * 600.0))
    assert s["utilisation_by_type"] == pytest.approx({"v100": 800.0 / 1200.0, "k80": 450.0 / 1200.0})
    assert s["cost_usd"] == pytest.approx(800.0 / 3600 * 3.0 + 450.0 / 3600 * 1.0)
    # Job 1 late (150 > 100), job 2 on time, job 3 unfinished: 2 of 3 (job 0 is outside the window).
    assert (s["slo_jobs"], s["slo_violations"]) == (3, 2)
    assert (s["restarts"], s["resizes"], s["lost_to_changes_s"]) == (3, 2, pytest.approx(138.0))
    # rho = JCT / (isolated x max(1, N g / G)): job 1: 150 / (50 x 1) = 3; job 2: 200 / (200 x 1.5).
    assert s["ftf_rho"] == pytest.approx({"avg": (3.0 + 2 / 3) / 2, "max": 3.0, "frac_gt_1": 0.5})
    assert summarize(r, window=(0, 1))["avg_jct_s"] == pytest.approx(400.0)

    paths = write_summary(r, str(tmp_path / "out"))
    assert json.load(open(paths["summary"]))["slo_violations"] == 2
    recs = [json.loads(line) for line in open(paths["jobs"])]
    assert [x["finish_s"] for x in recs] == [400.0, 150.0, 300.0, None]
    assert open(paths["cdf"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    load = plot_jct_vs_load({"las": [(1.0, 2.0), (0.5, 1.0)], "fifo": [(0.5, 1.5), (1.0, 4.0)]},
                            str(tmp_path / "load.png"))
    assert open(load, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------- bad input


def test_job_needing_more_gpus_than_the_cluster():
    cluster = Cluster(gpus={"v100": 2, "k80": 2})
    jobs = [JobSpec(job_id=0, job_type="e", scale_factor=4, total_steps=10.0)]
    with pytest.raises(ValueError, match="job 0 .* needs 4 GPUs but the largest accelerator type has 2"):
        simulate(jobs, cluster, toy_table(), get_policy("las"))


def test_bad_window_and_config():
    cluster = Cluster(gpus={"v100": 1, "k80": 1})
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=1, total_steps=10.0)]
    with pytest.raises(ValueError, match="window=5:9 contains none"):
        simulate(jobs, cluster, toy_table(), get_policy("las"), SimConfig(window=(5, 9)))
    with pytest.raises(ValueError, match="round_s=0 must be a positive"):
        MechanismConfig(round_s=0)
    with pytest.raises(ValueError, match="elastic_resize='fast'"):
        MechanismConfig(elastic_resize="fast")
    with pytest.raises(ValueError, match="recompute='never'"):
        SimConfig(recompute="never")


# ---------------------------------------------------------------------------------------- CLI


def test_cli_simulate_module(tmp_path, capsys):
    """``virtualflow simulate`` as its module defines it (``add_parser`` + ``main``)."""
    import argparse
    import json

    from virtualflow.cli import simulate as simulate_cli

    parser = argparse.ArgumentParser(prog="virtualflow")
    simulate_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    trace = "small_test"  # a trace bundled with the package, by name
    args = parser.parse_args(["simulate", "--cluster", "v100=4,p100=4,k80=4", "--trace", trace, "--policy", "las",
                              "--no-progress", "--prices", "v100=2.48,p100=1.46,k80=0.45", "-o", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "las: 20/20 jobs done" in out and "cost $" in out
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["finished"] == 20 and summary["unfinished"] == 0 and summary["cost_usd"] > 0
    # Gavel's round mechanics: the same jobs complete (the mechanism only changes who runs when).
    args = parser.parse_args(["simulate", "--cluster", "v100=4,p100=4,k80=4", "--trace", trace, "--policy", "las",
                              "--no-progress", "--mechanism", "gavel", "--restart-cost-s", "0"])
    assert args.func(args) == 0
    assert "las: 20/20 jobs done" in capsys.readouterr().out
    args = parser.parse_args(["simulate", "--cluster", "v100=4,p100=4,k80=4", "--trace", trace, "--policy", "las",
                              "--no-progress", "--mechanism", "lease_first"])
    assert args.func(args) == 0
    assert "las: 20/20 jobs done" in capsys.readouterr().out
    # Event-driven reallocation from the command line: the same figures as the API with the option.
    gen = "rate=12,jobs=20,seed=1,elastic=1"
    out_ev = tmp_path / "events"
    args = parser.parse_args(["simulate", "--cluster", "v100=8", "--generate", gen, "--policy", "elastic_fair",
                              "--no-progress", "--reallocate-on-events", "-o", str(out_ev)])
    assert args.func(args) == 0
    capsys.readouterr()
    from virtualflow.cluster.traces import parse_generate_spec
    table = ThroughputTable.from_gavel_json(gavel_data_dir() / "simulation_throughputs.json")
    jobs = generate_jobs(table, parse_generate_spec(gen))
    for ev in (True, False):
        want = summarize(simulate(jobs, Cluster.parse("v100=8"), table, get_policy("elastic_fair"),
                                  SimConfig(mechanism=MechanismConfig(reallocate_on_events=ev))))
        got = json.load(open(out_ev / "summary.json"))
        assert (got["avg_jct_h"] == pytest.approx(want["avg_jct_h"], rel=1e-12)) == ev
    args = parser.parse_args(["simulate", "--generate", "rate=2,jobs=20,seed=0", "--window", "5", "--no-progress"])
    with pytest.raises(ValueError, match="--window '5' must be LO:HI"):
        args.func(args)
    args = parser.parse_args(["simulate", "--trace", trace, "--policy", "fastest", "--no-progress"])
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        args.func(args)


def test_cli_own_table_format_progress_bar_and_errors(tmp_path, capsys):
    """Through the real entry point (``virtualflow.cli.main``): a table in virtualflow's own
    format with a Gavel trace, the progress bar over simulated hours on stderr, and bad input
    reported in one line with exit status 2."""
    import json
    import re

    from virtualflow.cli.main import main

    table = tmp_path / "own.json"
    table.write_text(json.dumps({"throughputs": {"a": {"v100": {"1": 2.0}, "k80": {"1": 1.0}},
                                                 "b": {"v100": {"1": 3.0}, "k80": {"1": 1.0}}}}))
    trace = tmp_path / "t.trace"
    trace.write_text("a\tcmd\tdir\t-n\t0\t1000\t1\t1\t-1\t0\nb\tcmd\tdir\t-n\t0\t600\t1\t1\t-1\t100\n")
    argv = ["simulate", "--cluster", "v100=1,k80=1", "--gpus-per-server", "1", "--throughputs", str(table),
            "--trace", str(trace), "--policy", "fifo", "--restart-cost-s", "0", "--round-s", "360",
            "--window", "0:2", "-o", str(tmp_path / "out")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    # The by-hand case of test_two_jobs_two_types_by_hand with free restarts: JCTs 500 s and 700 s.
    assert "fifo: 2/2 jobs done; JCT avg 600.0 s" in out  # a short trace: seconds
    assert "simulated h" in err  # tqdm's bar over simulated time
    assert json.load(open(tmp_path / "out" / "summary.json"))["window"] == [0, 2]
    assert main(argv + ["--no-progress"]) == 0
    assert "simulated h" not in capsys.readouterr().err
    for bad, message in [
        (["--trace", str(tmp_path / "missing.trace")], "--trace '.*missing.trace' does not exist"),
        (["--trace", "tiny_test"], r"--trace 'tiny_test' does not exist; .* bundled one \(artifact_evaluation.trace, "),
        (["--throughputs", str(trace)], r"t.trace: not valid JSON \(Expecting value at line 1, column 1\)"),
        (["--throughputs", str(tmp_path / "none.json")], "--throughputs '.*none.json' does not exist"),
        (["--policy", "lass"], "unknown policy 'lass'"),
        (["--cluster", "v100=1,k80=x"], "count 'x' is not an integer"),
        (["--generate", "rate=2,jobs=5,colour=red"], "'colour=red' is not KEY=VALUE"),
    ]:
        args = list(argv)
        for flag, value in zip(bad[::2], bad[1::2]):
            if flag == "--generate":
                i = args.index("--trace")
                del args[i:i + 2]
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        assert main(args + ["--no-progress"]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("virtualflow simulate: error: "), err
        assert re.search(message, err[0]), (message, err[0])


# ------------------------------------------------------------------------- Gavel's mechanism options


def test_spread_placement_runs_a_job_that_consolidated_placement_makes_wait():
    """Two 4-GPU servers of v100, each holding a 3-GPU job (lease extended): one GPU is free on each
    server. A 2-GPU job then has 2 free GPUs but no server with 2: consolidated placement makes it
    wait (``skipped_fragmented``), spread placement runs it on one GPU of each server."""
    cluster = Cluster(gpus={"v100": 8}, gpus_per_server={"v100": 4})
    for placement, runs in (("consolidated", False), ("spread", True)):
        mech = RoundMechanism(cluster, MechanismConfig(placement=placement))
        mech.set_allocation(Allocation(rows=[(0,), (1,)], X=np.array([[1.0], [1.0]]), gpus={0: 3, 1: 3}))
        first = mech.plan_round({0, 1})
        assert {first.placements[0].servers, first.placements[1].servers} == {((0, 3),), ((1, 3),)}
        mech.end_round()
        mech.set_allocation(Allocation(rows=[(0,), (1,), (2,)], X=np.array([[1.0], [1.0], [1.0]]),
                                       gpus={0: 3, 1: 3, 2: 2}))
        plan = mech.plan_round({0, 1, 2})
        assert plan.placements[0].change == plan.placements[1].change == "kept"
        assert (2 in plan.placements) == runs
        if runs:
            assert plan.placements[2].servers == ((0, 1), (1, 1))
            assert plan.used["v100"] == 8
        else:
            assert plan.skipped_fragmented == 1


def test_per_type_order_fills_types_in_cluster_order_by_priority_then_allocation():
    """Gavel's order: the first type is filled first from its own queue. Job 0 wants mostly the
    k80 (X 0.9) and a little v100 (0.1), job 1 only v100 (0.5), one GPU of each type: with equal
    priors the first round goes by allocation size within a type, v100 first: job 1 (0.5) takes
    the v100, job 0 the k80. A global queue (priorities all 1 at first, ties by larger X) puts
    job 0 on the k80 and job 1 on the v100 too; after that round the per-type queue keeps
    ordering by X / share-of-the-type's-time."""
    cluster = Cluster(gpus={"v100": 1, "k80": 1}, gpus_per_server={"v100": 1, "k80": 1})
    alloc = Allocation(rows=[(0,), (1,)], X=np.array([[0.1, 0.9], [0.5, 0.0]]), gpus={0: 1, 1: 1})
    mech = RoundMechanism(cluster, MechanismConfig(order="per_type", prior="equal"))
    mech.set_allocation(alloc)
    pr = mech.priorities()
    # equal priors: share of the type's time is 1/2 for both rows on both types -> priority 2 X
    np.testing.assert_allclose(pr, 2 * np.array([[0.1, 0.9], [0.5, 0.0]]))
    plan = mech.plan_round({0, 1})
    assert {j: p.acc_type for j, p in plan.placements.items()} == {0: "k80", 1: "v100"}
    mech.end_round()
    # Received: job 0 k80 +360, job 1 v100 +360 (priors 180 each): v100 shares 180/720 and 540/720.
    np.testing.assert_allclose(mech.priorities()[:, 0], [0.1 / (180 / 720), 0.5 / (540 / 720)])


def test_carried_deficits_break_ties_after_an_allocation_change():
    """Two identical jobs share one GPU (X = 0.5 each). Job 0 runs the first round (its deficit
    after the change: 0.5 x 360 - 360 = -180; job 1's: +180). After the allocation is replaced
    by the same shares, priorities tie (equal priors): the carried deficit puts job 1 first.
    Without carried deficits the tie goes to the lease holder, job 0."""
    cluster = Cluster(gpus={"v100": 1}, gpus_per_server={"v100": 1})
    alloc = Allocation(rows=[(0,), (1,)], X=np.array([[0.5], [0.5]]), gpus={0: 1, 1: 1})
    for carry, want in ((True, 1), (False, 0)):
        mech = RoundMechanism(cluster, MechanismConfig(order="per_type", prior="equal", carry_deficits=carry))
        mech.set_allocation(alloc)
        first = mech.plan_round({0, 1})
        assert list(first.placements) == [0]  # tie at the start: row order
        mech.end_round()
        mech.set_allocation(alloc)
        assert list(mech.plan_round({0, 1}).placements) == [want]
    assert MechanismConfig.gavel().order == "per_type"


def test_default_mechanics_and_lease_first():
    """The default since issue 17 is Gavel's round mechanics with consolidated placement;
    ``lease_first()`` gives the earlier ones; ``gavel()`` adds spread placement."""
    d, old, g = MechanismConfig(), MechanismConfig.lease_first(round_s=60.0), MechanismConfig.gavel()
    assert (d.order, d.prior, d.carry_deficits, d.placement, d.reallocate_on_events) == (
        "per_type", "equal", True, "consolidated", False)
    assert (old.order, old.prior, old.carry_deficits, old.placement, old.round_s) == (
        "global", "allocation", False, "consolidated", 60.0)
    assert (g.order, g.prior, g.carry_deficits, g.placement) == ("per_type", "equal", True, "spread")
    # After an allocation change, the default goes by allocation size: the row with X = 0.9 runs
    # before the one with X = 0.1 that held the GPU; lease_first keeps the holder.
    cluster = Cluster(gpus={"v100": 1}, gpus_per_server={"v100": 1})
    for cfg, want in ((d, 1), (old, 0)):
        mech = RoundMechanism(cluster, cfg)
        mech.set_allocation(Allocation(rows=[(0,)], X=np.array([[1.0]]), gpus={0: 1}))
        assert list(mech.plan_round({0}).placements) == [0]
        mech.end_round()
        mech.set_allocation(Allocation(rows=[(0,), (1,)], X=np.array([[0.1], [0.9]]), gpus={0: 1, 1: 1}))
        assert list(mech.plan_round({0, 1}).placements) == [want]


@pytest.mark.parametrize("field,value", [("order", "random"), ("prior", "zero"), ("placement", "anywhere")])
def test_mechanism_options_are_validated(field, value):
    with pytest.raises(ValueError, match=f"{field}='{value}' must be one of"):
        MechanismConfig(**{field: value})


# ------------------------------------------------------------------- event-driven reallocation


@pytest.mark.parametrize("mode,cost", [("in_place", 1.5), ("restart", 45.0)])
def test_event_driven_reallocation_by_hand(mode, cost):
    """elastic_fair on 4 v100s (one server), job type e (1, 2, 4 GPUs: 1, 2, 4 steps/s), rounds of 360 s.

    With events: t=0 A (2000 steps, up to 4 GPUs) alone on 4 GPUs; t=100 B (200 steps, up to 4)
    arrives: the round ends, A shrinks to 2 (resize cost c) with 400 + 2 (100 - c) = 600 - 2c steps
    done by t=200, when B (2 GPUs, 2/s) finishes: the round ends, A grows back to 4 (cost c) and
    finishes at 200 + c + (1400 + 2c) / 4 = 550 + 1.5c. JCT_B = 100.
    Without events: B waits for t=360; A has 1440 steps then, shrinks to 2 (cost c) while B runs to
    460; B's GPUs idle until 720, A finishes at 360 + c + 560 / 2 = 640 + c. JCT_B = 360.
    """
    cluster = Cluster(gpus={"v100": 4}, gpus_per_server={"v100": 4})
    jobs = [JobSpec(job_id=0, job_type="e", scale_factor=4, min_gpus=1, total_steps=2000.0, arrival_s=0.0),
            JobSpec(job_id=1, job_type="e", scale_factor=4, min_gpus=1, total_steps=200.0, arrival_s=100.0)]
    out = {}
    for events in (True, False):
        mc = MechanismConfig(round_s=360.0, restart_cost_s=45.0, resize_cost_s=1.5, elastic_resize=mode,
                             reallocate_on_events=events)
        out[events] = simulate(jobs, cluster, toy_table(), get_policy("elastic_fair"),
                               SimConfig(mechanism=mc, check_allocations=True))
    ev, rb = out[True], out[False]
    assert ev.finish_s.tolist() == pytest.approx([550.0 + 1.5 * cost, 200.0], abs=1e-9)
    assert ev.lost_s.tolist() == pytest.approx([2 * cost, 0.0], abs=1e-12)
    changes = (ev.resizes[0], ev.restarts[0])
    assert changes == ((2, 0) if mode == "in_place" else (0, 2))
    # Rounds: [0, 100), [100, 200), then A alone, past one full round (560) when c = 45.
    assert ev.rounds == (3 if mode == "in_place" else 4) and ev.end_s == pytest.approx(550.0 + 1.5 * cost)
    np.testing.assert_allclose(ev.gpu_s[:, 0], [4 * 100 + 2 * 100 + 4 * (350.0 + 1.5 * cost), 2 * 100], atol=1e-9)
    assert rb.finish_s.tolist() == pytest.approx([640.0 + cost, 460.0], abs=1e-9)
    assert rb.lost_s.tolist() == pytest.approx([cost, 0.0], abs=1e-12)


def test_event_driven_round_end_keeps_an_unpaid_change_cost():
    """fifo on 4 v100s, type a (1 GPU, 2 steps/s), start cost 30 s, events on.

    t=0 X (200 steps) starts paying 30 s; t=10 Y (100 steps) arrives: the round ends with 20 s of
    X's start still owed; X keeps its GPU and pays them first, Y pays its own 30 s and finishes at
    10 + 30 + 50 = 90; X runs from 30 and finishes at 30 + 100 = 130, having lost exactly 30 s.
    """
    cluster = Cluster(gpus={"v100": 4}, gpus_per_server={"v100": 4})
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=1, total_steps=200.0, arrival_s=0.0),
            JobSpec(job_id=1, job_type="a", scale_factor=1, total_steps=100.0, arrival_s=10.0)]
    mc = MechanismConfig(round_s=360.0, start_cost_s=30.0, reallocate_on_events=True)
    r = simulate(jobs, cluster, toy_table(), get_policy("fifo"), SimConfig(mechanism=mc, check_allocations=True))
    assert r.finish_s.tolist() == pytest.approx([130.0, 90.0], abs=1e-9)
    assert r.lost_s.tolist() == pytest.approx([30.0, 30.0], abs=1e-12)
    assert r.restarts.tolist() == [0, 0] and r.rounds == 3
    # The round boundaries: 0, 10 (arrival), 90 (Y done), then X alone to 130.
    np.testing.assert_allclose(r.gpu_s[:, 0], [130.0, 80.0], atol=1e-9)


def test_end_round_counts_a_shortened_round():
    """Two rows sharing one GPU half and half (prior: one round at the allocation, 180 of 360 s each):
    row 0 runs a round cut to 60 s, so it has received 240 of 420 s and row 1 180 of 420 s."""
    cluster = Cluster(gpus={"v100": 1}, gpus_per_server={"v100": 1})
    mech = RoundMechanism(cluster, MechanismConfig(round_s=360.0, reallocate_on_events=True))
    mech.set_allocation(Allocation(rows=[(0,), (1,)], X=np.array([[0.5], [0.5]]), gpus={0: 1, 1: 1}))
    assert list(mech.plan_round({0, 1}).placements) == [0]
    mech.end_round(length_s=60.0)
    np.testing.assert_allclose(mech.priorities()[:, 0], [0.5 / (240 / 420), 0.5 / (180 / 420)])
    assert list(mech.plan_round({0, 1}).placements) == [1]
    with pytest.raises(ValueError, match="length_s=-1.0 must be a round length"):
        mech.end_round(length_s=-1.0)
    with pytest.raises(TypeError, match="reallocate_on_events=1 must be True or False"):
        MechanismConfig(reallocate_on_events=1)


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_event_driven_conservation_on_a_generated_trace(gavel, mode):
    """Elastic and rigid jobs from the generator, events on: every job runs exactly its steps and
    no type holds more GPU-seconds than it has over the run; rounds are cut at events, so there are
    more of them than with fixed rounds, and the median JCT is lower (no wait for a boundary)."""
    cluster = Cluster.parse("v100=4,p100=4,k80=4", gpus_per_server=4)
    jobs = generate_jobs(gavel, num_jobs=24, rate_per_hour=12.0, seed=3, elastic_fraction=0.5,
                         scale_choices=(1, 2, 4), scale_probs=(0.4, 0.3, 0.3))
    jobs = [dataclasses.replace(j, total_steps=j.total_steps * 0.1) for j in jobs]
    mc = MechanismConfig(round_s=360.0, elastic_resize=mode, reallocate_on_events=True)
    r = simulate(jobs, cluster, gavel, get_policy("elastic_fair"), SimConfig(mechanism=mc, check_allocations=True))
    assert np.isfinite(r.finish_s).all() and (r.finish_s > r.arrival_s).all()
    np.testing.assert_allclose(r.steps_run, [j.total_steps for j in jobs])
    assert (r.gpu_s.sum(axis=0) <= np.array([4, 4, 4]) * r.end_s + 1e-6).all()
    assert (r.resizes > 0).any() if mode == "in_place" else (r.resizes == 0).all()
    off = simulate(jobs, cluster, gavel, get_policy("elastic_fair"),
                   SimConfig(mechanism=dataclasses.replace(mc, reallocate_on_events=False)))
    assert r.rounds > off.rounds  # rounds cut at arrivals and completions
    assert np.median(r.jct_s) < np.median(off.jct_s)
