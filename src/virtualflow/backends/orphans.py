"""Orphan reaping: finding and ending the processes of a job whose cluster service died.

Every job driver the cluster service starts, and through the environment every local worker it
starts, carries ``VIRTUALFLOW_SERVICE_JOB=<the job's run directory>`` (:data:`MARKER_ENV`). A
service started again after a crash waits for what is left of the jobs it ran (their drivers see
the service's pipe close and stop their jobs with the state written) and SIGKILLs what is still
there after a while (:func:`wait_orphans`), so two runs never write one run directory.

Invariants: a process is waited for or signalled only while it is verifiably the job's
(:func:`is_job_process`): it carries the job's marker (read from ``/proc/PID/environ``) and, for
a PID taken from the job's ``status.json``, it started no later than that file was written
(``/proc/PID/stat``). A PID reused by another process fails both checks and is left alone,
whatever its name; this process and PID 1 are never candidates. Nothing here starts a process.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from virtualflow.records.rundir import read_json

log = logging.getLogger(__name__)

__all__ = ["MARKER_ENV", "is_job_process", "job_pids", "job_processes", "start_time_s", "wait_orphans"]

MARKER_ENV = "VIRTUALFLOW_SERVICE_JOB"
"""The environment variable naming the job (its run directory) a process belongs to."""


def _boot_time_s(proc: str = "/proc") -> float | None:
    try:
        with open(os.path.join(proc, "stat")) as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def start_time_s(pid: int, proc: str = "/proc") -> float | None:
    """When process ``pid`` started (seconds since the epoch, to the clock tick), or None."""
    try:
        with open(os.path.join(proc, str(pid), "stat")) as f:
            text = f.read()
        ticks = int(text.rpartition(")")[2].split()[19])  # field 22: starttime, after the command
        boot = _boot_time_s(proc)
    except (OSError, ValueError, IndexError):
        return None
    return None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")


def _has_marker(pid: int, marker: str, proc: str = "/proc") -> bool:
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as f:
            env = f.read().split(b"\0")
    except OSError:  # gone, or another user's process: never ours to signal
        return False
    return f"{MARKER_ENV}={marker}".encode() in env


def is_job_process(pid: int, marker: str, *, not_after_s: float | None, proc: str = "/proc") -> bool:
    """Whether ``pid`` is one of the job's processes: it carries the job's marker and (when
    ``not_after_s`` is given: when the job's ``status.json`` listed it) it started no later than
    then (a reused PID belongs to a process started later)."""
    if pid <= 1 or pid == os.getpid() or not _has_marker(pid, marker, proc):
        return False
    if not_after_s is None:
        return True
    started = start_time_s(pid, proc)
    return started is not None and started <= not_after_s + 1.0  # the clock tick and the write's rounding


def job_processes(marker: str, proc: str = "/proc") -> list[int]:
    """Every process of this user that carries the job's marker (a driver or worker that the
    job's ``status.json`` did not list yet)."""
    out = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if name.isdigit() and _has_marker(int(name), marker, proc) and int(name) != os.getpid():
            out.append(int(name))
    return sorted(out)


def job_pids(run_dir: str) -> dict[int, float | None]:
    """The processes of the job in ``run_dir`` that a dead service may have left: those its
    ``status.json`` lists (its driver, which hosts the coordinator, and its workers), each with
    the time that file was written (a process listed there had started by then), and any other
    process carrying the job's marker (no time: the marker alone identifies it)."""
    status = read_json(os.path.join(run_dir, "status.json")) or {}
    written = status.get("updated")
    written = float(written) if isinstance(written, (int, float)) and not isinstance(written, bool) else None
    listed = [w.get("pid") for w in status.get("workers", []) if isinstance(w, dict)]
    coordinator = status.get("coordinator")
    if isinstance(coordinator, dict):
        listed.append(coordinator.get("pid"))
    out: dict[int, float | None] = {p: written for p in listed
                                    if isinstance(p, int) and not isinstance(p, bool) and p > 1 and written is not None}
    for p in job_processes(run_dir):
        out.setdefault(p, None)
    return out


def wait_orphans(run_dirs: list[str], timeout_s: float = 20.0) -> None:
    """Wait for what is left of the jobs in ``run_dirs`` after the service died: their drivers see
    the service's pipe close and stop their jobs at the next step boundary with the state
    written; SIGKILL those still there after ``timeout_s`` (a worker still starting may wait much
    longer), so two runs never write one run directory. A process is waited for or signalled only
    while it is verifiably the job's (:func:`is_job_process`: the job's marker in its environment
    and, for a PID from ``status.json``, a start no later than that file was written): a PID
    reused by another process is left alone, whatever its name."""
    candidates = {(d, p): t for d in run_dirs for p, t in job_pids(d).items()}

    def ours() -> list[tuple[str, int]]:
        return [(d, p) for (d, p), t in candidates.items() if is_job_process(p, d, not_after_s=t)]

    deadline = time.monotonic() + timeout_s
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    for d, p in ours():
        log.warning("process %d of the job in %s outlived the service that ran it; killing it", p, d)
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
