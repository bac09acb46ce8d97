"""``virtualflow simulate --model service``: any trace through the cluster service's scheduler (pure).

Proofs: a job alone finishes when the service's timing model says (a hand computation) and the
result's GPU-seconds and lost time add up; a run exported by ``virtualflow cluster replay
--export`` and simulated from the files predicts what the replay predicts from the database (two
independent paths to the same model); a start longer than a round is not undone before it pays
off (the service's pin), where the rounds model restarts the job every round; the service's
slowdown factors come from the table's row or ``--slowdowns``; the JSON trace round-trips; bad
input is refused with the knob named.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from test_service_replay import COSTS, two_job_cluster
from virtualflow.cli import main as cli_main
from virtualflow.cluster import Cluster, JobSpec, ThroughputTable, get_policy
from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.simulator import SimConfig, simulate
from virtualflow.cluster.traces import read_json_trace, write_json_trace
from virtualflow.service.model import replay_jobs, simulate_service
from virtualflow.service.replay import ReplayCosts

TABLE = ThroughputTable.from_dict({"throughputs": {
    "a": {"v100": {"1": 20.0, "2": 36.0}, "k80": {"1": 10.0, "2": 18.0}},
    "b": {"v100": {"1": 8.0, "2": 15.0}, "k80": {"1": 2.0, "2": 3.8}},
}})


def test_a_job_alone_finishes_when_the_service_model_says():
    job = JobSpec(job_id=0, job_type="a", scale_factor=1, total_steps=100, arrival_s=10.0)
    res = simulate_service([job], Cluster.parse("v100=1,k80=1"), TABLE, get_policy("fifo"), round_s=3.0, costs=COSTS)
    launch = 10.0 + COSTS.idle_s + COSTS.first_launch_s
    # the service places it on the faster type; first step start_s after the launch, 99 more at 20/s
    finish = launch + COSTS.start_s + 99 / 20.0 + COSTS.done_s
    assert res.finish_s[0] == pytest.approx(finish)
    assert res.jct_s[0] == pytest.approx(finish - 10.0)
    assert res.lost_s[0] == pytest.approx(COSTS.start_s - 1 / 20.0)  # the pause, less the first step
    # one v100 slot held from the first round's start (10.25) to the finish; none on k80
    assert res.gpu_s[0].tolist() == pytest.approx([finish - 10.25, 0.0])
    assert res.restarts[0] == 0 and res.resizes[0] == 0 and res.steps_run[0] == 100
    # solved at the arrival, then again when the first measurement moved the estimate off the prior
    assert res.rounds == 3 and res.solves == 2


def test_an_exported_run_simulates_as_the_replay_predicts(tmp_path, capsys):
    """Two paths to one prediction: `cluster replay` (database -> measure -> replay) and
    `cluster replay --export` + `simulate --model service` (files -> trace, table, costs -> replay)."""
    d, ids = two_job_cluster(tmp_path)
    out = str(tmp_path / "export")
    assert cli_main.main(["cluster", "replay", "--dir", d, "--json", "--export", out]) == 0
    want = json.loads(capsys.readouterr().out)
    info = json.load(open(os.path.join(out, "export.json")))
    assert sorted(os.listdir(out)) == ["costs.json", "export.json", "throughputs.json", "trace.json"]
    assert info["slots"] == {"v100": 1} and info["policy"] == "fifo" and info["round_s"] == 2.0
    assert info["jobs"]["job-%d" % ids[0]]["measured"] == ["v100/1"]
    trace = json.load(open(os.path.join(out, "trace.json")))["jobs"]
    assert [j["arrival_s"] for j in trace] == [0.0, 1.0] and [j["total_steps"] for j in trace] == [30.0, 30.0]
    argv = info["command"].split()[1:] + ["--no-progress", "-o", str(tmp_path / "sim")]
    assert cli_main.main(argv) == 0
    line = capsys.readouterr().out
    assert "fifo: 2/2 jobs done" in line
    recs = [json.loads(x) for x in open(tmp_path / "sim" / "jobs.jsonl")]
    got = [r["finish_s"] - r["arrival_s"] for r in recs]
    assert got == pytest.approx([j["predicted_jct_s"] for j in want["jobs"]], rel=1e-9)
    summary = json.load(open(tmp_path / "sim" / "summary.json"))
    assert summary["finished"] == 2 and summary["restarts"] == 0


def test_a_start_longer_than_a_round_is_not_undone():
    """Two jobs time-share one slot under LAS with a resume pause three rounds long: the service
    keeps a started job until it has stepped, so every start pays its whole pause and is followed
    by steps; the rounds model takes the job away after a round and charges a restart at most the
    round it happens in (restarting far more often, each undercharged)."""
    jobs = [JobSpec(job_id=i, job_type="a", scale_factor=1, total_steps=200, arrival_s=0.0) for i in range(2)]
    costs = ReplayCosts(start_s=3.0, resume_s=3.0, launch_s=0.0, first_launch_s=0.0, stop_s=0.0, done_s=0.0,
                        idle_s=0.0)
    svc = simulate_service(jobs, Cluster.parse("v100=1"), TABLE, get_policy("las"), round_s=1.0, costs=costs)
    assert np.isfinite(svc.finish_s).all() and (svc.restarts >= 1).all()
    assert svc.lost_s.tolist() == pytest.approx([(3.0 - 0.05) * (1 + r) for r in svc.restarts])
    rounds = simulate(jobs, Cluster.parse("v100=1"), TABLE, get_policy("las"),
                      SimConfig(mechanism=MechanismConfig(round_s=1.0, restart_cost_s=3.0, start_cost_s=3.0)))
    assert (rounds.restarts >= 2 * svc.restarts).all()
    assert (rounds.lost_s <= (1 + rounds.restarts) * 1.0 + 1e-9).all()


def test_the_services_slowdowns_come_from_the_table_row_or_the_override():
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=2, min_gpus=1, total_steps=50),
            JobSpec(job_id=1, job_type="b", scale_factor=1, total_steps=50)]
    a, b = replay_jobs(jobs, {"v100": 2, "k80": 2}, TABLE)
    assert a.slowdowns == pytest.approx({"v100": 1.0, "k80": 2.0})
    assert b.slowdowns == pytest.approx({"v100": 1.0, "k80": 4.0})
    assert a.elastic and (a.min_workers, a.max_workers) == (1, 2) and not b.elastic
    assert a.rates == {"v100/1": 20.0, "v100/2": 36.0, "k80/1": 10.0, "k80/2": 18.0}
    assert b.rates == {"v100/1": 8.0, "k80/1": 2.0}
    a2, b2 = replay_jobs(jobs, {"v100": 2, "k80": 2}, TABLE, slowdowns={"k80": 3.0})
    assert a2.slowdowns["k80"] == 3.0 and b2.slowdowns["k80"] == 3.0 and a2.rates == a.rates
    with pytest.raises(ValueError, match=r"job 0 \(a\) needs 2 workers on one type but the largest type has 1"):
        replay_jobs([JobSpec(job_id=0, job_type="a", scale_factor=2, total_steps=5)], {"v100": 1, "k80": 1}, TABLE)


def test_the_json_trace_round_trips_and_refuses_bad_jobs(tmp_path):
    jobs = [JobSpec(job_id=0, job_type="a", scale_factor=2, min_gpus=1, total_steps=50.0, weight=2.0,
                    arrival_s=3.5, slo_s=100.0),
            JobSpec(job_id=1, job_type="b", scale_factor=1, total_steps=7.0)]
    path = tmp_path / "t.json"
    write_json_trace(path, jobs)
    assert read_json_trace(path, TABLE) == jobs

    def bad(rows, match):
        path.write_text(json.dumps({"jobs": rows}))
        with pytest.raises(ValueError, match=match):
            read_json_trace(path, TABLE)

    ok = {"job_type": "a", "total_steps": 5, "scale_factor": 1}
    bad([{**ok, "gpus": 2}], r"job 0: unknown keys \['gpus'\]")
    bad([ok, {"job_type": "a", "scale_factor": 1}], r"job 1: .*missing keys \['total_steps'\]")
    bad([{**ok, "job_type": "zz"}], r"job 0: unknown job type 'zz'")
    bad([{**ok, "min_gpus": 3}], r"job 0: .*min_gpus=3 must be at most 1 \(an elastic job.s fewest GPUs, at most its scale_factor\)")
    bad([{**ok, "scale_factor": 4}], r"job 0: the throughput table has no throughput for 'a' at scale_factor=4")
    bad([], r"at least one job")


def test_the_command_line_refuses_what_the_service_model_does_not_do(tmp_path, capsys):
    base = ["simulate", "--trace", "small_test", "--cluster", "v100=4,p100=4,k80=4", "--no-progress"]
    assert cli_main.main(base + ["--costs", str(tmp_path / "none.json")]) == 2
    assert "apply to --model service only" in capsys.readouterr().err
    assert cli_main.main(base + ["--model", "service", "--reallocate-on-events"]) == 2
    assert "leave out --reallocate-on-events" in capsys.readouterr().err
    assert cli_main.main(base + ["--model", "service", "--policy", "min_cost", "--prices", "v100=3,p100=2,k80=1"]) == 2
    assert "--policy min_cost needs prices, which the cluster service does not have" in capsys.readouterr().err
    assert cli_main.main(base + ["--model", "service", "--costs", str(tmp_path / "none.json")]) == 2
    assert "--costs" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps({"start_s": 1.0, "restart_s": 2.0}))
    assert cli_main.main(base + ["--model", "service", "--costs", str(tmp_path / "c.json")]) == 2
    assert "unknown keys ['restart_s']" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps({"costs": {"start_s": 1.0, "resume_s": 2.0}}))
    assert cli_main.main(base + ["--model", "service", "--costs", str(tmp_path / "c.json")]) == 0
    assert "20/20 jobs done" in capsys.readouterr().out
