"""The cluster service without processes: decisions (virtualflow.service.core), the database
(virtualflow.service.state) and the checks of a submission (virtualflow.cli.cluster).

The scheduler is proven to be the simulator's policy and mechanism: driving it round by round
with the progress the table predicts places every job exactly where ``virtualflow.cluster.
simulator.simulate`` places it, and finishes every job in the same round.
"""

from __future__ import annotations

import math
import os
import sqlite3

import numpy as np
import pytest

from virtualflow.cli import main as cli_main
from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.policies.base import get_policy
from virtualflow.cluster.simulator import SimConfig, simulate
from virtualflow.cluster.throughputs import ThroughputTable
from virtualflow.service.core import (PRIOR_STEPS_PER_S, Action, JobView, Scheduler, diff_actions, estimate,
                                      parse_slowdowns, prior_rate, recovery_action, type_slowdowns,
                                      update_estimates)
from virtualflow.service.runner import gavel_table, init_cluster
from virtualflow.service.state import ClusterDB

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS = {"v100": 2, "k80": 2}


# -- emulated accelerator types ----------------------------------------------------------------
def test_slowdowns_follow_the_throughput_table():
    table = gavel_table()
    jt = "ResNet-18 (batch size 64)"
    s = type_slowdowns(("v100", "k80"), table, job_type=jt)
    assert s["v100"] == 1.0
    assert s["k80"] == pytest.approx(table.throughput(jt, "v100", 1) / table.throughput(jt, "k80", 1))
    # Without a job type: the geometric mean over the job types; the fastest type is 1.
    g = type_slowdowns(("v100", "p100", "k80"), table)
    assert min(g.values()) == 1.0 and g["k80"] > g["p100"] > 1.0
    assert type_slowdowns(("v100", "k80"), table, overrides={"k80": 2.5})["k80"] == 2.5


def test_unknown_type_needs_a_slowdown():
    with pytest.raises(ValueError, match="--slowdowns t4=FACTOR"):
        type_slowdowns(("v100", "t4"), gavel_table())
    assert type_slowdowns(("v100", "t4"), gavel_table(), overrides={"t4": 1.7})["t4"] == 1.7
    with pytest.raises(ValueError, match="FACTOR >= 1"):
        parse_slowdowns("k80=0.5")
    assert parse_slowdowns("k80=3, v100=1") == {"k80": 3.0, "v100": 1.0}


# -- estimates -----------------------------------------------------------------------------------
def test_estimates_start_at_the_prior_then_follow_measurements():
    v = JobView(job_id=1, steps=10, max_workers=2, slowdowns={"v100": 1.0, "k80": 4.0})
    assert estimate(v, "v100", 1) == PRIOR_STEPS_PER_S
    assert estimate(v, "k80", 2) == PRIOR_STEPS_PER_S * 2 / 4.0
    v.estimates = update_estimates({}, "k80", 1, 0.5)  # measured: 0.5 steps/s on one K80
    assert estimate(v, "k80", 1) == 0.5
    assert estimate(v, "v100", 1) == pytest.approx(2.0)  # 0.5 x slowdown 4
    assert estimate(v, "v100", 2) == pytest.approx(4.0)
    v.estimates = update_estimates(v.estimates, "k80", 1, 1.5)  # exponential average, half weight
    assert estimate(v, "k80", 1) == pytest.approx(1.0)
    assert update_estimates(v.estimates, "k80", 1, float("nan")) == v.estimates  # ignored
    # A job never measured is assumed to be like the measured ones (their median per-worker rate).
    fresh = JobView(job_id=2, steps=10, max_workers=2, slowdowns={"v100": 1.0, "k80": 4.0})
    other = JobView(job_id=3, steps=10, max_workers=2, slowdowns={"v100": 1.0, "k80": 4.0}, estimates={"v100/2": 4.0})
    assert prior_rate([v, fresh]) == pytest.approx(4.0) and prior_rate([fresh]) == PRIOR_STEPS_PER_S  # 1.0 x 4
    assert prior_rate([v, fresh, other]) == pytest.approx(3.0)  # median of 4.0 and 2.0
    assert estimate(fresh, "k80", 2, prior_rate([v, fresh, other])) == pytest.approx(3.0 * 2 / 4.0)


# -- actions -------------------------------------------------------------------------------------
def view(jid, running=None, slots=(), elastic=False, lo=1, hi=1):
    return JobView(job_id=jid, steps=100, elastic=elastic, min_workers=lo, max_workers=hi,
                   slowdowns={"v100": 1.0, "k80": 3.0}, running=running, slots=tuple(slots))


