"""The stage engine: one worker of a pipeline replica - its pieces, optimizer and steps.

Purpose: :class:`StageEngine` holds the model pieces of one worker (stage-rank ``r`` of a pipeline
replica: pieces ``r, r + p, ...``), adopts a generation's layout (:meth:`StageEngine.set_layout`)
and runs steps (:meth:`StageEngine.steps`, a generator of :mod:`.requests` answered by a driver).
It composes the package's collaborators: micro-batch preparation (:mod:`.microbatch`), the
executor's walk of the action list (:mod:`.executor`), the flush step (:mod:`.flush`) or the
streamed window (:mod:`.stream`), the reduction over the replicas (:mod:`.reduction`), the
sharded optimizer over the replicas (:mod:`.stage_shard`, ``reduction="sharded"``), and
Bamboo's replica of the successor's stage (:mod:`.redundancy`).

Invariants:

- The engine never talks to the network: every exchange is a yielded request, so the in-process
  and the process drivers run the same code (see :mod:`virtualflow.runtime.pipeline`).
- ``model`` holds this worker's layers under their whole-model names, so its ``state_dict`` is
  this worker's slice of the whole model's.
- A step either commits (update applied, BatchNorm statistics loaded, replica refreshed) or
  leaves every piece of state as it was at the step's start (:meth:`StageEngine.discard_step`).
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Sequence

import torch
from torch import nn

from virtualflow.config.composition import check
from virtualflow.config.loop import autocast_dtype
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import DataPlan
from virtualflow.plan.pipeline.geometry import TiedCopy
from virtualflow.plan.pipeline import Schedule
from virtualflow.plan.vnmap import TreePlan
from virtualflow.runtime.pipeline.batchnorm import PieceBatchNorm
from virtualflow.runtime.pipeline.executor import run_actions
from virtualflow.runtime.pipeline.flush import FlushStep
from virtualflow.runtime.pipeline.loop import StageLoop
from virtualflow.runtime.pipeline.microbatch import MicroBatchPrep
from virtualflow.runtime.pipeline.pieces import stage_model
from virtualflow.runtime.pipeline.reduction import StageReducer
from virtualflow.runtime.pipeline.redundancy import (Eager, Reuse, StageReplica, TwinSum, hand_over,
                                                     reuse_of, spliced_forward)
from virtualflow.runtime.pipeline.requests import Request, StepResult
from virtualflow.runtime.pipeline.schedule import schedule_for
from virtualflow.runtime.pipeline.stage_shard import StageShard, stage_update
from virtualflow.runtime.pipeline.stream import StreamWindow
from virtualflow.runtime.pipeline.timing import StageTiming
from virtualflow.runtime.prefetch import batch_source
from virtualflow.runtime.pipeline.tied import EXACT_TIES, TIED_SUMS, ExactTies, NoTiedSum


class StageEngine:
    """One worker of a pipeline replica: its model pieces, optimizer and schedule execution."""

    def __init__(
        self, *, pieces: dict[int, nn.Module], n_pieces: int, stage_rank: int,
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None, pipeline: Pipeline, plan: DataPlan,
        loader: Callable[[torch.Tensor], Any], model_input: Callable[[Any], Any],
        output_loss: Callable[[Any, Any], torch.Tensor], seed: int, batchnorm: str, deterministic: bool,
        device: torch.device, tied: Sequence[TiedCopy] = (), successor_pieces: dict[int, nn.Module] | None = None,
        eager_every_wait: bool = False, loop: StageLoop | None = None, reduction: str = "allreduce",
        breakdown: bool = True, loader_workers: int = 0, tied_twins: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        """``build_optimizer``: ``Job.build_optimizer``, given this worker's stage module
        (:func:`~virtualflow.runtime.pipeline.pieces.stage_model`). ``loop``: the training loop's
        knobs (:func:`~virtualflow.runtime.pipeline.loop.stage_loop`; default float32, no
        clipping). ``reduction``: ``"allreduce"`` (every replica holds the stage's whole optimizer
        state) or ``"sharded"`` (each holds its chunk, :mod:`.stage_shard`). ``breakdown``: measure where each
        step's time goes (:mod:`.timing`). ``loader_workers``: threads that load the next micro-batches
        while the current ones compute (:func:`~virtualflow.runtime.prefetch.batch_source`; 0: none).
        ``tied_twins``: Bamboo after a failover, default mode: (copy, twin) per second use of a tied
        weight on this worker (:data:`~.redundancy.RELAID_TIES`)."""
        check_reduction(reduction)
        self.pipeline = pipeline
        self.loop = loop if loop is not None else StageLoop()
        """Precision, loss scaler, clipping; checkpointing and compile were applied to the pieces."""
        self.loop.check_schedule(pipeline)
        self.loop.prepare(pieces)
        self.tied = list(tied)
        """Weights shared with pieces on other workers: per shared weight, this worker's copy (or
        None), its size and dtype and the workers holding it, in the same order on every worker
        (``geometry.tied_for_worker``). Their gradients are summed over the copies before every
        update (default mode: :attr:`tied_sum`; deterministic mode: :attr:`ties`)."""
        check_tied(self.tied, pipeline)
        self.p = pipeline.stages
        self.stage_rank = stage_rank
        self.n_pieces = n_pieces
        self.pieces, self.model, self.params, self.optimizer, self.scheduler = stage_model(
            pieces, build_optimizer, scheduler_factory)
        self.norm_params = self.loop.norm_params(self.model)
        """This worker's parameters the gradient norm counts, with their whole-model index."""
        self.piece_params = {k: [q for q in m.parameters() if q.requires_grad] for k, m in self.pieces.items()}
        self.ties: ExactTies | None = None
        """Deterministic mode, a weight read by two pieces (here, or here and on another worker):
        its per-VN gradients summed before the tree, as autograd sums them in the unpipelined job."""
        if deterministic and ExactTies.needed(self.params, self.piece_params, self.tied):
            self.ties = EXACT_TIES[reduction](params=self.params, piece_params=self.piece_params, tied=self.tied,
                                              stage_rank=stage_rank, p=pipeline.stages,
                                              low=autocast_dtype(self.loop.precision))
        self.tied_sum = NoTiedSum() if deterministic or not self.tied else TIED_SUMS[reduction](self.tied, device)
        """Default mode: how the copies of a weight shared with other workers are summed, before
        the replicas' reduction or after it (:mod:`.tied`)."""
        self.tied_sum = TwinSum(self.tied_sum, tied_twins)  # (Bamboo after a failover: RELAID_TIES)
        self.update = stage_update(reduction, self.params, self.optimizer, pipeline=pipeline,
                                   norm_blocks=self.loop.max_grad_norm is not None)
        """The stage's optimizer update, whole or sharded (:func:`~.stage_shard.stage_update`)."""
        self.shard: StageShard | None = self.update.shard
        """``reduction="sharded"``: this copy's chunk of the stage's optimizer (``self.optimizer``
        is then its :class:`~.stage_shard.StageOptimizer`); ``None`` otherwise."""
        self.optimizer = self.update.optimizer
        self.tree_params = self.ties.tree_params if self.ties is not None else self.params
        """Deterministic mode: the parameters whose gradients this worker's tree vector holds."""
        self.plan = plan
        self.seed = seed
        self.batchnorm = batchnorm
        self.deterministic = deterministic
        self.device = device
        self.bn = {k: PieceBatchNorm(m) for k, m in self.pieces.items()}
        self.bn_numel = sum(b.numel for b in self.bn.values())
        self.grad_numel = sum(q.numel() for q in self.params)
        self.reducer = StageReducer(grad_numel=self.grad_numel, bn_numel=self.bn_numel, device=device)
        """How this worker's step is summed over the replicas (by job stage after a failover)."""
        self._init_membership(pipeline, breakdown)
        self.prep = MicroBatchPrep(
            plan=plan, source=batch_source(loader, loader_workers, plan.vn_indices, io=breakdown),
            model_input=model_input, output_loss=output_loss, seed=seed, device=device, n_pieces=n_pieces,
            pieces=self.pieces, clock=self.timing.clock)
        """Inputs and outputs of this worker's pieces per micro-batch (their data loaded when the
        forward asks, or ahead by ``loader_workers`` threads)."""
        self._init_step_state()
        self._init_redundancy(successor_pieces, build_optimizer, scheduler_factory, eager_every_wait)
        check_streamed_batchnorm(pipeline, self.bn_numel)

    def _init_membership(self, pipeline: Pipeline, breakdown: bool) -> None:
        """The generation's layout as :meth:`set_layout` will set it (one replica until then)."""
        self.replicas = 1
        self.replica = 0
        self.assignment: list[list[int]] = [list(range(self.plan.virtual_nodes))]
        self.tree: TreePlan | None = None
        self.timeline: list[dict[str, Any]] | None = [] if pipeline.record_timeline else None
        self.timing = StageTiming(breakdown)
        """The step breakdown of this stage (flush schedules): its clock and its slot in the
        step's statistics all-reduce (set with the generation: :meth:`set_breakdown_slot`)."""

    def _init_step_state(self) -> None:
        """Where a step is, and what a step interrupted or committed leaves behind."""
        self.phase = "idle"
        self.slowdown = 1.0
        self.pending_commit: tuple[int, Callable[[torch.Tensor], StepResult]] | None = None
        """(step, finish) while the step's stats all-reduce runs (flush schedules): what the step
        still does once the stats are known (the gradients are reduced by then)."""
        self.last_commit: tuple[int, torch.Tensor] | None = None
        """(step, stats) of the last step whose stats all-reduce completed here."""
        self.prev_version: dict[int, dict[str, torch.Tensor]] | None = None
        """``2bw``: per piece, the weights after the second-to-last update (the version the next
        window's first step runs on); ``None`` before the first update."""
        self.fault_point: Callable[[str], None] | None = None
        """Fault injection (tests): called with a phase name at the points of
        :mod:`virtualflow.runtime.faults` a step passes (first send, first backward, the commit's
        reduction, the update)."""

    def _init_redundancy(self, successor_pieces: dict[int, nn.Module] | None, build_optimizer: Callable[..., Any],
                         scheduler_factory: Callable[..., Any] | None, eager_every_wait: bool) -> None:
        """Bamboo's replica of the successor's stage and its eager forwards."""
        self.replica_of_successor: StageReplica | None = None
        """``Pipeline.redundancy``: the successor's stage, kept up to date after every step."""
        if successor_pieces is not None:  # (a weight tied with this worker's pieces: the replica's own copy)
            self.replica_of_successor = StageReplica(successor_pieces, build_optimizer, scheduler_factory,
                                                     (self.stage_rank + 1) % self.p, loop=self.loop,
                                                     make_update=self.update.like,
                                                     holder_params=list(self.model.parameters()))
        self.eager = self.pipeline.eager_forwards and self.replica_of_successor is not None
        """``Pipeline.redundant_compute="eager"``: run the successor's forwards on the replica in
        idle slots (:meth:`StageReplica.forward_eagerly`)."""
        self.reuse: Reuse | None = None
        """After a failover: the eager forwards of the stage this worker took over, used by the
        redone step instead of running that stage's forwards again."""
        self.reused_forwards = 0
        """Forwards the redone step took from eager forwards (since this engine was built)."""
        self.eager_every_wait = eager_every_wait
        """Diagnostic: run eager forwards at every receive whose message is not there yet, bubble
        or not, from the first step (tests use it to make the failover's reuse certain; it shows
        what placing them in the bubbles saves). Given by whoever builds the engine (the process
        entry point reads ``VIRTUALFLOW_EAGER_EVERY_WAIT=1``)."""
        self.fb_times: tuple[float, float] | None = None
        """This worker's mean forward and backward seconds per micro-batch in its last step (they
        place eager forwards in the schedule's bubbles)."""

    # ---- membership -----------------------------------------------------------------------
    def set_layout(self, replica: int, assignment: Sequence[Sequence[int]]) -> None:
        """Adopt a generation: this worker is in pipeline replica ``replica``; ``assignment[j]`` are
        the VNs replica ``j`` runs (in micro-batch order)."""
        self.replica = replica
        self.replicas = len(assignment)
        self.assignment = [list(a) for a in assignment]
        self.tree = TreePlan.build(self.assignment) if self.deterministic else None
        vns = self.assignment[replica]
        if not vns:
            raise ValueError(
                f"pipeline replica {replica} has no virtual node; every replica needs at least one: use at most "
                f"{self.plan.virtual_nodes} replicas"
            )
        schedule_for(self.pipeline, len(vns), self.pipeline.window)  # validate m for this schedule now
        self.prep.set_vns(vns)  # (loader threads: what was loaded for the old map is dropped)
        self.timing.new_generation(None, self.stage_rank)

    def set_breakdown_slot(self, rank: int, size: int) -> None:
        """This worker is rank ``rank`` of the generation's ``size`` workers: its slot for the step
        breakdown (after :meth:`set_layout`, on every worker of the generation or on none)."""
        self.timing.slot = (rank, size)

    def set_job_stages(self, stages: Sequence[tuple[int, int, int]] | None) -> None:
        """Bamboo: this worker runs the job stages ``(stage, first layer, end layer)`` (consecutive,
        in order) of a failed-over replica while other replicas run them on one worker each. Its
        reductions over the replicas then go job stage by job stage, each over the workers that
        run that stage (:attr:`StageSum.stage`), so every element is summed over the same replicas
        in the same order as in an undisturbed run. ``None``: one reduction (one stage group)."""
        self.reducer.set_job_stages(self.model, self.pieces, stages, self.tree_params)

    @property
    def job_stages(self) -> list[tuple[int, torch.Tensor, torch.Tensor]] | None:
        """Per job stage this worker runs, the indices of its gradients and BatchNorm statistics
        (:meth:`set_job_stages`); ``None``: one stage group."""
        return self.reducer.job_stages

    def take_over(self, lo: int, hi: int, eager: dict[tuple[int, int], Eager]) -> None:
        """After a failover: the redone step takes layers ``[lo, hi)`` (a stage this worker now
        runs) from ``eager`` (the eager forwards of the replica it held) instead of running them
        - unless that would change a tied weight's sum (:func:`~.redundancy.reuse_of`)."""
        tied = {id(t.param) for t in self.tied if t.param is not None}
        self.reuse = reuse_of(self.model, lo, hi, eager, tied, autocast_dtype(self.loop.precision))

    def close(self) -> None:
        """Stop this engine's loader threads (if any); it takes no step after this."""
        self.prep.close()

    def discard_step(self) -> None:
        """An interrupted step: BatchNorm statistics (the pieces' and the replica's) back to the
        step's start, gradients dropped."""
        for bn in self.bn.values():
            bn.restore()  # nothing changes where no snapshot is held
        if self.replica_of_successor is not None:
            self.replica_of_successor.rewind()
        self.optimizer.zero_grad(set_to_none=True)

    def tree_vector(self) -> tuple[int, torch.dtype]:
        """Deterministic mode: the size and dtype of this worker's per-VN vector, the one its
        reduction over the replicas sums along the tree ``[gradients of tree_params | BatchNorm
        statistics ("mean") | loss (last piece)]``."""
        is_last = self.last in self.pieces
        with_bn = bool(self.bn_numel) and self.batchnorm == "mean"
        numel = sum(q.numel() for q in self.tree_params) + (self.bn_numel if with_bn else 0) + int(is_last)
        dtypes = [q.dtype for q in self.tree_params] + ([torch.float32] if with_bn or is_last else [])
        dtype = dtypes[0] if dtypes else torch.float32
        for d in dtypes[1:]:
            dtype = torch.promote_types(dtype, d)
        return numel, dtype

    @property
    def stats_numel(self) -> int:
        """Entries of a flush step's stats vector (:meth:`FlushStep.finish`): the same on every
        worker of the job."""
        return FlushStep.stats_numel(self.plan.virtual_nodes, self.loop)

    @property
    def first(self) -> int:
        return 0

    @property
    def last(self) -> int:
        return self.n_pieces - 1

    # ---- one action list --------------------------------------------------------------------
    def steps(self, first_step: int, n_steps: int,
              control: int | Callable[[], int] = 0) -> Generator[Request, Any, list[StepResult]]:
        """Run steps ``first_step .. first_step + n_steps - 1`` (flush schedules: one at a time;
        no-flush schedules: streamed as one action list). Yields requests; returns one
        :class:`StepResult` per step."""
        results = []
        if self.pipeline.flush:
            for t in range(first_step, first_step + n_steps):
                res = yield from self.timing.timed(self._flush_step(t, control if t == first_step else 0))
                results.append(res)
            return results
        return (yield from self._stream(first_step, n_steps, control))

    def vn_of(self, first_step: int, mb: int, m: int) -> tuple[int, int]:
        """(step, VN id) of micro-batch ``mb`` of an action list starting at ``first_step``."""
        return first_step + mb // m, self.assignment[self.replica][mb % m]

    def _run_actions(self, schedule: Schedule, first_step: int, mbs: dict, *, on_backward_done=None,
                     forward=None, backward=None, eager: bool = False) -> Generator[Request, Any, float]:
        """Run this worker's actions (:func:`~virtualflow.runtime.pipeline.executor.run_actions`);
        returns its compute seconds."""
        return (yield from run_actions(self, schedule, first_step, mbs, on_backward_done=on_backward_done,
                                       forward=forward, backward=backward, eager=eager))

    def spliced_forward(self, module: nn.Module, x: Any, entry: Eager) -> Any:
        """``module(x)`` with layers ``[reuse.lo, reuse.hi)`` taken from an eager forward."""
        h, spliced = spliced_forward(module, x, entry, self.reuse.lo, self.reuse.hi, self.device)
        self.reused_forwards += spliced
        return h

    _spliced_forward = spliced_forward  # the name the unit tests call

    # ---- flush schedules ----------------------------------------------------------------------
    def _flush_step(self, step: int, control: int | Callable[[], int]) -> Generator[Request, Any, StepResult]:
        """One step: forwards and backwards (the executor), the reduction over the replicas, tied
        weights, Bamboo's hand-over to the replica, then the stats all-reduce and the commit."""
        self.timing.begin()
        work = FlushStep(self, step)
        self.model.train()
        for bn in self.bn.values():
            if bn:
                bn.snapshot()
        if self.eager:
            self.replica_of_successor.begin_step()
        if self.reuse is not None and not any(key[0] == step for key in self.reuse.entries):
            self.reuse = None
        self.update.begin_step(self.replica, self.replicas)  # (sharded: the chunks cut by this layout)
        if self.replica_of_successor is not None:
            self.replica_of_successor.begin_update(self.replica, self.replicas)
        self.phase = "compute"
        work.compute_s = yield from self._run_actions(work.schedule, step, work.mbs, forward=work.forward,
                                                      backward=work.backward, eager=self.eager,
                                                      on_backward_done=work.backward_done)
        self.reuse = None
        self.phase = "reduction"
        yield from self.tied_sum.before(self.replica)  # (deterministic mode: summed in work.reduce())
        bn_new, loss_total = yield from work.reduce()
        yield from self.tied_sum.after(self.replica)
        work.check_grads()  # unscale (16-mixed), and this worker's part of the norm and verdict
        if self.replica_of_successor is not None:
            # Bamboo: hand the predecessor what it needs to take this stage's step on its replica
            # (reduced gradients, BatchNorm statistics, buffers) before the step commits, so a
            # replica is never behind a committed step.
            work.replica_update = yield from hand_over(
                step, self.stage_rank, self.p, self.replica_of_successor.stage_rank, self.update.handed_grads(), bn_new,
                list(self.model.buffers()), self.device)
        return (yield from work.finish(control, bn_new, loss_total))

    # ---- no-flush schedules (2BW, asynchronous PipeDream) ---------------------------------------
    def _snapshot(self, k: int) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone().requires_grad_(t.requires_grad)
                for name, t in self.pieces[k].named_parameters()}

    def load_prev_version(self, versions: dict[int, dict[str, torch.Tensor]]) -> None:
        """Adopt another worker's older weight version (2BW state moved to a newcomer)."""
        out = {}
        for k, v in versions.items():
            params = dict(self.pieces[int(k)].named_parameters())
            out[int(k)] = {n: t.detach().clone().requires_grad_(params[n].requires_grad) for n, t in v.items()}
        self.prev_version = out

    def _stream(self, first_step: int, n_steps: int,
                control: int | Callable[[], int]) -> Generator[Request, Any, list[StepResult]]:
        window = StreamWindow(self, first_step, n_steps, self._snapshot)
        self.phase = "compute"
        compute_s = yield from self._run_actions(window.schedule, first_step, window.mbs, forward=window.forward,
                                                 backward=window.backward, on_backward_done=window.on_backward_done)
        self.prev_version = window.older_version()
        results = yield from window.finish(control, compute_s)
        self.phase = "idle"
        return results


def check_reduction(reduction: str) -> None:
    """``reduction`` is one a stage knows."""
    if reduction not in ("allreduce", "sharded"):
        raise ValueError(f"reduction={reduction!r} is not known; choose 'allreduce' or 'sharded' (--reduction)")


def check_tied(tied: Sequence[TiedCopy], pipeline: Pipeline) -> None:
    """Weights shared across workers are summed before every update: a flush schedule only."""
    check("tied+no_flush", tied=bool(tied), flush=pipeline.flush, schedule=pipeline.schedule)


def check_streamed_batchnorm(pipeline: Pipeline, bn_numel: int) -> None:
    """BatchNorm's per-step statistics are exact with a flush schedule only."""
    check("no_flush+batchnorm_stage", flush=pipeline.flush, batchnorm=bool(bn_numel), schedule=pipeline.schedule)
