"""The cluster service's decisions, pure: no processes, no clock, no database.

Each round the service builds a :class:`JobView` per active job and asks
:meth:`Scheduler.plan` what to do. The scheduler

1. builds a throughput table from the service's **estimates** (:func:`estimate`): a
   (type, workers) the job was measured on uses the measurement; any other is extrapolated from
   the job's measurements as ``base * workers / slowdown[type]`` (``base``: the job's steps/s
   per worker at full speed, the median over its measurements; a job never measured gets the
   median ``base`` of the jobs measured so far, or :data:`PRIOR_STEPS_PER_S` before any), so a
   job the table does not know is still scheduled, and better each round;
2. re-solves the **policy** (the same :mod:`virtualflow.cluster.policies` code as ``virtualflow
   simulate``) when the set of active jobs changed or an estimate the last solution used moved by
   more than ``drift`` (re-solving resets the mechanism's time-share counters, so it is not done
   every round); a policy that fails (a solver that finds no optimum, or any error) never stops
   the service: the round falls back to :data:`FALLBACK_POLICY` (first come, first served, no
   solver) and the decision says why (:attr:`RoundDecision.fallback`, recorded as a
   ``policy_fallback`` event);
3. asks the **round mechanism** (:class:`~virtualflow.cluster.mechanism.RoundMechanism`) for this
   round's placements;
4. diffs them against what runs now (:func:`diff_actions`): a job placed on the same type with
   the same worker count keeps running; an elastic job on the same type with another count is
   **resized in place**; a job no longer placed is **preempted** (stopped with its state kept);
   any other change (a rigid job's new count, a move to another type) is a **restart** from the
   job's state. Slots are named ``TYPE-i``; a job keeps the slots it holds where it can.

Accelerator types are emulated on one machine by **slowdown factors** (:func:`type_slowdowns`):
a worker on type ``k`` sleeps ``slowdown[k] - 1`` times its measured compute after each virtual
node (:class:`virtualflow.WorkerSpec`), ``slowdown[k] = fastest / throughput(k)`` in a
throughput table (Gavel's measurements by default: per job type when the job names one, else
the geometric mean over the table's job types at one GPU).

Invariants: a round never places more workers of a type than the type has slots; the actions of
a round release slots (preempt, shrink, restart) before they take slots (start, grow); a job
appears in at most one action; the same inputs give the same decision.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from virtualflow.cluster.mechanism import MechanismConfig, RoundMechanism, RoundPlan
from virtualflow.cluster.model import Cluster, JobSpec
from virtualflow.cluster.policies.base import Policy, PolicyInput
from virtualflow.cluster.policies.elastic_batch import BATCH_KEY
from virtualflow.cluster.policies.greedy import Fifo
from virtualflow.cluster.throughputs import ThroughputTable

__all__ = ["PRIOR_STEPS_PER_S", "JobView", "base_rate", "prior_rate", "Action", "RoundDecision", "Scheduler", "type_slowdowns",
           "slot_names", "estimate", "update_estimates", "diff_actions", "recovery_action", "parse_slowdowns",
           "MECHANISMS", "mechanism_knobs", "mechanism_of", "FALLBACK_POLICY", "batch_changes", "batch_fields"]

MECHANISMS = ("default", "lease_first", "gavel")
"""Round mechanics a cluster can be started with: this virtualflow's defaults (what ``virtualflow
simulate`` uses), the mechanics before issue 17 (one global queue, lease holders first), Gavel's."""
_KNOBS = ("order", "prior", "carry_deficits", "placement", "reallocate_on_events")


def mechanism_knobs(name: str) -> dict:
    """The round mechanism's knobs (beyond the round length and costs) of a :data:`MECHANISMS`
    name, as a cluster's configuration records them."""
    if name not in MECHANISMS:
        raise ValueError(f"--mechanism {name!r} must be one of {list(MECHANISMS)}")
    cfg = {"default": MechanismConfig, "lease_first": MechanismConfig.lease_first,
           "gavel": MechanismConfig.gavel}[name]()
    return {k: getattr(cfg, k) for k in _KNOBS}


