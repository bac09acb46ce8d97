"""Discrete-event cluster simulator: the real policy and mechanism code on an injected clock.

Events are job arrivals, job completions and round boundaries. The simulator advances a
``SimClock`` (or any object with ``now()`` and ``advance_to(t)``) from event to event:

- **Rounds.** Time is cut into rounds of ``MechanismConfig.round_s``. At each round boundary the
  mechanism (``mechanism.RoundMechanism``) picks placements; during the round each placed job
  runs at its throughput on the assigned type and GPU count (a space-sharing pair at the table's
  co-location throughputs), after losing the round's change cost (restart, resize). A job that
  finishes mid-round records its exact finish time; its GPUs stay idle until the round ends (as
  in Gavel). A job that arrives mid-round waits for the next round; when the cluster is idle the
  clock jumps to the next arrival and a round starts there.
- **Policy recomputation** (``recompute="on_change"``, the default, like Gavel): at the first
  round boundary after the set of active jobs changed (arrivals or completions). With
  ``"every_round"`` the policy is re-solved at every boundary (time-dependent policies such as
  finish-time fairness then see fresh progress every round).
- **Stopping**: when every job is done, or, with ``window`` and ``stop_after_window`` (default),
  when every job of the measurement window is done (later arrivals keep the cluster loaded until
  then, as in Gavel's continuous experiments), or at ``max_sim_s``.

**Batch sizes.** A policy may also decide batch sizes (``Allocation.info["batch_size"]``, job id
-> batch; ``policies.elastic_batch``). The simulator applies a job's decided batch when it next
runs: it then progresses at ``elastic_batch.batch_rate`` (base steps/s: ``total_steps`` counts
steps at the job's ``batch_size``), a change on a job that keeps its GPUs costs ``resize_cost_s``
(V changes in place at a step boundary), and each change is recorded in ``SimResult.batch_log`` as
``(time_s, job_id, old_batch, new_batch)``. A batch a job did not allow raises ``ValueError``.

Invariants: a job completes exactly its ``total_steps`` (progress is accumulated per round and
clamped at completion); the clock never moves backwards; the same inputs give the same result
(no randomness here; ties broken by job id).
"""

from __future__ import annotations

import logging
import time as _time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from virtualflow.cluster.mechanism import MechanismConfig, RoundMechanism
from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.policies.base import Policy, PolicyInput, check_allocation
from virtualflow.cluster.policies.elastic_batch import BATCH_KEY, batch_rate
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["Clock", "SimClock", "SimConfig", "SimResult", "simulate"]

log = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float: ...

    def advance_to(self, t: float) -> None: ...


@dataclass
class SimClock:
    """Simulated time in seconds; only moves forward."""

    t: float = 0.0

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        if t < self.t - 1e-9:
            raise ValueError(f"clock cannot move backwards from {self.t} to {t}")
        self.t = max(self.t, t)


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """Knobs of a simulation run."""

    mechanism: MechanismConfig = field(default_factory=MechanismConfig)
    """Round length and change costs."""
    recompute: str = "on_change"
    """``"on_change"`` (arrivals/completions) or ``"every_round"``."""
    window: tuple[int, int] | None = None
    """Measurement window of job ids ``[lo, hi)``; metrics are computed over it."""
    stop_after_window: bool = True
    """Stop once every job of ``window`` is done."""
    max_sim_s: float | None = None
    """Stop at this simulated time even if jobs remain (they are reported unfinished)."""
    check_allocations: bool = False
    """Run ``check_allocation`` on every policy output (slower; tests turn it on)."""
    progress: bool = False
    """Show a tqdm progress bar over simulated time (hours)."""

    def __post_init__(self) -> None:
        if self.recompute not in ("on_change", "every_round"):
            raise ValueError(f"recompute={self.recompute!r} must be 'on_change' or 'every_round'")
        if self.window is not None:
            lo, hi = self.window
            if not (0 <= lo < hi):
                raise ValueError(f"window={self.window} must be job ids lo:hi with 0 <= lo < hi")
        if self.max_sim_s is not None and not self.max_sim_s > 0:
            raise ValueError(f"max_sim_s={self.max_sim_s} must be > 0")


