"""The grid planner's cost model and search: per-layer costs under ``(T, k)``, one candidate
evaluated by simulating its schedule, every layout of a problem, and each layout's best split.
The formulas, what is not modelled and which candidates and splits are searched are in
:mod:`virtualflow.plan.grid`'s docstring. Pure code, no processes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from virtualflow.plan.grid_problem import NO_PIPELINE, TIME_RESOLUTION_S, GridCandidate, GridProblem, rank_key
from virtualflow.plan.memory import WorkerBytes, worker_bytes
from virtualflow.plan.pipeline.partition import InfeasiblePartition, LayerProfile, Link, partition
from virtualflow.plan.pipeline.predict import stage_in_flight
from virtualflow.plan.pipeline.schedules import Schedule, build_schedule
from virtualflow.plan.pipeline.simulate import simulate

@dataclass(frozen=True, slots=True)
class LayerCosts:
    """Per-layer costs of one micro-batch under ``(T, k)``: the formulas of the module docstring."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    act: tuple[float, ...]
    params: tuple[float, ...]
    stash: tuple[float, ...]
    tp_bytes: tuple[float, ...]
    tp_comm_s: tuple[float, ...]
    """Seconds of collectives per micro-batch (forward + backward)."""


def ring_step_s(nbytes: float, link: Link) -> float:
    """One ring step: ``nbytes`` over ``link`` plus its latency."""
    return nbytes / link.bandwidth_bytes_per_s + link.latency_s


def contention(problem: GridProblem, data: int, tensor: int) -> float:
    """How many times its CPU overhead a layer takes when its ``data x tensor`` workers run it at
    once on ``problem.cores`` shared cores (1 without a core count)."""
    return 1.0 if problem.cores is None else max(1.0, data * tensor / problem.cores)


def layer_costs(problem: GridProblem, tensor: int, k: int, data: int = 1) -> LayerCosts:
    f, b, w, act, params, stash, tpb, tps = [], [], [], [], [], [], [], []
    link = problem.tensor_link
    busy = contention(problem, data, tensor)
    overhead = problem.overhead_s or ((0.0, 0.0),) * len(problem.layers)
    for i, layer in enumerate(problem.layers):
        pairs = problem.tensor_parallel[i]
        tp = pairs > 0 and tensor > 1
        d = tensor if tp else 1
        a = layer.activation_bytes / k
        step = ring_step_s(a / tensor, link) if tp else 0.0
        wg = problem.weight_grad_s[i] if problem.weight_grad_s is not None else 0.5 * layer.backward_s
        f.append(layer.forward_s / (k * d) + pairs * 2 * (tensor - 1) * step + busy * overhead[i][0])
        b.append(layer.backward_s / (k * d) + pairs * 3 * (tensor - 1) * step + busy * overhead[i][1])
        w.append(wg / (k * d))
        act.append(a)
        params.append(layer.param_bytes / d)
        stash.append(layer.stash_bytes / (k * d))
        tpb.append(pairs * 5 * (tensor - 1) / tensor * a if tp else 0.0)
        tps.append(pairs * 5 * (tensor - 1) * step)
    return LayerCosts(*(tuple(x) for x in (f, b, w, act, params, stash, tpb, tps)))


def fsdp_bytes(problem: GridProblem, data: int, activations: float = 0.0) -> WorkerBytes:
    """A worker's bytes under ``reduction="fsdp"`` with ``data`` workers: every unit's parameters
    (``problem.unit_bytes``, else each layer's) cut in ``data`` with their gradients and optimizer
    state (``optimizer_state_factor - 2`` bytes per parameter byte), plus the units gathered
    (:func:`virtualflow.plan.memory.worker_bytes`, counted in bytes: every kind of element is the
    parameters' size here, as ``optimizer_state_factor`` assumes)."""
    units = problem.unit_bytes if problem.unit_bytes is not None else [x.param_bytes for x in problem.layers]
    return worker_bytes("fsdp", [round(b) for b in units], problem.optimizer_state_factor - 2.0, data,
                        root_numel=round(problem.root_bytes), param_bytes=1, reduce_bytes=1, activations=activations)


