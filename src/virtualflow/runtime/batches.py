"""What one virtual node's step consumes and produces: its batch, its random streams, its loss.

:class:`BatchLoader` reads only a VN's own samples (one gather per tensor for tensor datasets);
:func:`to_device` moves a batch; :func:`seed_random_streams` seeds the generators a VN's forward
draws from with ``vn_seed(seed, step, vn)``; :func:`check_loss` refuses a loss that is not a
scalar floating-point tensor (:class:`LossShapeError`); :class:`StepOutcome` is what a step
hands back to the worker. Shared by the VN engine and the pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import TensorDataset, default_collate

from virtualflow.runtime.breakdown import Raw

__all__ = ["BatchLoader", "LossShapeError", "NonFiniteLossError", "StepOutcome", "check_loss",
           "seed_generators", "seed_random_streams", "split_loss", "to_device", "vn_generators"]


class NonFiniteLossError(RuntimeError):
    """A virtual node's loss was NaN or infinite; the step was not applied."""


class LossShapeError(ValueError):
    """The job's loss did not return a scalar tensor."""


@dataclass(slots=True)
class StepOutcome:
    loss: float
    bad_vns: list[int]
    control: int
    compute_s: list[float] | None = None
    """Each rank's local compute time (loading its VNs' data, their forward and backward, up to
    the reduction) of the *previous* step, in rank order; 0 on the first step of a generation.
    A rank with no VN reports the time of its probe VN, or 0 in a step without a probe. The
    profiler's input, free since it rides in the step's reduction (the current step's time is
    not known when that reduction starts: the profiler pairs it with the previous step's
    duration)."""
    breakdown_raw: Raw | None = None
    """Every rank's raw timing of the *previous* step (:class:`virtualflow.runtime.breakdown.Raw`),
    held by rank 0 only; None elsewhere, on a generation's first step or with the breakdown off.
    It rides in this step's reduction, like ``compute_s``, and is derived where it is read (the
    coordinator, for the step report; :attr:`breakdown` in process), not in the step."""
    metrics: dict[str, float] | None = None
    """The loss function's extra metrics (``loss`` returned ``(loss, {name: value})``), each the
    mean over the global batch (VN values weighted by their share of it, as the loss is)."""
    grad_norm: float | None = None
    """The whole step's gradient L2 norm before clipping (after unscaling); ``None`` when it was not
    computed (no ``max_grad_norm``)."""
    skipped: bool = False
    """``16-mixed``: the step had an inf/nan gradient and was not applied (on any worker)."""
    loss_scale: float | None = None
    """``16-mixed``: the loss scale this step used (the next step's may differ)."""

    @property
    def breakdown(self) -> list[dict[str, float] | None] | None:
        """Where the *previous* step's time went on each rank (rank order, None for a rank with
        no row; :func:`virtualflow.runtime.breakdown.derive`), derived from :attr:`breakdown_raw`."""
        return self.breakdown_raw.derive() if self.breakdown_raw is not None else None


MAX_METRIC_NAME = 200
"""Longest metric name ``Job.loss`` may return: every step report carries the names, and a
report must fit the store's report channel (``protocol.MAX_REPORT_BYTES``); refusing a long name
at the first call beats a report the coordinator would have to drop."""


def split_loss(out: Any, where: str) -> tuple[Any, dict[str, Any]]:
    """``Job.loss``'s result as ``(loss, metrics)``: a bare loss, or ``(loss, {name: value})`` whose
    values are scalars (numbers or one-element tensors) to be averaged over the global batch, and
    whose names are at most :data:`MAX_METRIC_NAME` characters."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise LossShapeError(f"Job.loss returned a tuple of {len(out)} items {where}; return the loss, or "
                                 f"(loss, {{'name': value}}) with the metrics to log")
        loss, metrics = out
        for name, value in metrics.items():
            if not isinstance(name, str) or not (isinstance(value, (int, float)) and not isinstance(value, bool) or
                                                 isinstance(value, torch.Tensor) and value.numel() == 1):
                raise LossShapeError(f"Job.loss's metric {name!r} {where} is {type(value).__name__}; metrics must be "
                                     f"named by strings and be numbers or one-element tensors")
            if len(name) > MAX_METRIC_NAME:
                raise LossShapeError(f"Job.loss returned a metric name of {len(name)} characters {where} "
                                     f"({name[:40]!r}...); at most {MAX_METRIC_NAME} characters are allowed (every "
                                     f"step report carries the names): shorten it")
        return loss, metrics
    return out, {}


def check_loss(loss: Any, where: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossShapeError(
            f"Job.loss must return a scalar floating-point tensor (the mean loss over the batch); "
            f"{where} it returned {shape}: reduce it with .mean()"
        )


def seed_random_streams(seed: int, device: torch.device) -> None:
    """Seed the generators a VN's forward draws from: the CPU one and, on a GPU, that device's.

    Not ``torch.manual_seed``: it also seeds every CUDA/MPS/XPU backend lazily and records a
    Python stack trace for each on a CPU-only process (about 0.1-0.3 ms per call measured here,
    paid once per virtual node). A caller that seeds at every VN keeps :func:`vn_generators`
    instead (reading ``device.type`` costs microseconds).
    """
    seed_generators(seed, vn_generators(device))


def seed_generators(seed: int, generators: Sequence[torch.Generator]) -> None:
    """Seed each of ``generators`` (what :func:`vn_generators` returned) with ``seed``."""
    for gen in generators:
        gen.manual_seed(seed)


def vn_generators(device: torch.device) -> tuple[torch.Generator, ...]:
    """The generators :func:`seed_random_streams` seeds on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.default_generator, torch.cuda.default_generators[index]
    return (torch.default_generator,)


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class BatchLoader:
    """Loads the samples of one virtual node; only the VN's own samples are read."""

    def __init__(self, dataset: Any, collate_fn: Callable | None) -> None:
        self.dataset = dataset
        self.collate = collate_fn or default_collate
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) and collate_fn is None else None
        self.reads_files = self._tensors is None
        """Whether loading may read files (False for an in-memory ``TensorDataset``: its I/O
        profile is skipped, two reads of ``/proc/thread-self/io`` per load, 35 us each here)."""

    def vn_batches(self, indices: list[torch.Tensor]) -> list[Any]:
        """One batch per VN. Tensor datasets gather all of the worker's rows in one indexing
        operation per tensor and hand each VN a view of its rows (same values, fewer calls)."""
        if self._tensors is not None and len(indices) > 1 and len({len(i) for i in indices}) == 1:
            n = len(indices[0])
            rows = [t[torch.cat(indices)] for t in self._tensors]
            return [[r[k * n : (k + 1) * n] for r in rows] for k in range(len(indices))]
        return [self(i) for i in indices]

    def block_batches(self, block: torch.Tensor, sizes: Sequence[int]) -> list[Any]:
        """One batch per VN from the VNs' indices back to back (``block``, ``sizes[k]`` each): a
        tensor dataset gathers the rows once per tensor and hands each VN a view of its rows."""
        cuts = [0]
        for n in sizes:
            cuts.append(cuts[-1] + n)
        if self._tensors is not None:
            rows = [t[block] for t in self._tensors]
            return [[r[a:b] for r in rows] for a, b in zip(cuts, cuts[1:])]
        return [self(block[a:b]) for a, b in zip(cuts, cuts[1:])]

    def __call__(self, indices: torch.Tensor) -> Any:
        if self._tensors is not None:  # fast path: one gather per tensor, same values as collate
            return [t[indices] for t in self._tensors]
        idx = indices.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(idx) if getitems is not None else [self.dataset[i] for i in idx]
        return self.collate(samples)
