"""The GNN engine's executors that start processes: ``P`` graph-server and ``L`` tensor-worker
processes (:class:`ProcessExecutor`), tensor workers as Ray tasks (:class:`RayTensorPool`), and the
one place that builds an executor from :class:`~virtualflow.gnn.engine.DorylusOptions`
(:func:`make_executor`) and hands it to the engine (:func:`train_dorylus`, re-exported as
``virtualflow.gnn.train_dorylus``).

Invariants: the engine (:mod:`virtualflow.gnn.engine`) never chooses or starts its executor; it
gets one built here (or by another caller) from the servers' parts. Every executor here answers the
same requests as the in-process :class:`~virtualflow.gnn.executors.SimExecutor` with the same
replies, so the driver cannot tell them apart.

Why pipes from a driver and not torch.distributed: the driver decides every task (that is
where the staleness rule and the relaunch of lost tensor tasks live), tasks are irregular and
per interval, and a gloo collective needs every rank in lockstep, which bounded asynchrony is
meant to avoid. One duplex pipe per process keeps each graph server's requests in order (a
scatter posted before a gather is applied before it); ghost rows and gradient contributions are
batched into one message per (interval, layer, destination server). The messages are pickled
tensors between this process and the children it started (multiprocessing's own transport);
nothing from outside is read.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Sequence

import torch

from virtualflow.gnn.engine import DorylusOptions, GNNResult, run_engine, set_up
from virtualflow.gnn.executors import Executor, ExecutorStats, SimExecutor
from virtualflow.gnn.job import GNNJob
from virtualflow.gnn.layers import LayerSpec
from virtualflow.gnn.servers import GraphServer, ServerPart
from virtualflow.gnn.workers import WorkerLimits, run_tensor_task, task_bytes

log = logging.getLogger(__name__)


def make_executor(parts: list[ServerPart], opts: DorylusOptions) -> Executor:
    """The executor ``opts`` asks for, over the graph servers' ``parts``: ``mode="simulated"``: this
    process on a virtual clock; ``mode="process"``: graph-server processes and tensor workers as
    processes (``worker_backend="process"``) or Ray tasks (``"ray"``)."""
    if opts.mode == "simulated":
        return SimExecutor(parts, opts.tensor_workers, opts.limits, opts.sim_duration)
    return ProcessExecutor(parts, opts.tensor_workers, opts.limits, kill_tasks=opts.kill_tasks,
                           timeout_s=opts.timeout_s, use_ray=opts.worker_backend == "ray",
                           ray_address=opts.ray_address)


def train_dorylus(job: GNNJob, opts: DorylusOptions | None = None, **kw) -> GNNResult:
    """Train ``job`` on graph servers and tensor workers (``opts`` or keyword options)."""
    opts = opts or DorylusOptions(**kw)
    setup = set_up(job, opts)
    t0 = time.perf_counter()
    return run_engine(job, opts, setup, make_executor(setup.parts, opts), t0)


# ---- the processes' own loops (they run in the children) ---------------------------------------


def incoming(conn):
    """The driver's ``(tag, payload)`` messages on a process's pipe, until it closes the pipe or
    sends ``None`` (the loop of every graph server and tensor worker process)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        yield msg


def tensor_worker(conn, specs: Sequence[LayerSpec], activation: str, limits: WorkerLimits) -> None:
    """A tensor worker process: ``(tag, task)`` in, ``(tag, result)`` out, nothing kept between tasks."""
    torch.set_num_threads(1)
    first = True
    for tag, task in incoming(conn):
        if task.get("op") == "ping":
            conn.send((tag, "pong"))
            continue
        wait = limits.latency_s + limits.transfer_s(task_bytes(task))
        if first:
            wait += limits.cold_start_s
            first = False
        if task.get("crash"):  # fault injection: killed while holding the task
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        if limits.hangs(task["id"], task["attempt"]):
            time.sleep(limits.task_timeout_s * 100)  # never answers; the driver kills us
        if wait:
            time.sleep(wait)
        res = run_tensor_task(specs, activation, task)
        t = limits.transfer_s(task_bytes(res))
        if t:
            time.sleep(t)
        conn.send((tag, res))


