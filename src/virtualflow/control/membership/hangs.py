"""The membership controller's watch over hangs in the job's own code: a stalled step, a
generation that does not form, the members that do not answer an abort.

:class:`HangGuard` carries out the pure verdicts of :mod:`.watchdog` for its controller: it aborts
a stalled generation, then judges after a grace which members did not answer (wedged: killed
and fenced like silent ones, returned as failures), and bounds the formation of a published
generation by the first-step allowance (its silent members wedged, else the job fails).

Invariants: it holds only the hang's own bookkeeping (when each worker was last heard, the stall
in progress, when the formation is timed from, the members that train and those that reported
the generation broken); the controller's members, phase and records are read through the
controller, and only the controller publishes.
"""

from __future__ import annotations

import logging

from virtualflow.comm import protocol
from virtualflow.control.membership.decisions import GiveUp
from virtualflow.control.membership.interface import JobFailed
from virtualflow.control.membership.phases import Phase
from virtualflow.control.membership.roster import Roster
from virtualflow.control.membership.watchdog import Stalled, Wedged, decide_unformed, decide_wedged

logger = logging.getLogger(__name__)


class HangGuard:
    """A run hung in the job's own code, for one controller (see the module docstring)."""

    def __init__(self, ctl: Roster, heartbeat_timeout_s: float) -> None:
        self.ctl = ctl
        self.wedge_grace_s = max(10.0, 2 * heartbeat_timeout_s)
        """After a stall's abort, how long a member has to answer before it is judged wedged."""
        self.heard: dict[int, float] = {}  # worker -> when its last report came (controller clock)
        self.stall: tuple[float, Stalled] | None = None  # the generation was aborted for a stall then
        self.form_since: float | None = None  # the formation of the published generation is timed from here
        self.training: list[int] = []  # members of the last generation that formed (the one that trains)
        self.faulted: set[int] = set()  # members that reported that generation broken

    def check(self, now: float) -> dict[int, str]:
        """The step watchdog and the formation bound (:mod:`.watchdog`); returns the members
        judged wedged (already killed and fenced), to be handled as failures."""
        ctl = self.ctl
        if self.stall is not None:
            since, stalled = self.stall
            verdict = decide_wedged(members=self.training, heard=self.heard, faulted=self.faulted, since=since,
                                    now=now, grace_s=self.wedge_grace_s, stalled=stalled)
            if verdict is None:
                return {}
            self.stall = None
            if isinstance(verdict, Wedged):
                return self.wedged(verdict)
            ctl.watchdog.restart(now)  # every member answered: the broken generation is retried
            return {}
        if ctl.phase in (Phase.TRAINING, Phase.CHANGING):  # changing: the formed generation trains on
            stalled = ctl.watchdog.check(now)
            if stalled is not None:
                logger.warning("generation %d stalled at step %d: %s; aborting it", ctl.formed, ctl.last_step,
                               stalled.why)
                ctl.coord.event("stalled", generation=ctl.formed, step=ctl.last_step,
                                waited_s=round(stalled.waited_s, 3), limit_s=stalled.limit_s, why=stalled.why)
                ctl.abort(ctl.formed)
                self.stall = (now, stalled)
                return {}
        if ctl.busy:
            return self._check_formation(now)
        return {}

    def _check_formation(self, now: float) -> dict[int, str]:
        """The published generation has not formed: once every member joined, bound the wait by
        the first-step allowance (:func:`.watchdog.decide_unformed`)."""
        ctl = self.ctl
        if self.form_since is None:
            return {}
        joined = [w for w in ctl.members if w in ctl.joined]
        if len(joined) < len(ctl.members):
            self.form_since = now  # timed from the last member's join
            return {}
        change = ctl.change_in_flight
        decision = decide_unformed(generation=ctl.generation, kind=change.kind if change else "?",
                                   members=ctl.members, joined=joined, heard=self.heard,
                                   since=self.form_since, now=now, limit_s=ctl.watchdog.first_limit_s(),
                                   timeout_s=ctl.watchdog.timeout_s)
        if isinstance(decision, GiveUp):
            for w in ctl.members:
                ctl.coord.point(w, ctl.assigned[w], protocol.FAIL)
            raise JobFailed(decision.message)
        if isinstance(decision, Wedged):
            self.form_since = now
            return self.wedged(decision)
        return {}

    def wedged(self, verdict: Wedged) -> dict[int, str]:
        """Kill and fence the wedged members (a dead worker's treatment): their causes."""
        for w in verdict.workers:
            self.ctl.liveness.wedged(w)
            logger.warning("worker %d %s", w, verdict.causes[w])
        return dict(verdict.causes)
