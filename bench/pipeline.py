"""Pipeline parallelism: virtualflow's pipeline executor against ``torch.distributed.pipelining``,
its bubbles against the simulator, and its stashed activations against the schedules' bounds.

Three measurements in one run, from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline            # about 2 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --quick    # under a minute

virtualflow runs as its executor, **not the worker loop**: ``runtime.pipeline_local.build_engine`` (the
``StageEngine`` of a rank) driven by the public ``runtime.pipeline_worker.drive`` over its own
``ProcessGroupGloo`` (``virtualflow.comm.groups.make_group``), with one ``Links`` per engine kept
across steps, as ``PipelineWorkerEngine`` keeps one per generation: from the second step on, every
receive's payload is posted before the message arrives (the engine announces its receives with
``Expect``). The optimizer step and the per-step all-reduce are inside ``StageEngine.steps``.

**(1) Step time against torch.distributed.pipelining** (real compute, p = 2). Two fresh processes
(``python -m bench.pipeline --child-vs JSON``, 1 thread each) on a TCPStore the launcher hosts on a
free port. torch: ``init_process_group("gloo")``, one ``PipelineStage`` per model piece of the rank,
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (2 pieces per rank) with
``loss_fn=cross_entropy``, then ``optimizer.step()`` and ``zero_grad()``. Same ``nn.Sequential``
(an MLP of 8 layers), same pieces (``resolve_bounds`` + ``piece_module``), same initial weights,
same micro-batches (virtualflow's ``DataPlan``: micro-batch i is virtual node i; torch gets their
concatenation and splits it into m chunks), SGD + momentum; the final weights agree (key
``weight_diff``). The two alternate step by step in the same 2 processes (order swapped every
step; an untimed barrier before each step), so host noise cancels; a step's time is the slower
rank's. Per schedule and repetition (fresh processes): median over post-warm-up steps; ratio =
virtualflow / torch, the median of the repetitions' ratios. Target <= 1.00 per schedule (keys
``ratio_gpipe``, ``ratio_1f1b``, ``ratio_interleaved_1f1b``).

A second model size (``--hidden2``, 1024 by default: about 4x the compute per message, 1 repetition)
is compared the same way as a diagnostic, not a target. Diagnostic, in the same processes after
the timed steps: a few more alternating steps with the
executor's timeline switched on (``StageEngine.timeline``): per rank, the step's time in compute
(F/B actions), blocked in receives, in sends, and the rest (the engine's bookkeeping between
actions, posting receives, the optimizer, the per-step all-reduce); and the latency of a message
whose receiver was already waiting (receive end - send end).

**(2) Bubbles with emulated compute** (p = 4, m = 8, equal stage times). Four processes, each a
``StageEngine`` (``Pipeline(record_timeline=True)``) driven by ``drive``. The model's layers
*sleep*: forward ``f``; backward through custom autograd Functions that sleep ``i`` on the
input-gradient path and ``w`` on the weight-gradient path (so ``B`` = i + w, zb_h1's ``I`` = i and
``W`` = w), so 4 processes overlap on 2 cores. Bubble of a rank in a step = 1 - (its compute
time) / (first compute start to last compute end of the step over all ranks), from the timeline,
averaged over ranks, median over steps (2BW: windows of steps). Against
``virtualflow.plan.pipeline.simulate`` with the nominal times, and for 1F1B also the analytic
``(p-1)/(m+p-1)``: within 5 points (key ``bubble_error``); interleaved and zb_h1 below 1F1B;
2BW throughput (samples/s over a window of steps) above 1F1B's (key ``throughput_2bw``).
``--f-ms/--i-ms/--w-ms`` change the emulated unit (10 ms each by default).

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
import weakref

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H
from bench.harness.emulated import sleep_through

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
SEED = H.SEED
CPU = torch.device("cpu")
COMPUTE = ("F", "B", "I", "W")

# (1) the real-compute workload
VS_P = 2
VS_IN, VS_HIDDEN, VS_CLASSES = 256, 512, H.CLASSES
VS_DATASET = 4096

# (2) the emulated workload
EMU_P = 4
EMU_WIDTH = 16
EMU_MB = 4


def vs_data() -> TensorDataset:
    """The harness's synthetic classification set, cut to 4,096 samples of its first 256 features
    (labels from its teacher)."""
    x, y = H.bench_data().tensors
    return TensorDataset(x[:VS_DATASET, :VS_IN].contiguous(), y[:VS_DATASET])


def vs_model(hidden: int = VS_HIDDEN) -> nn.Sequential:
    """8 layers: 7 Linear+ReLU blocks and a Linear head (p=2: 4 + 4 layers; v=2: 2 per piece)."""
    blocks = [nn.Sequential(nn.Linear(VS_IN, hidden), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(hidden, VS_CLASSES))


def vs_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def vs_job(schedule: str, m: int, mb: int, hidden: int):
    import virtualflow as vf

    chunks = 2 if schedule == "interleaved_1f1b" else 1
    return vf.Job(model=lambda: vs_model(hidden), optimizer=H.sgd, output_loss=vs_loss, dataset=vs_data,
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


class _Driver:
    """One rank's virtualflow side: its group, a trivial stage group (one pipeline replica) and
    ``drive`` with one :class:`Links` per engine, kept across that engine's steps."""

    def __init__(self, cfg: dict, p: int) -> None:
        import torch.distributed as dist

        from virtualflow.comm.groups import make_group
        from virtualflow.pipeline import Grid

        torch.set_num_threads(1)
        self.store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))
        self.group = make_group(self.store, 0, cfg["rank"], cfg["world"], 120.0, CPU)
        self.trivial = make_group(self.store, 1, 0, 1, 120.0, CPU)
        self.grid = Grid(p, 1, cfg["rank"])
        self.links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def run(self, engine, first_step: int, n_steps: int = 1) -> list:
        from virtualflow.runtime.pipeline_worker import Links, drive

        links = self.links.get(engine)
        if links is None:
            links = self.links[engine] = Links()
        return drive(engine.steps(first_step, n_steps), group=self.group, stage_group=self.trivial, grid=self.grid,
                     n_pieces=engine.n_pieces, device=CPU, links=links)

    def barrier(self) -> None:
        self.group.all_reduce(torch.zeros(1))

    def close(self) -> None:
        self.group.close()


