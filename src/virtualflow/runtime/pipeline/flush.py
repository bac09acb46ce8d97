"""One step of a flush schedule (1F1B, GPipe, interleaved 1F1B, zero-bubble) on one worker.

Purpose: what a flush step does around the executor's walk of the action list - each
micro-batch's forward and backward, then the step's reduction over the replicas, and the commit
(apply the update, or skip the step) once every worker knows the step's stats.
:meth:`virtualflow.runtime.pipeline.engine.StageEngine.steps` orders these phases; this module
holds the per-step state they share (:class:`FlushStep`).

Invariants:

- **BatchNorm**: every micro-batch's forward starts from the step's starting running statistics;
  the step's new statistics are combined once (mean over the V virtual nodes, or VN 0's) and
  loaded only when the step commits.
- **Gradients.** Default mode: backward accumulates into ``.grad`` (micro-batches in schedule
  order), then each piece's gradients are summed over the pipeline replicas. Deterministic mode:
  each micro-batch's gradient vector (with BatchNorm statistics and, on the last piece, the
  weighted loss) is kept apart and summed along the fixed VN-id tree (:mod:`virtualflow.plan.vnmap`),
  so the result is bit-identical to the unpipelined job's for every p, d, v and schedule.
- **Commit.** The update is applied once per step after every piece's gradients are summed; a
  non-finite loss in any VN (learnt by every worker from one small all-reduce of the step's
  stats) skips the step. The same all-reduce carries the training loop's global decisions
  (:mod:`.loop`): how many workers found an inf/nan in their unscaled gradient (16-mixed: the
  step is then skipped everywhere, the optimizer and scheduler not stepped, BatchNorm statistics
  kept as after any forward) and the block sums of the whole model's gradient norm
  (:class:`virtualflow.runtime.clipping.NormBlocks`, by which each worker clips its gradient
  before the update). While that all-reduce runs, the rest of the step is kept as the engine's
  ``pending_commit``: a failure can complete the all-reduce on some members only, and the others
  then finish the step from the stats those hand over.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Protocol, Sequence

import torch

from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.plan.vnmap import Node
from virtualflow.runtime.pipeline.batchnorm import load_statistics
from virtualflow.runtime.pipeline.loop import metric_header, share_metrics
from virtualflow.runtime.pipeline.microbatch import MicroBatch
from virtualflow.runtime.pipeline.pieces import flat_grads, load_grads
from virtualflow.runtime.pipeline.requests import AllSum, Request, StageScatter, StageTree, StepResult
from virtualflow.runtime.pipeline.schedule import schedule_for
from virtualflow.runtime.pipeline.tied import tie_traffic
from virtualflow.runtime.pipeline.tree_fold import StreamedPerVN
from virtualflow.runtime.step.reduction import Tail


class FlushStage(Protocol):
    """What a flush step reads of (and, the commit's fields, writes to) its stage: a
    :class:`~virtualflow.runtime.pipeline.engine.StageEngine` (a protocol, not the class: the
    engine imports this module)."""

    pipeline: Any
    plan: Any
    loop: Any
    device: torch.device
    deterministic: bool
    batchnorm: str
    pieces: dict[int, torch.nn.Module]
    params: list[torch.Tensor]
    piece_params: dict[int, list[torch.Tensor]]
    tree_params: list[torch.Tensor]
    norm_params: list[tuple[int, torch.Tensor]]
    optimizer: Any
    scheduler: Any
    shard: Any
    update: Any
    ties: Any
    tree: Any
    reducer: Any
    prep: Any
    timing: Any
    bn: dict[int, Any]
    bn_numel: int
    replica: int
    replicas: int
    assignment: list[list[int]]
    replica_of_successor: Any
    reuse: Any
    phase: str
    fault_point: Callable[[str], None] | None
    pending_commit: tuple[int, Callable[[torch.Tensor], StepResult]] | None
    last_commit: tuple[int, torch.Tensor] | None

    @property
    def last(self) -> int: ...

    def spliced_forward(self, module: torch.nn.Module, x: Any, entry: Any) -> Any: ...


class Accumulated:
    """Default mode: every micro-batch's backward accumulates into the parameters' ``.grad``."""

    def before(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def after(self, params: Sequence[torch.Tensor], vn: int, k: int) -> None:
        pass

    def backward_done(self, k: int, mb: int) -> Generator[Request, Any, None]:
        yield from ()


ACCUMULATED = Accumulated()


class PerVN:
    """Deterministic mode: each micro-batch's parameter gradients are taken out of ``.grad`` after
    its backward (B or W) and kept per VN (``leaves``: VN -> (piece, parts)), to be summed along
    the fixed VN-id tree at the step's end (a shared weight whose per-VN sums cannot be formed as
    the micro-batches end; otherwise :class:`~.tree_fold.StreamedPerVN` sums them as they come)."""

    def __init__(self, work: "FlushStep") -> None:
        self.work = work
        self.leaves = work.leaves

    def before(self, params: Sequence[torch.Tensor]) -> None:
        for q in params:
            q.grad = None

    def after(self, params: Sequence[torch.Tensor], vn: int, k: int) -> None:
        parts = flat_grads(params)
        for q in params:
            q.grad = None
        self.leaves.setdefault(vn, []).append((k, parts))

    def backward_done(self, k: int, mb: int) -> Generator[Request, Any, None]:
        """A shared weight's gradients of this micro-batch's VN go to its owner as they are final
        (:func:`~.tied.tie_traffic`: per micro-batch where the schedule allows it)."""
        w = self.work
        vn = w.vns[mb % w.m]
        yield from w.tied.after_backward(k, vn, mb % w.m, dict(self.leaves.get(vn, [])), w.step)

    def partials(self, nodes: Sequence[Node]) -> Generator[Request, Any, dict[Node, torch.Tensor]]:
        """This worker's partial sums ``nodes`` of the leaves (a weight read by two pieces: the
        other use's per-VN gradients first, :func:`~.tied.tie_traffic`)."""
        w = self.work
        remote = yield from w.tied.at_end(self.leaves, w.vns, w.step)

        def leaf(vn: int) -> torch.Tensor:
            return torch.cat(w.leaf_parts(vn, dict(self.leaves.pop(vn)), remote.pop(vn, None)))

        return tree_reduce_local(nodes, leaf)


