"""The coordinator: owns the job's store, its membership generations and its records.

It hosts a ``torch.distributed.TCPStore`` listening on ``host`` only (loopback in local mode, the
node's address on Ray, the ``--listen`` address with external workers; a free port chosen by the
OS unless ``port`` is given),
publishes membership as numbered generations, accepts control commands (``stop`` now; resize
in the elasticity work) and turns the workers' reports into the run's records:
``events.jsonl`` (join, generation, step, eval, error, done), ``metrics.jsonl`` (one line per
step, fields :data:`STEP_FIELDS`) and the in-memory history returned to the user. It logs once
for the whole job.

Everything it writes that workers act on (generation records, next pointers, commands, abort
flags) is signed with the run key, and every report it reads is checked
(:func:`virtualflow.comm.protocol.ReportReader`) before it counts: a report that does not verify
or is not of its schema is dropped and logged (``report_rejected``, bounded by
:class:`~virtualflow.comm.rejects.RejectLog`), never raised into the job's monitor.

It starts no processes and reads no environment: backends do that.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist

from virtualflow.comm import auth, protocol
from virtualflow.comm.rejects import RejectLog
from virtualflow.plan.flops import throughput
from virtualflow.records.rundir import json_text
from virtualflow.runtime import breakdown, dataset_check
from virtualflow.runtime.channel import ABORT_MARK

logger = logging.getLogger(__name__)

STEP_FIELDS = ("step", "loss", "samples", "step_time_s", "workers", "generation", "vns", "metrics", "grad_norm",
               "skipped", "loss_scale", "lr", "samples_per_s", "tokens_per_s", "mfu")
"""The fields of every step record (``metrics.jsonl``, ``Result.history``), in this order, always
present (null where they do not apply); ``breakdown`` and ``breakdown_step`` follow when the step
breakdown was measured. ``metrics``: the loss function's extra metrics (each the mean over the
global batch); ``grad_norm``: the whole step's gradient norm before clipping (null without
``max_grad_norm``); ``skipped``: loss scaling skipped the step; ``loss_scale``: the scale the
step used (``16-mixed``); ``lr``: the learning rate the step used (the optimizer's first
parameter group); ``samples_per_s`` = samples / step_time_s; ``tokens_per_s`` (with
``Job.tokens_per_sample``); ``mfu``: model FLOPs utilisation, a fraction (with
``Job.flops_per_sample`` and a peak: ``--peak-tflops`` or the device's)."""
MAX_METRICS = 256
"""A step report's metrics beyond this many are dropped (a report is untrusted input)."""


class JsonlWriter:
    """Append-only JSON-lines file (or nothing when ``path`` is None); flushed per line."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._f = open(path, "a", buffering=1) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json_text(record) + "\n")  # standard JSON: a NaN loss as "nan"

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass(slots=True)
class JobProgress:
    """What the coordinator knows about the running job (the source of ``JobHandle.status``)."""

    state: str = "starting"  # starting | running | stopping | done | failed | stopped
    step: int = 0  # steps completed
    total_steps: int = 0
    generation: int = -1
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    last_loss: float | None = None
    samples_per_s: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """The last evaluation's metrics."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    last_step: dict[str, Any] | None = None
    """The last step record (:data:`STEP_FIELDS`)."""
    skipped_steps: int = 0
    """Steps loss scaling skipped."""
    stop_request: str | None = None
    """Why a callback asked the job to stop early (the workers stop by themselves), or None."""


class Coordinator:
    def __init__(
        self,
        *,
        total_steps: int,
        run_dir: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        store_timeout_s: float = 120.0,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        job_id: str | None = None,
        key: str | None = None,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_tflops: float | None = None,
    ) -> None:
        self.store = _listening_store(host, datetime.timedelta(seconds=store_timeout_s), port)
        self.job_id = job_id or auth.new_job_id()
        self.run = protocol.RunKey(key or auth.new_token(), self.job_id)
        """Signs what workers act on and checks their reports (a random key when none is given:
        tests that play the workers read it from here)."""
        self.host = host
        self.port = self.store.port
        self.run_dir = run_dir
        self.events = JsonlWriter(os.path.join(run_dir, "events.jsonl") if run_dir else None)
        self.metrics_log = JsonlWriter(os.path.join(run_dir, "metrics.jsonl") if run_dir else None)
        self.progress = JobProgress(total_steps=total_steps)
        self.history: list[dict[str, Any]] = []
        self.eval_history: list[dict[str, Any]] = []
        self.on_step = on_step
        self.tokens_per_sample, self.flops_per_sample = tokens_per_sample, flops_per_sample
        self.peak_tflops = peak_tflops
        """One worker's peak TFLOP/s for MFU: the launch option, else what the workers' devices
        report (in their step reports), else None."""
        self._peak_given = peak_tflops is not None
        self._control_seq = 0
        self.store.set(protocol.JOB_KEY, self.job_id)
        self.store.set(protocol.CONTROL_SEQ_KEY, "0")
        self._t0 = time.time()
        self.reports = protocol.ReportReader(self.run)
        self.rejects = RejectLog(self.event, logger)
        """Every refused message of the job is logged through this (bounded)."""
        self._aborted: set[int] = set()
        """Generations whose abort flag is written (:meth:`abort`)."""
        self.fenced: dict[int, int] = {}
        """Worker id -> the last generation it was assigned to, for workers fenced out (silent for
        the heartbeat timeout): their reports are refused from then on (:meth:`fence`)."""
        self.dataset_reference: tuple[int, dict[str, str]] | None = None
        """The first worker's id and its dataset's fingerprint: every later join is compared
        with it (:meth:`_check_dataset`)."""

    # -- events ---------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        self.events.write({"time": time.time(), "elapsed_s": time.time() - self._t0, "event": kind, **fields})

    # -- generations and commands ---------------------------------------------------------
    def publish_generation(self, generation: int, members: Sequence[int], assignment: Sequence[Sequence[int]],
                           start_step: int, *, hold: bool = False, reason: str = "",
                           vn_sizes: list[int] | None = None, layout: list[list[int]] | None = None) -> None:
        record = protocol.GenerationRecord(generation, list(members), [list(a) for a in assignment], start_step,
                                           hold=hold, reason=reason, vn_sizes=vn_sizes, layout=layout)
        self.store.set(protocol.generation_key(generation), record.seal(self.run))
        self.store.set(protocol.GENERATION_KEY, str(generation))
        self.progress.generation = generation
        self.event("generation", generation=generation, members=list(members), assignment=record.assignment,
                   start_step=start_step, hold=hold, reason=reason, vn_sizes=vn_sizes,
                   **({"layout": layout} if layout is not None else {}))
        if generation > 0:
            ids = ", ".join(f"worker {w} runs VNs {_span(a)}" for w, a in zip(members, assignment))
            logger.info("generation %d (%s, from step %d)%s: %s", generation, reason, start_step,
                        " HOLD" if hold else "", ids)

    def command(self, op: str, **fields: Any) -> int:
        """Queue a control command; workers apply it together at a step boundary."""
        self._control_seq += 1
        self.store.set(protocol.control_key(self._control_seq),
                       protocol.seal_command(self.run, self._control_seq, op, fields))
        self.store.set(protocol.CONTROL_SEQ_KEY, str(self._control_seq))
        self.event("command", op=op, seq=self._control_seq, **fields)
        return self._control_seq

    def point(self, worker: int, after: int, to: str) -> None:
        """Tell ``worker`` where to go once generation ``after`` ends: a generation number,
        ``leave <g>`` or ``fail`` (``vf/member/<worker>/next/<after>``, signed)."""
        self.store.set(protocol.next_key(worker, after), protocol.seal_next(self.run, worker, after, to))

    def point_many(self, pointers: Sequence[tuple[int, int, str]]) -> None:
        """:meth:`point` for many ``(worker, after, to)`` at once, in one store round trip
        (``multi_set``): a generation's pointers are one call, not one per member."""
        if pointers:
            self.store.multi_set([protocol.next_key(w, after) for w, after, _ in pointers],
                                 [protocol.seal_next(self.run, w, after, to) for w, after, to in pointers])

    def fence(self, worker: int, generation: int, cause: str = "") -> None:
        """Refuse every later report of ``worker`` (it was fenced out after ``generation``): a
        worker cut off by a partition still holds a valid run key, and when the partition heals
        its reports (a fault of its old generation, a step, an error) must not count."""
        self.fenced[worker] = generation
        self.event("fenced", worker=worker, generation=generation, cause=cause)

    def abort(self, generation: int, beating: Iterable[int] = ()) -> None:
        """Declare generation ``generation`` broken (its members stop waiting on each other).
        Written once per generation: every member that saw the break reports a fault, and each
        asked for this flag again (W signed writes per failure). Then every worker of
        ``beating`` (those whose heartbeats are watched) gets :data:`ABORT_MARK` added to its
        heartbeat counter, after the flag: its next beat sees the mark and reads the flag, so a
        beat costs one store call, not one plus an abort check (one call per worker per abort
        instead of one per worker per beat). The generation's rendezvous key is set with the flag,
        after it, in the same call (:func:`~virtualflow.runtime.channel.rendezvous`): members still
        waiting for the others wake, read the flag and give the generation up."""
        if generation in self._aborted:
            return
        self._aborted.add(generation)
        self.store.multi_set([protocol.abort_key(generation), protocol.ready_key(generation)],
                             [protocol.seal_abort(self.run, generation), "1"])
        for w in beating:
            self.store.add(protocol.heartbeat_key(w), ABORT_MARK)

    # -- reports ---------------------------------------------------------------------------
    def poll(self) -> list[dict[str, Any]]:
        """Process every report queued so far; returns those that verify and fit their schema
        (the others are dropped and logged)."""
        reports = []
        for raw in protocol.pop_raw(self.store, protocol.REPORTS_QUEUE):
            try:
                r = self.reports.parse(raw)
            except ValueError as exc:
                self.rejects("report_rejected", exc, raw)
                continue
            if r["worker"] in self.fenced:
                g = self.fenced[r["worker"]]
                self.rejects("report_rejected", f"worker {r['worker']} was fenced out after generation {g}: its "
                             f"{r['type']} report is refused", raw, worker=r["worker"], type=r["type"],
                             generation=r.get("generation"), fenced_after=g)
                continue
            reports.append(r)
        for r in reports:
            kind = r.get("type")
            if kind == "step":
                if "breakdown_raw" in r:  # rank 0 sends every rank's raw timing: the parts are derived here
                    r["breakdown"] = breakdown.from_report(r.pop("breakdown_raw"), r.get("members"))
                self._on_step(r)
            elif kind == "join":
                self.progress.workers[r["worker"]] = {"pid": r["pid"], "setup_s": r["setup_s"]}
                self.event("join", worker=r["worker"], pid=r["pid"], setup_s=r["setup_s"])
                self._check_dataset(r)
            elif kind == "eval":
                self.progress.metrics = r["metrics"]
                self.eval_history.append({"step": r["step"], **r["metrics"]})
                self.event("eval", step=r["step"], metrics=r["metrics"], eval_time_s=r["eval_time_s"])
                logger.info("eval after %d steps: %s", r["step"], _fmt_metrics(r["metrics"]))
            elif kind == "error":
                self.progress.errors.append(r)
                self.event("error", worker=r["worker"], pid=r["pid"], error=r["error"], step=r.get("step"), traceback=r["traceback"])
            elif kind == "done":
                self.progress.workers.setdefault(r["worker"], {}).update(peak_rss_mib=r["peak_rss_mib"],
                                                                          peak_device_mib=r.get("peak_device_mib"),
                                                                          optimizer_bytes=r["optimizer_bytes"],
                                                                          replica_bytes=r["replica_bytes"],
                                                                          replica_refresh_s=r["replica_refresh_s"],
                                                                          redundant_forwards=r["redundant_forwards"])
                if r.get("rank") == 0:
                    self.progress.done = True
            elif kind == "checkpoint":
                self.event("checkpoint", step=r["step"], path=r["path"], save_s=r["save_s"])
            elif kind == "rejected":  # a worker refused something it read from the store
                self.rejects(f"{r['channel'].partition(' ')[0]}_rejected", r["reason"], worker=r["worker"],
                             channel=r["channel"], message=r["message"], bytes=r["bytes"])
        if self.progress.state == "starting" and self.history:
            self.progress.state = "running"
        return reports

    def _check_dataset(self, r: dict[str, Any]) -> None:
        """Compare a joining worker's dataset fingerprint with the first worker's: a difference
        fails the job (an error of that worker, as if it had reported one), since the same sample
        index would name different samples in different processes."""
        fp = r.get("dataset")
        if fp is None:
            return  # that worker could not read its samples (it logged why): nothing to compare
        if self.dataset_reference is None:
            self.dataset_reference = (r["worker"], fp)
            return
        ref_worker, ref = self.dataset_reference
        problem = dataset_check.compare(ref, ref_worker, fp, r["worker"])
        if problem is None:
            return
        self.event("dataset_mismatch", worker=r["worker"], reference_worker=ref_worker, fingerprint=fp,
                   reference=ref)
        self.progress.errors.append({"type": "error", "worker": r["worker"], "pid": r["pid"], "seq": r["seq"],
                                     "error": f"DatasetMismatch: {problem}", "traceback": "", "step": None,
                                     "phase": "joining"})

    def _on_step(self, r: dict[str, Any]) -> None:
        if r["step"] < self.progress.step:
            return  # re-sent after a regroup and already recorded
        record = {
            "step": r["step"],
            "loss": r["loss"],
            "samples": r["samples"],
            "step_time_s": r["step_time_s"],
            "workers": r["workers"],
            "generation": r["generation"],
            "vns": r["vns"],
            **_loop_fields(r),
        }
        if not self._peak_given and _number(r.get("peak_tflops")) is not None and r["peak_tflops"] > 0:
            self.peak_tflops = float(r["peak_tflops"])
        record.update(throughput(r["samples"], r["step_time_s"], r["workers"], tokens_per_sample=self.tokens_per_sample,
                                 flops_per_sample=self.flops_per_sample, peak_tflops_per_worker=self.peak_tflops))
        parts = breakdown.clean(r.get("breakdown"))  # where the previous step's time went, if measured
        if parts is not None and isinstance(r.get("breakdown_step"), int):
            record.update(breakdown=parts, breakdown_step=r["breakdown_step"])
        self.history.append(record)
        self.progress.step = r["step"] + 1
        # What the records reach: a worker that prunes checkpoints keeps the newest one within it,
        # so a resume never has to start past the records (workers cut off from this coordinator
        # train on and checkpoint steps nobody records: launching/resume.py skips those).
        self.store.set(protocol.RECORDED_KEY, str(self.progress.step))
        self.progress.last_loss = r["loss"]
        self.progress.samples_per_s = record["samples_per_s"]
        self.progress.last_step = record
        self.progress.skipped_steps += record["skipped"]
        self.metrics_log.write({"time": r["time"], **record})
        self.event("step", step=r["step"], loss=r["loss"], step_time_s=r["step_time_s"], workers=r["workers"])
        reason = r.get("stop_reason")
        if isinstance(reason, str) and self.progress.stop_request is None:
            self.progress.stop_request = reason[:500]
            self.event("early_stop", step=r["step"], reason=self.progress.stop_request)
            logger.info("stopping after step %d: %s", r["step"], self.progress.stop_request)
        if self.on_step is not None:
            self.on_step(record)

    def close(self) -> None:
        self.rejects.flush()
        self.events.close()
        self.metrics_log.close()


def _listening_store(host: str, timeout: datetime.timedelta, port: int = 0) -> dist.TCPStore:
    """A master TCPStore that accepts connections on ``host``'s address only.

    Given a bare port, TCPStore's server listens on every interface whatever host it is told;
    handing it a socket already bound to ``host`` (``master_listen_fd``) keeps a local job off the
    network. Should this torch refuse the socket, it falls back to TCPStore's own listener."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"the job's store cannot listen on {host}:{port}: {host!r} does not resolve "
                         f"({exc.strerror}); give an address of this machine (listen= / --listen)") from None
    sock = socket.socket(family, kind, proto)
    try:
        if port:  # a fixed port (external workers join it): rebindable right after a previous job
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr[:2] if family == socket.AF_INET else addr)
        sock.listen(512)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"the job's store cannot listen on {host}:{port}: {host} is not an address of this "
                             f"machine ({socket.gethostname()}); listen= (--listen) must name one of its addresses, "
                             f"or 0.0.0.0 for every interface") from None
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"the job's store cannot listen on {host}:{port}: the port is in use (another job, "
                             f"or one that has just ended); choose another port in listen= (--listen)") from None
        raise
    fd = sock.detach()  # the store owns (and closes) the descriptor from here on
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd)
    except (TypeError, RuntimeError, ValueError) as exc:
        try:
            os.close(fd)
        except OSError:
            pass
        logger.warning("this torch's TCPStore does not take a bound socket (%s): the job's store listens on "
                       "all interfaces, not only %s", exc, host)
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _loop_fields(r: dict[str, Any]) -> dict[str, Any]:
    """The training loop's fields of a step report (metrics, grad_norm, skipped, loss_scale, lr),
    read defensively: a value of the wrong type is dropped (None), never raised."""
    raw = r.get("metrics")
    metrics: dict[str, float] = {}
    if isinstance(raw, dict):
        for k, v in list(raw.items())[:MAX_METRICS]:
            if isinstance(k, str) and _number(v) is not None:
                metrics[k[:200]] = float(v)
    return {"metrics": metrics, "grad_norm": _number(r.get("grad_norm")), "skipped": r.get("skipped") is True,
            "loss_scale": _number(r.get("loss_scale")), "lr": _number(r.get("lr"))}


def _span(vns: Sequence[int]) -> str:
    if not vns:
        return "none"
    return f"{vns[0]}-{vns[-1]}" if len(vns) > 1 else str(vns[0])


def _fmt_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
