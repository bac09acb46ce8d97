"""Pipeline parallelism: virtualflow's pipeline executor against ``torch.distributed.pipelining``,
its bubbles against the simulator, and its stashed activations against the schedules' bounds.

Three measurements in one run, from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline            # about 2.5 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --quick    # under a minute

**(1) Step time against torch.distributed.pipelining** (real compute, p = 2). Two fresh processes
(``python -m bench.pipeline --child-vs JSON``, 1 thread each, OMP_NUM_THREADS=1) on a TCPStore
the launcher hosts on a free port (port 0, chosen at run time). In each process:

* torch: ``init_process_group("gloo")``, one ``PipelineStage`` per model piece of the rank, and
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (2 pieces per rank) with
  ``loss_fn=cross_entropy`` (``scale_grads=True``), then ``optimizer.step()`` and ``zero_grad()``;
* virtualflow: its executor, **not the worker loop**: ``runtime.pipeline.build_engine`` (the
  ``StageEngine`` of the rank) driven by ``runtime.pipeline_worker.drive`` over its own
  ``ProcessGroupGloo`` on the same TCPStore (``virtualflow.comm.groups.make_group``); the
  optimizer step and the per-step all-reduce are inside ``StageEngine.steps``.

Same ``nn.Sequential`` (an MLP of 8 layers), same pieces (``resolve_bounds`` + ``piece_module``),
same initial weights, same micro-batches (virtualflow's ``DataPlan``: micro-batch i is virtual
node i; torch gets their concatenation and splits it into m chunks), SGD + momentum; the final
weights agree (key ``weight_diff``). The two alternate step by step in the same 2 processes
(order swapped every step; an untimed barrier before each timed step), so host noise cancels; a
step's time is the slower rank's. Per schedule and repetition (fresh processes): median over
post-warm-up steps; ratio = virtualflow / torch, the median of the repetitions' ratios. Target
<= 1.00 per schedule (keys ``ratio_gpipe``, ``ratio_1f1b``, ``ratio_interleaved_1f1b``).

Then a **profile** of the difference in the same processes: a ladder of instrumented copies of
``drive()`` (bench code; ``src/`` is not touched), each removing one more of what virtualflow's
message protocol does beyond torch's (receiving a message's parts one after another, the header
message, receives posted only when needed, the RNG state part, the per-step all-reduce),
alternating with torch again, plus the costs of those pieces measured in isolation.

**(2) Bubbles with emulated compute** (p = 4, m = 8, equal stage times). Four processes, each a
``StageEngine`` (``Pipeline(record_timeline=True)``) driven by ``drive``. The model's layers
*sleep*: forward ``f``; backward through custom autograd Functions that sleep ``i`` on the
input-gradient path and ``w`` on the weight-gradient path (so ``B`` = i + w, zb_h1's ``I`` = i and
``W`` = w), so 4 processes overlap on 2 cores. Bubble of a rank in a step = 1 - (its compute
time) / (first compute start to last compute end of the step over all ranks), from the timeline,
averaged over ranks and steps (2BW: over a window of steps). Against
``virtualflow.plan.pipeline.simulate`` with the nominal times, and for 1F1B also the analytic
``(p-1)/(m+p-1)``: within 5 points (key ``bubble_error``); interleaved and zb_h1 below 1F1B;
2BW throughput (samples/s over a window of steps) above 1F1B's (key ``throughput_2bw``).

**(3) Stashed activations** (the same emulated runs): live micro-batch contexts per rank, counted
with ``torch.autograd.graph.saved_tensors_hooks``: a context (one forward of one piece, tagged by
a forward pre-hook on the piece) is live from its forward until the last tensor its graph saved
is released, i.e. after its last backward part. Peak per rank == the schedule's ``stash_bound``;
2BW: weight versions used by live contexts == 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H

NAME = "pipeline"
MODULE = "bench.pipeline"
VS_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
EMU_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "2bw")
TARGET_KEYS = ("ratio_gpipe", "ratio_1f1b", "ratio_interleaved_1f1b", "weight_diff", "bubble_error",
               "throughput_2bw")
TARGET_RATIO = 1.00
TARGET_WEIGHT_DIFF = 1e-4
TARGET_BUBBLE_ERR = 0.05
TARGET_TPUT_2BW = 1.00
SEED = 0
CPU = torch.device("cpu")

# (1) the real-compute workload
VS_P = 2
VS_IN, VS_HIDDEN, VS_CLASSES = 256, 512, 10
VS_DATASET = 4096

# (2) the emulated workload
EMU_P = 4
EMU_WIDTH = 16
EMU_MB = 4


def vs_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(VS_DATASET, VS_IN, generator=g)
    teacher = torch.randn(VS_IN, VS_CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def vs_model(hidden: int = VS_HIDDEN) -> nn.Sequential:
    """8 layers: 7 Linear+ReLU blocks and a Linear head (p=2: 4 + 4 layers; v=2: 2 per piece)."""
    blocks = [nn.Sequential(nn.Linear(VS_IN, hidden), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(hidden, VS_CLASSES))


def vs_sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def vs_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def vs_job(schedule: str, m: int, mb: int, hidden: int):
    import virtualflow as vf

    chunks = 2 if schedule == "interleaved_1f1b" else 1
    return vf.Job(model=lambda: vs_model(hidden), optimizer=vs_sgd, output_loss=vs_loss, dataset=vs_data,
                  global_batch_size=m * mb, virtual_nodes=m, seed=SEED,
                  pipeline=vf.Pipeline(stages=VS_P, schedule=schedule, chunks=chunks), name=NAME)


# --------------------------------------------------------------------------------------------
# Child processes.


def _start_children(mode: str, world: int, cfg: dict, timeout_s: float = 300.0) -> list[dict]:
    """``world`` fresh ``python -m bench.pipeline MODE JSON`` processes (1 thread each) on a
    TCPStore hosted here on a free port; their JSON results, by rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    procs = [H.spawn_child(MODULE, [mode, json.dumps({**cfg, "rank": r, "world": world, "port": store.port})], 1)
             for r in range(world)]
    out = H.collect_children(procs, f"{mode} rank", timeout_s=timeout_s)
    del store
    return sorted(out, key=lambda r: r["rank"])


def _child_store(cfg: dict):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))


# --------------------------------------------------------------------------------------------
# (1) virtualflow's executor vs torch.distributed.pipelining, alternating in the same processes.


