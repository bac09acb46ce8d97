"""Errors in the user's code are one line naming their origin; Ctrl-C and SIGTERM stop a run at a
step boundary with the final state written and `stopped` recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from virtualflow.runtime.checkpoint import load_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = os.path.join(ROOT, "tests", "jobs.py")
# `virtualflow` as started from a terminal, whatever started this test: a shell without job control
# starts its background commands with SIGINT ignored, and a child inherits that (the CLI then keeps
# ignoring Ctrl-C, as a background command should), so the Ctrl-C tests set it back to Python's
# default first.
CLI_AS_FROM_A_TERMINAL = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                          "signal.default_int_handler); from virtualflow.cli.main import main; sys.exit(main())"]

BROKEN = '''
import torch, virtualflow as vf
from torch import nn

def raises_runtime():
    raise RuntimeError("no GPU quota left")

def raises_value():
    raise ValueError("bad learning rate")

def lists_not_tensors():
    data = [([0.1 * i] * 4, [1.0]) for i in range(64)]  # python lists: default_collate keeps lists
    return vf.Job(model=lambda: nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), dataset=data,
                  global_batch_size=16, virtual_nodes=4)

def model_raises():
    def model():
        raise KeyError("layer_9")
    return lists_not_tensors().replace(model=model)
'''


def cli(*args, cwd=ROOT, timeout=240):
    return subprocess.run([sys.executable, "-m", "virtualflow.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("fn,message", [
    ("raises_runtime", "the job function '{f}:raises_runtime' raised RuntimeError: no GPU quota left"),
    ("raises_value", "the job function '{f}:raises_value' raised ValueError: bad learning rate"),
    ("model_raises", "Job.model raised KeyError: 'layer_9'"),
    ("lists_not_tensors", "Job.loss raised TypeError: linear(): argument 'input' (position 1) must be Tensor, "
                          "not list on virtual node 0's batch of step 0, a list(list[4] of Tensor[4] float64, "
                          "list[1] of Tensor[4] float64)"),
])
def test_errors_in_the_job_code_are_one_line_naming_the_part(tmp_path, fn, message):
    f = tmp_path / "broken.py"
    f.write_text(BROKEN)
    p = cli("run", f"{f}:{fn}", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert message.format(f=f) in lines[0]
    if fn == "lists_not_tensors":
        assert "dataset items must be tensors" in lines[0]
    verbose = cli("--verbose", "run", f"{f}:{fn}", "--steps", "1", "--run-dir", str(tmp_path / "run2"))
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr


@pytest.mark.parametrize("sig,code,reason", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_interrupt_stops_at_a_step_boundary_with_the_final_state(tmp_path, sig, code, reason):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([*CLI_AS_FROM_A_TERMINAL, "run", f"{JOBS}:elastic_job",
                             "--workers", "2", "--steps", "100000", "--run-dir", run_dir, "--no-progress"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for a few committed steps
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            try:
                with open(os.path.join(run_dir, "status.json")) as fh:
                    if json.load(fh)["step"] >= 3:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        proc.send_signal(sig)  # only the coordinator: workers run in their own session
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert "stopped at step" in err and reason in err and "Traceback" not in err
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(run_dir, "status.json")) as fh:
        status = json.load(fh)
    assert summary["status"] == status["state"] == "stopped"
    assert summary["stop_reason"] == status["stop_reason"] == reason
    assert summary["error"] is None and summary["failures"] == []
    final = load_state(os.path.join(run_dir, "final.pt"))
    assert 3 <= final["step"] == summary["steps_completed"] < 100000
    steps = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == list(range(final["step"]))  # every committed step recorded once, none after the state
    assert all(torch.isfinite(v).all() for v in final["model"].values() if v.is_floating_point())


def test_worker_join_with_nothing_listening_is_one_line(tmp_path):
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4)
    token.chmod(0o600)
    p = cli("worker", "--join", "127.0.0.1:1", "--token-file", str(token), "--join-timeout", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr and "frame #" not in p.stderr, p.stderr
    assert p.stderr.strip() == ("virtualflow worker: nothing is listening at 127.0.0.1:1 (Connection refused); start "
                                "the job first (virtualflow run ... --backend external --listen 127.0.0.1:1) or "
                                "check --join")
    token.chmod(0o644)  # a token others can read is refused, naming the fix
    p = cli("worker", "--join", "127.0.0.1:1", "--token-file", str(token), "--join-timeout", "1")
    assert p.returncode == 2 and f"chmod 600 {token}" in p.stderr and len(p.stderr.strip().splitlines()) == 1


SLOW = '''
import time, torch, virtualflow as vf
from torch import nn

def loss(model, batch):
    time.sleep(2.5)  # a step long enough that Ctrl-C falls inside its computation
    return nn.functional.mse_loss(model(batch[0]), batch[1])

def make_job():
    x = torch.linspace(-1, 1, 64).reshape(16, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return vf.Job(model=lambda: nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=loss,
                  dataset=data, global_batch_size=4, virtual_nodes=2)
'''


def test_ctrl_c_during_a_step_stops_at_that_steps_boundary(tmp_path):
    """The docs promise the next step boundary: Ctrl-C while step k computes keeps step k and
    nothing after it (the stop landed one step later: the control position was read when the
    step started), and the log says the job was stopped, not that its last step is done."""
    job = tmp_path / "slow.py"
    job.write_text(SLOW)
    run_dir = str(tmp_path / "run")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    proc = subprocess.Popen([*CLI_AS_FROM_A_TERMINAL, "run", str(job), "--workers", "2",
                             "--steps", "50", "--run-dir", run_dir, "--no-progress"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        seen = 0
        while seen < 2:  # steps 0 and 1 recorded: step 2 is computing (2.5 s in its loss)
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            try:
                with open(metrics) as fh:
                    seen = sum(1 for line in fh if line.endswith("\n"))
            except OSError:
                pass
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    steps = [json.loads(line)["step"] for line in open(metrics)]
    assert steps == list(range(seen + 1)), (seen, steps)  # the step in flight, and no other
    assert f"stopped after {seen + 1} steps: interrupted (Ctrl-C)" in err, err[-3000:]
    assert "the job's last step is done" not in err