def mechanism_of(knobs: dict | None, round_s: float) -> MechanismConfig:
    """The service's round mechanism from recorded knobs (``None``: a cluster created before they
    were recorded, which ran this virtualflow's defaults)."""
    extra = {k: knobs[k] for k in _KNOBS if k in knobs} if knobs else {}
    return MechanismConfig(round_s=round_s, start_cost_s=0.0, **extra)

PRIOR_STEPS_PER_S = 1.0
"""Steps/s per full-speed worker assumed for a job not measured yet."""

FALLBACK_POLICY = Fifo()
"""What the scheduler allocates with when the cluster's policy fails (a solver that finds no
optimum, e.g. for priorities spanning too many orders of magnitude, or any error): first come,
first served on the fastest free type, no solver, never time-shared."""


def estimate_key(acc_type: str, workers: int) -> str:
    return f"{acc_type}/{workers}"


def parse_slowdowns(spec: str) -> dict[str, float]:
    """``"v100=1,k80=3.5"`` -> ``{"v100": 1.0, "k80": 3.5}`` (``--slowdowns``)."""
    out: dict[str, float] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            f = float(value)
        except ValueError:
            f = float("nan")
        if not sep or not name.strip() or not math.isfinite(f) or f < 1:
            raise ValueError(f"--slowdowns item {part!r} must look like TYPE=FACTOR with FACTOR >= 1 "
                             f"(1 = full speed), e.g. k80=3.5")
        out[name.strip()] = f
    return out


def type_slowdowns(types: tuple[str, ...] | list[str], table: ThroughputTable | None,
                   overrides: dict[str, float] | None = None, job_type: str | None = None) -> dict[str, float]:
    """Slowdown factor (>= 1) of each accelerator type: ``overrides`` where given, else from
    ``table`` (``job_type``'s row at one GPU when it names one the table has, else the geometric
    mean over the job types known on every type at one GPU); the fastest type gets 1."""
    overrides = dict(overrides or {})
    missing = [t for t in types if t not in overrides and (table is None or t not in table.acc_types)]
    if missing:
        raise ValueError(f"accelerator type(s) {missing} are not in the throughput table "
                         f"({list(table.acc_types) if table is not None else 'none'}): give their speed with "
                         f"--slowdowns {missing[0]}=FACTOR (1 = full speed)")
    speed: dict[str, float] = {}
    from_table = [t for t in types if t not in overrides]
    if from_table:
        assert table is not None
        if job_type is not None and table.has(job_type, 1):
            rows = [job_type]
        else:
            rows = [jt for jt in table.job_types
                    if table.has(jt, 1) and all(table.throughput(jt, t, 1) > 0 for t in from_table)]
        if not rows:
            raise ValueError(f"the throughput table has no job type measured on all of {from_table} at one GPU; "
                             f"give their speeds with --slowdowns TYPE=FACTOR,...")
        for t in from_table:
            vals = [table.throughput(jt, t, 1) for jt in rows]
            if any(v <= 0 for v in vals):
                raise ValueError(f"job type {rows[0]!r} cannot run on {t!r} in the throughput table; give its "
                                 f"speed with --slowdowns {t}=FACTOR")
            speed[t] = math.exp(sum(math.log(v) for v in vals) / len(vals))
        fastest = max(speed.values())
        out = {t: fastest / speed[t] for t in from_table}
    else:
        out = {}
    out.update({t: float(overrides[t]) for t in types if t in overrides})
    return {t: out[t] for t in types}


def slot_names(slots: dict[str, int]) -> list[str]:
    """``{"v100": 2, "k80": 1}`` -> ``["v100-0", "v100-1", "k80-0"]``."""
    return [f"{t}-{i}" for t, n in slots.items() for i in range(n)]


