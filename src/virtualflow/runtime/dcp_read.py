"""Reading sharded checkpoints (``checkpoint_format="dcp"``) safely: the manifest, the files it
lists, the tensors' ranges, the whole state (the format: :mod:`virtualflow.runtime.dcp`, which
writes them and re-exports these names).

Invariants. Nothing is unpickled from a checkpoint folder but plain data: DCP's metadata is built
from ``manifest.json`` (JSON with a SHA-256 of its own contents), every listed file's size and
SHA-256 are verified before anything is read (the size first, so a file of another size is never
hashed), and tensors are read with ``torch.load(weights_only=True)``. Every file is opened below
the folder without following a link and without blocking (:func:`_open_member`) and must be a
regular file. A missing, truncated, altered or foreign file is a
:class:`~virtualflow.runtime.checkpoint.CorruptCheckpointError` naming the file and the fix
(:data:`FIX`); a link or a FIFO is an :class:`~virtualflow.runtime.checkpoint.UntrustedStateError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import warnings
from typing import Any

import torch

from virtualflow.runtime.checkpoint import CorruptCheckpointError, UntrustedStateError, load_state

__all__ = ["CUT", "DTYPES", "FIX", "FORMAT", "MANIFEST", "META", "SUFFIX", "causes", "file_digest", "fsync_dir", "is_dcp",
           "json_digest", "load_checkpoint", "load_dcp_model", "load_dcp_state", "load_ranges", "peek_dcp",
           "read_file", "read_manifest", "torch_dcp"]

SUFFIX = ".dcp"
MANIFEST = "manifest.json"
META = "meta.pt"
FORMAT = "virtualflow-dcp-v1"
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}
CUT = "@tp"
"""``<fqn>@tp<t>``: tensor rank ``t``'s shard of entry ``<fqn>`` (a tensor-parallel job's checkpoint)."""
FIX = "restore it from a copy, or move the folder away to resume from the previous checkpoint"
"""The way out a corrupt checkpoint's error names."""


def is_dcp(path: str) -> bool:
    """Whether ``path`` names a sharded checkpoint folder (``….dcp``)."""
    return path.rstrip(os.sep).endswith(SUFFIX)


def torch_dcp() -> Any:
    """:mod:`virtualflow.runtime.dcp_torch`, imported when a sharded checkpoint is first written or
    read (``torch.distributed.checkpoint`` costs every process that imports it ~0.7 CPU-s)."""
    from virtualflow.runtime import dcp_torch

    return dcp_torch


# -- reading ------------------------------------------------------------------------------------
def read_manifest(folder: str, *, verify_files: bool = True) -> dict[str, Any]:
    """The checked manifest of the checkpoint ``folder``: its own checksum, its shape, every chunk
    in a listed file, every tensor covered exactly once, and (``verify_files``) every listed file
    present with its recorded size and SHA-256. Anything wrong: a one-line
    :class:`CorruptCheckpointError` naming the file and the fix."""
    if os.path.islink(folder):
        raise UntrustedStateError(f"refusing to read {folder}: it is a symbolic link, and checkpoints are read only "
                                  f"from the run directory's own folders; copy the folder there, or pass its real path")
    if not os.path.isdir(folder):
        raise CorruptCheckpointError(f"{folder} is not a folder (a sharded checkpoint is one); {FIX}")
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete (its save was interrupted); "
                                     f"resume from the previous checkpoint")
    raw = read_file(folder, MANIFEST)
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{path} is not a virtualflow checkpoint manifest ({FORMAT}); {FIX}")
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        checksum = json_digest(body)
    except RecursionError:  # a manifest virtualflow writes is 4 levels deep
        raise CorruptCheckpointError(f"{path} is nested too deeply to be a checkpoint manifest (altered); "
                                     f"{FIX}") from None
    except ValueError:
        raise CorruptCheckpointError(f"{path} is not valid JSON (truncated or altered); {FIX}") from None
    if manifest.get("checksum") != checksum:
        raise CorruptCheckpointError(f"{path} does not match its checksum (altered or damaged); {FIX}")
    _check_manifest(path, manifest)
    named = re.fullmatch(r"step-(\d+)\.dcp", os.path.basename(os.path.normpath(folder)))
    if named is not None and int(named.group(1)) != manifest["step"]:
        raise CorruptCheckpointError(f"{path} is the checkpoint of step {manifest['step']}, in a folder named for step "
                                     f"{int(named.group(1))} (moved or copied over); {FIX}")
    if verify_files:
        for name, want in manifest["files"].items():
            _verify_file(folder, name, want)
    return manifest


