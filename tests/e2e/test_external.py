"""External workers: a coordinator that listens on an address and workers that join it with
``virtualflow worker --join ADDR:PORT --token-file FILE``, end to end on loopback.

The standard of proof is the one of tests/test_elastic.py: the run ends with weights and
optimizer state bit-identical (deterministic mode) to ``vf.train(..., workers=2)`` on the local
backend for the same number of steps, however the workers came and went. Around it: requests
not signed with the job's token (a join with a wrong token, a resize pushed straight into the
store) are refused and logged, and the job does not notice them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import virtualflow as vf
from conftest import assert_same_training
import jobs

pytestmark = pytest.mark.slow

FOREVER = 1_000_000
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(address: str, token_file: str, log_path: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "virtualflow.cli.main", "worker", "--join", address,
                                 "--token-file", token_file, "--join-timeout", "60"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def events(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


def wait_until(predicate, what: str, timeout_s: float = 90.0, handle: vf.JobHandle | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if handle is not None and handle.done:
            handle.wait()
            raise AssertionError(f"the job ended before {what}")
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.02)


def members(handle: vf.JobHandle) -> int:
    return sum(1 for w in handle.status()["workers"] if w["rank"] is not None)


def settled(handle: vf.JobHandle, n: int) -> bool:
    st = handle.status()
    return st["generation"] == st["formed_generation"] and members(handle) == n


def join_then_stop(handle: vf.JobHandle, procs: list, address: str, token_file: str, log: str,
                   who: str) -> vf.Result:
    """Start one more worker, wait until it is in a generation of 2 and 3 more steps ran, stop."""
    procs.append(start_worker(address, token_file, log))
    wait_until(lambda: settled(handle, 2), f"{who} in a generation", handle=handle)
    step = handle.status()["step"]
    wait_until(lambda: handle.status()["step"] >= step + 3, "3 more steps", handle=handle)
    return handle.stop()


def reap(procs: list[subprocess.Popen]) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def test_two_joined_workers_train_bit_identical_to_local(tmp_path):
    run_dir, token_file = str(tmp_path / "run"), str(tmp_path / "secret")
    with open(token_file, "w") as f:
        f.write("0123456789abcdef" * 4)
    os.chmod(token_file, 0o600)
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.elastic_job, workers=2, steps=12, deterministic=True, run_dir=run_dir,
                       backend="external", listen=address, token_file=token_file)
    procs = [start_worker(address, token_file, str(tmp_path / f"w{i}.log")) for i in range(2)]
    try:
        result = handle.wait(timeout_s=180)
    finally:
        codes = reap(procs)
    assert codes == [0, 0], [open(tmp_path / f"w{i}.log").read()[-2000:] for i in range(2)]
    assert sorted(e["worker"] for e in events(run_dir, "joined")) == [0, 1]
    assert {h["workers"] for h in result.history} == {2}
    # The local backend's run writes its own token, owner-only, and names it for `virtualflow resize`.
    ref_dir = str(tmp_path / "ref")
    ref = vf.train(jobs.elastic_job, workers=2, steps=12, deterministic=True, run_dir=ref_dir)
    assert stat.S_IMODE(os.stat(os.path.join(ref_dir, "token")).st_mode) == 0o600
    assert_same_training(result, ref)
    assert "token" not in os.listdir(run_dir)  # a given token file is used where it is, not copied


def test_unsigned_requests_are_refused_and_joins_leaves_resize_in_place(tmp_path):
    run_dir = str(tmp_path / "run")
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="external", listen=address)
    token_file = os.path.join(run_dir, "token")
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    procs = [start_worker(address, token_file, str(tmp_path / f"w{i}.log")) for i in range(2)]
    try:
        wait_until(lambda: handle.status()["step"] >= 3, "step 3", handle=handle)

        # 1. A join signed with another token: refused and logged; the job goes on with 2 workers.
        wrong = str(tmp_path / "wrong")
        with open(wrong, "w") as f:
            f.write("f" * 64)
        os.chmod(wrong, 0o600)
        intruder = start_worker(address, wrong, str(tmp_path / "intruder.log"))
        assert intruder.wait(timeout=60) == 1
        assert "refused the join" in open(tmp_path / "intruder.log").read()
        rejected = events(run_dir, "join_rejected")
        assert len(rejected) == 1 and "bad signature" in rejected[0]["reason"]

        # 2. An unsigned resize pushed straight into the store's request queue: ignored and logged.
        store = dist.TCPStore("127.0.0.1", int(address.rsplit(":", 1)[1]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        store.queue_push("vf/requests", json.dumps({"op": "resize", "workers": 1, "source": "cli"}))
        wait_until(lambda: len(events(run_dir, "request_rejected")) == 1, "the unsigned request logged", 30)
        step = handle.status()["step"]
        wait_until(lambda: handle.status()["step"] >= step + 3, "3 more steps", handle=handle)
        assert handle.status()["target_workers"] == 2 and members(handle) == 2 and handle.status()["generation"] == 0
        assert not events(run_dir, "resize_request")

        # 3. A signed one (the CLI signs with RUN_DIR/token) shrinks the job in place ...
        out = subprocess.run([sys.executable, "-m", "virtualflow.cli.main", "resize", run_dir, "--workers", "1",
                              "--wait", "--timeout", "90"], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=SRC))
        assert out.returncode == 0, out.stderr
        assert settled(handle, 1)
        # The worker that left (whichever process got id 1) exits cleanly.
        wait_until(lambda: any(p.poll() is not None for p in procs), "the leaving worker's exit", 30)
        assert [p.poll() for p in procs].count(0) == 1 and [p.poll() for p in procs].count(None) == 1

        # 4. ... and a worker that joins later grows it in place.
        result = join_then_stop(handle, procs, address, token_file, str(tmp_path / "w2.log"), "the joined worker")
    finally:
        if not handle.done:
            handle.kill()
        codes = reap(procs)
    assert codes == [0, 0, 0], [open(tmp_path / f"w{i}.log").read()[-2000:] for i in range(3)]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 1, 2]
    assert [e["source"] for e in events(run_dir, "resize_request")] == ["cli", "join"]
    assert not result.failures
    assert_same_training(result, vf.train(jobs.elastic_job, workers=2, steps=result.steps, deterministic=True))


def test_a_joined_worker_killed_mid_run_is_survived_and_a_replacement_can_join(tmp_path):
    import signal

    run_dir = str(tmp_path / "run")
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="external", listen=address, heartbeat_timeout_s=2.0)
    token_file = os.path.join(run_dir, "token")
    procs = [start_worker(address, token_file, str(tmp_path / f"w{i}.log")) for i in range(2)]
    try:
        wait_until(lambda: handle.status()["step"] >= 3, "step 3", handle=handle)
        victim = next(w["pid"] for w in handle.status()["workers"] if w["id"] == 1)
        os.kill(victim, signal.SIGKILL)  # no goodbye: only its silent heartbeat tells
        wait_until(lambda: settled(handle, 1), "the survivor alone in a generation", handle=handle)
        result = join_then_stop(handle, procs, address, token_file, str(tmp_path / "w2.log"), "the replacement")
    finally:
        if not handle.done:
            handle.kill()
        codes = reap(procs)
    assert sorted(codes) == [-signal.SIGKILL, 0, 0]
    assert [f["worker"] for f in result.failures] == [1] and "no heartbeat" in result.failures[0]["cause"]
    assert_same_training(result, vf.train(jobs.elastic_job, workers=2, steps=result.steps, deterministic=True))


def test_sigterm_to_a_joined_worker_is_a_preemption_notice(tmp_path):
    """A spot machine's notice (SIGTERM to `virtualflow worker`) releases that worker at a step
    boundary: no failure, it exits with code 0, the survivor goes on with the same model."""
    import signal

    run_dir = str(tmp_path / "run")
    address = f"127.0.0.1:{free_port()}"
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       backend="external", listen=address)
    token_file = os.path.join(run_dir, "token")
    procs = [start_worker(address, token_file, str(tmp_path / f"w{i}.log")) for i in range(2)]
    try:
        wait_until(lambda: handle.status()["step"] >= 3, "step 3", handle=handle)
        victim = next(w["pid"] for w in handle.status()["workers"] if w["id"] == 1)
        os.kill(victim, signal.SIGTERM)
        wait_until(lambda: settled(handle, 1), "the survivor alone in a generation", handle=handle)
        step = handle.status()["step"]
        wait_until(lambda: handle.status()["step"] >= step + 2, "2 more steps", handle=handle)
        result = handle.stop()
    finally:
        if not handle.done:
            handle.kill()
        codes = reap(procs)
    assert codes == [0, 0], [open(tmp_path / f"w{i}.log").read()[-2000:] for i in range(2)]
    assert not result.failures and [e["worker"] for e in events(run_dir, "preemption_notice")] == [1]
    assert [h["step"] for h in result.history] == list(range(result.steps))
    assert_same_training(result, vf.train(jobs.elastic_job, workers=2, steps=result.steps, deterministic=True))


def test_listen_belongs_to_the_external_backend_and_the_local_store_stays_on_loopback(tmp_path):
    with pytest.raises(ValueError, match="needs listen="):
        vf.launch(jobs.elastic_job, steps=1, backend="external")
    with pytest.raises(ValueError, match="only applies to backend='external'"):
        vf.launch(jobs.elastic_job, steps=1, listen="127.0.0.1:1234")
    with pytest.raises(ValueError, match="not ADDR:PORT"):
        vf.launch(jobs.elastic_job, steps=1, backend="external", listen="10.0.0.5")
    result = vf.train(jobs.elastic_job, workers=1, steps=1, run_dir=str(tmp_path / "run"))
    with open(tmp_path / "run" / "status.json") as f:
        coordinator = json.load(f)["coordinator"]
    assert coordinator["host"] == "127.0.0.1" and coordinator["token_file"] == str(tmp_path / "run" / "token")
    assert result.steps == 1


def test_command_line_coordinator_says_where_the_token_is_and_a_worker_joins_it(tmp_path):
    run_dir = str(tmp_path / "run")
    address = f"127.0.0.1:{free_port()}"
    root = os.path.dirname(SRC)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "virtualflow.cli.main", "run", "tests/jobs.py:elastic_job", "--backend", "external",
         "--listen", address, "--workers", "1", "--steps", "3", "--deterministic", "--run-dir", run_dir,
         "--no-progress"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    token_file = os.path.join(run_dir, "token")
    try:
        wait_until(lambda: os.path.exists(os.path.join(run_dir, "status.json")), "the coordinator listening", 60)
        worker = start_worker(address, token_file, str(tmp_path / "w0.log"))
        out, err = coordinator.communicate(timeout=120)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        codes = reap([worker]) if "worker" in locals() else []
    assert coordinator.returncode == 0, err[-3000:]
    assert codes == [0]
    assert f"virtualflow worker --join {address} --token-file FILE" in err and token_file in err
    assert "done: 3 steps" in out