def _torch_side(schedule: str, m: int, rank: int, hidden: int):
    """torch.distributed.pipelining stages, schedule and optimizer of this rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from virtualflow.pipeline import layers_of, piece_module, resolve_bounds

    job = vs_job(schedule, m, 1, hidden)
    torch.manual_seed(SEED)
    layers = layers_of(vs_model(hidden))
    bounds = resolve_bounds(job.pipeline, len(layers))
    stages = [PipelineStage(piece_module(layers, a, b), k, len(bounds), CPU)
              for k, (a, b) in enumerate(bounds) if k % VS_P == rank]
    opt = vs_sgd([q for st in stages for q in st.submod.parameters()])
    loss_fn = nn.functional.cross_entropy
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    return stages, sched, opt, any(st.is_first for st in stages), any(st.is_last for st in stages)


def _vf_engine(schedule: str, m: int, mb: int, hidden: int, rank: int, ds):
    from virtualflow.pipeline import layers_of, resolve_bounds
    from virtualflow.runtime.pipeline import build_engine

    job = vs_job(schedule, m, mb, hidden)
    bounds = resolve_bounds(job.pipeline, len(layers_of(vs_model(hidden))))
    engine = build_engine(job, job.pipeline, bounds, rank, dataset=ds, deterministic=False, device=CPU)
    engine.set_layout(0, [list(range(m))])
    return engine


# The profile ladder: instrumented copies of drive(), each removing one more of virtualflow's
# extras. Options: parts_together (receive a message's parts with one batch of irecvs after its
# header, not one blocking recv after another), prepost_headers (post every header receive of the
# step at its start), no_header (shapes cached from the first step: no header message),
# prepost_all (with no_header: post every receive of the step at its start), no_rng (the RNG state
# part is not sent; the receiver uses its own), no_allsum (the per-step all-reduce answered locally).
LADDER = (
    ("drive", {}),
    ("parts together", {"parts_together": True}),
    ("+ headers pre-posted", {"parts_together": True, "prepost_headers": True}),
    ("no header, recv on demand", {"no_header": True}),
    ("no header, recvs pre-posted", {"no_header": True, "prepost_all": True}),
    ("+ no RNG part", {"no_header": True, "prepost_all": True, "no_rng": True}),
    ("+ no all-reduce", {"no_header": True, "prepost_all": True, "no_rng": True, "no_allsum": True}),
)


def _drive_variant(gen, *, group, grid, engine, opts: dict, state: dict):
    """A copy of ``pipeline_worker.drive`` (one pipeline replica) with ``opts`` applied."""
    from virtualflow.runtime.pipeline import AllSum, Recv, Send, schedule_for
    from virtualflow.runtime.pipeline_worker import _HEADER, _header, _parse, _tag

    pg, n_pieces = group.pg, engine.n_pieces
    shapes: dict = state.setdefault("shapes", {})  # (direction, from piece) -> [(dtype, shape)]
    first = state.get("steps", 0) == 0  # the first step always carries headers (learns the shapes)
    no_header = opts.get("no_header") and not first
    pending, posted = [], {}
    if opts.get("prepost_headers") or (opts.get("prepost_all") and no_header):
        sched = schedule_for(engine.pipeline, len(engine.assignment[0]), state.get("n_steps", 1))
        for a in sched.actions[engine.stage_rank]:
            if a.kind not in ("RECV_F", "RECV_B"):
                continue
            key = ("F", a.stage - 1, a.microbatch) if a.kind == "RECV_F" else ("B", a.stage + 1, a.microbatch)
            src = grid.rank_of(grid.replica, a.peer)
            if no_header:
                bufs = [torch.empty(s, dtype=d) for d, s in shapes[key[:2]]]
                posted[key] = (bufs, [pg.recv([b], src, _tag(key, n_pieces, k + 1)) for k, b in enumerate(bufs)])
            else:
                h = torch.empty(_HEADER, dtype=torch.int64)
                posted[key] = (h, pg.recv([h], src, _tag(key, n_pieces, 0)))
    answer = None
    try:
        req = next(gen)
        while True:
            if isinstance(req, Send):
                dst = grid.rank_of(grid.replica, req.peer)
                tensors = [t.detach().contiguous() for t in req.tensors]
                if opts.get("no_rng") and req.key[0] == "F":
                    tensors = tensors[:-1]
                works, keep = [], list(tensors)
                if not no_header:
                    header = _header(tensors)
                    works.append(pg.send([header], dst, _tag(req.key, n_pieces, 0)))
                    keep.append(header)
                works += [pg.send([t], dst, _tag(req.key, n_pieces, k + 1)) for k, t in enumerate(tensors)]
                pending.append((works, keep))
                answer = None
            elif isinstance(req, Recv):
                src = grid.rank_of(grid.replica, req.peer)
                if no_header:
                    if req.key in posted:
                        bufs, works = posted.pop(req.key)
                    else:
                        bufs = [torch.empty(s, dtype=d) for d, s in shapes[req.key[:2]]]
                        works = [pg.recv([b], src, _tag(req.key, n_pieces, k + 1)) for k, b in enumerate(bufs)]
                    for w in works:
                        w.wait()
                else:
                    if req.key in posted:
                        header, w = posted.pop(req.key)
                        w.wait()
                    else:
                        header = torch.empty(_HEADER, dtype=torch.int64)
                        pg.recv([header], src, _tag(req.key, n_pieces, 0)).wait()
                    metas = _parse(header)
                    shapes[req.key[:2]] = metas
                    bufs = [torch.empty(s, dtype=d) for d, s in metas]
                    if opts.get("parts_together") or opts.get("no_header"):
                        works = [pg.recv([b], src, _tag(req.key, n_pieces, k + 1)) for k, b in enumerate(bufs)]
                        for w in works:
                            w.wait()
                    else:
                        for k, b in enumerate(bufs):
                            pg.recv([b], src, _tag(req.key, n_pieces, k + 1)).wait()
                answer = bufs
                if opts.get("no_rng") and req.key[0] == "F":
                    answer = bufs + [torch.get_rng_state()]
            elif isinstance(req, AllSum):
                if not opts.get("no_allsum"):
                    group.all_reduce(req.vector)
                answer = req.vector
            else:
                raise TypeError(f"the profile ladder drives one pipeline replica, not {req!r}")
            req = gen.send(answer)
    except StopIteration as stop:
        results = stop.value
    for works, _keep in pending:
        for w in works:
            w.wait()
    state["steps"] = state.get("steps", 0) + 1
    return results


def vs_rank(cfg: dict) -> dict:
    """One rank of the comparison: every schedule of ``cfg['schedules']`` in turn; virtualflow and
    torch alternate step by step, then (``cfg['ladder_steps']``) the profile ladder."""
    import torch.distributed as dist

    from virtualflow.comm.groups import make_group
    from virtualflow.pipeline import Grid
    from virtualflow.runtime.pipeline_worker import drive

    torch.set_num_threads(1)
    rank, world, m, mb, hidden = cfg["rank"], cfg["world"], cfg["m"], cfg["mb"], cfg["hidden"]
    store = _child_store(cfg)
    dist.init_process_group("gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = make_group(store, 0, rank, world, 120.0, CPU)
    trivial = make_group(store, 1, 0, 1, 120.0, CPU)  # one pipeline replica: the stage group is trivial
    grid = Grid(VS_P, 1, rank)
    out: dict = {"rank": rank, "schedules": {}, "ladder": {}}
    ds = vs_data()
    X, Y = ds.tensors
    for schedule in cfg["schedules"]:
        engine = _vf_engine(schedule, m, mb, hidden, rank, ds)
        stages, sched, opt, has_first, has_last = _torch_side(schedule, m, rank, hidden)
        plan = engine.plan

        def torch_step(t: int) -> float:
            idx = torch.cat([plan.vn_indices(t, v) for v in range(m)])
            losses: list = []
            sched.step(*((X[idx],) if has_first else ()), target=Y[idx] if has_last else None,
                       losses=losses if has_last else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(torch.stack(losses).sum() / m) if losses else float("nan")

        def vf_step(eng, t: int) -> float:
            (res,) = drive(eng.steps(t, 1), group=group, stage_group=trivial, grid=grid, n_pieces=eng.n_pieces,
                           device=CPU)
            return res.loss

        sides = {"vf": lambda t: vf_step(engine, t), "torch": torch_step}
        times: dict[str, list[float]] = {k: [] for k in sides}
        losses: dict[str, list[float]] = {k: [] for k in sides}
        for t in range(cfg["steps"]):
            for which in (("vf", "torch") if t % 2 == 0 else ("torch", "vf")):
                dist.barrier()
                t0 = time.perf_counter()
                losses[which].append(sides[which](t))
                times[which].append(time.perf_counter() - t0)
        theirs = {k: v for st in stages for k, v in st.submod.state_dict().items()}
        mine = engine.model.state_dict()
        out["schedules"][schedule] = {
            "times": times, "losses": losses, "n_pieces": engine.n_pieces,
            "max_abs_weight_diff": max(float((mine[k] - theirs[k]).abs().max()) for k in theirs),
            "bit_identical": all(torch.equal(mine[k], theirs[k]) for k in theirs),
        }
        if cfg["ladder_steps"]:
            ladder_sides = {"torch": torch_step}
            for label, opts in LADDER:
                eng, st = _vf_engine(schedule, m, mb, hidden, rank, ds), {}
                if label == "drive":
                    ladder_sides[label] = lambda t, eng=eng: vf_step(eng, t)
                else:
                    ladder_sides[label] = lambda t, eng=eng, opts=opts, st=st: _drive_variant(
                        eng.steps(t, 1), group=group, grid=grid, engine=eng, opts=opts, state=st)[0].loss
            names = list(ladder_sides)
            lt: dict[str, list[float]] = {k: [] for k in names}
            for t in range(cfg["ladder_steps"]):
                for which in (names if t % 2 == 0 else names[::-1]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    ladder_sides[which](cfg["steps"] + t if which == "torch" else t)
                    lt[which].append(time.perf_counter() - t0)
            out["ladder"][schedule] = lt
        dist.barrier()
    if cfg.get("costs_reps"):
        out["costs"] = _costs(cfg, group, rank)
    dist.barrier()
    group.close()
    dist.destroy_process_group()
    return out


def _costs(cfg: dict, group, rank: int) -> dict:
    """What the extras cost in isolation, in these processes: one-way message time (half a round
    trip) of a bare activation, of header + activation received one part after another (as
    ``drive``), of header + activation + RNG state; the RNG calls; the per-step all-reduce."""
    import torch.distributed as dist

    from virtualflow.runtime.engine import seed_random_streams
    from virtualflow.runtime.pipeline_worker import _header, _parse

    reps, peer, pg = cfg["costs_reps"], 1 - rank, group.pg
    act = torch.randn(cfg["mb"], cfg["hidden"])
    rng = torch.get_rng_state()
    header = _header([act, rng])

    def timed(fn, n=reps) -> float:
        for _ in range(max(3, n // 10)):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    def one_way(parts, together=False):
        def once():  # rank 0 sends the parts, rank 1 receives them (as drive: one after another) and answers
            for direction in (0, 1):
                if rank == direction:
                    ws = [pg.send([t], peer, 10 * direction + k) for k, t in enumerate(parts)]
                    for w in ws:
                        w.wait()
                elif together:
                    ws = [pg.recv([torch.empty_like(t)], peer, 10 * direction + k) for k, t in enumerate(parts)]
                    for w in ws:
                        w.wait()
                else:
                    for k, t in enumerate(parts):
                        pg.recv([torch.empty_like(t)], peer, 10 * direction + k).wait()
        return timed(once) / 2

    def after_idle(parts, together: bool, idle_s: float = 0.003, n: int = 120) -> list[float]:
        """Latency of one forward message (as drive sends it) when the sender computes (sleeps)
        before sending and the receiver waits: time from the send to the last part received."""
        out = []
        stamp = torch.zeros(1, dtype=torch.float64)
        dist.barrier()
        for it in range(n):
            if rank == 0:
                time.sleep(idle_s)
                stamp[0] = time.time()
                ws = [pg.send([stamp], peer, 50)] + [pg.send([t], peer, 51 + k) for k, t in enumerate(parts)]
                pg.recv([torch.zeros(1)], peer, 49).wait()
                for w in ws:
                    w.wait()
            else:
                got = torch.zeros(1, dtype=torch.float64)
                bufs = [torch.empty_like(t) for t in parts]
                if together:
                    ws = [pg.recv([got], peer, 50)] + [pg.recv([b], peer, 51 + k) for k, b in enumerate(bufs)]
                    for w in ws:
                        w.wait()
                else:
                    pg.recv([got], peer, 50).wait()
                    for k, b in enumerate(bufs):
                        pg.recv([b], peer, 51 + k).wait()
                if it >= 10:
                    out.append(time.time() - float(got))
                pg.send([torch.zeros(1)], peer, 49).wait()
        return out

    idle = {}
    for label, together in (("one_after_another", False), ("together", True)):
        lat = after_idle([header, act, rng], together)
        if rank == 1:
            idle[label] = {"median_s": H.median(lat), "p90_s": H.quantile(lat, 0.9), "p99_s": H.quantile(lat, 0.99)}
    stats = torch.zeros(cfg["m"] + 2, dtype=torch.float64)
    return {
        "after_idle_3ms": idle,
        "msg_activation_s": one_way([act]),
        "msg_header_activation_s": one_way([header, act]),
        "msg_header_activation_rng_s": one_way([header, act, rng]),
        "msg_header_activation_rng_together_s": one_way([header, act, rng], together=True),
        "make_header_s": timed(lambda: _header([act, rng])),
        "parse_header_s": timed(lambda: _parse(header)),
        "get_rng_state_s": timed(torch.get_rng_state),
        "set_rng_state_s": timed(lambda: torch.set_rng_state(rng)),
        "seed_random_streams_s": timed(lambda: seed_random_streams(7, CPU)),
        "allreduce_stats_s": timed(lambda: group.all_reduce(stats)),
        "rng_state_bytes": rng.numel(), "activation_bytes": act.numel() * 4, "header_bytes": header.numel() * 8,
    }


def measure_vs(args) -> dict:
    reps = []
    for rep in range(args.vs_reps):
        k = rep % len(VS_SCHEDULES)
        order = list(VS_SCHEDULES[k:] + VS_SCHEDULES[:k])
        cfg = {"schedules": order, "m": args.m, "mb": args.mb, "hidden": args.hidden, "steps": args.vs_steps,
               "ladder_steps": args.ladder_steps if rep == 0 else 0, "costs_reps": args.costs_reps if rep == 0 else 0}
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            ranks = _start_children("--child-vs", VS_P, cfg)
        w = args.vs_warmup
        row: dict = {"other_load_cores": meter.other_cores, "order": order, "schedules": {}}
        for s in VS_SCHEDULES:
            per = [r["schedules"][s] for r in ranks]
            vf_t = [max(xs) for xs in zip(*(p["times"]["vf"] for p in per))]
            th_t = [max(xs) for xs in zip(*(p["times"]["torch"] for p in per))]
            vf_med, th_med = H.median(vf_t[w:]), H.median(th_t[w:])
            r = row["schedules"][s] = {
                "vf_step_s": vf_med, "torch_step_s": th_med, "ratio": vf_med / th_med,
                "p25_ratio": H.p25(vf_t[w:]) / H.p25(th_t[w:]),
                "max_abs_weight_diff": max(p["max_abs_weight_diff"] for p in per),
                "bit_identical": all(p["bit_identical"] for p in per),
                "last_loss_vf": per[-1]["losses"]["vf"][-1], "last_loss_torch": per[-1]["losses"]["torch"][-1],
                "raw_vf_step_s": vf_t, "raw_torch_step_s": th_t,
            }
            print(f"  rep {rep} {s:17s} virtualflow {1e3 * vf_med:7.2f} ms, torch {1e3 * th_med:7.2f} ms, ratio "
                  f"{r['ratio']:.3f} (p25 {r['p25_ratio']:.3f}); max |weight diff| {r['max_abs_weight_diff']:.1e}"
                  f"{' (bit-identical)' if r['bit_identical'] else ''}", flush=True)
        if ranks[0]["ladder"]:
            row["ladder"] = {}
            lw = max(1, args.ladder_steps // 4)
            for s in VS_SCHEDULES:
                names = list(ranks[0]["ladder"][s])
                step = {n: [max(xs) for xs in zip(*(r["ladder"][s][n] for r in ranks))] for n in names}
                med = {n: H.median(v[lw:]) for n, v in step.items()}
                row["ladder"][s] = {"median_step_s": med, "ratio_to_torch": {n: med[n] / med["torch"] for n in names},
                                    "raw_step_s": step}
                print(f"  profile {s:17s} " + ", ".join(f"{n} {med[n] / med['torch']:.2f}" for n in names[1:]),
                      flush=True)
        if "costs" in ranks[0]:
            row["costs"] = [r["costs"] for r in ranks]
        reps.append(row)
    return {"reps": reps}


def summarize_vs(vs: dict, args, targets: H.Targets) -> dict:
    out = {}
    for s in VS_SCHEDULES:
        ratios = [r["schedules"][s]["ratio"] for r in vs["reps"]]
        ratio = H.median(ratios)
        key = f"ratio_{s}"
        met = targets.at_most(key, f"p={VS_P} m={args.m} mb={args.mb} {s}: virtualflow / torch.distributed.pipelining "
                                   f"step time (median of {len(ratios)} repetitions)", ratio, TARGET_RATIO)
        out[s] = {"ratio": ratio, "ratios": ratios, "met": met,
                  "p25_ratio": H.median([r["schedules"][s]["p25_ratio"] for r in vs["reps"]]),
                  "vf_step_s": H.median([r["schedules"][s]["vf_step_s"] for r in vs["reps"]]),
                  "torch_step_s": H.median([r["schedules"][s]["torch_step_s"] for r in vs["reps"]]),
                  "max_abs_weight_diff": max(r["schedules"][s]["max_abs_weight_diff"] for r in vs["reps"]),
                  "bit_identical": all(r["schedules"][s]["bit_identical"] for r in vs["reps"])}
    targets.at_most("weight_diff", "same computation: max |final weight difference| virtualflow vs torch",
                    max(o["max_abs_weight_diff"] for o in out.values()), TARGET_WEIGHT_DIFF)
    return out


# --------------------------------------------------------------------------------------------
# (2) + (3) emulated compute: sleep-paced layers, p = 4.


class _Pace(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds`` (the emulated backward work on its path)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return g, None


class PacedLayer(nn.Module):
    """Forward sleeps ``f``; backward sleeps ``i`` on the input-gradient path and ``w`` on the
    weight-gradient path; ``x * gain + bias`` saves tensors for backward like a real layer."""

    def __init__(self, width: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.f, self.i, self.w = f, i, w

    def forward(self, x):
        time.sleep(self.f)
        return _Pace.apply(x, self.i) * _Pace.apply(self.gain, self.w) + self.bias


def emu_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, EMU_WIDTH, generator=g)
    return TensorDataset(x, x.tanh())


def emu_loss(out, batch):
    return nn.functional.mse_loss(out, batch[1])


def emu_job(schedule: str, m: int, f: float, i: float, w: float, window: int):
    """p * v paced layers (times / v each), one per piece; piece 0 also holds a small Linear, so its
    backward has an input-gradient path too (every stage's B = i + w)."""
    import virtualflow as vf

    v = 2 if schedule == "interleaved_1f1b" else 1
    n = EMU_P * v

    def model():
        return nn.Sequential(nn.Linear(EMU_WIDTH, EMU_WIDTH),
                             *[PacedLayer(EMU_WIDTH, f / v, i / v, w / v) for _ in range(n)])

    pipe = vf.Pipeline(stages=EMU_P, schedule=schedule, chunks=v, split=[2] + [1] * (n - 1), record_timeline=True,
                       window=window)
    return vf.Job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), output_loss=emu_loss,
                  dataset=emu_data, global_batch_size=m * EMU_MB, virtual_nodes=m, seed=SEED, pipeline=pipe,
                  name=NAME)


