"""Choosing the 3-D grid (PTD-P): ``W = D x P x T`` workers as ``D`` data-parallel replicas of a
pipeline of ``P`` stages, each stage a tensor-parallel group of ``T`` workers. Pure code, no
processes: the same inputs give the same ranking.

Inputs (:class:`GridProblem`): per-layer costs at ``T = 1`` on one virtual node's batch
(:class:`~virtualflow.plan.pipeline.partition.LayerProfile`: forward and backward seconds,
parameter bytes, output activation bytes, stashed bytes), which layers are tensor-parallel blocks
(and how many Megatron column-then-row-parallel pairs each holds: an attention or MLP sub-layer is one),
the attention heads, the workers, the job's virtual nodes (VNs), a per-worker memory limit, the
optimizer-state factor and two links: ``tp_link`` inside a tensor-parallel group and ``link``
between stages and between replicas.

Cost model, per candidate (``D``, ``P``, ``T``, schedule, chunks ``v``, micro-batches per VN ``k``,
split). Every replica runs ``ceil(V / D)`` VNs, each cut into ``k`` micro-batches: ``m = k *
ceil(V / D)`` micro-batches per step; a micro-batch costs ``1 / k`` of a VN (compute and bytes
scale linearly). For layer ``i``, with ``A_i`` its output activation bytes per micro-batch and
``d_i = T`` for a tensor-parallel block (``1`` for a replicated layer) and ``c_i`` its pairs:

- forward ``f_i = forward_s / (k d_i) + c_i 2 (T-1) (A_i / (T B_tp) + alpha_tp)``: compute
  divided by ``T``, then per pair a reduce-scatter and an all-gather along tokens, each a ring of
  ``T-1`` steps that send ``A_i / T`` bytes;
- backward ``b_i = backward_s / (k d_i) + c_i 3 (T-1) (A_i / (T B_tp) + alpha_tp)``: per pair an
  all-gather and an all-reduce (``2 (T-1)`` ring steps) of the input gradient; the zero-bubble
  schedule's weight part ``w_i`` is ``weight_grad_s / (k d_i)`` (half the backward when not
  measured), the collectives belong to the input-gradient part;
- memory: parameters ``param_bytes / d_i``, stash ``stash_bytes / (k d_i)`` (the activations of a
  block are sharded along tokens or heads; its norms and row-parallel biases, which stay whole,
  are counted as sharded too).

A piece of layers ``[a, b)`` (a pipeline stage's model chunk) takes ``F = sum f + hop`` and ``B =
sum b + hop``, ``hop = A_{b-1} / B_link + alpha_link`` for every piece but the last (its output
forward and its gradient back; each of the ``T`` members sends the full activation to its peer).
The schedule (THE factory, :func:`~virtualflow.plan.pipeline.schedules.build_schedule`) is
simulated with these times (:func:`~virtualflow.plan.pipeline.simulate.simulate`); stage rank
``r`` finishes its last backward at ``end_r``, then all-reduces the gradients of its shard
``G_r = sum param_bytes / d_i`` over its pieces across the ``D`` replicas (ring:
``2 (D-1)/D G_r / B_link + 2 (D-1) alpha_link``; ``reduction="sharded"``, reduce-scatter then
all-gather, moves the same bytes). **Step time = max_r (end_r + allreduce_r)**; the **bubble** is
the simulated schedule's idle share, averaged over stage ranks; **memory per worker** = the most
over stage ranks of ``factor * sum G`` (``factor`` = ``optimizer_state_factor``; with
``reduction="sharded"`` the optimizer's part beyond weights and gradients is divided by ``D``) plus
the peak of the stash the schedule holds (walked over the rank's actions); **bytes per step per
worker** (sent, the most over stage ranks): tensor-parallel ``m * 5 (T-1)/T * A_i`` per pair,
pipeline hops ``m * A`` per boundary the worker sends across, data ``2 (D-1)/D * G_r``.

Not modelled: overlap of communication with compute (collectives, hops and the all-reduce all
block), contention between links that share a NIC, the optimizer step, data loading, fixed
per-kernel costs (a micro-batch of ``1/k`` of a VN is taken to cost ``1/k`` of its time), memory
fragmentation and the activations of the collectives' buffers.

Candidates: every ``(D, P, T)`` with ``D P T = W``, ``D <= V``, ``P <= layers``, ``T`` dividing
``heads`` (``T = 1`` only when no layer is tensor-parallel); ``P = 1`` runs no pipeline (the
``1f1b`` entry: gradient accumulation over the ``m`` micro-batches); ``P > 1`` each schedule of
``schedules`` (``interleaved_1f1b`` with each of ``chunks`` where ``P v <= layers`` and ``P``
divides ``m``); each ``k`` of ``microbatches_per_vn`` dividing ``vn_batch``. Splits: every
contiguous split into ``P v`` non-empty pieces when there are at most ``max_splits`` of them,
otherwise the partitioner's (:func:`~virtualflow.plan.pipeline.partition.partition` on the costs
above, under the memory limit) and the equal split. One candidate per layout: its best split.

Ranking (:func:`rank_key`): candidates that fit the memory limit first; then the predicted step
time, equal to the picosecond being a tie; ties go to fewer bytes per worker per step, then fewer
micro-batches per VN (the model charges nothing for smaller micro-batches; real kernels do), less
memory per worker, more data parallelism (larger ``D``), smaller ``T``, smaller ``P``, the preferred
schedule (``interleaved_1f1b`` first for ``P > 2`` as in Megatron, else ``1f1b``; then
``1f1b``/``interleaved_1f1b``, ``zb_h1``, ``gpipe``), fewer chunks, and the lexicographically
smallest layer counts. The best is the first when it fits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from virtualflow.plan.pipeline.partition import InfeasiblePartition, LayerProfile, Link, partition
from virtualflow.plan.pipeline.predict import DEFAULT_OPTIMIZER_STATE_FACTOR, LOOPBACK, stage_in_flight
from virtualflow.plan.pipeline.schedules import Schedule, build_schedule
from virtualflow.plan.pipeline.simulate import simulate

GRID_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
"""The flush schedules the grid planner searches (the no-flush ones keep extra weight versions and
are not planned here)."""
REDUCTIONS = ("allreduce", "sharded")
TIME_RESOLUTION_S = 1e-12
"""Predicted step times equal to this resolution are ties (broken by :func:`rank_key`)."""
NO_PIPELINE = "1f1b"
"""The schedule entry of ``P = 1`` candidates (no pipeline: the ``m`` micro-batches run one after
the other, one stashed at a time)."""


def _positive_int(owner: str, name: str, value: Any, rule: str, knob: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer ({rule}); set {knob}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GridProblem:
    """What the grid planner needs; validated on construction (errors name the value, the rule
    and the knob, with the ``virtualflow plan`` flag that sets it)."""

    layers: tuple[LayerProfile, ...]
    """Per layer, costs per VN micro-batch at ``T = 1`` (from the profiler)."""
    tensor_parallel: tuple[int, ...]
    """Per layer: how many Megatron column-then-row-parallel pairs it holds (an attention or an MLP
    sub-layer is one; a transformer layer with both is two), 0 for a replicated layer. A layer
    with pairs divides its compute, weights and stash by ``T``; each pair adds 4 collectives per
    micro-batch. ``True``/``False`` read as 1/0."""
    heads: int
    """Attention heads (or the column-parallel width unit): ``T`` must divide it."""
    workers: int
    """``W = D x P x T``."""
    virtual_nodes: int
    """The job's VNs per step; each replica runs ``ceil(V / D)`` of them."""
    memory_limit_bytes: float | None = None
    """Per worker; ``None``: no limit."""
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
    """Resident bytes per parameter byte: weights, gradients and optimizer state (fp32 Adam: 4)."""
    link: Link = LOOPBACK
    """Between consecutive stages and between data-parallel replicas."""
    tp_link: Link | None = None
    """Inside a tensor-parallel group (``None``: ``link``)."""
    weight_grad_s: tuple[float, ...] | None = None
    """Per layer: the weight-gradient part of ``backward_s`` (zero-bubble); ``None``: half."""
    vn_batch: int | None = None
    """Samples per VN; when given, micro-batches per VN must divide it."""
    microbatches_per_vn: tuple[int, ...] = (1,)
    """``k`` values tried: a VN cut into ``k`` micro-batches. The pipeline engine runs one
    micro-batch per VN (``k = 1``, the default); larger values are what-ifs of the cost model."""
    schedules: tuple[str, ...] = GRID_SCHEDULES
    """Schedules tried for ``P > 1``."""
    chunks: tuple[int, ...] = (2,)
    """Model chunks per worker tried with ``interleaved_1f1b``."""
    max_splits: int = 64
    """Search every split when a layout has at most this many; else the partitioner's and the equal one."""
    reduction: str = "allreduce"
    """``allreduce`` (ring) or ``sharded`` (reduce-scatter + all-gather, optimizer state divided by D)."""

    def __post_init__(self) -> None:
        owner = "GridProblem"
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "tensor_parallel", tuple(int(x) if isinstance(x, bool) else x
                                                          for x in self.tensor_parallel))
        for name in ("microbatches_per_vn", "schedules", "chunks"):  # each value once, in the order given
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        if self.weight_grad_s is not None:
            object.__setattr__(self, "weight_grad_s", tuple(self.weight_grad_s))
        if not self.layers:
            raise ValueError(f"{owner}.layers is empty; the model needs at least one layer (profile the job's model)")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ValueError(f"{owner}.layers[{i}] is a {type(layer).__name__}, not a LayerProfile")
        if len(self.tensor_parallel) != len(self.layers):
            raise ValueError(f"{owner}.tensor_parallel has {len(self.tensor_parallel)} entries for "
                             f"{len(self.layers)} layers; give one per layer (--tensor-parallel-layers)")
        for i, pairs in enumerate(self.tensor_parallel):
            if not isinstance(pairs, int) or pairs < 0:
                raise ValueError(f"{owner}.tensor_parallel[{i}]={pairs!r} must be an integer >= 0 (column/row-parallel "
                                 f"pairs in layer {i}; 0: replicated); fix --tensor-parallel-layers")
        _positive_int(owner, "workers", self.workers, "W = D x P x T workers", "--workers")
        _positive_int(owner, "heads", self.heads, "attention heads; T must divide them", "--heads")
        _positive_int(owner, "virtual_nodes", self.virtual_nodes, "the job's virtual nodes per step",
                      "Job.virtual_nodes")
        lim = self.memory_limit_bytes
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float)) or not lim > 0
                                or math.isinf(lim)):
            raise ValueError(f"{owner}.memory_limit_bytes={lim!r} must be a finite number > 0 (bytes per worker); "
                             f"set --memory-limit-gib to a positive value or leave it out for no limit")
        fac = self.optimizer_state_factor
        if isinstance(fac, bool) or not isinstance(fac, (int, float)) or not (1 <= fac < math.inf):
            raise ValueError(f"{owner}.optimizer_state_factor={fac!r} must be a finite number >= 1 (resident bytes "
                             f"per parameter byte: 4 for fp32 Adam); set optimizer_state_factor")
        for name in ("link", "tp_link"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Link):
                raise ValueError(f"{owner}.{name}={value!r} must be a Link(bandwidth_bytes_per_s=..., latency_s=...)")
        if self.weight_grad_s is not None:
            if len(self.weight_grad_s) != len(self.layers):
                raise ValueError(f"{owner}.weight_grad_s has {len(self.weight_grad_s)} entries for "
                                 f"{len(self.layers)} layers; give one per layer or None")
            for i, (w, layer) in enumerate(zip(self.weight_grad_s, self.layers)):
                if not (0 <= w <= layer.backward_s):
                    raise ValueError(f"{owner}.weight_grad_s[{i}]={w!r} must be within 0..backward_s="
                                     f"{layer.backward_s} (the weight part of the backward); re-profile")
        if self.vn_batch is not None:
            _positive_int(owner, "vn_batch", self.vn_batch, "samples per virtual node", "Job.global_batch_size")
        if not self.microbatches_per_vn:
            raise ValueError(f"{owner}.microbatches_per_vn is empty; give at least one (--microbatches-per-vn 1)")
        for k in self.microbatches_per_vn:
            _positive_int(owner, "microbatches_per_vn", k, "micro-batches a VN is cut into", "--microbatches-per-vn")
        if not self.schedules:
            raise ValueError(f"{owner}.schedules is empty; give some of {GRID_SCHEDULES} (--schedule)")
        for s in self.schedules:
            if s not in GRID_SCHEDULES:
                raise ValueError(f"{owner}.schedules has {s!r}, which the grid planner does not search: it plans "
                                 f"the flush schedules {GRID_SCHEDULES}; set --schedule to one of them")
        for v in self.chunks:
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ValueError(f"{owner}.chunks has {v!r}; interleaved chunks per worker must be integers >= 2 "
                                 f"(--chunks)")
        _positive_int(owner, "max_splits", self.max_splits, "splits searched exhaustively per layout",
                      "max_splits")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"{owner}.reduction={self.reduction!r} must be one of {REDUCTIONS}; set reduction")

    @property
    def tensor_link(self) -> Link:
        return self.tp_link if self.tp_link is not None else self.link


