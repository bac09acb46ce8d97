"""The Ray backend: every worker is a Ray actor, placed by Ray on any node of a cluster.

Ray places and supervises the processes; torch.distributed (gloo/NCCL) stays the collective
engine, and the coordinator and membership controller are the same as on the local backend:
they see this backend only through ``start_worker`` / ``kill_worker`` / ``poll`` / ``pid``
(plus ``terminate_all`` and ``workers[id].log_tail()`` for the job handle). So a resize
creates or kills actors and the survivors carry on in place, and a failure is redone as a
step, exactly as on the local backend (Ray Train, by contrast, restarts the whole worker group
from a checkpoint).

Invariants:

* **One actor per worker, one process per actor.** The actor's resources are the job's
  (``cpus_per_worker``, ``gpus_per_worker``, custom resources such as an accelerator type, which
  pass through to Ray unchanged). Its ``run`` method is :func:`virtualflow.runtime.worker.run_worker`;
  the actor is never restarted by Ray (``max_restarts=0``): virtualflow decides what a loss means.
* **Exit codes as on the local backend.** ``run`` returning is the process exiting with that
  code (the actor is then killed to give its resources back); an actor that dies (``ray.kill``,
  a crash, its node lost) reads as killed by SIGKILL; an exception escaping ``run`` as code 1,
  with Ray's error appended to the worker's log.
* **A job that cannot get its workers says which resource is short.** Before anything starts,
  the request is checked against the resources of the cluster's live nodes (a resource nobody
  has, or more workers than the nodes can hold): :class:`WorkersUnavailable` at once. An actor
  that Ray has not placed after ``placement_timeout_s`` (the cluster is busy) is given up, with
  the resources that are short right now in the message; for a starting worker the job fails.
* **Same environment as a local worker.** ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` equal the
  thread budget, the allocator settings of the local backend, ``PYTHONPATH`` led by this
  checkout's ``src``; output goes to ``<state_dir>/logs/worker-<id>.log``. The run directory
  must be visible at the same path on every node (as Ray Train's ``storage_path`` on a
  multi-node cluster): workers write checkpoints, ``final.pt`` and their logs there, and a
  worker that does not see it fails at once with that in its error.

``ray`` is imported only inside this module's functions: without it, asking for the backend
raises :class:`RayNotInstalled` naming ``pip install virtualflow[ray]``.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from virtualflow.config.resources import parse_resources  # noqa: F401 - re-exported: its home before config/

if TYPE_CHECKING:  # the worker module imports torch: keep it out of the actor's start-up
    from virtualflow.backends.base import Attachment
    from virtualflow.runtime.worker import WorkerConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install virtualflow[ray]"
_MARKER = ".virtualflow-ray"


class RayNotInstalled(ImportError):
    """``backend="ray"`` was asked for but ``ray`` cannot be imported."""


class WorkersUnavailable(ValueError):
    """The Ray cluster cannot give the job the workers it asks for; the message names the
    resource that is short and the knob to change."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalled(
            f"backend='ray' needs the ray package, which cannot be imported here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    return ray


