"""Layer profiler for pipelined jobs, and the predictions built on it.

This module *runs the model* (it is runtime code); the partitioner it feeds
(:mod:`virtualflow.plan.pipeline.partition`) and the schedule simulator stay pure.

:func:`profile_model` measures, for every layer of a pipelined job's model (the children of its
``nn.Sequential``, :func:`virtualflow.pipeline.layers_of`), on one virtual node's batch of step 0
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

On top of a profile: :func:`auto_split` (``Pipeline.split="auto"``: the partitioner under
``Pipeline.memory_limit_gib`` and the schedule's stash bound) and :func:`predict` (a split's
per-stage time, simulated step time and bubble, and memory per worker).

What the predictions leave out: the all-reduce of gradients between the ``d`` pipeline replicas,
the optimizer step, and data loading; the link is one :class:`Link` for every boundary.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

from virtualflow.job import Job
from virtualflow.pipeline import Pipeline, check_workers, layers_of, resolve_bounds, tensors_of
from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.pipeline.partition import (
    InfeasiblePartition, LayerProfile, Link, Partition, evaluate_split, partition,
)
from virtualflow.plan.pipeline.schedules import SCHEDULES, Schedule
from virtualflow.plan.pipeline.simulate import simulate
from virtualflow.runtime.engine import BatchLoader, to_device

log = logging.getLogger(__name__)

LOOPBACK = Link(bandwidth_bytes_per_s=2.0e9, latency_s=1.0e-4)
"""Default link between pipeline workers on one machine: about 2 GB/s and 0.1 ms per message
(gloo over loopback TCP; ``bench/results/README.md`` measured 2.3 GB/s for large messages)."""

DEFAULT_OPTIMIZER_STATE_FACTOR = 4.0
"""Resident bytes per parameter byte when the optimizer's state cannot be measured (fp32 Adam:
weights, gradients and two moments)."""

SplitArg = Union[str, Sequence[int], Sequence[Sequence[int]]]


class ProfileError(ValueError):
    """The job's own code failed while it was being profiled (a user error)."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One profile of a job's model: per-layer costs plus what the predictions need besides."""

    layers: tuple[LayerProfile, ...]
    """One entry per layer, in order (``name`` is ``"<child name>:<type>"``)."""
    weight_grad_s: tuple[float, ...] | None
    """Per layer: the weight-gradient part of ``backward_s`` (``backward_s`` minus the time of the
    input gradient alone), measured only with ``profile_model(weight_grad=True)``; ``None``
    otherwise. The zero-bubble schedule needs it."""
    optimizer_state_factor: float
    """Resident bytes per parameter byte: 2 (weights and gradients) plus the optimizer's state,
    measured after one optimizer step (``DEFAULT_OPTIMIZER_STATE_FACTOR`` when that fails)."""
    micro_batch_size: int
    """Samples in the profiled batch: ``B / V``."""
    device: str
    repeats: int
    elapsed_s: float
    """Wall time of the whole profile (model build, data, warm-up, passes, optimizer step)."""


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


def _profile(job: Job, dev: torch.device, repeats: int, warmup: int, weight_grad: bool):
    if job.output_loss is None:
        raise ValueError("profiling a pipelined model needs Job.output_loss=(outputs, batch) -> scalar (the last "
                         "layer's loss); the job gives only Job.loss")
    dataset = _user("Job.dataset", job.build_dataset)
    plan = DataPlan(len(dataset), job.global_batch_size, job.virtual_nodes, job.seed)
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
                  BatchLoader(dataset, job.collate_fn), plan.vn_indices(0, 0))
    batch = to_device(batch, dev)
    first_input = _user("Job.model_input" if job.model_input is not None else "Job.input_of (batch[0])",
                        job.input_of, batch)
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
    optimizer = _user("Job.optimizer", job.optimizer, model.parameters())
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


# ---- schedules, grid ------------------------------------------------------------------------------


def _pipeline_of(job: Job, pipeline: Pipeline | None) -> Pipeline:
    pipeline = pipeline if pipeline is not None else job.pipeline
    if pipeline is None:
        raise ValueError("the job has no pipeline: give Job(pipeline=Pipeline(stages=...)) or pass pipeline=...")
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a virtualflow.pipeline.Pipeline, got {type(pipeline).__name__}")
    return pipeline


def micro_batches(job: Job, pipeline: Pipeline, workers: int | None = None) -> tuple[int, int]:
    """``(replicas d, m)``: pipeline replicas for ``workers`` (default ``stages``: one replica) and
    the most VNs any replica runs per step (its micro-batches; the slowest replica sets the pace)."""
    workers = pipeline.stages if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer (stages x pipeline replicas)")
    d = check_workers(pipeline, workers)
    v = job.virtual_nodes
    if v < d:
        raise ValueError(
            f"virtual_nodes={v} is fewer than the {d} pipeline replicas of workers={workers} / "
            f"stages={pipeline.stages}; every replica needs at least one virtual node (micro-batch): use at most "
            f"workers={v * pipeline.stages} or raise virtual_nodes"
        )
    return d, -(-v // d)


def make_schedule(pipeline: Pipeline, m: int) -> Schedule:
    """The schedule ``pipeline`` runs with ``m`` micro-batches (no-flush schedules: ``window``
    steps streamed back to back)."""
    gen = SCHEDULES[pipeline.schedule]
    p = pipeline.stages
    if pipeline.schedule == "interleaved_1f1b":
        return gen(p, m, pipeline.chunks)
    if not pipeline.flush:
        return gen(p, m, steps=pipeline.window)
    return gen(p, m)


def stage_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per schedule stage (model piece): the most micro-batches whose activations it holds at
    once (forward done, last backward part not yet done)."""
    split = schedule.split_backward()
    last = "W" if split else "B"
    held = [0] * schedule.stages
    peak = [0] * schedule.stages
    for acts in schedule.actions:
        for a in acts:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == last:
                held[a.stage] -= 1
    return tuple(peak)


