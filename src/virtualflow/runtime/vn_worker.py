"""The VN engine as a worker's :class:`~virtualflow.runtime.engines.Engine`.

:class:`VNWorkerEngine` wraps a :class:`~virtualflow.runtime.engine.VNEngine` (which runs steps
and knows nothing of generations' records, checkpoints or the worker's reports) and gives it the
worker-facing half: adopting a generation (a broadcast of the whole state to members behind, or
of the initial weights), the whole state for checkpoints, the step-boundary work and a held
generation's checkpoint, in both reduction modes.

Invariants. With the plain reduction every member holds the whole state, so checkpoints are
written by rank 0 alone after its step report; with the sharded reduction the optimizer state is
spread over the members, so assembling it is a collective every member enters at the same step
boundary, before rank 0's report. Checkpoints taken during training keep the newest
``keep_checkpoints`` (both modes); a held generation's checkpoint prunes only with the plain
reduction (as before this module existed). With ``checkpoint_format="dcp"`` no state is
assembled for a checkpoint in either mode: every member writes what it holds
(:meth:`VNWorkerEngine.sharded_parts`) at the same step boundary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.batch_change import adopt_changes, batch_of, changed
from virtualflow.runtime.engine import StepOutcome, VNEngine
from virtualflow.runtime.checkpoint import shared_names
from virtualflow.runtime.dcp import Piece, model_pieces
from virtualflow.runtime.streaming import loader_of
from virtualflow.runtime.engines import Boundary, Joining, Successor
from virtualflow.runtime.fsdp import FsdpKnobs
from virtualflow.runtime.fsdp.update import FsdpUpdate
from virtualflow.runtime.fsdp.worker_state import ShardedModelState
from virtualflow.runtime.model_prep import prepare_model
from virtualflow.runtime.regrid import optimizer_names, unstage
from virtualflow.runtime.step.update import materialize_state
from virtualflow.runtime.transfer import Progress, broadcast_state

if TYPE_CHECKING:
    from virtualflow.config.job import Job
    from virtualflow.runtime.worker_config import WorkerConfig

__all__ = ["VNWorkerEngine", "broadcast_module", "full_state", "load_full_state", "materialize_optimizer_state"]


def broadcast_module(module: torch.nn.Module, group: Group, src: int = 0) -> None:
    """Make every worker's parameters and buffers bit-identical to ``src``'s."""
    if group.size == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            group.broadcast(flat, src)
            offset = 0
            for t in same:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def full_state(engine: VNEngine, progress: Progress) -> dict[str, Any]:
    """What a state transfer moves: model, optimizer and scheduler state, and the progress."""
    return {
        "model": engine.model.state_dict(),
        "optimizer": engine.update.state(),
        "lr_scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "grad_scaler": engine.finish.scaling.state_dict(),
        "step": progress.step,
        "control": progress.control,
    }


def load_full_state(engine: VNEngine, state: dict[str, Any]) -> None:
    """Load a transferred or checkpointed state (model, optimizer, scheduler) into ``engine``."""
    engine.model.load_state_dict(state["model"])
    engine.update.load_state(state["optimizer"])
    if engine.scheduler is not None and state.get("lr_scheduler") is not None:
        engine.scheduler.load_state_dict(state["lr_scheduler"])
    engine.finish.scaling.load_entries(state)


def materialize_optimizer_state(engine: VNEngine) -> None:
    """:func:`~virtualflow.runtime.step.update.materialize_state` of ``engine``'s optimizer."""
    materialize_state(engine.optimizer)


