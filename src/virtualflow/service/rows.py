"""One job's row of the cluster database, read defensively (:class:`JobRow`).

Invariants: reading never raises for a bad cell. A malformed JSON cell or a bad counter reads as
its default (logged once per cell and value, never a flood); a row whose defining cells are
unusable (steps, worker bounds, priority, state, ...) reads as **quarantined**
(:attr:`JobRow.quarantine` says why, ``state`` reads :data:`QUARANTINED`, never stored): it shows
in ``queue`` and is never scheduled, and the other jobs run on.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["QUARANTINED", "FINAL_STATES", "JOB_STATES", "JobRow", "loads_cell", "warn_once"]

QUARANTINED = "quarantined"
"""The state a row reads as when its defining cells are unusable (never stored)."""
FINAL_STATES = ("done", "failed", "cancelled")
JOB_STATES = ("queued", "running") + FINAL_STATES

_WARNED: set[tuple[str, str]] = set()
"""(cell, value) pairs already logged: the service reads its rows several times a second, and a
bad cell is worth one line, not a flood."""


def warn_once(where: str, value: Any, msg: str, *args: Any) -> None:
    key = (where, repr(value)[:200])
    if key in _WARNED:
        return
    if len(_WARNED) < 10000:
        _WARNED.add(key)
    log.warning(msg, *args)


def loads_cell(text: Any, default: Any, where: str) -> Any:
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        warn_once(where, text, "malformed JSON in %s: %r (read as %r)", where, str(text)[:200], default)
        return default


@dataclass(slots=True)
class JobRow:
    """One row of ``jobs`` (see the module docstring)."""

    id: int
    name: str
    target: str
    steps: int
    elastic: bool
    min_workers: int
    max_workers: int
    priority: float
    job_type: str | None
    deterministic: bool
    checkpoint_every: int
    submitted_s: float
    state: str
    steps_done: int = 0
    acc_type: str | None = None
    workers: int = 0
    slots: list[str] = field(default_factory=list)
    started_s: float | None = None
    finished_s: float | None = None
    run_dir: str = ""
    error: str | None = None
    cancel_requested: bool = False
    starts: int = 0
    restarts: int = 0
    resizes: int = 0
    loss: float | None = None
    received: dict[str, float] = field(default_factory=dict)
    """accelerator type -> seconds the job has held workers of that type."""
    estimates: dict[str, float] = field(default_factory=dict)
    """``"TYPE/WORKERS"`` -> measured steps/s (the service's estimates for this job)."""
    deadline_s: float | None = None
    """When the job should be done (seconds since the epoch; ``submit --deadline``), or None."""
    deadline_missed: bool = False
    """Its deadline passed while it was unfinished (one ``deadline_missed`` event was recorded)."""
    eta_s: float | None = None
    """The service's latest estimate of the seconds it needs to finish (deadline jobs only)."""
    batch: dict[str, Any] | None = None
    """An elastic-batch job's batch (``submit --batch-size-range``): ``{"base": its own batch,
    "vn_size", "range": [B_min, B_max], "lr_rule", "now": the batch it was last given}``; None:
    the job keeps its batch."""
    quarantine: str | None = None
    """Why the row is quarantined (its defining cells are unusable: ``state`` then reads as
    ``quarantined`` and the unusable cells as defaults), or None for a sound row."""

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @classmethod
    def from_sql(cls, r: sqlite3.Row, run_dir: str | None = None) -> JobRow:
        """Parse one row defensively. ``run_dir``: the job's run directory as the cluster
        directory places it (``DIR/jobs/<id>``), used where the stored cell is empty or unusable."""
        d = dict(r)
        d.pop("quarantine", None)
        jid = d["id"]
        where = f"jobs[{jid}]"
        bad: list[str] = []  # unusable defining cells: the row is quarantined
        slots = loads_cell(d.pop("slots"), [], where + ".slots")
        received = loads_cell(d.pop("received"), {}, where + ".received")
        estimates = loads_cell(d.pop("estimates"), {}, where + ".estimates")
        batch = loads_cell(d.pop("batch", None) or "null", None, where + ".batch")

        def number(key: str, default: Any, *, integer: bool = False, lo: float | None = None,
                   above: float | None = None, optional: bool = False, defining: bool = False) -> Any:
            v = d.get(key)
            if v is None and optional:
                return None
            good = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and (not integer or float(v).is_integer()) and (lo is None or v >= lo)
                    and (above is None or v > above))
            if good:
                return int(v) if integer else float(v)
            if defining:
                bad.append(f"{key}={v!r}")
            else:
                warn_once(f"{where}.{key}", v, "bad value in %s.%s: %r (read as %r)", where, key, v, default)
            return default

        def flag(key: str, *, defining: bool = False) -> bool:
            v = d.get(key)
            if v in (0, 1):
                return bool(v)
            if defining:
                bad.append(f"{key}={v!r}")
            else:
                warn_once(f"{where}.{key}", v, "bad value in %s.%s: %r (read as False)", where, key, v)
            return False

        def text(key: str, default: str | None, *, optional: bool = False, defining: bool = False) -> str | None:
            v = d.get(key)
            if isinstance(v, str) and (v or optional) or (v is None and optional):
                return v
            if defining:
                bad.append(f"{key}={v!r}")
            return default

        out: dict[str, Any] = dict(id=jid)
        out["target"] = text("target", "", defining=True)
        out["steps"] = number("steps", 1, integer=True, lo=1, defining=True)
        out["elastic"] = flag("elastic", defining=True)
        out["min_workers"] = number("min_workers", 1, integer=True, lo=1, defining=True)
        out["max_workers"] = number("max_workers", out["min_workers"], integer=True, lo=out["min_workers"],
                                    defining=True)
        out["priority"] = number("priority", 1.0, above=0.0, defining=True)
        out["job_type"] = text("job_type", None, optional=True, defining=True)
        out["deterministic"] = flag("deterministic", defining=True)
        out["checkpoint_every"] = number("checkpoint_every", 1, integer=True, lo=1, defining=True)
        out["submitted_s"] = number("submitted_s", 0.0, defining=True)
        out["cancel_requested"] = flag("cancel_requested", defining=True)
        out["deadline_s"] = number("deadline_s", None, optional=True, defining=True)
        state = d.get("state")
        if state not in JOB_STATES:
            bad.append(f"state={state!r}")
        out["name"] = text("name", f"job-{jid}") or f"job-{jid}"
        out["steps_done"] = number("steps_done", 0, integer=True, lo=0)
        out["acc_type"] = text("acc_type", None, optional=True)
        out["workers"] = number("workers", 0, integer=True, lo=0)
        out["started_s"] = number("started_s", None, optional=True)
        out["finished_s"] = number("finished_s", None, optional=True)
        err = d.get("error")
        out["error"] = None if err is None else str(err)
        for k in ("starts", "restarts", "resizes"):
            out[k] = number(k, 0, integer=True, lo=0)
        out["loss"] = number("loss", None, optional=True)
        out["deadline_missed"] = flag("deadline_missed")
        out["eta_s"] = number("eta_s", None, optional=True)
        stored_dir = d.get("run_dir")
        out["run_dir"] = stored_dir if isinstance(stored_dir, str) and stored_dir else (run_dir or "")
        if bad:
            out["state"], out["quarantine"] = QUARANTINED, "unusable cell(s): " + ", ".join(bad)
        else:
            out["state"] = state
        if batch is not None and not _batch_cell(batch):
            bad.append(f"batch={batch!r}"[:200])
            out["state"], out["quarantine"] = QUARANTINED, "unusable cell(s): " + ", ".join(bad)
        return cls(**out, batch=batch if _batch_cell(batch) else None,
                   slots=[str(s) for s in slots] if isinstance(slots, list) else [],
                   received={str(k): float(v) for k, v in received.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                   if isinstance(received, dict) else {},
                   estimates={str(k): float(v) for k, v in estimates.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                   if isinstance(estimates, dict) else {})


def _batch_cell(cell: Any) -> bool:
    """Whether a ``batch`` cell is one :func:`virtualflow.cli.cluster.check_submission` writes."""
    ints = ("base", "vn_size", "now")
    return (isinstance(cell, dict) and all(isinstance(cell.get(k), int) and cell[k] > 0 for k in ints)
            and isinstance(cell.get("range"), list) and len(cell["range"]) == 2
            and all(isinstance(x, int) for x in cell["range"]) and isinstance(cell.get("lr_rule"), (str, dict)))
