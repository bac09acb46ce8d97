"""The cluster service replayed in virtual time (virtualflow.service.replay), without processes.

Proofs: a job alone finishes exactly when the timing model says (pauses, launch, rate, done
latency) — a hand computation; the replay's decisions are the service's own ``Scheduler``'s,
checked against an independent drive of the same scheduler; a job is never moved before its
first step (the service's pin); rounds stretch when launches block the loop; ``measure`` recovers
known constants and rates from a synthetic run's records, and ``virtualflow cluster replay``
reproduces a run from its own database.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from virtualflow.cli import main as cli_main
from virtualflow.cluster.policies.base import get_policy
from virtualflow.service.core import JobView, Scheduler
from virtualflow.service.replay import ReplayConfig, ReplayCosts, ReplayJob, measure, replay
from virtualflow.service.runner import init_cluster
from virtualflow.service.state import ClusterDB

SLOW = {"v100": 1.0, "k80": 2.0}
COSTS = ReplayCosts(start_s=2.0, resume_s=1.5, start_per_worker_s=0.5, grow_s=1.0, shrink_s=0.2, launch_s=0.1,
                    first_launch_s=0.7, stop_s=0.3, done_s=0.2, idle_s=0.25, round_extra_s=0.0)


def job(jid: int, steps: int, arrival: float, rates: dict[str, float], **kw) -> ReplayJob:
    return ReplayJob(job_id=jid, steps=steps, arrival_s=arrival, slowdowns=dict(SLOW), rates=rates, **kw)


def test_a_job_alone_finishes_when_the_timing_model_says():
    j = job(1, 100, 10.0, {"v100/1": 20.0})
    res = replay([j], ReplayConfig(slots={"v100": 1, "k80": 1}, policy="fifo", round_s=3.0), COSTS)
    launch = 10.0 + COSTS.idle_s + COSTS.first_launch_s
    # first step ends start_s after the launch returned; then 99 more at 20 steps/s; done_s later
    expect = launch + COSTS.start_s + 99 / 20.0 + COSTS.done_s
    assert res.finish_s[1] == pytest.approx(expect)
    assert res.jct_s[1] == pytest.approx(expect - 10.0)
    assert res.rounds[0].start_s == pytest.approx(10.25)
    assert all(r.end_s - r.start_s == pytest.approx(3.0) for r in res.rounds)
    assert res.starts[1] == 1 and res.restarts[1] == 0 and res.resizes[1] == 0


def test_a_queued_job_starts_at_the_first_round_after_the_slot_frees():
    a = job(1, 40, 0.0, {"v100/1": 20.0})
    b = job(2, 40, 0.0, {"v100/1": 20.0})
    costs = ReplayCosts(start_s=1.0, resume_s=1.0, launch_s=0.0, first_launch_s=0.0, done_s=0.0, idle_s=0.0,
                        stop_s=0.0)
    res = replay([a, b], ReplayConfig(slots={"v100": 1}, policy="fifo", round_s=2.0), costs)
    # job 1: first step at 1.0, 39 more -> 2.95; job 2 starts at the round at 4.0 -> 4.0 + 1 + 1.95
    assert res.finish_s[1] == pytest.approx(2.95)
    assert res.finish_s[2] == pytest.approx(6.95)
    assert res.makespan_s == pytest.approx(6.95)


def test_decisions_are_the_services_scheduler(monkeypatch):
    """Every round enacts exactly what the service's Scheduler decided (recorded as it decides),
    and the first round's decision is what a fresh Scheduler decides for the same jobs."""
    import virtualflow.service.replay as replay_mod

    decided: list[list[tuple[str, int]]] = []
    seen: list[tuple[list[JobView], float]] = []

    class Recording(Scheduler):
        def plan(self, views, now_s, pinned=frozenset()):
            d = super().plan(views, now_s, pinned)
            decided.append([(a.kind, a.job_id) for a in d.actions])
            seen.append((views, now_s))
            return d

    monkeypatch.setattr(replay_mod, "Scheduler", Recording)
    jobs = [job(i, 60 + 10 * i, 1.5 * i, {"v100/1": 20.0, "k80/1": 10.0, "v100/2": 36.0, "k80/2": 18.0},
                elastic=i % 2 == 0, min_workers=1, max_workers=2 if i % 2 == 0 else 1) for i in range(1, 6)]
    cfg = ReplayConfig(slots={"v100": 2, "k80": 1}, policy="elastic_fair", round_s=2.0)
    res = replay(jobs, cfg, COSTS)
    assert sorted(res.finish_s) == [1, 2, 3, 4, 5]
    assert [r.actions for r in res.rounds] == decided
    assert sum(len(a) for a in decided) > 5
    fresh = Scheduler(dict(cfg.slots), get_policy("elastic_fair"), round_s=2.0)
    views, now_s = seen[0]
    assert [(a.kind, a.job_id) for a in fresh.plan(views, now_s).actions] == decided[0]


