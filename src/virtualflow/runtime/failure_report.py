"""Why a worker failed, told to the coordinator and to the worker's own log.

:func:`report_failure` is called once, with the exception that ends the worker process: it
prints the exception, the step and the phase with the full traceback to stderr, and sends an
``error`` report with the traceback cut to the job's own code
(:func:`virtualflow.records.result.job_traceback`). A full disk becomes one line naming the file, the
space free there and the space the state needs. Best effort throughout: a failure is never lost
over its formatting or over a store that is gone.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Protocol

import torch

from virtualflow.records.result import job_traceback
from virtualflow.records.rundir import DiskFullError, free_bytes, no_space
from virtualflow.runtime.channel import Reporter

__all__ = ["FailedWorker", "failing_step", "memory_hint", "peak_device_mib", "peak_rss_mib", "report_failure", "state_bytes"]


class FailedWorker(Protocol):
    """What a failure's report reads of the worker (:class:`virtualflow.runtime.worker.Worker`)."""

    phase: str
    progress: Any
    cfg: Any
    engine: Any


def failing_step(exc: BaseException, worker: FailedWorker | None) -> int | None:
    """The step (0-based) a worker failed at: the one the exception names (``exc.step``), else the
    one the worker was running or about to run; None when it failed while setting up (building
    the job), before any step was its."""
    step = getattr(exc, "step", None)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if worker is None or worker.phase == "setting up" or worker.progress.step < 0:
        return None
    return worker.progress.step


def report_failure(reporter: Reporter, worker_id: int, exc: BaseException, worker: FailedWorker | None) -> None:
    """Tell the coordinator and the worker's own log (stderr) why this worker failed: the
    exception, the step, and the traceback, in full and from the job's own code on
    (:func:`virtualflow.records.result.job_traceback`). Best effort: a report that cannot be sent (the
    store is gone) leaves the log."""
    step = failing_step(exc, worker)
    phase = worker.phase if worker is not None else "setting up"
    full = "".join(traceback.format_exception(exc))
    disk = no_space(exc)
    if disk is not None:  # one line naming the file, the space free there and the space needed
        path = disk.filename if isinstance(disk.filename, str) else (worker.cfg.state_dir if worker else "?")
        needed = getattr(disk, "needed_bytes", None) or state_bytes(worker)
        free = disk.free_bytes if isinstance(disk, DiskFullError) else free_bytes(path)  # as measured at the failure
        exc = DiskFullError(path, free, needed, disk.errno)
    try:
        short = job_traceback(exc)
    except Exception:  # noqa: BLE001 - never lose the failure over its formatting
        short = full
    where = f"at step {step}" if step is not None else f"while {phase}"
    said = f"{type(exc).__name__}: {exc}{memory_hint(exc, worker)}"
    try:
        print(f"virtualflow worker {worker_id} failed {where}: {said}\n{full}",
              file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not hide the report below
        pass
    try:
        reporter({
            "type": "error",
            "error": said[-4000:],
            "traceback": full[-16000:],
            "job_traceback": short[-16000:],
            "phase": phase,
            "step": step,
        })
    except Exception:  # noqa: BLE001 - the store is gone: the log above is what is left
        pass


OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "cannot allocate memory")


def memory_hint(exc: BaseException, worker: FailedWorker | None) -> str:
    """For an out-of-memory failure, the knobs that make the job fit (empty otherwise)."""
    text = str(exc).lower()
    if not (isinstance(exc, MemoryError) or isinstance(exc, torch.OutOfMemoryError)
            or any(k in text for k in OUT_OF_MEMORY)):
        return ""
    reduction = getattr(getattr(getattr(worker, "cfg", None), "options", None), "reduction", None)
    if reduction == "fsdp":
        return (" -- this worker ran out of memory with its parameters already sharded: add workers (--workers), "
                "offload the shards to the host (offload='cpu', --offload cpu), or lower the activations "
                "(activation_checkpointing, --activation-checkpointing every)")
    return (" -- this worker ran out of memory: reduction='fsdp' (--reduction fsdp) divides the parameters, their "
            "gradients and the optimizer state by the workers (reduction='sharded': the optimizer state only); "
            "activation_checkpointing (--activation-checkpointing every) lowers the activations")


def state_bytes(worker: FailedWorker | None) -> int | None:
    """About how many bytes a state file of this worker's job takes (its model's tensors and the
    optimizer state it holds); None when that cannot be told (set-up not done, pipelined)."""
    try:
        return worker.engine.state_bytes()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - an estimate for a message only
        return None


def peak_device_mib(device: torch.device) -> float | None:
    """The most memory tensors held on this worker's accelerator at once
    (``torch.cuda.max_memory_allocated``), in MiB; None on a CPU (see :func:`peak_rss_mib`)."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.max_memory_allocated(device) / 2**20
    except Exception:  # noqa: BLE001 - a figure for the records only
        return None


def peak_rss_mib() -> float:
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
