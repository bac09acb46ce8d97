"""A pipelined job's workers in one process: building their engines, and a cooperative driver.

:class:`LocalDriver` runs every worker of a pipelined job in this process, one at a time: a worker
runs until it asks for a message that has not been sent yet or joins a collective, and a
collective completes when all its members have joined. It answers the same requests as the
process driver (:func:`virtualflow.runtime.pipeline.worker_engine.drive`), so what is proven here holds
there: ``tests/unit/test_pipeline_engine.py`` proves the executor's semantics with it, and
:func:`train_local` trains a pipelined job without processes (profiling, notebooks).

Invariants: single-threaded, so handing the global random generator from piece to piece is safe;
a collective completes only when every member has joined it; a state in which no worker can
move raises :class:`PipelineDeadlock` (naming every worker's pending request) instead of hanging.
Nothing here reads the environment: the diagnostic ``eager_every_wait`` is an argument
(:mod:`virtualflow.backends.inprocess` gives it its default from ``VIRTUALFLOW_EAGER_EVERY_WAIT``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.vnmap import Node, split
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.loop import stage_loop
from virtualflow.runtime.pipeline.requests import (AllSum, Expect, Poll, Recv, Send, StageGather, StageScatter,
                                                   StageSum, StageTree, StepResult, TreeOpen, TreePart)
from virtualflow.runtime.pipeline.wire import MsgKey

__all__ = ["LocalDriver", "PipelineDeadlock", "build_engine", "train_local"]


# ---- building the engines of a job ------------------------------------------------------------
def build_engine(job: Any, pipeline: Pipeline, bounds: Sequence[tuple[int, int]], stage_rank: int, *,
                 dataset: Any, deterministic: bool, device: torch.device,
                 eager_every_wait: bool = False, reduction: str = "allreduce", loader_workers: int = 0) -> StageEngine:
    """Build worker ``stage_rank``'s engine: the whole model from the job's seed (so every worker's
    pieces start from the same weights as the unpipelined model), then only its pieces kept.
    ``eager_every_wait``: :attr:`StageEngine.eager_every_wait` (a diagnostic). ``loader_workers``:
    threads that load the next micro-batches ahead (the first and last stages')."""
    from virtualflow.plan.pipeline.geometry import layers_of, piece_module, successor_pieces, tied_for_worker
    from virtualflow.runtime.streaming import data_plan_of, loader_of

    torch.manual_seed(job.seed)
    layers = [layer.to(device) for layer in layers_of(job.model())]
    p = pipeline.stages
    pieces = {k: piece_module(layers, a, b) for k, (a, b) in enumerate(bounds) if k % p == stage_rank}
    plan = data_plan_of(dataset, job)
    return StageEngine(
        pieces=pieces, n_pieces=len(bounds), stage_rank=stage_rank, build_optimizer=job.build_optimizer,
        scheduler_factory=job.lr_scheduler, pipeline=pipeline, plan=plan,
        loader=loader_of(dataset, job.collate_fn, plan), model_input=job.input_of, output_loss=job.output_loss,
        seed=job.seed, batchnorm=job.batchnorm, deterministic=deterministic, device=device,
        tied=tied_for_worker(layers, bounds, p, stage_rank),
        successor_pieces=successor_pieces(pipeline, layers, bounds, stage_rank),
        eager_every_wait=eager_every_wait, loop=stage_loop(job, layers, bounds, p), reduction=reduction,
        loader_workers=loader_workers,
    )


class PipelineDeadlock(RuntimeError):
    """No worker of an in-process pipeline can move (a schedule the checker would refuse)."""


class LocalDriver:
    """Runs the workers of a pipelined job in this process, cooperatively (one at a time).

    ``engines[r]`` is worker ``r`` = stage-rank ``r % p`` of replica ``r // p``. A worker runs until
    it asks for a message that has not been sent yet or joins a collective; a collective completes
    when every member has joined it. Single-threaded, so the global random generator is safe to
    hand from piece to piece.
    """

    def __init__(self, engines: Sequence[StageEngine]) -> None:
        self.engines = list(engines)
        self.p = engines[0].p
        if len(engines) % self.p:
            raise ValueError(f"{len(engines)} engines is not a multiple of stages={self.p}")
        self.d = len(engines) // self.p

    def set_layout(self, assignment: Sequence[Sequence[int]]) -> None:
        if len(assignment) != self.d:
            raise ValueError(f"assignment has {len(assignment)} replicas, the driver has {self.d}")
        for r, e in enumerate(self.engines):
            e.set_layout(r // self.p, assignment)
            e.set_breakdown_slot(r, len(self.engines))

    def run(self, first_step: int, n_steps: int, control: int = 0) -> list[StepResult]:
        gens = [e.steps(first_step, n_steps, control) for e in self.engines]
        pending: list[Any] = [None] * len(gens)
        answer: list[Any] = [None] * len(gens)
        done: list[Any] = [None] * len(gens)
        mailbox: dict[tuple[int, int, MsgKey], list[torch.Tensor]] = {}
        live = set(range(len(gens)))

        def advance(r: int) -> None:
            try:
                pending[r] = gens[r].send(answer[r]) if pending[r] is not None else next(gens[r])
            except StopIteration as stop:
                done[r] = stop.value
                pending[r] = None
                live.discard(r)
            answer[r] = None

        for r in range(len(gens)):
            advance(r)
        while live:
            moved = False
            for r in sorted(live):
                while r in live:
                    req = pending[r]
                    rep, sr = divmod(r, self.p)
                    if isinstance(req, (Expect, TreeOpen, TreePart)):
                        pass  # everything is in this process: nothing to post ahead or send early
                    elif isinstance(req, Send):
                        mailbox[rep, req.peer, req.key] = req.tensors
                    elif isinstance(req, Poll):
                        answer[r] = (rep, sr, req.key) in mailbox
                    elif isinstance(req, Recv):
                        box = (rep, sr, req.key)
                        if box not in mailbox:
                            break
                        answer[r] = mailbox.pop(box)
                    else:
                        break  # a collective: completed below when every member has joined
                    advance(r)
                    moved = True
            moved |= self._collectives(pending, answer, live, advance)
            if not moved and live:
                waits = "; ".join(f"worker {r}: {pending[r]!r:.120}" for r in sorted(live))
                raise PipelineDeadlock(f"no worker can move: {waits}")
        return done[0]

    def _collectives(self, pending, answer, live, advance) -> bool:
        moved = False
        everyone = list(range(len(self.engines)))
        if all(isinstance(pending[r], AllSum) for r in everyone) and set(everyone) <= live:
            total = pending[0].vector.clone()
            for r in everyone[1:]:
                total += pending[r].vector
            for r in everyone:
                answer[r] = total.clone()
                advance(r)
            return True
        for sr in range(self.p):
            members = [rep * self.p + sr for rep in range(self.d)]
            reqs = [pending[r] for r in members]
            if not all(r in live for r in members):
                continue
            if all(isinstance(q, StageSum) for q in reqs):
                total = reqs[0].vector.clone()
                for q in reqs[1:]:
                    total += q.vector
                for r in members:
                    answer[r] = total.clone()
                    advance(r)
                moved = True
            elif all(isinstance(q, StageScatter) for q in reqs):
                total = reqs[0].vector.clone()
                for q in reqs[1:]:
                    total += q.vector
                for j, (r, q) in enumerate(zip(members, reqs)):
                    lo, hi = q.bounds[j]
                    q.vector[lo:hi] = total[lo:hi]  # in place, as the ring leaves it
                    answer[r] = q.vector
                    advance(r)
                moved = True
            elif all(isinstance(q, StageGather) for q in reqs):
                for j, q in enumerate(reqs):
                    lo, hi = q.bounds[j]
                    for other in reqs:
                        if other is not q:
                            other.vector[lo:hi] = q.vector[lo:hi]
                for r, q in zip(members, reqs):
                    answer[r] = q.vector
                    advance(r)
                moved = True
            elif all(isinstance(q, StageTree) for q in reqs):
                known: dict[Node, torch.Tensor] = {}
                for q in reqs:
                    known.update(q.nodes)
                root = _combine(known, (0, reqs[0].plan.virtual_nodes))
                for r in members:
                    answer[r] = root.clone()
                    advance(r)
                moved = True
        return moved


def _combine(known: dict[Node, torch.Tensor], node: Node) -> torch.Tensor:
    """The fixed tree's sum (as :func:`virtualflow.comm.reduce.tree_exchange` combines it)."""
    if node in known:
        return known[node]
    left, right = split(node)
    return _combine(known, left) + _combine(known, right)


def train_local(job: Any, steps: int, *, replicas: int = 1, deterministic: bool = False,
                bounds: Sequence[tuple[int, int]] | None = None,
                device: torch.device = torch.device("cpu"),
                eager_every_wait: bool = False, reduction: str = "allreduce",
                engines_out: list[StageEngine] | None = None,
                loader_workers: int = 0) -> tuple[dict[str, torch.Tensor], list[StepResult]]:
    """Train a pipelined job for ``steps`` steps with all its workers in this process; returns the
    whole model's final state dict and one result per step. The proof harness of the executor
    (``tests/unit/test_pipeline_engine.py``) and a way to try a pipeline without processes. With
    tensor-parallel stages (``Pipeline.tensor > 1``), whose workers talk inside their forward and
    backward, every worker runs in a thread of its own (:func:`virtualflow.runtime.grid_threads.
    train_threads`; ``engines_out`` then gets the workers' :class:`PipelineWorkerEngine`).
    ``eager_every_wait``: :attr:`StageEngine.eager_every_wait` (a diagnostic). ``reduction``:
    :class:`StageEngine`'s. ``engines_out``: a list the workers' engines are appended to (in rank
    order), for a caller that inspects them after training. ``loader_workers``: each engine's
    loader threads (``--loader-workers``); they are stopped when training ends."""
    from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
    from virtualflow.plan.vnmap import contiguous_assignment

    pipeline = job.pipeline
    if pipeline.tensor > 1:  # its stages talk inside their forward and backward: a thread per worker
        return _train_threads(job, steps, replicas=replicas, deterministic=deterministic, bounds=bounds,
                              device=device, eager_every_wait=eager_every_wait, reduction=reduction,
                              engines_out=engines_out)
    dataset = job.build_dataset()
    if bounds is None:
        torch.manual_seed(job.seed)
        bounds = resolve_bounds(pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, pipeline, bounds, r % pipeline.stages, dataset=dataset,
                            deterministic=deterministic, device=device, eager_every_wait=eager_every_wait,
                            reduction=reduction, loader_workers=loader_workers)
               for r in range(pipeline.stages * replicas)]
    if engines_out is not None:
        engines_out.extend(engines)
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, replicas))
    history: list[StepResult] = []
    window = 1 if pipeline.flush else pipeline.window
    t = 0
    try:
        while t < steps:
            n = min(window, steps - t)
            history += driver.run(t, n)
            t += n
    finally:
        for e in engines:
            e.close()
    state: dict[str, torch.Tensor] = {}
    for e in engines[: pipeline.stages]:
        state.update({k: v.detach().clone() for k, v in e.model.state_dict().items()})
    return state, history


