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
this module is the engine: adopting generations (resizes, Bamboo failovers and reconfigurations),
moving and gathering stage state, and the worker's :class:`~virtualflow.runtime.engines.Engine`
protocol.

Checkpoints with ``checkpoint_format="dcp"`` are written without a gather: every member writes
its share of its stage (:meth:`PipelineWorkerEngine.sharded_parts`), laid out so that the
checkpoint reads back as ``gather_state``'s (one optimizer state per job stage). After a Bamboo
failover (replicas of unequal depth) a checkpoint is gathered and written as one file instead.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

import torch

from virtualflow.comm.groups import Group
from virtualflow.plan.pipeline.geometry import Grid, check_workers, layers_of, resolve_bounds
from virtualflow.config.pipeline import Pipeline
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.replica_shares import replica_blocks
from virtualflow.runtime.checkpoint import shared_names
from virtualflow.runtime.dcp import Piece, model_pieces, optimizer_pieces
from virtualflow.runtime.engine import StepOutcome
from virtualflow.runtime.streaming import data_plan_of, loader_of
from virtualflow.runtime.engines import Boundary, Joining
from virtualflow.runtime.pipeline.engine import StageEngine
from virtualflow.runtime.pipeline.stage_state import (exchange_for_layout, gather_stages, load_merged, load_stage_state, resume_stage,
                                                 scaler_state, stage_state, stage_states, successor, transfer_stages)
from virtualflow.runtime.pipeline.links import Links, StageExchanges, drive
from virtualflow.runtime.pipeline.flush import FlushStep
from virtualflow.runtime.pipeline.loop import StageLoop, model_norm_blocks, stage_loop
from virtualflow.runtime.pipeline.tensor_grid import (TensorPlanes, convert_layers, merge_stage_states, rebind_comm,
                                                      shard_stage_state, whole_splits)
from virtualflow.runtime.pipeline.stage_shard import gather_stage_optimizer, optimizer_bytes
from virtualflow.runtime.sharded import ShardLost