def test_the_replay_uses_the_mechanism_it_is_given():
    from virtualflow.cluster.mechanism import MechanismConfig

    mech = MechanismConfig(round_s=2.0, start_cost_s=0.0, order="global", prior="allocation", carry_deficits=False)
    sched = Scheduler({"v100": 1}, get_policy("fifo"), round_s=2.0, mechanism=mech)
    assert sched.mechanism.config is mech
    jobs = [job(i, 60, 0.5 * i, {"v100/1": 20.0, "k80/1": 10.0}) for i in range(1, 5)]
    a = replay(jobs, ReplayConfig(slots={"v100": 1, "k80": 1}, policy="las", round_s=2.0, mechanism=mech), COSTS)
    b = replay(jobs, ReplayConfig(slots={"v100": 1, "k80": 1}, policy="las", round_s=2.0,
                                  mechanism=MechanismConfig.gavel(round_s=2.0)), COSTS)
    assert sorted(a.finish_s) == sorted(b.finish_s) == [1, 2, 3, 4]


def test_a_job_is_not_moved_before_its_first_step():
    """Rounds far shorter than a start: las would rotate two jobs on one slot every round, but a
    started job keeps its slot until it has stepped (the service's pin)."""
    jobs = [job(1, 200, 0.0, {"v100/1": 50.0}), job(2, 200, 0.0, {"v100/1": 50.0})]
    costs = ReplayCosts(start_s=3.0, resume_s=3.0, launch_s=0.0, first_launch_s=0.0, idle_s=0.0, done_s=0.0)
    res = replay(jobs, ReplayConfig(slots={"v100": 1}, policy="las", round_s=0.5), costs)
    started: dict[int, float] = {}
    for r in res.rounds:
        for kind, jid in r.actions:
            if kind in ("preempt", "restart"):
                assert r.start_s >= started[jid] + 3.0 - 1e-9, (jid, r.start_s, started[jid])
            if kind in ("start", "restart"):
                started[jid] = r.start_s
    assert res.restarts[1] + res.restarts[2] >= 1  # it does rotate once jobs have stepped


def test_min_run_s_pins_longer():
    jobs = [job(1, 400, 0.0, {"v100/1": 50.0}), job(2, 400, 0.0, {"v100/1": 50.0})]
    costs = ReplayCosts(start_s=0.5, resume_s=0.5, launch_s=0.0, first_launch_s=0.0, idle_s=0.0, done_s=0.0)
    free = replay(jobs, ReplayConfig(slots={"v100": 1}, policy="las", round_s=1.0), costs)
    held = replay(jobs, ReplayConfig(slots={"v100": 1}, policy="las", round_s=1.0, min_run_s=4.0), costs)
    assert sum(held.restarts.values()) < sum(free.restarts.values())