@dataclass(kw_only=True, slots=True)
class JobView:
    """What the scheduler knows of one active job."""

    job_id: int
    steps: int
    steps_done: int = 0
    elastic: bool = False
    min_workers: int = 1
    max_workers: int = 1
    """Rigid jobs run on exactly ``max_workers`` (== ``min_workers``)."""
    priority: float = 1.0
    arrival_s: float = 0.0
    """Seconds since the service's epoch."""
    slowdowns: dict[str, float] = field(default_factory=dict)
    """Type -> the slowdown this job's workers get there."""
    estimates: dict[str, float] = field(default_factory=dict)
    """``"TYPE/WORKERS"`` -> measured steps/s."""
    received_s: dict[str, float] = field(default_factory=dict)
    """Type -> seconds it has run there."""
    running: tuple[str, int] | None = None
    """(type, workers) it runs on now, or None."""
    slots: tuple[str, ...] = ()
    """The slots it holds now."""
    batch: dict | None = None
    """An elastic-batch job's batch (:attr:`virtualflow.service.rows.JobRow.batch`: its own, the
    per-VN size, the range, the rule and the batch it was last given); None: it keeps its batch."""


def base_rate(view: JobView) -> float | None:
    """The job's measured steps/s per full-speed worker (median over its measurements), or None."""
    bases = []
    for key, v in view.estimates.items():
        t, _, g = key.rpartition("/")
        if t in view.slowdowns and g.isdigit() and int(g) > 0 and v > 0:
            bases.append(v * view.slowdowns[t] / int(g))
    return statistics.median(bases) if bases else None


def prior_rate(views: list[JobView]) -> float:
    """What a job never measured is assumed to make per full-speed worker: the median of the
    measured jobs' rates (jobs sharing a cluster tend to be alike), else :data:`PRIOR_STEPS_PER_S`."""
    rates = [b for b in map(base_rate, views) if b is not None]
    return statistics.median(rates) if rates else PRIOR_STEPS_PER_S


def estimate(view: JobView, acc_type: str, workers: int, prior: float = PRIOR_STEPS_PER_S) -> float:
    """Steps/s of ``view``'s job on ``workers`` workers of ``acc_type`` (see the module docstring);
    ``prior``: the per-worker rate of a job not measured yet."""
    measured = view.estimates.get(estimate_key(acc_type, workers))
    if measured is not None and measured > 0:
        return measured
    base = base_rate(view)
    return (prior if base is None else base) * workers / view.slowdowns[acc_type]


def update_estimates(estimates: dict[str, float], acc_type: str, workers: int, measured: float,
                     weight: float = 0.5) -> dict[str, float]:
    """A new estimates dict with ``measured`` steps/s folded in (exponential average: ``weight``
    on the new measurement)."""
    if not (math.isfinite(measured) and measured > 0):
        return dict(estimates)
    out = dict(estimates)
    key = estimate_key(acc_type, workers)
    old = out.get(key)
    out[key] = measured if old is None else (1 - weight) * old + weight * measured
    return out


@dataclass(frozen=True, slots=True)
class Action:
    """One change to enact. ``kind``: ``start`` (first start or resume after a preemption),
    ``resize`` (elastic, in place), ``preempt`` (stop, state kept) or ``restart`` (preempt, then
    start on ``acc_type`` x ``workers``)."""

    kind: str
    job_id: int
    acc_type: str | None = None
    workers: int = 0
    slots: tuple[str, ...] = ()


ORDER = {"preempt": 0, "restart": 1, "resize": 2, "start": 3}


