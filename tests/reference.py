"""A plain single-process PyTorch reference of what a virtualflow job computes.

Written from the documented semantics only (data order, VN slices, weighting, per-VN random
streams, BatchNorm rule), with no virtualflow code besides the public ``vn_seed``.
"""

from __future__ import annotations

import torch

import virtualflow as vf


def bn_buffers(model):
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            out += [m.running_mean, m.running_var, m.num_batches_tracked]
    return out


def step_batch(job: vf.Job, n: int, step: int) -> torch.Tensor:
    """Dataset indices of the global batch of ``step``: a fresh permutation per epoch from
    ``seed + epoch``, cut into consecutive batches of B."""
    B = job.global_batch_size
    epoch, i = divmod(step, n // B)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(job.seed + epoch))
    return order[i * B : (i + 1) * B]


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
