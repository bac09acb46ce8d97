"""Public entry points: :func:`train` (blocking), :func:`launch` (returns a :class:`JobHandle`).

Everything a user can get wrong is checked here, in the calling process, before any worker
starts: the arguments, the job (built once here, its dataset measured, its loss evaluated on
one virtual node's batch) and whether worker processes will be able to rebuild it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from virtualflow.backends.external import ExternalBackend, parse_address
from virtualflow.backends.local import LocalBackend
from virtualflow.backends.ray import RayBackend, RayOptions, WorkersUnavailable, check_capacity, connect
from virtualflow.control.autoscale import FixedPolicy, Limits, Policy, make_policy
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.control.coordinator import Coordinator
from virtualflow.job import Job, JobSource, source_from, resolve_spec
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment, describe_assignment
from virtualflow.comm import auth, protocol
from virtualflow.control.membership import JobFailed, MembershipController, check_resize
from virtualflow.runtime.checkpoint import CorruptCheckpointError, load_state
from virtualflow.plan.hetero import check_memory
from virtualflow.runtime.faults import FaultPlan
from virtualflow.spec import WorkerSpec
from virtualflow.runtime.engine import BatchLoader, check_loss
from virtualflow.runtime.worker import WorkerConfig

logger = logging.getLogger("virtualflow")

__all__ = ["train", "launch", "JobHandle", "Result", "TrainingError"]


class TrainingError(RuntimeError):
    """The job failed; the message names the worker, what happened and where the logs are."""


@dataclass(slots=True)
class Result:
    state_dict: dict[str, torch.Tensor]
    """Final model weights (CPU tensors)."""
    optimizer_state_dict: dict[str, Any]
    lr_scheduler_state_dict: dict[str, Any] | None
    history: list[dict[str, Any]]
    """One record per step: step (0-based), loss, samples, step_time_s, workers, generation,
    vns (the VN ids each worker ran)."""
    metrics: dict[str, float]
    """The last evaluation's metrics (empty without ``Job.evaluate``)."""
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str | None = None
    steps: int = 0
    """Steps completed."""
    stopped: bool = False
    """True when :meth:`JobHandle.stop` ended the job before ``steps``."""
    peak_rss_mib: dict[int, float] = field(default_factory=dict)
    """Peak resident memory of each worker process (worker id -> MiB)."""
    generations: int = 1
    """Membership generations the job went through (1: no resize, no failure)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Workers lost and survived: worker id, cause, generation."""
    autoscale: dict[str, Any] | None = None
    """With ``autoscale=``: the policy, its decisions, the measurement of every worker count
    tried and where it settled (None without autoscaling)."""


