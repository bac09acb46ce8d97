"""The training loop's reporting and callbacks, end to end on the local backend (a few short runs):
metrics from the loss reach metrics.jsonl reduced over the global batch as a plain computation
says; what a callback is told equals the step records; tokens/s and MFU agree with the step
times in metrics.jsonl, status.json and summary.json; a callback's early stop ends every worker
after the step it named; an EMA kept by a ``ranks="all"`` callback survives a resize and
equals an EMA computed beside a plain PyTorch loop; an error in a callback fails the run with
the callback's frame in the traceback."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from torch import nn

import virtualflow as vf
from conftest import wait_for_step
from reference import step_batch
from virtualflow.plan.flops import run_throughput
import jobs

pytestmark = pytest.mark.slow

FOREVER = 1_000_000


def mse_with_metrics(model, batch):
    """The mean squared error, with two metrics whose global-batch means a plain computation
    knows: the mean target and the fraction of positive first features."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y), {"y_mean": y.mean(), "x0_pos": (x[:, 0] > 0).float().mean()}


class Record:
    """Keeps what on_step_end was told (its state: rank 0's copy lands in final.pt)."""

    ranks = "all"

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_step_end(self, info):
        self.seen.append({"step": info.step, "loss": info.loss, "metrics": dict(info.metrics), "lr": info.lr,
                          "grad_norm": info.grad_norm, "skipped": info.skipped, "workers": info.workers,
                          "rank": info.rank, "has_model": isinstance(info.model, nn.Module)})

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, info):
        return True if info.step == self.step else None


class Broken:
    def on_step_end(self, info):
        if info.step == 2:
            raise RuntimeError("my callback broke")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_step_info_tokens_and_mfu(run_dir):
    job = jobs.regression_job("sgd", max_grad_norm=10.0, callbacks=[Record()], tokens_per_sample=10,
                              flops_per_sample=2e6).replace(loss=mse_with_metrics)
    result = vf.train(job, workers=2, steps=6, deterministic=True, run_dir=run_dir, peak_tflops=1e-3)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    x, y = job.build_dataset().tensors
    for r in records:  # each metric is the mean over the step's global batch
        idx = step_batch(job, len(x), r["step"])
        assert r["metrics"]["y_mean"] == pytest.approx(y[idx].mean().item(), rel=1e-5, abs=1e-6)
        assert r["metrics"]["x0_pos"] == pytest.approx((x[idx, 0] > 0).float().mean().item(), rel=1e-6)
        assert r["grad_norm"] > 0 and r["skipped"] is False and r["loss_scale"] is None
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["step_time_s"])
        assert r["tokens_per_s"] == pytest.approx(10 * r["samples"] / r["step_time_s"])
        assert r["mfu"] == pytest.approx(2e6 * r["samples"] / r["step_time_s"] / (1e-3 * 1e12 * r["workers"]))
    assert [r["lr"] for r in records] == pytest.approx([0.05] * 5 + [0.05 * 0.7])  # StepLR(5, 0.7)
    assert records == [{"time": r["time"], **h} for r, h in zip(records, result.history)]
    # what the callback was told, on rank 0 (its state in final.pt), is what the records say
    seen = result.callbacks_state[0]["state"]["seen"]
    assert [s["step"] for s in seen] == list(range(6)) and all(s["rank"] == 0 and s["workers"] == 2 for s in seen)
    for s, h in zip(seen, result.history):
        assert (s["loss"], s["metrics"], s["lr"], s["grad_norm"], s["skipped"]) == (
            h["loss"], h["metrics"], h["lr"], h["grad_norm"], h["skipped"])
        assert s["has_model"]
    # the run's throughput: over its steady steps, in the Result, summary.json and status.json
    expected = run_throughput([(h["samples"], h["step_time_s"], h["workers"]) for h in result.history[1:]],
                              tokens_per_sample=10, flops_per_sample=2e6, peak_tflops_per_worker=1e-3)
    assert result.throughput == {**expected, "peak_tflops": 1e-3}
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["tokens_per_s"] == pytest.approx(expected["tokens_per_s"])
    assert summary["mfu"] == pytest.approx(expected["mfu"]) and summary["peak_tflops_per_worker"] == 1e-3
    assert summary["final_train_metrics"] == result.history[-1]["metrics"]
    status = json.load(open(os.path.join(run_dir, "status.json")))
    assert status["train_metrics"] == result.history[-1]["metrics"]
    assert status["tokens_per_s"] == pytest.approx(result.history[-1]["tokens_per_s"])
    assert status["grad_norm"] == result.history[-1]["grad_norm"] and status["lr"] == result.history[-1]["lr"]


def test_a_callback_stops_every_worker_after_the_step_it_names(run_dir):
    job = jobs.regression_job("sgd", callbacks=[StopAt(3)])
    result = vf.train(job, workers=2, steps=10, run_dir=run_dir)
    assert result.steps == 4 and result.stopped
    assert result.stop_reason == "StopAt.on_step_end asked to stop after step 3"
    assert [h["step"] for h in result.history] == [0, 1, 2, 3]
    assert torch.load(os.path.join(run_dir, "final.pt"), weights_only=True)["step"] == 4
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["status"] == "stopped" and summary["stop_reason"] == result.stop_reason
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "early_stop"] == [3]
    assert events[-1]["event"] == "done" and events[-1]["stopped"] and events[-1]["stop_reason"] == result.stop_reason


