"""Spot-availability traces: Bamboo's measured ones (shipped with the package), parsing, generated
ones, which instances a drop takes, and Young's checkpoint interval. Pure (no processes); the
replay that uses them is :mod:`virtualflow.cluster.spot`.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from virtualflow.cluster import bounds

_EPS = 1e-9


# ------------------------------------------------------------------------------------------ traces


@dataclass(frozen=True, slots=True)
class SpotTrace:
    """Instances up over time: ``counts[i]`` holds from ``times_s[i]`` to ``times_s[i + 1]`` (the last
    to ``end_s``). Times are non-decreasing; two changes at the same time (a zero-length step: an
    instance lost and replaced within the trace's resolution) are kept as two events."""

    times_s: tuple[float, ...]
    counts: tuple[int, ...]
    end_s: float
    name: str = "trace"

    def __post_init__(self) -> None:
        if not self.times_s or len(self.times_s) != len(self.counts):
            raise ValueError(f"trace {self.name!r}: times ({len(self.times_s)}) and counts ({len(self.counts)}) "
                             "must be non-empty and of the same length")
        for i, (t, c) in enumerate(zip(self.times_s, self.counts)):
            where = f"trace {self.name!r}: change {i}"
            bounds.number(t, where=where, field="time_s", lo=0, hi=bounds.MAX_SIM_S,
                          meaning="seconds into the trace, ten years at most")
            bounds.number(c, where=where, field="count", lo=0, hi=bounds.MAX_SPOT_INSTANCES, integral=True,
                          meaning="instances up")
            if i and t < self.times_s[i - 1]:
                raise ValueError(f"trace {self.name!r}: time {t} (change {i}) is before {self.times_s[i - 1]}; "
                                 "times must not decrease")
        bounds.number(self.end_s, where=f"trace {self.name!r}", field="end_s", lo=0, hi=bounds.MAX_SIM_S,
                      meaning="seconds into the trace, ten years at most")
        if not self.end_s > self.times_s[0]:
            raise ValueError(f"trace {self.name!r}: it spans {self.end_s - self.times_s[0]:g} s; it must span "
                             "more than 0 s")
        if self.end_s < self.times_s[-1]:
            raise ValueError(f"trace {self.name!r}: end {self.end_s} is before its last change {self.times_s[-1]}")

    @property
    def start_s(self) -> float:
        return self.times_s[0]

    @property
    def span_s(self) -> float:
        return self.end_s - self.times_s[0]

    @property
    def max_count(self) -> int:
        return max(self.counts)

    @property
    def instances_lost(self) -> int:
        """Instances preempted over the trace (sum of the drops)."""
        return sum(max(0, a - b) for a, b in zip(self.counts, self.counts[1:]))

    def count_at(self, t: float) -> int:
        """Instances up at time t (after every change at t)."""
        i = int(np.searchsorted(np.asarray(self.times_s), t, side="right")) - 1
        return self.counts[max(i, 0)]

    def instance_hours(self) -> float:
        bounds = list(self.times_s[1:]) + [self.end_s]
        return sum(c * (b - a) for a, b, c in zip(self.times_s, bounds, self.counts)) / 3600.0

    def compressed(self, speedup: float) -> "SpotTrace":
        """The same trace replayed ``speedup`` times faster: every time divided by ``speedup``."""
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"--speedup {speedup} must be a finite number > 0 (1 replays the trace in real time)")
        return SpotTrace(times_s=tuple(t / speedup for t in self.times_s), counts=self.counts,
                         end_s=self.end_s / speedup, name=f"{self.name} x{speedup:g}" if speedup != 1 else self.name)


def bamboo_data_dir() -> Path:
    """The folder of Bamboo's traces shipped with the package (``data/bamboo``)."""
    root = resources.files("virtualflow.cluster") / "data" / "bamboo"
    if not isinstance(root, Path) or not root.is_dir():
        raise FileNotFoundError(f"Bamboo traces missing from the installed package ({root}); reinstall virtualflow "
                                "unpacked (its package data ships them)")
    return root


def bamboo_trace_names() -> tuple[str, ...]:
    """Names of the bundled traces (file names without ``.csv``), sorted."""
    return tuple(sorted(p.stem for p in bamboo_data_dir().glob("*.csv")))


