"""Spot-instance simulator: replay an availability trace for a pipelined job under three strategies.

A *trace* is a step function of how many spot instances are up over time (``SpotTrace``; Bamboo's
measured traces ship with the package, ``load_trace(NAME)``; ``generate_trace`` draws one from a
Poisson process of preemptions). ``predict`` replays it for a job of ``stages`` pipeline stages and
up to ``pipelines`` data-parallel pipelines under one strategy and returns a ``SpotResult`` with
totals and a per-interval timeline:

``bamboo``
    Redundancy on spot. Stage s of every pipeline also holds a replica of stage (s+1) mod P, and
    all the time pays ``redundancy_overhead`` (throughput / (1 + overhead)). A lost stage whose
    predecessor survives is taken over by that predecessor (a *failover*): the job pauses
    ``failover_s`` (loss -> first completed step, the redone step included), loses no step, and
    that pipeline then runs ``failover_slowdown`` x slower. A loss that leaves two cyclically
    adjacent stages of one pipeline missing (two consecutive stages, or the node already running
    two stages) cannot be covered: a *fallback restart* from the last checkpoint (the work since
    it is lost, then ``restart_s``). After a failover and when instances arrive, the job
    *reconfigures* at a step boundary (a pause of ``reconfigure_s``, nothing lost) when spare
    instances can fully repair a failed-over pipeline or form a new one (at most ``pipelines``),
    or when fresh full-depth pipelines on the up instances (min(pipelines, up // P)) would be
    faster than that (with ``sync="slowest"``, 3 full pipelines beat 4 with one failed over).
``checkpoint``
    Checkpoint-restart on spot. A preemption of a node that holds a stage stops the job: the work
    since the last checkpoint is lost and, once at least P instances are up, the job restarts
    (``restart_s``) with min(pipelines, up // P) pipelines. When arrivals allow more pipelines,
    it checkpoints and restarts to grow (``checkpoint_s`` + ``restart_s``, nothing lost; counted
    as a reconfiguration).
``on-demand``
    ``stages x pipelines`` on-demand instances for the trace's span, never preempted, no
    redundancy, no checkpoints.

Rules shared by the spot strategies:

- **Which node a preemption hits.** The trace gives counts only. Instances get ids in order of
  arrival; a drop of k instances removes k of the up instances drawn uniformly without
  replacement by ``numpy.random.default_rng(seed)`` (``node_events``). The draw depends on the
  trace and the seed only, so both spot strategies see the same instances vanish; a hit on an
  instance that holds no stage (a spare) costs nothing.
- **Layout.** A (re)start uses the up instances in id order: pipeline j, stage s on instance
  ``ids[j * P + s]``, for min(pipelines, up // P) pipelines; the rest are spares.
- **Cost.** Every instance the trace says is up is billed at the spot price, whether it holds a
  stage, is a spare, or waits for a restart. On-demand bills its fixed count.
- **Checkpoints** every ``checkpoint_every_s`` of running time (pauses excluded), each a pause of
  ``checkpoint_s``; a checkpoint commits when its write ends, and a loss during the write loses
  it too. Default interval: Young's optimum sqrt(2 x checkpoint_s x MTBF), for each spot
  strategy with the MTBF of its own restarts (span / restarts; ``predict`` starts from the
  trace's span / instances lost and re-runs the replay until the interval settles within 1 %).
- **Data-parallel pipelines** are synchronous: with ``sync="slowest"`` (default) a step waits for
  the slowest pipeline, so one failed-over pipeline slows the job by ``failover_slowdown``; with
  ``sync="proportional"`` micro-batches are split in proportion to pipeline speed (the job's
  rate is the sum of the pipelines' rates).
- **Pauses.** Events during a pause extend it: a failover or reconfiguration to at least
  ``t + its cost``; a (fallback) restart starts over at ``t``. The job's first start, when P
  instances are first up, is free (on-demand pays no start-up either).
- **Time compression** (``SpotTrace.compressed(x)``) divides the trace's times by x and leaves
  the constants alone; costs follow the compressed time.

Invariants: the replay is deterministic given (trace, constants, job); the timeline's intervals
tile [trace start, trace end] for every strategy; samples = produced - lost >= 0. Pure: the engine's
constants come in as a :class:`~virtualflow.cluster.spot_constants.SpotConstants` (its JSON file read
from a path it is given); finding the source tree's bench results, writing the outputs and the
plot are the command line's (:mod:`virtualflow.cli.simulate_spot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["STRATEGIES", "SpotTrace", "SpotConstants", "SpotJob", "SpotResult", "Interval", "SpotEvent",
           "NodeEvent", "load_trace", "parse_trace", "bamboo_trace_names", "bamboo_data_dir", "generate_trace",
           "parse_generate_spec", "node_events", "young_interval_s", "predict", "compare", "summary"]

STRATEGIES = ("bamboo", "checkpoint", "on-demand")
SPOT_PRICE = 0.91
"""$ per instance-hour on spot (the figure Bamboo used; see data/bamboo/README.md)."""
ON_DEMAND_PRICE = 3.06
"""$ per instance-hour on demand (the figure Bamboo used)."""
_EPS = 1e-9


from virtualflow.cluster import bounds
from virtualflow.cluster.spot_constants import SpotConstants
from virtualflow.cluster.spot_traces import (  # noqa: F401 - re-exported
    NodeEvent, SpotTrace, bamboo_data_dir, bamboo_trace_names, generate_trace, load_trace, node_events,
    parse_generate_spec, parse_trace, young_interval_s, young_s,
)


# --------------------------------------------------------------------------------------------- job


@dataclass(kw_only=True, slots=True)
class SpotJob:
    """The job and the prices: what does not come from the engine's measurements."""

    stages: int
    """P: pipeline stages (>= 2: redundancy needs a predecessor)."""
    pipelines: int | None = None
    """D: data-parallel pipelines wanted (None: the trace's max count // P)."""
    spot_price: float = SPOT_PRICE
    """$ per spot instance-hour."""
    on_demand_price: float = ON_DEMAND_PRICE
    """$ per on-demand instance-hour."""
    checkpoint_every_s: float | None = None
    """Running seconds between checkpoints (None: each spot strategy gets Young's interval for the
    restarts it suffers in this replay; see ``predict``)."""
    seed: int = 0
    """Which instances a preemption takes (``node_events``)."""
    sync: str = "slowest"
    """How synchronous pipelines share a step: "slowest" or "proportional" (see the module doc)."""

    def __post_init__(self) -> None:
        bounds.number(self.stages, where="job", field="--stages", lo=2, hi=bounds.MAX_SPOT_INSTANCES, integral=True,
                      meaning="pipeline stages; a stage's replica lives on its predecessor, so at least 2")
        if self.pipelines is not None:
            bounds.number(self.pipelines, where="job", field="--pipelines", lo=1, hi=bounds.MAX_SPOT_INSTANCES,
                          integral=True, meaning="data-parallel pipelines")
        for flag, v in (("--spot-price", self.spot_price), ("--on-demand-price", self.on_demand_price)):
            bounds.number(v, where="job", field=flag, lo=0, lo_open=True, hi=1e6, meaning="$ per instance-hour")
        if self.checkpoint_every_s is not None:
            bounds.number(self.checkpoint_every_s, where="job", field="--checkpoint-every-s", lo=1e-3,
                          hi=bounds.MAX_SIM_S, meaning="running seconds between checkpoints")
        if self.sync not in ("slowest", "proportional"):
            raise ValueError(f"--sync {self.sync!r} must be 'slowest' or 'proportional'")

    def resolved_pipelines(self, trace: SpotTrace) -> int:
        d = self.pipelines if self.pipelines is not None else trace.max_count // self.stages
        if d < 1:
            raise ValueError(f"--stages {self.stages} is more than the trace's max count {trace.max_count}: no "
                             "pipeline can ever run; lower --stages or use a bigger trace")
        return int(d)



