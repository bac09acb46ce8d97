"""The membership controller's handling of lost workers: failures recorded and fenced, then the
next generation (a recovery, a hold, Bamboo's failover) or the end of the job.

:class:`LossHandler` carries out the pure decisions of :mod:`.sizing` (``decide_loss``) and
:mod:`.failover` (``decide_failover``) for its controller, and retries a generation a member
reported broken when no worker was found lost.

Invariants: failures are handled at once, whatever change is in flight (a loss that hits an
unformed recovery generation, or any loss in a fleet of :data:`STORM_MIN_WORKERS`, aborts the
generation at once, and the losses are answered together once they stop: one generation,
:data:`STORM_SETTLE_S`); a worker fenced for
silence is refused from then on and pointed at ``fail``; newcomers that keep failing before they
join, and generations that keep breaking without a loss or progress, fail the job (bounded). It
holds only its own counters; members, targets and records are the controller's, and every
generation is published by the controller.
"""

from __future__ import annotations

import logging
from typing import Any

from virtualflow.comm import protocol
from virtualflow.control.membership.decisions import FallBack, Failover, GiveUp
from virtualflow.control.membership.failover import decide_failover
from virtualflow.control.membership.interface import FallbackRestart, JobFailed
from virtualflow.control.membership.phases import Phase
from virtualflow.control.membership.roster import Roster
from virtualflow.control.membership.sizing import decide_loss

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
"""Breaks of one generation without a lost worker and without progress before the job fails."""
STORM_SETTLE_S = 0.5
"""A failure storm: losses are gathered until none came for this long, then answered with one
generation (not one per loss)."""
STORM_MAX_S = 2.0
"""A storm that goes on is answered at the latest this long after its first loss (the next
losses start the next one)."""
STORM_MIN_WORKERS = 32
"""From this many members on, even a first loss is gathered (:data:`STORM_SETTLE_S`) before it is
answered: in a fleet that large a loss is likely one of many (a rack, a switch, a spot
reclaim), and half a second is small next to forming its next generation; a smaller job answers
a lone loss at once."""


