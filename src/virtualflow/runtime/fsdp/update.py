"""Sharded parameters' optimizer update, and their whole state when one is needed.

Purpose: :class:`FsdpUpdate` is ``reduction="fsdp"``'s update object (the role
:class:`~virtualflow.runtime.step.update.ShardedUpdate` has for the sharded optimizer state): it
owns the :class:`~virtualflow.runtime.fsdp.store.ParamStore` (the parameter shards and their
gathers), the mode's reduction (:mod:`~virtualflow.runtime.fsdp.reduce`) and an optimizer of
the user's class over *pieces*: one view per parameter of the part of it inside this worker's
shard of its unit, grouped as the user's groups (Adam, AdamW and SGD are elementwise, so a piece
steps as the whole parameter would: :func:`~virtualflow.runtime.sharded.check_optimizer`).

Invariants.

* *The whole step's norm from blocks*: a shard starts on a block of the norm
  (:func:`~virtualflow.plan.param_shards.unit_bounds`), so each owner fills its blocks' sums and
  one all-reduce (one writer per entry, exact) gives every worker the norm of the unsharded rule,
  bit for bit in deterministic mode.
* *The whole state is assembled only on request* (a checkpoint, the final state): each unit's
  shards and each optimizer state entry are sent to one rank (:meth:`FsdpUpdate.whole_state`),
  never all-gathered on every worker; a loaded whole state is held until the next generation cuts
  it (:meth:`FsdpUpdate.load`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.runtime.clipping import BLOCK
from virtualflow.runtime.fsdp.reduce import reduction_of
from virtualflow.runtime.fsdp.reshard import Prepared, Successor, hand_over, move_shards
from virtualflow.runtime.fsdp.store import ParamStore, UnitShard, to_root
from virtualflow.runtime.fsdp.units import Unit
from virtualflow.runtime.sharded import STATE_KEYS, ShardLost, elementwise, same_kind, check_optimizer
from virtualflow.runtime.step.finish import Part, StepFinish

__all__ = ["FsdpGrads", "FsdpUpdate"]

class FsdpGrads:
    """This worker's gradient shards as the step finish sees them (a HeldGradient)."""

    def __init__(self, grads: list[torch.Tensor], parts: list[Part], group: Group | None) -> None:
        self.grads, self.parts, self.group = grads, parts, group

    def norm(self, finish: StepFinish) -> torch.Tensor:
        device = self.grads[0].device if self.grads else torch.device("cpu")
        sums = finish.block_sums(self.parts, device)
        if self.group is not None and self.group.size > 1:
            self.group.all_reduce(sums)
        return finish.norm(sums)

    def release(self) -> None:
        pass


