"""A local worker dies with its launching process, even while it is still starting.

The bug: a worker still starting when its launcher (the job's coordinator: ``virtualflow run``,
the cluster service) was killed did not exit: it runs in a session of its own (no hang-up
signal), and once its imports were done it waited for the dead coordinator's store for the
store's connect timeout (600 s). Now it checks at start-up that its parent still hosts the job's
store and watches its parent from then on (virtualflow.backends.local_worker.ParentWatch).

The watch and the start-up check are proven without processes; then, end to end, a launcher is
SIGKILLed (1) as soon as its worker exists (it is still importing: the start-up check catches it)
and (2) once the worker has connected to the store (the parent watch catches it), before it
joined, and the worker must exit within a bounded time, saying why in its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from virtualflow.backends.local_worker import ORPHAN_EXIT_CODE, ParentWatch, launcher_gone, listens_on
from virtualflow.records.rundir import pid_alive

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)


# -- the watch, without processes ------------------------------------------------------------
def test_parent_watch_exits_once_the_parent_changes():
    ppid = [4242]
    exits: list[int] = []
    done = threading.Event()

    def exit_(code):
        exits.append(code)
        done.set()

    watch = ParentWatch(4242, interval_s=0.01, getppid=lambda: ppid[0], exit_=exit_).start()
    time.sleep(0.1)
    assert not exits and not watch.orphaned()  # the parent lives: nothing happens
    ppid[0] = 1  # reparented to init: the launcher died
    assert done.wait(5) and exits == [ORPHAN_EXIT_CODE]
    assert watch.orphaned()


def test_parent_watch_ignores_init_and_bad_intervals():
    exits: list[int] = []
    watch = ParentWatch(1, interval_s=0.01, getppid=lambda: 99, exit_=exits.append).start()
    time.sleep(0.05)
    assert not exits and not watch.orphaned()  # started by init: nothing to outlive
    with pytest.raises(ValueError, match="interval_s=0"):
        ParentWatch(5, interval_s=0)


def test_start_up_check_knows_the_launcher_by_its_store_socket():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        assert launcher_gone(os.getpid(), port) is False  # this process hosts the "store"
        assert listens_on(os.getppid(), port) is False
        assert launcher_gone(os.getppid(), port) is True  # a parent that does not: gone (e.g. init)
    assert listens_on(os.getpid(), port) is False and launcher_gone(os.getpid(), port) is True
    # Without /proc it cannot tell: only a parent of 1 counts as gone.
    assert listens_on(os.getpid(), port, proc="/nonexistent") is None
    assert launcher_gone(1, port, proc="/nonexistent") and not launcher_gone(4242, port, proc="/nonexistent")


# -- end to end: SIGKILL the launcher while its workers start --------------------------------
LAUNCHER = """
import sys, time
sys.path.insert(0, {tests!r})
import virtualflow as vf
vf.launch({job!r}, workers={workers}, steps=1000, run_dir={run_dir!r}, progress=False)
time.sleep(600)
"""


def _worker_pids(run_dir: str, n: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(run_dir, "status.json")) as f:
                pids = [w["pid"] for w in json.load(f).get("workers", []) if isinstance(w.get("pid"), int)]
        except (OSError, ValueError):
            pids = []
        if len(pids) == n:
            return pids
        time.sleep(0.01)
    raise AssertionError(f"{n} worker pids not in {run_dir}/status.json within {timeout_s} s")


def _joined(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return any(json.loads(line).get("event") in ("join", "step") for line in f if line.strip())
    except (OSError, ValueError):
        return False


def _holds_socket(pid: int) -> bool:
    """Whether the process has a socket open (a worker's first is its store connection, made
    after the start-up check: the parent watch runs by then)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("when,message", [("importing", "is gone before the worker started"),
                                          ("connected", "the job's coordinator) is gone; exiting")],
                         ids=["importing", "connected"])
def test_workers_exit_when_their_launcher_is_killed_during_start_up(tmp_path, when, message):
    run_dir = str(tmp_path / "run")
    code = LAUNCHER.format(tests=HERE, job=os.path.join(HERE, "service_jobs.py") + ":paced", workers=1,
                           run_dir=run_dir)
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    pids: list[int] = []
    try:
        pids = _worker_pids(run_dir, 1, 60)  # as soon as it exists: it is still importing virtualflow
        deadline = time.monotonic() + 60
        while when == "connected" and not _holds_socket(pids[0]):  # past its start-up check, in run_worker
            assert pid_alive(pids[0]) and time.monotonic() < deadline, "the worker never connected"
            time.sleep(0.002)
        # (Connected, it is building the job, or at most just joined: the watch is what ends it either way.)
        assert when == "connected" or not _joined(run_dir), "the worker had joined already: this tests start-up"
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 15  # before the fix it lived for the store's 600 s connect timeout
        while any(pid_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"orphaned workers {[p for p in pids if pid_alive(p)]} still alive"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
    with open(os.path.join(run_dir, "logs", "worker-0.log")) as f:
        assert message in f.read()
