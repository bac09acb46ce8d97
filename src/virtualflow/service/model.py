"""The cluster service as a simulator: any trace played through the service's own scheduler (pure).

``virtualflow simulate --model service`` asks what ``virtualflow cluster start`` would do with a
trace, where the default model (``rounds``, :mod:`virtualflow.cluster.simulator`) plays the
policies with Gavel's idealised rounds. :func:`simulate_service` turns the trace's
:class:`~virtualflow.cluster.model.JobSpec` s and a throughput table into the replay's jobs and
plays them with :func:`virtualflow.service.replay.replay`, the service's
:class:`~virtualflow.service.core.Scheduler` on a virtual clock. What this model has and the
rounds model has not (why the latter was 24-545 % off the service's physical runs,
``bench/cluster_physical.py``):

- the service's **knowledge**: it plans from throughput *estimates* that start at the prior (the
  measured jobs' median) and learn each job's rate as it runs (``update_estimates``), with each
  type's speed from its slowdown factors (``type_slowdowns``: the job type's row in the table, or
  ``slowdowns`` given as ``cluster start --slowdowns`` takes them), not from the true table;
- **pins**: a started job keeps its slots until it has made a step (and ``min_run_s``), so a
  start that takes longer than a round is not undone before it pays off;
- **pauses** instead of a per-round cost: a start or resume takes ``start_s`` / ``resume_s``,
  plus ``start_per_worker_s`` for each other worker process starting in the same round; a
  round lasts as long as its launches block the loop if longer than ``round_s``; in-place
  resizes keep the old workers stepping for ``grow_s`` (:class:`~virtualflow.service.replay.ReplayCosts`,
  measured on a real cluster by ``virtualflow cluster replay --export``);
- **one machine per type**: every type's slots form one server (as the service places them);
- deadlines (``slo_s``) go through the service's earliest-deadline-first admission.

The job's **true** rates are the table's (a (type, workers) the table lacks is extrapolated from
the job's other entries, as the service extrapolates). The result is a
:class:`~virtualflow.cluster.simulator.SimResult`, so ``virtualflow simulate``'s summaries,
per-job records and plots apply unchanged; GPU-seconds count a job's slots from its round's start
(or its arrival) to the round's end or its finish.

Invariants: virtual time only (no processes); the same inputs give the same result; every job of
the trace runs to completion (there is no ``max_sim_s``: the replay bounds its rounds instead).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.policies.base import Policy
from virtualflow.cluster.simulator import SimResult
from virtualflow.cluster.throughputs import ThroughputTable
from virtualflow.service.core import estimate_key, type_slowdowns
from virtualflow.service.replay import ReplayConfig, ReplayCosts, ReplayJob, ReplayRound, replay

__all__ = ["replay_jobs", "simulate_service"]


def _rate(table: ThroughputTable, job_type: str, acc_type: str, workers: int) -> float | None:
    if acc_type not in table.acc_types or not table.has(job_type, workers):
        return None
    try:
        v = table.throughput(job_type, acc_type, workers)
    except ValueError:
        return None
    return v if v > 0 else None


def replay_jobs(jobs: Sequence[JobSpec], slots: dict[str, int], table: ThroughputTable,
                slowdowns: dict[str, float] | None = None) -> list[ReplayJob]:
    """The replay's jobs for ``jobs`` on ``slots``: true rates from ``table`` (every type of the
    slots, every worker count the job may run at), the service's slowdown factors per job
    (``slowdowns`` override the table's, as ``cluster start --slowdowns``)."""
    types = list(slots)
    biggest = max(slots.values())
    out = []
    for j in jobs:
        lo = j.min_gpus if j.elastic else j.scale_factor
        if lo > biggest:
            raise ValueError(f"job {j.job_id} ({j.job_type}) needs {lo} workers on one type but the largest type has "
                             f"{biggest} slots ({slots}); the service runs a job on one type: give more slots "
                             f"(--cluster) or a smaller job")
        rates = {estimate_key(t, g): r for t in types for g in range(lo, j.scale_factor + 1)
                 if (r := _rate(table, j.job_type, t, g)) is not None}
        if not rates:
            raise ValueError(f"job {j.job_id}: the throughput table has no rate for {j.job_type!r} on any of the "
                             f"types {types} at {lo}..{j.scale_factor} workers")
        out.append(ReplayJob(job_id=j.job_id, steps=max(int(math.ceil(j.total_steps - 1e-9)), 1),
                             arrival_s=float(j.arrival_s), elastic=j.elastic, min_workers=lo,
                             max_workers=j.scale_factor, priority=float(j.weight),
                             slowdowns=type_slowdowns(types, table, slowdowns, job_type=j.job_type),
                             rates=rates,
                             deadline_s=None if j.slo_s is None else float(j.arrival_s + j.slo_s)))
    return out


def simulate_service(jobs: Sequence[JobSpec], cluster: Cluster, table: ThroughputTable, policy: Policy, *,
                     round_s: float, costs: ReplayCosts | None = None, slowdowns: dict[str, float] | None = None,
                     min_run_s: float = 0.0, mechanism: MechanismConfig | None = None,
                     window: tuple[int, int] | None = None, max_rounds: int = 1_000_000,
                     on_round: Callable[[ReplayRound], None] | None = None) -> SimResult:
    """Play ``jobs`` through the cluster service's scheduler in virtual time (module docstring).
    ``cluster``'s GPU counts are the service's slots (its servers are ignored: one per type)."""
    jobs = list(jobs)
    if not jobs:
        raise ValueError("no jobs to simulate")
    if len({j.job_id for j in jobs}) != len(jobs):
        raise ValueError("job ids must be unique")
    slots = dict(cluster.gpus)
    rjobs = replay_jobs(jobs, slots, table, slowdowns)
    config = ReplayConfig(slots=slots, policy=policy, round_s=round_s, min_run_s=min_run_s, mechanism=mechanism,
                          max_rounds=max_rounds)
    res = replay(rjobs, config, costs or ReplayCosts(), on_round=on_round)
    types = list(cluster.types)
    tix = {t: i for i, t in enumerate(types)}
    n = len(jobs)
    idx = {j.job_id: i for i, j in enumerate(jobs)}
    arrival = np.array([j.arrival_s for j in jobs], dtype=float)
    finish = np.array([res.finish_s.get(j.job_id, math.nan) for j in jobs], dtype=float)
    gpu_s = np.zeros((n, len(types)))
    cont = np.zeros(n)
    present = np.zeros(n)
    for r in res.rounds:
        for jid, (t, g) in r.placements.items():
            i = idx[jid]
            a, b = max(r.start_s, arrival[i]), min(r.end_s, finish[i]) if math.isfinite(finish[i]) else r.end_s
            if b > a:
                gpu_s[i, tix[t]] += g * (b - a)
        length = r.end_s - r.start_s
        here = (arrival <= r.start_s + 1e-9) & ~(finish <= r.start_s)
        cont[here] += r.active * length
        present[here] += length
    with np.errstate(invalid="ignore", divide="ignore"):
        contention = np.where(present > 0, cont / np.maximum(present, 1e-12), 1.0)
    iso = np.array([j.total_steps / max([r for t in types if (r := _rate(table, j.job_type, t, j.scale_factor))]
                                        or [math.nan]) for j in jobs])
    end = max((r.end_s for r in res.rounds), default=float(arrival.max()))
    return SimResult(jobs=jobs, cluster=cluster, policy=getattr(policy, "name", type(policy).__name__),
                     arrival_s=arrival, finish_s=finish,
                     steps_run=np.where(np.isfinite(finish), [j.total_steps for j in jobs], 0.0),
                     restarts=np.array([res.restarts[j.job_id] for j in jobs], dtype=np.int64),
                     resizes=np.array([res.resizes[j.job_id] for j in jobs], dtype=np.int64),
                     lost_s=np.array([res.lost_s.get(j.job_id, 0.0) for j in jobs]), gpu_s=gpu_s,
                     contention=contention, isolated_s=iso, end_s=float(end), rounds=len(res.rounds),
                     solves=sum(r.solved for r in res.rounds), solve_s=sum(r.decision_s for r in res.rounds),
                     skipped_fragmented=0, window=window)