def diff_actions(views: list[JobView], placements: dict[int, tuple[str, int]], slots: dict[str, int],
                 pinned: set[int] | frozenset[int] = frozenset()) -> tuple[list[Action], dict[int, tuple[str, ...]]]:
    """The actions that turn what runs (``view.running``, ``view.slots``) into ``placements``
    (job id -> (type, workers)), and every placed job's slots afterwards.

    A running job in ``pinned`` (one that has not settled since it was last started: see
    :class:`Scheduler`) keeps what it runs on whatever ``placements`` says; a placement that then
    finds too few free slots is deferred (no action: the job waits for a later round). Without
    pins, a placement that does not fit is a ``ValueError`` (the mechanism over-committed)."""
    placements = dict(placements)
    for v in views:
        if v.job_id in pinned and v.running is not None:
            placements[v.job_id] = v.running
    free = {t: [f"{t}-{i}" for i in range(n)] for t, n in slots.items()}
    by_id = {v.job_id: v for v in views}
    held: dict[int, tuple[str, ...]] = {}
    for v in views:
        if v.running is not None:
            for s in v.slots:
                t = v.running[0]
                if s in free.get(t, []):
                    free[t].remove(s)
            held[v.job_id] = tuple(v.slots)
    actions: list[Action] = []
    out: dict[int, tuple[str, ...]] = {}
    pending: list[tuple[str, int, str, int]] = []  # (kind, job, type, workers): take slots after releases

    def release(jid: int, keep: int = 0) -> tuple[str, ...]:
        v = by_id[jid]
        kept, gone = held[jid][:keep], held[jid][keep:]
        assert v.running is not None
        free[v.running[0]].extend(gone)
        return kept

    for v in sorted(views, key=lambda v: v.job_id):
        want = placements.get(v.job_id)
        if v.running is None:
            if want is not None:
                pending.append(("start", v.job_id, want[0], want[1]))
            continue
        if want is None:
            release(v.job_id)
            actions.append(Action("preempt", v.job_id))
        elif want == v.running:
            out[v.job_id] = held[v.job_id]
        elif want[0] == v.running[0] and v.elastic:
            if want[1] < v.running[1]:
                out[v.job_id] = release(v.job_id, keep=want[1])
                actions.append(Action("resize", v.job_id, want[0], want[1], out[v.job_id]))
            else:
                pending.append(("resize", v.job_id, want[0], want[1]))
        else:
            release(v.job_id)
            pending.append(("restart", v.job_id, want[0], want[1]))
    for t in free:
        free[t].sort(key=lambda s: int(s.rpartition("-")[2]))
    for kind, jid, t, n in sorted(pending, key=lambda p: (ORDER[p[0]], p[1])):
        have = held.get(jid, ()) if kind == "resize" else ()
        need = n - len(have)
        if need > len(free[t]) and pinned:  # deferred: the slots are held by a pinned job
            if kind == "restart":  # it was released to move: it waits, preempted
                actions.append(Action("preempt", jid))
            elif kind == "resize":  # it cannot grow yet: it runs on as it is
                out[jid] = held[jid]
            continue
        if need > len(free[t]):
            raise ValueError(f"placement of job {jid} needs {need} more {t} slot(s) but {len(free[t])} are free; "
                             f"the mechanism over-committed type {t!r}")
        got = tuple(free[t][:need])
        del free[t][:need]
        out[jid] = tuple(have) + got
        actions.append(Action(kind, jid, t, n, out[jid]))
    actions.sort(key=lambda a: (ORDER[a.kind], a.job_id))
    return actions, out


@dataclass(slots=True)
class RoundDecision:
    """One round's decision."""

    plan: RoundPlan
    actions: list[Action]
    slots: dict[int, tuple[str, ...]]
    """Placed job id -> its slots this round."""
    solved: bool
    """Whether the policy was re-solved this round."""
    decision_s: float
    """Wall-clock seconds the decision took (policy + mechanism + diff)."""
    fallback: str | None = None
    """Why the policy's allocation was not used this round (it failed to solve, or raised), or
    None. The scheduler then used :data:`FALLBACK_POLICY`, or, should that fail too, kept what
    runs and started nothing; the service records a ``policy_fallback`` event with this text."""
    batches: dict[int, int] = field(default_factory=dict)
    """Running elastic-batch job -> the batch the policy gives it now, where that differs from the
    one it was last given (``Allocation.info["batch_size"]``; a job that did not opt in never has
    one): the service changes it in place (:meth:`virtualflow.JobHandle.change_batch`)."""


