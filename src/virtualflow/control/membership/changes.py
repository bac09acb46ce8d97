"""The membership controller's planned changes: resizes, holds, rebalances, preemption notices
and Bamboo's reconfigurations, one at a time.

:class:`ChangePlanner` carries out the pure decisions of :mod:`.sizing` (resize, hold, release),
:mod:`.failover` (shrink, reconfigure, planned failover) and :mod:`.speed` (rebalance) for its
controller, once the last published generation has formed.

Invariants: nothing is planned while a published generation has not formed; a noticed member is
released before anything else; newcomers join a generation only once ready (they reported
``join``). It holds only whether an uncovered notice was already reported; every generation is
published by the controller.
"""

from __future__ import annotations

import logging

from virtualflow.comm import protocol
from virtualflow.control.membership.decisions import (FallBack, GiveUp, Grow, NoChange, Rebalance, Resume, Shrink,
                                                      StartWorkers)
from virtualflow.control.membership.failover import decide_planned_failover, decide_reconfigure, decide_shrink
from virtualflow.control.membership.interface import JobFailed
from virtualflow.control.membership.losses import LossHandler
from virtualflow.control.membership.roster import Roster
from virtualflow.control.membership.sizing import decide_hold, decide_release, decide_resize

logger = logging.getLogger(__name__)


