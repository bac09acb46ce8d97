"""The membership controller: turns reports, exits, heartbeats and requests into generations.

Rules it enforces (its phases: :mod:`.phases`; its policies: :mod:`.speed`, :mod:`.failover`):

* **Newcomers join ready.** A worker started for a grow is added to a generation only after it
  has reported ``join`` (job, data and model built): survivors never wait for a start-up.
* **One planned change at a time.** A resize is published as generation ``g+1`` plus a
  ``regroup`` command; the next is considered once ``g+1`` has formed (phase ``training``).
  Failures are handled at once, whatever is in flight.
* **Failures.** A worker that exits unexpectedly, or whose heartbeat is silent for
  ``heartbeat_timeout_s`` (it is then killed: fencing), is removed; generation ``g`` is marked
  aborted and the survivors get ``g+1`` (phase ``recovering``), where they redo the
  interrupted step. A fenced worker may still be alive (cut off by a partition, on a machine
  the launcher cannot kill on): the coordinator refuses its reports from then on and its next
  pointer says ``fail``, so when it comes back it writes nothing that counts and exits.
* **Hangs in the job's own code.** A worker blocked in a callback or its data keeps beating; the
  step watchdog (:mod:`.watchdog`) notices that no step came within the run's limit
  (``step_timeout_s``), aborts the generation, and judges the members that did not answer the
  abort within a grace *wedged*: they are killed and fenced like silent ones and removed as
  failed. A published generation that does not form within the first-step allowance fails the
  same way (its silent members wedged, else the job), never an endless ``recovering``.
* **Pipelines.** A pipelined job keeps whole replicas: a replica that lost a worker leaves whole.
  With Bamboo's redundancy each hit replica fails over instead (:mod:`.failover`); only a
  replica that cannot cover its loss leaves, and the job falls back to a restart when none is
  left.
* **min_workers.** With fewer survivors than ``min_workers`` the next generation is a *hold*
  (phase ``holding``): members form it, checkpoint, and wait. Once enough workers are ready
  (``replace_failed`` or a resize), training resumes; after ``min_workers_timeout_s`` the job
  fails with the checkpoint named in the error.
* **Heterogeneous workers** (``balance=True``). VNs are mapped by measured speed and rebalanced
  as speeds drift; see :mod:`.speed` (the policy decides, the controller publishes).
* **Next pointers.** Every member's next generation is written to ``vf/member/<id>/next/<g>``
  for the last generation ``g`` it was assigned to, so a worker that abandons ``g`` for any
  reason (planned regroup, broken collective, aborted rendezvous) always finds where to go.

It starts and kills workers only through the :class:`~.interface.WorkerLauncher` it is given (a
backend), so it runs unchanged over the local backend, Ray, or a fake in tests.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from virtualflow.comm import protocol
from virtualflow.control.membership.decisions import (FallBack, Failover, GiveUp, Grow, NoChange, Rebalance, Resume,
                                                      Shrink, StartWorkers)
from virtualflow.control.membership.failover import (decide_failover, decide_planned_failover, decide_reconfigure,
                                                     decide_shrink, replica_layouts)
from virtualflow.control.membership.interface import FallbackRestart, JobFailed, WorkerLauncher, check_resize
from virtualflow.control.membership.liveness import Liveness
from virtualflow.control.membership.phases import RECOVERY_KINDS, Change, Phase, phase_of_change
from virtualflow.control.membership.sizing import decide_hold, decide_loss, decide_release, decide_resize
from virtualflow.control.membership.speed import SpeedPolicy
from virtualflow.control.membership.watchdog import (AUTO_FLOOR_S, Stalled, StepWatchdog, Wedged, decide_unformed,
                                                     decide_wedged)
from virtualflow.config.options import LaunchOptions
from virtualflow.plan.hetero import SpeedModel
from virtualflow.plan.vnmap import contiguous_assignment

logger = logging.getLogger(__name__)

_UNFORMED = (Phase.FORMING, Phase.CHANGING, Phase.RECOVERING)


class MembershipController:
    """Turns reports, exits, heartbeats and requests into generations (see the module docstring).

    Its settings come from the job's :class:`~virtualflow.config.options.LaunchOptions` (starting
    workers, ``min_workers``, timeouts, ``replace_failed``, speed-based mapping and worker
    specs); the keyword arguments are the job's shape (``stages`` for a pipelined job,
    ``redundancy`` for Bamboo's redundant stages, ``last_step`` the step a resumed run starts
    at) and the controller's own tuning. Everything is given here: nothing configures it later.

    Size: about 620 lines in one class on purpose: it is the membership's one actor, and every
    rule above reads and writes the same fields (members, assigned pointers, the phase and the
    change in flight) and publishes through one path (:meth:`_publish`); what needs none of
    them is elsewhere: the decisions in the pure policies (:mod:`.speed`, :mod:`.failover`,
    :mod:`.sizing`, :mod:`.watchdog`), exits and heartbeats in :mod:`.liveness`.
    """

    def __init__(
        self,
        coordinator: Any,
        launcher: WorkerLauncher,
        options: LaunchOptions,
        *,
        virtual_nodes: int,
        global_batch_size: int | None = None,
        stages: int | None = None,
        redundancy: bool = False,
        last_step: int = 0,
        max_newcomer_failures: int = 5,
        assign: Callable[[int, int], list[list[int]]] = contiguous_assignment,
        clock: Callable[[], float] = time.monotonic,
        rebalance_threshold: float = 0.10,
        rebalance_patience: int = 3,
        min_observations: int = 3,
        speed_window: int = 15,
    ) -> None:
        self.coord = coordinator
        self.store = coordinator.store
        self.launcher = launcher
        self.V = virtual_nodes
        self.min_workers = options.min_workers
        # Without the control plane (benchmarks) nobody beats: silence means nothing.
        self.heartbeat_timeout_s = options.heartbeat_timeout_s if options.control_plane else float("inf")
        self.replace_failed = options.replace_failed
        self.min_workers_timeout_s = options.min_workers_timeout_s
        self.max_newcomer_failures = max_newcomer_failures
        self.stages = stages
        """Set for a pipelined job: resizes go in whole replicas of this many stages."""
        self.redundancy = redundancy
        """A pipelined job with Bamboo's redundant stages: a replica that loses a worker fails
        over (:mod:`.failover`) instead of ending."""
        self.balance = options.balanced
        """VNs are mapped by measured speed (:mod:`.speed`); see :meth:`balance_by_speed`."""
        self.clock = clock
        self.phase = Phase.NEW
        """Where the membership stands (:mod:`.phases`); changed only by :meth:`_enter`."""
        self.target = options.start_workers
        self.members: list[int] = []
        self.assignment: list[list[int]] = []
        self.generation = -1
        self.formed = -1
        self.last_step = last_step
        self.hold_since: float | None = None  # when the job entered ``holding``
        self.hold_checkpoint: str | None = None  # where the members of a hold generation checkpointed
        self.checkpointed = last_step > 0
        """The run has a state to continue from: it resumed from one, or a checkpoint was written."""
        self.noticed: list[int] = []
        """Members that reported a preemption notice and have not been released yet."""
        self.layout: tuple[tuple[int, ...], ...] | None = None
        """The current generation's layout after a failover (None: one stage per member)."""
        self._formed_layout: tuple[list[int], tuple[tuple[int, ...], ...] | None] | None = None
        """Members and layout of the last generation that formed: what the workers really hold
        (a failover decides from it, so losses in quick succession are judged together)."""
        self.bamboo_events: list[dict[str, Any]] = []
        """Failovers, reconfigurations and fallbacks so far (kind, step, layout): for the status."""
        self._notice_uncovered = False
        self.next_id = 0
        self.assigned: dict[int, int] = {}  # worker -> last generation it was assigned to (-1: none)
        self.pending: dict[int, float] = {}  # started, not yet joined -> start time
        self.ready: list[int] = []  # joined, not in any generation yet
        self.joined: set[int] = set()
        self.liveness = Liveness(launcher, self.store, self.heartbeat_timeout_s)
        """Exits and heartbeats: which workers are gone (:mod:`.liveness`)."""
        # Without the control plane nobody can be told to abort: no watchdog either.
        # Its automatic floor follows collective_timeout_s: a gap between steps that long (rank 0
        # evaluating or checkpointing alone) is what the job's peers already accept.
        self.watchdog = StepWatchdog(options.step_timeout_s if options.control_plane else 0.0,
                                     floor_s=max(AUTO_FLOOR_S, options.collective_timeout_s))
        """Step progress: a run hung in the job's own code (:mod:`.watchdog`)."""
        self.wedge_grace_s = max(10.0, 2 * options.heartbeat_timeout_s)
        """After a stall's abort, how long a member has to answer before it is judged wedged."""
        self.heard: dict[int, float] = {}  # worker -> when its last report came (controller clock)
        self._stall: tuple[float, Stalled] | None = None  # the generation was aborted for a stall then
        self._form_since: float | None = None  # the formation of the published generation is timed from here
        self._training: list[int] = []  # members of the last generation that formed (the one that trains)
        self._faulted: set[int] = set()  # members that reported that generation broken
        self._change: Change | None = None
        self._failed_newcomers = 0
        self._fault_at: float | None = None  # a member reported the current generation broken
        self._retries = 0
        self.failures: list[dict[str, Any]] = []
        self.predicted_step_s: float | None = None
        self.vn_sizes: list[int] | None = None
        self.speed_policy = SpeedPolicy(
            virtual_nodes=virtual_nodes, global_batch_size=global_batch_size, uneven=options.uneven_vn_sizes,
            memory_limits={i: s.memory_limit for i, s in enumerate(options.specs)}, assign=assign,
            threshold=rebalance_threshold, patience=rebalance_patience, min_observations=min_observations,
            window=speed_window, slowdowns={i: s.slowdown for i, s in enumerate(options.specs)})

    # -- the phase ------------------------------------------------------------------------------
    def _enter(self, phase: Phase, why: str) -> None:
        """The one place the phase changes: logged as ``previous -> next`` and recorded as a
        ``membership_phase`` event (best effort: a record that no longer fits does not change
        the run's outcome). A terminal phase is never left."""
        previous = self.phase
        if phase is previous or previous.terminal:
            return
        self.phase = phase
        logger.info("membership %s -> %s (generation %d, step %d): %s", previous.value, phase.value,
                    self.generation, self.last_step, why)
        try:
            self.coord.event("membership_phase", previous=previous.value, phase=phase.value,
                             generation=self.generation, step=self.last_step, why=why)
        except OSError as exc:
            logger.warning("membership_phase event not recorded: %s", exc)

    @property
    def hold(self) -> bool:
        """The job is holding: fewer workers than ``min_workers`` (phase ``holding``)."""
        return self.phase is Phase.HOLDING

    @property
    def finished(self) -> bool:
        """The job's last step is done (phase ``finished``)."""
        return self.phase is Phase.FINISHED

    @property
    def busy(self) -> bool:
        """A published generation has not formed yet."""
        return self.formed != self.generation

    @property
    def change_in_flight(self) -> Change | None:
        """The published change whose generation has not formed yet (None when none)."""
        return self._change

    # -- what the speed policy measured (status, summary, tests) --------------------------------
    @property
    def measured_step_s(self) -> float | None:
        """Median step time of the current generation, warm-up left out (:mod:`.speed`)."""
        return self.speed_policy.measured_step_s

    @property
    def time_per_vn(self) -> dict[int, float]:
        """Each measured worker's seconds per VN (the median of its recent measurements)."""
        return self.speed_policy.time_per_vn

    @property
    def reduction_s(self) -> float:
        return self.speed_policy.reduction_s

    @property
    def speed(self) -> SpeedModel:
        return self.speed_policy.speed

    @speed.setter
    def speed(self, model: SpeedModel) -> None:
        self.speed_policy.speed = model

    @property
    def _rejected(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, float]]:
        return self.speed_policy.rejected  # kept for tests written against the one-class controller

    def _still_rejected(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
        return self.speed_policy.still_rejected(key)

    # -- start and requests ---------------------------------------------------------------------
    def start(self) -> None:
        ids = [self._new_worker() for _ in range(self.target)]
        self._publish(ids, kind="start", hold=False)

    def _new_worker(self) -> int:
        wid = self.next_id
        self.next_id += 1
        self.assigned[wid] = -1
        self.pending[wid] = self.clock()
        self.launcher.start_worker(wid)
        return wid

    def request_resize(self, workers: int, source: str = "api") -> None:
        check_resize(workers, self.V, self.min_workers, self.stages)
        self.coord.event("resize_request", workers=workers, current=len(self.members), source=source)
        logger.info("resize requested (%s): %d -> %d workers", source, len(self.members), workers)
        self.target = workers

    def balance_by_speed(self) -> None:
        """Map VNs by measured speed from the next generation on (the autoscaler's rebalance
        of a job started with balance off); the speeds are measured all along."""
        self.balance = True

    # -- the loop body --------------------------------------------------------------------------
    def tick(self, reports: Sequence[dict[str, Any]]) -> None:
        """One loop step: fold ``reports`` in, judge exits and heartbeats, then handle failures
        or plan. Raises :class:`JobFailed` when the job cannot go on; whatever it raises ends
        the job (the supervisor fails it), so the phase becomes ``failed`` first."""
        try:
            self._tick(reports)
        except Exception as exc:
            self._enter(Phase.FAILED, f"{type(exc).__name__}: {str(exc)[:200]}")
            raise

    def _tick(self, reports: Sequence[dict[str, Any]]) -> None:
        now = self.clock()
        for r in reports:
            self._on_report(r, now)
        failed = self.liveness.judge(now, self.finished)
        if not failed and not self.finished:
            failed = self._watch(now)
        if failed and not self.finished:
            self._on_failures(failed, now)
        elif not self.finished:
            self._retry_broken(now)
            self._plan(now)

    # -- hangs in the job's own code --------------------------------------------------------------
    def _watch(self, now: float) -> dict[int, str]:
        """The step watchdog and the formation bound (:mod:`.watchdog`); returns the members
        judged wedged (already killed and fenced), to be handled as failures."""
        if self._stall is not None:
            since, stalled = self._stall
            verdict = decide_wedged(members=self._training, heard=self.heard, faulted=self._faulted, since=since,
                                    now=now,
                                    grace_s=self.wedge_grace_s, stalled=stalled)
            if verdict is None:
                return {}
            self._stall = None
            if isinstance(verdict, Wedged):
                return self._wedged(verdict)
            self.watchdog.restart(now)  # every member answered: the broken generation is retried
            return {}
        if self.phase in (Phase.TRAINING, Phase.CHANGING):  # changing: the formed generation trains on
            stalled = self.watchdog.check(now)
            if stalled is not None:
                logger.warning("generation %d stalled at step %d: %s; aborting it", self.formed, self.last_step,
                               stalled.why)
                self.coord.event("stalled", generation=self.formed, step=self.last_step,
                                 waited_s=round(stalled.waited_s, 3), limit_s=stalled.limit_s, why=stalled.why)
                self.coord.abort(self.formed)
                self._stall = (now, stalled)
                return {}
        if self.busy:
            if self._form_since is None:
                return {}
            joined = [w for w in self.members if w in self.joined]
            if len(joined) < len(self.members):
                self._form_since = now  # timed from the last member's join
                return {}
            change = self._change
            decision = decide_unformed(generation=self.generation, kind=change.kind if change else "?",
                                       members=self.members, joined=joined, heard=self.heard,
                                       since=self._form_since, now=now, limit_s=self.watchdog.first_limit_s(),
                                       timeout_s=self.watchdog.timeout_s)
            if isinstance(decision, GiveUp):
                for w in self.members:
                    self.coord.point(w, self.assigned[w], protocol.FAIL)
                raise JobFailed(decision.message)
            if isinstance(decision, Wedged):
                self._form_since = now
                return self._wedged(decision)
        return {}

    def _wedged(self, verdict: Wedged) -> dict[int, str]:
        """Kill and fence the wedged members (a dead worker's treatment): their causes."""
        for w in verdict.workers:
            self.liveness.wedged(w)
            logger.warning("worker %d %s", w, verdict.causes[w])
        return dict(verdict.causes)

    def _on_report(self, r: dict[str, Any], now: float) -> None:
        """One worker report. Reports reach the controller checked (signature, sequence and the
        schema of their type in :mod:`virtualflow.comm.protocol`): :meth:`Coordinator.poll`
        drops and logs the rest, so the fields used here are present and of their type."""
        kind, wid = r.get("type"), r.get("worker")
        if isinstance(wid, int):
            self.heard[wid] = now
        if kind == "join":
            self.joined.add(wid)
            self.liveness.joined(wid, now)
            if wid in self.pending:
                started = self.pending.pop(wid)
                if self.assigned.get(wid, -1) < 0 and wid not in self.members:
                    self.ready.append(wid)
                    self.coord.event("ready", worker=wid, startup_s=now - started)
        elif kind == "formed":
            g = r["generation"]
            if g > self.formed:
                self.formed = g
            if g == self.generation and self.stages is not None:
                self._formed_layout = (list(self.members), self.layout)
            self.last_step = max(self.last_step, r["step"])
            if r.get("exchange") is not None:
                self.coord.event("exchange", generation=g, algorithm=r["exchange"], reason=r.get("exchange_reason"))
            change = self._change
            if change is not None and change.generation == g:
                self.coord.event(
                    "formed", generation=g, change=change.kind, members=r["members"], step=r["step"],
                    pause_s=now - change.t_start, group_s=r["group_s"], transfer_s=r["transfer_s"],
                    transfer_bytes=r["bytes"], source=r["source"], receivers=r["receivers"], **change.detail,
                )
                self._change = None
            if g == self.generation:
                self.watchdog.restart(now)  # the next step is the generation's first
                self._training, self._faulted = list(r["members"]), set()
            if g == self.generation and self.phase in _UNFORMED:  # a hold generation formed: still holding
                self._enter(Phase.TRAINING, f"generation {g} formed")
        elif kind == "fault":
            # A member saw the generation break: tell the others at once, so that none of them
            # waits out a collective timeout on a peer that has already given up.
            self.coord.abort(r["generation"])
            if r["generation"] == self.formed:
                self._faulted.add(wid)
            if r["generation"] == self.generation and self._fault_at is None:
                self._fault_at = now
            self.coord.event("fault", worker=wid, generation=r["generation"], phase=r["phase"],
                             step=r["step"], error=r["error"][:300])
        elif kind == "leave":
            self.coord.event("leave", worker=wid, step=r["step"])
        elif kind == "notice":
            # A preemption notice (SIGTERM to the worker, as a spot instance gets before it is
            # reclaimed): the worker keeps training until a generation without it forms at a
            # step boundary, then leaves; nothing is lost and no step is redone.
            self.coord.event("preemption_notice", worker=wid, step=r["step"])
            if wid in self.members and wid not in self.noticed:
                self.noticed.append(wid)
        elif kind == "held":
            self.coord.event("held", generation=r["generation"], step=r["step"], checkpoint=r["checkpoint"])
            self.hold_checkpoint = r["checkpoint"]
            self.checkpointed = True
        elif kind == "checkpoint":
            self.checkpointed = True
        elif kind == "step":
            if r["step"] + 1 > self.last_step:
                self.watchdog.step(now)
                if self._form_since is not None:  # the old generation still trains (a planned change)
                    self._form_since = now
            self.last_step = max(self.last_step, r["step"] + 1)
            if r.get("generation") == self.generation:
                self._retries = 0
                self._measure(r)
        elif kind == "done":
            # Every member reports done with the step count it finished at; another member's
            # done can be read before rank 0's last step report, so the step comes from here.
            if isinstance(r.get("step"), int):
                self.last_step = max(self.last_step, r["step"])
            self._enter(Phase.FINISHED, finished_why(r.get("step"), self.coord.progress.stop_request))

    def _measure(self, r: dict[str, Any]) -> None:
        """A step report of the current generation into the speed policy; once 12 steps of a
        speed-solved map are measured, its prediction is recorded against the measurement."""
        if not self.speed_policy.observe(r):
            return
        if self.predicted_step_s is not None and len(self.speed_policy.step_times) == 12:
            measured = self.measured_step_s
            self.coord.event("prediction", generation=self.generation, predicted_step_s=self.predicted_step_s,
                             measured_step_s=measured,
                             error=(self.predicted_step_s - measured) / measured if measured > 0 else None)

    # -- failures -------------------------------------------------------------------------------
    def _on_failures(self, failed: dict[int, str], now: float) -> None:
        for wid, cause in failed.items():
            pid = self.launcher.pid(wid)
            role = "member" if wid in self.members else "newcomer"
            self.failures.append({"worker": wid, "cause": cause, "generation": self.generation, "time": now})
            self.coord.event("failure", worker=wid, pid=pid, role=role, cause=cause, generation=self.generation,
                             step=self.last_step)
            logger.warning("worker %d (pid %s, %s) %s at step %d", wid, pid, role, cause, self.last_step)
            self.pending.pop(wid, None)
            if wid in self.ready:
                self.ready.remove(wid)
            self.liveness.forget(wid)
            if wid in self.liveness.fenced:
                # Silent, not seen dead: it may be cut off and come back (a healed partition).
                # Whatever it sends from now on is refused, and where it looks for its next
                # generation it finds a signed "fail": it exits instead of waiting.
                self.coord.fence(wid, self.assigned.get(wid, -1), cause)
                self.coord.point(wid, self.assigned.get(wid, -1), protocol.FAIL)
        lost = [w for w in self.members if w in failed]
        newcomers_lost = [w for w in failed if w not in self.members]
        self._failed_newcomers += len(newcomers_lost)
        if self._failed_newcomers > self.max_newcomer_failures:
            raise JobFailed(f"{self._failed_newcomers} newcomer workers failed before joining; "
                            f"see their logs (last: worker {newcomers_lost[-1]}: {failed[newcomers_lost[-1]]})")
        # A newcomer assigned to an unformed generation breaks that generation too.
        breaks = lost or any(self.assigned.get(w, -1) == self.generation and self.busy for w in newcomers_lost)
        if not breaks:
            return
        if self.stages is not None and self.redundancy and any(w not in failed for w in self.members):
            self._fail_over(failed)  # per pipeline replica: fail over, leave whole, or fall back
            return
        decision = decide_loss(members=self.members, failed=failed, stages=self.stages,
                               pids={w: self.launcher.pid(w) for w in failed}, replace_failed=self.replace_failed,
                               target=self.target, min_workers=self.min_workers, step=self.last_step,
                               checkpointed=self.checkpointed)
        self.coord.abort(self.generation)
        if isinstance(decision, GiveUp):
            raise JobFailed(decision.message)
        self.target = decision.target
        for _ in range(decision.replacements):
            self._new_worker()
        self._publish(list(decision.members), kind="hold" if decision.hold else "failure", hold=decision.hold,
                      detail={"failed": sorted(failed), "causes": failed})

    def _fail_over(self, failed: dict[int, str]) -> None:
        """Bamboo: pipeline replicas lost workers; carries out :func:`.failover.decide_failover`'s
        decision (a failover, whole replicas leaving, or a fallback ending the run)."""
        decision = decide_failover(stages=self.stages, members=self.members, layout=self.layout,
                                   formed=self._formed_layout, replace_failed=self.replace_failed,
                                   dead={f["worker"] for f in self.failures} | set(failed))
        self.coord.abort(self.generation)
        if isinstance(decision, FallBack):
            lost_desc = "; ".join(f"worker {w} {c}" for w, c in failed.items())
            self.coord.event("fallback_restart", step=self.last_step, reason=decision.reason, failed=sorted(failed))
            self.bamboo_events.append({"kind": "fallback_restart", "step": self.last_step, "reason": decision.reason})
            raise FallbackRestart(
                f"{lost_desc} at step {self.last_step}: {decision.reason}, so redundancy cannot cover the loss. "
                f"Resume from the last checkpoint (--resume RUN_DIR; --checkpoint-every N keeps one)"
            )
        self._record_failover(decision, failed=sorted(failed))
        self._carry_out_failover(decision, kind=decision.kind, command=False,
                                 detail={"failed": sorted(failed), "causes": failed})

    def _carry_out_failover(self, d: Failover, *, kind: str, command: bool, detail: dict[str, Any]) -> None:
        for _ in range(d.replacements):
            self._new_worker()
        self.target = d.target
        self.layout = d.layout  # in the record (members re-lay their stages from it)
        self._publish(list(d.members), kind=kind, hold=False, command=command, detail=detail)
        self.layout = d.layout_after

    def _record_failover(self, d: Failover, **fields: Any) -> None:
        """One ``failover`` event per replica that covered a loss (its index and new layout), one
        warning per replica that leaves whole."""
        for left in d.left:
            logger.warning("pipeline replica %d (workers %s) leaves whole: %s", left.replica, list(left.workers),
                           left.reason)
            self.coord.event("replica_left", step=self.last_step, replica=left.replica, workers=list(left.workers),
                             reason=left.reason)
        for c in d.covered:
            extra = {"replica": c.replica} if c.numbered else {}
            self.coord.event("failover", step=self.last_step, taken_over=c.taken_over, layout=c.layout,
                             **extra, **fields)
            self.bamboo_events.append({"kind": "failover", "step": self.last_step, "layout": c.layout,
                                       **extra, **fields})

    def _retry_broken(self, now: float) -> None:
        """A member reported the current generation broken but no worker was found dead or
        silent (e.g. a collective timed out): after a heartbeat timeout's grace, form the next
        generation with everyone alive. Bounded: repeated breaks without progress fail the job."""
        if self._fault_at is None or now - self._fault_at < self.heartbeat_timeout_s or self._stall is not None:
            return
        self._fault_at = None
        self._retries += 1
        if self._retries > 3:
            raise JobFailed(
                f"generation {self.generation} broke {self._retries} times without a lost worker and without "
                f"progress; see the fault events in events.jsonl and the worker logs"
            )
        self.coord.abort(self.generation)
        self._publish(list(self.members), kind="failure", hold=self.hold,
                      detail={"failed": [], "causes": {}, "retry": self._retries})

    # -- planned changes ------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        if self.busy:
            return
        if self._release_noticed() or self._reconfigure():
            return
        size = len(self.members)
        if self.hold:
            self._plan_hold(now)
        elif self.target == size:
            if self.balance:
                decision = self.speed_policy.check(self.generation, self.members, self.assignment, self.vn_sizes)
                if isinstance(decision, Rebalance):
                    self._publish(list(self.members), kind="rebalance", hold=False, command=True,
                                  detail=decision.detail, counts=decision.revert_to)
        elif self.target < size and self.layout is not None:  # Bamboo, failed over: whole replicas leave
            shrink = decide_shrink(stages=self.stages, members=self.members, layout=self.layout, target=self.target)
            self.target = shrink.target
            if shrink.removed:
                self.layout = shrink.layout
                self._publish(list(shrink.members), kind="shrink", hold=False, command=True,
                              detail={"from": size, "to": shrink.target, "removed": list(shrink.removed)})
                self.layout = shrink.layout_after
        else:
            resize = decide_resize(members=self.members, ready=self.ready, target=self.target)
            if isinstance(resize, Grow):
                self._start_missing(resize.need)
                if resize.added:
                    self.ready = self.ready[len(resize.added):]
                    self._publish(list(resize.members), kind="grow", hold=False, command=True,
                                  detail={"from": size, "to": self.target, "added": list(resize.added)})
            elif isinstance(resize, Shrink):
                self._publish(list(resize.members), kind="shrink", hold=False, command=True,
                              detail={"from": size, "to": self.target, "removed": list(resize.removed)})

    def _plan_hold(self, now: float) -> None:
        """Holding: carries out :func:`.sizing.decide_hold` (resume, give up, or start workers)."""
        decision = decide_hold(members=self.members, ready=self.ready, target=self.target,
                               min_workers=self.min_workers, timeout_s=self.min_workers_timeout_s,
                               held_s=now - self.hold_since if self.hold_since is not None else None,
                               replace_failed=self.replace_failed, checkpoint=self.hold_checkpoint,
                               step=self.last_step)
        if isinstance(decision, Resume):
            self.ready = self.ready[len(decision.added):]
            self._publish(list(decision.members), kind="resume", hold=False, command=False)
        elif isinstance(decision, GiveUp):
            for w in self.members:
                self.coord.point(w, self.assigned[w], protocol.FAIL)
            raise JobFailed(decision.message)
        elif isinstance(decision, StartWorkers):
            self._start_missing(decision.count)

    def _reconfigure(self) -> bool:
        """Bamboo: ready newcomers take back the stages a failover gave to other workers
        (:func:`.failover.decide_reconfigure`). Returns whether a generation was published."""
        d = decide_reconfigure(stages=self.stages, members=self.members, layout=self.layout, ready=self.ready)
        if isinstance(d, NoChange):
            return False
        self.ready = self.ready[len(d.added):]
        self.layout = d.layout  # in the record even when standard: every member re-lays its stages
        layout = [list(r) for r in d.layout]
        self.coord.event("reconfigure", step=self.last_step, added=list(d.added), layout=layout)
        self.bamboo_events.append({"kind": "reconfigure", "step": self.last_step, "added": list(d.added),
                                   "layout": [list(r) for r in d.layout]})
        self._publish(list(d.members), kind="reconfigure", hold=False, command=True, detail={"added": list(d.added)})
        self.layout = d.layout_after
        return True

    def _release_noticed(self) -> bool:
        """Publish a generation without the members that got a preemption notice (a planned
        shrink: every member regroups at the same step boundary; a pipelined job loses the
        noticed worker's whole replica, a redundant one fails over). With ``replace_failed`` the
        target stays, so replacements start. Returns whether a generation was published."""
        noticed = [w for w in self.noticed if w in self.members]
        self.noticed = noticed
        if not noticed:
            return False
        if self.stages is not None and self.redundancy:
            return self._planned_failover(noticed)
        release = decide_release(members=self.members, noticed=noticed, stages=self.stages,
                                 min_workers=self.min_workers)
        if isinstance(release, NoChange):
            return False  # nothing to hand over to: the notice runs out and the loss is a failure
        target = self.target
        self.noticed = []
        self.publish(list(release.members), kind="preempted", detail={"noticed": noticed,
                                                                      "removed": list(release.removed)})
        if self.replace_failed:
            self.target = target  # replacements start and the job grows back (_plan)
        return True

    def _planned_failover(self, noticed: list[int]) -> bool:
        """Bamboo, on a preemption notice: carries out :func:`.failover.decide_planned_failover`.
        A notice no replica survives is not acted on: the notice runs out and the loss is judged
        then (a fallback naming the checkpoint)."""
        d = decide_planned_failover(stages=self.stages, members=self.members, layout=self.layout, noticed=noticed,
                                    replace_failed=self.replace_failed, min_workers=self.min_workers)
        if isinstance(d, FallBack):
            if not self._notice_uncovered:
                self._notice_uncovered = True
                self.coord.event("preemption_uncovered", step=self.last_step, noticed=noticed, reason=d.reason)
                logger.warning("preemption notice for worker(s) %s not acted on: %s", noticed, d.reason)
            return False
        self.noticed = []
        self._record_failover(d, failed=[], noticed=sorted(noticed))
        self._carry_out_failover(d, kind="preempted", command=True,
                                 detail={"noticed": sorted(noticed), "removed": list(d.dropped)})
        return True

    def _start_missing(self, need: int) -> None:
        for _ in range(need - len(self.ready) - len(self.pending)):
            self._new_worker()

    # -- publishing -----------------------------------------------------------------------------
    def publish(self, members: list[int], *, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Publish a generation with exactly ``members`` (in rank order) and tell the current
        members to regroup at the next step boundary: for deciders that need "these members"
        rather than "the first n" (the autoscaler replacing a straggler). The target follows."""
        self.target = len(members)
        self._publish(list(members), kind=kind, hold=False, command=True, detail=detail)

    def _publish(self, members: list[int], *, kind: str, hold: bool, command: bool = False,
                 detail: dict[str, Any] | None = None, counts: Sequence[int] | None = None) -> None:
        """Publish generation ``g+1`` of ``members`` (VN map: ``counts`` per member when given, else
        the speed policy's: per pipeline replica for a pipelined job), point every
        member at it, send the leavers away, and enter the change's phase."""
        g = self.generation + 1
        if self.stages is not None:  # pipelined: VN shares per replica (after a failover, by stages run)
            layouts = replica_layouts(self.layout, len(members), self.stages)
            plan = self.speed_policy.plan_pipeline_map(
                members, [len(run) for rep in layouts for run in rep], [len(rep) for rep in layouts],
                balance=self.balance, counts=counts)
            assignment, self.predicted_step_s, self.vn_sizes = plan.assignment, plan.predicted_step_s, None
        else:
            self.predicted_step_s, self.vn_sizes = None, None
            plan = self.speed_policy.plan_map(members, balance=self.balance, counts=counts)
            assignment, self.predicted_step_s, self.vn_sizes = plan.assignment, plan.predicted_step_s, plan.vn_sizes
        previous = list(self.members)
        self.coord.publish_generation(g, members, assignment, self.last_step, hold=hold, reason=kind,
                                      vn_sizes=self.vn_sizes,
                                      layout=[list(r) for r in self.layout] if self.layout is not None else None)
        for w in members:
            self.coord.point(w, self.assigned.get(w, -1), str(g))
            self.assigned[w] = g
        for w in previous:
            if w not in members and w not in self.liveness.gone:
                self.liveness.leave(w)
                self.coord.point(w, self.assigned[w], f"{protocol.LEAVE} {g}")
        self.members, self.assignment, self.generation = list(members), assignment, g
        self.hold_since = self.clock() if hold and self.hold_since is None else (self.hold_since if hold else None)
        self._change = Change(g, kind, self.clock(), dict(detail or {}))
        if self.predicted_step_s is not None:
            self._change.detail["predicted_step_s"] = self.predicted_step_s
        if hold or kind in RECOVERY_KINDS or kind == "start" or self.phase not in (Phase.TRAINING, Phase.CHANGING):
            self.watchdog.idle()  # nothing trains until it forms (a planned change trains on meanwhile)
        self._fault_at = None
        self._stall = None
        self._form_since = self.clock()
        self.speed_policy.new_generation(g)
        self._enter(phase_of_change(kind, hold=hold), f"{kind} generation {g} of {len(members)} published")
        if command:
            self.coord.command("regroup", generation=g)

    # -- status ---------------------------------------------------------------------------------
    def worker_table(self) -> list[dict[str, Any]]:
        rows = []
        for rank, w in enumerate(self.members):
            rows.append({"id": w, "pid": self.launcher.pid(w), "rank": rank, "vns": self.assignment[rank],
                         "state": "member" if w in self.joined else "starting",
                         "time_per_vn_s": self.time_per_vn.get(w)})
        for w in self.ready:
            rows.append({"id": w, "pid": self.launcher.pid(w), "rank": None, "vns": [], "state": "ready"})
        for w in self.pending:
            if w not in self.members:
                rows.append({"id": w, "pid": self.launcher.pid(w), "rank": None, "vns": [], "state": "starting"})
        return rows


def finished_why(steps: Any, stop_request: str | None) -> str:
    """Why the job finished, for the log line and the ``membership_phase`` event: its last step
    is done, or it was stopped (Ctrl-C, SIGTERM, ``stop()``, a callback) after ``steps`` steps."""
    if stop_request is None:
        return "the job's last step is done"
    return f"stopped after {steps} steps: {stop_request}"