def _factor(profile_factor: float, schedule: Schedule) -> float:
    """Resident bytes per parameter byte under ``schedule``: no-flush schedules keep extra weight
    versions (2BW: 2; asynchronous PipeDream: up to ``p - s``); the most any stage keeps is used."""
    return profile_factor + (max(schedule.weight_versions) - 1)


def _as_profile(profiles: ModelProfile | Sequence[LayerProfile]) -> ModelProfile:
    if isinstance(profiles, ModelProfile):
        return profiles
    layers = tuple(profiles)
    for k, layer in enumerate(layers):
        if not isinstance(layer, LayerProfile):
            raise TypeError(f"profiles[{k}] is a {type(layer).__name__}, not a LayerProfile")
    return ModelProfile(layers=layers, weight_grad_s=None, optimizer_state_factor=DEFAULT_OPTIMIZER_STATE_FACTOR,
                        micro_batch_size=0, device="", repeats=0, elapsed_s=0.0)


def _limit_bytes(pipeline: Pipeline) -> float | None:
    return None if pipeline.memory_limit_gib is None else pipeline.memory_limit_gib * 2**30


# ---- auto split -----------------------------------------------------------------------------------


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
    """``Pipeline.split="auto"``: the layer counts per model piece that minimise the slowest
    piece's time, with each worker's memory within ``pipeline.memory_limit_gib``.

    ``pipeline`` defaults to ``job.pipeline``; ``workers`` (default ``stages``) fixes the replicas
    and so ``m``, the micro-batches per replica, which with the schedule gives each piece's
    stashed micro-batches (``in_flight``). ``profiles`` defaults to a fresh
    :func:`profile_model`. With ``chunks = v > 1`` each of a worker's ``v`` pieces must fit in
    ``1/v`` of the limit (a sufficient condition for the worker's sum).

    Raises :class:`~virtualflow.plan.pipeline.partition.InfeasiblePartition` (a ``ValueError``)
    when no split fits the limit, naming the smallest limit that would and what else to change.
    """
    pipeline = _pipeline_of(job, pipeline)
    profile = _as_profile(profiles) if profiles is not None else profile_model(
        job, repeats=repeats, device=device, weight_grad=pipeline.schedule == "zb_h1")
    layers = profile.layers
    pieces, v = pipeline.pieces, pipeline.chunks
    resolve_bounds(Pipeline(stages=pipeline.stages, schedule=pipeline.schedule, chunks=v), len(layers))
    _, m = micro_batches(job, pipeline, workers)
    schedule = make_schedule(pipeline, m)
    in_flight = stage_in_flight(schedule)
    factor = _factor(profile.optimizer_state_factor, schedule)
    limit = _limit_bytes(pipeline)
    piece_limit = None if limit is None else limit / v
    try:
        best = partition(layers, pieces, link=link, memory_limit_bytes=piece_limit, in_flight=in_flight,
                         optimizer_state_factor=factor)
    except InfeasiblePartition:
        raise _infeasible(pipeline, layers, in_flight, factor, m) from None
    return best.stage_sizes, best