@dataclass(kw_only=True, slots=True)
class RayOptions:
    """Where and how the job's worker actors are placed."""

    address: str | None = None
    """Ray cluster to use: ``None`` (the one this process is connected to, ``RAY_ADDRESS``, or a
    new local instance), ``"auto"`` (the cluster running on this machine) or ``"HOST:PORT"``."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per worker actor (fractions allowed); also the default thread budget."""
    gpus_per_worker: float = 0.0
    """Ray GPUs per worker actor (then use ``device="cuda"``)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. ``{"accel_a100": 1}`` for an accelerator type."""
    per_worker: dict[int, dict[str, float]] = field(default_factory=dict)
    """Worker id -> custom resources that worker asks for on top of ``resources`` (from
    ``WorkerSpec.resources``: a heterogeneous job places each worker on its device type)."""
    placement_timeout_s: float = 60.0
    """An actor that Ray has not placed and started after this long is given up (the resources
    short are named); a starting worker then fails the job."""
    listen: tuple[str, int] | None = None
    """Where the coordinator's store listens and the workers reach it (``--listen ADDR[:PORT]``;
    port 0: any free one). None: Ray's address for the driver's node."""

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ValueError(f"address={self.address!r} must be 'auto' or 'HOST:PORT' (--address)")
        if isinstance(self.address, str) and self.address.startswith("ray://"):
            raise ValueError(
                f"address={self.address!r}: Ray Client (ray://) is not supported: the coordinator runs in this "
                f"process and the workers must reach it; run on a node of the cluster with address='auto' (--address auto)"
            )
        for name in ("cpus_per_worker", "gpus_per_worker"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0 (--{name.replace('_', '-')})")
        if not isinstance(self.resources, dict):
            raise ValueError(f"resources={self.resources!r} must be a dict of resource name -> amount (--resources)")
        for name, amount in self.resources.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"resources: {name!r} is not a resource name")
            if name in ("CPU", "GPU"):
                raise ValueError(f"resources={{{name!r}: ...}}: ask for {name}s with "
                                 f"{name.lower()}s_per_worker= (--{name.lower()}s-per-worker)")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not amount > 0:
                raise ValueError(f"resources[{name!r}]={amount!r} must be a number > 0 (--resources)")
        if not isinstance(self.placement_timeout_s, (int, float)) or not self.placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s={self.placement_timeout_s!r} must be a positive number of seconds")

    def demand(self, worker_id: int | None = None) -> dict[str, float]:
        """What one worker actor (``worker_id``'s, with its own extras) needs from a node
        (resources asked in zero amounts left out)."""
        extra = self.per_worker.get(worker_id, {}) if worker_id is not None else {}
        out = {"CPU": float(self.cpus_per_worker), "GPU": float(self.gpus_per_worker), **self.resources, **extra}
        return {k: float(v) for k, v in out.items() if v > 0}

    def default_threads(self) -> int:
        return max(1, int(self.cpus_per_worker))


NORMAL_NICENESS = {"RAY_worker_niceness": "0"}
"""Runtime-environment variables that start a Ray worker process at niceness 0. Ray starts its
worker processes at 15 (its ``worker_niceness``); a training worker is the job itself, and at 15
two other busy processes on its node left it about 5 % of a core (measured: 60 s later it was
still importing torch). The raylet honours this variable per worker (as for Ray's own job
supervisor), on every cluster and without privileges."""


def connect(options: RayOptions) -> str:
    """Make sure this process is a Ray driver; returns the address of this node that the
    workers will reach the coordinator on (Ray's node IP, never loopback unless Ray says so)."""
    ray = import_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": options.address, "logging_level": logging.WARNING}
        if options.address is None and not os.environ.get("RAY_ADDRESS"):
            kwargs["include_dashboard"] = False  # a new local instance: no dashboard to start
        ray.init(**kwargs)
    elif options.address is not None:
        logger.debug("already connected to a Ray cluster; address=%r is not used", options.address)
    return ray.util.get_node_ip_address()


