"""The speed-based VN map of heterogeneous workers (``balance=True``): a policy that measures
workers and returns decisions.

:class:`SpeedPolicy` folds workers' step reports into a noise-robust seconds-per-VN for every
worker (:class:`virtualflow.plan.hetero.SpeedModel`) and the reduction's time, maps VNs for a new
generation (:meth:`SpeedPolicy.plan_map`) and, as speeds drift, decides when a rebalance pays
(:meth:`SpeedPolicy.check`: a :class:`~.decisions.Rebalance` or :class:`~.decisions.NoChange`).
A rebalance is judged by its outcome: once the new map has run :attr:`SpeedPolicy.TRIAL_STEPS`
steps, a map whose median step is slower than the old one's by more than the threshold is
reverted (a ``Rebalance`` with ``revert_to``) and not proposed again for those members while
their speeds stay as they were (:attr:`SpeedPolicy.REJECT_MOVE`).

Measurements: a report for step ``k`` carries the compute times of step ``k-1`` (they ride in
step ``k``'s reduction), so they are paired with step ``k-1``'s duration from the previous
report (reduction = duration - slowest compute); a generation's first step (warm-up) is not
measured; each rank's compute is taken from the step's breakdown (input + forward + backward)
when the report carries one (:func:`timed_compute`).

A pipelined job (:meth:`SpeedPolicy.plan_pipeline_map`) maps VNs over its pipeline *replicas*:
every worker of a replica runs the replica's block as its micro-batches, and the shares come from
:func:`virtualflow.plan.replica_shares.solve_shares` on each replica's flush-schedule time model
(its slowest worker paces it, its fill and drain are paid whatever its share). A worker's seconds
per micro-batch *per job stage it runs* is its measured time when every member has one, else
its stated ``WorkerSpec.slowdown`` (the stages of a balanced split taken as equal): so a replica
on slower workers, or one failed over under Bamboo's redundancy (a worker running two stages),
gets fewer micro-batches.

Tensor-parallel stages (``tensor=T > 1``, a ``D x P x T`` grid): a replica's ``P T`` workers form
its ``P`` stages, the ``T`` members of each consecutive in rank order; a stage's seconds per
micro-batch on its group are its slowest member's (the group computes in lock step), so the stated
speeds weigh a replica by each stage's largest slowdown (:func:`~virtualflow.plan.replica_shares.replica_time`
with ``tensor=T``). Measured, a stage's time is its tensor rank 0's: the step breakdown carries one
row per stage (the group's other members run the same schedule on the same shapes), whose
forwards and backwards waited in the group's collectives for the slowest member, so the row is
the group's time, collectives included; the group's other members take it.

Measured speeds of a pipelined job come from the step breakdown (:func:`pipeline_compute`): each
stage worker's forwards and backwards of the step (its data loading and emulated slowness
included) over the micro-batches it ran, the same pairing as the VN engine's ``compute_s`` (the
breakdown of step ``k-1`` rides in step ``k``'s report; a generation's first step is warm-up). Once
every stage is measured :meth:`SpeedPolicy.check` re-solves the shares at each measured step
boundary and returns a :class:`~.decisions.Rebalance` when they pay; the controller publishes it.

Pure: no store, no processes, no clock; it keeps measurements (state) but publishes nothing.
The controller calls :meth:`SpeedPolicy.new_generation` on every generation it publishes and
carries a decision out by publishing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from virtualflow.control.membership.decisions import NoChange, Rebalance
from virtualflow.plan.hetero import SpeedModel, blocks, check_memory, check_rebalance, solve_uneven
from virtualflow.plan.replica_shares import ReplicaTime, per_worker, predict_step_s, replica_time, solve_shares
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime import breakdown


@dataclass(frozen=True, slots=True)
class MapPlan:
    """A generation's VN map: the assignment (VNs per rank), the step time the solver predicts
    for it (None: not solved by speed) and the VN sizes of an uneven map (None: equal)."""

    assignment: list[list[int]]
    predicted_step_s: float | None = None
    vn_sizes: list[int] | None = None


class SpeedPolicy:
    """Measures workers' speeds and decides VN maps and rebalances (see the module docstring).

    ``assign`` is the map used without speeds (a pipelined job's whole replicas, or contiguous
    blocks); ``memory_limits`` maps a worker id to its memory limit (None: unlimited);
    ``slowdowns`` a worker id to its stated ``WorkerSpec.slowdown`` (missing: 1), the speed a
    pipelined job's replicas are weighted by until every member is measured; ``tensor`` the
    workers per pipeline stage (``Pipeline.tensor``; 1 without tensor parallelism)."""

    REJECT_MOVE = 0.25
    """Relative change of any member's per-VN estimate after which a rejected map may be tried again."""

    TRIAL_STEPS = 12
    """Steps of a rebalanced map (warm-up included) before its step time is judged."""

    def __init__(self, *, virtual_nodes: int, global_batch_size: int | None, uneven: bool,
                 memory_limits: dict[int, int | None], assign: Callable[[int, int], list[list[int]]],
                 threshold: float = 0.10, patience: int = 3, min_observations: int = 3,
                 window: int = 15, slowdowns: dict[int, float] | None = None, tensor: int = 1) -> None:
        if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1:
            raise ValueError(f"tensor={tensor!r} must be a positive integer (Pipeline.tensor: workers per stage)")
        self.tensor = tensor
        self.V = virtual_nodes
        self.B = global_batch_size
        self.vn_batch = global_batch_size // virtual_nodes if global_batch_size is not None else None
        self.uneven = uneven
        self.memory_limits = memory_limits
        self.assign = assign
        self.threshold = threshold
        self.patience = patience
        self.min_observations = min_observations
        self.speed = SpeedModel(window)
        self.slowdowns = dict(slowdowns or {})
        self.stage_runs: dict[int, int] = {}
        """A pipelined job: the job stages each member of the current generation runs (two for the
        worker that took a lost stage over); a measurement is per micro-batch and job stage."""
        self.replica_sizes: list[int] | None = None
        """A pipelined job: workers per replica in the current generation (None: not pipelined)."""
        self.reduction_s = 0.0
        self.cost: dict[int, dict[tuple[int, int], float]] = {}  # worker -> (VNs, samples) -> compute s
        self.rejected: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, float]] = {}
        """(members, counts) of a rebalanced map that ran slower -> the per-VN estimates it was
        rejected under; forgotten once an estimate moves by more than :attr:`REJECT_MOVE` (the
        workers' speeds really changed, so the old trial says nothing about the map any more)."""
        self.trial: dict[str, Any] | None = None
        self._pending_trial: dict[str, Any] | None = None
        # Per generation (reset by new_generation):
        self.obs: dict[int, int] = {}
        self.step_times: list[float] = []
        self._prev_step: tuple[int, float, bool] | None = None  # (step, duration, generation's first)
        self._measured = False  # a step was measured since the last drift check
        self._drift = 0

    # -- measuring ------------------------------------------------------------------------------
    @property
    def time_per_vn(self) -> dict[int, float]:
        """Each measured worker's seconds per VN (the median of its recent measurements)."""
        return self.speed.estimates()

    @property
    def measured_step_s(self) -> float | None:
        """Median step time of the current generation, its first two steps (warm-up) left out;
        None until a third step is measured."""
        times = self.step_times[2:]
        return sorted(times)[len(times) // 2] if times else None

    def new_generation(self, generation: int) -> None:
        """A generation was published: its steps are measured afresh (a rebalance just decided
        starts its trial in it)."""
        self.obs = {}
        self.step_times = []
        self._prev_step = None
        self._measured = False
        self._drift = 0
        if self._pending_trial is not None:
            self.trial = {"generation": generation, **self._pending_trial}
            self._pending_trial = None

    def observe(self, r: dict[str, Any]) -> bool:
        """Fold one step report of the current generation into the speeds and the reduction
        estimate (see the module docstring for the pairing of a report with the step before);
        a rank with no VN reports a probe VN's time, or 0. Returns whether the report carried
        compute times (its step time then counts in :attr:`step_times`)."""
        compute, members, vns = r.get("compute_s"), r.get("members"), r.get("vns")
        if compute is None and self.replica_sizes is not None and members:
            compute = pipeline_compute(members, r.get("breakdown"))
        if not compute or not members or len(compute) != len(members):
            return False
        compute = timed_compute(compute, members, vns, r.get("breakdown"))
        self.step_times.append(r["step_time_s"])
        prev = self._prev_step
        self._prev_step = (r["step"], r["step_time_s"], max(compute) <= 0)
        if prev is not None and prev[0] == r["step"] - 1 and not prev[2] and max(compute) > 0:
            self._measure(compute, members, vns, r.get("vn_sizes"), step_time_s=prev[1])
        return True

    def _measure(self, compute: list[float], members: list[int], vns: list[list[int]], sizes: list[int] | None,
                 step_time_s: float) -> None:
        """One step's compute times (and its duration) into the profile."""
        for rank, w in enumerate(members):
            if compute[rank] <= 0:
                continue
            if not vns[rank]:  # no VN: a probe, one VN's forward and backward
                count = 1
            else:
                count = len(vns[rank]) * self.stage_runs.get(w, 1)  # (a pipeline worker: per job stage)
                if self.uneven:
                    samples = sum(sizes[v] for v in vns[rank]) if sizes else count * (self.vn_batch or 1)
                    costs = self.cost.setdefault(w, {})
                    key = (count, samples)
                    costs[key] = compute[rank] if key not in costs else 0.7 * costs[key] + 0.3 * compute[rank]
            self.speed.observe(w, compute[rank] / count)
            self.obs[w] = self.obs.get(w, 0) + 1
        reduction = max(0.0, step_time_s - max(compute))
        self.reduction_s = reduction if self.reduction_s == 0 else 0.8 * self.reduction_s + 0.2 * reduction
        self._measured = True

    def cost_models(self, members: Sequence[int]) -> tuple[list[float], list[float]] | None:
        """Per worker (seconds per VN, seconds per sample), fitted to its measured step costs:
        non-negative least squares over the (VNs, samples) configurations it has run; with one
        configuration only, all of the cost is put on the samples."""
        from scipy.optimize import nnls

        fits: dict[int, tuple[float, float]] = {}
        for w in members:
            costs = self.cost.get(w)
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

    # -- deciding -------------------------------------------------------------------------------
    def plan_map(self, members: Sequence[int], *, balance: bool, counts: Sequence[int] | None = None) -> MapPlan:
        """The VN map of a new generation of ``members``: ``counts`` VNs per member when given
        (a revert: :attr:`Rebalance.revert_to`) and they fit, else the solver's (``balance``;
        uneven VN sizes when the job allows them) once speeds are known, else ``assign``'s."""
        forced = counts
        if forced is not None and len(forced) == len(members) and sum(forced) == self.V:
            return MapPlan(blocks(forced))  # a revert to the map before a rebalance that made steps slower
        if not balance:
            return MapPlan(self.assign(self.V, len(members)))
        if self.uneven:
            models = self.cost_models(members)
            if models is None:
                return MapPlan(self.assign(self.V, len(members)))
            plan = solve_uneven(self.V, self.B, models[0], models[1], reduction_s=self.reduction_s,
                                memory_limits=[self.memory_limits.get(w) for w in members])
            return MapPlan(plan.blocks(), plan.predicted_step_s, plan.vn_sizes)
        limits = [self.memory_limits.get(w) for w in members]
        if self.vn_batch is not None:
            check_memory(self.vn_batch, limits)
        if self.speed.speeds(members) is None:  # pooled speeds; none measured yet
            return MapPlan(self.assign(self.V, len(members)))
        plan = self.speed.plan(self.V, members, reduction_s=self.reduction_s)
        return MapPlan(plan.blocks(), plan.predicted_step_s)

    @property
    def group(self) -> int:
        """Consecutive members measured as one: a pipelined job's ``tensor`` (a stage's group), else 1."""
        return self.tensor if self.replica_sizes is not None else 1

    def measured_members(self, members: Sequence[int]) -> list[int]:
        """The members whose measurements speak for their stage: every member, or with
        ``tensor=T > 1`` tensor rank 0 of each stage (ranks ``0, T, 2T, ...``: the breakdown's rows)."""
        return list(members[::self.group])

    def stage_seconds(self, members: Sequence[int]) -> tuple[list[float], str]:
        """Each member's seconds per micro-batch and job stage, and where they come from:
        ``"measured"`` when every stage's measured member (:meth:`measured_members`) has a
        measurement (a tensor-parallel stage's other members take its time), else ``"stated"``
        (its slowdown, in units of one full-speed stage)."""
        measured = self.time_per_vn
        leaders = self.measured_members(members)
        if members and all(w in measured for w in leaders):
            return [measured[members[r - r % self.group]] for r in range(len(members))], "measured"
        return [max(1.0, float(self.slowdowns.get(w, 1.0))) for w in members], "stated"

    def plan_pipeline_map(self, members: Sequence[int], runs: Sequence[int], sizes: Sequence[int], *,
                          balance: bool, counts: Sequence[int] | None = None) -> MapPlan:
        """The VN map of a pipelined generation: ``runs[i]`` job stages on member ``i``, replicas of
        ``sizes`` workers in rank order. Every worker of a replica runs the replica's block.
        ``counts`` (per member, a revert) is kept when consistent; without ``balance`` the
        replicas get equal contiguous blocks; with it, the shares minimising the predicted step
        (:func:`~virtualflow.plan.replica_shares.solve_shares` on 1F1B's time model, GPipe's
        too; the controller refuses schedules it does not fit at launch)."""
        if len(runs) != len(members) or sum(sizes) != len(members):
            raise ValueError(f"{len(members)} members, {len(runs)} stage runs and replicas of {list(sizes)} workers")
        self.stage_runs = {w: int(n) for w, n in zip(members, runs)}
        self.replica_sizes = list(sizes)
        firsts = [sum(sizes[:j]) for j in range(len(sizes))]
        if counts is not None and len(counts) == len(members):
            shares = [int(counts[r]) for r in firsts]
            if sum(shares) == self.V and min(shares) >= 1:
                return MapPlan(per_worker(blocks(shares), sizes))
        if not sizes:
            return MapPlan([])
        if not balance:
            return MapPlan(per_worker(contiguous_assignment(self.V, len(sizes)), sizes))
        plan = solve_shares(self.V, self.replica_times(members, runs, sizes), reduction_s=0.0)
        stated = self.stage_seconds(members)[1] == "stated"
        return MapPlan(per_worker(plan.blocks(), sizes), None if stated else plan.predicted_step_s)

    def replica_times(self, members: Sequence[int], runs: Sequence[int], sizes: Sequence[int]) -> list[ReplicaTime]:
        """Each replica's time model (:func:`~virtualflow.plan.replica_shares.replica_time`) from
        its workers' seconds per micro-batch: per job stage times the stages each runs; with
        ``tensor=T`` every ``T`` consecutive workers are one stage's group, paced by the slowest."""
        per_stage, _ = self.stage_seconds(members)
        worker_s = [t * n for t, n in zip(per_stage, runs)]
        out, start = [], 0
        for n in sizes:
            out.append(replica_time(worker_s[start:start + n], tensor=self.tensor))
            start += n
        return out

    def _check_pipeline(self, members: Sequence[int], assignment: Sequence[Sequence[int]]) -> Rebalance | NoChange:
        """A pipelined job: re-solve the replicas' shares with the measured speeds; a
        :class:`Rebalance` when the current shares are predicted slower than the best by more
        than the threshold plus the noise margin for ``patience`` measured steps."""
        sizes = self.replica_sizes or []
        runs = [self.stage_runs.get(w, 1) for w in members]
        if sum(sizes) != len(members) or self.stage_seconds(members)[1] != "measured":
            return NoChange("not every member is measured")
        firsts = [sum(sizes[:j]) for j in range(len(sizes))]
        current = [len(assignment[r]) for r in firsts]
        times = self.replica_times(members, runs, sizes)
        best = solve_shares(self.V, times)
        now = predict_step_s(current, times)
        required = self.threshold + self.speed.margin(self.measured_members(members))
        worse = best.counts != current and now > best.predicted_step_s * (1 + required)
        self._drift = self._drift + 1 if worse else 0
        if self._drift < self.patience:
            return NoChange("the current shares are good enough")
        self._drift = 0
        return Rebalance(detail={"replica_shares": best.counts, "predicted_before_s": now,
                                 "required_gain": required},
                         counts_before=tuple(len(a) for a in assignment))

    def check(self, generation: int, members: Sequence[int], assignment: Sequence[Sequence[int]],
              vn_sizes: list[int] | None) -> Rebalance | NoChange:
        """Re-solve with the current speeds (once per new measurement, not per tick): a
        :class:`Rebalance` when the current map is worse than the best one by more than the
        threshold for ``patience`` consecutive measured steps, or when a rebalance on trial made
        steps slower (a revert). Members running no VN are measured by probes only now and
        then: their last known speed counts, they are not waited for."""
        if not self._measured:
            return NoChange("no new measurement")
        self._measured = False
        counted = set(self.measured_members(members))
        if any(self.obs.get(w, 0) < self.min_observations for w, a in zip(members, assignment) if a and w in counted):
            return NoChange("too few measurements")
        if self.replica_sizes is not None:
            return self._check_pipeline(members, assignment)
        if self.uneven:
            return self._check_uneven(members, assignment, vn_sizes)
        counts = [len(a) for a in assignment]
        revert = self._judge_trial(generation, members, counts)
        if revert is not None:
            return revert
        verdict = check_rebalance(counts, self.speed, members, self.V,
                                  reduction_s=self.reduction_s, threshold=self.threshold)
        tried = self.still_rejected((tuple(members), tuple(verdict.best.counts)))
        self._drift = self._drift + 1 if verdict.worse and not tried else 0
        if self._drift < self.patience:
            return NoChange("the current map is good enough")
        self._drift = 0
        estimates = self.time_per_vn
        before = self.measured_step_s
        if before is not None:
            self._pending_trial = {"members": tuple(members), "counts": counts, "step_s": before}
        return Rebalance(detail={"time_per_vn": {str(w): estimates.get(w) for w in members},
                                 "predicted_before_s": verdict.current_step_s,
                                 "required_gain": verdict.required_gain},
                         trial_step_s=before, counts_before=tuple(counts))

    def _check_uneven(self, members: Sequence[int], assignment: Sequence[Sequence[int]],
                      vn_sizes: list[int] | None) -> Rebalance | NoChange:
        a, b = self.cost_models(members)  # type: ignore[misc]  # measured: min_observations passed
        best = solve_uneven(self.V, self.B, a, b, reduction_s=self.reduction_s,
                            memory_limits=[self.memory_limits.get(w) for w in members])
        sizes = vn_sizes or [self.B // self.V] * self.V
        samples = [sum(sizes[v] for v in vns) for vns in assignment]
        counts = [len(vns) for vns in assignment]
        current = max(a[i] * counts[i] + b[i] * samples[i] for i in range(len(counts))) + self.reduction_s
        changed = (best.counts, best.samples) != (counts, samples)
        worse = current > best.predicted_step_s * (1 + self.threshold)
        self._drift = self._drift + 1 if changed and worse else 0
        if self._drift < self.patience:
            return NoChange("the current map is good enough")
        self._drift = 0
        return Rebalance(detail={"predicted_before_s": current}, counts_before=tuple(counts))

    def still_rejected(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
        """Whether the map ``key`` was reverted under speeds like today's (see :attr:`rejected`)."""
        then = self.rejected.get(key)
        if then is None:
            return False
        now = self.time_per_vn
        for w in key[0]:
            a, b = then.get(w), now.get(w)
            if a is None or b is None or a <= 0 or abs(b - a) > self.REJECT_MOVE * a:
                del self.rejected[key]
                return False
        return True

    def _judge_trial(self, generation: int, members: Sequence[int], counts: list[int]) -> Rebalance | None:
        """After a rebalance: once the new map has run :attr:`TRIAL_STEPS` steps, keep it if its
        median step time is no worse than the old map's by more than the threshold, else a
        revert to the old map (and the rejected map is not proposed again for these members)."""
        trial = self.trial
        if trial is None:
            return None
        if trial["generation"] != generation or trial["members"] != tuple(members):
            self.trial = None  # something else changed the job meanwhile: nothing to judge
            return None
        if len(self.step_times) < self.TRIAL_STEPS or self.measured_step_s is None:
            return None
        self.trial = None
        now, before = self.measured_step_s, trial["step_s"]
        if now <= before * (1 + self.threshold):
            return None
        self.rejected[(tuple(members), tuple(counts))] = dict(self.time_per_vn)
        return Rebalance(detail={"reverted": True, "measured_step_s": now, "measured_before_s": before},
                         revert_to=tuple(trial["counts"]), counts_before=tuple(counts))


def pipeline_compute(members: Sequence[int], parts: Any) -> list[float]:
    """A pipelined job's step report: each rank's compute of the step its breakdown describes,
    ``input_s + forward_s + backward_s`` of its stage's row (its micro-batches' forwards and
    backwards, emulated slowness included), 0 for a rank with no row (a tensor-parallel stage's
    members other than tensor rank 0) and for every rank when the report has no breakdown (a
    generation's first step: the next report's breakdown, of this warm-up step, is then skipped)."""
    rows = breakdown.clean(parts)
    by_worker = {int(p["worker"]): p for p in rows} if rows is not None else {}
    return [by_worker[w]["input_s"] + by_worker[w]["forward_s"] + by_worker[w]["backward_s"] if w in by_worker
            else 0.0 for w in members]


def timed_compute(compute: list[float], members: list[int], vns: list[list[int]], parts: Any) -> list[float]:
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
