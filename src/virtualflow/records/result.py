"""What a finished job returns (:class:`Result`) and how a failed one is reported
(:class:`TrainingError`, with the failing worker's traceback as text: :class:`WorkerTraceback`),
and how a traceback is shown from the job's own code on (:func:`job_traceback`,
:func:`job_frame`)."""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: reading a run's records (the CLI) needs no torch
    import torch


class TrainingError(RuntimeError):
    """The job failed; the message (one line) names the worker, what happened, the step and
    where the logs are. When a worker's code raised, the worker's traceback comes with it:
    :attr:`worker_traceback` (the job's own frames first) and ``__cause__`` (a
    :class:`WorkerTraceback`, which Python prints above this error)."""

    fallback_restart: bool = False
    """A pipeline lost workers its redundant stages could not cover: :func:`virtualflow.train`
    (and ``virtualflow run``) restart it from its last checkpoint."""
    worker: int | None = None
    """The worker whose failure ended the job (None when no single worker did)."""
    step: int | None = None
    """The step (0-based, as in ``Result.history``) the failing worker was at; None when it
    failed before training (building the job) or the step is not known."""
    worker_traceback: str | None = None
    """The failing worker's traceback as text, starting at the job's own code (the virtualflow
    frames that led to it are counted, not shown); None when the worker did not report one
    (it was killed, or it lost its connection)."""
    worker_traceback_full: str | None = None
    """The same traceback with every frame (what the worker's log holds)."""
    disk_full: bool = False
    """The run stopped because a write found no space left (the message names the file, the
    space free there and what to do; the states already written are kept)."""


class WorkerTraceback(Exception):
    """A traceback that happened in a worker process, carried as text: the ``__cause__`` of the
    :class:`TrainingError` it led to, so that Python's own report of the error shows where the
    job's code failed (as ``concurrent.futures`` does for its worker processes)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "raised in the worker:\n\n" + self.text.rstrip("\n")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The virtualflow package's folder (this module is in its records/ subfolder)."""
_STDLIB_DIRS = tuple({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib")
                      if (p := sysconfig.get_paths().get(key))})


def is_internal_frame(filename: str) -> bool:
    """Whether a frame of ``filename`` is not the job's own code: virtualflow's, Python's standard
    library (threads, executors), an installed library's (torch, Ray) or generated code
    (``<string>``: a dataclass's ``__init__``)."""
    if filename == "<string>":
        return True
    path = os.path.abspath(filename)
    return (path.startswith(_PACKAGE_DIR) or path.startswith(_STDLIB_DIRS)
            or f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path)


def job_traceback(exc: BaseException, internal: Callable[[str], bool] = is_internal_frame) -> str:
    """``exc``'s traceback as text, starting at the first frame of the job's code: the frames
    before it (virtualflow's and the standard library's, see :func:`is_internal_frame`) are left
    out and counted in the header; every frame after it is kept (the library calls the job's
    code made, torch's included). Chained exceptions are shown as Python shows them. When no
    frame is the job's (virtualflow itself failed), the whole traceback."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    first = next((i for i, f in enumerate(frames) if not internal(f.filename)), None)
    if not first:  # None (no frame of the job's) or 0 (nothing to leave out)
        return "".join(te.format())
    te.stack = traceback.StackSummary.from_list(frames[first:])
    lines = list(te.format())
    header = "Traceback (most recent call last):\n"
    last = max(i for i, line in enumerate(lines) if line == header)  # the outermost exception's
    lines[last] = (f"Traceback (most recent call last; {first} frame{'s' if first > 1 else ''} of virtualflow "
                   f"before the job's code left out):\n")
    return "".join(lines)


def job_frame(exc: BaseException, internal: Callable[[str], bool] = is_internal_frame) -> str | None:
    """Where the job's code raised ``exc``: ``"FILE, line N, in FUNCTION (SOURCE)"`` of the last
    frame of the job's own code in its traceback (None when there is none)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not internal(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    code = f" ({' '.join((f.line or '').split())})" if f.line else ""
    return f"{f.filename}, line {f.lineno}, in {f.name}{code}"


