"""CoCoNeT (issue 15): our ring reduce-scatter against gloo's, and the sharded data-parallel step
against all-reduce + full Adam.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.coconet            # about 6-9 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.coconet --quick    # about 2 minutes

**(1) Collectives** (2 ranks, float32, 10 M / 30 M / 100 M elements, even chunks). Two fresh
processes (``python -m bench.coconet --child-collectives JSON``, 1 thread each) build a gloo group
with ``virtualflow.comm.groups.make_group`` on a TCPStore the launcher hosts on a free port.
Methods, interleaved repetition by repetition (order rotated), each preceded by a small untimed
all-reduce as a barrier; a repetition's time is the slower rank's; median over repetitions after
the warm-up ones:

* ``ring``: :class:`virtualflow.comm.ring.Collectives` ``reduce_scatter`` (in place, synchronous);
* ``gloo_reduce_scatter``: gloo's own ``ProcessGroup.reduce_scatter`` (what
  ``torch.distributed.reduce_scatter`` calls; list of chunk views in, one chunk out);
* ``gloo_reduce_scatter_base``: gloo's ``_reduce_scatter_base`` (``reduce_scatter_tensor``);
* ``gloo_all_reduce``: gloo's all-reduce of the whole vector (the cost of doing it the old way).

Target (issue): ring >= 1.8x faster than gloo's reduce-scatter (key ``rs_speedup``; the faster of
gloo's two reduce-scatter entry points). All-gather likewise (``ring_ag`` vs ``gloo_allgather``
and ``gloo_allgather_base``), reported without a target. The ring's ledger bytes are checked
against the closed form (N - N/p) * 4 per rank.

**(2) Sharded data-parallel step** (2 processes, an MLP of 25 M parameters, Adam): the sharded
step (reduce-scatter -> Adam on the local slice -> all-gather) against all-reduce + full Adam.
Targets: step time ratio sharded / all-reduce <= 1.00 (key ``step_ratio``), optimizer-state tensor
bytes ÷ p (key ``opt_bytes_ratio``: full / sharded >= 0.99 p), and the peak RSS saving at least
80 % of the optimizer bytes saved (key ``rss_saving_fraction``). Measured through
``virtualflow.train(..., reduction="sharded")`` against the default ``reduction="allreduce"`` when the
installed virtualflow has that option (step times from ``Result.history``, peak RSS from
``Result.peak_rss_mib``); without it, through a plain-torch emulation in two processes (flat
gradient and parameter buffers; gloo all-reduce + ``torch.optim.Adam`` on every parameter, against
ring reduce-scatter + Adam on the local slice + ring all-gather), said so in the output. The
emulation runs in either case, beside torch's own ``ZeroRedundancyOptimizer`` (DDP + ZeRO-1) and
FSDP2 (``fully_shard`` per Linear + root) on gloo, same model, data and Adam, for reference (no
target); a variant that fails on gloo records its error.

2 cores: each of the 2 processes has 1 thread; ratios are at equal worker counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn

from bench import harness as H

NAME = "coconet"
MODULE = "bench.coconet"
TARGET_KEYS = ("rs_speedup", "step_ratio", "opt_bytes_ratio", "rss_saving_fraction")
WORLD = 2
RS_TARGET = 1.8
STEP_TARGET = 1.00
RSS_SAVING_TARGET = 0.8

# The part-2 workload: the resize benchmarks' 25 M-parameter MLP with Adam, global batch 48.
WIDTHS = (1024, 4096, 4096, 1024, 10)
GLOBAL_BATCH = 48
VIRTUAL_NODES = 2
SAMPLES = 4096
LR = 1e-3


# --------------------------------------------------------------------------------------------
# Shared by the children.


def _store_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=datetime.timedelta(seconds=120))


def _launch_pair(flag: str, cfg: dict, timeout_s: float = 400.0) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    procs = [H.spawn_child(MODULE, [flag, json.dumps({**cfg, "rank": r, "port": store.port})], 1)
             for r in range(WORLD)]
    out = H.collect_children(procs, f"{flag} rank", timeout_s=timeout_s)
    del store
    return sorted(out, key=lambda r: r["rank"])


# --------------------------------------------------------------------------------------------
# (1) Collectives.


def collectives_rank(cfg: dict) -> dict:
    from virtualflow.comm.groups import make_group
    from virtualflow.comm.ring import Collectives, Ledger, ring_traffic
    from virtualflow.plan.shards import shard_bounds

    torch.set_num_threads(1)
    rank, p = cfg["rank"], WORLD
    store = _store_client(cfg["port"])
    group = make_group(store, 0, rank, p, 120.0, torch.device("cpu"))
    pg = group.pg
    ledger = Ledger()
    coll = Collectives(group, ledger)
    tick = torch.zeros(1)
    results = {}
    for n in cfg["sizes"]:
        bounds = shard_bounds(n, p)
        lo, hi = bounds[rank]
        base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        x = torch.empty(n)
        out = torch.empty(hi - lo)
        mine = torch.empty(hi - lo)
        views = [x[a:b] for a, b in bounds]

        def rs_ring():
            coll.reduce_scatter(x, bounds)

        def rs_gloo():
            pg.reduce_scatter([out], [views]).wait()

        def rs_gloo_base():
            pg._reduce_scatter_base(out, x).wait()

        def ar_gloo():
            pg.allreduce([x]).wait()

        def ag_ring():
            coll.all_gather(x, bounds)

        def ag_gloo():
            pg.allgather([views], [mine]).wait()

        def ag_gloo_base():
            pg._allgather_base(x, x[lo:hi]).wait()

        methods = {"ring": rs_ring, "gloo_reduce_scatter": rs_gloo, "gloo_reduce_scatter_base": rs_gloo_base,
                   "gloo_all_reduce": ar_gloo, "ring_ag": ag_ring, "gloo_allgather": ag_gloo,
                   "gloo_allgather_base": ag_gloo_base}
        names = list(methods)
        times: dict[str, list[float]] = {m: [] for m in names}
        ledger.clear()
        for rep in range(cfg["warmup"] + cfg["reps"]):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                x.copy_(base)
                mine.copy_(base[lo:hi])
                pg.allreduce([tick]).wait()  # barrier, untimed
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
        # correctness of the last ring reduce-scatter, against gloo's (same inputs)
        x.copy_(base)
        coll.reduce_scatter(x, bounds)
        ring_chunk = x[lo:hi].clone()
        x.copy_(base)
        rs_gloo()
        rs = ledger.by_op()["reduce_scatter"]
        want = ring_traffic("reduce_scatter", bounds, rank, 4)
        results[str(n)] = {
            "times": {m: t[cfg["warmup"]:] for m, t in times.items()},
            "max_abs_diff_vs_gloo": float((ring_chunk - out).abs().max()),
            "ring_bytes_sent_per_op": rs["bytes_sent"] / rs["count"],
            "ring_bytes_received_per_op": rs["bytes_received"] / rs["count"],
            "ring_messages_per_op": rs["messages"] / rs["count"],
            "formula_bytes_sent": want.bytes_sent,
            "formula_bytes_received": want.bytes_received,
        }
    coll.close()
    pg.allreduce([tick]).wait()
    group.close()
    return {"rank": rank, "results": results, "vmhwm_mib": H.vmhwm_mib()}


def measure_collectives(args) -> dict:
    sizes = [int(s * 1_000_000) for s in args.sizes]
    ranks = _launch_pair("--child-collectives", {"sizes": sizes, "reps": args.reps, "warmup": args.warmup})
    out = {}
    for n in sizes:
        rs = [r["results"][str(n)] for r in ranks]
        methods = rs[0]["times"].keys()
        per_rep = {m: [max(ts) for ts in zip(*(r["times"][m] for r in rs))] for m in methods}
        med = {m: H.median(v) for m, v in per_rep.items()}
        gloo_rs = min(med["gloo_reduce_scatter"], med["gloo_reduce_scatter_base"])
        gloo_ag = min(med["gloo_allgather"], med["gloo_allgather_base"])
        out[str(n)] = {
            "numel": n, "mbytes": n * 4 / 1e6, "median_s": med, "per_rep_s": per_rep,
            "rs_speedup": gloo_rs / med["ring"],
            "rs_speedup_vs_list": med["gloo_reduce_scatter"] / med["ring"],
            "rs_speedup_vs_base": med["gloo_reduce_scatter_base"] / med["ring"],
            "rs_speedup_vs_all_reduce": med["gloo_all_reduce"] / med["ring"],
            "ag_speedup": gloo_ag / med["ring_ag"],
            "ring_rs_algbw_gbps": n * 4 / med["ring"] / 1e9,
            "max_abs_diff_vs_gloo": max(r["max_abs_diff_vs_gloo"] for r in rs),
            "ring_bytes_sent_per_op": [r["ring_bytes_sent_per_op"] for r in rs],
            "formula_bytes_sent": [r["formula_bytes_sent"] for r in rs],
            "ring_bytes_ok": all(r["ring_bytes_sent_per_op"] == r["formula_bytes_sent"]
                                 and r["ring_bytes_received_per_op"] == r["formula_bytes_received"] for r in rs),
            "ring_messages_per_op": rs[0]["ring_messages_per_op"],
        }
    return {"sizes": out, "vmhwm_mib": [r["vmhwm_mib"] for r in ranks]}


# --------------------------------------------------------------------------------------------
# (2) The sharded step: the workload, plain-torch variants, and virtualflow.train.


def coconet_model() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def coconet_data():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, WIDTHS[0], generator=g)
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def coconet_adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _proc_status_mib(name: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def coconet_memory(model: nn.Module) -> dict[str, float]:
    """``Job.evaluate`` (rank 0, every ``EVAL_EVERY`` steps and after the last): the worker's peak
    and current resident memory."""
    return {"vmhwm_mib": _proc_status_mib("VmHWM"), "vmrss_mib": _proc_status_mib("VmRSS")}


EVAL_EVERY = 4


def coconet_job():
    """The part-2 job for virtualflow.train (imported by the worker processes)."""
    import virtualflow as vf

    return vf.Job(model=coconet_model, optimizer=coconet_adam, loss=H.cross_entropy, dataset=coconet_data,
                  global_batch_size=GLOBAL_BATCH, virtual_nodes=VIRTUAL_NODES, seed=H.SEED,
                  evaluate=coconet_memory, eval_every=EVAL_EVERY, name="coconet")


def param_count() -> int:
    return sum(p.numel() for p in coconet_model().parameters())


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
    per_epoch = len(X) // GLOBAL_BATCH
    for step in range(steps):
        e, i = divmod(step, per_epoch)
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(H.SEED + e))
        idx = order[i * GLOBAL_BATCH + rank * local: i * GLOBAL_BATCH + (rank + 1) * local]
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
    store = _store_client(cfg["port"])
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
        ranks = _launch_pair("--child-step", {"mode": mode, "steps": steps})
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
    from virtualflow.options import LaunchOptions

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


def steady(times: list[float], warmup: int) -> float:
    return H.median(times[warmup:] or times)


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


# --------------------------------------------------------------------------------------------
# Summary, targets, report.


def summarize_step(m: dict, warmup: int, targets: H.Targets | None) -> dict:
    n_params = param_count()
    full_opt_bytes = 2 * n_params * 4
    s: dict = {"params": n_params, "full_adam_state_bytes": full_opt_bytes}
    em = m["emulation"]["pairs"]
    ok = all("error" not in r[k] for r in em for k in r)
    rows = {}
    if ok:
        ratios = [steady(r["sharded"]["step_times"], warmup) / steady(r["allreduce"]["step_times"], warmup) for r in em]
        for mode in ("allreduce", "sharded"):
            rows[mode] = {
                "step_s": H.median([steady(r[mode]["step_times"], warmup) for r in em]),
                "vmhwm_mib": [H.median([r[mode]["vmhwm_mib"][k] for r in em]) for k in range(WORLD)],
                "opt_state_bytes": em[0][mode]["opt_state_bytes"],
            }
        s["emulation"] = {
            "step_ratio": H.median(ratios), "per_pair_ratios": ratios, "rows": rows,
            "pair_other_load_cores": [max(r[k].get("other_load_cores", float("nan")) for k in r) for r in em],
            "same_model": em[0]["allreduce"]["param_head"] is not None and max(
                abs(a - b) for a, b in zip(em[0]["allreduce"]["param_head"], em[0]["sharded"]["param_head"])),
            "checksums": [em[0]["allreduce"]["checksum"], em[0]["sharded"]["checksum"]],
            "sharded_ledger_rank0": em[0]["sharded"]["ledger"],
        }
    else:
        s["emulation"] = {"error": [r[k].get("error") for r in em for k in r if "error" in r[k]]}
    s["torch"] = {}
    for mode, r in m["torch"].items():
        if "error" in r:
            s["torch"][mode] = {"error": r["error"]}
        else:
            s["torch"][mode] = {"step_s": steady(r["step_times"], warmup), "vmhwm_mib": r["vmhwm_mib"],
                                "opt_state_bytes": r["opt_state_bytes"]}
    vf_pairs = m["virtualflow"].get("pairs")
    if vf_pairs:
        errs = [r[k]["error"] for r in vf_pairs for k in r if "error" in r[k]]
        if errs:
            s["virtualflow"] = {"error": errs}
        else:
            vf_ratios = [steady(r["sharded"]["step_times"], warmup) / steady(r["allreduce"]["step_times"], warmup)
                         for r in vf_pairs]
            s["virtualflow"] = {
                "step_ratio": H.median(vf_ratios), "per_pair_ratios": vf_ratios,
                "pair_other_load_cores": [max(r[k].get("other_load_cores", float("nan")) for k in r) for r in vf_pairs],
                "rows": {red: {"step_s": H.median([steady(r[red]["step_times"], warmup) for r in vf_pairs]),
                               "peak_rss_mib": [H.median([r[red]["peak_rss_mib"][k] for r in vf_pairs])
                                                for k in range(WORLD)],
                               "training_vmhwm_rank0_mib": H.median([r[red]["training_vmhwm_rank0_mib"]
                                                                     for r in vf_pairs]),
                               "gathered_opt_state_bytes": vf_pairs[0][red]["gathered_opt_state_bytes"],
                               "optimizer_bytes": vf_pairs[0][red]["optimizer_bytes"]}
                         for red in ("allreduce", "sharded")},
                "checksums": [vf_pairs[0]["allreduce"]["checksum"], vf_pairs[0]["sharded"]["checksum"]],
            }
    # Which measurement the targets read: virtualflow.train when it has the option, else the emulation.
    src = "virtualflow" if "step_ratio" in s.get("virtualflow", {}) else "emulation"
    s["targets_from"] = src
    if targets is not None:
        t = targets
        how = ("virtualflow.train reduction='sharded' vs 'allreduce'" if src == "virtualflow"
               else "plain-torch emulation (virtualflow.train has no reduction='sharded' yet): ring RS + Adam on "
                    "the slice + ring AG vs gloo all-reduce + full Adam")
        ratio = s[src].get("step_ratio", float("nan"))
        t.at_most("step_ratio", f"sharded / all-reduce step time, {how}", ratio, STEP_TARGET)
        vrows = s.get("virtualflow", {}).get("rows", {})
        full = shard = None
        bytes_where = ""
        if src == "virtualflow" and all(vrows[red]["optimizer_bytes"][k] for red in vrows for k in range(WORLD)):
            full = max(vrows["allreduce"]["optimizer_bytes"])
            shard = max(vrows["sharded"]["optimizer_bytes"])
            bytes_where = "virtualflow Result.optimizer_bytes"
        elif rows:
            full = rows["allreduce"]["opt_state_bytes"][0]
            shard = max(rows["sharded"]["opt_state_bytes"])
            bytes_where = "emulation, each rank's Adam moment tensors"
        if full is not None:
            s["opt_bytes_ratio"] = full / shard
            t.at_least("opt_bytes_ratio", f"optimizer state bytes, all-reduce / sharded (largest rank; {bytes_where}), "
                       f"p={WORLD}", full / shard, 0.99 * WORLD)
            if src == "virtualflow":
                rss_full = s["virtualflow"]["rows"]["allreduce"]["training_vmhwm_rank0_mib"]
                rss_shard = s["virtualflow"]["rows"]["sharded"]["training_vmhwm_rank0_mib"]
                where = ("virtualflow rank 0's peak RSS (VmHWM) at its last evaluation before the end of training, "
                         "i.e. before the final state is gathered and written")
            else:
                rss_full = max(rows["allreduce"]["vmhwm_mib"])
                rss_shard = max(rows["sharded"]["vmhwm_mib"])
                where = "emulation processes' peak RSS (VmHWM)"
            saved_opt_mib = (full - shard) / 2**20
            frac = (rss_full - rss_shard) / saved_opt_mib
            s["rss"] = {"full_mib": rss_full, "sharded_mib": rss_shard, "saved_mib": rss_full - rss_shard,
                        "opt_bytes_saved_mib": saved_opt_mib, "saving_fraction": frac, "where": where}
            t.at_least("rss_saving_fraction", f"peak RSS saved / Adam state saved ({where}; "
                       f"{rss_full:.0f} -> {rss_shard:.0f} MiB, state saved {saved_opt_mib:.0f} MiB)",
                       frac, RSS_SAVING_TARGET)
        else:
            t.holds("optimizer state bytes ÷ p", False, "no optimizer bytes measured (the runs failed)")
    return s


def summarize_collectives(c: dict, targets: H.Targets) -> None:
    for key, r in c["sizes"].items():
        targets.at_least("rs_speedup", f"ring reduce-scatter vs gloo reduce_scatter, {r['numel'] / 1e6:.0f} M float32, "
                         f"2 ranks (speed-up)", r["rs_speedup"], RS_TARGET)
    targets.holds("ring bytes per rank = (N - N/p) * 4 (ledger vs closed form)",
                  all(r["ring_bytes_ok"] for r in c["sizes"].values()))


def collectives_table(c: dict) -> tuple[list[str], list[list]]:
    header = ["N (M fp32)", "ring RS ms", "gloo reduce_scatter ms", "gloo _reduce_scatter_base ms",
              "gloo all_reduce ms", "RS speed-up", ">= 1.8", "vs all-reduce", "ring AG ms", "gloo allgather ms",
              "gloo _allgather_base ms", "AG speed-up", "ring RS GB/s"]
    rows = []
    for r in c["sizes"].values():
        m = r["median_s"]
        rows.append([f"{r['numel'] / 1e6:.0f}", H.ms(m["ring"]), H.ms(m["gloo_reduce_scatter"]),
                     H.ms(m["gloo_reduce_scatter_base"]), H.ms(m["gloo_all_reduce"]), f"{r['rs_speedup']:.2f}",
                     H.yes_no(r["rs_speedup"] >= RS_TARGET), f"{r['rs_speedup_vs_all_reduce']:.2f}",
                     H.ms(m["ring_ag"]), H.ms(m["gloo_allgather"]), H.ms(m["gloo_allgather_base"]),
                     f"{r['ag_speedup']:.2f}", f"{r['ring_rs_algbw_gbps']:.2f}"])
    return header, rows


def step_table(s: dict) -> tuple[list[str], list[list]]:
    header = ["variant", "step ms", "vs all-reduce", "peak RSS MiB (r0, r1)", "optimizer state MiB (r0, r1)",
              "vf: r0 training peak RSS MiB"]
    rows = []
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    em = s.get("emulation", {})
    base = em.get("rows", {}).get("allreduce", {}).get("step_s")
    for mode, label in (("allreduce", "emulation: gloo all-reduce + full Adam"),
                        ("sharded", "emulation: ring RS + Adam on slice + ring AG")):
        r = em.get("rows", {}).get(mode)
        if r:
            rows.append([label, H.ms(r["step_s"]), f"{em['step_ratio'] if mode == 'sharded' else 1.0:.3f}",
                         ", ".join(f"{v:.0f}" for v in r["vmhwm_mib"]), ", ".join(mib(b) for b in r["opt_state_bytes"]),
                         ""])
    vf_rows = s.get("virtualflow", {}).get("rows", {})
    for red in ("allreduce", "sharded"):
        r = vf_rows.get(red)
        if r:
            ratio = s["virtualflow"]["step_ratio"] if red == "sharded" else 1.0
            rows.append([f"virtualflow.train reduction={red!r}", H.ms(r["step_s"]), f"{ratio:.3f}",
                         ", ".join(f"{v:.0f}" for v in r["peak_rss_mib"]),
                         ", ".join(mib(b) if b else "?" for b in r["optimizer_bytes"]),
                         f"{r['training_vmhwm_rank0_mib']:.0f}"])
    for mode, label in (("ddp", "torch DDP + Adam"), ("zero", "torch DDP + ZeroRedundancyOptimizer(Adam)"),
                        ("fsdp2", "torch FSDP2 fully_shard + Adam")):
        r = s["torch"].get(mode, {})
        if "error" in r:
            rows.append([label, "error: " + r["error"][:120], "", "", "", ""])
        elif r:
            rows.append([label, H.ms(r["step_s"]), f"{r['step_s'] / base:.3f}" if base else "",
                         ", ".join(f"{v:.0f}" for v in r["vmhwm_mib"]), ", ".join(mib(b) for b in r["opt_state_bytes"]),
                         ""])
    return header, rows


def markdown(run: H.Run, args, c: dict | None, s: dict | None, load: dict) -> str:
    parts = ["# coconet: ring reduce-scatter vs gloo, sharded step vs all-reduce + Adam\n", H.env_markdown(), "",
             "Machine load (CPU cores used by other processes while each part ran): "
             + ", ".join(f"{k} {v:.2f}" for k, v in load.items()) + ".", ""]
    if c:
        h, rows = collectives_table(c)
        parts += ["## (1) Collectives, 2 ranks, gloo over loopback",
                  f"Median over {args.reps} interleaved repetitions ({args.warmup} warm-up) of the slower rank's time. "
                  "`RS speed-up` = the faster of gloo's two reduce-scatter entry points / our ring (target >= 1.8); "
                  "`vs all-reduce` = gloo all-reduce of the whole vector / our ring reduce-scatter. gloo's "
                  "reduce-scatter is an all-reduce underneath (it moves twice a ring reduce-scatter's bytes). "
                  "Ring bytes per rank per op (ledger) = (N - N/p) x 4 = the closed form: "
                  f"{'yes' if all(r['ring_bytes_ok'] for r in c['sizes'].values()) else 'NO'}.", "",
                  H.md_table(h, rows), ""]
    if s:
        h, rows = step_table(s)
        em = s.get("emulation", {})
        parts += ["## (2) Sharded data-parallel step",
                  f"Workload: MLP {'-'.join(map(str, WIDTHS))} ReLU ({s['params'] / 1e6:.1f} M params), Adam lr={LR}, "
                  f"global batch {GLOBAL_BATCH} (half per process), 2 processes x 1 thread; {args.steps} steps per run "
                  f"({args.warmup_steps} warm-up), {args.step_reps} interleaved pairs (a pair during which other processes "
                  f"used more than {args.max_other_cores} cores is measured again, {args.retries} time(s) at most); "
                  f"a step's time = the slower rank's (virtualflow: `Result.history`'s `step_time_s`); `step ms` = median over "
                  f"the pairs of each run's median; `vs all-reduce` = the median of the pairs' ratios (sharded rows; "
                  f"the target), torch rows: their median / the emulated all-reduce's. Full Adam state = 2 x params x 4 B = {s['full_adam_state_bytes'] / 2**20:.0f} MiB.",
                  "",
                  f"Targets read from: **{s['targets_from']}**"
                  + ("" if s["targets_from"] == "virtualflow" else
                     " (virtualflow.train had no reduction='sharded' when this ran: a plain-torch emulation of the "
                     "sharded step stands in for it)") + ".", "",
                  H.md_table(h, rows), ""]
        if "step_ratio" in em:
            parts.append(f"Emulation: per-pair ratios {', '.join(f'{x:.3f}' for x in em['per_pair_ratios'])} (other "
                         f"load {', '.join(f'{x:.2f}' for x in em['pair_other_load_cores'])} cores); "
                         f"first 8 parameters differ by at most {em['same_model']:.1e} between the two (same model).")
        if "step_ratio" in s.get("virtualflow", {}):
            v = s["virtualflow"]
            parts.append(f"virtualflow.train: per-pair ratios {', '.join(f'{x:.3f}' for x in v['per_pair_ratios'])} "
                         f"(other load {', '.join(f'{x:.2f}' for x in v['pair_other_load_cores'])} cores); "
                         f"final state checksums {v['checksums'][0]:.6f} (allreduce), {v['checksums'][1]:.6f} (sharded).")
        elif "error" in s.get("virtualflow", {}):
            parts.append(f"virtualflow.train failed: {s['virtualflow']['error']}")
        if "rss" in s:
            r = s["rss"]
            parts.append(f"Peak RSS: {r['full_mib']:.0f} MiB (all-reduce) vs {r['sharded_mib']:.0f} MiB (sharded), "
                         f"{r['saved_mib']:.0f} MiB saved of the {r['opt_bytes_saved_mib']:.0f} MiB of Adam state "
                         f"sharded away ({r['where']}).")
        parts.append("Peak RSS columns: each process's own VmHWM at its end (virtualflow: `Result.peak_rss_mib`, "
                     "read when the worker exits, i.e. including writing the final state, which gathers the whole "
                     "optimizer state in a sharded run); `vf: r0 training peak` is rank 0's VmHWM read by "
                     f"`Job.evaluate` at its last periodic evaluation before the end (every {EVAL_EVERY} steps; the evaluation "
                     "after the last step comes after a sharded run has gathered the whole optimizer state for the "
                     "final state, so it is not used). Optimizer state = the "
                     "bytes of each rank's own Adam moment tensors (virtualflow rows: `Result.optimizer_bytes`, step counters "
                     "included).")
        parts.append("ZeroRedundancyOptimizer assigns whole parameters to ranks (its state is only as even as the "
                     "parameter sizes allow); FSDP2 shards every parameter and all-gathers it per layer.")
    parts += ["", f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=9, reps_help="timed repetitions per collective and size", quiet_wait=60.0)
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per collective and size")
    p.add_argument("--sizes", type=lambda t: [float(x) for x in t.split(",")], default=[10, 30, 100],
                   help="vector sizes in millions of float32 (comma-separated)")
    p.add_argument("--steps", type=int, default=24, help="steps per plain-torch run")
    p.add_argument("--vf-steps", type=int, default=24, help="steps per virtualflow.train run")
    p.add_argument("--warmup-steps", type=int, default=4, help="steps left out of the medians")
    p.add_argument("--step-reps", type=int, default=3, help="interleaved pairs of (all-reduce, sharded) runs")
    p.add_argument("--max-other-cores", type=float, default=0.3,
                   help="repeat a part-2 pair when other processes used more CPU cores than this during it")
    p.add_argument("--retries", type=int, default=1, help="repetitions of a part-2 pair measured on a busy machine")
    p.add_argument("--parts", default="1,2", help="which parts to run (1, 2 or 1,2)")
    p.add_argument("--child-collectives", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.sizes = 3, 1, [10, 30]
        args.steps = args.vf_steps = 12
        args.warmup_steps, args.step_reps, args.retries, args.quiet_wait = 3, 1, 0, min(args.quiet_wait, 10.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_collectives:
        print(json.dumps(collectives_rank(json.loads(args.child_collectives))))
        return 0
    if args.child_step:
        print(json.dumps(step_rank(json.loads(args.child_step))))
        return 0
    malloc_env = H.apply_malloc_mode("stable")
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    parts = {x.strip() for x in args.parts.split(",")}
    print(H.banner(f"coconet: ring collectives vs gloo ({WORLD} ranks); sharded step vs all-reduce + Adam"))
    payload: dict = {"benchmark": run.name, "environment": H.environment(), "allocator": malloc_env,
                     "config": {k: v for k, v in vars(args).items() if not k.startswith("child")}}
    load: dict[str, float] = {}
    c = s = None
    if "1" in parts:
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            c = measure_collectives(args)
        load["part 1"] = meter.other_cores
        summarize_collectives(c, run.targets)
        payload["collectives"] = c
        print()
        print(H.text_table(*collectives_table(c)))
    if "2" in parts:
        with H.LoadMeter() as meter:
            m = measure_step(args)
        load["part 2"] = meter.other_cores
        s = summarize_step(m, args.warmup_steps, run.targets)
        payload["step_raw"] = m
        payload["step"] = s
        print()
        print(H.text_table(*step_table(s)))
        print(f"  targets read from: {s['targets_from']}")
    payload["other_load_cores"] = load
    return run.finish(payload, markdown(run, args, c, s, load))


if __name__ == "__main__":
    sys.exit(main())
