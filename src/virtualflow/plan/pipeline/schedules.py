"""Pipeline schedules as pure action lists: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1,
PipeDream-2BW and asynchronous PipeDream. Pure code, no processes.

A schedule tells each of the ``p`` ranks of one pipeline replica which actions to run, in order.
The model is cut into ``p * v`` *stages*; stage ``s`` lives on rank ``s % p`` as its model chunk
``s // p`` (``v = 1`` except for the interleaved schedule). The ``m`` micro-batches of a step are
the job's virtual nodes on this pipeline replica.

Invariants every generator keeps (``check.check`` proves them):

- Each (stage, micro-batch) gets exactly one ``F`` and either one ``B`` or one ``I`` followed by
  one ``W`` (zero-bubble splits the backward into input-gradient and weight-gradient parts).
- Data crosses ranks only through a ``SEND_*`` on the producer and its one matching ``RECV_*`` on
  the consumer. A send is asynchronous (it never blocks its rank); a receive blocks until the
  matching send has run. Receives sit immediately before the action that consumes them, sends
  immediately after the action that produces them. Neighbouring stages on the same rank
  (interleaved with ``p = 1``) pass data locally, without a send.
- Micro-batch ids are global over the ``steps`` optimizer steps an action list covers: step
  ``t`` owns ids ``t*m .. t*m + m - 1``. Flush schedules cover one step; the no-flush schedules
  (2BW, asynchronous) stream ``steps`` steps back to back without draining, and stage ``s``
  applies step ``t``'s update right after its last backward of step ``t``.
- ``stash_bound[r]`` is the most (stage, micro-batch) activations rank ``r`` holds at once
  (forward done, last backward part not yet done); ``weight_versions[s]`` the most weight
  versions stage ``s`` keeps at once.

Message addressing: ``SEND_F`` carries the output of ``stage`` to ``stage + 1``; ``RECV_F`` the
input of ``stage`` from ``stage - 1``; ``SEND_B`` the input gradient of ``stage`` to
``stage - 1``; ``RECV_B`` the output gradient of ``stage`` from ``stage + 1``. ``peer`` is the
other rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
WEIGHT_RULES = ("sync", "delay1", "newest")


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of a rank's action list."""

    kind: str
    """One of ``F`` (forward), ``B`` (full backward), ``I`` (backward for the input gradient),
    ``W`` (backward for the weight gradient), ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``."""
    stage: int
    """Global stage index (``0 .. p*v - 1``) this action belongs to on its rank."""
    microbatch: int
    """Global micro-batch id (step ``t`` owns ``t*m .. t*m + m - 1``)."""
    chunk: int = 0
    """Model chunk on the rank, ``stage // p``."""
    peer: int | None = None
    """The other rank of a send/receive; ``None`` for compute."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind={self.kind!r} is not one of {KINDS}")
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ValueError(f"Action {self.kind}: peer={self.peer} must be set for send/recv and only for them")

    def __str__(self) -> str:
        tail = f" peer={self.peer}" if self.peer is not None else ""
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch}{tail})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Per-rank ordered action lists of one pipeline replica, with what they promise."""

    name: str
    """Generator name: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``, ``2bw``, ``async``."""
    p: int
    """Ranks (workers) in the pipeline."""
    m: int
    """Micro-batches per step (the job's virtual nodes on this pipeline replica)."""
    v: int
    """Model chunks per rank; the model has ``p * v`` stages."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[r]``: rank ``r``'s actions in execution order."""
    flush: bool
    """True when the pipeline drains before every optimizer step (synchronous semantics)."""
    weight_versions: tuple[int, ...]
    """Per stage: weight versions kept at once (1 for flush schedules, 2 for 2BW)."""
    stash_bound: tuple[int, ...]
    """Per rank: the most stashed activations the rank holds at once."""
    steps: int = 1
    """Optimizer steps the action lists cover (1 for flush schedules)."""
    weight_rule: str = "sync"
    """Which weights a micro-batch of step ``t`` uses on a stage (its forward and backward use the
    same): ``sync`` (flush schedules: the weights of this step), ``delay1`` (2BW: the version made
    by step ``t-2``'s update, i.e. one step stale), ``newest`` (asynchronous PipeDream: the newest
    version on the stage when its forward runs, stashed for its backward)."""

    def __post_init__(self) -> None:
        for knob in ("p", "m", "v", "steps"):
            if getattr(self, knob) < 1:
                raise ValueError(f"Schedule {knob}={getattr(self, knob)} must be at least 1")
        if len(self.actions) != self.p:
            raise ValueError(
                f"Schedule has {len(self.actions)} action lists for p={self.p} ranks; need one per rank"
            )
        if len(self.stash_bound) != self.p:
            raise ValueError(f"Schedule stash_bound has {len(self.stash_bound)} entries for p={self.p} ranks")
        if self.weight_rule not in WEIGHT_RULES:
            raise ValueError(f"Schedule weight_rule={self.weight_rule!r} is not one of {WEIGHT_RULES}")
        if self.flush != (self.weight_rule == "sync") or (self.flush and self.steps != 1):
            raise ValueError(
                f"Schedule flush={self.flush} needs weight_rule='sync' and steps=1 (got "
                f"weight_rule={self.weight_rule!r}, steps={self.steps}); no-flush schedules use another rule"
            )
        if len(self.weight_versions) != self.stages:
            raise ValueError(
                f"Schedule weight_versions has {len(self.weight_versions)} entries for {self.stages} stages"
            )

    @property
    def stages(self) -> int:
        return self.p * self.v

    @property
    def microbatches(self) -> int:
        """Micro-batch ids the action lists cover: ``steps * m``."""
        return self.steps * self.m

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def split_backward(self) -> bool:
        """True when the backward is split into ``I`` and ``W``."""
        return any(a.kind == "I" for acts in self.actions for a in acts)


