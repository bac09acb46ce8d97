"""The executor: runs one worker's action list of a pipeline schedule, sans I/O.

Purpose: walk the actions of this worker's stage-rank in a
:class:`~virtualflow.plan.pipeline.Schedule` - receives, sends, forwards and backwards (B, or I
and W for zero-bubble schedules) of its pieces - and yield what it needs from outside as
requests (:mod:`.requests`). What a forward or a backward *does* is given by the caller (the
flush step or the streamed window), so one walk serves every schedule.

Invariants:

- Messages between two pieces on this worker never leave it; a message whose sender is another
  worker is received by a :class:`~.requests.Recv` announced :data:`LOOKAHEAD` receives ahead by
  an :class:`~.requests.Expect`.
- A finished micro-batch's context is dropped as soon as its last backward ran (its graph and
  weight version may go): the walk holds no reference to it afterwards.
- Eager redundant forwards (Bamboo) run only while a receive's message is not there yet and the
  predicted wait (the schedule's bubble, :func:`~.schedule.idle_slots`) still holds one more, so
  they never delay a message that is due; forwards no slot was left for are counted as skipped.
- Compute seconds returned exclude eager forwards; an emulated slowdown stretches every compute
  action (and eager forward) by the same factor.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any, Callable, Generator, Protocol, Sequence

import torch

from virtualflow.plan.pipeline import Schedule
from virtualflow.runtime.pipeline.requests import Expect, Poll, Recv, Request, Send
from virtualflow.runtime.pipeline.schedule import idle_slots
from virtualflow.runtime.pipeline.wire import MsgKey, forward_message, recv_key

LOOKAHEAD = 4
"""Receives announced (:class:`Expect`) ahead of the action that needs them, per worker."""
SLACK = 1.1
"""An eager redundant forward starts in a bubble if it ends within this factor of the bubble's
predicted length (the prediction leaves out message latency, so waits run a little longer)."""


class ActionHost(Protocol):
    """What the executor reads from (and, ``fb_times``, writes to) the engine it runs for."""

    pipeline: Any
    p: int
    stage_rank: int
    pieces: dict[int, Any]
    replica_of_successor: Any
    eager_every_wait: bool
    fb_times: tuple[float, float] | None
    fault_point: Callable[[str], None] | None
    slowdown: float
    timeline: list[dict[str, Any]] | None
    prep: Any

    @property
    def first(self) -> int: ...

    @property
    def last(self) -> int: ...

    def vn_of(self, first_step: int, mb: int, m: int) -> tuple[int, int]: ...


def run_actions(host: ActionHost, schedule: Schedule, first_step: int, mbs: dict, *, on_backward_done=None,
                forward=None, backward=None, eager: bool = False) -> Generator[Request, Any, float]:
    """Run ``host``'s actions of ``schedule`` (micro-batch ``i`` = the ``i``-th VN of its replica,
    step ``first_step + i // m``); returns its compute seconds (eager redundant forwards, run while
    a receive would wait, not included). ``forward(k, mb, step, vn, message)`` returns the
    micro-batch's context, ``backward(kind, k, mb, ctx)`` runs a B, I or W action,
    ``on_backward_done(k, mb, ctx)`` (a generator) follows a micro-batch's last backward."""
    m = schedule.m
    walk = _Walk(host, first_step, m, mbs, forward, backward, on_backward_done)
    busy = 0.0
    replica, todo, idle, f_s = _eager_plan(host, schedule, first_step, eager)
    walk.replica, walk.todo = replica, todo
    f_sum = b_sum = 0.0
    f_n = b_n = 0
    t_origin = time.perf_counter()
    wall_origin = time.time()
    actions = schedule.actions[host.stage_rank]
    receives = [k for k, a in enumerate(actions) if a.kind in ("RECV_F", "RECV_B")]
    announced = 0  # receives[:announced] have been announced
    timing = getattr(host, "timing", None)  # the step breakdown (.timing), if kept
    for index, a in enumerate(actions):
        done = bisect.bisect_left(receives, index)  # receives before this action have run
        while announced < min(len(receives), done + LOOKAHEAD):
            b = actions[receives[announced]]
            yield Expect(b.peer, recv_key(b))
            announced += 1
        if todo and idle[index] > 0 and a.kind in ("RECV_F", "RECV_B"):
            # A bubble: run redundant forwards while the message is not there and the
            # predicted wait still holds one.
            key = recv_key(a)
            t_slot = time.perf_counter()
            while todo and time.perf_counter() - t_slot + replica.forward_est(f_s) <= SLACK * idle[index] \
                    and not (yield Poll(a.peer, key)):
                replica.forward_eagerly(*todo.popleft(), host.prep, host.slowdown)
        t0 = time.perf_counter()
        loaded = host.prep.load_s
        yield from walk.act(a)
        t1 = time.perf_counter()
        if a.kind in ("F", "B", "I", "W"):
            busy += t1 - t0
            took = t1 - t0
            if host.slowdown > 1.0:
                time.sleep((host.slowdown - 1.0) * (t1 - t0))
                t1 = time.perf_counter()
            if timing is not None:
                timing.compute(a.kind, took, host.prep.load_s - loaded, t1 - t0 - took)
            if a.kind == "F":
                f_sum, f_n = f_sum + t1 - t0, f_n + 1
            elif a.kind == "B":
                b_sum, b_n = b_sum + t1 - t0, b_n + 1
        if host.timeline is not None:
            # wall-clock times, comparable between the workers of one machine
            host.timeline.append({"kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                                  "step": first_step + a.microbatch // m,
                                  "start": wall_origin + (t0 - t_origin), "end": wall_origin + (t1 - t_origin)})
        yield from walk.after_action()
    if todo and 0 < idle[-1] < float("inf"):
        # The bubble between this worker's last action and the slowest worker's.
        t_slot = time.perf_counter()
        while todo and time.perf_counter() - t_slot + replica.forward_est(f_s) <= SLACK * idle[-1]:
            replica.forward_eagerly(*todo.popleft(), host.prep, host.slowdown)
    if replica is not None:
        replica.skipped += len(todo)  # no idle slot was left for them: a failover recomputes them
    if f_n and b_n:
        host.fb_times = (f_sum / f_n, b_sum / b_n)
    return busy


