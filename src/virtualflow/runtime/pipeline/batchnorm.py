"""BatchNorm statistics of a pipeline stage's pieces: their size and loading them in one piece.

Purpose: the pipeline engine keeps one :class:`~virtualflow.runtime.batchnorm.PieceBatchNorm` per
piece (the runtime's one BatchNorm state module, :mod:`virtualflow.runtime.batchnorm`, holds the
class and its invariants: fresh buffers on restore, a snapshot from ``snapshot`` to ``settle``);
a step's new statistics travel as one flat tensor, piece after piece. This module sizes and
unpacks that tensor.

Invariant: the flat layout is the pieces' in ``bn``'s order, each piece's as
:meth:`PieceBatchNorm.flat` (per tracked layer, running mean then running variance).
"""

from __future__ import annotations

import torch
from torch import nn

from virtualflow.runtime.batchnorm import PieceBatchNorm, tracked_batchnorms

__all__ = ["PieceBatchNorm", "load_statistics", "statistics_numel"]


def statistics_numel(module: nn.Module) -> int:
    """Elements of ``module``'s running statistics in the flat layout."""
    return sum(m.running_mean.numel() + m.running_var.numel() for m in tracked_batchnorms(module))


def load_statistics(bn: dict[int, PieceBatchNorm], flat: torch.Tensor) -> None:
    """Load ``flat`` (the pieces' flat statistics, piece after piece in ``bn``'s order)."""
    offset = 0
    for b in bn.values():
        b.load_flat(flat[offset: offset + b.numel])
        offset += b.numel
