"""How the cluster service tells a job's failure from the machine's: a full disk, a shortage.

A job fails for good only for what its own code did. When the *service* cannot write (its
database, a job's run directory: :func:`disk_full`) or runs short of descriptors, processes or
memory (:func:`short_of_resources`), nobody's job is at fault: the service pauses, or queues the
job again after a back-off, and never records it failed.

Invariants: every function here is a pure judgement of an error or a read of free space; nothing
is written, no process is started.
"""

from __future__ import annotations

import os
import shutil
import sqlite3

__all__ = ["SERVICE_FREE_BYTES", "RESOURCE_BACKOFF_S", "short_of_resources", "disk_full", "one_line", "free_bytes"]

SERVICE_FREE_BYTES = 64 * 1024 * 1024
"""Free space the service asks for on its database's file system after "database or disk is full"
before it goes on (the database grows by its write-ahead log; 64 MiB is ample for many rounds)."""


RESOURCE_BACKOFF_S = (15.0, 600.0)
"""A job whose start failed because the *service* ran short of a process resource (descriptors,
processes, memory) is placed again after the first figure, doubling at each repeat up to the
second: the shortage is the machine's, not the job's, so it never fails the job for good."""


def short_of_resources(exc: BaseException) -> bool:
    """Whether ``exc`` says this process (or the machine) ran out of descriptors, processes or
    memory: EMFILE, ENFILE, EAGAIN (fork), ENOMEM. Transient, and no fault of the job's."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's (or the OS's) "out of space"."""
    import errno

    if isinstance(exc, sqlite3.OperationalError):
        return "disk is full" in str(exc)  # SQLITE_FULL: "database or disk is full"
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def one_line(error: BaseException | str) -> str:
    """An error as one line: a job's own failure (``TrainingError``, the driver's report) or a
    stop's time-out by its message, anything else with its type."""
    text = str(error) if isinstance(error, (str, RuntimeError, TimeoutError)) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def free_bytes(path: str) -> float:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return float(shutil.disk_usage(path or "/").free)
    except OSError:
        return float("nan")
