"""Before any worker starts: build the job once in the launching process and run its code on one
virtual node's batch, so that a mistake in the user's code is reported here, in one line that
names which part of the job failed, instead of as a worker's traceback.

Errors raised by the user's code become :class:`JobCodeError` (a ``ValueError``: a user error)
with the part (job function, ``Job.dataset``, ``Job.model``, ``Job.optimizer``, ``Job.loss``),
the exception's type and message, and for the loss, what the batch looked like.
"""

from __future__ import annotations

import inspect
import shutil
from typing import Any, Callable

import torch

from virtualflow.config.job import Job, JobImportError, resolve_spec
from virtualflow.launching.fsdp import FsdpLaunch
from virtualflow.plan.data import DataPlan
from virtualflow.plan.streams import StreamPlan
from virtualflow.records.result import job_frame
from virtualflow.runtime.amp import autocast
from virtualflow.runtime.batches import split_loss
from virtualflow.runtime.engine import LossShapeError, check_loss
from virtualflow.runtime.streaming import loader_of
from virtualflow.runtime.model_prep import apply_activation_checkpointing


class JobCodeError(ValueError):
    """The job's own code failed when it was tried before any worker started."""


def _call(part: str, fn: Callable[..., Any], *args: Any, hint: str | Callable[[Exception], str] = "") -> Any:
    """``fn(*args)``; an exception of the user's code becomes a :class:`JobCodeError` naming
    ``part``, the exception, ``hint`` (or ``hint(exc)``) and the line of the job's code that
    raised it."""
    try:
        return fn(*args)
    except (JobImportError, JobCodeError, LossShapeError):
        raise
    except Exception as exc:  # the user's code: any exception is theirs to fix
        extra = hint(exc) if callable(hint) else hint
        frame = job_frame(exc)
        where = f"; raised at {frame}" if frame else ""
        raise JobCodeError(f"{part} raised {type(exc).__name__}: {_one_line(exc)}{extra}{where}") from exc


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


def stacked(batch: Any, depth: int = 0) -> bool:
    """Whether ``batch`` looks like what the default collate makes of tensor items: a tensor, or
    tuples/lists/dicts of tensors, with no list below the top level (the default collate turns
    an item's Python list into a list of per-position tensors instead of stacking it)."""
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, list) and depth > 0:
        return False
    if isinstance(batch, (list, tuple)):
        return all(stacked(b, depth + 1) for b in batch)
    if isinstance(batch, dict):
        return all(stacked(b, depth + 1) for b in batch.values())
    return False


def loss_hint(exc: Exception, batch: Any, model: torch.nn.Module, job: Job) -> str:
    """What to add to the loss's error: the batch it saw, and the likely cause when the exception
    and the batch tell it (a dict batch indexed by position, the arguments swapped, items that
    are not tensors). Only what the evidence supports: an exception in a loss that got a batch
    of tensors is reported as the user's code raised it."""
    text = f" on virtual node 0's batch of step 0, a {describe(batch)}"
    name = type(model).__name__
    if isinstance(batch, dict) and isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], int):
        keys = ", ".join(repr(k) for k in list(batch)[:6])
        text += f"; the batch is a dict (keys {keys}): index it by key, not by position"
    elif (job.loss is not None and isinstance(exc, (TypeError, AttributeError))
          and (f"'{name}'" in str(exc) or f" {name} object" in str(exc))):
        text += (f"; the error is about the model ({name}) where the loss expected the batch: Job.loss is called "
                 f"as loss(model, batch), model first")
    elif not stacked(batch):
        text += ("; dataset items must be tensors, or tuples/dicts of tensors, that the default collate stacks "
                 "(or give Job.collate_fn)")
    return text


