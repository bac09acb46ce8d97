"""Communication on real links: 2-4 hosts (network namespaces, tests/hosts.py) with links limited
to 1 Gbit/s and 100 Mbit/s, each reduction's bytes counted on the wire and timed, beside what the
byte ledger and ``virtualflow explain`` predict.

    python -m bench.hosts [--quick]        (root; from the repository root)

One rank process per host (``python -m bench.hosts --rank ...`` inside the namespace) builds the
runtime's gloo group (``virtualflow.comm.groups.make_group``) over the hosts' interfaces (store on
h0's address, ``GLOO_SOCKET_IFNAME=eth0``) and runs, on command, one of:

* ``allreduce``      the default reduction: ``Group.all_reduce`` of a flat gradient (gloo's ring);
* ``sharded``        the sharded reduction's ring reduce-scatter + all-gather
                     (``virtualflow.comm.ring.Collectives``, with its byte ledger);
* ``deterministic``  deterministic mode's default exchange (``owners``,
                     ``virtualflow.comm.exchange``: each worker sends each chunk of its partial sums
                     to that chunk's owner only; owners send each unit of their chunk of the root
                     to everyone as soon as it is combined), V=8 VNs;
* ``hop``            pipeline hops: activations sent h0 -> h1 -> ... (point to point; each host
                     forwards an activation with an asynchronous send and receives the next one
                     meanwhile, as the pipeline engine does).

Bytes. The interface counters (the host's bridge port) count Ethernet frames: per frame 14 bytes
of Ethernet, 20 of IPv4 and 32 of TCP (20 + a 12-byte timestamp option) ahead of the payload
(veth offloads may count a TSO/GRO super-frame once, with one set of headers: counting frames
handles both). So each host's **payload** = bytes - 66 x frames, and **equal** means: the
payload every host sent during the op equals the prediction within 0.5 % plus 4 KiB per op (gloo's
own per-message preamble and a stray ARP frame are the only other bytes on these links). The
wire overhead (headers of data frames, and the ACK frames a host sends for what it receives)
is reported beside it.

Time. tbf counts Ethernet frames against the rate, so a host's link needs (payload sent x
(1 + 66/1448)) + (payload received x 66/(2 x 1448)) bytes each way (full 1448-byte segments,
one delayed ACK per two) at its rate. The prediction is an alpha-beta model: the op's fixed cost
(alpha: the same op on 1 KiB, timed on the same hosts: the latency of its sequential messages,
which on a loaded machine includes waiting to be scheduled) plus the busiest host direction's
bytes / rate (beta). Hops run one after another; timed repetitions stream through the chain as
micro-batches do. The owners exchange's beta is its schedule's model
(``virtualflow.plan.exchange.owners_seconds``: every link's bytes, or the first phase followed by
the last unit's second phase, whichever is longer; the second phase is pipelined per unit).
Measured: each repetition of a collective or exchange starts from a common point (a one-element
all-reduce before it, untimed: a step's reduction starts when the workers' backward passes end, not
while the previous one's last bytes are still arriving) and is timed by its slowest rank; its
buffers, and the owners exchange with its schedule, are made before the timing, once, as the
runtime makes them once per generation. The hops stream all their repetitions after one common
start, nine streams per measurement. Seconds per op: the median over the repetitions (nine in the
full run; the hops: over the streams, each stream's seconds per activation, five activations per
stream); target within 15 %.

Every figure in bench/results/hosts.* was measured on a shared 2-core machine: a loaded one
(the markdown records the other load); CPU-bound copies keep 1 Gbit/s from its line rate there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import harness as H

HEADER = 14 + 20 + 32
"""Ethernet + IPv4 + TCP with timestamps, per frame."""
MSS = 1500 - 20 - 32
"""TCP payload of a full frame on a 1500-byte MTU with timestamps."""
V = 8
"""Virtual nodes of the deterministic exchange."""
OPS = ("allreduce", "sharded", "deterministic", "hop")
PORT = 29471
BYTES_REL, BYTES_ABS = 0.005, 4096
TIME_TOL = 0.15
STREAMS = 9
"""Streams of hops timed per measurement (each of ``reps`` activations)."""
SMALL = 256
"""Elements of the op that measures its fixed cost (1 KiB)."""
REPS = 9
"""Timed repetitions of a collective or exchange in the full run, of which the median is taken
(single repetitions at 100 Mbit/s scatter by 10-20 %: docs/benchmarks.md)."""
HOP_ACTIVATIONS = 5
"""Activations per stream of hops in the full run (a longer stream is a different measurement: the
pipeline's fill weighs less in it; the median is over the :data:`STREAMS`)."""


# ---------------------------------------------------------------------------------------------
# The rank process (inside a host).


def rank_main(rank: int, world: int, store_host: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from virtualflow.comm.groups import make_group
    from virtualflow.comm.exchange import OwnerExchange
    from virtualflow.plan.exchange import OwnerSchedule, depth_for
    from virtualflow.comm.ring import Collectives, Ledger
    from virtualflow.plan.shards import shard_bounds
    from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

    torch.set_num_threads(1)
    store = dist.TCPStore(store_host, PORT, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    group = make_group(store, 0, rank, world, 120.0, torch.device("cpu"))
    ledger = Ledger()
    coll = Collectives(group, ledger)
    plan = TreePlan.build(contiguous_assignment(V, world))
    print("ready", flush=True)

    def prepare(op: str, n: int) -> Callable[[], None]:
        """One op on ``n`` elements, with its buffers (and the exchange, with its schedule) made
        beforehand, once, as the runtime makes them once per generation: the timed part is the op."""
        if op == "allreduce":
            x = torch.ones(n)
            return lambda: group.all_reduce(x)
        if op == "sharded":
            x, bounds = torch.ones(n), shard_bounds(n, world)

            def sharded() -> None:
                coll.reduce_scatter(x, bounds)
                coll.all_gather(x, bounds)
            return sharded
        if op == "deterministic":
            ex = OwnerExchange(OwnerSchedule.build(plan, n, depth=depth_for(group.local)), group)  # as the runtime cuts
            local = {node: torch.ones(n) for node in plan.per_worker[rank]}

            def exchange() -> None:
                ex.begin()
                for node, vec in local.items():
                    ex.send(node, vec)
                ex.finish(local)
            return exchange
        raise ValueError(op)

    def hops(bufs: list) -> None:
        """The activations down the chain: receive one, forward it asynchronously, receive the
        next while it goes out (the links stream, as a pipeline's micro-batches do)."""
        pending = []
        for x in bufs:
            if rank > 0:
                group.recv(x, rank - 1)
            if rank < world - 1:
                pending.append(group.isend(x, rank + 1))
        for w in pending:
            w.wait()

    def barrier() -> None:
        group.all_reduce(torch.zeros(1))

    prepared: dict[tuple[str, int], Callable[[], None]] = {}
    for line in sys.stdin:
        verb, op, n, reps = line.split()
        n, reps = int(n), int(reps)
        if verb == "quit":
            break
        ledger.clear()
        per = []
        if op == "hop":  # streams of ``reps`` activations, each timed whole, per activation
            bufs = [torch.ones(n) for _ in range(reps)]
            for _ in range(STREAMS):
                barrier()
                t0 = time.perf_counter()
                hops(bufs)
                per.append((time.perf_counter() - t0) / reps)
        else:  # each repetition from a common start, as a step's exchange starts after its backward
            if (op, n) not in prepared:  # (the warm-up's: its buffers faulted in)
                prepared[(op, n)] = prepare(op, n)
            run_op = prepared[(op, n)]
            for _ in range(reps):
                barrier()
                t0 = time.perf_counter()
                run_op()
                per.append(time.perf_counter() - t0)
        barrier()
        print(json.dumps({"per": per, "ledger_sent": ledger.totals().get("bytes_sent", 0.0)}), flush=True)
    coll.close()
    group.close()


# ---------------------------------------------------------------------------------------------
# Predictions.


def predicted_payload(op: str, n: int, world: int) -> tuple[list[int], str]:
    """Bytes each rank sends in one op, and where the number comes from."""
    from virtualflow.plan.comm.ledger import comm_ledger, totals
    from virtualflow.plan.comm.rewrites import apply
    from virtualflow.plan.comm.workloads import dp_adam
    from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

    if op == "allreduce":
        return totals(comm_ledger(dp_adam(shapes=((n,),)), world))[0], "explain dp_adam (all_reduce)"
    if op == "sharded":
        prog = apply(dp_adam(shapes=((n,),)), ["split", "reorder"])
        return totals(comm_ledger(prog, world))[0], "explain dp_adam --rewrites split,reorder"
    if op == "deterministic":
        from virtualflow.plan.exchange import owners_traffic_closed_form

        plan = TreePlan.build(contiguous_assignment(V, world))
        return ([owners_traffic_closed_form(plan, n, r, 4)[0] for r in range(world)],
                "plan.exchange's closed form of the owners exchange")
    return [4 * n if r < world - 1 else 0 for r in range(world)], "the activation's bytes per hop"


def wire_need(sent: float, received: float) -> float:
    """Bytes a host's link carries in the sending direction: its data frames and the ACKs for
    what it receives (one per two full segments)."""
    return sent * (1 + HEADER / MSS) + received * HEADER / (2 * MSS)


def predicted_received(op: str, n: int, world: int, sent: list[int]) -> list[int]:
    """Bytes each rank receives in one op: as many as it sends for the ring collectives; the owners
    exchange's closed form (a worker holding more partial sums sends more than it receives)."""
    if op == "deterministic":
        from virtualflow.plan.exchange import owners_traffic_closed_form
        from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

        plan = TreePlan.build(contiguous_assignment(V, world))
        return [owners_traffic_closed_form(plan, n, r, 4)[1] for r in range(world)]
    return list(sent)


def predicted_time(op: str, sent: list[int], received: list[int], rate_mbit: float, reps: int,
                   numel: int = 0) -> float:
    """Seconds the op's bytes need on the links (without its fixed cost): the busiest direction of
    any host's link bounds a collective (a host's link carries what it sends one way and what it
    receives the other, each with the other direction's ACKs); the owners exchange (``numel``
    elements) by its schedule's model, on the same links. The hops' timed repetitions stream
    through the chain as a pipeline's micro-batches do: (reps + hops - 1) / reps hops per op."""
    rate = rate_mbit * 1e6 / 8
    if op == "deterministic":
        from virtualflow.plan.exchange import OwnerSchedule, owners_seconds
        from virtualflow.plan.vnmap import TreePlan, contiguous_assignment

        plan = TreePlan.build(contiguous_assignment(V, len(sent)))
        return owners_seconds(OwnerSchedule.build(plan, numel), 4, lambda out, into: wire_need(out, into) / rate)
    if op == "hop":
        hops = sum(1 for x in sent if x)
        return wire_need(max(sent), max(sent)) / rate * (reps + hops - 1) / reps
    return max(max(wire_need(s, r), wire_need(r, s)) for s, r in zip(sent, received)) / rate


# ---------------------------------------------------------------------------------------------
# The parent: hosts, ranks, counters.


def counters(host) -> tuple[int, int, int, int]:
    """(tx bytes, tx frames, rx bytes, rx frames) of the host's interface (its bridge port sees
    them the other way round)."""
    stats = Path(f"/sys/class/net/{host.veth}/statistics")
    read = lambda name: int((stats / name).read_text())  # noqa: E731
    return read("rx_bytes"), read("rx_packets"), read("tx_bytes"), read("tx_packets")


class Ranks:
    def __init__(self, hosts, world: int) -> None:
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(H.REPO_ROOT), os.path.join(H.REPO_ROOT, "src")])}
        self.hosts = [hosts[i] for i in range(world)]
        self.procs = [h.run([sys.executable, "-m", "bench.hosts", "--rank", str(r), "--world", str(world),
                             "--store", self.hosts[0].ip], env=env, cwd=H.REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True) for r, h in enumerate(self.hosts)]
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a rank did not start (said {line!r}; exit {p.poll()})")

    def run(self, op: str, n: int, reps: int) -> tuple[list[dict], list[tuple[int, int, int, int]]]:
        for p in self.procs:
            p.stdin.write(f"run {op} {n} {reps}\n")
            p.stdin.flush()
        out = [json.loads(p.stdout.readline()) for p in self.procs]
        return out, [counters(h) for h in self.hosts]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit x 0 0\n")
                p.stdin.flush()
                p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()


