"""The step finish: unscale, the inf/nan verdict, the whole step's gradient norm, clip, skip.

Purpose: what happens to a step's reduced gradient before the optimizer sees it, written once for
every layout. :class:`StepFinish` holds ``Job.precision``'s loss scaling
(:mod:`virtualflow.runtime.amp`), ``Job.max_grad_norm`` and the whole model's
:class:`~virtualflow.runtime.clipping.NormBlocks`; a layout says only *what gradient it holds*:

* the VN engine hands it a :class:`HeldGradient`, chosen by its optimizer update
  (:mod:`virtualflow.runtime.step.update`): the whole gradient in ``p.grad``
  (:class:`WholeGrads`, torch's norm), the deterministic tree's flat sum (:class:`FlatSum`), or a
  sharded worker's chunk whose block sums the workers all-reduce (:class:`ChunkGrads`), and
  :meth:`StepFinish.finish` does the rest on every worker alike;
* a pipeline stage computes its *local part* (:meth:`StepFinish.local`: unscale, a found-inf
  flag, its block sums into the step's float64 stats vector, tensor-parallel shards in their
  slots by :class:`TensorSlots`), the stats all-reduce sums the parts, and :meth:`StepFinish.verdict`
  reads the norm and the skip from the sum; :meth:`StepFinish.clip_` and :meth:`StepFinish.update`
  follow.

Invariants: the arithmetic is :mod:`virtualflow.runtime.clipping`'s (one rule for every layout,
the same ops in the same order, so the bits do not depend on the layout) and
:mod:`virtualflow.runtime.amp`'s (GradScaler's numbers); every decision is taken from numbers every
worker holds identically, so a step is skipped, and clipped by the same factor, everywhere or
nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from virtualflow.runtime.amp import LossScaler, NoLossScale
from virtualflow.runtime.clipping import BLOCK, NormBlocks, clip_, total_norm

__all__ = ["ChunkGrads", "FlatSum", "HeldGradient", "ONE_SLOT", "OneSlot", "Part", "StepFinish", "TensorSlots",
           "WholeGrads", "range_parts"]


@dataclass(frozen=True, slots=True)
class Part:
    """Elements of one parameter's gradient this holder counts in the norm: ``grad`` holds the
    elements from block ``first`` on of parameter ``index`` (the whole model's parameter order)."""

    index: int
    param: torch.Tensor
    """The parameter (its identity tells a tensor-parallel shard from a replicated parameter)."""
    grad: torch.Tensor
    first: int = 0


def range_parts(flat: torch.Tensor, entries: Iterable[tuple[int, torch.Tensor, int]], lo: int,
                hi: int) -> list[Part]:
    """The :class:`Part` s of the elements ``[lo, hi)`` of ``flat``, a flat vector of parameters
    given as (index in the norm's order, parameter, offset in ``flat``); a range that starts on a
    block (:meth:`NormBlocks.cuts`) cuts none."""
    out = []
    for index, q, offset in entries:
        a, b = max(lo, offset), min(hi, offset + q.numel())
        if a < b:
            out.append(Part(index, q, flat[a:b], (a - offset) // BLOCK))
    return out


class OneSlot:
    """Every parameter whole on its holder (no tensor parallelism): one slot of blocks each."""

    def any_of(self, found: float) -> float:
        return found

    def sums(self, blocks: NormBlocks, sums: torch.Tensor, parts: Sequence[Part]) -> torch.Tensor:
        for part in parts:
            blocks.fill(sums, part.index, part.grad, first=part.first)
        return sums


ONE_SLOT = OneSlot()


@dataclass(frozen=True, slots=True)
class TensorSlots:
    """A tensor-parallel stage: a sharded parameter's shards fill one slot each (this rank's:
    ``rank``), summed over the tensor group by ``sum`` (exact: one contributor per entry); a
    replicated parameter, the same on every worker of the group, fills its one slot here."""

    sum: Callable[[torch.Tensor], None]
    """Sums a float64 vector in place over the stage's tensor-parallel group."""
    sharded: frozenset[int]
    """``id()`` of this worker's parameters that hold a shard."""
    rank: int
    device: torch.device

    def any_of(self, found: float) -> float:
        """An inf in any shard skips the step on every worker of the group."""
        flag = torch.tensor([found], dtype=torch.float64, device=self.device)
        self.sum(flag)
        return float(flag.item() > 0)

    def sums(self, blocks: NormBlocks, sums: torch.Tensor, parts: Sequence[Part]) -> torch.Tensor:
        shards = torch.zeros_like(sums)
        for part in parts:
            if id(part.param) in self.sharded:
                blocks.fill(shards, part.index, part.grad, first=part.first, slot=self.rank)
            else:
                blocks.fill(sums, part.index, part.grad, first=part.first)
        self.sum(shards)
        return sums + shards


class HeldGradient(Protocol):
    """The reduced gradient a VN engine's worker holds after the reduction (see the module docstring)."""

    grads: list[torch.Tensor]
    """What is unscaled and clipped."""

    def norm(self, finish: StepFinish) -> torch.Tensor:
        """The whole step's gradient norm (the same on every worker)."""

    def release(self) -> None:
        """The gradient where the optimizer reads it (``p.grad``)."""


class WholeGrads:
    """The whole reduced gradient in ``p.grad`` on every worker: torch's norm."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.grads = [p.grad for p in params if p.grad is not None]

    def norm(self, finish: StepFinish) -> torch.Tensor:
        return total_norm(self.grads)

    def release(self) -> None:
        pass


class FlatSum:
    """The deterministic tree's sum, one flat vector in the parameters' order (every worker holds
    it whole): the blocks' norm; then ``p.grad`` become views of it."""

    def __init__(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        self.flat, self.params = flat, params
        self.grads = [flat]

    def norm(self, finish: StepFinish) -> torch.Tensor:
        entries, at = [], 0
        for i, p in enumerate(self.params):
            entries.append((i, p, at))
            at += p.numel()
        return finish.norm(finish.block_sums(range_parts(self.flat, entries, 0, at), self.flat.device))

    def release(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            # a view: the vector is not written again before the optimizer has stepped and
            # dropped the gradients (the next step's exchange, or a pooled buffer's reuse); a
            # parameter of a narrower dtype than the vector's (parameters of several dtypes: the
            # tree sums in the widest) gets its sum rounded to its own dtype, as autograd's would be
            grad = self.flat[offset : offset + n].view_as(p)
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
            offset += n


class ChunkGrads:
    """This worker's chunk ``[lo, hi)`` of the flat gradient (the sharded optimizer's): its blocks'
    sums, all-reduced with the other chunks' by ``all_reduce`` (each block has one holder: chunks
    start on blocks), give the norm."""

    def __init__(self, flat_grad: torch.Tensor, params: Sequence[torch.Tensor], offsets: Sequence[int], lo: int,
                 hi: int, all_reduce: Callable[[torch.Tensor], Any] | None) -> None:
        self.flat_grad, self.lo, self.hi, self.all_reduce = flat_grad, lo, hi, all_reduce
        self.entries = [(i, p, o) for i, (p, o) in enumerate(zip(params, offsets))]
        self.grads = [flat_grad[lo:hi]]

    def norm(self, finish: StepFinish) -> torch.Tensor:
        sums = finish.block_sums(range_parts(self.flat_grad, self.entries, self.lo, self.hi), self.flat_grad.device)
        if self.all_reduce is not None:
            self.all_reduce(sums)
        return finish.norm(sums)

    def release(self) -> None:
        pass


class StepFinish:
    """A step's finish for one worker (see the module docstring). ``blocks`` is ``None`` when no
    norm is taken (no clipping, and in a pipeline no clipping whatever the precision)."""

    def __init__(self, scaler: LossScaler | None, max_grad_norm: float | None, blocks: NormBlocks | None) -> None:
        self.scaler = scaler
        """``"16-mixed"``'s loss scaler (``None`` otherwise)."""
        self.scaling: LossScaler | NoLossScale = scaler or NoLossScale()
        """The loss scaling every step asks (:class:`~virtualflow.runtime.amp.NoLossScale` without a scaler)."""
        self.max_grad_norm = max_grad_norm
        self.blocks = blocks

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], precision: str, loss_scale: dict[str, Any] | None,
           max_grad_norm: float | None) -> StepFinish:
        """The VN engine's: a worker holding the whole model's ``params``; the norm is taken to
        clip, and for loss scaling's verdict."""
        scaler = LossScaler.of(precision, loss_scale)
        takes_norm = max_grad_norm is not None or scaler is not None
        return cls(scaler, max_grad_norm, NormBlocks.of(params) if takes_norm else None)

    @property
    def loss_scale(self) -> float | None:
        """The scale this step's loss was multiplied by (``None`` without loss scaling)."""
        return self.scaling.scale

    def cuts(self) -> list[int] | None:
        """Where a chunk of the flat parameters may start so that no block straddles two holders
        (``None``: anywhere, no norm is taken)."""
        return self.blocks.cuts() if self.blocks is not None else None

    # ---- the whole gradient held (VN engine) -----------------------------------------------------
    def finish(self, held: HeldGradient) -> tuple[float | None, bool]:
        """Unscale, take the norm, decide the skip and clip ``held``; returns (norm, skipped)."""
        norm_value, skipped = None, False
        if self.blocks is not None:
            self.scaling.unscale_(held.grads)
            norm = held.norm(self)
            norm_value = float(norm)
            skipped = self.scaling.skips(norm_value)
            if not skipped:
                self.clip_(held.grads, norm)
        held.release()
        return norm_value, skipped

    # ---- parts summed elsewhere (pipeline stages) ------------------------------------------------
    def local(self, grads: list[torch.Tensor], parts: Sequence[Part], device: torch.device,
              slots: OneSlot | TensorSlots = ONE_SLOT) -> tuple[float, torch.Tensor | None]:
        """Unscale ``grads`` and return (1.0 if one of them holds an inf/nan else 0.0, ``parts``'
        block sums as a float64 vector of the blocks' size, which holds them exactly; ``None`` when
        no norm is taken)."""
        found = self.scaling.found_inf(grads, slots.any_of)
        if self.blocks is None:
            return found, None
        return found, slots.sums(self.blocks, self.blocks.zeros(device, torch.float64), parts)

    def verdict(self, flags: float | torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(the norm from every block's summed sum of squares or ``None``, skipped) from the
        summed local parts: ``flags`` holders found an inf/nan."""
        norm = self.norm(sums) if self.blocks is not None else None
        return norm, self.scaling.skips_flagged(flags)

    # ---- arithmetic shared by both -----------------------------------------------------------------
    def block_sums(self, parts: Sequence[Part], device: torch.device) -> torch.Tensor:
        """``parts``' block sums in a vector of the norm's dtype."""
        assert self.blocks is not None
        return ONE_SLOT.sums(self.blocks, self.blocks.zeros(device), parts)

    def norm(self, sums: torch.Tensor) -> torch.Tensor:
        assert self.blocks is not None
        return self.blocks.norm(sums)

    def clip_(self, grads: Sequence[torch.Tensor], norm: torch.Tensor) -> None:
        """Multiply ``grads`` by ``clip_grad_norm_``'s factor (when clipping)."""
        if self.max_grad_norm is not None:
            clip_(grads, norm, self.max_grad_norm)

    def update(self, skipped: bool) -> None:
        """The loss scale after the step (backs off when it was skipped)."""
        self.scaling.update(skipped)
