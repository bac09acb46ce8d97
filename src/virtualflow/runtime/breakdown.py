"""Where a step's time goes, per worker: measured on each worker, combined on rank 0, summarised.

A worker's *step period* is the wall time from the start of one step to the start of the next (on
one clock, ``time.perf_counter``). :class:`StepClock` cuts it into intervals as the engine runs:

* ``input_s``     dataset access and collation of the worker's VNs (with prefetching: only the
  time the compute *waited* for a batch, a stall; the loaders' own time is ``loaded_s``);
* ``forward_s``   the job's loss call (``Job.loss(model, batch)``: the model's forward and the loss);
* ``backward_s``  ``.backward()`` of the weighted loss (the gradient buckets launch during it);
* ``blocked_s``   from entering the step's reduction until its result is there;
* ``optimizer_s`` the update (``optimizer.step()``, LR scheduler, zeroing; with the sharded
  reduction also its all-gather);
* ``control_s``  the control plane: from the end of the update to the next step's start, the
  worker's step loop around the engine (the step report, control commands, checkpoint and
  evaluation decisions);
* ``p2p_s`` and ``bubble_s`` (pipelined jobs, per stage; 0 for the VN engine): see *Pipeline
  stages* below;
* the rest of the period is ``overhead_s``: the engine's own bookkeeping inside the step
  (zeroing gradients, the per-VN loop, packing and unpacking the statistics that ride in the
  reduction, BatchNorm bookkeeping, the probe of a worker with no VN).

(Until issue 26 the last two were one part, ``control_s``, and the engine's bookkeeping read as
control-plane cost: 6-7 % of a 9 ms step. Measured apart, the control plane is a fraction of a
percent of such a step; see docs/observability.md.)

Emulated slowness (``WorkerSpec.slowdown``) sleeps after a VN's compute; it is split between
forward and backward in proportion to their measured times.

``blocked_s`` is split on rank 0 (:func:`derive`) into **waiting for the slowest member**
(``straggler_s``) and the **exposed reduction** (``reduction_s``, the communication that did not
overlap the backward). Every worker leaves a reduction at nearly the same moment, so the time
from the end of the previous step's reduction to entering this one (``arrive_s``) is
comparable across workers: a worker that arrived ``d`` seconds before the last one waited
``min(d, blocked_s)`` for it, the rest of its blocked time is communication. (The first step of a
generation has no previous reduction: the time since the step's start is used.)

The intervals partition the period exactly, so ``sum(parts) == step_s`` per worker by
construction; what makes each part *right* is that each is timed where it happens (the tests
inject known latencies into each and find them there).

Transport. Worker ``r``'s raw numbers of step ``s`` are known once step ``s+1`` starts; they ride
in step ``s+1``'s reduction (a few floats per worker appended to the small statistics vector that
travels anyway), so rank 0 learns everybody's and reports them with step ``s+1`` as
``breakdown_step = s``. A generation's last step is therefore not broken down (it has no next step
in that group). Rank 0 hands the raw rows on (:class:`Raw`, the report's ``breakdown_raw``) and
the coordinator derives the parts when the report arrives (:func:`from_report`): every worker
waits for rank 0 at the next reduction, so its step does not pay for the derivation. Cost: two ``perf_counter`` reads per interval and, for file-backed datasets, two
reads of ``/proc/thread-self/io`` per batch loaded (the I/O profile), measured in
``bench/input_pipeline.py``.

Pipeline stages. A pipelined job's worker runs one stage of one pipeline replica, and its step
is the schedule's walk of that stage's actions (:mod:`virtualflow.runtime.pipeline.timing` times
it). Its parts mean, per stage:

* ``forward_s`` / ``backward_s``: the stage's own forwards (the first stage's include loading its
  micro-batches' data, so its ``input_s`` is 0; the last stage's include the loss) and backwards
  (B, or I and W for zero-bubble schedules);
* ``p2p_s``: sending activations and gradients to the neighbour stages and posting receives
  (packing and handing messages to the transport; sends never block);
* ``bubble_s``: idle, waiting for a neighbour's activation or gradient (the schedule's bubble,
  and any transfer time the schedule did not hide) and for the other stages at the step's
  statistics all-reduce (the pipeline's drain: a last stage waits there for the first stage's
  last backward);
* ``reduction_s`` / ``straggler_s``: the stage's reduction over its pipeline replicas (its stage
  group ``gen/<g>/stage<s>``), split as above, but against the last replica *of the same stage* to
  arrive (:func:`derive`'s ``groups``);
* ``optimizer_s``: the stage's update (with ``reduction="sharded"`` its chunk's, and the
  parameters' all-gather over the stage group).

They ride in the next step's statistics all-reduce, as the VN engine's do. No-flush schedules
(``2bw``, ``async``) stream a window of steps as one action list: no per-step breakdown.

Pure except :class:`StepClock` and :func:`thread_io` (clocks and the OS counters): no processes.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

RAW = ("input_s", "forward_s", "backward_s", "emulated_s", "blocked_s", "optimizer_s", "period_s", "arrive_s",
       "read_calls", "read_bytes", "loaded_s", "loop_s", "p2p_s", "bubble_s")
"""What each worker measures per step, in this order (the vector that rides in the reduction)."""
assert RAW == ("input_s", "forward_s", "backward_s", "emulated_s", "blocked_s", "optimizer_s", "period_s", "arrive_s",
               "read_calls", "read_bytes", "loaded_s", "loop_s", "p2p_s", "bubble_s"), "derive() unpacks RAW in order"
_PERIOD, _ARRIVE = RAW.index("period_s"), RAW.index("arrive_s")

PARTS = ("input_s", "forward_s", "backward_s", "p2p_s", "bubble_s", "reduction_s", "straggler_s", "optimizer_s",
         "overhead_s", "control_s")
"""The parts a step period is cut into (they add up to ``step_s``). ``p2p_s`` and ``bubble_s`` are
a pipeline stage's (0 for the VN engine)."""

