"""The optimizer update, whole or sharded, chosen once when the engine is built.

Purpose: everything a step and a worker do with the optimizer - clear the gradients, hand the
reduced gradient to the step finish (:mod:`virtualflow.runtime.step.finish`), apply the update and
the LR scheduler, and read, gather, load and measure the state - behind one interface with two
variants, so that an engine asks no layout question:

* :class:`WholeUpdate` (``reduction="allreduce"``): every worker holds and steps the user's
  optimizer over the whole model; its state is local.
* :class:`ShardedUpdate` (``reduction="sharded"``, ZeRO-1/2): the parameters live in one flat
  vector (:class:`~virtualflow.runtime.sharded.FlatParams`) and each worker steps its chunk with
  a :class:`~virtualflow.runtime.sharded.ShardedOptimizer`, then the chunks are all-gathered;
  ``shard_replicas=1`` adds the replica's commit rule (:mod:`virtualflow.runtime.shard_replica`).
  A pipeline stage's sharded optimizer (:class:`~virtualflow.runtime.pipeline.stage_shard.StageShard`)
  uses the same chunk code.

Invariants: the variant never changes during a run; the state methods return the user's
optimizer's ``state_dict`` format in both, so checkpoints and transfers are the same files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from virtualflow.config.composition import check

from virtualflow.comm.groups import PeerFailure
from virtualflow.runtime.dcp import Piece, optimizer_pieces, sharded_optimizer_pieces
from virtualflow.runtime.shard_replica import exchange_gradients, rebuild_state
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer, ShardLost, gather_sharded_state
from virtualflow.runtime.step.finish import ChunkGrads, FlatSum, HeldGradient, Part, WholeGrads, range_parts

if TYPE_CHECKING:
    from virtualflow.comm.groups import Group
    from virtualflow.comm.ring import Collectives

__all__ = ["ShardedUpdate", "WholeUpdate", "make_update", "materialize_state", "state_bytes"]


def state_bytes(optimizer: Any) -> int:
    """Bytes of the state tensors ``optimizer`` holds."""
    held = getattr(optimizer, "state", {})
    return sum(v.numel() * v.element_size() for st in held.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a newcomer's optimizer its state tensors now, during set-up, by one step with zero
    gradients. The values do not matter (the state transfer overwrites model, optimizer and
    scheduler state); what matters is that the memory is allocated and touched before the
    worker joins, so the transfer receives into it instead of faulting in hundreds of MB while
    the survivors wait. Best effort: an optimizer that cannot step this way (e.g. one that needs
    a closure) just gets its state from the transfer as usual."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimization only
        pass
    finally:
        optimizer.zero_grad(set_to_none=True)


def _drop_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, cheaply: torch's own wraps the walk over the
    groups in a profiler range and dynamo's guard (about 50-150 us a call here), so for an
    optimizer that does not override it the gradients are set to None directly (the same effect),
    and nothing is done when none is there."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


class WholeUpdate:
    """Every worker holds the whole optimizer state and takes the whole update."""

    flat: FlatParams | None = None
    shard: ShardedOptimizer | None = None
    deferred_failure: PeerFailure | None = None
    """Never set: the whole update has no all-gather to fail after it applied."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)

    # -- a step ----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drop every gradient (:func:`_drop_grads`; a step starts by calling this)."""
        _drop_grads(self.optimizer)

    @property
    def keeps_gradient(self) -> bool:
        """Whether an abandoned step's reduced gradient must stay (never: the step is redone)."""
        return False

    def held(self, flat_sum: torch.Tensor | None, group: Group | None) -> HeldGradient:
        """The reduced gradient as the step finish sees it: the deterministic tree's flat sum
        when the reduction left one, else the gradients in ``p.grad``."""
        return FlatSum(flat_sum, self.params) if flat_sum is not None else WholeGrads(self.params)

    def stage_parts(self, norm_params: Sequence[tuple[int, torch.Tensor]],
                    contributes: bool) -> tuple[list[torch.Tensor], list[Part]]:
        """A pipeline stage: (the gradients to unscale, the parts it counts in the norm: every
        one of ``norm_params`` when it ``contributes``, none otherwise)."""
        grads = [q.grad for q in self.params if q.grad is not None]
        parts = [Part(i, q, q.grad) for i, q in norm_params if q.grad is not None] if contributes else []
        return grads, parts

    def apply(self, scheduler: Any, group: Group | None = None, comm: Collectives | None = None,
              point: Callable[[str], None] | None = None, phase: Callable[[str], None] | None = None) -> None:
        """The update with the reduced (finished) gradient in ``p.grad``, the LR scheduler, and
        the gradients dropped. (``group`` ... ``phase``: what the sharded update needs.)"""
        self.optimizer.step()
        if scheduler is not None:
            scheduler.step()
        _drop_grads(self.optimizer)

    def raise_deferred(self) -> None:
        pass

    # -- the state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def gather_state(self, comm: Collectives | None, group: Group | None, root: int | None = None
                     ) -> dict[str, Any] | None:
        return self.optimizer.state_dict()  # local: every worker holds it whole

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def before_regroup(self, comm: Collectives | None, group: Group | None) -> None:
        pass  # every member keeps the whole state

    def state_bytes(self) -> int:
        return state_bytes(self.optimizer)

    def replica_bytes(self) -> int:
        return 0

    def checkpoint_pieces(self, rank: int, size: int) -> tuple[list[Piece], dict[str, Any]]:
        """This worker's even share of the optimizer state for a sharded checkpoint, and what
        rank 0 writes beside it (hyperparameters)."""
        return optimizer_pieces(self.state(), rank, size)

    # -- a worker's generations --------------------------------------------------------------------
    def prepare_to_join(self) -> None:
        materialize_state(self.optimizer)

    def check_held(self, run_dir: str) -> None:
        pass  # whatever failed, a survivor holds the whole state

    def rebuild(self, group: Group, progress: int, run_dir: str | None) -> None:
        pass


