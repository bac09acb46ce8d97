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

Size: one concept (a step over this worker's VNs, in its two reduction modes and with its
profiling probe). What a VN's step consumes and produces is in :mod:`virtualflow.runtime.batches`,
the BatchNorm bookkeeping in :mod:`virtualflow.runtime.batchnorm`, the probe's rule in
:mod:`virtualflow.runtime.probe`; the worker-facing half (generations, checkpoints) is
:class:`virtualflow.runtime.vn_worker.VNWorkerEngine`.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.exchange import OwnerExchange
from virtualflow.comm.groups import Group, PeerFailure
from virtualflow.comm.reduce import (BucketReducer, ShardReducer, plan_buckets, tree_exchange,
                                     tree_exchange_sharded, tree_reduce_local)
from virtualflow.comm.ring import Collectives
from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.exchange import OwnerSchedule, choose_exchange
from virtualflow.plan.vnmap import Node, TreePlan, split
from virtualflow.runtime.amp import LossScaler, autocast
from virtualflow.runtime.batches import (BatchLoader, LossShapeError, NonFiniteLossError, StepOutcome, check_loss,
                                         seed_random_streams, split_loss, to_device)
from virtualflow.runtime.batchnorm import BatchNormState
from virtualflow.runtime.breakdown import RAW, StepClock, derive, measured_load
from virtualflow.runtime.partials import Partials, direct_possible
from virtualflow.runtime.prefetch import Prefetcher
from virtualflow.runtime.probe import PROBE_BUDGET, PROBE_CHANGE, PROBE_EVERY, ProbeCounters, probe_due
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer
from virtualflow.runtime.step.finish import StepFinish
from virtualflow.runtime.step.update import ShardedUpdate, WholeUpdate, make_update


__all__ = ["PROBE_BUDGET", "PROBE_CHANGE", "PROBE_EVERY", "BatchLoader", "BatchNormState", "LossShapeError",
           "NonFiniteLossError", "StepOutcome", "VNEngine", "check_loss", "probe_due", "seed_random_streams",
           "to_device"]
"""The step's parts (:mod:`~virtualflow.runtime.batches`), the BatchNorm state
(:mod:`~virtualflow.runtime.batchnorm`) and the probe rule (:mod:`~virtualflow.runtime.probe`) are
re-exported: they were imported from here."""


MAX_METRICS = 16
"""Slots for the loss function's metrics in a step's statistics vector (every worker sends the same
length, whether or not it ran a virtual node)."""