PIPELINE_PARTS = ("p2p_s", "bubble_s")
"""The parts only a pipelined job's workers measure (records without them read them as 0)."""

IO_FIELDS = ("read_calls", "read_bytes", "loaded_s")
"""The I/O profile per worker and step: read system calls and bytes read while loading the
dataset (the loading threads' own counters), and the loaders' busy time."""

INPUT_ADVICE_SHARE = 0.25
"""Input loading above this share of the step time gets a sentence of advice."""


def thread_io() -> tuple[int, int, int] | None:
    """(read system calls, bytes read, bytes this reading itself took) of the calling thread so
    far (``/proc/thread-self/io``: ``syscr`` and ``rchar``, which counts page-cache hits too), or
    None where the OS has none. The file is read with one system call, which the next reading
    counts: :func:`measured_load` subtracts it."""
    try:
        fd = os.open("/proc/thread-self/io", os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    calls = nbytes = -1
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key == b"syscr":
            calls = int(value)
        elif key == b"rchar":
            nbytes = int(value)
    return (calls, nbytes, len(text)) if calls >= 0 and nbytes >= 0 else None


@dataclass(slots=True)
class LoadStats:
    """What loading some batches cost: seconds, read calls and bytes (the loading thread's)."""

    seconds: float = 0.0
    read_calls: int = 0
    read_bytes: int = 0

    def add(self, other: "LoadStats") -> None:
        self.seconds += other.seconds
        self.read_calls += other.read_calls
        self.read_bytes += other.read_bytes


def measured_load(fn, *args: Any, io: bool = True) -> tuple[Any, LoadStats]:
    """``fn(*args)`` and what it cost the calling thread (time; reads when ``io``)."""
    before = thread_io() if io else None
    t0 = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t0
    after = thread_io() if before is not None else None
    if before is None or after is None:
        return out, LoadStats(took)
    # The first reading's own system call and bytes are in the second one's counters.
    return out, LoadStats(took, max(0, after[0] - before[0] - 1), max(0, after[1] - before[1] - before[2]))


class StepClock:
    """One worker's intervals of the current step and the finished raw vector of the previous one.

    The engine calls :meth:`begin` at each step's start, :meth:`add` for each interval,
    :meth:`enter_reduction` / :meth:`leave_reduction` around the reduction; :meth:`previous` is the
    last finished step's :data:`RAW` vector (None on a generation's first step). ``enabled=False``
    turns every call into a no-op (the benchmark's baseline)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.now = time.perf_counter
        self._cur = dict.fromkeys(RAW, 0.0)
        self._prev: list[float] | None = None
        self._start: float | None = None
        self._left_reduction: float | None = None
        self._entered: float | None = None
        self._applied: float | None = None  # when the current step's update ended

    def reset(self) -> None:
        """A new generation (a new group): nothing carries over."""
        self._cur = dict.fromkeys(RAW, 0.0)
        self._prev = None
        self._start = None
        self._left_reduction = None
        self._applied = None

    def begin(self) -> None:
        if not self.enabled:
            return
        now = self.now()
        if self._start is not None:
            self._cur["period_s"] = now - self._start
            # From the end of the update to now: the worker's loop between steps (the control
            # plane). A step that applied no update (non-finite loss) leaves it 0.
            applied = self._applied
            self._cur["loop_s"] = now - applied if applied is not None and applied >= self._start else 0.0
            self._prev = [float(self._cur[k]) for k in RAW]
        else:
            self._prev = None
        self._cur = dict.fromkeys(RAW, 0.0)
        self._start = now
        self._entered = None

    def abandon(self) -> None:
        """The step was interrupted (a peer failed): its partial times are dropped."""
        self.reset()

    def add(self, part: str, seconds: float) -> None:
        if self.enabled:
            self._cur[part] += seconds
            if part == "optimizer_s":  # the update is the step's last timed interval
                self._applied = self.now()

    def add_load(self, stats: LoadStats) -> None:
        if self.enabled:
            self._cur["read_calls"] += stats.read_calls
            self._cur["read_bytes"] += stats.read_bytes
            self._cur["loaded_s"] += stats.seconds

    def enter_reduction(self) -> None:
        if not self.enabled or self._start is None:
            return
        self._entered = now = self.now()
        since = self._left_reduction if self._left_reduction is not None else self._start
        self._cur["arrive_s"] = now - since

    def leave_reduction(self) -> None:
        if not self.enabled or self._entered is None:
            return
        now = self.now()
        self._cur["blocked_s"] += now - self._entered
        self._left_reduction = now
        self._entered = None

    def previous(self) -> list[float] | None:
        return self._prev if self.enabled else None


# -- rank 0: combining the workers' vectors ------------------------------------------------------
def derive(raw: Sequence[Sequence[float]], groups: Sequence[int] | None = None) -> list[dict[str, float]] | None:
    """Per worker (rank order) the :data:`PARTS`, ``step_s`` and the :data:`IO_FIELDS` of one step
    from every worker's :data:`RAW` vector; None when a worker has no finished step (a
    generation's first step, or the breakdown off). ``groups[r]``: the reduction group of rank
    ``r`` (a pipeline's stage); a worker's straggler wait is against the last member of its own
    group to arrive (default: one group)."""
    if not raw or any(len(v) != len(RAW) for v in raw):
        return None
    rows = [[float(x) for x in v] for v in raw]
    # (a sum is finite only when every term is: one check per row; a sum that overflows is no period)
    if any(r[_PERIOD] <= 0 or not math.isfinite(sum(r)) for r in rows):
        return None
    groups = list(groups) if groups is not None else [0] * len(rows)
    if len(groups) != len(rows):
        return None
    last_of: dict[int, float] = {}
    for g, r in zip(groups, rows):
        last_of[g] = max(last_of.get(g, r[_ARRIVE]), r[_ARRIVE])
    out = []
    for g, r in zip(groups, rows):
        (input_s, forward_s, backward_s, emulated_s, blocked_s, optimizer_s, period_s, arrive_s, read_calls,
         read_bytes, loaded_s, loop_s, p2p_s, bubble_s) = r
        compute = forward_s + backward_s
        fwd_share = forward_s / compute if compute > 0 else 0.5
        forward = forward_s + emulated_s * fwd_share
        backward = backward_s + emulated_s * (1 - fwd_share)
        straggler = min(max(0.0, last_of[g] - arrive_s), blocked_s)
        measured = input_s + forward + backward + p2p_s + bubble_s + blocked_s + optimizer_s
        rest = max(0.0, period_s - measured)
        control = min(max(0.0, loop_s), rest)
        out.append({
            "input_s": input_s, "forward_s": forward, "backward_s": backward, "p2p_s": p2p_s, "bubble_s": bubble_s,
            "reduction_s": blocked_s - straggler, "straggler_s": straggler, "optimizer_s": optimizer_s,
            "overhead_s": rest - control, "control_s": control, "step_s": period_s,
            "read_calls": int(round(read_calls)), "read_bytes": int(round(read_bytes)), "loaded_s": loaded_s,
        })
    return out


@dataclass(frozen=True, slots=True)
class Raw:
    """Every worker's :data:`RAW` vector of one step, as rank 0 holds them after the reduction, not
    yet derived: the parts are derived where they are read (:meth:`derive`), on the coordinator
    for the step report (:func:`from_report`), so rank 0's step does not pay for them.

    ``rows[r]`` is rank ``r``'s vector, or None for a rank whose row is not reported (a
    tensor-parallel stage's members other than tensor rank 0); ``groups[r]`` is rank ``r``'s
    reduction group (a pipeline's stage, :func:`derive`'s ``groups``), None for one group."""

    rows: list[list[float] | None]
    groups: list[int] | None = None

    def derive(self) -> list[dict[str, float] | None] | None:
        """The parts of each rank (None where ``rows`` has none), or None when the step has no
        breakdown (a generation's first step, or a row that is not a measured step)."""
        present = [i for i, row in enumerate(self.rows) if row is not None]
        groups = None if self.groups is None else [self.groups[i] for i in present]
        got = derive([self.rows[i] for i in present], groups)  # type: ignore[misc]
        if got is None:
            return None
        out: list[dict[str, float] | None] = [None] * len(self.rows)
        for i, parts in zip(present, got):
            out[i] = parts
        return out

    def spread(self, every: int) -> Raw:
        """The rows placed at ranks ``0, every, 2 every, ...`` of a generation ``every`` times as
        large (a tensor-parallel grid's plane 0), None at the others."""
        if every == 1:
            return self
        rows: list[list[float] | None] = [None] * (len(self.rows) * every)
        groups = None if self.groups is None else [0] * len(rows)
        for i, row in enumerate(self.rows):
            rows[i * every] = row
            if groups is not None and self.groups is not None:
                groups[i * every] = self.groups[i]
        return Raw(rows, groups)

    def to_report(self) -> dict[str, Any]:
        """The step report's ``breakdown_raw`` field."""
        return {"rows": self.rows, "groups": self.groups}


def from_report(value: Any, members: Any, max_workers: int = 4096) -> list[dict[str, Any]] | None:
    """A step report's ``breakdown_raw`` (:meth:`Raw.to_report`) derived into the report's
    ``breakdown``: one record per reported rank, ``{"worker": id, **parts}`` with ``members[r]``
    the id of rank ``r``; None for anything malformed or a step with no breakdown."""
    if not isinstance(value, dict) or not isinstance(members, list) or not 0 < len(members) <= max_workers:
        return None
    rows, groups = value.get("rows"), value.get("groups")
    if not isinstance(rows, list) or len(rows) != len(members):
        return None
    for row in rows:
        if row is not None and (not isinstance(row, list) or len(row) != len(RAW) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)):
            return None
    if groups is not None and (not isinstance(groups, list) or len(groups) != len(rows) or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in groups)):
        return None
    derived = Raw(rows, groups).derive()
    if derived is None:
        return None
    return clean([{"worker": w, **parts} for w, parts in zip(members, derived) if parts is not None], max_workers)


def clean(value: Any, max_workers: int = 4096) -> list[dict[str, float]] | None:
    """A breakdown read from a report: a list of per-worker records (rank order), each with its
    ``worker`` id and a finite number >= 0 for each of :data:`PARTS`, ``step_s`` and
    :data:`IO_FIELDS`; anything else is None (dropped)."""
    if not isinstance(value, list) or not value or len(value) > max_workers:
        return None
    keys = PARTS + ("step_s",) + IO_FIELDS
    out = []
    for row in value:
        if not isinstance(row, dict):
            return None
        wid = row.get("worker")
        if isinstance(wid, bool) or not isinstance(wid, int):
            return None
        rec: dict[str, float] = {"worker": wid}
        for k in keys:
            # Records written before overhead_s was measured apart counted it in control_s; records
            # written before pipeline stages were broken down have no p2p_s / bubble_s (0 then).
            x = row.get(k, 0.0 if k == "overhead_s" or k in PIPELINE_PARTS else None)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                return None
            rec[k] = x
        out.append(rec)
    return out


# -- summaries -------------------------------------------------------------------------------
@dataclass(slots=True)
class Summary:
    """Mean seconds per step of each part, over the broken-down steps, per worker id and overall."""

    steps: int = 0
    mean: dict[str, float] = field(default_factory=dict)
    share: dict[str, float] = field(default_factory=dict)
    per_worker: dict[int, dict[str, float]] = field(default_factory=dict)
    io: dict[int, dict[str, float]] = field(default_factory=dict)
    advice: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "mean_s": self.mean, "share": self.share,
                "per_worker": {str(k): v for k, v in self.per_worker.items()},
                "io_per_step": {str(k): v for k, v in self.io.items()}, "advice": self.advice}


