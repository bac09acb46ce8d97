"""The local backend: worker processes on this machine, supervised by the launching process.

Workers are fresh Python processes (``python -m virtualflow.backends.local_worker``), never
forked from the caller, so they start from a clean interpreter whatever the caller has done
(threads, CUDA, open sockets). Each gets ``OMP_NUM_THREADS``/``torch.set_num_threads`` equal to
its thread budget and writes its output to ``<state_dir>/logs/worker-<id>.log``.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from virtualflow.runtime.worker import WorkerConfig


@dataclass(slots=True)
class WorkerProcess:
    worker_id: int
    proc: subprocess.Popen
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker's log ("" if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class LocalBackend:
    def __init__(self, config: WorkerConfig, state_dir: str) -> None:
        self.config = config
        self.state_dir = state_dir
        self.workers: dict[int, WorkerProcess] = {}
        os.makedirs(os.path.join(state_dir, "logs"), exist_ok=True)
        self.config_path = os.path.join(state_dir, "worker_config.pkl")
        with open(self.config_path, "wb") as f:
            pickle.dump(config, f)

    def start_worker(self, worker_id: int) -> WorkerProcess:
        env = dict(os.environ)
        threads = str(self.config.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
        # Keep freed tensor memory in the process instead of returning it to the OS after every
        # step: with glibc's defaults a training step paid thousands of page faults (10-40 % of a
        # step measured in bench/). Peak memory is unchanged. A user's own setting wins.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1024 * 1024 * 1024))
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        log_path = os.path.join(self.state_dir, "logs", f"worker-{worker_id}.log")
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "virtualflow.backends.local_worker", self.config_path, str(worker_id)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()
        wp = WorkerProcess(worker_id, proc, log_path)
        self.workers[worker_id] = wp
        return wp

    def kill_worker(self, worker_id: int) -> None:
        """SIGKILL one worker (fencing a hung one works even if it is stopped)."""
        wp = self.workers.get(worker_id)
        if wp is not None and wp.proc.poll() is None:
            wp.proc.kill()
            try:
                wp.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def pid(self, worker_id: int) -> int | None:
        wp = self.workers.get(worker_id)
        return wp.pid if wp is not None else None

    def poll(self) -> dict[int, int | None]:
        """Exit code of every worker, None while it runs."""
        return {wid: wp.proc.poll() for wid, wp in self.workers.items()}

    def terminate_all(self, grace_s: float = 3.0) -> None:
        alive = [wp for wp in self.workers.values() if wp.proc.poll() is None]
        for wp in alive:
            wp.proc.terminate()
            try:
                os.kill(wp.pid, signal.SIGCONT)  # a stopped (hung) worker must wake up to die
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for wp in alive:
            try:
                wp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                wp.proc.kill()
                wp.proc.wait()
