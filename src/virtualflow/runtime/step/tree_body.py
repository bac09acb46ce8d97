"""Deterministic mode's step body on a VN-engine worker: per-VN vectors summed along the fixed tree.

Purpose: :class:`TreeBody` is what :class:`~virtualflow.runtime.engine.VNEngine` runs for a step
in deterministic mode (chosen once, when the engine is built; default mode runs the engine's own
bucket body). Per VN of this worker, in order: forward and backward, then the VN's vector
``[gradients | BatchNorm statistics ("mean") | weighted loss]`` becomes a leaf of the fixed VN-id
tree (:mod:`virtualflow.plan.vnmap`), summed locally into this worker's partial sums and brought
together with the other workers' by the generation's
:class:`~virtualflow.runtime.step.reduction.TreeReduction`; then the small statistics vector is
all-reduced. The result does not depend on how the VNs are spread over workers: bit-identical for
any worker count.

Invariants: the body holds deterministic mode's own state (the leaves' layout and buffers,
BatchNorm's ``first`` statistics, the step's compute time) and writes to the engine only what
the engine reports and what failure handling reads from it (:class:`TreeHost`: the phase, the
last-backward flag the ``mid_backward`` fault point reads, the generation's statistics layout and
exchange choice). The order of float operations is the one the engine always had.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import TreePlan
from virtualflow.runtime.batchnorm import BatchNormState
from virtualflow.runtime.breakdown import StepClock
from virtualflow.runtime.probe import IdleProbe
from virtualflow.runtime.step.compute import VNCompute
from virtualflow.runtime.step.exchange import ExchangeChoice
from virtualflow.runtime.step.reduction import TreeLeaves, TreeReduction
from virtualflow.runtime.step.stats import BadFlags, StatsLayout

__all__ = ["TreeBody", "TreeHost"]


class TreeHost(Protocol):
    """What :class:`TreeBody` reads and writes of its engine (a :class:`~virtualflow.runtime.engine.VNEngine`)."""

    params: list[torch.nn.Parameter]
    bn: BatchNormState
    batchnorm: str
    plan: DataPlan
    device: torch.device
    compute: VNCompute
    clock: StepClock
    idle: IdleProbe
    exchange: ExchangeChoice
    shard: Any
    comm: Any
    group: Group | None
    reduction: Any
    vns: list[int]
    update: Any
    stats: StatsLayout | None
    exchange_choice: tuple[str, str] | None
    phase: str
    _in_last_backward: bool

    @property
    def fault_points(self) -> bool: ...

    def point(self, phase: str) -> None: ...

    def check_broken(self) -> None: ...

    def idle_compute(self, step: int) -> tuple[float, bool]: ...

    def pack_stats(self, bad: BadFlags, control: int | Callable[[], int], loss: torch.Tensor | None,
                   bn: torch.Tensor | None) -> torch.Tensor: ...


class TreeBody:
    """Deterministic mode's step body (see the module docstring)."""

    def __init__(self, host: TreeHost) -> None:
        self.host = host
        self.leaves = TreeLeaves(host.params, host.bn.float_bufs, host.batchnorm == "mean", host.plan.virtual_nodes,
                                 host.device)
        """The leaf vector's layout, the partial sums' reused buffers and the per-generation reduction."""
        self.first_bn: torch.Tensor | None = None
        """BatchNorm ``first``: VN 0's statistics, when this worker ran VN 0 this step."""
        self.compute_s = 0.0
        """This step's compute seconds (the VNs, or a probe), reported with the next step's statistics."""

    def reduction_for(self, group: Group, assignment: Sequence[Sequence[int]]) -> TreeReduction:
        """The generation's statistics layout and reduction: the loss and BatchNorm's mean
        statistics are summed in the tree (its tail); BatchNorm's ``first`` statistics (VN 0's)
        ride in the statistics vector."""
        h = self.host
        first = h.bn.numel if h.batchnorm == "first" else 0
        h.stats = StatsLayout(h.plan.virtual_nodes, group.size, group.rank, loss=False, bn_numel=first, bn_mean=False)
        tree, h.exchange_choice = self.leaves.reduction(TreePlan.build(assignment), group, h.compute.loss_dtype,
                                                        h.exchange, h.shard, h.comm)
        return tree

    def sum(self, step: int, bad: BadFlags, control: int | Callable[[], int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
        """The tree's sums, then the statistics' all-reduce: (the summed statistics, the loss,
        BatchNorm's mean statistics or None, the whole flat gradient sum or None (sharded: this
        worker's chunk is in the flat gradient already), this step's compute seconds)."""
        h = self.host
        assert h.group is not None
        if h.fault_points:
            h.group.on_launch = lambda: h.point("during_reduction")
        bn_mean, loss, flat = self._tree_sums(step, bad)
        stats = h.pack_stats(bad, control, None, self.first_bn)
        h.group.all_reduce(stats)
        h.clock.leave_reduction()  # entered in _tree_sums
        h.group.on_launch = None
        return stats, loss, bn_mean, flat, self.compute_s

    def _tree_sums(self, step: int, bad: BadFlags
                   ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Per-VN vectors [grads | BN stats | weighted loss] summed along the fixed tree and
        brought together by this generation's :class:`~virtualflow.runtime.step.reduction.TreeReduction`;
        returns the root's (BatchNorm mean, loss) and the summed flat gradient (None when sharded:
        this worker's chunk is in the flat gradient)."""
        h = self.host
        tree = h.reduction
        assert isinstance(tree, TreeReduction)
        self.first_bn = None
        with_bn = self.leaves.tail.bn_numel
        last_vn = h.vns[-1] if h.vns else None

        def run_vn(vn: int) -> torch.Tensor:
            """Forward and backward of one VN; returns its tail [BN stats (mean mode) | weighted
            loss]; the VN's gradient is in (or was accumulated into) ``p.grad``."""
            h.check_broken()
            t_vn = time.perf_counter()
            loss, share = h.compute.forward(step, vn)
            if vn == last_vn:
                h.phase = "backward"
                h._in_last_backward = True
            h.compute.backward(loss, share)
            h._in_last_backward = False
            h.compute.emulate(t_vn)
            weighted = h.compute.weighted(loss, share)
            del loss
            bad.note(vn, weighted)
            tail = []
            if with_bn:
                tail.append(h.bn.flat())
            elif h.bn.numel and vn == 0:
                self.first_bn = h.bn.flat()
            tail.append(weighted.reshape(1))
            return torch.cat(tail) if len(tail) > 1 else tail[0]

        def leaf(vn: int) -> torch.Tensor:  # a fresh vector per leaf (parameters of several dtypes)
            h.update.zero_grad()
            tail = run_vn(vn)
            parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in h.params]
            parts.append(tail)
            return torch.cat(parts)

        t_step = time.perf_counter()
        tree.begin()  # every receive of the step is posted before the first send
        if h.vns:
            local, probed = tree.local(run_vn, leaf), False
            self.compute_s = time.perf_counter() - t_step
        else:  # no VN here: maybe a probe; no node of the tree to contribute
            local = {}
            self.compute_s, probed = h.idle_compute(step)
        h.phase = "reduction"
        h.clock.enter_reduction()  # left in sum(), after the statistics' all-reduce
        # the whole flat sum goes into p.grad once the step is decided (the engine's finish)
        flat, tail = tree.finish(local, lambda: self.leaves.like(h.compute.loss_dtype))
        if not h.vns:
            h.idle.note_idle(t_step, probed)
        bn_mean, loss = self.leaves.tail.read(tail)
        return bn_mean, loss, flat
