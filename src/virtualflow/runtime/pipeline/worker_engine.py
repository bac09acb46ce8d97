"""A pipelined job inside a worker process: the engine the worker's generation loop
(:mod:`runtime.worker`) runs for a job with a pipeline.

Layout. Generation rank ``r`` is stage-rank ``r % p`` of pipeline replica ``r // p``; a
generation's size must be a multiple of ``p`` (whole pipelines). Activations and gradients move
point to point over the generation's group; each stage-rank's replicas reduce their gradients
over their own group (``gen/<g>/stage<s>``); one small all-reduce over the whole group per step
carries losses, bad VNs and the control position. A resize adds or removes whole replicas: a
survivor keeps its stage-rank (members keep their order), a newcomer receives its stage's state
(pieces, optimizer, scheduler, 2BW's older weights) from a member of the same stage that reached
the step. A failure leaves the job its whole replicas (see ``control/membership.py``); with
Bamboo's redundancy the hit replica fails over instead, one worker shorter (:meth:`_relayout`:
replicas may then differ in depth, and a worker running several job stages joins each stage's
group).

Every worker builds the whole model once from the job's seed (so all pieces start from the
unpipelined model's initial weights) and keeps the layers of its stage-rank for training; rank 0
also keeps the whole model to assemble checkpoints, the final state and evaluation, gathered
from the first replica's stages (:meth:`PipelineWorkerEngine.gather_state`, a collective).

The process driver (:func:`drive`, the wire format) lives in :mod:`virtualflow.runtime.pipeline.links`;
this module is the engine: adopting generations (resizes, Bamboo failovers and reconfigurations)
and the worker's :class:`~virtualflow.runtime.engines.Engine` protocol. Tensor parallelism is one
object chosen at construction (:mod:`~virtualflow.runtime.pipeline.tensor_stage`); building a
stage is :mod:`~virtualflow.runtime.pipeline.layout`'s, moving and gathering stage state
:mod:`~virtualflow.runtime.pipeline.stage_state`'s.

Checkpoints with ``checkpoint_format="dcp"`` are written without a gather: every member writes
its share of its stage (:meth:`PipelineWorkerEngine.sharded_parts`; with tensor parallelism its
shards), laid out so that the checkpoint reads back as ``gather_state``'s (one optimizer state per
job stage, the single-worker layout of every tensor). After a Bamboo failover (replicas of unequal
depth) a checkpoint is gathered and written as one file instead. A checkpoint of any grid resumes
(:meth:`PipelineWorkerEngine.resume_from`): a state of other stages, another split or no pipeline
is cut again by parameter name (:func:`virtualflow.runtime.regrid.restage`), and each worker takes
its tensor rank's shards of the whole tensors.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.pipeline.geometry import Grid, check_workers, layers_of, resolve_bounds
from virtualflow.config.pipeline import Pipeline
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.replica_shares import replica_blocks
from virtualflow.runtime.dcp import Piece
from virtualflow.runtime.engine import StepOutcome
from virtualflow.runtime.streaming import data_plan_of
from virtualflow.runtime.engines import Boundary, Joining
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.layout import StageBuilder, check_relayout, held_states, stages_held
from virtualflow.runtime.pipeline.stage_state import exchange_for_layout, whole_state
from virtualflow.runtime.pipeline.links import Links, StageExchanges, drive, exchange_choice
from virtualflow.runtime.pipeline.flush import FlushStep
from virtualflow.runtime.pipeline.loop import StageLoop, model_norm_blocks
from virtualflow.runtime.pipeline.tensor_stage import TensorStage, tensor_stage
from virtualflow.runtime.pipeline.timing import write_timeline
from virtualflow.runtime.pipeline.redundancy import RedundantTotals
from virtualflow.runtime.pipeline.settle import InterruptedCommit
from virtualflow.runtime.pipeline.stage_shard import gather_stage_optimizer, optimizer_bytes
from virtualflow.runtime.pipeline.shard_failover import make_stages_whole
from virtualflow.runtime.regrid import optimizer_names, restage
from virtualflow.runtime.sharded import ShardLost

class PipelineWorkerEngine:
    """The worker's engine for a pipelined job: the :class:`~virtualflow.runtime.engines.Engine`
    of a job with a ``Pipeline`` (the VN engine's counterpart, :mod:`virtualflow.runtime.vn_worker`).

    It holds the generation's state (its groups, the layout, the stage) that an adoption (a
    resize, a Bamboo failover or reconfiguration), a step and the protocol's state methods read
    and change together; it delegates the rest: tensor parallelism to a :class:`TensorStage`,
    building a stage to a :class:`StageBuilder` (:mod:`.layout`), moving and gathering stage state
    to :mod:`.stage_state`, the interrupted step to :class:`InterruptedCommit`, the wire to
    :func:`~.links.drive`."""

    def __init__(self, job: Any, dataset: Any, options: WorkerOptions, *, device: torch.device,
                 subgroup: Callable[..., Group], eager_every_wait: bool = False) -> None:
        """``options``: the job's worker knobs, whole. Its ``deterministic_exchange``: how
        deterministic mode's per-stage reduction over the replicas runs (:class:`~.links.StageExchanges`);
        ``reduction="sharded"`` shards each stage's optimizer state over its replicas
        (:mod:`~virtualflow.runtime.pipeline.stage_shard`). ``subgroup(generation, name, rank, size,
        duplex=...)``: a group of the generation's workers."""
        self.job = job
        self.reduction = options.reduction
        self.deterministic_exchange = options.deterministic_exchange
        self.exchanges = StageExchanges(self.deterministic_exchange)  # (checks the knob's value now)
        """This generation's per-stage exchanges: which one each stage group runs, and why."""
        self.pipeline: Pipeline = job.pipeline
        self.deterministic = options.deterministic
        self.device = device
        self.subgroup = subgroup
        torch.manual_seed(job.seed)
        self.model: torch.nn.Module | None = job.model().to(device)
        """The whole model: built once from the seed so every piece starts from the unpipelined
        model's weights, dropped once this worker's pieces are cut from it (only they stay in
        memory); rebuilt on rank 0 when a checkpoint, an evaluation or the final state needs it."""
        self.layers: list[torch.nn.Module] | None = layers_of(self.model)
        self.bounds = resolve_bounds(self.pipeline, len(self.layers))
        self.norm_blocks = model_norm_blocks(self.layers, self.pipeline.tensor)[0] if job.max_grad_norm is not None \
            else None
        """The gradient norm's blocks (the stats' size before this worker has a stage)."""
        self.plan = data_plan_of(dataset, job)
        self.stage: StageEngine | None = None
        self.group: Group | None = None
        self.stage_group: Group | None = None
        self.stage_groups: dict[int, Group] = {}
        """Per job stage this worker runs, the group of the workers running it in every replica
        (``stage_group`` is the first; more than one after a Bamboo failover)."""
        self.grid: Grid | None = None
        self.tensor: TensorStage = tensor_stage(self.pipeline, self.bounds, device, subgroup=subgroup,
                                                build_optimizer=job.build_optimizer)
        """The stages' tensor parallelism (:mod:`~virtualflow.runtime.pipeline.tensor_stage`): its
        groups, shards and state merge; ``self.group`` is the group it gives the pipeline (a plane)."""
        self.builder = StageBuilder(job, dataset, self.plan, self.deterministic, device, eager_every_wait, options.breakdown,
                                    options.loader_workers)
        """Builds this worker's stage engine (:mod:`~virtualflow.runtime.pipeline.layout`)."""
        self.phase = "idle"
        self.slowdown = 1.0
        self.generation_broken = None
        self.total_steps: int | None = None
        self._results: dict[int, StepOutcome] = {}
        self._broken_window = False
        self.resume_state: dict[str, Any] | None = None
        """A state (checkpoint) to start from: loaded when the worker learns its stage."""
        self._fault: Callable[[int, str], None] | None = None
        self.full_bounds = self.bounds
        """Layer ranges of the job's own stages (``self.bounds`` are those of the current layout)."""
        self.layout: tuple[tuple[int, ...], ...] | None = None
        """After a Bamboo failover: the job stages each member runs (None: one per member)."""
        self.group_rank = 0
        self.interrupted = InterruptedCommit()
        """A step interrupted in its stats all-reduce (see :meth:`settle_commit`)."""
        self._relaid = -1
        self.relayout_bytes = 0
        """Bytes moved between the members in the last re-layout (a failover or a reconfiguration)."""
        self.timeline_dir: str | None = None
        """Where recorded timelines go (``Pipeline.record_timeline``); set by the worker."""
        self._due: tuple[bool, bool] = (False, False)
        """A checkpoint / an evaluation fell due inside a no-flush window (done at its end)."""
        self.redundant_totals = RedundantTotals()
        """Eager redundant forwards of the engines this worker dropped at re-layouts."""

    def redundant_forwards(self) -> dict[str, float]:
        """Eager redundant forwards of this worker over the whole run (``Result.redundant_forwards``)."""
        return self.redundant_totals.report(self.stage)

    @property
    def exchange_choice(self) -> tuple[str, str] | None:
        """Deterministic mode: the exchange this worker's stage group runs over the replicas in
        this generation, and why (:func:`~.links.exchange_choice`). ``None`` otherwise."""
        if self.grid is None:
            return None
        # (``None`` outside deterministic mode too: only then does a stage have a tree)
        return exchange_choice(self.exchanges, self.stage, self.grid.stage_rank)

    @property
    def optimizer(self):
        return self.stage.optimizer if self.stage is not None else None

    @property
    def scheduler(self):
        return self.stage.scheduler if self.stage is not None else None

    def install_fault_point(self, fn) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point of a step (runtime/faults.py)."""
        self._fault = fn

    def set_membership(self, group: Group, assignment: Any, layout: list[list[int]] | None = None,
                       steps: list[int] | None = None, target: int | None = None) -> None:
        if self._broken_window:
            raise RuntimeError(
                f"a failure interrupted a {self.pipeline.schedule} window after some stages had applied its updates; "
                f"a no-flush pipeline cannot redo it consistently. Use a flush schedule (1f1b, ...) for a job that "
                f"must survive failures, or a shorter Pipeline.window"
            )
        if steps is not None and target is not None:
            steps = self.settle_commit(group, steps, target)
        if layout is not None:  # Bamboo: a failover or a reconfiguration (one pipeline replica)
            self._relayout(group, layout, steps, target, assignment)
            return
        if self.layout is not None:
            raise RuntimeError("a failed-over pipeline changes its membership only through a layout")
        d = check_workers(self.pipeline, group.size)
        group = self.tensor.join(group)  # the group the pipeline engine runs on (a plane: tensor parallel)
        grid = Grid(self.pipeline.stages, d, group.rank)
        if self.stage is None:
            build = lambda: self.builder.stage(self.pipeline, self.layers, self.bounds, grid.stage_rank,  # noqa: E731
                                               self.tensor, self.reduction)
            self.stage = self.tensor.build(build, self.model, self.resume_state, grid.stage_rank)
            self.resume_state = None
            self.model, self.layers = None, None  # keep only this worker's pieces
        elif self.stage.stage_rank != grid.stage_rank:
            raise RuntimeError(
                f"worker moved from stage-rank {self.stage.stage_rank} to {grid.stage_rank}; a pipelined job "
                f"resizes in whole pipeline replicas and its survivors keep their stage"
            )
        # The replicas' VN blocks from the generation's map (shares weighted by speed, or equal).
        self._adopt(group, grid, replica_blocks(assignment, [self.pipeline.replica_workers] * d, self.job.virtual_nodes))

    def _adopt(self, group: Group, grid: Grid, assignment: list[list[int]],
               job_stages: tuple[int, ...] | None = None) -> None:
        """Join the generation: its groups (one per job stage this worker runs, ``job_stages``; by
        default its stage-rank's), its place in its replica, the replicas' VNs."""
        self._close_stage_groups()
        names = job_stages if job_stages is not None else (grid.stage_rank,)
        # In increasing stage order on every worker, so building them cannot deadlock.
        self.stage_groups = {s: self.subgroup(group.generation, self.tensor.stage_group_name(s), grid.replica,
                                              grid.replicas)
                             for s in sorted(names)}
        self.tensor.bind(self.stage)
        for g in self.stage_groups.values():  # broken with its generation: its waits end on the abort flag too
            g.abort_check = group.abort_check
        self.stage_group = self.stage_groups[min(names)]
        self.stage.set_layout(grid.replica, assignment)
        self.stage.set_breakdown_slot(group.rank, group.size)
        self.stage.slowdown = self.slowdown
        self.stage.fault_point = None
        self.group, self.grid = group, grid
        self.links = Links()  # a new generation: new peers, no shared history
        self.exchanges = StageExchanges(self.deterministic_exchange)
        self._results = {}

    def _close_stage_groups(self) -> None:
        for g in self.stage_groups.values():
            if g.pg is not None:  # (bounded: a streamed step a failure ended may leave a send to a lost peer)
                g.close_soon()
        self.stage_groups = {}
        self.stage_group = None

    # ---- Bamboo: failover and reconfiguration ---------------------------------------------------
    def _relayout(self, group: Group, layout: list[list[int]], steps: list[int] | None, target: int | None,
                  assignment: Any = None) -> None:
        """Adopt a Bamboo layout (one run of stages per member, pipeline replica after replica;
        a replica starts at the run holding stage 0): every member ends up with the state of its
        own stages and a replica of its successor's in its replica, taken from its own pieces,
        its replica, or (a broadcast) from a member holding them. With several replicas, each
        job stage is reduced over the workers running it, one per replica, in replica order
        (:meth:`StageEngine.set_job_stages`). Collective."""
        p = self.pipeline.stages
        group = self.tensor.join(group)  # tensor parallel: each plane re-lays its pipeline (one run per group)
        layout = self.tensor.plane_layout(layout)
        layouts, new = check_relayout(layout, self.pipeline, group.size, steps, target)
        chunk_bytes = make_stages_whole(self.stage, group, p, self.device)  # (sharded stages: whole again)
        own_old, rep_old = stages_held(self.stage, self.layout, p, self.group_rank)
        old_replica = self.redundant_totals.add(self.stage)  # the engine this re-layout drops
        local = held_states(self.stage, own_old, rep_old, self.full_bounds)
        got, self.relayout_bytes = exchange_for_layout(group, new, p, own_old, rep_old, local, self.device)
        self.relayout_bytes += chunk_bytes
        # Build this worker's pieces from the whole model's layers, loaded with the stages' states.
        grid = Grid(p, len(layouts), group.rank, sizes=tuple(len(rep) for rep in layouts))
        runs, pos = layouts[grid.replica], grid.stage_rank
        self.layout = new
        self.group_rank = group.rank
        if self.stage is not None:
            self.stage.close()  # its loader threads (the re-laid engine has its own)
        self.stage, self.bounds = self.builder.relaid(self.pipeline, self.full_bounds, runs, pos, got, old_replica,
                                                      by_job_stage=len(layouts) > 1, tensor=self.tensor)
        self.model, self.layers = None, None
        self._relaid = group.generation
        if all(len(run) == 1 for run in new):
            self.layout = None  # full depth again: the standard layout from here on
            grid = Grid(p, len(layouts), group.rank)
        self._adopt(group, grid, replica_blocks(assignment, [len(rep) for rep in layouts], self.job.virtual_nodes),
                    job_stages=runs[pos])

    # ---- the worker's Engine protocol (runtime/engines.py) ---------------------------------------
    def resume_from(self, state: dict[str, Any]) -> None:
        saved = state.get("pipeline") or {}
        if [list(b) for b in saved.get("bounds", [])] != [list(b) for b in self.full_bounds]:
            # a checkpoint of other stages, another split or no pipeline: cut again by name
            whole_names = optimizer_names(self.job.build_optimizer(self.model), self.model)
            state = restage(state, whole_names, self.full_bounds, self.pipeline.stages)
        self.resume_state = state  # loaded into the stage once its place is known

    def prepare_to_join(self) -> None:
        pass  # a newcomer's stage is built once its place is known

    def check_state_held(self, run_dir: str) -> None:
        # What a failed member held comes back from its stage's survivors (or a replica), except a chunk
        # of a sharded stage optimizer without Bamboo's replica (one copy): ShardLost, naming the way out.
        shard = self.stage.shard if self.stage is not None and self.stage.replica_of_successor is None else None
        if shard is not None and shard.opt.full is None and shard.opt.size > 1:
            try:
                shard.opt.check_held()
            except ShardLost as exc:
                raise ShardLost(f"{exc} (this run's directory: {run_dir})") from None

    def adopt(self, joining: Joining) -> tuple[int, float]:
        record, group = joining.record, joining.group
        moved, t_transfer = 0, 0.0
        self.plan.set_vn_sizes(record.vn_sizes)
        self.set_membership(group, record.assignment, layout=record.layout, steps=joining.steps,
                            target=joining.target)
        if record.layout is not None:
            moved = self.relayout_bytes  # what the re-layout moved between the members
        if joining.behind:
            joining.transferring = True
            t1 = time.perf_counter()
            moved += self.transfer(group, joining.steps, joining.target)
            t_transfer = time.perf_counter() - t1
            joining.transferring = False
        return moved, t_transfer

    def before_regroup(self, successor: Any = None) -> None:
        # Each member keeps its stage's state; a sharded stage optimizer is gathered whole on every
        # replica now, while the old stage group works (the next generation cuts it again).
        gather_stage_optimizer(self.stage, self.stage_group)  # (nothing to do for a whole one)

    def whole_state(self, group: Group) -> dict[str, Any] | None:
        return self.gather_state(group)

    def boundary(self, group: Group, step: int, work: Boundary) -> None:
        """Checkpoint and evaluation of a pipelined job: every member takes part in the gather."""
        ck, ev = work.checkpoint_due(step), work.eval_due(step)
        # A no-flush schedule has computed its whole window already: what falls due inside a
        # window is done at the window's end, where the state is that of a step boundary.
        self._due = (self._due[0] or ck, self._due[1] or ev)
        if self.mid_window:
            return
        ck, ev = self._due
        self._due = (False, False)
        if ck and work.dcp and self.layout is None:  # every member writes its stage's share: no gather
            t_ck = time.perf_counter()
            gather_stage_optimizer(self.stage, self.stage_group)  # a sharded stage optimizer's: gathered first
            pieces, meta = self.sharded_parts(group)
            path = work.save_sharded(group, step, pieces, meta)
            if group.rank == 0:
                work.checkpointed(step, path, t_ck)
            ck = False
        if not (ck or ev):
            return
        t_ck = time.perf_counter()
        state = work.whole_state(self, group, step)
        if state is None:
            return
        if ck:
            work.checkpointed(step, work.save_checkpoint(step, state, prune=False), t_ck)
        if ev:
            work.evaluate(self.model, step)
        self.model = None  # the whole model was rebuilt on rank 0 for this; only pieces stay

    def sharded_parts(self, group: Group) -> tuple[list[Piece], dict[str, Any] | None]:
        """This worker's part of a sharded checkpoint (:meth:`TensorStage.sharded_parts`). Local."""
        return self.tensor.sharded_parts(self.stage, group.rank, group.size)

    def boundary_on_rank0(self, step: int, work: Boundary) -> None:
        pass  # its checkpoints and evaluations are collectives: :meth:`boundary`

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        work.drain()  # a held job may be stopped: its sharded save in flight completes first
        state = work.whole_state(self, group, step)  # rank 0 gathers the stages
        return work.save_checkpoint(step, state, prune=False) if group.rank == 0 else None

    def learning_rate(self) -> float | None:
        optimizer = self.optimizer  # this worker's stage's (every stage's follows the same schedule)
        groups = optimizer.param_groups if optimizer is not None else None
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None

    def non_finite_note(self, step: int, path: str) -> str:
        if not self.pipeline.flush:
            return (f"the {self.pipeline.schedule} schedule streams steps without a flush, so the updates of its "
                    f"window were applied; the state after them is in {path}")
        return f"the step was not applied and the last good state (before step {step}) is in {path}"

    def final_report(self) -> dict[str, Any]:
        replica = self.stage.replica_of_successor if self.stage is not None else None
        return {"optimizer_bytes": optimizer_bytes(self.stage), "replica_bytes": replica.nbytes() if replica else 0,
                "replica_refresh_s": replica.refresh_s if replica else 0.0,
                "redundant_forwards": self.redundant_forwards()}

    def state_bytes(self) -> int | None:
        return None  # spread over the stages: not told

    def close(self) -> None:
        # The tensor-parallel groups stay: the final state is gathered after this (a daemon thread).
        if self.stage is not None:
            self.stage.close()  # its loader threads, if any

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        if step in self._results:
            return self._results.pop(step)
        n = 1
        if not self.pipeline.flush:
            end = self.total_steps if self.total_steps is not None else step + self.pipeline.window
            n = max(1, min(self.pipeline.window, end - step))
        self.stage.slowdown = self.slowdown
        control = self.tensor.agree_control(control)
        fault = self._fault
        if fault is not None:
            fault(step, "before_forward")
            self.stage.fault_point = lambda phase: fault(step, phase)
        self.phase = "compute"
        results = drive(self.stage.steps(step, n, control), group=self.group, stage_group=self.stage_group,
                        grid=self.grid, n_pieces=len(self.bounds), device=self.device, links=self.links,
                        stage_groups=self.stage_groups, exchanges=self.exchanges)
        self.phase = "idle"
        if self.stage.timeline:
            write_timeline(self.stage.timeline, self.timeline_dir, self.tensor.generation_rank(self.group),
                           self.grid.replica, self.grid.stage_rank, self.group.generation)
        out = {r.step: StepOutcome(r.loss, r.bad_vns, r.control, None, self.tensor.generation_rows(r.breakdown_raw),
                                   metrics=r.metrics, grad_norm=r.grad_norm, skipped=r.skipped,
                                   loss_scale=r.loss_scale) for r in results}
        first = out.pop(step)
        self._results = out
        return first

    @property
    def mid_window(self) -> bool:
        """True between the steps of a no-flush window (its later steps are already computed)."""
        return bool(self._results)

    def abandon_step(self) -> None:
        if self.stage is not None and not self.pipeline.flush:
            # Some stages may have applied updates of the interrupted window already: the window
            # cannot be redone consistently.
            self._broken_window = True
        self.interrupted.keep(self.stage)
        self._close_stage_groups()
        self.tensor.leave()
        self.group = None
        self._results = {}
        self.phase = "idle"

    def settle_commit(self, group: Group, steps: list[int], target: int) -> list[int]:
        """Members that missed the interrupted step's stats finish it from a member that completed
        it (:func:`~.settle.settle_commit`); returns the steps after settling. Collective."""
        return self.interrupted.settle(group, steps, target, self.stage, self._stats_numel, self.device)

    def _stats_numel(self) -> int:
        """A flush step's stats entries (a newcomer has no stage yet: from the job)."""
        if self.stage is not None:
            return self.stage.stats_numel
        return FlushStep.stats_numel(self.job.virtual_nodes, StageLoop(max_grad_norm=self.job.max_grad_norm,
                                                                       blocks=self.norm_blocks))

    # ---- state (the moving parts: runtime/pipeline/stage_state.py) ------------------------------------
    def transfer(self, group: Group, steps: list[int], target: int) -> int:
        """Bring every worker to step ``target``: each stage's state goes from a member of that
        stage that reached it to the members of that stage behind (:func:`transfer_stages`).
        ``steps[r]`` is rank ``r``'s step. Collective."""
        if self._relaid == group.generation:
            return 0  # the re-layout moved every stage a member needed
        steps = self.interrupted.steps_of(group.generation, steps)
        return self.tensor.transfer(self.stage, group, steps, target)

    def gather_state(self, group: Group) -> dict[str, Any] | None:
        """Collective: rank 0 gets the whole model's state (also loaded into ``self.model``, rebuilt
        from the job if needed) and every stage's
        optimizer and scheduler state; others get ``None``. After a failover, members running
        several stages send each stage's state apart, so the layout is that of the job's stages."""
        gather_stage_optimizer(self.stage, self.stage_group, root=0)  # a sharded stage's, on replica 0
        stages = self.tensor.gather(self.stage, group, self.layout, self._whole_model)
        if stages is None:
            return None
        return whole_state(stages, self._whole_model(), self.pipeline, self.full_bounds)

    def _whole_model(self) -> torch.nn.Module:
        """The whole model (rank 0: for a checkpoint, an evaluation, the final state), built again
        from the job where this worker dropped it."""
        if self.model is None:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(self.job.seed)
                self.model = self.job.model().to(self.device)
        return self.model

