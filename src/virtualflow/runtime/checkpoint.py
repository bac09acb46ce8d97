"""Training-state files: written atomically, verified by checksum when read.

A state file holds ``{"model", "optimizer", "lr_scheduler", "step", "job"}``. It is written to a
temporary file in the same directory, fsynced and renamed, with its SHA-256 in a ``.sha256``
sidecar written the same way; a reader that finds a mismatch or a truncated file gets a clear
error instead of silently wrong weights.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

import torch


class CorruptCheckpointError(RuntimeError):
    """A state file does not match its recorded checksum, or cannot be read."""


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_state(path: str, state: dict[str, Any]) -> str:
    """Write ``state`` to ``path`` atomically; returns its SHA-256."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _atomic_write(path, data)
    _atomic_write(path + ".sha256", digest.encode())
    return digest


def load_state(path: str) -> dict[str, Any]:
    """Read a state file, verifying its checksum when a sidecar exists."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read state file {path}: {exc}") from exc
    sidecar = path + ".sha256"
    if os.path.exists(sidecar):
        with open(sidecar) as f:
            expected = f.read().strip()
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise CorruptCheckpointError(
                f"state file {path} is corrupt or truncated: sha256 {actual[:12]}… does not match "
                f"the recorded {expected[:12]}…"
            )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CorruptCheckpointError(f"cannot load state file {path}: {exc}") from exc