class VNWorkerEngine:
    """A :class:`VNEngine` behind the worker's :class:`~virtualflow.runtime.engines.Engine` protocol."""

    def __init__(self, vn: VNEngine) -> None:
        self.vn = vn
        self.run_dir: str | None = None
        """Where this run's states go (named by a :class:`ShardLost` after a failure)."""
        self.checkpoints: RankZeroCheckpoints | CollectiveCheckpoints = (
            CollectiveCheckpoints(self) if vn.sharded else RankZeroCheckpoints(self))
        self.models: WholeModelState | ShardedModelState = (
            ShardedModelState(vn) if isinstance(vn.update, FsdpUpdate) else WholeModelState(vn))
        """How the model's state is read, written, moved and written to checkpoints (whole on every
        worker, or sharded parameters: :mod:`virtualflow.runtime.fsdp.worker_state`)."""
        """Who writes a ``.pt`` checkpoint, and when (the optimizer state is whole on every worker, or spread)."""
        self.batch = batch_of(vn.plan, vn.optimizer)
        """The run's batch: one, or ``Job.batch_schedule``'s changes at step boundaries
        (:mod:`virtualflow.runtime.batch_change`)."""

    @classmethod
    def build(cls, job: Job, dataset: Any, plan: DataPlan, cfg: WorkerConfig, device: torch.device) -> VNWorkerEngine:
        """The job's model (from ``torch.manual_seed(job.seed)``), optimizer, scheduler and engine,
        with the job's worker knobs (``cfg.options``)."""
        opts = cfg.options
        torch.manual_seed(job.seed)
        model = job.model().to(device)
        prepare_model(model, activation_checkpointing=job.activation_checkpointing, compile=job.compile)
        optimizer = job.build_optimizer(model)
        scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
        return cls(VNEngine(
            model, optimizer, scheduler, job.compute_loss, plan, loader_of(dataset, job.collate_fn, plan),
            seed=job.seed, batchnorm=job.batchnorm, deterministic=opts.deterministic, device=device,
            reduction=opts.reduction, loader_workers=opts.loader_workers, breakdown=opts.breakdown,
            precision=job.precision, max_grad_norm=job.max_grad_norm,
            loss_scale=dict(job.loss_scale) if job.loss_scale is not None else None,
            shard_replicas=opts.shard_replicas, deterministic_exchange=opts.deterministic_exchange,
            fsdp=FsdpKnobs.of(opts) if opts.reduction == "fsdp" else None,
        ))

    # -- the engine's attributes, the VN engine's own -------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.vn.model

    @property
    def slowdown(self) -> float:
        return self.vn.slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        self.vn.slowdown = value

    @property
    def phase(self) -> str:
        return self.vn.phase

    @property
    def exchange_choice(self) -> tuple[str, str] | None:
        """Deterministic mode: this generation's exchange and why (None otherwise)."""
        return self.vn.exchange_choice

    @property
    def generation_broken(self) -> Callable[[], bool] | None:
        return self.vn.generation_broken

    @generation_broken.setter
    def generation_broken(self, value: Callable[[], bool] | None) -> None:
        self.vn.generation_broken = value

    def install_fault_point(self, fn: Callable[[int, str], None]) -> None:
        self.vn.install_fault_point(fn)

    # -- before joining ---------------------------------------------------------------------------
    def resume_from(self, state: dict[str, Any]) -> None:
        self.batch.check_resume(state)  # the batch changes the checkpointed steps ran are the job's
        # a pipelined run's state (any stages, split or tensor degree): its optimizer as one, by name
        self.models.load(unstage(state, optimizer_names(self.vn.optimizer, self.vn.model)))

    def prepare_to_join(self) -> None:
        self.vn.update.prepare_to_join()  # (a sharded optimizer's chunks are cut when the generation forms)

    def check_state_held(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.vn.update.check_held(run_dir)  # sharded, after a failure: ShardLost, naming the way out

    # -- a generation -----------------------------------------------------------------------------
    def adopt(self, joining: Joining) -> tuple[int, float]:
        vn, group, record = self.vn, joining.group, joining.record
        moved, t_transfer = 0, 0.0
        # shard_replicas=1, after a failure: the whole state from the chunks and replicas the survivors hold
        vn.update.rebuild(group, joining.progress.step, self.run_dir)
        if joining.target == 0 and group.size > 1 and not joining.behind:
            self.models.identical_start(group)  # identical start whatever the factory does
        if joining.behind:
            joining.transferring = True
            t1 = time.perf_counter()
            moved = self.models.transfer(group, joining.src, joining.behind, joining.progress, joining.state_point)
            t_transfer = time.perf_counter() - t1
            joining.transferring = False
        if joining.behind:  # changes asked while the run went on reach the members behind
            self.batch = adopt_changes(self.batch, vn.plan, vn.optimizer, group, joining.src, joining.behind,
                                       joining.target, vn.device)
        vn.plan.set_vn_sizes(record.vn_sizes)
        vn.set_membership(group, self.batch.assignment(vn.plan, joining.target, group.size, record.assignment))
        return moved, t_transfer

    def change_batch(self, step: int, virtual_nodes: int, lr_rule: Any) -> None:
        """A batch change asked while the run goes on (a ``batch`` command every member read at the
        boundary before ``step``): ``virtual_nodes`` from ``step`` on, the rate by ``lr_rule``."""
        self.batch = changed(self.batch, self.vn.plan, self.vn.optimizer, step, virtual_nodes, lr_rule)

    @property
    def step_samples(self) -> int:
        """The global batch of the step last begun (what its step record counts)."""
        return self.vn.plan.global_batch_size

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        self.batch.before_step(self.vn, step)  # a batch schedule's change takes effect at this boundary
        return self.vn.step(step, control)

    def abandon_step(self) -> None:
        self.vn.abandon_step()

    @property
    def wants_successor(self) -> bool:
        """Sharded parameters: a planned change moves the shards by the next generation's members
        (the worker reads them for :meth:`before_regroup` only then)."""
        return isinstance(self.models, ShardedModelState)

    def before_regroup(self, successor: Successor | None = None) -> None:
        # sharded optimizer state: every member gathers it; sharded parameters: the shards move
        self.models.before_regroup(self.vn.group, successor)

    # -- the whole state and the boundary work ----------------------------------------------------
    def whole_state(self, group: Group) -> dict[str, Any] | None:
        vn = self.vn
        optimizer = vn.update.gather_state(vn.comm, vn.group, 0)  # sharded: a collective
        model = self.models.model_state(group)  # sharded parameters: a collective
        if group.rank != 0:
            return None
        return {"model": model, "optimizer": optimizer, **self.small_state()}

    def small_state(self) -> dict[str, Any]:
        """The whole state's parts besides the model and the optimizer state (every worker holds
        them alike): a state file has them beside the two, a sharded checkpoint in rank 0's
        ``meta.pt``."""
        vn = self.vn
        # 16-mixed: the loss scale and its growth counter resume too
        return {"lr_scheduler": vn.scheduler.state_dict() if vn.scheduler is not None else None,
                **vn.finish.scaling.checkpoint_entries(), **self.batch.state_entries()}

    def sharded_parts(self, group: Group) -> tuple[list[Piece], dict[str, Any] | None]:
        """This worker's part of a sharded checkpoint: its share of the model, the optimizer state
        it holds (sharded reduction: its chunk; all-reduce: an even share), and on rank 0 the rest
        of the state (optimizer hyperparameters, scheduler, scaler). Local: no collective."""
        pieces, meta = self.models.pieces(group.rank, group.size)
        return pieces, (None if meta is None else {**meta, **self.small_state()})

    def boundary(self, group: Group, step: int, work: Boundary) -> None:
        self.vn.update.raise_deferred()  # shard_replicas=1: the step is applied, its all-gather failed
        if work.eval_due(step):
            self.models.before_eval(group)  # sharded parameters: the model whole on rank 0
        if work.dcp:
            if work.checkpoint_due(step):  # every member writes its part
                t_ck = time.perf_counter()
                pieces, meta = self.sharded_parts(group)
                path = work.save_sharded(group, step, pieces, meta)
                if group.rank == 0:
                    work.checkpointed(step, path, t_ck)
            return
        self.checkpoints.at_boundary(group, step, work)

    def boundary_on_rank0(self, step: int, work: Boundary) -> None:
        if not work.dcp:
            self.checkpoints.on_rank0(step, work)
        if work.eval_due(step):
            work.evaluate(self.vn.model, step)

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        work.drain()  # a held job may be stopped: its sharded save in flight completes first
        return self.checkpoints.hold(group, step, work)

    def learning_rate(self) -> float | None:
        groups = self.vn.optimizer.param_groups  # (a batch schedule's multiplier of the next step applied)
        return self.batch.rate(float(groups[0]["lr"])) if groups and "lr" in groups[0] else None

    def non_finite_note(self, step: int, path: str) -> str:
        return f"the step was not applied and the last good state (before step {step}) is in {path}"

    def final_report(self) -> dict[str, Any]:
        return {"optimizer_bytes": self.vn.update.state_bytes(), "replica_bytes": self.vn.update.replica_bytes(),
                "replica_refresh_s": 0.0, "redundant_forwards": {}}

    def state_bytes(self) -> int | None:
        return self.models.model_bytes() + self.vn.update.state_bytes()

    def close(self) -> None:
        self.vn.close()  # its loader threads, if any


class WholeModelState:
    """Every worker holds the whole model (the plain and the sharded-optimizer reductions)."""

    def __init__(self, vn: VNEngine) -> None:
        self.vn = vn

    def identical_start(self, group: Group) -> None:
        broadcast_module(self.vn.model, group)

    def model_state(self, group: Group | None) -> dict[str, torch.Tensor] | None:
        if group is not None and group.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.vn.model.state_dict().items()}

    def load(self, state: dict[str, Any]) -> None:
        load_full_state(self.vn, state)

    def transfer(self, group: Group, src: int, behind: list[int], progress: Progress,
                 on_started: Callable[[], None] | None = None) -> int:
        """The whole state from ``src`` to the members ``behind``; returns the bytes received."""
        vn = self.vn
        mine = full_state(vn, progress) if group.rank == src else None
        # A newcomer's own tensors hold nothing of value: receive into them. A survivor one
        # step behind keeps its state intact until the transfer is through (if the source
        # dies mid-way, that state may be the best one left).
        into = full_state(vn, progress) if progress.step < 0 else None
        state, moved = broadcast_state(group, src, mine, vn.device, on_started=on_started, receivers=behind,
                                       into=into)
        if group.rank in behind:
            load_full_state(vn, state)
        return moved

    def before_regroup(self, group: Group | None, successor: Any = None) -> None:
        self.vn.before_regroup()  # sharded optimizer state: every member gathers it

    def before_eval(self, group: Group) -> None:
        pass

    def pieces(self, rank: int, size: int) -> tuple[list[Piece], dict[str, Any] | None]:
        vn = self.vn
        model = vn.model.state_dict()
        pieces = model_pieces(model, rank, size)
        more, rest = vn.update.checkpoint_pieces(rank, size)
        pieces += more
        if rank != 0:
            return pieces, None
        empty = {k: v.detach().cpu() for k, v in model.items() if not v.numel()}  # in no chunk: kept here
        return pieces, {"model": empty, "model_keys": list(model), "model_aliases": shared_names(model),
                        "optimizer": rest}

    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.vn.model.state_dict().values())