def rows(records: Iterable[dict[str, Any]]) -> list[tuple[int, int, int, dict[str, float]]]:
    """(step, generation, worker id, parts) for every worker of every broken-down step record
    (metrics.jsonl's or the history's), in order."""
    out = []
    for rec in records:
        parts = clean(rec.get("breakdown"))
        step = rec.get("breakdown_step")
        gen = rec.get("generation")
        if parts is None or isinstance(step, bool) or not isinstance(step, int):
            continue
        for p in parts:
            out.append((step, gen if isinstance(gen, int) else 0, int(p["worker"]), p))
    return out


def summarize(records: Iterable[dict[str, Any]], *, loader_workers: int = 0) -> Summary | None:
    """The run's breakdown: mean per part and worker, shares of the step, the I/O profile per step
    and, when input loading dominates, one sentence of advice. None when nothing was broken down."""
    table = rows(records)
    if not table:
        return None
    keys = PARTS + ("step_s",)
    by_worker: dict[int, list[dict[str, float]]] = {}
    for _, _, wid, p in table:
        by_worker.setdefault(wid, []).append(p)
    per_worker = {w: {k: statistics.fmean(p[k] for p in ps) for k in keys} for w, ps in sorted(by_worker.items())}
    io = {w: {k: statistics.fmean(p[k] for p in ps) for k in IO_FIELDS} for w, ps in sorted(by_worker.items())}
    mean = {k: statistics.fmean(p[k] for _, _, _, p in table) for k in keys}
    total = mean["step_s"]
    share = {k: (mean[k] / total if total > 0 else 0.0) for k in PARTS}
    steps = len({s for s, _, _, _ in table})
    return Summary(steps, mean, share, per_worker, io, advice(share, loader_workers=loader_workers,
                                                              stalled_s=mean["input_s"]))