def unreachable_store(host: str, node_addresses: Sequence[str], *, given: bool) -> str | None:
    """Why Ray nodes at ``node_addresses`` could not reach a store listening on ``host`` (None
    when they can, as far as addresses tell): a loopback address serves only its own machine."""
    loopback = _is_loopback(host)
    remote = sorted({a for a in node_addresses if a and not _is_loopback(a)})
    if not loopback or not remote:
        return None
    where = f"listen={host!r} (--listen)" if given else f"{host}, Ray's address for this node,"
    return (f"the coordinator's store would listen on {where} which the Ray node{'s' if len(remote) > 1 else ''} at "
            f"{', '.join(remote[:8])} cannot reach (a loopback address serves only this machine); give an address "
            f"of this machine they reach: --listen ADDR (listen='ADDR'), or start this node with `ray start "
            f"--node-ip-address ADDR`")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _fits(node_resources: dict[str, float], demand: dict[str, float]) -> int:
    """How many workers of ``demand`` one node can hold."""
    if not demand:
        return 1 << 30
    return min(int(math.floor(node_resources.get(r, 0.0) / d + 1e-9)) for r, d in demand.items())


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def check_capacity(options: RayOptions, workers: int, *, knob: str = "--workers") -> None:
    """Raise :class:`WorkersUnavailable` when the cluster's live nodes, empty, could not hold
    ``workers`` actors of ``options.demand()``; the message names the short resource."""
    ray = import_ray()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for wid in sorted(options.per_worker):
        # A worker with its own resources: some node must be able to hold it at all.
        demand_w = options.demand(wid)
        if wid < workers and not any(_fits(n, demand_w) for n in nodes):
            missing = [r for r in demand_w if max((n.get(r, 0.0) for n in nodes), default=0.0) + 1e-9 < demand_w[r]]
            what = f"resource {missing[0]!r} is short" if missing else "no node has them together"
            raise WorkersUnavailable(
                f"worker {wid} asks for {_fmt(demand_w)} (its WorkerSpec resources plus the job's) and {what} "
                f"on the Ray cluster; change that worker's WorkerSpec(resources=...) or add such a node"
            )
    demand = options.demand()
    per_worker = f"each worker asks for {_fmt(demand)} (--cpus-per-worker, --gpus-per-worker, --resources)"
    totals: dict[str, float] = {}
    for n in nodes:
        for r, v in n.items():
            totals[r] = totals.get(r, 0.0) + v
    for r, d in demand.items():
        best = max((n.get(r, 0.0) for n in nodes), default=0.0)
        if best + 1e-9 < d:
            have = (f"the most any node has is {best:g}" if best > 0 else "no node of the Ray cluster has it")
            custom = sorted(k for k in totals if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith("node:"))
            raise WorkersUnavailable(
                f"resource {r!r} is short: one worker needs {r}={d:g} and {have} "
                f"({len(nodes)} live node{'s' if len(nodes) != 1 else ''}; custom resources there: "
                f"{', '.join(custom) or 'none'}); {per_worker}: ask for less, or add nodes that have {r!r}"
            )
    capacity = sum(_fits(n, demand) for n in nodes)
    if capacity >= workers:
        return
    short = [r for r in demand if sum(_fits(n, {r: demand[r]}) for n in nodes) < workers]
    if short:
        r = short[0]
        detail = (f"resource {r!r} is short: {workers} workers need {workers * demand[r]:g} {r} "
                  f"({demand[r]:g} each) and the cluster has {totals.get(r, 0.0):g}")
    else:
        detail = (f"no node has the resources {_fmt(demand)} together for more than "
                  f"{capacity} worker{'s' if capacity != 1 else ''}")
    raise WorkersUnavailable(
        f"workers={workers} do not fit on the Ray cluster: {detail} ({capacity} fit); "
        f"{per_worker}: lower {knob} or the amount per worker, or add nodes"
    )


class _WorkerActor:
    """The body of a worker actor (wrapped with ``ray.remote`` by :class:`RayBackend`)."""

    def __init__(self, worker_id: int, log_path: str) -> None:
        self.worker_id = worker_id
        self.log_path = log_path
        # The actor owns its process: its output goes where a local worker's goes.
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return  # run() reports the missing run directory
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def info(self) -> tuple[int, str, str]:
        import ray

        ctx = ray.get_runtime_context()
        return os.getpid(), ctx.get_node_id(), ray.util.get_node_ip_address()

    def run(self, config: "WorkerConfig", marker: str) -> int:
        import sys

        if not os.path.isfile(marker):
            raise RuntimeError(
                f"the run directory {config.state_dir} is not visible on this node (pid {os.getpid()}); "
                f"the Ray backend needs it on a filesystem every node shares (give run_dir= / --run-dir there)"
            )
        from virtualflow.backends.inprocess import eager_every_wait_from_env
        from virtualflow.backends.local_worker import interface_from_environment, preemption_notice
        from virtualflow.runtime.worker import run_worker

        try:
            # A synchronous actor runs its methods on the process's main thread: SIGTERM to the
            # actor's process while it trains is a preemption notice, as for a local worker.
            # GLOO_SOCKET_IFNAME: the node's own (its `ray start` environment), not the driver's.
            return run_worker(interface_from_environment(config), self.worker_id, preemption_notice(),
                              eager_every_wait=eager_every_wait_from_env())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


@dataclass(slots=True)
class RayWorker:
    """One worker actor, as the job handle and the controller see it."""

    worker_id: int
    actor: Any
    log_path: str
    info_ref: Any
    run_ref: Any
    initial: bool
    started: float
    pid_: int | None = None
    node_id: str | None = None
    node_ip: str | None = None
    code: int | None = None
    info_failed: bool = False

    @property
    def pid(self) -> int | None:
        return self.pid_

    @property
    def placed(self) -> bool:
        """Ray created the actor (or gave up on it: then ``run_ref`` reports why)."""
        return self.pid_ is not None or self.info_failed

    def log_tail(self, lines: int = 15) -> str:
        from virtualflow.backends.local import log_tail  # not at the top: it imports torch

        return log_tail(self.log_path, lines)


