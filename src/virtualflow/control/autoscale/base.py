"""Autoscaling's vocabulary and measurements: what a policy sees (:class:`Observation`), what it
returns (decisions), how each worker count is measured, and the trial-and-error search the
``efficiency`` and ``utility`` policies share. See the package docstring for the invariants."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable




# --------------------------------------------------------------------------------------------
# What a policy sees and what it returns.


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """One training step, as the autoscaler sees it."""

    step: int
    """The (0-based) step this record describes."""
    workers: int
    """Workers that ran the step (members of its generation)."""
    throughput: float
    """Samples per second of the whole job over this step: global batch / step time."""
    step_time_s: float
    """Wall time of the step, measured by rank 0 from the end of the previous step."""
    cost_rate_per_h: float
    """What the running workers cost per hour: workers x price per worker-hour."""
    elapsed_s: float
    """Seconds since the job started."""
    steps_remaining: int
    """Steps left after this one."""
    generation: int = 0
    """Membership generation that ran the step (a new one starts after every change)."""
    worker_ids: tuple[int, ...] = ()
    """Ids of the workers, by rank."""
    per_worker_throughput: Mapping[int, float] = field(default_factory=dict)
    """Worker id -> samples per second of that worker's own compute (its samples over its
    compute time, without the reduction). Empty when unknown (the first step of a generation)."""
    vn_counts: Mapping[int, int] = field(default_factory=dict)
    """Worker id -> virtual nodes it ran in this step."""
    parts: Mapping[str, float] = field(default_factory=dict)
    """Where the time of a step at this size went, mean seconds per worker
    (:data:`virtualflow.runtime.breakdown.PARTS` and ``step_s``; the breakdown of the previous
    step of the same generation, which rides in this one's reduction). Empty when not measured."""

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"Observation.workers={self.workers!r} must be a positive int")
        if not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"Observation.step_time_s={self.step_time_s!r} must be a positive number")

    @property
    def throughput_per_worker(self) -> float:
        """Total throughput divided by the worker count."""
        return self.throughput / self.workers


