"""Job deadlines in the cluster service (virtualflow.service.deadlines), without processes.

- ``--deadline`` parsing: durations, ISO times, refusals (past, unreadable) with nothing queued;
- the ETA and slack shown by ``virtualflow queue`` and the dashboard;
- one ``deadline_missed`` event per job whose deadline passes unfinished;
- earliest-deadline-first admission (``admit``): an urgent job (makes its deadline only if it runs
  now) takes slots the policy gave to jobs with no deadline or a later one, shrinking elastic jobs
  in place before preempting, never touching a pinned job; its invariants on random instances,
  checked by an independent capacity count;
- in the service (fake job handles): the round enacts the admission, records it, and a job that
  the policy (fifo) would have kept waiting starts first.
"""

from __future__ import annotations

import os
import random
import re
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import pytest

from virtualflow.cli import main as cli_main
from virtualflow.service.core import JobView, estimate
from virtualflow.service.deadlines import (admit, deadline_cells, eta_s, format_duration, newly_missed,
                                           parse_deadline, slack_s)
from virtualflow.service.runner import Service, init_cluster
from virtualflow.service.state import ClusterDB

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(HERE, "service_jobs.py")
NOW = 1_800_000_000.0
SLOW = {"v100": 1.0, "k80": 2.0}


# -- parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,after", [("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("90", 90), ("90s", 90),
                                        ("1d", 86400), ("2.5m", 150), (" 2 h ", 7200)])
def test_durations_count_from_submission(text, after):
    assert parse_deadline(text, NOW) == NOW + after


def test_iso_times_with_and_without_a_zone():
    at = datetime.fromtimestamp(NOW, timezone.utc) + timedelta(hours=3)
    assert parse_deadline(at.isoformat(), NOW) == pytest.approx(NOW + 3 * 3600)
    local = datetime.fromtimestamp(NOW + 600)  # naive: this machine's local time
    assert parse_deadline(local.strftime("%Y-%m-%dT%H:%M:%S"), NOW) == pytest.approx(NOW + 600)


@pytest.mark.parametrize("text,match", [("0", "positive duration"), ("soon", "neither a duration nor an ISO time"),
                                        ("", "empty"), ("2020-01-01T00:00", "not in the future"),
                                        ("-5m", "neither"), ("12x", "neither")])