@dataclass(slots=True)
class Result:
    state_dict: dict[str, torch.Tensor]
    """Final model weights (CPU tensors)."""
    optimizer_state_dict: dict[str, Any]
    lr_scheduler_state_dict: dict[str, Any] | None
    history: list[dict[str, Any]]
    """One record per step: step (0-based), loss, samples, step_time_s, workers, generation,
    vns (the VN ids each worker ran), metrics (the loss function's, each the mean over the global
    batch), grad_norm, skipped, loss_scale, lr, samples_per_s, tokens_per_s, mfu (the fields of
    ``metrics.jsonl``: :data:`virtualflow.control.coordinator.STEP_FIELDS`)."""
    metrics: dict[str, float]
    """The last evaluation's metrics (empty without ``Job.evaluate``)."""
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str | None = None
    steps: int = 0
    """Steps completed."""
    stopped: bool = False
    """True when the job ended before its steps: :meth:`JobHandle.stop`, Ctrl-C or SIGTERM, or a
    callback's early stop."""
    stop_reason: str | None = None
    """Why it stopped early (``"stop() called"``, ``"EarlyStopping.on_step_end asked to stop after
    step 41"``, ...); None when it ran all its steps."""
    throughput: dict[str, float | None] | None = None
    """Mean throughput over the steady steps (all but the first): ``samples_per_s``,
    ``tokens_per_s`` (with ``Job.tokens_per_sample``), ``mfu`` (a fraction, with
    ``Job.flops_per_sample`` and a peak) and the ``peak_tflops`` of one worker it is measured
    against (None when unknown)."""
    callbacks_state: list[dict[str, Any] | None] | None = None
    """The final state of the job's callbacks that have one (``Job.callbacks`` order: ``{"class",
    "ranks", "state"}`` or None for a callback without state); None when no callback has state."""
    peak_rss_mib: dict[int, float] = field(default_factory=dict)
    """Peak resident memory of each worker process (worker id -> MiB)."""
    peak_device_mib: dict[int, float] = field(default_factory=dict)
    """Peak memory held by tensors on each worker's GPU (``torch.cuda.max_memory_allocated``,
    worker id -> MiB); empty on CPUs, whose peak is ``peak_rss_mib``."""
    optimizer_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes of optimizer state each worker held at the end (worker id -> bytes): the whole state
    with the default reduction, its chunk with ``reduction="sharded"``; pipelined jobs: its stage's,
    or with ``reduction="sharded"`` its chunk of its stage's after its last update)."""
    replica_bytes: dict[int, int] = field(default_factory=dict)
    """``Pipeline(redundancy=True)``: bytes of each worker's replica of its successor's stage at
    the end (parameters, buffers, optimizer state; worker id -> bytes; 0 without redundancy).
    ``reduction="sharded", shard_replicas=1``: bytes of each worker's replica of its predecessor's
    chunk of the optimizer state and the gradient buffer that refreshes it (0 with one worker)."""
    replica_refresh_s: dict[int, float] = field(default_factory=dict)
    """``Pipeline(redundancy=True)``: the redundant compute, seconds each worker spent taking its
    successor's steps on its replica (worker id -> seconds; since the worker's last re-layout)."""
    redundant_forwards: dict[int, dict[str, float]] = field(default_factory=dict)
    """``Pipeline(redundancy=True, redundant_compute="eager")``: per worker (id -> counts), its
    eager redundant forwards over the run: ``seconds`` spent in them, ``forwards`` run,
    ``skipped`` (no idle slot left for them in their step), ``reused`` (forwards a failover's
    redone step took from them instead of running the lost stage again), ``peak_bytes`` (the most
    memory one step's kept forwards held: the activations their graphs saved and their outputs)."""
    generations: int = 1
    """Membership generations the job went through (1: no resize, no failure)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Workers lost and survived: worker id, cause, generation."""
    autoscale: dict[str, Any] | None = None
    """With ``autoscale=``: the policy, its decisions, the measurement of every worker count
    tried and where it settled (None without autoscaling)."""
