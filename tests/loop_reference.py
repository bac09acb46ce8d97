"""The plain PyTorch training loop a practitioner writes, as the reference of a job with the
training-loop knobs: gradient accumulation over the virtual nodes' slices of the global batch,
``torch.autocast``, ``torch.amp.GradScaler``, ``torch.nn.utils.clip_grad_norm_``, an LR scheduler
stepped only after an applied step (as Accelerate and the Hugging Face Trainer do).

Written from the documented semantics only, with no virtualflow code besides the public
``vn_seed``: data order (:func:`reference.step_batch`), each VN's slice and random stream, losses
weighted by n_v / B."""

from __future__ import annotations

import contextlib

import torch

import virtualflow as vf
from reference import step_batch


def loop_train(job: vf.Job, steps: int, *, activation_checkpointing=None):
    torch.manual_seed(job.seed)
    model = job.model()
    if activation_checkpointing is not None:
        from torch.utils.checkpoint import checkpoint

        for m in model.modules():
            if isinstance(m, activation_checkpointing):
                fwd = m.forward
                m.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(fwd)
    opt = job.optimizer(model)  # the factory takes the model (parameter groups by name)
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    dtype = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[job.precision]
    scaler = torch.amp.GradScaler("cpu", **(job.loss_scale or {})) if job.precision == "16-mixed" else None
    ds = job.build_dataset()
    x_all, y_all = ds.tensors
    n, B, V = len(ds), job.global_batch_size, job.virtual_nodes
    record = {"loss": [], "norm": [], "skipped": [], "scale": []}
    model.train()
    for s in range(steps):
        idx = step_batch(job, n, s)
        opt.zero_grad()
        total = 0.0
        for v in range(V):
            sl = idx[v * (B // V) : (v + 1) * (B // V)]
            torch.manual_seed(vf.vn_seed(job.seed, s, v))
            region = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with region:
                out = job.loss(model, (x_all[sl], y_all[sl]))
            loss = (out[0] if isinstance(out, tuple) else out) * (len(sl) / B)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.item()
        record["scale"].append(scaler.get_scale() if scaler is not None else None)
        if scaler is not None:
            scaler.unscale_(opt)
        norm = None
        if job.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm))
        skipped = False
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            opt.step()
        if sched and not skipped:
            sched.step()
        record["loss"].append(total)
        record["norm"].append(norm)
        record["skipped"].append(skipped)
    return model, record
