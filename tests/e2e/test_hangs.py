"""Hangs nobody else detects: a job whose own code blocks, an external worker welcomed that never
joins, a process the job forked that would outlive it.

Each test starts few, short processes and bounds its wait generously (a loaded 2-core box); the
decisions themselves (the step watchdog, the welcome deadline) are unit-tested with a fake clock
in ``tests/unit/test_hang_policies.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import virtualflow as vf
import jobs
from conftest import process_alive as _alive




class ForkDaemon:
    """At the first step's end, starts a sleeping child in the worker's own process group (as a
    job that launches a helper and forgets it) and writes its pid to ``path``. ``detached``: a
    real daemon instead, in a session of its own and orphaned at once (``setsid`` from a shell
    that exits), so neither the worker's process group nor its children list holds it."""

    def __init__(self, path: str, detached: bool = False) -> None:
        self.path, self.detached = path, detached

    def on_step_end(self, info):
        if info.step == 0:
            if self.detached:
                out = subprocess.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!"],
                                     capture_output=True, text=True, check=True)
                pid = int(out.stdout.strip())
            else:
                pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                       start_new_session=False).pid
            with open(self.path, "w") as f:
                f.write(str(pid))


@pytest.mark.parametrize("detached", [False, True], ids=["child", "setsid-daemon"])
def test_a_process_forked_by_the_job_ends_with_its_worker(tmp_path, detached):
    path = str(tmp_path / "daemon.pid")
    pid = None
    try:
        job = jobs.regression_job("sgd", callbacks=[ForkDaemon(path, detached)])
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


class BlockAt:
    """Blocks for ever in ``on_step_end`` of step ``step`` (a callback waiting on something that
    never comes), while the worker's heartbeat thread goes on beating."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, info):
        if info.step == self.step:
            while True:
                time.sleep(1)


def test_a_worker_blocked_in_a_callback_fails_the_job_with_a_clear_message(tmp_path, monkeypatch):
    """The grace to answer the abort (at least 10 s by default: tests/e2e/test_membership.py's
    wedged-member cases, with a fake clock) is cut to 2 s here: a blocked worker never answers."""
    from virtualflow.control.membership.hangs import HangGuard

    real_init = HangGuard.__init__

    def short_grace(self, *args, **kw):
        real_init(self, *args, **kw)
        self.wedge_grace_s = 2.0

    monkeypatch.setattr(HangGuard, "__init__", short_grace)
    job = jobs.regression_job("sgd", callbacks=[BlockAt(2)])
    t0 = time.monotonic()
    with pytest.raises(vf.TrainingError) as err:
        vf.train(job, workers=1, steps=50, run_dir=str(tmp_path / "run"), step_timeout_s=3.0)
    message = str(err.value)
    assert "no step for" in message and "step_timeout_s=3" in message and "wedged" in message, message
    assert time.monotonic() - t0 < 120  # 3 s without a step + 2 s to answer the abort, on a loaded box
    events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    stalled = [e for e in events if e["event"] == "stalled"]
    assert len(stalled) == 1 and stalled[0]["step"] == 2  # steps 0 and 1 done, step 2 blocked
    assert [e["worker"] for e in events if e["event"] == "failure"] == [0]


def test_an_external_worker_welcomed_that_never_joins_does_not_stall_the_job(tmp_path, monkeypatch):
    """A joiner takes a place (it is welcomed) and then says nothing, as a worker that died right
    after its welcome: the job starts without it once its welcome runs out and the worker that
    did join trains the job to its end (before: ``forming`` for ever). The real worker joins
    first (it is beating before the silent one is welcomed), so the welcome's allowance (at least
    30 s by default: tests/unit/test_welcome_allowance_inproc.py) is cut to 3 s here without a
    slow start of the real worker ever meeting it."""
    from test_external import free_port, reap, start_worker
    from virtualflow.backends import external
    from virtualflow.cli.worker import join
    from virtualflow.comm import protocol

    real_init = external.ExternalBackend.__init__
    monkeypatch.setattr(external.ExternalBackend, "__init__",
                        lambda self, listen, **kw: real_init(self, listen, **{**kw, "first_beat_s": 3.0}))
    run_dir, token_file = str(tmp_path / "run"), str(tmp_path / "secret")
    with open(token_file, "w") as f:
        f.write("0123456789abcdef" * 4)
    os.chmod(token_file, 0o600)
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.regression_job(), workers=2, steps=4, run_dir=run_dir, backend="external",
                       listen=address, token_file=token_file, heartbeat_timeout_s=2.0)
    procs = []
    try:
        procs.append(start_worker(address, token_file, str(tmp_path / "w.log")))
        store, deadline = handle.coordinator.store, time.monotonic() + 120

        def beating(w) -> bool:  # welcomed, and its heartbeat has begun
            return w.pid == procs[0].pid and store.add(protocol.heartbeat_key(w.worker_id), 0) > 0

        while not any(beating(w) for w in list(handle.backend.workers.values())):
            assert time.monotonic() < deadline and procs[0].poll() is None and not handle.done, handle.status()
            time.sleep(0.05)
        silent_id, _ = join(address, open(token_file).read().strip(), timeout_s=60)  # welcomed, then silent
        result = handle.wait(timeout_s=150)
    finally:
        if not handle.done:
            handle.kill()
        codes = reap(procs)
    assert codes == [0], open(tmp_path / "w.log").read()[-2000:]
    assert result.steps == 4 and {h["workers"] for h in result.history} == {1}
    assert [f["worker"] for f in result.failures] == [silent_id]
    assert "never started beating (no heartbeat within 3 s of its welcome" in result.failures[0]["cause"]


def test_a_stop_while_the_first_generation_forms_ends_the_job_at_once(tmp_path):
    """``virtualflow run --backend external`` stopped (SIGTERM, Ctrl-C: :func:`virtualflow.api.stop_interrupted`
    calls ``handle.stop``) before any worker came: no step boundary will come to stop at, so the
    job ends at once instead of after ``stop``'s own timeout (no worker process is started here)."""
    from test_external import free_port

    handle = vf.launch(jobs.regression_job(), workers=2, steps=4, run_dir=str(tmp_path / "run"), backend="external",
                       listen=f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    try:
        with pytest.raises(vf.TrainingError, match=r"stopped \(SIGTERM\) before the first generation formed"):
            handle.stop(timeout_s=60, reason="SIGTERM")
    finally:
        if not handle.done:
            handle.kill()
    assert time.monotonic() - t0 < 30 and handle.done
