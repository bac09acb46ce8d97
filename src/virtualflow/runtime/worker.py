"""A worker: rebuild the job, then live through membership generations until the job ends.

The worker is started by a backend with a :class:`WorkerConfig` and its worker id. It talks to
the coordinator only through the job's TCPStore (see :mod:`virtualflow.comm.protocol`):

1. **Set-up before joining.** Start the heartbeat thread, rebuild the job and its dataset, build
   the model with ``torch.manual_seed(seed)``, the optimizer and the engine, report ``join``. Survivors never wait for a newcomer's start-up: the coordinator adds a newcomer to a
   generation only after this report.
2. **Form a generation.** Follow ``vf/member/<id>/next/<g>`` to the generation to join, meet the
   other members at its rendezvous, build its group from ``PrefixStore("gen/<g>")``, agree on
   how far everyone got, and broadcast the full state from the most advanced member to anyone
   behind (newcomers; a survivor that had not applied an interrupted step).
3. **Train** until the job ends, a ``stop`` or ``regroup`` command arrives (every member sees it
   at the same step boundary, it rides in the step's all-reduce), a callback asks to stop (agreed
   at the boundary of the step it named), or a collective fails
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

Engines. The worker never asks which engine it runs (VN or pipelined, plain or sharded
reduction): what differs is behind :class:`virtualflow.runtime.engines.Engine` (adopting a
generation, a step, abandoning it, the whole state, the step-boundary work, a held generation);
:func:`build_engine` is the one place that picks the engine from the job. Nor does it read the
job's layout: whether a generation's group carries pipeline hops both ways is the engine's
:attr:`~virtualflow.runtime.engines.Engine.generation_hops_duplex`, and the knobs are read
from ``cfg.options`` (:class:`~virtualflow.config.worker_options.WorkerOptions`).

Size: one concept (a worker's life through generations: set-up, forming a group, agreeing on
the state, the step loop, leaving). Beside it: its side of the control plane
(:mod:`virtualflow.runtime.channel`), its configuration (:mod:`virtualflow.runtime.worker_config`),
checkpoints and evaluations at step boundaries (:mod:`virtualflow.runtime.step_boundary`), the
job's callbacks (:mod:`virtualflow.runtime.callbacks`: run after each step, their early stop agreed
by every member, their state moved when a generation forms) and its failure report
(:mod:`virtualflow.runtime.failure_report`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from virtualflow.comm import auth, protocol
from virtualflow.comm.groups import Group, PeerFailure, make_group
from virtualflow.comm.net import resolve_interface
from virtualflow.config.job import Job
from virtualflow.plan.flops import peak_tflops
from virtualflow.runtime.callbacks import Callbacks, StepInfo
from virtualflow.runtime.channel import Heartbeat, Rejections, Reporter, aborted, connect_store, rendezvous
from virtualflow.runtime import dataset_check
from virtualflow.runtime.checkpoint import save_state
from virtualflow.runtime.dcp import load_checkpoint
from virtualflow.runtime.engine import NonFiniteLossError
from virtualflow.runtime.engines import Engine, Joining, Successor
from virtualflow.runtime.factory import build_engine
from virtualflow.runtime.faults import WorkerFaults
from virtualflow.runtime.failure_report import failing_step, peak_device_mib, peak_rss_mib, report_failure
from virtualflow.runtime.step_boundary import WorkerBoundary, apply_commands, checkpoint_path
from virtualflow.runtime.trace_window import StepProfiler
from virtualflow.runtime.transfer import Progress, agree_progress
from virtualflow.runtime.worker_config import WorkerConfig

__all__ = ["PreemptionNotice", "Worker", "WorkerConfig", "build_engine", "build_job", "checkpoint_path",
           "failing_step", "report_failure", "run_worker"]
"""``WorkerConfig`` (its home is :mod:`virtualflow.runtime.worker_config`), ``checkpoint_path``
(:mod:`virtualflow.runtime.step_boundary`) and the failure report
(:mod:`virtualflow.runtime.failure_report`) are re-exported: they were imported from here."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


def build_job(cfg: WorkerConfig) -> Job:
    job = cfg.job_source.load()
    return job.replace(**cfg.overrides) if cfg.overrides else job


