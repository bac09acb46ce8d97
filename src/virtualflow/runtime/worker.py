"""A worker: rebuild the job, then live through membership generations until the job ends.

The worker is started by a backend with a :class:`WorkerConfig` and its worker id. It talks to
the coordinator only through the job's TCPStore (see :mod:`virtualflow.comm.protocol`):

1. **Set-up before joining.** Rebuild the job and its dataset, build the model with
   ``torch.manual_seed(seed)``, the optimizer and the engine, start the heartbeat thread, report
   ``join``. Survivors never wait for a newcomer's start-up: the coordinator adds a newcomer to a
   generation only after this report.
2. **Form a generation.** Follow ``vf/member/<id>/next/<g>`` to the generation to join, meet the
   other members at its rendezvous, build its group from ``PrefixStore("gen/<g>")``, agree on
   how far everyone got, and broadcast the full state from the most advanced member to anyone
   behind (newcomers; a survivor that had not applied an interrupted step).
3. **Train** until the job ends, a ``stop`` or ``regroup`` command arrives (every member sees it
   at the same step boundary, it rides in the step's all-reduce), or a collective fails
   (:class:`PeerFailure`): then the interrupted step is abandoned (BatchNorm statistics and
   gradients restored), a ``fault`` is reported with the phase, and the worker waits for the
   coordinator's next generation, where the step is redone.

Commit rule (why survivors always agree). A worker applies step ``s`` only after its gradient
all-reduce for ``s`` completed, i.e. it holds the complete, deterministic gradient of ``s``
(all V virtual nodes). A failure can stop some survivors after that point and others before it,
so survivors may differ by *exactly one applied step*, never more (nobody can finish the
reduction of ``s+1`` before everyone has entered it, i.e. applied ``s``). When the next
generation forms, members all-reduce their step counters and the state of a member with the
highest one is broadcast to the others before any training: every survivor ends up with the
state an undisturbed run has after that step, bit for bit, and no update is ever applied by
one survivor and missed by another once training continues. Data order and randomness are
functions of (seed, step, VN id), so the step that is redone is the same step.

Any other exception is reported (:func:`report_failure`) with the step, the phase and its traceback,
in full and from the job's own code on, and printed to the worker's log, before the process
exits non-zero.

Trust. The store has no authentication, so a worker acts only on what verifies with the run key
(:mod:`virtualflow.comm.protocol`): next pointers, generation records, control commands and abort
flags that do not are refused, noted (its log, and a ``rejected`` report that becomes a
``<channel>_rejected`` event) and read again until the coordinator's own value is there. Its own
reports are signed and numbered. A forged command written ahead of the coordinator's never
advances the worker's control position: commands are followed in order and only as far as they
verify (the heartbeat thread checks them, so rank 0 puts only a verified position into the step's
reduction).

Size: about 580 lines, one concept (a worker's life through generations: set-up, forming a
group, agreeing and transferring state, the step loop, leaving); its side of the control plane
is in :mod:`virtualflow.runtime.channel`.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from virtualflow.comm import auth, protocol
from virtualflow.comm.groups import Group, PeerFailure, make_group
from virtualflow.job import Job
from virtualflow.plan.data import DataPlan
from virtualflow.result import job_traceback
from virtualflow.rundir import DiskFullError, free_bytes, no_space
from virtualflow.runtime.channel import Heartbeat, Rejections, Reporter, aborted
from virtualflow.runtime.checkpoint import load_state, save_state
from virtualflow.runtime.engine import BatchLoader, NonFiniteLossError, VNEngine
from virtualflow.runtime.transfer import Progress, agree_progress, broadcast_state
from virtualflow.runtime.worker_config import WorkerConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


def build_job(cfg: WorkerConfig) -> Job:
    job = cfg.job_source.load()
    return job.replace(**cfg.overrides) if cfg.overrides else job


def broadcast_module(module: torch.nn.Module, group: Group, src: int = 0) -> None:
    """Make every worker's parameters and buffers bit-identical to ``src``'s."""
    if group.size == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            group.broadcast(flat, src)
            offset = 0
            for t in same:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def training_state(job: Job, engine: VNEngine, step: int,
                   optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's contents. ``optimizer_state``: the whole optimizer state when the caller
    gathered it (the sharded reduction), else the engine's."""
    return {
        "model": {k: v.detach().cpu() for k, v in engine.model.state_dict().items()},
        "optimizer": optimizer_state if optimizer_state is not None else engine.optimizer_state(),
        "lr_scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "step": step,
        "job": {
            "name": job.name,
            "global_batch_size": job.global_batch_size,
            "virtual_nodes": job.virtual_nodes,
            "seed": job.seed,
        },
    }


