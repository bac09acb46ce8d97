"""Moving the full training state between workers of a generation.

When a generation forms, its members first agree on how far each of them got
(:func:`agree_progress`), then, if anyone is behind (a newcomer, or a survivor that had not yet
applied the step a failed peer interrupted), the state of the most advanced member is sent to
those behind (:func:`broadcast_state`, point to point): model parameters and buffers, optimizer
state, LR-scheduler state, step and control position.

The state is sent as one small JSON header (the nested structure with tensors replaced by
slots, and each tensor's dtype name and shape: :func:`encode_header`), then every large tensor as
its own message and the small ones packed into one buffer per dtype, so a 25M-parameter model with
Adam moves in a few dozen messages at loopback bandwidth; copying is bit-exact. A newcomer
receives straight into tensors it allocated (and touched) during its set-up, before it joined, so
the survivors do not wait for it to fault in fresh memory.

The header comes from a peer found through the job's (unauthenticated) store, so it is data, not
code: nothing is unpickled. The structure may hold dicts (with their key types: optimizer states
are keyed by ints), ordered dicts (a ``state_dict`` and its ``_metadata``), lists, tuples, str,
int, float (NaN and infinities included), bool, None and tensors of the dtypes in
:data:`DTYPES`; a header that is not of that form is a :class:`PeerFailure` (the generation is
abandoned and formed again, as when the peer dies), never an exception in the user's job.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from virtualflow.comm.groups import Group, PeerFailure

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}
"""Tensor dtypes a state transfer carries, by name (the allow-list of a received header)."""

MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64
"""Deepest nesting of the state structure (a state dict is 3-5 levels deep)."""
MAX_DIMS = 64


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


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> None:
    """Collect the tensors of ``obj`` in the order :func:`encode_header` numbers them."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
    elif isinstance(obj, dict):
        for v in obj.values():
            _flatten(v, tensors)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _flatten(v, tensors)


_SCALARS = (type(None), bool, int, float, str)


