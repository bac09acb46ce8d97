"""Predict a cluster service's runs: the service's own decisions replayed in virtual time (pure).

:func:`replay` plays the rounds of :class:`virtualflow.service.runner.Service` on a virtual clock
with the very same :class:`~virtualflow.service.core.Scheduler` (policy, round mechanism,
re-solving only when the active set changes or an estimate drifts, pins, slot-keeping
:func:`~virtualflow.service.core.diff_actions`), and a model of each job's progress fed by
measured constants (:class:`ReplayCosts`):

- a round starts as soon as the previous one ends while jobs are active, or ``idle_s`` after an
  arrival when the service was idle; it decides, enacts its actions (preemptions in parallel,
  ``stop_s``; then one launch after another, ``launch_s`` each, the service's first
  ``first_launch_s``) and lasts ``max(round_s, enacting) + round_extra_s``;
- a started job makes its first step ``start_s`` after its launch returned (``resume_s`` when it
  resumes from its state), then steps at its measured rate on (type, workers)
  (:attr:`ReplayJob.rates`; a (type, workers) never measured is extrapolated like
  :func:`~virtualflow.service.core.estimate`); an in-place resize keeps the old workers stepping
  for ``grow_s`` (``shrink_s``) until the new membership forms; a preemption keeps the steps made;
- a job's last step is recorded done ``done_s`` later; its slots are free at the next round;
- the service's **estimates** start empty (the policy plans from the prior, as the service does)
  and at each round's end fold in the job's rate for what it ran on when it stepped long enough
  in the round to be measured (``2 * poll_s``, two steps: the service's rule), with
  :func:`~virtualflow.service.core.update_estimates`; received time grows by each round's length
  for the jobs running at its end (the service's bookkeeping);
- jobs with a deadline go through the service's earliest-deadline-first admission each round;
- a running job is pinned until it has made a step since its last start (seen at the service's
  next poll: a step less than ``poll_s`` before a round is not seen in it) and run ``min_run_s``.

:func:`measure` derives :class:`ReplayCosts` and the jobs' rates from a finished cluster's
records (jobs, events, rounds and each job's per-step metrics), so a cluster's own run can be
compared with its prediction (``virtualflow cluster replay``).

Invariants: virtual time only; the same inputs give the same result; a job never makes more than
its ``steps``; no type ever holds more workers than it has slots (the scheduler's invariant).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from virtualflow.cluster.mechanism import MechanismConfig
from virtualflow.cluster.policies.base import Policy, get_policy
from virtualflow.service.core import (JobView, Scheduler, base_rate, diff_actions, estimate_key, prior_rate,
                                      update_estimates)
from virtualflow.service.deadlines import admit

__all__ = ["ReplayCosts", "ReplayJob", "ReplayConfig", "ReplayRound", "ReplayResult", "replay", "measure",
           "job_rate"]

_EPS = 1e-9


@dataclass(kw_only=True, slots=True)
class ReplayCosts:
    """Measured constants of a service's machine (seconds). :func:`measure` reads them from a run."""

    start_s: float = 2.0
    """A job's first start: launch returned -> its first step ended, when it is the round's only
    worker process to start."""
    resume_s: float = 2.0
    """The same for a start from the job's state (after a preemption or a move)."""
    start_per_worker_s: float = 0.0
    """What each other worker process started in the same round (starts, restarts, grows) adds to a
    start's pause: processes starting at once share the machine's cores."""
    grow_s: float = 2.0
    """An in-place grow: the old workers keep stepping this long until the newcomers are members."""
    shrink_s: float = 0.0
    """An in-place shrink: the old workers keep stepping this long until the smaller group forms."""
    launch_s: float = 0.03
    """How long one launch blocks the service loop."""
    first_launch_s: float = 1.0
    """How long the service's first launch blocks it (imports the job's code)."""
    stop_s: float = 0.2
    """How long a round's preemptions block the loop (they run in parallel: each waits for its
    job's step boundary and writes its state)."""
    done_s: float = 0.15
    """A job's last step -> the service records it done."""
    idle_s: float = 0.2
    """An idle service: an arrival -> the round it starts (polling)."""
    round_extra_s: float = 0.0
    """A round's length beyond ``max(round_s, its enacting)`` (its end-of-round writes)."""

    def __post_init__(self) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"ReplayCosts.{name}={v!r} must be a number of seconds >= 0")


