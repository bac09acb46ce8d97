"""(4) Deterministic mode's pipelined step against the default mode's (1F1B, p = 2, d = 2).

Four fresh processes (``python -m bench.pipeline --child-det JSON``, 1 thread each): two pipeline
replicas of two stages. Each rank builds two ``StageEngine`` s of the same job (``build_engine``),
one in deterministic mode and one in default mode, and drives them with ``links.drive`` over the
same groups: the generation's (duplex, as a pipelined job builds it) and its stage group (the
two replicas of its stage-rank), with one ``Links`` and one ``StageExchanges`` (``"auto"``, as a
training job's knob) per engine kept across steps. The two modes alternate step by step in the
same processes (the order swapped every step, an untimed barrier before each), so host noise
cancels; a step's time is the slowest rank's. Ratio = median deterministic step / median default
step after warm-up; per repetition in fresh processes, the median of the repetitions' ratios.
Target <= 1.10 (key ``ratio_deterministic``). Also checked: the deterministic replicas hold the
same weights bit for bit at the end (key-free check).
"""

from __future__ import annotations

import datetime
import time

import torch

from bench import harness as H
from bench.pipeline.children import start_children
from bench.pipeline.workload import CPU, vs_data, vs_job, vs_model

DET_P, DET_D = 2, 2
DET_SCHEDULE = "1f1b"
TARGET_DET_RATIO = 1.10