class ShardedUpdate:
    """Each worker steps its chunk of the flat parameters (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *, replicas: int = 0,
                 cuts: Sequence[int] | None = None) -> None:
        self.flat = FlatParams(params)  # the model's parameters now live in one flat vector
        # With a gradient norm, no clipping block may straddle two workers' chunks (``cuts``).
        self.opt = ShardedOptimizer(optimizer, self.flat, replicas=replicas, cuts=cuts)
        self.deferred_failure: PeerFailure | None = None
        """``shard_replicas=1``: the parameters' all-gather failed after this worker applied the step
        (so the step counts as applied); raised at the step boundary (:meth:`raise_deferred`)."""

    @property
    def shard(self) -> ShardedOptimizer:
        """The chunk's optimizer (the name the engines read)."""
        return self.opt

    # -- a step ----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.zero_grad()  # gradients stay views of the flat vector

    @property
    def keeps_gradient(self) -> bool:
        """``shard_replicas=1``: a step exchanged for the replica but not applied keeps its
        reduced chunk for the rebuild to apply."""
        return self.opt.pending

    def chunk_parts(self, entries: Sequence[tuple[int, torch.Tensor, int]]) -> list[Part]:
        """The norm's parts in this worker's chunk of the flat gradient; ``entries``: (index in
        the norm's order, parameter, offset in the flat vector)."""
        return range_parts(self.flat.grad, entries, *self.opt.chunk())

    def chunk_grads(self) -> torch.Tensor:
        lo, hi = self.opt.chunk()
        return self.flat.grad[lo:hi]

    def held(self, flat_sum: torch.Tensor | None, group: Group | None) -> HeldGradient:
        """This worker's chunk of the reduced gradient (every reduction leaves it in the flat
        gradient); the chunks' block sums meet in an all-reduce over ``group``."""
        assert flat_sum is None, "the sharded reduction leaves the chunk in the flat gradient"
        lo, hi = self.opt.chunk()
        all_reduce = group.all_reduce if group is not None and group.size > 1 else None
        return ChunkGrads(self.flat.grad, self.flat.params, self.flat.offsets, lo, hi, all_reduce)

    def step_own(self, scheduler: Any) -> None:
        """Update this worker's chunk from the reduced gradient in the flat vector, then the LR
        scheduler (the chunk's optimizer read the user's learning rate)."""
        self.opt.step_own()
        if scheduler is not None:
            self.opt.scheduler_step(scheduler)

    def apply(self, scheduler: Any, group: Group | None = None, comm: Collectives | None = None,
              point: Callable[[str], None] | None = None, phase: Callable[[str], None] | None = None) -> None:
        """The chunk's update, the parameters' all-gather over ``comm`` (``shard_replicas=1``: the
        replica's gradient exchange and the commit first, and the replica stepped while the
        all-gather runs), the LR scheduler; ``point`` and ``phase`` report where the step is."""
        assert group is not None and comm is not None and point is not None and phase is not None
        opt = self.opt
        if opt.replica is not None:  # the commit rule: runtime/shard_replica.py
            phase("commit")
            exchange_gradients(opt, group)
            opt.pending = True
            group.all_reduce(torch.zeros(1, device=self.flat.grad.device))  # the commit
            phase("apply")
        opt.load_replica_params()
        opt.step_own()
        replica_stepped = False
        try:
            point("after_update")  # (a "lose" fault here: this member's all-gather failed)
            gathered = comm.all_gather(self.flat.flat, opt.bounds, async_op=True)
            opt.step_replica()  # on its own copy of the parameters: overlaps the all-gather
            replica_stepped = True
            gathered.wait()
        except PeerFailure as exc:
            if not opt.replicas:
                raise
            if not replica_stepped:  # it is part of the applied step
                opt.step_replica()
            opt.store_replica_params()  # the predecessor's new chunk, for the rebuild
            self.deferred_failure = exc  # applied here: the next generation rebuilds the parameters
        if scheduler is not None:
            opt.scheduler_step(scheduler)
        self.flat.zero_grad()

    def raise_deferred(self) -> None:
        """Raise the failure of an applied step's all-gather (``shard_replicas=1``), if any."""
        if self.deferred_failure is not None:
            raise self.deferred_failure

    # -- the state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The whole state, only while it is held whole (:meth:`gather_state` collects it)."""
        if self.opt.full is None:
            raise RuntimeError("the sharded optimizer state is spread over the workers: gather_optimizer_state() "
                               "(a collective) first")
        return self.opt.full

    def gather_state(self, comm: Collectives | None, group: Group | None, root: int | None = None
                     ) -> dict[str, Any] | None:
        """Collective (every member at the same point): the whole state on every member, or on
        rank ``root`` only (the others get ``None``)."""
        assert comm is not None and group is not None
        return gather_sharded_state(self.opt, comm, group, root)

    def load_state(self, state: dict[str, Any]) -> None:
        self.opt.load_state(state)  # cut into chunks when the next generation forms

    def before_regroup(self, comm: Collectives | None, group: Group | None) -> None:
        """Every member gathers the whole state while the old generation's group still works, so
        the next generation can cut it again (a leaving member's chunk is not lost)."""
        if self.opt.full is None:
            self.opt.keep_full(self.gather_state(comm, group))

    def state_bytes(self) -> int:
        return self.opt.state_bytes()

    def replica_bytes(self) -> int:
        return self.opt.replica_bytes()

    def checkpoint_pieces(self, rank: int, size: int) -> tuple[list[Piece], dict[str, Any]]:
        """The chunk this worker holds (or, while the whole state is held, an even share of it),
        and what rank 0 writes beside it (hyperparameters)."""
        if self.opt.full is not None:
            return optimizer_pieces(self.opt.full, rank, size)
        return sharded_optimizer_pieces(self.opt), {"param_groups": self.opt.user.state_dict()["param_groups"],
                                                    "state": {}}

    # -- a worker's generations --------------------------------------------------------------------
    def prepare_to_join(self) -> None:
        pass  # the chunks are cut when the generation forms

    def check_held(self, run_dir: str) -> None:
        """After a failure without replicas: :class:`ShardLost`, naming the way out."""
        if self.opt.replicas:
            return  # with replicas the next generation rebuilds the state (rebuild), or says why not
        try:
            self.opt.check_held()
        except ShardLost as exc:
            raise ShardLost(f"{exc} (this run's directory: {run_dir})") from None

    def rebuild(self, group: Group, progress: int, run_dir: str | None) -> None:
        """``shard_replicas=1``, a forming generation: the whole state from the chunks and
        replicas the survivors hold (a collective)."""
        if not self.opt.replicas:
            return
        try:
            rebuild_state(self.opt, group, progress)
        except ShardLost as exc:
            raise ShardLost(f"{exc} (this run's directory: {run_dir})" if run_dir else str(exc)) from None


def make_update(reduction: str, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
                shard_replicas: int = 0, cuts: Sequence[int] | None = None) -> WholeUpdate | ShardedUpdate:
    """The update ``reduction`` needs (``cuts``: where a chunk may start, the norm's blocks)."""
    if reduction == "sharded":
        return ShardedUpdate(optimizer, params, replicas=shard_replicas, cuts=cuts)
    if reduction != "allreduce":
        raise ValueError(f"reduction={reduction!r} is not known; choose 'allreduce' or 'sharded' (--reduction)")
    check("shard_replicas+allreduce", shard_replicas=shard_replicas, reduction=reduction)
    return WholeUpdate(optimizer, params)