@dataclass(frozen=True, slots=True)
class GridCandidate:
    """One layout with its best split and its predicted costs (seconds, bytes)."""

    data: int
    stages: int
    tensor: int
    schedule: str
    chunks: int
    microbatches_per_vn: int
    micro_batches: int
    """``m``: micro-batches per replica per step."""
    counts: tuple[int, ...]
    """Layers per piece (``P x chunks`` pieces; piece ``s`` on stage rank ``s % P``)."""
    split: str
    """How the split was found: ``searched`` (every split), ``auto`` (partitioner), ``equal``."""
    step_time_s: float
    pipeline_s: float
    """The simulated schedule's makespan (without the data-parallel all-reduce)."""
    allreduce_s: float
    """The slowest stage rank's gradient all-reduce across the D replicas."""
    bubble: float
    memory_bytes: float
    """Peak per worker (the most over stage ranks)."""
    fits: bool
    tp_bytes: float
    hop_bytes: float
    data_bytes: float
    """Bytes each worker sends per step (the most over stage ranks) per kind of communication."""

    @property
    def layout(self) -> str:
        return f"D={self.data} P={self.stages} T={self.tensor}"

    @property
    def comm_bytes(self) -> float:
        return self.tp_bytes + self.hop_bytes + self.data_bytes

    def describe(self) -> str:
        sched = "no pipeline" if self.stages == 1 else self.schedule + (
            f" ({self.chunks} chunks)" if self.chunks > 1 else "")
        per_vn = f"{self.microbatches_per_vn} micro-batch{'es' if self.microbatches_per_vn > 1 else ''} per VN"
        return f"{self.layout} ({sched}, {per_vn}, m={self.micro_batches}, split {','.join(map(str, self.counts))})"

    def as_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["counts"] = list(self.counts)
        return out


