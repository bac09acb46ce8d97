"""Job code never runs in the cluster service's process; hangs are found by step progress;
stopping a job never blocks the loop; a restart kills only processes that are verifiably a job's;
a full disk pauses the service instead of crashing it or recording false final states.

Without processes (fake job handles, fault injection, a fake ``/proc``): the hang rule, the
driver protocol's parsing, a stop that blocks, hang detection, the disk-full pause and shutdown,
process identity. With processes (one test, about 30 s): five jobs whose code exits, ``os._exit``s,
segfaults, sleeps past the launch limit or raises while the job is built, and one that hangs in
its loss after a few steps, run beside a good job: each fails alone with its reason, the service
(this test's process) never imports any of them, and the good job trains exactly like a plain
PyTorch loop, every step recorded once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import assert_state_close
from virtualflow.records.rundir import pid_alive
from virtualflow.service import runner
from virtualflow.service.core import Action, RoundDecision
from virtualflow.service.launcher import MARKER_ENV, describe_exit, is_job_process, parse_message
from virtualflow.service.runner import Service, _wait_orphans, init_cluster
from virtualflow.service.state import ClusterDB
from virtualflow.service.watchdog import HangRule, StepClock
from test_service_runner import FakeHandle, FakeResult, add


def decide(s: Service, *actions: Action) -> None:
    rows = {r.id: r for r in s.db.jobs()}
    s.enact(RoundDecision(plan=None, actions=list(actions), slots={}, solved=False, decision_s=0.0), rows)


def make_service(tmp_path, handles: dict, name: str = "c", **config) -> Service:
    d = str(tmp_path / name)
    init_cluster(d, slots={"v100": 2}, policy="fifo", round_s=4.0).close()
    if config:
        db = ClusterDB(d)
        db.set_meta("config", {**db.config(), **config})
        db.close()

    def launch(target, **kw):
        h = handles.get(target, FakeHandle)(kw)
        handles.setdefault("made", []).append(h)
        return h

    s = Service(d, poll_s=0.02, launch=launch)
    s.epoch_s = 0.0
    return s


# -- the hang rule and the driver protocol, pure -------------------------------------------------
def test_hang_rule_follows_the_jobs_own_step_time():
    rule = HangRule(factor=10, floor_s=5, first_step_s=50)
    clock = StepClock(since_s=0.0)
    assert clock.observe(1.0, 0) is False  # the step it starts from
    assert rule.verdict(clock, 49.0) is None
    assert "no step within 51 s of its launch" in rule.verdict(clock, 51.0)
    clock.observe(3.0, 1)  # the first step: not timed (it includes starting the workers)
    assert clock.step_times == [] and clock.stepped
    for i in range(2, 12):
        clock.observe(3.0 + (i - 1) * 2.0, i)  # 2 s per step
    assert clock.step_times == [2.0] * 10
    assert rule.limit_s(clock.step_times) == 20.0  # 10 x 2 s, above the floor
    assert rule.verdict(clock, clock.since_s + 19.0) is None
    assert "no step for 21 s while its steps took 2 s" in rule.verdict(clock, clock.since_s + 21.0)
    fast = StepClock(since_s=0.0)
    for i in range(6):
        fast.observe(0.1 * i, i)
    assert rule.limit_s(fast.step_times) == 5.0  # the floor
    clock.observe(clock.since_s + 30.0, 15)  # a poll that sees 4 steps at once: 7.5 s each
    assert clock.step_times[-1] == 7.5
    # The job's own measurements (its coordinator's recent step times) replace the polled ones,
    # also when one poll saw its first steps all at once.
    burst = StepClock(since_s=0.0)
    burst.observe(1.0, 0)
    burst.observe(2.0, 6, reported=[0.01] * 5)
    assert burst.step_times == [0.01] * 5 and rule.verdict(burst, 6.0) is None
    assert "no step for 6 s while its steps took 0.01 s" in rule.verdict(burst, 8.0)
    with pytest.raises(ValueError, match="hang_factor=0"):
        HangRule(factor=0)


def test_driver_messages_are_parsed_defensively():
    ok = parse_message(b'{"kind": "status", "status": {"step": 3, "state": "running", "loss": 0.5, '
                       b'"workers": [{"id": 0, "rank": 0, "pid": 12}, {"id": "x"}, 7]}}\n')
    assert ok == {"kind": "status", "status": {"state": "running", "step": 3, "loss": 0.5, "step_times": [],
                                               "workers": [{"id": 0, "rank": 0, "pid": 12, "node": None}]}}
    times = parse_message(b'{"kind": "status", "status": {"step": 1, "step_times": [0.5, -1, "x", 0.25]}}')
    assert times["status"]["step_times"] == [0.5, 0.25]
    assert parse_message(b'{"kind": "result", "steps": 4, "stopped": false, "loss": NaN}')["loss"] is None
    assert parse_message(b'{"kind": "building", "extra": [1]}') == {"kind": "building"}
    for bad in (b"not json", b"[1, 2]", b'{"kind": "exec", "code": "rm -rf /"}', b'{"kind": "status"}',
                b'{"kind": "result", "steps": -1}', b'{"kind": "error", "error": 5}', b"\x80\x81"):
        assert parse_message(bad) is None, bad
    assert describe_exit(-signal.SIGSEGV) == "was killed by signal SIGSEGV" and describe_exit(3) == "exited with status 3"


# -- stops never block the loop; hangs are found by progress ----------------------------------
class BlockingHandle(FakeHandle):
    """A job hung in its code: its stop returns only when the test says so."""

    release = threading.Event()

    def stop(self, timeout_s=60.0, *, reason=""):
        self.calls.append(("stop", reason))
        if not self.release.wait(timeout_s):
            raise TimeoutError("still running")
        self.done = True
        return FakeResult(self.step)


def test_a_stop_that_blocks_does_not_block_the_loop(tmp_path):
    BlockingHandle.release = threading.Event()
    handles: dict = {"/x/hung.py:make": BlockingHandle}
    s = make_service(tmp_path, handles)
    a = add(s, target="/x/hung.py:make")
    b = add(s)
    c = add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)), Action("start", b, "v100", 1, ("v100-1",)))
    ha, hb = s.running[a].handle, s.running[b].handle
    ha.step = hb.step = 2
    s._tick()
    ha.step = 3
    # Preempt the hung job and give its slot to job c: enact returns with the stop still pending,
    # c waits for the slot, and job b's progress goes on being recorded.
    decide(s, Action("preempt", a), Action("start", c, "v100", 1, ("v100-0",)))
    assert s.stops[a].thread.is_alive() and ha.calls[-1] == ("stop", "preempted by the cluster scheduler")
    assert s.db.job(a).state == "running" and c not in s.running and s.db.job(c).state == "queued"
    hb.step = 9
    s._tick()
    assert s.db.job(b).steps_done == 9
    assert s._view(s.db.job(a)).slots == ("v100-0",)  # it holds its slot until it has stopped
    BlockingHandle.release.set()
    s.stops[a].thread.join(10)
    s._tick()
    assert s.db.job(a).state == "queued" and s.db.job(a).steps_done == 3
    assert c in s.running and s.running[c].slots == ("v100-0",)


def test_a_job_that_stops_stepping_is_killed_as_hung(tmp_path, monkeypatch):
    s = make_service(tmp_path, {}, hang_factor=5.0, hang_floor_s=1.0)
    a, b = add(s), add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)), Action("start", b, "v100", 1, ("v100-1",)))
    ha, hb = s.running[a].handle, s.running[b].handle
    for step in range(6):
        ha.step = hb.step = step
        s._tick()
    run = s.running[a]
    limit = s.hang.limit_s(run.clock.step_times)
    assert limit >= 1.0
    run.clock.since_s -= limit + 1  # no step for longer than its limit (its heartbeat could be fine)
    s._tick()
    row = s.db.job(a)
    assert row.state == "failed" and row.error.startswith("hung: no step for") and ha.calls[-1] == ("kill",)
    assert s.db.job(b).state == "running" and b in s.running and ("kill",) not in hb.calls
    # A job that stops stepping on a full disk is not failed: it is queued to resume.
    monkeypatch.setattr(runner, "_free_bytes", lambda path: 1024.0)
    s.running[b].clock.since_s -= limit + 1
    s._tick()
    assert s.db.job(b).state == "queued" and hb.calls[-1] == ("kill",)
    assert "0 MiB free there" in s.db.events(job_id=b, kind="preempt")[-1]["data"]["reason"]


# -- a full disk: the service pauses, records nothing false ------------------------------------
def test_service_pauses_when_its_database_is_full_and_goes_on_after(tmp_path, monkeypatch, caplog):
    handles: dict = {}
    full = threading.Event()
    full.set()
    free = {"bytes": 1024.0 * 1024}
    monkeypatch.setattr(runner, "_free_bytes", lambda path: free["bytes"])
    caplog.set_level(logging.ERROR, logger="virtualflow.service.runner")
    made: list[Service] = []
    errors = []

    def serve():  # the service in a thread of its own, as its SQLite connection must be
        try:
            s = make_service(tmp_path, handles)
            real_update = s.db.update_job

            def update_job(job_id, **fields):
                if full.is_set() and "steps_done" in fields:
                    raise sqlite3.OperationalError("database or disk is full")
                return real_update(job_id, **fields)

            s.db.update_job = update_job
            made.append(s)
            s.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    db = ClusterDB(str(tmp_path / "c"), create=True)  # (init_cluster in make_service configures it)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 90
    while not made:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    s = made[0]
    a = add_job(db)
    while not handles.get("made"):
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    h = handles["made"][0]
    h.step = 7  # its next record fails: the database is full
    while s.paused is None:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    line = s.paused
    assert s.db.path in line and "1.0 MiB free" in line and "needs 64 MiB" in line
    assert any(r.getMessage() == line for r in caplog.records)
    time.sleep(0.3)
    assert thread.is_alive() and h.calls == [] and db.job(a).state == "running", (h.calls, db.job(a))  # nothing stopped or failed
    full.clear()
    free["bytes"] = 1e12
    while s.paused is not None or db.job(a).steps_done != 7:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    db.set_meta("stop_requested", True)
    thread.join(30)
    assert not thread.is_alive() and not errors
    assert db.job(a).state == "queued" and db.job(a).steps_done == 7 and h.calls[-1][0] == "stop"


def add_job(db: ClusterDB, **kw) -> int:
    fields = dict(name="j", target="/x/job.py:make", steps=100, elastic=False, min_workers=1, max_workers=1,
                  priority=1.0, job_type=None, deterministic=True, checkpoint_every=5)
    fields.update(kw)
    return db.add_job(**fields)


def test_shutdown_never_marks_a_job_failed_and_survives_a_full_disk(tmp_path, monkeypatch, caplog):
    class FailingStop(FakeHandle):
        def stop(self, timeout_s=60.0, *, reason=""):
            raise OSError(28, "No space left on device")

    s = make_service(tmp_path, {"/x/full.py:make": FailingStop})
    a, b = add(s, target="/x/full.py:make"), add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)), Action("start", b, "v100", 1, ("v100-1",)))
    s.running[a].handle.step = s.running[b].handle.step = 4
    s._tick()
    s.running[a].handle.step = s.running[b].handle.step = 5
    s.shutdown()
    row = s.db.job(a)
    assert row.state == "queued" and "No space left on device" in s.db.events(job_id=a, kind="preempt")[-1]["data"]["reason"]
    assert s.db.job(b).state == "queued" and s.db.job(b).steps_done == 5
    # With the database itself full, shutdown records nothing and raises nothing: the rows stay as
    # they were ("running"), which the next start recovers from the run directories.
    s2 = make_service(tmp_path, {}, name="c2")
    c = add(s2)
    decide(s2, Action("start", c, "v100", 1, ("v100-0",)))
    s2.running[c].handle.step = 3

    def full(*_, **__):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(s2.db, "set_job_state", full)
    monkeypatch.setattr(s2.db, "event", full)
    caplog.set_level(logging.ERROR, logger="virtualflow.service.runner")
    s2.shutdown()
    assert ClusterDB(s2.dir).job(c).state == "running"
    assert any("cluster service stopped without recording it" in r.getMessage() for r in caplog.records)


def test_a_job_out_of_space_is_queued_not_failed_and_waits_for_room(tmp_path, monkeypatch):
    from virtualflow.service.launcher import JobProcessError

    class OutOfSpace(FakeHandle):
        disk_full = False

        def wait(self, timeout_s=None):
            raise JobProcessError("worker 0 failed: OSError: [Errno 28] No space left on device: 'final.pt'")

    free = {"bytes": 5.0 * 2**20}
    monkeypatch.setattr(runner, "_free_bytes", lambda path: free["bytes"])
    s = make_service(tmp_path, {"/x/full.py:make": OutOfSpace})
    a, b = add(s, target="/x/full.py:make"), add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)), Action("start", b, "v100", 1, ("v100-1",)))
    h = s.running[a].handle
    h.step, h.done, h.disk_full = 4, True, True
    s._tick()
    row = s.db.job(a)
    reason = s.db.events(job_id=a, kind="preempt")[-1]["data"]["reason"]
    assert row.state == "queued" and row.error is None and row.run_dir in reason and "5 MiB free" in reason
    assert [r.id for r in s._active_rows()] == [b]  # not placed again while there is no room
    free["bytes"] = 100.0 * 2**20
    assert [r.id for r in s._active_rows()] == [a, b]



def test_a_start_the_service_lacks_descriptors_for_is_held_back_not_failed(tmp_path, monkeypatch):
    """EMFILE while the service starts a job (its own descriptors ran out, e.g. under a flood of
    connections) is the machine's shortage, not the job's fault: the job stays queued, is not
    placed during a back-off that doubles while the shortage lasts, and starts normally after."""
    import errno

    fail = {"left": 2}

    def launch(target, **kw):
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return FakeHandle(kw)

    clock = {"t": 1000.0}
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock["t"])
    s = make_service(tmp_path, {})
    s.launch = launch
    a, b = add(s), add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)))
    row = s.db.job(a)
    assert row.state == "queued" and row.error is None
    held = s.db.events(job_id=a, kind="held")
    assert len(held) == 1 and "Too many open files" in held[0]["data"]["reason"] and "15 s" in held[0]["data"]["reason"]
    assert [r.id for r in s._active_rows()] == [b]  # held back meanwhile; the other job is not
    clock["t"] += 16
    assert [r.id for r in s._active_rows()] == [a, b]
    decide(s, Action("start", a, "v100", 1, ("v100-0",)))  # short again: the back-off doubles
    assert "30 s" in s.db.events(job_id=a, kind="held")[-1]["data"]["reason"]
    clock["t"] += 31
    decide(s, Action("start", a, "v100", 1, ("v100-0",)))
    assert s.db.job(a).state == "running" and not s.db.events(job_id=a, kind="failed")
    assert a not in s._held  # a start ends the back-off


# -- a restart kills only what is verifiably a job's ------------------------------------------------
def fake_proc(root, pid: int, *, env: dict[str, str], start_ticks: int, btime: int = 1_000_000) -> None:
    os.makedirs(root / str(pid), exist_ok=True)
    (root / "stat").write_text(f"cpu  1 2 3\nbtime {btime}\n")
    (root / str(pid) / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    fields = ["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 10
    (root / str(pid) / "stat").write_text(f"{pid} (python -m virtualflow worker) " + " ".join(fields) + "\n")


def test_process_identity_needs_the_marker_and_an_early_enough_start(tmp_path):
    root = tmp_path / "proc"
    hz = os.sysconf("SC_CLK_TCK")
    run_dir = "/c/jobs/3"
    fake_proc(root, 101, env={MARKER_ENV: run_dir}, start_ticks=50 * hz)  # started at btime + 50 s
    fake_proc(root, 102, env={MARKER_ENV: run_dir}, start_ticks=500 * hz)  # a PID reused at btime + 500 s
    fake_proc(root, 103, env={"PATH": "/bin"}, start_ticks=50 * hz)  # named virtualflow, not the job's
    fake_proc(root, 104, env={MARKER_ENV: "/c/jobs/33"}, start_ticks=50 * hz)  # another job's
    written = 1_000_000 + 100.0  # status.json written at btime + 100 s
    verdicts = {p: is_job_process(p, run_dir, not_after_s=written, proc=str(root)) for p in (101, 102, 103, 104, 105)}
    assert verdicts == {101: True, 102: False, 103: False, 104: False, 105: False}


def test_restart_clean_up_kills_the_jobs_processes_and_leaves_a_reused_pid_alone(tmp_path):
    run_dir = str(tmp_path / "jobs" / "1")
    os.makedirs(run_dir)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "virtualflow.backends.local_worker"]
    ours = subprocess.Popen(sleeper, env={**os.environ, MARKER_ENV: run_dir})
    stranger = subprocess.Popen(sleeper)  # its command line says virtualflow: the old rule killed it
    try:
        with open(os.path.join(run_dir, "status.json"), "w") as f:
            json.dump({"updated": time.time() + 1, "workers": [{"pid": ours.pid}, {"pid": stranger.pid}],
                       "coordinator": {"pid": os.getpid()}}, f)
        _wait_orphans([run_dir], timeout_s=0.5)
        assert ours.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None and pid_alive(os.getpid())
    finally:
        for p in (ours, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


# -- end to end: job code runs only in job processes ---------------------------------------------
JOB_FILE = '''
import ctypes, os, sys, time
import torch
from torch import nn
from torch.utils.data import TensorDataset
import virtualflow as vf

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports.txt"), "a") as f:
    f.write(f"{os.getpid()}\\n")  # who imported this file

def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x @ torch.randn(6, 1, generator=g))

def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])

CALLS = [0]

def hanging_mse(model, batch):
    CALLS[0] += 1
    if CALLS[0] > 12:
        time.sleep(3600)  # hung in the job's code; its worker's heartbeat thread goes on
    return mse(model, batch)

def job(model=lambda: nn.Linear(6, 1), loss=mse):
    return vf.Job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss=loss, dataset=data,
                  global_batch_size=16, virtual_nodes=2, seed=4)

def good():
    return job()

def hangs():
    return job(loss=hanging_mse)

def exits():
    return job(model=lambda: sys.exit(3))

def hard_exit():
    return job(model=lambda: os._exit(7))

def segfault():
    return job(model=lambda: ctypes.string_at(0))

def sleeps():
    return job(model=lambda: time.sleep(90))

def raises():
    raise RuntimeError("boom in the job function")
'''


@pytest.mark.timeout(240)
def test_job_code_runs_only_in_job_processes_and_each_bad_job_fails_alone(tmp_path):
    jobs_py = tmp_path / "userjobs.py"
    jobs_py.write_text(JOB_FILE)
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 7}, policy="fifo", round_s=4.0).close()
    db = ClusterDB(d)
    db.set_meta("config", {**db.config(), "launch_timeout_s": 20.0, "hang_floor_s": 10.0})
    s = Service(d, poll_s=0.1)
    s.epoch_s = 0.0
    names = ["good", "hangs", "exits", "hard_exit", "segfault", "sleeps", "raises"]
    ids = {}
    for n in names:
        ids[n] = db.add_job(name=n, target=f"{jobs_py}:{n}", steps=40, elastic=False, min_workers=1, max_workers=1,
                            priority=1.0, job_type=None, deterministic=True, checkpoint_every=10)
    decide(s, *(Action("start", ids[n], "v100", 1, (f"v100-{i}",)) for i, n in enumerate(names)))
    # A driver that does not read its commands never blocks the service: once its pipe is full a
    # command is refused at once. (Stopped here, so that it cannot read whatever the machine's load:
    # a driver still starting may or may not have its reader running yet.)
    handle = s.running[ids["sleeps"]].handle
    os.kill(handle.proc.pid, signal.SIGSTOP)
    try:
        sent = [handle._send({"op": "slowdown", "worker": 0, "factor": 2.0}) for _ in range(5000)]
    finally:
        os.kill(handle.proc.pid, signal.SIGCONT)
    assert sent[0] and not sent[-1]
    hang_pids: list[int] = []
    deadline = time.monotonic() + 150
    try:
        while not all(r.final for r in db.jobs()):
            assert time.monotonic() < deadline, [(r.name, r.state, r.steps_done) for r in db.jobs()]
            s._tick()
            run = s.running.get(ids["hangs"])
            if run is not None:
                hang_pids = [w["pid"] for w in run.handle.status()["workers"] if w.get("pid")] or hang_pids
            time.sleep(0.1)
    finally:
        for jid in list(s.running):
            s.running[jid].handle.kill()
    with open(tmp_path / "imports.txt") as f:
        importers = {int(line) for line in f}
    assert os.getpid() not in importers  # the service never imported the job file
    rows = {r.name: r for r in db.jobs()}
    assert rows["good"].state == "done" and rows["good"].steps_done == 40
    errors = {n: rows[n].error for n in names[1:]}
    assert all(rows[n].state == "failed" for n in names[1:]), errors
    assert errors["exits"] == "the job's code called sys.exit(3) while the job was built and checked"
    assert "exited with status 7 while the job was built and checked" in errors["hard_exit"]
    assert "was killed by signal SIGSEGV while the job was built and checked" in errors["segfault"]
    assert "did not finish within 20 s" in errors["sleeps"]
    assert "boom in the job function" in errors["raises"]
    assert errors["hangs"].startswith("hung: no step for") and "hang_floor_s=10" in errors["hangs"]
    assert hang_pids and all(_gone(p) for p in hang_pids)  # its worker, hung in user code, was killed
    # The good job: every step recorded once, and it trained like a plain PyTorch loop.
    run_dir = rows["good"].run_dir
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == list(range(40))
    sys.path.insert(0, str(tmp_path))
    try:
        import userjobs
        from reference import reference_train

        model, _, _ = reference_train(userjobs.good(), 40)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("userjobs", None)
    final = torch.load(os.path.join(run_dir, "final.pt"), weights_only=False)
    assert_state_close(final["model"], model.state_dict())


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pid_alive(pid)
