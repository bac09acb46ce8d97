"""The local backend: worker processes on this machine, supervised by the launching process.

Workers are fresh Python processes (``python -m virtualflow.backends.local_worker``), never
forked from the caller, so they start from a clean interpreter whatever the caller has done
(threads, CUDA, open sockets). Each reads its configuration from its stdin pipe (nothing in the
run directory is unpickled) and runs in a session of its own, so a terminal's Ctrl-C reaches
only the launching process, which stops the job cleanly. Each gets ``OMP_NUM_THREADS``/``torch.set_num_threads`` equal to
its thread budget and writes its output to ``<state_dir>/logs/worker-<id>.log``.

A worker's session is also its process group (its id is the worker's pid), and every process the
job's code starts without leaving it (``subprocess.Popen``, ``os.fork``, a daemon that does not
call ``setsid``) belongs to it. The group ends with the worker: once the worker is seen exiting
(:meth:`LocalBackend.poll`), killed (:meth:`LocalBackend.kill_worker`) or terminated at the job's
end, whatever is left of its group is sent SIGKILL, so nothing the job forked outlives it. (A
process that leaves the group on purpose, with ``setsid``, is beyond this; a cgroup would be
needed to follow it.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import cloudpickle

if TYPE_CHECKING:
    from virtualflow.backends.base import Attachment
    from virtualflow.runtime.worker import WorkerConfig


@dataclass(slots=True)
class WorkerProcess:
    worker_id: int
    proc: subprocess.Popen
    log_path: str

    ended: bool = False
    """Its process group was sent SIGKILL after the worker exited (done once)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def end_group(self) -> None:
        """SIGKILL whatever is left of the worker's process group (what its job forked), once,
        after the worker itself has exited. The group id is the worker's pid (it leads its own
        session); while any member is left, the kernel never reuses that id for another process,
        and it is killed here as soon as the exit is seen, so no stranger's group is hit."""
        if self.ended:
            return
        self.ended = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left in the group

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker's log ("" if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def check_local_device(device: str) -> None:
    """Refuse, before any worker starts, a ``device`` this process's torch cannot use: not a device
    name, a CUDA device with a CPU-only torch or none visible, an index past the devices there
    are, MPS where it is not available. (Without this, workers started and failed seconds later
    on an assertion deep in torch.)"""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a torch device name; use e.g. cpu, cuda or cuda:1 "
                         f"(--device)") from None
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ValueError(f"device={device!r}, but this torch ({torch.__version__}) is a CPU-only build; install "
                             f"a CUDA build of torch, or train on --device cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"device={device!r}, but torch sees no CUDA device on this machine (check "
                             f"CUDA_VISIBLE_DEVICES and the driver), or train on --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r}, but this machine has {count} CUDA device{'s' if count > 1 else ''} "
                             f"(cuda:0 to cuda:{count - 1}); choose one of them (--device)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}, but MPS is not available on this machine; train on --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):  # xpu and others that say whether they are there
        module = getattr(torch, dev.type, None)
        available = getattr(module, "is_available", None)
        if callable(available) and not available():
            raise ValueError(f"device={device!r}, but torch reports no {dev.type} device on this machine; train on "
                             f"--device cpu")


class LocalBackend:
    """Worker processes on this machine (see the module docstring)."""

    name = "local"
    kind_of_worker = "local processes"

    def __init__(self) -> None:
        self.workers: dict[int, WorkerProcess] = {}
        self.config: WorkerConfig | None = None
        self.state_dir = ""
        self._config_bytes = b""

    def store_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0  # loopback only: nothing outside this machine reaches the store

    def default_threads(self, workers: int) -> int:
        return max(1, (os.cpu_count() or 1) // workers)

    def check_capacity(self, workers: int, *, knob: str = "--workers") -> None:
        return None  # processes on this machine: no capacity to check

    def check_device(self, device: str) -> None:
        """The workers run on this machine: ``device`` must exist here (:func:`check_local_device`)."""
        check_local_device(device)

    def attach(self, attachment: Attachment) -> None:
        self.config, self.state_dir = attachment.config, attachment.state_dir
        os.makedirs(os.path.join(self.state_dir, "logs"), exist_ok=True)
        # Handed to each worker through its stdin pipe: never a file another user could replace.
        self._config_bytes = cloudpickle.dumps(self.config)

    def serve(self, reports: Sequence[dict[str, Any]]) -> None:
        return None

    def logs_where(self) -> str:
        return f"logs in {os.path.join(self.state_dir, 'logs')}"

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        wp = self.workers.get(worker_id)
        return wp.log_tail(lines) if wp is not None else ""

    def start_worker(self, worker_id: int) -> WorkerProcess:
        env = dict(os.environ)
        assert self.config is not None, "attach() first"
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
            [sys.executable, "-m", "virtualflow.backends.local_worker", str(worker_id)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            env=env,
            # Its own session: a Ctrl-C in the terminal reaches the coordinator only, which then
            # stops the workers at a step boundary with the final state written.
            start_new_session=True,
        )
        assert proc.stdin is not None
        try:
            proc.stdin.write(self._config_bytes)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at start-up: poll() reports its exit code
        log.close()
        wp = WorkerProcess(worker_id, proc, log_path)
        self.workers[worker_id] = wp
        return wp

    def kill_worker(self, worker_id: int) -> str:
        """SIGKILL one worker (fencing a hung one works even if it is stopped)."""
        wp = self.workers.get(worker_id)
        if wp is not None and wp.proc.poll() is None:
            wp.proc.kill()
            try:
                wp.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if wp is not None and wp.proc.poll() is not None:
            wp.end_group()
        return "killed"

    def pid(self, worker_id: int) -> int | None:
        wp = self.workers.get(worker_id)
        return wp.pid if wp is not None else None

    def poll(self) -> dict[int, int | None]:
        """Exit code of every worker, None while it runs; a worker seen exited has what is left
        of its process group killed (see the module docstring)."""
        codes = {}
        for wid, wp in self.workers.items():
            codes[wid] = code = wp.proc.poll()
            if code is not None:
                wp.end_group()
        return codes

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
        for wp in self.workers.values():
            if wp.proc.poll() is not None:
                wp.end_group()
