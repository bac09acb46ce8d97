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


def outside_search(history: Sequence[Observation], limits: Limits) -> Decision | None:
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
class Verdict:
    """Whether going from ``small`` to ``large`` workers paid, and why."""

    small: int
    large: int
    passed: bool
    value: float
    text: str


def search(current: int, start: int, measured: Mapping[int, SizeMeasurement], limits: Limits, step_size: int,
            judge: Callable[[SizeMeasurement, SizeMeasurement], Verdict]) -> tuple[str, int, str, Verdict | None]:
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

    def down(k: int, why_first: Verdict | None) -> tuple[str, int, str, Verdict | None]:
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


def decision_from_search(name: str, current: int, counts: Mapping[int, int], min_steps: int,
                          result: tuple[str, int, str, Verdict | None],
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