def per_op(out: list[dict]) -> float:
    """Seconds per op: each timed part (a repetition; a stream of hops over its activations) by
    its slowest rank, the median over the parts."""
    return statistics.median(max(times) for times in zip(*(o["per"] for o in out)))


def measure(ranks: Ranks, op: str, n: int, reps: int, world: int, rate: float) -> dict[str, Any]:
    ranks.run(op, n, 1)  # warm-up: connections made, buffers faulted in
    small, _ = ranks.run(op, SMALL, reps)  # the op's fixed cost: its messages' latency, no bytes to speak of
    fixed_s = per_op(small)
    before = [counters(h) for h in ranks.hosts]
    out, after = ranks.run(op, n, reps)
    d = [[a - b for a, b in zip(x, y)] for x, y in zip(after, before)]
    ops = reps * (STREAMS if op == "hop" else 1)
    payload = [(tb - HEADER * tp) / ops for tb, tp, _, _ in d]
    wire = [tb / ops for tb, _, _, _ in d]
    sent, source = predicted_payload(op, n, world)
    seconds = per_op(out)
    t_pred = fixed_s + predicted_time(op, sent, predicted_received(op, n, world, sent), rate, reps, n)
    bytes_ok = all(abs(m - p) <= BYTES_REL * p + BYTES_ABS for m, p in zip(payload, sent))
    row = {"rate_mbit": rate, "hosts": world, "op": op, "numel": n, "predicted_sent": sent, "source": source,
           "measured_payload": payload, "measured_wire": wire,
           "wire_overhead": (sum(wire) - sum(payload)) / max(1.0, sum(payload)),
           "ledger_sent": [o["ledger_sent"] / reps for o in out] if op == "sharded" else None,
           "fixed_s": fixed_s, "predicted_s": t_pred, "measured_s": seconds, "time_ratio": seconds / t_pred if t_pred else None,
           "bytes_equal": bytes_ok, "time_within": abs(seconds / t_pred - 1) <= TIME_TOL if t_pred else False}
    print(f"  {rate:>6g} Mbit/s  {world} hosts  {op:<13} sent/host {H.mib(max(sent))} predicted, "
          f"{H.mib(max(payload))} measured (wire +{100 * row['wire_overhead']:.1f} %), "
          f"{seconds * 1e3:7.1f} ms vs {t_pred * 1e3:7.1f} ms predicted ({row['time_ratio']:.2f}x)  "
          f"bytes {H.yes_no(bytes_ok)}  time {H.yes_no(row['time_within'])}", flush=True)
    return row