@dataclass(kw_only=True, slots=True)
class ReplayJob:
    """One job of the trace."""

    job_id: int
    steps: int
    arrival_s: float
    elastic: bool = False
    min_workers: int = 1
    max_workers: int = 1
    priority: float = 1.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    """Type -> the job's slowdown there (as the service gives it)."""
    rates: dict[str, float] = field(default_factory=dict)
    """``"TYPE/WORKERS"`` -> the job's real steps/s there (its per-step records)."""
    deadline_s: float | None = None
    """When the job should be done (the trace's clock), or None: the service's earliest-deadline-
    first admission (:func:`virtualflow.service.deadlines.admit`) runs over each round as it does."""
    start_pauses: tuple[float, ...] = ()
    """Trace-driven pauses: the k-th start of the job takes ``start_pauses[k]`` (launch returned ->
    first step) instead of the model's pause, where given (:func:`measure` with ``observed=True``:
    separates the decisions' fidelity from the noise of the machine)."""
    measured: dict[str, float] = field(default_factory=dict)
    """``"TYPE/WORKERS"`` -> what the service's own measurement reports there (its polling samples
    the steps: a little off the real rate); where missing, the real rate."""
    measurements: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Trace-driven measurements: the k-th measurement on a key reports ``measurements[key][k]``
    where given (what the service's throughput events said, in order), else ``measured``."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"job {self.job_id}: steps={self.steps} must be >= 1")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"job {self.job_id}: min_workers={self.min_workers} and max_workers={self.max_workers} "
                             f"must satisfy 1 <= min_workers <= max_workers")
        if not all(math.isfinite(p) and p >= 0 for p in self.start_pauses):
            raise ValueError(f"job {self.job_id}: start_pauses={self.start_pauses} must be seconds >= 0")
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"job {self.job_id}: arrival_s={self.arrival_s} must be a finite number of seconds")


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    """The service's configuration (as ``cluster start`` sets it)."""

    slots: dict[str, int]
    policy: str | Policy = "elastic_fair"
    round_s: float = 30.0
    min_run_s: float = 0.0
    drift: float = 0.25
    poll_s: float = 0.25
    mechanism: MechanismConfig | None = None
    """The round mechanism the service used (default: the library's defaults with ``round_s``, as
    a service started now uses; a run made under other defaults needs its own)."""
    max_rounds: int = 100000
    """A bound on the rounds played (a trace that never finishes is an error, not a hang)."""

    def __post_init__(self) -> None:
        if not self.slots or any(n < 1 for n in self.slots.values()):
            raise ValueError(f"slots={self.slots} must name at least one type with >= 1 slot")
        if not (math.isfinite(self.round_s) and self.round_s > 0):
            raise ValueError(f"round_s={self.round_s} must be a positive number of seconds")
        if not (math.isfinite(self.min_run_s) and self.min_run_s >= 0):
            raise ValueError(f"min_run_s={self.min_run_s} must be a number of seconds >= 0")


@dataclass(slots=True)
class ReplayRound:
    """One replayed round."""

    start_s: float
    end_s: float
    solved: bool
    active: int
    placements: dict[int, tuple[str, int]]
    """Job id -> (type, workers) that runs after the round's actions."""
    actions: list[tuple[str, int]]
    """(kind, job id) of the round's actions."""
    decision_s: float = 0.0
    """Wall-clock seconds the scheduler's decision took (policy, mechanism, diff)."""


@dataclass(slots=True)
class ReplayResult:
    """Per-job outcomes (times on the trace's clock, arrivals included)."""

    finish_s: dict[int, float]
    jct_s: dict[int, float]
    starts: dict[int, int]
    restarts: dict[int, int]
    resizes: dict[int, int]
    rounds: list[ReplayRound]
    lost_s: dict[int, float] = field(default_factory=dict)
    """Seconds each job held slots without stepping: its starts' pauses (a resize loses nothing:
    the old workers step on until the new group forms)."""

    @property
    def makespan_s(self) -> float:
        """Last finish minus first arrival."""
        first = min(f - j for f, j in zip(self.finish_s.values(), self.jct_s.values()))
        return max(self.finish_s.values()) - first


