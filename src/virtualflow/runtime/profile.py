"""Layer profiler for pipelined jobs: the measuring half (the predictions built on a profile are
pure and live in :mod:`virtualflow.plan.pipeline.predict`).

This module *runs the model* (it is runtime code); the partitioner it feeds
(:mod:`virtualflow.plan.pipeline.partition`), the predictions and the schedule simulator stay pure.

:func:`profile_model` measures, for every layer of a pipelined job's model (the children of its
``nn.Sequential``, :func:`virtualflow.plan.pipeline.geometry.layers_of`), on one virtual node's batch of step 0
(``B / V`` samples, loaded through :class:`~virtualflow.plan.data.DataPlan` and
:class:`~virtualflow.runtime.engine.BatchLoader` as the engine loads it):

- ``forward_s``: the layer's forward on that micro-batch;
- ``backward_s``: the layer's *own* backward. Each layer runs on a detached copy of the previous
  layer's output (floating tensors made to require grad, as a pipeline stage receives them; the
  first layer gets ``Job.input_of(batch)`` as it is), and its backward is
  ``torch.autograd.backward`` from its output with a ones-like gradient, so it times this layer
  alone. The last layer includes ``Job.output_loss`` in its forward and backward (the last stage
  computes the loss);
- ``activation_bytes``: the bytes of the layer's output (``numel * element_size`` summed over
  its tensors): what a cut after this layer sends forward, and the size of the gradient that
  comes back;
- ``stash_bytes``: the bytes the layer's autograd graph keeps for its backward, collected with
  ``torch.autograd.graph.saved_tensors_hooks``: the distinct storages of the tensors saved,
  parameters and buffers excluded (they are resident anyway). Because every layer is profiled on
  its own, a tensor two neighbouring layers both save (a ReLU's output the next Linear saves as
  its input) counts once per layer: within a stage this over-estimates, which errs on the safe
  side of a memory limit;
- ``param_bytes``: the bytes of the layer's parameters (weights alone).

Invariants: the job's own random state is untouched (the profile runs inside
``torch.random.fork_rng``, the model is built after ``torch.manual_seed(job.seed)`` as the
workers build it); times are medians of ``repeats`` passes after ``warmup`` passes; sizes do not
depend on timing. Errors raised by the job's own code become :class:`ProfileError` (a
``ValueError``), naming the layer and what it was given.

:func:`auto_split` here is :func:`virtualflow.plan.pipeline.predict.auto_split` that measures a
profile first when none is given. The predictions once defined here (``predict``,
``split_partition``, ``micro_batches``, ``stage_in_flight``, ``min_peak_split``, ``LOOPBACK``,
``ModelProfile``) are still importable from this module, with a ``DeprecationWarning`` for those
this module does not use itself; ``make_schedule`` became THE schedule factory,
:func:`virtualflow.plan.pipeline.schedules.schedule_of`.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from virtualflow.config.job import Job
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.pipeline import predict as _predict
from virtualflow.plan.pipeline.geometry import layers_of, tensors_of
from virtualflow.plan.pipeline.partition import LayerProfile, Link, Partition
from virtualflow.plan.pipeline.predict import DEFAULT_OPTIMIZER_STATE_FACTOR, LOOPBACK, ModelProfile
from virtualflow.runtime.batches import split_loss
from virtualflow.runtime.engine import to_device
from virtualflow.runtime.streaming import data_plan_of, loader_of

log = logging.getLogger(__name__)

class ProfileError(ValueError):
    """The job's own code failed while it was being profiled (a user error)."""


# ---- measuring ------------------------------------------------------------------------------------


def profile_layers(job: Job, repeats: int = 3, device: str | torch.device = "cpu", *,
                   warmup: int = 1) -> list[LayerProfile]:
    """Per-layer costs of ``job``'s model on one virtual node's batch (see the module docstring)."""
    return list(profile_model(job, repeats=repeats, device=device, warmup=warmup).layers)


def profile_model(job: Job, *, repeats: int = 3, device: str | torch.device = "cpu", warmup: int = 1,
                  weight_grad: bool = False, threads: int | None = None) -> ModelProfile:
    """Profile every layer of ``job``'s model: ``warmup`` passes, then the median of ``repeats``.

    ``weight_grad=True`` also times each layer's input gradient alone, giving
    ``ModelProfile.weight_grad_s``. ``threads`` runs the profile with that many torch threads (a
    CPU worker's budget), restoring the setting afterwards.
    """
    for knob, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"profile: {knob}={value!r} must be an integer >= {low}")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"profile: threads={threads!r} must be a positive integer or None")
    dev = torch.device(device)
    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.enable_grad():
            profile = _profile(job, dev, repeats, warmup, weight_grad)
    finally:
        if threads is not None:
            torch.set_num_threads(old_threads)
    elapsed = time.perf_counter() - t_start
    log.debug("profiled %d layers on %s in %.3f s", len(profile[0]), dev, elapsed)
    layers, wgrad, factor, mbs = profile
    return ModelProfile(layers=layers, weight_grad_s=wgrad, optimizer_state_factor=factor, micro_batch_size=mbs,
                        device=str(dev), repeats=repeats, elapsed_s=elapsed)


