"""Faults a real cluster has, on hosts (network namespaces, tests/hosts.py): a whole host dies, a
host is cut off by a partition and comes back, a link is slow, the coordinator's host is cut off.

Every run is a real multi-node run: the coordinator (``virtualflow run --backend external
--listen ADDR:PORT``) in host h0, each worker (``virtualflow worker --join``) in a host of its own,
gloo and the store on the hosts' interfaces. The standard of proof is the one of
tests/e2e/test_elastic.py: deterministic mode, and the run ends with weights, optimizer and
LR-scheduler state bit-identical to an undisturbed run of as many steps, with every step recorded
exactly once in ``metrics.jsonl``.

The partition test shows *why* a stale worker cannot corrupt the job: the coordinator fenced it
(``fenced`` event) and, when the link is back, the worker's next report — signed with a valid
run key, for its old generation — is refused by the coordinator (``report_rejected`` naming the
worker, the report's type and generation), and the worker finds a signed ``fail`` where it looks
for its next generation and exits cleanly. Not luck of timing: the partition lasts well under
the worker's ``coordinator_timeout_s``, so the worker is certainly alive and writing when it heals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_state_equal, flat_optimizer_state
from hosts import make_hosts  # noqa: F401 - fixture
from virtualflow.runtime.checkpoint import load_state
from vn_reference import Reference, deterministic_reference
import jobs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent
PY = sys.executable
PORT = 29400
FOREVER = 1_000_000


class Run:
    """One job across hosts: the coordinator's CLI in ``coord_host``, workers joined from others."""

    def __init__(self, hosts, tmp: Path, *, coord_host: str = "h0", job: str = "tests/jobs.py:elastic_job",
                 steps: int = FOREVER, run_dir: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        self.hosts, self.tmp = hosts, tmp
        self.run_dir = run_dir or tmp / "run"
        self.address = f"{hosts[coord_host].ip}:{PORT}"
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]
                                                  + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        self.log = open(tmp / f"coordinator-{len(list(tmp.glob('coordinator-*')))}.log", "wb")
        self.coordinator = hosts[coord_host].run(
            [PY, "-m", "virtualflow.cli.main", "run", job, "--backend", "external", "--listen", self.address,
             "--steps", str(steps), "--deterministic", "--no-progress",
             *(() if "--resume" in extra else ("--run-dir", str(self.run_dir))),
             "--heartbeat-timeout", "1", *extra],
            env=self.env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers: dict[int, subprocess.Popen] = {}  # pid -> process
        self.where: dict[int, str] = {}  # pid -> host name
        started = len(events(self.run_dir, "start"))  # a resumed run appends to the same events.jsonl
        wait(lambda: len(events(self.run_dir, "start")) > started, "the coordinator listening", self.coordinator, 60)

    def join(self, host: str, *, timeout_s: float = 60.0) -> subprocess.Popen:
        log = open(self.tmp / f"{host}-{len(self.workers)}.log", "wb")
        p = self.hosts[host].run([PY, "-m", "virtualflow.cli.main", "worker", "--join", self.address, "--token-file",
                                  str(self.run_dir / "token"), "--join-timeout", str(timeout_s)],
                                 env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers[p.pid], self.where[p.pid] = p, host
        return p

    def worker_on(self, host: str) -> int:
        """The worker id of the process joined from ``host`` (the joined events name the pid)."""
        pids = {pid for pid, h in self.where.items() if h == host}
        return next(e["worker"] for e in events(self.run_dir, "joined") if e["pid"] in pids)

    def steps(self) -> list[int]:
        return recorded_steps(self.run_dir)

    def wait_steps(self, n: int, what: str = "", timeout_s: float = 90.0) -> None:
        wait(lambda: len(self.steps()) >= n, what or f"{n} steps recorded", self.coordinator, timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to `virtualflow run`: it stops at the next step boundary with final.pt written."""
        self.coordinator.send_signal(signal.SIGTERM)
        code = self.coordinator.wait(timeout=timeout_s)
        for p in self.workers.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        return code

    def output(self) -> str:
        return "".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("*.log")))


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    try:
        with open(run_dir / "events.jsonl") as f:
            return [e for e in map(json.loads, f) if kind is None or e["event"] == kind]
    except FileNotFoundError:
        return []


def recorded_steps(run_dir: Path) -> list[int]:
    try:
        with open(run_dir / "metrics.jsonl") as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    except FileNotFoundError:
        return []


def wait(predicate, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first (exit {proc.returncode})")
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.05)


_REFERENCES: dict[tuple[str, int], Reference] = {}


def reference(steps: int, job=jobs.elastic_job) -> Reference:
    """The undisturbed deterministic run of ``steps`` steps (the VN engine in this process, its
    loss unpaced: deterministic mode is bit-identical for any worker count)."""
    key = (job.__name__, steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = deterministic_reference(job().replace(loss=jobs.cross_entropy), steps)
    return _REFERENCES[key]


def assert_exact(run_dir: Path, *, first_step: int = 0) -> dict:
    """final.pt holds exactly the undisturbed run's state, and every step is recorded once."""
    final = load_state(str(run_dir / "final.pt"))
    ref = reference(final["step"])
    assert_state_equal(final["model"], ref.state_dict)
    assert_state_equal(flat_optimizer_state(final["optimizer"]), flat_optimizer_state(ref.optimizer_state_dict))
    assert final["lr_scheduler"] == ref.lr_scheduler_state_dict
    assert recorded_steps(run_dir) == list(range(first_step, final["step"]))
    return final


# ---------------------------------------------------------------------------------------------
def test_a_whole_host_dies_and_the_job_goes_on_exactly(make_hosts, tmp_path):
    hosts = make_hosts(3)
    run = Run(hosts, tmp_path, extra=("--workers", "2"))
    try:
        for h in ("h1", "h2"):
            run.join(h)
        run.wait_steps(4, "4 steps on 2 hosts")
        victim = run.worker_on("h2")
        killed = hosts["h2"].kill_all()  # every process of the host at once: no goodbye
        assert killed
        wait(lambda: any(g["members"] == sorted(set(g["members"]) - {victim}) and victim not in g["members"]
                         for g in events(run.run_dir, "generation")[1:]), "a generation without the dead host",
             run.coordinator)
        n = len(run.steps())
        run.wait_steps(n + 3, "3 more steps on the host left")
        assert run.stop() == 128 + signal.SIGTERM, run.output()
    finally:
        if run.coordinator.poll() is None:
            run.coordinator.kill()
    failures = events(run.run_dir, "failure")
    assert [f["worker"] for f in failures] == [victim] and "no heartbeat" in failures[0]["cause"]
    assert_exact(run.run_dir)


def test_a_partitioned_host_is_fenced_and_its_writes_are_refused_when_it_heals(make_hosts, tmp_path):
    hosts = make_hosts(3)
    # The partition (a few seconds) is far shorter than --coordinator-timeout: the cut-off worker
    # stays alive, so it certainly comes back and tries.
    run = Run(hosts, tmp_path, extra=("--workers", "2", "--coordinator-timeout", "60"))
    try:
        procs = {h: run.join(h) for h in ("h1", "h2")}
        run.wait_steps(4, "4 steps on 2 hosts")
        stale = run.worker_on("h2")
        t_cut = time.monotonic()
        hosts["h2"].link_down()  # mid-step: steps run back to back
        wait(lambda: events(run.run_dir, "fenced"), "h2's worker fenced", run.coordinator, 30)
        fenced_s = time.monotonic() - t_cut
        # The fence and the generation after it are two records: wait for the second too.
        wait(lambda: stale not in events(run.run_dir, "generation")[-1]["members"], "a generation without h2",
             run.coordinator, 30)
        assert len(events(run.run_dir, "generation")[-1]["members"]) == 1
        n = len(run.steps())
        run.wait_steps(n + 3, "3 steps without h2")  # the job goes on while h2 is cut off
        assert procs["h2"].poll() is None  # still alive behind the partition
        hosts["h2"].link_up()
        code = procs["h2"].wait(timeout=45)  # it comes back, is refused, and exits cleanly
        n = len(run.steps())
        run.wait_steps(n + 3, "3 more steps after the heal")
        assert run.stop() == 128 + signal.SIGTERM, run.output()
    finally:
        if run.coordinator.poll() is None:
            run.coordinator.kill()
    assert fenced_s < 1.0 + 3.0  # the heartbeat timeout, plus the coordinator's tick and this poll
    fenced = events(run.run_dir, "fenced")
    assert [(e["worker"], e["generation"]) for e in fenced] == [(stale, 0)]
    # What the stale worker tried once it was back: report its broken generation 0 (signed with
    # the run key it still holds). The coordinator refused it as a fenced worker's, so nothing it
    # said reached the membership (no abort, no step, no fault recorded from it).
    # (A step it finished just before the cut may be reported first: where the cut falls in the
    # step decides, so only the presence of its fault report is asserted, not the order.)
    refused = [e for e in events(run.run_dir, "report_rejected") if e.get("worker") == stale]
    assert any(e["type"] == "fault" for e in refused), refused
    assert all(e["generation"] == 0 for e in refused), refused
    assert all("fenced out after generation 0" in e["reason"] for e in refused)
    assert not [e for e in events(run.run_dir, "fault") if e["worker"] == stale]
    assert code == 0
    log = next(p for p in tmp_path.glob("h2-*.log")).read_text()
    assert f"worker {stale} is no longer part of the job after generation 0" in log, log[-2000:]
    assert_exact(run.run_dir)


def test_a_slow_link_shows_as_communication_and_the_autoscaler_names_it(make_hosts, tmp_path):
    hosts = make_hosts(3, rate_mbit={"h1": 1000, "h2": 20})  # h2's link: a fiftieth of h1's
    run = Run(hosts, tmp_path, job="tests/host_jobs.py:link_job",
              extra=("--workers", "2", "--min-workers", "1", "--max-workers", "2",
                     "--autoscale", "efficiency:min_steps=4,warmup_steps=1,replan_change=0"))
    try:
        for h in ("h1", "h2"):
            run.join(h)
        wait(lambda: events(run.run_dir, "autoscale_settled"), "the autoscaler settling", run.coordinator, 120)
        assert run.stop() == 128 + signal.SIGTERM, run.output()
    finally:
        if run.coordinator.poll() is None:
            run.coordinator.kill()
    with open(run.run_dir / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r.get("breakdown") and r["workers"] == 2]
    assert rows
    # Every worker waits for the slow link in the reduction: communication is most of the step.
    for r in rows[1:]:
        for w in r["breakdown"]:
            assert w["reduction_s"] + w["straggler_s"] > 0.5 * w["step_s"], w
    reasons = [d["reason"] for d in events(run.run_dir, "autoscale_decision")]
    reasons += [e["reason"] for e in events(run.run_dir, "autoscale_settled")]
    assert any("communication-bound" in r for r in reasons), reasons


def test_the_coordinators_host_cut_off_workers_exit_in_bounded_time_and_resume_is_exact(make_hosts, tmp_path):
    hosts = make_hosts(3)
    timeout_s = 3.0
    run = Run(hosts, tmp_path, extra=("--workers", "2", "--checkpoint-every", "4",
                                      "--coordinator-timeout", str(timeout_s)))
    try:
        procs = [run.join(h) for h in ("h1", "h2")]
        wait(lambda: (run.run_dir / "checkpoints").exists() and any((run.run_dir / "checkpoints").iterdir()),
             "a checkpoint", run.coordinator)
        t_cut = time.monotonic()
        hosts["h0"].link_down()  # the coordinator's host: the workers still reach each other
        codes = [p.wait(timeout=timeout_s + 20) for p in procs]
        exited_s = time.monotonic() - t_cut
        hosts["h0"].link_up()
        run.coordinator.wait(timeout=30)  # it lost every worker: the job failed
    finally:
        if run.coordinator.poll() is None:
            run.coordinator.kill()
        for p in run.workers.values():
            if p.poll() is None:
                p.kill()
    assert codes == [3, 3], run.output()
    assert exited_s < timeout_s + 6.0  # the bound, plus a store call's timeout and start-up slack
    assert "has been unreachable for" in run.output()
    # Healed, the job continues from its last good state, in place, to a fixed number of steps.
    steps = max(recorded_steps(run.run_dir)) + 6
    resumed = Run(hosts, tmp_path, steps=steps, run_dir=run.run_dir,
                  extra=("--workers", "2", "--resume", str(run.run_dir)))
    try:
        for h in ("h1", "h2"):
            resumed.join(h)
        assert resumed.coordinator.wait(timeout=120) == 0, resumed.output()
    finally:
        if resumed.coordinator.poll() is None:
            resumed.coordinator.kill()
    final = assert_exact(run.run_dir)
    assert final["step"] == steps
