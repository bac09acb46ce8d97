"""Experiment trackers as ``Job.callbacks``: :class:`MLflowLogger` and :class:`WandbLogger`.

Both run on rank 0 only (``ranks = "zero"``), inside the worker, and log per step (x axis: the
step, 0-based as in ``metrics.jsonl``): ``train/loss``, ``train/lr`` and ``train/grad_norm``
(when the step has them), ``train/skipped`` (1 for a step loss scaling skipped),
``cluster/workers``, ``metrics/<name>`` for each of the loss function's metrics -- the names
``--tensorboard`` uses -- and ``eval/<name>`` after each evaluation, at the number of steps done
(the ``step`` of events.jsonl's ``eval`` records).

Invariants:

- **Nothing happens until the first step.** The tracker's run is opened by the first hook that
  logs, in the worker, so building the job (in the launching process, in ``virtualflow plan``)
  opens nothing, and the package (``mlflow``, ``wandb``) is imported then: without it the first
  step fails with an error naming the install command.
- **One run per job, across resizes, failures and resumes.** ``state_dict()`` holds the
  tracker's run id, so it travels with checkpoints and state transfers: a new rank 0 after a
  failure, and ``virtualflow run --resume``, log into the same run. Steps a resumed job redoes
  are logged again (MLflow keeps both values of a step; wandb ignores a step below its last).
- **The run is closed** by ``on_train_end`` (MLflow: status ``FINISHED``; wandb:
  ``finish()``, then ``wandb.teardown()``, which waits until wandb's service has written the
  run's last records); a worker that fails leaves it open, and the run it continues in is the
  same.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

__all__ = ["MLflowLogger", "WandbLogger", "step_metrics"]


def step_metrics(info: Any) -> dict[str, float]:
    """The numbers a tracker logs for one step (:class:`virtualflow.StepInfo`), by name."""
    out = {"train/loss": float(info.loss), "train/skipped": float(bool(info.skipped)),
           "cluster/workers": float(info.workers)}
    if info.lr is not None:
        out["train/lr"] = float(info.lr)
    if info.grad_norm is not None:
        out["train/grad_norm"] = float(info.grad_norm)
    for name, value in (info.metrics or {}).items():
        out[f"metrics/{name}"] = float(value)
    return out


def _import(package: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"{extra} needs the {package.split('.')[0]} package ({exc}): pip install "
                          f"'virtualflow[{extra.split('Logger')[0].lower()}]', or remove it from Job.callbacks") from None


class MLflowLogger:
    """Log a job's steps and evaluations to MLflow (``pip install 'virtualflow[mlflow]'``).

    ``tracking_uri``: where the runs go (``"sqlite:///mlflow.db"``, ``"file:./mlruns"``, an
    ``http://`` server; ``None``: MLflow's own default, ``MLFLOW_TRACKING_URI`` or ``./mlruns``);
    ``experiment``: the experiment's name (made when missing; ``None``: MLflow's default one);
    ``run_name``, ``params`` (logged once, as MLflow params) and ``tags`` describe the run.
    After the first step, :attr:`run_id` names the run.
    """

    ranks = "zero"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None, run_name: str | None = None,
                 params: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.params = dict(params or {})
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None

    def _open(self) -> Any:
        if self._client is None:
            tracking = _import("mlflow.tracking", "MLflowLogger")
            self._client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is None:
            client = self._client
            experiment_id = "0"
            if self.experiment is not None:
                found = client.get_experiment_by_name(self.experiment)
                experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
            run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id
            for key, value in self.params.items():
                client.log_param(self.run_id, key, value)
        return self._client

    def _log(self, values: Mapping[str, float], step: int) -> None:
        client = self._open()  # first: it names the missing package
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items() if math.isfinite(value)]
        client.log_batch(self.run_id, metrics=metrics)

    def on_step_end(self, info: Any) -> None:
        self._log(step_metrics(info), info.step)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._log({f"eval/{k}": float(v) for k, v in metrics.items()}, step)

    def on_train_end(self, step: int) -> None:
        if self.run_id is not None:
            self._open().set_terminated(self.run_id, "FINISHED")

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("run_id") if isinstance(state, Mapping) else None
        self.run_id = run_id if isinstance(run_id, str) and run_id else self.run_id


class WandbLogger:
    """Log a job's steps and evaluations to Weights & Biases (``pip install 'virtualflow[wandb]'``).

    ``project``, ``name``, ``config`` (the run's hyperparameters), ``mode`` (``"online"``,
    ``"offline"``: files under ``dir`` to ``wandb sync`` later, ``"disabled"``; ``None``: wandb's
    own default and ``WANDB_MODE``) and ``dir`` go to ``wandb.init``, with any other keyword in
    ``init``. After the first step, :attr:`run_id` names the run.
    """

    ranks = "zero"

    def __init__(self, project: str | None = None, name: str | None = None, config: Mapping[str, Any] | None = None,
                 mode: str | None = None, dir: str | None = None, **init: Any) -> None:  # noqa: A002 - wandb's name
        self.init = {"project": project, "name": name, "config": dict(config or {}), "mode": mode, "dir": dir, **init}
        self.run_id: str | None = None
        self._run: Any = None

    def _open(self) -> Any:
        if self._run is None:
            wandb = _import("wandb", "WandbLogger")
            kwargs = {k: v for k, v in self.init.items() if v is not None}
            if self.run_id is not None:  # a resumed job, or a new rank 0: the same run
                kwargs.update(id=self.run_id, resume="allow")
            self._run = wandb.init(**kwargs)
            self.run_id = self._run.id
        return self._run

    def on_step_end(self, info: Any) -> None:
        self._open().log(step_metrics(info), step=info.step)

    def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._open().log({f"eval/{k}": float(v) for k, v in metrics.items()}, step=step)

    def on_train_end(self, step: int) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            # finish() returns before wandb's service has written the run's last records (an
            # offline run's file was seen short right after it); teardown waits for the service
            # to end, and the worker exits right after this anyway.
            import wandb

            wandb.teardown()

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("run_id") if isinstance(state, Mapping) else None
        self.run_id = run_id if isinstance(run_id, str) and run_id else self.run_id