def _train_threads(job: Any, steps: int, *, replicas: int, deterministic: bool,
                   bounds: Sequence[tuple[int, int]] | None, device: torch.device, eager_every_wait: bool,
                   reduction: str, engines_out: list[Any] | None) -> tuple[dict[str, torch.Tensor], list[StepResult]]:
    """:func:`train_local` of a job with tensor-parallel stages: a thread per worker."""
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.grid_threads import Generation, train_threads

    if bounds is not None:
        raise ValueError(f"bounds={list(bounds)} with Pipeline.tensor={job.pipeline.tensor}: tensor-parallel stages "
                         f"are cut by the job's own split; give it as Pipeline.split")
    workers = tuple(range(replicas * job.pipeline.replica_workers))
    run = train_threads(job, [Generation(members=workers, steps=steps)], device=device,
                        options=WorkerOptions(deterministic=deterministic, reduction=reduction),
                        eager_every_wait=eager_every_wait)
    if engines_out is not None:
        engines_out.extend(run.engines)
    history = [StepResult(step=t, loss=o.loss, bad_vns=list(o.bad_vns), control=o.control, compute_s=0.0,
                          metrics=o.metrics, grad_norm=o.grad_norm, skipped=o.skipped, loss_scale=o.loss_scale,
                          breakdown_raw=o.breakdown_raw)
               for t, o in enumerate(run.outcomes)]
    return dict(run.state["model"]), history
