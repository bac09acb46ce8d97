"""One virtual node's compute on a worker: its batch, forward, loss, backward and emulated slowness.

Purpose: what every VN of a step does, whatever the reduction (:mod:`.reduction`) and in whatever
order the VN engine runs them (in turn in default mode, along the fixed tree in deterministic
mode): load the VN's samples (from the prefetcher when there is one), restore BatchNorm's running
statistics to the step's start, seed the random streams with ``vn_seed(seed, step, vn)``, run the
loss under the job's precision, weight it by the VN's share ``n_v / B`` and add its metrics to the
step's sums (:class:`~virtualflow.runtime.step.stats.MetricSums`); backward of the weighted loss
(scaled by ``16-mixed``'s loss scale). A worker with no VN times a *probe* VN with the same forward
(nothing accumulated, see :mod:`virtualflow.runtime.probe`).

The weighting is folded into the backward where that gives the same bits
(:mod:`.weighting`, shared with the pipeline's last piece): for a float32 or float64 loss and no
loss scale, :meth:`VNCompute.backward` starts from ``loss`` with the seed gradient
``dtype(share)``, which is what ``(loss * share).backward()`` hands ``loss``'s backward. The
weighted loss itself (for the statistics) is ``loss * share`` of the detached loss, the same
operation. A block of VNs on CPU reads its losses as Python floats
(:meth:`VNCompute.weighted_block`): a float32 loss times its share rounded to float32 is exact in
a Python float, so the flags are those of the weighted losses and their sum is rounded once (to
the statistics vector's dtype, when it is packed); on an accelerator the block stays on the
device. Half-precision losses and ``16-mixed`` keep the multiplication.

Invariants: a VN's random streams and BatchNorm statistics depend only on (seed, step, VN), never
on the worker or on the VNs before it; every interval is added to the step's clock
(:class:`~virtualflow.runtime.breakdown.StepClock`) under the name the breakdown reports.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.runtime.amp import LossScaler, autocast
from virtualflow.runtime.batches import BatchLoader, check_loss, seed_generators, split_loss, to_device, vn_generators
from virtualflow.runtime.batchnorm import BatchNormState
from virtualflow.runtime.breakdown import StepClock, measured_load
from virtualflow.runtime.prefetch import Prefetcher
from virtualflow.runtime.step.stats import MetricSums
from virtualflow.runtime.step.weighting import FOLDED, LossWeighting


class VNCompute:
    """Forward and backward of one VN of a step on this worker (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, plan: DataPlan, loader: BatchLoader, *,
                 seed: int, device: torch.device, precision: str, scaler: LossScaler | None, bn: BatchNormState,
                 clock: StepClock, prefetcher: Prefetcher | None) -> None:
        self.model, self.loss_fn, self.plan, self.loader = model, loss_fn, plan, loader
        self.seed, self.device, self.precision = seed, device, precision
        self.weighting = LossWeighting(scaler)
        """What each VN's backward starts from (``16-mixed``: the weighted loss times the loss scale)."""
        self.bn, self.clock, self.prefetcher = bn, clock, prefetcher
        self.has_bn = bool(bn)
        self.on_cpu = device.type == "cpu"
        """The batch stays where it is (``torch.device.type`` costs a few microseconds per read)."""
        self.generators = vn_generators(device)
        """What each VN's seed seeds (``runtime/batches.py``)."""
        self.autocast = autocast(device, precision)
        """The forward's ``torch.autocast`` (a null context in full precision), entered anew each VN."""
        self.io = clock.enabled and getattr(loader, "reads_files", True)
        """Whether a load's I/O profile is read (the breakdown is on and the dataset may read files)."""
        self.block_loads = isinstance(loader, BatchLoader) and hasattr(plan, "vn_block")
        """Whether a step's VNs are read as one block of indices (:meth:`batches`)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.metrics = MetricSums()
        self.slowdown = 1.0
        """Emulated slowness (tests, benchmarks): each VN's compute is followed by a sleep of
        ``(slowdown - 1)`` times its measured duration."""
        self.vn_s = 0.0
        """Smoothed compute time of one VN, without emulated sleep."""
        self.loss_dtype: torch.dtype | None = None
        """The loss's dtype, once a forward ran here."""
        self._shares: tuple[tuple[float, ...], torch.dtype, Any] = ((), torch.float32, None)
        """The last block's shares (the same every step) as :meth:`weighted_block` multiplies by
        them: a tensor on an accelerator, Python floats rounded to the loss's dtype on CPU."""

    def batches(self, step: int, vns: Sequence[int]) -> tuple[list[int], list[Any]]:
        """(each VN's sample count, the batches) of ``vns`` in ``step``: loaded now, or None each
        when a prefetcher hands them over in turn (:meth:`load`). Consecutive VNs of a tensor
        dataset are read as one block of indices (one gather per tensor, a view per VN)."""
        block = None
        if self.prefetcher is None and self.block_loads:
            block = self.plan.vn_block(step, vns)
        if block is not None:
            batches, load = measured_load(self.loader.block_batches, *block, io=self.io)
            sizes = block[1]
        else:
            indices = [self.plan.vn_indices(step, vn) for vn in vns]
            sizes = [len(i) for i in indices]
            if self.prefetcher is not None:
                return sizes, [None] * len(indices)
            batches, load = measured_load(self.loader.vn_batches, indices, io=self.io)
        self.clock.add("input_s", load.seconds)
        self.clock.add_load(load)
        return sizes, batches

    def load(self, step: int, vn: int) -> tuple[Any, int]:
        """VN ``vn``'s batch of ``step`` and its sample count: from the prefetcher when there is
        one (the time waited for it is the input time), else loaded now."""
        indices = self.plan.vn_indices(step, vn)
        if self.prefetcher is not None:
            batch, waited, stats = self.prefetcher.take(step, vn, indices)
            self.clock.add("input_s", waited)
        else:
            batch, stats = measured_load(self.loader, indices, io=self.io)
            self.clock.add("input_s", stats.seconds)
        self.clock.add_load(stats)
        return batch, len(indices)

    def prefetch(self, step: int, vns: Sequence[int]) -> None:
        """Start loading this step's VNs (what is not under way yet) and the next step's."""
        assert self.prefetcher is not None
        for s in (step, step + 1):
            for vn in vns:
                self.prefetcher.schedule(s, vn, self.plan.vn_indices(s, vn))

    def forward(self, step: int, vn: int, batch: Any = None, n: int = 0) -> tuple[torch.Tensor, float]:
        """Forward of one VN from the step's starting BN statistics; returns (the loss, the VN's
        share ``n_v / B``): :meth:`backward` weights the loss's gradient by the share and
        :meth:`weighted` the loss's value."""
        if self.has_bn:
            self.bn.restore()
        now = time.perf_counter
        if batch is None:
            batch, n = self.load(step, vn)
        if not self.on_cpu:
            t0 = now()
            batch = to_device(batch, self.device)
            self.clock.add("input_s", now() - t0)
        seed_generators(vn_seed(self.seed, step, vn), self.generators)
        t0 = now()
        with self.autocast:
            out = self.loss_fn(self.model, batch)
        self.clock.add("forward_s", now() - t0)
        share = n / self.plan.global_batch_size
        if type(out) is torch.Tensor and not self.metrics.names and out.dim() == 0 and out.is_floating_point():
            loss = out  # a bare scalar loss and no metrics: nothing to split, check or name
        else:
            loss = self._checked(out, share, step, vn)
        self.loss_dtype = loss.dtype
        return loss, share

    def _checked(self, out: Any, share: float, step: int, vn: int) -> torch.Tensor:
        """``Job.loss``'s result split into the loss (checked) and its metrics (added to the step's
        sums, weighted by ``share``)."""
        where = f"at step {step} in virtual node {vn}"
        loss, metrics = split_loss(out, where)
        check_loss(loss, where)
        self.metrics.note(metrics, share, where)
        return loss

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """Backward of the VN's loss weighted by ``share`` (and scaled by ``16-mixed``'s loss scale)."""
        t0 = time.perf_counter()
        root, seed = self.weighting.root(loss, share)
        root.backward(seed)
        self.clock.add("backward_s", time.perf_counter() - t0)

    weighted = staticmethod(LossWeighting.weighted)
    """The VN's weighted loss ``loss * share``, detached (the statistics' value)."""

    def weighted_block(self, losses: Sequence[torch.Tensor], shares: Sequence[float]
                       ) -> tuple[list[float] | torch.Tensor, float | torch.Tensor]:
        """(the weighted losses of a block of VNs, their sum). On CPU with float32/float64 losses:
        Python floats, ``x * s`` with the share ``s`` rounded to the loss's dtype, which is exact
        (two float32 significands fit a Python float's), so each is finite exactly where
        :meth:`weighted` is, and the sum is taken in double precision. Otherwise a detached
        vector, element ``i`` equal to :meth:`weighted` of ``losses[i]``, and its sum."""
        dtype = losses[0].dtype
        if dtype not in FOLDED or any(x.dtype != dtype for x in losses):
            with torch.no_grad():
                ws = torch.stack([x * s for x, s in zip(losses, shares)])
            return ws, ws.sum()
        key, kept_dtype, factors = self._shares
        if factors is None or kept_dtype != dtype or key != tuple(shares) or self.on_cpu != isinstance(factors, list):
            if self.on_cpu:
                factors = np.array(shares, dtype=np.float32 if dtype == torch.float32 else np.float64).tolist()
            else:
                factors = torch.tensor(shares, dtype=dtype, device=losses[0].device)
            self._shares = (tuple(shares), dtype, factors)
        if self.on_cpu:
            ws = [x.item() * s for x, s in zip(losses, factors)]
            return ws, sum(ws)
        with torch.no_grad():
            ws = torch.stack(losses) * factors
        return ws, ws.sum()

    def sleep(self, seconds: float) -> None:
        """Emulated slowness (counted as compute, split between forward and backward)."""
        time.sleep(seconds)
        self.clock.add("emulated_s", seconds)

    def emulate(self, t0: float) -> None:
        """Sleep ``(slowdown - 1)`` times the VN's compute that started at ``t0``."""
        dt = time.perf_counter() - t0
        self.vn_s = dt if self.vn_s == 0.0 else 0.8 * self.vn_s + 0.2 * dt
        if self.slowdown > 1.0:
            self.sleep((self.slowdown - 1.0) * dt)

    def sleep_before_last_backward(self, t_vn: float) -> None:
        """The last VN's backward launches the reduction: sleep before it, for the forward just
        run (since ``t_vn``) and a backward estimated from earlier VNs."""
        if self.slowdown > 1.0:
            self.sleep((self.slowdown - 1.0) * max(self.vn_s, time.perf_counter() - t_vn))

    def probe(self, step: int) -> float:
        """Time one VN's forward and backward without contributing it; returns the seconds."""
        vn = step % self.plan.virtual_nodes
        t0 = time.perf_counter()
        loss, share = self.forward(step, vn)
        self.metrics.reset()  # a probe contributes nothing
        if loss.requires_grad:
            t_b = time.perf_counter()
            root, seed = self.weighting.root(loss, share)
            torch.autograd.grad(root, self.params, seed, allow_unused=True)
            self.clock.add("backward_s", time.perf_counter() - t_b)
        self.emulate(t0)
        del loss
        if self.bn:
            self.bn.restore()
        return time.perf_counter() - t0