def serve(conn, part: ServerPart) -> None:
    """A graph server process: requests in order from the driver's pipe; replies for tagged ones."""
    torch.set_num_threads(1)
    server = GraphServer(part)
    for tag, req in incoming(conn):
        try:
            out = server.handle(req)
        except Exception as exc:  # reported to the driver, which fails the run with it
            log.exception("graph server %d: %s failed", part.server, req[0])
            if tag is None:
                conn.send((("error", part.server), f"{type(exc).__name__}: {exc}"))
                continue
            conn.send((tag, ("error", f"{type(exc).__name__}: {exc}")))
            continue
        if tag is not None:
            conn.send((tag, out))


# ---- the driver's side ---------------------------------------------------------------------------


class WorkerSlot:
    """One tensor-worker process, its pipe, and the task it holds (None when idle)."""

    __slots__ = ("proc", "conn", "task", "tag", "t0", "deadline")

    def __init__(self, proc, conn) -> None:
        self.proc, self.conn = proc, conn
        self.task: dict | None = None
        self.tag: Any = None
        self.t0 = 0.0
        self.deadline = float("inf")


class ProcessExecutor:
    """``P`` graph-server processes and ``L`` tensor-worker processes, one pipe each.

    Tensor tasks go to idle workers from a queue; a worker that dies (its process sentinel fires)
    or passes ``limits.task_timeout_s`` on a task is killed and relaunched, and the task is sent
    again (attempt + 1). ``kill_tasks``: fault injection, the tensor-task dispatches (0-based,
    first attempts) whose worker is SIGKILLed while holding the task.
    """

    def __init__(self, parts: list[ServerPart], tensor_workers: int, limits: WorkerLimits,
                 kill_tasks: tuple[int, ...] = (), timeout_s: float = 600.0, ray_address: str | None = None,
                 use_ray: bool = False) -> None:
        from virtualflow.config.job import check_main_guard

        check_main_guard("graph-server and tensor-worker processes")  # each would import the script again
        # forkserver: one server process imports torch and PyG once and forks every graph server and
        # tensor worker from it (a spawned child would import them again: seconds each, here).
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["virtualflow.backends.gnn", "torch_geometric.nn"])
        self.limits = limits
        self.kill_tasks = set(kill_tasks)
        self.timeout_s = timeout_s
        self.specs, self.activation = parts[0].specs, parts[0].activation
        self.stats = ExecutorStats()
        self.gs: list[tuple[Any, Any]] = []
        for part in parts:
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=serve, args=(child, part), daemon=True, name=f"gnn-gs{part.server}")
            proc.start()
            child.close()
            self.gs.append((proc, parent))
        self.ray: RayTensorPool | None = None
        if use_ray and tensor_workers:
            self.ray = RayTensorPool(tensor_workers, self.specs, self.activation, limits, self.stats, ray_address)
            tensor_workers = 0  # no local worker processes
        self.workers = [self._launch(w) for w in range(tensor_workers)]
        self.idle = collections.deque(range(tensor_workers))
        self.queue: collections.deque = collections.deque()
        self.dispatches = 0
        self.task_ids = itertools.count()
        self.t_start = time.perf_counter()

    def warm_up(self) -> None:
        """Wait until every process answers (start-up is not training time); restarts the clock."""
        if self.ray is not None:
            self.ray.warm_up()
        for p, (_, conn) in enumerate(self.gs):
            conn.send((("warm", p), ("ping",)))
        for wk in self.workers:
            wk.conn.send((("warm",), {"op": "ping"}))
        for _, conn in self.gs:
            self._recv_bounded(conn)
        for wk in self.workers:
            self._recv_bounded(wk.conn)
        self.t_start = time.perf_counter()

    def _recv_bounded(self, conn) -> Any:
        if not conn.poll(self.timeout_s):
            raise TimeoutError(f"a graph server or tensor worker did not start within {self.timeout_s:.0f} s")
        return conn.recv()

    def _launch(self, w: int) -> WorkerSlot:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=tensor_worker, args=(child, self.specs, self.activation, self.limits),
                                daemon=True, name=f"gnn-tw{w}")
        proc.start()
        child.close()
        return WorkerSlot(proc, parent)

    def now(self) -> float:
        return time.perf_counter() - self.t_start

    def submit_gs(self, server: int, req: tuple, tag: Any) -> None:
        self.gs[server][1].send((tag, req))

    def post_gs(self, server: int, req: tuple) -> None:
        self.gs[server][1].send((None, req))

    def submit_tw(self, task: dict, tag: Any, home: int) -> None:
        if self.ray is not None:
            crash = self.dispatches in self.kill_tasks
            self.dispatches += 1
            self.ray.submit(tag, dict(task, id=next(self.task_ids), attempt=0, crash=crash))
            return
        if not self.workers:  # CPU-only: the graph server does the tensor work
            self.submit_gs(home, ("tensor", task), tag)
            return
        self.queue.append((tag, dict(task, id=next(self.task_ids), attempt=0)))
        self._pump()

    def _pump(self) -> None:
        while self.queue and self.idle:
            w = self.idle.popleft()
            tag, task = self.queue.popleft()
            if task["attempt"] == 0 and self.dispatches in self.kill_tasks:
                task = dict(task, crash=True)
            if task["attempt"] == 0:
                self.dispatches += 1
            wk = self.workers[w]
            wk.task, wk.tag, wk.t0 = task, tag, time.perf_counter()
            wk.deadline = wk.t0 + self.limits.task_timeout_s
            self.stats.tw_tasks += 1
            self.stats.bytes_to_tw += task_bytes(task)
            wk.conn.send((tag, task))

    def _relaunch(self, w: int, why: str) -> None:
        wk = self.workers[w]
        if wk.proc.is_alive():
            wk.proc.kill()
        wk.proc.join(10)
        wk.conn.close()
        self.stats.relaunches += 1
        if wk.task is not None:
            self.stats.tw_busy_s += time.perf_counter() - wk.t0  # the lost attempt is billed too
            retry = dict(wk.task, attempt=wk.task["attempt"] + 1)
            retry.pop("crash", None)
            self.queue.appendleft((wk.tag, retry))
            log.warning("tensor worker %d %s on task %s (attempt %d); relaunched, task sent again", w, why,
                        wk.tag, wk.task["attempt"])
        self.workers[w] = self._launch(w)
        if w not in self.idle:
            self.idle.append(w)
        self._pump()

    def wait(self) -> tuple[Any, Any]:
        t_give_up = time.perf_counter() + self.timeout_s
        while True:
            now = time.perf_counter()
            if now > t_give_up:
                raise TimeoutError(f"no graph server or tensor worker answered for {self.timeout_s:.0f} s")
            busy = [w for w, wk in enumerate(self.workers) if wk.task is not None]
            deadline = min([self.workers[w].deadline for w in busy], default=t_give_up)
            objs: list[Any] = [c for _, c in self.gs] + [p.sentinel for p, _ in self.gs]
            objs += [self.workers[w].conn for w in busy] + [self.workers[w].proc.sentinel for w in busy]
            wait_s = max(0.0, min(deadline, t_give_up) - now)
            if self.ray is not None and self.ray.busy():
                wait_s = min(wait_s, 0.002)  # Ray's refs cannot be waited on with the pipes: poll both
            ready = set(mp_wait(objs, timeout=wait_s))
            for p, (proc, conn) in enumerate(self.gs):
                if conn in ready:
                    tag, out = conn.recv()
                    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and out[0] == "error":
                        raise RuntimeError(f"graph server {p} failed: {out[1]}")
                    if isinstance(tag, tuple) and tag and tag[0] == "error":
                        raise RuntimeError(f"graph server {p} failed: {out}")
                    return tag, out
                if proc.sentinel in ready:
                    raise RuntimeError(f"graph server {p} exited (code {proc.exitcode})")
            if self.ray is not None and self.ray.busy():
                got = self.ray.poll()
                if got is not None:
                    return got
            for w in busy:
                wk = self.workers[w]
                if wk.conn in ready:
                    try:
                        tag, out = wk.conn.recv()
                    except (EOFError, OSError):
                        self._relaunch(w, "died")
                        continue
                    self.stats.tw_busy_s += time.perf_counter() - wk.t0
                    self.stats.bytes_from_tw += task_bytes(out)
                    wk.task = None
                    wk.deadline = float("inf")
                    self.idle.append(w)
                    self._pump()
                    return tag, out
                if wk.proc.sentinel in ready:
                    self._relaunch(w, "died")
                elif time.perf_counter() > wk.deadline:
                    self.stats.timeouts += 1
                    self._relaunch(w, f"timed out after {self.limits.task_timeout_s} s")

    def close(self) -> None:
        if self.ray is not None:
            self.ray.close()
        for proc, conn in self.gs:
            try:
                conn.send(None)
            except OSError:
                pass
        for wk in self.workers:
            try:
                wk.conn.send(None)
            except OSError:
                pass
        for proc in [p for p, _ in self.gs] + [wk.proc for wk in self.workers]:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def ray_tensor_task(specs, activation: str, limits: WorkerLimits, task: dict) -> dict:
    """One tensor task as a Ray task (the emulated latency and transfer included)."""
    if task.get("crash"):  # fault injection: the Ray worker process dies holding the task
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    if task.get("op") == "ping":
        return {"pong": True}
    if limits.hangs(task["id"], task["attempt"]):
        time.sleep(limits.task_timeout_s * 100)
    wait = limits.latency_s + limits.transfer_s(task_bytes(task))
    if wait:
        time.sleep(wait)
    out = run_tensor_task(specs, activation, task)
    t = limits.transfer_s(task_bytes(out))
    if t:
        time.sleep(t)
    return out