def _infeasible(pipeline: Pipeline, layers: Sequence[LayerProfile], in_flight: Sequence[int], factor: float,
                m: int) -> InfeasiblePartition:
    """The error for a limit no split meets: the smallest per-worker peak any split reaches."""
    peak, bounds = min_peak_split(layers, in_flight, factor)
    v = pipeline.chunks
    s = max(range(len(bounds)), key=lambda k: _piece_memory(layers, bounds[k], in_flight[k], factor))
    a, b = bounds[s]
    weights = factor * sum(layers[i].param_bytes for i in range(a, b))
    stashed = in_flight[s] * sum(layers[i].stash_bytes for i in range(a, b))
    need_gib = peak * v / 2**30
    share = f" ({1 / v:.3g} of it per model chunk, chunks={v})" if v > 1 else ""
    return InfeasiblePartition(
        f"Pipeline.memory_limit_gib={pipeline.memory_limit_gib} per worker{share} is below what any split of "
        f"{len(layers)} layers into {pipeline.pieces} pieces needs under schedule={pipeline.schedule!r} with m={m} "
        f"micro-batches per replica: the smallest peak is {peak / 2**20:.2f} MiB, on piece {s} (layers {a}-{b - 1}: "
        f"weights, gradients and optimizer state {weights / 2**20:.2f} MiB + {in_flight[s]} stashed micro-batches "
        f"{stashed / 2**20:.2f} MiB). Raise memory_limit_gib to at least {_ceil3(need_gib):g}, use "
        f"more stages (Pipeline.stages), or stash less: more virtual_nodes (smaller micro-batches), or a schedule "
        f"with fewer micro-batches in flight (1f1b rather than gpipe)"
    )


