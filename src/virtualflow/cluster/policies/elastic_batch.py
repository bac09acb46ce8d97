"""Elastic batch-size allocation: a dynamic program choosing each job's GPU count *and* batch size
from its scaling efficiency (the "effective elastic scaling" scheduler), and its baseline, the same
allocator at each job's fixed batch size.

**Options.** On an accelerator type, job ``i`` may run at ``(g, B)``: ``g`` a GPU count the
throughput table has for its type, in ``[min_gpus, scale_factor]`` (exactly ``scale_factor`` for a
rigid job), and ``B`` one of ``JobSpec.batch_sizes`` (its one ``batch_size`` unless it opted in
with ``batch_size_range``; with ``fixed_batch=True``, the baseline, always ``batch_size``). With
``vn_size`` known, ``B`` runs as ``V = B / vn_size`` virtual nodes and a GPU holds at least one, so
``g <= V``; ``max_vns_per_gpu`` (None: any number, virtualflow's accumulation) also bounds
``V <= g * max_vns_per_gpu`` (1: plain data parallelism, where a batch needs enough GPUs to hold
it: the paper's memory constraint).

**Scaling-efficiency model** (:func:`job_rates`): the rate of ``(g, B)`` in *base steps/s* (samples/s
divided by ``batch_size``, the unit of ``total_steps``):

- measured where the table has it: ``(g, batch_size)`` is the job's own entry; ``(g, B)`` is the
  entry of the job type named like Gavel's, ``"<model> (batch size B)"``, when the table has one
  and the job's own type is ``"<model> (batch size <its batch_size>)"``;
- fitted elsewhere: a step at ``V`` virtual nodes on ``g`` GPUs takes ``a * ceil(V / g) + c(g)``,
  ``a`` the time of one virtual node (from the smallest measured count, all of it compute) and
  ``c(g) = max(0, measured step time at batch_size - a * ceil(V0 / g))`` the rest (communication);
  the measured step time at ``(g, batch_size)`` is scaled by this model's ratio of the two step
  times (equal to the model where ``c(g) > 0``; where a table scales superlinearly, as Gavel's
  does in places, ``c(g)`` is 0 and only the virtual-node granularity changes the rate).

**Objective.** Each job's value at ``(g, B)`` is ``weight * rate(g, B) / rate_base``,
``rate_base`` its rate at ``batch_size`` and its largest allowed count up to ``scale_factor`` on
its fastest type (throughput-weighted progress, normalised so a job at its requested allocation is
worth its weight); a waiting job is worth 0. Jobs are **admitted** in arrival order (then id) while their
smallest count fits, skipping one that does not (a smaller one behind it may): an admitted job must
run (no starvation); the others run only on GPUs the admitted ones leave. The DP
(:func:`knapsack`) maximises the sum of values under the GPU capacity; per ``(job, g)`` only the
best ``B`` matters, so it is a knapsack over GPUs with one option per GPU count, exact,
O(jobs x capacity x counts) with NumPy (about 1,000 x 64 x 7 cells: milliseconds).

**Several types** (the paper has one): one such DP per type in the cluster's order (list the
fastest first), each over the jobs the earlier types left waiting, with its own admission; exact
per type, greedy across types.

Decisions: ``Allocation.gpus`` and ``X`` (1 on the type for a running job, 0 waiting) as every
policy, and ``Allocation.info["batch_size"]`` = {job id: batch} for every running job with a known
batch. Ties go to the smaller GPU count, then to ``batch_size``, then to the smaller batch.
Invariant: a job that did not opt in is never given another batch size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from virtualflow.cluster.model import JobSpec
from virtualflow.cluster.policies.base import Allocation, PolicyInput
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["BATCH_KEY", "ElasticBatch", "JobOptions", "batch_rate", "job_options", "job_rates", "knapsack"]

BATCH_KEY = "batch_size"
"""Key of ``Allocation.info`` holding {job id: batch size} (the simulator applies it)."""
_FAMILY = re.compile(r"^(?P<model>.*) \(batch size (?P<b>\d+)\)$")


def _siblings(table: ThroughputTable, job: JobSpec, batches: tuple[int | None, ...]) -> dict[int, str]:
    """Column -> the table's job type for the same model at that batch (Gavel's naming), for the
    batches the table has, when the job's own type is named after its ``batch_size``."""
    m = _FAMILY.match(job.job_type)
    if m is None or int(m["b"]) != job.batch_size:
        return {}
    known = set(table.job_types)
    names = ((c, f"{m['model']} (batch size {b})") for c, b in enumerate(batches) if b != job.batch_size)
    return {c: name for c, name in names if name in known}


