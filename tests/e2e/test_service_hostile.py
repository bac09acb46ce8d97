"""The cluster service against hostile or broken state (issue 27): another local user's files in
the cluster directory, rows that do not parse, a policy whose solver fails, an emptied database,
a cancel made while the service was down, two starts at once, a corrupt database.

Each finding is now a one-line refusal, a row (job) set apart alone, or the service carrying on,
and the other jobs are started as they would have been. These tests drive the service with fake
job handles (no processes: what each decision turns into); that a job the service runs is
bit-identical to a standalone run is proven with real processes in tests/test_service_e2e.py.
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from virtualflow.cli import main as cli_main
from virtualflow.cli.cluster import _StartLock, format_queue
from virtualflow.cluster.policies.base import get_policy
from virtualflow.cluster.policies.lp import SolveError
from virtualflow.service import state as state_mod
from virtualflow.service.core import FALLBACK_POLICY, JobView, Scheduler
from virtualflow.service.runner import Service, init_cluster
from virtualflow.service.state import ClusterDB, check_cluster_dir, foreign_run_dir

from test_service_runner import FakeHandle, fake_service


def new_cluster(path: str, policy: str = "las") -> str:
    init_cluster(path, slots={"v100": 2, "k80": 2}, policy=policy, round_s=5.0, slowdowns={"k80": 3.0}).close()
    return path


def add(db: ClusterDB, **kw) -> int:
    fields = dict(name="j", target="/x/job.py:make", steps=50, elastic=False, min_workers=1, max_workers=1,
                  priority=1.0, job_type=None, deterministic=True, checkpoint_every=5)
    fields.update(kw)
    return db.add_job(**fields)




def foreign(path: str, monkeypatch) -> None:
    """Make ``path`` belong to another user: chown where we may (root), else report it so."""
    if os.geteuid() == 0:
        os.lchown(path, 4242, 4242)
        return
    real_lstat, target = os.lstat, os.path.normpath(os.path.abspath(path))

    def lstat(p, *a, **k):
        st = real_lstat(p, *a, **k)
        if os.path.normpath(os.path.abspath(p)) != target:
            return st
        fields = list(st)
        fields[4] = st.st_uid + 1
        return os.stat_result(fields)

    monkeypatch.setattr(state_mod.os, "lstat", lstat)


def start_refusal(d: str, capsys) -> str:
    """``cluster start`` in ``d``: refused with exit code 2 and one line, which is returned."""
    rc = cli_main.main(["cluster", "start", "--dir", d, "--slots", "v100=1", "--foreground"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


# -- the directory, the database and the token are private ---------------------------------------
def test_a_new_cluster_is_private(tmp_path):
    d = new_cluster(str(tmp_path / "c"))
    db = ClusterDB(d)
    add(db)  # writes the WAL
    modes = {n: stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) for n in os.listdir(d)}
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    for name in ("cluster.db", "cluster.db-wal", "token", "last_job_id"):
        assert modes[name] == 0o600, (name, oct(modes[name]))


@pytest.mark.parametrize("hostile,message", [
    ("dir_world_writable", "is writable by group and others (mode 0777)"),
    ("dir_symlink", "is a symbolic link (to "),
    ("dir_other_user", "belongs to another user"),
    ("token_other_user", "token belongs to another user"),
    ("token_symlink", "token is a symbolic link"),
    ("token_readable", "token is readable by group and others (mode 0644)"),
    ("db_writable", "cluster.db is writable by group and others (mode 0666)"),
    ("wal_other_user", "cluster.db-wal belongs to another user"),
    ("logs_writable", "logs is writable by group and others (mode 0777)"),
    ("jobs_symlink", "jobs is a symbolic link"),
])
def test_cluster_start_refuses_what_another_user_could_write(hostile, message, tmp_path, monkeypatch, capsys):
    d = new_cluster(str(tmp_path / "c"))
    db = ClusterDB(d)
    job = add(db)
    db.close()
    token = os.path.join(d, "token")
    with open(token) as f:
        token_before = f.read()
    where = d
    if hostile == "dir_world_writable":
        os.chmod(d, 0o777)
    elif hostile == "dir_symlink":
        where = str(tmp_path / "link")
        os.symlink(d, where)
    elif hostile == "dir_other_user":
        foreign(d, monkeypatch)
    elif hostile == "token_other_user":
        foreign(token, monkeypatch)
    elif hostile == "token_symlink":
        os.replace(token, str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), token)
    elif hostile == "token_readable":
        os.chmod(token, 0o644)
    elif hostile == "db_writable":
        os.chmod(os.path.join(d, "cluster.db"), 0o666)
    elif hostile == "wal_other_user":
        with open(os.path.join(d, "cluster.db-wal"), "ab"):
            pass
        os.chmod(os.path.join(d, "cluster.db-wal"), 0o600)
        foreign(os.path.join(d, "cluster.db-wal"), monkeypatch)
    elif hostile == "logs_writable":
        os.mkdir(os.path.join(d, "logs"))
        os.chmod(os.path.join(d, "logs"), 0o777)
    elif hostile == "jobs_symlink":
        os.mkdir(str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), os.path.join(d, "jobs"))
    err = start_refusal(where, capsys)
    assert message in err, err
    fix = {"dir_world_writable": f"chmod 700 {d}", "token_readable": "chmod 600", "db_writable": "chmod 600"}
    assert fix.get(hostile, "") in err
    # Every other command refuses the directory too (the service, submit, queue, cancel, the dashboard).
    with pytest.raises(ValueError, match="(?i)" + message.split(" (")[0].replace(".", r"\.")):
        ClusterDB(where)
    # Nothing was rewritten: the token is not replaced, the job not touched.
    if hostile != "token_symlink":
        monkeypatch.undo()
        os.chmod(d, 0o700)
        with open(token) as f:
            assert f.read() == token_before
    if hostile in ("dir_world_writable", "token_readable", "db_writable"):
        os.chmod(d, 0o700)
        os.chmod(token, 0o600)
        os.chmod(os.path.join(d, "cluster.db"), 0o600)
        assert ClusterDB(d).job(job).state == "queued"  # the fix named works


def test_a_database_only_readable_by_others_is_made_private(tmp_path):
    d = new_cluster(str(tmp_path / "c"))
    os.chmod(os.path.join(d, "cluster.db"), 0o644)  # as databases made before the check were
    ClusterDB(d).close()
    assert stat.S_IMODE(os.stat(os.path.join(d, "cluster.db")).st_mode) == 0o600


def test_a_missing_directory_is_created_private_and_a_plain_file_is_refused(tmp_path):
    check_cluster_dir(str(tmp_path / "a" / "b"), create=True)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o700
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_cluster_dir(str(tmp_path / "f"))


# -- no single row or solver failure stops the service -------------------------------------------
def views_with_priorities(*priorities: float) -> list[JobView]:
    slow = {"v100": 1.0, "k80": 3.0}
    return [JobView(job_id=i + 1, steps=100, priority=p, slowdowns=slow, arrival_s=float(i))
            for i, p in enumerate(priorities)]


def policy_input(sched: Scheduler, views: list[JobView]):
    """The policy input the scheduler builds for ``views`` (through its own throughput table)."""
    import numpy as np

    from virtualflow.cluster.model import JobSpec
    from virtualflow.cluster.policies.base import PolicyInput

    specs = [JobSpec(job_id=v.job_id, job_type=f"job-{v.job_id}", scale_factor=v.max_workers, min_gpus=None,
                     total_steps=float(v.steps), weight=v.priority, arrival_s=v.arrival_s) for v in views]
    return PolicyInput(jobs=specs, cluster=sched.cluster, table=sched.table(views), time_s=0.0,
                       steps_done=np.zeros(len(views)), elapsed_s=np.zeros(len(views)),
                       time_received_s=np.zeros((len(views), len(sched.cluster.types))))


def test_a_policy_that_fails_to_solve_falls_back_to_fifo():
    """priority 1e-15 beside 1 (what ``submit --priority 1e-15`` queues): HiGHS finds no optimum
    for LAS; the round is FIFO's and says why."""
    views = views_with_priorities(1.0, 1e-15, 1.0)
    sched = Scheduler({"v100": 2, "k80": 2}, get_policy("las"), round_s=5.0)
    with pytest.raises(SolveError, match="HiGHS did not find an optimum"):  # the policy itself fails here
        get_policy("las").allocate(policy_input(sched, views))
    decision = sched.plan(views, 0.0)
    assert decision.fallback is not None and "SolveError" in decision.fallback, decision.fallback
    assert "policy las failed" in decision.fallback and "fifo" in decision.fallback
    # The placements FIFO itself makes: every job runs (2 v100 + 2 k80 slots, 3 one-worker jobs).
    reference = Scheduler({"v100": 2, "k80": 2}, FALLBACK_POLICY, round_s=5.0).plan(views, 0.0)
    assert decision.slots == reference.slots and len(decision.slots) == 3
    # The next round keeps the fallback's allocation (no new solve while nothing changed).
    sched.end_round()
    again = sched.plan(views, 5.0)
    assert not again.solved and again.fallback is None and again.slots == decision.slots


