"""BatchNorm running statistics of one pipeline piece, kept exact across interleaved micro-batches.

Purpose: a pipelined step interleaves the forwards of its micro-batches, and each must see the
running statistics of the step's start, as in the unpipelined step; the step's new statistics are
then combined once (mean over the VNs, or VN 0's) and loaded.

Invariants:

- Restoring gives each layer *fresh* buffer tensors: a micro-batch's backward may still need the
  buffers its forward saw (the VN engine's in-place restore is safe only because it never
  interleaves micro-batches).
- Flat layout as :class:`virtualflow.runtime.engine.BatchNormState`: per tracked layer (in
  ``module.modules()`` order), running mean then running variance.
- A snapshot is held from :meth:`PieceBatchNorm.snapshot` until :meth:`PieceBatchNorm.settle`
  (the step applied or skipped); :meth:`PieceBatchNorm.restore` without one changes nothing, so an
  interrupted step can always be restored.

:class:`PieceBatchNorm` has the same methods as the one in ``runtime/batchnorm.py`` (the runtime's
one BatchNorm state module, beside the VN engine's in-place ``BatchNormState``): once both are
merged, this class is that one and this module keeps only :func:`statistics_numel` and
:func:`load_statistics`.
"""

from __future__ import annotations

import torch
from torch import nn


def tracked_layers(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``module`` that track running statistics, in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def statistics_numel(module: nn.Module) -> int:
    """Elements of ``module``'s running statistics in the flat layout."""
    return sum(m.running_mean.numel() + m.running_var.numel() for m in tracked_layers(module))


class PieceBatchNorm:
    """The BatchNorm running statistics of one piece (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = tracked_layers(module)
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


def load_statistics(bn: dict[int, PieceBatchNorm], flat: torch.Tensor) -> None:
    """Load ``flat`` (the pieces' flat statistics, piece after piece in ``bn``'s order)."""
    offset = 0
    for b in bn.values():
        b.load_flat(flat[offset: offset + b.numel])
        offset += b.numel