def job_rates(table: ThroughputTable, job: JobSpec, acc_type: str, gpus: np.ndarray,
              batches: tuple[int | None, ...], max_vns_per_gpu: int | None = None) -> np.ndarray:
    """(len(gpus), len(batches)) base steps/s of ``job`` at each (g, B) on ``acc_type`` (module
    docstring); 0 where it cannot run. ``gpus`` must be counts the table has for the job's type; the
    fit takes ``a`` from the smallest count the table has, whatever ``gpus`` holds."""
    g = np.asarray(gpus, dtype=np.int64)
    m0 = table.matrix([job.job_type] * g.size, g, [acc_type])[:, 0]
    out = np.repeat(m0[:, None], len(batches), axis=1)
    b0, vn = job.batch_size, job.vn_size
    if b0 is None or vn is None or not g.size:
        return out  # only a job with both may have another batch than batch_size
    B = np.array(batches, dtype=np.int64)
    V, v0 = B // vn, b0 // vn
    pos = m0 > 0
    sc = np.array(table.scales_of(job.job_type), dtype=np.int64)  # the fit uses every measured count
    ms = table.matrix([job.job_type] * sc.size, sc, [acc_type])[:, 0]
    if (ms > 0).any():
        first = int(np.argmax(ms > 0))
        a = (1.0 / ms[first]) / math.ceil(v0 / sc[first])
        with np.errstate(divide="ignore", invalid="ignore"):
            comm = np.where(pos, np.maximum(1.0 / m0 - a * np.ceil(v0 / g), 0.0), np.inf)[:, None]
            fit = (m0[:, None] * (B / b0)[None, :] * (a * np.ceil(v0 / g)[:, None] + comm)
                   / (a * np.ceil(V[None, :] / g[:, None]) + comm))
        other = B != b0
        out[:, other] = fit[:, other]
    rows, cols, names = [], [], []
    gl = g.tolist()
    for c, name in _siblings(table, job, batches).items():
        have = set(table.scales_of(name))
        for r, x in enumerate(gl):
            if x in have:
                rows.append(r)
                cols.append(c)
                names.append(name)
    if names:  # measured: one lookup for every (sibling, count) the table has
        out[rows, cols] = table.matrix(names, g[rows], [acc_type])[:, 0] * B[cols] / b0
    ok = pos[:, None] & (g[:, None] <= V[None, :])
    if max_vns_per_gpu is not None:
        ok &= g[:, None] * max_vns_per_gpu >= V[None, :]
    return np.where(ok, out, 0.0)


def batch_rate(table: ThroughputTable, job: JobSpec, acc_type: str, gpus: int, batch: int | None) -> float:
    """Base steps/s of ``job`` on ``gpus`` GPUs of ``acc_type`` at ``batch`` (the simulator's rate)."""
    return float(job_rates(table, job, acc_type, np.array([gpus]), (batch,))[0, 0])


@dataclass(frozen=True, slots=True)
class JobOptions:
    """One job's options after the best batch per GPU count is taken."""

    gpus: np.ndarray
    """Allowed GPU counts (ascending) at which some batch runs."""
    value: np.ndarray
    """Value (weight x rate / rate_base) at each count, at its best batch."""
    batch: list[int | None]
    """The best batch at each count."""


def job_options(inp: PolicyInput, i: int, fixed_batch: bool, max_vns_per_gpu: int | None,
                memo: dict | None = None) -> list[JobOptions]:
    """Job ``i``'s options on each type (module docstring), collapsed to the best batch per GPU count.
    ``memo`` shares the rate tables of jobs with the same type, GPU range and batch fields."""
    job = inp.jobs[i]
    lo = job.min_gpus if job.elastic else job.scale_factor
    g = np.array([s for s in inp.table.scales_of(job.job_type)
                  if lo <= s <= min(job.scale_factor, inp.capacities.max())], dtype=np.int64)
    batches = (job.batch_size,) if fixed_batch or not job.elastic_batch else job.batch_sizes
    c0 = batches.index(job.batch_size)
    key = (job.job_type, lo, job.scale_factor, batches, job.batch_size, job.vn_size)
    R = None if memo is None else memo.get(key)
    if R is None:
        R = np.stack([job_rates(inp.table, job, t, g, batches, max_vns_per_gpu) * (g <= cap)[:, None]
                      for t, cap in zip(inp.types, inp.capacities)]) if g.size else np.zeros((1, 0, len(batches)))
        if memo is not None:
            memo[key] = R
    base = [r[np.flatnonzero(r[:, c0] > 0)[-1], c0] for r in R if (r[:, c0] > 0).any()]
    norm = max(base) if base else R.max(initial=0.0)
    if norm <= 0:
        raise ValueError(f"job {job.job_id} ({job.job_type!r}) can run at no GPU count in [{lo}, "
                         f"{job.scale_factor}] on {dict(zip(inp.types, inp.capacities.astype(int)))} at batch "
                         f"sizes {list(batches)[:8]} (max_vns_per_gpu={max_vns_per_gpu}); widen its GPU or batch range")
    # Best batch per count; ties (within 1e-9, the fit's rounding): batch_size, then the smaller batch.
    order = np.array([c0] + [c for c in range(len(batches)) if c != c0])
    out = []
    for r in R:
        col = order[np.argmax(r[:, order] >= r.max(axis=1, keepdims=True) * (1 - 1e-9), axis=1)]
        val = r[np.arange(g.size), col] * inp.weights[i] / norm
        keep = val > 0
        out.append(JobOptions(gpus=g[keep], value=val[keep], batch=[batches[c] for c in col[keep]]))
    return out


