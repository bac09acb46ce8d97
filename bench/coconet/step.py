"""(2) The sharded step: plain-torch ranks (flat all-reduce + Adam vs ring reduce-scatter + sharded
Adam + all-gather, and torch's ZeroRedundancyOptimizer), and ``virtualflow.train`` with
``reduction='sharded'`` when it has the option; interleaved pairs.
"""

from __future__ import annotations

import datetime
import time
import traceback

import torch
from torch import nn

from bench import harness as H
from bench.coconet.workload import GLOBAL_BATCH, LR, WORLD, coconet_adam, coconet_data, coconet_job, coconet_model
from bench.coconet.children import launch_pair, store_client


def _state_bytes(state_values) -> int:
    total = 0
    for st in state_values:
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                if t.dim() > 0:  # Adam's scalar step counters are not the state that scales
                    total += t.numel() * t.element_size()
    return total


def _batches(rank: int, steps: int):
    """Rank ``rank``'s half of each global batch (same sample order in every variant)."""
    X, Y = coconet_data().tensors
    local = GLOBAL_BATCH // WORLD
    for step in range(steps):
        idx = H.batch_indices(len(X), GLOBAL_BATCH, step, rank * local, (rank + 1) * local)
        yield X[idx], Y[idx]


def _flatten(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-point every parameter's data and grad into one flat buffer each (as the engine does)."""
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    flat_p = torch.empty(n)
    flat_g = torch.zeros(n)
    at = 0
    for p in params:
        k = p.numel()
        flat_p[at:at + k].copy_(p.data.reshape(-1))
        p.data = flat_p[at:at + k].view_as(p)
        p.grad = flat_g[at:at + k].view_as(p)
        at += k
    return flat_p, flat_g


def step_rank(cfg: dict) -> dict:
    """One variant of the data-parallel step in one of 2 processes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, mode, steps = cfg["rank"], cfg["mode"], cfg["steps"]
    store = store_client(cfg["port"])
    torch.manual_seed(H.SEED)
    model = coconet_model()
    loss_fn = nn.functional.cross_entropy
    times: list[float] = []
    out: dict = {"rank": rank, "mode": mode}
    try:
        if mode in ("allreduce", "sharded"):
            from virtualflow.comm.groups import make_group
            from virtualflow.comm.ring import Collectives, Ledger
            from virtualflow.plan.shards import shard_bounds

            group = make_group(store, 0, rank, WORLD, 120.0, torch.device("cpu"))
            flat_p, flat_g = _flatten(model)
            ledger = Ledger()
            coll = Collectives(group, ledger)
            if mode == "allreduce":
                opt = coconet_adam(model.parameters())
            else:
                bounds = shard_bounds(flat_p.numel(), WORLD, 16)
                lo, hi = bounds[rank]
                shard = flat_p[lo:hi]
                shard.grad = flat_g[lo:hi]
                opt = coconet_adam([shard])
            t_prev = time.perf_counter()
            for x, y in _batches(rank, steps):
                flat_g.zero_()
                loss_fn(model(x), y).backward()
                if mode == "allreduce":
                    group.all_reduce(flat_g)
                    flat_g.div_(WORLD)
                else:
                    coll.reduce_scatter(flat_g, bounds)
                    flat_g[lo:hi].div_(WORLD)
                opt.step()
                if mode == "sharded":
                    coll.all_gather(flat_p, bounds)
                now = time.perf_counter()
                times.append(now - t_prev)
                t_prev = now
            out["ledger"] = ledger.by_op()
            coll.close()
            out["checksum"] = float(flat_p.double().sum())
            out["param_head"] = flat_p[:4].tolist() + flat_p[-4:].tolist()
            group.all_reduce(torch.zeros(1))
            group.close()
        else:
            dist.init_process_group("gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=WORLD,
                                    timeout=datetime.timedelta(seconds=120))
            if mode == "zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(model)
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
                inner = lambda: opt.optim  # noqa: E731
            elif mode == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(model)
                opt = coconet_adam(model.parameters())
                inner = lambda: opt  # noqa: E731
            elif mode == "fsdp2":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (WORLD,))
                for layer in model:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                opt = coconet_adam(model.parameters())
                inner = lambda: opt  # noqa: E731
            else:
                raise ValueError(f"unknown mode {mode!r}")
            t_prev = time.perf_counter()
            for x, y in _batches(rank, steps):
                opt.zero_grad(set_to_none=False)
                loss_fn(model(x), y).backward()
                opt.step()
                now = time.perf_counter()
                times.append(now - t_prev)
                t_prev = now
            opt = inner()
            dist.barrier()
            dist.destroy_process_group()
        out["opt_state_bytes"] = _state_bytes(opt.state.values())
    except Exception as exc:  # noqa: BLE001 - recorded honestly (a variant may not run on gloo)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    out.update(step_times=times, vmhwm_mib=H.vmhwm_mib())
    return out


def measure_step_variant(mode: str, steps: int) -> dict:
    try:
        ranks = launch_pair("--child-step", {"mode": mode, "steps": steps})
    except Exception as exc:  # noqa: BLE001 - a crashed child (e.g. a variant gloo cannot run)
        return {"mode": mode, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"mode": mode, "error": errors[0], "traceback": ranks[0].get("traceback", "")}
    per_step = [max(ts) for ts in zip(*(r["step_times"] for r in ranks))]
    return {"mode": mode, "step_times": per_step, "vmhwm_mib": [r["vmhwm_mib"] for r in ranks],
            "opt_state_bytes": [r["opt_state_bytes"] for r in ranks],
            "checksum": ranks[0].get("checksum"), "param_head": ranks[0].get("param_head"),
            "ledger": ranks[0].get("ledger")}


def vf_has_sharded() -> bool:
    from virtualflow.config.options import LaunchOptions

    return "reduction" in getattr(LaunchOptions, "__dataclass_fields__", {})


def measure_vf(reduction: str, steps: int) -> dict:
    import virtualflow as vf

    t0 = time.perf_counter()
    try:
        result = vf.train(coconet_job, workers=WORLD, steps=steps, threads_per_worker=1, reduction=reduction)
    except Exception as exc:  # noqa: BLE001 - recorded, the target then reads as missed
        return {"reduction": reduction, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    opt_bytes = _state_bytes(result.optimizer_state_dict.get("state", {}).values())
    return {"reduction": reduction, "step_times": [h["step_time_s"] for h in result.history],
            "peak_rss_mib": [result.peak_rss_mib.get(w) for w in range(WORLD)],
            "training_vmhwm_rank0_mib": max((e["vmhwm_mib"] for e in result.eval_history
                                             if e.get("step", steps) < steps and "vmhwm_mib" in e), default=float("nan")),
            "rank0_memory_by_step": [{"step": e.get("step"), "vmhwm_mib": e.get("vmhwm_mib"),
                                      "vmrss_mib": e.get("vmrss_mib")} for e in result.eval_history],
            "gathered_opt_state_bytes": opt_bytes,
            "optimizer_bytes": [getattr(result, "optimizer_bytes", {}).get(w) for w in range(WORLD)],
            "wall_s": time.perf_counter() - t0,
            "checksum": float(sum(v.double().sum() for v in result.state_dict.values()))}


def measure_step(args) -> dict:
    """Interleaved (all-reduce, sharded) pairs, order swapped every pair; a pair during which other
    processes used more than ``--max-other-cores`` is repeated (``--retries`` times at most)."""
    out: dict = {"emulation": {}, "torch": {}, "virtualflow": {}, "vf_has_sharded": vf_has_sharded()}
    kw = dict(max_other_cores=args.max_other_cores, retries=args.retries, quiet_wait_s=args.quiet_wait)
    out["emulation"]["pairs"] = [
        H.run_pair({m: (lambda m=m: measure_step_variant(m, args.steps)) for m in ("allreduce", "sharded")},
                   H.pair_order(rep, "allreduce", "sharded"), label=f"emulation pair {rep}", **kw)
        for rep in range(args.step_reps)]
    if out["vf_has_sharded"]:
        out["virtualflow"]["pairs"] = [
            H.run_pair({red: (lambda red=red: measure_vf(red, args.vf_steps)) for red in ("allreduce", "sharded")},
                       H.pair_order(rep, "allreduce", "sharded"), label=f"virtualflow pair {rep}", **kw)
            for rep in range(args.step_reps)]
    for mode in ("ddp", "zero", "fsdp2"):
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            out["torch"][mode] = measure_step_variant(mode, args.steps)
        out["torch"][mode]["other_load_cores"] = meter.other_cores
    return out