class VNEngine:
    """Runs steps of one job on one worker; the group and the VN list may change between steps.

    Why one class of about 500 lines: a step's order of operations (BatchNorm snapshot, each VN's
    forward and backward, the reduction with its stats riding in the last bucket, the update, the
    probe of a worker with no VN) in both reduction modes reads and writes the same per-step
    state; split, that order would be spread over several classes' private fields. What needs
    none of it lives beside it (:mod:`~virtualflow.runtime.batches`, :mod:`~virtualflow.runtime.batchnorm`,
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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.plan = plan
        self.loader = loader
        self.seed = seed
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
        self.reducer: BucketReducer | ShardReducer | None = None
        self.sharded = reduction == "sharded"
        self.precision = precision
        """``Job.precision``: the forward and loss run under :func:`~virtualflow.runtime.amp.autocast`."""
        self.finish = StepFinish.of(self.params, precision, loss_scale, max_grad_norm)
        """Unscale, the inf/nan verdict, the whole step's norm, clip (:mod:`virtualflow.runtime.step.finish`)."""
        self.update: WholeUpdate | ShardedUpdate = make_update(reduction, optimizer, self.params,
                                                               shard_replicas=shard_replicas, cuts=self.finish.cuts())
        """The optimizer update, whole or sharded (:mod:`virtualflow.runtime.step.update`)."""
        self.flat: FlatParams | None = self.update.flat
        """Sharded: the parameters' flat vector (the reduction writes the chunk's gradient there)."""
        self.shard: ShardedOptimizer | None = self.update.shard
        self.comm: Collectives | None = None
        self.tree: TreePlan | None = None
        self.grad_numel = sum(p.numel() for p in self.params)
        self._first_bn: torch.Tensor | None = None
        self.slowdown = 1.0
        """Emulated slowness (tests, benchmarks): each VN's compute is followed by a sleep of
        ``(slowdown - 1)`` times its measured duration."""
        self._last_compute_s = 0.0
        self._vn_s = 0.0  # smoothed compute time of one VN, without emulated sleep
        # A worker with no VN: its probes (see the module docstring).
        self.probes = ProbeCounters()
        """A worker with no VN: when it probes (see the module docstring)."""
        self._steps_in_generation = 0
        self._loss_dtype: torch.dtype | None = None
        self.phase = "idle"
        """Where the current step is (reported when a peer fails): before_forward, backward,
        reduction, commit (``shard_replicas=1``: the replica's exchange and the commit), apply, idle."""
        self.metric_names: list[str] = []
        """The loss function's metric names (sorted), learnt from the first forward run here."""
        self._metric_sums: dict[str, torch.Tensor] = {}
        self._det_flat: torch.Tensor | None = None
        choose_exchange(TreePlan.build([[0]]), 1, 4, deterministic_exchange)  # the knob's check
        self.deterministic_exchange = deterministic_exchange
        """``LaunchOptions.deterministic_exchange``: auto, owners or slots (:mod:`virtualflow.plan.exchange`)."""
        self.exchange_choice: tuple[str, str] | None = None
        """Deterministic mode with several workers: (the exchange this generation runs, why)."""
        self._exchange: OwnerExchange | None = None
        self._partials: Partials | None = None
        """Deterministic mode: the partial sums' reused buffers and leaf arithmetic (None when the
        parameters' dtypes differ: fresh vectors per leaf then, :func:`tree_reduce_local`)."""
        if deterministic and direct_possible(self.params):
            self._partials = Partials(self.params, self._tail_numel())
        self._fault_point: Callable[[int, str], None] | None = None
        self._step_no = -1
        self._in_last_backward = False
        self.generation_broken: Callable[[], bool] | None = None
        """Asked before each virtual node's forward: True once the coordinator has declared this
        generation broken (the worker's heartbeat thread watches the flag). The step is then
        abandoned at once instead of after computing the VNs left, whose result nobody can use."""

    @property
    def scaler(self) -> LossScaler | None:
        """``"16-mixed"``'s loss scale (None otherwise); its decisions are the whole step's."""
        return self.finish.scaler

    @property
    def deferred_failure(self) -> PeerFailure | None:
        """``shard_replicas=1``: the parameters' all-gather failed after this worker applied the step
        (so the step counts as applied); raised at the step boundary (:meth:`raise_deferred`)."""
        return self.update.deferred_failure

    @deferred_failure.setter
    def deferred_failure(self, value: PeerFailure | None) -> None:
        self.update.deferred_failure = value

    def install_fault_point(self, fn: Callable[[int, str], None]) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point (see runtime/faults.py)."""
        self._fault_point = fn

        def mid_backward(_: torch.Tensor) -> None:
            if self._in_last_backward:
                self._in_last_backward = False
                fn(self._step_no, "mid_backward")

        # params[0] receives its gradient late in backward, after most buckets have launched.
        self.params[0].register_post_accumulate_grad_hook(mid_backward)

    def _check_broken(self) -> None:
        if self.generation_broken is not None and self.generation_broken():
            generation = self.group.generation if self.group is not None else -1
            raise PeerFailure(generation, "the coordinator declared the generation broken (a member failed); "
                                          "the step is abandoned before its next virtual node")

    def _point(self, phase: str) -> None:
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
        self.deferred_failure = None
        self._det_flat = None
        self._metric_sums = {}
        self._drop_exchange()
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.comm is not None:
            self.comm.close(timeout_s=1.0)  # its thread may wait on a silent peer: do not wait for it
            self.comm = None
        self.group = None
        self.phase = "idle"

    def set_membership(self, group: Group, assignment: Sequence[Sequence[int]]) -> None:
        """Adopt a generation: this worker runs ``assignment[group.rank]``."""
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.group = group
        self.deferred_failure = None
        self.clock.reset()
        if self.prefetcher is not None:
            self.prefetcher.clear()
        self.vns = list(assignment[group.rank])
        self._vn_ids = torch.tensor(self.vns, dtype=torch.long, device=self.device)
        self._last_compute_s = 0.0
        self.probes.new_generation()
        self._steps_in_generation = 0
        self._drop_exchange()
        if self.deterministic:
            self.tree = TreePlan.build(assignment)
        if self.sharded:
            assert self.shard is not None and self.flat is not None
            self.shard.shard(group.rank, group.size, group.generation)  # raises ShardLost after a failure
            self.comm = Collectives(group)
            if not self.deterministic and group.size > 1:
                self.reducer = ShardReducer(self.params, self.flat.offsets, self.flat.grad, self.shard.bounds,
                                            self.comm)
        elif not self.deterministic and group.size > 1:
            self.reducer = BucketReducer(self.params, group)
        if self.deterministic:
            self._plan_exchange()

    # -- deterministic mode's exchange ------------------------------------------------------------
    def _tail_numel(self) -> int:
        """Elements after the gradients in a deterministic leaf: BatchNorm statistics (mean
        mode), then the weighted loss."""
        return (self.bn.numel if self.bn.numel and self.batchnorm == "mean" else 0) + 1

    def _plan_exchange(self) -> None:
        """Choose this generation's exchange (:func:`~virtualflow.plan.exchange.choose_exchange`)
        and, for ``owners``, cut the leaf vector into the pieces the last backward sends as it
        finishes them: the gradient buckets in launch order (as the default mode's), then the tail."""
        assert self.tree is not None and self.group is not None
        self.exchange_choice = None
        if self.group.size == 1:
            return
        numel = self.grad_numel + self._tail_numel()
        like = self._leaf_like()
        self.exchange_choice = choose_exchange(self.tree, numel, like.element_size(), self.deterministic_exchange)
        if self.exchange_choice[0] != "owners":
            return
        offsets, at = [], 0
        for p in self.params:
            offsets.append(at)
            at += p.numel()
        pieces, piece_params = [], []
        for idx in plan_buckets(self.params):
            lo = min(offsets[i] for i in idx)
            hi = max(offsets[i] + self.params[i].numel() for i in idx)
            pieces.append((lo, hi))
            piece_params.append(sorted(idx))
        if self._partials is not None:
            self._partials.set_pieces(pieces, piece_params)
        pieces.append((self.grad_numel, numel))  # the tail: BatchNorm statistics and loss
        if self.shard is not None:  # each owner keeps its chunk of the gradients; the tail goes to all
            bounds = [tuple(b) for b in self.shard.bounds]
            bounds[-1] = (bounds[-1][0], numel)
            gather = [(self.grad_numel, numel)]
        else:
            bounds, gather = None, None
        schedule = OwnerSchedule.build(self.tree, numel, bounds=bounds, pieces=pieces, gather=gather)
        pieces_units = [[j for j, u in enumerate(schedule.units) if lo <= u.lo and u.hi <= hi] for lo, hi in pieces]
        self._exchange = OwnerExchange(schedule, self.group, dtype=like.dtype, device=self.device,
                                       pieces_units=pieces_units)

    def _drop_exchange(self) -> None:
        if self._exchange is not None:
            self._exchange.abandon()
        self._exchange = None

    def _zero_grad(self) -> None:
        self.update.zero_grad()

    # -- the whole optimizer state (checkpoints, transfers) -------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's whole state (``state_dict`` format). Sharded: only while it is held
        whole (:meth:`gather_optimizer_state` collects it, a collective)."""
        return self.update.state()

    def gather_optimizer_state(self, root: int | None = None) -> dict[str, Any] | None:
        """The whole optimizer state: with the sharded reduction a collective (every member calls
        it at the same point) that delivers it to every member, or only to rank ``root`` (the
        others get ``None`` and never hold more than their chunk); a local read otherwise."""
        return self.update.gather_state(self.comm, self.group, root)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.update.load_state(state)

    def before_regroup(self) -> None:
        """A planned membership change follows this step: with the sharded reduction, every member
        gathers the whole optimizer state now, while the old generation's group still works, so the
        next generation can cut it again (a leaving member's chunk is not lost)."""
        self.update.before_regroup(self.comm, self.group)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds now."""
        return self.update.state_bytes()

    def _apply(self) -> None:
        """The update, with the reduced gradient in place."""
        self.update.apply(self.scheduler, self.group, self.comm, self._point, self._set_phase)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    # ------------------------------------------------------------------------------------
    def raise_deferred(self) -> None:
        """Raise the failure of an applied step's all-gather (``shard_replicas=1``), if any."""
        self.update.raise_deferred()

    def replica_bytes(self) -> int:
        """Bytes the sharded optimizer's replica costs this worker (``shard_replicas=1``; else 0)."""
        return self.update.replica_bytes()

    def _forward(self, step: int, vn: int, batch: Any = None, n: int = 0) -> torch.Tensor:
        """Forward of one VN from the step's starting BN statistics; returns the weighted loss."""
        if self.bn:
            self.bn.restore()
        now = time.perf_counter
        if batch is None:
            indices = self.plan.vn_indices(step, vn)
            batch, n = self._load(step, vn, indices), len(indices)
        if self.device.type != "cpu":
            t0 = now()
            batch = to_device(batch, self.device)
            self.clock.add("input_s", now() - t0)
        seed_random_streams(vn_seed(self.seed, step, vn), self.device)
        t0 = now()
        with autocast(self.device, self.precision):
            out = self.loss_fn(self.model, batch)
        self.clock.add("forward_s", now() - t0)
        where = f"at step {step} in virtual node {vn}"
        loss, metrics = split_loss(out, where)
        check_loss(loss, where)
        self._loss_dtype = loss.dtype
        share = n / self.plan.global_batch_size
        self._note_metrics(metrics, share, where)
        return loss * share

    def _note_metrics(self, metrics: dict[str, Any], share: float, where: str) -> None:
        """Add a VN's metrics, weighted by its share of the global batch, to the step's sums."""
        names = sorted(metrics)
        if not self.metric_names and names:
            if len(names) > MAX_METRICS:
                raise LossShapeError(f"Job.loss returned {len(names)} metrics {where}; at most {MAX_METRICS} are "
                                     f"reduced per step")
            self.metric_names = names
        elif names != self.metric_names and (names or self._metric_sums):
            raise LossShapeError(f"Job.loss returned the metrics {names} {where}, but {self.metric_names} before: "
                                 f"return the same names at every call")
        for name in names:
            value = metrics[name]
            value = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(
                float(value))
            acc = self._metric_sums.get(name)
            self._metric_sums[name] = value * share if acc is None else acc + value * share

    def _load(self, step: int, vn: int, indices: torch.Tensor) -> Any:
        """VN ``vn``'s batch of ``step``: from the prefetcher when there is one (the time waited
        for it is the input time), else loaded now."""
        if self.prefetcher is not None:
            batch, waited, stats = self.prefetcher.take(step, vn, indices)
            self.clock.add("input_s", waited)
        else:
            batch, stats = measured_load(self.loader, indices, io=self.clock.enabled)
            self.clock.add("input_s", stats.seconds)
        self.clock.add_load(stats)
        return batch

    def _prefetch(self, step: int) -> None:
        """Start loading this step's VNs (what is not under way yet) and the next step's."""
        assert self.prefetcher is not None
        for s in (step, step + 1):
            for vn in self.vns:
                self.prefetcher.schedule(s, vn, self.plan.vn_indices(s, vn))

    def _backward(self, weighted: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.finish.scale_loss(weighted).backward()
        self.clock.add("backward_s", time.perf_counter() - t0)

    def _sleep(self, seconds: float) -> None:
        """Emulated slowness (counted as compute, split between forward and backward)."""
        time.sleep(seconds)
        self.clock.add("emulated_s", seconds)

    def close(self) -> None:
        """Stop the loader threads (the worker is leaving)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    # -- a worker with no VN -------------------------------------------------------------------
    def _probe_due(self) -> bool:
        """Whether this step (of a worker with no VN) runs a probe: :func:`probe_due` on this
        worker's counters."""
        return self.probes.due(self._vn_s * self.slowdown, ran_forward=self._loss_dtype is not None)

    def _probe(self, step: int) -> float:
        """Time one VN's forward and backward without contributing it; returns the seconds."""
        old = self.probes.estimate(self._vn_s * self.slowdown)
        vn = step % self.plan.virtual_nodes
        t0 = time.perf_counter()
        weighted = self._forward(step, vn)
        self._metric_sums = {}  # a probe contributes nothing
        if weighted.requires_grad:
            t_b = time.perf_counter()
            torch.autograd.grad(weighted, self.params, allow_unused=True)
            self.clock.add("backward_s", time.perf_counter() - t_b)
        self._emulate(t0)
        del weighted
        if self.bn:
            self.bn.restore()
        took = time.perf_counter() - t0
        self.probes.took(took, old)
        return took

    def _idle_compute(self, step: int) -> tuple[float, bool]:
        """A worker with no VN, before it joins the reduction: (compute time to report, probed)."""
        if self._probe_due():
            return self._probe(step), True
        return 0.0, False

    def _note_idle(self, t_step: float, probed: bool) -> None:
        """After the reduction: how long a worker with no VN waited for the others (the time a
        probe may take for free). The generation's first step (warm-up) is left out."""
        if probed or self._steps_in_generation <= 1:
            return
        self.probes.waited(time.perf_counter() - t_step)

    def _leaf_like(self) -> torch.Tensor:
        """An (uninitialised) vector of one deterministic-mode leaf's size and dtype: what a
        worker with no VN hands to the tree exchange."""
        with_bn = self.bn.numel and self.batchnorm == "mean"
        if self._partials is not None:  # the buffers' dtype: the parameters'
            return torch.empty(self._partials.numel, dtype=self._partials.dtype, device=self.device)
        dtypes = [p.dtype for p in self.params] + [self._loss_dtype or self.params[0].dtype]
        numel = self.grad_numel + 1
        if with_bn:
            dtypes += [b.dtype for b in self.bn.float_bufs]
            numel += self.bn.numel
        return torch.empty(numel, dtype=functools.reduce(torch.promote_types, dtypes), device=self.device)

    def _pack_stats(self, bad: torch.Tensor, control: int | Callable[[], int], loss: torch.Tensor | None,
                    bn: torch.Tensor | None) -> torch.Tensor:
        """[bad flag per VN | control | metric sums (MAX_METRICS slots) | loss (default mode) | BN
        statistics (if any) | timing]. A callable ``control`` is read here, as late as the step
        allows: a command (a stop) given while this step computed is acted on at its boundary."""
        if callable(control):
            control = int(control())
        metrics = torch.zeros(MAX_METRICS, device=self.device, dtype=bad.dtype)
        for i, name in enumerate(self.metric_names):
            if name in self._metric_sums:
                metrics[i] = self._metric_sums[name].to(self.device, bad.dtype)
        parts = [bad, torch.tensor([float(control)], device=self.device, dtype=bad.dtype), metrics]
        if loss is not None:
            parts.append(loss.reshape(1).to(bad.dtype))
        if self.bn.numel and (self.batchnorm == "first" or not self.deterministic):
            parts.append(bn.to(bad.dtype) if bn is not None else torch.zeros(self.bn.numel, device=self.device, dtype=bad.dtype))
        size, K = self.group.size, len(RAW)
        timing = torch.zeros(size * (1 + K), device=self.device, dtype=bad.dtype)
        timing[self.group.rank] = self._last_compute_s
        prev = self.clock.previous()
        if prev is not None:
            start = size + self.group.rank * K
            timing[start : start + K] = torch.tensor(prev, dtype=bad.dtype)
        parts.append(timing)
        return torch.cat(parts)

    def _emulate(self, t0: float) -> None:
        """Sleep ``(slowdown - 1)`` times the VN's compute that started at ``t0``."""
        dt = time.perf_counter() - t0
        self._vn_s = dt if self._vn_s == 0.0 else 0.8 * self._vn_s + 0.2 * dt
        if self.slowdown > 1.0:
            self._sleep((self.slowdown - 1.0) * dt)

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        """Run one step. ``control`` (a number, or a callable read when the statistics are packed)
        is summed across workers and handed back (see worker).

        Besides the gradients, workers must agree on a few numbers (which VNs had a
        non-finite loss, the control sequence, the loss, the BatchNorm statistics): they travel
        in one small vector, appended to the last gradient bucket in default mode.
        """
        assert self.group is not None, "set_membership() first"
        self.raise_deferred()
        self.clock.begin()
        self._metric_sums = {}
        self._step_no = step
        self._steps_in_generation += 1
        if self.prefetcher is not None:
            self._prefetch(step)
        self.model.train()
        if self.bn:
            self.bn.snapshot()
        self.phase = "before_forward"
        self._point("before_forward")
        V = self.plan.virtual_nodes
        bad = torch.zeros(V, device=self.device)
        if self.deterministic:
            if self._fault_point is not None:
                self.group.on_launch = lambda: self._point("during_reduction")
            loss, bn_mean = self._step_deterministic(step, bad)
            stats = self._pack_stats(bad, control, None, self._first_bn)
            self.group.all_reduce(stats)
            self.clock.leave_reduction()  # entered in _step_deterministic
            self.group.on_launch = None
            self._last_compute_s = self._det_compute_s
        elif not self.vns:
            # No VN here: maybe a probe, then zeros into every bucket (finish() launches them all).
            self._zero_grad()
            t_step = time.perf_counter()
            compute_s, probed = self._idle_compute(step)
            bn_acc = torch.zeros(self.bn.numel, device=self.device) if self.batchnorm == "mean" else None
            stats = self._pack_stats(bad, control, torch.zeros((), device=self.device), bn_acc)
            self.phase = "reduction"
            self.clock.enter_reduction()
            if self.reducer is not None:
                stats = self._reduce_default(stats, arm=True)
            self.clock.leave_reduction()
            self._last_compute_s = compute_s
            self._note_idle(t_step, probed)
        else:
            self._zero_grad()
            t_step = time.perf_counter()  # the VNs' data loading counts as their compute
            bn_acc = torch.zeros(self.bn.numel, device=self.device) if self.batchnorm == "mean" else None
            last = len(self.vns) - 1
            indices = [self.plan.vn_indices(step, vn) for vn in self.vns]
            if self.prefetcher is not None:
                batches = [None] * len(indices)  # each taken from the prefetcher when its turn comes
            else:
                batches, load = measured_load(self.loader.vn_batches, indices, io=self.clock.enabled)
                self.clock.add("input_s", load.seconds)
                self.clock.add_load(load)
            losses = []
            for i, vn in enumerate(self.vns):
                self._check_broken()
                if batches[i] is None:
                    batches[i] = self._load(step, vn, indices[i])
                t_vn = time.perf_counter()
                weighted = self._forward(step, vn, batches[i], len(indices[i]))
                batches[i] = None  # drop the VN's inputs with its activations
                losses.append(weighted.detach())
                if self.bn.numel:
                    if self.batchnorm == "mean":
                        bn_acc += self.bn.flat()
                    elif vn == 0:
                        bn_acc = self.bn.flat()
                if i == last:
                    ws = torch.stack(losses)
                    loss = ws.sum()
                    bad[self._vn_ids] = (~torch.isfinite(ws)).to(bad.dtype)
                    stats = self._pack_stats(bad, control, loss, bn_acc)
                    if self.reducer is not None:
                        self.reducer.arm(**({} if self.sharded else {"extra": stats}))
                    self.phase = "backward"
                    self._in_last_backward = True
                    if self.slowdown > 1.0:
                        # The last VN's backward launches the reduction: sleep before it, for
                        # the forward just run and a backward estimated from earlier VNs.
                        self._sleep((self.slowdown - 1.0) * max(self._vn_s, time.perf_counter() - t_vn))
                self._backward(weighted)
                if i != last:
                    self._emulate(t_vn)
            self._in_last_backward = False
            self._last_compute_s = time.perf_counter() - t_step
            self.phase = "reduction"
            self.clock.enter_reduction()
            if self.reducer is not None:
                stats = self._reduce_default(stats, arm=False)
            self.clock.leave_reduction()
        bad_vns = [int(v) for v in torch.nonzero(stats[:V]).flatten().tolist()]
        control_sum = int(round(stats[V].item()))
        metric_values = stats[V + 1 : V + 1 + MAX_METRICS].tolist()
        metrics = {name: metric_values[i] for i, name in enumerate(self.metric_names)} or None
        offset = V + 1 + MAX_METRICS
        if not self.deterministic:
            loss = stats[offset]
            offset += 1
        bn_new = None
        if self.bn.numel:
            if self.deterministic and self.batchnorm == "mean":
                bn_new = bn_mean
            else:
                bn_new = stats[offset : offset + self.bn.numel]
                if self.batchnorm == "mean":
                    bn_new = bn_new / V
            if not (self.deterministic and self.batchnorm == "mean"):
                offset += self.bn.numel
        size = self.group.size
        compute_s = stats[offset : offset + size].tolist()
        offset += size
        breakdown = None
        if self.clock.enabled and self.group.rank == 0:  # rank 0 reports it
            breakdown = derive(stats[offset : offset + size * len(RAW)].view(size, len(RAW)).tolist())
        loss_value = float(loss)
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
        self._point("after_reduction")
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

    def _reduce_default(self, stats: torch.Tensor, *, arm: bool) -> torch.Tensor:
        """Default mode's reduction after the last backward (``arm``: nothing was armed, as on a
        worker with no VN); returns the reduced ``stats``."""
        assert self.reducer is not None and self.group is not None
        if isinstance(self.reducer, BucketReducer):
            if arm:
                self.reducer.arm(extra=stats)
            self._point("during_reduction")
            return self.reducer.finish()
        self._point("during_reduction")
        self.reducer.finish()  # gradients: reduce-scattered into this worker's chunk
        self.group.all_reduce(stats)  # the few numbers everyone needs whole
        return stats

    def _step_deterministic(self, step: int, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-VN vectors [grads | BN stats | weighted loss] summed along the fixed tree."""
        assert self.tree is not None and self.group is not None
        self._first_bn = None
        with_bn = self.bn.numel and self.batchnorm == "mean"

        last_vn = self.vns[-1] if self.vns else None

        def run_vn(vn: int) -> torch.Tensor:
            """Forward and backward of one VN; returns its tail [BN stats (mean mode) | weighted
            loss]; the VN's gradient is in (or was accumulated into) ``p.grad``."""
            self._check_broken()
            t_vn = time.perf_counter()
            weighted = self._forward(step, vn)
            if vn == last_vn:
                self.phase = "backward"
                self._in_last_backward = True
            self._backward(weighted)
            self._in_last_backward = False
            self._emulate(t_vn)
            weighted = weighted.detach()
            bad[vn] = (~torch.isfinite(weighted)).to(bad.dtype)
            tail = []
            if with_bn:
                tail.append(self.bn.flat())
            elif self.bn.numel and vn == 0:
                self._first_bn = self.bn.flat()
            tail.append(weighted.reshape(1))
            return torch.cat(tail) if len(tail) > 1 else tail[0]

        def leaf(vn: int) -> torch.Tensor:  # a fresh vector per leaf (parameters of several dtypes)
            self._zero_grad()
            tail = run_vn(vn)
            parts = [
                p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in self.params
            ]
            parts.append(tail)
            return torch.cat(parts)

        t_step = time.perf_counter()
        probed = False
        ex = self._exchange
        held: list[torch.Tensor] = []
        if ex is not None:
            ex.begin()  # every receive of the step is posted before the first send
        if self.vns:
            nodes = self.tree.per_worker[self.group.rank]
            parts = self._partials
            if parts is not None and ex is not None:
                local = parts.streamed(nodes, run_vn, ex.send)
            elif parts is not None:
                local = parts.partials(nodes, run_vn)
            else:
                local = tree_reduce_local(nodes, leaf)
                if ex is not None:
                    for node, vec in local.items():
                        ex.send(node, vec)
            if parts is not None:
                held = list(local.values())
                if self.flat is not None:
                    self.flat.attach_grads()  # the sharded optimizer's gradients are views of its vector
            self._det_compute_s = time.perf_counter() - t_step
        else:  # no VN here: maybe a probe; no node of the tree to contribute
            local = {}
            self._det_compute_s, probed = self._idle_compute(step)
        try:
            return self._det_exchange(local, t_step, probed, with_bn)
        finally:
            if self._partials is not None:
                self._partials.give_back(held)  # reused next step (what is read from them is used before)

    def _det_exchange(self, local: dict[Node, torch.Tensor], t_step: float, probed: bool,
                      with_bn: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bring the partial sums together; returns (loss, BatchNorm mean) and leaves the summed
        gradient in ``_det_flat`` (or, sharded, this worker's chunk in the flat gradient)."""
        assert self.tree is not None and self.group is not None
        ex = self._exchange
        self.phase = "reduction"
        self.clock.enter_reduction()  # left in step(), after the statistics' all-reduce
        if ex is not None:
            root = ex.finish(local)
            if not self.vns:
                self._note_idle(t_step, probed)
            numel = self.grad_numel
            if self.shard is not None:
                lo, hi = self.shard.chunk()
                self.flat.grad[lo:hi].copy_(root[lo:hi])
            else:
                self._det_flat = root[:numel]  # into p.grad once the step is decided (_finish_gradient)
            bn_mean = root[numel : numel + self.bn.numel] / self.plan.virtual_nodes if with_bn else None
            return root[-1], bn_mean
        like = None if local else self._leaf_like()
        if self.shard is not None:
            assert self.flat is not None and self.comm is not None
            chunk, rest = tree_exchange_sharded(self.tree, self.group, local, like, self.comm, self.shard.bounds,
                                                self.grad_numel)
            if not self.vns:
                self._note_idle(t_step, probed)
            lo, hi = self.shard.chunk()
            self.flat.grad[lo:hi].copy_(chunk)
            bn_mean = rest[: self.bn.numel] / self.plan.virtual_nodes if with_bn else None
            return rest[-1], bn_mean
        total = tree_exchange(self.tree, self.group, local, like=like)
        if not self.vns:
            self._note_idle(t_step, probed)
        self._det_flat = total[: self.grad_numel]  # into p.grad once the step is decided (_finish_gradient)
        offset = self.grad_numel
        bn_mean = None
        if with_bn:
            bn_mean = total[offset : offset + self.bn.numel] / self.plan.virtual_nodes
            offset += self.bn.numel
        return total[offset], bn_mean
