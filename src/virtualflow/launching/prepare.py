"""What :func:`virtualflow.launch` decides between its checks and starting the supervisor.

:func:`prepare` runs in the calling process, before any worker starts. It checks everything a
user can get wrong: the job (built once here, its dataset measured, its loss evaluated on one
virtual node's batch), what needs both the job and the options (worker counts against
``virtual_nodes``, memory limits, the pipeline's grid and split, the capacity of a Ray cluster,
a resume state), and whether worker processes will be able to rebuild the job. Then it makes the
run directory private and locked, continues (resume) or sets aside (never deletes) an earlier
run's files in it, and returns the :class:`~virtualflow.launching.supervisor.RunSetup` the
supervisor runs.

Invariant: nothing is written into a run directory before it is claimed (private, locked), and a
failure anywhere in :func:`prepare` or in the caller's ``with`` block releases the lock and
removes a directory it created while it is still empty.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Any, Callable, Iterator

from virtualflow.backends import make_backend
from virtualflow.comm import auth
from virtualflow.config.composition import check_stage_sharding
from virtualflow.config.job import Job, source_from
from virtualflow.config.options import LaunchOptions
from virtualflow.config.pipeline import pipeline_of
from virtualflow.control.autoscale import FixedPolicy, Limits, make_policy
from virtualflow.launching.composition import (check_batch_schedule, check_fsdp_layout, check_pipeline_balance,
                                               check_streaming)
from virtualflow.launching.fsdp import FsdpLaunch
from virtualflow.launching.identity import check_identity, job_label, record_identity, run_identity
from virtualflow.launching.pipeline import plan_pipeline
from virtualflow.launching.preflight import build_dataset, build_job, preflight
from virtualflow.launching.resume import find_resume_state
from virtualflow.launching.supervisor import RunSetup
from virtualflow.plan.hetero import check_memory
from virtualflow.plan.streams import StreamPlan
from virtualflow.plan.pipeline.geometry import check_workers
from virtualflow.runtime.dcp import is_dcp, remove_discarded
from virtualflow.plan.vnmap import contiguous_assignment, pipeline_assignment
from virtualflow.runtime.streaming import data_plan_of
from virtualflow.records.rundir import (RunLock, disk_full_error, earlier_run, make_private_dir, set_aside,
                                        state_files, trim_metrics)

logger = logging.getLogger("virtualflow")

JobLike = Job | Callable[[], Job] | str

__all__ = ["JobLike", "autoscaler", "claim_run_dir", "prepare", "prepare_run_dir"]


@contextlib.contextmanager
def prepare(job: JobLike, opts: LaunchOptions) -> Iterator[RunSetup]:
    """Check ``job`` under ``opts``, claim and prepare the run directory, and yield the run's
    setup; if anything raises (here or in the ``with`` block that starts the run), the run
    directory's lock is released and a directory created here is removed while still empty."""
    policy, limits = autoscaler(opts)
    backend = make_backend(opts)
    # Only a backend whose workers run on this machine can tell whether the device exists.
    check_device = getattr(backend, "check_device", None)
    if check_device is not None:
        check_device(opts.device)

    source = source_from(job)
    job_obj = build_job(job, source.target)
    overrides_job = opts.job_overrides()
    job_obj = job_obj.replace(**overrides_job)
    pipeline = pipeline_of(job_obj, opts)
    check_fsdp_layout(pipeline, opts)
    if pipeline is not None:
        check_workers(pipeline, opts.start_workers)
        if opts.max_workers is not None:
            check_workers(pipeline, opts.max_workers)
    dataset = build_dataset(job_obj)
    plan = data_plan_of(dataset, job_obj)
    check_streaming(isinstance(plan, StreamPlan), opts)
    workers = opts.start_workers
    check_batch_schedule(job_obj, isinstance(plan, StreamPlan), opts,
                         max(workers, limits.max_workers if limits is not None else 0))
    total_steps = opts.steps if opts.steps is not None else opts.epochs * plan.steps_per_epoch
    if pipeline is None:
        assignment = contiguous_assignment(job_obj.virtual_nodes, workers)  # checks workers <= V
        check_against_job(opts, job_obj, limits)
    else:
        # Equal shares to start; with balance the controller weighs the replicas by speed.
        check_pipeline_balance(pipeline, opts)
        assignment = pipeline_assignment(job_obj.virtual_nodes, workers, pipeline.replica_workers)
        if limits is not None:
            pipeline_assignment(job_obj.virtual_nodes, limits.max_workers, pipeline.replica_workers)
    if pipeline is not None and opts.reduction == "sharded":
        # Each stage's optimizer state is sharded over its pipeline replicas
        # (runtime/pipeline/stage_shard.py); what that does not cover is refused here.
        check_stage_sharding(pipeline, shard_replicas=opts.shard_replicas)
    fsdp = FsdpLaunch.of(opts, limits.max_workers if limits is not None else None)
    signature = preflight(job_obj, dataset, plan, reduction=opts.reduction, fsdp=fsdp)
    if pipeline is not None:
        pipeline = plan_pipeline(job_obj.replace(pipeline=pipeline), dataset, workers, device=opts.device,
                                 deterministic=opts.deterministic)
        if opts.reduction == "sharded":
            check_stage_sharding(pipeline)
        overrides_job["pipeline"] = pipeline
        job_obj = job_obj.replace(pipeline=pipeline)
    backend.check_capacity(workers)
    if limits is not None and limits.max_workers > workers:
        backend.check_capacity(limits.max_workers, knob="--max-workers")

    # A given token file is checked before anything is written; then the run directory is made
    # private and locked before anything in it is read or written (see virtualflow.records.rundir).
    token = auth.read_token(opts.token_file, private=True) if opts.token_file is not None else None
    run_dir = opts.run_dir
    if run_dir is None and opts.resume is not None and os.path.isdir(opts.resume) and not is_dcp(opts.resume):
        run_dir = opts.resume
    lock, created = claim_run_dir(run_dir)
    try:
        resume_path, resume_step = None, 0
        if opts.resume is not None:
            resume_path, resume_step = find_resume_state(opts.resume, job_obj)
            if resume_step >= total_steps:
                raise ValueError(
                    f"the checkpoint {resume_path} is at step {resume_step}, which already reaches "
                    f"steps={total_steps}; ask for more steps (--steps/--epochs) to continue training"
                )
        identity = run_identity(job_obj, job_label(job, source), signature)
        state_dir = prepare_run_dir(run_dir, opts, resume_path, resume_step, identity)
        if run_dir is None and opts.checkpoint_every:
            logger.warning("checkpoint_every=%d without run_dir: the checkpoints go to the temporary folder %s, which "
                           "is removed when the run succeeds (kept if it fails); give run_dir= (--run-dir) to keep "
                           "them", opts.checkpoint_every, state_dir)
        if token is not None:
            token_path = os.path.abspath(opts.token_file)
        else:
            token, token_path = auth.new_token(), os.path.join(state_dir, "token")
            auth.write_token(token_path, token)
        threads = opts.threads_per_worker
        if threads is None:
            threads = 1 if opts.deterministic else backend.default_threads(workers)

        yield RunSetup(
            job=job_obj, source=source, overrides=overrides_job, options=opts, backend=backend,
            total_steps=total_steps, steps_per_epoch=plan.steps_per_epoch,
            assignment=assignment,
            run_dir=run_dir, state_dir=state_dir, own_state_dir=run_dir is None, threads=threads,
            resume_path=resume_path, resume_step=resume_step, token=token, token_path=token_path,
            autoscale=policy, autoscale_limits=limits, run_lock=lock, streaming=isinstance(plan, StreamPlan),
        )
    except BaseException:
        if lock is not None:
            lock.release()
            if created:
                try:
                    os.rmdir(run_dir)  # only if nothing was written there
                except OSError:
                    pass
        raise


