"""The undisturbed deterministic run of a job, in this process: the reference of process tests.

Deterministic mode promises weights, optimizer state and LR schedule that depend on nothing but
the job and the step count: not on the number of workers, the VN map, resizes, failures or the
backend. So the reference a process test compares its run with (a resized, killed, Ray or hostile
run) is the VN engine on one worker running all V virtual nodes in this process: the same bits as
``vf.train(job, workers=N, steps=..., deterministic=True)`` for any N, without starting a
coordinator and worker processes (seconds each on a loaded 2-core machine, for a reference that
takes about a second here). The engine itself is proven against plain PyTorch
(``tests/reference.py``) in ``tests/unit/test_data_order.py`` and
``tests/unit/test_mixed_dtype_deterministic.py``.

Invariants: the model is built after ``torch.manual_seed(job.seed)`` (as every worker builds it);
the returned tensors are copies, so a cached reference cannot be changed by a later run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.engine import BatchLoader, VNEngine


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


def deterministic_reference(job: vf.Job, steps: int) -> Reference:
    """``job`` (its pipeline, if any, dropped) trained ``steps`` steps in deterministic mode by the
    VN engine of one worker in this process (see the module's docstring)."""
    job = job.replace(pipeline=None) if getattr(job, "pipeline", None) is not None else job
    ds = job.build_dataset()
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    eng = VNEngine(model, opt, sched, job.compute_loss,
                   DataPlan.of_job(job, len(ds)), BatchLoader(ds, None),
                   seed=job.seed, batchnorm=job.batchnorm, deterministic=True, device=torch.device("cpu"),
                   precision=job.precision, max_grad_norm=job.max_grad_norm, loss_scale=job.loss_scale)
    eng.set_membership(Group(0, 0, 1, None), [list(range(job.virtual_nodes))])
    outcomes = [eng.step(s) for s in range(steps)]
    history = [{"step": s, "loss": o.loss, "grad_norm": o.grad_norm} for s, o in enumerate(outcomes)]
    return Reference(steps=steps, state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
                     optimizer_state_dict=copy.deepcopy(opt.state_dict()),
                     lr_scheduler_state_dict=copy.deepcopy(sched.state_dict()) if sched else None, history=history)