@dataclass
class SimResult:
    """Per-job outcomes of one simulation (arrays in the order of ``jobs``)."""

    jobs: list[JobSpec]
    cluster: Cluster
    policy: str
    arrival_s: np.ndarray
    finish_s: np.ndarray
    """Completion time (NaN: not finished when the simulation stopped)."""
    steps_run: np.ndarray
    """Steps each job ran (== total_steps for finished jobs)."""
    restarts: np.ndarray
    """Checkpoint-restarts (resume after preemption, or a move) per job."""
    resizes: np.ndarray
    """In-place GPU-count changes per job (elastic jobs)."""
    lost_s: np.ndarray
    """Seconds lost to change costs per job."""
    gpu_s: np.ndarray
    """(jobs, types) GPU-seconds each job held on each type."""
    contention: np.ndarray
    """Time-averaged number of active jobs while the job was in the system."""
    isolated_s: np.ndarray
    """Run time alone on its requested GPUs of its fastest type."""
    end_s: float
    rounds: int
    solves: int
    solve_s: float
    """Wall-clock seconds spent in the policy."""
    skipped_fragmented: int
    """Rows passed over by the mechanism for lack of a consolidated placement (summed over rounds)."""
    window: tuple[int, int] | None = None
    batch_changes: np.ndarray | None = None
    """Batch-size changes per job (policies that decide batch sizes; zeros otherwise)."""
    batch_log: list[tuple[float, int, int, int]] = field(default_factory=list)
    """Every batch change applied: (time_s, job_id, old_batch, new_batch), in time order."""

    @property
    def jct_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s


def _rate(table: ThroughputTable, jobs_by_id: dict[int, JobSpec], jid: int, row: tuple[int, ...], t: str,
          g: int, cache: dict) -> float:
    key = (jid, row, t, g)
    v = cache.get(key)
    if v is None:
        if len(row) == 1:
            v = table.throughput(jobs_by_id[jid].job_type, t, g)
        else:
            a, b = jobs_by_id[row[0]], jobs_by_id[row[1]]
            ta, tb = table.colocated(a.job_type, b.job_type, t, g)
            v = ta if jid == row[0] else tb
        cache[key] = v
    return v


def _apply_batches(decided: dict[int, int], by_id: dict[int, JobSpec]) -> None:
    """Refuse a decided batch the job does not allow (a job that did not opt in keeps its own)."""
    for jid, b in decided.items():
        if b not in by_id[jid].batch_sizes:
            raise ValueError(f"policy gave job {jid} batch {b}, which is not one of its batch sizes "
                             f"{by_id[jid].batch_sizes[:8]} (batch_size_range={by_id[jid].batch_size_range})")


def validate_jobs(jobs: Sequence[JobSpec], cluster: Cluster, table: ThroughputTable) -> None:
    """Every job must be runnable on this cluster (checked once, up front, by the policy input's rules)."""
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids must be unique")
    PolicyInput(jobs=list(jobs), cluster=cluster, table=table)


