"""Autoscaling policies: pure objects that turn a history of observations into a decision.

The autoscaling engine searches, by trial and error while the job trains, for the most
resource-efficient number of workers (Or, Zhang, Freedman, "Resource Elasticity in Distributed
Deep Learning", MLSys 2020). It is split in two, as every policy in virtualflow is:

* a **policy** (this module) sees the history of :class:`Observation` records (one per training
  step: worker count, throughput, step time, cost rate, elapsed time, steps remaining) and
  returns a decision: :class:`Resize`, :class:`Stay`, :class:`Replace` or :class:`Rebalance`.
  It starts nothing, holds no mutable state and reads no clock, so it is tested on synthetic
  sequences (``tests/test_autoscale.py``);
* an **executor** (:mod:`virtualflow.control.autoscale_executor`) makes the observations from
  the workers' step reports, asks the policy, and applies its decisions through in-place resize.

Invariants every built-in policy keeps:

1. **Decisions are a function of the history.** Calling ``decide`` twice on the same history
   gives the same decision; no state is kept between calls.
2. **A size is judged once.** Each worker count is measured on the first ``min_steps``
   post-warm-up steps run at it (the first ``warmup_steps`` of every generation are skipped: the
   regroup, cold caches) and that median is frozen; later steps at the same size never revise it.
   A judgement therefore cannot flip, so the search cannot oscillate: it visits every size at
   most once and makes at most (number of sizes in ``[min, max]``) + 1 resizes.
3. **Medians, not means.** One noisy step (a page fault storm, another process's burst) moves a
   median of ``min_steps >= 3`` samples by at most one rank: a single outlier cannot decide.
4. **Bounds.** A decision never leaves ``[Limits.min_workers, Limits.max_workers]``.

Policies never touch B, V or anything the model sees: they only choose how many workers run.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

__all__ = [
    "Observation", "Limits", "Resize", "Stay", "Replace", "Rebalance", "Decision", "Policy",
    "SizeMeasurement", "measure_sizes", "EfficiencyPolicy", "UtilityPolicy", "StragglerPolicy",
    "FixedPolicy", "LinearUtility", "DeadlineUtility", "parse_utility", "POLICIES", "make_policy",
    "scaling_efficiency",
]


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

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"Observation.workers={self.workers!r} must be a positive int")
        if not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"Observation.step_time_s={self.step_time_s!r} must be a positive number")

    @property
    def throughput_per_worker(self) -> float:
        """Total throughput divided by the worker count."""
        return self.throughput / self.workers


@dataclass(frozen=True, slots=True)
class Limits:
    """The range of worker counts a policy may choose from."""

    min_workers: int
    max_workers: int

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

    def clamp(self, n: int) -> int:
        return max(self.min_workers, min(self.max_workers, n))


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

    @property
    def cost_per_sample(self) -> float:
        """Price of one sample at this size (cost rate per second / throughput)."""
        return self.cost_rate_per_h / 3600.0 / self.throughput

    @property
    def worker_seconds_per_sample(self) -> float:
        return self.workers / self.throughput


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
                )
                break
    counts = {k: (min_steps if k in done else len(p)) for k, p in pools.items()}
    return done, counts


def _outside_search(history: Sequence[Observation], limits: Limits) -> Decision | None:
    """What every searching policy decides before it searches: nothing to judge yet, or a
    worker count outside the bounds (brought back inside)."""
    if not history:
        return Stay("no observation yet")
    current = history[-1].workers
    if current != limits.clamp(current):
        n = limits.clamp(current)
        return Resize(n, f"{current} -> {n}: outside [{limits.min_workers}, {limits.max_workers}]")
    return None


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
class _Verdict:
    """Whether going from ``small`` to ``large`` workers paid, and why."""

    small: int
    large: int
    passed: bool
    value: float
    text: str


def _search(current: int, start: int, measured: Mapping[int, SizeMeasurement], limits: Limits, step_size: int,
            judge: Callable[[SizeMeasurement, SizeMeasurement], _Verdict]) -> tuple[str, int, str, _Verdict | None]:
    """Walk from ``start``: add ``step_size`` workers while the last addition passed ``judge``;
    settle at the last size that passed. If the very first addition fails (or none is possible),
    explore downward: remove ``step_size`` at a time while the size above did not pay for itself.

    Returns ``("try", n, why, verdict)`` (n still needs measuring) or ``("settle", n, why,
    verdict)``. Every size is judged on its frozen measurement, so the walk for a given set of
    measurements is always the same (invariant 2).
    """
    lo, hi = limits.min_workers, limits.max_workers
    k0 = limits.clamp(start)
    if k0 not in measured:
        return "try", k0, f"measuring {k0} workers", None

    def down(k: int, why_first: _Verdict | None) -> tuple[str, int, str, _Verdict | None]:
        last = why_first
        while True:
            lower = max(k - step_size, lo)
            if lower == k:
                return "settle", k, f"{k} is min_workers" + (f" ({last.text})" if last else ""), last
            if lower not in measured:
                if last is None:
                    why = f"{k} is max_workers: exploring downward"
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

    k, last = k0, None
    while True:
        nxt = min(k + step_size, hi)
        if nxt == k:
            if last is None and k0 > lo:  # started at max_workers: nothing to add
                return down(k0, None)
            return "settle", k, f"{k} is max_workers" + (f" ({last.text})" if last else ""), last
        if nxt not in measured:
            return "try", nxt, last.text if last else "exploring upward", last
        v = judge(measured[k], measured[nxt])
        if v.passed:
            k, last = nxt, v
            continue
        if last is None and k0 > lo:
            return down(k0, v)
        return "settle", k, f"{v.text}: settling at {k}, the last size that passed", v


def _decision_from_search(name: str, current: int, counts: Mapping[int, int], min_steps: int,
                          result: tuple[str, int, str, _Verdict | None],
                          measured: Mapping[int, SizeMeasurement]) -> Decision:
    kind, n, why, verdict = result
    table = {str(k): round(m.throughput, 3) for k, m in measured.items()}
    detail: dict[str, Any] = {"policy": name, "phase": "explore" if kind == "try" else "settled",
                              "throughput": table}
    if verdict is not None:
        detail.update(judged=[verdict.small, verdict.large], value=verdict.value, passed=verdict.passed)
    if n == current:
        if kind == "try":
            return Stay(f"measuring {current} workers ({counts.get(current, 0)}/{min_steps} steps)")
        return Stay(f"settled at {current} workers ({why})", settled=True)
    return Resize(n, f"{current} -> {n}: {why}", detail)


# --------------------------------------------------------------------------------------------
# Built-in policies.


def _check_int(name: str, value: Any, minimum: int, knob: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{knob} {name}={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EfficiencyPolicy:
    """``efficiency``: grow while the last addition's scaling efficiency exceeds a threshold.

    Rule: measure the starting size, then add ``step_size`` workers at a time; after each
    addition from k_prev to k, compute s = (ΔR/Δk) / (R_prev/k_prev) (R: median throughput of
    the first ``min_steps`` steps at a size after ``warmup_steps`` skipped). Continue while
    s > ``threshold``; when an addition fails, go back to and settle at the last size that
    passed. When the first addition already fails (or the job starts at ``max_workers``),
    explore downward: remove ``step_size`` workers at a time while the size above did not pay
    for itself (s of that addition <= threshold), and settle at the first size that did, or at
    ``min_workers``. Once settled it stays (at most one resize per size in range, plus one).
    """

    threshold: float = 0.1
    """Smallest scaling efficiency an addition must show, in (0, 1]."""
    step_size: int = 1
    """Workers added or removed per trial."""
    min_steps: int = 10
    """Measured steps per size before judging it (>= 1; >= 3 to outvote one noisy step). 10: on a
    shared machine a 5-step median was seen to misjudge a size by 20 % (a burst of other load)."""
    warmup_steps: int = 3
    """Steps skipped at the start of every generation (the regroup, a newcomer's first steps,
    which run slower for a few steps)."""
    name: str = "efficiency"

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (0 < self.threshold <= 1):
            raise ValueError(f"efficiency threshold={self.threshold!r} must be in (0, 1] (e.g. 0.1: an added worker "
                             f"must bring at least 10 % of the average worker's throughput)")
        _check_int("step_size", self.step_size, 1, "efficiency")
        _check_int("min_steps", self.min_steps, 1, "efficiency")
        _check_int("warmup_steps", self.warmup_steps, 0, "efficiency")

    def judge(self, prev: SizeMeasurement, new: SizeMeasurement) -> _Verdict:
        s = scaling_efficiency(prev, new)
        op = ">" if s > self.threshold else "<="
        return _Verdict(prev.workers, new.workers, s > self.threshold, s,
                        f"scaling efficiency {s:.2f} {op} {self.threshold:.2f} ({prev.workers} -> {new.workers})")

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        early = _outside_search(history, limits)
        if early is not None:
            return early
        current = history[-1].workers
        measured, counts = measure_sizes(history, min_steps=self.min_steps, warmup_steps=self.warmup_steps)
        result = _search(current, history[0].workers, measured, limits, self.step_size, self.judge)
        return _decision_from_search(self.name, current, counts, self.min_steps, result, measured)


# -- utility ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinearUtility:
    """U(T) = -per_hour x T_hours: every hour of completion time costs ``per_hour``."""

    per_hour: float

    def __post_init__(self) -> None:
        if not (isinstance(self.per_hour, (int, float)) and math.isfinite(self.per_hour) and self.per_hour >= 0):
            raise ValueError(f"linear utility per_hour={self.per_hour!r} must be a number >= 0")

    def __call__(self, completion_s: float) -> float:
        return -self.per_hour * completion_s / 3600.0

    @property
    def deadline_s(self) -> float | None:
        return None

    def describe(self) -> str:
        return f"linear:{self.per_hour:g}"


@dataclass(frozen=True, slots=True)
class DeadlineUtility:
    """A step function: U(T) = ``value`` if the job completes within ``deadline_s`` of its start,
    else ``late_value``."""

    deadline_s: float
    value: float
    late_value: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.deadline_s, (int, float)) and math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"deadline utility deadline={self.deadline_s!r} must be a positive duration")
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value)):
            raise ValueError(f"deadline utility value={self.value!r} must be a number")

    def __call__(self, completion_s: float) -> float:
        return self.value if completion_s <= self.deadline_s else self.late_value

    def describe(self) -> str:
        return f"deadline:{self.deadline_s:g}s:{self.value:g}:{self.late_value:g}"


UTILITY_FORMS = ("linear:VALUE_PER_HOUR (e.g. linear:20)",
                 "deadline:DURATION:VALUE[:LATE_VALUE] (e.g. deadline:30m:100; DURATION in s, m or h)")


def _duration_s(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]


def parse_utility(spec: str | LinearUtility | DeadlineUtility) -> LinearUtility | DeadlineUtility:
    """``"linear:20"`` or ``"deadline:30m:100[:0]"`` -> a utility of completion time."""
    if isinstance(spec, (LinearUtility, DeadlineUtility)):
        return spec
    accepted = "; ".join(UTILITY_FORMS)
    if not isinstance(spec, str):
        raise ValueError(f"utility {spec!r} must be a string; accepted forms: {accepted}")
    parts = [p.strip() for p in spec.split(":")]
    try:
        if parts[0] == "linear" and len(parts) == 2:
            return LinearUtility(float(parts[1]))
        if parts[0] == "deadline" and len(parts) in (3, 4):
            late = float(parts[3]) if len(parts) == 4 else 0.0
            return DeadlineUtility(_duration_s(parts[1]), float(parts[2]), late)
    except ValueError as exc:
        raise ValueError(f"utility {spec!r} does not parse ({exc}); accepted forms: {accepted}") from None
    raise ValueError(f"utility {spec!r} does not parse; accepted forms: {accepted}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilityPolicy:
    """``utility``: grow while the gain in utility exceeds the added cost.

    The user gives a utility of the job's completion time T (``value``: ``linear:V`` = -V per
    hour of T, or ``deadline:D:V[:L]`` = V when done within D of the start, else L) and the
    price of a worker-hour comes from the observations (``cost_rate_per_h / workers``, i.e.
    ``price_per_worker_hour`` of the job). For a measured size k with step time T_k, judged when
    the later of two measurements completed (elapsed e, S steps remaining):

        J(k) = U(e + S T_k) - price x k x S T_k / 3600        (utility minus remaining cost)

    The search is that of ``efficiency`` (start, add ``step_size`` at a time, explore downward
    when the first addition fails) with "the addition paid" meaning J(k) > J(k_prev); with a
    deadline not yet met at k_prev, an addition that still raises throughput passes too (a
    larger size may meet it). It settles at the measured size with the largest J.
    """

    value: LinearUtility | DeadlineUtility | str = "linear:10"
    """The utility of completion time (see :func:`parse_utility`)."""
    step_size: int = 1
    min_steps: int = 10
    warmup_steps: int = 3
    name: str = "utility"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", parse_utility(self.value))
        _check_int("step_size", self.step_size, 1, "utility")
        _check_int("min_steps", self.min_steps, 1, "utility")
        _check_int("warmup_steps", self.warmup_steps, 0, "utility")

    def objective(self, m: SizeMeasurement, elapsed_s: float, steps_remaining: int) -> float:
        price = m.cost_rate_per_h / m.workers
        remaining_s = steps_remaining * m.step_time_s
        return self.value(elapsed_s + remaining_s) - price * m.workers * remaining_s / 3600.0

    def judge(self, prev: SizeMeasurement, new: SizeMeasurement) -> _Verdict:
        ctx = max(prev, new, key=lambda m: m.at_step)
        j_prev = self.objective(prev, ctx.elapsed_s, ctx.steps_remaining)
        j_new = self.objective(new, ctx.elapsed_s, ctx.steps_remaining)
        small, large = sorted((prev, new), key=lambda m: m.workers)
        j_small, j_large = (j_prev, j_new) if small is prev else (j_new, j_prev)
        net = j_large - j_small
        passed = net > 0
        text = f"utility net gain {net:+.4g} of {small.workers} -> {large.workers}"
        deadline = getattr(self.value, "deadline_s", None)
        if not passed and deadline is not None:
            small_end = ctx.elapsed_s + ctx.steps_remaining * small.step_time_s
            if small_end > deadline and large.throughput > small.throughput:
                passed = True
                text += f" (deadline {deadline:g} s not met at {small.workers}; throughput still rises)"
        return _Verdict(small.workers, large.workers, passed, net, text + (" > 0" if net > 0 else ""))

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        early = _outside_search(history, limits)
        if early is not None:
            return early
        current = history[-1].workers
        measured, counts = measure_sizes(history, min_steps=self.min_steps, warmup_steps=self.warmup_steps)
        kind, n, why, verdict = _search(current, history[0].workers, measured, limits, self.step_size, self.judge)
        if kind == "settle":
            # The best measured size by J, in the context of the last measurement (frozen once
            # the search has ended: no new size is measured after it).
            in_range = [m for m in measured.values() if limits.min_workers <= m.workers <= limits.max_workers]
            ctx = max(in_range, key=lambda m: m.at_step)
            best = max(in_range, key=lambda m: (self.objective(m, ctx.elapsed_s, ctx.steps_remaining), -m.workers))
            if best.workers != n:
                why = f"{why}; best utility at {best.workers} workers"
                n = best.workers
        return _decision_from_search(self.name, current, counts, self.min_steps, (kind, n, why, verdict), measured)


# -- straggler ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerPolicy:
    """``straggler``: replace a worker whose smoothed throughput falls below ``fraction`` of the
    median, or give it fewer VNs when it cannot be replaced.

    Rule: in the current generation (after ``warmup_steps``), once ``window`` steps carry
    per-worker throughputs (a worker's samples over its own compute time), smooth each worker's
    by the median of its last ``window`` values. The slowest worker below ``fraction`` x the
    median of the smoothed values is a straggler. While fewer than ``max_replacements`` workers
    have been replaced and one more worker fits under ``max_workers``, the decision is
    :class:`Replace` (a replacement joins first, then the straggler leaves; the worker count is
    unchanged). Otherwise it is :class:`Rebalance` (fewer VNs for it, with heterogeneous mapping
    on) when the straggler still has at least the median VN share, else :class:`Stay`. The
    worker count never changes; replacements are bounded by ``max_replacements``.
    """

    fraction: float = 0.8
    """A worker slower than this fraction of the median is a straggler, in (0, 1)."""
    window: int = 5
    warmup_steps: int = 2
    max_replacements: int = 2
    name: str = "straggler"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not (0 < self.fraction < 1):
            raise ValueError(f"straggler fraction={self.fraction!r} must be in (0, 1) (e.g. 0.8: slower than 80 % "
                             f"of the median worker)")
        _check_int("window", self.window, 1, "straggler")
        _check_int("warmup_steps", self.warmup_steps, 0, "straggler")
        _check_int("max_replacements", self.max_replacements, 0, "straggler")

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        if not history:
            return Stay("no observation yet")
        last = history[-1]
        seg = segments(history)[-1][self.warmup_steps:]
        usable = [o for o in seg if o.per_worker_throughput][-self.window:]
        if len(usable) < self.window or last.workers < 2:
            return Stay("measuring per-worker throughput")
        ids = list(last.worker_ids) or sorted(last.per_worker_throughput)
        smoothed: dict[int, float] = {}
        for w in ids:
            values = [o.per_worker_throughput[w] for o in usable if w in o.per_worker_throughput]
            if len(values) == self.window:
                smoothed[w] = statistics.median(values)
        if len(smoothed) < 2:
            return Stay("measuring per-worker throughput")
        med = statistics.median(smoothed.values())
        slow = min(smoothed, key=lambda w: smoothed[w])
        if smoothed[slow] >= self.fraction * med:
            return Stay(f"no straggler (slowest worker {slow} at {smoothed[slow] / med:.2f} x the median)")
        why = (f"worker {slow} at {smoothed[slow]:.4g} samples/s is below {self.fraction:.2f} x the median "
               f"{med:.4g} samples/s")
        seen = {w for o in history for w in (o.worker_ids or tuple(o.per_worker_throughput))}
        replaced = len(seen - set(ids))
        if replaced < self.max_replacements and last.workers + 1 <= limits.max_workers:
            return Replace(slow, f"{why}: replacing it ({replaced + 1}/{self.max_replacements})")
        counts = dict(last.vn_counts)
        if counts and counts.get(slow, 0) >= statistics.median(counts.values()):
            cause = ("replacement budget spent" if replaced >= self.max_replacements
                     else f"no room for a replacement under max_workers={limits.max_workers}")
            return Rebalance(slow, f"{why}; {cause}: fewer VNs for it")
        return Stay(f"{why}; it already has fewer VNs")


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedPolicy:
    """``fixed``: no autoscaling (the worker count stays what it is), for comparison."""

    name: str = "fixed"

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        return Stay("fixed: no autoscaling")


# --------------------------------------------------------------------------------------------
# Registry.

POLICIES: dict[str, type] = {
    "efficiency": EfficiencyPolicy,
    "utility": UtilityPolicy,
    "straggler": StragglerPolicy,
    "fixed": FixedPolicy,
}


def _params_of(cls: type) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}


def _convert(cls_name: str, f: dataclasses.Field, text: str) -> Any:
    default = f.default
    try:
        if isinstance(default, bool):
            return text.lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        raise ValueError(f"{cls_name} parameter {f.name}={text!r} is not a {type(default).__name__}") from None
    return text


def make_policy(spec: str | Policy, **params: Any) -> Policy:
    """A policy from ``"NAME"`` or ``"NAME:PARAM=VALUE,PARAM=VALUE"`` (e.g.
    ``"efficiency:threshold=0.2,step_size=2"``, ``"utility:value=deadline:30m:100"``), or a
    :class:`Policy` object (returned as is). ``params`` override the spec's."""
    if not isinstance(spec, str):
        if isinstance(spec, Policy):
            if params:
                raise ValueError("parameters are given inside a Policy object, not beside it")
            return spec
        raise ValueError(f"autoscale={spec!r} must be a policy name ({', '.join(POLICIES)}) or a Policy object "
                         f"with name and decide(history, limits)")
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in POLICIES:
        raise ValueError(f"unknown autoscaling policy {name!r}; accepted: {', '.join(POLICIES)} "
                         f"(or a Policy object: name + decide(history, limits))")
    cls = POLICIES[name]
    fields = _params_of(cls)
    given: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))) if rest else ():
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            accepted = ", ".join(fields) or "none"
            raise ValueError(f"autoscale {spec!r}: {item!r} is not a parameter of {name!r}; "
                             f"accepted: {accepted} (as {name}:PARAM=VALUE,PARAM=VALUE)")
        given[key] = _convert(name, fields[key], value.strip())
    for key in params:
        if key not in fields:
            raise ValueError(f"{key!r} is not a parameter of the {name!r} policy; accepted: {', '.join(fields) or 'none'}")
    given.update(params)
    return cls(**given)