def _eager_plan(host: ActionHost, schedule: Schedule, first_step: int,
                eager: bool) -> tuple[Any, deque[tuple[int, int, list[torch.Tensor] | None]], Sequence[float], float]:
    """Eager redundant forwards of one walk: (the replica that runs them, ``None`` for none; the
    forwards known now; per action, the predicted wait before it, the last entry after the last
    action; the forward's mean seconds)."""
    m = schedule.m
    replica = host.replica_of_successor if eager else None
    todo: deque[tuple[int, int, list[torch.Tensor] | None]] = deque()  # eager forwards not run yet
    idle: Sequence[float] = ()
    f_s = 0.0
    if replica is not None and host.eager_every_wait:
        idle = [float("inf")] * (len(schedule.actions[host.stage_rank]) + 1)
    elif replica is not None and host.fb_times is not None:
        # Eager forwards go where the schedule has this worker wait (its bubbles), as long as
        # the predicted wait holds one more: they never delay a message that is due.
        f_s, b_s = host.fb_times
        units = idle_slots(host.pipeline.schedule, host.p, m, round(4 * b_s / f_s) / 4 if f_s > 0 else 2.0)
        idle = [u * f_s for u in units[host.stage_rank]]
    elif replica is not None:
        replica.skipped += m  # the first step: no measured times to find the bubbles with yet
        replica = None
    if replica is not None and host.first in replica.pieces:
        # The replica of the first stage: its inputs are the micro-batches' data, known now.
        todo.extend((*host.vn_of(first_step, mb, m), None) for mb in range(m))
    return replica, todo, idle, f_s


