"""The membership controller: turns reports, exits, heartbeats and requests into generations.

Rules it enforces (its phases: :mod:`.phases`; its policies: :mod:`.speed`, :mod:`.failover`,
:mod:`.sizing`, :mod:`.watchdog`; the hands that carry their decisions out: :mod:`.hangs`,
:mod:`.losses`, :mod:`.changes`):

* **Newcomers join ready.** A worker started for a grow is added to a generation only after it
  has reported ``join`` (job, data and model built): survivors never wait for a start-up.
* **One planned change at a time.** A resize is published as generation ``g+1`` plus a
  ``regroup`` command; the next is considered once ``g+1`` has formed (phase ``training``).
  Failures are handled at once, whatever is in flight.
* **Failures.** A worker that exits unexpectedly, or whose heartbeat is silent for
  ``heartbeat_timeout_s`` (it is then killed: fencing), is removed; generation ``g`` is marked
  aborted and the survivors get ``g+1`` (phase ``recovering``), where they redo the
  interrupted step. Losses that come together (a storm: a loss while the recovery has not
  formed, or any loss among 32 members or more) are answered with one generation once they stop
  (:mod:`.losses`). A fenced worker may still be alive (cut off by a partition, on a machine
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
from virtualflow.control.membership.changes import ChangePlanner
from virtualflow.control.membership.failover import member_runs
from virtualflow.control.membership.hangs import HangGuard
from virtualflow.control.membership.interface import WorkerLauncher, check_resize
from virtualflow.control.membership.liveness import Liveness
from virtualflow.control.membership.losses import LossHandler
from virtualflow.control.membership.phases import RECOVERY_KINDS, Change, Phase, phase_of_change
from virtualflow.control.membership.speed import SpeedPolicy
from virtualflow.control.membership.watchdog import AUTO_FLOOR_S, StepWatchdog
from virtualflow.config.options import LaunchOptions
from virtualflow.plan.hetero import SpeedModel
from virtualflow.plan.vnmap import contiguous_assignment

logger = logging.getLogger(__name__)

_UNFORMED = (Phase.FORMING, Phase.CHANGING, Phase.RECOVERING)


class MembershipController:
    """Turns reports, exits, heartbeats and requests into generations (see the module docstring).

    Its settings come from the job's :class:`~virtualflow.config.options.LaunchOptions` (starting
    workers, ``min_workers``, timeouts, ``replace_failed``, speed-based mapping and worker
    specs); the keyword arguments are the job's shape (``stages`` for a pipelined job: workers
    per replica, ``tensor`` of them per stage; ``redundancy`` for Bamboo's redundant stages, ``last_step`` the step a resumed run starts
    at) and the controller's own tuning. Everything is given here: nothing configures it later.

    It is the membership's one actor: it holds the fields every rule reads and writes (members,
    assigned pointers, the phase and the change in flight), folds in the reports and publishes
    every generation through one path (:meth:`publish_next`). Its collaborators act on those
    fields by rule: :attr:`hangs` (:mod:`.hangs`: stalled steps, unformed generations),
    :attr:`losses` (:mod:`.losses`: lost workers, broken generations) and :attr:`changes`
    (:mod:`.changes`: planned resizes, holds, notices, reconfigurations); the decisions are the
    pure policies' (:mod:`.speed`, :mod:`.failover`, :mod:`.sizing`, :mod:`.watchdog`), exits and
    heartbeats :mod:`.liveness`'s.
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
        tensor: int = 1,
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
        self.stages = stages
        """Set for a pipelined job: resizes go in whole replicas of this many stages."""
        self.redundancy = redundancy
        self.shards_die_with_members = options.reduction == "fsdp"
        """Sharded parameters keep one copy of each shard: a lost member takes part of the model
        with it, so the run falls back to its last checkpoint (:class:`FallbackRestart`)."""
        """A pipelined job with Bamboo's redundant stages: a replica that loses a worker fails
        over (:mod:`.failover`) instead of ending."""
        self.tensor = tensor
        """``Pipeline.tensor``: a stage is a group of this many consecutive members (a failover
        judges and lays out tensor groups, :mod:`.failover`)."""
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
        self.formed_layout: tuple[list[int], tuple[tuple[int, ...], ...] | None] | None = None
        """Members and layout of the last generation that formed: what the workers really hold
        (a failover decides from it, so losses in quick succession are judged together)."""
        self.bamboo_events: list[dict[str, Any]] = []
        """Failovers, reconfigurations and fallbacks so far (kind, step, layout): for the status."""
        self.next_id = 0
        self.assigned: dict[int, int] = {}  # worker -> last generation it was assigned to (-1: none)
        self.pending: dict[int, float] = {}  # started, not yet joined -> start time
        self.ready: list[int] = []  # joined, not in any generation yet
        self.joined: set[int] = set()
        self.liveness = Liveness(launcher, self.store, self.heartbeat_timeout_s)  # exits, heartbeats: who is gone
        self.watchdog = StepWatchdog(options.step_timeout_s if options.control_plane else 0.0,
                                     floor_s=max(AUTO_FLOOR_S, options.collective_timeout_s))
        """Step progress: a run hung in the job's own code (:mod:`.watchdog`). Off without the control
        plane (nobody can be told to abort); its automatic floor follows ``collective_timeout_s``: a
        gap between steps that long (rank 0 evaluating or checkpointing alone) the peers accept."""
        self.hangs = HangGuard(self, options.heartbeat_timeout_s)
        """Stalled steps, unformed generations, wedged members (:mod:`.hangs`)."""
        self.losses = LossHandler(self, max_newcomer_failures)
        """Lost workers and broken generations (:mod:`.losses`)."""
        self.changes = ChangePlanner(self, self.losses)
        """Resizes, holds, rebalances, notices, reconfigurations (:mod:`.changes`)."""
        self._change: Change | None = None
        self.failures: list[dict[str, Any]] = []
        self.predicted_step_s: float | None = None
        self.vn_sizes: list[int] | None = None
        self.speed_policy = _speed_policy(options, virtual_nodes, global_batch_size, assign, rebalance_threshold,
                                          rebalance_patience, min_observations, speed_window, tensor)

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
    def stalled(self) -> bool:
        """The formed generation was aborted for a stall and its members are being judged."""
        return self.hangs.stall is not None

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
        ids = [self.new_worker() for _ in range(self.target)]
        self.publish_next(ids, kind="start", hold=False)

    def new_worker(self) -> int:
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
        failed, gather = self.liveness.judge(now, self.finished), True
        if not failed and not self.finished:
            failed, gather = self.hangs.check(now), False
        if failed and not self.finished:
            self.losses.on_failures(failed, now, gather=gather)
        elif not self.finished and not self.losses.settle(now):
            self.losses.retry_broken(now)
            self.changes.plan(now)

    def _on_report(self, r: dict[str, Any], now: float) -> None:
        """One worker report. Reports reach the controller checked (signature, sequence and the
        schema of their type in :mod:`virtualflow.comm.protocol`): :meth:`Coordinator.poll`
        drops and logs the rest, so the fields used here are present and of their type."""
        kind, wid = r.get("type"), r.get("worker")
        if isinstance(wid, int):
            self.hangs.heard[wid] = now
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
                self.formed_layout = (list(self.members), self.layout)
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
                self.hangs.training, self.hangs.faulted = list(r["members"]), set()
            if g == self.generation and self.phase in _UNFORMED:  # a hold generation formed: still holding
                self._enter(Phase.TRAINING, f"generation {g} formed")
        elif kind == "fault":
            # A member saw the generation break: tell the others at once, so that none of them
            # waits out a collective timeout on a peer that has already given up.
            self.abort(r["generation"])
            if r["generation"] == self.formed:
                self.hangs.faulted.add(wid)
            if r["generation"] == self.generation and self.losses.fault_at is None:
                self.losses.fault_at = now
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
            if r["step"] + 1 > self.last_step:  # a new step (not one re-sent after a regroup)
                self.liveness.stepped(r.get("members") or (), now)
                self.watchdog.step(now)
                if self.hangs.form_since is not None:  # the old generation still trains (a planned change)
                    self.hangs.form_since = now
            self.last_step = max(self.last_step, r["step"] + 1)
            if r.get("generation") == self.generation:
                self.losses.retries = 0
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

    # -- publishing -----------------------------------------------------------------------------
    def publish(self, members: list[int], *, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Publish a generation with exactly ``members`` (in rank order) and tell the current
        members to regroup at the next step boundary: for deciders that need "these members"
        rather than "the first n" (the autoscaler replacing a straggler). The target follows."""
        self.target = len(members)
        self.publish_next(list(members), kind=kind, hold=False, command=True, detail=detail)

    def publish_next(self, members: list[int], *, kind: str, hold: bool, command: bool = False,
                 detail: dict[str, Any] | None = None, counts: Sequence[int] | None = None) -> None:
        """Publish generation ``g+1`` of ``members`` (VN map: ``counts`` per member when given, else
        the speed policy's: per pipeline replica for a pipelined job), point every
        member at it, send the leavers away, and enter the change's phase."""
        g = self.generation + 1
        if self.stages is not None:  # pipelined: VN shares per replica (after a failover, by stages run)
            runs, sizes = member_runs(self.layout, len(members), self.stages, self.tensor)
            plan = self.speed_policy.plan_pipeline_map(members, runs, sizes, balance=self.balance, counts=counts)
            assignment, self.predicted_step_s, self.vn_sizes = plan.assignment, plan.predicted_step_s, None
        else:
            self.predicted_step_s, self.vn_sizes = None, None
            plan = self.speed_policy.plan_map(members, balance=self.balance, counts=counts)
            assignment, self.predicted_step_s, self.vn_sizes = plan.assignment, plan.predicted_step_s, plan.vn_sizes
        previous = list(self.members)
        self.coord.publish_generation(g, members, assignment, self.last_step, hold=hold, reason=kind,
                                      vn_sizes=self.vn_sizes,
                                      layout=[list(r) for r in self.layout] if self.layout is not None else None)
        # Every pointer in one store call (W members: one round trip, not W); a set for the
        # leavers (a list made this loop O(W^2)).
        pointers = [(w, self.assigned.get(w, -1), str(g)) for w in members]
        staying = set(members)
        for w in members:
            self.assigned[w] = g
        for w in previous:
            if w not in staying and w not in self.liveness.gone:
                self.liveness.leave(w)
                pointers.append((w, self.assigned[w], f"{protocol.LEAVE} {g}"))
        self.coord.point_many(pointers)
        self.members, self.assignment, self.generation = list(members), assignment, g
        self.hold_since = self.clock() if hold and self.hold_since is None else (self.hold_since if hold else None)
        self._change = Change(g, kind, self.clock(), dict(detail or {}))
        if self.predicted_step_s is not None:
            self._change.detail["predicted_step_s"] = self.predicted_step_s
        if hold or kind in RECOVERY_KINDS or kind == "start" or self.phase not in (Phase.TRAINING, Phase.CHANGING):
            self.watchdog.idle()  # nothing trains until it forms (a planned change trains on meanwhile)
        self.losses.fault_at = None
        self.hangs.stall = None
        self.hangs.form_since = self.clock()
        self.speed_policy.new_generation(g)
        self._enter(phase_of_change(kind, hold=hold), f"{kind} generation {g} of {len(members)} published")
        if command:
            self.coord.command("regroup", generation=g)

    def abort(self, generation: int) -> None:
        """Declare ``generation`` broken (:meth:`Coordinator.abort
        <virtualflow.control.coordinator.Coordinator.abort>`), marking the watched heartbeats."""
        self.coord.abort(generation, beating=self.liveness.watched())

    # -- status ---------------------------------------------------------------------------------
    def worker_table(self) -> list[dict[str, Any]]:
        """``status.json``'s workers: O(W) (the speeds are estimated once for the table, not once
        per row: that made each status write O(W^2), 65,536 medians at W = 256)."""
        rows = []
        times, members = self.time_per_vn, set(self.members)
        for rank, w in enumerate(self.members):
            rows.append({"id": w, "pid": self.launcher.pid(w), "rank": rank, "vns": self.assignment[rank],
                         "state": "member" if w in self.joined else "starting",
                         "time_per_vn_s": times.get(w)})
        for w in self.ready:
            rows.append({"id": w, "pid": self.launcher.pid(w), "rank": None, "vns": [], "state": "ready"})
        for w in self.pending:
            if w not in members:
                rows.append({"id": w, "pid": self.launcher.pid(w), "rank": None, "vns": [], "state": "starting"})
        return rows


def _speed_policy(options: LaunchOptions, virtual_nodes: int, global_batch_size: int | None,
                  assign: Callable[[int, int], list[list[int]]], threshold: float, patience: int,
                  min_observations: int, window: int, tensor: int = 1) -> SpeedPolicy:
    """The controller's speed policy (:mod:`.speed`), from the options' worker specs; ``tensor``:
    a pipelined job's workers per stage (its replicas' time model groups them)."""
    return SpeedPolicy(
        virtual_nodes=virtual_nodes, global_batch_size=global_batch_size, uneven=options.uneven_vn_sizes,
        memory_limits={i: s.memory_limit for i, s in enumerate(options.specs)}, assign=assign,
        threshold=threshold, patience=patience, min_observations=min_observations,
        window=window, slowdowns={i: s.slowdown for i, s in enumerate(options.specs)}, tensor=tensor)


def finished_why(steps: Any, stop_request: str | None) -> str:
    """Why the job finished, for the log line and the ``membership_phase`` event: its last step
    is done, or it was stopped (Ctrl-C, SIGTERM, ``stop()``, a callback) after ``steps`` steps."""
    if stop_request is None:
        return "the job's last step is done"
    return f"stopped after {steps} steps: {stop_request}"