# --------------------------------------------------------------------------------------------
# (1) virtualflow's executor vs torch.distributed.pipelining, alternating in the same processes.


class _TimedPg:
    """Diagnostic: virtualflow's process group, timing each call that posts a send or a receive
    (``Group.isend`` / ``irecv`` / ``recv`` make one each); everything else is passed through."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.calls: dict[str, list[float]] = {"send": [], "recv": []}

    def __getattr__(self, name: str):
        return getattr(self.pg, name)

    def send(self, tensors, dst: int, tag: int):
        return self._timed("send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._timed("recv", tensors, src, tag)

    def _timed(self, kind: str, tensors, peer: int, tag: int):
        t0 = time.perf_counter()
        work = getattr(self.pg, kind)(tensors, peer, tag)
        self.calls[kind].append(time.perf_counter() - t0)
        return work

    def take(self) -> dict[str, list[float]]:
        calls, self.calls = self.calls, {"send": [], "recv": []}
        return calls


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
    opt = H.sgd([q for st in stages for q in st.submod.parameters()])
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
    from virtualflow.runtime.pipeline_local import build_engine

    job = vs_job(schedule, m, mb, hidden)
    bounds = resolve_bounds(job.pipeline, len(layers_of(vs_model(hidden))))
    engine = build_engine(job, job.pipeline, bounds, rank, dataset=ds, deterministic=False, device=CPU)
    engine.set_layout(0, [list(range(m))])
    return engine


def vs_rank(cfg: dict) -> dict:
    """One rank of the comparison: every schedule of ``cfg['schedules']`` in turn; virtualflow and
    torch alternate step by step, then (``cfg['diag_steps']``) more steps with the timeline on."""
    import torch.distributed as dist

    drv = _Driver(cfg, VS_P)
    rank, world, m, mb, hidden = cfg["rank"], cfg["world"], cfg["m"], cfg["mb"], cfg["hidden"]
    dist.init_process_group("gloo", store=dist.PrefixStore("torch", drv.store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out: dict = {"rank": rank, "schedules": {}}
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

        sides = {"vf": lambda t: drv.run(engine, t)[0].loss, "torch": torch_step}

        def alternate(first: int, n: int, times: dict, losses: dict, stamps: list | None = None) -> None:
            for t in range(first, first + n):
                for which in H.pair_order(t, "vf", "torch"):
                    dist.barrier()
                    t0, w0 = time.perf_counter(), time.time()
                    losses[which].append(sides[which](t))
                    times[which].append(time.perf_counter() - t0)
                    if which == "vf" and stamps is not None:
                        stamps.append((w0, time.time(), drv.group.pg.take()))

        times: dict[str, list[float]] = {"vf": [], "torch": []}
        losses: dict[str, list[float]] = {"vf": [], "torch": []}
        alternate(0, cfg["steps"], times, losses)
        theirs = {k: v for st in stages for k, v in st.submod.state_dict().items()}
        mine = engine.model.state_dict()
        row = out["schedules"][schedule] = {
            "times": times, "losses": losses, "n_pieces": engine.n_pieces,
            "max_abs_weight_diff": H.state_max_abs_diff(theirs, mine),
            "bit_identical": all(torch.equal(mine[k], theirs[k]) for k in theirs),
        }
        if cfg["diag_steps"]:
            engine.timeline, pg = [], drv.group.pg
            drv.group.pg = _TimedPg(pg)
            diag_times: dict[str, list[float]] = {"vf": [], "torch": []}
            stamps: list = []
            alternate(cfg["steps"], cfg["diag_steps"], diag_times, {"vf": [], "torch": []}, stamps)
            drv.group.pg = pg
            row["diag"] = {"times": diag_times, "stamps": stamps, "first_step": cfg["steps"],
                           "timeline": [{k: e[k] for k in ("kind", "stage", "mb", "step", "start", "end")}
                                        for e in engine.timeline]}
            engine.timeline = None
        dist.barrier()
    drv.close()
    dist.destroy_process_group()
    return out


def _message_latency(timelines: list[list[dict]], call_key: str = "call") -> list[float]:
    """Per message whose receiver was already waiting: receive end - send end (seconds)."""
    sends = {}
    for tl in timelines:
        for e in tl:
            if e["kind"] in ("SEND_F", "SEND_B"):
                to = e["stage"] + 1 if e["kind"] == "SEND_F" else e["stage"] - 1
                sends[e["kind"][-1], to, e["mb"], e[call_key]] = e
    out = []
    for tl in timelines:
        for e in tl:
            if e["kind"] in ("RECV_F", "RECV_B"):
                snd = sends.get((e["kind"][-1], e["stage"], e["mb"], e[call_key]))
                if snd is not None and e["start"] < snd["end"]:
                    out.append(max(0.0, e["end"] - snd["end"]))
    return out


def _breakdown(per_rank: list[dict], warm: int) -> dict:
    """From the diagnostic steps' timelines: per rank, median ms per step in compute, blocked in
    receives, in sends and the rest of the step; message latencies."""
    ranks = []
    for d in per_rank:
        steps = range(d["first_step"] + warm, d["first_step"] + len(d["stamps"]))
        parts: dict[str, list[float]] = {"step": [], "compute": [], "recv": [], "send": [], "other": [],
                                         "gloo_sends": [], "gloo_recvs": [], "gloo_send_s": [], "gloo_recv_s": []}
        for t, (w0, w1, calls) in zip(steps, d["stamps"][warm:]):
            ev = [e for e in d["timeline"] if e["step"] == t]
            compute = sum(e["end"] - e["start"] for e in ev if e["kind"] in COMPUTE)
            recv = sum(e["end"] - e["start"] for e in ev if e["kind"].startswith("RECV"))
            send = sum(e["end"] - e["start"] for e in ev if e["kind"].startswith("SEND"))
            for k, v in (("step", w1 - w0), ("compute", compute), ("recv", recv), ("send", send),
                         ("other", w1 - w0 - compute - recv - send), ("gloo_sends", len(calls["send"])),
                         ("gloo_recvs", len(calls["recv"])), ("gloo_send_s", sum(calls["send"])),
                         ("gloo_recv_s", sum(calls["recv"]))):
                parts[k].append(v)
        ranks.append({k: H.median(v) for k, v in parts.items()})
    lat = _message_latency([[e for e in d["timeline"] if e["step"] >= d["first_step"] + warm] for d in per_rank],
                           "step")
    vf_t = [max(xs) for xs in zip(*(d["times"]["vf"] for d in per_rank))][warm:]
    th_t = [max(xs) for xs in zip(*(d["times"]["torch"] for d in per_rank))][warm:]
    return {"per_rank_s": ranks, "message_latency_median_s": H.median(lat) if lat else None,
            "message_latency_p90_s": H.quantile(lat, 0.9) if lat else None, "messages": len(lat),
            "vf_step_s": H.median(vf_t), "torch_step_s": H.median(th_t)}


def measure_vs(args, hidden: int, n_reps: int, diag_steps: int) -> dict:
    reps = []
    for rep in range(n_reps):
        k = rep % len(VS_SCHEDULES)
        order = list(VS_SCHEDULES[k:] + VS_SCHEDULES[:k])
        cfg = {"schedules": order, "m": args.m, "mb": args.mb, "hidden": hidden, "steps": args.vs_steps,
               "diag_steps": diag_steps}
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
            line = (f"  hidden={hidden} rep {rep} {s:17s} virtualflow {1e3 * vf_med:7.2f} ms, torch {1e3 * th_med:7.2f} ms, ratio "
                    f"{r['ratio']:.3f} (p25 {r['p25_ratio']:.3f}); max |weight diff| {r['max_abs_weight_diff']:.1e}"
                    f"{' (bit-identical)' if r['bit_identical'] else ''}")
            if "diag" in per[0]:
                d = r["diag"] = _breakdown([p["diag"] for p in per], max(1, diag_steps // 5))
                line += "\n      timeline on: vf {:.2f} ms, torch {:.2f} ms; per rank ms compute/recv/send/other " \
                        "(gloo sends+receives posted: n, ms): {}; message latency {:.2f} ms (p90 {:.2f})".format(
                            1e3 * d["vf_step_s"], 1e3 * d["torch_step_s"],
                            " | ".join("/".join(f"{1e3 * x[k]:.1f}" for k in ("compute", "recv", "send", "other"))
                                       + f" ({x['gloo_sends'] + x['gloo_recvs']:.0f}, "
                                         f"{1e3 * (x['gloo_send_s'] + x['gloo_recv_s']):.1f})"
                                       for x in d["per_rank_s"]),
                            1e3 * (d["message_latency_median_s"] or 0), 1e3 * (d["message_latency_p90_s"] or 0))
            print(line, flush=True)
        reps.append(row)
    return {"hidden": hidden, "reps": reps}


def summarize_vs(vs: dict, args, targets: H.Targets | None) -> dict:
    """Per schedule: the median ratio over repetitions (checked against the target when
    ``targets`` is given; the second model size is a diagnostic)."""
    out = {}
    for s in VS_SCHEDULES:
        rows = [r["schedules"][s] for r in vs["reps"]]
        ratios = [r["ratio"] for r in rows]
        ratio = H.median(ratios)
        met = ratio <= TARGET_RATIO
        if targets is not None:
            met = targets.at_most(f"ratio_{s}", f"p={VS_P} m={args.m} mb={args.mb} hidden={vs['hidden']} {s}: "
                                  f"virtualflow / torch.distributed.pipelining step time (median of {len(ratios)} "
                                  f"repetitions)", ratio, TARGET_RATIO)
        out[s] = {"ratio": ratio, "ratios": ratios, "met": met,
                  "p25_ratio": H.median([r["p25_ratio"] for r in rows]),
                  "vf_step_s": H.median([r["vf_step_s"] for r in rows]),
                  "torch_step_s": H.median([r["torch_step_s"] for r in rows]),
                  "max_abs_weight_diff": max(r["max_abs_weight_diff"] for r in rows),
                  "bit_identical": all(r["bit_identical"] for r in rows)}
    if targets is not None:
        targets.at_most("weight_diff", "same computation: max |final weight difference| virtualflow vs torch",
                        max(o["max_abs_weight_diff"] for o in out.values()), TARGET_WEIGHT_DIFF)
    return out


# --------------------------------------------------------------------------------------------
# (2) + (3) emulated compute: sleep-paced layers, p = 4.


class PacedLayer(nn.Module):
    """Forward sleeps ``f``; backward sleeps ``i`` on the input-gradient path and ``w`` on the
    weight-gradient path; ``x * gain + bias`` saves tensors for backward like a real layer."""

    def __init__(self, width: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.f, self.i, self.w = f, i, w

    def forward(self, x):
        return sleep_through(x, self.f, self.i) * sleep_through(self.gain, 0.0, self.w) + self.bias


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


def emu_rank(cfg: dict) -> dict:
    """One rank of the emulated pipeline: every schedule in turn, with timelines and stash counts."""
    from virtualflow.pipeline import bounds_from_counts
    from virtualflow.runtime.pipeline_local import build_engine

    drv = _Driver(cfg, EMU_P)
    rank, m, window = cfg["rank"], cfg["m"], cfg["window"]
    ds = emu_data()
    out: dict = {"rank": rank, "runs": {}}
    for schedule in cfg["schedules"]:
        job = emu_job(schedule, m, cfg["f"], cfg["i"], cfg["w"], window)
        engine = build_engine(job, job.pipeline, bounds_from_counts(job.pipeline.split), rank, dataset=ds,
                              deterministic=False, device=CPU)
        engine.set_layout(0, [list(range(m))])
        meter = _StashMeter()
        hooks = [piece.register_forward_pre_hook(meter.opener(piece)) for piece in engine.pieces.values()]
        meter.wrap_snapshot(engine)
        module_ptrs = {q.data_ptr() for q in engine.model.parameters()}
        per_call = 1 if job.pipeline.flush else window
        calls = cfg["flush_steps"] if job.pipeline.flush else cfg["windows"]
        timeline, call_times = [], []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            for c in range(calls):
                drv.barrier()  # line up (untimed)
                t0 = time.time()
                drv.run(engine, c * per_call, per_call)
                call_times.append(time.time() - t0)
                timeline += [{**e, "call": c} for e in engine.timeline]
                engine.timeline.clear()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        for h in hooks:
            h.remove()
        out["runs"][schedule] = {
            "timeline": timeline, "call_times": call_times, "steps_per_call": per_call, "cpu_s": cpu_s,
            "wall_s": wall_s, "peak_stash": meter.peak, "peak_versions_in_flight": meter.peak_versions,
            "versions_seen": len(meter.versions_seen), "peak_snapshots_at_forward": meter.peak_snapshots_at_forward,
            "peak_snapshots_transient": meter.peak_snapshots_transient, "snapshots_made": meter.snapshots_made,
            "forward_used_module_weights": bool(meter.versions_seen & module_ptrs), "left_live": len(meter.live),
        }
        drv.barrier()
    drv.close()
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
            if e["call"] in calls and e["kind"] in COMPUTE:
                d.setdefault((e["kind"], e["stage"]), []).append(e["end"] - e["start"])
    med = {k: H.median(v) for k, v in d.items()}
    fs = [med[("F", s)] for s in range(n_stages)]
    if ("B", 0) in med:
        return fs, [med[("B", s)] for s in range(n_stages)], [0.0] * n_stages
    ws = [med[("W", s)] for s in range(n_stages)]
    return fs, [med[("I", s)] + ws[s] for s in range(n_stages)], ws


def measure_emu(args) -> dict:
    from virtualflow.plan.pipeline import simulate

    cfg = {"schedules": list(EMU_SCHEDULES), "m": args.emu_m, "f": args.f_ms / 1e3, "i": args.i_ms / 1e3,
           "w": args.w_ms / 1e3, "window": args.window, "flush_steps": args.emu_steps, "windows": args.emu_windows}
    H.wait_for_quiet(args.quiet_wait)
    with H.LoadMeter() as meter:
        ranks = _start_children("--child-emu", EMU_P, cfg)
    m, f, i, w, window = cfg["m"], cfg["f"], cfg["i"], cfg["w"], cfg["window"]
    res: dict = {"other_load_cores": meter.other_cores, "config": cfg, "schedules": {}}
    for s in EMU_SCHEDULES:
        sched = _emu_schedule(s, m, window)
        sim = simulate(sched, *_nominal_times(s, f, i, w))
        per = [r["runs"][s] for r in ranks]
        n_calls = len(per[0]["call_times"])
        calls = set(range(1 if n_calls > 1 else 0, n_calls))  # the first call is warm-up
        timelines = [[e for e in p["timeline"] if e["call"] in calls] for p in per]
        bubbles, spans = [], []
        per_rank = [[] for _ in range(EMU_P)]
        for c in sorted(calls):
            ev = [[e for e in tl if e["call"] == c and e["kind"] in COMPUTE] for tl in timelines]
            span = max(e["end"] for r in ev for e in r) - min(e["start"] for r in ev for e in r)
            spans.append(span)
            for r in range(EMU_P):
                per_rank[r].append(1 - sum(e["end"] - e["start"] for e in ev[r]) / span)
            bubbles.append(sum(b[-1] for b in per_rank) / EMU_P)
        lat = _message_latency(timelines)
        comm = H.median(lat) if lat else 0.0
        calib = simulate(sched, *_measured_times(timelines, sched.stages, calls), comm_time=comm)
        measured = H.median(bubbles)
        sim_bubble = sum(sim.bubble) / EMU_P
        calib_bubble = sum(calib.bubble) / EMU_P
        call_time = H.median([max(xs) for xs in zip(*(p["call_times"] for p in per))][min(calls):])
        spc = per[0]["steps_per_call"]
        row = res["schedules"][s] = {
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
        print(f"  {s:17s} bubble {100 * measured:5.1f} %, simulated {100 * sim_bubble:5.1f} %"
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


def _diag_table(vs: dict) -> str:
    rows = []
    for i, rep in enumerate(vs["reps"]):
        for s, r in rep["schedules"].items():
            d = r.get("diag")
            if not d:
                continue
            rows.append([str(i), s, H.ms(d["vf_step_s"], 2), H.ms(d["torch_step_s"], 2)]
                        + [" / ".join(f"{1e3 * x[k]:.1f}" for x in d["per_rank_s"])
                           for k in ("compute", "recv", "send", "other")]
                        + [" / ".join(f"{x['gloo_sends']:.0f} + {x['gloo_recvs']:.0f}" for x in d["per_rank_s"]),
                           " / ".join(f"{1e3 * x['gloo_send_s']:.1f} + {1e3 * x['gloo_recv_s']:.1f}"
                                      for x in d["per_rank_s"])]
                        + [f"{H.ms(d['message_latency_median_s'], 2)} ({H.ms(d['message_latency_p90_s'], 2)})"])
    return H.md_table(["rep", "schedule", "virtualflow ms", "torch ms", "compute ms (rank 0 / 1)",
                       "blocked in receives ms", "sends ms", "rest of the step ms", "gloo sends + receives posted",
                       "ms in those calls", "message latency ms (p90)"], rows)


def _emu_table(rows: dict) -> str:
    header = ["schedule", "bubble measured", "simulated (nominal)", "error (points)", "analytic",
              "calibrated (measured times + median message latency)", "span ms (simulated)", "samples/s",
              "peak stash per rank", "stash_bound"]
    out = []
    for s, r in rows.items():
        out.append([s, f"{100 * r['measured_bubble']:.1f} %", f"{100 * r['simulated_bubble']:.1f} %",
                    f"**{r['error_points']:+.1f}**",
                    f"{100 * r['analytic_bubble']:.1f} %" if "analytic_bubble" in r else "",
                    f"{100 * r['calibrated_bubble']:.1f} % ({H.ms(r['message_latency_median_s'], 2)} ms; p90 "
                    f"{H.ms(r['message_latency_p90_s'], 2)})",
                    f"{1e3 * r['measured_span_s']:.0f} ({1e3 * r['simulated_span_s']:.0f})",
                    f"{r['throughput_samples_s']:.0f}", str(r["peak_stash_measured"]), str(r["stash_bound"])])
    return H.md_table(header, out)


def _vs_table(vs_sum: dict) -> str:
    return H.md_table(["schedule", "virtualflow ms", "torch ms", "ratio", "per-rep ratios", "p25 ratio",
                       f"<= {TARGET_RATIO}", "final weights"],
                      [[s, H.ms(o["vf_step_s"], 2), H.ms(o["torch_step_s"], 2), f"**{o['ratio']:.3f}**",
                        " ".join(f"{x:.3f}" for x in o["ratios"]), f"{o['p25_ratio']:.3f}", H.yes_no(o["met"]),
                        "bit-identical" if o["bit_identical"] else f"max diff {o['max_abs_weight_diff']:.1e}"]
                       for s, o in vs_sum.items()])


def markdown(run: H.Run, args, vs: dict, vs_sum: dict, vs2: dict | None, vs2_sum: dict | None, emu: dict) -> str:
    lines = [f"# {run.name}: pipeline executor vs torch.distributed.pipelining; bubbles; stash", "",
             H.env_markdown(), ""]
    loads = [r["other_load_cores"] for r in vs["reps"]]
    lines += [
        "## (1) Step time against torch.distributed.pipelining (real compute)", "",
        f"Model: MLP {VS_IN}-{args.hidden}x7-{VS_CLASSES} as an `nn.Sequential` of 8 layers "
        f"({sum(q.numel() for q in vs_model(args.hidden).parameters()) / 1e6:.2f} M params), SGD + momentum; "
        f"p = {VS_P} processes x 1 thread (gloo, one TCPStore on a free port), m = {args.m} micro-batches of "
        f"{args.mb}; interleaved: 2 pieces per rank. virtualflow = `build_engine` + `StageEngine.steps` driven by "
        f"`pipeline_worker.drive(..., links=Links())` (one `Links` per engine, kept across steps; its executor, not "
        f"the worker loop of `virtualflow.train`); torch = `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / "
        f"`ScheduleInterleaved1F1B`, then `optimizer.step()`. Alternating step by step in the same 2 processes, "
        f"{args.vs_steps} steps each ({args.vs_warmup} warm-up), {args.vs_reps} repetitions in fresh processes "
        f"(other load {', '.join(f'{x:.2f}' for x in loads)} cores); step time = the slower rank's; ratio = median "
        f"over repetitions of (median step ratio).", "",
        _vs_table(vs_sum), ""]
    if vs2 is not None:
        lines += [
            f"The same comparison at hidden = {vs2['hidden']} (about {(vs2['hidden'] / args.hidden) ** 2:.0f}x the "
            f"compute and {vs2['hidden'] / args.hidden:.0f}x the bytes per message; "
            f"{sum(q.numel() for q in vs_model(vs2['hidden']).parameters()) / 1e6:.2f} M params; {len(vs2['reps'])} "
            f"repetition(s); a diagnostic, not a target): a fixed cost per message shows as about the same "
            f"milliseconds and a smaller ratio.", "",
            _vs_table(vs2_sum), ""]
    if args.diag_steps:
        lines += [
            "### Where the executor's step time goes (diagnostic)", "",
            f"{args.diag_steps} more alternating steps per schedule and repetition in the same processes, with the "
            f"executor's timeline on (the first {max(1, args.diag_steps // 5)} not counted); per rank, median ms per "
            f"step: compute = its F/B actions; blocked in receives = RECV actions (waiting for the peer's compute "
            f"included); sends = SEND actions (packing and posting); rest = the step's wall time minus all actions "
            f"(posting receives, the optimizer, the per-step all-reduce, the engine's bookkeeping). gloo sends + "
            f"receives posted: the calls into virtualflow's `ProcessGroupGloo` that post a send or a receive "
            f"(per step, and the ms spent inside them: sends within the SEND actions, receives mostly in the "
            f"rest, posted when the engine announces them); torch.distributed.pipelining posts one send and one "
            f"receive per message. Message latency = receive end - send end for a message whose receiver was "
            f"already waiting.", "",
            _diag_table(vs), ""]
    e = emu["config"]
    rows = emu["schedules"]
    v2 = rows["2bw"]
    lines += [
        "## (2) Bubbles with emulated compute, (3) stashed activations", "",
        f"p = {EMU_P} processes (other load {emu['other_load_cores']:.2f} cores), m = {e['m']} micro-batches of "
        f"{EMU_MB}; sleep-paced layers, per stage and micro-batch: forward {args.f_ms:g} ms, backward "
        f"{args.i_ms + args.w_ms:g} ms (input-gradient path {args.i_ms:g} ms + weight-gradient path {args.w_ms:g} ms; "
        f"interleaved: 8 pieces of half these times). {e['flush_steps']} steps per flush schedule, 2BW "
        f"{e['windows']} windows of {e['window']} steps; the first call is warm-up. virtualflow = `drive` with one "
        f"`Links` per engine. Bubble = mean over ranks of 1 - compute / (first compute start .. last compute end over "
        f"all ranks), median over steps (2BW: windows). Simulated = `simulate(schedule, f, b, w)` with the nominal "
        f"times, comm 0; calibrated = the same with the timeline's median action times and the median message "
        f"latency (receive end - send end, receiver already waiting). Throughput = samples / wall time of a call "
        f"(a step; 2BW a window of {e['window']}), flush and all-reduce included.", "",
        _emu_table(rows), "",
        f"2BW / 1F1B throughput: {v2['throughput_samples_s'] / rows['1f1b']['throughput_samples_s']:.3f}x. 2BW weight "
        f"versions: snapshots alive at every forward, peak per stage {v2['peak_snapshots_at_forward']} (bound "
        f"{v2['weight_versions_bound']}); versions used by live micro-batches {v2['peak_versions_in_flight']} "
        f"(the last stage holds one micro-batch at a time). Besides the snapshots, each stage keeps its module's own "
        f"parameters (the optimizer's copy, {'also' if any(v2['forward_used_module_weights']) else 'never'} read by a "
        f"forward), and the rotation after each update clones the new snapshot before dropping the oldest: "
        f"{v2['peak_snapshots_transient']} snapshots alive for an instant.", "",
        f"Reproduce: `{run.command(NAME)}`"]
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
    p.add_argument("--hidden2", type=int, default=2 * VS_HIDDEN,
                   help="(1) a second MLP width, compared as a diagnostic (0: skip)")
    p.add_argument("--hidden2-reps", type=int, default=1, help="(1) repetitions at --hidden2")
    p.add_argument("--diag-steps", type=int, default=20,
                   help="(1) more steps per schedule with the executor's timeline on (0: skip)")
    p.add_argument("--emu-m", type=int, default=8, help="(2) micro-batches per step")
    p.add_argument("--f-ms", type=float, default=10.0, help="(2) emulated forward per stage and micro-batch")
    p.add_argument("--i-ms", type=float, default=10.0, help="(2) emulated input-gradient backward")
    p.add_argument("--w-ms", type=float, default=10.0, help="(2) emulated weight-gradient backward")
    p.add_argument("--emu-steps", type=int, default=8, help="(2) steps per flush schedule (the first: warm-up)")
    p.add_argument("--window", type=int, default=4, help="(2) 2BW steps per window")
    p.add_argument("--emu-windows", type=int, default=3, help="(2) 2BW windows (the first: warm-up)")
    p.add_argument("--child-vs", help=argparse.SUPPRESS)
    p.add_argument("--child-emu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not (args.child_vs or args.child_emu):
        args.vs_steps, args.vs_warmup, args.vs_reps, args.diag_steps = 24, 6, 1, 10
        args.emu_steps, args.emu_windows = 4, 2
    return args


CHILDREN = {"child_vs": "vs_rank", "child_emu": "emu_rank"}


def main(argv=None) -> int:
    args = parse_args(argv)
    for flag, fn in CHILDREN.items():
        if getattr(args, flag):
            print(json.dumps(globals()[fn](json.loads(getattr(args, flag)))))
            return 0
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    print(H.banner(f"pipeline: virtualflow's executor vs torch.distributed.pipelining (p={VS_P}, m={args.m}, "
                   f"mb={args.mb}); emulated bubbles and stash (p={EMU_P}, m={args.emu_m})"))
    print("(1) step time against torch.distributed.pipelining, alternating in the same processes", flush=True)
    vs = measure_vs(args, args.hidden, args.vs_reps, args.diag_steps)
    vs2 = measure_vs(args, args.hidden2, args.hidden2_reps, 0) if args.hidden2 else None
    print("(2)+(3) emulated compute: bubbles, stash, weight versions", flush=True)
    emu = measure_emu(args)
    vs_sum = summarize_vs(vs, args, run.targets)
    vs2_sum = summarize_vs(vs2, args, None) if vs2 is not None else None
    summarize_emu(emu, run.targets)
    payload = {"benchmark": run.name, "environment": H.environment(),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("child")},
               "vs_torch": {"hidden": args.hidden, "summary": vs_sum, "reps": vs["reps"]},
               "vs_torch_hidden2": (None if vs2 is None else
                                    {"hidden": vs2["hidden"], "summary": vs2_sum, "reps": vs2["reps"]}),
               "emulated": emu,
               "how": {"vs_torch": "virtualflow's executor (build_engine + StageEngine.steps driven by "
                                   "pipeline_worker.drive with one Links per engine kept across steps, over its own "
                                   "ProcessGroupGloo), not virtualflow.train",
                       "bubble": "mean over ranks of 1 - compute/(first compute start .. last compute end of the "
                                 "step over all ranks), median over post-warm-up steps",
                       "stash": "live contexts from saved_tensors_hooks tagged by piece forward pre-hooks"}}
    return run.finish(payload, markdown(run, args, vs, vs_sum, vs2, vs2_sum, emu))


if __name__ == "__main__":
    sys.exit(main())
