"""The undisturbed deterministic run of a job, in this process: the reference of process tests.

Deterministic mode promises weights, optimizer state and LR schedule that depend on nothing but
the job and the step count: not on the number of workers, the VN map, resizes, failures or the
backend. So the reference a process test compares its run with (a resized, killed, Ray or hostile
run) is the run of one worker holding all V virtual nodes, in this process: the same bits as
``vf.train(job, workers=N, steps=..., deterministic=True)`` for any N, without starting a
coordinator and worker processes (seconds each on a loaded 2-core machine, for a reference that
takes about a second here). The engines are proven against plain PyTorch (``tests/reference.py``)
in ``tests/unit/test_data_order.py`` and ``tests/unit/test_mixed_dtype_deterministic.py``.

:func:`one_worker` runs the worker's own engine (``runtime/grid_threads.py``: the engine the
worker process builds, in one thread, whose random generator is its own, so dropout draws what a
worker process draws); :func:`deterministic_reference` is the same for a pipelined job's
unpipelined model; :func:`undisturbed_pipeline` runs a pipelined job without tensor parallelism
with every stage in one thread, in the pipeline's own order (``LocalDriver``). A test comparing
a run in processes with one of these compares the process run with the engines' bits: a
difference between the two fails it.

Invariants: the returned state is the run's own (nothing else holds it), so a cached reference
cannot be changed by a later run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import virtualflow as vf
from virtualflow.backends.inprocess import train_local
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads


@dataclass(frozen=True, slots=True)
class Reference:
    """What :func:`conftest.assert_same_training` reads of a :class:`vf.Result`, plus the losses."""

    steps: int
    state_dict: dict[str, torch.Tensor]
    optimizer_state_dict: dict[str, Any]
    lr_scheduler_state_dict: dict[str, Any] | None
    history: list[dict[str, Any]] = field(default_factory=list)
    """One ``{"step", "loss", "grad_norm"}`` per step, bit-identical to a run's records in deterministic
    mode (``grad_norm``: None without ``max_grad_norm``)."""
    failures: list[dict[str, Any]] = field(default_factory=list)


def one_worker(job: vf.Job, steps: int) -> Reference:
    """``vf.train(job, workers=1, steps=steps, deterministic=True)``, in this process."""
    run = train_threads(job, [Generation(members=(0,), steps=steps)],
                        options=WorkerOptions(deterministic=True, breakdown=False))
    history = [{"step": s, "loss": o.loss, "grad_norm": o.grad_norm} for s, o in enumerate(run.outcomes)]
    return Reference(steps=steps, state_dict=run.state["model"], optimizer_state_dict=run.state["optimizer"],
                     lr_scheduler_state_dict=run.state["lr_scheduler"], history=history)


def deterministic_reference(job: vf.Job, steps: int) -> Reference:
    """``job`` (its pipeline, if any, dropped) trained ``steps`` steps in deterministic mode by one
    worker in this process (see the module's docstring)."""
    job = job.replace(pipeline=None) if getattr(job, "pipeline", None) is not None else job
    return one_worker(job, steps)


def undisturbed_pipeline(job: vf.Job, steps: int) -> dict[str, torch.Tensor]:
    """The whole model after ``steps`` deterministic steps of the pipelined ``job`` (one pipeline
    replica; ``Pipeline.tensor == 1``)."""
    if job.pipeline is None or job.pipeline.tensor != 1:
        raise ValueError(f"undisturbed_pipeline needs a pipelined job without tensor parallelism, got "
                         f"pipeline={job.pipeline!r}")
    state, _ = train_local(job, steps, deterministic=True)
    return state