def bounds_of_counts(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Layout:
    data: int
    stages: int
    tensor: int
    schedule: str
    chunks: int
    k: int
    m: int


def evaluate(problem: GridProblem, layout: _Layout, counts: Sequence[int], costs: LayerCosts,
             schedule: Schedule, split: str, *, simulate_step: bool = True) -> tuple[GridCandidate, float]:
    """The candidate for one layout and split, and its lower bound ``max_r (busy_r + allreduce_r)``
    (with ``simulate_step=False`` the step time is that bound, not simulated)."""
    bounds = bounds_of_counts(counts)
    n, p, m, d = len(bounds), layout.stages, layout.m, layout.data
    link = problem.link
    F, B, W, stash, params = [], [], [], [], []
    for s, (a, e) in enumerate(bounds):
        hop = link.transfer_s(costs.act[e - 1]) if s < n - 1 else 0.0
        F.append(sum(costs.f[a:e]) + hop)
        B.append(sum(costs.b[a:e]) + hop)
        W.append(sum(costs.w[a:e]))
        stash.append(sum(costs.stash[a:e]))
        params.append(sum(costs.params[a:e]))
    fac = problem.optimizer_state_factor
    if problem.reduction == "sharded":
        fac = min(fac, 2.0) + max(fac - 2.0, 0.0) / d
    split_bw = schedule.split_backward()
    last = "W" if split_bw else "B"
    memory, allreduce, busy, tp_bytes, hop_bytes, data_bytes = [], [], [], [], [], []
    for r in range(p):
        mine = range(r, n, p)
        grad = sum(params[s] for s in mine)
        now = peak = 0.0
        for act in schedule.actions[r]:
            if act.kind == "F":
                now += stash[act.stage]
                peak = max(peak, now)
            elif act.kind == last:
                now -= stash[act.stage]
        if problem.reduction == "fsdp":  # P = T = 1: the one rank holds every unit
            memory.append(fsdp_bytes(problem, d).total + peak)
            allreduce.append(1.5 * link.allreduce_s(grad, d))  # gathers (forward, backward) + reduce-scatter
        else:
            memory.append(fac * grad + peak)
            allreduce.append(link.allreduce_s(grad, d))
        busy.append(m * sum(F[s] + B[s] for s in mine))
        tp_bytes.append(m * sum(sum(costs.tp_bytes[bounds[s][0]:bounds[s][1]]) for s in mine))
        hop_bytes.append(m * sum((costs.act[bounds[s][1] - 1] if s < n - 1 else 0.0)
                                 + (costs.act[bounds[s][0] - 1] if s > 0 else 0.0) for s in mine))
        data_bytes.append((3 if problem.reduction == "fsdp" else 2) * (d - 1) / d * grad)
    bound = max(busy[r] + allreduce[r] for r in range(p))
    if simulate_step:
        sim = simulate(schedule, F, B, W if split_bw else None)
        ends = [float(sim.timeline[r][-1].end) if sim.timeline[r] else 0.0 for r in range(p)]
        step = max(ends[r] + allreduce[r] for r in range(p))
        makespan, bubble = float(sim.step_time), sum(sim.bubble) / p
    else:
        step, makespan, bubble = bound, math.nan, math.nan
    peak_mem = max(memory)
    lim = problem.memory_limit_bytes
    cand = GridCandidate(
        data=d, stages=p, tensor=layout.tensor, schedule=layout.schedule, chunks=layout.chunks,
        microbatches_per_vn=layout.k, micro_batches=m, counts=tuple(counts), split=split, step_time_s=step,
        pipeline_s=makespan, allreduce_s=max(allreduce), bubble=bubble, memory_bytes=peak_mem,
        fits=lim is None or peak_mem <= lim, tp_bytes=max(tp_bytes), hop_bytes=max(hop_bytes),
        data_bytes=max(data_bytes),
    )
    return cand, bound


# ---- the search -------------------------------------------------------------------------------


def layouts(problem: GridProblem) -> list[_Layout]:
    """Every layout the planner considers (see the module docstring), in a fixed order."""
    n_layers, w, v_nodes = len(problem.layers), problem.workers, problem.virtual_nodes
    any_tp = any(problem.tensor_parallel)
    flat = problem.reduction == "fsdp"  # refused with a pipeline or tensor parallelism (config/composition.py)
    out = []
    for t in range(1, w + 1):
        if w % t or problem.heads % t or (t > 1 and (flat or not any_tp)):
            continue
        for p in range(1, w // t + 1):
            if (w // t) % p or p > n_layers or (flat and p > 1):
                continue
            d = w // (t * p)
            if d > v_nodes:
                continue
            for k in problem.microbatches_per_vn:
                if problem.vn_batch is not None and problem.vn_batch % k:
                    continue
                m = k * -(-v_nodes // d)
                if p == 1:
                    out.append(_Layout(d, 1, t, NO_PIPELINE, 1, k, m))
                    continue
                for sched in problem.schedules:
                    if sched != "interleaved_1f1b":
                        out.append(_Layout(d, p, t, sched, 1, k, m))
                        continue
                    for v in problem.chunks:
                        if p * v <= n_layers and m % p == 0:
                            out.append(_Layout(d, p, t, sched, v, k, m))
    return out


def split_count(n_layers: int, pieces: int) -> int:
    return math.comb(n_layers - 1, pieces - 1)


def all_splits(n_layers: int, pieces: int) -> list[tuple[int, ...]]:
    """Every split of ``n_layers`` into ``pieces`` contiguous non-empty pieces, as layer counts."""
    out = []
    for cuts in itertools.combinations(range(1, n_layers), pieces - 1):
        edges = (0, *cuts, n_layers)
        out.append(tuple(edges[i + 1] - edges[i] for i in range(pieces)))
    return out


def equal_counts(n_layers: int, pieces: int) -> tuple[int, ...]:
    base, extra = divmod(n_layers, pieces)
    return tuple(base + (1 if s >= pieces - extra else 0) for s in range(pieces))


def _auto_counts(problem: GridProblem, layout: _Layout, costs: LayerCosts,
                 schedule: Schedule) -> tuple[int, ...] | None:
    """The partitioner's split on this layout's per-layer costs (``None`` when none fits)."""
    adjusted = [LayerProfile(forward_s=costs.f[i], backward_s=costs.b[i], activation_bytes=costs.act[i],
                             param_bytes=costs.params[i], stash_bytes=costs.stash[i])
                for i in range(len(problem.layers))]
    lim = problem.memory_limit_bytes
    fac = problem.optimizer_state_factor
    if problem.reduction == "sharded":
        fac = min(fac, 2.0) + max(fac - 2.0, 0.0) / layout.data
    try:
        part = partition(adjusted, layout.stages * layout.chunks, link=problem.link,
                         memory_limit_bytes=None if lim is None else lim / layout.chunks,
                         in_flight=stage_in_flight(schedule), optimizer_state_factor=fac)
    except InfeasiblePartition:
        return None
    return part.stage_sizes


def best_of_layout(problem: GridProblem, layout: _Layout) -> GridCandidate:
    """The layout's best split under :func:`rank_key` (splits that cannot beat it are skipped by
    their lower bound, never by a guess)."""
    n_layers, pieces = len(problem.layers), layout.stages * layout.chunks
    costs = layer_costs(problem, layout.tensor, layout.k, layout.data)
    schedule = build_schedule(layout.schedule, layout.stages, layout.m, layout.chunks)
    if split_count(n_layers, pieces) <= problem.max_splits:
        splits = [(c, "searched") for c in all_splits(n_layers, pieces)]
    else:
        eq = equal_counts(n_layers, pieces)
        auto = _auto_counts(problem, layout, costs, schedule)
        splits = ([(auto, "auto")] if auto is not None and auto != eq else []) + [(eq, "equal")]
    bounded = []
    for counts, how in splits:
        cand, bound = evaluate(problem, layout, counts, costs, schedule, how, simulate_step=False)
        bounded.append((not cand.fits, bound, counts, how))
    bounded.sort(key=lambda x: (x[0], x[1], x[2]))
    best: GridCandidate | None = None
    for unfit, bound, counts, how in bounded:
        if best is not None and (unfit > (not best.fits)
                                 or bound > best.step_time_s + TIME_RESOLUTION_S):
            break  # sorted: no later split can fit better or run faster
        cand, _ = evaluate(problem, layout, counts, costs, schedule, how)
        if best is None or rank_key(cand) < rank_key(best):
            best = cand
    if best is None:  # every layout has at least its equal split
        raise RuntimeError(f"grid: layout {layout} produced no split; this is a bug in the planner")
    return best


def predict_layout(problem: GridProblem, candidate: GridCandidate) -> GridCandidate:
    """``candidate``'s exact layout (``D``, ``P``, ``T``, schedule, chunks, micro-batches per VN and
    split) predicted on ``problem``'s costs: e.g. a layout chosen on one problem, re-costed on
    another (the same model with other layer times or another link). ``problem`` must have as many
    layers and workers as the candidate's layout."""
    n_layers = len(problem.layers)
    if sum(candidate.counts) != n_layers or candidate.data * candidate.stages * candidate.tensor != problem.workers:
        raise ValueError(f"predict_layout: {candidate.layout} with split {candidate.counts} does not fit a problem of "
                         f"{n_layers} layers and workers={problem.workers}; re-plan on this problem instead")
    k = candidate.microbatches_per_vn
    layout = _Layout(candidate.data, candidate.stages, candidate.tensor, candidate.schedule, candidate.chunks, k,
                     k * -(-problem.virtual_nodes // candidate.data))
    costs = layer_costs(problem, layout.tensor, k, layout.data)
    schedule = build_schedule(layout.schedule, layout.stages, layout.m, layout.chunks)
    cand, _ = evaluate(problem, layout, candidate.counts, costs, schedule, candidate.split)
    return cand


__all__ = ["LayerCosts", "all_splits", "best_of_layout", "bounds_of_counts", "contention", "equal_counts", "evaluate",
           "fsdp_bytes", "layer_costs",
           "layouts", "predict_layout", "ring_step_s", "split_count"]
