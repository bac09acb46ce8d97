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

Where things are: :class:`ClusterDB` (every read and write, one transaction each) is here; the
tables and their migrations are :mod:`virtualflow.service.schema`, a row read defensively is
:class:`~virtualflow.service.rows.JobRow`, and the cluster directory's files, its privacy check and
the run directories' identities are :mod:`virtualflow.service.clusterdir` (every name is
re-exported here).

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
import os
import secrets
import sqlite3
import time
from typing import Any

from virtualflow.records.rundir import RUN_FILES, atomic_write, make_private_dir, set_aside, state_files, write_json
from virtualflow.service.clusterdir import (DB_NAME, ID_MARK_NAME, IDENTITY_NAME, JOBS_DIR, TOKEN_NAME,
                                            check_cluster_dir, foreign_run_dir, read_id_mark, read_identity)
from virtualflow.service.rows import FINAL_STATES, JOB_STATES, QUARANTINED, JobRow, loads_cell
from virtualflow.service.schema import SCHEMA, CorruptDatabaseError, connect, corrupt_message, migrate

log = logging.getLogger(__name__)

__all__ = ["ClusterDB", "JobRow", "CorruptDatabaseError", "check_cluster_dir", "foreign_run_dir", "read_id_mark",
           "DB_NAME", "TOKEN_NAME", "ID_MARK_NAME", "JOBS_DIR", "IDENTITY_NAME", "QUARANTINED", "FINAL_STATES",
           "JOB_STATES"]


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
            self.conn = connect(self.path, cluster_dir, timeout_s)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if create:
                self.conn.executescript(SCHEMA)
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
            raise CorruptDatabaseError(corrupt_message(self.path, cluster_dir, exc)) from None
    def _migrate(self) -> None:
        """Add the columns a database made by an older version lacks (nothing else changes)."""
        migrate(self.conn)

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
        return default if r is None else loads_cell(r[0], default, f"meta[{key}]")

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
                now: float | None = None, deadline_s: float | None = None, batch: dict[str, Any] | None = None) -> int:
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
                "deterministic, checkpoint_every, submitted_s, state, deadline_s, run_dir, batch) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?, 'queued', ?, ?, ?)",
                (job_id, name, target, steps, int(elastic), min_workers, max_workers, priority, job_type,
                 int(deterministic), checkpoint_every, now, deadline_s, run_dir,
                 None if batch is None else json.dumps(batch)))
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
        identity = read_identity(ident_path)
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
            d["slots"] = loads_cell(d["slots"], [], "allocations.slots")
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
            d["data"] = loads_cell(d["data"], {}, f"events[{d['id']}]")
            out.append(d)
        return out
