"""Inputs that used to hang, crash or mislead the simulators and ``virtualflow gnn`` (issue 27).

Every case runs the real command line in process (``virtualflow.cli.main.main``) and checks that
it ends at once with exit status 2 and one line on stderr naming the file, the job (or row), the
field and the rule; the HiGHS banner check needs a fresh process (HiGHS prints it once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from virtualflow.cli.main import main

SIM = ["simulate", "--cluster", "v100=2,k80=2", "--no-progress"]


def _trace(tmp_path, **job) -> str:
    row = {"job_type": "ResNet-18 (batch size 16)", "total_steps": 1000, "scale_factor": 1, **job}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"jobs": [row]}))
    return str(path)


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("model", ["rounds", "service"])
@pytest.mark.parametrize("field, value, rule", [
    ("total_steps", 1e300, "total_steps=1e+300 must be at most 1e+12"),
    ("total_steps", True, "total_steps=True must be a number"),
    ("total_steps", 2e11, "would take"),  # within the count bound, but years of run time
    ("job_type", ["a", "b"], "job_type=['a', 'b'] must be a string"),
    ("scale_factor", 1.5, "scale_factor=1.5 must be a whole number"),
    ("arrival_s", 1e300, "arrival_s=1e+300 must be at most"),
    ("weight", float("inf"), None),  # not even JSON: json.dumps writes Infinity
])
def test_json_trace_numbers_are_bounded_by_their_meaning(tmp_path, capsys, model, field, value, rule):
    path = _trace(tmp_path, **{field: value})
    assert main(SIM + ["--model", model, "--trace", path]) == 2
    line = _err_line(capsys)
    assert path in line
    if rule is None:
        assert "Infinity is not a JSON number" in line
    else:
        assert "job 0" in line and field in line and rule in line


def test_json_nesting_and_huge_integers_are_refused_not_crashing(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(SIM + ["--trace", str(deep)]) == 2
    assert "nested deeper than 64 levels" in _err_line(capsys)
    big = tmp_path / "big.json"
    big.write_text('{"jobs": [{"job_type": "ResNet-18 (batch size 16)", "total_steps": ' + "9" * 400
                   + ', "scale_factor": 1}]}')
    assert main(SIM + ["--trace", str(big)]) == 2
    assert "an integer of 400 digits" in _err_line(capsys)


def test_gavel_trace_steps_are_bounded(tmp_path, capsys):
    path = tmp_path / "t.trace"
    path.write_text("ResNet-18 (batch size 16)\t-\t-\t-\t0\t1e300\t1\t1\t-1\t0\n")
    assert main(SIM + ["--trace", str(path)]) == 2
    line = _err_line(capsys)
    assert f"{path}:1" in line and "total_steps=1e+300 must be at most 1e+12" in line


def test_costs_are_bounded_pauses(tmp_path, capsys):
    trace = _trace(tmp_path)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"resume_s": 1e300}))
    assert main(SIM + ["--model", "service", "--trace", trace, "--costs", str(costs)]) == 2
    line = _err_line(capsys)
    assert str(costs) in line and "resume_s=1e+300 must be at most 86400" in line
    costs.write_text(json.dumps({"resume_s": "soon"}))
    assert main(SIM + ["--model", "service", "--trace", trace, "--costs", str(costs)]) == 2
    assert "resume_s='soon' must be a number" in _err_line(capsys)


@pytest.mark.parametrize("flag, value, rule", [
    ("--round-s", "0", "--round-s=0 must be >= 1"),
    ("--round-s", "1e300", "--round-s=1e+300 must be at most 86400"),
    ("--max-hours", "1e300", "--max-hours=1e+300 must be at most"),
    ("--restart-cost-s", "nan", "--restart-cost-s=nan must be a finite number"),
])
def test_simulate_options_are_bounded(tmp_path, capsys, flag, value, rule):
    assert main(SIM + ["--trace", _trace(tmp_path), flag, value]) == 2
    assert rule in _err_line(capsys)


def test_generated_workload_size_is_bounded(capsys):
    assert main(SIM + ["--generate", "rate=2,jobs=" + "9" * 400]) == 2
    assert "num_jobs=" in _err_line(capsys)


SPOT = ["simulate-spot", "--stages", "2"]


@pytest.mark.parametrize("rows, rule", [
    ("0,4\n1e300,2\n", "time (s)=1e+300 must be at most"),
    ("0,4\n10,1e12\n20,4\n", "count=1e+12 must be at most 100000"),
    ("0,4\n10,2.5\n20,4\n", "count=2.5 must be a whole number"),
])
def test_spot_trace_times_and_counts_are_bounded(tmp_path, capsys, rows, rule):
    path = tmp_path / "spot.csv"
    path.write_text(rows)
    assert main(SPOT + ["--trace", str(path)]) == 2
    line = _err_line(capsys)
    assert str(path) in line and ":2:" in line and rule in line


@pytest.mark.parametrize("argv, rule", [
    (["--generate", "rate=1,nodes=4,hours=1e300"], "hours=1e+300 must be at most"),
    (["--generate", "rate=1,nodes=1000000000000,hours=1"], "nodes=1000000000000 must be at most 100000"),
    (["--generate", "rate=1e9,nodes=4,hours=24"], "preemptions; at most"),
    (["--generate", "rate=1,nodes=4,hours=24", "--speedup", "1e-12"], "must be at most"),
    (["--generate", "rate=1,nodes=4,hours=24", "--checkpoint-every-s", "1e-300"], "--checkpoint-every-s=1e-300"),
])
def test_spot_generation_and_options_are_bounded(capsys, argv, rule):
    assert main(SPOT + argv) == 2
    assert rule in _err_line(capsys)


def test_spot_constants_are_bounded(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"constants": {"step_s": 1e-300}}))
    assert main(SPOT + ["--generate", "rate=1,nodes=4,hours=1", "--constants", str(path)]) == 2
    line = _err_line(capsys)
    assert str(path) in line and "step_s=1e-300 must be >= 1e-06" in line


def test_cluster_replay_round_s_zero_is_refused(tmp_path, capsys):
    assert main(["cluster", "replay", "--dir", str(tmp_path), "--round-s", "0"]) == 2
    assert "--round-s=0 must be > 0" in _err_line(capsys)


def test_highs_banner_stays_off_stdout():
    # HiGHS prints its banner once per process, when its first solver object is built: a fresh
    # process is the only place to see it.
    out = subprocess.run([sys.executable, "-m", "virtualflow.cli.main", "simulate", "--no-progress", "--generate",
                          "rate=2,jobs=6,seed=0",
                          "--policy", "finish_time_fairness"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "HiGHS" not in out.stdout and out.stdout.startswith("finish_time_fairness:"), out.stdout


# -- virtualflow gnn ---------------------------------------------------------------------------
GNN_JOB = '''
import torch
from torch_geometric.nn import GCNConv
from virtualflow.gnn import GNNJob, GNNModel, karate_club

def make_job():
    return GNNJob(graph=karate_club(train_per_class=2), model=lambda: GNNModel([GCNConv(34, 8), GCNConv(8, 4)]),
                  epochs=3, seed=0)

def nan_feature():
    g = karate_club(train_per_class=2)
    g.x[5, 7] = float("nan")
    return GNNJob(graph=g, model=lambda: GNNModel([GCNConv(34, 8), GCNConv(8, 4)]), epochs=3, seed=0)

def diverges():
    return GNNJob(graph=karate_club(train_per_class=2), model=lambda: GNNModel([GCNConv(34, 8), GCNConv(8, 4)]),
                  epochs=3, seed=0, optimizer=lambda p: torch.optim.SGD(p, lr=1e38))
'''


def test_gnn_nan_feature_is_refused_before_training(tmp_path, capsys):
    path = tmp_path / "job.py"
    path.write_text(GNN_JOB)
    assert main(["gnn", f"{path}:nan_feature", "--mode", "simulated", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "graph.x has 1 non-finite feature value(s) (first: vertex 5, feature 7 = nan)" in captured.err


def test_gnn_json_is_valid_json_and_a_diverged_run_reports_no_value(tmp_path, capsys):
    path = tmp_path / "job.py"
    path.write_text(GNN_JOB)
    assert main(["gnn", f"{path}:diverges", "--mode", "simulated", "--json", "--baselines", "cpu"]) == 1
    captured = capsys.readouterr()
    records = json.loads(captured.out)  # the whole of stdout, strictly (no NaN)
    assert [r["run"] for r in records] == ["dorylus S=0", "cpu-only"]
    for r in records:
        assert r["diverged"] is True and r["value"] is None and r["test_acc"] is None
    assert "graph:" in captured.err and "the loss became non-finite" in captured.err


def test_spot_trace_of_years_finishes(tmp_path, capsys):
    # Within the bounds, but at 1e8 s a float's spacing is coarser than the replay's old absolute
    # tolerance: it looped for ever a few nanoseconds before a checkpoint. An alarm bounds the
    # test should that come back.
    import signal

    path = tmp_path / "years.csv"
    path.write_text("0,4\n3.1e8,2\n3.15e8,2\n")

    def too_long(*_):
        raise TimeoutError("the replay of a 10-year trace did not finish in 120 s")

    old = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(120)
    try:
        assert main(SPOT + ["--trace", str(path), "--strategies", "checkpoint,bamboo", "--json"]) == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    s = json.loads(capsys.readouterr().out)
    assert s["strategies"]["checkpoint"]["hours"] == pytest.approx(3.15e8 / 3600)
