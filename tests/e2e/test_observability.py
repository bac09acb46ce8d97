"""Overlapped input keeps the model bit-identical; one short run end to end shows the breakdown in
metrics.jsonl / summary.json / ``virtualflow status`` / ``plot --breakdown``, recognises the
worker that waits for a slow member, and writes a profiler trace and TensorBoard events that
are read back here."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import virtualflow as vf
from conftest import assert_state_close, assert_state_equal
from jobs import bn_dropout_net, classification_data, cross_entropy, sgd
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.comm.groups import Group
from virtualflow.runtime import breakdown
from virtualflow.runtime.engine import BatchLoader, VNEngine


class PerSample(Dataset):
    """classification_data() served one sample at a time (the path prefetching takes)."""

    def __init__(self) -> None:
        self.x, self.y = classification_data().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def per_sample_job() -> vf.Job:
    return vf.Job(name="bn-dropout-per-sample", model=bn_dropout_net, optimizer=sgd, loss=cross_entropy,
                  dataset=PerSample, global_batch_size=24, virtual_nodes=6, seed=3)


def paced_cross_entropy(model, batch):
    time.sleep(0.005)  # emulated compute: 5 ms per VN (times the slowdown on a slow worker)
    return cross_entropy(model, batch)


def paced_job() -> vf.Job:
    return per_sample_job().replace(loss=paced_cross_entropy)


def train_in_process(job: vf.Job, steps: int, *, deterministic: bool, loader_workers: int) -> dict:
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    ds = job.build_dataset()
    plan = DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed)
    eng = VNEngine(model, opt, None, job.compute_loss, plan, BatchLoader(ds, None), seed=job.seed,
                   batchnorm=job.batchnorm, deterministic=deterministic, device=torch.device("cpu"),
                   loader_workers=loader_workers)
    eng.set_membership(Group(0, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
    for s in range(steps):
        eng.step(s)
        if s == 3:  # a new generation (same map) mid-run: what was prefetched is dropped, nothing lost
            eng.set_membership(Group(1, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
    eng.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("deterministic", [True, False])
def test_prefetching_keeps_the_model_bit_identical(deterministic):
    job = per_sample_job()
    plain = train_in_process(job, 7, deterministic=deterministic, loader_workers=0)
    for workers in (1, 3):
        assert_state_equal(train_in_process(job, 7, deterministic=deterministic, loader_workers=workers), plain)


def test_prefetcher_hands_over_only_batches_of_the_indices_asked_for():
    from virtualflow.runtime.prefetch import Prefetcher

    calls = []

    def load(idx):
        calls.append(idx.tolist())
        return idx * 10

    p = Prefetcher(load, 2)
    p.schedule(0, 0, torch.tensor([1, 2]))
    batch, _, _ = p.take(0, 0, torch.tensor([1, 2]))
    assert batch.tolist() == [10, 20]
    p.schedule(1, 0, torch.tensor([3, 4]))
    batch, _, _ = p.take(1, 0, torch.tensor([5, 6]))  # the VN's samples changed: loaded again
    assert batch.tolist() == [50, 60]
    p.schedule(2, 0, torch.tensor([7]))
    p.clear()
    assert p.pending == 0
    p.close()
    with pytest.raises(ValueError, match="loader_workers=0 .*--loader-workers"):
        Prefetcher(load, 0)


def test_end_to_end_breakdown_profile_and_tensorboard(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="tensorboard is a test dependency (pyproject [test])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from virtualflow.cli.main import main as cli

    run_dir = str(tmp_path / "run")
    job = paced_job()
    steps = 8
    # Worker 1 is 3x slower and keeps its VNs (no rebalancing): worker 0 waits for it every step.
    result = vf.train(job, workers=2, steps=steps, deterministic=True, loader_workers=2, slowdowns=[1, 3],
                      balance=False, run_dir=run_dir, profile="2-3", tensorboard=True)
    # Same model as one process without prefetching (deterministic mode: bit for bit) ...
    assert_state_equal(result.state_dict, train_in_process(job, steps, deterministic=True, loader_workers=0))
    # ... and the breakdown in the records.
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    broken = [r for r in records if "breakdown" in r]
    assert [r["breakdown_step"] for r in broken] == list(range(steps - 1))
    rows = breakdown.rows(records)
    fast = [p for _, _, w, p in rows if w == 0]
    slow = [p for _, _, w, p in rows if w == 1]
    assert statistics.median(p["straggler_s"] for p in fast) > 5 * statistics.median(p["straggler_s"] for p in slow)
    assert statistics.median(p["forward_s"] + p["backward_s"] for p in slow) > \
        2 * statistics.median(p["forward_s"] + p["backward_s"] for p in fast)
    for p in fast + slow:
        assert sum(p[k] for k in breakdown.PARTS) == pytest.approx(p["step_s"], rel=1e-4, abs=1e-5)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["breakdown"]["steps"] == steps - 1 and set(summary["breakdown"]["per_worker"]) == {"0", "1"}

    assert cli(["status", run_dir]) == 0
    out = capsys.readouterr().out
    assert "where the step time goes" in out and "straggler" in out
    png = str(tmp_path / "breakdown.png")
    assert cli(["plot", run_dir, "--breakdown", "-o", png]) == 0
    assert os.path.getsize(png) > 10_000

    # torch.profiler traces of steps 2-3 on both workers, in the Chrome trace format.
    for w in (0, 1):
        trace = json.load(open(os.path.join(run_dir, "profile", f"worker-{w}-steps-2-3.json")))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"step 2", "step 3"} <= names and "step 4" not in names
        assert any("backward" in str(n).lower() for n in names)

    # TensorBoard: loss and throughput per step, the breakdown per broken-down step.
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(steps))
    assert [e.value for e in loss] == pytest.approx([h["loss"] for h in result.history])
    assert "train/samples_per_s" in tags and "cluster/workers" in tags
    assert len(acc.Scalars("breakdown/straggler_s")) == steps - 1
    assert "breakdown_worker_1/backward_s" in tags


def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch):
    import builtins

    from virtualflow.observe import tensorboard

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    monkeypatch.setattr(tensorboard.importlib, "import_module", lambda name: no_tensorboard(name))
    with pytest.raises(ValueError, match=r"--tensorboard.*pip install"):
        tensorboard.check_available()


def test_prefetched_training_matches_plain_pytorch():
    """Prefetching in default mode is still the plain-PyTorch computation (within float tolerance)."""
    from reference import reference_train
    from jobs import regression_job

    job = regression_job()
    model, _, _ = reference_train(job, 5)
    torch.manual_seed(job.seed)
    m = job.model()
    opt = job.optimizer(m.parameters())
    sched = job.lr_scheduler(opt)
    ds = job.build_dataset()
    plan = DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed)
    eng = VNEngine(m, opt, sched, job.compute_loss, plan, BatchLoader(ds, None), seed=job.seed,
                   batchnorm=job.batchnorm, deterministic=False, device=torch.device("cpu"), loader_workers=2)
    eng.set_membership(Group(0, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
    for s in range(5):
        eng.step(s)
    eng.close()
    assert_state_close(m.state_dict(), model.state_dict(), rtol=1e-5, atol=1e-6)


_ = nn  # the jobs' modules come from tests/jobs.py