def job_rate(job: ReplayJob, acc_type: str, workers: int, prior: float) -> float:
    """The job's real steps/s on ``workers`` x ``acc_type``: measured, else extrapolated from its
    other measurements (``base * workers / slowdown``), else from ``prior`` (steps/s per
    full-speed worker)."""
    got = job.rates.get(estimate_key(acc_type, workers))
    if got is not None and got > 0:
        return got
    base = base_rate(JobView(job_id=job.job_id, steps=job.steps, slowdowns=job.slowdowns, estimates=job.rates))
    return (prior if base is None else base) * workers / job.slowdowns.get(acc_type, 1.0)


@dataclass(slots=True)
class _State:
    job: ReplayJob
    progress: float = 0.0
    t: float = 0.0
    """Time ``progress`` was last advanced to."""
    running: tuple[str, int] | None = None
    slots: tuple[str, ...] = ()
    rate: float = 0.0
    step_from: float = math.inf
    """Stepping (at ``rate``) resumes at this time (a start's pause)."""
    switch_at: float = math.inf
    """An in-place resize takes effect at this time (``switch_to``, ``switch_rate``)."""
    switch_to: tuple[str, int] | None = None
    switch_rate: float = 0.0
    started_s: float = 0.0
    start_progress: int = 0
    formed_s: float = math.inf
    """Since when the current (type, workers) steps (the measurement window's start)."""
    estimates: dict[str, float] = field(default_factory=dict)
    measured_n: dict[str, int] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    done_s: float | None = None
    starts: int = 0
    restarts: int = 0
    resizes: int = 0
    lost_s: float = 0.0

    def advance(self, to: float) -> None:
        """Progress up to time ``to`` (never past the job's steps)."""
        while self.t < to - _EPS:
            if self.running is None:
                self.t = to
                return
            if self.switch_at <= self.t + _EPS:
                self.running, self.rate, self.switch_at = self.switch_to, self.switch_rate, math.inf
                self.formed_s = self.t
            end = min(to, self.switch_at)
            lo = max(self.t, self.step_from)
            if end > lo:
                self.progress = min(float(self.job.steps), self.progress + (end - lo) * self.rate)
            self.t = end

    def finish_time(self) -> float:
        """When the last step ends on the current course (inf if it does not run)."""
        if self.running is None:
            return math.inf
        t, p = max(self.t, self.step_from), self.progress
        left = self.job.steps - p
        if self.switch_at < math.inf and self.switch_at > t:
            if self.rate > 0 and t + left / self.rate <= self.switch_at:
                return t + left / self.rate
            left -= (self.switch_at - t) * self.rate
            t, rate = self.switch_at, self.switch_rate
        else:
            rate = self.switch_rate if self.switch_at <= t else self.rate
        return t + left / rate if rate > 0 else math.inf

    def first_step_s(self) -> float:
        return self.step_from + 1.0 / self.rate if self.rate > 0 else math.inf


