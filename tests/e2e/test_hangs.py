"""Hangs nobody else detects: a job whose own code blocks, an external worker welcomed that never
joins, a process the job forked that would outlive it.

Each test starts few, short processes and bounds its wait generously (a loaded 2-core box); the
decisions themselves (the step watchdog, the welcome deadline) are unit-tested with a fake clock
in ``tests/unit/test_hang_policies.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import virtualflow as vf
import jobs


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone: it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ForkDaemon:
    """At the first step's end, starts a sleeping child in the worker's own process group (as a
    job that launches a helper and forgets it) and writes its pid to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, info):
        if info.step == 0:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                     start_new_session=False)
            with open(self.path, "w") as f:
                f.write(str(child.pid))


def test_a_process_forked_by_the_job_ends_with_its_worker(tmp_path):
    path = str(tmp_path / "daemon.pid")
    pid = None
    try:
        job = jobs.regression_job("sgd", callbacks=[ForkDaemon(path)])
        result = vf.train(job, workers=1, steps=3, run_dir=str(tmp_path / "run"))
        assert result.steps == 3
        pid = int(open(path).read())
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"the daemon the job forked (pid {pid}) outlived the job"
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
