"""A fingerprint of the dataset a worker built, so that workers whose datasets differ are refused.

Every worker process builds ``Job.dataset`` itself, and the data plan addresses samples by index
(or by position in a stream): two processes that build different datasets (an unseeded shuffle,
a listing of files in the directory's order) train on different samples under the same indices,
which silently changes the result with the number of workers. Each worker therefore reports a
fingerprint with its ``join`` (:func:`fingerprint`); the coordinator compares every worker's
with the first one it received (:func:`compare`) and fails the job on a difference, naming it.
A newcomer joining in a resize or as a replacement reports one too.

Invariants: the fingerprint reads a few samples at fixed indices only (:data:`SAMPLES` of a
map-style dataset: the first, the middle and the last; the first sample of a streaming dataset's
first non-empty shard), under a fixed seed of torch's, Python's and NumPy's random generators
(their states restored afterwards), so a random augmentation drawn from those does not read as
a difference; a sample's hash covers its tensors' dtypes, shapes and bytes, its numbers, strings
and structure, and only the type's name of anything else (whose ``repr`` may carry an address).
Pure: no store, no process group.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch

from virtualflow.config.streaming import as_streaming

__all__ = ["CAUSE", "SAMPLES", "compare", "fingerprint"]

SAMPLES = 3
"""Samples hashed in a map-style dataset: indices 0, len // 2 and len - 1."""

CAUSE = "the dataset must be built deterministically in every worker process (seed your shuffle)"

_SEED = 0x5EED


def _feed(h: Any, value: Any, depth: int = 0) -> None:
    """Add ``value`` to the hash ``h`` (a canonical byte stream: type tags, then contents)."""
    if depth > 20:
        h.update(b"<deep>")
        return
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (bool, int, float, complex, type(None))):
        h.update(f"N{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, str):
        h.update(b"S%d:" % len(value) + value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"B%d:" % len(value) + bytes(value))
    elif isinstance(value, dict):
        h.update(b"D%d:" % len(value))
        for k in sorted(value, key=repr):
            _feed(h, k, depth + 1)
            _feed(h, value[k], depth + 1)
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d:" % len(value))
        for v in value:
            _feed(h, v, depth + 1)
    elif hasattr(value, "tobytes") and hasattr(value, "dtype") and hasattr(value, "shape"):  # a NumPy array
        h.update(f"A{value.dtype}{tuple(value.shape)}".encode() + value.tobytes())
    else:  # an object of the job's own: its type only (a default repr carries its address)
        h.update(f"O{type(value).__module__}.{type(value).__qualname__};".encode())


def sample_hash(sample: Any) -> str:
    """16 hex digits of the SHA-256 of ``sample`` (see the module docstring)."""
    h = hashlib.sha256()
    _feed(h, sample)
    return h.hexdigest()[:16]


def _seeded(read: Any) -> Any:
    """``read()`` under fixed seeds of torch's, Python's and NumPy's generators, restored after."""
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        random.seed(_SEED)
        if np is not None:
            np.random.seed(_SEED)
        try:
            return read()
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def fingerprint(dataset: Any) -> dict[str, str]:
    """What this process's ``dataset`` looks like: ``{"len": "<n>", "sample <i>": "<hash>", ...}``
    (a streaming dataset: ``"shards"``, the hash of its shard lengths, and ``"stream sample 0"``)."""
    stream = as_streaming(dataset)
    if stream is not None:
        lengths = [int(n) for n in stream.lengths or []]
        out = {"len": str(sum(lengths)), "shards": sample_hash(lengths)}
        first = next((k for k, n in enumerate(lengths) if n > 0), None)
        if first is not None:
            shard = stream.shards[first]

            def read() -> Any:
                samples = shard(0) if stream.seek and callable(shard) else (shard() if callable(shard) else shard)
                return next(iter(samples))

            out[f"stream sample 0 of shard {first}"] = sample_hash(_seeded(read))
        return out
    n = len(dataset)
    out = {"len": str(n)}
    for i in sorted({0, n // 2, n - 1}) if n > 0 else []:
        out[f"sample {i}"] = sample_hash(_seeded(lambda i=i: dataset[i]))
    return out


def compare(reference: dict[str, str], reference_worker: int, other: dict[str, str], worker: int) -> str | None:
    """None when ``other`` (worker ``worker``'s fingerprint) matches ``reference`` (worker
    ``reference_worker``'s), else the error: what differs, in both, and the cause."""
    keys = list(reference) + [k for k in other if k not in reference]
    diffs = [f"{k}: {reference.get(k, 'absent')} vs {other.get(k, 'absent')}" for k in keys
             if reference.get(k) != other.get(k)]
    if not diffs:
        return None
    return (f"worker {worker}'s dataset differs from worker {reference_worker}'s ({'; '.join(diffs[:6])}; "
            f"worker {reference_worker} vs worker {worker}): {CAUSE}")
