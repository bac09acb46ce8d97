"""Sharded parameters on one worker: each unit's shard, gathered for its use and freed after.

Purpose: :class:`ParamStore` holds, for every sharding unit (:mod:`~virtualflow.runtime.fsdp.units`),
this worker's shard of the unit's parameters (the master copy, in the parameters' dtype, on the
host with ``offload="cpu"``) and the unit's *gather buffer*: one flat tensor of the whole unit
whose storage is allocated only while the unit is gathered. Every parameter's ``.data`` is a view
of its unit's gather buffer, set once; freeing a unit resizes the buffer's storage to nothing
(the parameter objects, the optimizer's and autograd's references to them stay valid), gathering
it resizes the storage back and all-gathers the shards into it (as FSDP2 does).

When units are gathered and freed is decided by module hooks installed once:

* the root unit (every parameter outside the unit modules: embeddings, the head) is gathered by
  the model's forward pre-hook and stays gathered until the VN's backward is over;
* a unit is gathered before its forward (its gather was issued as the previous unit's forward
  began: prefetch) and, unless ``keep_gathered``, freed after it;
* a freed unit is gathered again when the gradient reaches its outputs (a hook on them), and the
  next unit of the backward order is prefetched;
* once all its parameters' gradients are accumulated (a post-accumulate hook each; the engine
  flushes units left incomplete at the end of the backward), its gradient is handed to the
  reduction (:mod:`~virtualflow.runtime.fsdp.reduce`) in a fixed order and the unit is freed.

Invariants.

* *Every worker issues the same collectives in the same order*: gathers on one
  :class:`~virtualflow.comm.ring.Collectives` lane, in the forward order then the backward order
  (a hook that fires early issues every earlier gather of its order first); reductions on
  another lane, in the fixed backward order (units reversed, the root last), whatever order
  autograd finishes them in. A worker with no VN in a round runs a *ghost* VN (a real forward and
  backward whose gradient counts as zeros), so it takes part in the same collectives.
* *The same parameters*: a gathered unit holds exactly the master shards' values (in
  ``param_dtype`` when it is set: then rounded once, as autocast would round them for a matmul).
* *Hooks act only while the store is active* (training steps); an evaluation on the whole model
  gathers every unit first (:meth:`gather_all`) with the hooks off.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from virtualflow.comm.groups import Group
from virtualflow.comm.ring import Collectives, Handle
from virtualflow.plan.param_shards import unit_bounds
from virtualflow.runtime.fsdp.units import Unit

__all__ = ["DTYPES", "ParamStore", "UnitShard", "to_root"]

GATHER_TAG = 19
"""Point-to-point tag of a unit's gather to one rank."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class State(enum.Enum):
    FREE = 0
    PENDING = 1
    READY = 2