def simulate(jobs: Sequence[JobSpec], cluster: Cluster, table: ThroughputTable, policy: Policy,
             config: SimConfig | None = None, clock: Clock | None = None) -> SimResult:
    """Run ``policy`` on ``jobs`` over ``cluster`` and return per-job outcomes (see module docstring)."""
    cfg = config or SimConfig()
    clock = clock or SimClock()
    jobs = list(jobs)
    if not jobs:
        raise ValueError("no jobs to simulate")
    validate_jobs(jobs, cluster, table)
    R = cfg.mechanism.round_s
    n, k = len(jobs), len(cluster.types)
    types = list(cluster.types)
    tix = {t: i for i, t in enumerate(types)}
    idx = {j.job_id: i for i, j in enumerate(jobs)}
    by_id = {j.job_id: j for j in jobs}
    arrival = np.array([j.arrival_s for j in jobs])
    total = np.array([j.total_steps for j in jobs])
    done = np.zeros(n)
    finish = np.full(n, np.nan)
    restarts = np.zeros(n, dtype=np.int64)
    resizes = np.zeros(n, dtype=np.int64)
    lost = np.zeros(n)
    gpu_s = np.zeros((n, k))
    run_s = np.zeros((n, k))  # seconds each job held GPUs of each type (whatever its GPU count)
    cont = np.zeros(n)
    present = np.zeros(n)
    iso = np.array([j.total_steps / max(table.throughput(j.job_type, t, j.scale_factor)
                                        if table.has(j.job_type, j.scale_factor) else 0.0 for t in types)
                    for j in jobs])
    window_ids = None
    if cfg.window is not None:
        lo, hi = cfg.window
        window_ids = {j.job_id for j in jobs if lo <= j.job_id < hi}
        if not window_ids:
            raise ValueError(f"window={lo}:{hi} contains none of the {n} job ids "
                             f"({min(idx)}..{max(idx)}); choose a window inside them")
    window_left = set(window_ids) if window_ids is not None else None
    batch = {j.job_id: j.batch_size for j in jobs}  # batch each job runs at now
    target: dict[int, int] = {}  # batch the policy decided, applied when the job next runs
    batch_changes = np.zeros(n, dtype=np.int64)
    batch_log: list[tuple[float, int, int, int]] = []

    mech = RoundMechanism(cluster, cfg.mechanism)
    events = cfg.mechanism.reallocate_on_events
    owed = np.zeros(n)  # change cost not yet paid when a round ended early (event-driven reallocation)
    order = sorted(range(n), key=lambda i: (arrival[i], jobs[i].job_id))
    ptr = 0
    active: list[int] = []  # job indices, arrival order
    changed = False
    rounds = solves = 0
    solve_s = 0.0
    skipped_fragmented = 0
    cache: dict = {}
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        # Counted in finished jobs (of the window when one is given), so that a long simulation
        # shows how far it is and how long it has left; simulated hours go in the postfix.
        bar = tqdm(total=len(window_ids) if window_ids is not None else n, unit="job",
                   desc=f"simulate {getattr(policy, 'name', 'policy')}", mininterval=1.0)
    t = clock.now()
    try:
        while True:
            while ptr < n and arrival[order[ptr]] <= t + 1e-9:
                active.append(order[ptr])
                ptr += 1
                changed = True
            if not active:
                if ptr >= n:
                    break
                t = float(arrival[order[ptr]])
                clock.advance_to(t)
                continue
            if cfg.max_sim_s is not None and t >= cfg.max_sim_s:
                break
            if changed or cfg.recompute == "every_round":
                ai = np.array(active)
                inp = PolicyInput(jobs=[jobs[i] for i in active], cluster=cluster, table=table, time_s=t,
                                  steps_done=np.minimum(done[ai], total[ai]),
                                  elapsed_s=np.maximum(t - arrival[ai], 0.0),
                                  time_received_s=run_s[ai])
                t0 = _time.perf_counter()
                alloc = policy.allocate(inp)
                solve_s += _time.perf_counter() - t0
                solves += 1
                if cfg.check_allocations:
                    check_allocation(alloc, inp)
                mech.set_allocation(alloc, elastic={jobs[i].job_id: jobs[i].elastic for i in active})
                decided = alloc.info.get(BATCH_KEY, {})
                _apply_batches(decided, by_id)
                target.update(decided)
                changed = False
            active_ids = {jobs[i].job_id for i in active}
            plan = mech.plan_round(active_ids)
            skipped_fragmented += plan.skipped_fragmented
            end = t + R
            running = []  # (job index, type index, placement, change cost to pay now, throughput)
            for jid, p in plan.placements.items():
                i = idx[jid]
                if p.change in ("resume", "move"):
                    restarts[i] += 1
                elif p.change == "resize":
                    if cfg.mechanism.elastic_resize == "restart":
                        restarts[i] += 1
                    else:
                        resizes[i] += 1
                # A change cost cut short by an early round end is still owed if the job is kept.
                cost = owed[i] if (events and p.change == "kept") else min(p.cost_s, R)
                b = target.pop(jid, batch[jid])
                if b != batch[jid]:
                    batch_log.append((t, jid, batch[jid], b))
                    batch_changes[i] += 1
                    batch[jid] = b
                    if p.change == "kept":  # V changes in place at a step boundary
                        cost = min(cost + cfg.mechanism.resize_cost_s, R)
                if b == by_id[jid].batch_size or len(p.row) > 1:
                    thr = _rate(table, by_id, jid, p.row, p.acc_type, p.gpus, cache)
                else:
                    thr = cache.get((jid, p.acc_type, p.gpus, b))
                    if thr is None:
                        thr = cache[(jid, p.acc_type, p.gpus, b)] = batch_rate(table, by_id[jid], p.acc_type,
                                                                               p.gpus, b)
                running.append((i, tix[p.acc_type], p, cost, thr))
            owed[:] = 0.0
            if events:  # the round ends early at the first arrival or completion in it
                if ptr < n:
                    end = min(end, float(arrival[order[ptr]]))
                for i, _, _, cost, thr in running:
                    if thr > 0:
                        end = min(end, t + cost + (total[i] - done[i]) / thr)
            seg = end - t if events else R
            finished: list[int] = []
            for i, c, p, cost, thr in running:
                paid = min(cost, seg)
                owed[i] = cost - paid
                lost[i] += paid
                start = t + paid
                rem = total[i] - done[i]
                if thr > 0 and start + rem / thr <= end + 1e-9:
                    tf = start + rem / thr
                    done[i] = total[i]
                    finish[i] = tf
                    owed[i] = 0.0
                    finished.append(jobs[i].job_id)
                    held = tf - t
                else:
                    if thr > 0:
                        done[i] = min(done[i] + thr * (end - start), total[i])
                    held = seg
                gpu_s[i, c] += p.gpus * held
                run_s[i, c] += held
            ai = np.array(active)
            cont[ai] += len(active) * seg
            present[ai] += seg
            mech.end_round(length_s=seg)
            rounds += 1
            if finished:
                fin = set(finished)
                for jid in finished:
                    mech.stop(jid)
                    if window_left is not None:
                        window_left.discard(jid)
                active = [i for i in active if jobs[i].job_id not in fin]
                changed = True
            if bar is not None:
                counted = [jid for jid in finished if window_ids is None or jid in window_ids]
                if rounds % 50 == 0 or counted:
                    bar.set_postfix_str(f"{end / 3600:.0f} simulated h, {len(active)} active", refresh=False)
                bar.update(len(counted))
            t = end
            clock.advance_to(t)
            if window_left is not None and cfg.stop_after_window and not window_left:
                break
            if not active and ptr >= n:
                break
    finally:
        if bar is not None:
            bar.close()
    steps_run = done
    with np.errstate(invalid="ignore", divide="ignore"):
        contention = np.where(present > 0, cont / np.maximum(present, 1e-12), 1.0)
    return SimResult(jobs=jobs, cluster=cluster, policy=getattr(policy, "name", type(policy).__name__),
                     arrival_s=arrival, finish_s=finish, steps_run=steps_run, restarts=restarts, resizes=resizes,
                     lost_s=lost, gpu_s=gpu_s, contention=contention, isolated_s=iso, end_s=float(t), rounds=rounds,
                     solves=solves, solve_s=solve_s, skipped_fragmented=skipped_fragmented, window=cfg.window,
                     batch_changes=batch_changes, batch_log=batch_log)