class LossHandler:
    """Lost workers and broken generations, for one controller (see the module docstring)."""

    def __init__(self, ctl: Roster, max_newcomer_failures: int) -> None:
        self.ctl = ctl
        self.max_newcomer_failures = max_newcomer_failures
        self.failed_newcomers = 0
        self.fault_at: float | None = None  # a member reported the current generation broken
        self.retries = 0
        self.storm: tuple[float, float, dict[int, str]] | None = None
        """A failure storm being gathered: when its first and its last loss came, and every loss
        since the last published generation (:meth:`settle`)."""

    def on_failures(self, failed: dict[int, str], now: float, *, gather: bool = True) -> None:
        """Record and fence the ``failed`` workers (id -> cause), then publish the next
        generation, or raise when the job cannot go on. ``gather``: the losses may be part of a
        storm (exits, silence); members judged wedged (False) are answered at once, with the
        storm gathered so far."""
        ctl = self.ctl
        for wid, cause in failed.items():
            self._record(wid, cause, now)
        lost = [w for w in ctl.members if w in failed]
        newcomers_lost = [w for w in failed if w not in ctl.members]
        self.failed_newcomers += len(newcomers_lost)
        if self.failed_newcomers > self.max_newcomer_failures:
            raise JobFailed(f"{self.failed_newcomers} newcomer workers failed before joining; "
                            f"see their logs (last: worker {newcomers_lost[-1]}: {failed[newcomers_lost[-1]]})")
        # A newcomer assigned to an unformed generation breaks that generation too.
        breaks = lost or any(ctl.assigned.get(w, -1) == ctl.generation and ctl.busy for w in newcomers_lost)
        if not breaks:
            return
        if lost and ctl.shards_die_with_members:
            ctl.abort(ctl.generation)
            lost_desc = "; ".join(f"worker {w} {failed[w]}" for w in lost)
            reason = "reduction='fsdp' keeps one copy of each parameter shard and a lost member held some"
            ctl.coord.event("fallback_restart", step=ctl.last_step, reason=reason, failed=sorted(failed))
            raise FallbackRestart(f"{lost_desc} at step {ctl.last_step}: {reason}. Resume from the last checkpoint "
                                  f"(--resume RUN_DIR; --checkpoint-every N keeps one)")
        if ctl.stages is not None and ctl.redundancy and any(w not in failed for w in ctl.members):
            self.fail_over(failed)  # per pipeline replica: fail over, leave whole, or fall back
            return
        first = now
        if self.storm is not None:
            first, failed = self.storm[0], {**self.storm[2], **failed}
        if gather and (self.storm is not None or ctl.phase is Phase.RECOVERING
                       or len(ctl.members) >= STORM_MIN_WORKERS):
            # A loss while the recovery from another has not formed, or in a large fleet: a storm
            # may be under way (many workers dying in the same second). The generation is aborted
            # at once (its members stop waiting for the dead), and the next is published when the
            # losses stop (:meth:`settle`).
            ctl.abort(ctl.generation)
            self.storm = (first, now, failed)
            return
        self.storm = None
        self.recover(failed)

    def settle(self, now: float) -> bool:
        """While a storm is gathered: publish its one generation once no loss came for
        :data:`STORM_SETTLE_S` (at the latest :data:`STORM_MAX_S` after its first). True while the
        storm holds the membership (no other change)."""
        if self.storm is None:
            return False
        first, last, failed = self.storm
        if now - last < STORM_SETTLE_S and now - first < STORM_MAX_S:
            return True
        self.storm = None
        self.recover(failed)
        return True

    def recover(self, failed: dict[int, str]) -> None:
        """The next generation without the ``failed`` members (a recovery or a hold), or the end."""
        ctl = self.ctl
        decision = decide_loss(members=ctl.members, failed=failed, stages=ctl.stages,
                               pids={w: ctl.launcher.pid(w) for w in failed}, replace_failed=ctl.replace_failed,
                               target=ctl.target, min_workers=ctl.min_workers, step=ctl.last_step,
                               checkpointed=ctl.checkpointed)
        ctl.abort(ctl.generation)
        if isinstance(decision, GiveUp):
            raise JobFailed(decision.message)
        ctl.target = decision.target
        for _ in range(decision.replacements):
            ctl.new_worker()
        ctl.publish_next(list(decision.members), kind="hold" if decision.hold else "failure", hold=decision.hold,
                         detail={"failed": sorted(failed), "causes": failed})

    def _record(self, wid: int, cause: str, now: float) -> None:
        """One failed worker: its record and event, forgotten by the controller's bookkeeping,
        and fenced when it was killed for silence."""
        ctl = self.ctl
        pid = ctl.launcher.pid(wid)
        role = "member" if wid in ctl.members else "newcomer"
        ctl.failures.append({"worker": wid, "cause": cause, "generation": ctl.generation, "time": now})
        ctl.coord.event("failure", worker=wid, pid=pid, role=role, cause=cause, generation=ctl.generation,
                        step=ctl.last_step)
        logger.warning("worker %d (pid %s, %s) %s at step %d", wid, pid, role, cause, ctl.last_step)
        ctl.pending.pop(wid, None)
        if wid in ctl.ready:
            ctl.ready.remove(wid)
        ctl.liveness.forget(wid)
        if wid in ctl.liveness.fenced:
            # Silent, not seen dead: it may be cut off and come back (a healed partition).
            # Whatever it sends from now on is refused, and where it looks for its next
            # generation it finds a signed "fail": it exits instead of waiting.
            ctl.coord.fence(wid, ctl.assigned.get(wid, -1), cause)
            ctl.coord.point(wid, ctl.assigned.get(wid, -1), protocol.FAIL)

    def fail_over(self, failed: dict[int, str]) -> None:
        """Bamboo: pipeline replicas lost workers; carries out :func:`.failover.decide_failover`'s
        decision (a failover, whole replicas leaving, or a fallback ending the run)."""
        ctl = self.ctl
        decision = decide_failover(stages=ctl.stages, members=ctl.members, layout=ctl.layout,
                                   formed=ctl.formed_layout, replace_failed=ctl.replace_failed,
                                   dead={f["worker"] for f in ctl.failures} | set(failed), tensor=ctl.tensor)
        ctl.abort(ctl.generation)
        if isinstance(decision, FallBack):
            lost_desc = "; ".join(f"worker {w} {c}" for w, c in failed.items())
            ctl.coord.event("fallback_restart", step=ctl.last_step, reason=decision.reason, failed=sorted(failed))
            ctl.bamboo_events.append({"kind": "fallback_restart", "step": ctl.last_step, "reason": decision.reason})
            raise FallbackRestart(
                f"{lost_desc} at step {ctl.last_step}: {decision.reason}, so redundancy cannot cover the loss. "
                f"Resume from the last checkpoint (--resume RUN_DIR; --checkpoint-every N keeps one)"
            )
        self.record_failover(decision, failed=sorted(failed))
        self.carry_out_failover(decision, kind=decision.kind, command=False,
                                detail={"failed": sorted(failed), "causes": failed})

    def carry_out_failover(self, d: Failover, *, kind: str, command: bool, detail: dict[str, Any]) -> None:
        """Start the failover's replacements and publish its generation in its layout."""
        ctl = self.ctl
        for _ in range(d.replacements):
            ctl.new_worker()
        ctl.target = d.target
        ctl.layout = d.layout  # in the record (members re-lay their stages from it)
        ctl.publish_next(list(d.members), kind=kind, hold=False, command=command, detail=detail)
        ctl.layout = d.layout_after

    def record_failover(self, d: Failover, **fields: Any) -> None:
        """One ``failover`` event per replica that covered a loss (its index and new layout), one
        warning per replica that leaves whole."""
        ctl = self.ctl
        for left in d.left:
            logger.warning("pipeline replica %d (workers %s) leaves whole: %s", left.replica, list(left.workers),
                           left.reason)
            ctl.coord.event("replica_left", step=ctl.last_step, replica=left.replica, workers=list(left.workers),
                            reason=left.reason)
        for c in d.covered:
            extra = {"replica": c.replica} if c.numbered else {}
            ctl.coord.event("failover", step=ctl.last_step, taken_over=c.taken_over, layout=c.layout,
                            **extra, **fields)
            ctl.bamboo_events.append({"kind": "failover", "step": ctl.last_step, "layout": c.layout,
                                      **extra, **fields})

    def retry_broken(self, now: float) -> None:
        """A member reported the current generation broken but no worker was found dead or
        silent (e.g. a collective timed out): after a heartbeat timeout's grace, form the next
        generation with everyone alive. Bounded: repeated breaks without progress fail the job."""
        ctl = self.ctl
        if self.fault_at is None or now - self.fault_at < ctl.heartbeat_timeout_s or ctl.stalled:
            return
        self.fault_at = None
        self.retries += 1
        if self.retries > MAX_RETRIES:
            raise JobFailed(
                f"generation {ctl.generation} broke {self.retries} times without a lost worker and without "
                f"progress; see the fault events in events.jsonl and the worker logs"
            )
        ctl.abort(ctl.generation)
        ctl.publish_next(list(ctl.members), kind="failure", hold=ctl.hold,
                         detail={"failed": [], "causes": {}, "retry": self.retries})