def _engines(m: int, mb: int, hidden: int, rank: int, ds) -> dict:
    from virtualflow.backends.inprocess import build_engine
    from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
    from virtualflow.plan.vnmap import contiguous_assignment

    job = vs_job(DET_SCHEDULE, m, mb, hidden, replicas=DET_D)
    bounds = resolve_bounds(job.pipeline, len(layers_of(vs_model(hidden))))
    out = {}
    for name, deterministic in (("deterministic", True), ("default", False)):
        engine = build_engine(job, job.pipeline, bounds, rank % DET_P, dataset=ds, deterministic=deterministic,
                              device=CPU)
        engine.set_layout(rank // DET_P, contiguous_assignment(job.virtual_nodes, DET_D))
        out[name] = engine
    return out


def det_rank(cfg: dict) -> dict:
    """One rank: both modes' engines, alternating step by step; their step times and, for the
    deterministic engine, a digest of its final weights."""
    import torch.distributed as dist

    from virtualflow.comm.groups import make_group
    from virtualflow.plan.pipeline.geometry import Grid
    from virtualflow.runtime.pipeline.links import Links, StageExchanges, drive

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=120))
    group = make_group(store, 0, rank, world, 120.0, CPU, bind=["127.0.0.1"], duplex=True)
    group.abort_check = lambda: False  # waited for as a worker waits (the flag is never raised here)
    stage_group = make_group(store, 1 + rank % DET_P, rank // DET_P, DET_D, 120.0, CPU, bind=["127.0.0.1"])
    stage_group.abort_check = lambda: False
    grid = Grid(DET_P, DET_D, rank)
    engines = _engines(cfg["m"], cfg["mb"], cfg["hidden"], rank, vs_data())
    kept = {name: (Links(), StageExchanges()) for name in engines}

    def step(name: str, t: int) -> float:
        e, (links, exchanges) = engines[name], kept[name]
        return drive(e.steps(t, 1), group=group, stage_group=stage_group, grid=grid, n_pieces=e.n_pieces,
                     device=CPU, links=links, exchanges=exchanges)[0].loss

    names = list(engines)
    times: dict[str, list[float]] = {k: [] for k in names}
    for t in range(cfg["steps"]):
        k = t % len(names)
        for name in names[k:] + names[:k]:
            group.all_reduce(torch.zeros(1))  # an untimed barrier
            t0 = time.perf_counter()
            step(name, t)
            times[name].append(time.perf_counter() - t0)
    flat = torch.cat([q.detach().reshape(-1) for q in engines["deterministic"].model.parameters()])
    digest = float(flat.double().sum()), float((flat.double() ** 2).sum())
    choice = kept["deterministic"][1].choices.get(None)
    group.all_reduce(torch.zeros(1))
    group.close()
    stage_group.close()
    return {"rank": rank, "times": times, "digest": digest, "exchange": list(choice) if choice else None}


def measure_det(args) -> dict:
    """Per repetition in fresh processes: the median step of each mode and their ratio."""
    reps = []
    for rep in range(args.det_reps):
        cfg = {"m": args.m, "mb": args.mb, "hidden": args.hidden, "steps": args.det_steps}
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            ranks = start_children("--child-det", DET_P * DET_D, cfg)
        w = args.det_warmup
        per_mode = {}
        for name in ("deterministic", "default"):
            slowest = [max(xs) for xs in zip(*(r["times"][name] for r in ranks))]
            per_mode[name] = {"step_s": H.median(slowest[w:]), "raw_step_s": slowest}
        ratio = per_mode["deterministic"]["step_s"] / per_mode["default"]["step_s"]
        # stage-rank s of replica 0 and of replica 1 hold the same pieces: equal bits
        same = all(ranks[s]["digest"] == ranks[s + DET_P]["digest"] for s in range(DET_P))
        reps.append({"other_load_cores": meter.other_cores, "ratio": ratio, "modes": per_mode,
                     "replicas_bit_identical": same, "exchange": ranks[0]["exchange"]})
        print(f"  rep {rep}: deterministic {1e3 * per_mode['deterministic']['step_s']:.2f} ms, default "
              f"{1e3 * per_mode['default']['step_s']:.2f} ms, ratio {ratio:.3f}; exchange "
              f"{(ranks[0]['exchange'] or ['-'])[0]}; replicas {'bit-identical' if same else 'DIFFER'}", flush=True)
    return {"reps": reps}


def summarize_det(det: dict, args, targets: H.Targets) -> dict:
    ratios = [r["ratio"] for r in det["reps"]]
    ratio = H.median(ratios)
    met = targets.at_most("ratio_deterministic", f"{DET_SCHEDULE} p={DET_P} d={DET_D} m={args.m} mb={args.mb} "
                          f"hidden={args.hidden}: deterministic / default pipelined step time (median of "
                          f"{len(ratios)} repetitions)", ratio, TARGET_DET_RATIO)
    same = all(r["replicas_bit_identical"] for r in det["reps"])
    targets.holds("deterministic mode: both pipeline replicas end with the same weights, bit for bit", same)
    return {"ratio": ratio, "ratios": ratios, "met": met, "replicas_bit_identical": same}


def det_markdown(args, det: dict, summary: dict) -> list[str]:
    rows = [[str(i), H.ms(r["modes"]["deterministic"]["step_s"], 2), H.ms(r["modes"]["default"]["step_s"], 2),
             f"**{r['ratio']:.3f}**", (r["exchange"] or ["-"])[0], f"{r['other_load_cores']:.2f}"]
            for i, r in enumerate(det["reps"])]
    return [
        f"## (4) Deterministic vs default pipelined step ({DET_SCHEDULE}, p = {DET_P}, d = {DET_D})", "",
        f"MLP {args.hidden} wide (as (1)), m = {args.m} micro-batches of {args.mb} per replica, {DET_P * DET_D} "
        f"processes x 1 thread; each rank drives a deterministic and a default `StageEngine` of the same job with "
        f"`links.drive`, alternating step by step ({args.det_steps} steps each, {args.det_warmup} warm-up); step "
        f"time = the slowest rank's. Ratio {summary['ratio']:.3f} (target <= {TARGET_DET_RATIO}: "
        f"{H.yes_no(summary['met'])}).", "",
        H.md_table(["rep", "deterministic ms", "default ms", "ratio", "exchange", "other load (cores)"], rows), ""]