def _user(part: str, fn: Callable[..., Any], *args: Any, hint: str = "") -> Any:
    try:
        return fn(*args)
    except (ProfileError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the job's code: any exception is the user's to fix
        text = " ".join(str(exc).split())
        text = text if len(text) <= 400 else text[:400] + "..."
        raise ProfileError(f"profiling: {part} raised {type(exc).__name__}: {text}{hint}") from exc


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse / wrapper subclasses: no plain storage
        return None


class _SavedBytes:
    """``saved_tensors_hooks`` pair summing the distinct storages autograd keeps for backward."""

    def __init__(self, resident: set[int]) -> None:
        self.resident = resident
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is None:
            self.total += _nbytes(t)
        elif key[0] not in self.resident and key[0] not in self.seen:
            self.seen.add(key[0])
            self.total += key[1]
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _boundary(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """What a stage receives: detached copies of the previous output's tensors, the floating ones
    requiring grad (copies, so that an in-place first op does not touch a leaf). Returns the value
    to feed (same structure) and the leaves a gradient flows to."""
    tensors = tensors_of(value)
    leaves, fed = [], []
    for t in tensors:
        d = t.detach()
        if d.is_floating_point() or d.is_complex():
            d.requires_grad_(True)
            leaves.append(d)
            fed.append(d.clone())
        else:
            fed.append(d)
    if isinstance(value, torch.Tensor):
        return fed[0], leaves
    if hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*fed), leaves
    return type(value)(fed), leaves


def _prepare(job: Job, dev: torch.device) -> tuple[DataPlan, nn.Module, list[nn.Module], list[str], Any, Any]:
    """What a profile runs on, checked: ``(plan, model, layers, names, batch, first_input)``, the
    model built after ``torch.manual_seed(job.seed)`` as the workers build it, the batch virtual
    node 0's of step 0 on ``dev``."""
    if job.output_loss is None:
        raise ValueError("profiling a pipelined model needs Job.output_loss=(outputs, batch) -> scalar (the last "
                         "layer's loss); the job gives only Job.loss")
    dataset = _user("Job.dataset", job.build_dataset)
    plan = data_plan_of(dataset, job)
    torch.manual_seed(job.seed)
    model = _user("Job.model", job.model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"Job.model must return a torch.nn.Module, got {type(model).__name__}")
    layers = layers_of(model)
    if not layers:
        raise ValueError("the pipelined model is an empty nn.Sequential; give it at least one layer")
    names = [f"{name}:{type(layer).__name__}" for name, layer in model.named_children()]
    model = model.to(dev)
    model.train()
    batch = _user("loading virtual node 0's batch (Job.dataset items, then Job.collate_fn)",
                  loader_of(dataset, job.collate_fn, plan), plan.vn_indices(0, 0))
    batch = to_device(batch, dev)
    first_input = _user("Job.model_input" if job.model_input is not None else "Job.input_of (batch[0])",
                        job.input_of, batch)
    return plan, model, layers, names, batch, first_input


def _profile(job: Job, dev: torch.device, repeats: int, warmup: int, weight_grad: bool):
    plan, model, layers, names, batch, first_input = _prepare(job, dev)
    resident = {k[0] for t in (*model.parameters(), *model.buffers()) if (k := _storage_key(t)) is not None}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(vn_seed(job.seed, 0, 0))  # dropout & co. draw as VN 0 of step 0 would

    n = len(layers)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    inp_grad: list[list[float]] = [[] for _ in range(n)]
    act = [0] * n
    stash = [0] * n
    for rep in range(warmup + repeats):
        keep = rep >= warmup
        x: Any = first_input
        for k, layer in enumerate(layers):
            label = f"layer {k} ({names[k]})"
            if k == 0:
                fed, leaves = x, []
            else:
                fed, leaves = _boundary(x)
            saved = _SavedBytes(resident)
            sync()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                out = _user(label, layer, fed,
                            hint="; each layer takes the previous layer's output (a tensor or a tuple of tensors) "
                                 "as its one argument")
                if k == n - 1:
                    loss = _user("Job.output_loss", job.output_loss, out, batch,
                                 hint=f"; it was given the last layer's output, a {_shape(out)}")
            sync()
            t1 = time.perf_counter()
            outs = tensors_of(out)
            if k == n - 1:
                loss, _ = split_loss(loss, "when the pipeline was profiled")  # (loss, {name: value}) too
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"Job.output_loss must return a scalar tensor, got {_shape(loss)}")
                targets, grads = ([loss], [None]) if loss.requires_grad else ([], [])
            else:
                targets = [t for t in outs if t.requires_grad]
                grads = [torch.ones_like(t) for t in targets]
            t_in = 0.0
            if weight_grad and targets and leaves:
                sync()
                t2 = time.perf_counter()
                _user(f"{label} backward (input gradient)",
                      lambda: torch.autograd.grad(targets, leaves, grads, retain_graph=True, allow_unused=True))
                sync()
                t_in = time.perf_counter() - t2
            sync()
            t2 = time.perf_counter()
            if targets:
                _user(f"{label} backward", torch.autograd.backward, targets, grads)
            sync()
            t3 = time.perf_counter()
            if keep:
                fwd[k].append(t1 - t0)
                bwd[k].append(t3 - t2 if targets else 0.0)
                inp_grad[k].append(t_in)
            act[k] = sum(_nbytes(t) for t in outs)
            stash[k] = saved.total
            x = out
            del fed, leaves, saved, targets, grads
    params = [sum(_nbytes(p) for p in layer.parameters()) for layer in layers]
    profiles = tuple(
        LayerProfile(forward_s=statistics.median(fwd[k]), backward_s=statistics.median(bwd[k]),
                     activation_bytes=float(act[k]), param_bytes=float(params[k]), stash_bytes=float(stash[k]),
                     name=names[k])
        for k in range(n)
    )
    wgrad = None
    if weight_grad:
        wgrad = tuple(max(0.0, p.backward_s - statistics.median(inp_grad[k])) for k, p in enumerate(profiles))
    factor = _optimizer_state_factor(job, model)
    return profiles, wgrad, factor, plan.vn_batch_size


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_shape(v) for v in value[:4])})"
    return type(value).__name__