class ChangePlanner:
    """Planned changes of one controller's membership (see the module docstring)."""

    def __init__(self, ctl: Roster, losses: LossHandler) -> None:
        self.ctl = ctl
        self.losses = losses
        """Bamboo's planned failover is recorded and carried out as a loss's (:mod:`.losses`)."""
        self.notice_uncovered = False  # an uncovered preemption notice was reported (once)

    def plan(self, now: float) -> None:
        """Publish the next planned change, if any is due."""
        ctl = self.ctl
        if ctl.busy:
            return
        if self._release_noticed() or self._reconfigure():
            return
        size = len(ctl.members)
        if ctl.hold:
            self._plan_hold(now)
        elif ctl.target == size:
            if ctl.balance:
                decision = ctl.speed_policy.check(ctl.generation, ctl.members, ctl.assignment, ctl.vn_sizes)
                if isinstance(decision, Rebalance):
                    ctl.publish_next(list(ctl.members), kind="rebalance", hold=False, command=True,
                                     detail=decision.detail, counts=decision.revert_to)
        elif ctl.target < size and ctl.layout is not None:  # Bamboo, failed over: whole replicas leave
            shrink = decide_shrink(stages=ctl.stages, members=ctl.members, layout=ctl.layout, target=ctl.target,
                                   tensor=ctl.tensor)
            ctl.target = shrink.target
            if shrink.removed:
                ctl.layout = shrink.layout
                ctl.publish_next(list(shrink.members), kind="shrink", hold=False, command=True,
                                 detail={"from": size, "to": shrink.target, "removed": list(shrink.removed)})
                ctl.layout = shrink.layout_after
        else:
            self._resize(size)

    def _resize(self, size: int) -> None:
        """Towards the target: start missing workers and add the ready ones, or drop the last."""
        ctl = self.ctl
        resize = decide_resize(members=ctl.members, ready=ctl.ready, target=ctl.target)
        if isinstance(resize, Grow):
            self.start_missing(resize.need)
            if resize.added:
                ctl.ready = ctl.ready[len(resize.added):]
                ctl.publish_next(list(resize.members), kind="grow", hold=False, command=True,
                                 detail={"from": size, "to": ctl.target, "added": list(resize.added)})
        elif isinstance(resize, Shrink):
            ctl.publish_next(list(resize.members), kind="shrink", hold=False, command=True,
                             detail={"from": size, "to": ctl.target, "removed": list(resize.removed)})

    def _plan_hold(self, now: float) -> None:
        """Holding: carries out :func:`.sizing.decide_hold` (resume, give up, or start workers)."""
        ctl = self.ctl
        decision = decide_hold(members=ctl.members, ready=ctl.ready, target=ctl.target,
                               min_workers=ctl.min_workers, timeout_s=ctl.min_workers_timeout_s,
                               held_s=now - ctl.hold_since if ctl.hold_since is not None else None,
                               replace_failed=ctl.replace_failed, checkpoint=ctl.hold_checkpoint,
                               step=ctl.last_step)
        if isinstance(decision, Resume):
            ctl.ready = ctl.ready[len(decision.added):]
            ctl.publish_next(list(decision.members), kind="resume", hold=False, command=False)
        elif isinstance(decision, GiveUp):
            for w in ctl.members:
                ctl.coord.point(w, ctl.assigned[w], protocol.FAIL)
            raise JobFailed(decision.message)
        elif isinstance(decision, StartWorkers):
            self.start_missing(decision.count)

    def _reconfigure(self) -> bool:
        """Bamboo: ready newcomers take back the stages a failover gave to other workers
        (:func:`.failover.decide_reconfigure`). Returns whether a generation was published."""
        ctl = self.ctl
        d = decide_reconfigure(stages=ctl.stages, members=ctl.members, layout=ctl.layout, ready=ctl.ready,
                               tensor=ctl.tensor)
        if isinstance(d, NoChange):
            return False
        ctl.ready = ctl.ready[len(d.added):]
        ctl.layout = d.layout  # in the record even when standard: every member re-lays its stages
        layout = [list(r) for r in d.layout]
        ctl.coord.event("reconfigure", step=ctl.last_step, added=list(d.added), layout=layout)
        ctl.bamboo_events.append({"kind": "reconfigure", "step": ctl.last_step, "added": list(d.added),
                                  "layout": [list(r) for r in d.layout]})
        ctl.publish_next(list(d.members), kind="reconfigure", hold=False, command=True,
                         detail={"added": list(d.added)})
        ctl.layout = d.layout_after
        return True

    def _release_noticed(self) -> bool:
        """Publish a generation without the members that got a preemption notice (a planned
        shrink: every member regroups at the same step boundary; a pipelined job loses the
        noticed worker's whole replica, a redundant one fails over). With ``replace_failed`` the
        target stays, so replacements start. Returns whether a generation was published."""
        ctl = self.ctl
        noticed = [w for w in ctl.noticed if w in ctl.members]
        ctl.noticed = noticed
        if not noticed:
            return False
        if ctl.stages is not None and ctl.redundancy:
            return self._planned_failover(noticed)
        release = decide_release(members=ctl.members, noticed=noticed, stages=ctl.stages,
                                 min_workers=ctl.min_workers)
        if isinstance(release, NoChange):
            return False  # nothing to hand over to: the notice runs out and the loss is a failure
        target = ctl.target
        ctl.noticed = []
        ctl.publish(list(release.members), kind="preempted", detail={"noticed": noticed,
                                                                     "removed": list(release.removed)})
        if ctl.replace_failed:
            ctl.target = target  # replacements start and the job grows back (plan)
        return True

    def _planned_failover(self, noticed: list[int]) -> bool:
        """Bamboo, on a preemption notice: carries out :func:`.failover.decide_planned_failover`.
        A notice no replica survives is not acted on: the notice runs out and the loss is judged
        then (a fallback naming the checkpoint)."""
        ctl = self.ctl
        d = decide_planned_failover(stages=ctl.stages, members=ctl.members, layout=ctl.layout, noticed=noticed,
                                    replace_failed=ctl.replace_failed, min_workers=ctl.min_workers,
                                    tensor=ctl.tensor)
        if isinstance(d, FallBack):
            if not self.notice_uncovered:
                self.notice_uncovered = True
                ctl.coord.event("preemption_uncovered", step=ctl.last_step, noticed=noticed, reason=d.reason)
                logger.warning("preemption notice for worker(s) %s not acted on: %s", noticed, d.reason)
            return False
        ctl.noticed = []
        self.losses.record_failover(d, failed=[], noticed=sorted(noticed))
        self.losses.carry_out_failover(d, kind="preempted", command=True,
                                      detail={"noticed": sorted(noticed), "removed": list(d.dropped)})
        return True

    def start_missing(self, need: int) -> None:
        """Start workers until ``need`` are ready or starting."""
        ctl = self.ctl
        for _ in range(need - len(ctl.ready) - len(ctl.pending)):
            ctl.new_worker()
