"""Careless input and tampered files never cost a user their job (issue 13, items 3-7 and 12).

State files load as data only (a malicious pickle is refused and runs nothing); writes are atomic
and leave no temporary file; a run directory is private, locked by its coordinator, never shared
by two runs, never silently mixed with an earlier run; resume takes the newest good state of any
kind and deletes nothing. Most cases fail before any worker starts; the few real runs are short
(one worker, a few steps).
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest
import torch

import virtualflow as vf
from virtualflow.cli.run import default_run_dir
from virtualflow.comm import auth
from virtualflow.launching.resume import find_resume_state
from virtualflow.records.rundir import LOCK_FILE, RunLock, atomic_write, make_private_dir, read_jsonl, trim_metrics
from virtualflow.runtime.checkpoint import (CorruptCheckpointError, UntrustedStateError, content_digest, load_state,
                                            save_state)
from virtualflow.runtime.step_boundary import job_identity

import jobs

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def synthetic_state(job: vf.Job, step: int) -> dict:
    """A state of ``job`` at ``step`` as a worker writes it (initial weights, empty optimizer)."""
    torch.manual_seed(job.seed)
    model = job.model()
    return {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": None,
            "step": step, "job": job_identity(job)}


def metric_steps(run_dir: str) -> list[int]:
    return [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]


def events(run_dir: str, kind: str) -> list[dict]:
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e.get("event") == kind]


class MakesDirectory:
    """Unpickling this calls ``os.mkdir(path)``: the shape of a checkpoint built to run code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# -- item 3: states are data ------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "adamw"])
@pytest.mark.parametrize("scheduler", ["step", "lambda", "onecycle", "sequential"])
def test_real_training_states_round_trip_as_data_only(tmp_path, optimizer, scheduler):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
           "adam": lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.9, 0.99)),
           "adamw": lambda p: torch.optim.AdamW(p, amsgrad=True)}[optimizer](model.parameters())
    sched = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
             "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e),
             "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
             "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
                 o, [torch.optim.lr_scheduler.LinearLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
                 milestones=[2])}[scheduler](opt)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(), "step": 3,
             "job": {"name": "x", "global_batch_size": 32, "virtual_nodes": 8, "seed": 5}}
    path = str(tmp_path / "final.pt")
    save_state(path, state)
    back = load_state(path)
    assert content_digest(back) == content_digest(state)
    assert back["lr_scheduler"] == state["lr_scheduler"] and back["step"] == 3
    # A user can read it with plain torch, as data only; the checksum travels inside the file.
    plain = torch.load(path, weights_only=True)
    assert set(plain) == set(state) | {"checksum"}
    assert os.listdir(tmp_path) == ["final.pt"]  # no sidecar, no temporary file


