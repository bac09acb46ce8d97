"""Sharded checkpoints (``checkpoint_format="dcp"``): every worker writes what it holds with
``torch.distributed.checkpoint``; a JSON manifest, written last, makes the folder a checkpoint.

Layout of ``checkpoints/step-<8 digits>.dcp/``::

    rank-00000/__0_0.distcp   worker 0's tensors (DCP's file format: torch.save'd tensors)
    rank-00000/meta.pt        worker 0 only: step, job identity, optimizer hyperparameters, the LR
                              scheduler, grad scaler, callbacks, model tensors without
                              elements (a state file of
                              :mod:`virtualflow.runtime.checkpoint`: plain data, checksum inside)
    rank-00001/__0_0.distcp   worker 1's tensors, ...
    .metadata                 DCP's metadata, for plain ``torch.distributed.checkpoint.load`` users
    manifest.json             every tensor's chunks and every file's size and SHA-256

Invariants.

* **Every tensor is a flat vector cut into chunks.** Entry ``model/<name>`` is the model tensor
  flattened, ``optimizer/state/<position>/<key>`` an optimizer state tensor flattened (position:
  the optimizer ``state_dict``'s parameter numbering). A worker writes the elements ``[lo, hi)``
  it holds as one DCP chunk at global offset ``lo`` (the model: an even split of all model
  elements over the workers, so each writes ``1/p`` of it; the sharded optimizer: the chunk the
  worker owns; the all-reduce optimizer: an even split). Loading asks DCP for any range of any
  entry, so a checkpoint written by ``p`` workers loads on ``q`` workers, with either reduction.
* **A pipeline's stages are entries of their own optimizer.** A pipelined job writes
  ``optimizer/stage/<s>/state/<index>/<key>`` (``index``: the stage optimizer's numbering);
  replica 0's member of stage ``s`` writes its ``meta.pt`` with the stage's parameter names in
  that order (``param_names``), so the optimizer state can be cut again for other stages by name
  (:mod:`virtualflow.runtime.regrid`); rank 0's records the grid, ``pipeline = {stages, bounds,
  schedule, tensor, replicas}``.
* **A tensor shard is written as it is held, never gathered.** With ``Pipeline(tensor=T)`` a
  stage's tensor rank ``t`` holds a shard of each split tensor (:class:`~virtualflow.parallel.
  convert.Split`: a ``[q; k; v]`` shard is three boxes of the whole tensor, not one range of its
  flat vector). It writes it as the entry ``<fqn>@tp<t>`` (:data:`CUT`) of the shard's shape,
  split evenly over the ``D`` replicas; ``<fqn>`` names the tensor of the single-worker layout
  (``model/<name>``, or an optimizer tensor of the parameter's shape, numbered in the
  *unconverted* stage's order, as a gathered ``.pt`` is). What every tensor rank holds alike (a
  replicated tensor, Adam's ``step``) is the plain entry, split over the stage's ``D T``
  workers. Stage ``s``'s ``meta.pt`` is generation rank ``s T``'s (replica 0, tensor rank 0);
  rank 0's adds ``pipeline.splits``: per cut parameter name, ``[dim, blocks, units]``. The reader
  (:func:`~virtualflow.runtime.dcp_read.load_dcp_state`) merges the ``T`` shards of each entry
  with that split (``Split.merge``, bit for bit), so every reader sees the single-worker layout
  whatever ``T`` wrote it, and cuts it for its own ``T`` (or none).
* **A checkpoint exists once its manifest does.** Workers write into ``step-N.dcp.partial/``,
  each ending with ``rank-R.json`` (its chunks and files' digests, written atomically). The worker
  whose ``rank-R.json`` completes the set merges them into ``manifest.json``, then renames the
  folder to ``step-N.dcp``. No worker waits for another. A crash at any moment leaves either a
  ``.partial`` folder (never read, removed by a later save) or a complete checkpoint; the
  newest complete one is what a resume picks. Deleting holds to it too: a pruned checkpoint is
  renamed ``step-N.dcp.discarded-<hex>`` before it is deleted (:func:`prune`), so no crash leaves
  a ``step-N.dcp`` with files missing, and the newest ``keep`` complete ones stay whole.
* **Nothing is unpickled from the folder but plain data.** DCP's ``.metadata`` is a pickle: it
  is written for interoperability and never read here. The reader builds DCP's metadata from
  ``manifest.json`` (JSON, with a SHA-256 of its own contents), verifies every listed file's
  size and SHA-256 before anything is read, and DCP reads tensors with
  ``torch.load(weights_only=True)``; ``meta.pt`` is read by :func:`load_state`. A missing,
  truncated, altered or foreign file is a :class:`~virtualflow.runtime.checkpoint.
  CorruptCheckpointError` naming the file and the fix, so a resume falls back to the previous
  good checkpoint. Every file is opened below the folder without following a link and without
  blocking (``dcp_read._open_member``) and must be a regular file: a link (a ``rank-N/`` folder
  included) or a FIFO is an :class:`~virtualflow.runtime.checkpoint.UntrustedStateError`. A
  file's size is checked before it is hashed.
* **Asynchronous saves stall for the host copy only.** :class:`DcpSaver` copies the worker's
  pieces to host memory (into the buffers of its previous save when the layout is unchanged),
  then writes them on a thread; at most one save is in flight per worker
  (the next save first waits for it). The write uses no process group, so a generation change
  never waits for it; a worker drains it before it exits or holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from virtualflow.plan.shards import shard_bounds
from virtualflow.records.rundir import atomic_write, disk_full_error
from virtualflow.runtime.checkpoint import CorruptCheckpointError, UntrustedStateError, save_state
from virtualflow.runtime.dcp_read import (CUT, DTYPES, FORMAT, MANIFEST, META, SUFFIX, causes, file_digest, fsync_dir,
                                          is_dcp, json_digest, load_checkpoint, load_dcp_model, load_dcp_state,
                                          load_ranges, peek_dcp, read_file, read_manifest, torch_dcp)

logger = logging.getLogger(__name__)

__all__ = ["CUT", "MANIFEST", "META", "SUFFIX", "DcpSaver", "Piece", "grid_pieces", "is_dcp", "load_checkpoint", "load_dcp_model",
           "load_dcp_state", "load_ranges", "model_pieces", "optimizer_pieces", "peek_dcp", "read_manifest",
           "sharded_optimizer_pieces", "write_rank"]
"""The reading names (``is_dcp``, ``load_*``, ``peek_dcp``, ``read_manifest``) live in
:mod:`virtualflow.runtime.dcp_read` and are re-exported here: one import path for the format."""

PARTIAL = ".partial"
DISCARDED = ".discarded-"
"""A complete checkpoint being deleted is first renamed ``step-N.dcp.discarded-<8 hex>``."""
_FOLDER = re.compile(r"step-(\d+)\.dcp(\.partial)?(\.discarded-[0-9a-f]{8})?")
_RANK_FORMAT = "virtualflow-dcp-rank-v1"


@dataclasses.dataclass(slots=True)
class Piece:
    """Elements ``[lo, lo + tensor.numel())`` of the flattened entry ``fqn`` of global ``shape``."""

    fqn: str
    shape: tuple[int, ...]
    lo: int
    tensor: torch.Tensor


# -- what a worker holds ------------------------------------------------------------------------
def _split(entries: list[tuple[str, torch.Tensor]], rank: int, world: int) -> list[Piece]:
    """Worker ``rank``'s share of ``entries`` (flattened end to end, split evenly by elements)."""
    total = sum(t.numel() for _, t in entries)
    lo, hi = shard_bounds(total, world)[rank]
    out, start = [], 0
    for fqn, t in entries:
        n = t.numel()
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            out.append(Piece(fqn, tuple(t.shape), a - start, t.detach().reshape(-1)[a - start : b - start]))
        start += n
    return out