def _check_count(name: str, value: Any, knob: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; set {knob}")


def launch(
    job: Job | Callable[[], Job] | str,
    *,
    workers: int | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    deterministic: bool = False,
    run_dir: str | None = None,
    global_batch_size: int | None = None,
    virtual_nodes: int | None = None,
    seed: int | None = None,
    threads_per_worker: int | None = None,
    device: str = "cpu",
    collective_timeout_s: float = 120.0,
    progress: bool = False,
    backend: str = "local",
    min_workers: int = 1,
    replace_failed: bool = False,
    heartbeat_timeout_s: float = 3.0,
    min_workers_timeout_s: float = 60.0,
    checkpoint_every: int | None = None,
    resume: str | None = None,
    fault_plan: FaultPlan | None = None,
    worker_specs: list[WorkerSpec] | None = None,
    slowdowns: list[float] | None = None,
    balance: bool | None = None,
    uneven_vn_sizes: bool = False,
    autoscale: str | Policy | None = None,
    max_workers: int | None = None,
    price_per_worker_hour: float = 1.0,
    address: str | None = None,
    cpus_per_worker: float | None = None,
    gpus_per_worker: float | None = None,
    resources: dict[str, float] | None = None,
    placement_timeout_s: float | None = None,
    listen: str | None = None,
    token_file: str | None = None,
    _control_plane: bool = True,
) -> "JobHandle":
    """Start training ``job`` on ``workers`` worker processes (default 1, or ``min_workers``
    with ``autoscale``); returns at once.

    ``job`` is a :class:`Job`, an importable zero-argument function returning one, or a
    ``"module:function"`` / ``"file.py:function"`` string. Give exactly one of ``steps`` and
    ``epochs``. ``global_batch_size``, ``virtual_nodes`` and ``seed`` override the job's fields.
    ``deterministic=True`` makes the final weights bit-identical for any number of workers (at
    some cost in speed: per-VN gradients are summed along a fixed tree, one thread per worker
    unless ``threads_per_worker`` says otherwise).

    Elasticity: :meth:`JobHandle.resize` changes the worker count at the next step boundary; a
    worker that dies or stops responding (no heartbeat for ``heartbeat_timeout_s``) is removed
    and the survivors redo the interrupted step. Below ``min_workers`` the job holds (state
    checkpointed) for up to ``min_workers_timeout_s`` waiting for workers; ``replace_failed``
    starts a replacement for every lost worker. ``checkpoint_every`` writes
    ``checkpoints/step-N.pt`` (the last two kept); ``resume`` (a run directory or a checkpoint
    file) continues a job from its latest good checkpoint. ``fault_plan`` injects failures
    (tests; see :mod:`virtualflow.runtime.faults`).

    Heterogeneous workers: ``worker_specs`` (one :class:`WorkerSpec` per starting worker:
    memory limit, emulated ``slowdown``) or ``slowdowns`` (shorthand). ``balance`` (default: on
    when specs or slowdowns are given) maps VNs by measured speed with an exact solver and
    rebalances as speeds drift; B, V and the trained model do not change.
    ``uneven_vn_sizes=True`` also lets VN sizes differ per worker (a faster or larger worker
    gets bigger VNs; gradients stay exactly weighted by sample counts, but BatchNorm statistics
    and per-VN random streams then depend on the map, so runs match bit for bit only under the
    same map).

    Autoscaling: ``autoscale`` (a policy name, ``"NAME:PARAM=VALUE,..."``, or a
    :class:`virtualflow.control.autoscale.Policy` object; built-ins: ``efficiency``, ``utility``,
    ``straggler``, ``fixed``) grows and shrinks the job between ``min_workers`` and
    ``max_workers`` by trial and error while it trains, through the same in-place resizes;
    ``price_per_worker_hour`` prices a worker for the observations' cost rate (``utility``).
    Decisions and the throughput of every size tried go to ``events.jsonl`` and
    ``Result.autoscale``; B, V and the trained model do not change.

    Backends: ``"local"`` (worker processes on this machine) or ``"ray"``: every worker is a Ray
    actor with ``cpus_per_worker`` (default 1), ``gpus_per_worker`` and custom ``resources``
    (e.g. ``{"accel_a100": 1}``), on the cluster at ``address`` (``"auto"``, ``"HOST:PORT"``;
    default: the one this process is connected to, or a new local instance). Resizes and
    failures are handled in place as on the local backend. A request the cluster cannot hold
    raises :class:`virtualflow.backends.ray.WorkersUnavailable` naming the short resource; a
    starting worker Ray has not placed within ``placement_timeout_s`` (default 60) fails the
    job. The run directory must be on a filesystem every node sees. Needs
    ``pip install virtualflow[ray]``.

    ``"external"``: workers started elsewhere join by address. The coordinator's store listens on
    ``listen`` (``"ADDR:PORT"``) and waits for ``workers`` workers to run
    ``virtualflow worker --join ADDR:PORT --token-file FILE``; a later join grows the job in place,
    a worker that exits or stops beating is a failure as on the other backends. The run
    directory must be on a filesystem the workers see at the same path.

    Control requests from outside this process (joins, ``virtualflow resize``) must be signed
    with the job's token (HMAC-SHA256, :mod:`virtualflow.comm.auth`): the contents of
    ``token_file``, or a new random token written to ``<run_dir>/token`` (mode 0600) for every
    backend. Unsigned or wrongly signed requests are ignored and logged.
    """
    if backend == "external":
        if listen is None:
            raise ValueError("backend='external' needs listen='ADDR:PORT' (--listen), the address workers join")
        listen_addr = parse_address(listen)
    elif listen is not None:
        raise ValueError(f"listen={listen!r} only applies to backend='external'; add backend='external' "
                         f"(--backend external) or drop it")
    token = auth.read_token(token_file) if token_file is not None else None
    ray_options = _backend_options(backend, address=address, cpus_per_worker=cpus_per_worker,
                                   gpus_per_worker=gpus_per_worker, resources=resources,
                                   placement_timeout_s=placement_timeout_s)
    policy = None
    if autoscale is not None:
        policy = make_policy(autoscale)
        if max_workers is None and not isinstance(policy, FixedPolicy):
            raise ValueError(
                f"autoscale={getattr(policy, 'name', autoscale)!r} needs max_workers= (--max-workers): the largest "
                f"worker count it may try (at most virtual_nodes)"
            )
    elif max_workers is not None:
        raise ValueError(f"max_workers={max_workers!r} bounds the autoscaler; give autoscale= (--autoscale POLICY) "
                         f"too, or drop max_workers")
    if workers is None:
        workers = min_workers if policy is not None else 1
    _check_count("workers", workers, "workers= (--workers) to 1 or more")
    if (steps is None) == (epochs is None):
        raise ValueError(
            f"give exactly one of steps and epochs (got steps={steps!r}, epochs={epochs!r}); "
            f"e.g. steps=100 (--steps 100) or epochs=3 (--epochs 3)"
        )
    if steps is not None:
        _check_count("steps", steps, "steps= (--steps)")
    if epochs is not None:
        _check_count("epochs", epochs, "epochs= (--epochs)")
    if threads_per_worker is not None:
        _check_count("threads_per_worker", threads_per_worker, "threads_per_worker=")
    _check_count("min_workers", min_workers, "min_workers= (--min-workers)")
    if min_workers > workers:
        raise ValueError(
            f"min_workers={min_workers} is greater than the starting workers={workers}; the job could "
            f"never start: lower min_workers (--min-workers) or start more workers (--workers)"
        )
    if checkpoint_every is not None:
        _check_count("checkpoint_every", checkpoint_every, "checkpoint_every= (--checkpoint-every)")
    for name, value in (("heartbeat_timeout_s", heartbeat_timeout_s), ("min_workers_timeout_s", min_workers_timeout_s)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    if slowdowns is not None:
        if worker_specs is not None:
            raise ValueError("give worker_specs or slowdowns, not both (slowdowns is a shorthand)")
        if len(slowdowns) != workers:
            raise ValueError(f"slowdowns has {len(slowdowns)} values for workers={workers}; give one per worker")
        worker_specs = [WorkerSpec(slowdown=float(x)) for x in slowdowns]
    if worker_specs is not None and len(worker_specs) != workers:
        raise ValueError(f"worker_specs has {len(worker_specs)} entries for workers={workers}; give one per worker")
    per_worker = {i: dict(s.resources) for i, s in enumerate(worker_specs or []) if s.resources}
    if per_worker:
        if ray_options is None:
            raise ValueError(f"WorkerSpec resources (given for worker{'s' if len(per_worker) > 1 else ''} "
                             f"{', '.join(map(str, sorted(per_worker)))}) only apply to backend='ray'; add "
                             f"backend='ray' (--backend ray) or drop them")
        ray_options.per_worker = per_worker
    if balance is None:
        balance = worker_specs is not None or uneven_vn_sizes
    if uneven_vn_sizes and not balance:
        raise ValueError("uneven_vn_sizes=True needs balance (speed-based mapping); drop balance=False")
    limits = None
    if policy is not None:
        limits = Limits(min_workers, max_workers if max_workers is not None else workers)
        if not limits.min_workers <= workers <= limits.max_workers:
            raise ValueError(
                f"the starting workers={workers} is outside [min_workers={limits.min_workers}, "
                f"max_workers={limits.max_workers}]; start inside the autoscaler's range (--workers)"
            )
        if not (isinstance(price_per_worker_hour, (int, float)) and math.isfinite(price_per_worker_hour)
                and price_per_worker_hour > 0):
            raise ValueError(f"price_per_worker_hour={price_per_worker_hour!r} must be a positive number")
    if fault_plan is not None and not isinstance(fault_plan, FaultPlan):
        raise TypeError(f"fault_plan must be a virtualflow.FaultPlan, got {type(fault_plan).__name__}")

    source = source_from(job)
    if isinstance(job, Job):
        job_obj = job
    else:
        fn = resolve_spec(source.target)
        job_obj = fn()
        if not isinstance(job_obj, Job):
            raise TypeError(f"the job function {source.target!r} returned {type(job_obj).__name__}, not virtualflow.Job")
    overrides = {
        k: v
        for k, v in dict(global_batch_size=global_batch_size, virtual_nodes=virtual_nodes, seed=seed).items()
        if v is not None
    }
    job_obj = job_obj.replace(**overrides)
    dataset = job_obj.build_dataset()
    plan = DataPlan(len(dataset), job_obj.global_batch_size, job_obj.virtual_nodes, job_obj.seed)
    assignment = contiguous_assignment(job_obj.virtual_nodes, workers)
    total_steps = steps if steps is not None else epochs * plan.steps_per_epoch
    _preflight(job_obj, dataset, plan)
    if limits is not None and limits.max_workers > job_obj.virtual_nodes:
        raise ValueError(
            f"max_workers={limits.max_workers} is more than virtual_nodes={job_obj.virtual_nodes}: every worker "
            f"needs at least one virtual node; lower --max-workers or raise --virtual-nodes"
        )
    if worker_specs is not None:
        check_memory(job_obj.global_batch_size // job_obj.virtual_nodes, [s.memory_limit for s in worker_specs])
    store_host, store_port = "127.0.0.1", 0  # local: loopback only
    if backend == "external":
        store_host, store_port = listen_addr
    if ray_options is not None:
        store_host = connect(ray_options)  # the node's address, which the other nodes reach
        check_capacity(ray_options, workers)
        if limits is not None and limits.max_workers > workers:
            check_capacity(ray_options, limits.max_workers, knob="--max-workers")
    resume_path, resume_step = None, 0
    if resume is not None:
        resume_path, resume_step = find_resume_state(resume, job_obj)
        if resume_step >= total_steps:
            raise ValueError(
                f"the checkpoint {resume_path} is at step {resume_step}, which already reaches steps={total_steps}; "
                f"ask for more steps (--steps/--epochs) to continue training"
            )
        if run_dir is None and os.path.isdir(resume):
            run_dir = resume

    own_state_dir = run_dir is None
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        stale = ["summary.json", "final.pt", "final.pt.sha256", "status.json"]
        if resume is None:
            stale += ["events.jsonl", "metrics.jsonl"]
        for name in stale:
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
        state_dir = run_dir
    else:
        state_dir = tempfile.mkdtemp(prefix="virtualflow-")
    if token is None:
        token_path = os.path.join(state_dir, "token")
        token = auth.new_token()
        auth.write_token(token_path, token)
    else:
        token_path = os.path.abspath(token_file)
    if threads_per_worker is None:
        if deterministic:
            threads_per_worker = 1
        elif ray_options is not None:
            threads_per_worker = ray_options.default_threads()
        else:
            threads_per_worker = max(1, (os.cpu_count() or 1) // workers)

    handle = JobHandle(
        job=job_obj,
        source=source,
        overrides=overrides,
        workers=workers,
        assignment=assignment,
        total_steps=total_steps,
        deterministic=deterministic,
        run_dir=run_dir,
        state_dir=state_dir,
        own_state_dir=own_state_dir,
        threads=threads_per_worker,
        device=device,
        collective_timeout_s=collective_timeout_s,
        progress=progress,
        steps_per_epoch=plan.steps_per_epoch,
        min_workers=min_workers,
        replace_failed=replace_failed,
        heartbeat_timeout_s=heartbeat_timeout_s,
        min_workers_timeout_s=min_workers_timeout_s,
        checkpoint_every=checkpoint_every,
        resume_path=resume_path,
        resume_step=resume_step,
        fault_plan=fault_plan,
        worker_specs=worker_specs,
        balance=balance,
        uneven_vn_sizes=uneven_vn_sizes,
        autoscale=policy,
        autoscale_limits=limits,
        price_per_worker_hour=float(price_per_worker_hour),
        ray_options=ray_options,
        store_host=store_host,
        store_port=store_port,
        external=backend == "external",
        token=token,
        token_path=token_path,
    )
    if not _control_plane:  # benchmarks only: measure what heartbeats and control reads cost
        handle._config.control_plane = False
        handle.backend = _make_backend(handle._config, state_dir, ray_options)
        handle.controller.launcher = handle.backend
        handle.controller.heartbeat_timeout_s = float("inf")
    handle._start()
    return handle


def _backend_options(backend: str, **ray_kwargs: Any) -> RayOptions | None:
    """``None`` for the local backend (which takes none of the Ray options), else the
    validated :class:`RayOptions`."""
    if backend not in ("local", "ray", "external"):
        raise ValueError(f"backend={backend!r} is not available; choose 'local' (this machine), 'ray' or "
                         f"'external' (workers join by address) (--backend)")
    given = {k: v for k, v in ray_kwargs.items() if v is not None}
    if backend in ("local", "external"):
        if given:
            names = ", ".join(f"{k}=" for k in given)
            raise ValueError(f"{names} only apply to backend='ray'; add backend='ray' (--backend ray) or drop them")
        return None
    return RayOptions(**given)


def _make_backend(config: WorkerConfig, state_dir: str, ray_options: RayOptions | None) -> LocalBackend | RayBackend:
    if ray_options is None:
        return LocalBackend(config, state_dir)
    return RayBackend(config, state_dir, ray_options)


def find_resume_state(resume: str, job: Job) -> tuple[str, int]:
    """The newest good state file under ``resume`` (a run directory or a state file) that belongs
    to ``job``; corrupt or truncated files are reported and skipped."""
    if os.path.isdir(resume):
        folder = os.path.join(resume, "checkpoints")
        names = sorted(f for f in os.listdir(folder) if f.startswith("step-") and f.endswith(".pt")) if os.path.isdir(folder) else []
        candidates = [os.path.join(folder, f) for f in reversed(names)]
        if not candidates:
            raise ValueError(
                f"resume={resume!r}: no checkpoints in {folder}; a run writes them with "
                f"checkpoint_every= (--checkpoint-every N)"
            )
    elif os.path.isfile(resume):
        candidates = [resume]
    else:
        raise ValueError(f"resume={resume!r} is neither a run directory nor a checkpoint file")
    problems = []
    for path in candidates:
        try:
            state = load_state(path)
        except CorruptCheckpointError as exc:
            logger.warning("skipping %s: %s", path, exc)
            problems.append(str(exc))
            continue
        _check_same_job(path, state, job)
        if problems:
            logger.warning("resuming from %s, the newest good checkpoint", path)
        return path, int(state["step"])
    raise ValueError(f"resume={resume!r}: no readable checkpoint ({'; '.join(problems)})")


def _check_same_job(path: str, state: dict[str, Any], job: Job) -> None:
    saved = state.get("job", {})
    for key in ("global_batch_size", "virtual_nodes", "seed"):
        if saved.get(key) != getattr(job, key):
            raise ValueError(
                f"the checkpoint {path} is from a different job: its {key}={saved.get(key)!r}, the job's is "
                f"{getattr(job, key)!r}. Resume with the same {key} (--{key.replace('_', '-')}), or start a new run"
            )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        expected = {k: tuple(v.shape) for k, v in job.model().state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state["model"].items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(
            f"the checkpoint {path} holds a different model than the job's (first differences: {diff}); "
            f"resume it with the job that wrote it"
        )


def train(job: Job | Callable[[], Job] | str, **options: Any) -> Result:
    """Train ``job`` and block until it ends; same arguments as :func:`launch`."""
    handle = launch(job, **options)
    try:
        return handle.wait()
    except KeyboardInterrupt:
        handle.kill()
        raise


def _preflight(job: Job, dataset: Any, plan: DataPlan) -> None:
    """Build the model and run the loss on VN 0's batch of step 0, here, before any worker."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        model = job.model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Job.model must return a torch.nn.Module, got {type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to train")
        job.optimizer(model.parameters())
        batch = BatchLoader(dataset, job.collate_fn)(plan.vn_indices(0, 0))
        model.train()
        with torch.no_grad():
            loss = job.loss(model, batch)
        check_loss(loss, "on virtual node 0's batch of step 0")


class JobHandle:
    """A running job: ``status()``, ``resize()``, ``wait()``, ``stop()``, ``kill()``."""

    def __init__(self, *, job: Job, source: JobSource, overrides: dict, workers: int, assignment, total_steps: int,
                 deterministic: bool, run_dir: str | None, state_dir: str, own_state_dir: bool, threads: int,
                 device: str, collective_timeout_s: float, progress: bool, steps_per_epoch: int,
                 min_workers: int = 1, replace_failed: bool = False, heartbeat_timeout_s: float = 3.0,
                 min_workers_timeout_s: float = 60.0, checkpoint_every: int | None = None,
                 resume_path: str | None = None, resume_step: int = 0, fault_plan: FaultPlan | None = None,
                 worker_specs: list[WorkerSpec] | None = None, balance: bool = False,
                 uneven_vn_sizes: bool = False, autoscale: Policy | None = None,
                 autoscale_limits: Limits | None = None, price_per_worker_hour: float = 1.0,
                 ray_options: RayOptions | None = None, store_host: str = "127.0.0.1", store_port: int = 0,
                 external: bool = False, token: str | None = None, token_path: str | None = None) -> None:
        self.job = job
        self.run_dir = run_dir
        self._state_dir = state_dir
        self._own_state_dir = own_state_dir
        self._workers = workers
        self._assignment = assignment
        self.total_steps = total_steps
        self._deterministic = deterministic
        self._progress = progress
        self._bar = None
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._t0 = time.time()
        self._steps_per_epoch = steps_per_epoch
        self._min_workers = min_workers
        self._resume_path = resume_path
        self._resume_step = resume_step
        self._requests: deque[int] = deque()
        self._taken_requests: list[str] = []
        self._status_written = 0.0
        self._ray_options = ray_options
        self._external = external
        self._backend_name = "external" if external else ("ray" if ray_options is not None else "local")
        self._token = token or auth.new_token()
        self._token_path = token_path
        self._replay = auth.ReplayGuard()
        self.coordinator = Coordinator(total_steps=total_steps, run_dir=run_dir, host=store_host, port=store_port,
                                       on_step=self._on_step)
        self.coordinator.progress.step = resume_step
        self._config = WorkerConfig(
            store_host=self.coordinator.host,
            store_port=self.coordinator.port,
            job_source=source,
            total_steps=total_steps,
            state_dir=state_dir,
            overrides=overrides,
            deterministic=deterministic,
            threads=threads,
            device=device,
            collective_timeout_s=collective_timeout_s,
            checkpoint_every=checkpoint_every,
            resume_path=resume_path,
            initial_workers=workers,
            fault_plan=fault_plan,
            slowdowns={i: s.slowdown for i, s in enumerate(worker_specs or []) if s.slowdown != 1.0},
        )
        if external:
            self.backend = ExternalBackend(self._config, self.coordinator.store, self._token,
                                           grow=self._grow_for_join, event=self.coordinator.event)
        else:
            self.backend = _make_backend(self._config, state_dir, ray_options)
        self.controller = MembershipController(
            self.coordinator,
            self.backend,
            virtual_nodes=job.virtual_nodes,
            workers=workers,
            min_workers=min_workers,
            heartbeat_timeout_s=heartbeat_timeout_s,
            replace_failed=replace_failed,
            min_workers_timeout_s=min_workers_timeout_s,
            balance=balance,
            vn_batch=job.global_batch_size // job.virtual_nodes,
            memory_limits={i: s.memory_limit for i, s in enumerate(worker_specs or [])},
            uneven_vn_sizes=uneven_vn_sizes,
            global_batch_size=job.global_batch_size,
        )
        self.controller.last_step = resume_step
        self.autoscaler: AutoscaleExecutor | None = None
        if autoscale is not None:
            assert autoscale_limits is not None
            self.autoscaler = AutoscaleExecutor(
                autoscale, self.controller, self.coordinator, limits=autoscale_limits,
                global_batch_size=job.global_batch_size, virtual_nodes=job.virtual_nodes, total_steps=total_steps,
                price_per_worker_hour=price_per_worker_hour, start_time=self._t0,
            )

    # -- lifecycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        job, V = self.job, self.job.virtual_nodes
        msg = (
            f"{job.name}: global batch {job.global_batch_size} = {V} virtual nodes x "
            f"{job.global_batch_size // V}; {self.total_steps} steps ({self._steps_per_epoch} per epoch) "
            f"on {self._workers} worker{'s' if self._workers > 1 else ''}{' (Ray actors)' if self._ray_options else ''} "
            f"({self._config.threads} thread{'s' if self._config.threads > 1 else ''} each"
            f"{', deterministic' if self._deterministic else ''}); {describe_assignment(self._assignment)}"
        )
        if self._resume_path:
            msg += f"; resuming from {self._resume_path} (step {self._resume_step})"
        logger.info(msg)
        if self._external:
            logger.info("waiting for %d worker%s to join %s:%d; on each machine run: virtualflow worker --join "
                        "%s:%d --token-file FILE (the job's token is in %s; copy it there, mode 0600)",
                        self._workers, "s" if self._workers > 1 else "", self.coordinator.host, self.coordinator.port,
                        self.coordinator.host, self.coordinator.port, self._token_path)
        else:
            logger.info("control requests (virtualflow resize) are signed with the token in %s", self._token_path)
        self.coordinator.event(
            "start",
            job=job.name,
            global_batch_size=job.global_batch_size,
            virtual_nodes=V,
            seed=job.seed,
            workers=self._workers,
            total_steps=self.total_steps,
            deterministic=self._deterministic,
            backend=self._backend_name,
            threads_per_worker=self._config.threads,
            min_workers=self._min_workers,
            resume_path=self._resume_path,
            resume_step=self._resume_step,
            autoscale=self._autoscale_info(),
        )
        if self.autoscaler is not None:
            a = self.autoscaler
            logger.info("autoscale: policy %s between %d and %d workers (%s)", a.policy.name, a.limits.min_workers,
                        a.limits.max_workers, a.policy)
        self.controller.start()
        if self._progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self._resume_step, desc=job.name, unit="step",
                             dynamic_ncols=True)
        self._write_status(force=True)
        self._thread = threading.Thread(target=self._monitor, name="virtualflow-monitor", daemon=True)
        self._thread.start()

    def _on_step(self, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(1)
            sps = record["samples"] / record["step_time_s"] if record["step_time_s"] > 0 else float("nan")
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{sps:.0f}", workers=record["workers"])

    def _monitor(self) -> None:
        coord, progress, ctl = self.coordinator, self.coordinator.progress, self.controller
        try:
            while True:
                reports = coord.poll()
                if progress.errors:
                    time.sleep(0.3)  # let the other workers' reports arrive: pick the root cause
                    coord.poll()
                    raise TrainingError(self._failure_message(self.backend.poll()))
                serve = getattr(self.backend, "serve", None)
                if serve is not None:  # external workers: answer joins, note exits
                    serve(reports)
                self._take_requests()
                try:
                    ctl.tick(reports)
                except JobFailed as exc:
                    raise TrainingError(self._job_failed_message(exc)) from None
                except WorkersUnavailable as exc:
                    raise TrainingError(f"{exc} (logs in {os.path.join(self._state_dir, 'logs')})") from None
                if self.autoscaler is not None:
                    self.autoscaler.update(reports)
                if progress.state == "starting" and progress.step > self._resume_step:
                    progress.state = "running"
                if progress.done:
                    codes = self.backend.poll()
                    if all(codes.get(w) is not None for w in ctl.members):
                        coord.poll()
                        self.backend.terminate_all()  # newcomers still starting, if any
                        self._result = self._collect()
                        progress.state = "stopped" if self._result.stopped else "done"
                        coord.event("done", steps=self._result.steps, stopped=self._result.stopped,
                                    wall_time_s=time.time() - self._t0, generations=ctl.generation + 1,
                                    failures=len(ctl.failures))
                        return
                self._write_status()
                # The launcher must not take CPU from the workers; it looks closer during changes.
                time.sleep(0.01 if ctl.busy else 0.05)
        except BaseException as exc:  # noqa: BLE001 - reported through wait()
            self._error = exc
            progress.state = "failed"
            self.backend.terminate_all()
            coord.event("failed", error=str(exc))
        finally:
            if self._bar is not None:
                self._bar.close()
            self._write_summary()
            self._write_status(force=True)
            coord.close()
            if self._own_state_dir and self._error is None:
                shutil.rmtree(self._state_dir, ignore_errors=True)
            self._finished.set()

    def _take_requests(self) -> None:
        """Resize requests from this process (:meth:`resize`) and from outside (``virtualflow
        resize`` pushes to the store's request queue). Those from outside count only when signed
        with the job's token (the store has no authentication): others are ignored and logged."""
        while self._requests:
            self.controller.request_resize(self._requests.popleft(), source="api")
        for message in protocol.pop_reports(self.coordinator.store, queue=protocol.REQUESTS_QUEUE):
            try:
                req = auth.verify(self._token, message, guard=self._replay)
            except auth.AuthError as exc:
                shown = message if len(json.dumps(message)) < 500 else "(a long message)"
                logger.warning("ignored a control request that is not signed with the job's token: %s (%s)", exc, shown)
                self.coordinator.event("request_rejected", request=shown, error=str(exc), auth=False)
                continue
            try:
                if req.get("op") != "resize":
                    raise ValueError(f"unknown request op={req.get('op')!r}")
                self._check_room(req.get("workers"))
                self.controller.request_resize(req.get("workers"), source=req.get("source", "cli"))
                # ``virtualflow resize --wait`` looks for its nonce here: only a status written
                # after its request was taken tells whether the request has been carried out.
                self._taken_requests = (self._taken_requests + [req["nonce"]])[-20:]
                self._write_status(force=True)
            except ValueError as exc:
                logger.warning("rejected request %s: %s", req, exc)
                self.coordinator.event("request_rejected", request=req, error=str(exc))

    def _grow_for_join(self) -> str | None:
        """An external worker asked to join and no slot is open: grow the job by one through
        the ordinary resize path. Returns why not, or None."""
        ctl = self.controller
        want = max(ctl.target, len(ctl.members)) + 1
        if want > self.job.virtual_nodes:
            return (f"the job already has {want - 1} workers for virtual_nodes={self.job.virtual_nodes}; every worker "
                    f"needs at least one virtual node")
        try:
            ctl.request_resize(max(want, self._min_workers), source="join")
        except ValueError as exc:
            return str(exc)
        return None

    def _check_room(self, workers: Any) -> None:
        """On Ray, refuse a resize the cluster's nodes could never hold (names the short resource)."""
        if self._ray_options is not None and isinstance(workers, int) and not isinstance(workers, bool):
            check_capacity(self._ray_options, workers)

    def _job_failed_message(self, exc: JobFailed) -> str:
        where = f"logs in {os.path.join(self._state_dir, 'logs')}"
        msg = f"{exc} ({where})"
        if self.controller.failures:
            wid = self.controller.failures[-1]["worker"]
            wp = self.backend.workers.get(wid)
            tail = wp.log_tail().strip() if wp is not None else ""
            if tail:
                msg += f"; worker {wid}'s last output:\n{tail}"
        return msg

    def _failure_message(self, codes: dict[int, int | None]) -> str:
        errors = self.coordinator.progress.errors
        # Prefer the root cause: an error that is not a peer's connection dropping.
        consequential = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timeout")
        primary = next((e for e in errors if not any(s in e["error"] for s in consequential)), None)
        where = f"logs in {os.path.join(self._state_dir, 'logs')}"
        if primary is not None:
            return f"worker {primary['worker']} (pid {primary['pid']}) failed: {primary['error']} ({where})"
        e = errors[0]
        return f"worker {e['worker']} (pid {e['pid']}) failed: {e['error']} ({where})"

    def _collect(self) -> Result:
        state = load_state(os.path.join(self._state_dir, "final.pt"))
        steps = int(state["step"])
        return Result(
            state_dict=state["model"],
            optimizer_state_dict=state["optimizer"],
            lr_scheduler_state_dict=state["lr_scheduler"],
            history=list(self.coordinator.history),
            metrics=dict(self.coordinator.progress.metrics),
            eval_history=list(self.coordinator.eval_history),
            run_dir=self.run_dir,
            steps=steps,
            stopped=steps < self.total_steps,
            peak_rss_mib={w: i["peak_rss_mib"] for w, i in self.coordinator.progress.workers.items() if "peak_rss_mib" in i},
            generations=self.controller.generation + 1,
            failures=list(self.controller.failures),
            autoscale=self.autoscaler.summary() if self.autoscaler is not None else None,
        )

    def _write_summary(self) -> None:
        if self.run_dir is None:
            return
        history = self.coordinator.history
        times = [h["step_time_s"] for h in history[1:]] or [h["step_time_s"] for h in history]
        mean_step = sum(times) / len(times) if times else None
        summary = {
            "job": self.job.name,
            "status": self.coordinator.progress.state,
            "error": str(self._error) if self._error else None,
            "global_batch_size": self.job.global_batch_size,
            "virtual_nodes": self.job.virtual_nodes,
            "seed": self.job.seed,
            "workers": self._workers,
            "workers_final": len(self.controller.members),
            "assignment": self._assignment,
            "generations": self.controller.generation + 1,
            "failures": self.controller.failures,
            "final_map": [{"worker": w, "vns": a, "time_per_vn_s": self.controller.time_per_vn.get(w)}
                          for w, a in zip(self.controller.members, self.controller.assignment)],
            "vn_sizes": self.controller.vn_sizes,
            "balance": self.controller.balance,
            "autoscale": self.autoscaler.summary() if self.autoscaler is not None else None,
            "predicted_step_s": self.controller.predicted_step_s,
            "deterministic": self._deterministic,
            "backend": self._backend_name,
            "threads_per_worker": self._config.threads,
            "steps_total": self.total_steps,
            "steps_completed": self.coordinator.progress.step,
            "resumed_from": self._resume_path,
            "final_loss": history[-1]["loss"] if history else None,
            "metrics": self.coordinator.progress.metrics,
            "mean_step_time_s": mean_step,
            "samples_per_s": self.job.global_batch_size / mean_step if mean_step else None,
            "wall_time_s": time.time() - self._t0,
            "peak_rss_mib": {str(w): i.get("peak_rss_mib") for w, i in self.coordinator.progress.workers.items()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "virtualflow": _version()},
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()},
        }
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)

    def _write_status(self, force: bool = False) -> None:
        """``status.json`` in the run directory: what ``virtualflow status`` prints, and how
        ``virtualflow resize`` reaches the coordinator (loopback host, port, pid)."""
        if self.run_dir is None:
            return
        now = time.monotonic()
        if not force and now - self._status_written < 0.5:
            return
        self._status_written = now
        data = self.status()
        data.update(
            job=self.job.name,
            virtual_nodes=self.job.virtual_nodes,
            min_workers=self._min_workers,
            coordinator={"host": self.coordinator.host, "port": self.coordinator.port, "pid": os.getpid(),
                         "token_file": self._token_path},
            backend=self._backend_name,
            taken_requests=list(self._taken_requests),
            updated=time.time(),
        )
        tmp = os.path.join(self.run_dir, f".status.json.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, os.path.join(self.run_dir, "status.json"))

    # -- public ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        p, ctl = self.coordinator.progress, self.controller
        return {
            "state": p.state,
            "step": p.step,
            "total_steps": p.total_steps,
            "generation": ctl.generation,
            "formed_generation": ctl.formed,
            "balance": ctl.balance,
            "predicted_step_s": ctl.predicted_step_s,
            "measured_step_s": ctl.measured_step_s,
            "target_workers": ctl.target,
            "workers": ctl.worker_table(),
            "recent_step_times_s": [round(h["step_time_s"], 6) for h in self.coordinator.history[-10:]],
            "loss": p.last_loss,
            "samples_per_s": p.samples_per_s,
            "metrics": dict(p.metrics),
            "failures": len(ctl.failures),
            "run_dir": self.run_dir,
            "autoscale": self._autoscale_info(),
        }

    def _autoscale_info(self) -> dict[str, Any] | None:
        a = self.autoscaler
        if a is None:
            return None
        last = a.decisions[-1] if a.decisions else None
        return {"policy": a.policy.name, "min_workers": a.limits.min_workers, "max_workers": a.limits.max_workers,
                "settled_at": a.settled_at, "decisions": len(a.decisions),
                "last_decision": last["reason"] if last else None, "disabled": a.disabled}

    def resize(self, workers: int, *, wait: bool = False, timeout_s: float = 120.0) -> None:
        """Change the number of workers; it takes effect at a step boundary, without a restart.

        Growing starts new workers, which build the job before they join (training goes on
        meanwhile) and receive the full state from a survivor; shrinking lets the highest ranks
        leave. ``B``, ``V`` and the trained model are unchanged. With ``wait=True``, block until
        a generation with ``workers`` members has formed.
        """
        if self._finished.is_set():
            raise RuntimeError(f"the job has {self.coordinator.progress.state}; it cannot be resized")
        check_resize(workers, self.job.virtual_nodes, self._min_workers)
        self._check_room(workers)
        self._requests.append(workers)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            ctl = self.controller
            if not self._requests and not ctl.busy and ctl.target == workers and len(ctl.members) == workers:
                return
            if self._finished.is_set():
                if self._error is not None:
                    raise self._error
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"resize to {workers} workers not done after {timeout_s} s "
                                   f"(generation {ctl.generation}, {len(ctl.members)} members)")
            time.sleep(0.02)

    def set_slowdown(self, worker: int, factor: float) -> None:
        """Emulation: make worker ``worker`` ``factor`` times slower from the next step boundary
        (a straggler appears; with balance on, the mapper notices and rebalances)."""
        WorkerSpec(slowdown=factor)  # validates
        self.coordinator.command("slowdown", worker=worker, factor=float(factor))

    def wait(self, timeout_s: float | None = None) -> Result:
        """Block until the job ends; returns its :class:`Result` or raises :class:`TrainingError`."""
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"the job is still running after {timeout_s} s (step {self.coordinator.progress.step})")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def stop(self, timeout_s: float = 60.0) -> Result:
        """Stop at the next step boundary, keeping the state reached; returns the Result."""
        if not self._finished.is_set():
            self.coordinator.progress.state = "stopping"
            self.coordinator.command("stop")
        try:
            return self.wait(timeout_s)
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        """Terminate the workers at once (no final state)."""
        self.backend.terminate_all(grace_s=1.0)
        self._finished.wait(10.0)

    @property
    def done(self) -> bool:
        return self._finished.is_set()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("virtualflow")
    except Exception:
        return "unknown"