def test_launches_that_block_the_loop_stretch_the_round():
    jobs = [job(i, 50, 0.0, {"v100/1": 20.0}) for i in range(1, 5)]
    costs = ReplayCosts(launch_s=0.9, first_launch_s=0.9, start_s=0.5, resume_s=0.5, idle_s=0.0, done_s=0.0,
                        round_extra_s=0.05)
    res = replay(jobs, ReplayConfig(slots={"v100": 4}, policy="fifo", round_s=2.0), costs)
    assert res.rounds[0].actions == [("start", i) for i in range(1, 5)]
    assert res.rounds[0].end_s - res.rounds[0].start_s == pytest.approx(4 * 0.9 + 0.05)
    # four workers started at once: each start pays 3 x start_per_worker_s more (0 here) -> job 1:
    assert res.finish_s[1] == pytest.approx(0.9 + 0.5 + 49 / 20.0)


def test_observed_pauses_replace_the_model():
    a = job(1, 50, 0.0, {"v100/1": 20.0}, start_pauses=(4.0,))
    costs = ReplayCosts(launch_s=0.0, first_launch_s=0.0, start_s=1.0, idle_s=0.0, done_s=0.0)
    res = replay([a], ReplayConfig(slots={"v100": 1}, policy="fifo", round_s=5.0), costs)
    assert res.finish_s[1] == pytest.approx(4.0 + 49 / 20.0)
    with pytest.raises(ValueError, match="start_pauses"):
        job(2, 5, 0.0, {}, start_pauses=(-1.0,))


def test_a_deadline_job_is_admitted_ahead_of_the_policy():
    """The service's earliest-deadline-first admission runs in the replay: under fifo a short job
    with a deadline waits for a long one without it, and is put ahead of it with it."""
    costs = ReplayCosts(start_s=0.5, resume_s=0.5, launch_s=0.0, first_launch_s=0.0, idle_s=0.0, done_s=0.0,
                        stop_s=0.0)
    cfg = ReplayConfig(slots={"v100": 1}, policy="fifo", round_s=2.0)
    long_ = job(1, 400, 0.0, {"v100/1": 20.0})
    plain = replay([long_, job(2, 40, 1.0, {"v100/1": 20.0})], cfg, costs)
    assert plain.finish_s[2] > plain.finish_s[1] and plain.restarts[1] == 0
    urgent = replay([long_, job(2, 40, 1.0, {"v100/1": 20.0}, deadline_s=11.0)], cfg, costs)
    assert urgent.finish_s[2] < urgent.finish_s[1] and urgent.restarts[1] == 1
    assert urgent.finish_s[2] <= 11.0  # admitted at the round whose slack fell under a round (t = 8)


def test_concurrent_starts_pay_for_each_other():
    jobs = [job(i, 50, 0.0, {"v100/1": 20.0}) for i in range(1, 4)]
    costs = ReplayCosts(launch_s=0.0, first_launch_s=0.0, start_s=1.0, start_per_worker_s=0.5, idle_s=0.0, done_s=0.0)
    res = replay(jobs, ReplayConfig(slots={"v100": 3}, policy="fifo", round_s=5.0), costs)
    for i in (1, 2, 3):
        assert res.finish_s[i] == pytest.approx(1.0 + 2 * 0.5 + 49 / 20.0)


def test_an_elastic_job_grows_in_place_after_grow_s():
    # Job 2 holds one of two slots until it ends; job 1 (elastic 1-2) then grows in place.
    a = job(1, 400, 0.0, {"v100/1": 20.0, "v100/2": 40.0}, elastic=True, min_workers=1, max_workers=2)
    b = job(2, 30, 0.0, {"v100/1": 20.0})
    costs = ReplayCosts(launch_s=0.0, first_launch_s=0.0, start_s=0.5, resume_s=0.5, grow_s=1.0, idle_s=0.0,
                        done_s=0.0, stop_s=0.0)
    res = replay([a, b], ReplayConfig(slots={"v100": 2}, policy="elastic_fair", round_s=2.0), costs)
    assert res.resizes[1] >= 1 and res.restarts[1] == 0
    grow = next(r for r in res.rounds if ("resize", 1) in r.actions)
    assert grow.placements[1] == ("v100", 2)
    # first step at 0.5 (stepping from 0.45), 20 steps/s until the grow lands at 2.0 + grow_s = 3.0,
    # then 40 steps/s for the rest
    done_at_grow = (3.0 - 0.45) * 20.0
    assert res.finish_s[1] == pytest.approx(3.0 + (400 - done_at_grow) / 40.0)


