"""Choosing the 3-D grid (PTD-P): ``W = D x P x T`` workers as ``D`` data-parallel replicas of a
pipeline of ``P`` stages, each stage a tensor-parallel group of ``T`` workers. Pure code, no
processes: the same inputs give the same ranking.

The code in three modules: :mod:`virtualflow.plan.grid_problem` (the input, the candidate rows
and THE ranking), :mod:`virtualflow.plan.grid_model` (the cost model below and the search), and
this one (:func:`choose_grid`, the plan, its table and its explanation; it re-exports the names
of the other two, so ``virtualflow.plan.grid`` is the planner's one import path).

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
- the fixed CPU cost ``o_i`` of running the layer (``GridProblem.overhead_s``, forward and
  backward, measured by the profiler): added to ``f_i`` and ``b_i`` undivided, times
  ``max(1, D T / cores)`` when the workers share ``GridProblem.cores`` CPU cores (the ``D T``
  workers of a stage run the layer at the same moment: the tensor group in lock step, the
  replicas on the same schedule);
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
``reduction="fsdp"`` (sharded parameters; only ``P = T = 1``, the layouts it composes with): memory
is :func:`fsdp_bytes` (:func:`virtualflow.plan.memory.worker_bytes`: weights, gradients and
optimizer state divided by ``D``, plus the root unit and the two largest units gathered with their
gradients; the units ``GridProblem.unit_bytes``, else the layers) plus the stash; the data
exchange is an all-gather of every unit in the forward and again in the backward and a
reduce-scatter of its gradient: ``3 (D-1)/D * G`` bytes, 1.5 times the all-reduce's time.

Not modelled: overlap of communication with compute (collectives, hops and the all-reduce all
block), contention between links that share a NIC, the optimizer step, data loading, fixed
per-kernel costs beyond ``overhead_s`` (a micro-batch of ``1/k`` of a VN is taken to cost ``1/k``
of its time), memory
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

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from virtualflow.plan.grid_model import (LayerCosts, all_splits, best_of_layout, bounds_of_counts, contention,
                                         equal_counts, evaluate, fsdp_bytes, layer_costs, layouts, predict_layout,
                                         split_count)
from virtualflow.plan.grid_problem import (GRID_SCHEDULES, REDUCTIONS, GridCandidate, GridProblem, rank_key,
                                           schedule_preference)
from virtualflow.plan.pipeline.partition import Link


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
            + (" (reduction='fsdp': D = workers, P = T = 1)" if problem.reduction == "fsdp" else "")
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
        split_ = layer_costs(problem, t, k)
        before = sum(problem.layers[i].forward_s + problem.layers[i].backward_s for i in tp_idx) / k
        after = before / t
        coll = sum(split_.tp_comm_s[i] for i in tp_idx)
        lines.append(f"T={t} divides the compute of the {len(tp_idx)} tensor-parallel blocks by {t} ({_ms(before)} -> "
                     f"{_ms(after)} ms per micro-batch over the model) but adds 4 collectives to each of their {pairs} "
                     f"column/row-parallel pairs "
                     f"(reduce-scatter, all-gather forward; all-gather, all-reduce backward: {5 * (t - 1)} ring "
                     f"steps per pair, {_ms(coll)} ms per micro-batch in all).")
    if problem.overhead_s is not None:
        fixed = sum(f + b for f, b in problem.overhead_s)
        busy = contention(problem, best.data, best.tensor)
        lines.append(f"The layers' CPU overhead ({_ms(fixed)} ms per micro-batch, not divided by T) is taken "
                     f"{busy:g}x: {best.data * best.tensor} workers run each layer at once"
                     + ("" if problem.cores is None else f" on {problem.cores:g} shared cores") + ".")
    if problem.reduction == "fsdp":
        lines.append("P=1 T=1: reduction='fsdp' shards every unit over all the workers, without a pipeline or "
                     "tensor parallelism (refused at launch with it).")
    elif best.tensor == 1 and tp_idx:
        lines.append(f"T=1: splitting the {len(tp_idx)} tensor-parallel blocks would not pay here "
                     f"(collectives or fewer replicas cost more than the compute they divide).")
    if best.stages > 1:
        lines.append(f"P={best.stages} costs a bubble of {best.bubble:.1%} ({best.schedule}"
                     + (f", {best.chunks} chunks" if best.chunks > 1 else "")
                     + f", m={best.micro_batches}) and sends {_mib(best.hop_bytes)} MiB of activations and "
                     f"gradients per worker per step between stages.")
    if best.data > 1 and problem.reduction == "fsdp":
        lines.append(f"D={best.data} all-gathers the {_mib(best.data_bytes / (3 * (best.data - 1) / best.data))} "
                     f"MiB of parameters unit by unit for the forward and again for the backward, and "
                     f"reduce-scatters each unit's gradients ({_ms(best.allreduce_s)} ms).")
    elif best.data > 1:
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
    "bounds_of_counts", "candidates_table", "choose_grid", "contention", "equal_counts", "evaluate", "explain",
    "fsdp_bytes", "layer_costs", "layouts", "predict_layout", "rank_key", "schedule_preference", "split_count",
]
