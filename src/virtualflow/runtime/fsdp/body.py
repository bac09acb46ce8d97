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
from virtualflow.runtime.step.stats import StatsLayout

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


class FsdpBody:
    """``reduction="fsdp"``'s step body (see the module docstring)."""

    def __init__(self, host: Any, update: FsdpUpdate, deterministic: bool) -> None:
        self.host = host
        self.update = update
        self.deterministic = deterministic
        self.counts: list[int] = []
        self.assignment: list[list[int]] = []
        mean = host.batchnorm == "mean"
        self.tail = Tail(host.bn.numel if mean else 0, True, host.plan.virtual_nodes)
        """Deterministic mode: the tree's tail, as the unsharded deterministic run's."""
        self.first_bn: torch.Tensor | None = None

    def reduction_for(self, group: Group, assignment: Sequence[Sequence[int]]) -> FsdpGeneration:
        """The generation's statistics layout, VN ids (same counts, consecutive per round) and
        layout of the shards."""
        h = self.host
        det, first = self.deterministic, h.batchnorm == "first"
        h.stats = StatsLayout(h.plan.virtual_nodes, group.size, group.rank, loss=not det,
                              bn_numel=h.bn.numel if (first or not det) else 0, bn_mean=not det and not first)
        self.counts = [len(a) for a in assignment]
        self.assignment = interleaved_assignment(self.counts)
        h.vns = list(self.assignment[group.rank])
        self.update.cut(group)
        return FsdpGeneration(self.update)

    def sum(self, step: int, bad: torch.Tensor, control: int | Callable[[], int]
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The step's rounds, the reductions' end, the small vectors' sums: (the summed
        statistics, the loss and BatchNorm's mean statistics where the tree carries them)."""
        h, red = self.host, self.update.reduction
        V = h.plan.virtual_nodes
        self.update.store.free_all()  # (rank 0 may hold the whole model since a checkpoint or evaluation)
        red.begin_step(V)
        dtype = self.update.store.units[0].dtype
        tails = torch.zeros(V, self.tail.numel, dtype=dtype)
        self.first_bn = None
        t_step = time.perf_counter()
        losses, bn_acc = self._rounds(step, bad, tails)
        compute_s = time.perf_counter() - t_step
        h.phase = "reduction"
        h.clock.enter_reduction()
        h.point("during_reduction")
        red.finish_step()
        h._last_compute_s = compute_s
        if not self.deterministic:
            loss = torch.stack(losses).sum() if losses else torch.zeros(())
            stats = h.pack_stats(bad, control, loss, bn_acc if bn_acc is not None else self.first_bn)
            h.group.all_reduce(stats)
            h.clock.leave_reduction()
            return stats, None, None
        if h.group.size > 1:
            h.group.all_reduce(tails)
        fold, stack = InOrderFold(V), []
        for v in range(V):
            stack.append(tails[v].clone())
            for _ in fold.push():
                right = stack.pop()
                stack[-1].add_(right)
        bn_mean, loss = self.tail.read(stack[0])
        stats = h.pack_stats(bad, control, None, self.first_bn)
        h.group.all_reduce(stats)
        h.clock.leave_reduction()
        return stats, loss, bn_mean

    def _rounds(self, step: int, bad: torch.Tensor, tails: torch.Tensor
                ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Every round's VN here (or ghost); returns default mode's weighted losses and summed
        BatchNorm statistics (``mean``) or VN 0's (``first``)."""
        h, red, store = self.host, self.update.reduction, self.update.store
        mine = h.vns
        bn_acc = torch.zeros(h.bn.numel) if h.batchnorm == "mean" and not self.deterministic else None
        losses = []
        at = 0
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
            weighted = h.compute.forward(step, vn)
            if not ghost and i == len(mine) - 1:
                h.phase = "backward"
                h._in_last_backward = True
            h.compute.backward(weighted)
            h._in_last_backward = False
            store.end_vn()
            if ghost:
                h.compute.metrics.sums = kept
                if not mine and h.bn:
                    h.bn.restore()  # (the engine advances a VN-less worker's counters itself)
                continue
            h.compute.emulate(t_vn)
            w = weighted.detach()
            bad[vn] = (~torch.isfinite(w)).to(bad.dtype)
            losses.append(w)
            if h.bn.numel and h.batchnorm == "first" and vn == 0:
                self.first_bn = h.bn.flat()
            elif bn_acc is not None and h.bn.numel:
                bn_acc += h.bn.flat()
            if self.deterministic:
                row = [h.bn.flat()] if self.tail.bn_numel else []
                row.append(w.reshape(1))
                tails[vn] = torch.cat(row).to(tails.dtype) if len(row) > 1 else row[0].to(tails.dtype)
        return losses, bn_acc