def _encode(obj: Any, tensors: list[torch.Tensor], depth: int, where: str) -> Any:
    """JSON-ready form: scalars as they are, containers and tensors as one-key objects
    (``t``: tensor slot, ``d``: dict as [key, value] pairs, ``o``: ordered dict plus its
    ``_metadata`` in ``m``, ``l``: list, ``u``: tuple)."""
    if type(obj) in _SCALARS:
        return obj
    if isinstance(obj, (int, float, str)) and not isinstance(obj, bool):  # e.g. numpy.float64: same value
        return float(obj) if isinstance(obj, float) else int(obj) if isinstance(obj, int) else str(obj)
    if depth >= MAX_DEPTH:
        raise ValueError(f"the training state is nested more than {MAX_DEPTH} levels deep at {where}")
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {"t": len(tensors) - 1}
    if type(obj) is dict or type(obj) is OrderedDict:
        items = [[_encode(k, tensors, depth + 1, where), _encode(v, tensors, depth + 1, f"{where}[{k!r}]")]
                 for k, v in obj.items()]
        if type(obj) is dict:
            return {"d": items}
        return {"o": items, "m": _encode(getattr(obj, "_metadata", None), tensors, depth + 1, f"{where}._metadata")}
    if type(obj) is list:
        return {"l": [_encode(v, tensors, depth + 1, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if type(obj) is tuple:
        return {"u": [_encode(v, tensors, depth + 1, f"{where}[{i}]") for i, v in enumerate(obj)]}
    raise ValueError(f"the training state holds a {type(obj).__module__}.{type(obj).__qualname__} at {where}: a "
                     f"state transfer carries dicts, lists, tuples, str, int, float, bool, None and tensors only; "
                     f"keep optimizer and LR-scheduler state to those")


def _decode(obj: Any, tensors: list[Any], depth: int) -> Any:
    if type(obj) in _SCALARS:
        return obj
    if depth >= MAX_DEPTH or not isinstance(obj, dict):
        raise ValueError("not a state structure")
    tag = "t" if "t" in obj else "d" if "d" in obj else "o" if "o" in obj else "l" if "l" in obj else "u"
    if set(obj) != ({"o", "m"} if tag == "o" else {tag}):
        raise ValueError(f"unknown container {sorted(obj)[:3]}")
    body = obj[tag]
    if tag == "t":
        if type(body) is not int or not 0 <= body < len(tensors):
            raise ValueError("bad tensor slot")
        return tensors[body]
    if not isinstance(body, list):
        raise ValueError(f"bad {tag!r} container")
    if tag in "lu":
        items = [_decode(v, tensors, depth + 1) for v in body]
        return items if tag == "l" else tuple(items)
    if any(not isinstance(kv, list) or len(kv) != 2 for kv in body):
        raise ValueError("bad dict item")
    pairs = [(_decode(k, tensors, depth + 1), _decode(v, tensors, depth + 1)) for k, v in body]
    if any(not isinstance(k, _SCALARS + (tuple,)) for k, _ in pairs):
        raise ValueError("bad dict key")
    try:
        out = dict(pairs) if tag == "d" else OrderedDict(pairs)
    except TypeError:  # a tuple key holding a list
        raise ValueError("bad dict key") from None
    if tag == "o":
        meta = _decode(obj["m"], tensors, depth + 1)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
    return out


def encode_header(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header of ``state`` (ASCII JSON) and its tensors in slot order."""
    tensors: list[torch.Tensor] = []
    skeleton = _encode(state, tensors, 0, "state")
    for t in tensors:
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"the training state holds a tensor of dtype {t.dtype}, which a state transfer does "
                             f"not carry (it carries {', '.join(DTYPES)})")
    metas = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    text = json.dumps({"skeleton": skeleton, "tensors": metas}, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii"), tensors


def decode_header(raw: bytes) -> tuple[Any, list["_Meta"]]:
    """``(skeleton, metas)`` of a received header; the skeleton's slots are filled by
    :func:`fill_header`. Raises ``ValueError`` when ``raw`` is not a header of the form above
    (size, encoding, nesting, dtype names, shapes)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"state header of {len(raw)} bytes (more than {MAX_HEADER_BYTES})")
    try:
        doc = json.loads(raw.decode("ascii"))
    except (ValueError, RecursionError):
        raise ValueError("state header is not ASCII JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"skeleton", "tensors"} or not isinstance(doc["tensors"], list):
        raise ValueError("state header lacks its skeleton or tensor list")
    metas = []
    for m in doc["tensors"]:
        if (not isinstance(m, list) or len(m) != 2 or not isinstance(m[0], str) or m[0] not in DTYPES
                or not isinstance(m[1], list) or len(m[1]) > MAX_DIMS
                or any(type(d) is not int or d < 0 for d in m[1])):
            raise ValueError(f"state header: bad tensor description {str(m)[:80]}")
        metas.append(_Meta(DTYPES[m[0]], tuple(m[1])))
    return doc["skeleton"], metas


def fill_header(skeleton: Any, tensors: list[Any]) -> Any:
    """The state a header's skeleton describes, its slots filled with ``tensors``."""
    try:
        return _decode(skeleton, tensors, 0)
    except RecursionError:
        raise ValueError("state header nested too deeply") from None


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
        return state, _send_state(group, state, device, receivers, on_started)
    return _receive_state(group, src, device, on_started, into)


def _send_state(group: Group, state: Any, device: torch.device, receivers: Sequence[int],
                on_started: Callable[[], None] | None) -> int:
    """The source's side of :func:`broadcast_state`; returns the bytes it sent."""
    header, tensors = encode_header(state)
    metas = [_Meta(t.dtype, tuple(t.shape)) for t in tensors]
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
    return moved + len(header) * len(receivers)


def _receive_state(group: Group, src: int, device: torch.device, on_started: Callable[[], None] | None,
                   into: Any | None) -> tuple[Any, int]:
    """A receiver's side of :func:`broadcast_state`: (the state, the bytes received)."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(size, src, tag=1)
    if not 0 < int(size.item()) <= MAX_HEADER_BYTES:
        raise PeerFailure(group.generation, f"the state transfer's header would be {int(size.item())} bytes")
    hbuf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(hbuf, src, tag=2)
    try:
        skeleton, metas = decode_header(bytes(hbuf.cpu().numpy()))
    except ValueError as exc:
        raise PeerFailure(group.generation, f"the state transfer's header is invalid: {exc}") from None
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
    try:
        return fill_header(skeleton, received), moved
    except ValueError as exc:
        raise PeerFailure(group.generation, f"the state transfer's header is invalid: {exc}") from None


@dataclass(frozen=True)
class Successor:
    """The next generation of a planned change, as the old generation's members see it (what a
    resize of sharded parameters moves the shards by)."""

    previous: tuple[str, ...]
    """The old generation's members, by rank."""
    members: tuple[str, ...]
    """The new generation's members, by rank."""
