"""The MLflow and Weights & Biases loggers (``virtualflow.observe.loggers``), driven through the
worker's callback runner on real trackers: an MLflow file store and a wandb offline run under
tmp_path, read back with MLflow's client and from the offline run's file."""

from __future__ import annotations

import pytest
import torch

from virtualflow.observe.loggers import MLflowLogger, WandbLogger, step_metrics
from virtualflow.runtime.callbacks import Callbacks, StepInfo

import loggers_read

CPU = torch.device("cpu")
LOSSES = [2.0, 1.5, 1.25]


def _drive(callbacks: Callbacks, rank: int, steps=range(3)) -> None:
    """What a worker's loop tells its callbacks: each step, an evaluation after the last, the end."""
    for s in steps:
        callbacks.step_end(StepInfo(step=s, loss=LOSSES[s], metrics={"acc": 0.5 + 0.1 * s}, grad_norm=3.0 - s,
                                    skipped=s == 1, lr=0.1 / (s + 1), workers=2, rank=rank, model=None))
    if rank == 0:
        callbacks.evaluated(3, {"val_loss": 0.75})
    callbacks.finished(3, rank)


def test_step_metrics_names_what_tensorboard_names():
    info = StepInfo(step=4, loss=1.0, metrics={"ppl": 2.5}, grad_norm=None, skipped=False, lr=None, workers=3, rank=0,
                    model=None)
    assert step_metrics(info) == {"train/loss": 1.0, "train/skipped": 0.0, "cluster/workers": 3.0,
                                  "metrics/ppl": 2.5}


def test_mlflow_logger_writes_every_step_on_rank_0_and_one_run_across_a_new_rank_0(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in to a file store
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLflowLogger(tracking_uri=uri, experiment="tiny", run_name="r", params={"lr": 0.1})
    _drive(Callbacks([logger], CPU), rank=1)  # another rank: nothing logged, no run opened
    assert logger.run_id is None
    _drive(Callbacks([logger], CPU), rank=0, steps=range(2))
    # the worker fails; its successor as rank 0 gets the state and goes on in the same run
    successor = MLflowLogger(tracking_uri=uri, experiment="tiny", run_name="r", params={"lr": 0.1})
    runner = Callbacks([successor], CPU)
    runner.load_state_dict(Callbacks([logger], CPU).state_dict())
    _drive(runner, rank=0, steps=[2])
    runs = loggers_read.mlflow_histories(uri)
    assert list(runs) == [logger.run_id] == [successor.run_id]
    run = runs[logger.run_id]
    assert run["experiment"] == "tiny" and run["params"] == {"lr": "0.1"} and run["status"] == "FINISHED"
    m = run["metrics"]
    assert m["train/loss"] == list(enumerate(LOSSES))
    assert m["train/lr"] == [(s, pytest.approx(0.1 / (s + 1))) for s in range(3)]
    assert m["train/grad_norm"] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert m["train/skipped"] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert m["metrics/acc"] == [(s, pytest.approx(0.5 + 0.1 * s)) for s in range(3)]
    assert m["cluster/workers"] == [(s, 2.0) for s in range(3)]
    assert m["eval/val_loss"] == [(3, 0.75), (3, 0.75)]  # both rank 0s evaluated at step 3 in this drive


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="tiny", config={"lr": 0.1})
    _drive(Callbacks([logger], CPU), rank=1)
    assert logger.run_id is None
    _drive(Callbacks([logger], CPU), rank=0)
    runs = loggers_read.wandb_offline_rows(str(tmp_path))
    assert len(runs) == 1 and next(iter(runs)).endswith(logger.run_id)
    rows = next(iter(runs.values()))
    steps = [r for r in rows if "train/loss" in r]
    assert [r["_step"] for r in steps] == [0, 1, 2]
    assert [r["train/loss"] for r in steps] == LOSSES
    assert [r["train/grad_norm"] for r in steps] == [3.0, 2.0, 1.0]
    assert [r["metrics/acc"] for r in steps] == pytest.approx([0.5, 0.6, 0.7])
    assert [r["train/lr"] for r in steps] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert [(r["_step"], r["eval/val_loss"]) for r in rows if "eval/val_loss" in r] == [(3, 0.75)]


def test_a_missing_package_is_named_with_the_install_command(monkeypatch):
    import sys

    for name in ("mlflow", "mlflow.tracking", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without them imports
    info = StepInfo(step=0, loss=1.0, workers=1, rank=0)
    with pytest.raises(ImportError, match=r"MLflowLogger needs the mlflow package .*pip install 'virtualflow\[mlflow\]'"):
        Callbacks([MLflowLogger()], CPU).step_end(info)
    with pytest.raises(ImportError, match=r"WandbLogger needs the wandb package .*pip install 'virtualflow\[wandb\]'"):
        Callbacks([WandbLogger()], CPU).step_end(info)