def test_when_the_fallback_fails_too_what_runs_keeps_running():
    class Broken:
        name = "broken"

        def allocate(self, inp):
            raise ZeroDivisionError("boom")

    views = views_with_priorities(1.0, 1.0)
    views[0].running, views[0].slots = ("v100", 1), ("v100-1",)
    sched = Scheduler({"v100": 2, "k80": 2}, Broken(), round_s=5.0)
    import virtualflow.service.core as core

    saved = core.FALLBACK_POLICY
    core.FALLBACK_POLICY = Broken()
    try:
        decision = sched.plan(views, 0.0)
    finally:
        core.FALLBACK_POLICY = saved
    assert "ZeroDivisionError: boom" in decision.fallback and "kept what runs" in decision.fallback
    assert decision.actions == [] and decision.slots == {1: ("v100-1",)}


def test_the_service_carries_on_after_a_failed_solve_and_records_why(tmp_path):
    s = fake_service(new_cluster(str(tmp_path / "c")))
    a, b, c = add(s.db), add(s.db, priority=1e-15), add(s.db)
    s.round_s = 0.0
    s.play_round()
    assert sorted(s.running) == [a, b, c]  # FIFO: all fit
    (event,) = s.db.events(kind="policy_fallback")
    assert event["data"]["policy"] == "las" and "HiGHS" in event["data"]["reason"]
    assert [s.db.job(j).state for j in (a, b, c)] == ["running"] * 3


