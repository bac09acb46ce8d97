"""A streamed window of a no-flush schedule (``2bw``, asynchronous PipeDream) on one worker.

Purpose: no-flush schedules stream ``window`` steps as one action list; a piece applies step
``t``'s update right after its last backward of step ``t``, and forwards run on *snapshots*
(weight versions, ``torch.func.functional_call``) so that the backward of a micro-batch uses the
weights of its forward. :class:`StreamWindow` holds one window's versions and accumulators and
gives the executor its forward, backward and backward-done callbacks.

Invariants:

- ``2bw`` (weight rule ``delay1``): step ``t`` runs on the weights after ``max(t - 1, 0)``
  updates; two versions live (``current`` and ``older``), and the older one is carried to the
  next window through the engine's ``prev_version``. ``async`` (rule ``newest``): the newest
  weights when the forward runs (weight stashing); only ``current`` is kept.
- Only the window holds the versions (the engine's ``prev_version`` is handed over and cleared at
  the window's start), so a version lives no longer than a micro-batch that uses it.
- One piece per worker (v = 1 for the no-flush schedules); losses and bad VNs of every step are
  learnt at the window's end from one all-reduce, where the pipeline is drained (commands act
  there too).
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import torch

from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.runtime.pipeline.loop import metric_header, share_metrics
from virtualflow.runtime.pipeline.microbatch import MicroBatch
from virtualflow.runtime.pipeline.pieces import apply_update
from virtualflow.runtime.pipeline.requests import AllSum, Request, StageSum, StageTree, StepResult
from virtualflow.runtime.pipeline.schedule import schedule_for


class StreamWindow:
    """Steps ``first_step .. first_step + n_steps - 1`` of ``engine`` (a
    :class:`~virtualflow.runtime.pipeline.engine.StageEngine`, not imported here: it imports this
    module) under a no-flush schedule. ``snapshot(k)`` copies piece ``k``'s weights (a version)."""

    def __init__(self, engine: Any, first_step: int, n_steps: int,
                 snapshot: Callable[[int], dict[str, torch.Tensor]]) -> None:
        e = self.engine = engine
        self.first_step, self.n_steps = first_step, n_steps
        self.vns = e.assignment[e.replica]
        self.m = len(self.vns)
        self.schedule = schedule_for(e.pipeline, self.m, n_steps)
        self.V = e.plan.virtual_nodes
        e.model.train()
        (self.k,) = e.pieces  # v = 1 for the no-flush schedules
        self.piece = e.pieces[self.k]
        self.names = [n for n, q in self.piece.named_parameters() if q.requires_grad]
        self.rule = self.schedule.weight_rule
        self.snapshot = snapshot
        current = snapshot(self.k)  # the weights after all updates so far
        prev, e.prev_version = e.prev_version, None  # from here on only `versions` holds them
        self.versions = {"current": current,  # "older": the weights after one update fewer (2bw only)
                         "older": (prev[self.k] if prev is not None else current) if self.rule == "delay1" else None}
        del current, prev
        self.done_in_step: dict[int, int] = {}
        self.acc: dict[int, list[torch.Tensor]] = {}
        self.leaves: dict[int, dict[int, torch.Tensor]] = {}
        self.losses: dict[int, dict[int, torch.Tensor]] = {}
        self.mbs: dict[tuple[int, int], MicroBatch] = {}
        self.applied = first_step  # updates applied on this piece so far (one per step)
        self.tree_loss: dict[int, float] = {}
        self.metrics: dict[int, dict[int, dict[str, float]]] = {}  # the last piece: step -> VN -> weighted metrics

    def forward(self, k_: int, mb: int, step: int, vn: int, message) -> MicroBatch:
        e = self.engine
        ctx = MicroBatch()
        if self.rule == "delay1":
            # step t runs on the weights after max(t-1, 0) updates; two versions are live
            want = max(step - 1, 0)
            if want == self.applied:
                ctx.version = self.versions["current"]
            elif want == self.applied - 1:
                ctx.version = self.versions["older"]
            else:  # the schedule checker proves this cannot happen
                raise RuntimeError(f"2bw: step {step} needs version {want}, piece {k_} holds "
                                   f"{self.applied - 1} and {self.applied}")
        else:
            ctx.version = self.versions["current"]
        x = e.prep.inputs(k_, step, vn, message, ctx)
        with e.loop.autocast(e.device):  # the piece's forward and, on the last piece, the loss
            out = torch.func.functional_call(self.piece, ctx.version, (x,), strict=False)
            e.prep.finish_forward(k_, step, vn, out, ctx)
        if k_ == e.last:
            self.losses.setdefault(step, {})[vn] = e.loop.weighting.weighted(ctx.outputs[0], ctx.share)
            if ctx.metrics:
                self.metrics.setdefault(step, {})[vn] = ctx.metrics
        return ctx

    def backward(self, kind: str, k_: int, mb: int, ctx: MicroBatch) -> None:
        e = self.engine
        outs, grads = e.prep.grad_pairs(ctx)
        if grads is None:  # the last piece: its loss weighted by the VN's share (no loss scale here)
            root, seed = e.loop.weighting.root(outs[0], ctx.share)
            outs, grads = [root], (None if seed is None else [seed])
        wants_input = [t for t in ctx.inputs if t.is_floating_point()]
        weights = [ctx.version[n] for n in self.names]
        got = torch.autograd.grad(outs, weights + wants_input, grads, allow_unused=True)
        gw, gi = got[: len(weights)], got[len(weights):]
        if wants_input:
            ctx.in_grads = e.prep.input_grads(ctx, gi)
        step, vn = e.vn_of(self.first_step, mb, self.m)
        flat = [g if g is not None else torch.zeros_like(w) for g, w in zip(gw, weights)]
        if e.deterministic:
            self.leaves.setdefault(step, {})[vn] = (torch.cat([g.reshape(-1) for g in flat]) if flat
                                                    else torch.zeros(0, device=e.device))
        elif step in self.acc:
            for a_, g in zip(self.acc[step], flat):
                a_.add_(g)
        else:
            self.acc[step] = [g.clone() for g in flat]

    def on_backward_done(self, k_: int, mb: int, ctx: MicroBatch) -> Generator[Request, Any, None]:
        """After a micro-batch's last backward: on the last one of its step, reduce the step's
        gradients over the replicas and apply the update (a new current version)."""
        e = self.engine
        step, _ = e.vn_of(self.first_step, mb, self.m)
        self.done_in_step[step] = self.done_in_step.get(step, 0) + 1
        if self.done_in_step[step] < self.m:
            return
        # the last backward of `step` on this piece: reduce over replicas and apply
        if e.deterministic:
            step_leaves = self.leaves.pop(step)
            is_last = k_ == e.last
            losses = self.losses

            def leaf(vn: int) -> torch.Tensor:
                v = step_leaves.pop(vn)
                return torch.cat([v, losses[step][vn].reshape(1)]) if is_last else v

            nodes = tree_reduce_local(e.tree.per_worker[e.replica], leaf)
            total = yield StageTree(e.tree, nodes, next(iter(nodes.values())))
            if is_last:
                self.tree_loss[step] = float(total[-1])  # summed along the VN tree, as the VN engine does
        else:
            parts = self.acc.pop(step)
            total = torch.cat([g.reshape(-1) for g in parts]) if parts else torch.zeros(0, device=e.device)
            if e.replicas > 1:
                total = yield StageSum(total)
        offset = 0
        params = dict(self.piece.named_parameters())
        for q in (params[n] for n in self.names):
            q.grad = total[offset: offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        apply_update(e.optimizer, e.scheduler)
        self.versions["older"] = self.versions["current"] if self.rule == "delay1" else None
        self.versions["current"] = self.snapshot(k_)
        self.applied += 1

    def older_version(self) -> dict[int, dict[str, torch.Tensor]] | None:
        """What the next window's first step runs on (``2bw``), for the engine's ``prev_version``."""
        return {self.k: self.versions["older"]} if self.rule == "delay1" else None

    def finish(self, control: int | Callable[[], int], compute_s: float) -> Generator[Request, Any, list[StepResult]]:
        """Window end: losses and bad VNs of every step, from the last piece, in one all-reduce."""
        e, V, n_steps, first_step = self.engine, self.V, self.n_steps, self.first_step
        stats = torch.zeros(n_steps, V + 2, dtype=torch.float64, device=e.device)
        if self.k == e.last:
            for i in range(n_steps):
                t = first_step + i
                for v in self.vns:
                    stats[i, v] = float(not torch.isfinite(self.losses[t][v]).item())
                if e.deterministic:
                    stats[i, V + 1] = self.tree_loss[t] if e.replica == 0 else 0.0
                else:
                    stats[i, V + 1] = float(torch.stack([self.losses[t][v] for v in self.vns]).sum())
        # read last (a command given during the window acts at its end, where the pipeline is drained)
        stats[n_steps - 1, V] = control() if callable(control) else control
        sums = None
        header = torch.zeros(2, dtype=torch.float64, device=e.device)  # the metric names' bytes, count
        if self.k == e.last:
            sums = []
            for i in range(n_steps):
                per_vn = self.metrics.get(first_step + i, {})
                step_sums: dict[str, float] = {}
                for v in self.vns:
                    for name, value in per_vn.get(v, {}).items():
                        step_sums[name] = step_sums.get(name, 0.0) + value
                sums.append(step_sums)
            if e.replica == 0:
                names, k = metric_header(next((x for x in sums if x), None))
                header[:] = torch.tensor([float(len(names)), float(k)], dtype=torch.float64)
        total = yield AllSum(torch.cat([stats.reshape(-1), header]))
        stats = total[:-2].reshape(n_steps, V + 2)
        shared = yield from share_metrics(sums, self.k == e.last and e.replica == 0, int(total[-2]), int(total[-1]),
                                          n_steps, e.device)
        results = []
        for i in range(n_steps):
            bad = [v for v in range(V) if stats[i, v] > 0]
            results.append(StepResult(first_step + i, float(stats[i, V + 1]), bad,
                                      int(round(float(stats[i, V]))), compute_s / n_steps,
                                      metrics=shared[i] if shared else None))
        return results
