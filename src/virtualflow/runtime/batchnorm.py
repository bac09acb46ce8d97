"""BatchNorm running statistics held apart from the model: the one home of that bookkeeping.

A step runs several virtual nodes (or micro-batches) through the same layers, and each of them
must start from the running statistics the step started with; the statistics the step keeps are
combined once, at its end (mean over the virtual nodes, or VN 0's). Two holders share one flat
layout (per BatchNorm layer with ``track_running_stats``, in ``module.modules()`` order: running
mean, then running variance; the batch counters are kept apart):

- :class:`BatchNormState` (the VN engine) restores the buffers **in place**: safe because the VN
  engine never interleaves two VNs' forwards and backwards.
- :class:`PieceBatchNorm` (a pipeline stage's piece) restores by giving each layer **fresh**
  buffer tensors: a micro-batch's backward may still need the buffers its forward saw.

Invariants shared by both: :meth:`restore` without a snapshot taken (or after :meth:`settle`)
changes nothing; :meth:`flat` and :meth:`load_flat` use the layout above; ``numel`` is the
length of :meth:`flat`; a holder is falsy when the module has no such layer.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BatchNormState", "PieceBatchNorm", "tracked_batchnorms"]


def tracked_batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``module`` that keep running statistics, in ``modules()`` order."""
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


class BatchNormState:
    """The running statistics of the model's BatchNorm layers, as one flat vector (restored in place)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.float_bufs: list[torch.Tensor] = []
        self.int_bufs: list[torch.Tensor] = []
        for m in tracked_batchnorms(model):
            for name in ("running_mean", "running_var"):
                b = getattr(m, name)
                if b is not None:
                    self.float_bufs.append(b)
            if m.num_batches_tracked is not None:
                self.int_bufs.append(m.num_batches_tracked)
        self.numel = sum(b.numel() for b in self.float_bufs)
        self._start: list[torch.Tensor] = []
        self._start_int: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.float_bufs or self.int_bufs)

    @property
    def snapshotted(self) -> bool:
        """Whether a snapshot is held (what :meth:`restore` would go back to)."""
        return bool(self._start or self._start_int)

    def snapshot(self) -> None:
        self._start = [b.detach().clone() for b in self.float_bufs]
        self._start_int = [b.detach().clone() for b in self.int_bufs]

    def restore(self) -> None:
        """Back to the snapshot, in place (nothing changes without one)."""
        with torch.no_grad():
            for b, s in zip(self.float_bufs, self._start):
                b.copy_(s)
            for b, s in zip(self.int_bufs, self._start_int):
                b.copy_(s)

    def advance_counters(self) -> None:
        """``num_batches_tracked += 1``, as one training forward does (a worker that ran no VN in
        a step keeps its counters equal to the others')."""
        with torch.no_grad():
            for b in self.int_bufs:
                b.add_(1)

    def flat(self) -> torch.Tensor:
        if not self.float_bufs:
            return torch.zeros(0)
        return torch.cat([b.detach().reshape(-1) for b in self.float_bufs])

    def load_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for b in self.float_bufs:
                n = b.numel()
                b.copy_(flat[offset : offset + n].view_as(b))
                offset += n


class PieceBatchNorm:
    """The BatchNorm running statistics of one pipeline piece, restored between micro-batches by
    giving each layer *fresh* buffer tensors: a micro-batch's backward may still need the buffers
    its forward saw (the VN engine's in-place restore is safe only because it never interleaves
    micro-batches). Flat layout as :class:`BatchNormState`: per layer, running mean then running
    variance."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = tracked_batchnorms(module)
        self.numel = sum(m.running_mean.numel() + m.running_var.numel() for m in self.layers)
        self._start: list[tuple[torch.Tensor, ...]] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    @property
    def snapshotted(self) -> bool:
        """Whether a snapshot is held (taken by :meth:`snapshot`, not yet :meth:`settle`-d)."""
        return bool(self._start)

    def snapshot(self) -> None:
        self._start = [(m.running_mean.detach().clone(), m.running_var.detach().clone(),
                        m.num_batches_tracked.detach().clone()) for m in self.layers]

    def restore(self) -> None:
        """Back to the snapshot with fresh tensors (nothing changes without one)."""
        for m, (mean, var, count) in zip(self.layers, self._start):
            m.running_mean, m.running_var, m.num_batches_tracked = mean.clone(), var.clone(), count.clone()

    def settle(self) -> None:
        """The step is over (applied or skipped): nothing to restore if what follows fails."""
        self._start = []

    def flat(self) -> torch.Tensor:
        parts = [t.detach().reshape(-1) for m in self.layers for t in (m.running_mean, m.running_var)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def load_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        for m in self.layers:
            for name in ("running_mean", "running_var"):
                old = getattr(m, name)
                n = old.numel()
                setattr(m, name, flat[offset: offset + n].view_as(old).clone())
                offset += n
