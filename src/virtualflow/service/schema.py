"""The cluster database's schema, its migrations, and a connection that names corruption.

Tables (WAL mode, so the CLI, the dashboard and the service read and write at once): ``meta``,
``jobs``, ``rounds``, ``allocations``, ``events`` (what each holds: :mod:`virtualflow.service.state`).

Invariants: the schema only ever grows (:data:`ADDED_COLUMNS`, added on open by :func:`migrate`;
nothing is renamed or dropped, so a database made by any earlier version opens); a database that
is not one (corrupt, or another file) raises :class:`CorruptDatabaseError`, one line naming the
file and the fix, wherever the damage shows (:func:`connect`).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from virtualflow.service.clusterdir import read_id_mark

__all__ = ["SCHEMA", "ADDED_COLUMNS", "CorruptDatabaseError", "corrupt_message", "connect", "migrate"]

SCHEMA = """
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
    eta_s REAL,
    batch TEXT
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

ADDED_COLUMNS = (("deadline_s", "REAL"), ("deadline_missed", "INTEGER NOT NULL DEFAULT 0"), ("eta_s", "REAL"),
                 ("batch", "TEXT"))
"""Columns of ``jobs`` added after the first release (a database made before gets them on open)."""


def corrupt_message(path: str, cluster_dir: str, exc: BaseException) -> str:
    mark = read_id_mark(cluster_dir)
    return (f"{path} is not a readable cluster database ({exc}); it may be corrupt or another file: move it aside "
            f"(mv {path} {path}.bad) and start the cluster again (virtualflow cluster start --dir {cluster_dir} "
            f"--slots ...); the jobs' run directories stay" + (f" and new job ids continue above {mark}" if mark else ""))


class CorruptDatabaseError(ValueError):
    """The cluster database is not one SQLite can read (not a database, or a malformed image)."""


class _Connection(sqlite3.Connection):
    """A connection whose statements turn SQLite's "file is not a database" and "database disk
    image is malformed" (plain ``sqlite3.DatabaseError``) into :class:`CorruptDatabaseError`, one
    line naming the file and the fix, whenever the damage shows. Other errors pass unchanged (a
    locked or full database is the caller's to handle)."""

    where: tuple[str, str] = ("", "")
    """(database path, cluster directory), for the message."""

    def execute(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:  # type: ignore[override]
        try:
            return super().execute(*args, **kwargs)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise CorruptDatabaseError(corrupt_message(*self.where, exc)) from None

    def executescript(self, script: str) -> sqlite3.Cursor:  # type: ignore[override]
        try:
            return super().executescript(script)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise CorruptDatabaseError(corrupt_message(*self.where, exc)) from None


def connect(path: str, cluster_dir: str, timeout_s: float) -> sqlite3.Connection:
    """Open the database file ``path`` of ``cluster_dir`` (autocommit: every write is the caller's
    transaction; rows as :class:`sqlite3.Row`) with a connection whose statements raise
    :class:`CorruptDatabaseError` where SQLite finds no database."""
    conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, factory=_Connection)
    conn.where = (path, cluster_dir)
    conn.row_factory = sqlite3.Row
    return conn


def migrate(conn: sqlite3.Connection) -> None:
    """Add the columns a database made by an older version lacks (nothing else changes)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(jobs)").fetchall()}
    if not have:
        return
    for name, decl in ADDED_COLUMNS:
        if name not in have:
            try:
                conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
            except sqlite3.OperationalError:  # added meanwhile by another process
                pass
