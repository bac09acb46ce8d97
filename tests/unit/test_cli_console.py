"""The console a user meets first: flags are never abbreviated and a mistyped one is answered by
its verb with the closest flag; reading verbs answer without importing torch; ``virtualflow
plot`` draws the learning rate, the gradient norm and the loss function's own metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from virtualflow.cli.main import VERBS, build_parser, main


def _synthetic_run(run_dir: str, steps: int = 6) -> str:
    """A finished run's records as `virtualflow run` writes them (the fields plot and status read)."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"type": "step", "time": 100.0 + s, "step": s, "loss": 2.0 / (s + 1), "samples": 8,
                                "step_time_s": 0.01, "workers": 2, "generation": 0, "lr": 0.1 * (1 - s / steps),
                                "grad_norm": 1.0 + s, "skipped": False, "metrics": {"acc": s / steps, "ppl": 9.0 - s}})
                    + "\n")
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.write(json.dumps({"event": "eval", "step": steps - 1, "metrics": {"val_loss": 0.5}}) + "\n")
    status = {"job": "toy", "state": "done", "step": steps, "total_steps": steps, "generation": 0, "workers": []}
    with open(os.path.join(run_dir, "status.json"), "w") as f:
        json.dump(status, f)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"workers": 2, "steps": steps}, f)
    return run_dir


def test_a_prefix_of_a_flag_is_not_taken_for_it_and_the_verb_suggests_the_flag(capsys):
    """``--step`` was silently ``--steps`` (argparse's abbreviations) and a mistyped flag printed
    the top-level usage; now the verb refuses it with its own usage and the closest flag."""
    with pytest.raises(SystemExit) as exc:
        main(["run", "job.py", "--step", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: virtualflow run" in err
    assert "virtualflow run: error: unrecognized arguments: --step 5" in err
    assert "did you mean --steps?" in err
    with pytest.raises(SystemExit):
        main(["status", "RUN", "--jsn"])
    err = capsys.readouterr().err
    assert "usage: virtualflow status" in err and "did you mean --json?" in err
    with pytest.raises(SystemExit):  # a nested verb answers with its own usage
        main(["cluster", "stop", "--dir", "x", "--dri", "y"])
    err = capsys.readouterr().err
    assert "usage: virtualflow cluster stop" in err and "did you mean --dir?" in err
    with pytest.raises(SystemExit):  # a mistyped verb
        main(["sttus", "RUN"])
    assert "did you mean 'status'?" in capsys.readouterr().err


def test_every_parser_refuses_abbreviations():
    def walk(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    parsers = list(walk(build_parser()))
    assert len(parsers) > len(VERBS)
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers if p.allow_abbrev]


def test_the_verb_table_matches_the_verbs_modules():
    """``virtualflow --help`` lists the verbs from main's table without importing their modules;
    the table must say what the modules say."""
    full = build_parser()
    action = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in action._choices_actions}
    assert list(action.choices) == [name for name, _, _ in VERBS]
    assert {name: h for name, _, h in VERBS} == helps
    # a parser built for one verb lists the same verbs, that one complete
    one = build_parser("status")
    sub = next(a for a in one._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(action.choices)
    assert "--json" in sub.choices["status"]._option_string_actions


_PROBE = """
import sys
from virtualflow.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH-LOADED" if "torch" in sys.modules else "NO-TORCH", code)
"""


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["status", "RUN"], ["plot", "RUN", "-o", "OUT"],
                                  ["plot", "--help"], ["status", "--json", "RUN"]])
