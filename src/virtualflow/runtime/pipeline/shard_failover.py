"""Bamboo with ``reduction="sharded"``: a failover rebuilds each stage's whole optimizer state from
the chunks the survivors hold, the lost worker's from the replica its predecessor kept.

Purpose: a sharded stage keeps one chunk of its optimizer state on each of its *D* copies (one per
pipeline replica, :mod:`.stage_shard`), and Bamboo's replica of a stage mirrors the chunk of the
copy it stands in for (:class:`~.redundancy.StageReplica`: it steps that chunk with the copy's own
reduced gradient chunk, handed over at every flush). A Bamboo re-layout moves whole per-stage
states (:func:`~.stage_state.exchange_for_layout`), so before it every member holding a sharded
stage, or a sharded replica of one, gets that stage's whole state (:func:`make_stages_whole`):
chunk *j* of stage *s* comes from the worker of pipeline replica *j* that ran stage *s*, else from
the replica its predecessor held; the chunks are put together (:func:`chunk_payload`,
:func:`merge_chunks`) in the user's optimizer format.

Invariants:

- Only copies: no arithmetic touches a value, so the rebuilt state is, bit for bit, what the
  stage's copies held (the lost one's chunk included: the replica took the same update on the
  same values), and the re-laid job trains on as the undisturbed one.
- A chunk whose two copies (the worker's and its predecessor's replica) are both lost cannot be
  rebuilt: :class:`~virtualflow.runtime.sharded.ShardLost`, naming the way out.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from virtualflow.runtime.pipeline.stage_shard import StageShard
from virtualflow.runtime.sharded import ShardLost
from virtualflow.runtime.transfer import broadcast_state

__all__ = ["chunk_payload", "make_stages_whole", "merge_chunks", "sharded_holdings"]

RUNS, REPLICA = 2, 1
"""What a member holds of a chunk: the chunk of the stage it runs, or its replica's (a source
is taken from the first kind first)."""


def sharded_holdings(stage: Any) -> list[tuple[int, int, int, StageShard, int]]:
    """The chunks of sharded stage optimizers ``stage`` (a :class:`~.engine.StageEngine` of the
    standard layout, or ``None``) holds as chunks only: (job stage, chunk, chunks, its update,
    :data:`RUNS` or :data:`REPLICA`). A whole state held (before the first step, after a load or a
    gather) is not listed: it is held whole on every copy."""
    if stage is None:
        return []
    held = [(stage.stage_rank, stage.update, RUNS)]
    replica = stage.replica_of_successor
    if replica is not None:
        held.append((replica.stage_rank, replica.update, REPLICA))
    return [(s, u.opt.rank, u.opt.size, u, kind) for s, u, kind in held
            if isinstance(u, StageShard) and u.chunk_held and u.opt.full is None]


def chunk_payload(update: StageShard) -> dict[str, Any]:
    """The chunk's optimizer state, to be sent: per parameter piece in the chunk (parameter
    index -> (flat offset, elements, its state entries))."""
    opt = update.opt
    mine = opt.local.state if opt.local is not None else {}
    pieces = {}
    for i, (a, view) in opt.pieces.items():
        entries = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in mine.get(view, {}).items()}
        pieces[i] = (a, view.numel(), entries)
    return {"pieces": pieces}


def merge_chunks(update: StageShard, payloads: Iterable[dict[str, Any]]) -> None:
    """Hold the whole state put together from every chunk's :func:`chunk_payload` (elementwise
    entries placed piece by piece; a scalar entry, Adam's ``step``, from the piece holding the
    parameter's first element): the stage's optimizer then reads whole (a re-layout moves it)."""
    opt, flat = update.opt, update.flat
    parts: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for payload in payloads:
        for i, piece in payload["pieces"].items():
            parts.setdefault(int(i), []).append(piece)
    state: dict[int, dict[str, Any]] = {}
    for i, pieces in parts.items():
        p, o = flat.params[i], flat.offsets[i]
        pieces.sort(key=lambda piece: piece[0])
        entries: dict[str, Any] = {}
        spread: set[str] = set()  # the elementwise entries (cut like the parameter)
        for a, n, st in pieces:
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == n:
                    spread.add(key)
                    whole = entries.setdefault(key, torch.empty(p.numel(), dtype=v.dtype, device=v.device))
                    whole[a - o: a - o + n].copy_(v.reshape(-1))
                else:
                    entries.setdefault(key, v)
        state[i] = {k: (v.view_as(p) if k in spread else v) for k, v in entries.items()}
    opt.keep_full(opt.assemble(state))


def make_stages_whole(stage: Any, group: Any, p: int, device: torch.device) -> int:
    """Collective over the new generation's ``group`` (every member, before a Bamboo re-layout):
    every member holding a chunk of a sharded stage optimizer (its stage's or its replica's) then
    holds that stage's whole state (see the module docstring). Returns the bytes moved between all
    the members.
    Nothing moves where no stage is sharded (one small all-reduce)."""
    mine = sharded_holdings(stage)
    held = torch.zeros(group.size, p, group.size + 1, dtype=torch.float64)
    for s, j, size, _, kind in mine:
        held[group.rank, s, j] = kind
        held[group.rank, s, -1] = size  # (every holder of the stage tells the same number of chunks)
    group.all_reduce(held)
    moved = 0
    for s in range(p):
        needers = [r for r in range(group.size) if bool(held[r, s, :-1].any())]
        if not needers:
            continue
        chunks = int(held[needers[0], s, -1].item())
        local = {j: u for s2, j, _, u, _ in mine if s2 == s}
        payloads = []
        for j in range(chunks):
            col = held[:, s, j]
            sources = ([r for r in range(group.size) if col[r] == RUNS]
                       or [r for r in range(group.size) if col[r] == REPLICA])
            if not sources:
                raise ShardLost(
                    f"reduction='sharded' with Pipeline.redundancy=True: chunk {j} of stage {s}'s optimizer state "
                    f"was lost with both its copies (the worker and its predecessor's replica); resume from the "
                    f"last checkpoint (--resume RUN_DIR)")
            src = sources[0]
            payload = chunk_payload(local[j]) if group.rank == src else None
            got, n = broadcast_state(group, src, payload, device, receivers=[r for r in needers if r != src])
            moved += n if group.rank == src else 0
            payloads.append(got)
        for u in local.values():
            merge_chunks(u, payloads)
    total = torch.tensor([float(moved)], dtype=torch.float64)
    group.all_reduce(total)
    return int(total.item())