class UnitShard:
    """One unit on this worker: its layout, master shard and gather buffer."""

    def __init__(self, index: int, unit: Unit, gather_dtype: torch.dtype, device: torch.device,
                 host: torch.device) -> None:
        self.index, self.unit = index, unit
        self.name, self.module, self.params = unit.name, unit.module, unit.params
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.dtype = self.params[0].dtype
        """The master shard's dtype (the parameters' as built)."""
        self.full = torch.empty(self.numel, dtype=gather_dtype, device=device)
        """The gather buffer (its storage is empty while the unit is free)."""
        self.host = host
        self.shard = torch.empty(0, dtype=self.dtype, device=host)
        """This worker's elements ``[lo, hi)`` of the unit (the master copy the optimizer steps)."""
        self.bounds: list[tuple[int, int]] = [(0, self.numel)]
        self.lo, self.hi = 0, self.numel
        self.state = State.READY
        self.handle: Handle | None = None
        self.grad: torch.Tensor | None = None
        """While the unit's backward runs: its flat gradient (:meth:`attach_grads`)."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.full.element_size()

    def point_params(self) -> None:
        """Every parameter's ``.data`` a view of the gather buffer (done once per layout)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            p.data = self.full[o : o + n].view(p.shape)

    def cut(self, rank: int, size: int, whole: Sequence[torch.Tensor] | None) -> None:
        """This worker's shard of ``size``: copied out of ``whole`` (each parameter's values,
        flat) or left empty, to be filled by a resize's moves."""
        self.bounds = unit_bounds(self.numels, size)
        self.lo, self.hi = self.bounds[rank]
        if whole is None:
            return
        self.shard = torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.host)
        for v, o, n in zip(whole, self.offsets, self.numels):
            a, b = max(self.lo, o), min(self.hi, o + n)
            if a < b:
                self.shard[a - self.lo : b - self.lo].copy_(v[a - o : b - o])

    def attach_grads(self) -> None:
        """A zeroed flat gradient for the unit, its parameters' ``.grad`` views of it: autograd
        adds each gradient in place (``0 + g``: ``g``'s value, but that ``-0.0`` becomes
        ``0.0``, which no sum, norm or optimizer state can tell apart), and the unit's gradient is
        then one vector, reduced without a copy."""
        self.grad = torch.zeros(self.numel, dtype=self.full.dtype, device=self.full.device)
        for p, o, n in zip(self.params, self.offsets, self.numels):
            p.grad = self.grad[o : o + n].view(p.shape)

    def take_grad(self) -> torch.Tensor:
        """The unit's gradient of the VN just run, flat (a parameter without one: zeros); the
        parameters' ``.grad`` are dropped."""
        grad = self.grad
        if grad is None:  # (no hook attached it: gathered from the parameters)
            grad = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                              for p in self.params])
        for p in self.params:
            p.grad = None
        self.grad = None
        return grad

    def own_buffer(self) -> None:
        """A gather buffer this unit may resize: one whose storage was exported (a checkpoint's
        digest reads rank 0's gathered values through numpy, which pins the storage) is left to
        its holders and replaced by a new one."""
        if not self.full.untyped_storage().resizable():
            self.full = torch.empty(self.numel, dtype=self.full.dtype, device=self.full.device)
            self.point_params()

    def free(self) -> None:
        if self.state is State.PENDING and self.handle is not None:
            self.handle.wait()
        self.own_buffer()
        self.full.untyped_storage().resize_(0)
        self.state, self.handle = State.FREE, None

    def issue(self, gathers: Collectives | None) -> None:
        """Allocate the buffer, put this worker's shard in place and start the all-gather."""
        if self.state is not State.FREE:
            return
        self.own_buffer()
        self.full.untyped_storage().resize_(self.nbytes)
        with torch.no_grad():
            self.full[self.lo : self.hi].copy_(self.shard)
        if gathers is None:  # one worker: the shard is the unit
            self.state = State.READY
            return
        self.handle = gathers.all_gather(self.full, self.bounds, async_op=True)
        self.state = State.PENDING

    def ready(self) -> None:
        if self.state is State.PENDING:
            assert self.handle is not None
            self.handle.wait()
            self.handle = None
        self.state = State.READY


