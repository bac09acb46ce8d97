"""Entry point of a local worker process: ``python -m virtualflow.backends.local_worker ID``, its
configuration (a pickled :class:`WorkerConfig`) on stdin, written by the launching process.

:func:`preemption_notice` is shared by every backend's worker entry (local, Ray actors,
``virtualflow worker``): SIGTERM while training is a preemption notice.

A local worker lives and dies with its launching process (the job's coordinator runs there):
:class:`ParentWatch` notices the launcher's death, whatever the worker is doing, and ends the
process. Without it a worker still starting when the launcher died (importing torch, building
the job, connecting to the store the dead coordinator held) waited out the store's connect
timeout (``store_timeout_s``, 600 s): it runs in a session of its own, so no hang-up signal
reaches it. A worker that is already training would also notice through its heartbeat
(:class:`virtualflow.runtime.channel.Heartbeat`), a few seconds later.

Why poll ``os.getppid()`` rather than ``prctl(PR_SET_PDEATHSIG)``: the kernel sends the death
signal when the *thread* that forked the child exits, and the launcher starts workers from
several threads (a resize starts newcomers from the job's monitor thread, the cluster service
starts jobs from a pool), so a short-lived thread would kill healthy workers. The parent
*process* changing (the worker reparented to init or a subreaper) is exactly the event wanted,
and it is portable to every POSIX system.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
from typing import Any, Callable, Mapping

from virtualflow.backends.descendants import end_descendants, keep_descendants

ORPHAN_EXIT_CODE = 3
"""What an orphaned worker exits with (as a worker whose heartbeat lost the coordinator)."""


class ParentWatch:
    """A daemon thread that ends the process once its parent is gone.

    ``parent``: the pid the worker was started by (read at the very start of the process);
    every ``interval_s`` the thread compares ``getppid()`` with it, and when they differ it
    prints why and calls ``exit_(ORPHAN_EXIT_CODE)`` (``os._exit``: no interpreter teardown,
    which may block on gloo's threads). ``getppid`` and ``exit_`` are parameters so the watch is
    testable without processes. A ``parent`` of 1 is not watched (started by init: nothing to
    outlive). The one case it cannot see: a launcher that died in the few milliseconds between
    starting the process and its first instruction (the worker already has init as its
    parent); the cluster service's crash recovery kills such a worker."""

    def __init__(self, parent: int, *, worker_id: int | None = None, interval_s: float = 0.2,
                 getppid: Callable[[], int] = os.getppid, exit_: Callable[[int], object] = os._exit) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r} must be a positive number of seconds")
        self.parent = parent
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.getppid = getppid
        self.exit_ = exit_
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="virtualflow-parent-watch", daemon=True)

    def orphaned(self) -> bool:
        """Whether the parent this worker was started by is gone."""
        return self.parent > 1 and self.getppid() != self.parent

    def start(self) -> ParentWatch:
        if self.parent > 1:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.orphaned():
                who = f"virtualflow worker {self.worker_id}" if self.worker_id is not None else "virtualflow worker"
                try:
                    print(f"{who}: its launching process (pid {self.parent}, the job's coordinator) is gone; "
                          f"exiting", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a closed stderr must not keep an orphan alive
                    pass
                self.exit_(ORPHAN_EXIT_CODE)
                return
            self._stop.wait(self.interval_s)


def preemption_notice():
    """Install the SIGTERM handling of a worker process (:class:`PreemptionNotice`: a SIGTERM while
    training is a preemption notice, at any other time it ends the process) and return it; ``None``
    off the main thread, where Python cannot install signal handlers (a worker then dies on
    SIGTERM, as before: the loss is handled as a failure)."""
    from virtualflow.runtime.worker import PreemptionNotice

    if threading.current_thread() is not threading.main_thread():
        return None
    notice = PreemptionNotice()

    def handler(signum: int, frame: object) -> None:
        if not notice.take():
            os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    return notice


def listens_on(pid: int, port: int, proc: str = "/proc") -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux: ``/proc/net/tcp``
    and the process's file descriptors); None where that cannot be told (no ``/proc``, another
    user's process)."""
    inodes: set[str] = set()
    read = 0
    try:
        for table in ("tcp", "tcp6"):
            try:
                with open(os.path.join(proc, "net", table)) as f:
                    lines = f.readlines()[1:]
            except FileNotFoundError:
                continue
            read += 1
            for line in lines:
                cols = line.split()
                # local_address is HEXIP:HEXPORT; state 0A is LISTEN; column 9 is the inode.
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:
                    inodes.add(cols[9])
        if not read:
            return None
        if not inodes:
            return False
        fd_dir = os.path.join(proc, str(pid), "fd")
        for fd in os.listdir(fd_dir):
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
        return False
    except (OSError, ValueError):
        return None


def launcher_gone(parent: int, store_port: int, proc: str = "/proc") -> bool:
    """At start-up: whether the process that launched this worker is already gone. The launcher
    hosts the job's store, so the parent is the launcher if it listens on the store's port; a
    parent that does not (init, a subreaper: the launcher died while this process was importing)
    means the job's coordinator is gone. Without ``/proc``, a parent of 1 means gone."""
    held = listens_on(parent, store_port, proc)
    return parent == 1 if held is None else not held


def interface_from_environment(config: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """``config`` (a :class:`WorkerConfig`) with gloo's interface taken from this process's
    environment (``GLOO_SOCKET_IFNAME``, as torch reads it) when the job left it ``auto``: a
    machine's own setting applies to the workers that run there. Every backend's worker entry
    calls this before :func:`~virtualflow.runtime.worker.run_worker`."""
    chosen = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if config.interface == "auto" and chosen:
        return dataclasses.replace(config, interface=chosen, interface_knob="GLOO_SOCKET_IFNAME")
    return config


def main(argv: list[str], parent: int | None = None) -> int:
    worker_id = int(argv[1])
    parent = os.getppid() if parent is None else parent
    config = pickle.loads(sys.stdin.buffer.read())
    # Before the slow part (torch, the job, the store connection): die with the launcher. It may
    # have died already while this process imported virtualflow (a second or more).
    if launcher_gone(parent, int(config.store_port)):
        print(f"virtualflow worker {worker_id}: its launching process (the job's coordinator, store port "
              f"{config.store_port}) is gone before the worker started; exiting", file=sys.stderr, flush=True)
        return ORPHAN_EXIT_CODE
    ParentWatch(parent, worker_id=worker_id).start()
    keep_descendants()  # what the job starts stays in this tree, even if it leaves the process group
    from virtualflow.backends.inprocess import eager_every_wait_from_env
    from virtualflow.runtime.worker import run_worker

    return run_worker(interface_from_environment(config), worker_id, preemption_notice(),
                      eager_every_wait=eager_every_wait_from_env())


if __name__ == "__main__":
    try:
        code = main(sys.argv, os.getppid())
    finally:
        end_descendants()  # nothing the job started outlives its worker
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's background threads can abort the process while C++
    # statics are destroyed ("terminate called without an active exception"). All state that
    # matters is already written and reported.
    os._exit(code)
