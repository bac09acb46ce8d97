"""The deterministic exchange alone, in worker processes: the CPU one exchange costs all of them,
against gloo's ring all-reduce of the same vector (``bench.deterministic``'s ``exchange`` part).

On a machine with fewer cores than workers, the workers' CPU is their step time, so this is where
deterministic mode's extra time at W = 3 comes from, without the model's compute around it. Each
of ``workers`` processes (spawned, one thread, a gloo group over loopback) runs, ``reps`` times:
``steps`` gloo all-reduces of a ``numel``-element float32 vector (the default mode's exchange),
then ``steps`` ``owners`` exchanges of the partial sums its VNs give under each VN map asked for
(:class:`~virtualflow.comm.exchange.OwnerExchange`: begin, send every partial, finish, as the
engine's step does after its last backward, its chunks cut as the runtime cuts them on one machine) and, per map, the *point-to-point floor*: the same
messages' bytes as plain gloo ``send``/``recv`` calls from one thread, one message per partial sum
and owner, each owner adding every partial's chunk into one buffer, then sending it to every
other worker (no segments, no send thread, no tree order: what gloo's point-to-point path costs
for those bytes and additions with next to no Python around it). Figures: CPU seconds (``time.process_time``) per
exchange summed over the processes, and wall seconds per exchange on rank 0, from the last
repetition (the first pays for page faults and connections); the bytes (the most one worker
sends per exchange, and all of them together) are from the closed forms of
:mod:`virtualflow.plan.exchange`.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Sequence

__all__ = ["measure_exchange_cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, workers: int, port: int, numel: int, steps: int, reps: int,
          maps: dict[str, Sequence[Sequence[int]]], out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from virtualflow.comm.exchange import OwnerExchange
    from virtualflow.comm.groups import Group
    from virtualflow.comm.reduce import tree_reduce_local
    from virtualflow.comm.net import loopback_store
    from virtualflow.plan.exchange import OwnerSchedule, depth_for
    from virtualflow.plan.vnmap import TreePlan

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, workers, rank == 0, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("exchange_cpu", store), rank, workers, timeout)
    group = Group(0, rank, workers, pg, local=loopback_store(store))  # as the runtime's groups decide it
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(numel, generator=gen)
    runs: dict[str, Any] = {"gloo all-reduce": None}
    for name, assignment in maps.items():
        plan = TreePlan.build([list(a) for a in assignment])
        vns = plan.per_worker[rank]
        local = tree_reduce_local(vns, lambda i: torch.randn(numel, generator=gen)) if vns else {}
        ex = OwnerExchange(OwnerSchedule.build(plan, numel, depth=depth_for(group.local)), group)
        runs[name] = (ex, local)
        counts = [len(tree_reduce_local(plan.per_worker[r], lambda i: torch.zeros(1))) if plan.per_worker[r] else 0
                  for r in range(workers)]
        runs[f"p2p floor {name}"] = _Floor(pg, rank, workers, numel, list(local.values()), counts)
    result: dict[str, Any] = {}
    for name, held in runs.items():
        for _ in range(reps):
            pg.barrier().wait()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                if held is None:
                    pg.allreduce([grad]).wait()
                elif isinstance(held, _Floor):
                    held.run()
                else:
                    ex, local = held
                    ex.begin()
                    for node, vec in local.items():
                        ex.send(node, vec)
                    ex.finish(local)
            c1, t1 = time.process_time(), time.perf_counter()
            result[name] = {"cpu_s": (c1 - c0) / steps, "wall_s": (t1 - t0) / steps}
        if isinstance(held, tuple):
            ex, local = held
            result[name]["partials"] = len(local)
            held[0].close()
    pg.barrier().wait()
    out.put((rank, result))


class _Floor:
    """The point-to-point floor of one VN map on one rank (see the module docstring)."""

    def __init__(self, pg: Any, rank: int, workers: int, numel: int, partials: list, counts: list[int]) -> None:
        import torch

        self.pg, self.rank, self.workers, self.partials, self.counts = pg, rank, workers, partials, counts
        self.bounds = [(numel * j // workers, numel * (j + 1) // workers) for j in range(workers)]
        a, b = self.bounds[rank]
        self.inbox = {src: [torch.empty(b - a) for _ in range(counts[src])] for src in range(workers) if src != rank}
        self.acc = torch.empty(b - a)
        self.result = torch.empty(numel)

    def run(self) -> None:
        pg, rank, others = self.pg, self.rank, [j for j in range(self.workers) if j != self.rank]
        arriving = [pg.recv([buf], src, 11) for src in others for buf in self.inbox[src]]
        sent = [pg.send([p[slice(*self.bounds[j])]], j, 11) for p in self.partials for j in others]
        a, b = self.bounds[rank]
        held = [p[a:b] for p in self.partials] + [buf for src in others for buf in self.inbox[src]]
        self.acc.copy_(held[0])
        k = len(self.partials)
        for i, x in enumerate(held[1:], 1):
            if i >= k:
                arriving[i - k].wait()
            self.acc.add_(x)
        results = [pg.recv([self.result[slice(*self.bounds[j])]], j, 12) for j in others]
        sent += [pg.send([self.acc], j, 12) for j in others]
        for w in results + sent:
            w.wait()


def measure_exchange_cpu(workers: int, numel: int, maps: dict[str, Sequence[Sequence[int]]], *, steps: int,
                         reps: int = 2) -> dict[str, dict[str, float]]:
    """Per exchange (``gloo all-reduce`` and each of ``maps``, a name -> VN map): the CPU
    seconds all ``workers`` processes spend, rank 0's wall seconds, the most partial sums one
    worker holds, and the bytes the most one worker sends and all send (float32)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, workers, port, numel, steps, reps, maps, out), daemon=True)
             for r in range(workers)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    from virtualflow.plan.exchange import owners_traffic_closed_form, ring_allreduce_bytes
    from virtualflow.plan.vnmap import TreePlan

    sent = {"gloo all-reduce": [ring_allreduce_bytes(numel, workers, r, 4) for r in range(workers)]}
    for name, assignment in maps.items():
        plan = TreePlan.build([list(a) for a in assignment])
        sent[name] = [owners_traffic_closed_form(plan, numel, r, 4)[0] for r in range(workers)]
        sent[f"p2p floor {name}"] = sent[name]
    return {n: {"cpu_s": sum(got[r][n]["cpu_s"] for r in got), "wall_s": got[0][n]["wall_s"],
                "partials": max(got[r][n].get("partials", 1) for r in got), "bytes": max(sent[n]),
                "total_bytes": sum(sent[n])} for n in got[0]}
