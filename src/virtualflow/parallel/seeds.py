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
- **Attention-probability dropout**: the keep-mask of the ``[q, k]`` probabilities of sample
  ``b`` and *global* head ``g`` is ``torch.rand(q, k) >= p`` from a CPU generator seeded with
  ``splitmix64(splitmix64(seed ^ ATTENTION_TAG) ^ (b << 24 | g)) mod 2**32``
  (:func:`attention_keep`): a rank holding heads ``[g0, g1)`` draws only theirs, so the mask of
  ``(b, g)`` depends neither on the number of ranks nor on which rank holds ``g``.
- **Where a forward's seed comes from** (:class:`DropoutSeeds`): an explicit ``dropout_seed``;
  else, rule ``"module"``, the module's ``seed`` plus the training forwards it ran before; or,
  rule ``"generator"``, one draw from torch's default CPU generator per training forward with
  dropout (:func:`generator_seed`). The generator rule is the pipeline's: the default generator's
  state travels with the micro-batch (docs/pipeline.md), every tensor-parallel rank of a stage
  holds the same state, and ``torch.utils.checkpoint`` restores it for the recompute, so the
  seed is the same on every rank, in the recompute, and whatever D, P or the number of forwards
  the module ran before. One forward's sub-layers derive their own streams with
  :func:`sub_seed`.
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
ATTENTION_TAG = 0xA77E_4710
"""Mixed into the seed of the attention-probability masks (:func:`attention_keep`)."""
SEED_RULES = ("module", "generator")


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


def attention_keep(seed: int, batch: int, first_head: int, heads: int, q_len: int, k_len: int,
                   p: float) -> torch.Tensor:
    """The keep-mask (bool ``[batch, heads, q_len, k_len]``, on the CPU) of the attention
    probabilities of global heads ``[first_head, first_head + heads)`` under ``seed``."""
    if batch >= 1 << 40 or first_head + heads > 1 << 24:
        raise ValueError(f"attention_keep: batch={batch} or heads up to {first_head + heads} exceed the rule's "
                         f"2**40 samples and 2**24 heads")
    out = torch.empty(batch, heads, q_len, k_len, dtype=torch.bool)
    gen = torch.Generator()
    base = splitmix64((seed & _MASK64) ^ ATTENTION_TAG)
    for b in range(batch):
        for j in range(heads):
            gen.manual_seed(splitmix64(base ^ ((b << 24) | (first_head + j))) & _MASK32)
            out[b, j] = torch.rand(q_len, k_len, generator=gen) >= p
    return out


def sub_seed(seed: int, stream: int) -> int:
    """Seed of stream ``stream`` of one forward (a block's residual dropouts and attention
    masks): ``splitmix64(seed ^ splitmix64(stream))``, 64 bits."""
    return splitmix64((seed & _MASK64) ^ splitmix64(stream))


def generator_seed() -> int:
    """One draw from torch's default CPU generator: a 62-bit seed (the ``"generator"`` rule)."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64).item())


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
    """The dropout seed of each training forward: explicit, or (rule ``"module"``) ``seed`` +
    forwards so far, or (rule ``"generator"``) one draw from torch's default generator."""

    def __init__(self, seed: int, rule: str = "module") -> None:
        if rule not in SEED_RULES:
            raise ValueError(f"dropout_seeds={rule!r} is not a seed rule; use one of {SEED_RULES}")
        self.seed = seed
        self.rule = rule
        self.calls = 0

    def next(self, explicit: int | None) -> int:
        if explicit is not None:
            return explicit
        if self.rule == "generator":
            return generator_seed()
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


def skip_init_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """An ``nn.Linear`` whose constructor draws nothing from the global generator (its values are
    set by :func:`init_linears`)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias)
