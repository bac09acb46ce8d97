"""The TCP connections of gloo groups, and the native gloo calls in flight in this process.

:class:`Connections` names a group's connected sockets by descriptor and inode and shuts them
down (``shutdown(2)``: every operation waiting on them fails at once, as when the peer's process
is killed; the descriptors stay gloo's to close). :data:`NATIVE` counts the threads inside a
gloo wait or release, which run with the interpreter lock released: a daemon thread still in
one when the interpreter exits is ended by Python in the middle of a C++ frame, and the
process aborts ("terminate called without an active exception"). A caller that has shut a
run's connections down waits for the count to drop (:meth:`NativeCalls.settle`) before it
returns, so no such wait outlives it.

Limits: Linux only (``/proc/self/fd``); elsewhere a snapshot is empty and nothing is shut down.
"""

from __future__ import annotations

import os
import socket
import stat
import threading

__all__ = ["NATIVE", "Connections", "NativeCalls"]


class NativeCalls:
    """How many threads are inside a native gloo call that can block (a work's wait, a group's
    release); a context manager around each such call."""

    __slots__ = ("_count", "_changed")

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def __enter__(self) -> None:
        with self._changed:
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def __len__(self) -> int:
        return self._count

    def settle(self, timeout_s: float) -> bool:
        """Wait until no thread is inside such a call, at most ``timeout_s``; True if none is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout_s)


NATIVE = NativeCalls()
"""This process's count (every group of the process shares it)."""


class Connections:
    """The TCP connections of one gloo group: ``(fd, inode)`` of each connected socket this process
    opened while the group was built (its listening socket is left alone: gloo owns it and a peer
    never waits on it). The inode is checked again before a shutdown, so a descriptor that gloo has
    closed and the process has reused for something else is never touched."""

    __slots__ = ("sockets",)

    def __init__(self, sockets: tuple[tuple[int, int], ...] = ()) -> None:
        self.sockets = sockets

    def __len__(self) -> int:
        return len(self.sockets)

    def __repr__(self) -> str:
        return f"Connections({len(self.sockets)} sockets)"

    @staticmethod
    def snapshot() -> dict[int, int]:
        """This process's open sockets, descriptor -> inode (empty where ``/proc`` is missing)."""
        out: dict[int, int] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return out
        for name in names:
            try:
                st = os.stat(f"/proc/self/fd/{name}")
            except (OSError, ValueError):
                continue
            if stat.S_ISSOCK(st.st_mode):
                out[int(name)] = st.st_ino
        return out

    @classmethod
    def opened_between(cls, before: dict[int, int], after: dict[int, int], exclude_port: int | None) -> "Connections":
        """The connected TCP sockets in ``after`` and not in ``before``, except those with an end
        at port ``exclude_port`` (the store's: a heartbeat thread may reconnect meanwhile, and a
        process hosting the store accepts connections to it)."""
        return cls(tuple(_new_ends(before, after, exclude_port)))

    @classmethod
    def paired_between(cls, before: dict[int, int], after: dict[int, int], exclude_port: int | None) -> "Connections":
        """:meth:`opened_between`, only the connections both of whose ends are in this process
        (ranks run as threads of it, talking to each other over loopback): a socket to anywhere
        else that was opened meanwhile is never among them."""
        ends = _new_ends(before, after, exclude_port)
        local = {mine for mine, _ in ends.values()}
        return cls(tuple(key for key, (_, peer) in ends.items() if peer in local))

    def shut_down(self) -> int:
        """``shutdown(SHUT_RDWR)`` every connection still open; returns how many. Safe to repeat
        and from any thread; the descriptors stay gloo's to close."""
        done = 0
        for fd, ino in self.sockets:
            try:
                dup = os.dup(fd)
            except OSError:
                continue  # gloo closed it already
            try:
                if os.fstat(dup).st_ino != ino:
                    continue  # the number was reused by another file
                sock = socket.socket(fileno=dup)
                dup = -1  # the socket object owns it now
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                except OSError:
                    pass  # not connected any more
                finally:
                    sock.close()  # closes the duplicate only
            except OSError:
                pass
            finally:
                if dup >= 0:
                    os.close(dup)
        return done


def _new_ends(before: dict[int, int], after: dict[int, int],
              exclude_port: int | None) -> dict[tuple[int, int], tuple[int, int]]:
    """(fd, inode) -> (local port, peer port) of each connected TCP socket in ``after`` and not in
    ``before`` with no end at ``exclude_port``, in descriptor order."""
    found = {}
    for fd, ino in sorted(after.items()):
        if before.get(fd) == ino:
            continue
        ends = _ends_of(fd, ino)
        if ends is not None and exclude_port not in ends:
            found[(fd, ino)] = ends
    return found


def _ends_of(fd: int, ino: int) -> tuple[int, int] | None:
    """(local port, peer port) of the connected TCP socket ``fd`` (inode ``ino``), else None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != ino:
            return None
        sock = socket.socket(fileno=dup)
        dup = -1
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return None
            peer = sock.getpeername()  # OSError for a listening socket
            return int(sock.getsockname()[1]), int(peer[1])
        except OSError:
            return None
        finally:
            sock.close()
    except OSError:
        return None
    finally:
        if dup >= 0:
            os.close(dup)
