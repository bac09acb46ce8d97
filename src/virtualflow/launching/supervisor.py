"""The supervising loop of a running job, in the launching process.

:class:`Supervisor` wires the parts of a run together — the coordinator (store and records),
the backend (where workers run), the membership controller (generations) and the autoscaler's
executor — and runs the monitor loop in a thread: it polls the workers' reports, lets the
backend serve joins, takes resize requests (from this process, and signed ones from outside),
ticks the controller and the autoscaler, and ends the job when every member has finished or
something has failed. It writes ``status.json`` twice a second and ``summary.json`` at the end.

It owns no policy: the controller decides generations, the autoscaler's policy decides sizes.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from virtualflow.backends import Attachment, Backend
from virtualflow.comm import auth
from virtualflow.control.autoscale import Limits
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.status_pace import StatusPace, monitor_tick_s
from virtualflow.launching import outcome
from virtualflow.launching.composition import check_batch_schedule
from virtualflow.launching.requests import ResizeRequests
from virtualflow.plan.batch_schedule import batch_events
from virtualflow.plan.flops import describe as describe_throughput, run_throughput
from virtualflow.plan.vnmap import pipeline_assignment
from virtualflow.control.membership import FallbackRestart, JobFailed, MembershipController, Phase
from virtualflow.config.job import Job, JobSource
from virtualflow.config.options import LaunchOptions
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.records.result import Result, TrainingError
from virtualflow.records.rundir import RunLock, disk_full_error, remove_temporaries, write_json
from virtualflow.runtime import breakdown
from virtualflow.runtime.worker_config import WorkerConfig

logger = logging.getLogger("virtualflow")

# Errors that are the consequence of another worker's failure, not a root cause.


@dataclass(slots=True, kw_only=True)
class RunSetup:
    """Everything :func:`virtualflow.launch` decided before starting a run."""

    job: Job
    source: JobSource
    overrides: dict[str, Any]
    options: LaunchOptions
    backend: Backend
    total_steps: int
    steps_per_epoch: int
    assignment: list[list[int]]
    run_dir: str | None
    state_dir: str
    own_state_dir: bool
    """A temporary state directory (no ``run_dir``): removed after a successful run."""
    threads: int
    resume_path: str | None
    resume_step: int
    token: str
    token_path: str
    autoscale: Any = None
    """The autoscaler's policy object (None without autoscaling)."""
    autoscale_limits: Limits | None = None
    run_lock: RunLock | None = None
    """The run directory's lock (:class:`virtualflow.records.rundir.RunLock`), released when the run ends."""
    streaming: bool = False
    """The job's data plan streams (a batch change is refused then, as a batch schedule is)."""


class ProgressRate:
    """The progress bar's pace: seconds per step, samples/s and the time left, from the workers'
    own step times (``step_time_s`` of each step record), smoothed (an exponential moving
    average, ``smoothing`` the weight of the newest step).

    Invariant: only *steady* steps count. The first step of every generation is left out (it
    pays for forming the group, a state transfer, first-touch allocations), and start-up (the
    workers importing torch and building the job) never is a step: a bar's own clock, started
    before the workers, turned 13 s of start-up into "13.25s/step" and a 24-minute ETA. Until
    one steady step is known there is no estimate (None)."""

    def __init__(self, total_steps: int, smoothing: float = 0.2, tokens_per_sample: int | None = None) -> None:
        self.total_steps = total_steps
        self.smoothing = smoothing
        self.tokens_per_sample = tokens_per_sample
        self.step_s: float | None = None
        self.samples_per_s: float | None = None
        self.mfu: float | None = None
        self.done = 0
        self._generation: int | None = None

    def add(self, record: dict[str, Any]) -> None:
        self.done = record["step"] + 1
        first = record["generation"] != self._generation
        self._generation = record["generation"]
        t = record["step_time_s"]
        if first or not t > 0:
            return
        a = self.smoothing
        rate = record["samples"] / t
        self.step_s = t if self.step_s is None else a * t + (1 - a) * self.step_s
        self.samples_per_s = rate if self.samples_per_s is None else a * rate + (1 - a) * self.samples_per_s
        mfu = record.get("mfu")
        if mfu is not None:
            self.mfu = mfu if self.mfu is None else a * mfu + (1 - a) * self.mfu

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the steady pace (None before a steady step)."""
        return None if self.step_s is None else max(0, self.total_steps - self.done) * self.step_s

    def describe(self, record: dict[str, Any]) -> str:
        """The bar's text after its count and elapsed time: ETA, s/step, samples/s (tokens/s, MFU
        when known), loss, the loss function's metrics, workers."""
        from tqdm import tqdm

        if self.step_s is None:
            pace = "eta ?"
        else:
            pace = f"eta {tqdm.format_interval(self.eta_s)}, {self.step_s:.3g} s/step, {self.samples_per_s:.0f} samples/s"
            more = describe_throughput({
                "tokens_per_s": self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None,
                "mfu": self.mfu})
            if more:
                pace += ", " + more
        metrics = "".join(f", {k} {v:.4g}" for k, v in list((record.get("metrics") or {}).items())[:4])
        return (f"{pace}, loss {record['loss']:.4f}{metrics}, "
                f"{record['workers']} worker{'s' if record['workers'] > 1 else ''}")