def parse_trace(text: str, *, time_unit: str = "s", name: str = "trace", source: str | None = None) -> SpotTrace:
    """A trace from CSV text: rows ``time,count`` (no header; blank lines skipped), time in
    ``time_unit`` ("s" or "h"). Rows that repeat the previous count are dropped; the last row's
    time is the trace's end. Errors name ``source`` (default: the name) and the line."""
    scale = _time_scale(time_unit)
    times: list[float] = []
    counts: list[int] = []
    last_t = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source or name}:{lineno}"
        cols = line.split(",")
        if len(cols) != 2:
            raise ValueError(f"{where}: expected 2 comma-separated columns (time,count), got {len(cols)}: {line!r}")
        try:
            t = float(cols[0])
            c_f = float(cols[1])
        except ValueError:
            raise ValueError(f"{where}: {line!r} is not two numbers time,count") from None
        bounds.number(t * scale, where=where, field=f"time ({time_unit})", lo=0, hi=bounds.MAX_SIM_S,
                      meaning=f"ten years at most: {bounds.MAX_SIM_S / scale:g} {time_unit}")
        bounds.number(c_f, where=where, field="count", lo=0, hi=bounds.MAX_SPOT_INSTANCES, integral=True,
                      meaning="instances up")
        if last_t is not None and t < last_t:
            raise ValueError(f"{where}: time {t:g} is before the previous row's {last_t:g}; times must not decrease")
        last_t = t
        c = int(c_f)
        if counts and c == counts[-1]:
            continue  # the "old count" row of a change, or a repeat
        times.append(t * scale)
        counts.append(c)
    if last_t is None:
        raise ValueError(f"{source or name}: no rows (expected CSV rows time,count)")
    return SpotTrace(times_s=tuple(times), counts=tuple(counts), end_s=last_t * scale, name=name)


def _time_scale(time_unit: str) -> float:
    units = {"s": 1.0, "h": 3600.0}
    if time_unit not in units:
        raise ValueError(f"--time-unit {time_unit!r} must be 's' (seconds) or 'h' (hours)")
    return units[time_unit]


def load_trace(spec: str | os.PathLike, *, time_unit: str | None = None) -> SpotTrace:
    """A trace from a CSV file, or the name of one bundled with virtualflow (``bamboo_trace_names()``,
    with or without ``.csv``). ``time_unit`` None: hours when the file name ends in ``-hours``,
    else seconds (the convention of Bamboo's files)."""
    spec_s = os.fspath(spec)
    path = Path(spec_s)
    if not path.is_file() and os.sep not in spec_s and "/" not in spec_s:
        stem = spec_s[:-4] if spec_s.endswith(".csv") else spec_s
        if stem in bamboo_trace_names():
            path = bamboo_data_dir() / f"{stem}.csv"
    if not path.is_file():
        raise ValueError(f"--trace {spec_s!r} does not exist; give a CSV file of time,count rows, the name of a "
                         f"bundled trace ({', '.join(bamboo_trace_names())}), or use --generate")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--trace {path}: not a CSV trace (byte {exc.start} is not UTF-8 text)") from None
    unit = time_unit if time_unit is not None else ("h" if path.stem.endswith("-hours") else "s")
    return parse_trace(text, time_unit=unit, name=path.stem, source=f"--trace {os.fspath(path)}")


MAX_GENERATED_PREEMPTIONS = 1e6


def generate_trace(*, rate_per_hour: float, nodes: int, hours: float, seed: int = 0,
                   mean_down_s: float = 300.0) -> SpotTrace:
    """A trace drawn from a Poisson process: ``nodes`` instances up at 0; preemptions arrive at
    ``rate_per_hour`` (for the whole fleet) and each takes one up instance (none if all are down);
    a preempted instance returns after an exponential time of mean ``mean_down_s``. Draws, in a
    fixed order from one ``numpy.random.Generator(seed)``: every gap, then every down time."""
    for key, v, ok in (("rate", rate_per_hour, rate_per_hour >= 0), ("hours", hours, hours > 0),
                       ("mean_down_s", mean_down_s, mean_down_s > 0)):
        if not (math.isfinite(v) and ok):
            raise ValueError(f"--generate {key}={v} must be a finite number {'>= 0' if key == 'rate' else '> 0'}")
    bounds.number(nodes, where="--generate", field="nodes", lo=1, hi=bounds.MAX_SPOT_INSTANCES, integral=True,
                  meaning="instances")
    bounds.number(hours, where="--generate", field="hours", lo=0, lo_open=True, hi=bounds.MAX_SIM_S / 3600,
                  meaning="ten years at most")
    bounds.number(mean_down_s, where="--generate", field="mean_down_s", lo=0, lo_open=True, hi=bounds.MAX_SIM_S,
                  meaning="seconds")
    if rate_per_hour * hours > MAX_GENERATED_PREEMPTIONS:
        raise ValueError(f"--generate rate={rate_per_hour:g} x hours={hours:g} expects {rate_per_hour * hours:.3g} "
                         f"preemptions; at most {MAX_GENERATED_PREEMPTIONS:g} (lower rate or hours)")
    rng = np.random.default_rng(seed)
    end = hours * 3600.0
    hits: list[float] = []
    if rate_per_hour > 0:
        mean_gap = 3600.0 / rate_per_hour
        t = 0.0
        while True:
            t += float(rng.exponential(mean_gap))
            if t >= end:
                break
            hits.append(t)
    downs = rng.exponential(mean_down_s, len(hits)) if hits else np.zeros(0)
    times, counts = [0.0], [int(nodes)]
    up = int(nodes)
    returns: list[float] = []  # heap of return times
    for t, d in zip(hits, downs):
        while returns and returns[0] <= t:
            r = heapq.heappop(returns)
            up += 1
            times.append(r)
            counts.append(up)
        if up == 0:
            continue
        up -= 1
        times.append(t)
        counts.append(up)
        heapq.heappush(returns, t + float(d))
    while returns and returns[0] < end:
        up += 1
        times.append(heapq.heappop(returns))
        counts.append(up)
    name = f"generated rate={rate_per_hour:g}/h nodes={nodes} hours={hours:g} seed={seed}"
    return SpotTrace(times_s=tuple(times), counts=tuple(counts), end_s=end, name=name)


