"""What a run leaves on disk is standard JSON and loses nothing (issue 40, items 7 and 9): a NaN
or infinite number is written as a string strict parsers accept and read back as the float it
was; a step report too large for the store's report channel is refused where it is made, with
the limit named, instead of being dropped by the coordinator. Pure: no processes."""

from __future__ import annotations

import json
import math
import os

import pytest

from virtualflow.comm import auth, protocol
from virtualflow.control.coordinator import JsonlWriter
from virtualflow.records import rundir


def _strict(text: str):
    """json.loads that refuses the non-standard NaN/Infinity tokens."""
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


NONFINITE_RECORD = {"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1,
                    "metrics": {"acc": float("-inf"), "ok": 0.5}, "vns": [[0, 1], [2]],
                    "breakdown": [{"worker": 0, "compute_s": float("nan")}]}


def _same(a, b) -> bool:
    """Equal, with NaN equal to NaN (at any depth)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_metrics_and_events_lines_are_standard_json_and_read_back(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    w = JsonlWriter(path)
    w.write(NONFINITE_RECORD)
    w.write({"step": 4, "loss": 1.5})
    w.close()
    with open(path) as f:
        lines = [_strict(line) for line in f]  # every line parses without the NaN token
    assert lines[0]["loss"] == "nan" and lines[0]["grad_norm"] == "inf" and lines[0]["metrics"]["acc"] == "-inf"
    back = rundir.read_jsonl(path)
    assert _same(back[0], NONFINITE_RECORD) and back[1] == {"step": 4, "loss": 1.5}


def test_status_and_summary_are_standard_json_and_read_back(tmp_path):
    run_dir = str(tmp_path)
    status = {"state": "running", "step": 3, "last_loss": float("nan"), "last_step": NONFINITE_RECORD,
              "coordinator": {"pid": os.getpid()}}
    rundir.write_json(os.path.join(run_dir, "status.json"), status)
    rundir.write_json(os.path.join(run_dir, "summary.json"), {"final_loss": float("inf"), "error": "nan-free"})
    for name in ("status.json", "summary.json"):
        with open(os.path.join(run_dir, name)) as f:
            _strict(f.read())
    assert _same(rundir.read_status(run_dir), status)
    summary = rundir.read_summary(run_dir)
    assert summary["final_loss"] == math.inf and summary["error"] == "nan-free"
    assert _same(rundir.read_json(os.path.join(run_dir, "status.json")), status)


def test_status_cli_json_is_standard(tmp_path, capsys):
    import argparse

    from virtualflow.cli import status as status_cli

    rundir.write_json(str(tmp_path / "status.json"), {"state": "done", "step": 2, "last_loss": float("nan")})
    status_cli.main(argparse.Namespace(run_dir=str(tmp_path), json=True))
    assert _strict(capsys.readouterr().out)["last_loss"] == "nan"


def test_plot_reads_a_nan_loss_as_a_float(tmp_path):
    from virtualflow.cli.plot import load_run

    w = JsonlWriter(str(tmp_path / "metrics.jsonl"))
    for step, loss in enumerate([1.0, float("nan"), float("inf")]):
        w.write({"step": step, "loss": loss, "workers": 1})
    w.close()
    losses = [s["loss"] for s in load_run(str(tmp_path))["steps"]]
    assert losses[0] == 1.0 and math.isnan(losses[1]) and losses[2] == math.inf


# -- item 7: a report over the store's limit is refused where it is made ----------------------
def _run_key() -> protocol.RunKey:
    return protocol.RunKey(auth.run_key("t" * 64, auth.new_job_id()), "job")


def test_an_oversized_report_is_refused_when_sealed_naming_the_limit_and_the_field():
    run = _run_key()
    long_names = {("m" * 30_000) + str(i): 0.5 for i in range(10)}  # ~300 KB of metric names
    report = {"type": "step", "step": 0, "loss": 0.5, "samples": 8, "step_time_s": 0.1, "workers": 1,
              "generation": 0, "vns": [[0, 1]], "members": [0], "compute_s": None, "vn_sizes": None, "time": 1.0,
              "metrics": long_names, "worker": 0, "pid": 1, "seq": 1}
    with pytest.raises(protocol.ReportTooLarge,
                       match=r"step report of worker 0 at step 0 is \d+ bytes.*limit of 262144 bytes \(256 KiB\).*"
                             r"largest field is 'metrics'"):
        protocol.seal_report(run, report)
    # one under the limit still goes through, and the reader accepts it
    small = {**report, "metrics": {"loss2": 0.5}}
    assert protocol.ReportReader(run).parse(protocol.seal_report(run, small).encode())["metrics"] == {"loss2": 0.5}


def test_long_metric_names_are_refused_at_the_first_call():
    import torch

    from virtualflow.runtime.batches import MAX_METRIC_NAME, LossShapeError, split_loss

    loss = torch.tensor(1.0)
    assert split_loss((loss, {"a" * MAX_METRIC_NAME: 1.0}), "at step 0")[1] == {"a" * MAX_METRIC_NAME: 1.0}
    with pytest.raises(LossShapeError, match=rf"metric name of 300 characters at step 0.*at most {MAX_METRIC_NAME}"):
        split_loss((loss, {"x" * 300: 1.0}), "at step 0")