def run_worker(cfg: WorkerConfig, worker_id: int, notice: PreemptionNotice | None = None) -> int:
    """Run one worker to completion; returns the process exit code. ``notice``: the process's
    SIGTERM handling, when its entry point installed one (:class:`PreemptionNotice`)."""
    if not cfg.run_key or not auth.is_job_id(cfg.job_id):
        raise ValueError("WorkerConfig has no run key or job id: a worker signs its reports and checks the "
                         "coordinator's messages with them (the launching process fills them in)")
    torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    store = dist.TCPStore(
        cfg.store_host,
        cfg.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.store_timeout_s),
    )
    reporter = Reporter(store, protocol.RunKey(cfg.run_key, cfg.job_id), worker_id)
    worker: Worker | None = None
    try:
        worker = Worker(cfg, worker_id, store, reporter, notice)
        worker.run()
        return 0
    except Exception as exc:
        report_failure(reporter, worker_id, exc, worker)
        return 1


def failing_step(exc: BaseException, worker: Worker | None) -> int | None:
    """The step (0-based) a worker failed at: the one the exception names (``exc.step``), else the
    one the worker was running or about to run; None when it failed while setting up (building
    the job), before any step was its."""
    step = getattr(exc, "step", None)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if worker is None or worker.phase == "setting up" or worker.progress.step < 0:
        return None
    return worker.progress.step


