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

Invariants:

- **A job's id is never reused**, not even by a database that was emptied, deleted or replaced:
  an id is above every id this directory has handed out (the high-water mark ``last_job_id``,
  written beside the database, and the run directories under ``jobs/``), and a run directory
  is adopted only by the job it was made for (:meth:`ClusterDB.claim_run_dir`: the directory
  records its job's identity, ``cluster_job.json``; anything else found there is moved aside).
- A job in a final state (done, failed, cancelled) never leaves it (``set_job_state`` refuses);
  a job with a cancel request that is queued (however it got there: a cancel while the service
  was down, or during a preemption) is cancelled by the service's next sweep
  (:meth:`ClusterDB.settle`), never run again.
- Every write is one transaction. Values read back are parsed defensively: a malformed JSON
  cell or a bad counter reads as its default (logged, never raises); a row whose defining cells
  are unusable (steps, worker bounds, priority, state, ...) reads as **quarantined**
  (:attr:`JobRow.quarantine` says why): it shows in ``queue`` and is never scheduled, and the
  other jobs run on.
- **The directory is private** (:func:`check_cluster_dir`, at every open): the directory a real
  one (not a symbolic link) of this user that neither group nor others may write; the
  database, its WAL files, the dashboard token and the service's other files regular files of
  this user that neither group nor others may write, the token not readable by them either
  (a database merely readable by them is made 0600). Whoever can write there could queue jobs
  that run as the service's user, or plant the token that authorises cancelling. A database
  that is not one (corrupt, or another file) is refused naming the file and the fix.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from virtualflow.rundir import RUN_FILES, atomic_write, make_private_dir, set_aside, state_files, write_json

log = logging.getLogger(__name__)

DB_NAME = "cluster.db"
TOKEN_NAME = "token"
ID_MARK_NAME = "last_job_id"
"""The highest job id this directory has handed out (beside the database, so that an emptied or
replaced database never hands it out again)."""
JOBS_DIR = "jobs"
IDENTITY_NAME = "cluster_job.json"
"""In a job's run directory: which cluster and job it belongs to (see :meth:`ClusterDB.claim_run_dir`)."""
QUARANTINED = "quarantined"
"""The state a row reads as when its defining cells are unusable (never stored)."""
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


_WARNED: set[tuple[str, str]] = set()
"""(cell, value) pairs already logged: the service reads its rows several times a second, and a
bad cell is worth one line, not a flood."""


def _warn_once(where: str, value: Any, msg: str, *args: Any) -> None:
    key = (where, repr(value)[:200])
    if key in _WARNED:
        return
    if len(_WARNED) < 10000:
        _WARNED.add(key)
    log.warning(msg, *args)


def _loads(text: Any, default: Any, where: str) -> Any:
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        _warn_once(where, text, "malformed JSON in %s: %r (read as %r)", where, str(text)[:200], default)
        return default


# -- the directory is private ---------------------------------------------------------------
# The rule of run directories (virtualflow.rundir.make_private_dir), worded for a cluster
# directory: the service runs whatever the database queues, as its own user, and honours the
# token in the directory; so nobody else may be able to write either.
_PRIVATE_FILES = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", TOKEN_NAME)
"""Files nobody else may read either (the jobs' targets and history; the token)."""
_OWN_FILES = (ID_MARK_NAME, "service.lock", "service.log", "start.lock")
"""Files nobody else may write (read access does not matter)."""
_OWN_DIRS = (JOBS_DIR, "logs")
"""Folders nobody else may write: the jobs' run directories, the jobs' drivers' logs."""


def _who(mode: int, bits: tuple[tuple[str, int], ...]) -> str:
    return " and ".join(w for w, b in bits if mode & b)


def check_cluster_dir(cluster_dir: str, *, create: bool = False) -> None:
    """Refuse a cluster directory another user could write into (``ValueError``, one line naming
    the path, the rule and the fix: ``chmod``, or another ``--dir``). With ``create``, a missing
    directory is created with mode 0700 (its parents as usual).

    The directory: a real directory (not a symbolic link) of this user, not writable by group or
    others. In it, where they exist: the database, its WAL files, the token, the high-water mark,
    the lock and log files, ``jobs/`` and ``logs/``: regular files (folders) of this user that group and
    others cannot write; the token also not readable by them (whoever reads it can cancel jobs).
    A database only readable by others (as ones made before this check were) is made 0600."""
    path = os.path.normpath(cluster_dir)  # "link/" would make lstat follow the link
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise ValueError(f"{cluster_dir!r} is not a cluster directory (it does not exist); start a cluster there "
                             f"first: virtualflow cluster start --dir {cluster_dir} --slots v100=2,k80=2") from None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # whatever the umask
        except FileExistsError:
            pass  # made meanwhile by someone else: judged below
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"the cluster directory {path} is a symbolic link (to {os.readlink(path)}); whoever controls "
                         f"its target could queue jobs that run as you or plant the dashboard token: pass the real "
                         f"directory (--dir)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"the cluster directory {path} exists and is not a directory; choose another --dir")
    if st.st_uid != os.geteuid():
        raise ValueError(f"the cluster directory {path} belongs to another user (uid {st.st_uid}); its owner could "
                         f"queue jobs that run as you or plant the dashboard token: use a directory of your own (--dir)")
    wbits = (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"the cluster directory {path} is writable by {_who(st.st_mode, wbits)} (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); whoever can write there could queue jobs that run as you "
                         f"or plant the dashboard token: chmod 700 {path}")
    rwbits = (("group", stat.S_IRGRP | stat.S_IWGRP), ("others", stat.S_IROTH | stat.S_IWOTH))
    for name in _PRIVATE_FILES + _OWN_FILES + _OWN_DIRS:
        f = os.path.join(path, name)
        try:
            fs = os.lstat(f)
        except FileNotFoundError:
            continue
        want_dir = name in _OWN_DIRS
        if stat.S_ISLNK(fs.st_mode) or (stat.S_ISDIR(fs.st_mode) != want_dir) or not (
                stat.S_ISDIR(fs.st_mode) or stat.S_ISREG(fs.st_mode)):
            kind = "a symbolic link" if stat.S_ISLNK(fs.st_mode) else \
                f"not a {'directory' if want_dir else 'regular file'}"
            raise ValueError(f"{f} is {kind}, which someone else may have put there; remove it (rm {f}) after "
                             f"checking what it is")
        rm = f"rm -r {f}" if stat.S_ISDIR(fs.st_mode) else f"rm {f}"
        if fs.st_uid != os.geteuid():
            raise ValueError(f"{f} belongs to another user (uid {fs.st_uid}), who may have planted it; remove it "
                             f"({rm}) after checking what it is")
        if fs.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            why = ("whoever can write the token can cancel jobs" if name == TOKEN_NAME
                   else "whoever can write it could change what the service runs")
            fix = f"chmod {'700' if want_dir else '600'} {f}"
            if name == TOKEN_NAME:
                fix += f", or remove it ({rm}; cluster start writes a new one)"
            raise ValueError(f"{f} is writable by {_who(fs.st_mode, wbits)} (mode {stat.S_IMODE(fs.st_mode):04o}); "
                             f"{why}: {fix}")
        if name == TOKEN_NAME and fs.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            raise ValueError(f"{f} is readable by {_who(fs.st_mode, rwbits)} (mode {stat.S_IMODE(fs.st_mode):04o}); "
                             f"whoever read it can cancel jobs: remove it (rm {f}; cluster start writes a new one), or "
                             f"chmod 600 {f} if nobody else could have read it")
        if name in _PRIVATE_FILES and fs.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            # Ours and written by nobody else, only readable (as databases made before the
            # directory was guarded were): tighten it rather than refuse.
            os.chmod(f, 0o600)
            log.warning("%s was readable by group or others (mode %04o): now 0600", f, stat.S_IMODE(fs.st_mode))


def read_id_mark(cluster_dir: str) -> int:
    """The highest job id this directory has handed out, from outside the database: the
    high-water mark file and the run directories under ``jobs/`` (0 when there is none)."""
    best = 0
    try:
        with open(os.path.join(cluster_dir, ID_MARK_NAME), "rb") as f:
            text = f.read(64).strip()
        if text.isdigit():
            best = int(text)
    except OSError:
        pass
    try:
        names = os.listdir(os.path.join(cluster_dir, JOBS_DIR))
    except OSError:
        names = []
    return max([best] + [int(n) for n in names if n.isdigit() and len(n) < 19])


def _corrupt_message(path: str, cluster_dir: str, exc: BaseException) -> str:
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
            raise CorruptDatabaseError(_corrupt_message(*self.where, exc)) from None

    def executescript(self, script: str) -> sqlite3.Cursor:  # type: ignore[override]
        try:
            return super().executescript(script)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise CorruptDatabaseError(_corrupt_message(*self.where, exc)) from None


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
        slots = _loads(d.pop("slots"), [], where + ".slots")
        received = _loads(d.pop("received"), {}, where + ".received")
        estimates = _loads(d.pop("estimates"), {}, where + ".estimates")

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
                _warn_once(f"{where}.{key}", v, "bad value in %s.%s: %r (read as %r)", where, key, v, default)
            return default

        def flag(key: str, *, defining: bool = False) -> bool:
            v = d.get(key)
            if v in (0, 1):
                return bool(v)
            if defining:
                bad.append(f"{key}={v!r}")
            else:
                _warn_once(f"{where}.{key}", v, "bad value in %s.%s: %r (read as False)", where, key, v)
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
        return cls(**out, slots=[str(s) for s in slots] if isinstance(slots, list) else [],
                   received={str(k): float(v) for k, v in received.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                   if isinstance(received, dict) else {},
                   estimates={str(k): float(v) for k, v in estimates.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                   if isinstance(estimates, dict) else {})


def foreign_run_dir(identity: dict[str, Any] | None, mine: dict[str, Any], *, has_state: bool,
                    started: bool) -> str | None:
    """Why a run directory's contents belong to another job (pure), or None when the job may use
    them. ``identity``: the directory's identity record (None: there is none); ``mine``: the
    job's (cluster id, job id, submission time); ``has_state``: it holds state files;
    ``started``: the database says this job has been started before.

    An identity decides: the job's own, or another's. Without one (a directory from before
    identities were recorded), states are the job's only if the job has been started before;
    states in the directory of a job never started were left by another job with the same id
    (an emptied database that handed the id out again)."""
    if identity is not None:
        keys = ("cluster", "job_id", "submitted_s")
        if all(identity.get(k) == mine.get(k) for k in keys):
            return None
        return (f"the records of another job (identity {', '.join(f'{k}={identity.get(k)!r}' for k in keys)}; "
                f"this job is {', '.join(f'{k}={mine.get(k)!r}' for k in keys)})")
    if has_state and not started:
        return "states no start of this job wrote (no identity, and the job has never started)"
    return None


def _read_identity(path: str) -> dict[str, Any] | None:
    """A run directory's identity record, or None where there is none; an unreadable one reads
    as ``{}`` (an identity that matches no job)."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(65536))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class ClusterDB:
    """The cluster directory's database. One object per thread (sqlite3 connections are not
    shared across threads); every method commits its own transaction."""

    def __init__(self, cluster_dir: str, *, create: bool = False, timeout_s: float = 30.0) -> None:
        """Open the database of ``cluster_dir`` (``create``: make the directory and the tables
        where missing). The directory is checked first (:func:`check_cluster_dir`); a file that
        is not a cluster database is a ``ValueError`` naming it and the fix."""
        self.cluster_dir = cluster_dir
        self.path = os.path.join(cluster_dir, DB_NAME)
        self.recreated_over: int | None = None
        """Set when ``create`` made the tables in a directory whose earlier jobs (ids up to this
        value) the database no longer knows: the new ids continue above it."""
        if not create and not os.path.lexists(self.path):
            raise ValueError(f"{cluster_dir!r} is not a cluster directory (no {DB_NAME}); start a cluster there "
                             f"first: virtualflow cluster start --dir {cluster_dir} --slots v100=2,k80=2")
        check_cluster_dir(cluster_dir, create=create)
        if create and not os.path.lexists(self.path):
            # Made here, mode 0600 whatever the umask (SQLite gives its WAL files the same mode).
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        try:
            self.conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None, factory=_Connection)
            self.conn.where = (self.path, cluster_dir)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if create:
                self.conn.executescript(_SCHEMA)
                if "jobs" not in tables:
                    mark = read_id_mark(cluster_dir)
                    self.recreated_over = mark or None
                self.cluster_id()
            elif "jobs" not in tables:
                mark = read_id_mark(cluster_dir)
                raise ValueError(f"{self.path} holds no cluster tables (an emptied or foreign database); start the "
                                 f"cluster again (virtualflow cluster start --dir {cluster_dir} --slots ...)"
                                 + (f": new job ids continue above {mark}" if mark else ""))
            self._migrate()
        except (sqlite3.DatabaseError, CorruptDatabaseError) as exc:
            conn = getattr(self, "conn", None)
            if conn is not None:
                conn.close()
            if isinstance(exc, CorruptDatabaseError) or (isinstance(exc, sqlite3.OperationalError)
                                                         and "locked" in str(exc)):
                raise
            raise CorruptDatabaseError(_corrupt_message(self.path, cluster_dir, exc)) from None
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

    def cluster_id(self) -> str:
        """This cluster's random id (``meta``), made the first time it is asked for: a database
        made anew gets a new one, so a run directory's identity never matches a job of another
        database."""
        got = self.get_meta("cluster_id")
        if isinstance(got, str) and got:
            return got
        with self.tx() as c:  # two processes asking at once agree on the first one written
            c.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('cluster_id', ?)",
                      (json.dumps(secrets.token_hex(8)),))
        got = self.get_meta("cluster_id")
        if not (isinstance(got, str) and got):  # a malformed cell: replaced
            self.set_meta("cluster_id", secrets.token_hex(8))
            got = self.get_meta("cluster_id")
        return str(got)

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
        """Queue a job; returns its id: above every id this directory has handed out (the
        database's, the high-water mark's and the run directories'), recorded in the mark before
        the row is committed."""
        now = time.time() if now is None else now
        with self.tx() as c:
            seq = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
            top = c.execute("SELECT COALESCE(MAX(id), 0) FROM jobs").fetchone()[0]
            job_id = max(int(seq[0]) if seq else 0, int(top), read_id_mark(self.cluster_dir)) + 1
            run_dir = self.run_dir_of(job_id)
            c.execute(
                "INSERT INTO jobs (id, name, target, steps, elastic, min_workers, max_workers, priority, job_type, "
                "deterministic, checkpoint_every, submitted_s, state, deadline_s, run_dir) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?, 'queued', ?, ?)",
                (job_id, name, target, steps, int(elastic), min_workers, max_workers, priority, job_type,
                 int(deterministic), checkpoint_every, now, deadline_s, run_dir))
            self._event(c, now, job_id, "submit", {"target": target, "steps": steps, "elastic": elastic,
                                                   "min_workers": min_workers, "max_workers": max_workers,
                                                   "priority": priority, "deadline_s": deadline_s})
            # The mark is written inside the transaction: a failure to write it rolls the row back.
            atomic_write(os.path.join(self.cluster_dir, ID_MARK_NAME), f"{job_id}\n".encode(), mode=0o600)
        return job_id

    def run_dir_of(self, job_id: int) -> str:
        """Where job ``job_id``'s run directory goes: ``DIR/jobs/<id>``."""
        return os.path.join(os.path.abspath(self.cluster_dir), JOBS_DIR, str(job_id))

    def job(self, job_id: int) -> JobRow | None:
        """The job's row (a quarantined one included: see :attr:`JobRow.quarantine`), or None."""
        r = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if r is None else JobRow.from_sql(r, self.run_dir_of(int(r["id"])))

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobRow]:
        """Every job (``states=None``), or those in ``states``: a quarantined row is listed under
        ``quarantined`` only, whatever its stored state."""
        if states is None:
            rows = self.conn.execute("SELECT * FROM jobs ORDER BY id").fetchall()
        else:
            rows = self.conn.execute("SELECT * FROM jobs ORDER BY id").fetchall() if QUARANTINED in states else \
                self.conn.execute(f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY id",
                                  states).fetchall()
        out = [JobRow.from_sql(r, self.run_dir_of(int(r["id"]))) for r in rows]
        return out if states is None else [j for j in out if j.state in states]

    def settle(self, now: float | None = None) -> list[tuple[int, str]]:
        """The service's sweep (run at start and at every poll): a queued job with a cancel request
        is cancelled (a cancel made while the service was down, or while the job was being
        preempted, is never lost); a newly quarantined row gets one ``quarantined`` event.
        Returns (job id, what happened) for each."""
        now = time.time() if now is None else now
        done: list[tuple[int, str]] = []
        if self.conn.execute("SELECT 1 FROM jobs WHERE state = 'queued' AND cancel_requested = 1 LIMIT 1").fetchone():
            with self.tx() as c:
                for r in c.execute("SELECT id FROM jobs WHERE state = 'queued' AND cancel_requested = 1").fetchall():
                    c.execute("UPDATE jobs SET state = 'cancelled', finished_s = ? WHERE id = ?", (now, r[0]))
                    self._event(c, now, r[0], "cancelled", {"while": "queued", "requested": "earlier"})
                    done.append((int(r[0]), "cancelled"))
        # Rows that are not final by their stored state (a bogus state included): the ones the
        # service could otherwise schedule. Each read costs one pass over those rows, no more.
        q = f"SELECT * FROM jobs WHERE state NOT IN ({','.join('?' * len(FINAL_STATES))})"
        for r in self.conn.execute(q, FINAL_STATES).fetchall():
            j = JobRow.from_sql(r, self.run_dir_of(int(r["id"])))
            if j.quarantine is None or self.conn.execute(
                    "SELECT 1 FROM events WHERE job_id = ? AND kind = 'quarantined' LIMIT 1", (j.id,)).fetchone():
                continue
            self.event("quarantined", j.id, now=now, reason=j.quarantine)
            log.warning("job %d is quarantined (%s): it is not scheduled until the row is repaired", j.id,
                        j.quarantine)
            done.append((j.id, "quarantined"))
        return done

    def claim_run_dir(self, row: JobRow) -> str | None:
        """Make ``row``'s run directory its own before the service starts it there: created 0700
        where missing; the identity file (``cluster_job.json``: this cluster's id, the job's id
        and submission time) written the first time. What the directory holds that another job
        wrote (an identity that is not this job's, or states in a directory this job has never
        started in and that records no identity) is moved into ``previous-<time>/`` (never
        deleted, never resumed) and a ``run_dir_set_aside`` event recorded; returns that folder, or
        None. This is what keeps a job from adopting another job's states."""
        run_dir = row.run_dir or self.run_dir_of(row.id)
        jobs_dir = os.path.join(self.cluster_dir, JOBS_DIR)
        if not os.path.lexists(jobs_dir):
            try:
                os.mkdir(jobs_dir, 0o700)
            except FileExistsError:
                pass
        check_cluster_dir(self.cluster_dir)  # jobs/ included
        make_private_dir(run_dir)
        ident_path = os.path.join(run_dir, IDENTITY_NAME)
        mine = {"cluster": self.cluster_id(), "job_id": row.id, "submitted_s": row.submitted_s}
        identity = _read_identity(ident_path)
        why = foreign_run_dir(identity, mine, has_state=bool(state_files(run_dir)), started=row.starts > 0)
        moved = None
        if why is not None:
            names = [n for n in RUN_FILES + (IDENTITY_NAME,) if os.path.lexists(os.path.join(run_dir, n))]
            moved = set_aside(run_dir, names)
            self.event("run_dir_set_aside", row.id, reason=why, moved_to=moved, names=names)
            log.warning("job %d: its run directory held %s; moved to %s", row.id, why, moved)
            identity = None
        if identity is None:
            write_json(ident_path, mine)
        return moved

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Set columns of a job (lists/dicts are stored as JSON)."""
        if not fields:
            return
        cols, vals = [], []
        for k, v in fields.items():
            if k not in JobRow.__slots__ or k in ("id", "quarantine"):  # type: ignore[attr-defined]
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