def test_malformed_rows_are_quarantined_and_the_others_run(tmp_path, capsys):
    s = fake_service(new_cluster(str(tmp_path / "c")))
    good, bad_steps, bad_state, bad_min, good2 = (add(s.db) for _ in range(5))
    s.db.conn.execute("UPDATE jobs SET steps = 'abc' WHERE id = ?", (bad_steps,))
    s.db.conn.execute("UPDATE jobs SET state = 'bogus' WHERE id = ?", (bad_state,))
    s.db.conn.execute("UPDATE jobs SET elastic = 1, min_workers = -3, max_workers = 2 WHERE id = ?", (bad_min,))
    s.round_s = 0.0
    s.play_round()
    assert sorted(s.running) == [good, good2]
    rows = {r.id: r for r in s.db.jobs()}
    for jid, cell in ((bad_steps, "steps='abc'"), (bad_state, "state='bogus'"), (bad_min, "min_workers=-3")):
        assert rows[jid].state == "quarantined" and cell in rows[jid].quarantine
    # Marked once (an event per row), and shown by `queue`.
    s._tick()
    assert sorted(e["job_id"] for e in s.db.events(kind="quarantined")) == [bad_steps, bad_state, bad_min]
    assert cli_main.main(["queue", "--dir", s.dir]) == 0
    out = capsys.readouterr().out
    assert out.count("quarantined") == 6  # each row's state, and a line saying why
    for cell in ("steps='abc'", "state='bogus'", "min_workers=-3"):
        assert any(line.lstrip().startswith("quarantined:") and cell in line for line in out.splitlines())
    assert format_queue(s.db.jobs(), 0.0).count("running") == 2


def test_a_running_job_whose_row_breaks_is_stopped_with_its_state_and_not_rescheduled(tmp_path):
    s = fake_service(new_cluster(str(tmp_path / "c")))
    a, b = add(s.db), add(s.db)
    s.round_s = 0.0
    s.play_round()
    ha = s.running[a].handle
    ha.step = 7
    s.db.conn.execute("UPDATE jobs SET priority = 'high' WHERE id = ?", (a,))
    s._tick()
    assert ha.calls[-1] == ("stop", "quarantined") and a not in s.running and b in s.running
    row = s.db.job(a)
    assert row.state == "quarantined" and row.steps_done == 7
    s.play_round()
    assert a not in s.running
    # Repaired, it is an ordinary queued job again and resumes.
    s.db.conn.execute("UPDATE jobs SET priority = 1.0 WHERE id = ?", (a,))
    assert s.db.job(a).state == "queued"