class _Walk:
    """What one walk's actions share: the messages between this worker's pieces, the input
    gradients to send, the caller's forward and backward, the eager forwards to queue."""

    def __init__(self, host: ActionHost, first_step: int, m: int, mbs: dict, forward: Any, backward: Any,
                 on_backward_done: Any) -> None:
        self.host, self.first_step, self.m, self.mbs = host, first_step, m, mbs
        self.forward, self.backward, self.on_backward_done = forward, backward, on_backward_done
        self.local: dict[MsgKey, list[torch.Tensor]] = {}
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.replica: Any = None
        self.todo: deque[tuple[int, int, list[torch.Tensor] | None]] = deque()
        self.sent = self.backed = False
        """The first send / backward passed its fault-injection point."""
        self.finished: tuple[int, int, Any] | None = None
        """(piece, micro-batch, context) of a backward that just ended, for ``on_backward_done``."""

    def act(self, a: Any) -> Generator[Request, Any, None]:
        """Run action ``a`` (a receive, a send, a forward or a backward)."""
        host, local, mbs = self.host, self.local, self.mbs
        if a.kind == "RECV_F":
            tensors = yield Recv(a.peer, ("F", a.stage - 1, a.microbatch))
            local[("F", a.stage - 1, a.microbatch)] = tensors
        elif a.kind == "RECV_B":
            tensors = yield Recv(a.peer, ("B", a.stage + 1, a.microbatch))
            local[("B", a.stage + 1, a.microbatch)] = tensors
        elif a.kind == "SEND_F":
            ctx = mbs[a.stage, a.microbatch]
            if not self.sent and host.fault_point is not None:
                self.sent = True
                host.fault_point("send_recv")
            message = forward_message(ctx.outputs, ctx.rng)
            yield Send(a.peer, ("F", a.stage, a.microbatch), message)
            if self.replica is not None and a.stage + 1 in self.replica.pieces:
                self.todo.append((*host.vn_of(self.first_step, a.microbatch, self.m), message))
        elif a.kind == "SEND_B":
            yield Send(a.peer, ("B", a.stage, a.microbatch), self.grads_out.pop((a.stage, a.microbatch)))
        elif a.kind == "F":
            self._forward(a)
        else:  # B, I, W
            self._backward(a)

    def _forward(self, a: Any) -> None:
        host, local, mbs = self.host, self.local, self.mbs
        step, vn = host.vn_of(self.first_step, a.microbatch, self.m)
        if a.stage == host.first:
            message = None
        else:
            message = local.pop(("F", a.stage - 1, a.microbatch))
            if host.pieces.get(a.stage - 1) is not None:  # the previous piece is local
                message = [t.detach() for t in message]
        mbs[a.stage, a.microbatch] = self.forward(a.stage, a.microbatch, step, vn, message)
        if a.stage + 1 in host.pieces:  # pass to the next piece on this worker
            produced = mbs[a.stage, a.microbatch]
            local[("F", a.stage, a.microbatch)] = forward_message(produced.outputs, produced.rng)

    def _backward(self, a: Any) -> None:
        host, local, mbs = self.host, self.local, self.mbs
        if not self.backed and host.fault_point is not None:
            self.backed = True
            host.fault_point("mid_backward")
        ctx = mbs[a.stage, a.microbatch]
        if a.kind in ("B", "I") and a.stage != host.last:
            ctx.out_grads = local.pop(("B", a.stage + 1, a.microbatch))
        self.backward(a.kind, a.stage, a.microbatch, ctx)
        if a.kind in ("B", "I") and a.stage != host.first:
            if a.stage - 1 in host.pieces:
                local[("B", a.stage, a.microbatch)] = ctx.in_grads
            else:
                self.grads_out[a.stage, a.microbatch] = ctx.in_grads
            ctx.in_grads = None
        if a.kind in ("B", "W"):
            del mbs[a.stage, a.microbatch]
            if self.on_backward_done is not None:  # run by the walk once the action is timed
                self.finished = (a.stage, a.microbatch, ctx)
        # (a finished micro-batch's graph and weight version go with this frame: the walk keeps no ctx)

    def after_action(self) -> Generator[Request, Any, None]:
        """The caller's ``on_backward_done`` for the backward that just ended, if any (outside the
        action's compute time: what it asks of the driver is timed as such)."""
        if self.finished is not None:
            (k, mb, ctx), self.finished = self.finished, None
            yield from self.on_backward_done(k, mb, ctx)