def test_malicious_pickle_is_refused_at_resume_and_runs_nothing(tmp_path, capsys):
    run_dir, marker = str(tmp_path / "run"), str(tmp_path / "pwned")
    make_private_dir(run_dir)
    job = jobs.regression_job()
    save_state(os.path.join(run_dir, "checkpoints", "step-00000004.pt"), synthetic_state(job, 4))
    evil = synthetic_state(job, 9)
    evil["job"]["name"] = MakesDirectory(marker)
    path = os.path.join(run_dir, "final.pt")
    torch.save(evil, path)  # what someone with write access to the directory could leave there
    before = sorted(os.listdir(run_dir))
    with pytest.raises(UntrustedStateError, match=rf"refusing to load {re.escape(path)}: .*could run code"):
        vf.launch(job, workers=1, steps=20, resume=run_dir)
    from virtualflow.cli.main import main

    assert main(["run", f"{jobs.__file__}:regression_job", "--steps", "20", "--resume", run_dir, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to load" in err[0] and path in err[0] and "Traceback" not in err[0]
    assert not os.path.exists(marker)  # nothing ran
    assert sorted(os.listdir(run_dir)) == before  # nothing written, moved or deleted
    # The payload is real: a load that trusts the file runs it.
    torch.load(path, weights_only=False)
    assert os.path.isdir(marker)


def test_corrupt_and_foreign_files_are_told_apart(tmp_path):
    job = jobs.regression_job()
    path = str(tmp_path / "s.pt")
    save_state(path, synthetic_state(job, 3))
    data = bytearray(open(path, "rb").read())
    weight = next(iter(synthetic_state(job, 3)["model"].values())).numpy().tobytes()
    at = bytes(data).find(weight[:16])
    data[at] ^= 0x01  # one flipped bit in a tensor
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="is corrupt: the checksum"):
        load_state(path)
    buf = io.BytesIO()
    torch.save(torch.zeros(3), buf)
    open(path, "wb").write(buf.getvalue())
    with pytest.raises(CorruptCheckpointError, match="is not a training state"):
        load_state(path)


# -- item 5: resume takes the newest good state of any kind, deletes nothing ------------------
def test_find_resume_state_takes_the_newest_by_step_whatever_its_kind(tmp_path):
    job, run_dir = jobs.regression_job(), str(tmp_path)
    for step in (4, 8):
        save_state(os.path.join(run_dir, "checkpoints", f"step-{step:08d}.pt"), synthetic_state(job, step))
    save_state(os.path.join(run_dir, "final.pt"), synthetic_state(job, 10))
    assert find_resume_state(run_dir, job) == (os.path.join(run_dir, "final.pt"), 10)
    save_state(os.path.join(run_dir, "final.pt"), synthetic_state(job, 6))  # an older final state
    assert find_resume_state(run_dir, job) == (os.path.join(run_dir, "checkpoints", "step-00000008.pt"), 8)
    save_state(os.path.join(run_dir, "checkpoint.pt"), synthetic_state(job, 9))  # before a non-finite loss
    assert find_resume_state(run_dir, job) == (os.path.join(run_dir, "checkpoint.pt"), 9)
    save_state(os.path.join(run_dir, "final.pt"), synthetic_state(job, 9))
    assert find_resume_state(run_dir, job)[0] == os.path.join(run_dir, "final.pt")  # a tie: final.pt
    listed = sorted(os.listdir(run_dir)) + sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert listed == ["checkpoint.pt", "checkpoints", "final.pt", "step-00000004.pt", "step-00000008.pt"]


def test_find_resume_state_skips_states_past_the_runs_records(tmp_path):
    """Workers cut off from their coordinator train on and checkpoint steps nobody records: a
    resume from such a state would leave those steps out of metrics.jsonl for good."""
    job, run_dir = jobs.regression_job(), str(tmp_path)
    for step in (4, 8):
        save_state(os.path.join(run_dir, "checkpoints", f"step-{step:08d}.pt"), synthetic_state(job, step))
    save_state(os.path.join(run_dir, "final.pt"), synthetic_state(job, 12))

    def records(n: int) -> None:
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(n))

    assert find_resume_state(run_dir, job)[1] == 12  # no records: the newest
    records(12)
    assert find_resume_state(run_dir, job)[1] == 12
    records(9)  # steps 0..8 recorded: step-8 (8 steps done) is the newest they reach
    assert find_resume_state(run_dir, job) == (os.path.join(run_dir, "checkpoints", "step-00000008.pt"), 8)
    records(7)
    assert find_resume_state(run_dir, job)[1] == 4
    records(2)  # no state the records reach: the newest good one
    assert find_resume_state(run_dir, job)[1] == 12


def test_resume_continues_from_final_pt_and_keeps_every_step_once(run_dir):
    job = jobs.regression_job()
    vf.train(job, workers=1, steps=6, checkpoint_every=4, run_dir=run_dir, deterministic=True)
    step4 = os.path.join(run_dir, "checkpoints", "step-00000004.pt")
    assert os.path.exists(step4) and load_state(os.path.join(run_dir, "final.pt"))["step"] == 6
    # A stopped or finished run goes on from final.pt (not from the older checkpoint), and keeps it.
    result = vf.train(job, workers=1, steps=9, resume=run_dir, deterministic=True)
    start = events(run_dir, "start")[-1]
    assert start["resume_step"] == 6 and start["resume_path"].endswith("final.pt")
    assert [h["step"] for h in result.history] == [6, 7, 8]
    assert metric_steps(run_dir) == list(range(9))
    assert os.path.exists(step4) and load_state(os.path.join(run_dir, "final.pt"))["step"] == 9
    # A final state damaged meanwhile is skipped: back to step 4, whose later metrics are redone, not doubled.
    with open(os.path.join(run_dir, "final.pt"), "r+b") as f:
        f.truncate(1000)
    vf.train(job, workers=1, steps=11, resume=run_dir, deterministic=True)
    assert events(run_dir, "start")[-1]["resume_step"] == 4
    assert metric_steps(run_dir) == list(range(11))


