"""The autoscaling executor: observations in, a policy's decisions applied through in-place resize.

It runs in the launcher's monitor thread, right after the :class:`MembershipController` has
handled the same batch of worker reports, and does four things:

1. turns every step report (rank 0's, once per step) into an :class:`Observation`: worker count,
   throughput B / step time, each worker's own throughput (its samples over its compute time,
   which ride in the step's reduction), cost rate, elapsed time, steps remaining;
2. asks the policy for a decision, but only while no change is in flight (no resize pending,
   no generation forming, no hold) and the last report is of a step run by the current members:
   a decision is always made on the job as it is;
3. applies it: :class:`Resize` through ``controller.request_resize`` (the same path as
   ``JobHandle.resize``: newcomers build the job before joining, the others keep training);
   :class:`Replace` as a grow by one worker (a replica) followed, once it has joined, by a shrink
   that removes the straggler; :class:`Rebalance` as an immediate re-solve of the VN map by
   measured speed (turning speed-based mapping on when the job started without it);
4. records: ``autoscale_decision`` events (from, to, why, the throughput table),
   ``autoscale_size`` events (the frozen measurement of each worker count tried),
   ``autoscale_settled``, and the console line that says why (``3 -> 4: scaling efficiency
   0.93 > 0.10 (2 -> 3)``).

A pipelined job (``pipeline`` given) is autoscaled in whole replicas of stages x tensor workers
(:func:`virtualflow.control.autoscale.pipeline.pipeline_limits`: the policy sees bounds in whole
replicas and the replica time model); a decision that would leave a partial replica is rounded
to whole ones, away from the current size, before it is applied, and a replacement replaces the straggler's whole
replica: a fresh replica joins, then the straggler's leaves.

Autoscaling never changes B, V or anything the model sees: it only changes how many workers
run the V virtual nodes, through the same generations a manual resize uses, so the trained
weights are those of a static run (bit-identical in deterministic mode).

History kept for the policy: for every generation its first ``history_head`` observations and,
for the current one, also its last ``history_tail`` (the measurements a search needs and the
recent window a straggler check needs), so that a long job's decisions stay cheap.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Callable, Sequence

from virtualflow.runtime import breakdown
from virtualflow.control.autoscale import (
    Limits,
    Observation,
    Policy,
    Rebalance,
    Replace,
    Resize,
    Stay,
    measure_sizes,
    pipeline_limits,
)

logger = logging.getLogger("virtualflow")


class _History:
    """Observations per segment (one generation at one worker count): the first ``head`` of
    every segment, and the last ``tail`` of each beyond that."""

    def __init__(self, head: int, tail: int) -> None:
        self.head, self.tail = head, tail
        self._closed: list[Observation] = []
        self._head: list[Observation] = []
        self._tail: deque[Observation] = deque(maxlen=tail)
        self.count = 0

    def add(self, obs: Observation) -> None:
        cur = self._head[-1] if self._head else None
        if cur is not None and (cur.generation, cur.workers) != (obs.generation, obs.workers):
            self._closed += self._head + list(self._tail)
            self._head, self._tail = [], deque(maxlen=self.tail)
        if len(self._head) < self.head:
            self._head.append(obs)
        else:
            self._tail.append(obs)
        self.count += 1

    def view(self) -> list[Observation]:
        return self._closed + self._head + list(self._tail)

    def __bool__(self) -> bool:
        return self.count > 0


class AutoscaleExecutor:
    def __init__(
        self,
        policy: Policy,
        controller: Any,
        coordinator: Any,
        *,
        limits: Limits,
        global_batch_size: int,
        virtual_nodes: int,
        total_steps: int,
        price_per_worker_hour: float = 1.0,
        start_time: float | None = None,
        history_head: int = 256,
        history_tail: int = 256,
        clock: Callable[[], float] = time.time,
        pipeline: Any = None,
    ) -> None:
        self.policy = policy
        self.ctl = controller
        self.coord = coordinator
        self.limits = pipeline_limits(limits, pipeline, virtual_nodes)
        """The policy's bounds: for a pipelined job (``pipeline``, a resolved
        :class:`~virtualflow.config.pipeline.Pipeline`) in whole replicas, with its time model."""
        self.B, self.V = global_batch_size, virtual_nodes
        self.total_steps = total_steps
        self.price = price_per_worker_hour
        self.clock = clock
        self.t0 = start_time if start_time is not None else clock()
        self.history = _History(history_head, history_tail)
        self._last_step = -1
        self._replacing: tuple[int, int] | None = None  # (straggler, size before the grow)
        self._measured: dict[int, Any] = {}
        self._per_size: dict[int, dict[str, float]] = {}  # all steps, for the summary
        self.decisions: list[dict[str, Any]] = []
        self.settled_at: int | None = None
        self.replans: list[dict[str, Any]] = []
        """The points where the policy found the conditions changed and searched again."""
        self._last_replan: int | None = None
        self.disabled: str | None = None
        self._noted: set[str] = set()
        # How the executor's own per-size table is measured (the policy's settings if it has them).
        self.min_steps = int(getattr(policy, "min_steps", 10))
        self.warmup_steps = int(getattr(policy, "warmup_steps", 3))

    # -- observations ------------------------------------------------------------------------
    def observation(self, r: dict[str, Any]) -> Observation | None:
        """One step report -> an Observation (None for a report without a usable step time)."""
        step_time = float(r.get("step_time_s") or 0.0)
        if not (step_time > 0 and math.isfinite(step_time)):
            return None
        members = list(r.get("members") or [])
        vns = r.get("vns") or []
        compute = r.get("compute_s") or []
        sizes = r.get("vn_sizes")
        per_worker: dict[int, float] = {}
        counts: dict[int, int] = {}
        for rank, w in enumerate(members):
            mine = vns[rank] if rank < len(vns) else []
            counts[w] = len(mine)
            samples = (sum(sizes[v] for v in mine) if sizes else len(mine) * self.B // self.V) if mine else self.B // self.V
            if rank < len(compute) and compute[rank] > 0:
                per_worker[w] = samples / compute[rank]
        workers = int(r.get("workers") or len(members) or 1)
        parts = breakdown.clean(r.get("breakdown"))
        mean_parts = ({k: sum(p[k] for p in parts) / len(parts) for k in breakdown.PARTS + ("step_s",)}
                      if parts else {})
        return Observation(
            step=int(r["step"]),
            workers=workers,
            throughput=float(r.get("samples", self.B)) / step_time,
            step_time_s=step_time,
            cost_rate_per_h=workers * self.price,
            elapsed_s=float(r.get("time", self.clock())) - self.t0,
            steps_remaining=max(0, self.total_steps - int(r["step"]) - 1),
            generation=int(r.get("generation", 0)),
            worker_ids=tuple(members),
            per_worker_throughput=per_worker,
            vn_counts=counts,
            parts=mean_parts,
        )

    def _observe(self, r: dict[str, Any]) -> None:
        if r["step"] <= self._last_step:
            return  # re-sent after a regroup
        obs = self.observation(r)
        if obs is None:
            return
        self._last_step = obs.step
        self.history.add(obs)
        stats = self._per_size.setdefault(obs.workers, {"steps": 0, "step_time_s": 0.0, "worker_seconds": 0.0})
        stats["steps"] += 1
        stats["step_time_s"] += obs.step_time_s
        stats["worker_seconds"] += obs.step_time_s * obs.workers

    # -- the loop body -----------------------------------------------------------------------
    def update(self, reports: Sequence[dict[str, Any]]) -> None:
        """Called after each controller tick with the reports it just handled."""
        new = False
        for r in reports:
            if r.get("type") == "step":
                self._observe(r)
                new = True
        if not new or self.disabled or not self.history:
            if self._replacing is not None:
                self._finish_replacement()
            return
        history = self.history.view()
        self._record_sizes(history)
        if self._replacing is not None:
            self._finish_replacement()
            return
        ctl = self.ctl
        if ctl.busy or ctl.hold or ctl.target != len(ctl.members) or ctl.finished:
            return  # a change is in flight: decide on the job as it will be
        if history[-1].workers != len(ctl.members):
            return  # the last report is of a step run before the change: wait for one of the job as it is
        try:
            decision = self.policy.decide(history, self.limits)
        except Exception as exc:  # a user's policy: keep training, stop autoscaling
            self.disabled = f"{type(exc).__name__}: {exc}"
            logger.error("autoscale policy %r failed (%s); autoscaling is off for the rest of the job",
                         getattr(self.policy, "name", self.policy), self.disabled)
            self.coord.event("autoscale_error", policy=getattr(self.policy, "name", None), error=self.disabled)
            return
        self._apply(decision, history[-1])

    def _apply(self, decision: Any, last: Observation) -> None:
        current = len(self.ctl.members)
        name = getattr(self.policy, "name", type(self.policy).__name__)
        if isinstance(decision, Stay):
            if decision.settled and self.settled_at != current:
                self.settled_at = current
                logger.info("autoscale %s: %s", name, decision.reason)
                self.coord.event("autoscale_settled", policy=name, workers=current, step=last.step,
                                 reason=decision.reason, sizes=self._sizes_table())
            return
        if isinstance(decision, Resize):
            target = self.limits.toward(int(decision.workers), current)
            if target != decision.workers:
                self._note(f"resize-{decision.workers}", f"{name} asked for {decision.workers} workers; applying "
                           f"{target} (whole replicas of {self.limits.unit} in [{self.limits.min_workers}, "
                           f"{self.limits.max_workers}])")
            if target == current:
                return
            replan = decision.detail.get("replan") if isinstance(decision.detail, dict) else None
            if replan is not None and replan.get("step") != self._last_replan:
                self._last_replan = replan.get("step")
                self.replans.append(dict(replan))
                self.coord.event("autoscale_replan", policy=name, **replan)
            self.settled_at = None
            self._decided("resize", name, current, target, decision.reason, last, dict(decision.detail))
            self.ctl.request_resize(target, source="autoscale")
        elif isinstance(decision, Replace):
            w, unit = decision.worker, self.limits.unit
            if w not in self.ctl.members or current + unit > self.limits.highest or getattr(self.ctl, "layout", None):
                self._note(f"replace-{w}", f"cannot replace worker {w} (not a member, no room for {unit} more "
                                           f"under max_workers, or a failed-over pipeline layout runs)")
                return
            self._decided("replace", name, current, current + unit, decision.reason, last, {"worker": w})
            self._replacing = (w, current)
            self.ctl.request_resize(current + unit, source="autoscale")
        elif isinstance(decision, Rebalance):
            if not self.ctl.balance:
                # Fewer VNs for the straggler is a speed-based map: the controller measures every
                # worker's time per VN anyway, so it can solve one now (and keeps the map balanced
                # as speeds drift from here on).
                self.ctl.balance_by_speed()
                self._note("rebalance-on", f"{decision.reason}: VNs are mapped by measured speed from now on "
                                           f"(the job started with balance off)")
            self._decided("rebalance", name, current, current, decision.reason, last, {"worker": decision.worker})
            self._republish("rebalance", list(self.ctl.members), {"straggler": decision.worker})
        else:
            raise TypeError(f"the policy returned {decision!r}; expected Resize, Stay, Replace or Rebalance")

    def _decided(self, kind: str, name: str, current: int, target: int, reason: str, last: Observation,
                 detail: dict[str, Any]) -> None:
        record = {"action": kind, "policy": name, "from": current, "to": target, "step": last.step,
                  "elapsed_s": last.elapsed_s, "reason": reason, **detail}
        self.decisions.append(record)
        logger.info("autoscale %s: %s", name, reason)
        self.coord.event("autoscale_decision", **record, sizes=self._sizes_table())

    def _note(self, key: str, message: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            logger.warning("autoscale: %s", message)
            self.coord.event("autoscale_note", message=message)

    # -- replacement ---------------------------------------------------------------------------
    def _finish_replacement(self) -> None:
        """Second half of a Replace: once the grow has formed, the straggler leaves (in a
        pipelined job with the whole replica it belongs to: ranks are laid out replica by replica,
        so the replicas after it keep their stages)."""
        assert self._replacing is not None
        w, before = self._replacing
        ctl = self.ctl
        if ctl.busy or ctl.hold or ctl.target != len(ctl.members):
            return
        if w not in ctl.members:  # lost meanwhile (failure): nothing left to do
            self._replacing = None
            return
        unit = self.limits.unit
        if len(ctl.members) != before + unit:
            self._replacing = None  # something else changed the membership: give up quietly
            return
        first = ctl.members.index(w) // unit * unit
        removed = list(ctl.members[first:first + unit])
        keep = [m for m in ctl.members if m not in removed]
        ctl.target = len(keep)
        self._republish("shrink", keep, {"from": len(ctl.members), "to": len(keep), "removed": removed,
                                         "reason": "straggler replaced"})
        self._replacing = None

    def _republish(self, kind: str, members: list[int], detail: dict[str, Any]) -> None:
        # The controller's own publishing path (a new generation + a regroup command at the next
        # step boundary), with a member list the controller's planner cannot express by itself:
        # "these members" rather than "the first n".
        self.ctl.publish(members, kind=kind, detail=detail)

    # -- records -------------------------------------------------------------------------------
    def _record_sizes(self, history: list[Observation]) -> None:
        measured, _ = measure_sizes(history, min_steps=self.min_steps, warmup_steps=self.warmup_steps)
        for k, m in measured.items():
            if k not in self._measured:
                self._measured[k] = m
                cost_h = m.cost_rate_per_h * m.step_time_s / 3600.0
                self.coord.event("autoscale_size", workers=k, throughput=m.throughput, step_time_s=m.step_time_s,
                                 steps=m.steps, at_step=m.at_step, cost_rate_per_h=m.cost_rate_per_h,
                                 worker_seconds_per_sample=m.worker_seconds_per_sample,
                                 cost_per_step=cost_h)
                logger.info("autoscale: %d worker%s: %.1f samples/s (median of %d steps, %.1f ms/step)",
                            k, "s" if k != 1 else "", m.throughput, m.steps, m.step_time_s * 1e3)

    def _sizes_table(self) -> dict[str, float]:
        return {str(k): round(m.throughput, 3) for k, m in sorted(self._measured.items())}

    def summary(self) -> dict[str, Any]:
        sizes = {}
        for k in sorted(set(self._measured) | set(self._per_size)):
            m = self._measured.get(k)
            s = self._per_size.get(k, {})
            sizes[str(k)] = {
                "throughput": m.throughput if m else None,
                "step_time_s": m.step_time_s if m else None,
                "measured_steps": m.steps if m else 0,
                "steps_run": int(s.get("steps", 0)),
                "mean_step_time_s": s["step_time_s"] / s["steps"] if s.get("steps") else None,
                "worker_seconds": s.get("worker_seconds", 0.0),
            }
        return {
            "policy": getattr(self.policy, "name", type(self.policy).__name__),
            "min_workers": self.limits.min_workers,
            "max_workers": self.limits.max_workers,
            "price_per_worker_hour": self.price,
            "settled_at": self.settled_at,
            "resizes": sum(1 for d in self.decisions if d["action"] == "resize"),
            "decisions": list(self.decisions),
            "replans": list(self.replans),
            "sizes": sizes,
            "disabled": self.disabled,
        }