class Scheduler:
    """Policy + round mechanism over the service's estimates (stateful like the mechanism: the
    current allocation and the time-share counters)."""

    def __init__(self, slots: dict[str, int], policy: Policy, *, round_s: float, drift: float = 0.25,
                 mechanism: MechanismConfig | None = None) -> None:
        """``mechanism``: the round mechanism's knobs (default: the library's defaults with this
        ``round_s``; its change costs do not matter here: the service pays real ones)."""
        # One machine: every type's slots are one "server" (a job runs whole on one type).
        self.cluster = Cluster(gpus=dict(slots), gpus_per_server=dict(slots))
        self.slots = dict(slots)
        self.policy = policy
        self.drift = drift
        self.mechanism = RoundMechanism(self.cluster, mechanism or MechanismConfig(round_s=round_s, start_cost_s=0.0))
        self._solved_for: tuple[int, ...] | None = None
        self._batches: dict[int, int] = {}
        """The last solution's batches (``Allocation.info["batch_size"]``), job id -> batch."""
        self._solved_T: dict[tuple[int, str, int], float] = {}

    def table(self, views: list[JobView]) -> ThroughputTable:
        """The throughput table the policy sees: job type ``job-<id>``, every type, 1..max workers."""
        data: dict[str, dict[str, dict[str, float]]] = {}
        prior = prior_rate(views)
        for v in views:
            data[f"job-{v.job_id}"] = {t: {str(g): estimate(v, t, g, prior) if g <= self.slots[t] else 0.0
                                           for g in range(1, v.max_workers + 1)} for t in self.cluster.types}
        return ThroughputTable.from_dict({"throughputs": data}, source="service estimates")

    def _needs_solve(self, views: list[JobView]) -> bool:
        ids = tuple(sorted(v.job_id for v in views))
        if ids != self._solved_for:
            return True
        prior = prior_rate(views)
        for (jid, t, g), old in self._solved_T.items():
            v = next(v for v in views if v.job_id == jid)
            new = estimate(v, t, g, prior)
            if old > 0 and abs(new - old) / old > self.drift:
                return True
        return False

    def plan(self, views: list[JobView], now_s: float, pinned: set[int] | frozenset[int] = frozenset()) -> RoundDecision:
        """This round's placements and the actions that enact them (``now_s``: seconds since the
        service's epoch, for the policy's time-dependent inputs).

        ``pinned``: running jobs that keep their placement this round whatever the mechanism says
        (the service pins a job until it has made a step since its last start and run
        ``min_run_s``: on a loaded machine a start can take longer than a round, and moving a job
        that has not started yet would make no progress at all). The mechanism's placements are
        reported as planned; the actions and slots say what really runs."""
        t0 = time.perf_counter()
        active = [v for v in views if v.steps_done < v.steps]
        solved = False
        fallback: str | None = None
        if not active:
            self._solved_for = ()
            plan = RoundPlan(placements={}, used={t: 0 for t in self.cluster.types})
            actions, slots = diff_actions(views, {}, self.slots)
            return RoundDecision(plan, actions, slots, False, time.perf_counter() - t0)
        biggest = max(self.slots.values())
        # A job runs whole on one type: an elastic job never asks for more workers than the largest has.
        active = [v if v.max_workers <= biggest or not v.elastic else
                  _replace(v, max_workers=max(biggest, v.min_workers)) for v in active]
        if self._needs_solve(active):
            table = self.table(active)
            specs = [JobSpec(job_id=v.job_id, job_type=f"job-{v.job_id}", scale_factor=v.max_workers,
                             min_gpus=v.min_workers if v.elastic else None, total_steps=float(v.steps),
                             weight=v.priority, arrival_s=max(v.arrival_s, 0.0), **batch_fields(v)) for v in active]
            types = self.cluster.types
            inp = PolicyInput(jobs=specs, cluster=self.cluster, table=table, time_s=max(now_s, 0.0),
                              steps_done=np.array([min(v.steps_done, v.steps) for v in active], dtype=float),
                              elapsed_s=np.array([max(now_s - v.arrival_s, 0.0) for v in active]),
                              time_received_s=np.array([[v.received_s.get(t, 0.0) for t in types] for v in active]))
            elastic = {v.job_id: v.elastic for v in active}
            try:
                alloc = self.policy.allocate(inp)
                self.mechanism.set_allocation(alloc, elastic=elastic)
            except Exception as exc:  # noqa: BLE001 - one job's numbers must not stop the service
                fallback = f"policy {getattr(self.policy, 'name', type(self.policy).__name__)} failed: " \
                           f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                try:
                    alloc = FALLBACK_POLICY.allocate(inp)
                    self.mechanism.set_allocation(alloc, elastic=elastic)
                except Exception as exc2:  # noqa: BLE001 - keep what runs, start nothing
                    self._solved_for = None  # try again next round
                    fallback += f"; {FALLBACK_POLICY.name} failed too ({type(exc2).__name__}): kept what runs"
                    keep = {v.job_id: v.running for v in views if v.running is not None}
                    actions, slots = diff_actions(views, keep, self.slots, pinned)
                    plan = RoundPlan(placements={}, used={t: 0 for t in self.cluster.types})
                    return RoundDecision(plan, actions, slots, True, time.perf_counter() - t0, fallback)
                fallback += f"; this allocation is {FALLBACK_POLICY.name}'s (first come, first served)"
            self._solved_for = tuple(sorted(v.job_id for v in active))
            self._batches = {jid: int(b) for jid, b in (alloc.info or {}).get(BATCH_KEY, {}).items()}
            prior = prior_rate(active)
            self._solved_T = {(v.job_id, t, g): estimate(v, t, g, prior) for v in active for t in types
                              for g in {alloc.gpus.get(v.job_id, v.max_workers)} if g <= self.slots[t]}
            solved = True
        plan = self.mechanism.plan_round({v.job_id for v in active})
        placements = {jid: (p.acc_type, p.gpus) for jid, p in plan.placements.items()}
        actions, slots = diff_actions(views, placements, self.slots, pinned)
        return RoundDecision(plan, actions, slots, solved, time.perf_counter() - t0,
                             batches=batch_changes(views, actions, slots, self._batches), fallback=fallback)

    def end_round(self) -> None:
        self.mechanism.end_round()

    def finished(self, job_id: int) -> None:
        """The job left the cluster (done, failed, cancelled): its lease and counters go."""
        self.mechanism.stop(job_id)


