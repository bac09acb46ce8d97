"""Deterministic draws of the tensor-parallel blocks: dropout masks and weights, from a seed alone.

Purpose: ``t`` ranks and the single worker must draw the same dropout mask and build the same
weights, whatever their global random state. Everything random in :mod:`virtualflow.parallel.tensor`
comes from here.

Invariants:

- **Dropout rule**: the keep-mask of a ``[T, h]`` output is cut into blocks of
  :data:`DROPOUT_BLOCK_ROWS` token rows; block ``b`` is ``torch.rand(DROPOUT_BLOCK_ROWS, h) >= p``
  from a CPU generator seeded with ``splitmix64((seed mod 2**32) << 32 | b) mod 2**32``
  (:func:`dropout_keep`), so a token's mask depends on neither the number of ranks nor the number
  of overlap chunks.
- **Weights** are drawn whole from ``seed`` (:func:`init_linears`) with ``nn.Linear``'s own
  distribution, from a stream unrelated to the dropout blocks'; the global generator is never
  touched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

DROPOUT_BLOCK_ROWS = 64
"""Token rows per dropout block (see the module docstring's dropout rule)."""

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_INIT_TAG = 0x5EED_0F_11  # mixed into the weight generator's seed (the dropout blocks mix in block indices)


def dropout_keep(seed: int, lo: int, hi: int, width: int, p: float,
                 block_rows: int = DROPOUT_BLOCK_ROWS) -> torch.Tensor:
    """The keep-mask (bool ``[hi - lo, width]``, on the CPU: the rule's generator is torch's CPU
    generator on every device) of token rows ``[lo, hi)`` under ``seed``."""
    if not 0 <= lo <= hi:
        raise ValueError(f"dropout_keep: rows [{lo}, {hi}) are not a valid range")
    if hi == lo:
        return torch.ones(0, width, dtype=torch.bool)
    pieces = []
    gen = torch.Generator()
    for b in range(lo // block_rows, (hi - 1) // block_rows + 1):
        if b > _MASK32:
            raise ValueError(f"dropout_keep: {hi} token rows exceed the rule's 2**32 blocks")
        gen.manual_seed(splitmix64(((seed & _MASK32) << 32) | b) & _MASK32)
        block = torch.rand(block_rows, width, generator=gen) >= p
        a, z = max(lo, b * block_rows) - b * block_rows, min(hi, (b + 1) * block_rows) - b * block_rows
        pieces.append(block[a:z])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def splitmix64(x: int) -> int:
    """A bijective 64-bit mixer (Steele, Lea, Flood 2014), so nearby (seed, block) pairs seed
    unrelated-looking streams."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def keep_scale(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``keep`` as 0 or ``1/(1-p)`` in ``dtype`` (the single-worker block multiplies by the same)."""
    return keep.to(dtype) * (1.0 / (1.0 - p))


class DropoutSeeds:
    """The dropout seed of each training forward: explicit, or ``seed`` + forwards so far."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    def next(self, explicit: int | None) -> int:
        if explicit is not None:
            return explicit
        s = self.seed + self.calls
        self.calls += 1
        return s


def check_dropout_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p={p} must be in [0, 1)")


def init_linears(seed: int, *linears: nn.Linear) -> None:
    """Draw the weights and biases of ``linears`` (in order) from a CPU generator seeded from
    ``seed`` alone, with ``nn.Linear``'s own distribution (``U(-1/sqrt(in), 1/sqrt(in))`` for both).

    Why: ``nn.Linear`` draws from the global generator, whose state differs between ranks (data
    shuffling, per-rank seeds): ranks would cut *different* blocks and the tensor-parallel output
    would be wrong with no error. Drawn from ``seed``, the whole (unsharded) matrices are the same
    on every rank and each rank takes its slice. The global generator is not touched. The
    generator's seed is ``seed`` mixed twice with a tag: a stream unrelated to the dropout blocks'."""
    gen = torch.Generator()
    gen.manual_seed(splitmix64(splitmix64(seed & _MASK64) ^ _INIT_TAG) & _MASK32)
    with torch.no_grad():
        for lin in linears:
            bound = 1.0 / math.sqrt(lin.in_features) if lin.in_features > 0 else 0.0
            weight = torch.empty(lin.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
            lin.weight.copy_(weight)
            if lin.bias is not None:
                lin.bias.copy_(torch.empty(lin.bias.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen))


def skip_init_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` whose constructor draws nothing from the global generator (its values are
    set by :func:`init_linears`)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features)