def test_actions_keep_resize_preempt_restart_start():
    views = [view(1, ("v100", 1), ["v100-1"]),                              # kept
             view(2, ("k80", 2), ["k80-0", "k80-1"], elastic=True, hi=2),   # shrinks in place
             view(3, ("v100", 1), ["v100-0"]),                              # preempted
             view(4),                                                       # starts
             view(5, ("k80", 1), [])]                                       # (no slots held: bogus; moves)
    views[4].slots = ()
    actions, slots = diff_actions(views[:4], {1: ("v100", 1), 2: ("k80", 1), 4: ("v100", 1)}, SLOTS)
    assert actions == [Action("preempt", 3), Action("resize", 2, "k80", 1, ("k80-0",)),
                       Action("start", 4, "v100", 1, ("v100-0",))]
    assert slots == {1: ("v100-1",), 2: ("k80-0",), 4: ("v100-0",)}


def test_swapping_types_releases_before_taking():
    views = [view(1, ("v100", 2), ["v100-0", "v100-1"], hi=2), view(2, ("k80", 2), ["k80-0", "k80-1"], hi=2)]
    actions, slots = diff_actions(views, {1: ("k80", 2), 2: ("v100", 2)}, SLOTS)
    assert [a.kind for a in actions] == ["restart", "restart"]
    assert slots == {1: ("k80-0", "k80-1"), 2: ("v100-0", "v100-1")}
    grow = [view(1, ("v100", 1), ["v100-1"], elastic=True, hi=2)]
    actions, slots = diff_actions(grow, {1: ("v100", 2)}, SLOTS)
    assert actions == [Action("resize", 1, "v100", 2, ("v100-1", "v100-0"))]  # keeps its slot, adds one
    rigid = [view(1, ("v100", 1), ["v100-0"], hi=2)]  # a rigid job's new count is a restart
    assert diff_actions(rigid, {1: ("v100", 2)}, SLOTS)[0][0].kind == "restart"
    with pytest.raises(ValueError, match="over-committed"):
        diff_actions([view(1, hi=3), view(2)], {1: ("v100", 2), 2: ("v100", 1)}, SLOTS)


# -- the scheduler is the simulator's policy + mechanism -----------------------------------------
def drive(policy: str, specs: list[JobSpec], rates: dict[int, dict[tuple[str, int], float]], round_s: float):
    """Play the service's scheduler with the progress its (exact) estimates predict; returns per
    job the round it finished in, and every round's placements."""
    sched = Scheduler(SLOTS, get_policy(policy), round_s=round_s)
    views = {j.job_id: JobView(job_id=j.job_id, steps=int(j.total_steps), elastic=j.elastic,
                               min_workers=j.min_gpus or j.scale_factor, max_workers=j.scale_factor, priority=j.weight,
                               slowdowns={"v100": 1.0, "k80": 3.0},
                               estimates={f"{t}/{g}": v for (t, g), v in rates[j.job_id].items()}) for j in specs}
    done: dict[int, int] = {}
    history = []
    for r in range(200):
        active = [v for v in views.values() if v.job_id not in done]
        if not active:
            break
        d = sched.plan(active, r * round_s)
        for a in d.actions:  # every action's slots are in range and no slot is used twice
            assert all(s.rpartition("-")[0] == a.acc_type for s in a.slots) or a.kind == "preempt"
        used = [s for ss in d.slots.values() for s in ss]
        assert len(used) == len(set(used))
        history.append({jid: (p.acc_type, p.gpus) for jid, p in d.plan.placements.items()})
        for v in active:
            p = d.plan.placements.get(v.job_id)
            v.running, v.slots = ((p.acc_type, p.gpus), d.slots[v.job_id]) if p else (None, ())
            if p:
                v.steps_done = min(v.steps, v.steps_done + rates[v.job_id][(p.acc_type, p.gpus)] * round_s)
                v.received_s[p.acc_type] = v.received_s.get(p.acc_type, 0.0) + round_s
        sched.end_round()
        for v in active:
            if v.steps_done >= v.steps - 1e-9:
                done[v.job_id] = r
                sched.finished(v.job_id)
    return done, history


