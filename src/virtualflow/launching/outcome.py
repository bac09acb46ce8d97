"""How a run's end is told to the user: the :class:`Result` of a finished run, the
:class:`TrainingError` of a failed one.

Purpose: the supervisor (:mod:`virtualflow.launching.supervisor`) decides *that* a run ended;
this module words *how*: which worker's report is the root cause, where the logs are, what to
do after a full disk, and what a finished run returns.

Invariants: a worker report is read defensively (fields beyond its schema, ``job_traceback``
and ``phase``, are used only when they are text); a failure names the worker, its pid, the step
(or the phase) and where the logs are, in one line; a full disk is not a bug in anyone's code,
so its message says what to do and carries no traceback.
"""

from __future__ import annotations

import os
import re
from typing import Any

from virtualflow.control.membership import JobFailed
from virtualflow.records.result import Result, TrainingError, WorkerTraceback
from virtualflow.records.rundir import state_files
from virtualflow.runtime.checkpoint import load_state

__all__ = ["CONSEQUENTIAL", "collect_result", "disk_full_advice", "job_failed_message", "logs_where",
           "worker_failure"]

CONSEQUENTIAL = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timeout")
"""Errors that are the consequence of another worker's failure, not a root cause."""


def logs_where(setup: Any) -> str:
    """Where the run's worker logs are, as a message's tail (the backend knows: ``RUN_DIR/logs``
    for local and Ray workers, each machine's console for external ones)."""
    return setup.backend.logs_where()


def disk_full_advice(setup: Any) -> str:
    """What to do after a full disk stopped the run: continue from its states, if it wrote any."""
    folder = setup.state_dir
    if not state_files(folder):
        return "the run wrote no state yet: free space there (or choose another run directory) and start it again"
    return (f"the states already written are kept: free space there (or move the run directory), then continue "
            f"with --resume {setup.run_dir if setup.run_dir is not None else folder}")


def job_failed_message(exc: JobFailed, failures: list[dict[str, Any]], backend: Any, setup: Any) -> str:
    """The controller gave up (``exc``): its reason, every worker lost on the way that the reason
    does not name (workers lost at earlier ticks: the reason names only the last ones), where the
    logs are and the last output of each lost worker (the last three)."""
    msg = str(exc)
    earlier: dict[int, str] = {}
    for f in failures:
        wid = f.get("worker")
        if isinstance(wid, int) and re.search(rf"\bworker {wid}\b", msg) is None:
            earlier.setdefault(wid, f"worker {wid} (pid {backend.pid(wid)}) {' '.join(str(f.get('cause')).split())} "
                                    f"in generation {f.get('generation')}")
    if earlier:  # the most recent ones (a long elastic run may have replaced many)
        named = list(earlier.values())
        more = f"; and {len(named) - 5} more (the failure events in events.jsonl)" if len(named) > 5 else ""
        msg += f"; lost before that: {'; '.join(named[-5:])}{more}"
    msg += f" ({logs_where(setup)})"
    lost = list(dict.fromkeys(f["worker"] for f in failures if isinstance(f.get("worker"), int)))
    for wid in lost[-3:]:
        tail = backend.log_tail(wid).strip()
        if tail:
            msg += f"; worker {wid}'s last output:\n{tail}"
    return msg


def worker_failure(errors: list[dict[str, Any]], setup: Any) -> TrainingError:
    """The :class:`TrainingError` for the workers' error reports: the root cause's (an error
    that is not a peer's connection dropping) in one line, with the step and where the logs
    are; its traceback as ``worker_traceback`` and as the ``__cause__``. What a report holds
    beyond its schema's fields (``job_traceback``, ``phase``) is used only when it is text."""
    e = next((e for e in errors if not any(s in e["error"] for s in CONSEQUENTIAL)), errors[0])
    disk_full = e["error"].startswith("DiskFullError:")
    step = e.get("step")
    phase = e.get("phase") if isinstance(e.get("phase"), str) else None
    if isinstance(step, int) and step >= 0:
        where = f"at step {step}; "
    elif phase:
        where = f"while {phase[:40]}; "
    else:
        where = ""
    error = " ".join(e["error"].split())
    if disk_full:  # not a bug in anyone's code: the line says what to do, no traceback
        error = f"{error.removeprefix('DiskFullError: ')}; {disk_full_advice(setup)}"
    err = TrainingError(f"worker {e['worker']} (pid {e['pid']}) failed: {error} ({where}{logs_where(setup)})")
    err.worker, err.disk_full = e["worker"], disk_full
    err.step = step if isinstance(step, int) and step >= 0 else None
    full = e["traceback"] or None
    short = e.get("job_traceback") if isinstance(e.get("job_traceback"), str) else None
    err.worker_traceback_full = full
    err.worker_traceback = None if disk_full else short or full
    if err.worker_traceback:
        err.__cause__ = WorkerTraceback(err.worker_traceback)
    return err


def collect_result(setup: Any, coordinator: Any, controller: Any, autoscaler: Any, *, stop_reason: str | None = None,
                   throughput: dict[str, Any] | None = None) -> Result:
    """The :class:`Result` of a finished run: its final state (``final.pt``) and its records;
    ``stop_reason``: why it was asked to stop early (the supervisor's), ``throughput``: its mean
    throughput (:meth:`virtualflow.launching.supervisor.Supervisor.throughput`)."""
    state = load_state(os.path.join(setup.state_dir, "final.pt"))
    steps = int(state["step"])
    p = coordinator.progress
    return Result(
        state_dict=state["model"],
        optimizer_state_dict=state["optimizer"],
        lr_scheduler_state_dict=state["lr_scheduler"],
        history=list(coordinator.history),
        metrics=dict(p.metrics),
        eval_history=list(coordinator.eval_history),
        run_dir=setup.run_dir,
        steps=steps,
        stopped=steps < setup.total_steps,
        stop_reason=stop_reason if steps < setup.total_steps else None,
        throughput=throughput,
        callbacks_state=state.get("callbacks"),
        peak_rss_mib={w: i["peak_rss_mib"] for w, i in p.workers.items() if "peak_rss_mib" in i},
        peak_device_mib={w: i["peak_device_mib"] for w, i in p.workers.items() if i.get("peak_device_mib") is not None},
        optimizer_bytes={w: i["optimizer_bytes"] for w, i in p.workers.items() if "optimizer_bytes" in i},
        replica_bytes={w: i["replica_bytes"] for w, i in p.workers.items() if "replica_bytes" in i},
        replica_refresh_s={w: i["replica_refresh_s"] for w, i in p.workers.items() if "replica_refresh_s" in i},
        redundant_forwards={w: i["redundant_forwards"] for w, i in p.workers.items() if i.get("redundant_forwards")},
        generations=controller.generation + 1,
        failures=list(controller.failures),
        autoscale=autoscaler.summary() if autoscaler is not None else None,
    )
