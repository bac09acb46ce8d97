"""The sharded optimizer of the virtual node engine (``reduction="sharded"``, ZeRO stage 1).

With the default reduction every worker all-reduces the whole gradient and applies the whole
update, holding the whole optimizer state. The sharded reduction splits that all-reduce into its
two halves and moves the update between them (CoCoNeT's split + reorder rewrite of a
data-parallel step, see :mod:`virtualflow.plan.comm`):

1. **reduce-scatter** the gradient: worker r of p receives the sum of everyone's gradient for
   its chunk ``[lo_r, hi_r)`` of the flat parameter vector (:func:`virtualflow.plan.shards.
   shard_bounds`), in buckets launched as backward finishes them;
2. **update the chunk**: an optimizer of the user's class and hyperparameters steps views of the
   chunk, so worker r holds only its chunk's optimizer state (Adam's two moments: memory ÷ p);
3. **all-gather** the parameters: every worker again holds the whole model before the next
   forward.

Invariants.

* *Same model.* Adam, AdamW and SGD (with or without momentum) are elementwise: the update of an
  element depends on that element's gradient and state only, and the CPU kernels give the same
  bits on a slice as on the whole tensor (measured on torch 2.13 for slices at any offset). So
  the deterministic engine's sharded run is bit-identical to its all-reduce run, and the default
  engine's equal within float tolerance (the ring sums in another order). Optimizers whose update
  is not elementwise (LAMB, LARS, Adafactor, anything with a norm over a tensor) would change the
  model and are refused (:func:`check_optimizer`).
* *Parameters live in one flat buffer.* Each trainable parameter's ``.data`` is re-pointed into
  one flat vector and its ``.grad`` into another, so a bucket or a chunk is a contiguous range;
  ``model.state_dict()``, ``load_state_dict`` and the user's own optimizer see ordinary tensors.
* *The user's optimizer stays the source of hyperparameters.* Its ``param_groups`` (which an LR
  scheduler edits) are copied into the chunk's optimizer before each update; the user's object
  itself never steps and so holds no state.
* *The whole state is reassembled only when needed*: for a checkpoint or the final state (an
  all-gather of each state tensor, :meth:`ShardedOptimizer.gather_state`), and at a planned
  membership change, where every member gathers it in the old generation and slices it again by
  the new generation's chunks, so a resize loses no optimizer state. A *failure* loses the failed
  worker's chunk of the optimizer state (there is one copy of each chunk): the job stops with
  :class:`ShardLost`, naming the checkpoint to resume from.
* *With ``shard_replicas=1``* each worker also keeps a replica of its predecessor's chunk (rank
  r holds chunk r-1 mod p, :class:`ChunkReplica`) and steps it with the predecessor's reduced
  gradient, so a failure loses no chunk unless two neighbours in ring order fail together; the
  commit rule and the rebuild are in :mod:`virtualflow.runtime.shard_replica`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from virtualflow.plan.shards import Bounds, shard_bounds

if TYPE_CHECKING:
    from virtualflow.comm.groups import Group
    from virtualflow.comm.ring import Collectives

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
ALIGN = 16
"""Chunk boundaries fall on multiples of this many elements (a vector width)."""


class ShardLost(RuntimeError):
    """A member holding a chunk of the optimizer state failed; the state cannot be rebuilt in place."""


def check_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``optimizer`` can be sharded over ``params`` (the model's
    trainable parameters) without changing the model."""
    if type(optimizer) not in SUPPORTED:
        base = next((c for c in SUPPORTED if isinstance(optimizer, c)), None)
        if base is not None:
            raise ValueError(
                f"reduction='sharded' updates each worker's slice of the parameters with a {base.__name__} of the "
                f"user's hyperparameters, so a subclass's own step() ({type(optimizer).__name__}) never runs: a "
                f"subclass that clips gradients in step() would clip each slice by its own norm. Use the plain "
                f"torch.optim.{base.__name__} and Job.max_grad_norm (--max-grad-norm), which clips by the whole "
                f"step's gradient norm, or reduction='allreduce'")
        raise ValueError(
            f"reduction='sharded' updates each worker's slice of the parameters separately, which gives the "
            f"same model only for optimizers whose update is elementwise: torch.optim.Adam, AdamW and SGD; "
            f"Job.optimizer built {type(optimizer).__module__}.{type(optimizer).__name__}. Use one of those, "
            f"or the default reduction='allreduce' (--reduction allreduce)")
    if any(g.get("fused") for g in optimizer.param_groups):
        pass  # fused kernels are elementwise too
    dtypes = sorted({str(p.dtype) for p in params})
    devices = sorted({str(p.device) for p in params})
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"reduction='sharded' keeps the trainable parameters in one flat buffer, so they must share "
                         f"one dtype and device; the model has dtypes {dtypes} on {devices}. Cast the model, or use "
                         f"reduction='allreduce'")
    ids = {id(p) for p in params}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in ids:
                raise ValueError("reduction='sharded': Job.optimizer holds a tensor that is not a trainable parameter "
                                 "of the model (requires_grad=True); give it model.parameters() (or groups of them)")