class Supervisor:
    """One running job, seen from the launching process: built from the :class:`RunSetup`, it
    starts the coordinator, attaches the backend with the workers' configuration
    (:func:`worker_config`), and owns the membership controller, the autoscaler's executor and
    the resize requests (:class:`~virtualflow.launching.requests.ResizeRequests`).
    :meth:`start` runs the monitor loop in a thread until the job ends; :attr:`result` or
    :attr:`error` then says how, and :attr:`finished` is set once every record is written.

    Invariant: it decides nothing itself (the controller decides generations, the autoscaler's
    policy sizes, :mod:`~virtualflow.launching.outcome` how an ending is worded); every part of
    the ending runs whatever the others raised (:meth:`_best_effort`)."""

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        opts = setup.options
        self.job = setup.job
        self.t0 = time.time()
        self.status_pace = StatusPace()
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.bar = None
        self.rate = ProgressRate(setup.total_steps, tokens_per_sample=self.job.tokens_per_sample)
        self.stop_reason: str | None = None
        """Why the job was asked to stop early (``stop()``, Ctrl-C, SIGTERM, a callback); None if it was not."""
        host, port = setup.backend.store_address()
        # One id per launch (a resumed run gets a new one): every signed message names it, so a
        # message captured from one run verifies in no other, even one sharing the token file.
        self.job_id = auth.new_job_id()
        run_key = auth.run_key(setup.token, self.job_id)
        self.coordinator = Coordinator(total_steps=setup.total_steps, run_dir=setup.run_dir, host=host, port=port,
                                       on_step=self._on_step, job_id=self.job_id, key=run_key,
                                       tokens_per_sample=self.job.tokens_per_sample,
                                       flops_per_sample=self.job.flops_per_sample, peak_tflops=opts.peak_tflops)
        self.coordinator.progress.step = setup.resume_step
        self.tensorboard = None
        if opts.tensorboard and setup.run_dir is not None:
            from virtualflow.observe.tensorboard import TensorBoardLog

            self.tensorboard = TensorBoardLog(os.path.join(setup.run_dir, "tensorboard"))
        self.config = worker_config(setup, self.coordinator.host, self.coordinator.port, self.job_id, run_key)
        self.backend = setup.backend
        self.backend.attach(Attachment(config=self.config, state_dir=setup.state_dir, store=self.coordinator.store,
                                       token=setup.token, grow=lambda: self.requests.grow_for_join(),
                                       event=self.coordinator.event))
        extra = {}
        if self.job.pipeline is not None:
            stages = self.job.pipeline.replica_workers  # the controller's unit: whole replicas (P x T)
            extra["assign"] = lambda V, n: pipeline_assignment(V, n, stages)
            extra.update(stages=stages, redundancy=self.job.pipeline.redundancy, tensor=self.job.pipeline.tensor)
        self.controller = MembershipController(
            self.coordinator, self.backend, opts,
            virtual_nodes=self.job.virtual_nodes, global_batch_size=self.job.global_batch_size,
            last_step=setup.resume_step, **extra,
        )
        # (made before the monitor loop serves the first join: ``grow`` above is called from it)
        self.requests = ResizeRequests(self.job, opts.min_workers, setup.token, self.job_id, self.coordinator,
                                       self.backend, self.controller, on_taken=lambda: self.write_status(force=True))
        self.autoscaler: AutoscaleExecutor | None = None
        if setup.autoscale is not None:
            assert setup.autoscale_limits is not None
            self.autoscaler = AutoscaleExecutor(
                setup.autoscale, self.controller, self.coordinator, limits=setup.autoscale_limits,
                global_batch_size=self.job.global_batch_size, virtual_nodes=self.job.virtual_nodes,
                total_steps=setup.total_steps, price_per_worker_hour=float(opts.price_per_worker_hour),
                start_time=self.t0, pipeline=self.job.pipeline,
            )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        s, job = self.setup, self.job
        # The first records are written before any worker starts: a run directory that cannot
        # take them (a full disk) fails here, in one line, with no worker left behind.
        try:
            self.coordinator.event(
                "start", job=job.name, global_batch_size=job.global_batch_size, virtual_nodes=job.virtual_nodes,
                seed=job.seed, workers=s.options.start_workers, total_steps=s.total_steps,
                deterministic=s.options.deterministic, reduction=s.options.reduction, backend=self.backend.name,
                threads_per_worker=s.threads,
                min_workers=s.options.min_workers, resume_path=s.resume_path, resume_step=s.resume_step,
                autoscale=self.autoscale_info(),
            )
            for fields in batch_events(job):  # the recorded batch changes (Job.batch_schedule): a replay's input
                self.coordinator.event("batch", **fields)
            self.write_status(force=True)
        except OSError as exc:
            self._best_effort("closing the records", self.coordinator.close)
            full = disk_full_error(exc, getattr(exc, "filename", None) or s.state_dir)
            if full is not None:
                raise full from exc
            raise
        self.controller.start()
        if s.options.progress:
            from tqdm.auto import tqdm

            # The bar's own rate and ETA would count start-up as a step: ProgressRate gives both.
            self.bar = tqdm(total=s.total_steps, initial=s.resume_step, desc=job.name, unit="step", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self.bar.set_postfix_str("starting the workers")
        self.thread = threading.Thread(target=self._monitor, name="virtualflow-monitor", daemon=True)
        self.thread.start()

    def _on_step(self, record: dict[str, Any]) -> None:
        if self.tensorboard is not None:
            self.tensorboard.step(record)
        if self.bar is not None:
            self.rate.add(record)
            self.bar.set_postfix_str(self.rate.describe(record), refresh=False)
            self.bar.update(1)

    def _monitor(self) -> None:
        coord, progress, ctl = self.coordinator, self.coordinator.progress, self.controller
        try:
            while True:
                reports = coord.poll()
                if progress.stop_request is not None and self.stop_reason is None:
                    # A callback asked to stop: the workers agreed on it and stop by themselves.
                    self.stop_reason = progress.stop_request
                    progress.state = "stopping"
                if progress.errors:
                    time.sleep(0.3)  # let the other workers' reports arrive: pick the root cause
                    coord.poll()
                    raise outcome.worker_failure(self.coordinator.progress.errors, self.setup)
                self.backend.serve(reports)
                self.requests.take()
                self.requests.observe(reports)  # a batch change's first step: its ``batch`` record
                if self.stop_reason is not None and ctl.phase in (Phase.NEW, Phase.FORMING):
                    # No generation has formed, so no step boundary will come to stop at (the
                    # workers may never come: external ones): end now; nothing was trained.
                    raise TrainingError(f"stopped ({self.stop_reason}) before the first generation formed: no step "
                                        f"was trained in this launch, so there is no new state to save")
                try:
                    ctl.tick(reports)
                except JobFailed as exc:
                    err = TrainingError(outcome.job_failed_message(exc, self.controller.failures, self.backend, self.setup))
                    err.fallback_restart = isinstance(exc, FallbackRestart)
                    raise err from None
                except ValueError as exc:  # e.g. a grow the Ray cluster cannot place
                    raise TrainingError(f"{exc} ({outcome.logs_where(self.setup)})") from None
                if self.autoscaler is not None:
                    self.autoscaler.update(reports)
                if progress.state == "starting" and progress.step > self.setup.resume_step:
                    progress.state = "running"
                if progress.done and self._all_exited():
                    self.requests.observe(coord.poll())
                    self.backend.terminate_all()  # newcomers still starting, if any
                    self.result = outcome.collect_result(self.setup, self.coordinator, self.controller, self.autoscaler,
                                                         stop_reason=self.stop_reason,
                                                         throughput=self.throughput(self.coordinator.history))
                    progress.state = "stopped" if self.result.stopped else "done"
                    # The final state is written: a record that no longer fits does not undo that.
                    self._best_effort("the done event", lambda: coord.event(
                        "done", steps=self.result.steps, stopped=self.result.stopped, stop_reason=self.stop_reason,
                        wall_time_s=time.time() - self.t0, generations=ctl.generation + 1,
                        failures=len(ctl.failures)))
                    return
                self.write_status()
                # The launcher must not take CPU from the workers; it looks closer during changes.
                time.sleep(monitor_tick_s(len(ctl.members), ctl.busy))
        except BaseException as exc:  # noqa: BLE001 - reported through wait()
            full = disk_full_error(exc, getattr(exc, "filename", None) or self.setup.state_dir)
            if full is not None and not isinstance(exc, TrainingError):  # the launcher's own records
                err = TrainingError(f"the run's records cannot be written: {full}; {outcome.disk_full_advice(self.setup)}")
                err.__cause__, err.disk_full = exc, True
                exc = err
            self.error = exc
            progress.state = "failed"
            # A failed job's workers have nothing left to write; one blocked in a collective (a
            # SIGTERM while training is only a preemption notice to it) is killed after 1 s.
            self._best_effort("stopping the workers", lambda: self.backend.terminate_all(grace_s=1.0))
            self._best_effort("removing the stopped workers' partial writes", self._remove_partial_writes)
            self._best_effort("the failed event",
                              lambda: coord.event("failed", error=str(exc), step=getattr(exc, "step", None)))
        finally:
            # Every part of the ending runs, whatever the ones before it raised (a full disk fails
            # every write): a monitor that died here left a job that never ended, which not even
            # SIGTERM could stop. Records that cannot be written keep their last complete version.
            if self.bar is not None:
                self._best_effort("closing the progress bar", self.bar.close)
            if self.tensorboard is not None:
                self._best_effort("closing the TensorBoard log", self.tensorboard.close)
            self._best_effort("summary.json", self.write_summary)
            self._best_effort("status.json", lambda: self.write_status(force=True))
            self._best_effort("closing the records", coord.close)
            if self.setup.own_state_dir and self.error is None:
                shutil.rmtree(self.setup.state_dir, ignore_errors=True)
            if self.setup.run_lock is not None:
                self._best_effort("releasing the run directory's lock", self.setup.run_lock.release)
            self.finished.set()

    def _best_effort(self, what: str, fn: Any) -> bool:
        """Run ``fn``; an exception is logged (a warning; at debug level for one more write that a
        full disk, already reported, refused), not raised; returns whether ``fn`` succeeded. For
        the parts of a run's ending, each of which must run whatever the others did."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - logged; the ending goes on
            full = disk_full_error(exc, getattr(exc, "filename", None) or self.setup.state_dir)
            # After a full disk every record fails alike: the run's error already says so.
            quiet = full is not None and getattr(self.error, "disk_full", False)
            logger.log(logging.DEBUG if quiet else logging.WARNING, "%s: %s", what,
                       full if full is not None else f"{type(exc).__name__}: {exc}")
            return False

    def _remove_partial_writes(self) -> None:
        """A worker killed while it wrote a state leaves the temporary file of that write; the
        job has failed and its workers are stopped, so no write of theirs is in progress: remove
        what they left (the states they completed stay)."""
        pids = {pid for w in self.backend.poll() if (pid := self.backend.pid(w)) is not None}
        for folder in (self.setup.state_dir, os.path.join(self.setup.state_dir, "checkpoints")):
            removed = remove_temporaries(folder, pids)
            if removed:
                logger.debug("removed %s in %s (writes the stopped workers did not finish)", ", ".join(removed), folder)

    def _all_exited(self) -> bool:
        codes = self.backend.poll()
        return all(codes.get(w) is not None for w in self.controller.members)

    # -- requests ----------------------------------------------------------------------------
    def request_resize(self, workers: int) -> None:
        """A resize asked in this process (:meth:`JobHandle.resize`); checked, then queued."""
        self.requests.ask(workers)

    def request_batch(self, virtual_nodes: int, lr_rule: Any) -> None:
        """A batch change asked in this process (:meth:`JobHandle.change_batch`); checked (what a
        batch schedule does not combine with, as at launch), then queued."""
        asked = SimpleNamespace(batch_schedule=[(self.coordinator.progress.step + 1, max(virtual_nodes, 1))],
                                virtual_nodes=self.job.virtual_nodes, pipeline=self.job.pipeline)
        check_batch_schedule(asked, self.setup.streaming, self.setup.options, 1)
        self.requests.ask_batch(virtual_nodes, lr_rule)

    # -- results and records -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        p, ctl = self.coordinator.progress, self.controller
        return {
            "state": p.state,
            "stop_reason": self.stop_reason,
            "step": p.step,
            "total_steps": p.total_steps,
            "generation": ctl.generation,
            "formed_generation": ctl.formed,
            "phase": ctl.phase.value,
            "balance": ctl.balance,
            "predicted_step_s": ctl.predicted_step_s,
            "measured_step_s": ctl.measured_step_s,
            "target_workers": ctl.target,
            "workers": ctl.worker_table(),
            "recent_step_times_s": [round(h["step_time_s"], 6) for h in self.coordinator.history[-10:]],
            "loss": p.last_loss,
            "samples_per_s": p.samples_per_s,
            "metrics": dict(p.metrics),
            **self.training_fields(),
            "failures": len(ctl.failures),
            "redundancy": ({"layout": [list(r) for r in ctl.layout] if ctl.layout is not None else None,
                            "events": ctl.bamboo_events[-5:]} if ctl.redundancy else None),
            "run_dir": self.setup.run_dir,
            "autoscale": self.autoscale_info(),
            "breakdown": self.breakdown(self.coordinator.history[-20:]),
        }

    def training_fields(self) -> dict[str, Any]:
        """``status.json``'s view of the last step (its record's fields,
        :data:`virtualflow.control.coordinator.STEP_FIELDS`):
        ``train_metrics`` (the loss function's metrics; ``metrics`` holds the last evaluation's),
        ``grad_norm``, ``lr``, ``loss_scale``, ``tokens_per_s``, ``mfu``; ``skipped_steps`` over
        the run and the ``peak_tflops`` MFU is measured against."""
        p = self.coordinator.progress
        last = p.last_step or {}
        return {"train_metrics": dict(last.get("metrics") or {}), "grad_norm": last.get("grad_norm"),
                "lr": last.get("lr"), "loss_scale": last.get("loss_scale"), "tokens_per_s": last.get("tokens_per_s"),
                "mfu": last.get("mfu"), "skipped_steps": p.skipped_steps, "peak_tflops": self.coordinator.peak_tflops}

    def throughput(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The run's mean throughput over its steady steps (all but the first): samples/s,
        tokens/s and MFU (:func:`virtualflow.plan.flops.run_throughput`), and the peak used."""
        steps = history[1:] or history
        coord = self.coordinator
        out = run_throughput([(h["samples"], h["step_time_s"], h["workers"]) for h in steps],
                             tokens_per_sample=self.job.tokens_per_sample, flops_per_sample=self.job.flops_per_sample,
                             peak_tflops_per_worker=coord.peak_tflops)
        return {**out, "peak_tflops": coord.peak_tflops}

    def breakdown(self, history: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Where the step time went over ``history`` (runtime/breakdown.py), or None."""
        summary = breakdown.summarize(history, loader_workers=self.setup.options.loader_workers)
        return summary.as_dict() if summary is not None else None

    def autoscale_info(self) -> dict[str, Any] | None:
        a = self.autoscaler
        if a is None:
            return None
        last = a.decisions[-1] if a.decisions else None
        return {"policy": a.policy.name, "min_workers": a.limits.min_workers, "max_workers": a.limits.max_workers,
                "settled_at": a.settled_at, "decisions": len(a.decisions),
                "last_decision": last["reason"] if last else None, "disabled": a.disabled}

    def write_status(self, force: bool = False) -> None:
        """``status.json`` in the run directory: what ``virtualflow status`` prints, and how
        ``virtualflow resize`` reaches the coordinator (host, port, pid, token file)."""
        run_dir = self.setup.run_dir
        if run_dir is not None:  # paced by its cost (control/status_pace.py): O(W) per write
            self.status_pace.write(lambda: self._write_status(run_dir), force=force)

    def _write_status(self, run_dir: str) -> None:
        data = self.status()
        data.update(
            job=self.job.name,
            virtual_nodes=self.job.virtual_nodes,
            pipeline_stages=self.job.pipeline.stages if self.job.pipeline is not None else None,
            replica_workers=self.job.pipeline.replica_workers if self.job.pipeline is not None else None,
            min_workers=self.setup.options.min_workers,
            coordinator={"host": self.coordinator.host, "port": self.coordinator.port, "pid": os.getpid(),
                         "token_file": self.setup.token_path},
            backend=self.backend.name,
            job_id=self.job_id,
            taken_requests=list(self.requests.taken),
            updated=time.time(),
        )
        write_json(os.path.join(run_dir, "status.json"), data)

    def write_summary(self) -> None:
        s, run_dir = self.setup, self.setup.run_dir
        if run_dir is None:
            return
        history, ctl, p = self.coordinator.history, self.controller, self.coordinator.progress
        times = [h["step_time_s"] for h in history[1:]] or [h["step_time_s"] for h in history]
        mean_step = sum(times) / len(times) if times else None
        rates = self.throughput(history)
        summary = {
            "job": self.job.name,
            "status": p.state,
            "stop_reason": self.stop_reason,
            "error": str(self.error) if self.error else None,
            "global_batch_size": self.job.global_batch_size,
            "virtual_nodes": self.job.virtual_nodes,
            "pipeline": _pipeline_summary(self.job.pipeline),
            "seed": self.job.seed,
            "workers": s.options.start_workers,
            "workers_final": len(ctl.members),
            "assignment": s.assignment,
            "generations": ctl.generation + 1,
            "failures": ctl.failures,
            "final_map": [{"worker": w, "vns": a, "time_per_vn_s": ctl.time_per_vn.get(w)}
                          for w, a in zip(ctl.members, ctl.assignment)],
            "vn_sizes": ctl.vn_sizes,
            "balance": ctl.balance,
            "autoscale": self.autoscaler.summary() if self.autoscaler is not None else None,
            "predicted_step_s": ctl.predicted_step_s,
            "deterministic": s.options.deterministic,
            "reduction": s.options.reduction,
            "backend": self.backend.name,
            "threads_per_worker": s.threads,
            "steps_total": s.total_steps,
            "steps_completed": p.step,
            "resumed_from": s.resume_path,
            "final_loss": history[-1]["loss"] if history else None,
            "final_train_metrics": dict(history[-1]["metrics"]) if history else {},
            "metrics": p.metrics,
            "mean_step_time_s": mean_step,
            "breakdown": self.breakdown(history),
            "samples_per_s": self.job.global_batch_size / mean_step if mean_step else None,
            "tokens_per_sample": self.job.tokens_per_sample,
            "tokens_per_s": rates["tokens_per_s"],
            "flops_per_sample": self.job.flops_per_sample,
            "peak_tflops_per_worker": rates["peak_tflops"],
            "mfu": rates["mfu"],
            "skipped_steps": p.skipped_steps,
            "wall_time_s": time.time() - self.t0,
            "peak_rss_mib": {str(w): i.get("peak_rss_mib") for w, i in p.workers.items()},
            "peak_device_mib": {str(w): i.get("peak_device_mib") for w, i in p.workers.items()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "virtualflow": _version()},
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()},
        }
        write_json(os.path.join(run_dir, "summary.json"), summary)


def worker_config(setup: RunSetup, store_host: str, store_port: int, job_id: str, run_key: str) -> WorkerConfig:
    """What every worker of the run is told: the options' worker knobs whole
    (:meth:`WorkerOptions.of`) and what this launch resolved (the store, the steps, the threads,
    the resume state, the slowdowns of the starting workers, the run's id and key)."""
    opts = setup.options
    return WorkerConfig(
        options=WorkerOptions.of(opts), store_host=store_host, store_port=store_port, job_source=setup.source,
        total_steps=setup.total_steps, state_dir=setup.state_dir, overrides=setup.overrides, threads=setup.threads,
        resume_path=setup.resume_path, initial_workers=opts.start_workers,
        slowdowns={i: s.slowdown for i, s in enumerate(opts.specs) if s.slowdown != 1.0},
        job_id=job_id, run_key=run_key, interface=opts.interface,
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("virtualflow")
    except Exception:  # noqa: BLE001 - not installed (a source tree on sys.path)
        return "unknown"


def _pipeline_summary(pipeline: Any) -> dict[str, Any] | None:
    if pipeline is None:
        return None
    return {"stages": pipeline.stages, "tensor": pipeline.tensor, "schedule": pipeline.schedule, "chunks": pipeline.chunks,
            "split": list(pipeline.split) if not isinstance(pipeline.split, str) else pipeline.split}
