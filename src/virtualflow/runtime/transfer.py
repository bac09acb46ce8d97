"""Moving the full training state between workers of a generation.

When a generation forms, its members first agree on how far each of them got
(:func:`agree_progress`), then, if anyone is behind (a newcomer, or a survivor that had not yet
applied the step a failed peer interrupted), the state of the most advanced member is sent to
those behind (:func:`broadcast_state`, point to point): model parameters and buffers, optimizer
state, LR-scheduler state, step and control position.

The state is sent as one small pickled skeleton (the nested structure with tensors replaced by
slots), then every large tensor as its own message and the small ones packed into one buffer per
dtype, so a 25M-parameter model with Adam moves in a few dozen messages at loopback bandwidth;
copying is bit-exact. A newcomer receives straight into tensors it allocated (and touched) during
its set-up, before it joined, so the survivors do not wait for it to fault in fresh memory.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group


@dataclass(slots=True)
class Progress:
    """What a member brings to a new generation."""

    step: int
    """Steps applied (the next step to run); -1 for a newcomer that holds no state."""
    control: int
    """Control commands applied."""


def agree_progress(group: Group, mine: Progress, device: torch.device) -> list[Progress]:
    """Every member's progress, in rank order (one small all-reduce)."""
    vec = torch.zeros(2 * group.size, dtype=torch.float64, device=device)
    vec[2 * group.rank] = mine.step + 1  # +1: a newcomer's -1 becomes 0, never confused with a slot
    vec[2 * group.rank + 1] = mine.control
    group.all_reduce(vec)
    vals = [int(round(v)) for v in vec.tolist()]
    return [Progress(vals[2 * r] - 1, vals[2 * r + 1]) for r in range(group.size)]


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


@dataclass(frozen=True, slots=True)
class _Slot:
    index: int


@dataclass(frozen=True, slots=True)
class _Meta:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


DIRECT_BYTES = 1 << 20
"""Tensors of at least this size travel as their own message, straight from the source's tensor
into the receiver's (no packing copy on either side); smaller ones are packed into one buffer per
dtype, so a model with hundreds of small tensors still moves in a handful of messages."""


def _layout(metas: Sequence[_Meta]) -> tuple[list[int], list[tuple[torch.dtype, list[int]]]]:
    """Which tensors go direct, and the packed groups (dtype, indices); the same on both sides."""
    direct = [i for i, m in enumerate(metas) if m.nbytes >= DIRECT_BYTES]
    small = [i for i, m in enumerate(metas) if m.nbytes < DIRECT_BYTES]
    groups = [(dtype, [i for i in small if metas[i].dtype == dtype])
              for dtype in sorted({metas[i].dtype for i in small}, key=str)]
    return direct, groups


def _reusable(own: list[torch.Tensor], metas: Sequence[_Meta], device: torch.device) -> list[torch.Tensor | None]:
    """The receiver's own tensors that can take the incoming values in place: same position, dtype
    and shape, contiguous, on the device, and not sharing memory with another one used before."""
    out: list[torch.Tensor | None] = [None] * len(metas)
    if len(own) != len(metas):
        return out
    seen: set[int] = set()
    for i, (t, m) in enumerate(zip(own, metas)):
        if (t.dtype == m.dtype and tuple(t.shape) == m.shape and t.is_contiguous() and t.device == device
                and t.untyped_storage().data_ptr() not in seen):
            seen.add(t.untyped_storage().data_ptr())
            out[i] = t
    return out


def broadcast_state(
    group: Group,
    src: int,
    state: Any | None,
    device: torch.device,
    on_started: Callable[[], None] | None = None,
    receivers: Sequence[int] | None = None,
    into: Any | None = None,
) -> tuple[Any, int]:
    """Send ``state`` (nested dicts/lists of tensors and plain values) from rank ``src`` to the
    ranks in ``receivers`` (default: every other rank).

    Point to point: members that are already up to date take no part (they go straight on to
    the first step, where they wait for the receivers), and the source's bytes go out once per
    receiver. Receivers pass ``None`` and get the source's state; the source gets ``state``
    back. Returns ``(state, bytes_moved)``. ``on_started`` is called once the header is through
    (the fault-injection point ``state_transfer``).

    ``into`` (receivers only): a state of the same structure whose tensors may be overwritten
    (a newcomer's own, whose values do not matter). Tensors that match in position, dtype and
    shape receive in place, so no fresh memory is allocated and touched for them (that, not the
    wire, was most of a 300 MB transfer's time). Only pass state that is worthless if the
    transfer breaks half-way: a survivor that is one step behind must keep its state intact.
    """
    receivers = [r for r in (receivers if receivers is not None else range(group.size)) if r != src]
    is_src = group.rank == src
    if not is_src and group.rank not in receivers:
        return None, 0
    if is_src:
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(state, tensors)
        metas = [_Meta(t.dtype, tuple(t.shape)) for t in tensors]
        header = pickle.dumps((skeleton, metas), protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(header)], dtype=torch.int64, device=device)
        hbuf = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        for r in receivers:
            group.send(size, r, tag=1)
            group.send(hbuf, r, tag=2)
        if on_started is not None:
            on_started()
        direct, packed = _layout(metas)
        outgoing = [tensors[i].to(device).contiguous() for i in direct]
        outgoing += [torch.cat([tensors[i].reshape(-1).to(device) for i in idx]) for _, idx in packed]
        moved = 0
        for r in receivers:
            for k, t in enumerate(outgoing):
                group.send(t, r, tag=3 + k)
                moved += t.numel() * t.element_size()
        return state, moved + len(header) * len(receivers)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(size, src, tag=1)
    hbuf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(hbuf, src, tag=2)
    skeleton, metas = pickle.loads(bytes(hbuf.cpu().numpy()))
    if on_started is not None:
        on_started()
    own: list[torch.Tensor] = []
    if into is not None:
        _flatten(into, own)
    reuse = _reusable(own, metas, device)
    received: list[torch.Tensor | None] = [None] * len(metas)
    moved = hbuf.numel()
    direct, packed = _layout(metas)
    tag = 3
    for i in direct:
        t = reuse[i] if reuse[i] is not None else torch.empty(metas[i].shape, dtype=metas[i].dtype, device=device)
        group.recv(t, src, tag=tag)
        tag += 1
        received[i] = t
        moved += metas[i].nbytes
    for dtype, idx in packed:
        flat = torch.empty(sum(metas[i].numel for i in idx), dtype=dtype, device=device)
        group.recv(flat, src, tag=tag)
        tag += 1
        moved += flat.numel() * flat.element_size()
        offset = 0
        for i in idx:
            n = metas[i].numel
            received[i] = flat[offset : offset + n].view(metas[i].shape)
            offset += n
    return _unflatten(skeleton, received), moved
