"""PyTorch's way of sharding parameters, as users run it: FSDP2 (``fully_shard`` on each
transformer block, then on the root) over gloo, and the plain unsharded loop it is measured
against (``sharded_params``).

Each rank is a fresh interpreter (``python -m bench.NAME --child-fsdp2 JSON``: the benchmark's
module dispatches to :func:`fsdp2_rank`) with one thread, joined over gloo on a TCPStore the
launcher hosts on a free port. Every rank accumulates its micro-batches the FSDP2 way, a
reduce-scatter after each backward into the sharded gradients (memory-minimal: no unsharded
gradient is kept between micro-batches)::

    for k in range(micro):                       # this rank's micro-batches
        (loss_fn(model, micro_batch_k) / micro).backward()
    opt.step(); opt.zero_grad()

``world=1, sharded=False`` is the plain loop without any process group (the unsharded memory
baseline). Samples follow virtualflow's data order (:func:`bench.harness.workloads.batch_indices`):
rank ``r`` reads positions ``[r B/W, (r+1) B/W)`` of each step's batch, as virtualflow's worker
``r`` runs VNs ``r V/W ...`` with the contiguous assignment.

Measured per rank: its step times (end of step to end of step); its peak resident memory (VmHWM)
over the whole run up to the end of the last step, before the final weights are gathered, and
over the steady steps alone (``steady_vmhwm_mib``: the peak is reset with :func:`reset_peak_rss`
after the last warm-up step, so what building the model and the first steps held does not count);
its peak address space (VmPeak); the C allocator's bytes in use at the last step's start and at
its peak during it, all threads (:class:`bench.harness.alloc.PeakSampler`); and the bytes of
parameters, gradients and optimizer state it holds at the end of the last step (local shards:
:func:`bench.harness.gpt.state_bytes`).
:func:`apply_as_limit`, :func:`vmpeak_mib` and :func:`reset_peak_rss` serve virtualflow's workers
too.
"""

from __future__ import annotations

import datetime
import json
import resource
import time

import torch

from bench.harness.gpt import SIZES, adamw, build, live_tensor_bytes, lm_loss, state_bytes, token_data
from bench.harness.alloc import PeakSampler
from bench.harness.machine import _status_field, collect_children, spawn_child, vmhwm_mib
from bench.harness.workloads import SEED, batch_indices

TIMEOUT_S = 120.0
"""Bound on the process group's collectives and the store."""


def apply_as_limit(mib: float | None) -> None:
    """Limit this process's address space to ``mib`` MiB (``RLIMIT_AS``; None: no limit)."""
    if mib:
        limit = int(mib * 2 ** 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def vmpeak_mib() -> float:
    """Peak address space of this process (what ``RLIMIT_AS`` bounds)."""
    return _status_field("self", "VmPeak")


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current resident memory (Linux >= 4.0: ``5`` to
    ``/proc/self/clear_refs``), so that a later VmHWM is the peak since now; False when refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rank_slices(B: int, V: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first position, micro-batches, micro-batch size) of ``rank``'s share of a step's batch:
    ``B`` samples in ``V`` micro-batches over ``world`` ranks, each rank its contiguous V/W."""
    if V % world or B % V:
        raise ValueError(f"V={V} must be a multiple of W={world} and divide B={B}")
    return rank * (B // world), V // world, B // V


def _init(cfg: dict) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp2", store), rank=cfg["rank"],
                            world_size=cfg["world"], timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _model(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = build(cfg["size"])
    if cfg["sharded"]:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def _train(cfg: dict) -> dict:
    rank, steps = cfg["rank"], cfg["steps"]
    X, Y = token_data(SIZES[cfg["size"]]).tensors
    lo, micro, n = rank_slices(cfg["B"], cfg["V"], cfg["world"], rank)
    model = _model(cfg)
    opt = adamw(model)
    times, losses, held, early, sampler = [], [], {}, {}, PeakSampler()
    t_prev = time.perf_counter()
    for step in range(steps):
        idx = batch_indices(len(X), cfg["B"], step, lo, lo + micro * n)
        xb, yb = X[idx], Y[idx]
        total = 0.0
        for k in range(micro):
            loss = lm_loss(model, (xb[k * n:(k + 1) * n], yb[k * n:(k + 1) * n])) / micro
            loss.backward()
            total += float(loss)
        opt.step()
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        losses.append(total)
        if step == cfg["warmup"] - 1:  # the steady steps' peak from here on
            early = {"early_vmhwm_mib": vmhwm_mib(), "peak_reset": reset_peak_rss()}
        if step == steps - 1:  # the state held at the end of a step (gradients still there), after its time
            sampler.stop()
            held = {**state_bytes(model, opt), "live_tensors": live_tensor_bytes()}
        opt.zero_grad(set_to_none=True)
        if step == steps - 2:  # the allocator's peak over the last step
            sampler.start()
    steady = vmhwm_mib()
    out = {"rank": rank, "step_times": times, "losses": losses, "state_bytes": held, "steady_vmhwm_mib": steady,
           "vmhwm_mib": max(steady, early.get("early_vmhwm_mib", steady)), "vmpeak_mib": vmpeak_mib(),
           "alloc_start_bytes": sampler.start_bytes, "alloc_peak_bytes": sampler.peak_bytes, **early}
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    if rank == 0 and cfg.get("save"):
        torch.save(full, cfg["save"])
    return out


def fsdp2_rank(cfg: dict) -> dict:
    """One rank's whole run (the body of ``--child-fsdp2``)."""
    torch.set_num_threads(cfg.get("threads", 1))
    distributed = cfg["world"] > 1 or cfg["sharded"]
    if distributed:
        _init(cfg)
    out = _train(cfg)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return out


def run_fsdp2(module: str, workers: int, *, size: str, V: int, B: int, steps: int, warmup: int,
              sharded: bool = True, save: str | None = None, timeout_s: float = 900.0) -> list[dict]:
    """Run ``workers`` ranks as ``python -m MODULE --child-fsdp2 JSON`` (``MODULE`` calls
    :func:`fsdp2_rank`); their results by rank. ``sharded=False`` with 1 worker: the plain loop."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    procs = []
    for rank in range(workers):
        cfg = {"rank": rank, "world": workers, "port": store.port, "size": size, "V": V, "B": B, "steps": steps,
               "sharded": sharded, "threads": 1, "save": save, "warmup": warmup}
        procs.append(spawn_child(module, ["--child-fsdp2", json.dumps(cfg)], 1))
    out = collect_children(procs, "FSDP2 rank" if sharded else "plain loop", timeout_s=timeout_s)
    del store
    return sorted(out, key=lambda r: r["rank"])
