"""The virtual node engine: one optimizer step over this worker's virtual nodes.

Per step, for each of its VNs in order, a worker restores the BatchNorm running statistics to
their value at the start of the step, loads the VN's samples, seeds the random stream with
``vn_seed(seed, step, vn)``, runs forward and backward on the loss weighted by ``n_v / B``, and
frees the VN's activations before the next one (only one VN's activations are ever alive).
Gradients are then summed across workers, BatchNorm statistics are combined once for the step
(mean over the V virtual nodes, or VN 0's), and every worker applies the same update.

A step whose loss is not finite in any VN is never applied: all workers learn of it from the
same reduction and stop before the optimizer step.

A worker may have **no VN** in a generation (the heterogeneous solver gives none to a worker too
slow to help). It still takes part in every reduction with a zero contribution (default mode: its
gradient buckets are zeros; deterministic mode: it holds no node of the tree), advances its
BatchNorm batch counters as a forward would, and applies the same update, so its state stays
identical to everyone else's. Its speed stays measured by a *probe*: now and then, before
joining the reduction, it times one VN's forward and backward (``torch.autograd.grad``: nothing
is accumulated, BatchNorm statistics are restored, random streams are seeded per (step, VN) as
always) and reports that time as its compute time. The probe runs while the worker would
otherwise wait for the others, so it costs no step time when it is shorter than that wait; when
it is expected to be longer (a worker far slower than the rest), probes are spaced so that the
delay they add is at most ``PROBE_BUDGET`` of the step time, amortised.

Size: one concept (the order of a step over this worker's VNs, in its two modes). The parts every
layout shares are objects of :mod:`virtualflow.runtime.step`: a VN's forward and backward
(:mod:`~virtualflow.runtime.step.compute`), the gradient reduction chosen once per generation
(:mod:`~virtualflow.runtime.step.reduction`, the deterministic exchange's choice in
:mod:`~virtualflow.runtime.step.exchange`), the statistics vector (:mod:`~virtualflow.runtime.step.stats`).
What a VN's step consumes and produces is in :mod:`virtualflow.runtime.batches`, the BatchNorm
bookkeeping in :mod:`virtualflow.runtime.batchnorm`, the probe's rule in
:mod:`virtualflow.runtime.probe`; the worker-facing half (generations, checkpoints) is
:class:`virtualflow.runtime.vn_worker.VNWorkerEngine`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group, PeerFailure
from virtualflow.comm.ring import Collectives
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.amp import LossScaler
from virtualflow.runtime.batches import (BatchLoader, LossShapeError, NonFiniteLossError, StepOutcome, check_loss,
                                         seed_random_streams, to_device)
from virtualflow.runtime.batchnorm import BatchNormState
from virtualflow.runtime.breakdown import Raw, StepClock
from virtualflow.runtime.fsdp import FsdpKnobs
from virtualflow.runtime.fsdp.body import FsdpBody
from virtualflow.runtime.fsdp.update import FsdpUpdate
from virtualflow.runtime.prefetch import Prefetcher
from virtualflow.runtime.probe import PROBE_BUDGET, PROBE_CHANGE, PROBE_EVERY, IdleProbe, probe_due
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer
from virtualflow.runtime.step.compute import VNCompute
from virtualflow.runtime.step.exchange import ExchangeChoice
from virtualflow.runtime.step.finish import StepFinish
from virtualflow.runtime.step.reduction import Reduction, TreeLeaves, TreeReduction, default_reduction
from virtualflow.runtime.step.stats import MAX_METRICS, BadFlags, StatsLayout
from virtualflow.runtime.step.tree_body import TreeBody
from virtualflow.runtime.step.update import ShardedUpdate, WholeUpdate, make_update


__all__ = ["MAX_METRICS", "PROBE_BUDGET", "PROBE_CHANGE", "PROBE_EVERY", "BatchLoader", "BatchNormState",
           "LossShapeError", "NonFiniteLossError", "StepOutcome", "VNEngine", "check_loss", "probe_due",
           "seed_random_streams", "to_device"]
"""The step's parts (:mod:`~virtualflow.runtime.batches`), the BatchNorm state
(:mod:`~virtualflow.runtime.batchnorm`), the probe rule (:mod:`~virtualflow.runtime.probe`) and the
statistics vector's metric slots (:mod:`~virtualflow.runtime.step.stats`) are re-exported: they were
imported from here."""


class VNEngine:
    """Runs steps of one job on one worker; the group and the VN list may change between steps.

    It keeps a step's order of operations (BatchNorm snapshot, each VN's forward and backward in
    turn or along the tree, the reduction armed before the last backward, the update, the probe
    of a worker with no VN) and the generation's membership; the mode is chosen once, at
    construction (its step body and its reduction's factory), and the reduction once per
    generation. What needs none of the per-step state lives beside it (:mod:`virtualflow.runtime.step`,
    :mod:`~virtualflow.runtime.batches`, :mod:`~virtualflow.runtime.batchnorm`,
    :mod:`~virtualflow.runtime.probe`, :mod:`~virtualflow.runtime.sharded`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_fn: Callable,
        plan: DataPlan,
        loader: BatchLoader,
        *,
        seed: int,
        batchnorm: str,
        deterministic: bool,
        device: torch.device,
        reduction: str = "allreduce",
        loader_workers: int = 0,
        breakdown: bool = True,
        precision: str = "32",
        max_grad_norm: float | None = None,
        loss_scale: dict[str, Any] | None = None,
        shard_replicas: int = 0,
        deterministic_exchange: str = "auto",
        fsdp: FsdpKnobs | None = None,
    ) -> None:
        self.model = model
        self._modules = list(model.modules())  # to tell cheaply whether all are in training mode
        self.optimizer, self.scheduler = optimizer, scheduler
        self.plan = plan
        self.batchnorm = batchnorm
        self.deterministic = deterministic
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bn = BatchNormState(model)
        self.clock = StepClock(breakdown)
        """This worker's step intervals (runtime/breakdown.py)."""
        self.prefetcher = Prefetcher(loader, loader_workers, io=breakdown) if loader_workers > 0 else None
        """Loads the next VNs' batches while the current ones compute (``loader_workers`` > 0)."""
        self.group: Group | None = None
        self.vns: list[int] = []
        self.reduction: Reduction | TreeReduction | None = None  # this generation's (runtime/step/reduction.py)
        self.stats: StatsLayout | None = None  # this generation's statistics vector (runtime/step/stats.py)
        self.exchange = ExchangeChoice(deterministic_exchange)  # (checks the knob's value now)
        """``LaunchOptions.deterministic_exchange``: auto, owners or slots (:mod:`virtualflow.plan.exchange`)."""
        self.exchange_choice: tuple[str, str] | None = None
        """Deterministic mode with several workers: (the exchange this generation runs, why)."""
        # The mode's step body and reduction, chosen once (deterministic: the fixed VN-id tree).
        self._sum, self._reduction_for = self._sum_buckets, self._buckets_for
        self.tree_body: TreeBody | None = None  # deterministic mode's step body (runtime/step/tree_body.py)
        if deterministic:
            self.tree_body = TreeBody(self)
            self._sum, self._reduction_for = self._sum_tree, self.tree_body.reduction_for
        self.leaves: TreeLeaves | None = self.tree_body.leaves if self.tree_body is not None else None
        self.sharded = reduction in ("sharded", "fsdp")
        """The state is spread over the workers (checkpoints gather it collectively)."""
        self.precision = precision
        """``Job.precision``: the forward and loss run under :func:`~virtualflow.runtime.amp.autocast`."""
        self.finish = StepFinish.of(self.params, precision, loss_scale, max_grad_norm)
        """Unscale, the inf/nan verdict, the whole step's norm, clip (:mod:`virtualflow.runtime.step.finish`)."""
        self.update = self._update_for(reduction, optimizer, shard_replicas, fsdp)
        self.flat: FlatParams | None = self.update.flat
        """Sharded: the parameters' flat vector (the reduction writes the chunk's gradient there)."""
        self.shard: ShardedOptimizer | None = self.update.shard
        self.comm: Collectives | None = None
        self.grad_numel = sum(p.numel() for p in self.params)
        self.compute = VNCompute(model, loss_fn, plan, loader, seed=seed, device=device, precision=precision,
                                 scaler=self.scaler, bn=self.bn, clock=self.clock, prefetcher=self.prefetcher)
        """One VN's batch, forward and backward (:mod:`virtualflow.runtime.step.compute`)."""
        self._last_compute_s = 0.0
        self.idle = IdleProbe()
        """A worker with no VN: when it probes (see the module docstring)."""
        self.phase = "idle"
        """Where the current step is (reported when a peer fails): before_forward, backward,
        reduction, commit (``shard_replicas=1``: the replica's exchange and the commit), apply, idle."""
        self._det_flat: torch.Tensor | None = None
        self._fault_point: Callable[[int, str], None] | None = None
        self._step_no = -1
        self._in_last_backward = False
        self.generation_broken: Callable[[], bool] | None = None
        """Asked before each virtual node's forward: True once the coordinator has declared this
        generation broken (the worker's heartbeat thread watches the flag). The step is then
        abandoned at once instead of after computing the VNs left, whose result nobody can use."""

    def _update_for(self, reduction: str, optimizer: torch.optim.Optimizer, shard_replicas: int,
                    fsdp: FsdpKnobs | None) -> WholeUpdate | ShardedUpdate | FsdpUpdate:
        """The optimizer update, whole or sharded (:mod:`virtualflow.runtime.step.update`); sharded
        parameters (:mod:`virtualflow.runtime.fsdp`) bring their own step body, in both modes."""
        if fsdp is None:
            return make_update(reduction, optimizer, self.params, shard_replicas=shard_replicas,
                               cuts=self.finish.cuts())
        update = fsdp.update(self.model, optimizer, self.params, deterministic=self.deterministic, device=self.device)
        self._sum, self._reduction_for = FsdpBody(self, update, self.deterministic).entry_points()
        return update

    @property
    def scaler(self) -> LossScaler | None:
        """``"16-mixed"``'s loss scale (None otherwise); its decisions are the whole step's."""
        return self.finish.scaler

    def install_fault_point(self, fn: Callable[[int, str], None]) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point (see runtime/faults.py)."""
        self._fault_point = fn

        def mid_backward(_: torch.Tensor) -> None:
            if self._in_last_backward:
                self._in_last_backward = False
                fn(self._step_no, "mid_backward")

        # params[0] receives its gradient late in backward, after most buckets have launched.
        self.params[0].register_post_accumulate_grad_hook(mid_backward)

    def check_broken(self) -> None:
        if self.generation_broken is not None and self.generation_broken():
            generation = self.group.generation if self.group is not None else -1
            raise PeerFailure(generation, "the coordinator declared the generation broken (a member failed); "
                                          "the step is abandoned before its next virtual node")

    @property
    def fault_points(self) -> bool:
        """Whether fault injection is installed (:meth:`install_fault_point`)."""
        return self._fault_point is not None

    def point(self, phase: str) -> None:
        if self._fault_point is not None:
            self._fault_point(self._step_no, phase)

    def abandon_step(self) -> None:
        """Forget a step interrupted by a peer failure: BN statistics back to the step's start,
        gradients dropped, the reducer discarded (the generation's group is broken)."""
        self.clock.abandon()
        if self.bn and self.phase in ("before_forward", "backward", "reduction", "commit"):
            self.bn.restore()
        if not self.update.keeps_gradient:
            self._zero_grad()  # sharded, pending: the chunk's reduced gradient stays for the rebuild to apply
        self.update.deferred_failure = None
        self._det_flat = None
        self.compute.metrics.reset()
        if self.reduction is not None:
            self.reduction.close()  # (an exchange's open step is forgotten)
            self.reduction = None
        if self.comm is not None:
            self.comm.close(timeout_s=1.0)  # its thread may wait on a silent peer: do not wait for it
            self.comm = None
        self.group = None
        self.phase = "idle"

    def set_membership(self, group: Group, assignment: Sequence[Sequence[int]]) -> None:
        """Adopt a generation: this worker runs ``assignment[group.rank]``."""
        if self.reduction is not None:
            self.reduction.close()
            self.reduction = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.group = group
        self.update.deferred_failure = None
        self.clock.reset()
        if self.prefetcher is not None:
            self.prefetcher.clear()
        self.vns = list(assignment[group.rank])
        lo = self.vns[0] if self.vns else 0
        contiguous = self.vns == list(range(lo, lo + len(self.vns)))
        self._vn_ids = slice(lo, lo + len(self.vns)) if contiguous else torch.tensor(self.vns, dtype=torch.long,
                                                                                        device=self.device)
        """Where this worker's VNs' flags go in the step's ``bad`` vector: a slice (one copy) when
        they are consecutive, as the planner assigns them, else an index tensor."""
        self._last_compute_s = 0.0
        self.idle.new_generation()
        if self.shard is not None:
            self.shard.shard(group.rank, group.size, group.generation)  # raises ShardLost after a failure
            self.comm = Collectives(group)
        self.reduction = self._reduction_for(group, assignment)

    # -- the reduction, chosen once per generation (runtime/step/reduction.py) ---------------------
    def _buckets_for(self, group: Group, assignment: Sequence[Sequence[int]]) -> Reduction:
        """Default mode's statistics layout (the loss and the BatchNorm statistics ride in it) and
        reduction for this generation."""
        self.stats = StatsLayout(self.plan.virtual_nodes, group.size, group.rank, loss=True, bn_numel=self.bn.numel,
                                 bn_mean=self.batchnorm == "mean")
        return default_reduction(self.params, group, self.shard, self.comm)

    def _zero_grad(self) -> None:
        self.update.zero_grad()

    def _bn_sum(self) -> torch.Tensor | None:
        """A step's sum of BatchNorm statistics over this worker's VNs (``mean``), or None where
        there is none to sum (a model without BatchNorm: no empty tensor per step)."""
        return torch.zeros(self.bn.numel, device=self.device) if self.bn.numel and self.batchnorm == "mean" else None

    # -- the optimizer's state is read, gathered, loaded and sized through ``update`` -------------
    def before_regroup(self) -> None:
        """A planned membership change follows this step: with the sharded reduction, every member
        gathers the whole optimizer state now, while the old generation's group still works, so the
        next generation can cut it again (a leaving member's chunk is not lost)."""
        self.update.before_regroup(self.comm, self.group)

    def _apply(self) -> None:
        """The update, with the reduced gradient in place."""
        self.update.apply(self.scheduler, self.group, self.comm, self.point, self._set_phase)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    @property
    def slowdown(self) -> float:
        """Emulated slowness (tests, benchmarks): :attr:`VNCompute.slowdown <virtualflow.runtime.step.compute.VNCompute.slowdown>`."""
        return self.compute.slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        self.compute.slowdown = value

    def close(self) -> None:
        """Stop the loader threads (the worker is leaving)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    # -- a worker with no VN -------------------------------------------------------------------
    def idle_compute(self, step: int) -> tuple[float, bool]:
        """A worker with no VN, before it joins the reduction: (compute time to report, probed)."""
        c = self.compute
        return self.idle.compute(c.vn_s * c.slowdown, c.loss_dtype is not None, lambda: c.probe(step))

    def pack_stats(self, bad: BadFlags, control: int | Callable[[], int], loss: float | torch.Tensor | None,
                    bn: torch.Tensor | None) -> torch.Tensor:
        """This worker's statistics vector (:class:`~virtualflow.runtime.step.stats.StatsLayout`). A
        callable ``control`` is read here, as late as the step allows: a command (a stop) given
        while this step computed is acted on at its boundary."""
        if callable(control):
            control = int(control())
        return self.stats.pack(bad, control, self.compute.metrics.vector(self.device, bad.dtype), loss, bn,
                               self._last_compute_s, self.clock.previous())

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        """Run one step. ``control`` (a number, or a callable read when the statistics are packed)
        is summed across workers and handed back (see worker).

        Besides the gradients, workers must agree on a few numbers (which VNs had a
        non-finite loss, the control sequence, the loss, the BatchNorm statistics): they travel
        in one small vector (:mod:`virtualflow.runtime.step.stats`), appended to the last gradient
        bucket in default mode.
        """
        assert self.group is not None, "set_membership() first"
        self.update.raise_deferred()  # shard_replicas=1: the last step's all-gather failed after it applied
        self._begin(step)
        bad = BadFlags(self.plan.virtual_nodes, None if self.compute.on_cpu else self.device)
        got = self.stats.read(*self._sum(step, bad, control))  # the mode's body (_sum_buckets, _sum_tree)
        bad_vns, control_sum, compute_s, bn_new = got.bad_vns, got.control, got.compute_s, got.bn
        metrics = self.compute.metrics.named(got.metric_values)
        # rank 0 reports every rank's timing; the parts are derived where they are read (the
        # coordinator), not here: rank 0's step is every worker's wait
        breakdown = Raw(got.breakdown_raw) if self.clock.enabled and self.group.rank == 0 else None
        loss_value = float(got.loss)
        if bad_vns:
            if self.bn:
                self.bn.restore()
            self._zero_grad()
            self._det_flat = None
            self.phase = "idle"
            return StepOutcome(loss_value, bad_vns, control_sum, compute_s, breakdown, metrics=metrics)
        # The reduced gradient is held: from here on the step is committed on this worker (see
        # runtime/worker.py for the rule that keeps survivors consistent).
        self.phase = "apply"
        self.point("after_reduction")
        t_apply = time.perf_counter()
        scale = self.finish.loss_scale
        norm, skipped = self._finish_gradient()
        if bn_new is not None:
            self.bn.load_flat(bn_new)
        if not self.vns:
            self.bn.advance_counters()  # as the forward of a VN would have (the others ran one)
        if skipped:
            self._zero_grad()  # the optimizer and the LR scheduler do not step
        else:
            self._apply()
        self.finish.update(skipped)
        self.clock.add("optimizer_s", time.perf_counter() - t_apply)
        self.phase = "idle"
        return StepOutcome(loss_value, [], control_sum, compute_s, breakdown, metrics=metrics,
                           grad_norm=norm, skipped=skipped, loss_scale=scale)

    def _finish_gradient(self) -> tuple[float | None, bool]:
        """After the reduction: unscale (``16-mixed``), take the whole step's gradient norm when it
        is needed, decide whether the step is skipped (an inf/nan gradient under loss scaling) and
        clip (:meth:`StepFinish.finish`). Returns (norm, skipped). The same on every worker: every
        worker holds the same reduced gradient, or (sharded) the same all-reduced block sums
        (:mod:`virtualflow.runtime.clipping`)."""
        held = self.update.held(self._det_flat, self.group)  # the deterministic tree's sum, if it left one
        self._det_flat = None
        return self.finish.finish(held)

    def _begin(self, step: int) -> None:
        """The start of every step: the clock, the metric sums, the prefetch, BatchNorm's snapshot."""
        self.clock.begin()
        self.compute.metrics.reset()
        self._step_no = step
        self.idle.new_step()
        if self.prefetcher is not None:
            self.compute.prefetch(step, self.vns)
        if not all(m.training for m in self._modules):  # model.train() walks and sets every module: ~40 us
            self.model.train()
        if self.bn:
            self.bn.snapshot()
        self.phase = "before_forward"
        self.point("before_forward")

    # -- default mode: VNs in order, the last backward overlapped with the reduction ---------------
    def _sum_buckets(self, step: int, bad: BadFlags, control: int | Callable[[], int]
                     ) -> tuple[torch.Tensor, None, None]:
        """This worker's VNs (or, with none, maybe a probe and zeros), then the reduction; returns
        the summed statistics vector (the loss and BatchNorm statistics are in it)."""
        assert self.reduction is not None
        self._zero_grad()
        t_step = time.perf_counter()  # the VNs' data loading counts as their compute
        if self.vns:
            stats = self._run_vns(step, bad, control)  # armed the reduction before the last backward
            compute_s, probed = time.perf_counter() - t_step, False
        else:  # no VN here: maybe a probe, then zeros into every bucket (finish() launches them all)
            compute_s, probed = self.idle_compute(step)
            bn_acc = self._bn_sum()
            stats = self.pack_stats(bad, control, torch.zeros((), device=self.device), bn_acc)
        self.phase = "reduction"
        self.clock.enter_reduction()
        if not self.vns:
            self.reduction.arm(stats)
        stats = self.reduction.finish(stats, self.point)
        self.clock.leave_reduction()
        self._last_compute_s = compute_s
        if not self.vns:
            self.idle.note_idle(t_step, probed)
        return stats, None, None

    def _run_vns(self, step: int, bad: BadFlags, control: int | Callable[[], int]) -> torch.Tensor:
        """Forward and backward of each VN here, accumulating into ``.grad``; the statistics are
        packed, and the reduction armed with them, before the last backward. Returns them."""
        bn_acc = self._bn_sum()
        last = len(self.vns) - 1
        c = self.compute
        sizes, batches = c.batches(step, self.vns)  # (with a prefetcher, each taken when its turn comes)
        losses, shares = [], []
        for i, vn in enumerate(self.vns):
            self.check_broken()
            if batches[i] is None:
                batches[i] = c.load(step, vn)[0]
            t_vn = time.perf_counter()
            loss, share = c.forward(step, vn, batches[i], sizes[i])
            batches[i] = None  # drop the VN's inputs with its activations
            losses.append(loss)
            shares.append(share)
            if self.bn.numel:
                if self.batchnorm == "mean":
                    bn_acc += self.bn.flat()
                elif vn == 0:
                    bn_acc = self.bn.flat()
            if i == last:
                ws, total = c.weighted_block(losses, shares)
                bad.note_block(self.vns, self._vn_ids, ws)
                stats = self.pack_stats(bad, control, total, bn_acc)
                self.reduction.arm(stats)
                self.phase = "backward"
                self._in_last_backward = True
                c.sleep_before_last_backward(t_vn)
            c.backward(loss, share)
            if i != last:
                c.emulate(t_vn)
        self._in_last_backward = False
        return stats

    # -- deterministic mode: per-VN vectors summed along the fixed tree -----------------------------
    def _sum_tree(self, step: int, bad: BadFlags, control: int | Callable[[], int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Deterministic mode's body (:class:`~virtualflow.runtime.step.tree_body.TreeBody`): (the
        summed statistics, the loss, BatchNorm's mean statistics or None); the whole flat sum, when
        there is one, is held until the step is decided (:meth:`_finish_gradient`)."""
        stats, loss, bn_mean, self._det_flat, self._last_compute_s = self.tree_body.sum(step, bad, control)
        return stats, loss, bn_mean