def advice(share: dict[str, float], *, loader_workers: int, stalled_s: float = 0.0) -> str | None:
    """One plain sentence when input loading dominates the step, else None."""
    s = share.get("input_s", 0.0)
    if s < INPUT_ADVICE_SHARE:
        return None
    pct = f"{100 * s:.0f} %"
    if loader_workers <= 0:
        return (f"Input loading takes {pct} of the step time and the compute waits for it: load the next "
                f"virtual nodes' batches while the current ones compute with --loader-workers 2 (or more), "
                f"or make reading the dataset cheaper.")
    return (f"Input loading still stalls the compute for {pct} of the step time with --loader-workers "
            f"{loader_workers}: raise --loader-workers (the loaders cannot keep up), or make reading the dataset "
            f"cheaper (faster storage, smaller or cached files).")


def shown_parts(summary: Summary) -> tuple[str, ...]:
    """The parts a table shows: the pipeline stages' only where some worker measured them."""
    pipelined = any(m.get(k, 0.0) > 0 for m in summary.per_worker.values() for k in PIPELINE_PARTS)
    return PARTS if pipelined else tuple(k for k in PARTS if k not in PIPELINE_PARTS)


def format_table(summary: Summary) -> list[str]:
    """Lines for ``virtualflow status``: one row per worker, milliseconds per step (a pipelined
    run's rows are stages: see the module docstring for what each part means there)."""
    parts = shown_parts(summary)
    head = f"{'worker':>6} " + " ".join(f"{k.removesuffix('_s'):>9}" for k in parts) + f" {'step':>9}"
    lines = [f"where the step time goes (mean ms per step over {summary.steps} step(s)):", head]
    for wid, m in summary.per_worker.items():
        lines.append(f"{wid:>6} " + " ".join(f"{1000 * m[k]:>9.1f}" for k in parts) + f" {1000 * m['step_s']:>9.1f}")
    lines.append(f"{'share':>6} " + " ".join(f"{100 * summary.share[k]:>8.1f}%" for k in parts))
    reads = [(w, v) for w, v in summary.io.items() if v["read_calls"] > 0]
    if reads:
        lines.append("dataset reads per step: " + ", ".join(
            f"worker {w}: {v['read_calls']:.0f} reads, {v['read_bytes'] / 1e6:.2f} MB, loaders busy "
            f"{1000 * v['loaded_s']:.1f} ms" for w, v in reads))
    if summary.advice:
        lines.append(summary.advice)
    return lines