def test_bad_deadlines_are_refused_naming_the_value(text, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_deadline(text, NOW)
    assert repr(text) in str(err.value) and "--deadline" in str(err.value)


def seconds(text: str) -> int:
    """``"29m57s"`` (a printed duration) -> seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", text))


def test_durations_print_compactly():
    assert [format_duration(x) for x in (0, 59.6, 61, 3725, -190, 90000, None)] == \
        ["0s", "1m00s", "1m01s", "1h02m", "-3m10s", "1d01h", "-"]


# -- ETA, slack, missed ----------------------------------------------------------------------
def view(jid, steps=100, done=0, *, elastic=False, lo=1, hi=1, est=None, running=None, slots=()):
    return JobView(job_id=jid, steps=steps, steps_done=done, elastic=elastic, min_workers=lo, max_workers=hi,
                   slowdowns=dict(SLOW), estimates=dict(est or {}), running=running, slots=tuple(slots))


def test_eta_uses_the_current_placement_or_the_best_one():
    slots = {"v100": 2, "k80": 2}
    v = view(1, steps=100, done=40, est={"k80/1": 0.5, "v100/1": 2.0}, running=("k80", 1))
    assert eta_s(v, slots, prior=1.0) == pytest.approx(60 / 0.5)  # runs on a K80: its measured rate
    v.running = None
    assert eta_s(v, slots, prior=1.0) == pytest.approx(60 / 2.0)  # queued: its best placement
    e = view(2, steps=100, elastic=True, hi=2)  # never measured: the prior, on 2 V100s
    assert eta_s(e, slots, prior=1.0) == pytest.approx(100 / estimate(e, "v100", 2, 1.0)) == 50.0
    assert eta_s(view(3, done=100), slots, 1.0) == 0.0
    assert slack_s(NOW + 100, NOW, 30.0) == 70.0 and slack_s(None, NOW, 3.0) is None
    assert slack_s(NOW + 100, NOW, None) is None


def test_a_missed_deadline_is_reported_once():
    jobs = [(1, NOW - 1, False), (2, NOW - 1, True), (3, NOW + 10, False), (4, None, False)]
    assert newly_missed(jobs, NOW) == [1]
    assert newly_missed(jobs, NOW + 11) == [1, 3]


class Row:
    def __init__(self, **kw):
        self.__dict__.update(dict(deadline_s=None, state="queued", finished_s=None, deadline_missed=False,
                                  eta_s=None) | kw)


def test_queue_cells():
    assert deadline_cells(Row(), NOW) == ("-", "-")
    assert deadline_cells(Row(deadline_s=NOW + 600, eta_s=200.0), NOW) == ("10m00s", "6m40s")
    assert deadline_cells(Row(deadline_s=NOW + 600, eta_s=900.0), NOW) == ("10m00s", "-5m00s")
    assert deadline_cells(Row(deadline_s=NOW - 5, eta_s=9.0, deadline_missed=True), NOW) == ("missed", "-14s")
    assert deadline_cells(Row(deadline_s=NOW, state="done", finished_s=NOW - 130), NOW) == ("met 2m10s", "-")
    assert deadline_cells(Row(deadline_s=NOW, state="done", finished_s=NOW + 40), NOW) == ("missed 40s", "-")


# -- earliest-deadline-first admission -------------------------------------------------------
def decide(views, placements, deadlines, slots, pinned=frozenset(), round_s=30.0):
    return admit(views, placements, deadlines, now_s=NOW, round_s=round_s, slots=slots, pinned=set(pinned),
                 prior=1.0)


def test_an_urgent_job_takes_the_slot_of_a_job_without_deadline():
    # Job 2 needs 100 s on a V100 (measured 1 step/s); 105 s left: it must start now.
    views = [view(1, est={"v100/1": 1.0}, running=("v100", 1), slots=["v100-0"]), view(2, est={"v100/1": 1.0})]
    a = decide(views, {1: ("v100", 1)}, {2: NOW + 105}, {"v100": 1})
    assert a.placements == {2: ("v100", 1)} and a.urgent == [2]
    (sw,) = a.swaps
    assert (sw.job_id, sw.acc_type, sw.workers, sw.preempted, sw.shrunk) == (2, "v100", 1, (1,), ())
    assert sw.slack_s == pytest.approx(5.0)


@pytest.mark.parametrize("deadline,why", [(NOW + 200, "slack of 100 s: it can wait a round"),
                                          (NOW + 90, "hopeless: misses it even if it runs now")])
def test_jobs_that_can_wait_or_cannot_make_it_get_no_priority(deadline, why):
    views = [view(1, running=("v100", 1), slots=["v100-0"]), view(2, est={"v100/1": 1.0})]
    a = decide(views, {1: ("v100", 1)}, {2: deadline}, {"v100": 1})
    assert a.placements == {1: ("v100", 1)} and not a.swaps and a.urgent == [], why


def test_pinned_jobs_and_earlier_deadlines_are_never_displaced():
    views = [view(1, running=("v100", 1), slots=["v100-0"]), view(2, est={"v100/1": 1.0})]
    assert not decide(views, {1: ("v100", 1)}, {2: NOW + 105}, {"v100": 1}, pinned={1}).swaps
    a = decide(views, {1: ("v100", 1)}, {1: NOW + 50, 2: NOW + 105}, {"v100": 1})
    assert a.placements == {1: ("v100", 1)} and not a.swaps and a.urgent == [2]
    a = decide(views, {1: ("v100", 1)}, {1: NOW + 500, 2: NOW + 105}, {"v100": 1})  # a later deadline yields
    assert a.placements == {2: ("v100", 1)}


def test_elastic_jobs_are_shrunk_in_place_before_anyone_is_preempted():
    slots = {"v100": 4}
    views = [view(1, elastic=True, lo=1, hi=4, running=("v100", 4), slots=[f"v100-{i}" for i in range(4)]),
             view(2, hi=2, est={"v100/2": 1.0})]
    a = decide(views, {1: ("v100", 4)}, {2: NOW + 110}, slots)
    assert a.placements == {1: ("v100", 2), 2: ("v100", 2)}
    assert a.swaps[0].shrunk == ((1, 4, 2),) and a.swaps[0].preempted == ()
    # Not enough to shrink (its minimum is 3): it is preempted instead.
    views[0].min_workers = 3
    a = decide(views, {1: ("v100", 4)}, {2: NOW + 110}, slots)
    assert a.placements == {2: ("v100", 2)} and a.swaps[0].preempted == (1,) and a.swaps[0].shrunk == ()


def test_earliest_deadline_first():
    # Two urgent jobs for one V100 (100 s there, 105 s and 110 s left): the earlier deadline gets it.
    views = [view(1, running=("v100", 1), slots=["v100-0"]), view(2, est={"v100/1": 1.0}), view(3, est={"v100/1": 1.0})]
    a = decide(views, {1: ("v100", 1)}, {2: NOW + 110, 3: NOW + 105}, {"v100": 1})
    assert a.urgent == [3, 2] and a.placements == {3: ("v100", 1)}
    assert [(sw.job_id, sw.preempted) for sw in a.swaps] == [(3, (1,))]  # job 3's earlier deadline protects it


def test_the_fewest_workers_that_make_it_on_the_fastest_type():
    # An elastic job never measured on K80s: 0.5 steps/s per K80 worker (1 measured on a V100, K80 twice slower).
    views = [view(4, elastic=True, hi=2, est={"v100/1": 1.0})]
    a = decide(views, {}, {4: NOW + 120}, {"k80": 2})
    assert a.placements == {4: ("k80", 2)}  # 1 K80 needs 200 s: too slow; 2 need 100 s
    a = decide(views, {}, {4: NOW + 201}, {"k80": 2}, round_s=300)
    assert a.placements == {4: ("k80", 1)}  # 1 K80 makes it (slack 1 s): the fewest
    a = decide(views, {}, {4: NOW + 120}, {"k80": 2, "v100": 2}, round_s=300)
    assert a.placements == {4: ("v100", 1)}  # the fastest type first, 1 V100 (like 2 K80s) makes it


def test_a_job_placed_too_slow_for_its_deadline_moves_to_a_faster_type():
    # fifo-like: job 1 on the V100, job 2 on the K80 where it needs 200 s; 105 s left: it takes the V100.
    slots = {"v100": 1, "k80": 1}
    views = [view(1, running=("v100", 1), slots=["v100-0"]), view(2, est={"v100/1": 1.0})]
    a = decide(views, {1: ("v100", 1), 2: ("k80", 1)}, {2: NOW + 105}, slots)
    assert a.placements == {2: ("v100", 1)}
    assert a.swaps[0].planned == ("k80", 1) and a.swaps[0].preempted == (1,)
    # Placed well enough (it makes its deadline where the policy put it): nothing changes.
    a = decide(views, {1: ("k80", 1), 2: ("v100", 1)}, {2: NOW + 105}, slots)
    assert not a.swaps and a.placements == {1: ("k80", 1), 2: ("v100", 1)}


def test_a_job_the_policy_preempted_stays_where_it_runs():
    slots = {"v100": 1, "k80": 1}
    views = [view(1, est={"k80/1": 1.0, "v100/1": 1.1}, running=("k80", 1), slots=["k80-0"]),
             view(2, running=None)]
    # The policy gives job 1's K80 to job 2; job 1 (urgent) takes it back rather than move to the free V100.
    a = decide(views, {2: ("k80", 1)}, {1: NOW + 105}, slots)
    assert a.placements == {1: ("k80", 1)} and a.swaps[0].preempted == (2,)


def test_admission_invariants_on_random_instances():
    rng = random.Random(7)
    for _ in range(300):
        slots = {t: rng.randint(1, 4) for t in ("v100", "k80")}
        views, placements, used = [], {}, {t: 0 for t in slots}
        for jid in range(1, rng.randint(2, 7)):
            elastic = rng.random() < 0.5
            hi = rng.randint(1, 4)
            lo = rng.randint(1, hi) if elastic else hi
            v = view(jid, steps=rng.randint(10, 200), done=rng.randint(0, 5), elastic=elastic, lo=lo, hi=hi,
                     est={"v100/1": rng.uniform(0.5, 3)} if rng.random() < 0.7 else None)
            t = rng.choice(list(slots))
            n = rng.randint(lo, hi)
            if rng.random() < 0.6 and used[t] + n <= slots[t]:
                placements[jid] = (t, n)
                used[t] += n
                v.running = (t, n)
            views.append(v)
        deadlines = {v.job_id: NOW + rng.uniform(5, 150) for v in views if rng.random() < 0.5}
        pinned = {j for j in placements if rng.random() < 0.3}
        a = decide(views, placements, deadlines, slots, pinned)
        for t in slots:  # capacity, counted independently
            assert sum(n for tt, n in a.placements.values() if tt == t) <= slots[t]
        for j in pinned:
            assert a.placements.get(j) == placements[j]
        by = {v.job_id: v for v in views}
        for sw in a.swaps:
            assert sw.planned == placements.get(sw.job_id) and sw.job_id not in pinned and sw.slack_s >= 0
            assert (sw.acc_type, sw.workers) != sw.planned
            for j in sw.preempted + tuple(s[0] for s in sw.shrunk):
                assert j not in pinned and (j not in deadlines or deadlines[j] > sw.deadline_s)
            for j, before, to in sw.shrunk:
                assert by[j].elastic and by[j].min_workers <= to < before
        changed = {j for j in set(placements) | set(a.placements) if placements.get(j) != a.placements.get(j)}
        touched = {sw.job_id for sw in a.swaps} | {j for sw in a.swaps for j in sw.preempted} \
            | {s[0] for sw in a.swaps for s in sw.shrunk}
        assert changed <= touched
        assert a.placements == decide(views, placements, deadlines, slots, pinned).placements  # deterministic


# -- the database and the command line ------------------------------------------------------
@pytest.fixture
def cluster(tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1, "k80": 1}, policy="fifo", round_s=30.0).close()
    return d


def test_submit_stores_the_deadline_and_queue_shows_it(cluster, capsys):
    t0 = time.time()
    assert cli_main.main(["submit", f"{JOBS}:paced", "--dir", cluster, "--steps", "20", "--deadline", "30m"]) == 0
    assert "deadline" in capsys.readouterr().out
    assert cli_main.main(["submit", f"{JOBS}:paced", "--dir", cluster, "--steps", "20"]) == 0
    db = ClusterDB(cluster)
    a, b = db.jobs()
    assert t0 + 1800 <= a.deadline_s <= time.time() + 1800 and b.deadline_s is None
    assert db.events(kind="submit")[0]["data"]["deadline_s"] == a.deadline_s
    db.update_job(a.id, eta_s=600.0)
    capsys.readouterr()
    assert cli_main.main(["queue", "--dir", cluster]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == ["deadline", "slack"]
    left, slack = (seconds(x) for x in lines[1].split()[-2:])
    assert 1700 < left <= 1800 and slack == left - 600
    assert lines[2].split()[-2:] == ["-", "-"]


@pytest.mark.parametrize("deadline,match", [("yesterday", "neither a duration"), ("2001-01-01T00:00", "not in the future"),
                                            ("0m", "positive duration")])
def test_bad_deadline_is_refused_with_nothing_queued(cluster, capsys, deadline, match):
    assert cli_main.main(["submit", f"{JOBS}:paced", "--dir", cluster, "--steps", "20", "--deadline", deadline]) == 2
    err = capsys.readouterr().err
    assert match in err and "--deadline" in err and len(err.strip().splitlines()) == 1
    assert ClusterDB(cluster).jobs() == []


def test_an_older_database_gets_the_deadline_columns(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    con = sqlite3.connect(d / "cluster.db")
    con.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                      "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, target TEXT NOT NULL,"
                      " steps INTEGER NOT NULL, elastic INTEGER NOT NULL, min_workers INTEGER NOT NULL,"
                      " max_workers INTEGER NOT NULL, priority REAL NOT NULL, job_type TEXT,"
                      " deterministic INTEGER NOT NULL, checkpoint_every INTEGER NOT NULL, submitted_s REAL NOT NULL,"
                      " state TEXT NOT NULL, steps_done INTEGER NOT NULL DEFAULT 0, acc_type TEXT,"
                      " workers INTEGER NOT NULL DEFAULT 0, slots TEXT NOT NULL DEFAULT '[]', started_s REAL,"
                      " finished_s REAL, run_dir TEXT NOT NULL DEFAULT '', error TEXT,"
                      " cancel_requested INTEGER NOT NULL DEFAULT 0, starts INTEGER NOT NULL DEFAULT 0,"
                      " restarts INTEGER NOT NULL DEFAULT 0, resizes INTEGER NOT NULL DEFAULT 0, loss REAL,"
                      " received TEXT NOT NULL DEFAULT '{}', estimates TEXT NOT NULL DEFAULT '{}');"
                      "INSERT INTO jobs (name, target, steps, elastic, min_workers, max_workers, priority,"
                      " deterministic, checkpoint_every, submitted_s, state) VALUES ('j','t',5,0,1,1,1,0,1,0,'queued');")
    con.close()
    (row,) = ClusterDB(str(d)).jobs()
    assert row.deadline_s is None and row.deadline_missed is False and row.eta_s is None


# -- in the service (fake job handles) -------------------------------------------------------
class FakeHandle:
    def __init__(self, kw):
        self.kw, self.step, self.done = kw, 0, False
        self.workers = [{"id": i, "rank": i} for i in range(kw["workers"])]

    def status(self):
        return {"step": self.step, "state": "running", "workers": self.workers, "loss": 0.5}

    def stop(self, timeout_s=60.0, *, reason=""):
        self.done = True
        return type("R", (), {"steps": self.step, "history": []})()

    def kill(self):
        self.done = True


def test_the_service_moves_an_urgent_job_ahead_of_fifo_and_reports_a_missed_deadline(tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1, "k80": 1}, policy="fifo", round_s=30.0, slowdowns={"k80": 3.0}).close()
    s = Service(d, launch=lambda target, **kw: FakeHandle(kw))
    s.epoch_s = time.time()
    fields = dict(name="j", target=f"{JOBS}:paced", elastic=False, min_workers=1, max_workers=1, priority=1.0,
                  job_type=None, deterministic=True, checkpoint_every=5)
    now = time.time()
    first = s.db.add_job(steps=500, now=now - 10, **fields)
    # Job 1 measured 1 step/s on the V100 (1/3 on the K80), so an unmeasured job is assumed to do the same:
    # the second needs 20 s on the V100 and 60 s on the K80, with 30 s left.
    urgent = s.db.add_job(steps=20, now=now - 5, deadline_s=now + 30, **fields)
    s.db.update_job(first, estimates={"v100/1": 1.0, "k80/1": 1 / 3})
    views = [s._view(r) for r in s._active_rows()]
    plain = s.scheduler.plan(views, now - s.epoch_s)
    assert plain.slots == {first: ("v100-0",), urgent: ("k80-0",)}  # fifo alone: the first arrival on the V100
    s.scheduler = type(s.scheduler)(s.slots, s.scheduler.policy, round_s=s.round_s)  # a fresh mechanism
    s.request_stop()  # one round: decide and enact, no waiting
    s.play_round()
    assert s.db.job(urgent).acc_type == "v100" and s.running[urgent].acc_type == "v100"
    assert s.db.job(first).state == "queued" and first not in s.running
    (ev,) = s.db.events(kind="deadline_priority")
    assert ev["job_id"] == urgent and (ev["data"]["acc_type"], ev["data"]["workers"]) == ("v100", 1)
    assert {a["job_id"]: a["change"] for a in s.db.allocations()} == {urgent: "deadline"}
    assert s.db.job(urgent).eta_s == pytest.approx(20.0)  # queued when estimated: on its best placement
    # The deadline passes unfinished: one event, however often the service checks.
    deadline = s.db.job(urgent).deadline_s
    s.check_deadlines(deadline - 1)
    assert not s.db.events(kind="deadline_missed")
    s.check_deadlines(deadline + 1)
    s.check_deadlines(deadline + 2)
    (missed,) = s.db.events(kind="deadline_missed")
    assert missed["job_id"] == urgent and missed["data"]["late_s"] == pytest.approx(1.0)
    assert s.db.job(urgent).deadline_missed and not s.db.job(first).deadline_missed
    s.shutdown()
