"""The cluster service's state: one SQLite database in the cluster directory (``cluster.db``).

Tables (WAL mode, so the CLI, the dashboard and the service read and write at once):

- ``meta``: key -> JSON value (the cluster's slots, policy, round length, slowdowns; the
  service's pid and heartbeat; a stop request);
- ``jobs``: one row per submitted job: what to run (target, steps, worker bounds, priority,
  deadline), its state (``queued`` | ``running`` | ``done`` | ``failed`` | ``cancelled``), progress, where it
  runs now, counters (starts, restarts, resizes), its throughput estimates and, for a job with a
  deadline, the service's estimate of its time to finish and whether the deadline was missed;
- ``rounds``: one row per scheduling round (start, end, policy, whether it was re-solved, the
  decision time);
- ``allocations``: one row per (round, job) placed: accelerator type, worker count, slots, the
  mechanism's change label;
- ``events``: what happened (submit, start, resize, preempt, done, failure, throughput, ...),
  with a JSON payload.

Invariants: a job's id is never reused; a job in a final state (done, failed, cancelled) never
leaves it (``set_job_state`` refuses); every write is one transaction; values read back are
parsed defensively (a malformed JSON cell reads as its default and is logged, never raises).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DB_NAME = "cluster.db"
FINAL_STATES = ("done", "failed", "cancelled")
JOB_STATES = ("queued", "running") + FINAL_STATES

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    target TEXT NOT NULL,
    steps INTEGER NOT NULL,
    elastic INTEGER NOT NULL,
    min_workers INTEGER NOT NULL,
    max_workers INTEGER NOT NULL,
    priority REAL NOT NULL,
    job_type TEXT,
    deterministic INTEGER NOT NULL,
    checkpoint_every INTEGER NOT NULL,
    submitted_s REAL NOT NULL,
    state TEXT NOT NULL,
    steps_done INTEGER NOT NULL DEFAULT 0,
    acc_type TEXT,
    workers INTEGER NOT NULL DEFAULT 0,
    slots TEXT NOT NULL DEFAULT '[]',
    started_s REAL,
    finished_s REAL,
    run_dir TEXT NOT NULL DEFAULT '',
    error TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    starts INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    resizes INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    received TEXT NOT NULL DEFAULT '{}',
    estimates TEXT NOT NULL DEFAULT '{}',
    deadline_s REAL,
    deadline_missed INTEGER NOT NULL DEFAULT 0,
    eta_s REAL
);
CREATE TABLE IF NOT EXISTS rounds (
    id INTEGER PRIMARY KEY,
    start_s REAL NOT NULL,
    end_s REAL,
    policy TEXT NOT NULL,
    solved INTEGER NOT NULL,
    decision_s REAL NOT NULL,
    active INTEGER NOT NULL,
    placed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS allocations (
    round INTEGER NOT NULL,
    job_id INTEGER NOT NULL,
    acc_type TEXT NOT NULL,
    workers INTEGER NOT NULL,
    slots TEXT NOT NULL,
    change TEXT NOT NULL,
    start_s REAL NOT NULL,
    end_s REAL,
    PRIMARY KEY (round, job_id)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    t REAL NOT NULL,
    job_id INTEGER,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id);
"""

_ADDED_COLUMNS = (("deadline_s", "REAL"), ("deadline_missed", "INTEGER NOT NULL DEFAULT 0"), ("eta_s", "REAL"))
"""Columns of ``jobs`` added after the first release (a database made before gets them on open)."""


def _loads(text: Any, default: Any, where: str) -> Any:
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        log.warning("malformed JSON in %s: %r (read as %r)", where, text, default)
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

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @classmethod
    def from_sql(cls, r: sqlite3.Row) -> JobRow:
        d = dict(r)
        where = f"jobs[{d['id']}]"
        slots = _loads(d.pop("slots"), [], where + ".slots")
        received = _loads(d.pop("received"), {}, where + ".received")
        estimates = _loads(d.pop("estimates"), {}, where + ".estimates")
        for k in ("elastic", "deterministic", "cancel_requested", "deadline_missed"):
            d[k] = bool(d[k])
        return cls(**d, slots=[str(s) for s in slots] if isinstance(slots, list) else [],
                   received={str(k): float(v) for k, v in received.items() if isinstance(v, (int, float))}
                   if isinstance(received, dict) else {},
                   estimates={str(k): float(v) for k, v in estimates.items() if isinstance(v, (int, float))}
                   if isinstance(estimates, dict) else {})