class ParamStore:
    """Every unit's shard on this worker and the hooks that gather and free them (see the module
    docstring)."""

    def __init__(self, model: torch.nn.Module, units: Sequence[Unit], *, device: torch.device,
                 offload: str | None, param_dtype: str | None, keep_gathered: bool) -> None:
        self.model = model
        host = torch.device("cpu") if offload == "cpu" else device
        self.units = [UnitShard(i, u, DTYPES[param_dtype] if param_dtype else u.params[0].dtype, device, host)
                      for i, u in enumerate(units)]
        self.root: UnitShard | None = next((u for u in self.units if u.module is None), None)
        self.blocks = [u for u in self.units if u.module is not None]
        """The unit modules' shards, in forward order (the root is not one of them)."""
        self.keep_gathered = keep_gathered
        self.unit_of: dict[int, UnitShard] = {id(p): u for u in self.units for p in u.params}
        self.gathers: Collectives | None = None
        self.active = False
        """Hooks act only while training steps run."""
        self.on_unit_done: Callable[[UnitShard], None] | None = None
        """Called in the fixed reduction order with each unit whose gradient is complete."""
        self.reduce_order = list(reversed(self.blocks)) + ([self.root] if self.root is not None else [])
        self._cursor = {"forward": 0, "backward": 0}
        self._done: set[int] = set()
        self._next_reduce = 0
        self._counts: dict[int, int] = {}
        self.whole: list[list[torch.Tensor]] | None = [[p.detach().reshape(-1) for p in u.params]
                                                       for u in self.units]
        """Per unit, each parameter's whole values (flat) while they are held: the model as built
        (its own tensors, no copy) before the first layout is cut, a loaded state; None while
        this worker holds its shards only."""
        for u in self.units:
            u.point_params()
            u.free()
        self._install_hooks()

    # -- layout ---------------------------------------------------------------------------------
    def hold_whole(self, values: Sequence[Sequence[torch.Tensor]]) -> None:
        """Hold every unit's whole values (per unit, each parameter's, any shape) until the next
        :meth:`cut`: a loaded checkpoint, a transferred state."""
        self.whole = [[v.reshape(-1).to(u.host, u.dtype) for v in vs] for u, vs in zip(self.units, values)]

    def cut(self, rank: int, size: int) -> None:
        """Take this worker's shards of ``size`` workers out of the whole values held."""
        assert self.whole is not None, "hold_whole() first"
        for u, whole in zip(self.units, self.whole):
            u.cut(rank, size, whole)
        self.whole = None  # (the model's own tensors as built go now)
        release_freed_memory()

    def recut(self, rank: int, size: int) -> None:
        """A new layout whose shards a resize fills (:mod:`~virtualflow.runtime.fsdp.reshard`)."""
        for u in self.units:
            u.cut(rank, size, None)
        self.whole = None

    def bind(self, group: Group) -> None:
        """This generation's gather lane (lane 0 of the group)."""
        self.close()
        self.gathers = Collectives(group) if group.size > 1 else None

    def close(self) -> None:
        if self.gathers is not None:
            self.gathers.close(timeout_s=1.0)
            self.gathers = None

    def shard_bytes(self) -> int:
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units)

    def largest_units(self, k: int = 2) -> int:
        """Bytes of the ``k`` largest gather buffers (what prefetch may hold at once)."""
        return sum(sorted((u.nbytes for u in self.units), reverse=True)[:k])

    # -- whole model for evaluation, checkpoints, the final state ------------------------------
    def gather_all(self) -> None:
        """Every unit gathered (a collective, every member at the same point), hooks off."""
        self.active = False
        for u in self.units:
            u.issue(self.gathers)
        for u in self.units:
            u.ready()

    def drop(self) -> None:
        """After an abandoned step: every unit free at once. A gather still in flight keeps its
        buffer (the lane's thread may still write it): the unit gets a new one."""
        for u in self.units:
            if u.state is State.PENDING:
                u.full = torch.empty(u.numel, dtype=u.full.dtype, device=u.full.device)
                u.point_params()
            u.own_buffer()
            u.full.untyped_storage().resize_(0)
            u.state, u.handle, u.grad = State.FREE, None, None
        self.active = False

    def gather_to(self, group: Group | None, root: int = 0) -> list[torch.Tensor] | None:
        """Every unit's whole master values on ``root`` (collective; None elsewhere), where the
        model is then whole too, until its next step frees it: a checkpoint, the final state, an
        evaluation. Received into the gather buffers when they are in the master dtype (then the
        values returned are those buffers: valid until the next step)."""
        if self.whole is not None:
            return [torch.cat(vs) if len(vs) > 1 else vs[0] for vs in self.whole]
        assert group is not None
        out = []
        for u in self.units:
            into = None
            if group.rank == root and u.full.dtype == u.dtype and u.full.device == u.host:
                if u.state is State.FREE:
                    u.own_buffer()
                    u.full.untyped_storage().resize_(u.nbytes)
                into = u.full
            out.append(to_root(group, root, u.shard, u, into))
        if group.rank != root:
            return None
        for u, whole in zip(self.units, out):
            assert whole is not None
            if whole is not u.full:
                if u.state is State.FREE:
                    u.own_buffer()
                    u.full.untyped_storage().resize_(u.nbytes)
                with torch.no_grad():
                    u.full.copy_(whole)
            u.state = State.READY
        return out  # type: ignore[return-value]

    def free_all(self) -> None:
        for u in self.units:
            u.free()

    # -- a VN -------------------------------------------------------------------------------------
    def begin_vn(self) -> None:
        self.active = True
        if self.root is not None:  # (its gradient arrives first, from the head, and last)
            self.root.attach_grads()
        self._cursor = {"forward": 0, "backward": 0}
        self._done = set()
        self._next_reduce = 0
        self._counts = {}

    def end_vn(self) -> None:
        """After the VN's backward: units whose gradient never completed (parameters the VN did
        not use) are handed on now, every unit is freed."""
        for u in self.reduce_order:
            self._mark_done(u)
        self.free_all()
        self.active = False

    # -- hooks ------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self.model.register_forward_pre_hook(self._root_pre_forward)
        for u in self.blocks:
            assert u.module is not None
            u.module.register_forward_pre_hook(self._pre_forward(u))
            u.module.register_forward_hook(self._post_forward(u))
        for u in self.units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    @torch._disable_dynamo  # the public torch.compiler.disable imports dynamo (1.2 s) at import time
    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.active or not torch.is_grad_enabled():
            return
        if self.root is not None:
            self.root.issue(self.gathers)
        if self.blocks:
            self.blocks[0].issue(self.gathers)  # prefetch
        if self.root is not None:
            self.root.ready()

    def _issue_through(self, phase: str, order: Sequence[UnitShard], pos: int) -> None:
        """Issue the gathers of ``order[cursor .. pos]`` (every earlier one first: the same
        sequence on every worker), and prefetch ``order[pos + 1]``."""
        last = min(pos + 1, len(order) - 1)
        while self._cursor[phase] <= last:
            order[self._cursor[phase]].issue(self.gathers)
            self._cursor[phase] += 1

    def _pre_forward(self, u: UnitShard) -> Callable:
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self.active or not torch.is_grad_enabled():
                return
            self._issue_through("forward", self.blocks, self.blocks.index(u))
            u.ready()
        return hook

    def _post_forward(self, u: UnitShard) -> Callable:
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if not self.active or not torch.is_grad_enabled():
                return output
            if not self.keep_gathered:
                u.free()
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward(u), mode="any")
            return output
        return hook

    def _pre_backward(self, u: UnitShard) -> Callable:
        order = list(reversed(self.blocks))

        def hook(grad: Any) -> None:
            if not self.active:
                return
            if not self.keep_gathered:
                self._issue_through("backward", order, order.index(u))
            u.attach_grads()
            u.ready()
        return hook

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        u = self.unit_of[id(p)]
        n = self._counts.get(u.index, 0) + 1
        self._counts[u.index] = n
        if n == len(u.params):
            self._mark_done(u)

    def _mark_done(self, u: UnitShard) -> None:
        """Unit ``u``'s gradient is complete: hand on every unit now due in the fixed order."""
        self._done.add(u.index)
        order = self.reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].index in self._done:
            due = order[self._next_reduce]
            self._next_reduce += 1
            if self.on_unit_done is not None:
                self.on_unit_done(due)
            if due is not self.root:
                due.free()


def to_root(group: Group, root: int, chunk: torch.Tensor, u: UnitShard,
            into: torch.Tensor | None = None) -> torch.Tensor | None:
    """Unit ``u``'s whole vector from every rank's shard-shaped ``chunk``, on ``root`` only (into
    ``into`` when given; collective: every rank sends its chunk there; the others get None)."""
    if group.rank != root:
        if chunk.numel():
            group.send(chunk.contiguous(), root, tag=GATHER_TAG)
        return None
    whole = into if into is not None else chunk.new_zeros(u.numel)
    works = []
    for q, (a, b) in enumerate(u.bounds):
        if q == root:
            with torch.no_grad():
                whole[a:b].copy_(chunk)
        elif b > a:
            works.append(group.irecv(whole[a:b], q, tag=GATHER_TAG))
    for w in works:
        w.wait()
    return whole


def release_freed_memory() -> None:
    """Give the memory freed by the whole model as built back to the operating system (glibc's
    ``malloc_trim``; the worker's allocator settings keep large frees otherwise): a sharded
    worker's resident memory is then its shards'. Nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