class RayBackend:
    """One Ray actor per worker (see the module docstring)."""

    name = "ray"
    kind_of_worker = "Ray actors"

    def __init__(self, options: RayOptions) -> None:
        self._ray = import_ray()
        self.options = options
        self.workers: dict[int, RayWorker] = {}
        self.config: "WorkerConfig | None" = None
        self.state_dir = ""

    def store_address(self) -> tuple[str, int]:
        node_ip = connect(self.options)  # the node's address, which the other nodes reach
        host, port = self.options.listen or (node_ip, 0)
        nodes = [n.get("NodeManagerAddress", "") for n in self._ray.nodes() if n.get("Alive")]
        why = unreachable_store(host, nodes, given=self.options.listen is not None)
        if why is not None:
            raise ValueError(why)
        return host, port

    def default_threads(self, workers: int) -> int:
        return self.options.default_threads()

    def check_capacity(self, workers: int, *, knob: str = "--workers") -> None:
        connect(self.options)  # the cluster's resources are known once this process is its driver
        check_capacity(self.options, workers, knob=knob)

    def attach(self, attachment: "Attachment") -> None:
        self.config, self.state_dir = attachment.config, attachment.state_dir
        os.makedirs(os.path.join(self.state_dir, "logs"), exist_ok=True)
        self.marker = os.path.join(self.state_dir, _MARKER)
        with open(self.marker, "w") as f:
            f.write(uuid.uuid4().hex)
        self._config_ref = self._ray.put(self.config)
        self._actor_cls = self._ray.remote(_WorkerActor)

    def serve(self, reports: Sequence[dict[str, Any]]) -> None:
        return None

    def logs_where(self) -> str:
        return f"logs in {os.path.join(self.state_dir, 'logs')}"

    def log_tail(self, worker_id: int, lines: int = 15) -> str:
        w = self.workers.get(worker_id)
        return w.log_tail(lines) if w is not None else ""

    def _env(self) -> dict[str, str]:
        threads = str(self.config.threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        env.update(NORMAL_NICENESS)
        # As on the local backend: keep freed tensor memory in the process (a user's own setting wins).
        env["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
        env["MALLOC_TRIM_THRESHOLD_"] = os.environ.get("MALLOC_TRIM_THRESHOLD_", str(1024 * 1024 * 1024))
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        return env

    def start_worker(self, worker_id: int) -> RayWorker:
        if not self._ray.is_initialized():
            raise WorkersUnavailable(f"worker {worker_id} cannot be started: Ray was shut down in this process "
                                     "(ray.shutdown()) while the job ran")
        opts = self.options
        actor = self._actor_cls.options(
            num_cpus=opts.cpus_per_worker,
            num_gpus=opts.gpus_per_worker,
            resources={**opts.resources, **opts.per_worker.get(worker_id, {})},
            max_restarts=0,
            max_task_retries=0,
            runtime_env={"env_vars": self._env()},
        ).remote(worker_id, os.path.join(self.state_dir, "logs", f"worker-{worker_id}.log"))
        w = RayWorker(
            worker_id=worker_id,
            actor=actor,
            log_path=os.path.join(self.state_dir, "logs", f"worker-{worker_id}.log"),
            info_ref=actor.info.remote(),
            run_ref=actor.run.remote(self._config_ref, self.marker),
            initial=worker_id < self.config.initial_workers,
            started=time.monotonic(),
        )
        self.workers[worker_id] = w
        return w

    def kill_worker(self, worker_id: int) -> str:
        """Kill one worker's actor (fencing a hung one works: Ray kills the process)."""
        w = self.workers.get(worker_id)
        if w is not None and w.code is None and not self._left_ray():
            self._ray.kill(w.actor, no_restart=True)
        return "killed"

    def pid(self, worker_id: int) -> int | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        if not w.placed:
            self._resolve_info([w])
        return w.pid_

    def poll(self) -> dict[int, int | None]:
        """Exit code of every worker, None while it runs (see the module's docstring)."""
        ray = self._ray
        if self._left_ray():
            return {wid: w.code for wid, w in self.workers.items()}
        running = {w.run_ref: w for w in self.workers.values() if w.code is None}
        if running:
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=0, fetch_local=False)
            for ref in done:
                self._finished(running[ref])
        unplaced = [w for w in self.workers.values() if w.code is None and not w.placed]
        if unplaced:
            self._resolve_info(unplaced)
            now = time.monotonic()
            for w in unplaced:
                if not w.placed and w.code is None and now - w.started > self.options.placement_timeout_s:
                    self._give_up(w, now - w.started)
        return {wid: w.code for wid, w in self.workers.items()}

    def _left_ray(self) -> bool:
        """Whether this process has left Ray (``ray.shutdown()`` while the job ran); its actors
        died with it, and each running worker now reads as killed. No Ray call may follow: it
        would start or join an instance again (Ray's auto-init), and a cluster could then not be
        shut down while this driver holds it."""
        if self._ray.is_initialized():
            return False
        for w in self.workers.values():
            if w.code is None:
                w.code = -int(signal.SIGKILL)
                self._append_log(w, "virtualflow: Ray was shut down in this process while the worker ran")
        return True

    def _resolve_info(self, workers: list[RayWorker]) -> None:
        ray = self._ray
        if self._left_ray():
            return
        refs = {w.info_ref: w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0, fetch_local=True)
        for ref in ready:
            w = refs[ref]
            try:
                w.pid_, w.node_id, w.node_ip = ray.get(ref)
            except Exception:  # noqa: BLE001 - the actor died; poll() reports it through run_ref
                w.info_failed = True

    def _finished(self, w: RayWorker) -> None:
        ray = self._ray
        try:
            w.code = int(ray.get(w.run_ref))
        except ray.exceptions.RayActorError as exc:
            w.code = -int(signal.SIGKILL)
            self._append_log(w, f"virtualflow: Ray reports the worker's actor dead: {_first_lines(exc)}")
        except ray.exceptions.RayError as exc:
            w.code = 1
            self._append_log(w, f"virtualflow: the worker's actor failed: {_first_lines(exc, 20)}")
        # The process has exited as far as the job is concerned: give its resources back.
        try:
            ray.kill(w.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _give_up(self, w: RayWorker, waited_s: float) -> None:
        msg = (f"worker {w.worker_id} was not placed by Ray within {waited_s:.0f} s "
               f"(placement_timeout_s={self.options.placement_timeout_s:g}): {self.shortage()}")
        try:
            self._ray.kill(w.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        w.code = 1
        self._append_log(w, f"virtualflow: {msg}")
        if w.initial:
            raise WorkersUnavailable(msg + "; lower --workers or the resources per worker, or free or add nodes")
        logger.warning("%s; the newcomer is given up", msg)

    def shortage(self) -> str:
        """Which of one worker's resources the cluster has too few of free right now."""
        ray = self._ray
        demand = self.options.demand()
        try:
            free = ray.available_resources()
            total = ray.cluster_resources()
        except Exception as exc:  # noqa: BLE001
            return f"it needs {_fmt(demand)} (the cluster's resources could not be read: {exc})"
        short = [f"{r} (needs {d:g}, {free.get(r, 0.0):g} of {total.get(r, 0.0):g} free)"
                 for r, d in sorted(demand.items()) if free.get(r, 0.0) + 1e-9 < d]
        if short:
            return "short of " + ", ".join(short)
        return f"it needs {_fmt(demand)} on one node, and no node has that free together (or the node is slow to start it)"

    def terminate_all(self, grace_s: float = 3.0) -> None:
        ray = self._ray
        if self._left_ray():
            return
        alive = [w for w in self.workers.values() if w.code is None]
        for w in alive:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if not alive:
            return
        # Wait (bounded) until Ray has seen them die, so their resources are free for what comes next.
        refs = [w.run_ref for w in alive]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s, fetch_local=False)
        for w in alive:
            if w.run_ref in done:
                self._finished(w)
            else:
                w.code = -int(signal.SIGKILL)

    def _append_log(self, w: RayWorker, text: str) -> None:
        try:
            with open(w.log_path, "a") as f:
                f.write(text.rstrip() + "\n")
        except OSError:
            pass
        logger.debug("worker %d: %s", w.worker_id, text)


def _first_lines(exc: BaseException, n: int = 6) -> str:
    return "\n".join(str(exc).strip().splitlines()[:n])