def test_bad_counters_read_as_defaults_without_quarantine(tmp_path):
    db = ClusterDB(new_cluster(str(tmp_path / "c")))
    a = add(db)
    db.conn.execute("UPDATE jobs SET starts = 'x', loss = 'nan?', steps_done = -4, eta_s = 'soon' WHERE id = ?", (a,))
    row = db.job(a)
    assert row.quarantine is None and row.state == "queued"
    assert (row.starts, row.loss, row.steps_done, row.eta_s) == (0, None, 0, None)


# -- job ids are never reused; a run directory is its job's alone ---------------------------------
def test_an_emptied_database_never_hands_an_id_out_again(tmp_path, capsys):
    d = new_cluster(str(tmp_path / "c"))
    s = fake_service(d)
    old = add(s.db, steps=70)
    s.round_s = 0.0
    s.play_round()  # job 1 starts: its run directory is claimed
    run_dir = s.db.job(old).run_dir
    with open(os.path.join(run_dir, "final.pt"), "wb") as f:
        f.write(b"job 1's state")
    s.running.clear()
    s.db.close()
    with open(os.path.join(d, "cluster.db"), "wb"):
        pass  # emptied
    for n in ("cluster.db-wal", "cluster.db-shm"):
        if os.path.exists(os.path.join(d, n)):
            os.remove(os.path.join(d, n))
    with pytest.raises(ValueError, match=r"holds no cluster tables .* new job ids continue above 1"):
        ClusterDB(d)
    assert cli_main.main(["queue", "--dir", d]) == 2
    assert "holds no cluster tables" in capsys.readouterr().err
    new_cluster(d)
    s2 = fake_service(d)
    assert [e["data"] for e in s2.db.events(kind="database_new")] == [{"earlier_ids_up_to": old}]
    new = add(s2.db, steps=70)
    assert new == old + 1
    s2.round_s = 0.0
    s2.play_round()
    kw = s2.launched[-1][1]
    assert kw["resume"] is None and kw["run_dir"].endswith(os.path.join("jobs", str(new)))
    with open(os.path.join(run_dir, "final.pt"), "rb") as f:
        assert f.read() == b"job 1's state"  # untouched
    # Without the high-water mark, the run directories alone keep the ids above.
    os.remove(os.path.join(d, "last_job_id"))
    assert add(s2.db) == new + 1


def test_a_run_directory_with_another_jobs_states_is_set_aside_never_resumed(tmp_path):
    s = fake_service(new_cluster(str(tmp_path / "c")))
    a = add(s.db)
    run_dir = s.db.job(a).run_dir
    os.makedirs(run_dir, mode=0o700)
    with open(os.path.join(run_dir, "final.pt"), "wb") as f:  # states a start of this job never wrote
        f.write(b"someone else's")
    s.round_s = 0.0
    s.play_round()
    assert s.launched[-1][1]["resume"] is None
    (event,) = s.db.events(kind="run_dir_set_aside")
    moved = event["data"]["moved_to"]
    assert "never started" in event["data"]["reason"] and os.path.isfile(os.path.join(moved, "final.pt"))
    assert not os.path.exists(os.path.join(run_dir, "final.pt"))
    with open(os.path.join(run_dir, "cluster_job.json")) as f:
        assert json.load(f)["job_id"] == a
    # Its own states (written after its identity) are resumed as before.
    h = s.running[a].handle
    h.step = 5
    with open(os.path.join(run_dir, "final.pt"), "wb") as f:
        f.write(b"its own")
    s._stop_all({a: "test"})
    s.db.set_job_state(a, "queued", steps_done=5)
    s.play_round()
    assert s.launched[-1][1]["resume"] == run_dir and len(s.db.events(kind="run_dir_set_aside")) == 1


def test_foreign_run_dir_rule():
    mine = {"cluster": "c1", "job_id": 3, "submitted_s": 10.0}
    assert foreign_run_dir(dict(mine), mine, has_state=True, started=False) is None
    assert foreign_run_dir(None, mine, has_state=False, started=False) is None
    assert foreign_run_dir(None, mine, has_state=True, started=True) is None  # a directory from before identities
    assert "never started" in foreign_run_dir(None, mine, has_state=True, started=False)
    for other in ({**mine, "cluster": "c0"}, {**mine, "job_id": 4}, {**mine, "submitted_s": 9.0}, {}):
        assert "another job" in foreign_run_dir(other, mine, has_state=False, started=True)