def per_vn(work: "FlushStep") -> PerVN | StreamedPerVN:
    """Deterministic mode's gradients of ``work``: summed as they come where its shared weights (if
    any) travel per micro-batch (:func:`~.tied.tie_traffic`; :mod:`.tree_fold`), else at the
    step's end."""
    if work.tied.streams:
        return StreamedPerVN(work, work.tree_requests)
    return PerVN(work)


class FlushStep:
    """Step ``step`` of ``engine`` under a flush schedule: the accumulators its micro-batches fill,
    the forward and backward the executor calls, the reduction and the commit."""

    def __init__(self, engine: FlushStage, step: int) -> None:
        """``engine``: the stage whose step this is (a :class:`FlushStage`)."""
        e = self.engine = engine
        self.step = step
        self.vns = e.assignment[e.replica]
        self.m = len(self.vns)
        self.schedule = schedule_for(e.pipeline, self.m)
        self.V = e.plan.virtual_nodes
        self.bn_acc = {k: torch.zeros(b.numel, device=e.device) for k, b in e.bn.items()}
        self.bn_first: dict[int, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.leaves: dict[int, list[torch.Tensor]] = {}  # deterministic mode: VN -> parts per piece
        self.tied = tie_traffic(e.ties, self.schedule)
        """Deterministic mode: when a shared weight's per-VN gradients travel between workers."""
        self.grads: Accumulated | PerVN | StreamedPerVN = per_vn(self) if e.deterministic else ACCUMULATED
        """Where a backward's parameter gradients go: accumulated in ``.grad`` (default mode), or
        kept apart per VN for the tree (deterministic mode: :func:`per_vn`)."""
        self.bn_vn: dict[tuple[int, int], torch.Tensor] = {}  # deterministic mode: (piece, VN) -> statistics
        self.mbs: dict[tuple[int, int], MicroBatch] = {}
        self.compute_s = 0.0
        self.replica_update: list[torch.Tensor] | None = None
        self.metrics: dict[int, dict[str, float]] = {}  # the last piece: VN -> weighted metrics
        self.found_inf = 0.0
        self.norm_sums: torch.Tensor | None = None
        self.applied = False  # the update was applied (reduction="sharded": an all-gather of the chunks follows)

    # ---- one (piece, micro-batch) ------------------------------------------------------------
    def forward(self, k: int, mb: int, step_: int, vn: int, message) -> MicroBatch:
        e = self.engine
        ctx = MicroBatch()
        bn = e.bn[k]
        if bn:
            bn.restore()
        x = e.prep.inputs(k, step_, vn, message, ctx)
        entry = e.reuse.entries.pop((step_, vn), None) if e.reuse is not None else None
        with e.loop.autocast(e.device):  # the piece's forward and, on the last piece, the loss
            out = e.spliced_forward(e.pieces[k], x, entry) if entry is not None else e.pieces[k](x)
            e.prep.finish_forward(k, step_, vn, out, ctx)
        if bn.numel:
            if e.deterministic and e.batchnorm == "mean":
                self.bn_vn[k, vn] = bn.flat()
            elif e.batchnorm == "mean":
                self.bn_acc[k] += bn.flat()
            elif vn == 0:
                self.bn_first[k] = bn.flat()
        if e.ties is not None:  # the first forward of each piece: a shared weight read once
            e.ties.check_uses(k, e.piece_params[k], ctx.outputs)
        if k == e.last:
            self.losses[vn] = e.loop.weighting.weighted(ctx.outputs[0], ctx.share)
            if ctx.metrics:
                self.metrics[vn] = ctx.metrics
        return ctx

    def backward(self, kind: str, k: int, mb: int, ctx: MicroBatch) -> None:
        e = self.engine
        outs, grads = e.prep.grad_pairs(ctx)
        if grads is None:  # the last piece: its loss weighted by the VN's share (times the loss scale)
            root, seed = e.loop.weighting.root(outs[0], ctx.share)
            outs, grads = [root], (None if seed is None else [seed])
        params = e.piece_params[k]
        wants_input = [t for t in ctx.inputs if t.is_floating_point()]
        if kind in ("B", "W"):
            self.grads.before(params)
        if kind == "B":
            if params or wants_input:
                torch.autograd.backward(outs, grads, inputs=params + wants_input)
            if wants_input:
                ctx.in_grads = e.prep.input_grads(ctx, [t.grad for t in wants_input])
        elif kind == "I":
            if wants_input:
                got = torch.autograd.grad(outs, wants_input, grads, retain_graph=True, allow_unused=True)
                ctx.in_grads = e.prep.input_grads(ctx, got)
        else:  # W
            if params:
                torch.autograd.backward(outs, grads, inputs=params)
        if kind in ("B", "W"):
            self.grads.after(params, self.vns[mb % self.m], k)

    def backward_done(self, k: int, mb: int, ctx: MicroBatch) -> Generator[Request, Any, None]:
        """After micro-batch ``mb``'s last backward on piece ``k`` (the executor's hook):
        deterministic mode may fold its VN into the tree and hand a partial to the exchange."""
        yield from self.grads.backward_done(k, mb)

    # ---- the step's reduction ------------------------------------------------------------------
    def reduce(self) -> Generator[Request, Any, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Sum this worker's reduction vector [grads of its params | its BatchNorm statistics |
        loss] over the replicas; the summed gradients go to ``.grad``. Returns (the new BatchNorm
        statistics or None, the summed loss on a last-stage worker or None), read from the
        vector's tail (:class:`~virtualflow.runtime.step.reduction.Tail`, as the VN engine reads its own)."""
        e = self.engine
        is_last = e.last in e.pieces
        if e.deterministic:
            with_bn = bool(e.bn_numel and e.batchnorm == "mean")
            total, offset = yield from self._reduce_tree(with_bn, is_last)
            if e.ties is not None:  # the owners' totals to the other copies
                yield from e.ties.share_totals(self.step)
            return Tail(e.bn_numel if with_bn else 0, is_last, self.V).read(total, offset)
        vec, offset = yield from self._reduce_sum(is_last)
        return Tail(e.bn_numel, is_last, self.V if e.batchnorm == "mean" else None).read(vec, offset)

    def _reduce_tree(self, with_bn: bool, is_last: bool) -> Generator[Request, Any, tuple[torch.Tensor, int]]:
        """Deterministic mode: each VN's vector summed along the fixed VN-id tree over the
        replicas; returns (the root sum, where its tail starts)."""
        e = self.engine
        nodes = yield from self.grads.partials(e.tree.per_worker[e.replica])
        like = next(iter(nodes.values()))
        total = yield from e.reducer.tree_by_stage(e.tree, nodes, like, with_bn, is_last, self._chunks())
        # views, not copies: the root is this step's own (every driver answers with a fresh vector)
        offset = load_grads(e.tree_params, total, clone=False)
        e.update.grads_to_flat()  # (sharded: the chunk's update reads the flat gradient)
        return total, offset

    def leaf_parts(self, vn: int, by_piece: dict[int, list[torch.Tensor]],
                   remote: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """VN ``vn``'s leaf vector in parts: [gradients of the tree's parameters (``by_piece``: per
        piece of this worker, its parameters' gradients; ``remote``: a tied weight's other use's) |
        BatchNorm statistics ("mean") | loss (the last piece; a copy)]."""
        e = self.engine
        if e.ties is not None:
            parts = e.ties.leaf_grads(by_piece, remote)
        else:
            parts = [x for k in e.pieces for x in by_piece[k]]
        if e.bn_numel and e.batchnorm == "mean":
            parts += [self.bn_vn.pop((k, vn)) for k in e.pieces if e.bn[k].numel]
        if e.last in e.pieces:
            parts.append(self.losses[vn].reshape(1).clone())
        return parts or [torch.zeros(0, device=e.device)]  # (a worker with no parameter: an empty leaf)

    def _chunks(self) -> list[tuple[int, int]] | None:
        """``reduction="sharded"``: the replicas' chunks of the gradients (the root's chunk is
        enough, unless the whole gradient's norm is taken); ``None``: the whole root."""
        e = self.engine
        return e.shard.bounds if e.shard is not None and e.replicas > 1 and not e.loop.checks_grads else None

    def tree_requests(self, nodes: dict[Node, torch.Tensor], like: torch.Tensor
                      ) -> list[tuple[torch.Tensor | None, StageTree]]:
        """The step's :class:`StageTree` requests (one per job stage after a Bamboo failover), with
        the indices of each one's elements (:meth:`~.reduction.StageReducer.tree_requests`)."""
        e = self.engine
        return e.reducer.tree_requests(e.tree, nodes, like, bool(e.bn_numel and e.batchnorm == "mean"),
                                       e.last in e.pieces, self._chunks())

    def _reduce_sum(self, is_last: bool) -> Generator[Request, Any, tuple[torch.Tensor, int]]:
        """Default mode: [grads | BatchNorm statistics | loss], summed over the replicas in one
        vector (sharded: the gradients reduce-scattered into this replica's chunk, the tail summed
        alone); with one replica nothing is summed and the gradients stay where backward put them.
        Returns (the vector, where its tail starts)."""
        e = self.engine
        if e.shard is not None:  # reduction="sharded": the chunk's update reads the flat gradient
            e.shard.grads_to_flat()
            if e.replicas > 1:  # this replica receives its chunk's sum only
                yield StageScatter(e.shard.flat.grad, e.shard.bounds)
                vec = self._cat(self._tail_parts(is_last))
                if vec.numel():  # the tail [BatchNorm statistics | loss], whole
                    vec = yield from e.reducer.sum_by_stage(vec, False, bool(e.bn_numel), is_last)
                return vec, 0
        if e.replicas == 1:
            return self._cat(self._tail_parts(is_last)), 0
        vec = self._cat(flat_grads(e.params) + self._tail_parts(is_last))
        vec = yield from e.reducer.sum_by_stage(vec, True, bool(e.bn_numel), is_last)
        return vec, load_grads(e.params, vec)

    def _tail_parts(self, is_last: bool) -> list[torch.Tensor]:
        """This worker's [BatchNorm statistics of its pieces | the loss of its VNs (last stage)]."""
        e = self.engine
        parts = []
        if e.bn_numel:
            if e.batchnorm == "mean":
                parts += [self.bn_acc[k] for k in e.pieces if e.bn[k].numel]
            else:
                parts += [self.bn_first.get(k, torch.zeros(e.bn[k].numel, device=e.device))
                          for k in e.pieces if e.bn[k].numel]
        if is_last:
            parts.append(torch.stack([self.losses[v] for v in self.vns]).sum().reshape(1))
        return parts

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, device=self.engine.device)

    def check_grads(self) -> None:
        """After the reduction (and the tied weights' sum): unscale this worker's gradients
        (16-mixed), note whether one holds an inf/nan, and its parameters' block sums for the norm
        (replica 0 only, or each replica's chunk: every entry of the summed vector has one
        contributor)."""
        e = self.engine
        if e.loop.checks_grads:
            # (reduction="sharded": each replica checks, and adds to the norm, its chunk)
            grads, parts = e.update.stage_parts(e.norm_params, e.replica == 0)
            self.found_inf, self.norm_sums = e.loop.finish.local(grads, parts, e.device, e.loop.slots(e.device))

    # ---- the commit ------------------------------------------------------------------------------
    @staticmethod
    def stats_numel(V: int, loop: Any) -> int:
        """The stats vector: ``[bad VN flags (V) | control | loss | workers that found an inf/nan |
        the norm's block sums (when clipping) | metric names' bytes | metric count]``."""
        return V + 5 + loop.norm_entries

    def _metric_sums(self) -> dict[str, float] | None:
        if not self.metrics:
            return None
        out: dict[str, float] = {}
        for v in self.vns:  # in micro-batch order
            for name, value in self.metrics.get(v, {}).items():
                out[name] = out.get(name, 0.0) + value
        return out

    def finish(self, control: int | Callable[[], int], bn_new: torch.Tensor | None,
               loss_total: torch.Tensor | None) -> Generator[Request, Any, StepResult]:
        """One small all-reduce of the step's stats (bad VNs, control, the loss from one last-stage
        worker), then :meth:`commit`."""
        e, V = self.engine, self.V
        is_last = e.last in e.pieces
        base = self.stats_numel(V, e.loop)
        # [the step's stats | the previous step's breakdown, a slot per worker (.timing)]
        stats = torch.zeros(base + e.timing.block_numel, dtype=torch.float64, device=e.device)
        e.timing.pack(stats[base:])
        metric_sums = self._metric_sums() if is_last else None
        if is_last:
            for v in self.vns:
                stats[v] = float(not torch.isfinite(self.losses[v]).item())
            if e.replica == 0:
                stats[V + 1] = float(loss_total)
                names, k = metric_header(metric_sums)
                stats[base - 2: base] = torch.tensor([float(len(names)), float(k)], dtype=torch.float64)
        # read last: a command given while the step computed acts at its end
        stats[V] = control() if callable(control) else control
        stats[V + 2] = self.found_inf
        if self.norm_sums is not None:
            stats[V + 3: V + 3 + e.loop.norm_entries] = self.norm_sums
        if e.fault_point is not None:
            e.fault_point("during_reduction")
        first_bn = e.deterministic and e.bn_numel and e.batchnorm == "first"
        if first_bn:
            vec = torch.cat([self.bn_first.get(k, torch.zeros(e.bn[k].numel, device=e.device)) for k in e.pieces])
            if e.replicas == 1:
                bn_new, first_bn = vec, False
        # (With BatchNorm's "first" statistics over several replicas one more collective follows
        # the stats: a step interrupted there is not finished from another member's stats.)
        e.pending_commit = None if first_bn else (self.step, lambda st: self.commit(st, bn_new))
        stats = yield AllSum(stats)
        if e.fault_point is not None:
            e.fault_point("after_reduction")  # (a "lose" fault here: the stats missed this member)
        e.pending_commit = None
        e.last_commit = (self.step, stats.clone())
        # The loss function's metrics (reporting only: a failure in this all-reduce leaves the
        # step to the state transfer, as BatchNorm's "first" statistics below).
        shared = yield from share_metrics([metric_sums or {}] if is_last else None, is_last and e.replica == 0,
                                          int(stats[base - 2]), int(stats[base - 1]), 1, e.device)
        if first_bn:
            bn_new = yield from e.reducer.sum_by_stage(vec, False, True, False)
        result = self.commit(stats, bn_new, shared[0] if shared else None)
        result.breakdown_raw = e.timing.raw(stats[base:])
        if self.applied:  # reduction="sharded": every replica updated its chunk; all of them, everywhere
            yield from e.update.gather(e.replicas)
            if e.replica_of_successor is not None:  # (Bamboo: so did the replicas of the successor's chunks)
                yield from e.replica_of_successor.gather(e.replicas)
        return result

    def commit(self, stats: torch.Tensor, bn_new: torch.Tensor | None,
               metrics: dict[str, float] | None = None) -> StepResult:
        """The rest of the step once the stats all-reduce is through: skip it (a bad VN, or an
        inf/nan gradient on any worker with 16-mixed) or clip and apply it. Every decision is
        read from ``stats``, the same on every worker. Kept as the engine's ``pending_commit``
        while that all-reduce runs: a failure can complete it on some members only (they apply
        the step), and the others then finish the step from the stats those hand over."""
        e, V, loop = self.engine, self.V, self.engine.loop
        finish = loop.finish
        bad = [v for v in range(V) if stats[v] > 0]
        norm, found_inf = finish.verdict(stats[V + 2], stats[V + 3: V + 3 + loop.norm_entries])
        result = StepResult(self.step, float(stats[V + 1]), bad, int(round(float(stats[V]))), self.compute_s,
                            metrics=metrics, grad_norm=float(norm) if norm is not None else None,
                            skipped=found_inf and not bad, loss_scale=finish.loss_scale)
        if bad:
            for bn in e.bn.values():
                if bn:
                    bn.restore()
                    bn.settle()
            if e.replica_of_successor is not None:
                e.replica_of_successor.end_step(applied=False)
            e.optimizer.zero_grad(set_to_none=True)
            e.phase = "idle"
            return result
        finish.update(found_inf)  # every worker, the same verdict: the same scale
        e.phase = "apply"
        t_apply = time.perf_counter()
        # BatchNorm statistics as after any step whose forwards ran (a skipped step's included,
        # as in a plain loop where GradScaler skips only optimizer.step()).
        if bn_new is not None:
            load_statistics(e.bn, bn_new)
        for bn in e.bn.values():
            bn.settle()  # a failure after this step (at its boundary) must not undo it
        if found_inf:  # the optimizer and the LR scheduler do not step
            e.optimizer.zero_grad(set_to_none=True)
        else:  # (reduction="sharded": this replica's chunk)
            finish.clip_(e.update.stage_grads(), norm)
            e.update.apply(e.scheduler)
            self.applied = True
        if self.replica_update is not None:
            e.replica_of_successor.apply(self.replica_update, update=not found_inf,
                                         clip=(norm, loop.max_grad_norm) if norm is not None else None)
            e.replica_of_successor.end_step(applied=True)
        e.timing.clock.add("optimizer_s", time.perf_counter() - t_apply)
        e.phase = "idle"
        return result