class _StashMeter:
    """Live micro-batch contexts of this process, from saved-tensor hooks. A forward pre-hook on
    each piece opens a context and notes the weight version its layers see (under 2BW's
    ``functional_call``, the snapshot in use); every tensor autograd saves during it is tagged with
    the context; the context is live while any of them is. Weight snapshots (2BW) are counted
    alive from their creation until freed (``weakref.finalize``)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        self.current = -1
        self.next_id = 0
        self.peak = 0
        self.peak_versions = 0
        self.versions_seen: set[int] = set()
        self.snapshots_alive = 0
        self.peak_snapshots_at_forward = 0
        self.peak_snapshots_transient = 0
        self.snapshots_made = 0

    def opener(self, piece: nn.Module):
        paced = next(x for x in piece.children() if isinstance(x, PacedLayer))

        def open_context(module, args) -> None:
            self.current = self.next_id
            self.next_id += 1
            ptr = paced.gain.data_ptr()
            self.version_of[self.current] = ptr
            self.versions_seen.add(ptr)
            self.peak_snapshots_at_forward = max(self.peak_snapshots_at_forward, self.snapshots_alive)

        return open_context

    def wrap_snapshot(self, engine) -> None:
        """Count the weight snapshots ``StageEngine._snapshot`` makes (2BW) while they are alive."""
        import weakref

        make = engine._snapshot

        def snapshot(k: int):
            version = make(k)
            self.snapshots_made += 1
            self.snapshots_alive += 1
            self.peak_snapshots_transient = max(self.peak_snapshots_transient, self.snapshots_alive)
            weakref.finalize(next(iter(version.values())), self._snapshot_freed)
            return version

        engine._snapshot = snapshot

    def _snapshot_freed(self) -> None:
        self.snapshots_alive -= 1

    def pack(self, t):
        return _Saved(self, self.current, t)

    @staticmethod
    def unpack(obj):
        return obj.t


class _Saved:
    __slots__ = ("meter", "ctx", "t")

    def __init__(self, meter: _StashMeter, ctx: int, t) -> None:
        self.meter, self.ctx, self.t = meter, ctx, t
        live = meter.live
        live[ctx] = live.get(ctx, 0) + 1
        if len(live) > meter.peak:
            meter.peak = len(live)
        versions = len({meter.version_of[c] for c in live})
        if versions > meter.peak_versions:
            meter.peak_versions = versions

    def __del__(self) -> None:
        live = self.meter.live
        live[self.ctx] -= 1
        if not live[self.ctx]:
            del live[self.ctx]


EMU_VARIANT = {"no_header": True, "prepost_all": True}
"""The emulated runs' second driver: drive() with every receive of a step (2BW: of a window) posted
at its start, a message's parts received together, and no header after the first call (shapes
cached). Same actions, same order; only when the receives are posted differs."""


def emu_rank(cfg: dict) -> dict:
    """One rank of the emulated pipeline: every schedule and driver in turn, with timelines and
    stash counts."""
    from virtualflow.comm.groups import make_group
    from virtualflow.pipeline import Grid, bounds_from_counts
    from virtualflow.runtime.pipeline import build_engine
    from virtualflow.runtime.pipeline_worker import drive

    torch.set_num_threads(1)
    rank, world, m, window = cfg["rank"], cfg["world"], cfg["m"], cfg["window"]
    f, i, w = cfg["f"], cfg["i"], cfg["w"]
    store = _child_store(cfg)
    group = make_group(store, 0, rank, world, 120.0, CPU)
    trivial = make_group(store, 1, 0, 1, 120.0, CPU)
    grid = Grid(EMU_P, 1, rank)
    ds = emu_data()
    out: dict = {"rank": rank, "runs": {}}
    for driver in cfg["drivers"]:
        for schedule in cfg["schedules"]:
            job = emu_job(schedule, m, f, i, w, window)
            engine = build_engine(job, job.pipeline, bounds_from_counts(job.pipeline.split), rank, dataset=ds,
                                  deterministic=False, device=CPU)
            engine.set_layout(0, [list(range(m))])
            meter = _StashMeter()
            hooks = [piece.register_forward_pre_hook(meter.opener(piece)) for piece in engine.pieces.values()]
            meter.wrap_snapshot(engine)
            module_ptrs = {q.data_ptr() for q in engine.model.parameters()}
            per_call = 1 if job.pipeline.flush else window
            calls = cfg["flush_steps"] if job.pipeline.flush else cfg["windows"]
            timeline, call_times, state = [], [], {}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                for c in range(calls):
                    group.all_reduce(torch.zeros(1))  # line up (untimed)
                    t0 = time.time()
                    gen = engine.steps(c * per_call, per_call)
                    if driver == "drive":
                        drive(gen, group=group, stage_group=trivial, grid=grid, n_pieces=engine.n_pieces, device=CPU)
                    else:
                        state["n_steps"] = per_call
                        _drive_variant(gen, group=group, grid=grid, engine=engine, opts=EMU_VARIANT, state=state)
                    call_times.append(time.time() - t0)
                    timeline += [{**e, "call": c} for e in engine.timeline]
                    engine.timeline.clear()
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
            for h in hooks:
                h.remove()
            out["runs"][f"{driver}/{schedule}"] = {
                "timeline": timeline, "call_times": call_times, "steps_per_call": per_call, "cpu_s": cpu_s,
                "wall_s": wall_s, "peak_stash": meter.peak, "peak_versions_in_flight": meter.peak_versions,
                "versions_seen": len(meter.versions_seen), "peak_snapshots_at_forward": meter.peak_snapshots_at_forward,
                "peak_snapshots_transient": meter.peak_snapshots_transient, "snapshots_made": meter.snapshots_made,
                "forward_used_module_weights": bool(meter.versions_seen & module_ptrs), "left_live": len(meter.live),
            }
            group.all_reduce(torch.zeros(1))
    group.close()
    return out


def _emu_schedule(schedule: str, m: int, window: int):
    from virtualflow.plan.pipeline import SCHEDULES

    if schedule == "interleaved_1f1b":
        return SCHEDULES[schedule](EMU_P, m, 2)
    if schedule == "2bw":
        return SCHEDULES[schedule](EMU_P, m, window)
    return SCHEDULES[schedule](EMU_P, m)


def _nominal_times(schedule: str, f: float, i: float, w: float) -> tuple[list, list, list]:
    """Per-stage (f, b, w) the emulation was built with. zb_h1: stage 0 has no input gradient to
    compute (its input is data), so its ``I`` is empty and its ``W`` runs the whole backward (the
    executor's split); elsewhere ``I`` = i, ``W`` = w."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    n = EMU_P * v
    return [f / v] * n, [(i + w) / v] * n, [(i + w) / v] + [w / v] * (n - 1)


def _measured_times(timelines: list[list[dict]], n_stages: int, calls: set) -> tuple[list, list, list]:
    """Per-stage median durations from the timelines: (F, B or I + W, W or 0)."""
    d: dict[tuple[str, int], list[float]] = {}
    for tl in timelines:
        for e in tl:
            if e["call"] in calls and e["kind"] in ("F", "B", "I", "W"):
                d.setdefault((e["kind"], e["stage"]), []).append(e["end"] - e["start"])
    med = {k: H.median(v) for k, v in d.items()}
    fs = [med[("F", s)] for s in range(n_stages)]
    if ("B", 0) in med:
        return fs, [med[("B", s)] for s in range(n_stages)], [0.0] * n_stages
    ws = [med[("W", s)] for s in range(n_stages)]
    return fs, [med[("I", s)] + ws[s] for s in range(n_stages)], ws


def _message_latency(timelines: list[list[dict]], calls: set) -> list[float]:
    """Per message whose receiver was already waiting: receive end - send end (seconds)."""
    sends = {}
    for tl in timelines:
        for e in tl:
            if e["call"] in calls and e["kind"] in ("SEND_F", "SEND_B"):
                to = e["stage"] + 1 if e["kind"] == "SEND_F" else e["stage"] - 1
                sends[e["kind"][-1], to, e["mb"], e["call"]] = e
    out = []
    for tl in timelines:
        for e in tl:
            if e["call"] in calls and e["kind"] in ("RECV_F", "RECV_B"):
                snd = sends.get((e["kind"][-1], e["stage"], e["mb"], e["call"]))
                if snd is not None and e["start"] < snd["end"]:
                    out.append(max(0.0, e["end"] - snd["end"]))
    return out


def measure_emu(args) -> dict:
    from virtualflow.plan.pipeline import simulate

    cfg = {"schedules": list(EMU_SCHEDULES), "m": args.emu_m, "f": args.f_ms / 1e3, "i": args.i_ms / 1e3,
           "w": args.w_ms / 1e3, "window": args.window, "flush_steps": args.emu_steps, "windows": args.emu_windows,
           "drivers": ["drive"] + (["variant"] if args.emu_variant else [])}
    H.wait_for_quiet(args.quiet_wait)
    with H.LoadMeter() as meter:
        ranks = _start_children("--child-emu", EMU_P, cfg)
    m, f, i, w, window = cfg["m"], cfg["f"], cfg["i"], cfg["w"], cfg["window"]
    res: dict = {"other_load_cores": meter.other_cores, "config": cfg, "schedules": {}, "variant": {}}
    for driver, s in [(d, s) for d in cfg["drivers"] for s in EMU_SCHEDULES]:
        sched = _emu_schedule(s, m, window)
        sim = simulate(sched, *_nominal_times(s, f, i, w))
        per = [r["runs"][f"{driver}/{s}"] for r in ranks]
        n_calls = len(per[0]["call_times"])
        calls = set(range(1 if n_calls > 1 else 0, n_calls))  # the first call is warm-up
        timelines = [p["timeline"] for p in per]
        bubbles, spans = [], []
        per_rank = [[] for _ in range(EMU_P)]
        for c in sorted(calls):
            ev = [[e for e in tl if e["call"] == c and e["kind"] in ("F", "B", "I", "W")] for tl in timelines]
            span = max(e["end"] for r in ev for e in r) - min(e["start"] for r in ev for e in r)
            spans.append(span)
            for r in range(EMU_P):
                per_rank[r].append(1 - sum(e["end"] - e["start"] for e in ev[r]) / span)
            bubbles.append(sum(b[-1] for b in per_rank) / EMU_P)
        lat = _message_latency(timelines, calls)
        comm = H.median(lat) if lat else 0.0
        calib = simulate(sched, *_measured_times(timelines, sched.stages, calls), comm_time=comm)
        measured = H.median(bubbles)
        sim_bubble = sum(sim.bubble) / EMU_P
        calib_bubble = sum(calib.bubble) / EMU_P
        call_time = H.median([max(xs) for xs in zip(*(p["call_times"] for p in per))][min(calls):])
        spc = per[0]["steps_per_call"]
        row = res["schedules" if driver == "drive" else "variant"][s] = {
            "measured_bubble": measured, "measured_bubble_per_rank": [H.median(b) for b in per_rank],
            "simulated_bubble": sim_bubble, "simulated_bubble_per_rank": list(sim.bubble),
            "error_points": 100 * (measured - sim_bubble),
            "calibrated_bubble": calib_bubble, "calibrated_error_points": 100 * (measured - calib_bubble),
            "message_latency_median_s": comm, "message_latency_p90_s": H.quantile(lat, 0.9) if lat else None,
            "measured_span_s": H.median(spans), "simulated_span_s": float(sim.step_time),
            "calibrated_span_s": float(calib.step_time),
            "call_time_s": call_time, "steps_per_call": spc,
            "throughput_samples_s": m * EMU_MB * spc / call_time,
            "peak_stash_measured": [p["peak_stash"] for p in per], "stash_bound": list(sched.stash_bound),
            "simulator_peak_stash": list(sim.peak_stash), "weight_versions_bound": list(sched.weight_versions),
            "peak_versions_in_flight": [p["peak_versions_in_flight"] for p in per],
            "peak_snapshots_at_forward": [p["peak_snapshots_at_forward"] for p in per],
            "peak_snapshots_transient": [p["peak_snapshots_transient"] for p in per],
            "forward_used_module_weights": [p["forward_used_module_weights"] for p in per],
            "contexts_left_live": [p["left_live"] for p in per],
            "cpu_cores": sum(p["cpu_s"] / p["wall_s"] for p in per),
            "raw_bubbles": bubbles, "raw_spans_s": spans, "raw_call_times_s": [p["call_times"] for p in per],
        }
        if s == "1f1b":
            row["analytic_bubble"] = (EMU_P - 1) / (m + EMU_P - 1)
        label = "emulated" if driver == "drive" else "variant "
        print(f"  {label} {s:17s} bubble {100 * measured:5.1f} %, simulated {100 * sim_bubble:5.1f} %"
              + (f", analytic {100 * row['analytic_bubble']:5.1f} %" if s == "1f1b" else "")
              + f", calibrated {100 * calib_bubble:5.1f} % (message latency {1e3 * comm:.2f} ms); span "
              f"{1e3 * row['measured_span_s']:.0f} ms (sim {1e3 * row['simulated_span_s']:.0f}, calibrated "
              f"{1e3 * row['calibrated_span_s']:.0f}); {row['throughput_samples_s']:.0f} samples/s; stash "
              f"{row['peak_stash_measured']} (bound {row['stash_bound']})"
              + (f"; versions in flight {row['peak_versions_in_flight']}, snapshots alive "
                 f"{row['peak_snapshots_at_forward']} (transient {row['peak_snapshots_transient']})"
                 if s == "2bw" else ""), flush=True)
    return res


def summarize_emu(emu: dict, targets: H.Targets) -> None:
    rows = emu["schedules"]
    for s, row in rows.items():
        targets.at_most("bubble_error", f"emulated p={EMU_P} {s}: |measured bubble - simulated| (points)",
                        abs(row["error_points"]), 100 * TARGET_BUBBLE_ERR)
    one = rows["1f1b"]
    targets.at_most("bubble_error", f"emulated p={EMU_P} 1f1b: |measured bubble - analytic (p-1)/(m+p-1)| (points)",
                    abs(100 * (one["measured_bubble"] - one["analytic_bubble"])), 100 * TARGET_BUBBLE_ERR)
    for s in ("interleaved_1f1b", "zb_h1"):
        targets.holds(f"emulated {s} bubble below 1f1b's", rows[s]["measured_bubble"] < one["measured_bubble"],
                      f"{100 * rows[s]['measured_bubble']:.1f} % vs {100 * one['measured_bubble']:.1f} %")
    targets.at_least("throughput_2bw", "emulated 2bw / 1f1b throughput (samples/s, a window of steps each)",
                     rows["2bw"]["throughput_samples_s"] / one["throughput_samples_s"], TARGET_TPUT_2BW)
    for s, row in rows.items():
        targets.holds(f"peak stashed activations per rank == stash_bound ({s})",
                      row["peak_stash_measured"] == row["stash_bound"],
                      f"measured {row['peak_stash_measured']}, bound {row['stash_bound']}")
    v = rows["2bw"]
    targets.holds("2bw: weight versions held per stage == 2 (snapshots alive at every forward, peak)",
                  v["peak_snapshots_at_forward"] == v["weight_versions_bound"],
                  f"measured {v['peak_snapshots_at_forward']}, bound {v['weight_versions_bound']}")
    targets.holds("2bw: weight versions used by live micro-batches <= 2 per stage",
                  all(x <= 2 for x in v["peak_versions_in_flight"]), f"measured {v['peak_versions_in_flight']}")


# --------------------------------------------------------------------------------------------
# Report.


def _emu_table(rows: dict, with_stash: bool) -> str:
    header = ["schedule", "bubble measured", "simulated (nominal)", "error (points)", "analytic",
              "calibrated (measured times + median message latency)", "span ms (simulated)", "samples/s"]
    if with_stash:
        header += ["peak stash per rank", "stash_bound"]
    out = []
    for s, r in rows.items():
        row = [s, f"{100 * r['measured_bubble']:.1f} %", f"{100 * r['simulated_bubble']:.1f} %",
               f"**{r['error_points']:+.1f}**", f"{100 * r['analytic_bubble']:.1f} %" if "analytic_bubble" in r else "",
               f"{100 * r['calibrated_bubble']:.1f} % ({1e3 * r['message_latency_median_s']:.2f} ms; p90 "
               f"{1e3 * (r['message_latency_p90_s'] or 0):.2f})",
               f"{1e3 * r['measured_span_s']:.0f} ({1e3 * r['simulated_span_s']:.0f})",
               f"{r['throughput_samples_s']:.0f}"]
        if with_stash:
            row += [str(r["peak_stash_measured"]), str(r["stash_bound"])]
        out.append(row)
    return H.md_table(header, out)


def markdown(run: H.Run, args, vs: dict, vs_sum: dict, emu: dict) -> str:
    lines = [f"# {run.name}: pipeline executor vs torch.distributed.pipelining; bubbles; stash", "",
             H.env_markdown(), ""]
    loads = [r["other_load_cores"] for r in vs["reps"]]
    lines += [
        "## (1) Step time against torch.distributed.pipelining (real compute)", "",
        f"Model: MLP {VS_IN}-{args.hidden}x7-{VS_CLASSES} as an `nn.Sequential` of 8 layers "
        f"({sum(q.numel() for q in vs_model(args.hidden).parameters()) / 1e6:.2f} M params), SGD + momentum; "
        f"p = {VS_P} processes x 1 thread (gloo, one TCPStore on a free port), m = {args.m} micro-batches of "
        f"{args.mb}; interleaved: 2 pieces per rank. virtualflow = `build_engine` + `StageEngine.steps` driven by "
        f"`pipeline_worker.drive` (its executor, not the worker loop of `virtualflow.train`); torch = "
        f"`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B`, then `optimizer.step()`. "
        f"Alternating step by step in the same 2 processes, {args.vs_steps} steps each ({args.vs_warmup} warm-up), "
        f"{args.vs_reps} repetitions in fresh processes (other load {', '.join(f'{x:.2f}' for x in loads)} cores); "
        f"step time = the slower rank's; ratio = median over repetitions of (median step ratio).", "",
        H.md_table(["schedule", "virtualflow ms", "torch ms", "ratio", "per-rep ratios", "p25 ratio",
                    f"<= {TARGET_RATIO}", "final weights"],
                   [[s, f"{1e3 * o['vf_step_s']:.2f}", f"{1e3 * o['torch_step_s']:.2f}", f"**{o['ratio']:.3f}**",
                     " ".join(f"{x:.3f}" for x in o["ratios"]), f"{o['p25_ratio']:.3f}", H.yes_no(o["met"]),
                     "bit-identical" if o["bit_identical"] else f"max diff {o['max_abs_weight_diff']:.1e}"]
                    for s, o in vs_sum.items()]), ""]
    lad = vs["reps"][0].get("ladder")
    if lad:
        names = list(next(iter(lad.values()))["ratio_to_torch"])
        lines += [
            "### Profile: where virtualflow's extra time goes", "",
            f"Instrumented copies of `drive()` (bench code), each removing one more of the executor's extras, "
            f"alternating with torch in the same processes ({args.ladder_steps} steps, the first quarter warm-up); "
            f"step time / torch's step time:", "",
            H.md_table(["driver"] + list(lad), [[n] + [f"{lad[s]['ratio_to_torch'][n]:.2f}" for s in lad]
                                                 for n in names]), "",
            "- `drive`: the real `pipeline_worker.drive`: per message a header receive, then one blocking "
            "receive per part (activation or gradient, and on forward messages the 5 KB RNG state);",
            "- `parts together`: after the header, all parts received with one batch of irecvs;",
            "- `+ headers pre-posted`: also every header receive of the step posted at the step's start;",
            "- `no header, recv on demand`: shapes cached from the first step, no header message, parts received "
            "together when the action needs them;",
            "- `no header, recvs pre-posted`: every receive of the step posted at its start (torch posts a "
            "micro-batch's receives ahead of need, fused with its sends);",
            "- `+ no RNG part`: the RNG state is not sent with forward messages;",
            "- `+ no all-reduce`: the per-step (V+2) float64 all-reduce is skipped.", ""]
    costs = vs["reps"][0].get("costs")
    if costs:
        c = costs[0]
        lines += [
            "Costs in isolation (rank 0; one-way = half a round trip between the 2 processes): activation "
            f"({c['activation_bytes'] // 1024} KiB) alone {1e3 * c['msg_activation_s']:.3f} ms; header + activation "
            f"received one after the other {1e3 * c['msg_header_activation_s']:.3f} ms; header + activation + RNG "
            f"state ({c['rng_state_bytes']} B) one after the other (as `drive`) "
            f"{1e3 * c['msg_header_activation_rng_s']:.3f} ms, received together "
            f"{1e3 * c['msg_header_activation_rng_together_s']:.3f} ms; `get_rng_state` "
            f"{1e6 * c['get_rng_state_s']:.1f} us, `set_rng_state` {1e6 * c['set_rng_state_s']:.1f} us, "
            f"`seed_random_streams` {1e6 * c['seed_random_streams_s']:.1f} us; header build "
            f"{1e6 * c['make_header_s']:.1f} us, parse {1e6 * c['parse_header_s']:.1f} us; the per-step all-reduce "
            f"{1e3 * c['allreduce_stats_s']:.3f} ms.", ""]
        idle = costs[1]["after_idle_3ms"]
        if idle:
            a, b = idle["one_after_another"], idle["together"]
            lines += [
                "A forward message (header, activation, RNG state) sent after 3 ms of sleep (emulated compute) to a "
                "waiting receiver, 110 messages: received one part after another (as `drive`): median "
                f"{1e3 * a['median_s']:.2f} ms, p90 {1e3 * a['p90_s']:.2f} ms, p99 {1e3 * a['p99_s']:.2f} ms; parts "
                f"received together: median {1e3 * b['median_s']:.2f} ms, p90 {1e3 * b['p90_s']:.2f} ms, p99 "
                f"{1e3 * b['p99_s']:.2f} ms. (gloo moves a message only once its receive is posted: each part "
                f"received after the previous one costs another round trip, and on this VM a round trip to a "
                f"sleeping process often costs milliseconds.)", ""]
    e = emu["config"]
    rows = emu["schedules"]
    v2 = rows["2bw"]
    lines += [
        "## (2) Bubbles with emulated compute, (3) stashed activations", "",
        f"p = {EMU_P} processes (other load {emu['other_load_cores']:.2f} cores), m = {e['m']} micro-batches of "
        f"{EMU_MB}; sleep-paced layers, per stage and micro-batch: forward {args.f_ms:g} ms, backward "
        f"{args.i_ms + args.w_ms:g} ms (input-gradient path {args.i_ms:g} ms + weight-gradient path {args.w_ms:g} ms; "
        f"interleaved: 8 pieces of half these times). {e['flush_steps']} steps per flush schedule, 2BW "
        f"{e['windows']} windows of {e['window']} steps; the first call is warm-up. Bubble = mean over ranks of "
        f"1 - compute / (first compute start .. last compute end over all ranks), median over steps (2BW: windows). "
        f"Simulated = `simulate(schedule, f, b, w)` with the nominal times, comm 0; calibrated = the same with the "
        f"timeline's median action times and the median message latency (receive end - send end, receiver already "
        f"waiting). Throughput = samples / wall time of a call (a step; 2BW a window of {e['window']}), flush and "
        f"all-reduce included.", "",
        "With `drive()` (the executor as it is):", "",
        _emu_table(rows, True), ""]
    if emu.get("variant"):
        lines += [
            "Diagnostic, the same runs with every receive of a step (2BW: a window) posted at its start, parts "
            "received together, no header after the first call (bench driver; same actions in the same order):", "",
            _emu_table(emu["variant"], False), ""]
    lines += [
        f"2BW / 1F1B throughput: {v2['throughput_samples_s'] / rows['1f1b']['throughput_samples_s']:.3f}x. 2BW weight "
        f"versions: snapshots alive at every forward, peak per stage {v2['peak_snapshots_at_forward']} (bound "
        f"{v2['weight_versions_bound']}); versions used by live micro-batches {v2['peak_versions_in_flight']} "
        f"(the last "
        f"stage holds one micro-batch at a time). Besides the snapshots, each stage keeps its module's own "
        f"parameters (the optimizer's copy, {'also' if any(v2['forward_used_module_weights']) else 'never'} read by a "
        f"forward), and the rotation after each update clones the new snapshot before dropping the oldest: "
        f"{v2['peak_snapshots_transient']} snapshots alive for an instant. So weight memory is 3 copies steady and "
        f"4 at the rotation, where 2BW needs 2.", ""]
    lines += [f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Entry points.


def parse_args(argv):
    p = H.parser(__doc__, quiet_wait=20.0)
    p.add_argument("--m", type=int, default=8, help="(1) micro-batches per step")
    p.add_argument("--mb", type=int, default=32, help="(1) samples per micro-batch")
    p.add_argument("--hidden", type=int, default=VS_HIDDEN, help="(1) MLP width")
    p.add_argument("--vs-steps", type=int, default=60, help="(1) steps per side per schedule")
    p.add_argument("--vs-warmup", type=int, default=10)
    p.add_argument("--vs-reps", type=int, default=3, help="(1) repetitions in fresh processes")
    p.add_argument("--ladder-steps", type=int, default=30, help="(1) steps of the profile ladder (0: skip)")
    p.add_argument("--costs-reps", type=int, default=300, help="(1) repetitions of each isolated cost (0: skip)")
    p.add_argument("--emu-m", type=int, default=8, help="(2) micro-batches per step")
    p.add_argument("--f-ms", type=float, default=10.0, help="(2) emulated forward per stage and micro-batch")
    p.add_argument("--i-ms", type=float, default=10.0, help="(2) emulated input-gradient backward")
    p.add_argument("--w-ms", type=float, default=10.0, help="(2) emulated weight-gradient backward")
    p.add_argument("--emu-steps", type=int, default=8, help="(2) steps per flush schedule (the first: warm-up)")
    p.add_argument("--window", type=int, default=4, help="(2) 2BW steps per window")
    p.add_argument("--emu-windows", type=int, default=3, help="(2) 2BW windows (the first: warm-up)")
    p.add_argument("--no-emu-variant", dest="emu_variant", action="store_false",
                   help="(2) skip the emulated runs with receives posted ahead (the diagnostic driver)")
    p.add_argument("--child-vs", help=argparse.SUPPRESS)
    p.add_argument("--child-emu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_vs or args.child_emu:
        return args
    if args.quick:
        args.vs_steps, args.vs_warmup, args.vs_reps = 24, 6, 1
        args.ladder_steps, args.costs_reps, args.emu_steps, args.emu_windows = 10, 100, 4, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_vs:
        print(json.dumps(vs_rank(json.loads(args.child_vs))))
        return 0
    if args.child_emu:
        print(json.dumps(emu_rank(json.loads(args.child_emu))))
        return 0
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    print(H.banner(f"pipeline: virtualflow's executor vs torch.distributed.pipelining (p={VS_P}, m={args.m}, "
                   f"mb={args.mb}); emulated bubbles and stash (p={EMU_P}, m={args.emu_m})"))
    print("(1) step time against torch.distributed.pipelining, alternating in the same processes", flush=True)
    vs = measure_vs(args)
    print("(2)+(3) emulated compute: bubbles, stash, weight versions", flush=True)
    emu = measure_emu(args)
    vs_sum = summarize_vs(vs, args, run.targets)
    summarize_emu(emu, run.targets)
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("child")},
               "vs_torch": {"summary": vs_sum, "reps": vs["reps"]}, "emulated": emu,
               "how": {"vs_torch": "virtualflow's executor (build_engine + StageEngine.steps driven by "
                                   "pipeline_worker.drive over its own ProcessGroupGloo), not virtualflow.train",
                       "bubble": "mean over ranks of 1 - compute/(first compute start .. last compute end of the "
                                 "step over all ranks), median over post-warm-up steps",
                       "stash": "live contexts from saved_tensors_hooks tagged by piece forward pre-hooks"}}
    return run.finish(payload, markdown(run, args, vs, vs_sum, emu))


if __name__ == "__main__":
    sys.exit(main())
