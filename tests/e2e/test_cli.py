"""The command line, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, cwd=ROOT, timeout=240):
    return subprocess.run([sys.executable, "-m", "virtualflow.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_run_then_plot_two_worker_counts(tmp_path):
    dirs = []
    for workers in (1, 2):
        d = str(tmp_path / f"w{workers}")
        p = cli("run", "examples/synthetic.py", "--workers", str(workers), "--steps", "12", "--run-dir", d,
                "--virtual-nodes", "4", "--deterministic")
        assert p.returncode == 0, p.stderr
        assert "done: 12 steps" in p.stdout
        assert "global batch 64 = 4 virtual nodes x 16" in p.stderr
        assert "12/12" in p.stderr  # the progress bar reached the end
        dirs.append(d)
    a = torch.load(os.path.join(dirs[0], "final.pt"), weights_only=False)["model"]
    b = torch.load(os.path.join(dirs[1], "final.pt"), weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # --deterministic: same weights on 1 and 2 workers
    assert json.load(open(os.path.join(dirs[1], "summary.json")))["virtual_nodes"] == 4
    out = str(tmp_path / "loss.png")
    p = cli("plot", *dirs, "-o", out)
    assert p.returncode == 0, p.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000


def test_digits_job_with_evaluation(tmp_path):
    d = str(tmp_path / "digits")
    p = cli("run", "examples/digits.py", "--workers", "2", "--steps", "30", "--run-dir", d, "--no-progress")
    assert p.returncode == 0, p.stderr
    summary = json.load(open(os.path.join(d, "summary.json")))
    assert summary["metrics"]["accuracy"] > 0.5  # 30 steps of a CNN on digits: well above chance (0.1)
    out = str(tmp_path / "digits.png")
    assert cli("plot", d, "-o", out).returncode == 0 and os.path.exists(out)


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "examples/synthetic.py", "--workers", "0", "--steps", "1"], "workers=0 must be a positive integer"),
        (["run", "examples/synthetic.py", "--workers", "9", "--steps", "1"], "virtual_nodes=8 is smaller than workers=9"),
        (["run", "examples/synthetic.py", "--steps", "1", "--global-batch-size", "60"], "global_batch_size=60 is not divisible"),
        (["run", "examples/synthetic.py:nope", "--steps", "1"], "has no function 'nope'"),
        (["plot", "examples", "-o", "x.png"], "not a virtualflow run directory"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    p = cli(*args, cwd=ROOT)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_steps_or_epochs_required():
    p = cli("run", "examples/synthetic.py")
    assert p.returncode == 2 and "give exactly one of steps and epochs" in p.stderr and "(--steps 100)" in p.stderr