# ------------------------------------------------------------------------------------------ result


@dataclass(frozen=True, slots=True)
class Interval:
    """A piece of the timeline with one state: ``running`` (producing ``rate`` samples/s),
    ``failover``, ``reconfigure``, ``restart``, ``checkpoint`` (pauses) or ``waiting`` (< P up)."""

    start_s: float
    end_s: float
    state: str
    instances: int
    pipelines: int
    failed_over: int
    rate: float
    samples: float
    cost_usd: float


@dataclass(frozen=True, slots=True)
class SpotEvent:
    """``failover``, ``fallback_restart``, ``restart``, ``reconfigure`` or ``checkpoint`` at ``t_s``."""

    t_s: float
    kind: str
    detail: str


@dataclass(slots=True)
class SpotResult:
    strategy: str
    span_s: float
    samples: float = 0.0
    """Samples trained and kept (produced - lost)."""
    lost_samples: float = 0.0
    lost_steps: float = 0.0
    steps: float = 0.0
    """Job steps kept."""
    cost_usd: float = 0.0
    failovers: int = 0
    restarts: int = 0
    """Restarts from a checkpoint after a loss (bamboo: fallback restarts)."""
    reconfigurations: int = 0
    checkpoints: int = 0
    checkpoint_every_s: float | None = None
    timeline: list[Interval] = field(default_factory=list)
    events: list[SpotEvent] = field(default_factory=list)

    @property
    def hours(self) -> float:
        return self.span_s / 3600.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.span_s if self.span_s > 0 else 0.0

    @property
    def samples_per_usd(self) -> float:
        return self.samples / self.cost_usd if self.cost_usd > 0 else 0.0

    def produced_between(self, t0_s: float, t1_s: float) -> float:
        """Samples the timeline produces in [t0_s, t1_s] (work later lost at a restart included):
        what a measured replay's counter of completed samples should show over that window."""
        total = 0.0
        for iv in self.timeline:
            lo, hi = max(iv.start_s, t0_s), min(iv.end_s, t1_s)
            if hi > lo:
                total += iv.rate * (hi - lo)
        return total

    def totals(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "samples": self.samples, "hours": self.hours, "cost_usd": self.cost_usd,
                "samples_per_s": self.samples_per_s, "samples_per_usd": self.samples_per_usd,
                "steps": self.steps, "lost_samples": self.lost_samples, "lost_steps": self.lost_steps,
                "failovers": self.failovers, "restarts": self.restarts,
                "reconfigurations": self.reconfigurations, "checkpoints": self.checkpoints,
                "checkpoint_every_s": self.checkpoint_every_s}


