"""The cluster service end to end, as a user runs it: ``virtualflow cluster start`` (in the
background), ``virtualflow submit``, the service killed with SIGKILL mid-trace and started again
(with another policy), every job to completion.

The standard of proof: every job's final weights and optimizer state are bit-identical
(deterministic mode) to a standalone run of the same job (unpaced, by the VN engine in this
process: :mod:`vn_reference`), however often the service resized,
preempted or moved it and although the service died; each job completed once (one ``done``
event) and recorded every step exactly once in its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import assert_state_equal, flat_optimizer_state
from virtualflow.cli import main as cli_main
from virtualflow.records.rundir import pid_alive
from virtualflow.service.state import ClusterDB
from jobs import cross_entropy, elastic_job, mse, paced_regression_job
from vn_reference import deterministic_reference

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
JOBS = os.path.join(HERE, "service_jobs.py")


def cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "virtualflow.cli.main", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def wait_until(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.2)
    print(f"{time.monotonic() - T0[0]:6.1f} s: {what}")


T0 = [time.monotonic()]


def service_pid(db: ClusterDB) -> int:
    return int((db.get_meta("service") or {}).get("pid") or 0)


def worker_pids(db: ClusterDB) -> list[int]:
    pids = []
    for j in db.jobs():
        try:
            with open(os.path.join(j.run_dir, "status.json")) as f:
                pids += [w["pid"] for w in json.load(f).get("workers", []) if isinstance(w.get("pid"), int)]
        except (OSError, ValueError):
            pass
    return pids


def submit(d, *args):
    assert cli_main.main(["submit", *args, "--dir", d, "--deterministic", "--checkpoint-every", "5"]) == 0


TRACE = (("paced_slow", 100), ("paced_adam", 30), ("paced", 60))
# Each job's standalone run: the same job unpaced (the pace only sleeps), in this process.
UNPACED = {"paced_slow": paced_regression_job().replace(loss=mse), "paced": paced_regression_job().replace(loss=mse),
           "paced_adam": elastic_job().replace(loss=cross_entropy)}


def test_trace_survives_sigkill_and_every_job_matches_its_standalone_run(tmp_path):
    T0[0] = time.monotonic()
    d = str(tmp_path / "cluster")
    slots = ["--slots", "v100=2,k80=1", "--slowdowns", "k80=2", "--round-s", "2"]
    cli("cluster", "start", "--dir", d, "--policy", "elastic_fair", *slots)
    db = ClusterDB(d)
    try:
        # The elastic job alone gets both V100s; two rigid arrivals make elastic_fair shrink it to one
        # worker (in place when it stays on a V100, by a move otherwise), and it grows back later.
        submit(d, f"{JOBS}:paced_slow", "--steps", "100", "--elastic", "--max-workers", "2")
        wait_until(lambda: db.job(1).state == "running" and db.job(1).steps_done >= 1, 60, "job 1 running")
        submit(d, f"{JOBS}:paced_adam", "--steps", "30")
        submit(d, f"{JOBS}:paced", "--steps", "60")
        # Kill -9 once every job has made progress past a checkpoint (or ended).
        wait_until(lambda: all(j.steps_done >= 6 or j.final for j in db.jobs()), 90, "progress of every job")
        pid = service_pid(db)
        orphans = worker_pids(db)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, "the service's death")
        killed_at = {j.id: (j.state, j.steps_done) for j in db.jobs()}
        restarted_at = time.time()
        # Its jobs' workers lose their coordinator: members exit at their next step; the restarted
        # service kills what is left (a worker still starting can wait much longer).
        # Started again in the foreground this time (one interpreter less to start), under fifo, and
        # with --min-run-s: a job stays where it restarted for 20 s (no moves: a short end of the trace).
        env = dict(os.environ, OMP_NUM_THREADS="1")
        service = subprocess.Popen([sys.executable, "-m", "virtualflow.cli.main", "cluster", "start", "--dir", d,
                                    "--policy", "fifo", "--min-run-s", "20", "--foreground", *slots], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: all(j.final for j in db.jobs()), 150, "every job's completion")
        assert cli_main.main(["cluster", "stop", "--dir", d]) == 0
        assert service.wait(30) == 0
    finally:
        pid = service_pid(db)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not [p for p in orphans if pid_alive(p)]
    jobs = db.jobs()
    assert [j.state for j in jobs] == ["done"] * 3, [(j.id, j.state, j.error) for j in jobs]
    events = db.events()
    assert sorted(e["job_id"] for e in events if e["kind"] == "done") == [1, 2, 3]  # once each
    requeued = {e["job_id"] for e in events if e["kind"] == "requeued"}
    # A job's workers may finish its last steps on their own after the service died (members only
    # need the coordinator at a step boundary's control read): the restarted service then records
    # it done, the first thing it says of that job, instead of requeueing it.
    after = [e for e in events if e["t"] > restarted_at]
    finished_alone = {jid for jid in killed_at
                      if next((e["kind"] for e in after if e["job_id"] == jid), None) == "done"}
    running = {jid for jid, (state, _) in killed_at.items() if state == "running"}
    assert requeued == running - finished_alone and requeued, (requeued, running, finished_alone)
    assert any(e["kind"] == "start" and e["data"].get("resumed") for e in events)  # resumed from a state
    changes = [e["kind"] for e in events if e["kind"] in ("resize", "preempt")]
    assert changes, "no job was resized or preempted: the trace does not test the service"
    assert {a["acc_type"] for a in db.allocations()} == {"v100", "k80"}
    # Every job equals its standalone run; every step recorded once.
    for j, (name, steps) in zip(jobs, TRACE):
        ref = deterministic_reference(UNPACED[name], steps)
        final = torch.load(os.path.join(j.run_dir, "final.pt"), weights_only=False)
        assert final["step"] == j.steps and final["lr_scheduler"] == ref.lr_scheduler_state_dict
        assert_state_equal(final["model"], ref.state_dict)
        assert_state_equal(flat_optimizer_state(final["optimizer"]), flat_optimizer_state(ref.optimizer_state_dict))
        with open(os.path.join(j.run_dir, "metrics.jsonl")) as f:
            steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
        # No step recorded twice. The records of the last steps before the SIGKILL may be lost with
        # the coordinator (it lived in the killed service) although the workers checkpointed them;
        # such a gap ends where the job resumed after the restart.
        assert steps == sorted(set(steps)) and steps[-1] == j.steps - 1, f"job {j.id} recorded steps {steps}"
        missing = sorted(set(range(j.steps)) - set(steps))
        resumed_at = [e["data"]["from_step"] for e in events if e["kind"] == "start" and e["job_id"] == j.id
                      and e["t"] > restarted_at]
        assert not missing or (resumed_at and max(missing) < resumed_at[0]
                               and min(missing) >= killed_at[j.id][1] - 5), (j.id, missing, resumed_at)