def replay(jobs: Iterable[ReplayJob], config: ReplayConfig, costs: ReplayCosts | None = None, *,
           on_round: Callable[[ReplayRound], None] | None = None) -> ReplayResult:
    """Play the service's rounds over ``jobs`` in virtual time; see the module docstring.
    ``on_round``: called with each round once played (progress output)."""
    costs = costs or ReplayCosts()
    jobs = sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))
    if not jobs:
        raise ValueError("replay needs at least one job")
    if len({j.job_id for j in jobs}) != len(jobs):
        raise ValueError("replay: job ids must be unique")
    for j in jobs:
        missing = [t for t in config.slots if t not in j.slowdowns]
        if missing:
            raise ValueError(f"job {j.job_id}: slowdowns has no factor for type(s) {missing} of the cluster's slots")
    policy = get_policy(config.policy) if isinstance(config.policy, str) else config.policy
    sched = Scheduler(dict(config.slots), policy, round_s=config.round_s, drift=config.drift,
                      mechanism=config.mechanism)
    states = {j.job_id: _State(job=j, t=j.arrival_s) for j in jobs}
    measured = [j for j in jobs if j.rates]
    prior = statistics.median([b for j in measured if (b := base_rate(
        JobView(job_id=j.job_id, steps=j.steps, slowdowns=j.slowdowns, estimates=j.rates))) is not None] or [1.0])
    epoch = jobs[0].arrival_s
    t = jobs[0].arrival_s + costs.idle_s
    first_launch = True
    rounds: list[ReplayRound] = []

    def settle(now: float, lag_s: float) -> None:
        """Advance every job to ``now`` and record the ones whose last step came ``lag_s`` before it
        (at a round's start every job that made its last step: the service does not move a job
        that is ending, and records it done ``done_s`` after that step)."""
        for s in states.values():
            if s.done_s is not None or s.running is None:
                continue
            f = s.finish_time()
            if f + lag_s <= now + _EPS:
                s.advance(f)
                s.progress = float(s.job.steps)
                s.done_s = f + costs.done_s
                s.running, s.slots = None, ()
                sched.finished(s.job.job_id)
            else:
                s.advance(now)

    for _ in range(config.max_rounds):
        active = [s for s in states.values() if s.done_s is None and s.job.arrival_s <= t + _EPS]
        if not active:
            waiting = [s.job.arrival_s for s in states.values() if s.done_s is None]
            if not waiting:
                break
            t = max(t, min(waiting) + costs.idle_s)
            continue
        start = t
        settle(start, 0.0)
        active = [s for s in active if s.done_s is None]
        views = [JobView(job_id=s.job.job_id, steps=s.job.steps, steps_done=int(s.progress + _EPS),
                         elastic=s.job.elastic, min_workers=s.job.min_workers, max_workers=s.job.max_workers,
                         priority=s.job.priority, arrival_s=s.job.arrival_s - epoch, slowdowns=s.job.slowdowns,
                         estimates=s.estimates, received_s=s.received, running=s.running, slots=s.slots)
                 for s in active]
        # The service sees a step at its next poll (every poll_s, none while a round ends): a step
        # less than a poll before the round is not seen yet, and the job is still pinned.
        pinned = {s.job.job_id for s in active if s.running is not None and
                  (s.first_step_s() > start - config.poll_s + _EPS or start - s.started_s < config.min_run_s)}
        decision = sched.plan(views, start - epoch, pinned)
        actions = decision.actions
        deadlines = {s.job.job_id: s.job.deadline_s for s in active if s.job.deadline_s is not None}
        if deadlines:  # the service's earliest-deadline-first admission over the policy's round
            placed_now = {jid: (sl[0].rpartition("-")[0], len(sl)) for jid, sl in decision.slots.items() if sl}
            adm = admit(views, placed_now, deadlines, now_s=start, round_s=config.round_s, slots=dict(config.slots),
                        pinned=pinned, prior=prior_rate(views))
            if adm.swaps:
                actions, decision.slots = diff_actions(views, adm.placements, dict(config.slots), pinned)
        now = start
        launched = sum(a.workers for a in actions if a.kind in ("start", "restart")) + sum(
            max(a.workers - states[a.job_id].running[1], 0) for a in actions  # type: ignore[index]
            if a.kind == "resize" and states[a.job_id].running is not None)
        crowd_s = costs.start_per_worker_s * max(launched - 1, 0)
        if any(a.kind in ("preempt", "restart") for a in actions):
            now += costs.stop_s
        for a in actions:
            s = states[a.job_id]
            if a.kind in ("preempt", "restart"):
                s.advance(now)
                s.progress = math.floor(s.progress + _EPS)
                s.running, s.slots, s.rate = None, (), 0.0
                s.step_from, s.switch_at = math.inf, math.inf
                if s.progress >= s.job.steps:  # it made its last step before it was recorded done
                    s.done_s = now
                    sched.finished(s.job.job_id)
                    continue
            if a.kind in ("start", "restart"):
                assert a.acc_type is not None
                now += costs.first_launch_s if first_launch else costs.launch_s
                first_launch = False
                resumed = s.starts > 0
                s.advance(now)
                s.running, s.slots = (a.acc_type, a.workers), a.slots
                s.rate = job_rate(s.job, a.acc_type, a.workers, prior)
                # The pause ends with the first step: stepping starts one step before.
                pause = (costs.resume_s if resumed else costs.start_s) + crowd_s
                if s.starts < len(s.job.start_pauses):
                    pause = s.job.start_pauses[s.starts]
                s.step_from = now + max(pause - 1.0 / s.rate, 0.0)
                s.lost_s += s.step_from - now
                s.formed_s, s.started_s, s.start_progress = s.step_from, now, int(s.progress)
                s.starts += 1
                s.restarts += 1 if resumed else 0
            elif a.kind == "resize":
                assert a.acc_type is not None and s.running is not None
                s.advance(now)
                grow = a.workers > s.running[1]
                s.switch_at = max(now, s.step_from) + (costs.grow_s if grow else costs.shrink_s)
                s.switch_to, s.switch_rate = (a.acc_type, a.workers), job_rate(s.job, a.acc_type, a.workers, prior)
                s.slots = a.slots
                s.formed_s = math.inf
                s.resizes += 1
        placed = {jid: st.switch_to if st.switch_at < math.inf else st.running for jid, st in states.items()
                  if st.running is not None}
        end = max(start + config.round_s, now) + costs.round_extra_s
        settle(end, costs.done_s)
        # End of round: measurements and received time, for the jobs still running.
        for s in states.values():
            if s.running is None or s.done_s is not None:
                continue
            if s.switch_at <= end:
                s.advance(end)
            lo = max(s.formed_s, s.step_from, start)
            if end - lo >= 2 * config.poll_s - _EPS and (end - lo) * s.rate >= 2:
                key = estimate_key(*s.running)
                k = s.measured_n.get(key, 0)
                trace = s.job.measurements.get(key, ())
                seen = trace[k] if k < len(trace) else s.job.measured.get(key, s.rate)
                s.measured_n[key] = k + 1
                s.estimates = update_estimates(s.estimates, s.running[0], s.running[1], seen)
            s.received = dict(s.received)
            s.received[s.running[0]] = s.received.get(s.running[0], 0.0) + (end - start)
        sched.end_round()
        rounds.append(ReplayRound(start_s=start, end_s=end, solved=decision.solved, active=len(active),
                                  placements=placed,  # type: ignore[arg-type]
                                  actions=[(a.kind, a.job_id) for a in actions], decision_s=decision.decision_s))
        if on_round is not None:
            on_round(rounds[-1])
        t = end
    else:
        raise ValueError(f"replay did not finish in max_rounds={config.max_rounds} rounds; raise "
                         f"ReplayConfig.max_rounds or check that every job fits the slots")
    finish = {jid: float(s.done_s) for jid, s in states.items() if s.done_s is not None}
    return ReplayResult(finish_s=finish, jct_s={jid: f - states[jid].job.arrival_s for jid, f in finish.items()},
                        starts={j: s.starts for j, s in states.items()},
                        restarts={j: s.restarts for j, s in states.items()},
                        resizes={j: s.resizes for j, s in states.items()}, rounds=rounds,
                        lost_s={j: s.lost_s for j, s in states.items()})


