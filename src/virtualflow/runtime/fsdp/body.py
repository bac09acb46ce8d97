"""Sharded parameters' step body on a VN-engine worker: the step's VNs in rounds.

Purpose: :class:`FsdpBody` is what :class:`~virtualflow.runtime.engine.VNEngine` runs for a step
with ``reduction="fsdp"`` (in both modes; chosen once, when the engine is built). The step's
VNs run in *rounds*: in round ``i`` every worker runs its ``i``-th VN, whose units are gathered,
computed, freed and reduced unit by unit (:mod:`~virtualflow.runtime.fsdp.store`,
:mod:`~virtualflow.runtime.fsdp.reduce`). Gathers and reductions are collectives, so every worker
takes part in every round: one with fewer VNs runs a *ghost* VN there (a real forward and
backward on one of its batches, its gradient counted as zeros, its loss, metrics and BatchNorm
statistics dropped). The VN ids of a round are consecutive
(:func:`~virtualflow.plan.param_shards.interleaved_assignment`, same counts per worker as the
generation's map): the deterministic fold receives leaves in VN order.

Then the small vectors: default mode sums the statistics vector (the loss and BatchNorm's
statistics ride in it, as without sharding); deterministic mode sums each VN's tail
``[BatchNorm statistics ("mean") | weighted loss]`` along the fixed tree (one all-reduce of a
``V x tail`` matrix with one writer per row, exact, then the same in-order fold on every worker),
so the loss and statistics are the unsharded deterministic run's bits.

Invariants: the host's state is written only where the VN engine's own bodies write it (the
phase, the last-backward flag, the generation's statistics layout); a ghost leaves the step's
sums as they were.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.param_shards import InOrderFold, interleaved_assignment
from virtualflow.runtime.fsdp.update import FsdpUpdate
from virtualflow.runtime.step.reduction import Tail
from virtualflow.runtime.step.stats import BadFlags, StatsLayout

__all__ = ["FsdpBody", "FsdpGeneration"]


class FsdpGeneration:
    """A generation's reduction as the VN engine holds it (``close`` when the generation ends or
    a step is abandoned: the lanes and the reduction thread stop, gradients and gathers are dropped)."""

    def __init__(self, update: FsdpUpdate) -> None:
        self.update = update

    def close(self) -> None:
        u = self.update
        u.reduction.close()
        u.store.close()
        u.store.drop()
        for unit in u.store.units:
            for p in unit.params:
                p.grad = None


class PlainSums:
    """Default mode's small vectors: the loss and BatchNorm's statistics ride in the statistics
    vector (as without sharding)."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def layout(self, group: Group) -> StatsLayout:
        h = self.host
        return StatsLayout(h.plan.virtual_nodes, group.size, group.rank, loss=True, bn_numel=h.bn.numel,
                           bn_mean=h.batchnorm == "mean")

    def begin(self) -> None:
        h = self.host
        self.losses: list[torch.Tensor] = []
        self.bn = torch.zeros(h.bn.numel) if h.batchnorm == "mean" else None

    def note(self, vn: int, weighted: torch.Tensor) -> None:
        """A real VN's weighted loss and BatchNorm statistics (summed; ``first``: VN 0's)."""
        h = self.host
        self.losses.append(weighted)
        if h.bn.numel and self.bn is not None:
            self.bn += h.bn.flat()
        elif h.bn.numel and vn == 0:
            self.bn = h.bn.flat()

    def finish(self, bad: BadFlags, control: int | Callable[[], int]
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h = self.host
        loss = torch.stack(self.losses).sum() if self.losses else torch.zeros(())
        stats = h.pack_stats(bad, control, loss, self.bn)
        h.group.all_reduce(stats)
        return stats, None, None


class TreeSums:
    """Deterministic mode's small vectors: each VN's tail summed along the fixed tree (see the
    module docstring); BatchNorm's ``first`` statistics ride in the statistics vector."""

    def __init__(self, host: Any, dtype: torch.dtype) -> None:
        self.host, self.dtype = host, dtype
        mean = host.batchnorm == "mean"
        self.tail = Tail(host.bn.numel if mean else 0, True, host.plan.virtual_nodes)
        """The tree's tail, as the unsharded deterministic run's."""

    def layout(self, group: Group) -> StatsLayout:
        h = self.host
        first = h.bn.numel if h.batchnorm == "first" else 0
        return StatsLayout(h.plan.virtual_nodes, group.size, group.rank, loss=False, bn_numel=first, bn_mean=False)

    def begin(self) -> None:
        self.tails = torch.zeros(self.host.plan.virtual_nodes, self.tail.numel, dtype=self.dtype)
        self.first: torch.Tensor | None = None

    def note(self, vn: int, weighted: torch.Tensor) -> None:
        h = self.host
        row = [h.bn.flat()] if self.tail.bn_numel else []
        row.append(weighted.reshape(1))
        self.tails[vn] = torch.cat(row).to(self.dtype) if len(row) > 1 else row[0].to(self.dtype)
        if h.bn.numel and h.batchnorm == "first" and vn == 0:
            self.first = h.bn.flat()

    def finish(self, bad: BadFlags, control: int | Callable[[], int]
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h = self.host
        if h.group.size > 1:
            h.group.all_reduce(self.tails)  # one writer per row: exact
        fold, stack = InOrderFold(h.plan.virtual_nodes), []
        for row in self.tails:
            stack.append(row.clone())
            for _ in fold.push():
                right = stack.pop()
                stack[-1].add_(right)
        bn_mean, loss = self.tail.read(stack[0])
        stats = h.pack_stats(bad, control, None, self.first)
        h.group.all_reduce(stats)
        return stats, loss, bn_mean


class FsdpBody:
    """``reduction="fsdp"``'s step body (see the module docstring)."""

    def __init__(self, host: Any, update: FsdpUpdate, deterministic: bool) -> None:
        self.host = host
        self.update = update
        self.counts: list[int] = []
        self.assignment: list[list[int]] = []
        dtype = update.store.units[0].dtype
        self.sums: PlainSums | TreeSums = {False: lambda: PlainSums(host),
                                           True: lambda: TreeSums(host, dtype)}[deterministic]()
        """The mode's small vectors (chosen once)."""

    def entry_points(self) -> tuple[Callable, Callable]:
        """What the VN engine calls: (its step body, its reduction factory)."""
        return self.sum, self.reduction_for

    def reduction_for(self, group: Group, assignment: Sequence[Sequence[int]]) -> FsdpGeneration:
        """The generation's statistics layout, VN ids (same counts, consecutive per round) and
        layout of the shards."""
        h = self.host
        h.stats = self.sums.layout(group)
        self.counts = [len(a) for a in assignment]
        self.assignment = interleaved_assignment(self.counts)
        h.vns = list(self.assignment[group.rank])
        self.update.cut(group)
        return FsdpGeneration(self.update)

    def sum(self, step: int, bad: BadFlags, control: int | Callable[[], int]
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The step's rounds, the reductions' end, the small vectors' sums: (the summed
        statistics, the loss and BatchNorm's mean statistics where the tree carries them)."""
        h, red = self.host, self.update.reduction
        self.update.store.free_all()  # (rank 0 may hold the whole model since a checkpoint or evaluation)
        red.begin_step(h.plan.virtual_nodes)
        self.sums.begin()
        t_step = time.perf_counter()
        self._rounds(step, bad)
        h._last_compute_s = time.perf_counter() - t_step
        h.phase = "reduction"
        h.clock.enter_reduction()
        h.point("during_reduction")
        red.finish_step()
        out = self.sums.finish(bad, control)
        h.clock.leave_reduction()
        return out

    def _rounds(self, step: int, bad: BadFlags) -> None:
        """Every round's VN here, or a ghost (see the module docstring)."""
        h, red, store = self.host, self.update.reduction, self.update.store
        mine = h.vns
        at = 0
        kept_batch: tuple[Any, int] | None = None  # a ghost reruns the last real VN's batch (never reads more data)
        for i in range(max(self.counts, default=0)):
            active = [w for w, c in enumerate(self.counts) if c > i]
            red.begin_round(active, at)
            at += len(active)
            ghost = i >= len(mine)
            vn = mine[i] if not ghost else (mine[-1] if mine else i % h.plan.virtual_nodes)
            h.check_broken()
            red.ghost = ghost
            kept = dict(h.compute.metrics.sums)
            store.begin_vn()
            t_vn = time.perf_counter()
            if kept_batch is None or not ghost:
                kept_batch = h.compute.load(step, vn)
            loss, share = h.compute.forward(step, vn, *kept_batch)
            if not ghost and i == len(mine) - 1:
                h.phase = "backward"
                h._in_last_backward = True
            h.compute.backward(loss, share)
            h._in_last_backward = False
            store.end_vn()
            if ghost:
                h.compute.metrics.sums = kept
                if not mine and h.bn:
                    h.bn.restore()  # (the engine advances a VN-less worker's counters itself)
                continue
            h.compute.emulate(t_vn)
            w = h.compute.weighted(loss, share)
            bad.note(vn, w)
            self.sums.note(vn, w)