def run_worker(cfg: WorkerConfig, worker_id: int, notice: PreemptionNotice | None = None, *,
               eager_every_wait: bool = False) -> int:
    """Run one worker to completion; returns the process exit code. ``notice``: the process's
    SIGTERM handling, when its entry point installed one (:class:`PreemptionNotice`).
    ``eager_every_wait``: the pipeline diagnostic the entry point read from its environment
    (:func:`virtualflow.backends.inprocess.eager_every_wait_from_env`)."""
    if not cfg.run_key or not auth.is_job_id(cfg.job_id):
        raise ValueError("WorkerConfig has no run key or job id: a worker signs its reports and checks the "
                         "coordinator's messages with them (the launching process fills them in)")
    torch.set_num_threads(cfg.threads)
    if cfg.options.deterministic:
        torch.use_deterministic_algorithms(True)
    store = connect_store(cfg, worker_id)
    reporter = Reporter(store, protocol.RunKey(cfg.run_key, cfg.job_id), worker_id)
    worker: Worker | None = None
    try:
        bind = resolve_interface(cfg.interface, cfg.store_host, cfg.store_port, knob=cfg.interface_knob)
        logger.info("worker %d: collectives bind %s (%s %s)", worker_id, ", ".join(bind), cfg.interface_knob,
                    cfg.interface)
        cfg = dataclasses.replace(cfg, interface=",".join(bind))
        worker = Worker(cfg, worker_id, store, reporter, notice, eager_every_wait=eager_every_wait)
        worker.run()
        return 0
    except Exception as exc:
        report_failure(reporter, worker_id, exc, worker)
        return 1


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


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The peak TFLOP/s the worker's device is known for (:func:`virtualflow.plan.flops.peak_tflops`),
    or None (a CPU, an unknown GPU): the step reports carry it for model FLOPs utilisation."""
    if device.type != "cuda":
        return None
    try:
        return peak_tflops(torch.cuda.get_device_name(device), precision)
    except Exception:  # noqa: BLE001 - a figure for the records only
        return None


class _Aborted(Exception):
    """The generation was abandoned before it formed (a member failed during the rendezvous)."""


class Worker:
    """One worker's life: generations one after another until the job ends or it leaves."""

    def __init__(self, cfg: WorkerConfig, worker_id: int, store: dist.Store, reporter: Reporter,
                 notice: PreemptionNotice | None = None, *, eager_every_wait: bool = False) -> None:
        self.cfg, self.id, self.store = cfg, worker_id, store
        self.notice = notice
        self.eager_every_wait = eager_every_wait
        self._noticed = False
        self.report = reporter
        self.run_key = reporter.run
        self.rejections = Rejections(reporter)
        self._joining: Joining | None = None  # the generation being adopted (a fault report names its phase)
        self.device = torch.device(cfg.options.device)
        self.progress = Progress(step=-1, control=0)
        self.last_report: dict[str, Any] | None = None
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
        # Beat from the start, before the (possibly long) set-up: a worker that dies or freezes
        # between its welcome and its join is then seen silent by a backend that cannot see its
        # exit (external workers), instead of holding its place for ever. The controller watches
        # a worker's heartbeats only from its join on.
        self.heartbeat = Heartbeat(cfg, self.id, run=self.run_key, rejections=self.rejections)
        if cfg.options.control_plane:
            self.heartbeat.start()
        job = self.job = build_job(cfg)
        dataset = job.build_dataset()
        self.engine: Engine = build_engine(cfg, self.id, job, dataset, self.store, self.device,
                                           eager_every_wait=self.eager_every_wait)
        self.callbacks = Callbacks(job.callbacks, self.device)
        self.boundary = WorkerBoundary(cfg, job, self.report, self.callbacks)
        self.peak_tflops = device_peak_tflops(self.device, job.precision) if job.flops_per_sample else None
        self.profiler = None
        if cfg.options.profile_steps is not None:
            self.profiler = StepProfiler(cfg.options.profile_steps, os.path.join(cfg.state_dir, "profile"), self.id,
                                         self.device.type)
        plan = cfg.options.fault_plan
        self.faults = WorkerFaults.of(plan, self.id) if plan is not None else None
        if self.faults:
            self.engine.install_fault_point(self.faults.point)
            self.boundary.fault_point = self.faults.point
        if cfg.resume_path is not None and self.id < cfg.initial_workers:
            state = load_checkpoint(cfg.resume_path)  # a state file or a sharded checkpoint's folder
            self.engine.resume_from(state)
            self.progress = Progress(step=int(state["step"]), control=0)
            self.callbacks.resume(state.get("callbacks"), self.progress.step)
        elif self.id < cfg.initial_workers:
            # Generation 0 starts from the job's initial weights: everyone built the same model
            # from the same seed, and rank 0's copy is broadcast anyway (see _form).
            self.progress = Progress(step=0, control=0)
            self.callbacks.zero_seen = 0  # every initial worker's callbacks start alike
        else:
            self.engine.prepare_to_join()
        self.report({"type": "join", "setup_s": time.perf_counter() - t_start, "dataset": self._fingerprint(dataset)})

    def _fingerprint(self, dataset: Any) -> dict[str, str] | None:
        """The dataset's fingerprint for the coordinator's check that every worker process built
        the same one (None, logged, when a sample cannot be read here: training reads it again
        and fails there with the job's own traceback if it is broken)."""
        try:
            return dataset_check.fingerprint(dataset)
        except Exception as exc:  # noqa: BLE001 - the check must not be what fails a job
            logger.warning("worker %d: cannot fingerprint its dataset (%s: %s); it is not compared with the "
                           "other workers'", self.id, type(exc).__name__, exc)
            return None

    # -- the life loop ------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        self.phase = "forming a generation"  # waiting for the first generation counts as forming it
        where = self.next_generation(-1)
        after = -1
        while True:
            if where == protocol.FAIL:
                # Fenced out (the coordinator stopped hearing from this worker: a partition that
                # has healed since) or the job gave up: nothing of this worker counts any more.
                print(f"virtualflow worker: worker {self.id} is no longer part of the job after generation {after} "
                      f"(fenced out, or the job gave up); exiting", flush=True)
                self.heartbeat.stop()
                return
            if where.startswith(protocol.LEAVE):
                self.leave(where)
                return
            gen = after = int(where)
            record = self.read_signed(protocol.generation_key(gen),
                                      lambda raw: protocol.parse_generation(self.run_key, raw, gen),
                                      f"generation {gen}")
            self.phase = "forming a generation"
            try:
                group = self._form(record)
            except (PeerFailure, _Aborted) as exc:
                phase = "state_transfer" if self._joining is not None and self._joining.transferring else "regroup"
                self.report({"type": "fault", "generation": gen, "phase": phase, "step": self.progress.step,
                             "error": (str(exc) or "generation aborted")[:2000]})
                where = self.next_generation(gen)
                continue
            if record.hold:
                path = self.engine.hold(group, self.progress.step, self.boundary)
                if group.rank == 0:
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
        self._joining = None
        if self.progress.step >= 0:
            self.engine.check_state_held(cfg.state_dir)  # after a failure: what only this worker held
        t0 = time.perf_counter()
        rank = record.members.index(self.id)
        # Tell the coordinator this worker is here and alive (its step watchdog judges members
        # that say nothing while a generation forms as wedged in their own code).
        self.report({"type": "arrived", "generation": gen})
        if not rendezvous(self.store, gen, len(record.members), cfg.store_timeout_s, lambda: self.aborted(gen)):
            raise _Aborted()
        group = make_group(self.store, gen, rank, len(record.members), cfg.options.collective_timeout_s, self.device,
                           bind=cfg.gloo_bind(), duplex=self.engine.generation_hops_duplex)
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
        point = (lambda: self.faults.point(target, "state_transfer")) if self.faults else None
        joining = self._joining = Joining(group=group, record=record, progress=self.progress,
                                          steps=[p.step for p in everyone], target=target, src=src,
                                          state_point=point)
        moved, t_transfer = self.engine.adopt(joining)
        if self.callbacks:  # their state follows the training state (a collective)
            t1 = time.perf_counter()
            moved += self.callbacks.adopt(group, src=src, behind=joining.behind, step=target, hold=record.hold)
            t_transfer += time.perf_counter() - t1
        self.progress = Progress(step=target, control=max(p.control for p in everyone))
        if self.cfg.options.control_plane:
            self.heartbeat.watch(gen, rank=rank, workers=len(record.members), acted=self.progress.control)
            self.engine.generation_broken = self.heartbeat.broken
        if rank == 0:
            self.store.set(protocol.formed_key(gen), "1")
            self.report({
                "type": "formed", "generation": gen, "members": record.members, "step": target,
                "hold": record.hold, "group_s": t_group, "transfer_s": t_transfer, "bytes": moved,
                "source": record.members[src] if behind else None, "receivers": behind,
                "form_s": time.perf_counter() - t0, "time": time.time(),
                **exchange_fields(self.engine),
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

    def _step_report(self, step: int, outcome: Any, record: protocol.GenerationRecord, size: int,
                     lr: float | None) -> dict[str, Any]:
        """Step ``step``'s record for the coordinator (its time and a callback's stop are filled in
        at the step's end)."""
        report = {
            "type": "step", "step": step, "loss": outcome.loss, "samples": getattr(self.engine, "step_samples", self.job.global_batch_size),
            "step_time_s": 0.0, "workers": size, "generation": record.generation,
            "vns": record.assignment, "members": record.members, "compute_s": outcome.compute_s,
            "vn_sizes": record.vn_sizes,
            "time": time.time(),
            # the training loop's fields (records/: metrics.jsonl), checked by the coordinator
            "metrics": {str(k): float(v) for k, v in (outcome.metrics or {}).items()},
            "grad_norm": outcome.grad_norm, "skipped": bool(outcome.skipped),
            "loss_scale": outcome.loss_scale, "lr": lr, "peak_tflops": self.peak_tflops, "stop_reason": None,
        }
        if outcome.breakdown_raw is not None:  # of the previous step (it rode in this one's reduction)
            # raw: the coordinator derives the parts (breakdown.from_report), off rank 0's step
            report["breakdown_raw"] = outcome.breakdown_raw.to_report()
            report["breakdown_step"] = step - 1
        return report

    def _train(self, record: protocol.GenerationRecord, group: Group, step: int, t_prev: float) -> str:
        cfg, engine, rank = self.cfg, self.engine, group.rank
        profiler = self.profiler
        while step < cfg.total_steps:
            # Rank 0's control position, read by the engine when it packs the step's statistics (not
            # now): a command given while the step computes (Ctrl-C's stop) lands at this step's
            # boundary, not the next one's.
            heartbeat = self.heartbeat
            control = (lambda: heartbeat.control_seq) if rank == 0 else 0
            lr = engine.learning_rate()  # the rate this step uses (a scheduler moves it after the step)
            if profiler is not None:
                profiler.before(step)
            outcome = engine.step(step, control)
            self.heartbeat.stepped()  # every member entered the step's all-reduce: a liveness event
            if profiler is not None:
                profiler.after(step)
            if outcome.bad_vns:
                self._non_finite(outcome, step, group)
            step += 1
            self.progress = Progress(step=step, control=self.progress.control)
            # The step is applied: its record exists from now on, before any collective below can
            # break the generation (a callback's stop agreement, the boundary's work); the member
            # that forms the next generation re-sends it, so a step is never applied unrecorded.
            report = self.last_report = self._step_report(step - 1, outcome, record, group.size, lr)
            stop = False
            if self.callbacks:  # part of the step's time: a callback's work is the job's
                self.callbacks.step_end(StepInfo(
                    step=step - 1, loss=outcome.loss, metrics=dict(report["metrics"]), grad_norm=outcome.grad_norm,
                    skipped=outcome.skipped, lr=lr, workers=group.size, rank=rank, model=engine.model))
                stop = self.callbacks.agree_stop(group) and step < cfg.total_steps  # collective
            now = time.perf_counter()
            report["step_time_s"], t_prev = now - t_prev, now
            if stop:
                report["stop_reason"] = (self.callbacks.stop_reason
                                         or f"a callback on another worker asked to stop after step {step - 1}")
            self.engine.boundary(group, step, self.boundary)  # collective work (every member)
            if self.notice is not None and self.notice.given.is_set() and not self._noticed:
                self._noticed = True  # reported once, at a step boundary (the reporter is not shared)
                self.report({"type": "notice", "step": step})
            if rank != 0:
                self.report.flush()  # what the heartbeat thread refused, if anything
            else:
                self.report(report)
                engine.boundary_on_rank0(step, self.boundary)  # what rank 0 does alone
                t_prev = time.perf_counter()  # checkpoint and evaluation time is not step time
            if stop:  # every member agreed on it in this boundary's all-reduce
                return "stop"
            if outcome.control > self.progress.control:
                commands = [self._command(n) for n in range(self.progress.control + 1, outcome.control + 1)]
                ops = [c["op"] for c in commands]
                apply_commands(engine, commands, self.id, step)  # slowdowns, batch changes from this step
                self.progress = Progress(step=step, control=outcome.control)
                if "stop" in ops:
                    return "stop"
                if "regroup" in ops:
                    # what a leaving member holds is gathered (or, sharded parameters: moved) now
                    nxt = [c for c in commands if c["op"] == "regroup"][-1]
                    engine.before_regroup(self._successor(record, nxt) if getattr(engine, "wants_successor", False) else None)
                    return "regroup"
        return "done"

    def _successor(self, record: protocol.GenerationRecord, command: dict[str, Any]) -> Successor:
        """The generation a regroup command announces (published before the command), as this
        generation's members see it: the member lists a resize of sharded state moves by."""
        gen = int(command["generation"])
        nxt = self.read_signed(protocol.generation_key(gen), lambda raw: protocol.parse_generation(self.run_key, raw, gen),
                               f"generation {gen}")
        return Successor(tuple(record.members), tuple(nxt.members))

    def _command(self, n: int) -> dict[str, Any]:
        """Control command ``n``, verified (by the heartbeat thread, or here)."""
        command = self.heartbeat.commands.get(n)
        if command is None:
            command = self.read_signed(protocol.control_key(n),
                                       lambda raw: protocol.parse_command(self.run_key, raw, n), f"command {n}")
        return command

    def _non_finite(self, outcome, step: int, group: Group) -> None:
        path = os.path.join(self.cfg.state_dir, "checkpoint.pt")
        # every member learnt of the bad VNs from the same reduction
        state = self.boundary.whole_state(self.engine, group, step)
        if group.rank == 0:
            save_state(path, state)
        what = self.engine.non_finite_note(step, path)
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
        self.engine.close()  # its loader threads, if any
        self.boundary.drain()  # a sharded checkpoint in flight completes before the final state
        state = self.boundary.whole_state(self.engine, group, step)
        if group.rank == 0:
            if job.evaluate is not None and self.boundary.last_eval_step != step:
                self.boundary.evaluate(self.engine.model, step)
                if "callbacks" in state:  # what on_eval did to them
                    state["callbacks"] = self.callbacks.state_dict()
            save_state(os.path.join(self.cfg.state_dir, "final.pt"), state)
        if self.callbacks:  # before "done": a tracker closing its run (wandb.finish) is not cut short
            self.callbacks.finished(step, group.rank)
        self.report({"type": "done", "step": step, "rank": group.rank, "peak_rss_mib": peak_rss_mib(),
                     "peak_device_mib": peak_device_mib(self.device),
                     **self.engine.final_report()})
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
        self.engine.close()
        self.boundary.drain()  # its part of a sharded checkpoint in flight is written before it exits
        parts = where.split()
        if len(parts) == 2:
            try:
                self.store.wait([protocol.formed_key(int(parts[1]))], datetime.timedelta(seconds=10))
            except Exception:
                pass
        for old in self.retired:
            old.close()


def exchange_fields(engine: Any) -> dict[str, Any]:
    """Deterministic mode's exchange for this generation, for the ``formed`` report (and the run's
    events): ``{"exchange": name, "exchange_reason": why}``, both None without one."""
    choice = getattr(engine, "exchange_choice", None)
    if not choice:
        return {"exchange": None, "exchange_reason": None}
    return {"exchange": str(choice[0]), "exchange_reason": str(choice[1])[:1000]}