def test_callback_state_resumes_from_the_final_state(run_dir):
    job = jobs.regression_job("sgd", callbacks=[Record()])
    first = vf.train(job, workers=2, steps=3, run_dir=run_dir)
    assert [s["step"] for s in first.callbacks_state[0]["state"]["seen"]] == [0, 1, 2]
    resumed = vf.train(job, workers=1, steps=5, resume=run_dir, run_dir=run_dir)
    seen = resumed.callbacks_state[0]["state"]["seen"]
    assert [(s["step"], s["workers"]) for s in seen] == [(0, 2), (1, 2), (2, 2), (3, 1), (4, 1)]


class EMA:
    """An exponential moving average of the weights on every worker; each worker also writes its
    newest copy to ``folder`` (one file per process) so the test can read every replica."""

    ranks = "all"
    DECAY = 0.9

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.ema: dict[str, torch.Tensor] | None = None
        self.resizes: list[list[int]] = []

    def on_step_end(self, info):
        params = {k: v.detach().clone() for k, v in info.model.state_dict().items()}
        if self.ema is None:
            self.ema = params
        else:
            for k, v in params.items():
                self.ema[k].mul_(self.DECAY).add_(v, alpha=1 - self.DECAY)
        torch.save({"step": info.step, "rank": info.rank, "ema": self.ema},
                   os.path.join(self.folder, f"ema-{os.getpid()}.pt"))

    def on_resize(self, step, old, new):
        self.resizes.append([step, old, new])

    def state_dict(self):
        return {"ema": self.ema, "resizes": self.resizes}

    def load_state_dict(self, state):
        self.ema = {k: v.clone() for k, v in state["ema"].items()} if state["ema"] is not None else None
        self.resizes = [list(r) for r in state["resizes"]]


def plain_ema(job: vf.Job, steps: int) -> list[dict[str, torch.Tensor]]:
    """The EMA after each step of the plain PyTorch loop (the full global batch each step)."""
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt)
    x, y = job.build_dataset().tensors
    ema, out = None, []
    for s in range(steps):
        idx = step_batch(job, len(x), s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if ema is None:
            ema = params
        else:
            for k, v in params.items():
                ema[k].mul_(EMA.DECAY).add_(v, alpha=1 - EMA.DECAY)
        out.append({k: v.clone() for k, v in ema.items()})
    return out


def test_an_ema_callback_on_every_rank_survives_a_resize(run_dir, tmp_path):
    folder = str(tmp_path / "ema")
    os.makedirs(folder)
    job = jobs.paced_regression_job().replace(callbacks=[EMA(folder)])
    handle = vf.launch(job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 3)
    handle.resize(3, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    grown_at = next(h["step"] for h in result.history if h["workers"] == 3)
    reference = plain_ema(job, result.steps)
    final = result.callbacks_state[0]["state"]
    assert final["resizes"] == [[grown_at, 2, 3]]
    torch.testing.assert_close(final["ema"], reference[-1], rtol=1e-5, atol=1e-6)
    copies = [torch.load(p, weights_only=True) for p in glob.glob(os.path.join(folder, "ema-*.pt"))]
    last = [c for c in copies if c["step"] == result.steps - 1]
    assert sorted(c["rank"] for c in last) == [0, 1, 2]  # the newcomer's replica too
    for c in last:
        torch.testing.assert_close(c["ema"], reference[-1], rtol=1e-5, atol=1e-6)


def test_an_error_in_a_callback_fails_the_run_at_the_callbacks_frame():
    with pytest.raises(vf.TrainingError, match=r"RuntimeError: my callback broke .*at step 2") as e:
        vf.train(jobs.regression_job("sgd", callbacks=[Broken()]), workers=2, steps=6)
    tb = e.value.worker_traceback
    assert "in on_step_end" in tb and 'raise RuntimeError("my callback broke")' in tb
    assert "raised by Job.callbacks[0] (Broken).on_step_end at step 2" in tb
    assert "virtualflow/runtime" not in tb  # from the job's own code on


def test_mlflow_and_wandb_loggers_log_a_real_run_once_and_resume_into_the_same_run(tmp_path, monkeypatch, run_dir):
    """The loggers as a user adds them: two workers train, rank 0 alone logs every step to one
    MLflow run and one wandb offline run (the values of metrics.jsonl); a resumed job continues
    in the same MLflow run (its id travels in final.pt)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import loggers_read
    from virtualflow.observe.loggers import MLflowLogger, WandbLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # inherited by the workers
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    job = jobs.regression_job("sgd", callbacks=[MLflowLogger(tracking_uri=uri, experiment="e2e"),
                                                WandbLogger(project="e2e")])
    first = vf.train(job, workers=2, steps=3, run_dir=run_dir)
    runs = loggers_read.mlflow_histories(uri)
    assert len(runs) == 1  # rank 0 only
    (run_id, run), = runs.items()
    assert run["status"] == "FINISHED"
    assert run["metrics"]["train/loss"] == [(h["step"], pytest.approx(h["loss"])) for h in first.history]
    assert run["metrics"]["cluster/workers"] == [(h["step"], 2.0) for h in first.history]
    (rows,) = loggers_read.wandb_offline_rows(str(tmp_path)).values()
    assert [(r["_step"], r["train/loss"]) for r in rows if "train/loss" in r] == \
        [(h["step"], pytest.approx(h["loss"])) for h in first.history]
    assert first.callbacks_state[0]["state"] == {"run_id": run_id}
    resumed = vf.train(job, workers=1, steps=5, resume=run_dir, run_dir=run_dir)
    runs = loggers_read.mlflow_histories(uri)
    assert list(runs) == [run_id]
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert runs[run_id]["metrics"]["train/loss"] == [(h["step"], pytest.approx(h["loss"]))
                                                     for h in first.history + resumed.history]