class RankZeroCheckpoints:
    """The plain reduction: every member holds the whole state, so rank 0 writes a ``.pt``
    checkpoint alone, after its step report; a held generation's checkpoint prunes."""

    def __init__(self, engine: VNWorkerEngine) -> None:
        self.engine = engine

    def at_boundary(self, group: Group, step: int, work: Boundary) -> None:
        pass  # rank 0's, after its report (on_rank0)

    def on_rank0(self, step: int, work: Boundary) -> None:
        if work.checkpoint_due(step):
            t_ck = time.perf_counter()
            state = work.whole_state(self.engine, self.engine.vn.group, step)
            work.checkpointed(step, work.save_checkpoint(step, state, prune=True), t_ck)

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        if group.rank != 0:
            return None
        return work.save_checkpoint(step, work.whole_state(self.engine, group, step), prune=True)


class CollectiveCheckpoints:
    """The sharded reduction: the optimizer state is spread over the members, so assembling it for
    a ``.pt`` checkpoint is a collective every member enters at the same step boundary, before
    rank 0's report; a held generation's checkpoint does not prune."""

    def __init__(self, engine: VNWorkerEngine) -> None:
        self.engine = engine

    def at_boundary(self, group: Group, step: int, work: Boundary) -> None:
        if not work.checkpoint_due(step):
            return
        t_ck = time.perf_counter()  # every member takes part in gathering the optimizer state
        state = work.whole_state(self.engine, group, step)
        if state is not None:
            work.checkpointed(step, work.save_checkpoint(step, state, prune=True), t_ck)

    def on_rank0(self, step: int, work: Boundary) -> None:
        pass  # written at the boundary, by every member together

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        self.engine.before_regroup()  # the next generation cuts the optimizer state again
        state = work.whole_state(self.engine, group, step)  # rank 0 gathers the optimizer's chunks
        return work.save_checkpoint(step, state, prune=False) if group.rank == 0 else None
