"""The sharded optimizer of a pipeline stage (``reduction="sharded"`` with a pipeline).

Purpose: with *D* pipeline replicas each stage's parameters are held *D* times (one copy per
replica); with ``reduction="sharded"`` each copy keeps only its chunk of the stage's optimizer
state (ZeRO-1/2 over the stage group ``gen/<g>/stage<s>``), as the VN engine's sharded optimizer
(:mod:`virtualflow.runtime.sharded`) does over the whole job:

1. the stage's gradient is **reduce-scattered** over the stage's replicas (default mode,
   :class:`~.requests.StageScatter`): replica *j* receives the sum for its chunk ``[lo_j, hi_j)``
   of the stage's flat parameter vector; deterministic mode sums the per-VN vectors along the
   fixed VN-id tree as without sharding (:class:`~.requests.StageTree`) and each replica keeps its
   chunk of the root;
2. each replica **updates its chunk** with an optimizer of the user's class and hyperparameters
   (:class:`~virtualflow.runtime.sharded.ShardedOptimizer`), holding that chunk's state only;
3. the stage's parameters are **all-gathered** over the replicas
   (:class:`~.requests.StageGather`) before the next step's forwards.

Invariants.

* *Same model.* The optimizers allowed (Adam, AdamW, SGD) are elementwise and give the same bits
  on a slice as on the whole tensor (:mod:`virtualflow.runtime.sharded`), so a deterministic
  pipelined job with the sharded reduction is bit-identical to the same job without it, hence to
  the unpipelined deterministic job; default mode is equal within float tolerance.
* *The stage's optimizer looks whole to the state code.* :class:`StageOptimizer` stands in for the
  user's optimizer on the stage: its ``state_dict()`` is the whole state while the whole state is
  held (at the start, after a load, after :func:`gather_stage_optimizer`), and raises otherwise,
  so nothing can read a chunk as if it were the stage's state. Every path that reads or moves a
  stage's state (checkpoints, the final state, a resize's transfer, a sharded checkpoint's parts)
  first gathers it over the stage group; the next step cuts it into chunks again
  (:meth:`StageShard.cut`), by the layout of that step's generation.
* *With one replica* the chunk is the whole stage: the update is the plain one, nothing is
  scattered or gathered.
* *A failure* loses the failed replica's chunks (one copy of each): the survivors raise
  :class:`~virtualflow.runtime.sharded.ShardLost` before the next generation forms, naming the
  checkpoint to resume from (as the VN engine's sharded reduction does).
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import torch

from virtualflow.config.composition import check_stage_sharding
from virtualflow.runtime.clipping import block_cuts
from virtualflow.runtime.pipeline.pieces import flat_grads, load_grads
from virtualflow.runtime.pipeline.requests import Request, StageGather
from virtualflow.runtime.sharded import gather_sharded_state
from virtualflow.runtime.step.finish import Part
from virtualflow.runtime.step.update import ShardedUpdate, WholeUpdate

__all__ = ["StageOptimizer", "StageShard", "WholeStage", "check_stage_sharding", "gather_stage_optimizer",
           "optimizer_bytes", "stage_update"]



class WholeStage(WholeUpdate):
    """A stage copy holding its stage's whole optimizer (``reduction="allreduce"``): the update
    the VN engine's :class:`~virtualflow.runtime.step.update.WholeUpdate` takes, on the stage's
    parameters."""

    def stage_grads(self) -> list[torch.Tensor]:
        """The gradients the step finish unscales and clips."""
        return [q.grad for q in self.params if q.grad is not None]

    def stage_parts(self, norm_params: Sequence[tuple[int, torch.Tensor]],
                    contributes: bool) -> tuple[list[torch.Tensor], list[Part]]:
        """(:meth:`stage_grads`, the norm's parts: every one of ``norm_params`` when this copy
        ``contributes`` - replica 0, every replica holding the same sum - none otherwise)."""
        parts = [Part(i, q, q.grad) for i, q in norm_params if q.grad is not None] if contributes else []
        return self.stage_grads(), parts

    def begin_step(self, replica: int, replicas: int) -> None:
        """A step starts: the gradients are dropped (backward accumulates into fresh ones)."""
        self.optimizer.zero_grad(set_to_none=True)

    def grads_to_flat(self) -> None:
        """Nothing to move: the update reads each parameter's own gradient."""

    def gather(self, replicas: int) -> Generator[Request, Any, None]:
        """Nothing to gather after the update: every copy stepped the whole stage."""
        yield from ()

    def gather_whole(self, replica: int, replicas: int, group: Any, root: int | None = None) -> None:
        pass  # the whole state is held here

    # ---- Bamboo: what the replica of this stage (on the predecessor) takes ----------------------
    def like(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> WholeStage:
        """The update of the same kind for Bamboo's replica of the successor's stage (its
        ``params`` and ``optimizer``): the whole stage's."""
        return WholeStage(optimizer, params)

    def handed_grads(self) -> torch.Tensor:
        """The reduced gradients Bamboo's replica of this stage steps with: all of them, flat."""
        grads = flat_grads(self.params)
        return torch.cat(grads) if grads else torch.zeros(0)

    def load_handed(self, grads: torch.Tensor) -> None:
        """On the replica: :meth:`handed_grads` of the original into ``.grad`` (views of it)."""
        load_grads(self.params, grads, clone=False)


class StageShard:
    """One stage copy's chunk of the stage's optimizer (see the module docstring): the VN engine's
    sharded update (:class:`~virtualflow.runtime.step.update.ShardedUpdate`) over the stage's
    parameters and its replicas."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 norm_blocks: bool = False) -> None:
        # With a gradient norm, chunks start on its blocks (each parameter's own), so every block
        # has one holder.
        cuts = block_cuts([q.numel() for q in params]) if norm_blocks else None
        self.norm_blocks = norm_blocks
        self.core = ShardedUpdate(optimizer, params, cuts=cuts)
        self.flat = self.core.flat  # the stage's parameters now live in one flat vector
        self.opt = self.core.opt
        self.optimizer = StageOptimizer(self)
        """What the stage holds as its optimizer (the state code reads and loads it)."""
        self.held_bytes = 0
        """Optimizer state bytes this copy held after its last update (:meth:`state_bytes`)."""
        self.chunk_held = False
        """This copy's chunk (``opt.rank`` of ``opt.size``) is the current state (it stepped, or
        was cut from the whole state since the last load); a gather keeps it."""

    @property
    def shard(self) -> StageShard:
        """The stage's sharded optimizer (the name the stage engine reads)."""
        return self

    @property
    def bounds(self) -> list[tuple[int, int]]:
        assert self.opt.bounds is not None, "cut() first"
        return [tuple(b) for b in self.opt.bounds]

    def chunk(self) -> tuple[int, int]:
        return self.opt.chunk()

    def holds_chunk_of(self, replica: int, replicas: int) -> bool:
        """Whether this copy's chunk is chunk ``replica`` of ``replicas`` (and current)."""
        return self.chunk_held and (self.opt.rank, self.opt.size) == (replica, replicas)

    def cut(self, replica: int, replicas: int) -> None:
        """Before a step: hold chunk ``replica`` of ``replicas``, cut from the whole state held (a
        load, a regroup's gather); a chunk of this layout is kept (a gathered whole copy is
        dropped); a chunk of another layout with no whole state: :class:`ShardLost`."""
        if self.holds_chunk_of(replica, replicas):
            self.opt.full = None  # the chunk is current: the whole copy a gather left goes
            return
        self.opt.shard(replica, replicas)
        self.chunk_held = True

    def begin_step(self, replica: int, replicas: int) -> None:
        """A step starts: the chunks (re-)cut by this generation's layout, the flat gradient zeroed."""
        self.cut(replica, replicas)
        self.start_step()

    def start_step(self) -> None:
        """Gradients into the flat gradient vector, zeroed (backward accumulates there)."""
        self.core.zero_grad()

    def grads_to_flat(self) -> None:
        """Deterministic mode: after the reduction the parameters' ``.grad`` hold the whole summed
        gradient; copy it into the flat vector and make ``.grad`` views of it again (so unscaling
        and clipping act on what the chunk's update reads)."""
        for q, o in zip(self.flat.params, self.flat.offsets):
            g = q.grad
            dst = self.flat.grad[o: o + q.numel()]
            if g is None:
                dst.zero_()
            elif g.data_ptr() != dst.data_ptr():
                dst.copy_(g.reshape(-1))
        self.flat.attach_grads()

    def chunk_grads(self) -> torch.Tensor:
        return self.core.chunk_grads()

    def stage_grads(self) -> list[torch.Tensor]:
        """This copy's chunk of the reduced gradient: what the step finish unscales and clips
        (the rest of the flat gradient is scratch: its parameters arrive with the all-gather)."""
        return [self.chunk_grads()]

    def stage_parts(self, norm_params: Sequence[tuple[int, torch.Tensor]],
                    contributes: bool) -> tuple[list[torch.Tensor], list[Part]]:
        """(:meth:`stage_grads`, the norm's parts in this copy's chunk). Every copy contributes
        its chunk's blocks (a chunk starts on a block: :meth:`cut`), whatever ``contributes``
        says; the stats all-reduce gathers them, each block from one holder."""
        where = {id(q): o for q, o in zip(self.flat.params, self.flat.offsets)}
        return self.stage_grads(), self.core.chunk_parts([(i, q, where[id(q)]) for i, q in norm_params])

    def apply(self, scheduler: Any) -> None:
        """Update this copy's chunk from the reduced gradient in the flat vector, then the LR
        scheduler; the other chunks' parameters arrive with the all-gather (:meth:`gather`)."""
        self.core.step_own(scheduler)
        self.held_bytes = self.opt.state_bytes()

    def gather(self, replicas: int) -> Generator[Request, Any, None]:
        """After the update: every replica's chunk of the parameters, everywhere."""
        if replicas > 1:
            yield StageGather(self.flat.flat, self.bounds)

    # ---- Bamboo: the replica of a sharded stage mirrors the original's chunk ---------------------
    def like(self, params: Sequence[torch.nn.Parameter],
             optimizer: torch.optim.Optimizer) -> StageShard | WholeStage:
        """The update of the same kind for Bamboo's replica of the successor's stage (its
        ``params`` and ``optimizer``): a chunk cut as the successor's (the same blocks; nothing
        to shard in a stage with no trainable parameters)."""
        return StageShard(params, optimizer, norm_blocks=self.norm_blocks) if params else WholeStage(optimizer, params)

    def handed_grads(self) -> torch.Tensor:
        """The reduced gradients Bamboo's replica of this stage steps with: this copy's chunk only
        (the replica mirrors the chunk; the other chunks arrive with its holders' all-gather). A
        copy: the original clips its chunk in place afterwards."""
        return self.chunk_grads().clone()

    def load_handed(self, grads: torch.Tensor) -> None:
        """On the replica (cut like the original: :meth:`begin_step`): the original's reduced
        chunk (:meth:`handed_grads`) into the flat gradient, where :meth:`apply` reads it."""
        self.start_step()
        self.chunk_grads().copy_(grads)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this copy held after its last update (its chunk's; a gather
        for a checkpoint holds the whole state for a moment, which this does not count)."""
        return self.held_bytes

    def gather_whole(self, replica: int, replicas: int, group: Any, root: int | None = None) -> None:
        """:func:`gather_stage_optimizer` for this copy, chunk ``replica`` of ``replicas``.

        Symmetric by construction: the replicas take part exactly when their chunks are current for
        the stage's layout, which is true on all of them or on none (a generation's first step has
        not cut them yet: the whole state is then held everywhere already, from a load or the
        regroup's gather)."""
        if not self.holds_chunk_of(replica, replicas):
            return
        from virtualflow.comm.ring import Collectives

        opt = self.opt
        comm = Collectives(group) if group is not None and group.size > 1 else None
        held, opt.full = opt.full, None  # (gather_state reads the chunks only while no whole state is held)
        try:
            if comm is None:
                state = opt.gather_state(lambda chunk: chunk, lambda t: None)
            else:
                state = gather_sharded_state(opt, comm, group, root)
        finally:
            if comm is not None:
                comm.close()
        opt.full = state if state is not None else held