def numel_for(op: str, rate: float, seconds: float) -> int:
    """A size that keeps one op about ``seconds`` long on a 2-host link (the deterministic exchange
    moves several slots: a quarter of the gradient)."""
    n = int(rate * 1e6 / 8 * seconds / 4)
    return n // 4 if op == "deterministic" else n


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, prog="python -m bench.hosts")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.store)
        return 0
    sys.path.insert(0, os.path.join(H.REPO_ROOT, "tests"))
    import hosts as hosts_mod

    why = hosts_mod.unavailable_reason()
    if why is not None:
        print(f"bench.hosts needs network namespaces: {why}", file=sys.stderr)
        return 2
    run = H.Run("hosts", args, target_keys=())
    worlds = (2, 4) if run.quick else (2, 3, 4)
    rates = (1000.0, 100.0)
    reps = 3 if run.quick else REPS
    seconds = 0.15 if run.quick else 0.4
    rows: list[dict[str, Any]] = []
    meter = H.LoadMeter()
    with meter, hosts_mod.Hosts(max(worlds)) as hosts:
        for world in worlds:
            ranks = Ranks(hosts, world)
            try:
                for rate in rates:
                    for h in hosts:
                        h.set_rate(rate)
                    for op in OPS:
                        n_reps = reps if run.quick or op != "hop" else HOP_ACTIVATIONS
                        rows.append(measure(ranks, op, numel_for(op, rate, seconds), n_reps, world, rate))
            finally:
                ranks.close()
    t = run.targets
    for r in rows:
        label = f"{r['op']} on {r['hosts']} hosts at {r['rate_mbit']:g} Mbit/s"
        t.holds(f"{label}: payload per host equals the prediction (0.5 % + 4 KiB)", r["bytes_equal"],
                f"predicted {[int(x) for x in r['predicted_sent']]}, measured {[int(x) for x in r['measured_payload']]}")
        if r["ledger_sent"] is not None:
            t.holds(f"{label}: the runtime's byte ledger equals explain's prediction",
                    [int(x) for x in r["ledger_sent"]] == list(r["predicted_sent"]),
                    f"ledger {[int(x) for x in r['ledger_sent']]}")
        t.holds(f"{label}: time within 15 % of the prediction", r["time_within"],
                f"{r['measured_s'] * 1e3:.1f} ms measured, {r['predicted_s'] * 1e3:.1f} ms predicted")
    header = ["Mbit/s", "hosts", "op", "sent/host predicted", "payload measured", "wire overhead", "ledger",
              "ms predicted", "ms measured", "ratio", "bytes", "time"]
    table = [[f"{r['rate_mbit']:g}", r["hosts"], r["op"], H.mib(max(r["predicted_sent"])),
              H.mib(max(r["measured_payload"])), f"{100 * r['wire_overhead']:.1f} %",
              H.mib(max(r["ledger_sent"])) if r["ledger_sent"] else "", f"{r['predicted_s'] * 1e3:.1f}",
              f"{r['measured_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}", H.yes_no(r["bytes_equal"]),
              H.yes_no(r["time_within"])] for r in rows]
    md = "\n\n".join([
        "# Communication on real links (bench.hosts)", H.env_markdown(),
        f"Command: `{run.command('hosts')}` (as root). Other load while it ran: {meter.other_cores:.2f} cores "
        f"of 2 (a shared machine: figures from a loaded machine).",
        "Payload = interface bytes - 66 x frames (Ethernet 14 + IPv4 20 + TCP 32 per frame); 'equal' = within "
        "0.5 % + 4 KiB per op of the prediction; wire overhead = (bytes - payload) / payload, the headers of data "
        "and ACK frames. Time predicted = the op's fixed cost (the same op on 1 KiB, measured) + the busiest "
        "host link direction's frames / rate (the owners exchange: its schedule's model, "
        "virtualflow.plan.exchange.owners_seconds, on the same links).",
        H.md_table(header, table)])
    return run.finish({"rows": rows, "other_load_cores": meter.other_cores, "quick": run.quick,
                       "environment": H.environment()}, md)


if __name__ == "__main__":
    sys.exit(main())
