"""The data order: a seeded permutation of ``range(n)`` computed one position at a time.

Purpose: every worker needs the dataset indices of its own virtual nodes' positions at a step,
and nothing else. Materialising a whole epoch's permutation (``torch.randperm(n)``, the order
before ``data_order="feistel"``) costs 8 bytes per sample in every process: 80 MB at 10^7
samples, 8 GB at 10^9. Here position ``p`` of epoch ``e`` maps to its index directly, so the B
indices of a step cost O(B) time and memory, whatever ``n``.

The rule (exact: a reimplementation from this text gives the same indices). All arithmetic is
on non-negative integers; ``^`` is XOR, ``>>`` a right shift, ``&`` bitwise AND, ``//`` and
``%`` floor division and remainder::

    splitmix64(x):          # 64-bit, every step mod 2**64 (as vn_seed)
        x = x + 0x9E3779B97F4A7C15
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    key[r] = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ n) ^ r) & 0xFFFFFFFF
             for the rounds r = 0..5

    F(R, k):                # 32-bit mixer, every product mod 2**32
        y = R ^ k
        y = y ^ (y >> 16);  y = y * 0x7FEB352D
        y = y ^ (y >> 15);  y = y * 0x6C8E9CF5
        return y ^ (y >> 16)

    a = isqrt(n - 1) + 1                    # ceil(sqrt(n))
    b = (n + a - 1) // a                    # ceil(n / a): a*b >= n, and a*b - n < a
    E(x):                                   # a bijection of [0, a*b): 6 Feistel rounds
        for r in 0..5:                      # x = L*b + R with L < a, R < b
            L, R = x // b, x % b
            x = R * a + (L + F(R, key[r])) % a
            a, b = b, a                     # the parts swap places, and so their ranges
        return x                            # six swaps: every E starts with the a, b above

    index(p) = E(p), then E again while the result is >= n   (cycle-walking)

``index`` is a permutation of ``range(n)``: each round is invertible (``R = x // a`` is kept,
``L = (x % a - F(R)) mod a``), so ``E`` permutes ``[0, a*b)``, and cycle-walking restricts a
permutation to a subset (following ``E`` from ``p < n`` must come back below ``n``: at the
latest at ``p`` itself). Since ``a*b - n < a``, a value falls outside with probability below
``1/b``, about ``1/sqrt(n)``: a step's positions rarely take a second application of ``E``.
``seed`` enters modulo 2**64 (as in :func:`~virtualflow.plan.data.vn_seed`); ``n`` and
``epoch`` are part of the key, so another dataset size or epoch draws another permutation.

The arithmetic in torch: values stay below 2**63 (``x < a*b < 2**63``, ``R < 2**32``, a product
in ``F`` is below 2**32 * 2**31), so ``int64`` tensors compute it exactly (no overflow, no sign).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["MAX_SAMPLES", "ROUNDS", "epoch_indices", "round_keys"]

ROUNDS = 6
"""Feistel rounds of ``E``."""
MAX_SAMPLES = 1 << 62
"""The largest dataset size the rule is defined for."""

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_MUL1 = 0x7FEB352D
_MUL2 = 0x6C8E9CF5  # both odd and below 2**31: a 32-bit value times one fits in int64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_keys(n: int, seed: int, epoch: int) -> list[int]:
    """The six 32-bit round keys of epoch ``epoch``'s order over ``n`` samples (see the module)."""
    base = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64)) ^ n)
    return [_splitmix64(base ^ r) & _MASK32 for r in range(ROUNDS)]


_U32 = np.uint64(_MASK32)
_M1, _M2 = np.uint64(_MUL1), np.uint64(_MUL2)
_S15, _S16 = np.uint64(15), np.uint64(16)


def _mix(r: np.ndarray, key: int) -> np.ndarray:
    y = r ^ np.uint64(key)
    y = ((y ^ (y >> _S16)) * _M1) & _U32
    y = ((y ^ (y >> _S15)) * _M2) & _U32
    return y ^ (y >> _S16)


def _encrypt(x: np.ndarray, a: int, b: int, keys: list[int]) -> np.ndarray:
    """``E`` on unsigned 64-bit integers (NumPy: on a few thousand positions its element-wise
    operations cost a third of torch's here, 0.2 ms against 0.5 ms for 2,048; every value stays
    below 2**63, so the results are the same integers either way)."""
    ua, ub = np.uint64(a), np.uint64(b)
    for key in keys:
        left = x // ub
        right = x - left * ub
        x = right * ua + (left + _mix(right, key)) % ua
        ua, ub = ub, ua
    return x


def epoch_indices(positions: torch.Tensor | range | int, n: int, seed: int, epoch: int) -> torch.Tensor:
    """Dataset indices at ``positions`` of epoch ``epoch``'s order over ``n`` samples (the rule
    of this module's docstring), as an ``int64`` tensor of the positions' shape and device.

    Memory and time are O(len(positions)), never O(n): a step of a 10^9-sample dataset costs
    what a step of a 100-sample one does. ``positions`` may be a tensor, a ``range`` or an int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"a data order over n={n!r} samples: n must be an int in 1..2**62")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch={epoch!r} must be a non-negative int")
    if isinstance(positions, range):
        positions = torch.arange(positions.start, positions.stop, positions.step, dtype=torch.int64)
    elif isinstance(positions, int):
        positions = torch.tensor(positions, dtype=torch.int64)
    x = positions.to(torch.int64)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= n):
        raise ValueError(f"positions must lie in 0..{n - 1} (the epoch's order over n={n} samples), "
                         f"got {int(x.min())}..{int(x.max())}")
    a = math.isqrt(n - 1) + 1
    b = (n + a - 1) // a
    keys = round_keys(n, seed, epoch)
    u = _encrypt(x.cpu().numpy().astype(np.uint64).reshape(-1), a, b, keys)
    un = np.uint64(n)
    outside = u >= un
    while outside.any():  # cycle-walking: rare, a*b exceeds n by less than sqrt(n)
        u[outside] = _encrypt(u[outside], a, b, keys)
        outside = u >= un
    return torch.from_numpy(u.astype(np.int64)).reshape(x.shape).to(x.device)