def knapsack(options: list[JobOptions], capacity: int, forced: np.ndarray) -> tuple[np.ndarray, float]:
    """Exact DP: GPU count per job (0 = waits) maximising the sum of values with at most
    ``capacity`` GPUs; a ``forced`` job must get one of its counts. ``-inf`` when infeasible.
    Ties: the smaller count for the later job first (backtracking takes the first argmax)."""
    n = len(options)
    F = np.zeros(capacity + 1)  # best value with at most c GPUs over the jobs so far
    cs = np.arange(capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int16)
    for i, o in enumerate(options):
        gs = o.gpus if forced[i] else np.concatenate([[0], o.gpus])
        vs = o.value if forced[i] else np.concatenate([[0.0], o.value])
        rest = cs[:, None] - gs[None, :]
        M = np.where(rest >= 0, F[np.maximum(rest, 0)] + vs[None, :], -np.inf)
        k = np.argmax(M, axis=1)
        choice[i] = gs[k]
        F = M[cs, k]
    g = np.zeros(n, dtype=np.int64)
    c = capacity
    if not np.isfinite(F[c]):
        return g, -math.inf
    for i in range(n - 1, -1, -1):
        g[i] = choice[i, c]
        c -= g[i]
    return g, float(F[capacity])


@dataclass(kw_only=True, slots=True)
class ElasticBatch:
    """GPUs and batch size per job by a DP over scaling efficiency (``fixed_batch=True``: the baseline,
    GPUs only). Objective: the DP's sum of throughput-weighted progress."""

    name: str = "elastic_batch"
    fixed_batch: bool = False
    """The paper's baseline: the same allocator, every job at its ``batch_size``."""
    max_vns_per_gpu: int | None = None
    """Most virtual nodes one GPU may hold (None: any; 1: plain data parallelism, the paper's case)."""

    def __post_init__(self) -> None:
        v = self.max_vns_per_gpu
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"max_vns_per_gpu={v!r} must be a positive integer (or None: no limit)")

    def allocate(self, inp: PolicyInput) -> Allocation:
        memo: dict = {}
        opts = [job_options(inp, i, self.fixed_batch, self.max_vns_per_gpu, memo) for i in range(inp.n)]
        arrival = np.array([j.arrival_s for j in inp.jobs])
        rank = np.empty(inp.n, dtype=np.int64)
        rank[np.lexsort((inp.job_ids, arrival))] = np.arange(inp.n)
        X = np.zeros((inp.n, len(inp.types)))
        g = np.zeros(inp.n, dtype=np.int64)
        gpus, batch, admitted, obj = {}, {}, [], 0.0
        for k, cap in enumerate(inp.capacities.astype(int)):  # one exact DP per type, in cluster order
            todo = [i for i in range(inp.n) if g[i] == 0 and opts[i][k].gpus.size]
            forced = np.zeros(len(todo), dtype=bool)
            free = cap
            for pos in sorted(range(len(todo)), key=lambda p: rank[todo[p]]):
                need = int(opts[todo[pos]][k].gpus[0])
                if need <= free:
                    forced[pos], free = True, free - need
            gk, val = knapsack([opts[i][k] for i in todo], cap, forced)
            obj += val
            admitted += [int(inp.job_ids[i]) for i, f in zip(todo, forced) if f]
            for i, x in zip(todo, gk):
                if x:
                    o = opts[i][k]
                    g[i], X[i, k] = x, 1.0
                    b = o.batch[int(np.searchsorted(o.gpus, x))]
                    if b is not None:
                        batch[inp.jobs[i].job_id] = int(b)
        for i, j in enumerate(inp.jobs):
            gpus[j.job_id] = int(g[i]) if g[i] else int(min(o.gpus[0] for o in opts[i] if o.gpus.size))
        return Allocation(rows=[(j.job_id,) for j in inp.jobs], X=X, gpus=gpus, objective=obj,
                          info={BATCH_KEY: batch, "admitted": admitted})