def test_reading_verbs_do_not_import_torch(tmp_path, argv):
    """Every verb imported torch and the whole library first (seconds of CPU for a --help)."""
    run_dir = _synthetic_run(str(tmp_path / "run"))
    argv = [run_dir if a == "RUN" else str(tmp_path / "loss.png") if a == "OUT" else a for a in argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    last = proc.stdout.strip().splitlines()[-1]
    assert last in ("NO-TORCH 0", "NO-TORCH None"), (proc.stdout[-2000:], proc.stderr[-2000:])


def test_plot_draws_lr_grad_norm_and_the_users_metrics(tmp_path):
    from virtualflow.cli.plot import runs_figure

    a = _synthetic_run(str(tmp_path / "a"))
    b = _synthetic_run(str(tmp_path / "b"), steps=4)
    fig = runs_figure([a, b])
    titled = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(titled) == {"training loss", "learning rate", "gradient norm (before clipping)", "training: acc",
                           "training: ppl", "evaluation: val_loss"}
    lr = titled["learning rate"].lines[0]  # run a's learning rate, as recorded
    assert list(lr.get_xdata()) == list(range(6))
    assert list(lr.get_ydata()) == pytest.approx([0.1 * (1 - s / 6) for s in range(6)])
    ppl = titled["training: ppl"].lines
    assert [list(line.get_ydata()) for line in ppl] == [[9.0 - s for s in range(6)], [9.0 - s for s in range(4)]]
    assert len(titled["gradient norm (before clipping)"].lines) == 2
    assert main(["plot", a, "-o", str(tmp_path / "out" / "loss.png")]) == 0
    assert os.path.getsize(tmp_path / "out" / "loss.png") > 0


def test_plot_without_lr_or_grad_norm_draws_the_loss_only(tmp_path):
    from virtualflow.cli.plot import runs_figure

    run_dir = str(tmp_path / "r")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s in range(3):
            f.write(json.dumps({"step": s, "loss": -1.0 + s, "lr": None, "grad_norm": None, "metrics": {},
                                "workers": 1}) + "\n")
    fig = runs_figure([run_dir])
    assert [ax.get_title() for ax in fig.axes] == ["training loss"]
    assert fig.axes[0].get_yscale() == "linear"  # a negative loss cannot be drawn on a log scale


def test_the_start_up_split_names_the_workers_of_each_stage():
    """A 3-D job's start-up named "piece 1 (worker 1)" for a stage run by workers 2-3."""
    from torch import nn

    from virtualflow.plan.pipeline.geometry import describe_split, stage_workers

    layers = [nn.Linear(2, 2) for _ in range(4)]
    bounds = [(0, 2), (2, 4)]
    # 2 stages x 2 tensor-parallel workers, 1 replica: rank = stage * 2 + t
    text = describe_split(layers, bounds, stages=2, replicas=1, tensor=2)
    assert text.splitlines()[0].startswith("  piece 0 (stage 0: workers 0\u20131): layers 0-1")
    assert text.splitlines()[1].startswith("  piece 1 (stage 1: workers 2\u20133): layers 2-3")
    # 2 replicas of the same: stage 1 is workers 2-3 and 6-7
    assert stage_workers(1, stages=2, replicas=2, tensor=2) == "workers 2\u20133, 6\u20137"
    # a plain pipeline of 2 stages x 3 replicas: stage 1 is workers 1, 3 and 5
    assert stage_workers(1, stages=2, replicas=3) == "workers 1, 3, 5"
    # a single pipeline: the line it always had
    assert describe_split(layers, bounds, stages=2).splitlines()[1].startswith("  piece 1 (worker 1): layers 2-3")
    # interleaved chunks: piece 3 of 4 runs on stage 1
    four = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert describe_split(layers, four, stages=2).splitlines()[3].startswith("  piece 3 (stage 1: worker 1)")


def test_log_lines_go_above_the_progress_bar_not_onto_it():
    """A log line during a run was written after the bar's text on the same line."""
    import io
    import logging

    from tqdm.auto import tqdm

    from virtualflow.cli.main import ConsoleHandler

    stream = io.StringIO()
    log = logging.getLogger("virtualflow.test_console")
    log.propagate = False
    handler = ConsoleHandler(stream)
    log.addHandler(handler)
    try:
        bar = tqdm(total=10, desc="job", file=stream, mininterval=0, ascii=True, ncols=60)
        bar.update(3)
        log.warning("hello from the run")
        bar.update(1)
        bar.close()
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    import re

    match = re.search(r"\r( *)\r(\d\d:\d\d:\d\d WARNING virtualflow.test_console: hello from the run\n)", text)
    # the bar is cleared (a return, blanks over it, a return) and the line starts at column 0
    assert match and len(match.group(1)) > 0, repr(text)
    assert "3/10" in text[:match.start()] and "4/10" in text[match.end():]  # the bar is drawn again under it