class PipelineWorkerEngine:
    """The worker's engine for a pipelined job: the :class:`~virtualflow.runtime.engines.Engine`
    of a job with a ``Pipeline`` (the VN engine's counterpart, :mod:`virtualflow.runtime.vn_worker`).

    Why one class of about 470 lines: the stage, its groups, the layout and the interrupted
    step's commit (:meth:`settle_commit`) are one state that a generation's adoption (a resize, a
    Bamboo failover or reconfiguration), a step and the protocol's state methods all read and
    change together; the parts that need none of it (the wire driver, moving and gathering stage
    state) live in :mod:`~virtualflow.runtime.pipeline.links` and :mod:`~virtualflow.runtime.pipeline.stage_state`."""

    def __init__(self, job: Any, dataset: Any, options: WorkerOptions, *, device: torch.device,
                 subgroup: Callable[..., Group], eager_every_wait: bool = False) -> None:
        """``options``: the job's worker knobs, whole. Its ``deterministic_exchange``: how
        deterministic mode's per-stage reduction over the replicas runs (:class:`~.links.StageExchanges`);
        ``reduction="sharded"`` shards each stage's optimizer state over its replicas
        (:mod:`~virtualflow.runtime.pipeline.stage_shard`). ``subgroup(generation, name, rank, size,
        duplex=...)``: a group of the generation's workers."""
        self.job = job
        self.reduction = options.reduction
        self.breakdown = options.breakdown
        """Measure where each step's time goes, per stage (:mod:`~virtualflow.runtime.pipeline.timing`)."""
        self.deterministic_exchange = options.deterministic_exchange
        self.exchanges = StageExchanges(self.deterministic_exchange)  # (checks the knob's value now)
        """This generation's per-stage exchanges: which one each stage group runs, and why."""
        self.eager_every_wait = eager_every_wait
        """A diagnostic given by the process's entry point: :attr:`StageEngine.eager_every_wait`."""
        self.pipeline: Pipeline = job.pipeline
        self.dataset = dataset
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
        self._sharded_names: frozenset[str] = frozenset()
        """Tensor-parallel stages: whole-model names of the parameters that hold a shard."""
        self.planes: TensorPlanes | None = None
        """``Pipeline.tensor > 1``: this generation's plane and tensor-parallel groups
        (:mod:`~virtualflow.runtime.pipeline.tensor_grid`); ``self.group`` is then the plane's group."""
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
        self._pending: tuple[int, Callable[[torch.Tensor], Any]] | None = None
        """A step interrupted in its stats all-reduce (see :meth:`settle_commit`)."""
        self._settled: tuple[int, list[int]] | None = None
        self._relaid = -1
        self.relayout_bytes = 0
        """Bytes moved between the members in the last re-layout (a failover or a reconfiguration)."""
        self.timeline_dir: str | None = None
        """Where recorded timelines go (``Pipeline.record_timeline``); set by the worker."""
        self._due: tuple[bool, bool] = (False, False)
        """A checkpoint / an evaluation fell due inside a no-flush window (done at its end)."""
        self.redundant_totals = [0.0, 0, 0, 0, 0]
        """Eager redundant forwards of the engines this worker dropped at re-layouts: seconds,
        forwards run, forwards skipped (no idle slot), forwards a redone step reused, the most
        bytes one step's forwards kept."""

    def redundant_forwards(self) -> dict[str, float]:
        """Eager redundant forwards of this worker over the whole run (``Result.redundant_forwards``)."""
        s, n, skipped, reused, peak = self.redundant_totals
        replica = self.stage.replica_of_successor if self.stage is not None else None
        if replica is not None:
            s, n, skipped = s + replica.forward_s, n + replica.forwards, skipped + replica.skipped
            peak = max(peak, replica.peak_kept_bytes)
        if self.stage is not None:
            reused += self.stage.reused_forwards
        return {"seconds": s, "forwards": n, "skipped": skipped, "reused": reused, "peak_bytes": peak}

    @property
    def exchange_choice(self) -> tuple[str, str] | None:
        """Deterministic mode: the exchange this worker's stage group runs over the replicas in
        this generation, and why (:class:`~.links.StageExchanges`; each stage chooses for its own
        vector, so rank 0 reports its stage's). ``None`` otherwise."""
        stage = self.stage
        if not self.deterministic or stage is None or stage.tree is None or self.grid is None:
            return None
        numel, dtype = stage.tree_vector()
        like = torch.empty(numel, dtype=dtype, device="meta")
        if stage.job_stages is None:
            name = self.exchanges.choose(None, stage.tree, like)
            return name, f"stage {self.grid.stage_rank}: {self.exchanges.choices[None][1]}"
        names, reasons = [], []  # Bamboo: one reduction per job stage this worker runs
        is_last = stage.last in stage.pieces
        with_bn = bool(stage.bn_numel) and stage.batchnorm == "mean"
        for s, idx in stage.reducer.stage_slices(True, with_bn, is_last):
            names.append(self.exchanges.choose(s, stage.tree, like[: idx.numel()]))
            reasons.append(f"job stage {s}: {self.exchanges.choices[s][1]}")
        return "/".join(dict.fromkeys(names)), "; ".join(reasons)

    @property
    def optimizer(self):
        return self.stage.optimizer if self.stage is not None else None

    @property
    def scheduler(self):
        return self.stage.scheduler if self.stage is not None else None

    def install_fault_point(self, fn) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point of a step (runtime/faults.py)."""
        self._fault = fn

    def _build_stage(self, stage_rank: int) -> None:
        from virtualflow.plan.pipeline.geometry import piece_module, successor_pieces, tied_for_worker

        p = self.pipeline.stages
        layers = self.layers
        if self.planes is not None:  # tensor parallel: this worker's shard of each of its layers
            self._sharded_names = frozenset(n for n, split in whole_splits(layers, self.pipeline.tensor).items()
                                            if not split.replicated)
            for k, (a, b) in enumerate(self.bounds):
                if k % p == stage_rank:
                    layers = convert_layers(layers, a, b, self.planes.comm, self.pipeline.tensor_chunks)
        pieces = {k: piece_module(layers, a, b) for k, (a, b) in enumerate(self.bounds) if k % p == stage_rank}
        job = self.job
        self.stage = StageEngine(
            pieces=pieces, n_pieces=len(self.bounds), stage_rank=stage_rank, build_optimizer=job.build_optimizer,
            scheduler_factory=job.lr_scheduler, pipeline=self.pipeline, plan=self.plan,
            loader=loader_of(self.dataset, job.collate_fn, self.plan), model_input=job.input_of, output_loss=job.output_loss,
            seed=job.seed, batchnorm=job.batchnorm, deterministic=self.deterministic, device=self.device,
            tied=tied_for_worker(layers, self.bounds, p, stage_rank),
            successor_pieces=successor_pieces(self.pipeline, self.layers, self.bounds, stage_rank),
            eager_every_wait=self.eager_every_wait,
            loop=stage_loop(job, self.layers, self.bounds, p), reduction=self.reduction,
            breakdown=self.breakdown,
        )

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
        self._close_planes()
        if self.pipeline.tensor > 1:
            self.planes = TensorPlanes(group, self.pipeline.tensor, self.subgroup)
            group = self.planes.plane  # the pipeline engine runs on this worker's plane
        grid = Grid(self.pipeline.stages, d, group.rank)
        if self.stage is None:
            if self.planes is not None and self.resume_state is not None:
                self._resume_tensor_stage(grid.stage_rank)
            else:
                self._build_stage(grid.stage_rank)
                if self.resume_state is not None:
                    resume_stage(self.stage, self.model, self.resume_state, grid.stage_rank)
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
        plane = f".t{self.planes.t}" if self.planes is not None else ""  # one stage group per plane
        # In increasing stage order on every worker, so building them cannot deadlock.
        self.stage_groups = {s: self.subgroup(group.generation, f"stage{s}{plane}", grid.replica, grid.replicas)
                             for s in sorted(names)}
        if self.planes is not None:
            rebind_comm(self.stage.model, self.planes.comm)
            self._bind_tensor_loop()
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

    def _bind_tensor_loop(self) -> None:
        """The training loop's view of this generation's tensor-parallel group: the loss scaler's
        inf check and the clipping norm sum the shards' parts over it."""
        tp = self.planes.tp
        loop = self.stage.loop
        loop.tensor_sum = lambda v: tp.all_reduce(v)
        loop.tensor_sharded = frozenset(id(q) for n, q in self.stage.model.named_parameters()
                                        if n in self._sharded_names)
        loop.tensor_rank = self.planes.t

    def _close_planes(self) -> None:
        if self.planes is not None:
            self.planes.close()
            self.planes = None

    def _resume_tensor_stage(self, stage_rank: int) -> None:
        """Build a tensor-parallel stage from a gathered (single-worker layout) state: the whole
        model's weights first (the shards are cut from them), then this shard of the stage's
        optimizer state."""
        state = self.resume_state
        self.model.load_state_dict(state["model"])
        names = self._unconverted_names(stage_rank)
        splits = whole_splits(self.layers, self.pipeline.tensor)
        self._build_stage(stage_rank)
        full = {"model": {n: state["model"][n] for n in names},
                "optimizer": state["optimizer"]["pipeline_stages"][stage_rank]}
        mine = shard_stage_state(full, names, splits, self.planes.t, self.pipeline.tensor)
        self.stage.optimizer.load_state_dict(reorder_optimizer(mine["optimizer"], names,
                                                               optimizer_names(self.stage.optimizer, self.stage.model)))
        sched = state["lr_scheduler"]["pipeline_stages"][stage_rank]
        if self.stage.scheduler is not None and sched is not None:
            self.stage.scheduler.load_state_dict(sched)
        from virtualflow.runtime.pipeline.stage_state import load_scaler

        load_scaler(self.stage, state.get("grad_scaler"))

    def _unconverted_names(self, stage_rank: int, layers: list[torch.nn.Module] | None = None) -> list[str]:
        """The optimizer's parameter order of stage ``stage_rank`` without tensor parallelism (the
        order of a checkpoint's per-stage optimizer state): the job's optimizer built on the
        unconverted stage module."""
        from virtualflow.plan.pipeline.geometry import piece_module

        layers = layers if layers is not None else self.layers
        p = self.pipeline.stages
        module = torch.nn.Sequential(*[piece_module(layers, a, b) for k, (a, b) in enumerate(self.bounds)
                                       if k % p == stage_rank])
        flat = torch.nn.Sequential(OrderedDict(
            (name, layer) for piece in module.children() for name, layer in piece.named_children()))
        return optimizer_names(self.job.build_optimizer(flat), flat)

    def _close_stage_groups(self) -> None:
        for g in self.stage_groups.values():
            if g.pg is not None:
                g.close()
        self.stage_groups = {}
        self.stage_group = None

    # ---- Bamboo: failover and reconfiguration ---------------------------------------------------
    def _stages_held(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(stages this worker runs, stages its replica holds), in the job's stage numbering."""
        if self.stage is None:
            return (), ()
        if self.layout is None:
            p = self.pipeline.stages
            own = (self.stage.stage_rank,)
            rep = ((self.stage.stage_rank + 1) % p,) if self.stage.replica_of_successor is not None else ()
            return own, rep
        own = self.layout[self.group_rank]
        if self.stage.replica_of_successor is None:  # a replica of one worker keeps no replica
            return own, ()
        return own, self.layout[successor(self.layout, self.pipeline.stages, self.group_rank)]

    def _relayout(self, group: Group, layout: list[list[int]], steps: list[int] | None, target: int | None,
                  assignment: Any = None) -> None:
        """Adopt a Bamboo layout (one run of stages per member, pipeline replica after replica;
        a replica starts at the run holding stage 0): every member ends up with the state of its
        own stages and a replica of its successor's in its replica, taken from its own pieces,
        its replica, or (a broadcast) from a member holding them. With several replicas, each
        job stage is reduced over the workers running it, one per replica, in replica order
        (:meth:`StageEngine.set_job_stages`). Collective."""
        from virtualflow.config.pipeline import Pipeline
        from virtualflow.plan.pipeline.geometry import bounds_from_counts, piece_module
        from virtualflow.plan.pipeline.failover import flatten, split_replicas

        p = self.pipeline.stages
        layouts = split_replicas(layout, p)
        new = flatten(layouts)
        if len(new) != group.size:
            raise RuntimeError(f"layout {layout} names {len(new)} workers; the generation has {group.size}")
        if steps is not None and target is not None and any(0 <= t != target for t in steps):
            raise RuntimeError(f"a failover needs every surviving worker at the same step (steps {steps}); a "
                               f"failure struck between the stages' updates of one step: resume from a checkpoint")
        if self.pipeline.chunks != 1:
            raise RuntimeError("a Bamboo failover needs chunks=1")
        own_old, rep_old = self._stages_held()
        old_replica = self.stage.replica_of_successor if self.stage is not None else None
        if old_replica is not None:
            self.redundant_totals[0] += old_replica.forward_s
            self.redundant_totals[1] += old_replica.forwards
            self.redundant_totals[2] += old_replica.skipped
            self.redundant_totals[4] = max(self.redundant_totals[4], old_replica.peak_kept_bytes)
        if self.stage is not None:
            self.redundant_totals[3] += self.stage.reused_forwards
        local: dict[int, dict[str, Any]] = {}
        if self.stage is not None:
            local.update(stage_states(self.stage.replica_of_successor, rep_old, self.full_bounds) if rep_old else {})
            local.update(stage_states(self.stage, own_old, self.full_bounds))
        got, self.relayout_bytes = exchange_for_layout(group, new, p, own_old, rep_old, local, self.device)
        # Build this worker's pieces from the whole model's layers, loaded with the stages' states.
        grid = Grid(p, len(layouts), group.rank, sizes=tuple(len(rep) for rep in layouts))
        mine_rep = layouts[grid.replica]
        pos, m = grid.stage_rank, len(mine_rep)
        mine, succ = mine_rep[pos], mine_rep[(pos + 1) % m]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.job.seed)
            layers = [layer.to(self.device) for layer in layers_of(self.job.model())]
        whole = torch.nn.Sequential(*layers)
        whole.load_state_dict({k: v for s in set(mine) | set(succ) for k, v in got[s]["model"].items()},
                              strict=False)
        counts = [self.full_bounds[run[-1]][1] - self.full_bounds[run[0]][0] for run in mine_rep]
        self.layout = new
        self.group_rank = group.rank
        pipeline = Pipeline(stages=m, schedule=self.pipeline.schedule, split=counts, redundancy=m >= 2,
                            redundant_compute=self.pipeline.redundant_compute)
        self.bounds = bounds_from_counts(counts)
        a, b = self.bounds[pos]
        sa, sb = self.bounds[(pos + 1) % m]
        job = self.job
        self.stage = StageEngine(
            pieces={pos: piece_module(layers, a, b)}, n_pieces=m, stage_rank=pos,
            build_optimizer=job.build_optimizer, scheduler_factory=job.lr_scheduler, pipeline=pipeline, plan=self.plan,
            loader=loader_of(self.dataset, job.collate_fn, self.plan), model_input=job.input_of, output_loss=job.output_loss,
            seed=job.seed, batchnorm=job.batchnorm, deterministic=self.deterministic, device=self.device,
            successor_pieces={(pos + 1) % m: piece_module(layers, sa, sb)} if m >= 2 else None,
            eager_every_wait=self.eager_every_wait,
            loop=stage_loop(job, layers, self.bounds, m), breakdown=self.breakdown,
        )
        load_merged(self.stage, [got[s] for s in mine])
        load_merged(self.stage.replica_of_successor, [got[s] for s in succ])
        if old_replica is not None and old_replica.eager:
            # Eager redundant forwards of the interrupted step, of a stage this worker now runs:
            # the redone step takes them instead of running that stage's forwards again.
            lo = min(int(name) for mod in old_replica.pieces.values() for name, _ in mod.named_children())
            hi = max(int(name) for mod in old_replica.pieces.values() for name, _ in mod.named_children()) + 1
            if a <= lo and hi <= b and self.stage.pipeline.eager_forwards:
                self.stage.take_over(lo, hi, old_replica.eager)
            old_replica.eager.clear()
        if len(layouts) > 1 and len(mine) > 1:
            self.stage.set_job_stages([(s, *self.full_bounds[s]) for s in mine])
        self.model, self.layers = None, None
        self._relaid = group.generation
        if all(len(run) == 1 for run in new):
            self.layout = None  # full depth again: the standard layout from here on
            grid = Grid(p, len(layouts), group.rank)
        self._adopt(group, grid, replica_blocks(assignment, [len(rep) for rep in layouts], self.job.virtual_nodes),
                    job_stages=mine)

    # ---- the worker's Engine protocol (runtime/engines.py) ---------------------------------------
    def resume_from(self, state: dict[str, Any]) -> None:
        saved = state.get("pipeline") or {}
        if [list(b) for b in saved.get("bounds", [])] != [list(b) for b in self.full_bounds]:
            state = restage(state, self.full_bounds)  # a sharded checkpoint of another split
        self.resume_state = state  # loaded into the stage once its place is known

    def prepare_to_join(self) -> None:
        pass  # a newcomer's stage is built once its place is known

    def check_state_held(self, run_dir: str) -> None:
        # What a failed member held comes back from its stage's survivors (or a replica), except
        # a chunk of a sharded stage optimizer (one copy each): ShardLost, naming the way out.
        shard = self.stage.shard if self.stage is not None else None
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

    def before_regroup(self) -> None:
        # Every member keeps its own stage's state; a sharded stage optimizer is gathered whole on
        # every replica now, while the old stage group works (the next generation cuts it again).
        if self.stage is not None and self.stage.shard is not None:
            gather_stage_optimizer(self.stage, self.stage_group)

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
            if self.stage.shard is not None:  # (but a sharded stage optimizer's, over the stage group)
                gather_stage_optimizer(self.stage, self.stage_group)
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
        """This worker's part of a sharded checkpoint (standard layout): stage-rank ``s`` of
        replica ``k`` writes its share (1 / replicas) of its stage's layers and optimizer state
        (entries ``model/<name>``, ``optimizer/stage/<s>/state/<index>/<key>``); replica 0's member
        of each stage also writes the stage's optimizer hyperparameters and scheduler state
        (``meta.pt``), rank 0 with the pipeline's stages and bounds. Local: no collective."""
        p = self.pipeline.stages
        s, k, replicas = group.rank % p, group.rank // p, group.size // p
        stage = self.stage
        model = stage.model.state_dict()
        pieces = model_pieces(model, k, replicas)
        more, rest = optimizer_pieces(stage.optimizer.state_dict(), k, replicas)
        for piece in more:
            piece.fqn = piece.fqn.replace("optimizer/state/", f"optimizer/stage/{s}/state/", 1)
        pieces += more
        if k != 0:
            return pieces, None
        meta: dict[str, Any] = {
            "model": {n: v.detach().cpu() for n, v in model.items() if not v.numel()}, "model_keys": list(model),
            "model_aliases": shared_names(model), "optimizer": rest, "stage": s,
            "lr_scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
            "grad_scaler": scaler_state(stage),
            "param_names": [n for n, _ in stage.model.named_parameters()],  # the optimizer's order
        }
        if s == 0:
            meta["pipeline"] = {"stages": p, "bounds": [list(b) for b in self.full_bounds],
                                "schedule": self.pipeline.schedule}
        return pieces, meta

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
        pass  # the tensor-parallel groups stay: the final state is gathered after this (a daemon thread)

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        if step in self._results:
            return self._results.pop(step)
        n = 1
        if not self.pipeline.flush:
            end = self.total_steps if self.total_steps is not None else step + self.pipeline.window
            n = max(1, min(self.pipeline.window, end - step))
        self.stage.slowdown = self.slowdown
        if self.planes is not None and callable(control):
            control = int(control())  # the planes agree on it now, before the schedule
        if self.planes is not None and self.planes.plane_rank == 0:
            # Only generation rank 0 reads the control position; the planes' statistics
            # all-reduces are apart, so the first tensor-parallel group hands it to every plane's
            # rank 0 first (every plane must stop for a command at the same step).
            c = torch.tensor([float(control)], dtype=torch.float64)
            self.planes.tp.all_reduce(c)
            control = int(c.item())
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
            self._write_timeline()
        out = {r.step: StepOutcome(r.loss, r.bad_vns, r.control, None, self._generation_rows(r.breakdown),
                                   metrics=r.metrics, grad_norm=r.grad_norm, skipped=r.skipped,
                                   loss_scale=r.loss_scale) for r in results}
        first = out.pop(step)
        self._results = out
        return first

    def _generation_rows(self, rows: list[dict[str, float]] | None) -> list[dict[str, float] | None] | None:
        """The step breakdown's rows in generation-rank order. With tensor-parallel stages the rows
        are those of plane 0 (tensor rank 0 of every stage, generation ranks ``0, T, 2T, ...``; the
        stage's other workers run the same schedule on the same shapes): ``None`` for the others."""
        if rows is None or self.planes is None:
            return rows
        t = self.planes.tensor
        out: list[dict[str, float] | None] = [None] * (len(rows) * t)
        for i, row in enumerate(rows):
            out[i * t] = row
        return out

    @property
    def mid_window(self) -> bool:
        """True between the steps of a no-flush window (its later steps are already computed)."""
        return bool(self._results)

    def _write_timeline(self) -> None:
        """Append this worker's recorded actions to ``pipeline/timeline-<rank>.jsonl`` in the run's
        state directory (``virtualflow plot RUN_DIR --pipeline`` draws them)."""
        import json
        import os

        if self.timeline_dir is None:
            self.stage.timeline.clear()
            return
        os.makedirs(self.timeline_dir, mode=0o700, exist_ok=True)
        rank = self.planes.generation_group.rank if self.planes is not None else self.group.rank
        path = os.path.join(self.timeline_dir, f"timeline-{rank}.jsonl")
        g = self.grid
        with open(path, "a") as f:
            for e in self.stage.timeline:
                f.write(json.dumps({**e, "rank": rank, "replica": g.replica, "stage_rank": g.stage_rank,
                                    "generation": self.group.generation}) + "\n")
        self.stage.timeline.clear()

    def _gather_tensor_stages(self) -> list[dict[str, Any]] | None:
        """Collective over the generation: each plane's stages gathered on its plane rank 0
        (generation ranks ``0 .. T-1``, one tensor-parallel group), then sent to rank 0, which
        merges the shards into the single-worker layout."""
        from virtualflow.runtime.transfer import broadcast_state

        planes = self.planes
        mine = gather_stages(self.stage, self.pipeline, None, self.full_bounds, planes.plane, self.device)
        if planes.plane_rank != 0:
            return None
        per_plane = [mine]
        for t in range(1, planes.tensor):
            got, _ = broadcast_state(planes.tp, t, mine if planes.t == t else None, self.device, receivers=[0])
            if planes.t == 0:
                per_plane.append(got)
        if planes.t != 0:
            return None
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.job.seed)
            self.model = self.job.model().to(self.device)
        layers = layers_of(self.model)
        splits = whole_splits(layers, planes.tensor)
        out = []
        for s in range(self.pipeline.stages):
            merged = merge_stage_states([plane[s] for plane in per_plane], splits)
            target = self._unconverted_names(s, layers)
            merged["optimizer"] = reorder_optimizer(merged["optimizer"], merged["param_names"], target)
            out.append(merged)
        return out

    def abandon_step(self) -> None:
        if self.stage is not None and not self.pipeline.flush:
            # Some stages may have applied updates of the interrupted window already: the window
            # cannot be redone consistently.
            self._broken_window = True
        self._pending = self.stage.pending_commit if self.stage is not None else None
        if self.stage is not None:
            self.stage.pending_commit = None
        if self.stage is not None and self._pending is None:
            self._discard_step()
        self._close_stage_groups()
        self._close_planes()
        self.group = None
        self._results = {}
        self.phase = "idle"

    def _discard_step(self) -> None:
        self.stage.discard_step()  # back to the step's start; nothing changes once the step settled

    def settle_commit(self, group: Group, steps: list[int], target: int) -> list[int]:
        """A failure in a step's stats all-reduce can complete it on some members only: they
        applied the step, the others did not (their gradients are reduced: only the stats are
        missing). Those others finish the step now from the stats a member that completed it
        hands over, so that every stage reaches ``target`` again (without it, a stage whose
        every member missed the stats could not be made consistent). Collective only when the
        members' steps (known to all) differ by one; returns the steps after settling."""
        pending, self._pending = self._pending, None
        me = group.rank
        if not (target >= 1 and target - 1 in steps and target in steps):
            if pending is not None:
                self._discard_step()
            return steps
        mine = pending is not None and pending[0] == steps[me] == target - 1
        holds = self.stage is not None and self.stage.last_commit is not None and \
            self.stage.last_commit[0] == target - 1 and steps[me] == target
        flags = torch.zeros(2 * group.size, dtype=torch.float64, device=self.device)
        flags[2 * me], flags[2 * me + 1] = float(mine), float(holds)
        group.all_reduce(flags)
        waiting = [r for r in range(group.size) if flags[2 * r] > 0]
        sources = [r for r in range(group.size) if flags[2 * r + 1] > 0]
        if not waiting or not sources:
            if pending is not None:
                self._discard_step()
            return steps
        stats = self.stage.last_commit[1][: self._stats_numel()].clone() if me == sources[0] else \
            torch.zeros(self._stats_numel(), dtype=torch.float64, device=self.device)
        group.broadcast(stats, sources[0])
        if mine:
            pending[1](stats)
            self.stage.last_commit = (target - 1, stats)
        elif pending is not None:
            self._discard_step()
        settled = [target if r in waiting else s for r, s in enumerate(steps)]
        self._settled = (group.generation, settled)
        return settled

    def _stats_numel(self) -> int:
        """A flush step's stats entries (a newcomer has no stage yet: from the job)."""
        if self.stage is not None:
            return self.stage.stats_numel
        return FlushStep.stats_numel(self.job.virtual_nodes, StageLoop(max_grad_norm=self.job.max_grad_norm,
                                                                       blocks=self.norm_blocks))

    # ---- state (the moving parts: runtime/pipeline/stage_state.py) ------------------------------------
    def stage_state(self) -> dict[str, Any]:
        return stage_state(self.stage)

    def load_stage_state(self, state: dict[str, Any]) -> None:
        load_stage_state(self.stage, state)

    def transfer(self, group: Group, steps: list[int], target: int) -> int:
        """Bring every worker to step ``target``: each stage's state goes from a member of that
        stage that reached it to the members of that stage behind (:func:`transfer_stages`).
        ``steps[r]`` is rank ``r``'s step. Collective."""
        if self._relaid == group.generation:
            return 0  # the re-layout moved every stage a member needed
        if self._settled is not None and self._settled[0] == group.generation:
            steps = self._settled[1]  # members that finished the interrupted step need nothing
        if self.planes is not None:  # each plane brings its own members up to date
            return transfer_stages(self.stage, self.pipeline, self.planes.plane, self.planes.plane_steps(steps),
                                   target, self.device)
        return transfer_stages(self.stage, self.pipeline, group, steps, target, self.device)

    def gather_state(self, group: Group) -> dict[str, Any] | None:
        """Collective: rank 0 gets the whole model's state (also loaded into ``self.model``, rebuilt
        from the job if needed) and every stage's
        optimizer and scheduler state; others get ``None``. After a failover, members running
        several stages send each stage's state apart, so the layout is that of the job's stages."""
        p = self.pipeline.stages
        if self.stage is not None and self.stage.shard is not None:  # replica 0 sends each stage's state
            gather_stage_optimizer(self.stage, self.stage_group, root=0)
        if self.planes is not None:
            stages = self._gather_tensor_stages()
        else:
            stages = gather_stages(self.stage, self.pipeline, self.layout, self.full_bounds, group, self.device)
        if stages is None:
            return None
        whole = {}
        for st in stages:
            whole.update(st["model"])
        if self.model is None:  # the whole model again, for evaluation (Job.evaluate takes a model)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(self.job.seed)
                self.model = self.job.model().to(self.device)
        self.model.load_state_dict(whole)
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": {"pipeline_stages": [st["optimizer"] for st in stages]},
                "lr_scheduler": {"pipeline_stages": [st["lr_scheduler"] for st in stages]},
                "grad_scaler": stages[0].get("grad_scaler"),  # the same on every stage (16-mixed; else None)
                "pipeline": {"stages": p, "bounds": [list(b) for b in self.full_bounds],
                             "schedule": self.pipeline.schedule}}