def test_trim_metrics_drops_redone_steps_and_a_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    assert trim_metrics(str(tmp_path), 4) == 3
    assert [r["step"] for r in read_jsonl(str(path))] == [0, 1, 2, 3]
    assert trim_metrics(str(tmp_path), 4) == 0


# -- item 4: one run per directory ------------------------------------------------------------
def test_a_second_launch_into_a_running_jobs_directory_is_refused_and_the_first_goes_on(run_dir):
    job = jobs.regression_job()
    handle = vf.launch(job, workers=1, steps=8, run_dir=run_dir)
    try:
        token = open(os.path.join(run_dir, "token")).read()
        with pytest.raises(ValueError, match=rf"{re.escape(run_dir)} is in use by a running job \(coordinator pid "
                                             rf"{os.getpid()}\b"):
            vf.launch(job, workers=1, steps=8, run_dir=run_dir)
        with pytest.raises(ValueError, match=rf"in use by a running job \(coordinator pid {os.getpid()}\b"):
            vf.launch(job, workers=1, steps=20, resume=run_dir)
        result = handle.wait(timeout_s=120)
    finally:
        if not handle.done:
            handle.kill()
    assert result.steps == 8 and not result.stopped
    assert open(os.path.join(run_dir, "token")).read() == token
    assert metric_steps(run_dir) == list(range(8)) and len(events(run_dir, "start")) == 1
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))  # released when the run ended


def test_run_lock_names_another_process_and_a_dead_holder_never_blocks(tmp_path):
    d = str(tmp_path)
    # The holder loads rundir.py alone (it imports nothing from virtualflow): no torch import.
    code = ("import importlib.util, sys, time; spec = importlib.util.spec_from_file_location('rundir', sys.argv[2]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.RunLock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, d, os.path.join(SRC, "virtualflow", "records", "rundir.py")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"{re.escape(d)} is in use by a running job \(coordinator pid "
                                             rf"{holder.pid} on "):
            RunLock.acquire(d)
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(os.path.join(d, LOCK_FILE))  # left by the killed holder, naming a dead pid
    lock = RunLock.acquire(d)
    assert json.load(open(os.path.join(d, LOCK_FILE)))["pid"] == os.getpid()
    with pytest.raises(ValueError, match=f"pid {os.getpid()}"):
        RunLock.acquire(d)  # a second run in this process is refused too
    lock.release()
    lock.release()
    RunLock.acquire(d).release()


def test_default_run_directories_are_unique_within_a_second():
    names = {default_run_dir("examples/digits.py:make_job") for _ in range(50)}
    assert len(names) == 50
    stamp = time.strftime("%Y%m%d")
    assert all(re.fullmatch(rf"runs/digits-{stamp}-\d{{6}}-[0-9a-f]{{6}}", n) for n in names)


# -- item 6: a new run never mixes with an earlier one ----------------------------------------
def test_fresh_run_in_a_used_directory_is_refused_without_overwrite_and_sets_it_aside_with_it(run_dir):
    job = jobs.regression_job()
    make_private_dir(run_dir)
    save_state(os.path.join(run_dir, "final.pt"), synthetic_state(job, 10))
    save_state(os.path.join(run_dir, "checkpoints", "step-00000010.pt"), synthetic_state(job, 10))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(10))
    before = sorted(os.listdir(run_dir))
    with pytest.raises(ValueError, match=rf"{re.escape(run_dir)} holds the states of an earlier run \(final.pt, "
                                         r"checkpoints/step-00000010.pt\).*--resume.*--overwrite"):
        vf.launch(job, workers=1, steps=3, run_dir=run_dir)
    assert sorted(os.listdir(run_dir)) == before
    with pytest.raises(ValueError, match="would set aside the states"):
        vf.launch(job, workers=1, steps=20, resume=run_dir, overwrite=True)
    # With overwrite, the earlier run is moved aside whole; retention counts only the new run's
    # checkpoints (the old step-10 would otherwise sort last and evict the new ones).
    vf.train(job, workers=1, steps=3, run_dir=run_dir, overwrite=True, checkpoint_every=1)
    aside = [d for d in os.listdir(run_dir) if d.startswith("previous-")]
    assert len(aside) == 1
    old = os.path.join(run_dir, aside[0])
    assert sorted(os.listdir(old)) == ["checkpoints", "final.pt", "metrics.jsonl"]
    assert load_state(os.path.join(old, "final.pt"))["step"] == 10
    assert os.listdir(os.path.join(old, "checkpoints")) == ["step-00000010.pt"]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step-00000001.pt", "step-00000002.pt"]
    assert metric_steps(run_dir) == [0, 1, 2] and load_state(os.path.join(run_dir, "final.pt"))["step"] == 3
    assert find_resume_state(run_dir, job)[1] == 3