def report_failure(reporter: Reporter, worker_id: int, exc: BaseException, worker: Worker | None) -> None:
    """Tell the coordinator and the worker's own log (stderr) why this worker failed: the
    exception, the step, and the traceback, in full and from the job's own code on
    (:func:`virtualflow.result.job_traceback`). Best effort: a report that cannot be sent (the
    store is gone) leaves the log."""
    step = failing_step(exc, worker)
    phase = worker.phase if worker is not None else "setting up"
    full = "".join(traceback.format_exception(exc))
    disk = no_space(exc)
    if disk is not None:  # one line naming the file, the space free there and the space needed
        path = disk.filename if isinstance(disk.filename, str) else (worker.cfg.state_dir if worker else "?")
        needed = getattr(disk, "needed_bytes", None) or _state_bytes(worker)
        free = disk.free_bytes if isinstance(disk, DiskFullError) else free_bytes(path)  # as measured at the failure
        exc = DiskFullError(path, free, needed, disk.errno)
    try:
        short = job_traceback(exc)
    except Exception:  # noqa: BLE001 - never lose the failure over its formatting
        short = full
    where = f"at step {step}" if step is not None else f"while {phase}"
    try:
        print(f"virtualflow worker {worker_id} failed {where}: {type(exc).__name__}: {exc}\n{full}",
              file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not hide the report below
        pass
    try:
        reporter({
            "type": "error",
            "error": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": full[-16000:],
            "job_traceback": short[-16000:],
            "phase": phase,
            "step": step,
        })
    except Exception:  # noqa: BLE001 - the store is gone: the log above is what is left
        pass


def _state_bytes(worker: Worker | None) -> int | None:
    """About how many bytes a state file of this worker's job takes (its model's tensors and the
    optimizer state it holds); None when that cannot be told (set-up not done, pipelined)."""
    try:
        engine = worker.engine  # type: ignore[union-attr]
        model = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        return model + engine.optimizer_state_bytes()
    except Exception:  # noqa: BLE001 - an estimate for a message only
        return None


class PreemptionNotice:
    """A worker process's preemption notice: what a SIGTERM means to the worker, as data.

    The process's entry point installs the signal handler (:func:`virtualflow.backends.local_worker.
    preemption_notice`; ``runtime/`` installs none) and asks :meth:`take` what to do. A SIGTERM
    while the worker trains is a *preemption notice* (what a spot instance gets before it is
    reclaimed): :attr:`given` is set, the worker asks at its next step boundary to be released,
    the job regroups without it at a step boundary and it leaves cleanly: no failure, no step
    redone, nothing lost (the sharded reduction hands its optimizer chunk over). A SIGTERM at any
    other time (waiting for a generation, setting up), or a second one, ends the process at once,
    as the default action would (the launcher's shutdown sends SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.given = threading.Event()
        self.training = threading.Event()

    def take(self) -> bool:
        """A SIGTERM arrived: note it as a notice and return True, or return False when the
        process must end at once (a second one, or not training)."""
        if self.given.is_set() or not self.training.is_set():
            return False
        self.given.set()
        return True


class _Aborted(Exception):
    """The generation was abandoned before it formed (a member failed during the rendezvous)."""


def _rendezvous(store: dist.Store, cfg: WorkerConfig, generation: int, size: int,
                aborted: Callable[[], bool]) -> None:
    """Wait until every member of ``generation`` has arrived (or the generation is aborted)."""
    store.add(protocol.arrived_key(generation), 1)
    if size == 1:
        return
    deadline = time.monotonic() + cfg.store_timeout_s
    pause = 0.001
    while store.add(protocol.arrived_key(generation), 0) < size:
        if aborted():
            raise _Aborted()
        if time.monotonic() > deadline:
            raise _Aborted()
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _full_state(engine: VNEngine, progress: Progress) -> dict[str, Any]:
    return {
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer_state(),
        "lr_scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "step": progress.step,
        "control": progress.control,
    }


def _load_full_state(engine: VNEngine, state: dict[str, Any]) -> None:
    engine.model.load_state_dict(state["model"])
    engine.load_optimizer_state(state["optimizer"])
    if engine.scheduler is not None and state.get("lr_scheduler") is not None:
        engine.scheduler.load_state_dict(state["lr_scheduler"])


def _materialize_optimizer_state(engine: VNEngine) -> None:
    """Give a newcomer's optimizer its state tensors now, during set-up, by one step with zero
    gradients. The values do not matter (the state transfer overwrites model, optimizer and
    scheduler state); what matters is that the memory is allocated and touched before the
    worker joins, so the transfer receives into it instead of faulting in hundreds of MB while
    the survivors wait. Best effort: an optimizer that cannot step this way (e.g. one that needs
    a closure) just gets its state from the transfer as usual."""
    params = [p for g in engine.optimizer.param_groups for p in g["params"] if p.requires_grad]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        engine.optimizer.step()
    except Exception:  # noqa: BLE001 - an optimization only
        pass
    finally:
        engine.optimizer.zero_grad(set_to_none=True)


def checkpoint_path(state_dir: str, step: int) -> str:
    return os.path.join(state_dir, "checkpoints", f"step-{step:08d}.pt")


def _save_checkpoint(cfg: WorkerConfig, job: Job, engine: VNEngine, step: int,
                     state: dict[str, Any] | None = None) -> str:
    path = checkpoint_path(cfg.state_dir, step)
    save_state(path, state if state is not None else training_state(job, engine, step))
    folder = os.path.dirname(path)
    kept = sorted(f for f in os.listdir(folder) if f.startswith("step-") and f.endswith(".pt"))
    for old in kept[: max(0, len(kept) - cfg.keep_checkpoints)]:
        for suffix in ("", ".sha256"):
            try:
                os.remove(os.path.join(folder, old + suffix))
            except OSError:
                pass
    return path


class Worker:
    """One worker's life: generations one after another until the job ends or it leaves."""

    def __init__(self, cfg: WorkerConfig, worker_id: int, store: dist.Store, reporter: Reporter,
                 notice: PreemptionNotice | None = None) -> None:
        self.cfg, self.id, self.store = cfg, worker_id, store
        self.notice = notice
        self._noticed = False
        self.report = reporter
        self.run_key = reporter.run
        self.rejections = Rejections(reporter)
        self._transferring = False  # inside a state transfer (what a fault report names)
        self.device = torch.device(cfg.device)
        self.progress = Progress(step=-1, control=0)
        self.last_report: dict[str, Any] | None = None
        self.last_eval_step = -1
        self.retired: list[Group] = []
        self.phase = "setting up"
        """What the worker is doing, for a failure's report: setting up, forming a generation,
        training, finishing."""

    def read_signed(self, key: str, parse: Callable[[bytes], T], channel: str) -> T:
        """``parse`` of the value at ``key`` once it is there. A value that does not verify is
        refused (noted once) and read again until the coordinator's own value replaces it; after
        ``store_timeout_s`` the worker gives up with an error."""
        timeout_s = self.cfg.store_timeout_s
        deadline = time.monotonic() + timeout_s
        self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        while True:
            raw = self.store.get(key)
            try:
                return parse(raw)
            except ValueError as exc:
                self.rejections(channel, key, raw, exc)
                last = exc
            self.report.flush()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{channel} ({key}) in the job's store did not verify for {timeout_s:g} s "
                                   f"(something other than the coordinator writes there): {last}")
            time.sleep(0.05)

    def next_generation(self, after: int) -> str:
        """Where this worker goes after generation ``after`` (waits for the coordinator)."""
        return self.read_signed(protocol.next_key(self.id, after),
                                lambda raw: protocol.parse_next(self.run_key, raw, self.id, after),
                                f"next {self.id}/{after}")

    def aborted(self, generation: int) -> bool:
        return aborted(self.store, self.run_key, generation, self.rejections)

    # -- set-up: everything slow happens before joining --------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        t_start = time.perf_counter()
        job = self.job = build_job(cfg)
        dataset = job.build_dataset()
        plan = DataPlan(len(dataset), job.global_batch_size, job.virtual_nodes, job.seed)
        if job.pipeline is not None:
            self.engine = self._pipeline_engine(job, dataset)
        else:
            torch.manual_seed(job.seed)
            model = job.model().to(self.device)
            optimizer = job.optimizer(model.parameters())
            scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
            self.engine = VNEngine(
                model, optimizer, scheduler, job.compute_loss, plan, BatchLoader(dataset, job.collate_fn),
                seed=job.seed, batchnorm=job.batchnorm, deterministic=cfg.deterministic, device=self.device,
                reduction=cfg.reduction, loader_workers=cfg.loader_workers, breakdown=cfg.breakdown,
            )
        self.engine.slowdown = float(cfg.slowdowns.get(self.id, 1.0))
        self.profiler = None
        if cfg.profile_steps is not None:
            from virtualflow.runtime.trace_window import StepProfiler

            self.profiler = StepProfiler(cfg.profile_steps, os.path.join(cfg.state_dir, "profile"), self.id,
                                         self.device.type)
        self.faults = cfg.fault_plan.for_worker(self.id) if cfg.fault_plan is not None else None
        if self.faults:
            self.engine.install_fault_point(self.faults.point)
        self.pipelined = job.pipeline is not None
        self.sharded = not self.pipelined and cfg.reduction == "sharded"
        self.collective_state = self.pipelined or self.sharded
        """Whether the whole training state is assembled by a collective (every member takes part)."""
        if cfg.resume_path is not None and self.id < cfg.initial_workers:
            state = load_state(cfg.resume_path)
            if self.pipelined:
                self.engine.resume_state = state  # loaded into the stage once its place is known
            else:
                _load_full_state(self.engine, state)
            self.progress = Progress(step=int(state["step"]), control=0)
        elif self.id < cfg.initial_workers:
            # Generation 0 starts from the job's initial weights: everyone built the same model
            # from the same seed, and rank 0's copy is broadcast anyway (see _form).
            self.progress = Progress(step=0, control=0)
        elif not self.collective_state:
            _materialize_optimizer_state(self.engine)
        self.heartbeat = Heartbeat(cfg, self.id, run=self.run_key, rejections=self.rejections)
        if cfg.control_plane:
            self.heartbeat.start()
        self.report({"type": "join", "setup_s": time.perf_counter() - t_start})

    _due: tuple[bool, bool] = (False, False)
    """Pipelined job: a checkpoint / an evaluation fell due inside a no-flush window."""

    def _pipeline_engine(self, job: Job, dataset: Any):
        from virtualflow.comm.groups import make_subgroup
        from virtualflow.runtime.pipeline_worker import PipelineWorkerEngine

        cfg = self.cfg

        def subgroup(generation: int, name: str, rank: int, size: int) -> Group:
            return make_subgroup(self.store, generation, name, rank, size, cfg.collective_timeout_s, self.device)

        engine = PipelineWorkerEngine(job, dataset, deterministic=cfg.deterministic, device=self.device,
                                      subgroup=subgroup)
        engine.total_steps = cfg.total_steps
        engine.timeline_dir = os.path.join(cfg.state_dir, "pipeline")
        return engine

    def _whole_state(self, group: Group, step: int) -> dict[str, Any] | None:
        """The training state a checkpoint or the final state holds; ``None`` except on rank 0.
        A collective for a pipelined job (rank 0 gathers the stages), local otherwise."""
        if not self.pipelined:
            optimizer = self.engine.gather_optimizer_state(root=0) if self.sharded else None  # a collective
            return training_state(self.job, self.engine, step, optimizer) if group.rank == 0 else None
        state = self.engine.gather_state(group)
        if state is None:
            return None
        job = self.job
        state.update({"step": step, "job": {"name": job.name, "global_batch_size": job.global_batch_size,
                                            "virtual_nodes": job.virtual_nodes, "seed": job.seed}})
        return state

    # -- the life loop ------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        self.phase = "forming a generation"  # waiting for the first generation counts as forming it
        where = self.next_generation(-1)
        while True:
            if where == protocol.FAIL:
                return
            if where.startswith(protocol.LEAVE):
                self.leave(where)
                return
            gen = int(where)
            record = self.read_signed(protocol.generation_key(gen),
                                      lambda raw: protocol.parse_generation(self.run_key, raw, gen),
                                      f"generation {gen}")
            self.phase = "forming a generation"
            try:
                group = self._form(record)
            except (PeerFailure, _Aborted) as exc:
                phase = "state_transfer" if self._transferring else "regroup"
                self.report({"type": "fault", "generation": gen, "phase": phase, "step": self.progress.step,
                             "error": (str(exc) or "generation aborted")[:2000]})
                where = self.next_generation(gen)
                continue
            if record.hold:
                if self.sharded:
                    self.engine.before_regroup()  # the next generation cuts the optimizer state again
                if self.collective_state:  # rank 0 gathers the stages / the optimizer's chunks
                    state = self._whole_state(group, self.progress.step)
                    if group.rank == 0:
                        path = checkpoint_path(self.cfg.state_dir, self.progress.step)
                        save_state(path, state)
                        self.report({"type": "held", "generation": gen, "step": self.progress.step,
                                     "checkpoint": path})
                elif group.rank == 0:
                    path = _save_checkpoint(self.cfg, self.job, self.engine, self.progress.step)
                    self.report({"type": "held", "generation": gen, "step": self.progress.step, "checkpoint": path})
                self.retired.append(group)
                where = self.next_generation(gen)
                continue
            try:
                outcome = self._steps(record, group)
            except PeerFailure as exc:
                phase = self.engine.phase
                # Leave the generation at once (Group.abort shuts its connections down): this
                # worker's own operations still in flight (a reducer's thread) end now, and so does
                # every peer's wait on this worker, instead of at the group's timeout.
                group.abort()
                self.engine.abandon_step()
                self.report({"type": "fault", "generation": gen, "phase": phase, "step": self.progress.step,
                             "error": str(exc)[:2000]})
                group.close()
                where = self.next_generation(gen)
                continue
            if outcome == "regroup":
                self.retired.append(group)
                where = self.next_generation(gen)
                continue
            self._finish(group)
            return

    def _form(self, record: protocol.GenerationRecord) -> Group:
        """Rendezvous, build the generation's group, agree on the state, transfer it if needed."""
        cfg, gen = self.cfg, record.generation
        self._transferring = False
        if self.sharded and self.progress.step >= 0:
            from virtualflow.runtime.sharded import ShardLost

            try:
                self.engine.shard.check_held()  # after a failure: ShardLost, naming the way out
            except ShardLost as exc:
                raise ShardLost(f"{exc} (this run's directory: {cfg.state_dir})") from None
        t0 = time.perf_counter()
        rank = record.members.index(self.id)
        _rendezvous(self.store, cfg, gen, len(record.members), lambda: self.aborted(gen))
        group = make_group(self.store, gen, rank, len(record.members), cfg.collective_timeout_s, self.device)
        group.abort_check = lambda: self.aborted(gen)
        t_group = time.perf_counter() - t0
        for old in self.retired:  # every member has left the old groups: release them
            old.close()
        self.retired = []
        try:
            return self._agree_and_transfer(record, group, rank, t0, t_group)
        except BaseException:
            # Close at once: a peer blocked in an (unsliced) point-to-point receive from this
            # worker is released by the closed sockets instead of waiting for the timeout.
            group.close()
            raise

    def _agree_and_transfer(
        self, record: protocol.GenerationRecord, group: Group, rank: int, t0: float, t_group: float
    ) -> Group:
        gen = record.generation
        everyone = agree_progress(group, self.progress, self.device)
        target = max(p.step for p in everyone)
        if target < 0:
            raise RuntimeError("no member of the new generation holds the training state")
        src = next(r for r, p in enumerate(everyone) if p.step == target)
        behind = [record.members[r] for r, p in enumerate(everyone) if p.step < target]
        moved, t_transfer = 0, 0.0
        if self.pipelined:
            self.engine.plan.set_vn_sizes(record.vn_sizes)
            self.engine.set_membership(group, record.assignment, layout=record.layout,
                                       steps=[p.step for p in everyone], target=target)
            if record.layout is not None:
                moved = self.engine.relayout_bytes  # what the re-layout moved between the members
            if behind:
                self._transferring = True
                t1 = time.perf_counter()
                moved += self.engine.transfer(group, [p.step for p in everyone], target)
                t_transfer = time.perf_counter() - t1
                self._transferring = False
        elif target == 0 and group.size > 1 and not behind:
            broadcast_module(self.engine.model, group)  # identical start whatever the factory does
        if behind and not self.pipelined:
            self._transferring = True
            t1 = time.perf_counter()
            mine = _full_state(self.engine, self.progress) if rank == src else None
            point = (lambda: self.faults.point(target, "state_transfer")) if self.faults else None
            behind_ranks = [r for r, p in enumerate(everyone) if p.step < target]
            # A newcomer's own tensors hold nothing of value: receive into them. A survivor one
            # step behind keeps its state intact until the transfer is through (if the source
            # dies mid-way, that state may be the best one left).
            into = _full_state(self.engine, self.progress) if self.progress.step < 0 else None
            state, moved = broadcast_state(group, src, mine, self.device, on_started=point,
                                           receivers=behind_ranks, into=into)
            if rank in behind_ranks:
                _load_full_state(self.engine, state)
            t_transfer = time.perf_counter() - t1
            self._transferring = False
        self.progress = Progress(step=target, control=max(p.control for p in everyone))
        if not self.pipelined:
            self.engine.plan.set_vn_sizes(record.vn_sizes)
            self.engine.set_membership(group, record.assignment)
        if self.cfg.control_plane:
            self.heartbeat.watch(gen)
            self.engine.generation_broken = self.heartbeat.broken
        if rank == 0:
            self.store.set(protocol.formed_key(gen), "1")
            self.report({
                "type": "formed", "generation": gen, "members": record.members, "step": target,
                "hold": record.hold, "group_s": t_group, "transfer_s": t_transfer, "bytes": moved,
                "source": record.members[src] if behind else None, "receivers": behind,
                "form_s": time.perf_counter() - t0, "time": time.time(),
            })
        if rank == src and self.last_report is not None:
            # The most advanced member re-sends its last step record before anyone trains on:
            # the step may have been applied by survivors only, never reported by a rank 0 (the
            # old one died, or the new one is behind). The coordinator drops duplicates.
            self.report(self.last_report)
        return group

    def _steps(self, record: protocol.GenerationRecord, group: Group) -> str:
        """Train until the end, a stop, or a planned regroup; returns which. While it trains, a
        SIGTERM is a preemption notice (:class:`PreemptionNotice`)."""
        step = self.progress.step
        t_prev = time.perf_counter()
        if self.notice is not None:
            self.notice.training.set()
        self.phase = "training"
        try:
            return self._train(record, group, step, t_prev)
        finally:
            if self.notice is not None:
                self.notice.training.clear()

    def _train(self, record: protocol.GenerationRecord, group: Group, step: int, t_prev: float) -> str:
        cfg, job, engine = self.cfg, self.job, self.engine
        gen, rank = record.generation, group.rank
        profiler = self.profiler
        while step < cfg.total_steps:
            control = self.heartbeat.control_seq if rank == 0 else 0
            if profiler is not None:
                profiler.before(step)
            outcome = engine.step(step, control)
            if profiler is not None:
                profiler.after(step)
            if outcome.bad_vns:
                self._non_finite(outcome, step, group)
            step += 1
            self.progress = Progress(step=step, control=self.progress.control)
            now = time.perf_counter()
            step_time, t_prev = now - t_prev, now
            report = {
                "type": "step", "step": step - 1, "loss": outcome.loss, "samples": job.global_batch_size,
                "step_time_s": step_time, "workers": group.size, "generation": gen,
                "vns": record.assignment, "members": record.members, "compute_s": outcome.compute_s,
                "vn_sizes": record.vn_sizes,
                "time": time.time(),
            }
            if outcome.breakdown is not None:  # of the previous step (it rode in this one's reduction)
                report["breakdown"] = [{"worker": w, **parts} for w, parts in zip(record.members, outcome.breakdown)]
                report["breakdown_step"] = step - 2
            self.last_report = report
            if self.pipelined:
                self._pipeline_boundary(group, step)
            elif self.sharded:
                self._sharded_boundary(group, step)
            if self.notice is not None and self.notice.given.is_set() and not self._noticed:
                self._noticed = True  # reported once, at a step boundary (the reporter is not shared)
                self.report({"type": "notice", "step": step})
            if rank != 0:
                self.report.flush()  # what the heartbeat thread refused, if anything
            else:
                self.report(report)
                if self.collective_state:
                    pass  # its checkpoints were collectives: _pipeline_boundary / _sharded_boundary
                elif cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.total_steps:
                    t_ck = time.perf_counter()
                    path = _save_checkpoint(cfg, job, engine, step)
                    self.report({"type": "checkpoint", "step": step, "path": path,
                                 "save_s": time.perf_counter() - t_ck})
                if not self.pipelined and job.evaluate is not None and job.eval_every and step % job.eval_every == 0:
                    _evaluate(self.report, job, engine, step)
                    self.last_eval_step = step
                t_prev = time.perf_counter()  # checkpoint and evaluation time is not step time
            if outcome.control > self.progress.control:
                commands = [self._command(n) for n in range(self.progress.control + 1, outcome.control + 1)]
                ops = [c["op"] for c in commands]
                for c in commands:
                    if c["op"] == "slowdown" and c["worker"] == self.id:
                        engine.slowdown = float(c["factor"])
                self.progress = Progress(step=step, control=outcome.control)
                if "stop" in ops:
                    return "stop"
                if "regroup" in ops:
                    if self.sharded:
                        engine.before_regroup()  # every member gathers the optimizer state
                    return "regroup"
        return "done"

    def _pipeline_boundary(self, group: Group, step: int) -> None:
        """Checkpoint and evaluation of a pipelined job: every member takes part in the gather."""
        cfg, job = self.cfg, self.job
        ck = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.total_steps)
        ev = bool(job.evaluate is not None and job.eval_every and step % job.eval_every == 0)
        # A no-flush schedule has computed its whole window already: what falls due inside a
        # window is done at the window's end, where the state is that of a step boundary.
        self._due = (self._due[0] or ck, self._due[1] or ev)
        if self.engine.mid_window:
            return
        ck, ev = self._due
        self._due = (False, False)
        if not (ck or ev):
            return
        t_ck = time.perf_counter()
        state = self._whole_state(group, step)
        if state is None:
            return
        if ck:
            path = checkpoint_path(cfg.state_dir, step)
            save_state(path, state)
            self.report({"type": "checkpoint", "step": step, "path": path, "save_s": time.perf_counter() - t_ck})
        if ev:
            _evaluate(self.report, job, self.engine, step)
            self.last_eval_step = step
        self.engine.model = None  # the whole model was rebuilt on rank 0 for this; only pieces stay

    def _sharded_boundary(self, group: Group, step: int) -> None:
        """A checkpoint with the sharded reduction: every member takes part in gathering the
        optimizer state; rank 0 writes it."""
        cfg = self.cfg
        if not (cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.total_steps):
            return
        t_ck = time.perf_counter()
        state = self._whole_state(group, step)
        if state is not None:
            path = _save_checkpoint(cfg, self.job, self.engine, step, state)
            self.report({"type": "checkpoint", "step": step, "path": path, "save_s": time.perf_counter() - t_ck})

    def _command(self, n: int) -> dict[str, Any]:
        """Control command ``n``, verified (by the heartbeat thread, or here)."""
        command = self.heartbeat.commands.get(n)
        if command is None:
            command = self.read_signed(protocol.control_key(n),
                                       lambda raw: protocol.parse_command(self.run_key, raw, n), f"command {n}")
        return command

    def _non_finite(self, outcome, step: int, group: Group) -> None:
        path = os.path.join(self.cfg.state_dir, "checkpoint.pt")
        state = self._whole_state(group, step)  # every member learnt of the bad VNs from the same reduction
        if group.rank == 0:
            save_state(path, state)
        streamed = self.pipelined and not self.job.pipeline.flush
        what = (f"the {self.job.pipeline.schedule} schedule streams steps without a flush, so the updates of its "
                f"window were applied; the state after them is in {path}" if streamed else
                f"the step was not applied and the last good state (before step {step}) is in {path}")
        err = NonFiniteLossError(
            f"non-finite loss at step {step} in virtual node"
            f"{'s' if len(outcome.bad_vns) > 1 else ''} {', '.join(map(str, outcome.bad_vns))}; "
            f"{what}. Lower the learning rate, check the data of those samples, or clip gradients"
        )
        err.step = step  # type: ignore[attr-defined]
        raise err

    def _finish(self, group: Group) -> None:
        self.phase = "finishing"
        step, job = self.progress.step, self.job
        if self.profiler is not None:
            self.profiler.close()
        if not self.pipelined:
            self.engine.close()  # its loader threads, if any
        state = self._whole_state(group, step)
        if group.rank == 0:
            if job.evaluate is not None and self.last_eval_step != step:
                _evaluate(self.report, job, self.engine, step)
            save_state(os.path.join(self.cfg.state_dir, "final.pt"), state)
        optimizer_bytes = 0 if self.pipelined else self.engine.optimizer_state_bytes()
        replica = self.engine.stage.replica_of_successor if self.pipelined and self.engine.stage is not None else None
        self.report({"type": "done", "step": step, "rank": group.rank, "peak_rss_mib": _peak_rss_mib(),
                     "optimizer_bytes": optimizer_bytes, "replica_bytes": replica.nbytes() if replica else 0,
                     "replica_refresh_s": replica.refresh_s if replica else 0.0,
                     "redundant_forwards": self.engine.redundant_forwards() if self.pipelined else {}})
        self.heartbeat.stop()
        if group.pg is not None:
            try:
                # Nobody leaves before rank 0 has written the final state (a late error is still seen).
                group.all_reduce(torch.zeros(1, device=self.device))
            except PeerFailure:
                pass  # the state is written; a peer that died now changes nothing
            group.close()

    def leave(self, where: str) -> None:
        """Planned departure: wait until the next generation has formed, so that no survivor is
        still reading from this worker's sockets, then exit."""
        self.report({"type": "leave", "step": self.progress.step})
        self.heartbeat.stop()
        if not self.pipelined:
            self.engine.close()
        parts = where.split()
        if len(parts) == 2:
            try:
                self.store.wait([protocol.formed_key(int(parts[1]))], datetime.timedelta(seconds=10))
            except Exception:
                pass
        for old in self.retired:
            old.close()


def _peak_rss_mib() -> float:
    """This process's own peak resident memory (VmHWM). ``ru_maxrss`` is not used: on Linux it
    carries the parent's peak across fork+exec, so a worker would report its launcher's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except Exception:
        return float("nan")


def _evaluate(report: Reporter, job: Job, engine: VNEngine, step: int) -> None:
    model = engine.model
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = job.evaluate(model)
    model.train()
    report({
        "type": "eval",
        "step": step,
        "metrics": {str(k): float(v) for k, v in dict(metrics).items()},
        "eval_time_s": time.perf_counter() - t0,
    })