StepModel = Callable[[int], float]
"""A predicted step time (in any unit: only ratios are read) for a worker count: the pipeline time
model of :mod:`virtualflow.control.autoscale.pipeline`."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The worker counts a policy may choose from: the multiples of ``unit`` in
    ``[min_workers, max_workers]`` (the bounds rounded inwards to whole replicas), and, with a
    ``step_model``, only those the model says can be faster than every smaller one (:meth:`sizes`)."""

    min_workers: int
    max_workers: int
    unit: int = 1
    """Workers per replica: every count is a multiple of it (a pipelined job: stages x tensor,
    which grows and shrinks in whole replicas; 1 otherwise)."""
    step_model: StepModel | None = None
    """The predicted step time per worker count (a pipelined job's replica time model), or None:
    sizes are judged by measurement only."""

    def __post_init__(self) -> None:
        for name in ("min_workers", "max_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer (--{name.replace('_', '-')})")
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers={self.min_workers} is greater than max_workers={self.max_workers}; the autoscaler "
                f"needs min_workers <= max_workers (--min-workers, --max-workers)"
            )
        if not isinstance(self.unit, int) or isinstance(self.unit, bool) or self.unit < 1:
            raise ValueError(f"Limits.unit={self.unit!r} (workers per replica) must be a positive integer")
        if self.lowest > self.highest:
            raise ValueError(
                f"min_workers={self.min_workers} and max_workers={self.max_workers} hold no whole pipeline replica "
                f"of {self.unit} workers (stages x tensor); the autoscaler adds and removes whole replicas: choose "
                f"--max-workers of at least {self.lowest} (--min-workers, --max-workers)")

    @property
    def lowest(self) -> int:
        """The smallest count a policy may choose: ``min_workers`` rounded up to whole replicas."""
        return -(-self.min_workers // self.unit) * self.unit

    @property
    def highest(self) -> int:
        """The largest count a policy may choose: ``max_workers`` rounded down to whole replicas."""
        return self.max_workers // self.unit * self.unit

    def clamp(self, n: int) -> int:
        """``n`` brought into ``[lowest, highest]`` and down to whole replicas (never a partial one)."""
        return max(self.lowest, min(self.highest, n - n % self.unit))

    def toward(self, n: int, current: int) -> int:
        """A count asked as ``n`` from ``current`` in whole replicas: rounded away from ``current``
        (asking for one worker more grows by a replica, one fewer shrinks by one), then clamped."""
        rounded = -(-n // self.unit) * self.unit if n > current else n - n % self.unit
        return self.clamp(rounded)

    def sizes(self) -> tuple[int, ...]:
        """The counts a search visits, ascending: every multiple of ``unit`` in ``[lowest,
        highest]``; with a ``step_model``, without those predicted no faster than a smaller count
        (with V = 4 micro-batches, 3 pipeline replicas run 2, 1 and 1: the slowest runs 2, as with
        2 replicas, so the third replica cannot shorten the step and is never tried)."""
        out: list[int] = []
        best = math.inf
        for n in range(self.lowest, self.highest + 1, self.unit):
            if self.step_model is None:
                out.append(n)
                continue
            t = self.step_model(n)
            if t < best * (1 - 1e-9) or not out:
                out.append(n)
                best = min(best, t)
        return tuple(out)

    def above(self, k: int, steps: int) -> int:
        """The ``steps``-th size of :meth:`sizes` above ``k`` (the largest when fewer; ``k`` when none)."""
        up = [s for s in self.sizes() if s > k]
        return up[min(steps, len(up)) - 1] if up else k

    def below(self, k: int, steps: int) -> int:
        """The ``steps``-th size of :meth:`sizes` below ``k`` (the smallest when fewer; ``k`` when none)."""
        down = [s for s in self.sizes() if s < k]
        return down[-min(steps, len(down))] if down else k


@dataclass(frozen=True, slots=True)
class Stay:
    """Keep the current workers."""

    reason: str = ""
    settled: bool = False
    """True when the search has ended here (the executor records it once)."""


@dataclass(frozen=True, slots=True)
class Resize:
    """Change the worker count to ``workers`` (in place, at a step boundary)."""

    workers: int
    reason: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """Machine-readable grounds (e.g. ``{"efficiency": 0.62, "threshold": 0.1}``), logged."""


@dataclass(frozen=True, slots=True)
class Replace:
    """Replace worker ``worker`` by a fresh one: the replacement joins first, then ``worker``
    leaves (the worker count is unchanged once done)."""

    worker: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Give worker ``worker`` fewer virtual nodes (heterogeneous mapping re-solves the map with
    the measured speeds). Applied only when the job maps VNs by speed (``balance=True``)."""

    worker: int
    reason: str = ""


Decision = Union[Stay, Resize, Replace, Rebalance]


@runtime_checkable
class Policy(Protocol):
    """What the executor needs from a policy. ``decide`` must be a pure function of its
    arguments (see the module docstring); it is called after every step report."""

    name: str

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision: ...


# --------------------------------------------------------------------------------------------
# Measurements per size.


@dataclass(frozen=True, slots=True)
class SizeMeasurement:
    """A worker count's frozen measurement: medians of its first ``min_steps`` measured steps."""

    workers: int
    throughput: float
    """Median samples per second."""
    step_time_s: float
    """Median step time."""
    steps: int
    """Steps the medians are over."""
    at_step: int
    """The step whose observation completed the measurement."""
    elapsed_s: float
    steps_remaining: int
    cost_rate_per_h: float
    shares: Mapping[str, float] = field(default_factory=dict)
    """Median share of the step of each part of the breakdown over the measured steps (empty
    when the steps carried none): what :func:`bound` reads."""

    @property
    def bound(self) -> str | None:
        """What limits this size: ``compute``, ``communication``, ``waiting`` (for the slowest
        member), ``input`` or ``control`` (see :func:`bound`); None without a breakdown."""
        return bound(self.shares)[0] if self.shares else None

    @property
    def cost_per_sample(self) -> float:
        """Price of one sample at this size (cost rate per second / throughput)."""
        return self.cost_rate_per_h / 3600.0 / self.throughput

    @property
    def worker_seconds_per_sample(self) -> float:
        return self.workers / self.throughput


BOUND_PARTS = {"compute": ("forward_s", "backward_s"), "communication": ("reduction_s", "p2p_s"),
               "waiting": ("straggler_s", "bubble_s"), "input": ("input_s",),
               "control": ("optimizer_s", "overhead_s", "control_s")}
"""How the breakdown's parts group into what a step can be bound by."""


def shares_of(observations: Sequence[Observation]) -> dict[str, float]:
    """Median share of the step of each part over the observations that carry a breakdown."""
    rows = [o.parts for o in observations if o.parts and o.parts.get("step_s", 0) > 0]
    if not rows:
        return {}
    keys = [k for k in rows[0] if k != "step_s"]
    return {k: statistics.median(r.get(k, 0.0) / r["step_s"] for r in rows) for k in keys}


def bound(shares: Mapping[str, float]) -> tuple[str, float]:
    """(what the step is bound by, its share): the group of :data:`BOUND_PARTS` with the largest
    share. ``("compute", 0.7)`` means 70 % of the step is forward and backward; a size that is
    ``communication``-bound gains little from more workers, a ``waiting``-bound one has a slow
    member. ``("unknown", 0.0)`` without shares."""
    if not shares:
        return "unknown", 0.0
    totals = {name: sum(shares.get(p, 0.0) for p in parts) for name, parts in BOUND_PARTS.items()}
    name = max(totals, key=lambda n: totals[n])
    return name, totals[name]


def segments(history: Sequence[Observation]) -> list[list[Observation]]:
    """Split the history into runs of one generation and one worker count."""
    out: list[list[Observation]] = []
    for obs in history:
        if out and out[-1][-1].generation == obs.generation and out[-1][-1].workers == obs.workers:
            out[-1].append(obs)
        else:
            out.append([obs])
    return out


def measure_sizes(history: Sequence[Observation], *, min_steps: int, warmup_steps: int
                  ) -> tuple[dict[int, SizeMeasurement], dict[int, int]]:
    """Frozen measurements of every size whose first ``min_steps`` measured steps are in the
    history (in the order they completed), and how many measured steps each size has so far.

    A step is measured when it is not among the first ``warmup_steps`` of its generation.
    Samples of a size are pooled across its segments until ``min_steps`` are collected; the
    median of those is the measurement and is never revised.
    """
    pools: dict[int, list[Observation]] = {}
    done: dict[int, SizeMeasurement] = {}
    for seg in segments(history):
        k = seg[0].workers
        if k in done:
            continue
        pool = pools.setdefault(k, [])
        for i in range(warmup_steps, len(seg)):
            obs = seg[i]
            pool.append(obs)
            if len(pool) == min_steps:
                last = pool[-1]
                done[k] = SizeMeasurement(
                    workers=k,
                    throughput=statistics.median(o.throughput for o in pool),
                    step_time_s=statistics.median(o.step_time_s for o in pool),
                    steps=min_steps,
                    at_step=last.step,
                    elapsed_s=last.elapsed_s,
                    steps_remaining=last.steps_remaining,
                    cost_rate_per_h=last.cost_rate_per_h,
                    shares=shares_of(pool),
                )
                break
    counts = {k: (min_steps if k in done else len(p)) for k, p in pools.items()}
    return done, counts


@dataclass(frozen=True, slots=True)
class Replan:
    """Measured conditions changed after a size was measured: a new search starts after ``step``."""

    step: int
    """The step that confirmed the change (the new search uses only later steps)."""
    workers: int
    measured: float
    """The size's frozen throughput."""
    now: float
    """The median throughput of the last ``window`` steps at that size."""

    @property
    def text(self) -> str:
        return (f"conditions changed: {self.workers} workers now run {self.now:.4g} samples/s, "
                f"{self.now / self.measured:.2f} x their measured {self.measured:.4g}")


Settled = Callable[[Sequence[Observation], Mapping[int, SizeMeasurement]], "int | None"]
"""A policy's search on an epoch's history and measurements: the size it settles at, or None
while it is still searching."""


def _settle_point(sub: Sequence[Observation], measured: Mapping[int, SizeMeasurement],
                  settled: Settled | None) -> tuple[int, int] | None:
    """(step after which the search had settled, the size) in an epoch; with no ``settled``
    function, every measured size is watched from its measurement on (returns None)."""
    if settled is None:
        return None
    for m in sorted(measured.values(), key=lambda m: m.at_step):
        known = {k: v for k, v in measured.items() if v.at_step <= m.at_step}
        size = settled([o for o in sub if o.step <= m.at_step], known)
        if size is not None:
            return m.at_step, size
    return -1, -1  # never settled: nothing is watched


def replans(history: Sequence[Observation], *, min_steps: int, warmup_steps: int, change: float, window: int,
            limit: int, settled: Settled | None = None) -> list[Replan]:
    """Every point where the measured conditions changed (at most ``limit``), in order.

    Within one *epoch* (the history after the last re-plan) sizes are measured as
    :func:`measure_sizes` does. Once the policy's search has settled (``settled``: called at each
    point where a measurement completed; without it, each size from its own measurement on), the
    settled size's later measured steps (skipping every generation's warm-up) are watched in
    windows of ``window`` consecutive steps: when the median throughput of a window differs from
    the frozen measurement by more than ``change`` (relative), a new epoch starts after that
    window's last step, and nothing measured before counts any more. Steps taken while the
    search still runs are never watched (a search's own resizes and warm-ups cannot trigger one).
    ``change <= 0`` or ``limit == 0``: never.
    """
    out: list[Replan] = []
    if change <= 0 or limit <= 0 or window < 1:
        return out
    start = 0
    while len(out) < limit:
        sub = history[start:]
        measured, _ = measure_sizes(sub, min_steps=min_steps, warmup_steps=warmup_steps)
        point = _settle_point(sub, measured, settled)
        found: tuple[int, Replan] | None = None
        offset = start
        for seg in segments(sub):
            m = measured.get(seg[0].workers)
            if point is not None and seg[0].workers != point[1]:
                m = None
            if m is None:
                offset += len(seg)
                continue
            after = m.at_step if point is None else max(m.at_step, point[0])
            recent: list[Observation] = []
            for i, obs in enumerate(seg):
                if i < warmup_steps or obs.step <= after:
                    continue
                recent.append(obs)
                if len(recent) > window:
                    recent.pop(0)
                if len(recent) == window:
                    now = statistics.median(o.throughput for o in recent)
                    if abs(now / m.throughput - 1.0) > change:
                        found = (offset + i + 1, Replan(obs.step, m.workers, m.throughput, now))
                        break
            if found is not None:
                break
            offset += len(seg)
        if found is None:
            break
        start = found[0]
        out.append(found[1])
    return out


def epoch(history: Sequence[Observation], *, min_steps: int, warmup_steps: int, change: float, window: int,
          limit: int, settled: Settled | None = None) -> tuple[Sequence[Observation], Replan | None]:
    """The history since the last re-plan (all of it when there was none) and that re-plan."""
    points = replans(history, min_steps=min_steps, warmup_steps=warmup_steps, change=change, window=window,
                     limit=limit, settled=settled)
    if not points:
        return history, None
    last = points[-1]
    return [o for o in history if o.step > last.step], last


def outside_search(history: Sequence[Observation], limits: Limits) -> Decision | None:
    """What every searching policy decides before it searches: nothing to judge yet, or a
    worker count outside the bounds (brought back inside)."""
    if not history:
        return Stay("no observation yet")
    current = history[-1].workers
    if current != limits.clamp(current):
        n = limits.clamp(current)
        whole = f" in whole replicas of {limits.unit} workers" if limits.unit > 1 else ""
        return Resize(n, f"{current} -> {n}: outside [{limits.min_workers}, {limits.max_workers}]{whole}")
    return None


def predicted_efficiency(limits: Limits, k: int, n: int) -> float | None:
    """The scaling efficiency of ``k -> n`` workers that ``limits.step_model`` predicts (throughput
    is B / step time, so only the ratio of the two predicted steps counts), or None without a
    model. The model leaves out the reduction between replicas, which grows with them: the
    measured efficiency is at most this."""
    if limits.step_model is None:
        return None
    t_k, t_n = limits.step_model(k), limits.step_model(n)
    if not math.isfinite(t_n):
        return -math.inf
    return (t_k / t_n - 1.0) * k / (n - k)


def scaling_efficiency(prev: SizeMeasurement, new: SizeMeasurement) -> float:
    """s = (ΔR / Δk) / (R_prev / k_prev): the marginal throughput of the workers added, relative
    to the average throughput per worker before. 1 = linear scaling, 0 = no gain, < 0 = loss."""
    dk = new.workers - prev.workers
    if dk == 0:
        raise ValueError("scaling efficiency needs two different worker counts")
    return ((new.throughput - prev.throughput) / dk) / (prev.throughput / prev.workers)


# --------------------------------------------------------------------------------------------
# The trial-and-error search shared by `efficiency` and `utility`.


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether going from ``small`` to ``large`` workers paid, and why."""

    small: int
    large: int
    passed: bool
    value: float
    text: str


Prejudge = Callable[[int, int], "Verdict | None"]
"""A policy's prediction of an addition from ``k`` to ``n`` workers before ``n`` is measured (the
pipeline time model's), or None when it has none: a failing one counts as a failed addition."""


def _top(k: int, limits: Limits) -> str:
    if k == limits.highest:
        return f"{k} is max_workers"
    return f"{k} is the largest size the time model says can be faster (max_workers={limits.max_workers})"


def search(current: int, start: int, measured: Mapping[int, SizeMeasurement], limits: Limits, step_size: int,
           judge: Callable[[SizeMeasurement, SizeMeasurement], Verdict],
           prejudge: Prejudge | None = None) -> tuple[str, int, str, Verdict | None]:
    """Walk from ``start``: add ``step_size`` sizes of :meth:`Limits.sizes` (workers; whole
    replicas for a pipelined job) while the last addition passed ``judge``; settle at the last
    size that passed. If the very first addition fails (or none is possible), explore downward:
    remove ``step_size`` sizes at a time while the size above did not pay for itself. A size not
    measured yet is tried only when ``prejudge`` (the time model's prediction) does not already
    fail it.

    Returns ``("try", n, why, verdict)`` (n still needs measuring) or ``("settle", n, why,
    verdict)``. Every size is judged on its frozen measurement, so the walk for a given set of
    measurements is always the same (invariant 2).
    """
    k0 = limits.clamp(start)
    if k0 not in measured:
        return "try", k0, f"measuring {k0} workers", None

    def down(k: int, why_first: Verdict | None) -> tuple[str, int, str, Verdict | None]:
        last = why_first
        while True:
            lower = limits.below(k, step_size)
            if lower == k:
                floor = f"{k} is min_workers" + (f"={limits.min_workers} in whole replicas" if k != limits.min_workers
                                                  else "")
                return "settle", k, floor + (f" ({last.text})" if last else ""), last
            if lower not in measured:
                if last is None:
                    why = f"{_top(k, limits)}: exploring downward"
                elif last is why_first:
                    why = f"the first addition failed ({last.text}): exploring downward"
                else:
                    why = f"{last.text}: exploring downward"
                return "try", lower, why, last
            v = judge(measured[lower], measured[k])
            if v.passed:
                return "settle", k, f"{v.text}: settling at {k}", v
            last = v
            k = lower

    room_below = limits.below(k0, step_size) != k0
    k, last = k0, None
    while True:
        nxt = limits.above(k, step_size)
        if nxt == k:
            if last is None and room_below:  # started at the top: nothing to add
                return down(k0, None)
            return "settle", k, _top(k, limits) + (f" ({last.text})" if last else ""), last
        if nxt in measured:
            v = judge(measured[k], measured[nxt])
        else:
            v = prejudge(k, nxt) if prejudge is not None else None
            if v is None or v.passed:
                return "try", nxt, last.text if last else "exploring upward", last
        if v.passed:
            k, last = nxt, v
            continue
        if last is None and room_below:
            return down(k0, v)
        return "settle", k, f"{v.text}: settling at {k}, the last size that passed", v


def decision_from_search(name: str, current: int, counts: Mapping[int, int], min_steps: int,
                          result: tuple[str, int, str, Verdict | None],
                          measured: Mapping[int, SizeMeasurement], replan: Replan | None = None) -> Decision:
    kind, n, why, verdict = result
    table = {str(k): round(m.throughput, 3) for k, m in measured.items()}
    detail: dict[str, Any] = {"policy": name, "phase": "explore" if kind == "try" else "settled",
                              "throughput": table}
    bounds = {str(k): m.bound for k, m in measured.items() if m.bound is not None}
    if bounds:
        detail["bound"] = bounds
    if verdict is not None:
        detail.update(judged=[verdict.small, verdict.large], value=verdict.value, passed=verdict.passed)
        large = measured.get(verdict.large)
        if not verdict.passed and large is not None and large.shares:
            what, share = bound(large.shares)
            why += f"; {verdict.large} workers are {what}-bound ({100 * share:.0f} % of the step)"
    lead = ""
    if replan is not None:
        detail["replan"] = {"step": replan.step, "workers": replan.workers, "measured": replan.measured,
                            "now": replan.now}
        if len(measured) <= 1:  # the new search's first size: say why it searches again
            lead = f"{replan.text}: searching again; "
            why = lead + why
    if n == current:
        if kind == "try":
            return Stay(f"{lead}measuring {current} workers ({counts.get(current, 0)}/{min_steps} steps)")
        return Stay(f"settled at {current} workers ({why})", settled=True)
    return Resize(n, f"{current} -> {n}: {why}", detail)
