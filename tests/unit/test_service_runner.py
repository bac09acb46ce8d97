"""The cluster service's process layer (virtualflow.service.runner.Service) with fake job handles:
which public-API calls each decision turns into, without starting a process.

The real calls (launch, in-place resize, stop with the state written, resume) are proven end to
end in tests/test_service_e2e.py and, for virtualflow itself, in tests/test_elastic.py.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from virtualflow.records.result import TrainingError
from virtualflow.service.core import Action, RoundDecision
from virtualflow.service.runner import Service, init_cluster


class FakeResult:
    def __init__(self, steps):
        self.steps, self.history = steps, [{"step": steps - 1, "loss": 0.5}]


class FakeHandle:
    def __init__(self, launch_kwargs):
        self.kw = launch_kwargs
        self.step = 0
        self.workers = [{"id": i, "rank": i} for i in range(launch_kwargs["workers"])]
        self.calls = []
        self.done = False
        self.error = None

    def status(self):
        return {"step": self.step, "state": "running", "workers": self.workers, "loss": 0.25}

    def resize(self, n):
        self.calls.append(("resize", n))
        next_id = max(w["id"] for w in self.workers) + 1
        self.workers = self.workers[:n] + [{"id": next_id + i, "rank": None} for i in range(n - len(self.workers))]

    def set_slowdown(self, worker, factor):
        self.calls.append(("slowdown", worker, factor))

    def stop(self, timeout_s=60.0, *, reason=""):
        self.calls.append(("stop", reason))
        self.done = True
        return FakeResult(self.step)

    def kill(self):
        self.calls.append(("kill",))
        self.done = True

    def wait(self, timeout_s=None):
        if self.error:
            raise self.error
        return FakeResult(self.step)


def fake_service(d: str) -> Service:
    """A service over cluster directory ``d`` whose launches make :class:`FakeHandle` s (recorded in
    ``s.launched`` as ``(target, options)``) and whose rounds start at time 0."""
    launched: list = []

    def launch(target, **kw):
        launched.append((target, kw))
        return FakeHandle(kw)

    s = Service(d, launch=launch)
    s.epoch_s = 0.0
    s.launched = launched
    return s


@pytest.fixture
def service(tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 2, "k80": 2}, policy="las", round_s=5.0, slowdowns={"k80": 3.0}).close()
    return fake_service(d)


def add(s: Service, **kw) -> int:
    fields = dict(name="j", target="/x/job.py:make", steps=50, elastic=False, min_workers=1, max_workers=1,
                  priority=1.0, job_type=None, deterministic=True, checkpoint_every=5)
    fields.update(kw)
    return s.db.add_job(**fields)


def decide(s: Service, *actions: Action) -> None:
    rows = {r.id: r for r in s.db.jobs()}
    s.enact(RoundDecision(plan=None, actions=list(actions), slots={}, solved=False, decision_s=0.0), rows)


def test_start_resize_preempt_restart(service):
    s = service
    a = add(s, elastic=True, max_workers=2)
    decide(s, Action("start", a, "k80", 1, ("k80-0",)))
    target, kw = s.launched[-1]
    assert target == "/x/job.py:make"
    assert kw["workers"] == 1 and kw["slowdowns"] == [3.0] and kw["resume"] is None and kw["steps"] == 50
    assert kw["deterministic"] and kw["checkpoint_every"] == 5 and kw["run_dir"] == s.db.job(a).run_dir
    row = s.db.job(a)
    assert (row.state, row.acc_type, row.workers, row.slots) == ("running", "k80", 1, ["k80-0"])
    h = s.running[a].handle
    # Grow in place: the handle is resized; the newcomer gets the type's slowdown once it is a member.
    decide(s, Action("resize", a, "k80", 2, ("k80-0", "k80-1")))
    assert h.calls == [("resize", 2)]
    s._tick()
    assert ("slowdown", 1, 3.0) not in h.calls  # not a member yet
    h.workers[1]["rank"] = 1
    s._tick()
    assert h.calls[-1] == ("slowdown", 1, 3.0)
    assert s.db.job(a).resizes == 1
    # Preempt: stopped (it made steps: its state is written), queued with its progress.
    h.step = 12
    decide(s, Action("preempt", a))
    assert h.calls[-1] == ("stop", "preempted by the cluster scheduler")
    row = s.db.job(a)
    assert (row.state, row.steps_done, row.workers) == ("queued", 12, 0) and a not in s.running
    # Restart on another type resumes from the run directory's state.
    os.makedirs(row.run_dir, exist_ok=True)
    open(os.path.join(row.run_dir, "final.pt"), "wb").close()
    decide(s, Action("start", a, "v100", 2, ("v100-0", "v100-1")))
    kw = s.launched[-1][1]
    assert kw["resume"] == row.run_dir and kw["workers"] == 2 and "slowdowns" not in kw  # V100: full speed
    h2 = s.running[a].handle
    h2.step = 13
    s.running[a].start_step = 12
    decide(s, Action("restart", a, "k80", 1, ("k80-0",)))
    assert h2.calls[-1][0] == "stop" and s.launched[-1][1]["slowdowns"] == [3.0]
    assert s.db.job(a).restarts == 2


def test_a_job_that_has_not_stepped_is_killed_not_stopped(service):
    s = service
    a = add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)))
    h = s.running[a].handle
    decide(s, Action("preempt", a))
    assert h.calls == [("kill",)]
    assert s.db.job(a).state == "queued"


def test_a_crashing_job_fails_alone_and_a_finished_one_is_done(service):
    s = service
    a, b = add(s), add(s, steps=10)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)), Action("start", b, "v100", 1, ("v100-1",)))
    ha, hb = s.running[a].handle, s.running[b].handle
    ha.done, ha.error = True, TrainingError("worker 0 failed: RuntimeError: boom")
    hb.done, hb.step = True, 10
    s._tick()
    assert s.db.job(a).state == "failed" and "boom" in s.db.job(a).error
    assert s.db.job(b).state == "done" and s.db.job(b).steps_done == 10
    assert not s.running


def test_cancel_stops_a_running_job(service):
    s = service
    a = add(s)
    decide(s, Action("start", a, "v100", 1, ("v100-0",)))
    h = s.running[a].handle
    h.step = 4
    assert s.db.request_cancel(a) == "requested"
    s._tick()
    assert h.calls[-1] == ("stop", "cancelled") and s.db.job(a).state == "cancelled"


def test_recovery_records_completed_jobs_and_requeues_the_others(service):
    s = service
    a, b, c = add(s, steps=20), add(s, steps=20), add(s, steps=20)
    for j in (a, b, c):
        s.db.set_job_state(j, "running", acc_type="v100", workers=1, slots=["v100-0"])
    da, db_ = s.db.job(a).run_dir, s.db.job(b).run_dir
    os.makedirs(da)
    with open(os.path.join(da, "summary.json"), "w") as f:
        json.dump({"status": "done", "steps_completed": 20}, f)
    os.makedirs(os.path.join(db_, "checkpoints"))
    open(os.path.join(db_, "checkpoints", "step-10.pt"), "wb").close()
    s.recover()
    assert s.db.job(a).state == "done"
    assert s.db.job(b).state == "queued" and s.db.job(c).state == "queued"
    reasons = [e["data"]["reason"] for e in s.db.events(kind="requeued")]
    assert reasons == ["service restarted (resume)", "service restarted (restart)"]


def test_the_service_serves_its_dashboard_and_stops_on_request(tmp_path):
    import threading
    import urllib.request

    from virtualflow.service.state import ClusterDB

    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 1}, policy="fifo", round_s=1.0, dashboard_port=0).close()
    errors = []

    def serve():
        try:
            Service(d, poll_s=0.05, launch=lambda target, **kw: FakeHandle(kw)).run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    db = ClusterDB(d)
    deadline = time.monotonic() + 30
    while (db.get_meta("service") or {}).get("state") != "running":
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.05)
    url = db.get_meta("dashboard")
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and b"cluster queue" in r.read()
    db.set_meta("stop_requested", True)
    thread.join(30)
    assert not thread.is_alive() and not errors
    assert db.get_meta("service")["state"] == "stopped"


@pytest.mark.parametrize("emulate", [False, True])
def test_on_ray_a_slot_type_is_a_ray_resource(tmp_path, emulate):
    from virtualflow.service.state import ClusterDB

    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 2, "k80": 2}, policy="las", round_s=5.0, slowdowns={"k80": 3.0}).close()
    db = ClusterDB(d)  # as cluster start --backend ray writes it (its Ray check is in tests/test_service_ray.py)
    db.set_meta("config", {**db.config(), "backend": "ray", "address": "10.0.0.1:6379", "cpus_per_worker": 0.5,
                           "emulate_slowdowns": emulate})
    launched = []
    s = Service(d, launch=lambda target, **kw: launched.append(kw) or FakeHandle(kw))
    s.epoch_s = 0.0
    a = add(s, elastic=True, max_workers=2)
    decide(s, Action("start", a, "k80", 1, ("k80-0",)))
    kw = launched[-1]
    assert (kw["backend"], kw["address"], kw["cpus_per_worker"], kw["resources"]) == \
        ("ray", "10.0.0.1:6379", 0.5, {"k80": 1.0})
    assert kw.get("slowdowns") == ([3.0] if emulate else None)
    # A newcomer of an in-place resize asks for the same resource (job-wide) and gets the slowdown only if emulated.
    h = s.running[a].handle
    decide(s, Action("resize", a, "k80", 2, ("k80-0", "k80-1")))
    h.workers[1]["rank"] = 1
    s._tick()
    assert (("slowdown", 1, 3.0) in h.calls) == emulate
