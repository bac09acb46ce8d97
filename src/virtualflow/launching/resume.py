"""Resuming a job: find the newest good state of a run and check that it belongs to the job.

A run directory's states are ``final.pt`` (written when a run ends or is stopped),
``checkpoint.pt`` (the last good state before a non-finite loss), ``checkpoints/step-N.pt`` and
the sharded ``checkpoints/step-N.dcp/`` (complete once so named: an interrupted save is a
``.partial`` folder, and a pruned one being deleted a ``.discarded-<hex>`` folder, never a
candidate; every file is checked against its manifest); a symbolic link named ``checkpoints`` is
refused. ``resume`` may also name one state file or ``step-N.dcp`` folder. The newest
by step wins, whatever its kind (on a tie, ``final.pt``), among those the run's records reach: a
state past the last step ``metrics.jsonl`` records was written by workers that trained on while
the coordinator was cut off (their steps never recorded), so an earlier one is used and those
steps are redone, exactly, and recorded once. Corrupt or truncated files
are reported and skipped; a file holding anything but plain data is refused outright (it was
tampered with: see :mod:`virtualflow.runtime.checkpoint`), as is a state from a different job
(other B, V, seed, data order or model shapes), with a message naming what differs; a state of
another grid (data-, pipeline- or tensor-parallel) resumes, re-cut on load
(:mod:`virtualflow.runtime.regrid`); a state
that records no data order was written before ``Job.data_order`` existed, with ``"randperm"``.
Nothing here deletes or moves a state file.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch

from virtualflow.config.job import Job
from virtualflow.plan.batch_schedule import check_recorded
from virtualflow.records.rundir import STATE_FILES
from virtualflow.runtime.checkpoint import CorruptCheckpointError, UntrustedStateError, load_state
from virtualflow.runtime.dcp import is_dcp, peek_dcp
from virtualflow.runtime.regrid import regrid_refusal

logger = logging.getLogger("virtualflow")

_NUMBERED = re.compile(r"step-(\d+)\.(pt|dcp)")


def find_resume_state(resume: str, job: Job | None) -> tuple[str, int]:
    """The newest good state file under ``resume`` (a run directory or a state file) that belongs
    to ``job`` (``None``: any job, as an export reads), and its step; corrupt or truncated files
    are reported and skipped."""
    if is_dcp(resume):  # a sharded checkpoint is a folder too: named, it is the state to resume
        candidates = [(None, resume)]
    elif os.path.isdir(resume):
        candidates = _candidates(resume)
        if not candidates:
            raise ValueError(
                f"resume={resume!r}: no checkpoints in it (final.pt, checkpoint.pt, checkpoints/step-N.pt or "
                f"checkpoints/step-N.dcp); a run "
                f"writes final.pt when it ends or is stopped, and checkpoints with checkpoint_every= "
                f"(--checkpoint-every N)"
            )
    elif os.path.isfile(resume):
        candidates = [(None, resume)]
    else:
        raise ValueError(f"resume={resume!r} is neither a run directory nor a checkpoint file")
    # Files whose step is not in their name are read first, to place them among the numbered ones.
    loaded: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    ordered: list[tuple[int, int, str]] = []
    for step, path in candidates:
        if step is None:
            state = _load(path, problems)
            if state is None:
                continue
            loaded[path] = state
            step = int(state["step"])
        ordered.append((step, 1 if path in loaded else 0, path))
    ordered.sort(reverse=True)
    recorded = recorded_steps(resume) if os.path.isdir(resume) and not is_dcp(resume) else None
    if recorded is not None and ordered and all(step > recorded for step, _, _ in ordered):
        recorded = None  # no state the records reach: the newest good one, as without records
    for step, _, path in ordered:
        if recorded is not None and step > recorded:
            logger.warning("skipping %s: it is at step %d but the run recorded only %d steps (the workers trained on "
                           "while the coordinator was cut off, and nobody recorded those steps); resuming from an "
                           "earlier state redoes them exactly", path, step, recorded)
            continue
        state = loaded.pop(path, None) or _load(path, problems)
        if state is None:
            continue
        if job is not None:
            _check_same_job(path, state, job)
        if problems:
            logger.warning("resuming from %s, the newest good state", path)
        return path, int(state["step"])
    raise ValueError(f"resume={resume!r}: no readable checkpoint ({'; '.join(problems)})")


def recorded_steps(run_dir: str, tail_bytes: int = 1 << 16) -> int | None:
    """How many steps ``run_dir``'s ``metrics.jsonl`` records (its last record's step + 1; the
    file is append-only in step order), or None without a readable record. Only its tail is read."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line cut by the tail, or half-written
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step + 1
    return None


