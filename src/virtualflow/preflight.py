"""Before any worker starts: build the job once in the launching process and run its code on one
virtual node's batch, so that a mistake in the user's code is reported here, in one line that
names which part of the job failed, instead of as a worker's traceback.

Errors raised by the user's code become :class:`JobCodeError` (a ``ValueError``: a user error)
with the part (job function, ``Job.dataset``, ``Job.model``, ``Job.optimizer``, ``Job.loss``),
the exception's type and message, and for the loss, what the batch looked like.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from virtualflow.job import Job, JobImportError, resolve_spec
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.engine import BatchLoader, LossShapeError, check_loss


class JobCodeError(ValueError):
    """The job's own code failed when it was tried before any worker started."""


def _call(part: str, fn: Callable[..., Any], *args: Any, hint: str = "") -> Any:
    try:
        return fn(*args)
    except (JobImportError, JobCodeError, LossShapeError):
        raise
    except Exception as exc:  # the user's code: any exception is theirs to fix
        raise JobCodeError(f"{part} raised {type(exc).__name__}: {_one_line(exc)}{hint}") from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:400] + "..."


def build_job(job: Job | Callable[[], Job] | str, target: str) -> Job:
    """The :class:`Job` itself, or what the job function returns (checked to be a Job)."""
    if isinstance(job, Job):
        return job
    fn = resolve_spec(target) if isinstance(job, str) else job
    name = target or getattr(fn, "__qualname__", repr(fn))
    built = _call(f"the job function {name!r}", fn)
    if not isinstance(built, Job):
        raise TypeError(f"the job function {name!r} returned {type(built).__name__}, not virtualflow.Job")
    return built


def build_dataset(job: Job) -> Any:
    return _call("Job.dataset", job.build_dataset)


def describe(batch: Any, depth: int = 0) -> str:
    """A short structural description of a batch: ``tuple(Tensor[8, 16] float32, list[8] of float)``."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if depth >= 2:
        return type(batch).__name__
    if isinstance(batch, (list, tuple)):
        inner = {describe(b, depth + 1) for b in batch[:8]}
        if isinstance(batch, tuple) or len(inner) > 1:
            return f"{type(batch).__name__}({', '.join(describe(b, depth + 1) for b in batch[:4])})"
        return f"list[{len(batch)}] of {next(iter(inner), '?')}"
    if isinstance(batch, dict):
        return "dict(" + ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in list(batch.items())[:6]) + ")"
    return type(batch).__name__


def preflight(job: Job, dataset: Any, plan: DataPlan, *, reduction: str = "allreduce") -> None:
    """Build the model and optimizer and run the loss on VN 0's batch of step 0, here (and check
    that the optimizer can be sharded, with ``reduction="sharded"``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        model = _call("Job.model", job.model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Job.model must return a torch.nn.Module, got {type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to train")
        optimizer = _call("Job.optimizer", job.optimizer, model.parameters())
        if reduction == "sharded":
            from virtualflow.runtime.sharded import check_optimizer

            check_optimizer(optimizer, params)
        indices = plan.vn_indices(0, 0)
        batch = _call("loading virtual node 0's batch (Job.dataset items, then Job.collate_fn)",
                      BatchLoader(dataset, job.collate_fn), indices)
        model.train()
        hint = (f" on virtual node 0's batch of step 0, a {describe(batch)}; dataset items must be tensors, "
                f"or tuples/dicts of tensors, that the default collate stacks (or give Job.collate_fn)")
        with torch.no_grad():
            loss = _call("Job.loss" if job.loss is not None else "Job.output_loss", job.compute_loss, model, batch, hint=hint)
        check_loss(loss, "on virtual node 0's batch of step 0")