def _optimizer_state_factor(job: Job, model: nn.Module) -> float:
    """2 (weights, gradients) + optimizer state bytes / trainable parameter bytes, after a step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    pbytes = sum(_nbytes(p) for p in trainable)
    if not pbytes:
        return 1.0
    optimizer = _user("Job.optimizer", job.build_optimizer, model)  # a factory of parameters or of the model
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 - e.g. an optimizer that needs a closure: assume Adam's
        log.debug("optimizer step failed while profiling (%s); assuming factor %s", exc, DEFAULT_OPTIMIZER_STATE_FACTOR)
        return DEFAULT_OPTIMIZER_STATE_FACTOR
    own = {k[0] for p in trainable if (k := _storage_key(p)) is not None}
    seen: set[int] = set()
    state = 0
    for per_param in optimizer.state.values():
        values = per_param.values() if isinstance(per_param, dict) else (per_param,)
        for v in values:
            if isinstance(v, torch.Tensor):
                key = _storage_key(v)
                if key is None:
                    state += _nbytes(v)
                elif key[0] not in own and key[0] not in seen:
                    seen.add(key[0])
                    state += _nbytes(v)
    return 2.0 + state / pbytes


# ---- auto split with a measurement --------------------------------------------------------------


def auto_split(
    job: Job,
    pipeline: Pipeline | None = None,
    *,
    workers: int | None = None,
    link: Link = LOOPBACK,
    profiles: ModelProfile | Sequence[LayerProfile] | None = None,
    repeats: int = 3,
    device: str | torch.device = "cpu",
) -> tuple[tuple[int, ...], Partition]:
    """:func:`virtualflow.plan.pipeline.predict.auto_split`; ``profiles`` defaults to a fresh
    :func:`profile_model` (``repeats`` passes on ``device``)."""
    if profiles is None:
        chosen = _predict.pipeline_for(job, pipeline)
        profiles = profile_model(job, repeats=repeats, device=device, weight_grad=chosen.schedule == "zb_h1")
    return _predict.auto_split(job, pipeline, workers=workers, link=link, profiles=profiles)


def _make_schedule(pipeline: Pipeline, m: int) -> Any:
    """Deprecated: THE factory is :func:`virtualflow.plan.pipeline.schedules.schedule_of`."""
    from virtualflow.plan.pipeline.schedules import schedule_of

    return schedule_of(pipeline, m)


_MOVED = {"predict": _predict.predict, "split_partition": _predict.split_partition,
          "micro_batches": _predict.micro_batches, "stage_in_flight": _predict.stage_in_flight,
          "min_peak_split": _predict.min_peak_split, "make_schedule": _make_schedule}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        where = ("virtualflow.plan.pipeline.schedules.schedule_of" if name == "make_schedule"
                 else f"virtualflow.plan.pipeline.predict.{name}")
        warnings.warn(f"virtualflow.runtime.profile.{name} is deprecated; use {where}", DeprecationWarning,
                      stacklevel=2)
        return _MOVED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOOPBACK", "ModelProfile", "ProfileError", "auto_split", "profile_layers", "profile_model",
]