# ---- shared construction ------------------------------------------------------------------------

Compute = tuple[str, int, int]  # (kind, stage, microbatch)


def _check_knob(name: str, value: int, knob: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {knob}={value!r} must be a positive integer")


def _with_comm(p: int, v: int, orders: Sequence[Iterable[Compute]]) -> tuple[tuple[Action, ...], ...]:
    """Turn per-rank compute orders into action lists: a receive right before each compute that
    needs remote data, a send right after each compute whose output a remote rank needs."""
    last = p * v - 1
    out = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for kind, s, mb in order:
            c = s // p
            if kind == "F" and s > 0 and (s - 1) % p != r:
                acts.append(Action("RECV_F", s, mb, c, (s - 1) % p))
            if kind in ("B", "I") and s < last and (s + 1) % p != r:
                acts.append(Action("RECV_B", s, mb, c, (s + 1) % p))
            acts.append(Action(kind, s, mb, c))
            if kind == "F" and s < last and (s + 1) % p != r:
                acts.append(Action("SEND_F", s, mb, c, (s + 1) % p))
            if kind in ("B", "I") and s > 0 and (s - 1) % p != r:
                acts.append(Action("SEND_B", s, mb, c, (s - 1) % p))
        out.append(tuple(acts))
    return tuple(out)


def _one_f_one_b_orders(p: int, n: int) -> list[list[Compute]]:
    """1F1B compute order over ``n`` micro-batches (v = 1): rank ``r`` runs ``p - 1 - r`` warm-up
    forwards, then alternates forward/backward, then drains the remaining backwards."""
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, n)
        order: list[Compute] = [("F", r, i) for i in range(warm)]
        for j in range(n - warm):
            order += [("F", r, warm + j), ("B", r, j)]
        order += [("B", r, j) for j in range(n - warm, n)]
        orders.append(order)
    return orders


def _flush_schedule(
    name: str, p: int, m: int, v: int, orders: Sequence[Iterable[Compute]], stash: Sequence[int]
) -> Schedule:
    return Schedule(
        name=name, p=p, m=m, v=v, actions=_with_comm(p, v, orders), flush=True,
        weight_versions=(1,) * (p * v), stash_bound=tuple(stash),
    )