def _candidates(run_dir: str) -> list[tuple[int | None, str]]:
    """(step if the name tells it, path) of every state file of ``run_dir``."""
    out: list[tuple[int | None, str]] = [(None, os.path.join(run_dir, name)) for name in STATE_FILES
                                         if os.path.isfile(os.path.join(run_dir, name))]
    folder = os.path.join(run_dir, "checkpoints")
    if os.path.islink(folder):
        raise UntrustedStateError(
            f"refusing to read {folder}: it is a symbolic link (to {os.readlink(folder)!r}), and a run's checkpoints "
            f"are read only from its own folder (a link planted in a run directory must not redirect a resume); "
            f"move the checkpoints into a real folder there, or pass one checkpoint's real path to --resume")
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            numbered = _NUMBERED.fullmatch(name)  # never step-N.dcp.partial or .discarded-<hex>: no checkpoint
            if numbered is not None:  # a sharded checkpoint's folder is complete once named so
                out.append((int(numbered.group(1)), os.path.join(folder, name)))
    return out


def _load(path: str, problems: list[str]) -> dict[str, Any] | None:
    """The state in ``path``, or None (reported) if it is corrupt. A file that is not plain data
    raises :class:`~virtualflow.runtime.checkpoint.UntrustedStateError`: not skipped, refused."""
    try:
        return peek_dcp(path) if is_dcp(path) else load_state(path)
    except CorruptCheckpointError as exc:
        logger.warning("skipping %s: %s", path, exc)
        problems.append(str(exc))
        return None


def _check_same_job(path: str, state: dict[str, Any], job: Job) -> None:
    saved = state.get("job")
    saved = saved if isinstance(saved, dict) else {}
    for key in ("global_batch_size", "virtual_nodes", "seed"):
        if saved.get(key) != getattr(job, key):
            raise ValueError(
                f"the checkpoint {path} is from a different job: its {key}={saved.get(key)!r}, the job's is "
                f"{getattr(job, key)!r}. Resume with the same {key} (--{key.replace('_', '-')}), or start a new run"
            )
    _check_same_data_order(path, saved, job)
    check_recorded(state, job.batch_schedule)  # the batch changes its steps ran (Job.batch_schedule)
    _check_same_pipeline(path, state, job)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        expected = {k: tuple(v.shape) for k, v in job.model().state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state["model"].items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(
            f"the checkpoint {path} holds a different model than the job's (first differences: {diff}); "
            f"resume it with the job that wrote it"
        )


def _check_same_data_order(path: str, saved: dict[str, Any], job: Job) -> None:
    """The rest of the run must read the samples in the order its first steps did."""
    order = saved.get("data_order", "randperm")  # states from before data_order: torch.randperm's order
    if order != job.data_order:
        raise ValueError(
            f"the checkpoint {path} was trained with data_order={order!r}, the job has "
            f"data_order={job.data_order!r}; resume with Job(data_order={order!r}, ...) to keep its sample order"
        )


def _check_same_pipeline(path: str, state: dict[str, Any], job: Job) -> None:
    """A state resumes on any grid: other data- or tensor-parallel widths need nothing (a state
    holds the single-worker layout of the model), and other stages, another split, or a pipeline
    where there was none (and back) re-cut its optimizer state by parameter name
    (:mod:`virtualflow.runtime.regrid`), except for an optimizer of several parameter groups. The
    schedule may change, except to or from 2BW, whose older weight version a state does not hold."""
    saved = state.get("pipeline")
    saved = saved if isinstance(saved, dict) else None
    pipeline = job.pipeline
    if saved is None and pipeline is None:
        return
    bounds = (saved or {}).get("bounds")
    counts = tuple(int(b) - int(a) for a, b in bounds) if isinstance(bounds, list) else None
    same = saved is not None and pipeline is not None and (saved.get("stages"), counts) == (pipeline.stages,
                                                                                          tuple(pipeline.split))
    refusal = None if same else regrid_refusal(state)
    if refusal is not None:
        raise ValueError(f"the checkpoint {path} cannot resume on this grid: {refusal}")
    if "2bw" in ((saved or {}).get("schedule"), pipeline.schedule if pipeline is not None else None):
        raise ValueError(
            f"the checkpoint {path} cannot resume a 2bw run (or be resumed by one): a state does not hold 2BW's "
            f"older weight version; resume with a flush schedule, or start afresh"
        )
