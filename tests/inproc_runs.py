"""Reference runs in this process, for process tests whose promise is "the bits of the undisturbed
run": the worker's own engines, no worker process to start (a process run costs seconds to start;
these cost the training only).

Both run deterministic mode, whose bits depend neither on the worker count nor on where the
workers run: :func:`one_worker` is ``vf.train(job, workers=1, deterministic=True)`` (one engine in
one thread: the random generator is its own, so dropout draws what a worker process draws), and
:func:`undisturbed_pipeline` is ``vf.train(job, workers=P, deterministic=True)`` of a pipelined
job without tensor parallelism (the ``LocalDriver``: every stage in one thread, in turn, as the
pipeline's own order). A test comparing a run in processes with one of these compares the
process run with the engines' bits: a difference between the two fails it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import virtualflow as vf
from virtualflow.backends.inprocess import train_local
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads


def one_worker(job: vf.Job, steps: int) -> SimpleNamespace:
    """The 1-worker deterministic run of ``job`` for ``steps`` steps, shaped as the fields of
    :class:`vf.Result` that ``conftest.assert_same_training`` reads (``history``: step and loss)."""
    run = train_threads(job, [Generation(members=(0,), steps=steps)],
                        options=WorkerOptions(deterministic=True, breakdown=False))
    return SimpleNamespace(steps=steps, state_dict=run.state["model"], optimizer_state_dict=run.state["optimizer"],
                           lr_scheduler_state_dict=run.state["lr_scheduler"],
                           history=[{"step": s, "loss": o.loss} for s, o in enumerate(run.outcomes)])


def undisturbed_pipeline(job: vf.Job, steps: int) -> dict[str, torch.Tensor]:
    """The whole model after ``steps`` deterministic steps of the pipelined ``job`` (one pipeline
    replica; ``Pipeline.tensor == 1``)."""
    if job.pipeline is None or job.pipeline.tensor != 1:
        raise ValueError(f"undisturbed_pipeline needs a pipelined job without tensor parallelism, got "
                         f"pipeline={job.pipeline!r}")
    state, _ = train_local(job, steps, deterministic=True)
    return state