# -- cancels are never lost -----------------------------------------------------------------------
def test_a_cancel_made_while_the_service_was_down_is_honoured(tmp_path):
    d = new_cluster(str(tmp_path / "c"))
    s = fake_service(d)
    a, b = add(s.db), add(s.db)
    for j in (a, b):
        s.db.set_job_state(j, "running", acc_type="v100", workers=1, slots=["v100-0"])
    s.db.close()
    # The service is down (killed); the user cancels job a.
    assert ClusterDB(d).request_cancel(a) == "requested"
    s2 = fake_service(d)
    s2.recover()
    assert s2.db.job(a).state == "cancelled" and s2.db.job(b).state == "queued"
    s2.round_s = 0.0
    s2.play_round()
    assert [kw["run_dir"] for _, kw in s2.launched] == [s2.db.job(b).run_dir]


def test_a_cancel_during_a_preemption_is_honoured(tmp_path):
    s = fake_service(new_cluster(str(tmp_path / "c")))
    a = add(s.db)
    s.db.set_job_state(a, "running")
    s.db.request_cancel(a)
    s.db.set_job_state(a, "queued", event="preempt")  # the preemption ended after the request
    s._tick()
    assert s.db.job(a).state == "cancelled"
    assert s.db.events(kind="cancelled")[-1]["data"] == {"while": "queued", "requested": "earlier"}


# -- two starts at once; corrupt databases -------------------------------------------------------
def test_a_second_cluster_start_during_a_start_is_refused_and_changes_nothing(tmp_path, capsys):
    d = new_cluster(str(tmp_path / "c"), policy="las")
    lock = _StartLock(d)  # another `cluster start` is under way
    try:
        rc = cli_main.main(["cluster", "start", "--dir", d, "--slots", "k80=4", "--policy", "fifo", "--foreground"])
        err = capsys.readouterr().err
    finally:
        lock.release()
    assert rc == 2 and err.count("\n") == 1 and f"pid {os.getpid()} holds" in err, err
    cfg = ClusterDB(d).config()
    assert cfg["policy"] == "las" and cfg["slots"] == {"v100": 2, "k80": 2}


def test_a_corrupt_database_is_named_with_its_fix(tmp_path, capsys):
    d = new_cluster(str(tmp_path / "c"))
    db = ClusterDB(d)
    add(db)
    db.close()
    path = os.path.join(d, "cluster.db")
    for n in ("cluster.db-wal", "cluster.db-shm"):
        if os.path.exists(os.path.join(d, n)):
            os.remove(os.path.join(d, n))
    with open(path, "r+b") as f:
        f.write(b"this is not a database at all" * 4)
    with pytest.raises(ValueError) as err:
        ClusterDB(d)
    msg = str(err.value)
    assert path in msg and f"mv {path} {path}.bad" in msg and "continue above 1" in msg and "\n" not in msg
    assert cli_main.main(["queue", "--dir", d]) == 2
    assert path in capsys.readouterr().err


