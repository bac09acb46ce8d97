"""PyTorch DistributedDataParallel as users run it: the reference that virtualflow's step time is
compared with (``vs_ddp``, ``deterministic``).

Each rank is a fresh interpreter (``python -m bench.NAME --child-ddp JSON``: the benchmark's own
module dispatches to :func:`ddp_rank`) with one thread, joined over gloo on a TCPStore the
launcher hosts on a free port. The loop accumulates the rank's micro-batches with ``no_sync()``
on all but the last backward, the way a PyTorch user does::

    opt.zero_grad()
    for k in range(micro):                                   # this rank's micro-batches
        ctx = ddp.no_sync() if k < micro - 1 else nullcontext()
        with ctx:
            (loss_fn(ddp, micro_batch_k) / micro).backward()
    opt.step()

The workload is the harness's MLP (:func:`bench.harness.workloads.mlp`) on its data, in
virtualflow's data order (:func:`bench.harness.workloads.batch_indices`), so the two train the
same model on the same samples.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from typing import Callable

import torch

from bench.harness.machine import collect_children, minor_faults, ru_maxrss_mib, spawn_child, vmhwm_mib
from bench.harness.workloads import SEED, batch_indices, bench_data, cross_entropy, mlp, sgd


def init_rank(cfg: dict):
    """Join the DDP job described by ``cfg`` (port, rank, world, threads); returns the store."""
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp", store), rank=cfg["rank"],
                            world_size=cfg["world"], timeout=datetime.timedelta(seconds=120))
    return store


def ddp_stepper(rank: int, world: int, V: int, B: int) -> tuple[torch.nn.Module, Callable[[int], float]]:
    """A DDP replica and its step function (the loop a PyTorch user writes)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    X, Y = bench_data().tensors
    torch.manual_seed(SEED)
    model = DDP(mlp())
    opt = sgd(model.parameters())
    model.train()
    local_b = B // world  # this rank's share of the global batch
    micro = V // world  # micro-batches per rank
    n = local_b // micro

    def step_fn(step: int) -> float:
        # same sample order as virtualflow's DataPlan: this rank's share of the global batch
        idx = batch_indices(len(X), B, step, rank * local_b, (rank + 1) * local_b)
        xb, yb = X[idx], Y[idx]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for k in range(micro):
            ctx = model.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = cross_entropy(model, (xb[k * n : (k + 1) * n], yb[k * n : (k + 1) * n])) * (1.0 / micro)
                loss.backward()
            loss_sum += loss.detach()
        opt.step()
        return float(loss_sum)  # this rank's loss, logged (not reduced)

    return model, step_fn


def ddp_rank(cfg: dict) -> dict:
    """One DDP rank's whole run (the body of ``--child-ddp``): its step times, losses, memory."""
    import torch.distributed as dist

    rank, steps = cfg["rank"], cfg["steps"]
    init_rank(cfg)
    model, step_fn = ddp_stepper(rank, cfg["world"], cfg["V"], cfg["B"])
    times, losses = [], []
    faults_at = {}
    t_prev = time.perf_counter()
    for step in range(steps):
        if step == cfg["warmup"]:
            faults_at[step] = minor_faults()
        losses.append(step_fn(step))
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
    faults_at[steps] = minor_faults()
    (s0, f0), (s1, f1) = sorted(faults_at.items())
    if rank == 0 and cfg.get("save"):
        torch.save(model.module.state_dict(), cfg["save"])
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "step_times": times, "losses": losses, "vmhwm_mib": vmhwm_mib(),
            "ru_maxrss_mib": ru_maxrss_mib(), "faults_per_step": (f1 - f0) / max(1, s1 - s0)}


def run_ddp(module: str, workers: int, V: int, B: int, steps: int, save: str | None, warmup: int,
            flag: str = "--child-ddp") -> list[dict]:
    """Run ``workers`` DDP ranks as ``python -m MODULE FLAG JSON`` (``MODULE`` calls
    :func:`ddp_rank`, or its own rank body for another ``flag``); their results by rank.
    ``save``: where rank 0 writes its final weights (None: nowhere)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    procs = []
    for rank in range(workers):
        cfg = {"rank": rank, "world": workers, "port": store.port, "V": V, "B": B, "steps": steps,
               "threads": 1, "save": save, "warmup": warmup}
        procs.append(spawn_child(module, [flag, json.dumps(cfg)], 1))
    out = collect_children(procs, "DDP rank")
    del store
    return sorted(out, key=lambda r: r["rank"])