# ---- generators ----------------------------------------------------------------------------------


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards, then the step flushes.
    Bubble ``(p-1)/(m+p-1)`` with equal stage times; every rank stashes all ``m`` activations."""
    _check_knob("gpipe", p, "p"), _check_knob("gpipe", m, "m")
    orders = [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]
    return _flush_schedule("gpipe", p, m, 1, orders, [m] * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): GPipe's bubble, but rank ``r`` stashes at most ``min(m, p - r)``
    activations because each backward is run as soon as possible. Any ``m``, ``m < p`` included."""
    _check_knob("1f1b", p, "p"), _check_knob("1f1b", m, "m")
    return _flush_schedule("1f1b", p, m, 1, _one_f_one_b_orders(p, m), [min(m, p - r) for r in range(p)])


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron PTD-P): ``v`` model chunks per rank, stage ``s`` on rank
    ``s % p``. Micro-batches move through the chunks in groups of ``p``; rank ``r`` warms up with
    ``2(p-1-r) + (v-1)p`` forwards. With equal stage times the bubble is ``(p-1)/(v*m + p-1)``,
    ``v`` times smaller in idle time than 1F1B over the same model.

    Constraint: for ``v > 1``, ``m`` must be a multiple of ``p`` (the groups of ``p``
    micro-batches must be whole). ``v = 1`` is plain 1F1B and takes any ``m``.
    """
    for knob, value in (("p", p), ("m", m), ("v", v)):
        _check_knob("interleaved_1f1b", value, knob)
    if v == 1:
        s = one_f_one_b(p, m)
        return Schedule(name="interleaved_1f1b", p=p, m=m, v=1, actions=s.actions, flush=True,
                        weight_versions=s.weight_versions, stash_bound=s.stash_bound)
    if m % p != 0:
        lo, hi = (m // p) * p, (m // p + 1) * p
        choices = f"m={lo} or m={hi}" if lo else f"m={hi}"
        raise ValueError(
            f"interleaved_1f1b: m={m} micro-batches is not a multiple of p={p} ranks, which "
            f"v={v} > 1 chunks per rank requires; use {choices} (virtual nodes per pipeline "
            f"replica), or v=1, or the 1f1b schedule"
        )
    total, group = m * v, p * v
    orders, stash = [], []
    for r in range(p):
        def fwd(k: int) -> Compute:
            chunk, mb = (k % group) // p, (k // group) * p + k % p
            return ("F", chunk * p + r, mb)

        def bwd(k: int) -> Compute:
            chunk, mb = v - 1 - (k % group) // p, (k // group) * p + k % p
            return ("B", chunk * p + r, mb)

        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order = [fwd(k) for k in range(warm)]
        for j in range(total - warm):
            order += [fwd(warm + j), bwd(j)]
        order += [bwd(j) for j in range(total - warm, total)]
        orders.append(order)
        stash.append(min(total, warm + 1))
    return _flush_schedule("interleaved_1f1b", p, m, v, orders, stash)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """Zero-bubble H1: 1F1B's order of forwards and input-gradient backwards ``I``, with the
    weight-gradient backwards ``W`` moved into what would be bubbles. The input-gradient chain
    ``I`` back through the stages is shorter than a full backward, and ``W`` (which nobody waits
    for) fills the idle slots. Memory is 1F1B's peak: every rank stashes at most ``min(m, p)``
    activations (forward done, ``W`` not yet done), so a ``W`` is forced before a forward that
    would exceed it.

    The placement is built by list scheduling with unit times for F, I and W (the H1 assumption);
    the order is valid for any times, and best when they are close to equal.
    """
    _check_knob("zero_bubble_h1", p, "p"), _check_knob("zero_bubble_h1", m, "m")
    cap = min(m, p)
    skeleton = [[("I" if k == "B" else k, s, i) for k, s, i in o] for o in _one_f_one_b_orders(p, m)]
    end: dict[Compute, int] = {}  # finish time of each compute, unit durations
    orders: list[list[Compute]] = [[] for _ in range(p)]
    nxt = [0] * p  # next skeleton position per rank
    pending_w: list[list[int]] = [[] for _ in range(p)]  # micro-batches with I done, W not
    stash = [0] * p
    t = 0
    while any(nxt[r] < len(skeleton[r]) or pending_w[r] for r in range(p)):
        if t > 3 * m * (p + 1):  # every unit of time some rank can move; this cannot happen
            raise RuntimeError(f"zero_bubble_h1({p}, {m}): list scheduling made no progress")
        started: list[tuple[int, Compute]] = []
        for r in range(p):
            choice: Compute | None = None
            if nxt[r] < len(skeleton[r]):
                kind, s, i = skeleton[r][nxt[r]]
                dep = ("F", s - 1, i) if kind == "F" else ("I", s + 1, i)
                ready = (kind == "F" and s == 0) or (kind == "I" and s == p - 1) or end.get(dep, t + 1) <= t
                if kind == "F" and stash[r] >= cap:
                    ready = False  # memory full: a W must run first
                if ready:
                    choice = (kind, s, i)
                    nxt[r] += 1
            if choice is None and pending_w[r]:
                choice = ("W", r, pending_w[r].pop(0))
            if choice is not None:
                started.append((r, choice))
        for r, c in started:
            orders[r].append(c)
            end[c] = t + 1
            if c[0] == "F":
                stash[r] += 1
            elif c[0] == "I":
                pending_w[r].append(c[2])
            else:
                stash[r] -= 1
        t += 1
    return _flush_schedule("zb_h1", p, m, 1, orders, [cap] * p)


def _stream(name: str, p: int, m: int, steps: int, versions: Sequence[int], rule: str) -> Schedule:
    n = m * steps
    return Schedule(
        name=name, p=p, m=m, v=1, actions=_with_comm(p, 1, _one_f_one_b_orders(p, n)), flush=False,
        weight_versions=tuple(versions), stash_bound=tuple(min(n, p - r) for r in range(p)), steps=steps,
        weight_rule=rule,
    )


def pipedream_2bw(p: int, m: int, steps: int = 2) -> Schedule:
    """PipeDream-2BW: ``steps`` steps streamed in 1F1B order with no flush; each stage keeps 2
    weight versions. Step ``t``'s micro-batches run forward and backward on the version made by
    step ``t-2``'s update (the initial weights for ``t < 2``); gradients are summed over the step
    and applied once per step: ``W(t+1) = W(t) - lr * grad f(W(t-1))`` on every stage.

    Constraint: ``m >= p - 1``, so that on stage 0 (``p - 1`` forwards ahead of its backwards)
    step ``t-2``'s update is done before step ``t``'s first forward; otherwise a third version
    would be needed.
    """
    for knob, value in (("p", p), ("m", m), ("steps", steps)):
        _check_knob("pipedream_2bw", value, knob)
    if m < p - 1:
        raise ValueError(
            f"pipedream_2bw: m={m} micro-batches per step is below p-1={p - 1}; with 2 weight "
            f"versions stage 0 must finish step t-2's backwards before step t's first forward. "
            f"Raise m (virtual nodes per pipeline replica) to at least {p - 1}, or use fewer stages"
        )
    return _stream("2bw", p, m, steps, [2] * p, "delay1")


def pipedream_async(p: int, m: int = 1, steps: int = 2) -> Schedule:
    """Asynchronous PipeDream (1F1B with weight stashing): ``steps`` steps streamed in 1F1B order
    with no flush. Stage ``s`` applies step ``t``'s update right after its last backward of step
    ``t``; a forward uses the newest weights on its stage and its backward the same (stashed)
    version. Stage ``s`` has ``p - s`` micro-batches in flight, which span at most
    ``ceil((p-1-s)/m) + 1`` versions (and no more than ``steps``), so it keeps
    ``min(p - s, ceil((p-1-s)/m) + 1, steps)`` versions; the bound is reached once the pipeline
    is in steady state (``steps*m >= 2p``). Delays differ per stage (largest on stage 0).
    ``m = 1`` is the original PipeDream (an update per micro-batch, ``p - s`` versions)."""
    for knob, value in (("p", p), ("m", m), ("steps", steps)):
        _check_knob("pipedream_async", value, knob)
    versions = [min(p - s, -(-(p - 1 - s) // m) + 1, steps) for s in range(p)]
    return _stream("async", p, m, steps, versions, "newest")


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
    "2bw": pipedream_2bw,
    "async": pipedream_async,
}
"""THE schedule table: generators by schedule name (the ``schedule=`` knob). Every other list of
schedule names (the ``Pipeline`` check, the CLI's choices, the plots) is derived from it."""

STREAMING = ("2bw", "async")
"""The no-flush schedules: they stream ``steps`` optimizer steps back to back without a drain."""

SCHEDULE_NAMES = tuple(SCHEDULES)
"""Schedule names in table order."""

FLUSH_SCHEDULES = tuple(name for name in SCHEDULES if name not in STREAMING)
"""Schedules that drain the pipeline at the end of every step."""


@functools.lru_cache(maxsize=64)
def build_schedule(name: str, stages: int, m: int, chunks: int = 1, steps: int = 1) -> Schedule:
    """THE schedule factory: schedule ``name`` for ``stages`` ranks and ``m`` micro-batches
    (``chunks`` model pieces per rank for ``interleaved_1f1b``; ``steps`` streamed steps for the
    no-flush schedules, ignored by the flush schedules). Schedules are pure and immutable, so each
    shape is built once per process, not once per step."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {SCHEDULE_NAMES}")
    gen = SCHEDULES[name]
    if name == "interleaved_1f1b":
        return gen(stages, m, chunks)
    if name in STREAMING:
        return gen(stages, m, steps)
    return gen(stages, m)


def schedule_of(pipeline: "PipelineShape", m: int, steps: int | None = None) -> Schedule:
    """The schedule a pipeline description runs with ``m`` micro-batches: its ``schedule``,
    ``stages`` and ``chunks``; ``steps`` streamed steps (default ``pipeline.window``, which only
    the no-flush schedules use)."""
    return build_schedule(pipeline.schedule, pipeline.stages, m, pipeline.chunks,
                          pipeline.window if steps is None else steps)


class PipelineShape(Protocol):
    """What the schedule factory reads from a pipeline description (``virtualflow.Pipeline``)."""

    schedule: str
    stages: int
    chunks: int
    window: int