def model_pieces(state_dict: Mapping[str, torch.Tensor], rank: int, world: int) -> list[Piece]:
    """Worker ``rank``'s share of a replicated model's ``state_dict`` (every worker holds it whole)."""
    return _split([(f"model/{k}", v) for k, v in state_dict.items()], rank, world)


def grid_pieces(whole: list[tuple[str, torch.Tensor]], cut: list[tuple[str, torch.Tensor]], t: int, tensor: int,
                replica: int, replicas: int) -> list[Piece]:
    """Tensor rank ``t`` of replica ``replica``'s share of one tensor-parallel stage's entries:
    ``whole`` (every tensor rank holds them alike) split evenly over the stage's ``replicas x
    tensor`` workers, ``cut`` (this tensor rank's shards) written as entries ``<fqn>@tp<t>``
    (:data:`CUT`) split evenly over the ``replicas`` workers of tensor rank ``t``."""
    return (_split(whole, replica * tensor + t, replicas * tensor)
            + _split([(f"{fqn}{CUT}{t}", v) for fqn, v in cut], replica, replicas))


def optimizer_pieces(state: Mapping[str, Any], rank: int, world: int) -> tuple[list[Piece], dict[str, Any]]:
    """Worker ``rank``'s share of a whole optimizer ``state_dict`` (the all-reduce reduction: every
    worker holds it), and what is not a tensor of it (its hyperparameters and non-tensor entries:
    rank 0 writes those in ``meta.pt``). Scalars (0-d tensors, Adam's ``step``) go to rank 0."""
    entries, scalars, rest = [], [], {}
    for pos, st in state["state"].items():
        for key, v in st.items():
            fqn = f"optimizer/state/{int(pos)}/{key}"
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                entries.append((fqn, v))
            elif isinstance(v, torch.Tensor):
                scalars.append(Piece(fqn, (), 0, v.detach().reshape(-1)))
            else:
                rest.setdefault(int(pos), {})[key] = v
    pieces = _split(entries, rank, world) + (scalars if rank == 0 else [])
    return pieces, {"param_groups": state["param_groups"], "state": rest}