def test_same_inputs_same_result_and_bad_inputs_are_refused():
    jobs = [job(i, 80, 2.0 * i, {"v100/1": 20.0, "k80/1": 10.0}) for i in range(1, 6)]
    cfg = ReplayConfig(slots={"v100": 1, "k80": 1}, policy="las", round_s=3.0)
    assert replay(jobs, cfg, COSTS).finish_s == replay(list(reversed(jobs)), cfg, COSTS).finish_s
    with pytest.raises(ValueError, match="start_s=-1"):
        ReplayCosts(start_s=-1)
    with pytest.raises(ValueError, match="min_workers=3 and max_workers=2"):
        job(9, 10, 0.0, {}, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="round_s=0"):
        ReplayConfig(slots={"v100": 1}, round_s=0)
    with pytest.raises(ValueError, match="no factor for type"):
        replay([ReplayJob(job_id=1, steps=5, arrival_s=0.0, slowdowns={"v100": 1.0})],
               ReplayConfig(slots={"v100": 1, "k80": 1}), COSTS)


# -- measuring a run's constants -----------------------------------------------------------------
class Row:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def synthetic_run():
    """Two jobs on a clock starting at 1000: job 1 starts alone in round 1 (pause 2.0); in round 2
    job 1 grows to two workers and job 2 starts on two (three worker processes start: pause 4.0)."""
    t0 = 1000.0
    rounds = [{"start_s": t0 + 0.2, "end_s": t0 + 6.2}, {"start_s": t0 + 6.2, "end_s": t0 + 12.2}]
    events = [
        {"t": t0 + 1.2, "job_id": 1, "kind": "start", "data": {"acc_type": "v100", "workers": 1, "resumed": False}},
        {"t": t0 + 6.2, "job_id": 1, "kind": "throughput",
         "data": {"acc_type": "v100", "workers": 1, "steps_per_s": 9.5}},
        {"t": t0 + 6.3, "job_id": 1, "kind": "resize", "data": {"acc_type": "v100", "workers": 2}},
        {"t": t0 + 6.4, "job_id": 2, "kind": "start", "data": {"acc_type": "k80", "workers": 2, "resumed": False}},
        {"t": t0 + 10.0, "job_id": 1, "kind": "done", "data": {}},
        {"t": t0 + 12.0, "job_id": 2, "kind": "done", "data": {}},
    ]
    steps = {1: [(t0 + 3.2 + 0.1 * k, k, 1) for k in range(40)]  # 10 steps/s from 3.2 (pause 2.0)
             + [(t0 + 7.8 + 0.05 * k, 40 + k, 2) for k in range(40)],  # grown: first 2-worker step 1.5 s later
             2: [(t0 + 10.4 + 0.2 * k, k, 2) for k in range(8)]}  # pause 4.0 with 3 workers starting
    rows = [Row(id=1, steps=80, elastic=True, min_workers=1, max_workers=2, priority=1.0, submitted_s=t0),
            Row(id=2, steps=8, elastic=False, min_workers=2, max_workers=2, priority=1.0, submitted_s=t0 + 5.0)]
    return rows, events, rounds, steps