class FsdpUpdate:
    """Sharded parameters, their reduction and their optimizer on one worker (module docstring)."""

    flat = None
    shard = None
    deferred_failure = None

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, params: Sequence[torch.Tensor],
                 units: Sequence[Unit], *, deterministic: bool, device: torch.device, offload: str | None,
                 param_dtype: str | None, reduce_dtype: str, keep_gathered: bool) -> None:
        check_optimizer(optimizer, params)
        self.user = optimizer
        self.index = {id(p): i for i, p in enumerate(params)}
        """Each trainable parameter's position in the model's order (the norm's, the state's)."""
        self.order = [self.index[id(p)] for g in optimizer.param_groups for p in g["params"]]
        self.store = ParamStore(model, units, device=device, offload=offload, param_dtype=param_dtype,
                                keep_gathered=keep_gathered)
        self.reduction = reduction_of(deterministic, self.store.units, reduce_dtype)
        self.store.on_unit_done = self.reduction.unit_done
        self.full: dict[str, Any] | None = optimizer.state_dict()
        """The whole optimizer state while it is held (before the first layout, after a load)."""
        self.local: torch.optim.Optimizer | None = None
        self.pieces: list[tuple[UnitShard, int, int, int, torch.Tensor]] = []
        """(unit, parameter's index in the unit, start in the parameter, start in the shard, view)."""
        self.rank, self.size = 0, 1
        self.prepared: Prepared | None = None
        """The shards a planned change moved here, until the next layout is cut."""

    # -- layout ---------------------------------------------------------------------------------
    def cut(self, group: Group) -> None:
        """The generation's layout: this worker's shards (cut from the whole values held, moved
        here by a resize, or kept from the last generation when the layout is the same) and its
        optimizer over their pieces."""
        store, prepared = self.store, self.prepared
        same = (group.rank, group.size) == (self.rank, self.size) and store.whole is None and prepared is None
        self.rank, self.size = group.rank, group.size
        if prepared is not None:
            if (prepared.rank, prepared.size) != (group.rank, group.size):
                raise ShardLost(f"fsdp: the shards were moved for rank {prepared.rank} of {prepared.size}, but the "
                                f"generation formed with rank {group.rank} of {group.size}")
            store.recut(group.rank, group.size)
            for u, chunk in zip(store.units, prepared.mine):
                u.shard = chunk.pop("param")
            self.prepared = None
        elif store.whole is not None:
            store.cut(group.rank, group.size)
        elif not same:
            raise ShardLost("reduction='fsdp': this worker holds shards of another layout and no whole state")
        store.bind(group)
        self.reduction.bind(group)
        self._pieces()
        if prepared is not None:
            self.local = self._moved_optimizer(prepared)
            self.full = None
        elif self.full is not None:
            self.user.load_state_dict(self.full)
            self.local = self._optimizer(self.user.state)
            self.user.state.clear()
            self.full = None

    def _moved_optimizer(self, prepared: Prepared) -> torch.optim.Optimizer | None:
        """The optimizer over the new pieces, its state from the moved chunks."""
        opt = self._optimizer({})
        if opt is None:
            return None
        for u, _, _, at, view in self.pieces:
            chunk = prepared.mine[u.index]
            if chunk:
                entry = {k: v[at : at + view.numel()] for k, v in chunk.items()}  # (views: no copy)
                entry.update({k: torch.tensor(v) for k, v in prepared.scalars.items()})
                opt.state[view] = entry
        return opt

    # -- a resize -------------------------------------------------------------------------------
    def chunks(self, group: Group) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per unit, this worker's shard and its optimizer state's elementwise entries, flat and
        shard-shaped (the same keys on every member and unit: agreed over ``group``, zeros where
        a member holds no piece); and the state's scalars (Adam's ``step``, one for every piece)."""
        mine = self.local.state if self.local is not None else {}
        catalog = tuple(k for k in STATE_KEYS if k != "step")
        have = torch.zeros(len(catalog), dtype=torch.float64)
        scalars: dict[str, float] = {}
        for st in mine.values():
            for key, v in st.items():
                if key in catalog:
                    have[catalog.index(key)] = 1.0
                elif isinstance(v, torch.Tensor) and v.dim() == 0 or not isinstance(v, torch.Tensor):
                    scalars[key] = float(v)
        group.all_reduce(have)
        keys = [k for k, h in zip(catalog, have.tolist()) if h > 0]
        out = [{"param": u.shard, **{k: torch.zeros(u.hi - u.lo, dtype=u.dtype, device=u.host) for k in keys}}
               for u in self.store.units]
        for u, _, _, at, view in self.pieces:
            for key, v in mine.get(view, {}).items():
                if key in keys:
                    out[u.index][key][at : at + view.numel()].copy_(v.reshape(-1))
        return out, scalars

    def move(self, group: Group, successor: Successor | None) -> None:
        """A planned change follows this step: the shards go where the next layout wants them
        (:func:`~virtualflow.runtime.fsdp.reshard.move_shards`; collective in the old group)."""
        if successor is None or self.store.whole is not None:
            return
        chunks, scalars = self.chunks(group)
        self.prepared = move_shards(self.store.units, chunks, scalars, group, successor)

    def take_over(self, group: Group, behind: Sequence[int]) -> None:
        """The new generation, before it is cut: deputies hand newcomers (ranks ``behind``) their
        shards, which a newcomer then holds as its prepared layout. Collective over ``group``."""
        catalog = ("param",) + tuple(k for k in STATE_KEYS if k != "step")
        info = torch.zeros(len(catalog) + 2, dtype=torch.float64)
        if self.prepared is not None and group.rank not in behind:  # every survivor alike
            have = self.prepared.mine[0].keys() if self.prepared.mine else {"param"}
            info[: len(catalog)] = torch.tensor([float(k in have) for k in catalog], dtype=torch.float64)
            if "step" in self.prepared.scalars:
                info[-2], info[-1] = 1.0, self.prepared.scalars["step"]
        group.all_reduce(info)
        info /= max(1, group.size - len(behind))
        keys = [k for k, v in zip(catalog, info.tolist()) if v > 0.5]
        got = hand_over(self.store.units, group, self.prepared, behind, keys)
        if got is not None:
            self.prepared = Prepared(group.rank, group.size, got, {"step": info[-1].item()} if info[-2] > 0.5 else {})

    def _pieces(self) -> None:
        self.pieces = []
        for u in self.store.units:
            for k, (o, n) in enumerate(zip(u.offsets, u.numels)):
                a, b = max(u.lo, o), min(u.hi, o + n)
                if a < b:
                    self.pieces.append((u, k, a - o, a - u.lo, u.shard[a - u.lo : b - u.lo]))

    def _optimizer(self, state: Any) -> torch.optim.Optimizer | None:
        """An optimizer of the user's kind over this worker's pieces, its state sliced from
        ``state`` (the user's optimizer's, keyed by parameter)."""
        by_param = {id(u.params[k]): (start, view) for u, k, start, _, view in self.pieces}
        groups = []
        for g in self.user.param_groups:
            views = [by_param[id(p)][1] for p in g["params"] if id(p) in by_param]
            if views:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        if not groups:
            return None
        opt = same_kind(self.user, groups)
        for p, st in state.items():
            if id(p) not in by_param:
                continue
            start, view = by_param[id(p)]
            opt.state[view] = {k: (v.reshape(-1)[start : start + view.numel()].to(view.device, copy=True)
                                   if elementwise(v, p) else v) for k, v in st.items()}
        return opt

    # -- a step ---------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        pass  # each VN's gradients are taken from .grad by the reduction, unit by unit

    @property
    def keeps_gradient(self) -> bool:
        return False

    def held(self, flat_sum: torch.Tensor | None, group: Group | None) -> FsdpGrads:
        grads = self.reduction.grads
        parts = [Part(self.index[id(u.params[k])], u.params[k], grads[u.index][at : at + view.numel()], start // BLOCK)
                 for u, k, start, at, view in self.pieces]
        return FsdpGrads([g for g in grads if g.numel()], parts, group)

    def apply(self, scheduler: Any, group: Group | None = None, comm: Any = None,
              point: Callable[[str], None] | None = None, phase: Callable[[str], None] | None = None) -> None:
        """Step this worker's pieces with their reduced gradient, then the LR scheduler."""
        grads = self.reduction.grads
        if self.local is not None:
            k = 0
            owned = {id(u.params[i]) for u, i, *_ in self.pieces}
            for g in self.user.param_groups:  # an LR scheduler edits the user's groups
                if any(id(p) in owned for p in g["params"]):
                    for key, value in g.items():
                        if key != "params":
                            self.local.param_groups[k][key] = value
                    k += 1
            for u, _, _, at, view in self.pieces:
                view.grad = grads[u.index][at : at + view.numel()]
            self.local.step()
            for *_, view in self.pieces:
                view.grad = None
        if scheduler is not None:
            from virtualflow.runtime.sharded import ShardedOptimizer
            ShardedOptimizer.scheduler_step(scheduler)

    def raise_deferred(self) -> None:
        pass

    # -- the whole state ------------------------------------------------------------------------
    def gather_state(self, comm: Any, group: Group | None, root: int | None = 0) -> dict[str, Any] | None:
        """The whole optimizer state in the user's format on ``root`` (collective), None elsewhere."""
        if self.full is not None:
            return self.full
        assert group is not None and root is not None
        mine = self.local.state if self.local is not None else {}
        n = len(self.index)
        info = torch.zeros(len(STATE_KEYS) + 1, n, dtype=torch.float64)
        for u, k, start, _, view in self.pieces:
            if start:
                continue
            i = self.index[id(u.params[k])]
            for key, v in mine.get(view, {}).items():
                info[STATE_KEYS.index(key), i] = 1.0
                if key == "step":
                    info[-1, i] = float(v)
        if group.size > 1:
            group.all_reduce(info)
        state: dict[int, dict[str, Any]] = {i: {} for i in range(n)}
        for j, key in enumerate(STATE_KEYS):
            have = info[j] > 0
            if not bool(have.any()):
                continue
            if key == "step":
                for i in torch.nonzero(have).flatten().tolist():
                    state[i]["step"] = torch.tensor(info[-1, i].item(), dtype=torch.float32)
                continue
            for u in self.store.units:
                chunk = torch.zeros(u.hi - u.lo, dtype=u.dtype, device=u.host)
                for v_u, k, _, at, view in self.pieces:
                    value = mine.get(view, {}).get(key) if v_u is u else None
                    if value is not None:
                        chunk[at : at + view.numel()].copy_(value.reshape(-1))
                whole = to_root(group, root, chunk, u)
                if whole is None:
                    continue
                for k, (p, o, m) in enumerate(zip(u.params, u.offsets, u.numels)):
                    if bool(have[self.index[id(p)]]):
                        state[self.index[id(p)]][key] = whole[o : o + m].view(p.shape).clone()
        if group.rank != root:
            return None
        return {"state": {pos: state[i] for pos, i in enumerate(self.order) if state.get(i)},
                "param_groups": self.user.state_dict()["param_groups"]}

    def state(self) -> dict[str, Any]:
        if self.full is None:
            raise RuntimeError("reduction='fsdp': the optimizer state is spread over the workers; gather_state() "
                               "(a collective) first")
        return self.full

    def load_state(self, state: dict[str, Any]) -> None:
        """Hold a whole optimizer state (the user's format) until the next layout is cut."""
        self.user.load_state_dict(state)
        self.full = self.user.state_dict()
        self.user.state.clear()
        self.local = None

    def load_model(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Hold a whole model state: the parameters' values per unit, the buffers loaded now."""
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.store.hold_whole([[state[names[id(p)]] for p in u.params] for u in self.store.units])
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name in state:
                    buf.copy_(state[name])

    # -- bookkeeping ----------------------------------------------------------------------------
    def state_bytes(self) -> int:
        held = self.local.state.values() if self.local is not None else []
        return sum(v.numel() * v.element_size() for st in held for v in st.values() if isinstance(v, torch.Tensor))

    def replica_bytes(self) -> int:
        return 0

    def prepare_to_join(self) -> None:
        pass

    def check_held(self, run_dir: str) -> None:
        """After a failure: a lost member's shards are gone (one copy each): ShardLost."""
        if self.store.whole is None and self.prepared is None:
            raise ShardLost("reduction='fsdp' keeps one copy of each parameter shard, and a member holding one "
                            "failed, so the model cannot be rebuilt in place. Resume from the last checkpoint "
                            f"(--resume {run_dir}; keep --checkpoint-every small)")

    def rebuild(self, group: Group, progress: int, run_dir: str | None) -> None:
        pass

    def before_regroup(self, comm: Any, group: Group | None) -> None:
        pass  # a resize moves the shards (runtime/fsdp/reshard.py)

    def checkpoint_pieces(self, rank: int, size: int) -> tuple[list, dict[str, Any]]:
        raise NotImplementedError
