"""The cluster directory on disk: its file names, who may write there, and job identities.

A cluster directory holds the database (``cluster.db`` and its WAL files), the dashboard token,
the high-water mark of job ids (``last_job_id``), the service's lock and log, the jobs' run
directories (``jobs/<id>``) and the jobs' drivers' logs (``logs/``).

Invariants:

- **The directory is private** (:func:`check_cluster_dir`, at every open of the database): a real
  directory (not a symbolic link) of this user that neither group nor others may write; the
  database, its WAL files, the token and the service's other files regular files of this user
  that neither group nor others may write, the token not readable by them either (a database
  merely readable by them is made 0600). Whoever can write there could queue jobs that run as the
  service's user, or plant the token that authorises cancelling.
- **A job's id is never reused**: :func:`read_id_mark` reads the highest id handed out from
  outside the database (the mark file, the run directories), and a run directory is adopted only
  by the job its identity record (``cluster_job.json``) names (:func:`foreign_run_dir`, pure).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DB_NAME", "TOKEN_NAME", "ID_MARK_NAME", "JOBS_DIR", "IDENTITY_NAME", "check_cluster_dir",
           "read_id_mark", "foreign_run_dir", "read_identity"]

DB_NAME = "cluster.db"
TOKEN_NAME = "token"
ID_MARK_NAME = "last_job_id"
"""The highest job id this directory has handed out (beside the database, so that an emptied or
replaced database never hands it out again)."""
JOBS_DIR = "jobs"
IDENTITY_NAME = "cluster_job.json"
"""In a job's run directory: which cluster and job it belongs to (see :meth:`ClusterDB.claim_run_dir`)."""

# -- the directory is private ---------------------------------------------------------------
# The rule of run directories (virtualflow.records.rundir.make_private_dir), worded for a cluster
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


def read_identity(path: str) -> dict[str, Any] | None:
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
