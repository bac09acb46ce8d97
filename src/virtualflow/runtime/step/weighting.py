"""A virtual node's loss weighted by its share of the global batch: what its backward starts from.

Purpose: every engine weights a VN's (or a pipelined micro-batch's) loss by its share ``n_v / B``
of the global batch before the backward, and every one must give the bits of the plain PyTorch
way, ``(loss * share).backward()``. This is that weighting's one home: the VN engine's compute
(:mod:`.compute`, in default and deterministic mode and under FSDP) and the pipeline's last piece
(:mod:`virtualflow.runtime.pipeline.flush` and ``stream``) start their backward from
:meth:`LossWeighting.root`, and read the weighted loss's value with :meth:`LossWeighting.weighted`.

The multiplication is folded into the backward where that gives the same bits: for a float32 or
float64 loss and no loss scale, ``(loss * share).backward()`` hands ``loss``'s backward the gradient
``dtype(share)`` (one times the share, exact), so :meth:`LossWeighting.root` returns ``loss`` with
that tensor as its seed gradient (``loss.backward(dtype(share))``), which spares each VN a
multiplication, its autograd node and a detach. Half-precision losses and ``16-mixed`` keep the
multiplication (and the loss scale after it): autograd's own casts decide the bits there.

Invariants: the gradients are those of ``(loss * share)`` (scaled by the loss scale), bit for bit;
the weighted value is ``loss.detach() * share``, the same operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from virtualflow.runtime.amp import LossScaler

FOLDED = (torch.float32, torch.float64)
"""Loss dtypes whose weighting is folded into the backward's seed gradient."""

SEEDS_KEPT = 64
"""Seed gradients kept per (share, dtype) at most (shares change only with the global batch size)."""


class LossWeighting:
    """One worker's loss weighting (see the module docstring). ``scaler``: ``16-mixed``'s loss
    scaler (its scale is applied after the multiplication, which is then kept), or None."""

    __slots__ = ("_scaler", "folds", "_seeds")

    def __init__(self, scaler: "LossScaler | None") -> None:
        self._scaler = scaler
        self.folds = scaler is None
        """Whether the weighting can fold into the backward (no loss scale)."""
        self._seeds: dict[tuple[float, torch.dtype], torch.Tensor] = {}
        """The backward's seed gradient per (share, dtype): ``dtype(share)`` on the losses' device
        (one per worker)."""

    def root(self, loss: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor the backward starts from, its seed gradient or None for ones): ``loss`` and
        ``dtype(share)`` where the weighting folds, else the weighted (and scaled) loss."""
        if self.folds and loss.dtype in FOLDED:
            key = (share, loss.dtype)
            seed = self._seeds.get(key)
            if seed is None:
                if len(self._seeds) >= SEEDS_KEPT:
                    self._seeds.clear()
                seed = self._seeds[key] = torch.tensor(share, dtype=loss.dtype, device=loss.device)
            return loss, seed
        weighted = loss * share
        return (weighted if self.folds else self._scaler.scale_loss(weighted)), None

    @staticmethod
    def weighted(loss: torch.Tensor, share: float) -> torch.Tensor:
        """The weighted loss ``loss * share``, detached (the statistics' value)."""
        return loss.detach() * share
