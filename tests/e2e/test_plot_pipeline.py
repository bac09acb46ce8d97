"""``virtualflow plot RUN_DIR --pipeline``: one step's measured pipeline schedule beside the simulator's.

Timelines are recorded in this process (the executor's in-process driver with
``Pipeline(record_timeline=True)``) and written as a worker writes them, so the tests need no
worker processes; one test runs the command line on such a directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from torch import nn

import jobs
from virtualflow.cli import plot_pipeline as pp
from virtualflow.cli.main import main as cli_main
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.pipeline.simulate import simulate
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline import schedule_for
from virtualflow.backends.inprocess import LocalDriver, build_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPUTE = ("F", "B", "I", "W")


def _plain_net() -> nn.Module:  # no BatchNorm: the no-flush schedules refuse it
    return nn.Sequential(nn.Linear(jobs.FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def record(run_dir, schedule="1f1b", *, stages=2, chunks=1, steps=3, replicas=1, window=4, summary=True) -> str:
    """Train a pipelined job in this process with ``record_timeline=True`` and write what each
    worker recorded to ``run_dir/pipeline/timeline-<rank>.jsonl`` (and a summary.json)."""
    job = jobs.pipelined_job(schedule, stages)
    if schedule in ("2bw", "async") or chunks > 1:
        job = job.replace(model=_plain_net)
    pipeline = dataclasses.replace(job.pipeline, chunks=chunks, window=window, record_timeline=True)
    job = job.replace(pipeline=pipeline)
    dataset = job.build_dataset()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, pipeline, bounds, r % stages, dataset=dataset, deterministic=False,
                            device=torch.device("cpu")) for r in range(stages * replicas)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, replicas))
    t, n_per = 0, (1 if pipeline.flush else window)
    while t < steps:
        n = min(n_per, steps - t)
        driver.run(t, n)
        t += n
    os.makedirs(os.path.join(run_dir, "pipeline"), exist_ok=True)
    for rank, e in enumerate(engines):
        with open(os.path.join(run_dir, "pipeline", f"timeline-{rank}.jsonl"), "w") as f:
            for rec in e.timeline:
                f.write(json.dumps({**rec, "rank": rank, "replica": rank // stages, "stage_rank": rank % stages,
                                    "generation": 0}) + "\n")
    if summary:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"status": "done", "pipeline": {"stages": stages, "schedule": schedule, "chunks": chunks,
                                                      "split": [b - a for a, b in bounds]}}, f)
    return str(run_dir)


def records(run_dir) -> list[dict]:
    out = []
    folder = os.path.join(run_dir, "pipeline")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            out += [json.loads(line) for line in f]
    return out


def expected(run_dir, step, *, replica=0, stages=2, chunks=1, schedule="1f1b", m=8, window=1):
    """What the timeline implies, computed here from the raw records: the step's (or window's)
    span, each stage-rank's bubble, and simulate()'s result with the per-stage mean times."""
    recs = [r for r in records(run_dir) if r["replica"] == replica]
    first = step - step % window if window > 1 else step
    recs = [r for r in recs if first <= r["step"] < first + window]
    span = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    bubble = [1 - sum(r["end"] - r["start"] for r in recs if r["stage_rank"] == sr and r["kind"] in COMPUTE) / span
              for sr in range(stages)]

    def mean(kind, s):
        xs = [r["end"] - r["start"] for r in recs if r["kind"] == kind and r["stage"] == s]
        return sum(xs) / len(xs)

    sched = schedule_for(Pipeline(stages=stages, schedule=schedule, chunks=chunks), m, window)
    n = stages * chunks
    f = [mean("F", s) for s in range(n)]
    if sched.split_backward():
        w = [mean("W", s) for s in range(n)]
        sim = simulate(sched, f, [mean("I", s) + w[s] for s in range(n)], w)
    else:
        sim = simulate(sched, f, [mean("B", s) for s in range(n)])
    return span, bubble, sim


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def assert_matches(ps, span, bubble, sim):
    assert ps.step_time == pytest.approx(span, rel=1e-12)
    assert ps.bubble == pytest.approx(bubble, rel=1e-9, abs=1e-12)
    assert float(ps.predicted.step_time) == pytest.approx(float(sim.step_time), rel=1e-12)
    assert ps.predicted.bubble == pytest.approx(sim.bubble, rel=1e-9, abs=1e-12)
    # the simulated panel is laid out action by action as simulate() laid it out
    assert [[(s.action, float(s.start)) for s in row] for row in ps.predicted.timeline] == \
        [[(s.action, pytest.approx(float(s.start), rel=1e-12, abs=1e-15)) for s in row] for row in sim.timeline]


# ---- measuring ---------------------------------------------------------------------------------
def test_default_step_is_the_last_one_and_numbers_match_the_timeline(tmp_path):
    d = record(tmp_path / "run", "1f1b", replicas=2)  # 2 replicas of 4 VNs each: replica 0 is drawn
    ps = pp.measure(d)
    assert (ps.step, ps.replica, ps.steps, ps.schedule.name) == (2, 0, 1, "1f1b")
    assert (ps.schedule.p, ps.schedule.m, ps.schedule.v) == (2, 4, 1)
    assert ps.schedule_source == "from summary.json" and ps.order_matches
    span, bubble, sim = expected(d, 2, m=4)
    assert_matches(ps, span, bubble, sim)
    assert all(0.0 < b < 1.0 for b in ps.bubble)
    # every row holds this stage-rank's actions of step 2 of replica 0, in time order
    for r, row in enumerate(ps.rows):
        assert {(e.step, e.replica, e.stage_rank) for e in row} == {(2, 0, r)}
        assert [e.start for e in row] == sorted(e.start for e in row)
        assert sum(e.kind == "F" for e in row) == 4
    # and the report prints both step times and every stage-rank's bubbles
    text = pp.report(ps)
    assert f"measured {span * 1000:.3f} ms, predicted {float(sim.step_time) * 1000:.3f} ms" in text
    for r in range(2):
        assert f"{bubble[r]:.1%}" in text and f"{sim.bubble[r]:.1%}" in text
    out = pp.draw(ps, str(tmp_path / "out" / "pipeline.png"))
    assert png_size(out) == (15 * 110, int((1.6 + 0.55 * 2) * 110)) and os.path.getsize(out) > 10_000


@pytest.mark.parametrize("schedule,chunks", [("zb_h1", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_other_schedules(tmp_path, schedule, chunks):
    d = record(tmp_path / "run", schedule, chunks=chunks, steps=2)
    ps = pp.measure(d, step=1)
    assert ps.schedule.name == schedule and ps.schedule.v == chunks and ps.order_matches
    assert_matches(ps, *expected(d, 1, schedule=schedule, chunks=chunks))
    if schedule == "zb_h1":  # split backward: the simulator got W's mean and I + W as the backward
        assert ps.w_time is not None and all(0 < w < b for w, b in zip(ps.w_time, ps.b_time))
        assert {e.kind for row in ps.rows for e in row} >= {"F", "I", "W"}
    else:
        assert ps.w_time is None
    assert os.path.getsize(pp.draw(ps, str(tmp_path / "p.png"))) > 10_000


def test_no_flush_schedule_draws_the_window_of_the_step(tmp_path):
    d = record(tmp_path / "run", "2bw", steps=6, window=4)  # windows: steps 0-3 and 4-5
    ps = pp.measure(d, step=2)
    assert (ps.first_step, ps.steps, ps.schedule.steps) == (0, 4, 4)
    assert_matches(ps, *expected(d, 2, schedule="2bw", window=4))
    last = pp.measure(d)  # default: the last window (2 steps)
    assert (last.step, last.first_step, last.steps) == (5, 4, 2)
    assert_matches(last, *expected(d, 5, schedule="2bw", window=2))
    assert "steps 4-5 (one no-flush window" in pp.report(last)


def test_without_summary_the_schedule_is_inferred_from_the_order(tmp_path):
    for schedule in ("gpipe", "1f1b"):
        d = record(tmp_path / schedule, schedule, steps=1, summary=False)
        ps = pp.measure(d)
        assert ps.schedule.name == schedule and ps.schedule_source.startswith("inferred")
        assert_matches(ps, *expected(d, 0, schedule=schedule))
    # a summary.json that is not JSON (being rewritten) or has a bad pipeline entry: inferred too
    with open(os.path.join(tmp_path / "1f1b", "summary.json"), "w") as f:
        f.write('{"pipeline": {"stages": 2, "sched')
    assert pp.measure(str(tmp_path / "1f1b")).schedule.name == "1f1b"
    with open(os.path.join(tmp_path / "1f1b", "summary.json"), "w") as f:
        json.dump({"pipeline": {"stages": True, "schedule": "nope"}}, f)
    assert pp.measure(str(tmp_path / "1f1b")).schedule_source.startswith("inferred")


def test_malformed_records_are_skipped(tmp_path):
    d = record(tmp_path / "run", "1f1b", steps=2)
    clean = pp.measure(d)
    good = records(d)[0]
    junk = ["not json", "[1, 2]", "{}", json.dumps({**good, "kind": "X"}), json.dumps({**good, "stage": True}),
            json.dumps({**good, "start": "soon"}), json.dumps({**good, "end": good["start"] - 1}),
            json.dumps({**good, "mb": -1}), json.dumps({**good, "start": float("nan")}),
            json.dumps({**good, "stage": 1, "stage_rank": 0}),  # stage 1 does not live on stage-rank 0
            json.dumps({**good, "step": 1, "generation": "x"}), '{"kind": "F", "stage": 0, "mb"']
    with open(os.path.join(d, "pipeline", "timeline-0.jsonl"), "a") as f:
        f.write("\n".join(junk))  # the last one a partial line, as a crash leaves it
    os.symlink(os.path.join(d, "pipeline", "timeline-0.jsonl"), os.path.join(d, "pipeline", "timeline-7.jsonl"))
    with open(os.path.join(d, "pipeline", "timeline-x.jsonl"), "w") as f:
        f.write(json.dumps({**good, "step": 9}) + "\n")  # not a worker's file name
    again = pp.measure(d)
    assert again.step == 1 and again.step_time == clean.step_time and again.bubble == clean.bubble
    assert again.rows == clean.rows


def test_incomplete_steps_and_bad_steps(tmp_path):
    d = record(tmp_path / "run", "1f1b", steps=3)
    path = os.path.join(d, "pipeline", "timeline-1.jsonl")
    with open(path) as f:
        lines = f.readlines()
    last_b = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "B")
    with open(path, "w") as f:  # stage-rank 1 lost its last backward of step 2
        f.writelines(lines[:last_b] + lines[last_b + 1:])
    ps = pp.measure(d)  # the default skips the incomplete step
    assert ps.step == 1
    assert_matches(ps, *expected(d, 1))
    with pytest.raises(ValueError, match="stage-rank 1 recorded 15 of the 16 compute actions 1f1b runs"):
        pp.measure(d, step=2)
    with pytest.raises(ValueError, match=r"step 7 is not in .* \(replica 0 has steps 0-2\)"):
        pp.measure(d, step=7)
    with pytest.raises(ValueError, match="no action of replica 3"):
        pp.measure(d, replica=3)


def test_no_timeline_is_one_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"no pipeline timeline .* does not exist\); record it with "
                                         r"Pipeline\(record_timeline=True\)"):
        pp.measure(str(tmp_path / "run"))
    (tmp_path / "run" / "pipeline").mkdir()
    (tmp_path / "run" / "pipeline" / "timeline-0.jsonl").write_text("garbage\n")
    with pytest.raises(ValueError, match=r"is empty\); record it with Pipeline\(record_timeline=True\)"):
        pp.measure(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="does not exist"):
        pp.measure(str(tmp_path / "nowhere"))


# ---- the command line ----------------------------------------------------------------------------
def test_cli_pipeline_plot(tmp_path):
    d = record(tmp_path / "run", "1f1b", steps=2)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(2):
            f.write(json.dumps({"step": s, "loss": 1.0, "samples": 32, "step_time_s": 0.01, "workers": 2}) + "\n")
    out = str(tmp_path / "pipeline.png")
    p = subprocess.run([sys.executable, "-m", "virtualflow.cli.main", "plot", d, "--pipeline", "-o", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    span, bubble, sim = expected(d, 1)
    assert "run: step 1, replica 0, generation 0: 1f1b, p=2, m=8, v=1" in p.stdout
    assert f"step time: measured {span * 1000:.3f} ms, predicted {float(sim.step_time) * 1000:.3f} ms" in p.stdout
    assert f"wrote {out}" in p.stdout
    assert png_size(out)[0] == 15 * 110 and os.path.getsize(out) > 10_000


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot", str(tmp_path / "empty"), "--pipeline", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("virtualflow plot: error: ") and "record it with Pipeline(record_timeline=True)" in err
    assert "\n" not in err and not os.path.exists(tmp_path / "x.png")
    d = record(tmp_path / "run", "1f1b", steps=1)
    assert cli_main(["plot", d, "--pipeline", "--step", "5"]) == 2
    assert "step 5 is not in" in capsys.readouterr().err
    assert cli_main(["plot", d, "--step", "0"]) == 2
    assert "--step goes with --pipeline" in capsys.readouterr().err
    assert cli_main(["plot", d, d, "--pipeline"]) == 2
    assert "pass one RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["plot", d, "--pipeline", "--timeline"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
