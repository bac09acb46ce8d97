"""(1) Collectives: the ring reduce-scatter / all-gather against gloo's, per vector size, in two
child ranks (:func:`collectives_rank`), and the launcher's side (:func:`measure_collectives`).
"""

from __future__ import annotations

import time

import torch

from bench import harness as H
from bench.coconet.workload import WORLD
from bench.coconet.children import launch_pair, store_client


# --------------------------------------------------------------------------------------------
# (1) Collectives.


def collectives_rank(cfg: dict) -> dict:
    from virtualflow.comm.groups import make_group
    from virtualflow.comm.ring import Collectives, Ledger, ring_traffic
    from virtualflow.plan.shards import shard_bounds

    torch.set_num_threads(1)
    rank, p = cfg["rank"], WORLD
    store = store_client(cfg["port"])
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
    ranks = launch_pair("--child-collectives", {"sizes": sizes, "reps": args.reps, "warmup": args.warmup})
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