@pytest.mark.parametrize("policy", ["las", "elastic_fair", "fifo", "max_throughput", "finish_time_fairness"])
def test_scheduler_places_jobs_as_the_simulator_does(policy):
    R = 10.0
    specs = [JobSpec(job_id=1, job_type="job-1", scale_factor=1, total_steps=120.0),
             JobSpec(job_id=2, job_type="job-2", scale_factor=2, min_gpus=1, total_steps=200.0),
             JobSpec(job_id=3, job_type="job-3", scale_factor=2, total_steps=90.0),
             JobSpec(job_id=4, job_type="job-4", scale_factor=1, total_steps=60.0, weight=2.0)]
    base = {1: 2.0, 2: 1.5, 3: 1.0, 4: 0.7}
    rates = {j: {(t, g): base[j] * g / s for t, s in (("v100", 1.0), ("k80", 3.0)) for g in (1, 2)} for j in base}
    table = ThroughputTable.from_dict({"throughputs": {f"job-{j}": {t: {str(g): rates[j][(t, g)] for g in (1, 2)}
                                                                    for t in SLOTS} for j in base}})
    cluster = Cluster(gpus=dict(SLOTS), gpus_per_server=dict(SLOTS))
    sim = simulate(specs, cluster, table, get_policy(policy),
                   SimConfig(mechanism=MechanismConfig(round_s=R, restart_cost_s=0.0, resize_cost_s=0.0)))
    done, history = drive(policy, specs, rates, R)
    sim_round = {j.job_id: int(math.ceil(f / R - 1e-9)) - 1 for j, f in zip(specs, sim.finish_s)}
    assert done == sim_round
    assert sim.rounds == len(history)


def test_policy_is_resolved_on_arrivals_and_large_estimate_changes_only():
    sched = Scheduler(SLOTS, get_policy("las"), round_s=5)
    a = view(1)
    assert sched.plan([a], 0).solved
    assert not sched.plan([a], 5).solved
    a.estimates = {"v100/1": 1.1}  # within the 25 % drift of the prior (1.0)
    assert not sched.plan([a], 10).solved
    a.estimates = {"v100/1": 3.0}
    assert sched.plan([a], 15).solved
    assert sched.plan([a, view(2)], 20).solved  # an arrival


def test_elastic_jobs_are_capped_at_the_largest_type():
    sched = Scheduler({"v100": 2, "k80": 1}, get_policy("las"), round_s=5)
    d = sched.plan([view(1, elastic=True, lo=1, hi=8)], 0)
    assert d.plan.placements[1].gpus == 2


def test_recovery_after_a_crash():
    done = {"status": "done", "steps_completed": 40}
    assert recovery_action("running", done, True, 40) == "done"
    assert recovery_action("running", {"status": "stopped", "steps_completed": 12}, True, 40) == "resume"
    assert recovery_action("running", None, False, 40) == "restart"
    # The workers wrote final.pt at the last step, the service died before the summary: done.
    assert recovery_action("running", None, True, 40, state_step=40) == "done"
    assert recovery_action("running", None, True, 40, state_step=12) == "resume"
    assert recovery_action("queued", None, True, 40) == "keep"
    assert recovery_action("done", done, True, 40) == "keep"


# -- the database --------------------------------------------------------------------------------
def new_db(tmp_path) -> ClusterDB:
    return init_cluster(str(tmp_path / "c"), slots=dict(SLOTS), policy="las", round_s=5.0)


def add(db: ClusterDB, **kw) -> int:
    fields = dict(name="j", target="x.py:f", steps=10, elastic=False, min_workers=1, max_workers=1, priority=1.0,
                  job_type=None, deterministic=True, checkpoint_every=2)
    fields.update(kw)
    return db.add_job(**fields)


def test_database_states_events_and_wal(tmp_path):
    db = new_db(tmp_path)
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    a, b = add(db), add(db)
    assert db.job(a).run_dir.endswith(os.path.join("jobs", str(a)))
    assert db.set_job_state(a, "running", event="start", acc_type="v100", workers=1, slots=["v100-0"])
    assert db.job(a).slots == ["v100-0"]
    assert db.set_job_state(a, "done", event="done", finished_s=1.0)
    assert not db.set_job_state(a, "running")  # a final state is final
    assert db.job(a).state == "done"
    assert db.request_cancel(b) == "cancelled" and db.job(b).state == "cancelled"
    c = add(db)
    db.set_job_state(c, "running")
    assert db.request_cancel(c) == "requested" and db.job(c).cancel_requested
    assert db.request_cancel(a) == "done"
    with pytest.raises(ValueError, match="job 99 does not exist"):
        db.request_cancel(99)
    assert [e["kind"] for e in db.events(job_id=a)] == ["submit", "start", "done"]
    rid = db.add_round(start_s=1.0, policy="las", solved=True, decision_s=0.01, active=1,
                       placements=[{"job_id": c, "acc_type": "v100", "workers": 1, "slots": ["v100-0"],
                                    "change": "start"}])
    db.end_round(rid, 6.0)
    assert db.allocations()[0]["slots"] == ["v100-0"] and db.allocations()[0]["end_s"] == 6.0