def autoscaler(opts: LaunchOptions) -> tuple[Any, Limits | None]:
    """The autoscaler's policy and bounds (None, None without ``autoscale``)."""
    if opts.autoscale is None:
        return None, None
    policy = make_policy(opts.autoscale)
    if opts.max_workers is None and not isinstance(policy, FixedPolicy):
        raise ValueError(f"autoscale={getattr(policy, 'name', opts.autoscale)!r} needs max_workers= (--max-workers): "
                         f"the largest worker count it may try (at most virtual_nodes)")
    limits = Limits(opts.min_workers, opts.max_workers if opts.max_workers is not None else opts.start_workers)
    return policy, limits


def check_against_job(opts: LaunchOptions, job: Job, limits: Limits | None) -> None:
    """The checks of an unpipelined job that need both the job and the options."""
    V = job.virtual_nodes
    if limits is not None and limits.max_workers > V:
        raise ValueError(f"max_workers={limits.max_workers} is more than virtual_nodes={V}: every worker needs at "
                         f"least one virtual node; lower --max-workers or raise --virtual-nodes")
    if opts.specs:
        check_memory(job.global_batch_size // V, [s.memory_limit for s in opts.specs])


def claim_run_dir(run_dir: str | None) -> tuple[RunLock | None, bool]:
    """Make ``run_dir`` private (created 0700; an existing one must be this user's real directory
    that group and others cannot write) and lock it for this run: a directory whose coordinator
    is alive is refused, naming its pid. Returns the lock (released when the run ends) and
    whether the directory was created here."""
    if run_dir is None:
        return None, False
    try:
        created = make_private_dir(run_dir)
    except OSError as exc:
        full = disk_full_error(exc, run_dir)
        if full is not None:
            raise full from exc
        raise
    try:
        return RunLock.acquire(run_dir), created
    except BaseException:
        if created:
            try:
                os.rmdir(run_dir)
            except OSError:  # not empty after all: never hide the error that brought us here
                pass
        raise


def prepare_run_dir(run_dir: str | None, opts: LaunchOptions, resume_path: str | None, resume_step: int,
                    identity: dict[str, Any] | None = None) -> str:
    """Make the (locked) run directory ready for this run; without one, a temporary state
    directory. Nothing is deleted that the run could need, and two runs never share one:

    * continuing the run that is there (``resume`` from this directory or one of its state
      files): its states stay until the new run writes newer ones; its metrics of the steps
      about to be redone are dropped (no step twice in ``metrics.jsonl``), its events kept;
    * a new run where an earlier one left states: refused unless ``overwrite``; with it, and
      always for an earlier run's records alone, all it left is moved into
      ``previous-<time>/`` (so checkpoint retention and resume never mix two runs).

    ``identity`` (:func:`virtualflow.launching.identity.run_identity`): the job's, recorded in the
    run directory; a launch that continues a run of another job is refused before anything there
    changes."""
    if run_dir is None:
        return tempfile.mkdtemp(prefix="virtualflow-")
    if resume_path is not None and continues(run_dir, resume_path):
        if opts.overwrite:
            raise ValueError(f"overwrite=True (--overwrite) would set aside the states of {run_dir} that resume= "
                             f"continues from ({resume_path}); drop --overwrite to continue that run, or resume "
                             f"into another --run-dir")
        if identity is not None:
            check_identity(run_dir, identity)  # before anything of the run there changes
            record_identity(run_dir, identity)  # a run directory from before identities adopts this one
        for name in ("summary.json", "status.json"):  # rewritten by this run
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
        remove_discarded(os.path.join(run_dir, "checkpoints"))  # what a prune cut short by a crash left
        dropped = trim_metrics(run_dir, resume_step)
        if dropped:
            logger.info("%s: dropped %d metric record(s) of steps from %d on, which the resumed run redoes",
                        os.path.join(run_dir, "metrics.jsonl"), dropped, resume_step)
        return run_dir
    leftovers = earlier_run(run_dir)
    if not leftovers:
        if identity is not None:
            record_identity(run_dir, identity)
        return run_dir
    states = state_files(run_dir)
    if states and not opts.overwrite:
        shown = ", ".join(states[:3]) + (f" and {len(states) - 3} more" if len(states) > 3 else "")
        raise ValueError(
            f"the run directory {run_dir} holds the states of an earlier run ({shown}); a new run there would mix "
            f"with them. Continue that run with resume= (--resume {run_dir}), choose another run directory "
            f"(--run-dir), or pass overwrite=True (--overwrite) to move them into {run_dir}/previous-<time>/"
        )
    dest = set_aside(run_dir, leftovers)
    logger.info("moved what an earlier run left in %s (%s) to %s", run_dir, ", ".join(leftovers), dest)
    if identity is not None:
        record_identity(run_dir, identity)
    return run_dir


def continues(run_dir: str, resume_path: str) -> bool:
    """Whether ``resume_path`` is one of ``run_dir``'s own state files (the run there goes on)."""
    folder = os.path.realpath(os.path.dirname(os.path.normpath(os.path.abspath(resume_path))))
    return folder in (os.path.realpath(run_dir), os.path.realpath(os.path.join(run_dir, "checkpoints")))
