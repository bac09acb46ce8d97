"""Which job's run a run directory holds: ``RUN_DIR/job_identity.json``, written when a run starts
there, checked when a later launch continues it.

A resume checks its state against the job (:mod:`virtualflow.launching.resume`: *B*, *V*, seed,
data order, the model's shapes), but two jobs can agree on all of that (another job file with
the same model and batch, another dataset or loss): such a job resumed into the run directory
and replaced its ``final.pt`` without a word. The identity names the job, so that a launch that
continues a run directory (``--resume RUN_DIR``, or one of its states with ``--run-dir RUN_DIR``)
is refused when it runs another job, naming what differs and the two ways out (another
``--run-dir``; or ``--overwrite`` without ``--resume``, which sets the earlier run aside).

Invariants.

* **The identity is what defines the model a run trains**, not how it runs: the job's function
  (``tiny_lm:make_job``: the file's or module's last name and the function; ``None`` for a
  ``Job`` object or a lambda, which have no stable name), ``Job.name``, the global batch size,
  the virtual nodes, the seed, the data order, and a SHA-256 of the model's ``state_dict``
  names, shapes and dtypes, in order. Steps, epochs, worker counts, elasticity, the pipeline's
  layout, the device and the checkpoint format may change between launches of one run.
* **A job function's name is compared only when both launches have one** (the same job can be
  passed as a ``Job`` object one time and as its function the next).
* **A record that cannot be read is dropped and logged**, then written again (the resume's own
  checks on the state still apply): a damaged file never blocks a resume, and never passes a
  foreign job either, since it is then checked as a run directory that records no identity.
* A run directory written before this file existed records none: its next launch adopts it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

from virtualflow.config.job import Job, JobSource
from virtualflow.records.rundir import IDENTITY_FILE, read_json, write_json

logger = logging.getLogger("virtualflow")

__all__ = ["IDENTITY_FILE", "check_identity", "job_label", "model_fingerprint", "record_identity", "run_identity"]

_FORMAT = "virtualflow-run-identity-v1"
_COMPARED = ("job", "name", "global_batch_size", "virtual_nodes", "seed", "data_order", "model")


def job_label(job: Job | Callable[[], Job] | str, source: JobSource) -> str | None:
    """``module:function`` naming the job's function by the last part of its module or file name
    (``examples/tiny_lm.py:make_job`` and ``tiny_lm:make_job`` are both ``tiny_lm:make_job``), or
    None for a ``Job`` object or a function with no stable name (a lambda, a closure)."""
    if source.kind == "spec":
        path, _, func = source.target.rpartition(":")
        is_file = path.endswith(".py") or os.sep in path
        stem = os.path.splitext(os.path.basename(path))[0] if is_file else path.rsplit(".", 1)[-1]
        return f"{stem}:{func}"
    if isinstance(job, Job) or not callable(job):
        return None
    qualname = getattr(job, "__qualname__", "") or ""
    if not qualname or "<lambda>" in qualname or "<locals>" in qualname:
        return None
    code = getattr(job, "__code__", None)
    filename = getattr(code, "co_filename", "") or ""
    stem = os.path.splitext(os.path.basename(filename))[0] if filename.endswith(".py") else ""
    stem = stem or str(getattr(job, "__module__", "") or "").rsplit(".", 1)[-1]
    return f"{stem}:{qualname}" if stem else None


def model_fingerprint(signature: list[tuple[str, tuple[int, ...], str]]) -> str:
    """SHA-256 of the model's ``state_dict`` names, shapes and dtypes, in order."""
    body = json.dumps([[name, list(shape), dtype] for name, shape, dtype in signature])
    return hashlib.sha256(body.encode()).hexdigest()


def run_identity(job: Job, label: str | None, signature: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    """The identity of ``job``'s run (see the module docstring)."""
    return {"format": _FORMAT, "job": label, "name": job.name, "global_batch_size": job.global_batch_size,
            "virtual_nodes": job.virtual_nodes, "seed": job.seed, "data_order": job.data_order,
            "model": model_fingerprint(signature), "tensors": len(signature)}


def read_identity(run_dir: str) -> dict[str, Any] | None:
    """The identity ``run_dir`` records, or None (none, or one that cannot be read: logged)."""
    path = os.path.join(run_dir, IDENTITY_FILE)
    if not os.path.lexists(path):
        return None
    found = read_json(path) if os.path.isfile(path) and not os.path.islink(path) else None
    if found is None or found.get("format") != _FORMAT or not all(k in found for k in _COMPARED):
        logger.warning("ignoring %s: it is not a run identity virtualflow wrote (damaged or altered); it is written "
                       "again for this run", path)
        return None
    return found


def check_identity(run_dir: str, identity: dict[str, Any]) -> None:
    """Refuse to continue ``run_dir``'s run with a job whose ``identity`` is not the one it
    records (a ``ValueError`` naming what differs and the fix); nothing is written here."""
    recorded = read_identity(run_dir)
    if recorded is None:
        return
    differs = []
    for key in _COMPARED:
        mine, theirs = identity.get(key), recorded.get(key)
        if key == "job" and (mine is None or theirs is None):
            continue
        if mine != theirs:
            if key == "model":
                differs.append(f"the model's state_dict names, shapes or dtypes ({recorded.get('tensors')} tensors, "
                               f"fingerprint {str(theirs)[:12]}…; this job's: {identity.get('tensors')} tensors, "
                               f"{str(mine)[:12]}…)")
            else:
                differs.append(f"{key}={theirs!r} (this job: {mine!r})")
    if differs:
        raise ValueError(
            f"the run directory {run_dir} holds a run of another job: {'; '.join(differs)} (recorded in "
            f"{os.path.join(run_dir, IDENTITY_FILE)}). Continuing it with this job would mix two jobs' states and "
            f"replace its final.pt. Resume that run with its own job; or give this run another run directory "
            f"(--run-dir NEW: it may still start from that run's state with --resume); or start this job afresh "
            f"there with --overwrite and without --resume (the earlier run is moved into {run_dir}/previous-<time>/)"
        )


def record_identity(run_dir: str, identity: dict[str, Any]) -> None:
    """Write ``identity`` as ``run_dir``'s (atomically)."""
    write_json(os.path.join(run_dir, IDENTITY_FILE), identity)