def test_a_malformed_cell_reads_as_its_default(tmp_path):
    db = new_db(tmp_path)
    a = add(db)
    db.conn.execute("UPDATE jobs SET estimates = '{not json', slots = '[1' WHERE id = ?", (a,))
    row = db.job(a)
    assert row.estimates == {} and row.slots == []


def test_not_a_cluster_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a cluster directory"):
        ClusterDB(str(tmp_path))


# -- submissions are checked before anything is queued --------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["missing.py"], "job file 'missing.py' does not exist"),
    (["JOB:paced", "--elastic", "--min-workers", "3", "--max-workers", "2"], "--min-workers 3 is greater than --max-workers 2"),
    (["JOB:paced", "--workers", "3"], "--workers 3 is more than the largest slot type has (2"),
    (["JOB:paced", "--elastic", "--min-workers", "3", "--max-workers", "4"], "--min-workers 3 is more than the largest"),
    (["JOB:paced", "--elastic"], "needs --max-workers"),
    (["JOB:nope"], "has no function 'nope'"),
    (["JOB:paced", "--elastic", "--max-workers", "16"], "--max-workers 16 is more than the largest slot type has (2"),
    (["JOB:paced", "--priority", "0"], "--priority 0 must be a weight between 0.001 and 1000"),
    (["JOB:paced", "--job-type", "nonsense"], "--job-type 'nonsense' is not in Gavel's throughput table"),
])
def test_bad_submissions_are_refused_and_nothing_is_queued(args, message, tmp_path, capsys):
    db = new_db(tmp_path)
    args = [a.replace("JOB", os.path.join(HERE, "service_jobs.py")) for a in args]
    rc = cli_main.main(["submit", *args, "--dir", db.cluster_dir, "--steps", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert db.jobs() == []


def test_a_good_submission_is_queued(tmp_path, capsys):
    db = new_db(tmp_path)
    rc = cli_main.main(["submit", os.path.join(HERE, "service_jobs.py:paced"), "--dir", db.cluster_dir, "--steps",
                        "10", "--elastic", "--max-workers", "2", "--priority", "2"])
    assert rc == 0, capsys.readouterr().err
    (row,) = db.jobs()
    assert (row.state, row.elastic, row.min_workers, row.max_workers, row.priority) == ("queued", True, 1, 2, 2.0)
    assert os.path.isabs(row.target.partition(":")[0])
    assert cli_main.main(["queue", "--dir", db.cluster_dir]) == 0
    assert "queued" in capsys.readouterr().out
    assert cli_main.main(["cancel", str(row.id), "--dir", db.cluster_dir]) == 0
    assert db.job(row.id).state == "cancelled"


def test_cluster_start_refuses_bad_configurations(tmp_path, capsys):
    d = str(tmp_path / "c")
    assert cli_main.main(["cluster", "start", "--dir", d, "--slots", "v100=2,t4=1", "--foreground"]) == 2
    assert "--slowdowns t4=FACTOR" in capsys.readouterr().err
    assert cli_main.main(["cluster", "start", "--dir", d, "--slots", "v100=2", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    for flag, value in (("--hang-factor", "0.5"), ("--launch-timeout-s", "nan"), ("--hang-floor-s", "1e300"),
                        ("--hang-first-step-s", "-1")):
        assert cli_main.main(["cluster", "start", "--dir", d, "--slots", "v100=2", flag, value]) == 2
        assert f"{flag} " in capsys.readouterr().err
    assert not os.path.exists(os.path.join(d, "cluster.db"))


def test_cluster_start_records_the_launch_and_hang_limits(tmp_path):
    """The service's driver time limit and hang rule come from `cluster start`'s flags."""
    from virtualflow.service.runner import Service, init_cluster

    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=4.0, launch_timeout_s=30.0, hang_factor=5.0,
                 hang_floor_s=40.0, hang_first_step_s=90.0).close()
    s = Service(d, launch=lambda target, **kw: None)
    assert s.launch_timeout_s == 30.0
    assert (s.hang.factor, s.hang.floor_s, s.hang.first_step_s) == (5.0, 40.0, 90.0)
    s.db.close()
    np.testing.assert_equal(sqlite3.sqlite_version_info >= (3, 7, 0), True)