def schedule_preference(stages: int, schedule: str) -> int:
    """Tie-break order of schedules: Megatron's interleaved 1F1B first for ``P > 2``."""
    order = (("interleaved_1f1b", "1f1b", "zb_h1", "gpipe") if stages > 2
             else ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe"))
    return order.index(schedule)


def rank_key(c: GridCandidate) -> tuple:
    """THE ranking (see the module docstring): fits first, then time, then the tie rules."""
    return (not c.fits, round(c.step_time_s / TIME_RESOLUTION_S), c.comm_bytes, c.microbatches_per_vn,
            c.memory_bytes, -c.data, c.tensor, c.stages, schedule_preference(c.stages, c.schedule), c.chunks, c.counts)


# ---- the cost model ---------------------------------------------------------------------------


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


def layer_costs(problem: GridProblem, tensor: int, k: int) -> LayerCosts:
    f, b, w, act, params, stash, tpb, tps = [], [], [], [], [], [], [], []
    link = problem.tensor_link
    for i, layer in enumerate(problem.layers):
        pairs = problem.tensor_parallel[i]
        tp = pairs > 0 and tensor > 1
        d = tensor if tp else 1
        a = layer.activation_bytes / k
        step = ring_step_s(a / tensor, link) if tp else 0.0
        wg = problem.weight_grad_s[i] if problem.weight_grad_s is not None else 0.5 * layer.backward_s
        f.append(layer.forward_s / (k * d) + pairs * 2 * (tensor - 1) * step)
        b.append(layer.backward_s / (k * d) + pairs * 3 * (tensor - 1) * step)
        w.append(wg / (k * d))
        act.append(a)
        params.append(layer.param_bytes / d)
        stash.append(layer.stash_bytes / (k * d))
        tpb.append(pairs * 5 * (tensor - 1) / tensor * a if tp else 0.0)
        tps.append(pairs * 5 * (tensor - 1) * step)
    return LayerCosts(*(tuple(x) for x in (f, b, w, act, params, stash, tpb, tps)))


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
        memory.append(fac * grad + peak)
        allreduce.append(link.allreduce_s(grad, d))
        busy.append(m * sum(F[s] + B[s] for s in mine))
        tp_bytes.append(m * sum(sum(costs.tp_bytes[bounds[s][0]:bounds[s][1]]) for s in mine))
        hop_bytes.append(m * sum((costs.act[bounds[s][1] - 1] if s < n - 1 else 0.0)
                                 + (costs.act[bounds[s][0] - 1] if s > 0 else 0.0) for s in mine))
        data_bytes.append(2 * (d - 1) / d * grad)
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
    out = []
    for t in range(1, w + 1):
        if w % t or problem.heads % t or (t > 1 and not any_tp):
            continue
        for p in range(1, w // t + 1):
            if (w // t) % p or p > n_layers:
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
    costs = layer_costs(problem, layout.tensor, layout.k)
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
    costs = layer_costs(problem, layout.tensor, k)
    schedule = build_schedule(layout.schedule, layout.stages, layout.m, layout.chunks)
    cand, _ = evaluate(problem, layout, candidate.counts, costs, schedule, candidate.split)
    return cand


@dataclass(frozen=True, slots=True)
class GridPlan:
    """The planner's answer: every layout's best candidate, ranked; the best that fits; why."""

    problem: GridProblem
    candidates: tuple[GridCandidate, ...]
    best: GridCandidate | None
    explain: str = field(default="")

    def table(self, top: int = 5) -> str:
        return candidates_table(self.candidates[:top], self.problem.memory_limit_bytes)

    def as_json(self, top: int | None = None) -> dict[str, Any]:
        rows = self.candidates if top is None else self.candidates[:top]
        lim = self.problem.memory_limit_bytes
        return {"workers": self.problem.workers, "heads": self.problem.heads,
                "virtual_nodes": self.problem.virtual_nodes, "memory_limit_bytes": lim,
                "tensor_parallel_layers": [i for i, x in enumerate(self.problem.tensor_parallel) if x],
                "tensor_parallel_pairs": list(self.problem.tensor_parallel),
                "link": _link_json(self.problem.link), "tp_link": _link_json(self.problem.tensor_link),
                "reduction": self.problem.reduction, "layouts_considered": len(self.candidates),
                "best": None if self.best is None else self.best.as_json(),
                "candidates": [c.as_json() for c in rows], "explain": self.explain}


def _link_json(link: Link) -> dict[str, float]:
    return {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}


def choose_grid(problem: GridProblem) -> GridPlan:
    """Rank every layout of ``problem`` (see the module docstring) and explain the winner."""
    found = layouts(problem)
    if not found:
        raise ValueError(
            f"no grid (D, P, T) with D x P x T = workers={problem.workers} has D <= virtual_nodes="
            f"{problem.virtual_nodes}, P <= {len(problem.layers)} layers and T dividing heads={problem.heads}"
            + ("" if problem.vn_batch is None else f" with micro-batches per VN {problem.microbatches_per_vn} "
               f"dividing the VN batch of {problem.vn_batch}")
            + "; use fewer --workers or more virtual nodes (Job.virtual_nodes)")
    ranked = sorted((best_of_layout(problem, lay) for lay in found), key=rank_key)
    best = ranked[0] if ranked[0].fits else None
    plan = GridPlan(problem, tuple(ranked), best)
    return GridPlan(problem, tuple(ranked), best, explain(plan))


# ---- reporting --------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def candidates_table(rows: Sequence[GridCandidate], limit: float | None = None) -> str:
    header = ("#", "D", "P", "T", "schedule", "chunks", "mb/VN", "m", "split", "step ms", "bubble %",
              "MiB/worker", "TP MiB", "hop MiB", "data MiB", "fits")
    cells = [header]
    for i, c in enumerate(rows):
        cells.append((str(i + 1), str(c.data), str(c.stages), str(c.tensor),
                      "-" if c.stages == 1 else c.schedule, str(c.chunks), str(c.microbatches_per_vn),
                      str(c.micro_batches), ",".join(map(str, c.counts)) + ("" if c.split == "searched" else
                                                                             f" ({c.split})"),
                      _ms(c.step_time_s), f"{c.bubble * 100:.1f}", _mib(c.memory_bytes), _mib(c.tp_bytes),
                      _mib(c.hop_bytes), _mib(c.data_bytes), "yes" if c.fits else "NO"))
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]
    lines = ["  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    lim = "none" if limit is None else f"{limit / 2**20:.2f} MiB"
    lines.append(f"(bytes: sent per worker per step; MiB/worker: peak memory, limit {lim}; "
                 f"split: layers per piece, every split searched unless marked auto/equal)")
    return "\n".join(lines)


def _first(plan: GridPlan, pred) -> GridCandidate | None:
    return next((c for c in plan.candidates if pred(c)), None)


def _versus(plan: GridPlan, label: str, other: GridCandidate | None, limit: float | None) -> str | None:
    best = plan.best
    if other is None or other is best or best is None:
        return None
    if not other.fits:
        least = min(c.memory_bytes for c in plan.candidates
                    if (c.data, c.stages, c.tensor) == (other.data, other.stages, other.tensor))
        return (f"{label} {other.describe()}: {_ms(other.step_time_s)} ms but does not fit: {other.layout} needs at "
                f"least {_mib(least)} MiB per worker, over the limit of {_mib(limit or 0)} MiB")
    slower = other.step_time_s / best.step_time_s - 1 if best.step_time_s > 0 else math.inf
    return f"{label} {other.describe()}: {_ms(other.step_time_s)} ms, {slower:+.1%}"


def explain(plan: GridPlan) -> str:
    """Why the best layout wins: what its T, P and D cost and save, and the alternatives."""
    problem, best = plan.problem, plan.best
    limit = problem.memory_limit_bytes
    if best is None:
        least = min(plan.candidates, key=lambda c: c.memory_bytes)
        return (f"no layout fits memory_limit={_mib(limit or 0)} MiB per worker: the smallest need is "
                f"{_mib(least.memory_bytes)} MiB ({least.describe()}); raise --memory-limit-gib to at least "
                f"{least.memory_bytes / 2**30:.4g}, add workers, cut VNs into more micro-batches, or use a "
                f"schedule that stashes less")
    lines = [f"best: {best.describe()}: {_ms(best.step_time_s)} ms per step = {_ms(best.pipeline_s)} ms schedule + "
             f"{_ms(best.allreduce_s)} ms gradient all-reduce; {_mib(best.memory_bytes)} MiB per worker"
             + ("" if limit is None else f" (limit {_mib(limit)} MiB)") + "."]
    k = best.microbatches_per_vn
    tp_idx = [i for i, x in enumerate(problem.tensor_parallel) if x]
    pairs = sum(problem.tensor_parallel)
    if best.tensor > 1:
        t = best.tensor
        whole = layer_costs(problem, 1, k)
        split_ = layer_costs(problem, t, k)
        before = sum(whole.f[i] + whole.b[i] for i in tp_idx)
        after = sum(problem.layers[i].forward_s + problem.layers[i].backward_s for i in tp_idx) / (k * t)
        coll = sum(split_.tp_comm_s[i] for i in tp_idx)
        lines.append(f"T={t} divides the compute of the {len(tp_idx)} tensor-parallel blocks by {t} ({_ms(before)} -> "
                     f"{_ms(after)} ms per micro-batch over the model) but adds 4 collectives to each of their {pairs} "
                     f"column/row-parallel pairs "
                     f"(reduce-scatter, all-gather forward; all-gather, all-reduce backward: {5 * (t - 1)} ring "
                     f"steps per pair, {_ms(coll)} ms per micro-batch in all).")
    elif tp_idx:
        lines.append(f"T=1: splitting the {len(tp_idx)} tensor-parallel blocks would not pay here "
                     f"(collectives or fewer replicas cost more than the compute they divide).")
    if best.stages > 1:
        lines.append(f"P={best.stages} costs a bubble of {best.bubble:.1%} ({best.schedule}"
                     + (f", {best.chunks} chunks" if best.chunks > 1 else "")
                     + f", m={best.micro_batches}) and sends {_mib(best.hop_bytes)} MiB of activations and "
                     f"gradients per worker per step between stages.")
    if best.data > 1:
        lines.append(f"D={best.data} all-reduces {_mib(best.data_bytes / (2 * (best.data - 1) / best.data))} MiB of "
                     f"gradients per worker after the flush ({_ms(best.allreduce_s)} ms).")
    others = [
        ("vs pure data parallel", _first(plan, lambda c: c.stages == 1 and c.tensor == 1)),
        ("vs the best without tensor parallelism",
         _first(plan, lambda c: c.tensor == 1 and c.stages > 1) if best.tensor > 1 else None),
        ("vs the best without a pipeline",
         _first(plan, lambda c: c.stages == 1 and c.tensor > 1) if best.stages > 1 else None),
        ("runner-up", _first(plan, lambda c: (c.data, c.stages, c.tensor) != (best.data, best.stages, best.tensor))),
    ]
    shown: list[GridCandidate] = []
    for label, other in others:
        text = None if any(other is c for c in shown) else _versus(plan, label, other, limit)
        if text:
            lines.append(text)
            shown.append(other)
    ties = [c for c in plan.candidates[1:] if c.fits and rank_key(c)[1] == rank_key(best)[1]]
    if ties:
        lines.append(f"tied on time with {len(ties)} other layout(s); ties go to less communication, fewer "
                     f"micro-batches per VN, less memory, larger D, smaller T, smaller P, the preferred schedule, "
                     f"fewer chunks, then the smallest leading layer counts.")
    return "\n".join(lines)


__all__ = [
    "GRID_SCHEDULES", "GridCandidate", "GridPlan", "GridProblem", "LayerCosts", "REDUCTIONS", "all_splits",
    "bounds_of_counts", "candidates_table", "choose_grid", "equal_counts", "evaluate", "explain", "layer_costs",
    "layouts", "predict_layout", "rank_key", "schedule_preference", "split_count",
]