def _ceil3(x: float) -> float:
    """``x`` rounded up to 3 significant digits (a limit that is surely enough)."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 2)
    return math.ceil(x / scale * (1 - 1e-12)) * scale


def _piece_memory(layers: Sequence[LayerProfile], bound: tuple[int, int], in_flight: int, factor: float) -> float:
    a, b = bound
    return sum(factor * layers[i].param_bytes + in_flight * layers[i].stash_bytes for i in range(a, b))


def min_peak_split(layers: Sequence[LayerProfile], in_flight: Sequence[int],
                   factor: float) -> tuple[float, tuple[tuple[int, int], ...]]:
    """The split into ``len(in_flight)`` contiguous non-empty pieces with the smallest peak piece
    memory (``factor * params + in_flight * stash``), and that peak. ``O(L^2 p)``."""
    n, p = len(layers), len(in_flight)
    best = [[math.inf] * (n + 1) for _ in range(p + 1)]  # best[k][i]: layers [i, n) as the last k pieces
    choice = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][n] = 0.0
    for k in range(1, p + 1):
        s = p - k
        for i in range(s, n - k + 1):
            mem = 0.0
            for j in range(i + 1, n - k + 2):
                mem += factor * layers[j - 1].param_bytes + in_flight[s] * layers[j - 1].stash_bytes
                v = max(mem, best[k - 1][j])
                if v < best[k][i]:
                    best[k][i], choice[k][i] = v, j
    bounds, i = [], 0
    for k in range(p, 0, -1):
        j = choice[k][i]
        bounds.append((i, j))
        i = j
    return best[p][0], tuple(bounds)


# ---- predictions ----------------------------------------------------------------------------------


def _bounds_of(pipeline: Pipeline, split: SplitArg | None, n_layers: int) -> tuple[tuple[int, int], ...]:
    if split is None or isinstance(split, str):
        if split == "auto":
            raise ValueError("predict: split='auto' must be resolved first (auto_split gives the counts)")
        base = Pipeline(stages=pipeline.stages, schedule=pipeline.schedule, chunks=pipeline.chunks,
                        split=split or "equal")
        return resolve_bounds(base, n_layers)
    items = list(split)
    if items and all(isinstance(c, int) and not isinstance(c, bool) for c in items):
        base = Pipeline(stages=pipeline.stages, schedule=pipeline.schedule, chunks=pipeline.chunks,
                        split=tuple(items))
        return resolve_bounds(base, n_layers)
    bounds = tuple((int(a), int(b)) for a, b in items)
    if len(bounds) != pipeline.pieces:
        raise ValueError(
            f"predict: {len(bounds)} layer ranges for {pipeline.pieces} pieces (stages={pipeline.stages} x "
            f"chunks={pipeline.chunks}); give one (start, stop) per piece"
        )
    return bounds


def predict(
    job: Job,
    pipeline: Pipeline | None,
    split: SplitArg | None,
    profiles: ModelProfile | Sequence[LayerProfile],
    *,
    workers: int | None = None,
    link: Link = LOOPBACK,
) -> dict[str, Any]:
    """Predicted costs of running ``job`` cut by ``split`` (layer counts per piece, ``(start,
    stop)`` ranges, or ``"equal"``) under ``pipeline`` (default ``job.pipeline``) on ``workers``
    (default ``stages``).

    Per piece: compute (forward + backward), communication (its output boundary, forward and
    back, over ``link``) and their sum, as the partitioner counts them. The step is simulated:
    ``simulate(schedule(p, m), f_time, b_time, w_time)`` with ``f_time = forward + one transfer``
    and ``b_time = backward + one transfer`` per piece (so a piece's ``f + b`` is its time above),
    ``m`` the virtual nodes of the busiest pipeline replica; no-flush schedules are simulated over
    ``Pipeline.window`` steps and the step time is the average. Memory per worker is exact under
    the cost model: the weights of its pieces (times the optimizer-state factor, plus the extra
    weight versions of no-flush schedules) plus the peak of the stash the schedule holds on it.

    Returns a JSON-ready dict (see the keys below); ``fits`` compares the peak with
    ``Pipeline.memory_limit_gib``.
    """
    pipeline = _pipeline_of(job, pipeline)
    profile = _as_profile(profiles)
    layers = profile.layers
    bounds = _bounds_of(pipeline, split, len(layers))
    d, m = micro_batches(job, pipeline, workers)
    schedule = make_schedule(pipeline, m)
    p, v, pieces = pipeline.stages, pipeline.chunks, pipeline.pieces
    in_flight = stage_in_flight(schedule)
    base_factor = profile.optimizer_state_factor
    factor = _factor(base_factor, schedule)
    limit = _limit_bytes(pipeline)
    part = evaluate_split(layers, bounds, link=link, in_flight=in_flight, optimizer_state_factor=factor,
                          memory_limit_bytes=limit)

    f_time, b_time, w_time = [], [], []
    for s, (a, b) in enumerate(bounds):
        hop = link.transfer_s(layers[b - 1].activation_bytes) if s < pieces - 1 else 0.0
        f_time.append(sum(layers[i].forward_s for i in range(a, b)) + hop)
        b_time.append(sum(layers[i].backward_s for i in range(a, b)) + hop)
        if profile.weight_grad_s is not None:
            w_time.append(sum(profile.weight_grad_s[i] for i in range(a, b)))
        else:
            w_time.append(0.5 * sum(layers[i].backward_s for i in range(a, b)))
    split_bw = schedule.split_backward()
    sim = simulate(schedule, f_time, b_time, w_time if split_bw else None)
    step = float(sim.step_time) / schedule.steps

    params = [sum(layers[i].param_bytes for i in range(a, b)) for a, b in bounds]
    stashes = [sum(layers[i].stash_bytes for i in range(a, b)) for a, b in bounds]
    memory = []
    for r in range(p):
        resident = sum((base_factor + schedule.weight_versions[s] - 1) * params[s] for s in range(r, pieces, p))
        now = peak = 0.0
        for act in schedule.actions[r]:  # stash held: forward done, last backward part not yet
            if act.kind == "F":
                now += stashes[act.stage]
                peak = max(peak, now)
            elif act.kind == ("W" if split_bw else "B"):
                now -= stashes[act.stage]
        memory.append(resident + peak)

    if pipeline.schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        analytic = (p - 1) / (v * m + p - 1)
    else:
        analytic = None
    names = [layer.name for layer in layers]
    peak_memory = max(memory)
    return {
        "schedule": pipeline.schedule,
        "stages": p,
        "chunks": v,
        "workers": d * p,
        "replicas": d,
        "micro_batches": m,
        "micro_batch_size": job.global_batch_size // job.virtual_nodes,
        "counts": [b - a for a, b in bounds],
        "bounds": [[a, b] for a, b in bounds],
        "piece_layers": [names[a:b] for a, b in bounds],
        "piece_worker": [s % p for s in range(pieces)],
        "piece_compute_s": list(part.stage_compute_s),
        "piece_comm_s": list(part.stage_comm_s),
        "piece_time_s": list(part.stage_time_s),
        "piece_memory_bytes": list(part.stage_memory_bytes),
        "in_flight": list(in_flight),
        "worker_time_s": [sum(part.stage_time_s[s] for s in range(r, pieces, p)) for r in range(p)],
        "bottleneck_piece": part.bottleneck,
        "bottleneck_s": part.bottleneck_s,
        "step_time_s": step,
        "bubble": sum(sim.bubble) / p,
        "bubble_per_worker": list(sim.bubble),
        "analytic_bubble": analytic,
        "samples_per_s": job.global_batch_size / step if step > 0 else math.inf,
        "memory_bytes": memory,
        "peak_memory_bytes": peak_memory,
        "memory_limit_bytes": limit,
        "fits": limit is None or peak_memory <= limit,
        "optimizer_state_factor": factor,
        "weight_grad": None if not split_bw else ("measured" if profile.weight_grad_s is not None else "estimated"),
        "link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
    }


def split_partition(job: Job, pipeline: Pipeline | None, split: SplitArg | None,
                    profiles: ModelProfile | Sequence[LayerProfile], *, workers: int | None = None,
                    link: Link = LOOPBACK) -> Partition:
    """The :class:`Partition` (per-piece costs, for ``Partition.describe``) of a given split under
    the same in-flight counts and optimizer-state factor ``auto_split`` uses."""
    pipeline = _pipeline_of(job, pipeline)
    profile = _as_profile(profiles)
    bounds = _bounds_of(pipeline, split, len(profile.layers))
    _, m = micro_batches(job, pipeline, workers)
    schedule = make_schedule(pipeline, m)
    return evaluate_split(profile.layers, bounds, link=link, in_flight=stage_in_flight(schedule),
                          optimizer_state_factor=_factor(profile.optimizer_state_factor, schedule),
                          memory_limit_bytes=_limit_bytes(pipeline))


__all__ = [
    "LOOPBACK", "ModelProfile", "ProfileError", "auto_split", "make_schedule",
    "micro_batches", "min_peak_split", "predict", "profile_layers", "profile_model", "split_partition",
    "stage_in_flight",
]
