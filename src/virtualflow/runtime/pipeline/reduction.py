"""Summing a stage's step over the pipeline replicas: by stage group or job stage, and tied weights.

Purpose: a worker's per-step reduction vector is laid out ``[gradients of its parameters |
BatchNorm statistics of its pieces | loss]`` (each part present as the step needs). It is summed
over the replicas of its stage-rank - element-wise (:class:`~.requests.StageSum`, default mode)
or along the fixed VN-id tree (:class:`~.requests.StageTree`, deterministic mode). A worker that
runs several job stages after a Bamboo failover sums each job stage's elements over the workers
that run that stage (:meth:`StageReducer.set_job_stages`). Weights shared by pieces on several
workers (tied weights) have their copies' gradients summed once more over every worker in
default mode (:func:`sum_tied`); deterministic mode sums them per virtual node before the tree
(:mod:`.tied`).

With ``reduction="sharded"`` (deterministic mode) a replica asks for its chunk of the gradients
and the tail only (:meth:`StageReducer.tree_by_stage`'s ``chunks``; :mod:`.stage_shard`).

Invariants: summation is element-wise, so a worker's slice of the sum is bit-identical to the
same slice of the unpipelined job's sum, and a job stage reduced over its own workers sums every
element over the same replicas in the same order as an undisturbed run.
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import torch
from torch import nn

from virtualflow.plan.pipeline.geometry import TiedCopy
from virtualflow.plan.vnmap import Node, TreePlan
from virtualflow.runtime.pipeline.batchnorm import statistics_numel
from virtualflow.runtime.pipeline.requests import AllSum, Request, StageSum, StageTree
from virtualflow.runtime.step.exchange import sharded_bounds


class StageReducer:
    """How one worker's reduction vector is summed over the replicas (see the module docstring)."""

    def __init__(self, *, grad_numel: int, bn_numel: int, device: torch.device) -> None:
        self.grad_numel = grad_numel
        self.bn_numel = bn_numel
        self.device = device
        self.job_stages: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
        """Bamboo, several replicas, this worker running several job stages: per job stage, the
        indices of its gradients and of its BatchNorm statistics in this worker's flat vectors
        (:meth:`set_job_stages`); each job stage is reduced over its own workers."""

    def set_job_stages(self, model: nn.Module, pieces: dict[int, nn.Module],
                       stages: Sequence[tuple[int, int, int]] | None,
                       params: Sequence[torch.Tensor] | None = None) -> None:
        """This worker runs the job stages ``(stage, first layer, end layer)`` (consecutive, in
        order); ``model`` holds its layers under their whole-model names. ``None``: one reduction
        (one stage group). ``params``: the parameters whose gradients the vector holds, in
        ``model`` order (deterministic mode leaves out the copies of a tied weight this worker
        does not own); default: every trainable one."""
        if stages is None:
            self.job_stages = None
            return

        def stage_of(layer: int) -> int:
            for s, a, b in stages:
                if a <= layer < b:
                    return s
            raise ValueError(f"layer {layer} of this worker is in none of its job stages {list(stages)}")

        held = {id(q) for q in (params if params is not None else model.parameters()) if q.requires_grad}
        grad_owner = []
        for name, q in model.named_parameters():
            if id(q) in held:
                grad_owner += [stage_of(int(name.split(".")[0]))] * q.numel()
        self.grad_numel = len(grad_owner)
        bn_owner = []
        for module in pieces.values():  # the flat layout of PieceBatchNorm, layer by layer
            for name, layer in module.named_children():
                bn_owner += [stage_of(int(name))] * statistics_numel(layer)
        if len(bn_owner) != self.bn_numel:
            raise RuntimeError("BatchNorm statistics of a shared module cannot be split by job stage")
        g, b = torch.tensor(grad_owner, dtype=torch.int64), torch.tensor(bn_owner, dtype=torch.int64)
        self.job_stages = [(s, torch.nonzero(g == s).reshape(-1), torch.nonzero(b == s).reshape(-1))
                           for s, _, _ in stages]

    def stage_slices(self, grads: bool, bn: bool, loss: bool) -> list[tuple[int, torch.Tensor]]:
        """Per job stage, the indices of its elements in a vector laid out [grads | BatchNorm
        statistics | loss] (each part present as told); the loss goes with the last job stage."""
        G = self.grad_numel if grads else 0
        B = self.bn_numel if bn else 0
        out = []
        for i, (s, gi, bi) in enumerate(self.job_stages):
            parts = ([gi] if grads else []) + ([bi + G] if bn else [])
            if loss and i == len(self.job_stages) - 1:
                parts.append(torch.tensor([G + B], dtype=torch.int64))
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            out.append((s, idx.to(self.device)))
        return out

    def sum_by_stage(self, vec: torch.Tensor, grads: bool, bn: bool, loss: bool) -> Generator[Request, Any, torch.Tensor]:
        """:class:`StageSum` of ``vec``, job stage by job stage (see :meth:`set_job_stages`)."""
        if self.job_stages is None:
            return (yield StageSum(vec))
        out = torch.empty_like(vec)
        for s, idx in self.stage_slices(grads, bn, loss):
            part = yield StageSum(vec.index_select(0, idx), stage=s)
            out.index_copy_(0, idx, part)
        return out

    def tree_requests(self, tree: TreePlan, nodes: dict[Node, torch.Tensor], like: torch.Tensor, bn: bool,
                      loss: bool, chunks: Sequence[tuple[int, int]] | None = None
                      ) -> list[tuple[torch.Tensor | None, StageTree]]:
        """The :class:`StageTree` requests that sum ``nodes`` (see :meth:`tree_by_stage`), each with
        the indices of its elements in the vector (``None``: the whole vector, one stage group).
        A streamed step (:mod:`.tree_fold`) opens the same requests, nodes aside, and sends each
        partial's elements with them."""
        if self.job_stages is None and chunks is not None:
            bounds, tail = sharded_bounds(chunks, like.numel())
            return [(None, StageTree(tree, nodes, like, bounds=bounds, gather=tail))]
        if self.job_stages is None:
            return [(None, StageTree(tree, nodes, like))]
        return [(idx, StageTree(tree, {node: t.index_select(0, idx) for node, t in nodes.items()},
                                like.index_select(0, idx), stage=s))
                for s, idx in self.stage_slices(True, bn, loss)]

    def tree_by_stage(self, tree: TreePlan, nodes: dict[Node, torch.Tensor], like: torch.Tensor, bn: bool,
                      loss: bool, chunks: Sequence[tuple[int, int]] | None = None
                      ) -> Generator[Request, Any, torch.Tensor]:
        """:class:`StageTree` of ``nodes``, job stage by job stage (see :meth:`set_job_stages`):
        the tree's sums are element-wise, so each element's sum is the undisturbed run's.
        ``chunks`` (``reduction="sharded"``, one stage group): the replicas' chunks of the
        gradients; each needs only its own and the tail [BatchNorm statistics | loss] of the root."""
        requests = self.tree_requests(tree, nodes, like, bn, loss, chunks)
        if requests[0][0] is None:
            return (yield requests[0][1])
        out = torch.empty_like(like)
        for idx, req in requests:
            part = yield req
            out.index_copy_(0, idx, part)
        return out


def sum_tied(tied: Sequence[TiedCopy], replica: int, device: torch.device) -> Generator[Request, Any, None]:
    """Default mode: a weight held by several workers: sum its copies' gradients (each replica's
    copies are already summed over the replicas, so replica 0 alone contributes) and give every
    copy the total, so all copies take the same update. ``tied``: per shared weight, this worker's
    copy (or None), its size and dtype, in the same order on every worker. (Deterministic mode:
    :mod:`.tied`.)"""
    parts = []
    for t in tied:
        grad = t.param.grad if t.param is not None and replica == 0 else None
        parts.append(grad.reshape(-1) if grad is not None else torch.zeros(t.numel, dtype=t.dtype, device=device))
    total = yield AllSum(torch.cat(parts))
    offset = 0
    for t in tied:
        if t.param is not None:
            t.param.grad = total[offset: offset + t.numel].view_as(t.param).clone()
        offset += t.numel