def batch_fields(view: JobView) -> dict:
    """The :class:`~virtualflow.cluster.model.JobSpec` batch fields of an elastic-batch job (its
    own batch, the rule relative to it), none for a job that keeps its batch."""
    b = view.batch
    if b is None:
        return {}
    rule = b["lr_rule"] if isinstance(b["lr_rule"], str) else {int(k): float(m) for k, m in b["lr_rule"].items()}
    return dict(batch_size=b["base"], vn_size=b["vn_size"], batch_size_range=tuple(b["range"]), lr_rule=rule)


def batch_changes(views: list[JobView], actions: list[Action], slots: dict[int, tuple[str, ...]],
                  decided: dict[int, int]) -> dict[int, int]:
    """The batches to change in place this round: an elastic-batch job that runs before and after
    the round (not started, moved or preempted by it) whose decided batch differs from the one it
    was last given, and whose workers after the round each have a virtual node at that batch."""
    moved = {a.job_id for a in actions if a.kind != "resize"}
    out = {}
    for v in views:
        b = decided.get(v.job_id)
        if (v.batch is None or b is None or v.running is None or v.job_id in moved or v.job_id not in slots
                or b == v.batch["now"] or b // v.batch["vn_size"] < len(slots[v.job_id])):
            continue
        out[v.job_id] = b
    return out


def _replace(view: JobView, **fields: object) -> JobView:
    d = {f: getattr(view, f) for f in JobView.__slots__}  # type: ignore[attr-defined]
    d.update(fields)
    return JobView(**d)


def recovery_action(state: str, summary: dict | None, has_state: bool, total_steps: int,
                    state_step: int | None = None) -> str:
    """What a restarted service does with a job its database says was ``state`` (pure):

    - ``"done"``: the job's run directory says it completed all its steps (the service died after
      the job ended but before it recorded so; ``state_step``: the step of its newest state file,
      which the workers write before the service's summary): recorded as done, never run again;
    - ``"resume"``: it was running: queued again, to continue from its newest state file
      (``has_state``), or from the start when it has none;
    - ``"keep"``: nothing to recover (queued, or already final).
    """
    if state != "running":
        return "keep"
    if summary is not None and summary.get("status") == "done" and summary.get("steps_completed") == total_steps:
        return "done"
    if state_step is not None and state_step >= total_steps:
        return "done"  # the workers wrote the final state; the service died before the summary
    return "resume" if has_state else "restart"
