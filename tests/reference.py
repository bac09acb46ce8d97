"""A plain single-process PyTorch reference of what a virtualflow job computes.

Written from the documented semantics only (data order, VN slices, weighting, per-VN random
streams, BatchNorm rule), with no virtualflow code besides the public ``vn_seed``. The data order
(:func:`order_index`) is the rule of docs/training.md and ``virtualflow.plan.permutation``'s
docstring written again here in plain Python integers, one position at a time.
"""

from __future__ import annotations

import math

import torch

import virtualflow as vf


def bn_buffers(model):
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            out += [m.running_mean, m.running_var, m.num_batches_tracked]
    return out


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def order_index(p: int, n: int, seed: int, epoch: int) -> int:
    """The dataset index at position ``p`` of epoch ``epoch``'s order over ``n`` samples
    (``data_order="feistel"``): six rounds of a Feistel network over ``[0, a*b)``, ``a =
    ceil(sqrt(n))``, ``b = ceil(n / a)``, keyed by (seed, epoch, n, round); cycle-walking while
    the result is ``>= n``."""
    base = splitmix64(splitmix64(splitmix64(seed % 2**64) ^ epoch) ^ n)
    keys = [splitmix64(base ^ r) % 2**32 for r in range(6)]

    def mix(r: int, k: int) -> int:
        y = r ^ k
        y = ((y ^ (y >> 16)) * 0x7FEB352D) % 2**32
        y = ((y ^ (y >> 15)) * 0x6C8E9CF5) % 2**32
        return y ^ (y >> 16)

    a0 = math.isqrt(n - 1) + 1
    b0 = -(-n // a0)

    def encrypt(x: int) -> int:
        a, b = a0, b0
        for k in keys:
            hi, lo = divmod(x, b)
            x = lo * a + (hi + mix(lo, k)) % a
            a, b = b, a
        return x

    x = encrypt(p)
    while x >= n:
        x = encrypt(x)
    return x


def step_batch(job: vf.Job, n: int, step: int) -> torch.Tensor:
    """Dataset indices of the global batch of ``step``: positions ``[i*B, (i+1)*B)`` of its
    epoch's order, ``epoch, i = divmod(step, n // B)``. The order: :func:`order_index`, or with
    ``data_order="randperm"`` a fresh ``torch.randperm(n)`` per epoch from ``seed + epoch``."""
    B = job.global_batch_size
    epoch, i = divmod(step, n // B)
    if job.data_order == "randperm":
        order = torch.randperm(n, generator=torch.Generator().manual_seed(job.seed + epoch))
        return order[i * B : (i + 1) * B]
    return torch.tensor([order_index(p, n, job.seed, epoch) for p in range(i * B, (i + 1) * B)])


def reference_train(job: vf.Job, steps: int):
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    ds = job.build_dataset()
    x_all, y_all = ds.tensors
    n, B, V = len(ds), job.global_batch_size, job.virtual_nodes
    losses = []
    model.train()
    for s in range(steps):
        idx = step_batch(job, n, s)
        opt.zero_grad()
        start = [b.clone() for b in bn_buffers(model)]
        ends = []
        total = 0.0
        for v in range(V):
            for b, s0 in zip(bn_buffers(model), start):
                b.copy_(s0)
            sl = idx[v * (B // V) : (v + 1) * (B // V)]
            torch.manual_seed(vf.vn_seed(job.seed, s, v))
            loss = job.compute_loss(model, (x_all[sl], y_all[sl])) * (len(sl) / B)
            loss.backward()
            total += loss.item()
            ends.append([b.clone() for b in bn_buffers(model)])
        with torch.no_grad():
            for k, b in enumerate(bn_buffers(model)):
                if job.batchnorm == "first" or not b.is_floating_point():
                    b.copy_(ends[0][k])
                else:
                    b.copy_(sum(e[k] for e in ends) / V)
        opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return model, opt, losses