def optimizer_names(optimizer: Any, module: torch.nn.Module) -> list[str]:
    """The names (in ``module``) of the optimizer's parameters in its ``state_dict`` index order
    (parameter group after parameter group)."""
    by_id = {id(q): n for n, q in module.named_parameters()}
    groups = getattr(optimizer, "param_groups", [])
    return [by_id[id(q)] for g in groups for q in g["params"]]


def reorder_optimizer(opt: dict[str, Any], source: list[str], target: list[str]) -> dict[str, Any]:
    """An optimizer ``state_dict`` indexed by parameter names ``source`` re-indexed for ``target``
    (the same names in another order: the optimizer of a converted module and of the original)."""
    if source == target:
        return opt
    if sorted(source) != sorted(target):
        raise RuntimeError(f"optimizer parameters differ between the tensor-parallel stage and the model: "
                           f"{sorted(set(source) ^ set(target))[:4]}")
    index = {n: j for j, n in enumerate(target)}
    state = {index[source[int(i)]]: v for i, v in opt["state"].items()}
    groups = [{**g, "params": [index[source[int(i)]] for i in g["params"]]} for g in opt["param_groups"]]
    return {**opt, "state": state, "param_groups": groups}


def restage(state: dict[str, Any], full_bounds: list[tuple[int, int]]) -> dict[str, Any]:
    """A pipelined state (``gather_state``'s layout) cut again for the stages ``full_bounds``:
    each parameter's optimizer state follows it by name (a sharded checkpoint records each
    stage's parameter names, ``pipeline.stage_params``); every stage gets the first stage's
    hyperparameters and scheduler state (the stages share one schedule). Raises ``ValueError``,
    naming the knobs, where that cannot be done exactly."""
    saved = state.get("pipeline") or {}
    names = saved.get("stage_params")
    stages = state["optimizer"]["pipeline_stages"]
    counts = [int(b) - int(a) for a, b in saved.get("bounds", [])]
    refusal = (f"the checkpoint holds {saved.get('stages')} stages with layer counts {counts}; the job has "
               f"{len(full_bounds)} stages with {[b - a for a, b in full_bounds]}")
    if not names or len(names) != len(stages) or any(n is None for n in names):
        raise ValueError(f"{refusal}, and it does not name each stage's parameters (a single-file state): resume "
                         f"with --pipeline-stages {saved.get('stages')} --split {','.join(map(str, counts))}")
    if any(len(opt["param_groups"]) > 1 for opt in stages) or not all(
            n.split(".")[0].isdigit() for stage_names in names for n in stage_names):
        raise ValueError(f"{refusal}; moving optimizer state between stages needs one parameter group and layer-"
                         f"indexed parameter names: resume with --pipeline-stages {saved.get('stages')} --split "
                         f"{','.join(map(str, counts))}")
    by_name: dict[str, Any] = {}
    for opt, stage_names in zip(stages, names):
        for pos, name in enumerate(stage_names):
            if pos in opt["state"]:
                by_name[name] = opt["state"][pos]
    every = [n for stage_names in names for n in stage_names]
    first = stages[0]["param_groups"]
    group = {k: v for k, v in first[0].items() if k != "params"} if first else {}
    cut = []
    for a, b in full_bounds:
        mine = [n for n in every if a <= int(n.split(".")[0]) < b]
        cut.append({"state": {j: by_name[n] for j, n in enumerate(mine) if n in by_name},
                    "param_groups": [{**group, "params": list(range(len(mine)))}] if mine else []})
    sched = state["lr_scheduler"]["pipeline_stages"][0]
    bounds = [[int(a), int(b)] for a, b in full_bounds]
    return {**state, "optimizer": {"pipeline_stages": cut}, "lr_scheduler": {"pipeline_stages": [sched] * len(cut)},
            "pipeline": {**saved, "stages": len(cut), "bounds": bounds}}
