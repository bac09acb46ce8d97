"""Training-state files: written atomically with their checksum inside, read as data only.

A state file holds ``{"model", "optimizer", "lr_scheduler", "step", "job", "checksum"}``: plain
data (tensors, numbers, strings, lists, dicts), as ``torch.save`` writes it, so that
``torch.load(path, weights_only=True)`` reads it.

Invariants:

* **Nothing is unpickled but data.** :func:`load_state` reads with ``weights_only=True``: a file
  holding any other object (one whose unpickling would call a function, as a tampered
  checkpoint's does) is refused with :class:`UntrustedStateError` before anything of it runs.
* **A complete file is never read as corrupt, a corrupt one never as good.** The checksum is
  *inside* the file: ``checksum.sha256`` is a SHA-256 of the state's contents (every tensor's
  dtype, shape and bytes, every other value, in order; :func:`content_digest`), computed before
  the write and checked after the load. One file is written by one atomic rename
  (:func:`virtualflow.records.rundir.atomic_write`), so there is no moment at which a state and a
  separate checksum disagree (with a ``.sha256`` sidecar there was: a crash between the two
  renames left a good file that read as corrupt). A truncated file fails to load; a flipped
  bit fails the checksum. Files written before this format (a ``.sha256`` sidecar over the
  file's bytes) are still verified by their sidecar.
* **A state file is read only as a regular file.** It is opened with ``O_NOFOLLOW`` (and checked
  to be a regular file): a symbolic link named ``final.pt`` (or any state file, or its sidecar)
  is refused with :class:`UntrustedStateError`, so a link planted in a run directory cannot
  redirect a resume or a result to another file. (Writing never follows one either: the atomic
  rename replaces a link, not its target.)
* **An interrupted write leaves nothing behind for long.** :func:`atomic_write` writes to a
  hidden ``.<name>.tmp-<pid>-<8 hex>`` beside the file; a writer killed before its rename leaves
  that file. Every :func:`save_state` first removes, in its folder, the state temporaries whose
  writer is gone (:func:`remove_stale_temps`): a process id that is not alive on this host, or a
  file untouched for :data:`STALE_TEMP_S` (a writer on another host of a shared run directory).
  A run's state files are written one at a time (by its rank 0, at step boundaries), so a live
  writer's temporary is never taken for a stale one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import pickle
import re
import stat
import time
from collections.abc import Mapping
from typing import Any

import torch

from virtualflow.records.rundir import atomic_write, temporary_of

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "checksum"
_SCHEME = "virtualflow-state-content-v1"
STALE_TEMP_S = 600.0
"""A state temporary untouched this long is stale whoever wrote it (a live writer keeps writing)."""


class CorruptCheckpointError(RuntimeError):
    """A state file does not match its checksum, cannot be read, or is not a training state."""


class UntrustedStateError(ValueError):
    """A state file holds objects other than plain data: loading it could run code. Refused."""


def save_state(path: str, state: dict[str, Any]) -> str:
    """Write ``state`` to ``path`` atomically with its content checksum inside; returns the checksum."""
    digest = content_digest(state)
    body = {**state, CHECKSUM_KEY: {"sha256": digest, "scheme": _SCHEME}}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temps(folder)
    atomic_write(path, lambda f: torch.save(body, f))
    return digest


def remove_stale_temps(folder: str) -> list[str]:
    """Remove the temporaries of state writes in ``folder`` whose writer is gone (see the module
    docstring); returns their names. Anything else, a temporary of a live writer included, is
    left alone."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        found = temporary_of(name)
        if found is None or not found[0].endswith(".pt"):
            continue  # not the temporary of a state file
        target, pid = found
        full = os.path.join(folder, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # not something atomic_write made
        if _writer_alive(pid) and now - st.st_mtime < STALE_TEMP_S:
            continue
        try:
            os.unlink(full)
        except OSError:
            continue
        removed.append(name)
        logger.info("removed %s, left by an interrupted write of %s", full, target)
    return removed


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid`` lives on this host (a zombie, killed and not yet reaped, does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's process, or a number no process can have
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _read_regular(path: str) -> bytes:
    """The bytes of the regular file ``path``; a symbolic link or any other kind of file is refused
    (:class:`UntrustedStateError`), a file that cannot be read is a :class:`CorruptCheckpointError`."""
    if os.path.islink(path):
        raise _link_refused(path)
    try:
        # O_NOFOLLOW closes the race with the check above; O_NONBLOCK: a FIFO must not block the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(path) from None
        raise CorruptCheckpointError(f"cannot read state file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UntrustedStateError(f"refusing to read {path}: it is not a regular file (state files are written "
                                      f"as regular files); pass the path of a state file to resume")
        return f.read()


def _link_refused(path: str) -> UntrustedStateError:
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return UntrustedStateError(
        f"refusing to read {path}: it is a symbolic link{target}, and state files are read only as regular files "
        f"(a link planted in a run directory must not redirect a resume or a result); copy the state file itself "
        f"there, or pass its real path to resume"
    )


def load_state(path: str) -> dict[str, Any]:
    """Read and verify a state file (plain data only); the returned dict has no ``checksum``."""
    data = _read_regular(path)
    if not data:
        raise CorruptCheckpointError(f"state file {path} is empty (truncated)")
    state = _load_data(path, data)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path} is not a training state (a torch file holding a "
                                     f"{type(state).__name__}, not a dict with model, optimizer and step)")
    recorded = state.pop(CHECKSUM_KEY, None)
    if recorded is not None:
        expected = recorded.get("sha256") if isinstance(recorded, dict) else None
        actual = content_digest(state)
        if actual != expected:
            raise CorruptCheckpointError(f"state file {path} is corrupt: the checksum of its contents {actual[:12]}… "
                                         f"does not match the recorded {str(expected)[:12]}…")
    elif os.path.lexists(path + ".sha256"):  # written before the checksum moved inside the file
        expected = _read_regular(path + ".sha256").decode("ascii", "replace").strip()
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise CorruptCheckpointError(f"state file {path} is corrupt or truncated: sha256 {actual[:12]}… does not "
                                         f"match the recorded {expected[:12]}…")
    _check_shape(path, state)
    return state


def _load_data(path: str, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_global(str(exc))
        if refused is not None:
            raise UntrustedStateError(
                f"refusing to load {path}: it holds a pickled object that is not plain training data (it calls "
                f"{refused}), and loading it could run code; a state virtualflow wrote holds only tensors, numbers, "
                f"strings, lists and dicts. Resume from a state file you trust"
            ) from None
        raise CorruptCheckpointError(f"state file {path} is corrupt or truncated: {_first_line(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes torch raise
        raise CorruptCheckpointError(f"state file {path} is corrupt or truncated: {_first_line(str(exc))}") from None


def _refused_global(text: str) -> str | None:
    """The function or class a weights-only load refused to import (``GLOBAL os.system``), if
    that is why it failed: the mark of a pickle built to run code, not of a damaged file."""
    if "Weights only load failed" not in text:
        return None
    found = re.search(r"GLOBAL\s+([\w.]+)", text)
    return found.group(1) if found else None


def _first_line(text: str) -> str:
    """The informative first sentence of a torch load error."""
    unpickler = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    if unpickler is not None:
        return unpickler.group(1).strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0].split(". ")[0][:300] if lines else "unreadable"


def _check_shape(path: str, state: dict[str, Any]) -> None:
    model, step = state.get("model"), state.get("step")
    problems = []
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in model.items()):
        problems.append("'model' is not a dict of tensors")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        problems.append(f"'step' is {step!r}, not a step count")
    if not isinstance(state.get("optimizer"), Mapping):
        problems.append("'optimizer' is not a state dict")
    if problems:
        raise CorruptCheckpointError(f"{path} is not a training state written by virtualflow ({'; '.join(problems)}); "
                                     f"resume from a run directory or one of its state files")


def content_digest(state: Any) -> str:
    """SHA-256 over the contents of a state: every tensor's dtype, shape and bytes (wherever it
    lives), every number, string and ``None``, and the structure of dicts, lists and tuples, in
    order. The same for a state before ``torch.save`` and after ``torch.load``."""
    h = hashlib.sha256(_SCHEME.encode())
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}{t.layout};".encode())
        if t.layout == torch.strided and t.numel():
            t = t.resolve_conj().resolve_neg().cpu().contiguous()
            try:
                h.update(t.reshape(-1).view(torch.uint8).numpy())
            except (RuntimeError, TypeError):  # quantized and other exotic tensors: dtype and shape only
                pass
    elif obj is None:
        h.update(b"n;")
    elif isinstance(obj, bool):
        h.update(b"b1;" if obj else b"b0;")
    elif isinstance(obj, int):
        h.update(f"i{obj};".encode())
    elif isinstance(obj, float):
        h.update(f"f{obj!r};".encode())
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        h.update(f"s{len(raw)};".encode() + raw)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(f"y{len(obj)};".encode() + bytes(obj))
    elif isinstance(obj, Mapping):
        h.update(f"d{len(obj)};".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'l' if isinstance(obj, list) else 't'}{len(obj)};".encode())
        for v in obj:
            _feed(h, v)
    else:  # torch.dtype, torch.device, ...: what a weights-only load may return besides the above
        h.update(f"o{type(obj).__module__}.{type(obj).__qualname__}:{obj};".encode())


_NUMBERED = re.compile(r"step-(\d+)\.pt")


def prune_state_files(folder: str, keep: int, recorded: int | None = None) -> list[str]:
    """Keep the newest ``keep`` state files ``step-N.pt`` of ``folder`` (and never the newest one
    of a step below ``recorded``, the steps the run's records reach: see docs/elasticity.md, "The
    coordinator cut off"); remove the others with their legacy ``.sha256`` sidecars, and sidecars
    whose state file is gone (a prune cut short between the two removals). Each removal is one
    ``unlink``: a crash leaves every file whole, and the newest ``keep`` there. Returns the
    names removed."""
    names = os.listdir(folder)
    kept = sorted(n for n in names if _NUMBERED.fullmatch(n))
    old_ones = kept[: max(0, len(kept) - keep)]
    if recorded is not None:  # never remove the newest checkpoint the run's records reach
        within = [n for n in kept if int(_NUMBERED.fullmatch(n).group(1)) <= recorded]  # type: ignore[union-attr]
        if within and within[-1] in old_ones:
            old_ones.remove(within[-1])
    doomed = [n + suffix for n in old_ones for suffix in ("", ".sha256")]
    doomed += [n for n in names if n.endswith(".sha256") and _NUMBERED.fullmatch(n[: -len(".sha256")])
               and n[: -len(".sha256")] not in kept]
    removed = []
    for name in doomed:  # the state file before its sidecar: a sidecar alone is no state
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            continue
        removed.append(name)
    return removed


def shared_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: kept}`` for the tensors of ``tensors`` (a ``state_dict``) that are the same tensor
    under another name (tied weights: the same storage, offset, shape, strides and dtype), each
    mapped to the first of its names; empty tensors are never aliases. What a writer records so
    that a reader can tie them again, as :func:`safetensors.torch.save_model` records it."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.numel() or t.layout != torch.strided or t.device.type == "meta":
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out
