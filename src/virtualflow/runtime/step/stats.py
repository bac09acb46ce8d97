"""The VN engine's per-step statistics vector: its typed layout, how it is packed and read.

Purpose: besides the gradients, the workers of a step must agree on a few numbers - which VNs had
a non-finite loss, the control sequence, the loss function's metrics, the loss and the BatchNorm
statistics (where they do not travel with the gradients) and each worker's timing. They travel in
one small vector, summed over the workers (riding in the last gradient bucket in default mode):

    [BatchNorm statistics? | loss? | bad flag per VN (V) | metric sums (MAX_METRICS) | control |
     compute seconds per worker | previous step's breakdown per worker (len(RAW) each)]

The numbers this worker holds in Python (the control sequence, its timings, the metric slots'
zeros when the loss function returns no metrics and, on CPU, the loss and the bad flags) become
one tensor, so a step's packing costs a handful of operations: each small operation costs
microseconds, several times more right after a backward than in a loop of its own, and on a model
of a few thousand parameters the packing was a measurable part of the step. On an accelerator the
loss and the flags stay tensors (reading them would wait for the device before the reduction).

:class:`StatsLayout` is that layout for one generation (the loss and statistics slots are present
as the reduction decides: deterministic mode carries the loss, and BatchNorm's ``mean``
statistics, in the tree's tail instead); :class:`MetricSums` holds a step's metric sums.

Invariants: every worker of a generation packs the same length (a worker with no VN sends
zeros); every slot but the per-worker ones has the same meaning on every worker, and a worker
writes only its own per-worker slots, so the sum is each worker's value there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from virtualflow.runtime.batches import LossShapeError
from virtualflow.runtime.breakdown import RAW

MAX_METRICS = 16
"""Slots for the loss function's metrics in a step's statistics vector (every worker sends the same
length, whether or not it ran a virtual node)."""


class MetricSums:
    """The loss function's metrics of one step, each weighted by its VN's share of the global batch
    and summed in VN order; their names are learnt from the first forward run here."""

    def __init__(self) -> None:
        self.names: list[str] = []
        """The loss function's metric names (sorted), learnt from the first forward run here."""
        self.sums: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """A new step (or a probe's forward, which contributes nothing)."""
        self.sums = {}

    def note(self, metrics: dict[str, Any], share: float, where: str) -> None:
        """Add a VN's metrics, weighted by its share of the global batch, to the step's sums."""
        if not metrics and not self.names:
            return
        names = sorted(metrics)
        if not self.names and names:
            if len(names) > MAX_METRICS:
                raise LossShapeError(f"Job.loss returned {len(names)} metrics {where}; at most {MAX_METRICS} are "
                                     f"reduced per step")
            self.names = names
        elif names != self.names and (names or self.sums):
            raise LossShapeError(f"Job.loss returned the metrics {names} {where}, but {self.names} before: "
                                 f"return the same names at every call")
        for name in names:
            value = metrics[name]
            value = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(
                float(value))
            acc = self.sums.get(name)
            self.sums[name] = value * share if acc is None else acc + value * share

    def vector(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The sums in their ``MAX_METRICS`` slots (zeros where this worker has none); None when the
        loss function returns no metrics (the slots are zeros)."""
        if not self.names:
            return None
        out = torch.zeros(MAX_METRICS, device=device, dtype=dtype)
        for i, name in enumerate(self.names):
            if name in self.sums:
                out[i] = self.sums[name].to(device, dtype)
        return out

    def named(self, values: Sequence[float]) -> dict[str, float] | None:
        """The summed slots by name (None without metrics)."""
        return {name: values[i] for i, name in enumerate(self.names)} or None


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


_OVERFLOW = {torch.float32: math.ldexp(1 - 2.0**-25, 128)}
"""The least magnitude that rounds to infinity in float32 (its largest value plus half an ulp: the
tie goes to the even infinity); float64 is a Python float's own range."""


def in_range(x: float, dtype: torch.dtype) -> float:
    """``x``, or the infinity of its sign where rounding it to ``dtype`` overflows (as
    ``torch.tensor`` rounds it; NumPy would warn)."""
    limit = _OVERFLOW.get(dtype)
    return math.copysign(math.inf, x) if limit is not None and abs(x) >= limit else x


def floats(numbers: list[float], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """A tensor of Python floats (on CPU through NumPy: a third of ``torch.tensor``'s cost on a
    list); each number is rounded to ``dtype`` as ``torch.tensor`` rounds it."""
    if device is None and dtype in _NUMPY:
        return torch.from_numpy(np.array(numbers, dtype=_NUMPY[dtype]))
    return torch.tensor(numbers, dtype=dtype, device=device)


class BadFlags:
    """This worker's flags of a step's VNs, 1.0 where a VN's weighted loss is inf or NaN, in their
    slots of the statistics vector (summed over the workers: a VN is bad on every worker). On CPU
    (``device`` None) Python floats, read from the losses with one conversion and packed with the
    other numbers; on an accelerator a tensor on it, so that nothing waits for the device before
    the reduction. The statistics vector has the default dtype, as before the flags were typed."""

    __slots__ = ("values", "device", "dtype")

    def __init__(self, virtual_nodes: int, device: torch.device | None) -> None:
        self.device = device
        self.dtype = torch.get_default_dtype()
        self.values: list[float] | torch.Tensor = (
            [0.0] * virtual_nodes if device is None else torch.zeros(virtual_nodes, device=device))

    def note(self, vn: int, weighted: torch.Tensor) -> None:
        """VN ``vn``'s weighted loss (a scalar)."""
        if self.device is None:
            x = weighted.item()
            self.values[vn] = 0.0 if x - x == 0.0 else 1.0  # x - x is NaN exactly when x is inf or NaN
        else:
            self.values[vn] = torch.isnan(weighted - weighted)  # two kernels (isfinite's composite runs five)

    def note_block(self, vns: Sequence[int], where: slice | torch.Tensor,
                   weighted: Sequence[float] | torch.Tensor) -> None:
        """The weighted losses of ``vns`` (``weighted[i]``: VN ``vns[i]``'s; on CPU Python floats
        or a tensor); ``where``: their slots as a slice or index tensor (the device's copy)."""
        if self.device is None:
            values = self.values
            for vn, x in zip(vns, weighted.tolist() if isinstance(weighted, torch.Tensor) else weighted):
                if x - x != 0.0:
                    values[vn] = 1.0
        else:
            self.values[where] = torch.isnan(weighted - weighted)  # the copy converts: True is 1.0


@dataclass(frozen=True)
class StatsRead:
    """One step's summed statistics vector, read."""

    bad_vns: list[int]
    control: int
    metric_values: list[float]
    loss: float | torch.Tensor | None
    """The summed loss (a number, read from the vector) or the ``loss`` handed to :meth:`StatsLayout.read`."""
    bn: torch.Tensor | None
    compute_s: list[float]
    breakdown_raw: list[list[float]]
    """The previous step's raw intervals, one row of ``len(RAW)`` per worker."""


@dataclass(frozen=True)
class StatsLayout:
    """The statistics vector of one generation (see the module docstring)."""

    virtual_nodes: int
    size: int
    """Workers in the generation."""
    rank: int
    loss: bool
    """Whether the loss travels here (default mode; deterministic mode sums it in the tree)."""
    bn_numel: int
    """BatchNorm statistics travelling here (0: none, or they travel in the tree's tail)."""
    bn_mean: bool
    """The statistics here are summed over the VNs and read as their mean (BatchNorm ``mean``)."""

    def pack(self, bad: BadFlags, control: int, metrics: torch.Tensor | None, loss: float | torch.Tensor | None,
             bn: torch.Tensor | None, compute_s: float, previous: Sequence[float] | None) -> torch.Tensor:
        """This worker's vector, in ``bad``'s dtype on ``bad``'s device (``metrics`` None: zeros;
        ``bn`` None: zeros; ``previous``: this worker's previous step's intervals, or None)."""
        dtype, device = bad.dtype, bad.device
        items: list[torch.Tensor | list[float]] = []
        if self.bn_numel:
            items.append(bn.to(dtype) if bn is not None else torch.zeros(self.bn_numel, device=device, dtype=dtype))
        if self.loss:
            # on CPU the loss's value as a Python float (exact), rounded to dtype as .to(dtype) rounds it
            if device is None:
                items.append([in_range(loss if isinstance(loss, float) else loss.item(), dtype)])
            else:
                items.append(loss.reshape(1).to(dtype))
        items.append(bad.values)
        items.append(metrics if metrics is not None else [0.0] * MAX_METRICS)
        size, K = self.size, len(RAW)
        numbers = [0.0] * (1 + size * (1 + K))
        numbers[0] = float(control)
        numbers[1 + self.rank] = compute_s
        if previous is not None:
            start = 1 + size + self.rank * K
            numbers[start : start + K] = previous
        items.append(numbers)
        parts: list[torch.Tensor] = []
        run: list[float] = []
        for item in items:  # consecutive numbers become one tensor
            if isinstance(item, list):
                run += item
                continue
            if run:
                parts.append(floats(run, dtype, device))
                run = []
            parts.append(item)
        if run:
            parts.append(floats(run, dtype, device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read(self, stats: torch.Tensor, loss: torch.Tensor | None = None,
             bn: torch.Tensor | None = None) -> StatsRead:
        """The summed ``stats``; ``loss`` and ``bn`` (deterministic mode: from the tree's tail) are
        kept where this layout has no slot for them."""
        V = self.virtual_nodes
        values = stats.tolist()  # one conversion, then plain floats (each small op costs ~5 us)
        offset = 0
        if self.bn_numel:
            bn = stats[: self.bn_numel]
            if self.bn_mean:
                bn = bn / V
            offset = self.bn_numel
        if self.loss:
            loss = values[offset]
            offset += 1
        bad_vns = [v for v in range(V) if values[offset + v] != 0.0]
        offset += V
        metric_values = values[offset : offset + MAX_METRICS]
        control = int(round(values[offset + MAX_METRICS]))
        offset += MAX_METRICS + 1
        size, K = self.size, len(RAW)
        compute_s = values[offset : offset + size]
        offset += size
        raw = [values[offset + r * K : offset + (r + 1) * K] for r in range(size)]
        return StatsRead(bad_vns, control, metric_values, loss, bn, compute_s, raw)
