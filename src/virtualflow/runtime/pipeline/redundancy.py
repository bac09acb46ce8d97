"""Bamboo's redundancy: a replica of the successor's stage, its eager forwards, and their reuse.

Purpose: with ``Pipeline.redundancy`` every worker holds a copy of its successor's stage
(:class:`StageReplica`), kept up to date after every step from the successor's reduced gradients
(:func:`hand_over`), so a failover loses no state. With ``reduction="sharded"`` the replica
mirrors the successor's chunk of the stage's optimizer state (it steps that chunk with the
successor's reduced gradient chunk) and its holders all-gather the rest of the weights
(:meth:`StageReplica.gather`); a failover rebuilds the lost chunk from it
(:mod:`~virtualflow.runtime.pipeline.shard_failover`). With ``redundant_compute="eager"`` the worker
also runs the successor's forwards of what it sent on that copy in its idle slots
(:meth:`StageReplica.forward_eagerly`) and keeps them until the step commits; after a failover the
redone step splices them in (:class:`Reuse`, :func:`spliced_forward`) instead of running the lost
stage's layers again.

Invariants:

- The replica's update is the original's own code on the same values (same module structure,
  optimizer class and hyperparameters, scheduler, gradients, BatchNorm statistics and buffers),
  so the replica equals the original bit for bit after every step, whatever the optimizer.
- The hand-over happens before the step commits, so a replica is never behind a committed step;
  a skipped or interrupted step leaves the replica as it was (:meth:`StageReplica.end_step`,
  :meth:`StageReplica.rewind`).
- A spliced forward gives the values of running the layers again (same weights, same inputs,
  same random stream): loss, gradients, BatchNorm statistics and the random stream after it are
  bit-identical.
- A weight tied across workers (a GPT's embedding and head) that the holder's own pieces read
  too is a copy of its own in the replica (:func:`untie_from_holder`): the replica's copy takes
  the successor's update (its reduced gradient, the copies' sum), the holder's copy its own, so
  each equals its source after every refresh, and eager forwards read the successor's current
  weight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Sequence

import torch
from torch import nn

from virtualflow.plan.pipeline.geometry import TiedCopy, tensors_of, tied_for_worker, tied_parameters
from virtualflow.runtime.clipping import clip_
from virtualflow.runtime.pipeline.batchnorm import PieceBatchNorm, load_statistics
from virtualflow.runtime.pipeline.loop import StageLoop
from virtualflow.runtime.pipeline.microbatch import MicroBatch, MicroBatchPrep, starts_in_place
from virtualflow.runtime.pipeline.pieces import stage_model
from virtualflow.runtime.pipeline.requests import Expect, Recv, Request, Send
from virtualflow.runtime.pipeline.stage_shard import WholeStage
from virtualflow.runtime.pipeline.wire import replica_key, replica_update


@dataclass(slots=True)
class Eager:
    """One eager redundant forward: the successor stage's forward of one micro-batch, run on this
    worker's replica, kept (graph included) until the step commits."""

    inputs: list[torch.Tensor]
    """The forward's input leaves (the message's tensors; empty for the first stage: its data)."""
    outputs: tuple[torch.Tensor, ...]
    single: bool
    """The stage returned one tensor (not a tuple)."""
    rng: Any
    """The random generator state(s) after the forward."""
    buffers: dict[str, torch.Tensor]
    """The replica's buffers after the forward (BatchNorm statistics), by whole-model name."""
    params: dict[str, torch.Tensor]
    """The replica's parameters the graph uses, by whole-model name."""


@dataclass
class Reuse:
    """A failed-over worker's eager forwards of the stage it took over (layers ``[lo, hi)`` of the
    whole model), for the redone step: (step, VN) -> forward."""

    lo: int
    hi: int
    entries: dict[tuple[int, int], Eager]


