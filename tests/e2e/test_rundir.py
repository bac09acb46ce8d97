"""The run directory's records (virtualflow.records.rundir) and the plots drawn from them.

Records are read while a job may still be writing them: a partial last JSONL line and a
status.json caught mid-rewrite must give what is complete, or one clear error, never a decoder
traceback. Plotting must not touch the caller's matplotlib state (no pyplot, no backend change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from virtualflow.records.rundir import read_jsonl, read_status, read_summary, run_state, write_json

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def test_read_jsonl_skips_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    full = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.5}]
    # A crash (or a reader racing the writer) leaves the last record half written.
    path.write_text("".join(json.dumps(r) + "\n" for r in full) + '{"step": 2, "lo')
    assert read_jsonl(str(path)) == full
    # Blank lines and lines that are JSON but not records are skipped too.
    path.write_text(json.dumps(full[0]) + "\n\n[1, 2]\n" + json.dumps(full[1]) + "\n")
    assert read_jsonl(str(path)) == full
    assert read_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_write_json_round_trips_and_leaves_no_temp_file(tmp_path):
    status = {"state": "running", "step": 3, "coordinator": {"pid": os.getpid()}}
    write_json(str(tmp_path / "status.json"), status)
    assert read_status(str(tmp_path)) == status
    assert os.listdir(tmp_path) == ["status.json"]
    assert run_state(str(tmp_path), status) == "running"
    write_json(str(tmp_path / "summary.json"), {"workers": 2})
    assert read_summary(str(tmp_path)) == {"workers": 2}
    assert run_state(str(tmp_path), status) == "finished"


@pytest.mark.parametrize("content", ["", '{"state": "running", "st', '{"state": "running"}\n{"st'])
def test_read_status_on_a_truncated_file_says_to_retry(tmp_path, content):
    (tmp_path / "status.json").write_text(content)
    with pytest.raises(ValueError) as info:
        read_status(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path / "status.json") in message
    assert "being rewritten; retry" in message
    assert not isinstance(info.value, json.JSONDecodeError)  # one clear error, not the decoder's


def test_read_status_refuses_what_is_not_a_run_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_status(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"not a virtualflow run directory \(no status.json\)"):
        read_status(str(tmp_path))
    (tmp_path / "status.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not a run's status"):
        read_status(str(tmp_path))
    assert read_summary(str(tmp_path)) is None


def test_status_cli_reports_a_truncated_status_in_one_line(tmp_path, capsys):
    from virtualflow.cli.main import main

    (tmp_path / "status.json").write_text('{"job": "x", "state": "runn')
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "virtualflow status: error:" in err and "retry in a moment" in err
    assert "Traceback" not in err


def write_synthetic_run(run_dir: str) -> None:
    """A run that went 1 -> 2 -> 3 workers, lost one, and evaluated twice; its metrics file ends
    in a partial line, as a run still writing it leaves."""
    os.makedirs(run_dir, exist_ok=True)
    step_s = {1: 0.40, 2: 0.21, 3: 0.15}
    sizes = [1] * 8 + [2] * 8 + [3] * 8 + [2] * 6
    t = 1000.0
    metrics, generation = [], 0
    for step, k in enumerate(sizes):
        if step and k != sizes[step - 1]:
            generation += 1
        t += step_s[k]
        metrics.append({"step": step, "loss": 2.0 / (1 + step), "samples": 64, "step_time_s": step_s[k],
                        "workers": k, "generation": generation, "vns": 8, "time": t})
    events = [
        {"event": "formed", "generation": 0, "step": 0, "change": "start", "pause_s": 0.0},
        {"event": "resize_request", "step": 7, "workers": 2},
        {"event": "formed", "generation": 1, "step": 8, "change": "grow", "pause_s": 0.12},
        {"event": "formed", "generation": 2, "step": 16, "change": "grow", "pause_s": 0.10},
        {"event": "failure", "time": metrics[23]["time"] - 0.05},
        {"event": "formed", "generation": 3, "step": 24, "change": "failure", "pause_s": 0.30},
        {"event": "eval", "step": 10, "metrics": {"accuracy": 0.5}},
        {"event": "eval", "step": 20, "metrics": {"accuracy": 0.7}},
        {"event": "autoscale_size", "workers": 1, "throughput": 160.0, "cost_rate_per_h": 1.0},
        {"event": "autoscale_size", "workers": 2, "throughput": 305.0, "cost_rate_per_h": 2.0},
        {"event": "autoscale_size", "workers": 3, "throughput": 427.0, "cost_rate_per_h": 3.0},
        {"event": "autoscale_settled", "workers": 2},
    ]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
        f.write('{"step": 30, "loss": 0.0')
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    write_json(os.path.join(run_dir, "summary.json"), {"workers": 2})


def test_scaling_table_of_a_synthetic_run(tmp_path):
    from virtualflow.cli.plot import scaling_table

    run_dir = str(tmp_path / "run")
    write_synthetic_run(run_dir)
    rows, chosen, source = scaling_table(run_dir)
    assert source == "autoscaler's measurements" and chosen == 2
    assert [r["workers"] for r in rows] == [1, 2, 3]
    assert rows[1]["worker_s_per_1k_samples"] == pytest.approx(1000.0 * 2 / 305.0)


def test_plots_leave_the_callers_matplotlib_alone(tmp_path):
    """Every kind of plot of a synthetic run writes a PNG, in a process whose user chose a
    backend: afterwards the backend is the user's and pyplot was never imported."""
    pytest.importorskip("matplotlib")
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    write_synthetic_run(run_a)
    write_synthetic_run(run_b)
    script = textwrap.dedent(f"""
        import os, sys
        import matplotlib
        matplotlib.use("svg")  # the user's choice, made before virtualflow is imported
        from virtualflow.cli.main import main
        runs = [{run_a!r}, {run_b!r}]
        out = {str(tmp_path)!r}
        assert main(["plot", *runs, "-o", os.path.join(out, "loss.png")]) == 0
        assert main(["plot", *runs, "--timeline", "-o", os.path.join(out, "timeline.png")]) == 0
        assert main(["plot", runs[0], "--scaling", "-o", os.path.join(out, "sub", "scaling.png")]) == 0
        print("pyplot imported:", "matplotlib.pyplot" in sys.modules)
        print("backend:", matplotlib.get_backend())
    """)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MPLBACKEND", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "pyplot imported: False" in proc.stdout
    assert "backend: svg" in proc.stdout
    for name in ("loss.png", "timeline.png", os.path.join("sub", "scaling.png")):
        with open(tmp_path / name, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n", name
        assert os.path.getsize(tmp_path / name) > 10_000, name