def _check_manifest(path: str, m: dict[str, Any]) -> None:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path} does not describe a valid checkpoint ({why}); {FIX}")

    if not isinstance(m.get("step"), int) or not isinstance(m.get("world"), int) or m["world"] < 1:
        raise bad("step or world is not a positive integer")
    files, entries = m.get("files"), m.get("entries")
    if not isinstance(files, dict) or not isinstance(entries, list):
        raise bad("files or entries missing")
    for name, want in files.items():
        if (not isinstance(want, dict) or not isinstance(want.get("bytes"), int)
                or not isinstance(want.get("sha256"), str)
                or not re.fullmatch(r"(rank-\d{5}/)?[\w.\-]+", name) or ".." in name):
            raise bad(f"file entry {name!r}")
    covered: dict[str, list[tuple[int, int]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for e in entries:
        ok = (isinstance(e, dict) and isinstance(e.get("fqn"), str) and isinstance(e.get("shape"), list)
              and all(isinstance(s, int) and s >= 0 for s in e["shape"]) and e.get("dtype") in DTYPES
              and all(isinstance(e.get(k), int) and e[k] >= 0 for k in ("lo", "hi", "offset", "length"))
              and e.get("file") in files)
        if not ok:
            raise bad(f"entry {str(e)[:80]}")
        n = math.prod(e["shape"])
        if not e["lo"] < e["hi"] <= n or e["offset"] + e["length"] > files[e["file"]]["bytes"]:
            raise bad(f"chunk [{e['lo']}, {e['hi']}) of {e['fqn']} out of bounds")
        if shapes.setdefault(e["fqn"], (tuple(e["shape"]), e["dtype"])) != (tuple(e["shape"]), e["dtype"]):
            raise bad(f"{e['fqn']} has chunks of different shapes or dtypes")
        covered.setdefault(e["fqn"], []).append((e["lo"], e["hi"]))
    for fqn, spans in covered.items():
        spans.sort()
        end = 0
        for lo, hi in spans:
            if lo != end:
                raise bad(f"{fqn} is {'missing elements' if lo > end else 'written twice'} at {min(lo, end)}")
            end = hi
        if end != math.prod(shapes[fqn][0]):
            raise bad(f"{fqn} is missing elements from {end}")


def _verify_file(folder: str, name: str, want: dict[str, Any]) -> None:
    """The file ``name`` of ``folder`` is a regular file (reached through no link) of the size and
    SHA-256 the manifest records; the size is compared first, so a file of another size costs a
    ``stat``, not a read of the whole file."""
    full = os.path.join(folder, name)
    fd = _open_member(folder, name)
    try:
        size = os.fstat(fd).st_size
    except OSError as exc:
        os.close(fd)
        raise CorruptCheckpointError(f"cannot read {full}: {exc.strerror or exc}; {FIX}") from None
    if size != want["bytes"]:
        os.close(fd)
        what = "truncated" if size < want["bytes"] else "longer than its checkpoint wrote it"
        raise CorruptCheckpointError(f"{full} is {what} ({size} bytes, the manifest records {want['bytes']}); "
                                     f"{FIX}")
    got = _digest_of(fd, full)
    if got != want:
        raise CorruptCheckpointError(f"{full} does not match the manifest (sha256 {got['sha256'][:12]}…, recorded "
                                     f"{want['sha256'][:12]}…): it is another checkpoint's or job's file, or was "
                                     f"altered; {FIX}")


def load_ranges(folder: str, manifest: dict[str, Any], ranges: dict[str, tuple[int, int]], *,
                verify: bool = False) -> dict[str, torch.Tensor]:
    """Elements ``[lo, hi)`` of each flattened entry named in ``ranges`` (resharding: any range,
    whatever chunks the writers held), as 1-D CPU tensors. ``verify``: first check the digests of
    the files these ranges are read from (for a manifest read with ``verify_files=False``: a
    worker reading its chunk hashes only the files it reads)."""
    kinds = {e["fqn"]: (math.prod(e["shape"]), e["dtype"]) for e in manifest["entries"]}
    out = {}
    for fqn, (lo, hi) in ranges.items():
        if fqn not in kinds or not 0 <= lo <= hi <= kinds[fqn][0]:
            raise ValueError(f"checkpoint {folder} has no elements [{lo}, {hi}) of {fqn!r}")
        out[fqn] = torch.empty(hi - lo, dtype=DTYPES[kinds[fqn][1]])
    if verify:
        touched = {e["file"] for e in manifest["entries"]
                   if e["fqn"] in ranges and e["lo"] < ranges[e["fqn"]][1] and ranges[e["fqn"]][0] < e["hi"]}
        for name in sorted(touched):
            _verify_file(folder, name, manifest["files"][name])
    if any(t.numel() for t in out.values()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                T = torch_dcp()
                T.dcp.load(out, storage_reader=T.ManifestReader(folder, manifest["entries"], DTYPES, _open_member),
                           planner=T.RangePlanner(ranges), no_dist=True)
        except (UntrustedStateError, CorruptCheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            ours = next((c for c in causes(exc) if isinstance(c, (UntrustedStateError, CorruptCheckpointError))), None)
            if ours is not None:  # a shard refused as it was opened (_open_member)
                raise ours from None
            text = str(exc)
            if "Weights only load failed" in text or "WeightsUnpickler" in text:
                raise UntrustedStateError(f"refusing to read {folder}: a shard holds a pickled object that is not a "
                                          f"tensor, and loading it could run code; resume from a checkpoint you "
                                          f"trust") from None
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)[:200]
            raise CorruptCheckpointError(f"cannot read the shards of {folder} ({first}); {FIX}") from None
    return out


def load_dcp_state(folder: str, *, model_only: bool = False) -> dict[str, Any]:
    """The whole training state of a sharded checkpoint, in a state file's layout (``model``,
    ``optimizer``, ``lr_scheduler``, ``grad_scaler``, ``step``, ``job``, ``callbacks``): the chunks
    of every worker reassembled, whatever their number, and a tensor-parallel job's shards merged
    into the whole tensors (the single-worker layout, whatever ``T`` wrote it). ``model_only``: only ``model`` and the
    identity (what an export needs)."""
    manifest = read_manifest(folder)
    meta = load_state(os.path.join(folder, "rank-00000", META))
    if meta.get("step") != manifest["step"]:
        raise CorruptCheckpointError(f"{os.path.join(folder, 'rank-00000', META)} is of step {meta.get('step')}, the "
                                     f"manifest of step {manifest['step']}: files of two checkpoints; {FIX}")
    shapes = {e["fqn"]: tuple(e["shape"]) for e in manifest["entries"]}
    wanted = {f: (0, math.prod(s)) for f, s in shapes.items() if not model_only or f.startswith("model/")}
    flat = load_ranges(folder, manifest, wanted)
    metas = [meta]
    pipeline = meta.get("pipeline")
    if isinstance(pipeline, dict):  # one meta.pt per stage, by replica 0's member of it (its tensor rank 0)
        metas += _stage_metas(folder, pipeline)
        _merge_cuts(folder, flat, shapes, pipeline, metas)
    keys = [k for m in metas for k in m.get("model_keys", [])]
    keys = keys or sorted(f[len("model/"):] for f in wanted if f.startswith("model/"))
    state = {k: v for k, v in meta.items() if k not in ("model", "model_keys", "model_aliases", "optimizer", "stage")}
    empty = {k: v for m in metas for k, v in (m.get("model") or {}).items()}  # tensors without elements
    try:
        state["model"] = {k: empty[k] if k in empty else flat[f"model/{k}"].view(shapes[f"model/{k}"]) for k in keys}
    except KeyError as exc:
        raise CorruptCheckpointError(f"{folder}: the model tensor {exc.args[0]} is in no shard; {FIX}") from None
    for m in metas:  # tied weights (written once per name) are one tensor again, as in the model
        aliases = m.get("model_aliases")
        for alias, kept in (aliases.items() if isinstance(aliases, dict) else ()):
            if alias in state["model"] and kept in state["model"] and (
                    state["model"][alias].shape == state["model"][kept].shape
                    and state["model"][alias].dtype == state["model"][kept].dtype):
                state["model"][alias] = state["model"][kept]
    if model_only:
        return state
    if isinstance(pipeline, dict):  # gather_state's layout: one optimizer and scheduler state per stage
        state["optimizer"] = {"pipeline_stages": [_optimizer_of(m, flat, shapes, f"optimizer/stage/{s}/state/")
                                                  for s, m in enumerate(metas)]}
        state["lr_scheduler"] = {"pipeline_stages": [m.get("lr_scheduler") for m in metas]}
        state["pipeline"] = {**pipeline, "stage_params": [m.get("param_names") for m in metas]}
        return state
    state["optimizer"] = _optimizer_of(meta, flat, shapes, "optimizer/state/")
    return state


def _optimizer_of(meta: dict[str, Any], flat: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                  prefix: str) -> dict[str, Any]:
    """An optimizer ``state_dict``: ``meta``'s hyperparameters and non-tensor entries, and the
    tensors of the entries named ``<prefix><index>/<key>``."""
    opt = meta.get("optimizer") or {}
    per: dict[int, dict[str, Any]] = {int(p): dict(v) for p, v in (opt.get("state") or {}).items()}
    for fqn, t in flat.items():
        m = re.fullmatch(re.escape(prefix) + r"(\d+)/(.+)", fqn)
        if m is not None:
            per.setdefault(int(m.group(1)), {})[m.group(2)] = t.view(shapes[fqn])
    return {"state": dict(sorted(per.items())), "param_groups": opt.get("param_groups", [])}


def peek_dcp(folder: str) -> dict[str, Any]:
    """A sharded checkpoint verified (manifest and every file's digest) and described without
    reading its tensors: ``meta.pt``'s contents with ``model`` as empty tensors of the saved
    shapes (on the ``meta`` device), what a resume checks the job against."""
    manifest = read_manifest(folder)
    meta = load_state(os.path.join(folder, "rank-00000", META))
    if meta.get("step") != manifest["step"]:
        raise CorruptCheckpointError(f"{os.path.join(folder, 'rank-00000', META)} is of step {meta.get('step')}, the "
                                     f"manifest of step {manifest['step']}: files of two checkpoints; {FIX}")
    shapes = {e["fqn"][len("model/"):]: tuple(e["shape"]) for e in manifest["entries"] if e["fqn"].startswith("model/")}
    shapes = _whole_shapes(folder, shapes, meta.get("pipeline"))  # a tensor-parallel job's shards counted whole
    keys = list(shapes) if meta.get("pipeline") else meta.get("model_keys") or sorted(shapes)
    empty = meta.get("model") or {}
    meta["model"] = {k: torch.empty(shapes[k] if k in shapes else tuple(empty[k].shape) if k in empty else (0,),
                                    device="meta") for k in keys}
    if isinstance(meta.get("pipeline"), dict):  # each stage's parameter names (so that it can be cut again)
        meta["pipeline"]["stage_params"] = [m.get("param_names") for m in [meta] + _stage_metas(folder, meta["pipeline"])]
    return meta


def _stage_metas(folder: str, saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``meta.pt`` of stages ``1 .. P-1``: written by generation rank ``s T`` (replica 0's
    tensor rank 0 of stage ``s``; ``T = 1`` without tensor parallelism)."""
    width = int(saved.get("tensor", 1))
    return [load_state(os.path.join(folder, f"rank-{s * width:05d}", META)) for s in range(1, int(saved["stages"]))]


def _split_of(folder: str, saved: dict[str, Any], name: str) -> Any:
    """The recorded :class:`~virtualflow.parallel.convert.Split` that cut parameter ``name``."""
    from virtualflow.parallel.convert import Split

    spec = (saved.get("splits") or {}).get(name)
    if not (isinstance(spec, list) and len(spec) == 3 and all(isinstance(x, int) for x in spec)):
        raise CorruptCheckpointError(f"{folder}: {name} is written in tensor shards, but the checkpoint records no "
                                     f"split for it; {FIX}")
    return Split(dim=spec[0], blocks=spec[1], units=spec[2])


def _whole_shapes(folder: str, shapes: dict[str, tuple[int, ...]], saved: Any) -> dict[str, tuple[int, ...]]:
    """Model entry shapes by name (``shapes``: of the manifest's entries), the shard entries
    ``<name>@tp<t>`` counted once, as the whole tensor (its cut dimension ``T`` times the shard's);
    ``saved``: the checkpoint's ``pipeline`` record (``None`` for an unpipelined job: no shards)."""
    saved = saved if isinstance(saved, dict) else {}
    width = int(saved.get("tensor", 1))
    out: dict[str, tuple[int, ...]] = {}
    for fqn, shape in shapes.items():
        name, mark, _ = fqn.partition(CUT)
        if not mark:
            out[name] = shape
            continue
        dim = _split_of(folder, saved, name).dim
        out[name] = tuple(n * width if i == dim else n for i, n in enumerate(shape))
    return out


def _merge_cuts(folder: str, flat: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                saved: dict[str, Any], metas: list[dict[str, Any]]) -> None:
    """Replace the shard entries (``<fqn>@tp<t>``, ``t < T``) by the whole entry ``<fqn>`` (in
    place, in ``flat`` and ``shapes``): the shards merged by the split of their parameter
    (``Split.merge``, the inverse of the cut, bit for bit). An optimizer entry's parameter is its
    stage's ``param_names[index]``."""
    width = int(saved.get("tensor", 1))
    bases = sorted({fqn.partition(CUT)[0] for fqn in flat if CUT in fqn})
    for base in bases:
        parts = [f"{base}{CUT}{t}" for t in range(width)]
        if any(p not in flat for p in parts):
            raise CorruptCheckpointError(f"{folder}: {base} lacks some of its {width} tensor shards; {FIX}")
        m = re.fullmatch(r"optimizer/stage/(\d+)/state/(\d+)/.+", base)
        try:
            name = base[len("model/"):] if m is None else metas[int(m.group(1))]["param_names"][int(m.group(2))]
        except (IndexError, KeyError, TypeError):
            raise CorruptCheckpointError(f"{folder}: {base} names no parameter of its stage; {FIX}") from None
        whole = _split_of(folder, saved, name).merge([flat.pop(p).view(shapes.pop(p)) for p in parts])
        flat[base], shapes[base] = whole.reshape(-1), tuple(whole.shape)


def load_dcp_model(folder: str) -> dict[str, torch.Tensor]:
    """The model ``state_dict`` of a sharded checkpoint (consolidated)."""
    return load_dcp_state(folder, model_only=True)["model"]


def load_checkpoint(path: str) -> dict[str, Any]:
    """A state file or a sharded checkpoint folder, read and verified (the whole state)."""
    return load_dcp_state(path) if is_dcp(path) else load_state(path)


# -- helpers ------------------------------------------------------------------------------------
def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for DCP's ``CheckpointException``, what each rank raised (its ``failures``
    map a rank to an ``(exception, traceback)`` pair)."""
    out = [exc]
    for failure in getattr(exc, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, BaseException):
            out.append(cause)
    return out


def _refused_link(path: str) -> UntrustedStateError:
    return UntrustedStateError(f"refusing to read {path}: it is a symbolic link; a checkpoint's files and folders are "
                               f"read only as regular files and folders of the checkpoint itself")


def _open_member(folder: str, name: str) -> int:
    """A read-only descriptor of the regular file ``name`` (``rank-00000/__0_0.distcp``,
    ``manifest.json``) of the checkpoint ``folder``. Every component below ``folder`` is opened
    with ``O_NOFOLLOW`` relative to its parent (a symbolic link anywhere, a ``rank-N/`` folder
    included, is refused, with no race between a check and the open), the file with
    ``O_NONBLOCK`` (a FIFO must not block the open) and checked to be a regular file before
    anything is read."""
    nofollow, nonblock = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_NONBLOCK", 0)
    cloexec, directory = getattr(os, "O_CLOEXEC", 0), getattr(os, "O_DIRECTORY", 0)
    *dirs, leaf = name.split("/")
    where = folder
    try:
        dfd = os.open(folder, os.O_RDONLY | directory | cloexec)
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {folder}: {exc.strerror or exc}; {FIX}") from None
    try:
        for part in dirs:
            where = os.path.join(where, part)
            try:
                fd = os.open(part, os.O_RDONLY | directory | nofollow | cloexec, dir_fd=dfd)
            except OSError as exc:
                raise _open_error(where, exc) from None
            os.close(dfd)
            dfd = fd
        where = os.path.join(where, leaf)
        try:
            fd = os.open(leaf, os.O_RDONLY | nofollow | nonblock | cloexec, dir_fd=dfd)
        except OSError as exc:
            raise _open_error(where, exc) from None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedStateError(f"refusing to read {where}: it is not a regular file (a FIFO, device or "
                                      f"folder where the checkpoint has a file); {FIX}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(path: str, exc: OSError) -> Exception:
    """What failing to open a component ``path`` of a checkpoint means."""
    if os.path.islink(path) or exc.errno == errno.ELOOP:
        return _refused_link(path)
    if exc.errno == errno.ENOENT:
        return CorruptCheckpointError(f"{path} is missing (the manifest lists it); {FIX}")
    if exc.errno == errno.ENOTDIR:
        return CorruptCheckpointError(f"{path} is not a folder (a checkpoint's rank-N is one); {FIX}")
    return CorruptCheckpointError(f"cannot read {path}: {exc.strerror or exc}; {FIX}")


def read_file(folder: str, name: str) -> bytes:
    """The bytes of the regular file ``name`` of the checkpoint ``folder`` (see :func:`_open_member`)."""
    fd = _open_member(folder, name)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {os.path.join(folder, name)}: {exc.strerror or exc}; "
                                     f"{FIX}") from None


def file_digest(path: str) -> dict[str, Any]:
    """Size and SHA-256 of a file this worker just wrote (a checkpoint being made)."""
    folder, name = os.path.split(path)
    fd = _open_member(folder, name)
    return _digest_of(fd, path)


def _digest_of(fd: int, path: str) -> dict[str, Any]:
    """Size and SHA-256 of the open file ``fd`` (closed here)."""
    h, n = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
                n += len(block)
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {path}: {exc.strerror or exc}; {FIX}") from None
    return {"bytes": n, "sha256": h.hexdigest()}


def json_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