def test_measure_recovers_the_constants_and_rates():
    rows, events, rounds, steps = synthetic_run()
    jobs, costs = measure(rows, events, rounds, steps, round_s=6.0, slowdowns={1: dict(SLOW), 2: dict(SLOW)})
    # start pauses (2.0 with 1 worker starting, 4.0 with 3: job 2's two plus job 1's newcomer): a line
    assert costs.start_s == pytest.approx(2.0)
    assert costs.start_per_worker_s == pytest.approx(1.0)
    assert costs.resume_s == pytest.approx(2.0)  # no resumed start seen: the first start's
    assert costs.grow_s == pytest.approx(1.5)
    assert costs.first_launch_s == pytest.approx(1.0)
    assert costs.done_s == pytest.approx((0.25 + 0.2) / 2)  # last steps at 9.75 and 11.8, done at 10 and 12
    assert costs.idle_s == pytest.approx(0.2)
    by = {j.job_id: j for j in jobs}
    assert by[1].rates["v100/1"] == pytest.approx(10.0)
    assert by[1].rates["v100/2"] == pytest.approx(20.0)
    assert by[1].measured == {"v100/1": 9.5}
    assert by[2].rates["k80/2"] == pytest.approx(5.0)
    assert by[2].arrival_s == 1005.0 and by[1].elastic and not by[2].elastic
    assert by[1].steps == 80 and by[2].steps == 8
    rows[1].state, rows[1].steps_done = "cancelled", 5
    assert measure(rows, events, rounds, steps, round_s=6.0, slowdowns={1: dict(SLOW), 2: dict(SLOW)})[0][1].steps == 5
    rows[1].state = "done"
    assert by[1].start_pauses == () and by[2].start_pauses == ()
    traced, _ = measure(rows, events, rounds, steps, round_s=6.0, slowdowns={1: dict(SLOW), 2: dict(SLOW)},
                        observed=True)
    assert [j.start_pauses for j in traced] == [pytest.approx((2.0,)), pytest.approx((4.0,))]
    assert traced[0].measurements == {"v100/1": (9.5,)}


# -- the command line ----------------------------------------------------------------------------
def two_job_cluster(tmp_path) -> tuple[str, list[int]]:
    """A cluster directory (one v100 slot, fifo, rounds of 2 s) whose records were written by the
    replay's own model: two 30-step jobs, the second queued behind the first."""
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=2.0, slowdowns={}).close()
    db = ClusterDB(d)
    t0 = 5000.0
    # Job 1 arrives at t0, round at +0.2, launch returns at +0.5, first step at +1.5, 20 steps/s,
    # 30 steps, done at +3.05; job 2 arrives at +1 and starts at the round after (+4.2), 10 steps/s.
    ids = [db.add_job(name=f"j{i}", target="x.py:f", steps=30, elastic=False, min_workers=1, max_workers=1,
                      priority=1.0, job_type=None, deterministic=True, checkpoint_every=10) for i in (1, 2)]
    for jid, sub in zip(ids, (t0, t0 + 1.0)):
        db.update_job(jid, submitted_s=sub, run_dir=str(tmp_path / f"run{jid}"))
        os.makedirs(tmp_path / f"run{jid}")
    r1 = db.add_round(start_s=t0 + 0.2, policy="fifo", solved=True, decision_s=0.001, active=2, placements=[])
    db.event("start", ids[0], now=t0 + 0.5, acc_type="v100", workers=1, resumed=False)
    first = t0 + 1.5
    with open(tmp_path / f"run{ids[0]}" / "metrics.jsonl", "w") as f:
        for k in range(30):
            f.write(json.dumps({"time": first + 0.05 * k, "step": k, "loss": 1.0, "workers": 1}) + "\n")
    done1 = first + 1.45 + 0.1
    db.set_job_state(ids[0], "done", now=done1, event="done", finished_s=done1, steps_done=30)
    db.end_round(r1, t0 + 2.2)
    r2 = db.add_round(start_s=t0 + 2.2, policy="fifo", solved=True, decision_s=0.001, active=1, placements=[])
    db.end_round(r2, t0 + 4.2)
    r3 = db.add_round(start_s=t0 + 4.2, policy="fifo", solved=True, decision_s=0.001, active=1, placements=[])
    db.event("start", ids[1], now=t0 + 4.23, acc_type="v100", workers=1, resumed=False)
    with open(tmp_path / f"run{ids[1]}" / "metrics.jsonl", "w") as f:
        f.write("{torn line\n")
        for k in range(30):
            f.write(json.dumps({"time": t0 + 5.23 + 0.1 * k, "step": k, "loss": 1.0, "workers": 1}) + "\n")
    done2 = t0 + 5.23 + 2.9 + 0.1
    db.set_job_state(ids[1], "done", now=done2, event="done", finished_s=done2, steps_done=30)
    db.end_round(r3, t0 + 6.2)
    db.close()
    return d, ids