def stage_update(reduction: str, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *,
                 pipeline: Any, norm_blocks: bool) -> WholeStage | StageShard:
    """A stage copy's optimizer update for ``reduction`` (checked against ``pipeline``:
    :func:`check_stage_sharding`); ``norm_blocks``: the whole step's norm is taken (chunks start on
    its blocks). A stage with no trainable parameters has nothing to shard. A weight shared with
    another stage is a parameter like any other here: its copies' gradients are summed before the
    chunks are cut from them (:class:`~.tied.SumBeforeScatter`, :class:`~.tied.PairedTies`)."""
    if reduction != "sharded":
        return WholeStage(optimizer, params)
    check_stage_sharding(pipeline)
    return StageShard(params, optimizer, norm_blocks=norm_blocks) if params else WholeStage(optimizer, params)


class StageOptimizer:
    """The stage's optimizer as the rest of the pipeline sees it: the user's hyperparameters
    (``param_groups``, which the LR scheduler edits) and the whole state when it is held."""

    def __init__(self, shard: StageShard) -> None:
        self._shard = shard

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._shard.opt.user.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        return self._shard.opt.user.state  # empty: the chunks' state is in the chunk optimizer

    def state_dict(self) -> dict[str, Any]:
        full = self._shard.opt.full
        if full is None:
            raise RuntimeError("reduction='sharded': this stage's optimizer state is spread over its pipeline "
                               "replicas; gather_stage_optimizer() (a collective over the stage group) first")
        return full

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._shard.opt.load_state(state)  # cut into chunks by the next step's layout
        self._shard.chunk_held = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._shard.opt.user.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        raise RuntimeError("reduction='sharded': a stage's update is StageShard.apply (its chunk), not step()")


def gather_stage_optimizer(stage: Any, group: Any, root: int | None = None) -> None:
    """Collective over the stage group (every replica of the stage calls it at the same point):
    the whole optimizer state of ``stage`` (a :class:`~.engine.StageEngine`) held again on every
    replica (``root`` None) or on replica ``root`` only, beside the chunks (the next step drops it);
    nothing to do for a stage holding its whole optimizer (:meth:`WholeStage.gather_whole`)."""
    if stage is not None:
        stage.update.gather_whole(stage.replica, stage.replicas, group, root)
        # Bamboo: this stage group holds the successor's chunks too; a regroup moves them (a
        # checkpoint or the final state, gathered to ``root``, does not read a replica).
        replica = stage.replica_of_successor
        if replica is not None and root is None:
            replica.update.gather_whole(stage.replica, stage.replicas, group, root)


def optimizer_bytes(stage: Any) -> int:
    """Bytes of optimizer state a stage engine holds now (its chunk's with the sharded reduction)."""
    return stage.update.state_bytes() if stage is not None else 0