def preflight(job: Job, dataset: Any, plan: DataPlan | StreamPlan, *, reduction: str = "allreduce",
              fsdp: FsdpLaunch | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """Build the model and optimizer and run the loss on VN 0's batch of step 0, here (and check
    that the optimizer can be sharded, with ``reduction="sharded"``; with ``fsdp``, the checks of
    ``reduction="fsdp"``: its units, their sizes, the optimizer, host memory). Returns the model's
    ``state_dict`` signature: every entry's name, shape and dtype, in order (the run's identity,
    :mod:`virtualflow.launching.identity`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        model = _call("Job.model", job.model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Job.model must return a torch.nn.Module, got {type(model).__name__}")
        signature = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                     for name, t in model.state_dict().items()]
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to train")
        optimizer = _call("Job.optimizer", job.build_optimizer, model)
        if reduction == "sharded":
            from virtualflow.runtime.sharded import check_optimizer

            check_optimizer(optimizer, params)
        if fsdp is not None:
            fsdp.check(model, optimizer, params)
        check_loop(job, params, optimizer)
        if job.pipeline is None:
            apply_activation_checkpointing(model, job.activation_checkpointing)  # names a module that is not there
        indices = plan.vn_indices(0, 0)
        batch = _call("loading virtual node 0's batch (Job.dataset items, then Job.collate_fn)",
                      loader_of(dataset, job.collate_fn, plan), indices)
        model.train()
        with torch.no_grad(), autocast(torch.device("cpu"), job.precision):
            out = _call("Job.loss" if job.loss is not None else "Job.output_loss", job.compute_loss, model, batch,
                        hint=lambda exc: loss_hint(exc, batch, model, job))
        loss, _ = split_loss(out, "on virtual node 0's batch of step 0")
        check_loss(loss, "on virtual node 0's batch of step 0")
        if job.compile is not False and job.pipeline is None:
            check_traceable(job, model, batch)
    return signature


def check_loop(job: Job, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Refuse training-loop knobs that cannot work with this model and optimizer."""
    if job.precision == "16-mixed":
        low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
        if low:
            raise ValueError(
                f"precision='16-mixed' keeps the weights in float32 and runs the forward in float16 under autocast, "
                f"but the model's trainable parameters are {', '.join(low)} (their gradients cannot be unscaled "
                f"exactly): build the model in float32 (drop .half()), or train it as it is with precision='32' "
                f"(Job.precision / --precision)")
        step = inspect.signature(type(optimizer).step).parameters.get("closure")
        if step is not None and step.default is inspect.Parameter.empty:
            raise ValueError(
                f"precision='16-mixed' skips a step whose gradient overflowed, which needs an optimizer whose step() "
                f"takes no closure; {type(optimizer).__name__}.step requires one. Use precision='bf16-mixed' (no "
                f"loss scaling) or another optimizer (Job.optimizer)")


def check_traceable(job: Job, model: torch.nn.Module, batch: Any) -> None:
    """``compile``: a C++ compiler for inductor on the CPU, the backend known, and the model's
    forward traceable by dynamo (a cheap trace with the ``eager`` backend, here, before any
    worker starts)."""
    kwargs = dict(job.compile) if isinstance(job.compile, dict) else {}
    backend = kwargs.get("backend", "inductor")
    if isinstance(backend, str):
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"compile={{'backend': {backend!r}}}: torch.compile knows no such backend; it has "
                             f"{', '.join(sorted(known))} (Job.compile)")
        if backend == "inductor" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise ValueError("compile=True uses torch.compile's inductor backend, which builds C++ kernels on the CPU, "
                             "and no C++ compiler (g++, c++, clang++) is on PATH: install one (e.g. apt install g++), "
                             "or give compile={'backend': 'aot_eager'} (Job.compile / --compile)")
    trial = {k: v for k, v in kwargs.items() if k in ("fullgraph", "dynamic")}
    compiled = torch.compile(model, backend="eager", **trial)
    try:
        with torch.no_grad(), autocast(torch.device("cpu"), job.precision):
            job.compute_loss(compiled, batch)
    except Exception as exc:  # noqa: BLE001 - dynamo's errors are many classes
        raise ValueError(f"compile: torch.compile cannot trace the model's forward ({type(exc).__name__}: "
                         f"{_one_line(exc)}); make the forward traceable, drop fullgraph=True, or train without "
                         f"compile (Job.compile / --compile)") from exc
    finally:
        import torch._dynamo

        torch._dynamo.reset()