# ------------------------------------------------------------------------------------------ replay


class _Replay:
    """The state machine shared by the spot strategies: pauses, checkpoints and accounting. A
    strategy subclass says what a loss and an arrival do to its layout."""

    strategy = ""

    def __init__(self, trace: SpotTrace, c: SpotConstants, job: SpotJob, every_s: float) -> None:
        self.c, self.job = c, job
        self.P = job.stages
        self.D = job.resolved_pipelines(trace)
        self.every_s = every_s
        self.res = SpotResult(strategy=self.strategy, span_s=trace.span_s, checkpoint_every_s=self.every_s)
        self.t = trace.start_s
        self.up: set[int] = set()
        self.pipes: list[list[int | None]] = []  # node id per stage; None = run by the predecessor
        self.started = False
        self.waiting = True
        self.pause_end = -math.inf
        self.pause_kind = ""
        self.pause_is_restart = False  # the pause under way (re)starts the job: newcomers join it free
        self.commit_at: float | None = None  # a checkpoint being written commits then
        self.run_since_ckpt = 0.0
        self.samples_since_ckpt = 0.0
        self.steps_since_ckpt = 0.0

    # -- layout
    def fresh_layout(self) -> None:
        ids = sorted(self.up)
        f = min(self.D, len(ids) // self.P)
        self.pipes = [list(ids[j * self.P:(j + 1) * self.P]) for j in range(f)]

    def used(self) -> set[int]:
        return {n for p in self.pipes for n in p if n is not None}

    def failed_over(self) -> int:
        return sum(1 for p in self.pipes if None in p)

    def rate(self, pipes: list[list[int | None]] | None = None) -> float:
        """Samples/s of a layout (default: the current one) while running."""
        pipes = self.pipes if pipes is None else pipes
        if not pipes:
            return 0.0
        r = self.c.samples_per_step / self.c.step_s / self.overhead()
        s = self.c.failover_slowdown
        if self.job.sync == "slowest":
            return len(pipes) * r / (s if any(None in p for p in pipes) else 1.0)
        return sum(r / s if None in p else r for p in pipes)

    def overhead(self) -> float:
        return 1.0

    # -- pauses
    def pause(self, kind: str, seconds: float, *, restart: bool = False) -> None:
        """Pause ``seconds`` from now: a restart starts over; anything else extends a pause under
        way to at least its own end (the rest of the pause then carries its name)."""
        end = self.t + seconds
        if restart or self.t >= self.pause_end:
            self.pause_end, self.pause_kind, self.pause_is_restart = end, kind, restart
        elif end > self.pause_end:
            self.pause_end, self.pause_kind = end, kind

    def restarting(self) -> bool:
        return self.pause_is_restart and self.t < self.pause_end

    def lose_work(self) -> None:
        self.res.lost_samples += self.samples_since_ckpt
        self.res.lost_steps += self.steps_since_ckpt
        self.samples_since_ckpt = self.steps_since_ckpt = self.run_since_ckpt = 0.0
        self.commit_at = None

    def event(self, kind: str, detail: str) -> None:
        self.res.events.append(SpotEvent(t_s=self.t, kind=kind, detail=detail))

    def restart_or_wait(self, kind: str, why: str) -> None:
        """Re-form from scratch: a restart now if P instances are up, else wait for them."""
        self.fresh_layout()
        self.waiting = not self.pipes
        if self.pipes:
            self.pause(kind, self.c.restart_s, restart=True)
        else:
            self.pause_end = -math.inf
        self.event(kind, why + (f"; restart with {len(self.pipes)} pipeline(s)" if self.pipes
                                else f"; waiting for {self.P} instances ({len(self.up)} up)"))

    # -- time
    def record(self, end: float, state: str, rate: float) -> None:
        dt = end - self.t
        if dt <= 0:
            return
        samples = rate * dt
        cost = len(self.up) * self.job.spot_price * dt / 3600.0
        self.res.cost_usd += cost
        self.res.timeline.append(Interval(start_s=self.t, end_s=end, state=state, instances=len(self.up),
                                          pipelines=len(self.pipes), failed_over=self.failed_over(), rate=rate,
                                          samples=samples, cost_usd=cost))
        self.t = end

    def advance(self, t_to: float) -> None:
        while self.t < t_to:
            # Tolerances relative to the time: at 1e8 s a float's spacing (~1e-8 s) is coarser
            # than an absolute 1e-9, and a step of less than that spacing makes no progress (a
            # trace of months looped for ever a few nanoseconds before a checkpoint).
            tol = max(_EPS, 1e-12 * abs(self.t))
            if self.commit_at is not None and self.t >= self.commit_at - tol:
                self.samples_since_ckpt = self.steps_since_ckpt = self.run_since_ckpt = 0.0
                self.commit_at = None
            if self.waiting:
                self.record(t_to, "waiting", 0.0)
                break
            if self.t < self.pause_end:
                end = min(self.pause_end, t_to)
                if self.commit_at is not None and self.commit_at > self.t:
                    end = min(end, self.commit_at)
                self.record(end, self.pause_kind, 0.0)
                continue
            rate = self.rate()
            end = min(t_to, self.t + max(self.every_s - self.run_since_ckpt, 0.0))
            if end - self.t <= tol and end < t_to:
                self.run_since_ckpt = self.every_s  # within rounding of the checkpoint: take it now
                end = self.t
            dt = end - self.t
            step_rate = rate / (len(self.pipes) * self.c.samples_per_step)
            self.samples_since_ckpt += rate * dt
            self.steps_since_ckpt += step_rate * dt
            self.res.samples += rate * dt
            self.res.steps += step_rate * dt
            self.run_since_ckpt += dt
            self.record(end, "running", rate)
            if self.run_since_ckpt >= self.every_s - tol:
                self.res.checkpoints += 1
                self.commit_at = self.t + self.c.checkpoint_s
                self.run_since_ckpt = 0.0
                self.pause("checkpoint", self.c.checkpoint_s)
                if self.c.checkpoint_s == 0:
                    self.samples_since_ckpt = self.steps_since_ckpt = 0.0
                    self.commit_at = None

    def on_event(self, ev: NodeEvent) -> None:
        self.up.difference_update(ev.lost)
        hit = set(ev.lost) & self.used()
        if hit:
            self.on_loss(hit)
        if ev.joined:
            self.up.update(ev.joined)
            if not self.started or self.waiting:
                self.fresh_layout()
                if self.pipes:
                    self.waiting = False
                    if self.started:
                        self.pause("restart", self.c.restart_s, restart=True)
                        self.event("restart", f"{len(self.up)} instances up; restart with {len(self.pipes)} "
                                              "pipeline(s)")
                    self.started = True
            elif self.restarting():
                self.fresh_layout()  # a restart under way takes the newcomers in for free
            else:
                self.on_arrival()

    def on_loss(self, hit: set[int]) -> None:
        raise NotImplementedError

    def on_arrival(self) -> None:
        raise NotImplementedError

    def finish(self, end_s: float) -> SpotResult:
        self.advance(end_s)
        self.res.samples -= self.res.lost_samples
        self.res.steps -= self.res.lost_steps
        return self.res


class _Bamboo(_Replay):
    strategy = "bamboo"

    def overhead(self) -> float:
        return 1.0 + self.c.redundancy_overhead

    def on_loss(self, hit: set[int]) -> None:
        restarting = self.restarting()
        new = [[None if n in hit else n for n in p] for p in self.pipes]
        broken = [j for j, p in enumerate(new)
                  if any(p[s] is None and p[s - 1] is None for s in range(self.P))]  # s - 1 wraps at 0
        if restarting or broken:
            self.res.restarts += 1
            self.lose_work()
            why = (f"instances {sorted(hit)} lost while restarting" if restarting else
                   f"pipeline {broken[0]} lost two adjacent stages (instances {sorted(hit)}): redundancy cannot "
                   "cover it")
            self.restart_or_wait("fallback_restart", why)
            return
        self.pipes = new
        self.res.failovers += len(hit)
        self.pause("failover", self.c.failover_s)
        self.event("failover", f"instances {sorted(hit)} lost; {self.failed_over()} pipeline(s) failed over")
        self.on_arrival()  # spares may repair it, or fewer full pipelines may be faster

    def on_arrival(self) -> None:
        """Reconfigure when the spares can fully repair a failed-over pipeline or form a new one, or
        when fresh full-depth pipelines on the up instances would be faster than that."""
        spares = sorted(self.up - self.used())
        pipes = [list(p) for p in self.pipes]
        for p in pipes:
            holes = [s for s in range(self.P) if p[s] is None]
            if holes and len(holes) <= len(spares):
                for s in holes:
                    p[s] = spares.pop(0)
        while len(pipes) < self.D and len(spares) >= self.P:
            pipes.append(spares[:self.P])
            del spares[:self.P]
        ids = sorted(self.up)
        fresh: list[list[int | None]] = [list(ids[j * self.P:(j + 1) * self.P])
                                         for j in range(min(self.D, len(ids) // self.P))]
        if self.rate(fresh) > self.rate(pipes) * (1 + 1e-12):
            pipes = fresh
        if pipes != self.pipes:
            self.pipes = pipes
            self.res.reconfigurations += 1
            self.pause("reconfigure", self.c.reconfigure_s)
            self.event("reconfigure", f"{len(self.up)} instances up; {len(self.pipes)} pipeline(s), "
                                      f"{self.failed_over()} failed over")


class _Checkpoint(_Replay):
    strategy = "checkpoint"

    def on_loss(self, hit: set[int]) -> None:
        self.res.restarts += 1
        self.lose_work()
        self.restart_or_wait("restart", f"instances {sorted(hit)} lost")

    def on_arrival(self) -> None:
        if min(self.D, len(self.up) // self.P) > len(self.pipes):
            # Grow: checkpoint at a step boundary (nothing lost), then restart on more instances.
            self.res.reconfigurations += 1
            self.res.checkpoints += 1
            self.commit_at = self.t + self.c.checkpoint_s
            self.run_since_ckpt = 0.0
            self.fresh_layout()
            self.pause("reconfigure", self.c.checkpoint_s + self.c.restart_s, restart=True)
            self.event("reconfigure", f"{len(self.up)} instances up; checkpoint and restart with "
                                      f"{len(self.pipes)} pipeline(s)")


def _on_demand(trace: SpotTrace, c: SpotConstants, job: SpotJob) -> SpotResult:
    d = job.resolved_pipelines(trace)
    n = d * job.stages
    rate = d * c.samples_per_step / c.step_s
    cost = n * job.on_demand_price * trace.span_s / 3600.0
    res = SpotResult(strategy="on-demand", span_s=trace.span_s, samples=rate * trace.span_s,
                     steps=trace.span_s / c.step_s, cost_usd=cost)
    res.timeline.append(Interval(start_s=trace.start_s, end_s=trace.end_s, state="running", instances=n,
                                 pipelines=d, failed_over=0, rate=rate, samples=res.samples, cost_usd=cost))
    return res


def predict(trace: SpotTrace, constants: SpotConstants, strategy: str, job: SpotJob | None = None,
            **job_kw: Any) -> SpotResult:
    """Replay ``trace`` for ``job`` (or ``SpotJob(**job_kw)``) under ``strategy`` (one of
    ``STRATEGIES``): totals and a per-interval timeline (see the module docstring for the rules)."""
    if job is None:
        job = SpotJob(**job_kw)
    elif job_kw:
        raise ValueError("pass either a SpotJob or keyword arguments, not both")
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategies: unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "on-demand":
        return _on_demand(trace, constants, job)
    kind = _Bamboo if strategy == "bamboo" else _Checkpoint
    if job.checkpoint_every_s is not None:
        return _replay(kind, trace, constants, job, float(job.checkpoint_every_s))
    # Young's interval for the restarts this strategy suffers: start from the trace's loss rate,
    # then re-run with the rate of the replay's own restarts until the interval settles.
    every = young_interval_s(trace, constants.checkpoint_s)
    res = _replay(kind, trace, constants, job, every)
    for _ in range(8):
        nxt = young_s(trace.span_s, res.restarts, constants.checkpoint_s)
        if abs(nxt - every) <= 0.01 * every:
            break
        every = nxt
        res = _replay(kind, trace, constants, job, every)
    return res


def _replay(kind: type[_Replay], trace: SpotTrace, constants: SpotConstants, job: SpotJob,
            every_s: float) -> SpotResult:
    replay = kind(trace, constants, job, every_s)
    for ev in node_events(trace, job.seed):
        replay.advance(ev.t_s)
        replay.on_event(ev)
    return replay.finish(trace.end_s)


def compare(trace: SpotTrace, constants: SpotConstants, job: SpotJob,
            strategies: Iterable[str] = STRATEGIES) -> dict[str, SpotResult]:
    """``predict`` for each strategy, in order."""
    return {s: predict(trace, constants, s, job) for s in strategies}


def summary(trace: SpotTrace, constants: SpotConstants, job: SpotJob,
            results: Mapping[str, SpotResult]) -> dict[str, Any]:
    """A JSON-ready dict: the trace, the job, the constants (and which are defaults), per-strategy
    totals, value (samples per $) relative to on-demand, and bamboo relative to checkpoint."""
    out: dict[str, Any] = {
        "trace": {"name": trace.name, "span_h": trace.span_s / 3600.0, "max_count": trace.max_count,
                  "instances_lost": trace.instances_lost, "instance_hours": trace.instance_hours()},
        "job": {"stages": job.stages, "pipelines": job.resolved_pipelines(trace), "spot_price": job.spot_price,
                "on_demand_price": job.on_demand_price, "seed": job.seed, "sync": job.sync,
                "checkpoint_every_s": job.checkpoint_every_s,
                "checkpoint_every_from": "--checkpoint-every-s" if job.checkpoint_every_s is not None
                else "Young's interval for each strategy's own restart rate"},
        "constants": constants.to_dict(),
        "strategies": {k: r.totals() for k, r in results.items()},
    }
    od = results.get("on-demand")
    for k, r in results.items():
        if od is not None and od.samples_per_usd > 0:
            out["strategies"][k]["value_vs_on_demand"] = r.samples_per_usd / od.samples_per_usd
    if "bamboo" in results and "checkpoint" in results and results["checkpoint"].samples_per_usd > 0:
        out["bamboo_vs_checkpoint"] = results["bamboo"].samples_per_usd / results["checkpoint"].samples_per_usd
    return out