class FlatParams:
    """The trainable parameters as views of one flat vector, their gradients of another."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.offsets: list[int] = []
        n = 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        p0 = self.params[0]
        self.flat = torch.empty(n, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(n, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                self.flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[o : o + p.numel()].view_as(p)
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every ``p.grad`` into the flat gradient (autograd then accumulates into it)."""
        for p, o in zip(self.params, self.offsets):
            p.grad = self.grad[o : o + p.numel()].view_as(p)

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, o in zip(self.params, self.offsets):
            g = p.grad
            if g is None or g.data_ptr() != self.grad[o:].data_ptr():
                self.attach_grads()  # someone replaced a .grad (e.g. zero_grad(set_to_none=True))
                break

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(param index, start in param, end in param)`` for each parameter meeting ``[lo, hi)``."""
        out = []
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                out.append((i, a - o, b - o))
        return out


class ShardedOptimizer:
    """The chunk of the optimizer one worker holds, and the whole state when it must be moved."""

    def __init__(self, optimizer: torch.optim.Optimizer, flat: FlatParams, align: int = ALIGN,
                 replicas: int = 0, cuts: Sequence[int] | None = None) -> None:
        check_optimizer(optimizer, flat.params)
        if replicas not in (0, 1):
            raise ValueError(f"shard_replicas={replicas!r} must be 0 (one copy of each chunk of the optimizer state) "
                             f"or 1 (a replica on the next worker too) (--shard-replicas)")
        self.replicas = replicas
        """``shard_replicas``: 1 keeps a :class:`ChunkReplica` of the predecessor's chunk."""
        self.replica: ChunkReplica | None = None
        self.pending = False
        """A step's gradients are exchanged for the replica but the step is not applied yet (a
        failure now leaves it to the rebuild to finish or drop, see :mod:`~virtualflow.runtime.shard_replica`)."""
        self.finished = False
        """A pending step was applied while the state was being rebuilt (reset when the next
        generation cuts the state, or a transfer replaces it)."""
        self.generation = -1
        """The generation whose layout (``rank`` of ``size``) the chunks held are cut by."""
        self.size = 1
        self.user = optimizer
        self.flat = flat
        self.align = align
        """Chunk boundaries fall on multiples of this (:data:`ALIGN`), then on :attr:`cuts`."""
        self.cuts = list(cuts) if cuts is not None else None
        """Where a chunk may start (``None``: anywhere): the clipping norm's blocks when the norm is
        taken (:meth:`virtualflow.runtime.clipping.NormBlocks.cuts`), so no block straddles two
        workers."""
        self.index = {id(p): i for i, p in enumerate(flat.params)}
        self.order = [self.index[id(p)] for g in optimizer.param_groups for p in g["params"]]
        """Parameter index of each position of the user's ``state_dict`` (its state is keyed so)."""
        self.bounds: Bounds | None = None
        self.rank = 0
        self.local: torch.optim.Optimizer | None = None
        self.pieces: dict[int, tuple[int, torch.Tensor]] = {}
        """Parameter index -> (flat offset, view) of this worker's part of it (what ``local`` steps)."""
        self.full: dict[str, Any] | None = optimizer.state_dict()
        """The whole optimizer state (the user's optimizer's ``state_dict`` format) while it is held
        entirely: before the first generation, after a load, after a planned regroup's gather."""

    @property
    def holds_full(self) -> bool:
        return self.full is not None

    def chunk(self) -> tuple[int, int]:
        assert self.bounds is not None, "shard() first"
        return self.bounds[self.rank]

    # -- layout ---------------------------------------------------------------------------------
    def bounds_for(self, size: int) -> Bounds:
        """The chunks of ``size`` workers (:func:`~virtualflow.plan.shards.shard_bounds`)."""
        return shard_bounds(self.flat.numel, size, self.align, self.cuts)

    def check_held(self) -> None:
        """Raise :class:`ShardLost` unless the whole state is held (it is after a planned
        regroup's gather, a load or at the start; it is not after a failure)."""
        if self.full is None:
            raise ShardLost(
                "reduction='sharded' keeps one copy of each chunk of the optimizer state, and a member holding one "
                "failed (or left without handing it over), so the state cannot be rebuilt in place. Resume from "
                "the last checkpoint (--resume RUN_DIR; keep --checkpoint-every small), or train with "
                "reduction='allreduce', which recovers from failures in place")

    def shard(self, rank: int, size: int, generation: int = -1) -> None:
        """Take chunk ``rank`` of ``size`` out of the whole state held (a new generation); with
        ``replicas``, chunk ``rank - 1`` too, as this worker's replica of its predecessor's."""
        self.check_held()
        self.bounds = self.bounds_for(size)
        self.rank, self.size, self.generation = rank, size, generation
        self.user.load_state_dict(self.full)  # hyperparameters, and the whole state for a moment
        self.pieces, self.local = self._chunk_optimizer(*self.bounds[rank])
        self.replica = None
        if self.replicas and size > 1:
            q = (rank - 1) % size
            lo, hi = self.bounds[q]
            # Its parameters are views of the gradient buffer, free outside this worker's chunk
            # once the gradient is reduced: the replica steps a copy of the predecessor's
            # parameters there while the all-gather writes the real ones.
            pieces, opt = self._chunk_optimizer(lo, hi, base=self.flat.grad)
            self.replica = ChunkReplica(q, lo, hi, pieces, opt, self.flat.grad.new_zeros(hi - lo))
        self.user.state.clear()  # the user's optimizer holds no state: memory ÷ p
        self.full = None
        self.pending = self.finished = False

    def _chunk_optimizer(self, lo: int, hi: int, base: torch.Tensor | None = None
                         ) -> tuple[dict[int, tuple[int, torch.Tensor]], torch.optim.Optimizer | None]:
        """An optimizer of the user's kind over views of ``base[lo:hi]`` (default: the flat
        parameters; one view per parameter piece, grouped as the user's groups), its state sliced
        from the user's (loaded) state."""
        base = self.flat.flat if base is None else base
        pieces, groups = {}, []
        for g in self.user.param_groups:
            group_pieces = []
            for p in g["params"]:
                i = self.index[id(p)]
                o = self.flat.offsets[i]
                a, b = max(lo, o), min(hi, o + p.numel())
                if a < b:
                    view = base[a:b]
                    pieces[i] = (a, view)
                    group_pieces.append(view)
            if group_pieces:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": group_pieces})
        opt = same_kind(self.user, groups) if groups else None
        if opt is not None:
            for p, st in self.user.state.items():
                i = self.index[id(p)]
                if i not in pieces:
                    continue
                a, view = pieces[i]
                start = a - self.flat.offsets[i]
                opt.state[view] = {
                    k: (v.reshape(-1)[start : start + view.numel()].clone() if elementwise(v, p) else _copy(v))
                    for k, v in st.items()
                }
        return pieces, opt

    # -- the update -----------------------------------------------------------------------------
    def step(self) -> None:
        """Update this worker's chunk from the reduced gradient in ``flat.grad[lo:hi]``, and the
        replica (if any) from the predecessor's, received into ``replica.grad``: the replica's
        new parameters land in ``flat`` too (what the all-gather would bring)."""
        self.load_replica_params()
        self.step_own()
        self.step_replica()
        self.store_replica_params()

    def step_own(self) -> None:
        """Update this worker's chunk (the engine's order: before the all-gather is launched)."""
        self._step_chunk(self.local, self.pieces, lambda a, n: self.flat.grad[a : a + n])
        self.pending = False

    def load_replica_params(self) -> None:
        """Copy the predecessor's chunk of the parameters, before the step, to where the replica
        steps them (``flat.grad`` at the chunk: free once the gradient is reduced)."""
        r = self.replica
        if r is not None:
            self.flat.grad[r.lo : r.hi].copy_(self.flat.flat[r.lo : r.hi])

    def step_replica(self) -> None:
        """Step the replica with the predecessor's gradient (:meth:`load_replica_params` first;
        it may run while the all-gather writes the parameters)."""
        r = self.replica
        if r is not None:
            self._step_chunk(r.optimizer, r.pieces, lambda a, n: r.grad[a - r.lo : a - r.lo + n])

    def store_replica_params(self) -> None:
        """The replica's new parameters into ``flat`` (the all-gather failed, or none runs)."""
        r = self.replica
        if r is not None:
            self.flat.flat[r.lo : r.hi].copy_(self.flat.grad[r.lo : r.hi])

    def _step_chunk(self, opt: torch.optim.Optimizer | None, pieces: dict[int, tuple[int, torch.Tensor]],
                    grad: Callable[[int, int], torch.Tensor]) -> None:
        if opt is None:
            return
        k = 0
        for g in self.user.param_groups:
            if not any(self.index[id(p)] in pieces for p in g["params"]):
                continue
            for key, value in g.items():  # an LR scheduler edits the user's groups
                if key != "params":
                    opt.param_groups[k][key] = value
            k += 1
        for a, view in pieces.values():
            view.grad = grad(a, view.numel())
        opt.step()
        for _, view in pieces.values():
            view.grad = None

    @staticmethod
    def scheduler_step(scheduler: Any) -> None:
        """``scheduler.step()`` without torch's warning that the user's optimizer never stepped
        (the chunk's optimizer did, with the user's learning rate)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()

    # -- moving the whole state -----------------------------------------------------------------
    def gather_state(self, gather: Callable[[torch.Tensor], torch.Tensor | None],
                     all_reduce: Callable[[torch.Tensor], None]) -> dict[str, Any] | None:
        """The whole optimizer state, in the user's optimizer's ``state_dict`` format.

        ``gather(chunk)`` takes this member's chunk of a flat vector cut like the parameters and
        returns the whole vector where the state is wanted (every member for an all-gather, the
        writer of a checkpoint for a gather to one member) and ``None`` elsewhere; members where
        it returned ``None`` get ``None`` (they never hold more than their chunk). ``all_reduce``
        sums a small vector over the members. Every member calls this at the same point. Which
        parameter has which entry, and scalar entries (Adam's ``step``), come from the member
        owning the parameter's first element.
        """
        if self.full is not None:
            return self.full
        flat, n = self.flat.flat, len(self.flat.params)
        lo, hi = self.chunk()
        mine = self.local.state if self.local is not None else {}
        owned = [i for i, (a, _) in self.pieces.items() if a == self.flat.offsets[i]]
        info = torch.zeros(len(_STATE_KEYS) + 1, n, dtype=torch.float64, device=flat.device)
        step_dtype = None
        for i in owned:
            for key, v in mine.get(self.pieces[i][1], {}).items():
                if key not in _STATE_KEYS:
                    raise ValueError(f"reduction='sharded' cannot move optimizer state {key!r} of "
                                     f"{type(self.user).__name__}")
                info[_STATE_KEYS.index(key), i] = 1.0
                if key == "step":
                    info[-1, i] = float(v)
                    step_dtype = v.dtype if isinstance(v, torch.Tensor) else None
        all_reduce(info)
        if step_dtype is None:
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state: dict[int, dict[str, Any]] = {i: {} for i in range(n)}
        wanted = True
        for j, key in enumerate(_STATE_KEYS):
            have = info[j] > 0
            if not bool(have.any()):
                continue
            if key == "step":
                for i in torch.nonzero(have).flatten().tolist():
                    state[i]["step"] = torch.tensor(info[-1, i].item(), dtype=step_dtype)
                continue
            chunk = torch.zeros(hi - lo, dtype=flat.dtype, device=flat.device)
            for i, (a, view) in self.pieces.items():
                value = mine.get(view, {}).get(key)
                if value is not None:
                    chunk[a - lo : a - lo + view.numel()].copy_(value.reshape(-1))
            whole = gather(chunk)
            if whole is None:
                wanted = False
                continue
            for i in torch.nonzero(have).flatten().tolist():
                p, o = self.flat.params[i], self.flat.offsets[i]
                state[i][key] = whole[o : o + p.numel()].view_as(p).clone()
        if not wanted:
            return None
        return self.assemble(state)

    def assemble(self, state: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The user's optimizer's ``state_dict`` from each parameter's state (parameter index ->
        entries) and the user's hyperparameters."""
        groups = self.user.state_dict()["param_groups"]
        return {"state": {pos: state[i] for pos, i in enumerate(self.order) if state.get(i)}, "param_groups": groups}

    def load_state(self, state_dict: dict[str, Any]) -> None:
        """Hold ``state_dict`` (the user's optimizer's format) entirely until the next :meth:`shard`."""
        self.user.load_state_dict(state_dict)  # validates it and casts as torch does
        self.full = self.user.state_dict()
        self.user.state.clear()
        self.local, self.pieces, self.replica, self.pending, self.finished = None, {}, None, False, False

    def keep_full(self, state_dict: dict[str, Any]) -> None:
        """Hold the whole state just gathered (a planned membership change follows) or rebuilt."""
        self.full = state_dict
        self.local = None
        self.pieces = {}
        self.replica = None
        self.pending = False  # (finished stays until the next generation is cut: see shard_replica)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds."""
        return _state_bytes(self.local)

    def replica_bytes(self) -> int:
        """Bytes the replica of the predecessor's chunk costs this worker (``shard_replicas=1``):
        its optimizer state and the buffer its gradient arrives in."""
        r = self.replica
        return 0 if r is None else _state_bytes(r.optimizer) + r.grad.numel() * r.grad.element_size()


@dataclass(slots=True)
class ChunkReplica:
    """This worker's copy of its predecessor's chunk of the optimizer state (``shard_replicas=1``).

    Its optimizer is of the user's kind over views cut as the owner's are, of ``flat.grad[lo:hi]``
    (free outside this worker's chunk once the gradient is reduced), where a copy of the chunk's
    parameters is stepped while the all-gather brings the owner's: stepped with the owner's reduced
    gradient, it holds the owner's state and parameters bit for bit (the update is elementwise and
    runs the same kernels on the same shapes and values)."""

    rank: int
    """The owner's rank in the generation the chunks are cut by."""
    lo: int
    hi: int
    pieces: dict[int, tuple[int, torch.Tensor]]
    optimizer: torch.optim.Optimizer | None
    grad: torch.Tensor
    """The owner's reduced gradient of the step being applied (``hi - lo`` elements)."""


def _state_bytes(opt: torch.optim.Optimizer | None) -> int:
    held = opt.state.values() if opt is not None else []
    return sum(v.numel() * v.element_size() for st in held for v in st.values() if isinstance(v, torch.Tensor))


STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
"""The optimizer state entries the sharded optimizer can move (Adam, AdamW, SGD)."""
_STATE_KEYS = STATE_KEYS


GATHER_TAG = 17
"""Point-to-point tag of a sharded optimizer state's gather to one member (the ring's own tags
start at 2**30, so they never meet)."""


def gather_sharded_state(shard: ShardedOptimizer, comm: Collectives, group: Group,
                         root: int | None = None) -> dict[str, Any] | None:
    """Collective (every member calls it at the same point): the whole optimizer state from every
    member's chunk, delivered to every member (``root`` None, an all-gather over ``comm``) or only
    to rank ``root`` (the others get ``None`` and never hold more than their chunk)."""
    bounds = shard.bounds
    lo, hi = shard.chunk()

    def everywhere(chunk: torch.Tensor) -> torch.Tensor:
        whole = chunk.new_zeros(shard.flat.numel)
        whole[lo:hi].copy_(chunk)
        comm.all_gather(whole, bounds)
        return whole

    def to_root(chunk: torch.Tensor) -> torch.Tensor | None:
        if group.size == 1:
            return chunk
        if group.rank != root:
            if chunk.numel():
                group.send(chunk, root, tag=GATHER_TAG)
            return None
        whole = chunk.new_zeros(shard.flat.numel)
        whole[lo:hi].copy_(chunk)
        works = [group.irecv(whole[a:b], q, tag=GATHER_TAG) for q, (a, b) in enumerate(bounds)
                 if q != root and b > a]
        for w in works:
            w.wait()
        return whole

    return shard.gather_state(everywhere if root is None else to_root, group.all_reduce)


def same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (each carrying all its hyperparameters),
    built with the defaults its constructor accepts (AdamW's defaults name one it does not)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def elementwise(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == p.shape and p.numel() > 0 and v.dim() > 0


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