class Splice(torch.autograd.Function):
    """Put an eager forward's outputs in place of running layers ``[lo, hi)`` again: forward gives
    the kept outputs; backward runs the kept graph, adds its parameter gradients to the layers that
    run the stage now (``targets``: whole-model name -> parameter) and hands the input gradients to
    the live graph below. The values are those of running the layers again (same weights, same
    inputs, same random stream), so the step is unchanged."""

    @staticmethod
    def forward(ctx, entry: Eager, targets: dict[str, torch.Tensor], anchor: torch.Tensor, *live: torch.Tensor):
        ctx.entry, ctx.targets = entry, targets
        outs = tuple(o.detach().clone() for o in entry.outputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        entry, targets = ctx.entry, ctx.targets
        outs, gs = [], []
        for o, g in zip(entry.outputs, grads):
            if o.is_floating_point() and o.requires_grad and g is not None:
                outs.append(o)
                gs.append(g)
        ins = [t for t in entry.inputs if t.requires_grad]
        names = [n for n, q in entry.params.items() if q.requires_grad]
        wrt = ins + [entry.params[n] for n in names]
        got = (torch.autograd.grad(outs, wrt, gs, allow_unused=True) if outs and wrt
               else (None,) * len(wrt))
        for n, g in zip(names, got[len(ins):]):
            if g is not None:
                q = targets[n]
                q.grad = g if q.grad is None else q.grad + g
        it = iter(got[:len(ins)])
        in_grads = [next(it) if t.requires_grad else None for t in entry.inputs]
        ctx.entry = ctx.targets = None
        return (None, None, None, *in_grads)


def spliced_forward(module: nn.Module, x: Any, entry: Eager, lo: int, hi: int,
                    device: torch.device) -> tuple[Any, bool]:
    """``module(x)`` with layers ``[lo, hi)`` taken from an eager forward (``entry``); and whether
    the forward was spliced in (layer ``lo`` is one of ``module``'s). A tied weight ``module``
    holds under two names (both its uses on this worker after a failover) is a target under each."""
    targets = dict(module.named_parameters(remove_duplicate=False))
    h = x
    spliced = False
    for name, layer in module.named_children():
        i = int(name)
        if i < lo or i >= hi:
            h = layer(h)
        elif i == lo:
            live = tensors_of(h) if entry.inputs else ()
            anchor = torch.zeros((), device=device, requires_grad=True)
            outs = Splice.apply(entry, targets, anchor, *live)
            h = outs[0] if entry.single else tuple(outs)
            with torch.no_grad():
                for bname, value in entry.buffers.items():
                    owner, _, leaf = bname.rpartition(".")
                    setattr(module.get_submodule(owner) if owner else module, leaf, value.clone())
            if isinstance(entry.rng, tuple):
                torch.set_rng_state(entry.rng[0])
                torch.cuda.set_rng_state(entry.rng[1], device)
            else:
                torch.set_rng_state(entry.rng)
            spliced = True
    return h, spliced


def reuse_of(module: nn.Module, lo: int, hi: int, eager: dict[tuple[int, int], Eager], tied: set[int],
             low: torch.dtype | None) -> Reuse | None:
    """The redone step's reuse of ``eager`` (forwards of layers ``[lo, hi)`` of ``module``), or
    ``None`` where splicing them in would change a tied weight's gradient sum. Under autocast
    (``low``: its dtype) the unpipelined job adds the two uses' gradients of a weight inside one
    graph, through autocast's one cast of it, in the low precision; a spliced forward ran on its own graph, so its use's gradient would
    be added in float32 (and the stage's first forward, which tells :mod:`.tied` whether its use
    reads the cast, would not show it). So no splice where ``[lo, hi)`` reads a weight that the rest
    of ``module`` reads too or that is tied across workers (``tied``: ids of this worker's copies);
    the redone step runs those forwards again. Without autocast the sum is one float32 addition,
    exact in either order: always reused."""
    inside, outside = set(), set(tied)
    for name, layer in module.named_children():
        (inside if lo <= int(name) < hi else outside).update(id(q) for q in layer.parameters())
    return Reuse(lo, hi, dict(eager)) if low is None or not inside & outside else None


def hand_over(step: int, stage_rank: int, p: int, successor: int, grads: torch.Tensor,
              bn_new: torch.Tensor | None, buffers: list[torch.Tensor],
              device: torch.device) -> Generator[Request, Any, list[torch.Tensor]]:
    """Send this stage's step ``step`` (its reduced gradients, flat: the stage's update's
    ``handed_grads()``, the whole stage's or, sharded, this copy's chunk; new BatchNorm
    statistics, buffers) to the predecessor, which holds this stage's replica, and receive the
    successor's step for the replica this worker holds; returns the successor's message."""
    message = replica_update(grads.to(device),
                             bn_new if bn_new is not None else torch.zeros(0, device=device),
                             [b.detach() for b in buffers])
    yield Expect(successor, replica_key(successor, step))
    yield Send((stage_rank - 1) % p, replica_key(stage_rank, step), message)
    return (yield Recv(successor, replica_key(successor, step)))


def untie_from_holder(pieces: dict[int, nn.Module], holder_params: Sequence[torch.Tensor]) -> int:
    """Give the replica's ``pieces`` their own copy of each parameter they share with the holder's
    pieces (a weight tied across workers: both are cut from one whole model, so the successor's
    use of the weight is the holder's parameter object, and the holder would step it twice per
    step: its own update and the replica's). Uses inside the replica keep sharing their one copy.
    Returns the number of parameters copied."""
    held = {id(q) for q in holder_params}
    copies: dict[int, nn.Parameter] = {}
    for module in pieces.values():
        for sub in module.modules():
            for name, q in list(sub._parameters.items()):
                if q is not None and id(q) in held:
                    if id(q) not in copies:
                        copies[id(q)] = nn.Parameter(q.detach().clone(), requires_grad=q.requires_grad)
                    sub._parameters[name] = copies[id(q)]
    return len(copies)


def _run_bounds(full_bounds: list[tuple[int, int]], runs: list[list[int]]) -> list[tuple[int, int]]:
    """The layer range of each member of a re-laid replica (its run of job stages)."""
    return [(full_bounds[run[0]][0], full_bounds[run[-1]][1]) for run in runs]


def shared_ties(layers: list[nn.Module], full_bounds: list[tuple[int, int]], p: int, runs: list[list[int]],
                pos: int) -> tuple[list[TiedCopy], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Deterministic mode's :data:`RELAID_TIES`: the weights tied across the new layout's workers
    (:func:`~virtualflow.plan.pipeline.geometry.tied_for_worker`; :mod:`.tied` sums them per
    virtual node); where this worker now runs both uses they share one parameter, and autograd
    adds their gradients per virtual node, as in the unpipelined job. No twins."""
    return tied_for_worker(layers, _run_bounds(full_bounds, runs), len(runs), pos), []


def twin_ties(layers: list[nn.Module], full_bounds: list[tuple[int, int]], p: int, runs: list[list[int]],
              pos: int) -> tuple[list[TiedCopy], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Default mode's :data:`RELAID_TIES`: every weight tied across the job's stages, so that the
    list (the vector of the copies' sum, :data:`~.tied.TIED_SUMS`) is the same on every worker of
    every replica, failed over or not. Where this worker (or its replica of the successor) runs two
    uses, the later one gets a copy of its own, a *twin*: each use's gradient is then reduced with
    its own job stage over the replicas, exactly as the full-depth replicas reduce theirs, and the
    twins' gradients are added before the copies' sum (:class:`TwinSum`)."""
    m = len(runs)
    bounds = _run_bounds(full_bounds, runs)
    job_tied = tied_parameters(layers, full_bounds, p)
    twins = []
    for k in sorted({pos, (pos + 1) % m}):  # this worker's run, its replica's
        a, b = bounds[k]
        for locs in job_tied:
            here = [(i, name) for i, name in locs if a <= i < b]
            first = layers[here[0][0]].get_parameter(here[0][1]) if here else None
            for i, name in here[1:]:
                twin = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
                owner, _, leaf = name.rpartition(".")
                setattr(layers[i].get_submodule(owner) if owner else layers[i], leaf, twin)
                twins += [(first, twin)] if k == pos else []
    a, b = bounds[pos]
    out = []
    for locs in job_tied:
        first = layers[locs[0][0]].get_parameter(locs[0][1])
        mine = next((layers[i].get_parameter(name) for i, name in locs if a <= i < b), None)
        workers = tuple(next(k for k, (x, y) in enumerate(bounds) if x <= i < y) for i, _ in locs)
        out.append(TiedCopy(mine, first.numel(), first.dtype, workers))
    return out, twins


RELAID_TIES = {True: shared_ties, False: twin_ties}
"""A Bamboo re-layout's weights tied across pieces, re-planned for the new layout, per
deterministic mode: ``RELAID_TIES[deterministic](layers, full_bounds, p, runs, pos)`` for member
``pos`` of a replica whose members run the job stages ``runs`` (``layers``: its whole model,
loaded) gives (its tied copies, its twins)."""


class TwinSum:
    """Default mode: the engine's sum of the copies of the weights tied across workers
    (:data:`~.tied.TIED_SUMS`), with each twin (a second use of a tied weight on this worker after
    a Bamboo failover, :data:`RELAID_TIES`) taken in: after the replicas' reduction, its gradient
    (its own job stage's sum) is added to its first copy's before the copies' sum, and the total is
    given to both after it. Without twins: the engine's sum as it is."""

    def __init__(self, inner: Any, twins: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner = inner
        self.twins = list(twins)

    def before(self, replica: int) -> Generator[Request, Any, None]:
        yield from self.inner.before(replica)

    def after(self, replica: int) -> Generator[Request, Any, None]:
        for first, twin in self.twins:
            if twin.grad is not None:
                first.grad = twin.grad if first.grad is None else first.grad + twin.grad
        yield from self.inner.after(replica)
        for first, twin in self.twins:
            twin.grad = None if first.grad is None else first.grad.clone()


class StageReplica:
    """A copy of another worker's stage (Bamboo's redundant stage): its pieces, optimizer and
    scheduler, taking the same update as the original from the original's reduced gradients
    (see the module docstring)."""

    def __init__(self, pieces: dict[int, nn.Module], build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None, stage_rank: int,
                 loop: StageLoop | None = None, make_update: Callable[..., Any] | None = None,
                 holder_params: Sequence[torch.Tensor] = ()) -> None:
        """``holder_params``: the holder's own parameters; a weight tied across workers that the
        successor's pieces share with them becomes the replica's own copy (:func:`untie_from_holder`)."""
        self.stage_rank = stage_rank
        untie_from_holder(pieces, holder_params)
        self.loop = loop if loop is not None else StageLoop()
        """The holder's loop settings: the replica's pieces are prepared and autocast as the
        original's (its scaler stays the holder's: a replica takes already unscaled gradients)."""
        self.loop.prepare(pieces)
        self.pieces, self.model, self.params, optimizer, self.scheduler = stage_model(
            pieces, build_optimizer, scheduler_factory)
        make_update = make_update if make_update is not None else _whole_update
        self.update = make_update(self.params, optimizer)
        """The replica's update, of the original's kind (``make_update(params, optimizer)``, the
        stage engine's rule): the whole stage's (:class:`~.stage_shard.WholeStage`) or, with
        ``reduction="sharded"``, the original's chunk (:class:`~.stage_shard.StageShard`, cut by
        the holder's pipeline replica, which is the original's): it mirrors that chunk's optimizer
        state, and the stage's other chunks of the weights arrive with an all-gather over the
        holders (the predecessor stage's group: :meth:`gather`)."""
        self.optimizer = self.update.optimizer
        self.bn = {k: PieceBatchNorm(m) for k, m in self.pieces.items()}
        self.clone_input = any(starts_in_place(m) for m in self.pieces.values())
        self.refresh_s = 0.0
        """Time spent taking the original's steps (the redundant compute), in seconds."""
        self.eager: dict[tuple[int, int], Eager] = {}
        """This step's eager forwards, (step, VN) -> forward (``Pipeline.redundant_compute``)."""
        self.forward_s = 0.0
        """Time spent in eager redundant forwards, in seconds."""
        self.forwards = 0
        """Eager redundant forwards run."""
        self.skipped = 0
        """Forwards no idle slot was left for (a failover recomputes them)."""
        self.last_forward_s: float | None = None
        self.kept_bytes = 0
        self.peak_kept_bytes = 0
        """The most bytes one step's eager forwards held (activations their graphs saved and their
        outputs; the weights they share with the replica not counted)."""

    def forward_est(self, default: float) -> float:
        """Seconds the next eager forward should take: the last one's, else ``default``."""
        return self.last_forward_s if self.last_forward_s is not None else default

    def forward_eagerly(self, step: int, vn: int, message: list[torch.Tensor] | None, prep: MicroBatchPrep,
                        slowdown: float) -> None:
        """Bamboo's eager redundant computation: the successor stage's forward of micro-batch
        (step, VN) on this replica, from the message the holder sent the successor (or the VN's
        data for the first stage), kept with its graph until the step commits."""
        (k, module), = self.pieces.items()
        device = prep.device
        t0 = time.perf_counter()
        bn = self.bn[k]
        if bn:
            bn.restore()
        ctx = MicroBatch()
        x = prep.inputs(k, step, vn, message, ctx, clone=self.clone_input)
        weights = {q.untyped_storage().data_ptr() for q in module.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:  # what the kept graph holds (weights aside)
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                kept[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.loop.autocast(device):
            out = module(x)
        try:
            outs = tensors_of(out)
        except TypeError:  # a model output of another kind (the last stage's): not kept
            outs = None
        if outs is not None:
            rng = torch.get_rng_state()
            if device.type == "cuda":
                rng = (rng, torch.cuda.get_rng_state(device))
            self.eager[step, vn] = Eager(
                inputs=list(ctx.inputs), outputs=outs, single=isinstance(out, torch.Tensor), rng=rng,
                buffers={n: b.detach().clone() for n, b in module.named_buffers()},
                params=dict(module.named_parameters()))
            for t in outs:
                kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            self.kept_bytes += sum(kept.values())
            self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        t1 = time.perf_counter()
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * (t1 - t0))
        dt = time.perf_counter() - t0
        self.forward_s += dt
        self.forwards += 1
        self.last_forward_s = dt

    def layer_range(self) -> tuple[int, int]:
        """The whole-model layers ``[lo, hi)`` this replica holds."""
        names = [int(name) for mod in self.pieces.values() for name, _ in mod.named_children()]
        return min(names), max(names) + 1

    def begin_step(self) -> None:
        """A step starts: the forwards of earlier steps go; BatchNorm statistics are restored to
        this point before each eager forward."""
        self.eager.clear()
        self.kept_bytes = 0
        for bn in self.bn.values():
            if bn:
                bn.snapshot()

    def rewind(self) -> None:
        """Undo what eager forwards did to the replica's buffers (an interrupted step)."""
        for bn in self.bn.values():
            bn.restore()  # nothing changes where no snapshot is held

    def end_step(self, applied: bool) -> None:
        """The step committed (``applied``) or was skipped: its eager forwards go."""
        if not applied:
            self.rewind()
        for bn in self.bn.values():
            bn.settle()
        self.eager.clear()
        self.kept_bytes = 0

    def apply(self, message: list[torch.Tensor], *, update: bool = True,
              clip: tuple[torch.Tensor, float] | None = None) -> None:
        """The original's step: ``message`` = [its reduced gradients (flat, unscaled) | its new
        BatchNorm statistics (or empty) | its buffers after the step's forwards]; ``update``
        False: a skipped step (16-mixed: buffers and statistics only); ``clip``: (the step's
        norm, ``max_grad_norm``), the original's clipping."""
        t0 = time.perf_counter()
        self._apply(message, update, clip)
        self.refresh_s += time.perf_counter() - t0

    def _apply(self, message: list[torch.Tensor], update: bool = True,
               clip: tuple[torch.Tensor, float] | None = None) -> None:
        grads, bn_new, *buffers = message
        with torch.no_grad():
            for b, value in zip(self.model.buffers(), buffers):
                b.copy_(value)
        if bn_new.numel():
            load_statistics(self.bn, bn_new)
        if not update:
            return
        # views of the message (a buffer of its own), dropped after the step
        self.update.load_handed(grads)
        if clip is not None:
            clip_(self.update.stage_grads(), *clip)
        self.update.apply(self.scheduler)

    def begin_update(self, replica: int, replicas: int) -> None:
        """A step starts on the holder, pipeline replica ``replica`` of ``replicas`` (the
        original's): a sharded replica is cut as the original's chunk."""
        self.update.begin_step(replica, replicas)

    def gather(self, replicas: int) -> Generator[Request, Any, None]:
        """After an applied step (collective over the holder's stage group, right after the
        stage's own gather): a sharded replica's chunks of the weights, everywhere; nothing for a
        whole one. The holders of one stage's replicas are the ``replicas`` copies of the
        predecessor stage, one per pipeline replica, so they hold every chunk between them."""
        yield from self.update.gather(replicas)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])

    def nbytes(self) -> int:
        """Bytes the replica holds: parameters, buffers and optimizer state."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors) + self.update.state_bytes()


def _whole_update(params: list[torch.Tensor], optimizer: Any) -> WholeStage:
    """A replica's update without sharding: the whole stage's."""
    return WholeStage(optimizer, params)


@dataclass(slots=True)
class RedundantTotals:
    """A worker's eager redundant forwards over the whole run (``Result.redundant_forwards``):
    those of the engines it dropped at re-layouts (:meth:`add`), plus its current engine's."""

    seconds: float = 0.0
    forwards: int = 0
    skipped: int = 0
    """Forwards skipped (no idle slot)."""
    reused: int = 0
    """Forwards a redone step reused."""
    peak_bytes: int = 0
    """The most bytes one step's forwards kept."""

    def add(self, stage: Any) -> StageReplica | None:
        """Count the forwards of ``stage`` (a :class:`~.engine.StageEngine`, or ``None``); returns
        its replica of the successor's stage (``None`` without one)."""
        replica = stage.replica_of_successor if stage is not None else None
        if replica is not None:
            self.seconds += replica.forward_s
            self.forwards += replica.forwards
            self.skipped += replica.skipped
            self.peak_bytes = max(self.peak_bytes, replica.peak_kept_bytes)
        if stage is not None:
            self.reused += stage.reused_forwards
        return replica

    def report(self, stage: Any) -> dict[str, float]:
        """The totals with the current engine ``stage``'s forwards counted too."""
        now = replace(self)
        now.add(stage)
        return {"seconds": now.seconds, "forwards": now.forwards, "skipped": now.skipped, "reused": now.reused,
                "peak_bytes": now.peak_bytes}
