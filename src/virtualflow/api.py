"""Public entry points: :func:`train` (blocking) and :func:`launch` (returns a :class:`JobHandle`).

Everything a user can get wrong is checked here, in the calling process, before any worker
starts: the options (:class:`~virtualflow.options.LaunchOptions`, validated when built), the job
(built once here, its dataset measured, its loss evaluated on one virtual node's batch), the
checks that need both (worker counts against ``virtual_nodes``, memory limits, the capacity of a
Ray cluster, a resume state), and whether worker processes will be able to rebuild the job.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Callable


from virtualflow.backends import make_backend
from virtualflow.comm import auth
from virtualflow.control.autoscale import FixedPolicy, Limits, make_policy
from virtualflow.handle import JobHandle
from virtualflow.job import Job, source_from
from virtualflow.options import LaunchOptions, make_options
from virtualflow.plan.data import DataPlan
from virtualflow.plan.hetero import check_memory
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.preflight import build_dataset, build_job, preflight
from virtualflow.result import Result, TrainingError
from virtualflow.resume import find_resume_state
from virtualflow.supervisor import RunSetup

logger = logging.getLogger("virtualflow")

__all__ = ["train", "launch", "JobHandle", "LaunchOptions", "Result", "TrainingError"]

JobLike = Job | Callable[[], Job] | str


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
    opts = make_options(options, overrides)
    policy, limits = _autoscaler(opts)
    backend = make_backend(opts)

    source = source_from(job)
    job_obj = build_job(job, source.target)
    overrides_job = {k: v for k in ("global_batch_size", "virtual_nodes", "seed")
                     if (v := getattr(opts, k)) is not None}
    job_obj = job_obj.replace(**overrides_job)
    dataset = build_dataset(job_obj)
    plan = DataPlan(len(dataset), job_obj.global_batch_size, job_obj.virtual_nodes, job_obj.seed)
    workers = opts.start_workers
    total_steps = opts.steps if opts.steps is not None else opts.epochs * plan.steps_per_epoch
    assignment = contiguous_assignment(job_obj.virtual_nodes, workers)  # checks workers <= V
    _check_against_job(opts, job_obj, limits)
    preflight(job_obj, dataset, plan)
    backend.check_capacity(workers)
    if limits is not None and limits.max_workers > workers:
        backend.check_capacity(limits.max_workers, knob="--max-workers")

    resume_path, resume_step, run_dir = None, 0, opts.run_dir
    if opts.resume is not None:
        resume_path, resume_step = find_resume_state(opts.resume, job_obj)
        if resume_step >= total_steps:
            raise ValueError(
                f"the checkpoint {resume_path} is at step {resume_step}, which already reaches steps={total_steps}; "
                f"ask for more steps (--steps/--epochs) to continue training"
            )
        if run_dir is None and os.path.isdir(opts.resume):
            run_dir = opts.resume
    state_dir = _prepare_run_dir(run_dir, resuming=opts.resume is not None)
    if opts.token_file is not None:
        token, token_path = auth.read_token(opts.token_file), os.path.abspath(opts.token_file)
    else:
        token, token_path = auth.new_token(), os.path.join(state_dir, "token")
        auth.write_token(token_path, token)
    threads = opts.threads_per_worker
    if threads is None:
        threads = 1 if opts.deterministic else backend.default_threads(workers)

    handle = JobHandle(RunSetup(
        job=job_obj, source=source, overrides=overrides_job, options=opts, backend=backend,
        total_steps=total_steps, steps_per_epoch=plan.steps_per_epoch,
        assignment=assignment,
        run_dir=run_dir, state_dir=state_dir, own_state_dir=run_dir is None, threads=threads,
        resume_path=resume_path, resume_step=resume_step, token=token, token_path=token_path,
        autoscale=policy, autoscale_limits=limits,
    ))
    handle.start()
    return handle


def train(job: JobLike, options: LaunchOptions | None = None, **overrides: Any) -> Result:
    """Train ``job`` and block until it ends; same arguments as :func:`launch`.

    Ctrl-C (KeyboardInterrupt) stops the job at the next step boundary with the final state
    written, and returns that :class:`Result` (``stopped=True``); a second Ctrl-C kills the
    workers at once and raises."""
    handle = launch(job, options, **overrides)
    try:
        return handle.wait()
    except KeyboardInterrupt:
        return stop_interrupted(handle, "interrupted (Ctrl-C)")


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


def _autoscaler(opts: LaunchOptions) -> tuple[Any, Limits | None]:
    """The autoscaler's policy and bounds (None, None without ``autoscale``)."""
    if opts.autoscale is None:
        return None, None
    policy = make_policy(opts.autoscale)
    if opts.max_workers is None and not isinstance(policy, FixedPolicy):
        raise ValueError(f"autoscale={getattr(policy, 'name', opts.autoscale)!r} needs max_workers= (--max-workers): "
                         f"the largest worker count it may try (at most virtual_nodes)")
    limits = Limits(opts.min_workers, opts.max_workers if opts.max_workers is not None else opts.start_workers)
    return policy, limits


def _check_against_job(opts: LaunchOptions, job: Job, limits: Limits | None) -> None:
    V = job.virtual_nodes
    if limits is not None and limits.max_workers > V:
        raise ValueError(f"max_workers={limits.max_workers} is more than virtual_nodes={V}: every worker needs at "
                         f"least one virtual node; lower --max-workers or raise --virtual-nodes")
    if opts.specs:
        check_memory(job.global_batch_size // V, [s.memory_limit for s in opts.specs])


def _prepare_run_dir(run_dir: str | None, *, resuming: bool) -> str:
    """Create the run directory and clear the records a previous run left there (a resumed run
    keeps its event and metric logs); without one, a temporary state directory."""
    if run_dir is None:
        return tempfile.mkdtemp(prefix="virtualflow-")
    os.makedirs(run_dir, exist_ok=True)
    stale = ["summary.json", "final.pt", "final.pt.sha256", "status.json"]
    if not resuming:
        stale += ["events.jsonl", "metrics.jsonl"]
    for name in stale:
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    return run_dir