_GEN_KEYS = {"rate": "rate_per_hour", "rate_per_hour": "rate_per_hour", "nodes": "nodes", "hours": "hours",
             "seed": "seed", "mean_down_s": "mean_down_s"}


def parse_generate_spec(spec: str) -> dict[str, Any]:
    """``"rate=2,nodes=16,hours=24,seed=0[,mean_down_s=300]"`` -> keyword arguments of ``generate_trace``."""
    kw: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in _GEN_KEYS:
            raise ValueError(f"--generate: {part!r} is not KEY=VALUE with KEY in {sorted(_GEN_KEYS)} "
                             "(e.g. rate=2,nodes=16,hours=24,seed=0)")
        name = _GEN_KEYS[key]
        try:
            kw[name] = int(val) if name in ("nodes", "seed") else float(val)
        except ValueError:
            raise ValueError(f"--generate: {key}={val.strip()!r} is not a valid "
                             f"{'integer' if name in ('nodes', 'seed') else 'number'}") from None
    for need in ("rate_per_hour", "nodes", "hours"):
        if need not in kw:
            raise ValueError(f"--generate {spec!r} lacks {need.split('_')[0]}=...; give "
                             "rate=PREEMPTIONS_PER_HOUR,nodes=N,hours=H[,seed=S][,mean_down_s=S]")
    return kw


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A change of the trace at ``t_s``, at the level of instances (ids in order of arrival)."""

    t_s: float
    joined: tuple[int, ...]
    lost: tuple[int, ...]
    count: int


def node_events(trace: SpotTrace, seed: int = 0) -> list[NodeEvent]:
    """The trace's changes as instance arrivals and losses; which instances a drop takes is drawn
    uniformly without replacement from those up (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    up: list[int] = []
    next_id = 0
    out: list[NodeEvent] = []
    for t, c in zip(trace.times_s, trace.counts):
        if c > len(up):
            joined = tuple(range(next_id, next_id + c - len(up)))
            next_id += len(joined)
            up.extend(joined)
            out.append(NodeEvent(t_s=t, joined=joined, lost=(), count=c))
        elif c < len(up):
            pick = rng.choice(len(up), size=len(up) - c, replace=False)
            lost = tuple(sorted(up[int(i)] for i in pick))
            gone = set(lost)
            up = [n for n in up if n not in gone]
            out.append(NodeEvent(t_s=t, joined=(), lost=lost, count=c))
    return out


def young_interval_s(trace: SpotTrace, checkpoint_s: float) -> float:
    """Young's checkpoint interval sqrt(2 x checkpoint_s x MTBF), MTBF = span / instances lost
    (the trace's span when it loses none)."""
    return young_s(trace.span_s, trace.instances_lost, checkpoint_s)


def young_s(span_s: float, failures: int, checkpoint_s: float) -> float:
    """Young's checkpoint interval sqrt(2 x checkpoint_s x MTBF), MTBF = span_s / failures (at least
    ``checkpoint_s``; the whole span when nothing fails or checkpoints are free)."""
    if failures == 0 or checkpoint_s <= 0:
        return span_s
    return max(math.sqrt(2.0 * checkpoint_s * span_s / failures), checkpoint_s)