# -- item 7: private directory and token ------------------------------------------------------
def test_run_directory_is_created_private_and_unsafe_ones_are_refused(tmp_path):
    job = jobs.regression_job()
    fresh = str(tmp_path / "a" / "run")
    assert make_private_dir(fresh) and stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert not make_private_dir(fresh)
    shared = str(tmp_path / "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match=rf"{re.escape(shared)} is writable by group and others \(mode 0777\).*"
                                         rf"chmod 700 {re.escape(shared)}"):
        vf.launch(job, workers=1, steps=3, run_dir=shared)
    assert os.listdir(shared) == []
    link = str(tmp_path / "link")
    os.symlink(fresh, link)
    with pytest.raises(ValueError, match=rf"{re.escape(link)} is a symbolic link"):
        vf.launch(job, workers=1, steps=3, run_dir=link)
    assert os.listdir(fresh) == []


def test_token_write_refuses_a_symlink_and_never_follows_it(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious\n")
    os.chmod(target, 0o644)
    link = tmp_path / "token"
    os.symlink(target, link)
    with pytest.raises(ValueError, match=rf"refusing to write the job's token to {re.escape(str(link))}: it is a "
                                         r"symbolic link"):
        auth.write_token(str(link), auth.new_token())
    assert target.read_text() == "precious\n" and stat.S_IMODE(os.stat(target).st_mode) == 0o644
    path = str(tmp_path / "real")
    auth.write_token(path, "x" * 32)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and auth.read_token(path, private=True) == "x" * 32


def test_a_token_file_others_can_read_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef" * 4)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=rf"may be accessed by other users \(mode 0644\).*chmod 600 "
                                         rf"{re.escape(str(path))}"):
        vf.launch(jobs.regression_job(), workers=1, steps=3, run_dir=str(tmp_path / "run"), token_file=str(path))
    assert not os.path.exists(tmp_path / "run")


# -- item 12: atomic writes -------------------------------------------------------------------
def test_atomic_write_leaves_the_old_file_and_no_temporary_file_on_failure(tmp_path, monkeypatch):
    job = jobs.regression_job()
    path = str(tmp_path / "final.pt")
    save_state(path, synthetic_state(job, 3))
    atomic_write(str(tmp_path / "status.json"), b'{"state": "running"}')

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        save_state(path, synthetic_state(job, 7))
    with pytest.raises(OSError, match="No space left"):
        atomic_write(str(tmp_path / "status.json"), b'{"state": "done"}')
    monkeypatch.undo()

    def broken_writer(f):
        f.write(b"half a record")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        atomic_write(str(tmp_path / "status.json"), broken_writer)
    assert sorted(os.listdir(tmp_path)) == ["final.pt", "status.json"]
    assert load_state(path)["step"] == 3
    assert open(tmp_path / "status.json", "rb").read() == b'{"state": "running"}'