class ClusterDB:
    """The cluster directory's database. One object per thread (sqlite3 connections are not
    shared across threads); every method commits its own transaction."""

    def __init__(self, cluster_dir: str, *, create: bool = False, timeout_s: float = 30.0) -> None:
        self.cluster_dir = cluster_dir
        self.path = os.path.join(cluster_dir, DB_NAME)
        if not create and not os.path.exists(self.path):
            raise ValueError(f"{cluster_dir!r} is not a cluster directory (no {DB_NAME}); start a cluster there "
                             f"first: virtualflow cluster start --dir {cluster_dir} --slots v100=2,k80=2")
        self.conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        if create:
            self.conn.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add the columns a database made by an older version lacks (nothing else changes)."""
        have = {r[1] for r in self.conn.execute("PRAGMA table_info(jobs)").fetchall()}
        if not have:
            return
        for name, decl in _ADDED_COLUMNS:
            if name not in have:
                try:
                    self.conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
                except sqlite3.OperationalError:  # added meanwhile by another process
                    pass

    def close(self) -> None:
        self.conn.close()

    class _Tx:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def __enter__(self) -> sqlite3.Connection:
            self.conn.execute("BEGIN IMMEDIATE")
            return self.conn

        def __exit__(self, exc_type: Any, *_: Any) -> None:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")

    def tx(self) -> ClusterDB._Tx:
        """``with db.tx() as c:`` one write transaction."""
        return ClusterDB._Tx(self.conn)

    # -- meta -------------------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        r = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if r is None else _loads(r[0], default, f"meta[{key}]")

    def set_meta(self, key: str, value: Any) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                      "excluded.value", (key, json.dumps(value)))

    def config(self) -> dict[str, Any]:
        """The cluster's configuration (written by ``cluster start``)."""
        cfg = self.get_meta("config")
        if not isinstance(cfg, dict):
            raise ValueError(f"{self.cluster_dir}: the cluster has no configuration; start it with virtualflow "
                             f"cluster start --dir {self.cluster_dir} --slots TYPE=N,...")
        return cfg

    # -- jobs -------------------------------------------------------------------------------
    def add_job(self, *, name: str, target: str, steps: int, elastic: bool, min_workers: int, max_workers: int,
                priority: float, job_type: str | None, deterministic: bool, checkpoint_every: int,
                now: float | None = None, deadline_s: float | None = None) -> int:
        now = time.time() if now is None else now
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO jobs (name, target, steps, elastic, min_workers, max_workers, priority, job_type, "
                "deterministic, checkpoint_every, submitted_s, state, deadline_s) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?, 'queued', ?)",
                (name, target, steps, int(elastic), min_workers, max_workers, priority, job_type,
                 int(deterministic), checkpoint_every, now, deadline_s))
            job_id = int(cur.lastrowid)
            run_dir = os.path.join(os.path.abspath(self.cluster_dir), "jobs", str(job_id))
            c.execute("UPDATE jobs SET run_dir = ? WHERE id = ?", (run_dir, job_id))
            self._event(c, now, job_id, "submit", {"target": target, "steps": steps, "elastic": elastic,
                                                   "min_workers": min_workers, "max_workers": max_workers,
                                                   "priority": priority, "deadline_s": deadline_s})
        return job_id

    def job(self, job_id: int) -> JobRow | None:
        r = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if r is None else JobRow.from_sql(r)

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobRow]:
        if states is None:
            rows = self.conn.execute("SELECT * FROM jobs ORDER BY id").fetchall()
        else:
            q = ",".join("?" * len(states))
            rows = self.conn.execute(f"SELECT * FROM jobs WHERE state IN ({q}) ORDER BY id", states).fetchall()
        return [JobRow.from_sql(r) for r in rows]

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Set columns of a job (lists/dicts are stored as JSON)."""
        if not fields:
            return
        cols, vals = [], []
        for k, v in fields.items():
            if k not in JobRow.__slots__ or k == "id":  # type: ignore[attr-defined]
                raise ValueError(f"unknown job column {k!r}")
            cols.append(f"{k} = ?")
            vals.append(json.dumps(v) if isinstance(v, (list, dict)) else v)
        with self.tx() as c:
            c.execute(f"UPDATE jobs SET {', '.join(cols)} WHERE id = ?", (*vals, job_id))

    def set_job_state(self, job_id: int, state: str, *, now: float | None = None, event: str | None = None,
                      info: dict[str, Any] | None = None, **fields: Any) -> bool:
        """Move a job to ``state`` (with other columns, and an event carrying the scalar columns
        and ``info``), unless it is already in a final state; returns whether it moved."""
        if state not in JOB_STATES:
            raise ValueError(f"job state {state!r} is not one of {JOB_STATES}")
        now = time.time() if now is None else now
        with self.tx() as c:
            r = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if r is None or r[0] in FINAL_STATES:
                return False
            cols = ["state = ?"] + [f"{k} = ?" for k in fields]
            vals = [state] + [json.dumps(v) if isinstance(v, (list, dict)) else v for v in fields.values()]
            c.execute(f"UPDATE jobs SET {', '.join(cols)} WHERE id = ?", (*vals, job_id))
            if event:
                data = {k: v for k, v in fields.items() if isinstance(v, (int, float, str, type(None)))}
                self._event(c, now, job_id, event, {**data, **(info or {})})
        return True

    def request_cancel(self, job_id: int, now: float | None = None) -> str:
        """Cancel a job: a queued one at once, a running one by the service at its next check.
        Returns what happened: ``cancelled``, ``requested`` or the final state it already had."""
        now = time.time() if now is None else now
        with self.tx() as c:
            r = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if r is None:
                raise ValueError(f"job {job_id} does not exist in {self.cluster_dir}; see virtualflow queue "
                                 f"--dir {self.cluster_dir}")
            if r[0] in FINAL_STATES:
                return r[0]
            c.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            if r[0] == "queued":
                c.execute("UPDATE jobs SET state = 'cancelled', finished_s = ? WHERE id = ?", (now, job_id))
                self._event(c, now, job_id, "cancelled", {"while": "queued"})
                return "cancelled"
            self._event(c, now, job_id, "cancel_requested", {})
            return "requested"

    # -- rounds, allocations, events --------------------------------------------------------
    def add_round(self, *, start_s: float, policy: str, solved: bool, decision_s: float, active: int,
                  placements: list[dict[str, Any]]) -> int:
        with self.tx() as c:
            r = c.execute("SELECT COALESCE(MAX(id), 0) FROM rounds").fetchone()
            rid = int(r[0]) + 1
            c.execute("INSERT INTO rounds (id, start_s, policy, solved, decision_s, active, placed) "
                      "VALUES (?,?,?,?,?,?,?)", (rid, start_s, policy, int(solved), decision_s, active,
                                                 len(placements)))
            for p in placements:
                c.execute("INSERT INTO allocations (round, job_id, acc_type, workers, slots, change, start_s) "
                          "VALUES (?,?,?,?,?,?,?)", (rid, p["job_id"], p["acc_type"], p["workers"],
                                                     json.dumps(p["slots"]), p["change"], start_s))
        return rid

    def end_round(self, round_id: int, end_s: float) -> None:
        with self.tx() as c:
            c.execute("UPDATE rounds SET end_s = ? WHERE id = ?", (end_s, round_id))
            c.execute("UPDATE allocations SET end_s = ? WHERE round = ? AND end_s IS NULL", (end_s, round_id))

    def end_allocation(self, round_id: int, job_id: int, end_s: float) -> None:
        """The job left its slots before the round ended (finished, failed, cancelled)."""
        with self.tx() as c:
            c.execute("UPDATE allocations SET end_s = ? WHERE round = ? AND job_id = ? AND end_s IS NULL",
                      (end_s, round_id, job_id))

    def close_open_rounds(self, end_s: float) -> None:
        """After a crash: rounds and allocations left open end now."""
        with self.tx() as c:
            c.execute("UPDATE rounds SET end_s = ? WHERE end_s IS NULL", (end_s,))
            c.execute("UPDATE allocations SET end_s = ? WHERE end_s IS NULL", (end_s,))

    def rounds(self, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT * FROM rounds ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in reversed(rows)]

    def allocations(self, since_s: float | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM allocations"
        args: tuple[Any, ...] = ()
        if since_s is not None:
            q += " WHERE end_s IS NULL OR end_s >= ?"
            args = (since_s,)
        out = []
        for r in self.conn.execute(q + " ORDER BY round, job_id", args).fetchall():
            d = dict(r)
            d["slots"] = _loads(d["slots"], [], "allocations.slots")
            out.append(d)
        return out

    def event(self, kind: str, job_id: int | None = None, now: float | None = None, **data: Any) -> None:
        with self.tx() as c:
            self._event(c, time.time() if now is None else now, job_id, kind, data)

    @staticmethod
    def _event(c: sqlite3.Connection, now: float, job_id: int | None, kind: str, data: dict[str, Any]) -> None:
        c.execute("INSERT INTO events (t, job_id, kind, data) VALUES (?,?,?,?)",
                  (now, job_id, kind, json.dumps(data, default=str)))

    def events(self, job_id: int | None = None, kind: str | None = None, limit: int = 100000) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM events WHERE 1=1", []
        if job_id is not None:
            q += " AND job_id = ?"
            args.append(job_id)
        if kind is not None:
            q += " AND kind = ?"
            args.append(kind)
        rows = self.conn.execute(q + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["data"] = _loads(d["data"], {}, f"events[{d['id']}]")
            out.append(d)
        return out