def sharded_optimizer_pieces(shard: Any) -> list[Piece]:
    """The chunk of the optimizer state a :class:`~virtualflow.runtime.sharded.ShardedOptimizer`
    holds, as pieces of the whole state's entries (``step`` from the owner of a parameter's first
    element, as :meth:`ShardedOptimizer.gather_state` takes it)."""
    if shard.local is None:
        return []
    pos_of = {i: pos for pos, i in enumerate(shard.order)}
    out = []
    for i, (a, view) in sorted(shard.pieces.items()):
        p, o = shard.flat.params[i], shard.flat.offsets[i]
        for key, v in shard.local.state.get(view, {}).items():
            fqn = f"optimizer/state/{pos_of[i]}/{key}"
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"checkpoint_format='dcp' cannot write the optimizer state {key!r} (a "
                                 f"{type(v).__name__}) of a sharded {type(shard.user).__name__}")
            if v.dim() == 0:
                if a == o:
                    out.append(Piece(fqn, (), 0, v.detach().reshape(-1)))
            else:
                out.append(Piece(fqn, tuple(p.shape), a - o, v.detach().reshape(-1)))
    return out


def stage(pieces: list[Piece], buffers: dict[tuple[Any, ...], torch.Tensor] | None = None) -> list[Piece]:
    """The pieces copied to host memory (what an asynchronous save's stall is). ``buffers``: host
    tensors of an earlier save, reused where a piece has the same place, size and dtype (no new
    allocation, no page faults: the copy alone); updated to this save's."""
    out, used = [], {}
    on_device = False
    for p in pieces:
        t = p.tensor.detach()
        if not t.numel():
            continue
        key = (p.fqn, p.lo, t.numel(), t.dtype)
        buf = buffers.get(key) if buffers is not None else None
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.device.type == "cuda")
        on_device |= t.device.type == "cuda"
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        used[key] = buf
        out.append(Piece(p.fqn, p.shape, p.lo, buf))
    if on_device:
        torch.cuda.synchronize()
    if buffers is not None:
        buffers.clear()
        buffers.update(used)
    return out


def partial_dir(final: str) -> str:
    return final + PARTIAL


def write_rank(final: str, rank: int, world: int, save_id: str, step: int, pieces: list[Piece],
               meta: dict[str, Any] | None, keep: int | None = None,
               written: Callable[[], None] | None = None,
               recorded: Callable[[], int | None] | None = None) -> bool:
    """Write worker ``rank``'s part of the checkpoint ``final`` (a ``….dcp`` folder) into its
    partial folder; the worker completing the set finalizes it (see the module docstring).
    ``meta``: rank 0's ``meta.pt`` contents. ``keep``: after finalizing, keep this many complete
    checkpoints in the folder. ``written``: called once the tensors are on disk, before the part
    is marked complete (fault injection). ``recorded``: the steps the run's records reach, asked
    when pruning (:func:`prune`). Returns whether this call finalized the checkpoint."""
    part = partial_dir(final)
    mine = os.path.join(part, f"rank-{rank:05d}")
    marker = os.path.join(part, f"rank-{rank:05d}.json")
    os.makedirs(part, exist_ok=True)
    if os.path.lexists(marker):
        os.unlink(marker)  # an interrupted earlier attempt at this step: its part is written anew
    shutil.rmtree(mine, ignore_errors=True)
    os.makedirs(mine)
    live = [p for p in pieces if p.tensor.numel()]
    entries: list[dict[str, Any]] = []
    if live:
        try:
            with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent
                warnings.simplefilter("ignore", UserWarning)
                T = torch_dcp()
                saved = T.dcp.save({p.fqn: p.tensor for p in live}, planner=T.PiecePlanner(live), no_dist=True,
                                 storage_writer=T.FileSystemWriter(mine, single_file_per_rank=True, sync_files=True,
                                                                 thread_count=1, overwrite=True))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            causes = causes(exc)
            full = next((e for e in (disk_full_error(c, mine) for c in causes) if e is not None), None)
            if full is not None:
                raise full from None
            text = str(causes[-1]).strip()
            why = text.splitlines()[-1][:300] if text else type(causes[-1]).__name__
            raise RuntimeError(f"writing this worker's part of {final} failed: {why}") from None
        try:
            os.unlink(os.path.join(mine, ".metadata"))  # this worker's alone; the merged one is written below
        except OSError:
            pass
        by_fqn = {p.fqn: p for p in live}
        for index, info in saved.storage_data.items():
            p = by_fqn[index.fqn]
            entries.append({"fqn": p.fqn, "shape": list(p.shape), "dtype": _dtype_name(p.tensor.dtype),
                            "lo": p.lo, "hi": p.lo + p.tensor.numel(),
                            "file": f"rank-{rank:05d}/{info.relative_path}", "offset": info.offset,
                            "length": info.length})
    if meta is not None:
        save_state(os.path.join(mine, META), meta)
    if written is not None:
        written()
    files = {f"rank-{rank:05d}/{name}": file_digest(os.path.join(mine, name)) for name in sorted(os.listdir(mine))}
    record = {"format": _RANK_FORMAT, "save_id": save_id, "rank": rank, "world": world, "step": step,
              "entries": sorted(entries, key=lambda e: (e["fqn"], e["lo"])), "files": files}
    atomic_write(marker, lambda f: f.write(json.dumps(record).encode()))
    return _finalize(final, world, save_id, step, keep, recorded)


