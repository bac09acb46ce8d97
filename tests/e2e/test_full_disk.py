"""A full disk stops a run cleanly: one line naming the file, the space free there and the space
needed; every state already written is kept; no false final state; nothing hangs.

Lack of space is injected in-process (the writes fail with ``ENOSPC`` as a full filesystem makes
them fail); one integration test fills a real small filesystem (tmpfs, root only)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import pytest
import torch

import virtualflow as vf
from virtualflow import api
from virtualflow.records import rundir
from virtualflow.control import coordinator
from virtualflow.config.job import resolve_spec
from virtualflow.records.result import TrainingError
from virtualflow.records.rundir import DiskFullError, RunLock, atomic_write, format_bytes, free_bytes
from virtualflow.runtime.checkpoint import load_state
from virtualflow.runtime.worker import report_failure
from conftest import assert_state_close
import jobs
from reference import reference_train


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_atomic_write_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "status.json")
    atomic_write(path, b"old")

    def torch_like(f):  # torch.save turns the ENOSPC of its writes into its own RuntimeError
        try:
            f.write(b"partial")
            raise _enospc()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")

    def full_fsync(fd):  # the write-back finds no space
        raise _enospc()

    for data, needed in ((torch_like, None), (b"x" * 5000, 5000)):
        with monkeypatch.context() as m:
            if isinstance(data, bytes):
                m.setattr(rundir.os, "fsync", full_fsync)
            with pytest.raises(DiskFullError) as info:
                atomic_write(path, data)
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == path
        assert err.needed_bytes == needed
        need = f"; it needs about {format_bytes(needed)}" if needed else ""
        assert str(err) == f"No space left on device writing {path} ({format_bytes(free_bytes(path))} free there{need})"
        with open(path, "rb") as f:
            assert f.read() == b"old"  # the last complete version stays
        assert os.listdir(tmp_path) == ["status.json"]  # no temporary file left behind


def test_partial_writes_of_stopped_processes_are_removed_and_nothing_else(tmp_path):
    names = [".step-00000003.pt.tmp-123-0a1b2c3d", ".status.json.tmp-456-0a1b2c3d", "step-00000002.pt",
             ".step-00000004.pt.tmp-123-notmine", "notes.tmp-123-0a1b2c3d"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert rundir.remove_temporaries(str(tmp_path), {123}) == [".step-00000003.pt.tmp-123-0a1b2c3d"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_full_disk_at_launch_reports_enospc_not_the_clean_up(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")

    def full_pwrite(fd, data, offset):
        raise _enospc()

    monkeypatch.setattr(rundir.os, "pwrite", full_pwrite)
    with pytest.raises(DiskFullError) as info:
        api._claim_run_dir(run_dir)  # created here, then its lock cannot be written
    assert info.value.filename == os.path.join(run_dir, rundir.LOCK_FILE)
    assert str(info.value).startswith(f"No space left on device writing {run_dir}/coordinator.lock (")
    assert not os.path.exists(run_dir)  # the directory it created is gone again
    # An existing directory keeps everything but the lock file it could not write.
    os.mkdir(run_dir, 0o700)
    with pytest.raises(DiskFullError):
        RunLock.acquire(run_dir)
    assert os.listdir(run_dir) == []


def test_a_run_directory_that_cannot_take_the_first_records_starts_no_worker(run_dir, monkeypatch):
    from virtualflow.launching import supervisor
    from virtualflow.backends.local import LocalBackend

    started = []
    monkeypatch.setattr(LocalBackend, "start_worker", lambda self, worker_id: started.append(worker_id))

    def full_write_json(path, data):
        raise _enospc()

    monkeypatch.setattr(supervisor, "write_json", full_write_json)
    with pytest.raises(DiskFullError) as info:
        vf.launch(jobs.long_job, workers=2, steps=10, run_dir=run_dir)
    assert str(info.value).startswith(f"No space left on device writing in {run_dir} (")
    assert started == []
    assert not os.path.exists(os.path.join(run_dir, rundir.LOCK_FILE))  # released: the directory can be used again


def test_worker_reports_a_full_disk_in_one_line_with_the_space_needed(tmp_path):
    target = str(tmp_path / "checkpoints" / "step-00000003.pt")
    try:
        try:
            raise DiskFullError(target, 1024)
        except OSError:
            raise RuntimeError("torch's own error while handling it")
    except RuntimeError as exc:
        reports = []
        report_failure(reports.append, 0, exc, None)
    (r,) = reports
    assert r["error"] == f"DiskFullError: No space left on device writing {target} (1.0 KiB free there)"
    assert r["step"] is None and r["phase"] == "setting up"
    assert "torch's own error while handling it" in r["traceback"]  # the log keeps the whole chain


def test_records_that_no_longer_fit_stop_the_run_cleanly(run_dir, monkeypatch):
    """The launcher's own writes fail (metrics.jsonl, events.jsonl): the run ends with one line and
    the checkpoints it wrote; before, the monitor thread died and the run never ended."""
    real_write = coordinator.JsonlWriter.write
    steps = []

    def write(self, record):  # after 6 steps' metrics, no record fits any more
        if len(steps) >= 6:
            raise _enospc()
        if self.path and self.path.endswith("metrics.jsonl"):
            steps.append(record["step"])
        real_write(self, record)

    monkeypatch.setattr(coordinator.JsonlWriter, "write", write)
    handle = vf.launch(jobs.long_job, workers=2, steps=100_000, run_dir=run_dir, checkpoint_every=2)
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as info:
        handle.wait(timeout_s=120)
    err = info.value
    assert err.disk_full and "\n" not in str(err)
    assert str(err).startswith(f"the run's records cannot be written: No space left on device writing in {run_dir} (")
    assert str(err).endswith(f"the states already written are kept: free space there (or move the run directory), "
                             f"then continue with --resume {run_dir}")
    assert handle.done and time.monotonic() - t0 < 60
    assert all(w.proc.poll() is not None for w in handle.backend.workers.values())
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["status"] == "failed"
    assert not os.path.exists(os.path.join(run_dir, "final.pt"))
    # Every state written is whole; a write the stopped workers did not finish left nothing.
    kept = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert kept and all(load_state(os.path.join(run_dir, "checkpoints", k))["step"] == int(k[5:13]) for k in kept)
    assert not [f for f in os.listdir(run_dir) if f.startswith(".")]
    with pytest.raises(TrainingError):  # what SIGTERM and Ctrl-C do: the run has ended, nothing waits
        handle.stop(timeout_s=5)


BIG_JOB = '''
import torch
from torch import nn
import virtualflow as vf

def make_job():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g))
    return vf.Job(model=lambda: nn.Linear(256, 256), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), dataset=data,
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch_size=16, virtual_nodes=4)
'''


def test_checkpoints_filling_a_real_small_filesystem(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], check=True)
    try:
        job_file = tmp_path / "bigjob.py"
        job_file.write_text(BIG_JOB)
        run_dir = str(mount / "run")
        # Each state is about 257 KiB: two fit, the third cannot.
        with pytest.raises(TrainingError) as info:
            vf.train(f"{job_file}:make_job", workers=2, steps=30, checkpoint_every=1, run_dir=run_dir)
        err = info.value
        msg = str(err)
        assert err.disk_full and err.worker_traceback is None and "\n" not in msg
        kept = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        if msg.startswith("the run's records cannot be written"):
            # The third state filled the disk and the launcher's next record (written at the same
            # moment) met the full disk before the worker's report of it arrived: the same error,
            # told by the other writer, with the same advice and nothing lost.
            assert "No space left on device" in msg and f"continue with --resume {run_dir}" in msg, msg
            steps = [int(name[len("step-"):-len(".pt")]) for name in kept]
            assert 1 <= len(kept) <= 2 and kept == [f"step-{s:08d}.pt" for s in range(steps[0], steps[0] + len(kept))]
        else:
            assert f"failed: No space left on device writing {run_dir}/checkpoints/step-0000000{err.step}.pt (" in msg
            assert " free there; it needs about 25" in msg and f"continue with --resume {run_dir} (at step {err.step}" in msg
            assert kept == [f"step-{s:08d}.pt" for s in range(err.step - 2, err.step)]
        job = resolve_spec(f"{job_file}:make_job")()
        for name in kept:  # every state written is whole, and the one an undisturbed run has
            state = load_state(os.path.join(run_dir, "checkpoints", name))
            ref, _, _ = reference_train(job, state["step"])
            assert_state_close(state["model"], ref.state_dict(), rtol=1e-5, atol=1e-6)
        assert not os.path.exists(os.path.join(run_dir, "final.pt"))
        summary = os.path.join(run_dir, "summary.json")
        if os.path.exists(summary):  # written when it fitted: never a false "done"
            with open(summary) as f:
                assert json.load(f)["status"] == "failed"
    finally:
        subprocess.run(["umount", str(mount)], check=False)