class RayTensorPool:
    """Tensor workers as Ray tasks (``worker_backend="ray"``): at most ``slots`` in flight, each a
    stateless task on whatever Ray worker process is free. Ray's own retries are off: a task whose
    worker dies (``ray.get`` raises) or that passes ``limits.task_timeout_s`` (cancelled with
    ``force=True``) is submitted again by us, attempt + 1, so a fault-injected task is not retried
    with its fault. Cold starts are Ray's real ones (``cold_start_s`` is not added)."""

    def __init__(self, slots: int, specs, activation: str, limits: WorkerLimits, stats: ExecutorStats,
                 address: str | None) -> None:
        from virtualflow.backends.ray import NORMAL_NICENESS, RayOptions, connect, import_ray

        self.ray = import_ray()
        connect(RayOptions(address=address))
        self.slots, self.limits, self.stats = slots, limits, stats
        self.fn = self.ray.remote(num_cpus=0, max_retries=0,
                                  runtime_env={"env_vars": dict(NORMAL_NICENESS)})(ray_tensor_task)
        self.specs_ref = self.ray.put(tuple(specs))
        self.activation = activation
        self.queue: collections.deque = collections.deque()
        self.inflight: dict[Any, tuple[Any, dict, float]] = {}

    def warm_up(self) -> None:
        refs = [self.fn.remote(self.specs_ref, self.activation, self.limits, {"op": "ping"}) for _ in range(self.slots)]
        self.ray.get(refs, timeout=120)

    def busy(self) -> bool:
        return bool(self.inflight or self.queue)

    def submit(self, tag: Any, task: dict) -> None:
        self.queue.append((tag, task))
        self._pump()

    def _pump(self) -> None:
        while self.queue and len(self.inflight) < self.slots:
            tag, task = self.queue.popleft()
            self.stats.tw_tasks += 1
            self.stats.bytes_to_tw += task_bytes(task)
            ref = self.fn.remote(self.specs_ref, self.activation, self.limits, task)
            self.inflight[ref] = (tag, task, time.perf_counter())

    def _retry(self, ref, why: str) -> None:
        tag, task, t0 = self.inflight.pop(ref)
        self.stats.tw_busy_s += time.perf_counter() - t0
        self.stats.relaunches += 1
        retry = dict(task, attempt=task["attempt"] + 1)
        retry.pop("crash", None)
        log.warning("ray tensor task %s %s (attempt %d); sent again", tag, why, task["attempt"])
        self.queue.appendleft((tag, retry))

    def poll(self) -> tuple[Any, Any] | None:
        ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=0)
        now = time.perf_counter()
        for ref in ready:
            try:
                out = self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the worker died or the task failed: send it again
                self._retry(ref, f"failed ({type(exc).__name__})")
                continue
            tag, task, t0 = self.inflight.pop(ref)
            self.stats.tw_busy_s += now - t0
            self.stats.bytes_from_tw += task_bytes(out)
            self._pump()
            return tag, out
        for ref, (tag, task, t0) in list(self.inflight.items()):
            if now - t0 > self.limits.task_timeout_s:
                self.ray.cancel(ref, force=True)
                self.stats.timeouts += 1
                self._retry(ref, f"timed out after {self.limits.task_timeout_s} s")
        self._pump()
        return None

    def close(self) -> None:
        for ref in list(self.inflight):
            self.ray.cancel(ref, force=True)
        self.inflight.clear()