def _claim_name(save_id: str) -> str:
    """The file a finalizing worker creates exclusively (the save id holds slashes)."""
    return ".finalizing-" + hashlib.sha256(save_id.encode()).hexdigest()[:16]


def _finalize(final: str, world: int, save_id: str, step: int, keep: int | None,
              recorded: Callable[[], int | None] | None = None) -> bool:
    """Merge the workers' records into the manifest and rename, once every worker's is there."""
    part = partial_dir(final)
    records = []
    for r in range(world):
        try:
            rec = json.loads(read_file(part, f"rank-{r:05d}.json"))
        except (OSError, ValueError, RecursionError, CorruptCheckpointError, UntrustedStateError):
            return False  # not there yet (its worker finalizes), or not a record a worker wrote
        if not isinstance(rec, dict):
            return False
        if rec.get("save_id") != save_id:
            return False  # an earlier attempt's; its worker rewrites it
        records.append(rec)
    # Every record is there, and more than one worker may see that at once: one of them claims the
    # finalization (an exclusive create), so no two write the manifest or rename the folder.
    try:
        os.close(os.open(os.path.join(part, _claim_name(save_id)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False  # another worker finalizes this set
    except OSError:
        return False  # the folder was renamed meanwhile: finalized by another worker
    entries = [e for rec in records for e in rec["entries"]]
    files = {k: v for rec in records for k, v in rec["files"].items()}
    ours = {f"rank-{r:05d}" for r in range(world)} | {f"rank-{r:05d}.json" for r in range(world)}
    for name in os.listdir(part):  # an earlier attempt's workers beyond this world, stray files
        if name not in ours and not name.startswith("."):
            _remove(os.path.join(part, name))  # another finalizer taking it first is no error
    _write_dcp_metadata(part, entries)
    files[".metadata"] = file_digest(os.path.join(part, ".metadata"))
    body = {"format": FORMAT, "save_id": save_id, "step": step, "world": world,
            "entries": sorted(entries, key=lambda e: (e["fqn"], e["lo"])), "files": dict(sorted(files.items()))}
    manifest = {**body, "checksum": json_digest(body)}
    atomic_write(os.path.join(part, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    try:
        os.rename(part, final)
    except OSError as exc:  # another worker finalized the same set a moment earlier
        logger.debug("finalizing %s: %s", final, exc)
        return False
    fsync_dir(os.path.dirname(final))
    for name in [f"rank-{r:05d}.json" for r in range(world)] + [_claim_name(save_id)]:
        try:
            os.unlink(os.path.join(final, name))  # merged into the manifest; the claim
        except OSError:
            pass
    prune(os.path.dirname(final), step, keep, recorded)
    return True


def prune(folder: str, step: int, keep: int | None, recorded: Callable[[], int | None] | None = None) -> None:
    """After the checkpoint of ``step`` completed: remove partial folders of earlier steps (their
    saves were interrupted), what an interrupted prune left (:data:`DISCARDED` folders) and, with
    ``keep``, all but the newest ``keep`` complete checkpoints.

    A complete checkpoint is first renamed out of the set of checkpoints (``step-N.dcp`` ->
    ``step-N.dcp.discarded-<hex>``, one atomic rename), then deleted: a crash in the middle of
    the deletion leaves a folder no reader takes for a checkpoint (removed by the next prune or
    the next start, :func:`remove_discarded`), never a ``step-N.dcp`` with files missing. So after
    any crash the newest ``keep`` complete checkpoints are there, whole.

    ``recorded`` (asked only when something would be removed) gives the steps the run's records
    reach, or None: the newest checkpoint at or below that step is never removed, as
    :func:`~virtualflow.runtime.checkpoint.prune_state_files` does for single files (see
    docs/elasticity.md, "The coordinator cut off")."""
    remove_discarded(folder)
    complete = []
    for name in os.listdir(folder):
        m = _FOLDER.fullmatch(name)
        if m is None or m.group(3):
            continue
        if m.group(2) and int(m.group(1)) < step:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)  # never read: no rename needed
        elif not m.group(2):
            complete.append(name)
    if keep is None:
        return
    complete.sort(key=lambda n: int(_FOLDER.fullmatch(n).group(1)))  # type: ignore[union-attr]
    old_ones = complete[: max(0, len(complete) - keep)]
    reach = recorded() if old_ones and recorded is not None else None
    if reach is not None:  # never remove the newest checkpoint the run's records reach
        within = [n for n in complete if int(_FOLDER.fullmatch(n).group(1)) <= reach]  # type: ignore[union-attr]
        if within and within[-1] in old_ones:
            old_ones.remove(within[-1])
    for name in old_ones:
        discard(os.path.join(folder, name))


def _remove(path: str) -> bool:
    """Remove ``path``: a folder (never followed through a link) with what it holds, anything else
    unlinked. Returns False when it could not be unlinked (gone already, or refused)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def discard(path: str) -> None:
    """Delete the complete checkpoint folder ``path``: renamed first (it stops being a checkpoint at
    once, whole), then removed. Another worker's prune taking it first is no error."""
    doomed = f"{path}{DISCARDED}{secrets.token_hex(4)}"
    try:
        os.rename(path, doomed)
    except OSError as exc:
        logger.debug("discarding %s: %s", path, exc)
        return
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(doomed, ignore_errors=True)


def remove_discarded(folder: str) -> list[str]:
    """Remove what a prune interrupted by a crash left in ``folder`` (``step-N.dcp.discarded-<hex>``
    folders, already no checkpoint); returns their names."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _FOLDER.fullmatch(name)
        if m is not None and m.group(3):
            full = os.path.join(folder, name)
            if _remove(full):
                removed.append(name)
                logger.info("removed %s, a checkpoint whose deletion was interrupted", full)
    return removed


def _write_dcp_metadata(folder: str, entries: list[dict[str, Any]]) -> None:
    """DCP's own ``.metadata`` (a pickle), so that ``torch.distributed.checkpoint.load`` reads the
    folder. virtualflow never reads it back (it builds the same from the manifest)."""
    atomic_write(os.path.join(folder, ".metadata"), lambda f: pickle.dump(torch_dcp().metadata_of(entries, DTYPES), f))


# -- asynchronous saves -------------------------------------------------------------------------
class DcpSaver:
    """One worker's sharded saves: synchronous, or asynchronous with at most one in flight."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        """Host copies of the last save, reused by the next (one save in flight: it is written)."""
        self.last_write_s = 0.0
        """Seconds the last completed write took (off the training path when asynchronous)."""

    def save(self, job: Callable[[list[Piece]], Any], pieces: list[Piece]) -> None:
        """Stage ``pieces`` in host memory, then ``job(staged)`` (the write), now or on a thread."""
        self.drain()  # one save in flight: its host copies are free again
        if not self.asynchronous:  # training waits: write host tensors as they are, keep no copy
            on_host = [p for p in pieces if p.tensor.device.type == "cpu" and p.tensor.numel()]
            self._run(job, on_host + stage([p for p in pieces if p.tensor.device.type != "cpu"]))
            self._raise()
            return
        staged = stage(pieces, self._buffers)
        self._thread = threading.Thread(target=self._run, args=(job, staged), name="virtualflow-dcp-save")
        self._thread.start()

    def _run(self, job: Callable[[list[Piece]], Any], staged: list[Piece]) -> None:
        t0 = time.perf_counter()
        try:
            job(staged)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next drain
            self._error = exc
        self.last_write_s = time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for the save in flight, if any; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"checkpoint_format='dcp' cannot write a {name} tensor; use checkpoint_format='pt'")
    return name


