"""Membership control: who works in which generation, decided by one object in the coordinator.

The :class:`MembershipController` turns what it observes (workers' reports, process exits,
heartbeats) and what it is asked (resize requests) into generations. It starts and kills
workers only through the :class:`WorkerLauncher` it is given (a backend), so it runs
unchanged over the local backend, Ray, or a fake in tests.

Rules it enforces:

* **Newcomers join ready.** A worker started for a grow is added to a generation only after it
  has reported ``join`` (job, data and model built): survivors never wait for a start-up.
* **One planned change at a time.** A resize is published as generation ``g+1`` plus a
  ``regroup`` command; the next is considered once ``g+1`` has formed. Failures are handled at
  once, whatever is in flight.
* **Failures.** A worker that exits unexpectedly, or whose heartbeat is silent for
  ``heartbeat_timeout_s`` (it is then killed: fencing), is removed; generation ``g`` is marked
  aborted and the survivors get ``g+1``, where they redo the interrupted step.
* **Pipelines.** A pipelined job keeps whole replicas: a replica that lost a worker leaves whole.
  With Bamboo's redundancy each hit replica fails over instead (its lost worker's predecessor
  takes the stage over, :mod:`virtualflow.plan.pipeline.failover`); only a replica that cannot
  cover its loss leaves, and the job falls back to a restart when none is left.
* **min_workers.** With fewer survivors than ``min_workers`` the next generation is a *hold*:
  members form it, checkpoint, and wait. Once enough workers are ready (``replace_failed`` or a
  resize), training resumes; after ``min_workers_timeout_s`` the job fails with the checkpoint
  named in the error.
* **Heterogeneous workers** (``balance=True``). Step reports carry each rank's compute time;
  the controller keeps a noise-robust seconds-per-VN for every worker
  (:class:`virtualflow.plan.hetero.SpeedModel`: the median of its last ``speed_window``
  measurements; workers equal within the noise share one speed) and maps VNs with the exact
  solver of :mod:`virtualflow.plan.hetero` on every new generation (resize, failure), and
  re-solves as speeds drift: when the current map is predicted slower than the best one by
  more than ``rebalance_threshold`` plus the measurements' noise margin for
  ``rebalance_patience`` consecutive measured steps, a ``rebalance`` generation (same members,
  new map) is published like a resize. A rebalance is then judged by its outcome: if the new
  map's median step time is worse than the old one's by more than the threshold, the old map
  comes back (a ``rebalance`` with ``reverted``) and the rejected map is not proposed again for
  those members. Each rank's compute is taken from the step's breakdown (input + forward +
  backward) when the report carries one.
  The solver may give a worker no VN (when that is faster): it stays a member, and its engine
  keeps measuring it on a probe VN while it waits for the others, so its speed stays known and
  it gets VNs back once it is fast enough. Measurements: a report for step ``k`` carries the
  compute times of step ``k-1`` (they ride in step ``k``'s reduction), so they are paired with
  step ``k-1``'s duration from the previous report (reduction = duration - slowest compute);
  the first step of a generation (warm-up) is not measured.
* **Next pointers.** Every member's next generation is written to ``vf/member/<id>/next/<g>``
  for the last generation ``g`` it was assigned to, so a worker that abandons ``g`` for any
  reason (planned regroup, broken collective, aborted rendezvous) always finds where to go.

Size: one state machine (about 600 lines) kept in one module on purpose: its rules above share
the same fields (members, assigned pointers, the change in flight), and splitting them would
spread one invariant over several files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from virtualflow.comm import protocol
from virtualflow.options import LaunchOptions
from virtualflow.plan.hetero import SpeedModel, blocks, check_memory, check_rebalance, solve_uneven
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime import breakdown

logger = logging.getLogger("virtualflow")


class WorkerLauncher(Protocol):
    """What the controller uses of a backend (a subset of :class:`virtualflow.backends.Backend`;
    tests pass fakes)."""

    def start_worker(self, worker_id: int) -> Any: ...

    def kill_worker(self, worker_id: int) -> None: ...

    def poll(self) -> dict[int, int | None]: ...

    def pid(self, worker_id: int) -> int | None: ...


class JobFailed(RuntimeError):
    """The membership cannot go on (every worker lost, min_workers not reached in time, ...)."""


class FallbackRestart(JobFailed):
    """Bamboo: a loss redundancy cannot cover; the run is to restart from its last checkpoint."""


@dataclass(slots=True)
class Change:
    """A published generation that has not formed yet: what kind of change it is and when it
    was published (the controller's clock)."""

    generation: int
    kind: str  # start | grow | shrink | failure | hold | resume
    t_start: float
    detail: dict[str, Any] = field(default_factory=dict)


class MembershipController:
    """Turns reports, exits, heartbeats and requests into generations (see the module docstring).

    Its settings come from the job's :class:`~virtualflow.options.LaunchOptions` (starting
    workers, ``min_workers``, timeouts, ``replace_failed``, speed-based mapping and worker
    specs); the keyword arguments are the job's shape and the controller's own tuning.
    """

    def __init__(
        self,
        coordinator: Any,
        launcher: WorkerLauncher,
        options: LaunchOptions,
        *,
        virtual_nodes: int,
        global_batch_size: int | None = None,
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
        self.assign = assign
        self.noticed: list[int] = []
        """Members that reported a preemption notice and have not been released yet."""
        self.stages: int | None = None
        """Set for a pipelined job: resizes go in whole replicas of this many stages."""
        self.redundancy = False
        """A pipelined job with Bamboo's redundant stages: a single pipeline that loses a worker
        fails over (:mod:`virtualflow.plan.pipeline.failover`) instead of ending."""
        self.layout: tuple[tuple[int, ...], ...] | None = None
        """The current generation's layout after a failover (None: one stage per member)."""
        self._exited_0: set[int] = set()
        """Workers seen exiting with code 0 one tick ago (see :meth:`tick`)."""
        self.bamboo_events: list[dict[str, Any]] = []
        """Failovers, reconfigurations and fallbacks so far (kind, step, layout): for the status."""
        self._notice_uncovered = False
        self._formed_layout: tuple[list[int], tuple[tuple[int, ...], ...] | None] | None = None
        """Members and layout of the last generation that formed: what the workers really hold
        (a failover decides from it, so losses in quick succession are judged together)."""
        self.clock = clock
        self.target = options.start_workers
        self.members: list[int] = []
        self.assignment: list[list[int]] = []
        self.generation = -1
        self.formed = -1
        self.hold = False
        self.hold_since: float | None = None
        self.hold_checkpoint: str | None = None  # where the members of a hold generation checkpointed
        self.next_id = 0
        self.assigned: dict[int, int] = {}  # worker -> last generation it was assigned to (-1: none)
        self.pending: dict[int, float] = {}  # started, not yet joined -> start time
        self.ready: list[int] = []  # joined, not in any generation yet
        self.leaving: set[int] = set()
        self.gone: set[int] = set()  # exited or killed, handled
        self.joined: set[int] = set()
        self._hb: dict[int, tuple[int, float]] = {}
        self._change: Change | None = None
        self._failed_newcomers = 0
        self._fault_at: float | None = None  # a member reported a broken current generation
        self._retries = 0
        self.finished = False
        self.failures: list[dict[str, Any]] = []
        self.last_step = 0
        # Heterogeneous mapping: the profiler's smoothed seconds per VN of each worker.
        self.balance = options.balanced
        self.vn_batch = global_batch_size // virtual_nodes if global_batch_size is not None else None
        self.memory_limits = {i: s.memory_limit for i, s in enumerate(options.specs)}
        self.rebalance_threshold = rebalance_threshold
        self.rebalance_patience = rebalance_patience
        self.min_observations = min_observations
        self.speed = SpeedModel(speed_window)
        # Rebalances are judged by their outcome: the step time measured under the new map
        # against the old one's; a map that made steps slower is reverted and not tried again
        # for these members (per-VN times measured under CPU contention depend on the map).
        self._trial: dict[str, Any] | None = None
        self._rejected: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, float]] = {}
        """(members, counts) of a rebalanced map that ran slower -> the per-VN estimates it was
        rejected under; forgotten once an estimate moves by more than ``REJECT_MOVE`` (the
        workers' speeds really changed, so the old trial says nothing about the map any more)."""
        self._forced_counts: list[int] | None = None
        self.reduction_s = 0.0
        self.predicted_step_s: float | None = None
        self._obs: dict[int, int] = {}
        self._gen_step_times: list[float] = []
        self._prev_step: tuple[int, float, bool] | None = None  # (step, duration, generation's first)
        self._measured = False  # a step was measured since the last drift check
        self._drift = 0
        self.uneven = options.uneven_vn_sizes
        self.B = global_batch_size
        self.vn_sizes: list[int] | None = None
        self._cost: dict[int, dict[tuple[int, int], float]] = {}  # worker -> (VNs, samples) -> compute s

    # -- start ------------------------------------------------------------------------------
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

    # -- requests ---------------------------------------------------------------------------
    def request_resize(self, workers: int, source: str = "api") -> None:
        check_resize(workers, self.V, self.min_workers, self.stages)
        self.coord.event("resize_request", workers=workers, current=len(self.members), source=source)
        logger.info("resize requested (%s): %d -> %d workers", source, len(self.members), workers)
        self.target = workers

    @property
    def busy(self) -> bool:
        """A published generation has not formed yet."""
        return self.formed != self.generation

    @property
    def change_in_flight(self) -> Change | None:
        """The published change whose generation has not formed yet (None when none)."""
        return self._change

    @property
    def measured_step_s(self) -> float | None:
        """Median step time of the current generation, its first two steps (warm-up) left out;
        None until a third step is measured."""
        times = self._gen_step_times[2:]
        return sorted(times)[len(times) // 2] if times else None

    # -- the loop body ----------------------------------------------------------------------
    def tick(self, reports: Sequence[dict[str, Any]]) -> None:
        now = self.clock()
        for r in reports:
            self._on_report(r, now)
        failed: dict[int, str] = {}
        for wid, code in self.launcher.poll().items():
            if code is None or wid in self.gone:
                continue
            if code == 0 and not self.finished and wid not in self.leaving and wid not in self._exited_0:
                # A clean exit seen before the worker's last reports were read (rank 0 posts
                # "done" and exits at once): judge it at the next tick, after those reports.
                self._exited_0.add(wid)
                continue
            self.gone.add(wid)
            if wid in self.leaving and code == 0:
                self.leaving.discard(wid)
                continue
            if self.finished and code == 0:
                continue
            failed[wid] = _describe_exit(code)
        for wid, (count, t_seen) in list(self._hb.items()):
            if self.finished:
                break
            if wid in self.gone or wid in failed:
                self._hb.pop(wid, None)
                continue
            value = self.store.add(protocol.heartbeat_key(wid), 0)
            if value != count:
                self._hb[wid] = (value, now)
            elif now - t_seen > self.heartbeat_timeout_s:
                failed[wid] = f"stopped responding (no heartbeat for {now - t_seen:.1f} s); killed"
                self.launcher.kill_worker(wid)
                self.gone.add(wid)
        if failed and not self.finished:
            self._on_failures(failed, now)
        elif not self.finished:
            self._retry_broken(now)
            self._plan(now)

    def _on_report(self, r: dict[str, Any], now: float) -> None:
        """One worker report. Reports reach the controller checked (signature, sequence and the
        schema of their type in :mod:`virtualflow.comm.protocol`): :meth:`Coordinator.poll`
        drops and logs the rest, so the fields used here are present and of their type."""
        kind, wid = r.get("type"), r.get("worker")
        if kind == "join":
            self.joined.add(wid)
            self._hb[wid] = (self.store.add(protocol.heartbeat_key(wid), 0), now)
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
            change = self._change
            if change is not None and change.generation == g:
                self.coord.event(
                    "formed", generation=g, change=change.kind, members=r["members"], step=r["step"],
                    pause_s=now - change.t_start, group_s=r["group_s"], transfer_s=r["transfer_s"],
                    transfer_bytes=r["bytes"], source=r["source"], receivers=r["receivers"], **change.detail,
                )
                self._change = None
            if self.hold and g == self.generation:
                pass  # a hold generation formed: members checkpoint and wait
        elif kind == "fault":
            # A member saw the generation break: tell the others at once, so that none of them
            # waits out a collective timeout on a peer that has already given up.
            self.coord.abort(r["generation"])
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
        elif kind == "step":
            self.last_step = max(self.last_step, r["step"] + 1)
            if r.get("generation") == self.generation:
                self._retries = 0
                self._profile(r)
        elif kind == "done":
            self.finished = True

    # -- heterogeneous mapping --------------------------------------------------------------
    def _profile(self, r: dict[str, Any]) -> None:
        """Fold one step report into the smoothed seconds per VN of each worker and the
        reduction estimate.

        The report for step ``k`` carries each rank's compute time of step ``k-1`` (it rides in
        step ``k``'s reduction, which starts before step ``k``'s compute is over), so it is
        paired with the duration of step ``k-1``, from the previous report: both then describe
        the same step. The generation's first step is warm-up (a new group's first collectives,
        cold caches) and is not measured; a rank with no VN reports a probe VN's time, or 0.
        """
        compute, members, vns = r.get("compute_s"), r.get("members"), r.get("vns")
        if not compute or not members or len(compute) != len(members):
            return
        compute = _timed_compute(compute, members, vns, r.get("breakdown"))
        self._gen_step_times.append(r["step_time_s"])
        prev = self._prev_step
        self._prev_step = (r["step"], r["step_time_s"], max(compute) <= 0)
        if prev is not None and prev[0] == r["step"] - 1 and not prev[2] and max(compute) > 0:
            self._measure(compute, members, vns, r.get("vn_sizes"), step_time_s=prev[1])
        n = len(self._gen_step_times)
        if self.predicted_step_s is not None and n == 12:
            measured = self.measured_step_s
            self.coord.event("prediction", generation=self.generation, predicted_step_s=self.predicted_step_s,
                             measured_step_s=measured,
                             error=(self.predicted_step_s - measured) / measured if measured > 0 else None)

    def _measure(self, compute: list[float], members: list[int], vns: list[list[int]], sizes: list[int] | None,
                 step_time_s: float) -> None:
        """One step's compute times (and its duration) into the profile."""
        for rank, w in enumerate(members):
            if compute[rank] <= 0:
                continue
            if not vns[rank]:  # no VN: a probe, one VN's forward and backward
                count = 1
            else:
                count = len(vns[rank])
                if self.uneven:
                    samples = sum(sizes[v] for v in vns[rank]) if sizes else count * (self.vn_batch or 1)
                    costs = self._cost.setdefault(w, {})
                    key = (count, samples)
                    costs[key] = compute[rank] if key not in costs else 0.7 * costs[key] + 0.3 * compute[rank]
            self.speed.observe(w, compute[rank] / count)
            self._obs[w] = self._obs.get(w, 0) + 1
        reduction = max(0.0, step_time_s - max(compute))
        self.reduction_s = reduction if self.reduction_s == 0 else 0.8 * self.reduction_s + 0.2 * reduction
        self._measured = True

    @property
    def time_per_vn(self) -> dict[int, float]:
        """Each measured worker's seconds per VN (the median of its recent measurements)."""
        return self.speed.estimates()

    def _speeds(self, members: Sequence[int]) -> list[float] | None:
        # Pooled speeds (equal within the noise -> one speed); a newcomer is assumed typical.
        return self.speed.speeds(members)

    def _cost_models(self, members: Sequence[int]) -> tuple[list[float], list[float]] | None:
        """Per worker (seconds per VN, seconds per sample), fitted to its measured step costs:
        non-negative least squares over the (VNs, samples) configurations it has run; with one
        configuration only, all of the cost is put on the samples."""
        from scipy.optimize import nnls

        fits: dict[int, tuple[float, float]] = {}
        for w in members:
            costs = self._cost.get(w)
            if not costs:
                continue
            keys = list(costs)
            if len({n / c for c, n in keys}) >= 2:
                import numpy as np

                A = np.array([[c, n] for c, n in keys], dtype=float)
                coef, _ = nnls(A, np.array([costs[k] for k in keys]))
                fits[w] = (float(coef[0]), max(float(coef[1]), 1e-9))
            else:
                (_, n), t = keys[-1], costs[keys[-1]]
                fits[w] = (0.0, t / n)
        if not fits:
            return None
        typical = sorted(fits.values(), key=lambda ab: ab[1])[len(fits) // 2]
        chosen = [fits.get(w, typical) for w in members]
        return [a for a, _ in chosen], [b for _, b in chosen]

    def _assignment_for(self, members: Sequence[int]) -> list[list[int]]:
        self.predicted_step_s = None
        self.vn_sizes = None
        forced, self._forced_counts = self._forced_counts, None
        if forced is not None and len(forced) == len(members) and sum(forced) == self.V:
            return blocks(forced)  # a revert to the map before a rebalance that made steps slower
        if not self.balance:
            return self.assign(self.V, len(members))
        if self.uneven:
            models = self._cost_models(members)
            if models is None:
                return self.assign(self.V, len(members))
            plan = solve_uneven(self.V, self.B, models[0], models[1], reduction_s=self.reduction_s,
                                memory_limits=[self.memory_limits.get(w) for w in members])
            self.predicted_step_s = plan.predicted_step_s
            self.vn_sizes = plan.vn_sizes
            return plan.blocks()
        limits = [self.memory_limits.get(w) for w in members]
        if self.vn_batch is not None:
            check_memory(self.vn_batch, limits)
        if self._speeds(members) is None:
            return self.assign(self.V, len(members))
        plan = self.speed.plan(self.V, members, reduction_s=self.reduction_s)
        self.predicted_step_s = plan.predicted_step_s
        return plan.blocks()

    def _check_drift(self) -> None:
        """Re-solve with the current speeds; rebalance when the current map is worse than the
        best one by more than the threshold for ``patience`` consecutive measured steps (checked
        once per new measurement, not per tick). Members running no VN are measured by probes
        only now and then: their last known speed counts, they are not waited for."""
        if not self.balance or not self._measured:
            return
        self._measured = False
        if any(self._obs.get(w, 0) < self.min_observations for w, a in zip(self.members, self.assignment) if a):
            return
        if self.uneven:
            a, b = self._cost_models(self.members)
            best_u = solve_uneven(self.V, self.B, a, b, reduction_s=self.reduction_s,
                                  memory_limits=[self.memory_limits.get(w) for w in self.members])
            sizes = self.vn_sizes or [self.B // self.V] * self.V
            samples = [sum(sizes[v] for v in vns) for vns in self.assignment]
            counts = [len(vns) for vns in self.assignment]
            current = max(a[i] * counts[i] + b[i] * samples[i] for i in range(len(counts))) + self.reduction_s
            changed = (best_u.counts, best_u.samples) != (counts, samples)
            worse = current > best_u.predicted_step_s * (1 + self.rebalance_threshold)
            self._drift = self._drift + 1 if changed and worse else 0
            if self._drift >= self.rebalance_patience:
                self._drift = 0
                self._publish(list(self.members), kind="rebalance", hold=False, command=True,
                              detail={"predicted_before_s": current})
            return
        counts = [len(a) for a in self.assignment]
        if self._judge_trial(counts):
            return
        verdict = check_rebalance(counts, self.speed, self.members, self.V,
                                  reduction_s=self.reduction_s, threshold=self.rebalance_threshold)
        tried = self._still_rejected((tuple(self.members), tuple(verdict.best.counts)))
        self._drift = self._drift + 1 if verdict.worse and not tried else 0
        if self._drift >= self.rebalance_patience:
            self._drift = 0
            estimates = self.time_per_vn
            before = self.measured_step_s
            self._publish(list(self.members), kind="rebalance", hold=False, command=True,
                          detail={"time_per_vn": {str(w): estimates.get(w) for w in self.members},
                                  "predicted_before_s": verdict.current_step_s,
                                  "required_gain": verdict.required_gain})
            if before is not None:
                self._trial = {"generation": self.generation, "members": tuple(self.members), "counts": counts,
                               "step_s": before}

    REJECT_MOVE = 0.25
    """Relative change of any member's per-VN estimate after which a rejected map may be tried again."""

    def _still_rejected(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
        """Whether the map ``key`` was reverted under speeds like today's (see :attr:`_rejected`)."""
        then = self._rejected.get(key)
        if then is None:
            return False
        now = self.time_per_vn
        for w in key[0]:
            a, b = then.get(w), now.get(w)
            if a is None or b is None or a <= 0 or abs(b - a) > self.REJECT_MOVE * a:
                del self._rejected[key]
                return False
        return True

    TRIAL_STEPS = 12
    """Steps of a rebalanced map (warm-up included) before its step time is judged."""

    def _judge_trial(self, counts: list[int]) -> bool:
        """After a rebalance: once the new map has run :attr:`TRIAL_STEPS` steps, keep it if its
        median step time is no worse than the old map's by more than the threshold, else revert
        to the old map (a ``rebalance`` generation with ``reverted``) and never propose the
        rejected map again for these members. True when it published the revert."""
        trial = self._trial
        if trial is None:
            return False
        if trial["generation"] != self.generation or trial["members"] != tuple(self.members):
            self._trial = None  # something else changed the job meanwhile: nothing to judge
            return False
        if len(self._gen_step_times) < self.TRIAL_STEPS or self.measured_step_s is None:
            return False
        self._trial = None
        now, before = self.measured_step_s, trial["step_s"]
        if now <= before * (1 + self.rebalance_threshold):
            return False
        self._rejected[(tuple(self.members), tuple(counts))] = dict(self.time_per_vn)
        self._forced_counts = list(trial["counts"])
        self._publish(list(self.members), kind="rebalance", hold=False, command=True,
                      detail={"reverted": True, "measured_step_s": now, "measured_before_s": before})
        return True

    # -- failures ---------------------------------------------------------------------------
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
            self._hb.pop(wid, None)
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
        survivors = [w for w in self.members if w not in failed]
        if self.stages is not None and self.redundancy and survivors:
            self._failover(failed)  # per pipeline replica: fail over, leave whole, or fall back
            return
        if self.stages is not None and survivors:
            # A pipelined job goes on with its whole replicas only (members keep their order, so
            # every survivor keeps its stage); the rest of a broken replica leaves.
            p = self.stages
            replicas = [self.members[i:i + p] for i in range(0, len(self.members), p)]
            whole = [w for rep in replicas if not any(x in failed for x in rep) for w in rep]
            if not whole:
                self.coord.abort(self.generation)
                lost_desc = "; ".join(f"worker {w} {c}" for w, c in failed.items())
                raise JobFailed(
                    f"{lost_desc} at step {self.last_step}: every pipeline replica lost a stage, so no whole "
                    f"pipeline is left to continue; run with more replicas (--workers a larger multiple of "
                    f"{p}) to survive a failure"
                )
            survivors = whole
        newcomers_in_gen = [w for w in self.members if w not in failed and self.assigned.get(w) == self.generation]
        self.coord.abort(self.generation)
        if not survivors:
            lost_desc = "; ".join(f"worker {w} (pid {self.launcher.pid(w)}) {c}" for w, c in failed.items())
            raise JobFailed(
                f"{lost_desc} at step {self.last_step}, and no worker is left to continue the job; "
                f"with checkpoint_every= (--checkpoint-every) a later run can resume from the last "
                f"checkpoint (--resume RUN_DIR)"
            )
        if not self.replace_failed:
            self.target = max(min(self.target, len(survivors)), 1)
        else:
            # one replacement per member gone (a pipelined job also loses the rest of a broken replica)
            for _ in range(len(self.members) - len(survivors)):
                self._new_worker()
        del newcomers_in_gen
        hold = len(survivors) < self.min_workers
        self._publish(survivors, kind="hold" if hold else "failure", hold=hold,
                      detail={"failed": sorted(failed), "causes": failed})

    def _replica_layouts(self, layout: tuple[tuple[int, ...], ...] | None, size: int) -> tuple:
        """Per pipeline replica, its layout (``layout`` None: every replica at full depth)."""
        from virtualflow.plan.pipeline.failover import split_replicas, standard

        if layout is None:
            return tuple(standard(self.stages) for _ in range(size // self.stages))
        return split_replicas(layout, self.stages)

    def _failover(self, failed: dict[int, str]) -> None:
        """Bamboo: pipeline replicas lost workers. In each hit replica the lost workers'
        predecessors take their stages over from their replicas; a replica that cannot cover its
        loss leaves whole; with no replica left the job falls back (ends, naming its last
        checkpoint). See :func:`virtualflow.plan.pipeline.failover.failover_replicas`."""
        from virtualflow.plan.pipeline.failover import Fallback, failover_replicas, is_standard

        members, layout = self._formed_layout if self._formed_layout is not None else (self.members, self.layout)
        dead = {f["worker"] for f in self.failures} | set(failed)
        if any(w not in members for w in self.members):  # newcomers of an unformed generation: judge now
            members, layout = self.members, self.layout
        layouts = self._replica_layouts(layout, len(members))
        lost = [i for i, w in enumerate(members) if w in dead]
        decision = failover_replicas(layouts, lost)
        self.coord.abort(self.generation)
        lost_desc = "; ".join(f"worker {w} {c}" for w, c in failed.items())
        if isinstance(decision, Fallback):
            self.coord.event("fallback_restart", step=self.last_step, reason=decision.reason, failed=sorted(failed))
            self.bamboo_events.append({"kind": "fallback_restart", "step": self.last_step, "reason": decision.reason})
            raise FallbackRestart(
                f"{lost_desc} at step {self.last_step}: {decision.reason}, so redundancy cannot cover the loss. "
                f"Resume from the last checkpoint (--resume RUN_DIR; --checkpoint-every N keeps one)"
            )
        survivors = [members[i] for i in decision.survivors]
        self._record_failover(members, layouts, decision, failed=sorted(failed))
        dropped = [w for w in members if w not in survivors and w in self.members]
        if self.replace_failed:
            for _ in dropped:
                self._new_worker()
        missing = sum(len(run) - 1 for run in decision.layout)  # workers short of full depth
        self.target = len(survivors) + ((missing + self.stages * len(decision.left)) if self.replace_failed else 0)
        new_layout = decision.layout
        standard_before = layout is None or is_standard(layout)
        self.layout = None if is_standard(new_layout) and standard_before else new_layout
        self._publish(survivors, kind="failover" if decision.failed_over else "failure", hold=False,
                      detail={"failed": sorted(failed), "causes": failed})
        if is_standard(new_layout):
            self.layout = None  # full depth everywhere (the record carried the layout: members re-laid)

    def _record_failover(self, members: list[int], layouts: tuple, decision: Any, **fields: Any) -> None:
        """One ``failover`` event per replica that covered a loss (its index and new layout), one
        warning per replica that leaves whole."""
        offset, old_offsets = 0, []
        for rep in layouts:
            old_offsets.append(offset)
            offset += len(rep)
        for j, why in decision.left.items():
            gone = members[old_offsets[j]: old_offsets[j] + len(layouts[j])]
            logger.warning("pipeline replica %d (workers %s) leaves whole: %s", j, gone, why)
            self.coord.event("replica_left", step=self.last_step, replica=j, workers=gone, reason=why)
        for j in decision.failed_over:
            lo, hi = old_offsets[j], old_offsets[j] + len(layouts[j])
            new = [list(r) for r in decision.layouts[decision.kept.index(j)]]
            taken = {str(members[m]): members[q] for m, q in decision.taken_over.items() if lo <= m < hi}
            extra = {"replica": j} if len(layouts) > 1 else {}
            self.coord.event("failover", step=self.last_step, taken_over=taken, layout=new, **extra, **fields)
            self.bamboo_events.append({"kind": "failover", "step": self.last_step, "layout": new, **extra, **fields})

    def _reconfigure(self) -> bool:
        """Bamboo: newcomers take back the stages a failover gave to other workers (full depth
        again, at a step boundary), replica by replica. Returns whether a generation was published."""
        from virtualflow.plan.pipeline.failover import is_standard, reconfigure_replicas

        if self.layout is None or not self.ready:
            return False
        plan = reconfigure_replicas(self._replica_layouts(self.layout, len(self.members)), len(self.ready))
        added = [self.ready.pop(0) for slot in plan.order if slot is None]
        it = iter(added)
        members = [self.members[i] if i is not None else next(it) for i in plan.order]
        self.layout = plan.layout  # in the record even when standard: every member re-lays its stages
        self.coord.event("reconfigure", step=self.last_step, added=added, layout=[list(r) for r in plan.layout])
        self.bamboo_events.append({"kind": "reconfigure", "step": self.last_step, "added": added,
                                   "layout": [list(r) for r in plan.layout]})
        self._publish(members, kind="reconfigure", hold=False, command=True, detail={"added": added})
        self.layout = None if is_standard(plan.layout) else plan.layout
        return True

    def _retry_broken(self, now: float) -> None:
        """A member reported the current generation broken but no worker was found dead or
        silent (e.g. a collective timed out): after a heartbeat timeout's grace, form the next
        generation with everyone alive. Bounded: repeated breaks without progress fail the job."""
        if self._fault_at is None or now - self._fault_at < self.heartbeat_timeout_s:
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

    # -- planned changes --------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        if self.busy:
            return
        if self._release_noticed():
            return
        if self._reconfigure():
            return
        size = len(self.members)
        if self.hold:
            if size + len(self.ready) >= self.min_workers:
                add = self.ready[: max(self.min_workers, self.target) - size]
                self.ready = self.ready[len(add):]
                self._publish(self.members + add, kind="resume", hold=False, command=False)
            elif self.hold_since is not None and now - self.hold_since > self.min_workers_timeout_s:
                ck = self.hold_checkpoint
                for w in self.members:
                    self.coord.point(w, self.assigned[w], protocol.FAIL)
                raise JobFailed(
                    f"only {size} worker{'s' if size != 1 else ''} left, below min_workers={self.min_workers}, "
                    f"and no replacement arrived within {self.min_workers_timeout_s:g} s; the state at step "
                    f"{self.last_step} is in {ck}. Continue with `virtualflow run ... --resume RUN_DIR`, "
                    f"lower min_workers, or use replace_failed (--replace-failed)"
                )
            elif self.replace_failed or self.target > size:
                self._start_missing(max(self.min_workers, self.target) - size)
            return
        if self.target == size:
            self._check_drift()
        elif self.target > size:
            need = self.target - size
            self._start_missing(need)
            if len(self.ready) >= need:
                add, self.ready = self.ready[:need], self.ready[need:]
                self._publish(self.members + add, kind="grow", hold=False, command=True,
                              detail={"from": size, "to": self.target, "added": add})
        elif self.target < size and self.layout is not None:
            # Bamboo, failed over: whole replicas leave from the last one (at least one stays).
            from virtualflow.plan.pipeline.failover import flatten

            layouts = self._replica_layouts(self.layout, size)
            while len(layouts) > 1 and sum(len(rep) for rep in layouts) > self.target:
                layouts = layouts[:-1]
            n = sum(len(rep) for rep in layouts)
            self.target = n
            if n < size:
                self.layout = flatten(layouts)
                self._publish(self.members[:n], kind="shrink", hold=False, command=True,
                              detail={"from": size, "to": n, "removed": self.members[n:]})
                if all(len(run) == 1 for run in self.layout):
                    self.layout = None
        elif self.target < size:
            keep = self.members[: self.target]
            self._publish(keep, kind="shrink", hold=False, command=True,
                          detail={"from": size, "to": self.target, "removed": self.members[self.target:]})

    def _release_noticed(self) -> bool:
        """Publish a generation without the members that got a preemption notice (a planned
        shrink: every member regroups at the same step boundary; a pipelined job loses the
        noticed worker's whole replica). With ``replace_failed`` the target stays, so
        replacements start. Returns whether a generation was published."""
        noticed = [w for w in self.noticed if w in self.members]
        self.noticed = noticed
        if not noticed:
            return False
        members = list(self.members)
        if self.stages is not None and self.redundancy:
            return self._planned_failover(noticed)
        if self.stages is not None:
            p = self.stages
            broken = {i // p for i, w in enumerate(members) if w in noticed}
            keep = [w for i, w in enumerate(members) if i // p not in broken]
        else:
            keep = [w for w in members if w not in noticed]
        if not keep or len(keep) < self.min_workers:
            return False  # nothing to hand over to: the notice runs out and the loss is a failure
        target = self.target
        self.noticed = []
        self.publish(keep, kind="preempted", detail={"noticed": noticed, "removed": [w for w in members
                                                                                     if w not in keep]})
        if self.replace_failed:
            self.target = target  # replacements start and the job grows back (_plan)
        return True

    def _planned_failover(self, noticed: list[int]) -> bool:
        """Bamboo, on a preemption notice: the noticed workers of a redundant pipeline leave at the
        next step boundary and their predecessors take their stages over from the replicas (fresh
        after every step), as a failover would after a loss, but with no step redone; a replica
        that cannot cover its notice leaves whole if another replica goes on. A notice no replica
        survives (see :func:`failover_replicas`) is not acted on: the notice runs out and the loss
        is judged then (a fallback naming the checkpoint)."""
        from virtualflow.plan.pipeline.failover import Fallback, failover_replicas, is_standard

        members = list(self.members)
        layouts = self._replica_layouts(self.layout, len(members))
        decision = failover_replicas(layouts, [i for i, w in enumerate(members) if w in noticed])
        survivors = [] if isinstance(decision, Fallback) else [members[i] for i in decision.survivors]
        if isinstance(decision, Fallback) or len(survivors) < self.min_workers:
            reason = decision.reason if isinstance(decision, Fallback) else f"below min_workers={self.min_workers}"
            if not self._notice_uncovered:
                self._notice_uncovered = True
                self.coord.event("preemption_uncovered", step=self.last_step, noticed=noticed, reason=reason)
                logger.warning("preemption notice for worker(s) %s not acted on: %s", noticed, reason)
            return False
        self.noticed = []
        self._record_failover(members, layouts, decision, failed=[], noticed=sorted(noticed))
        dropped = [w for w in members if w not in survivors]
        if self.replace_failed:
            for _ in dropped:
                self._new_worker()
        missing = sum(len(run) - 1 for run in decision.layout)
        self.target = len(survivors) + ((missing + self.stages * len(decision.left)) if self.replace_failed else 0)
        standard_before = self.layout is None or is_standard(self.layout)
        self.layout = None if is_standard(decision.layout) and standard_before else decision.layout
        self._publish(survivors, kind="preempted", hold=False, command=True,
                      detail={"noticed": sorted(noticed), "removed": dropped})
        if is_standard(decision.layout):
            self.layout = None
        return True

    def _start_missing(self, need: int) -> None:
        for _ in range(need - len(self.ready) - len(self.pending)):
            self._new_worker()

    # -- publishing -------------------------------------------------------------------------
    def publish(self, members: list[int], *, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Publish a generation with exactly ``members`` (in rank order) and tell the current
        members to regroup at the next step boundary: for deciders that need "these members"
        rather than "the first n" (the autoscaler replacing a straggler). The target follows."""
        self.target = len(members)
        self._publish(list(members), kind=kind, hold=False, command=True, detail=detail)

    def _publish(self, members: list[int], *, kind: str, hold: bool, command: bool = False,
                 detail: dict[str, Any] | None = None) -> None:
        g = self.generation + 1
        if self.layout is not None:  # Bamboo: some members run several stages (equal VN shares per replica)
            layouts = self._replica_layouts(self.layout, len(members))
            blocks = contiguous_assignment(self.V, len(layouts))
            assignment = [list(blocks[j]) for j, rep in enumerate(layouts) for _ in rep]
            self.predicted_step_s, self.vn_sizes = None, None
        else:
            assignment = self._assignment_for(members)
        previous = list(self.members)
        self.coord.publish_generation(g, members, assignment, self.last_step, hold=hold, reason=kind,
                                      vn_sizes=self.vn_sizes,
                                      layout=[list(r) for r in self.layout] if self.layout is not None else None)
        for w in members:
            self.coord.point(w, self.assigned.get(w, -1), str(g))
            self.assigned[w] = g
        for w in previous:
            if w not in members and w not in self.gone:
                self.leaving.add(w)
                self.coord.point(w, self.assigned[w], f"{protocol.LEAVE} {g}")
                self._hb.pop(w, None)
        self.members, self.assignment, self.generation = list(members), assignment, g
        self.hold = hold
        self.hold_since = self.clock() if hold and self.hold_since is None else (self.hold_since if hold else None)
        self._change = Change(g, kind, self.clock(), dict(detail or {}))
        if self.predicted_step_s is not None:
            self._change.detail["predicted_step_s"] = self.predicted_step_s
        self._fault_at = None
        self._obs = {}
        self._gen_step_times = []
        self._prev_step = None
        self._measured = False
        self._drift = 0
        if command:
            self.coord.command("regroup", generation=g)

    # -- status -----------------------------------------------------------------------------
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


def _timed_compute(compute: list[float], members: list[int], vns: list[list[int]], parts: Any) -> list[float]:
    """Each rank's compute of the step, from the step's breakdown when the report carries one.

    The breakdown (:mod:`virtualflow.runtime.breakdown`) rides in the same report and describes
    the same step as ``compute_s``, but times input, forward and backward where they happen;
    ``compute_s`` is one interval around the VN loop. Under other load the two disagreed for
    rank 0 (``compute_s`` near its whole step, 7x its forward + backward, while the straggler
    times showed it was not the slowest), and the map followed ``compute_s`` to 1-5-2 for
    slowdowns 1,1,3. A rank with no VN keeps ``compute_s`` (its probe is not in the parts)."""
    rows = breakdown.clean(parts)
    if rows is None or [p["worker"] for p in rows] != list(members):
        return compute
    out = list(compute)
    for rank, p in enumerate(rows):
        timed = p["input_s"] + p["forward_s"] + p["backward_s"]
        if vns[rank] and timed > 0:
            out[rank] = timed
    return out


def check_resize(workers: Any, virtual_nodes: int, min_workers: int, stages: int | None = None) -> None:
    """Validate a resize target: names the value, the rule and the knob. ``stages``: the job is
    pipelined with that many stages, and resizes in whole pipeline replicas."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"resize to workers={workers!r}: the job needs at least 1 worker")
    if stages is not None:
        if workers % stages:
            lo = max(stages, (workers // stages) * stages)
            raise ValueError(
                f"resize to workers={workers} is not a multiple of the pipeline's {stages} stages; a pipelined "
                f"job grows and shrinks in whole pipeline replicas: resize to {lo} or {lo + stages}"
            )
        if workers // stages > virtual_nodes:
            raise ValueError(
                f"resize to workers={workers} makes {workers // stages} pipeline replicas, more than "
                f"virtual_nodes={virtual_nodes}: every replica needs at least one virtual node"
            )
    elif workers > virtual_nodes:
        raise ValueError(
            f"resize to workers={workers} is more than virtual_nodes={virtual_nodes}: every worker needs "
            f"at least one virtual node; resize to at most {virtual_nodes} or start the job with more "
            f"virtual nodes"
        )
    if workers < min_workers:
        raise ValueError(
            f"resize to workers={workers} is below min_workers={min_workers}; resize to at least "
            f"{min_workers} or start the job with a lower min_workers"
        )


def _describe_exit(code: int) -> str:
    import signal

    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