def _median(xs: list[float], default: float) -> float:
    xs = [x for x in xs if math.isfinite(x) and x >= 0]
    return statistics.median(xs) if xs else default


def measure(jobs: list[Any], events: list[dict[str, Any]], rounds: list[dict[str, Any]],
            steps: dict[int, list[tuple[float, int, int]]], *, round_s: float,
            slowdowns: dict[int, dict[str, float]], observed: bool = False
            ) -> tuple[list[ReplayJob], ReplayCosts]:
    """The trace and the constants of a finished cluster run, from its records (pure).

    ``jobs``: the database's job rows (``id``, ``steps``, ``elastic``, ``min_workers``,
    ``max_workers``, ``priority``, ``submitted_s``); ``events``: its events (``t``, ``job_id``,
    ``kind``, ``data``); ``rounds``: its rounds (``start_s``, ``end_s``); ``steps``: job id ->
    its per-step records (wall time the step ended, step, workers) from its metrics; ``slowdowns``:
    job id -> its slowdown per type. A job's rate on a (type, workers) is the median of the
    service's throughput measurements there (its per-step records where they show it); a job that
    failed or was cancelled makes the steps it made, then leaves; the costs are medians over what
    happened (a cost never observed keeps :class:`ReplayCosts`' default). ``observed``: trace-driven, also give each
    job the pauses its starts really took (:attr:`ReplayJob.start_pauses`) and the service's
    measurements in order (:attr:`ReplayJob.measurements`). A quarantined row (state
    ``quarantined``: its defining cells are unusable) is left out: the service never scheduled it."""
    jobs = [r for r in jobs if getattr(r, "state", None) != "quarantined"]
    d = ReplayCosts()
    by_job: dict[int, list[dict[str, Any]]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e.get("job_id") is not None:
            by_job.setdefault(int(e["job_id"]), []).append(e)
    round_starts = sorted(float(r["start_s"]) for r in rounds)

    def round_of(t: float) -> float | None:
        before = [s for s in round_starts if s <= t + _EPS]
        return before[-1] if before else None

    trace: list[ReplayJob] = []
    grow_p: list[float] = []
    shrink_p: list[float] = []
    launch_p: list[float] = []
    stop_p: list[float] = []
    done_p: list[float] = []
    starts_p: list[tuple[float, int, bool]] = []  # (pause, worker processes started in its round, resumed)
    launched: dict[float | None, int] = {}  # round start -> worker processes started in it
    size: dict[int, int] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        data, jid = e.get("data") or {}, e.get("job_id")
        if e["kind"] in ("start", "resize") and jid is not None:
            w = int(data.get("workers", 0))
            grown = w if e["kind"] == "start" else max(w - size.get(int(jid), 0), 0)
            launched[round_of(e["t"])] = launched.get(round_of(e["t"]), 0) + grown
            size[int(jid)] = w
    first_launch: float | None = None
    all_starts = sorted((e["t"], jid) for jid, es in by_job.items() for e in es if e["kind"] == "start")
    if all_starts:
        r0 = round_of(all_starts[0][0])
        if r0 is not None:
            first_launch = all_starts[0][0] - r0
    prev_action: dict[float, float] = {}
    for t_ev, _ in all_starts[1:]:
        r0 = round_of(t_ev)
        if r0 is not None:
            launch_p.append(t_ev - max(r0, prev_action.get(r0, r0)))
            prev_action[r0] = t_ev
    for row in jobs:
        jid = int(row.id)
        recs = sorted(steps.get(jid, []))
        rates: dict[str, list[float]] = {}
        pauses: list[float] = []
        workers_now = 0
        for e in by_job.get(jid, []):
            data = e.get("data") or {}
            if e["kind"] == "throughput":
                rates.setdefault(estimate_key(str(data.get("acc_type")), int(data.get("workers", 0))), []).append(
                    float(data.get("steps_per_s", 0.0)))
            elif e["kind"] == "start":
                after = [r[0] for r in recs if r[0] > e["t"]]
                r0 = round_of(e["t"])
                if after:
                    starts_p.append((after[0] - e["t"], launched.get(r0, 1), bool(data.get("resumed"))))
                pauses.append(after[0] - e["t"] if after else math.nan)
                workers_now = int(data.get("workers", 0))
            elif e["kind"] == "resize":
                new = int(data.get("workers", 0))
                after = [r[0] for r in recs if r[0] > e["t"] and r[2] == new]
                if after:
                    (grow_p if new > workers_now else shrink_p).append(after[0] - e["t"])
                workers_now = new
            elif e["kind"] == "preempt":
                r0 = round_of(e["t"])
                if r0 is not None:
                    stop_p.append(e["t"] - r0)
            elif e["kind"] == "done" and recs:
                done_p.append(e["t"] - recs[-1][0])
        stepped = _step_rates(by_job.get(jid, []), recs)
        seen = {k: statistics.median(v) for k, v in rates.items() if v and statistics.median(v) > 0}
        # A job that failed or was cancelled leaves after the steps it made (its slots free again).
        ended = getattr(row, "state", None) in ("failed", "cancelled")
        n_steps = max(int(getattr(row, "steps_done", 0)), 1) if ended else int(row.steps)
        trace.append(ReplayJob(job_id=jid, steps=n_steps, arrival_s=float(row.submitted_s),
                               elastic=bool(row.elastic), min_workers=int(row.min_workers),
                               max_workers=int(row.max_workers), priority=float(row.priority),
                               deadline_s=getattr(row, "deadline_s", None),
                               slowdowns=dict(slowdowns[jid]),
                               rates={**seen, **stepped}, measured=seen,
                               start_pauses=tuple(pauses) if observed and all(map(math.isfinite, pauses)) else (),
                               measurements={k: tuple(v) for k, v in rates.items()} if observed else {}))
    idle_p, extra_p = [], []
    ordered = sorted(rounds, key=lambda r: r["start_s"])
    arrivals = sorted(float(r.submitted_s) for r in jobs)
    for i, r in enumerate(ordered):
        prev_end = float(ordered[i - 1]["end_s"]) if i > 0 and ordered[i - 1]["end_s"] is not None else -math.inf
        if r["start_s"] - prev_end > 2 * _EPS + 0.05:  # the service was idle: woken by an arrival
            came = [a for a in arrivals if prev_end <= a <= r["start_s"]]
            if came:
                idle_p.append(r["start_s"] - came[0])
        nxt = ordered[i + 1] if i + 1 < len(ordered) else None
        if r["end_s"] is not None and nxt is not None and abs(nxt["start_s"] - r["end_s"]) < 0.05:
            extra_p.append(max(float(r["end_s"]) - r["start_s"] - round_s, 0.0))
    start_s, per_worker_s, resume_s = _fit_starts(starts_p, d)
    costs = ReplayCosts(start_s=start_s, resume_s=resume_s, start_per_worker_s=per_worker_s,
                        grow_s=_median(grow_p, d.grow_s), shrink_s=_median(shrink_p, d.shrink_s),
                        launch_s=_median(launch_p, d.launch_s),
                        first_launch_s=(first_launch if first_launch is not None and first_launch >= 0
                                        else d.first_launch_s),
                        stop_s=_median(stop_p, d.stop_s), done_s=_median(done_p, d.done_s),
                        idle_s=_median(idle_p, d.idle_s), round_extra_s=_median(extra_p, d.round_extra_s))
    return trace, costs


def _fit_starts(points: list[tuple[float, int, bool]], d: ReplayCosts) -> tuple[float, float, float]:
    """(start_s, start_per_worker_s, resume_s) from (pause, worker processes started in the round,
    resumed) points: a least-squares line over all starts (pause = a + b * (workers - 1), b >= 0;
    flat when every round started as many), then the resumed starts' median offset from it."""
    pts = [(p, max(n, 1), r) for p, n, r in points if math.isfinite(p) and p >= 0]
    if not pts:
        return d.start_s, d.start_per_worker_s, d.resume_s
    xs = [n - 1 for _, n, _ in pts]
    ys = [p for p, _, _ in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0) if var > 0 else 0.0
    a = max(my - b * mx, 0.0)
    first = [p - b * (n - 1) - a for p, n, r in pts if not r]
    resumed = [p - b * (n - 1) - a for p, n, r in pts if r]
    start_s = max(a + (statistics.median(first) if first else 0.0), 0.0)
    resume_s = max(a + statistics.median(resumed), 0.0) if resumed else start_s
    return start_s, b, resume_s


def _step_rates(events: list[dict[str, Any]], recs: list[tuple[float, int, int]]) -> dict[str, float]:
    """A job's steps/s per ``"TYPE/WORKERS"`` from its per-step records: within each stretch between
    two of its events (start, resize, preempt, done) where the records have one worker count, the
    steps after the first one over the time they took (three records at least), pooled."""
    marks = sorted((float(e["t"]), e) for e in events if e["kind"] in ("start", "resize", "preempt", "done", "failed"))
    pooled: dict[str, list[float]] = {}
    acc_type: str | None = None
    for i, (t, e) in enumerate(marks):
        data = e.get("data") or {}
        if e["kind"] in ("start", "resize"):
            acc_type = str(data.get("acc_type")) if data.get("acc_type") is not None else acc_type
        else:
            continue
        until = marks[i + 1][0] if i + 1 < len(marks) else math.inf
        workers = int(data.get("workers", 0))
        seg = [r for r in recs if t < r[0] <= until and r[2] == workers]
        if len(seg) >= 3 and seg[-1][0] > seg[1][0] and acc_type is not None:
            p = pooled.setdefault(estimate_key(acc_type, workers), [0.0, 0.0])
            p[0] += seg[-1][1] - seg[1][1]
            p[1] += seg[-1][0] - seg[1][0]
    return {k: n / dt for k, (n, dt) in pooled.items() if n > 0 and dt > 0}
