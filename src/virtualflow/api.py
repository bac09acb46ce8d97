"""Public entry points: :func:`train` (blocking) and :func:`launch` (returns a :class:`JobHandle`).

Everything a user can get wrong is checked in the calling process before any worker starts, by
:func:`virtualflow.launching.prepare.prepare` (the options are validated when built, see
:class:`~virtualflow.config.options.LaunchOptions`); then the run's supervisor starts. Training
that ends in a loss Bamboo's redundancy cannot cover is restarted from the last checkpoint
(:func:`wait_restarting`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from virtualflow.config.job import check_not_importing
from virtualflow.config.options import LaunchOptions, make_options
from virtualflow.handle import JobHandle
from virtualflow.launching.prepare import JobLike, prepare
from virtualflow.launching.prepare import claim_run_dir as _claim_run_dir  # noqa: F401 - the name tests use
from virtualflow.records.result import Result, TrainingError

logger = logging.getLogger("virtualflow")

__all__ = ["train", "launch", "JobHandle", "LaunchOptions", "Result", "TrainingError"]


def launch(job: JobLike, options: LaunchOptions | None = None, **overrides: Any) -> JobHandle:
    """Start training ``job``; returns a :class:`JobHandle` at once.

    ``job`` is a :class:`Job`, a zero-argument function returning one (module-level, a lambda, a
    closure, or defined in ``__main__`` / a notebook: whatever is not importable reaches the
    workers through cloudpickle), or a ``"module:function"`` / ``"file.py:function"`` string.

    How it runs is :class:`LaunchOptions` (see its fields for every option, its default and its
    command-line flag): pass ``options=``, keywords, or both (keywords override ``options``'
    fields), e.g. ``launch(make_job, workers=2, steps=100, deterministic=True)``. Give exactly
    one of ``steps`` and ``epochs``. The guides in ``docs/`` explain the options by concern.
    """
    check_not_importing()  # a job file's unguarded top-level training code, run by its import
    opts = make_options(options, overrides)
    with prepare(job, opts) as setup:  # releases the run directory if starting fails
        handle = JobHandle(setup)
        handle.start()
    return handle


def train(job: JobLike, options: LaunchOptions | None = None, **overrides: Any) -> Result:
    """Train ``job`` and block until it ends; same arguments as :func:`launch`.

    Ctrl-C (KeyboardInterrupt) stops the job at the next step boundary with the final state
    written, and returns that :class:`Result` (``stopped=True``); a second Ctrl-C kills the
    workers at once and raises."""
    handle = launch(job, options, **overrides)
    try:
        return wait_restarting(handle, job)[0]
    except KeyboardInterrupt:
        return stop_interrupted(handle, "interrupted (Ctrl-C)")


MAX_FALLBACK_RESTARTS = 3
"""Automatic restarts from the last checkpoint after losses Bamboo's redundancy cannot cover."""


def wait_restarting(handle: JobHandle, job: JobLike) -> tuple[Result, JobHandle]:
    """``handle.wait()``; when a pipeline with redundant stages lost workers its replicas could
    not cover (a ``fallback_restart`` event), launch the job again from its run directory's last
    checkpoint, with the same options (fault injection excepted: a test plan applies to the first
    launch), up to :data:`MAX_FALLBACK_RESTARTS` times. Returns the result and the last handle."""
    restarts = 0
    while True:
        try:
            return handle.wait(), handle
        except TrainingError as exc:
            state_dir = handle.state_dir
            checkpoints = os.path.join(state_dir, "checkpoints")
            has_checkpoint = os.path.isdir(checkpoints) and any(  # a state file or a complete sharded one
                f.endswith(".pt") or f.endswith(".dcp") for f in os.listdir(checkpoints))
            if not exc.fallback_restart or restarts >= MAX_FALLBACK_RESTARTS or not has_checkpoint:
                raise
            restarts += 1
            logger.warning("%s; restarting from the last checkpoint in %s (restart %d of at most %d)",
                           str(exc).split(" (logs in")[0], state_dir, restarts, MAX_FALLBACK_RESTARTS)
            opts = handle.options.replace(resume=state_dir, run_dir=state_dir, overwrite=False,
                                                      fault_plan=None)
            handle = launch(job, opts)


def stop_interrupted(handle: JobHandle, reason: str) -> Result:
    """Stop ``handle``'s job gracefully after an interrupt; a second interrupt kills it."""
    logger.warning("%s: stopping at the next step boundary, with the final state written (Ctrl-C again to kill "
                   "at once)", reason)
    try:
        return handle.stop(timeout_s=120.0, reason=reason)
    except KeyboardInterrupt:
        logger.warning("interrupted again: killing the workers (no final state)")
        handle.kill()
        raise