def test_cluster_replay_reproduces_a_run_from_its_database(tmp_path, capsys):
    """The CLI predicts every job's JCT of a run from its records within a step or two."""
    d, ids = two_job_cluster(tmp_path)
    assert cli_main.main(["cluster", "replay", "--dir", d, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["jct_error_median"] < 0.02 and out["makespan_error"] < 0.02
    assert [p["job"] for p in out["jobs"]] == ids
    assert cli_main.main(["cluster", "replay", "--dir", d, "--json", "--observed"]) == 0
    assert json.loads(capsys.readouterr().out)["jct_error_median"] < 0.02
    for mech in ("lease_first", "gavel"):  # the service's round mechanics, named explicitly
        assert cli_main.main(["cluster", "replay", "--dir", d, "--json", "--mechanism", mech]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["config"]["mechanism"] == mech and got["jct_error_median"] < 0.02
    assert cli_main.main(["cluster", "replay", "--dir", d]) == 0
    text = capsys.readouterr().out
    assert "median JCT error" in text and "predicted" in text
    # what if: rounds of 1 s would start job 2 sooner
    assert cli_main.main(["cluster", "replay", "--dir", d, "--json", "--round-s", "1"]) == 0
    faster = json.loads(capsys.readouterr().out)
    assert faster["jobs"][1]["predicted_jct_s"] < out["jobs"][1]["predicted_jct_s"]


def test_cluster_replay_refuses_what_it_cannot_replay(tmp_path, capsys):
    assert cli_main.main(["cluster", "replay", "--dir", str(tmp_path)]) == 2
    assert "holds no cluster database" in capsys.readouterr().err
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=2.0).close()
    assert cli_main.main(["cluster", "replay", "--dir", d]) == 2
    assert "no finished job" in capsys.readouterr().err
    assert math.isfinite(1.0)


def test_the_cluster_records_its_round_mechanics_and_the_replay_reads_them(tmp_path):
    """`cluster start --mechanism` is written to the database; the service runs it and `cluster
    replay` replays with it unless told otherwise; an unknown name is refused, nothing written."""
    from virtualflow.cli.cluster_replay import mechanism_config
    from virtualflow.cluster.mechanism import MechanismConfig
    from virtualflow.service.runner import Service

    d = str(tmp_path / "c")
    with pytest.raises(ValueError, match=r"--mechanism 'gavle' must be one of \['default', 'lease_first', 'gavel'\]"):
        init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=2.0, mechanism="gavle")
    assert not os.path.exists(d)
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=2.0, mechanism="lease_first").close()
    recorded = ClusterDB(d).config()["mechanism"]
    want = MechanismConfig.lease_first(round_s=2.0, start_cost_s=0.0)
    service = Service(d)
    try:
        assert service.scheduler.mechanism.config == want
    finally:
        service.db.close()
    assert mechanism_config("recorded", 2.0, recorded) == want
    assert mechanism_config("recorded", 2.0, None) == MechanismConfig(round_s=2.0, start_cost_s=0.0)
