"""A worker process's descendants: kept as its own and ended with it.

Job code may start processes (a data server, a ``subprocess.Popen`` it forgets, a daemon that
double-forks or calls ``setsid``). None of them may outlive the worker that started them. The
local backend kills a worker's process group when it sees the worker exit (covers a SIGKILLed
worker); this module covers what a process group does not: a descendant that left the group
(``setsid``) and a worker whose machine this coordinator cannot reach (``virtualflow worker``).

Invariants: :func:`keep_descendants` makes this process a *child subreaper* (Linux
``PR_SET_CHILD_SUBREAPER``), so an orphaned descendant is re-parented to it instead of to PID 1 and
stays in its tree; :func:`end_descendants` SIGKILLs every process in that tree (read from
``/proc``), never this process or one outside its tree, and reaps them, until none is left or a
bound passes. Both are no-ops where Linux's interfaces are absent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time

log = logging.getLogger(__name__)

__all__ = ["descendants", "end_descendants", "keep_descendants"]

_PR_SET_CHILD_SUBREAPER = 36


def keep_descendants() -> bool:
    """Make this process the subreaper of its descendants (orphans come back to it, not to
    PID 1); returns whether that took effect."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents(proc: str) -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; ppid follows the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 2 and fields[1].isdigit():
            out[int(name)] = int(fields[1])
    return out


def descendants(pid: int | None = None, proc: str = "/proc") -> list[int]:
    """Every process below ``pid`` (default: this one) in the process tree, children first."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent in _parents(proc).items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop(0)
        if p == root or p in out:
            continue
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(timeout_s: float = 5.0, proc: str = "/proc") -> list[int]:
    """SIGKILL every descendant of this process and reap them; repeated while new orphans come
    back to this (subreaper) process, for at most ``timeout_s``. Returns the PIDs signalled."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in descendants(proc=proc) if p not in killed or _alive(p)]
        if not left:
            break
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            if p not in killed:
                killed.append(p)
        _reap()
        if time.monotonic() > deadline:
            log.warning("processes started by the job are still there after %.0f s: %s", timeout_s, left)
            break
        time.sleep(0.01)
    _reap()
    if killed:
        log.info("ended %d process(es) the job started and left running: %s", len(killed), killed)
    return killed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] != "Z"  # a zombie is gone (reaped by its parent soon)
