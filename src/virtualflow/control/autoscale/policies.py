"""The built-in autoscaling policies (``efficiency``, ``utility``, ``straggler``, ``fixed``) and
the registry that builds one from ``"NAME:PARAM=VALUE,..."``."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from virtualflow.control.autoscale.base import (
    Decision, Limits, Observation, Policy, Prejudge, Rebalance, Replace, SizeMeasurement, Stay, Verdict,
    decision_from_search, epoch, measure_sizes, outside_search, predicted_efficiency, scaling_efficiency, search,
    segments,
)


def _check_replan(policy: Any) -> None:
    c = policy.replan_change
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0 <= c < 10):
        raise ValueError(f"{policy.name} replan_change={c!r} must be a number in [0, 10) (e.g. 0.3: search again "
                         f"when a size runs 30 % faster or slower than measured; 0: search once)")
    _check_int("replan_window", policy.replan_window, 1, policy.name)
    _check_int("max_replans", policy.max_replans, 0, policy.name)


def _epoch(policy: Any, history: Sequence[Observation], limits: Limits):
    """The history since the last re-plan (conditions changed after the search settled)."""
    def settled(sub: Sequence[Observation], measured: Any) -> int | None:
        kind, n, _, _ = search(sub[-1].workers, sub[0].workers, measured, limits, policy.step_size, policy.judge,
                               _prejudge(policy, limits))
        return n if kind == "settle" else None

    return epoch(history, min_steps=policy.min_steps, warmup_steps=policy.warmup_steps,
                 change=policy.replan_change, window=policy.replan_window, limit=policy.max_replans,
                 settled=settled)


def _prejudge(policy: Any, limits: Limits) -> Prejudge | None:
    """The policy's prediction of an untried addition under ``limits``' time model (None without one)."""
    make = getattr(policy, "prejudge", None)
    return None if make is None or limits.step_model is None else make(limits)


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

    A pipelined job (``Limits.unit`` = stages x tensor workers per replica) is searched in whole
    replicas, over the sizes its time model says can be faster (:meth:`Limits.sizes`); an
    addition whose *predicted* efficiency (the replica time model, which leaves out the reduction
    and so over-estimates) already fails the threshold is not tried: it counts as failed.
    """

    threshold: float = 0.1
    """Smallest scaling efficiency an addition must show, in (0, 1]."""
    step_size: int = 1
    """Sizes added or removed per trial: workers, or whole replicas for a pipelined job."""
    min_steps: int = 10
    """Measured steps per size before judging it (>= 1; >= 3 to outvote one noisy step). 10: on a
    shared machine a 5-step median was seen to misjudge a size by 20 % (a burst of other load)."""
    warmup_steps: int = 3
    """Steps skipped at the start of every generation (the regroup, a newcomer's first steps,
    which run slower for a few steps)."""
    replan_change: float = 0.3
    """Search again when a measured size later runs this much faster or slower (relative median
    throughput over ``replan_window`` steps): a node slowed down, load appeared. 0: search once."""
    replan_window: int = 10
    """Steps whose median is compared with the size's measurement."""
    max_replans: int = 4
    """At most this many new searches in a job (each costs at most one resize per size)."""
    name: str = "efficiency"

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (0 < self.threshold <= 1):
            raise ValueError(f"efficiency threshold={self.threshold!r} must be in (0, 1] (e.g. 0.1: an added worker "
                             f"must bring at least 10 % of the average worker's throughput)")
        _check_int("step_size", self.step_size, 1, "efficiency")
        _check_int("min_steps", self.min_steps, 1, "efficiency")
        _check_int("warmup_steps", self.warmup_steps, 0, "efficiency")
        _check_replan(self)

    def judge(self, prev: SizeMeasurement, new: SizeMeasurement) -> Verdict:
        s = scaling_efficiency(prev, new)
        op = ">" if s > self.threshold else "<="
        return Verdict(prev.workers, new.workers, s > self.threshold, s,
                        f"scaling efficiency {s:.2f} {op} {self.threshold:.2f} ({prev.workers} -> {new.workers})")

    def prejudge(self, limits: Limits) -> Prejudge:
        """The time model's verdict on an addition not measured yet (see the class docstring)."""
        def verdict(k: int, n: int) -> Verdict | None:
            s = predicted_efficiency(limits, k, n)
            if s is None or s > self.threshold:
                return None
            return Verdict(k, n, False, s, f"the pipeline time model predicts scaling efficiency {s:.2f} <= "
                                           f"{self.threshold:.2f} ({k} -> {n} workers)")
        return verdict

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        early = outside_search(history, limits)
        if early is not None:
            return early
        current = history[-1].workers
        recent, replan = _epoch(self, history, limits)
        if not recent:
            return decision_from_search(self.name, current, {}, self.min_steps,
                                        ("try", current, "", None), {}, replan)
        measured, counts = measure_sizes(recent, min_steps=self.min_steps, warmup_steps=self.warmup_steps)
        result = search(current, recent[0].workers, measured, limits, self.step_size, self.judge,
                        _prejudge(self, limits))
        return decision_from_search(self.name, current, counts, self.min_steps, result, measured, replan)


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
    replan_change: float = 0.3
    """As :class:`EfficiencyPolicy`'s: search again when conditions change (0: search once)."""
    replan_window: int = 10
    max_replans: int = 4
    name: str = "utility"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", parse_utility(self.value))
        _check_int("step_size", self.step_size, 1, "utility")
        _check_int("min_steps", self.min_steps, 1, "utility")
        _check_int("warmup_steps", self.warmup_steps, 0, "utility")
        _check_replan(self)

    def objective(self, m: SizeMeasurement, elapsed_s: float, steps_remaining: int) -> float:
        price = m.cost_rate_per_h / m.workers
        remaining_s = steps_remaining * m.step_time_s
        return self.value(elapsed_s + remaining_s) - price * m.workers * remaining_s / 3600.0

    def judge(self, prev: SizeMeasurement, new: SizeMeasurement) -> Verdict:
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
        return Verdict(small.workers, large.workers, passed, net, text + (" > 0" if net > 0 else ""))

    def decide(self, history: Sequence[Observation], limits: Limits) -> Decision:
        early = outside_search(history, limits)
        if early is not None:
            return early
        current = history[-1].workers
        history, replan = _epoch(self, history, limits)
        if not history:
            return decision_from_search(self.name, current, {}, self.min_steps,
                                        ("try", current, "", None), {}, replan)
        measured, counts = measure_sizes(history, min_steps=self.min_steps, warmup_steps=self.warmup_steps)
        kind, n, why, verdict = search(current, history[0].workers, measured, limits, self.step_size, self.judge)
        if kind == "settle":
            # The best measured size by J, in the context of the last measurement (frozen once
            # the search has ended: no new size is measured after it).
            in_range = [m for m in measured.values() if m.workers in limits.sizes()]
            ctx = max(in_range, key=lambda m: m.at_step)
            best = max(in_range, key=lambda m: (self.objective(m, ctx.elapsed_s, ctx.steps_remaining), -m.workers))
            if best.workers != n:
                why = f"{why}; best utility at {best.workers} workers"
                n = best.workers
        return decision_from_search(self.name, current, counts, self.min_steps, (kind, n, why, verdict), measured,
                                    replan)


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
    worker count never changes; replacements are bounded by ``max_replacements``. In a pipelined
    job (``Limits.unit`` > 1) a worker is compared with the workers of its own stage in the other
    replicas, and the replacement is a whole replica.
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
        # A pipelined job's workers run different stages: each is compared with the workers of
        # its own stage (the same place in every replica), whose work is the same.
        unit = limits.unit
        peers = {w: [p for p in ids[ids.index(w) % unit::unit] if p in smoothed] for w in smoothed}
        medians = {w: statistics.median(smoothed[p] for p in peers[w]) for w in smoothed}
        slow = min(smoothed, key=lambda w: smoothed[w] / medians[w])
        med = medians[slow]
        if smoothed[slow] >= self.fraction * med:
            return Stay(f"no straggler (slowest worker {slow} at {smoothed[slow] / med:.2f} x the median"
                        + (" of its stage's workers)" if unit > 1 else ")"))
        why = (f"worker {slow} at {smoothed[slow]:.4g} samples/s is below {self.fraction:.2f} x the median "
               f"{med:.4g} samples/s" + (" of its stage's workers" if unit > 1 else ""))
        seen = {w for o in history for w in (o.worker_ids or tuple(o.per_worker_throughput))}
        replaced = -(-len(seen - set(ids)) // limits.unit)  # a pipelined job replaces whole replicas
        if replaced < self.max_replacements and last.workers + limits.unit <= limits.highest:
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