# -- with real processes: the other jobs are untouched -------------------------------------------
@pytest.mark.slow
def test_hostile_rows_and_a_stale_run_directory_leave_the_other_jobs_bit_identical(tmp_path):
    """The issue's case end to end: a directory whose database was emptied (job 1's ``final.pt``
    is still in ``jobs/1``), then a policy that cannot solve (priority 1e-15) and a corrupted row.
    The new jobs get new ids, train every step once from the start and end bit-identical to a
    standalone run; the bad row waits quarantined; job 1's files are untouched."""
    import threading

    import torch

    import jobs
    from conftest import assert_state_equal, flat_optimizer_state
    from vn_reference import deterministic_reference

    jobs_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "service_jobs.py")
    d = str(tmp_path / "c")
    check_cluster_dir(d, create=True)
    steps = 12
    old_dir = os.path.join(d, "jobs", "1")  # what "job 1" of the emptied database left
    os.makedirs(old_dir, mode=0o700)
    old_bytes = b"job 1's state at step 10 of 70"
    with open(os.path.join(old_dir, "final.pt"), "wb") as f:
        f.write(old_bytes)
    init_cluster(d, slots={"v100": 1, "k80": 1}, policy="las", round_s=1.0, slowdowns={"k80": 2.0}).close()
    db = ClusterDB(d)
    assert [e["data"] for e in db.events(kind="database_new")] == [{"earlier_ids_up_to": 1}]
    common = dict(name="paced", target=f"{jobs_file}:paced", steps=steps, elastic=False, min_workers=1,
                  max_workers=1, job_type=None, deterministic=True, checkpoint_every=4)
    good = db.add_job(priority=1.0, **common)
    tiny = db.add_job(priority=1e-15, **common)
    broken = db.add_job(priority=1.0, **common)
    db.conn.execute("UPDATE jobs SET steps = 'abc' WHERE id = ?", (broken,))
    assert (good, tiny) == (2, 3)
    thread = threading.Thread(target=lambda: Service(d, poll_s=0.1).run(), daemon=True)  # its own connection
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (db.job(good).final and db.job(tiny).final):
            assert time.monotonic() < deadline and thread.is_alive(), [(j.id, j.state) for j in db.jobs()]
            time.sleep(0.2)
    finally:
        db.set_meta("stop_requested", True)
        thread.join(60)
    assert not thread.is_alive()
    # The standalone run: the job unpaced (the pace only sleeps), in this process.
    ref = deterministic_reference(jobs.paced_regression_job().replace(loss=jobs.mse), steps)
    assert [db.job(j).state for j in (good, tiny, broken)] == ["done", "done", "quarantined"]
    assert db.events(kind="policy_fallback") and db.events(kind="quarantined")[0]["job_id"] == broken
    for jid in (good, tiny):
        run_dir = db.job(jid).run_dir
        final = torch.load(os.path.join(run_dir, "final.pt"), weights_only=False)
        assert final["step"] == steps
        assert_state_equal(final["model"], ref.state_dict)
        assert_state_equal(flat_optimizer_state(final["optimizer"]), flat_optimizer_state(ref.optimizer_state_dict))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            recorded = [r["step"] for r in map(json.loads, f) if "loss" in r]
        assert recorded == list(range(steps))  # every step once, from the first: nothing adopted
    with open(os.path.join(old_dir, "final.pt"), "rb") as f:
        assert f.read() == old_bytes  # job 1's files untouched


def test_a_replay_leaves_quarantined_rows_out(tmp_path):
    from virtualflow.service.replay import measure

    db = ClusterDB(new_cluster(str(tmp_path / "c")))
    a, b = add(db), add(db)
    db.conn.execute("UPDATE jobs SET max_workers = 'two' WHERE id = ?", (b,))
    slow = {"v100": 1.0, "k80": 3.0}
    trace, _ = measure(db.jobs(), db.events(), [], {}, round_s=5.0, slowdowns={a: slow, b: slow})
    assert [j.job_id for j in trace] == [a]


def test_damage_found_while_the_database_is_in_use_is_named_with_its_fix(tmp_path, capsys):
    """Pages overwritten under an open cluster: the first read that meets them raises one line
    naming the file and the fix (was a bare ``DatabaseError: database disk image is malformed``)."""
    d = new_cluster(str(tmp_path / "c"))
    db = ClusterDB(d)
    for _ in range(20):
        add(db, target="/x/" + "j" * 2000 + ".py:make")
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    path = os.path.join(d, "cluster.db")
    db = ClusterDB(d)  # opens: the damage is not in the pages it reads to open
    with open(path, "r+b") as f:
        f.seek(4096 * 3)
        f.write(b"\xff" * 4096 * 3)
    with pytest.raises(state_mod.CorruptDatabaseError) as err:
        db.jobs()
    assert "database disk image is malformed" in str(err.value) and f"mv {path} {path}.bad" in str(err.value)
    assert cli_main.main(["queue", "--dir", d]) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and path in err_text


def test_a_database_without_a_cluster_id_gets_one_before_any_identity_is_written(tmp_path):
    """A database made before cluster ids: the first claim makes the id, and the identity it
    writes matches at every later start (the job's own states are resumed, never set aside)."""
    s = fake_service(new_cluster(str(tmp_path / "c")))
    s.db.conn.execute("DELETE FROM meta WHERE key = 'cluster_id'")
    a = add(s.db)
    row = s.db.job(a)
    assert s.db.claim_run_dir(row) is None
    cid = s.db.get_meta("cluster_id")
    assert isinstance(cid, str) and len(cid) == 16
    with open(os.path.join(row.run_dir, "final.pt"), "wb") as f:
        f.write(b"its own")
    assert s.db.claim_run_dir(s.db.job(a)) is None and s.db.get_meta("cluster_id") == cid
    assert os.path.exists(os.path.join(row.run_dir, "final.pt"))
    with pytest.raises(ValueError, match="unknown job column 'quarantine'"):
        s.db.update_job(a, quarantine="x")
