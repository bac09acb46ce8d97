"""Tensor workers: stateless processes that run one interval's apply-vertex forward, backward,
or (last layer) forward + loss + backward, from the rows and the weight version they are sent.
This module holds what a task computes (:func:`run_tensor_task`) and the emulated limits; the
process loop that runs tasks (``tensor_worker``) is in :mod:`virtualflow.backends.gnn`.

A task is a plain dict; its result depends on nothing but the task, so a task whose worker dies
or times out is simply run again on a fresh worker (the relaunch gives the same result).

Emulated cheap-worker limits (:class:`WorkerLimits`, all off by default) make one machine behave
like serverless threads: a cold start on a new worker's first task, a per-task invocation
latency, a transfer time of ``bytes / bandwidth`` for the task's inputs and outputs, and an
occasional timeout (the worker stops answering; the driver kills it after ``task_timeout_s`` and
relaunches). Emulation sleeps, which frees the CPU, as waiting on a network does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from virtualflow.gnn.layers import LayerSpec, vertex_op


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLimits:
    latency_s: float = 0.0
    """Invocation latency added to every task."""
    bandwidth_bytes_per_s: float = 0.0
    """Transfer rate for a task's inputs + outputs; 0 = unlimited."""
    cold_start_s: float = 0.0
    """Added to the first task of every (re)launched worker."""
    timeout_prob: float = 0.0
    """Chance that a task attempt hangs (drawn from the task id, the attempt and ``seed``)."""
    task_timeout_s: float = 60.0
    """The driver kills and relaunches a worker whose task runs longer than this."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth_bytes_per_s", "cold_start_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0; pass --{name.replace('_', '-')}")
        if not 0.0 <= self.timeout_prob < 1.0:
            raise ValueError(f"timeout_prob={self.timeout_prob!r} must lie in [0, 1); pass --timeout-prob")
        if self.task_timeout_s <= 0:
            raise ValueError(f"task_timeout_s={self.task_timeout_s!r} must be > 0; pass --task-timeout-s")

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s > 0 else 0.0

    def hangs(self, task_id: int, attempt: int) -> bool:
        if self.timeout_prob <= 0:
            return False
        return random.Random(f"{self.seed}/{task_id}/{attempt}").random() < self.timeout_prob


def task_bytes(obj) -> int:
    """Bytes of the tensors in a task or a result (what crosses the network)."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(task_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(task_bytes(v) for v in obj)
    return 0


def run_tensor_task(specs: Sequence[LayerSpec], activation: str, task: dict) -> dict:
    """Run one tensor task. ``task["op"]``:

    * ``"forward"``: ``{"rows": vertex_op(l)(x)}``.
    * ``"backward"``: recompute ``vertex_op(l)`` from the stashed input ``x`` and the stashed
      weights, then ``{"grads": d/dparams, "grad_x": d/dx (l > 0)}`` for the output gradient ``g``.
    * ``"last"``: logits ``z + bias``, loss ``sum of NLL over the training rows / total_train``,
      ``{"grads", "grad_x", "loss", "correct": {mask: (hits, count)}}``.
    """
    l, params = task["layer"], task["params"]
    op = task["op"]
    if op == "forward":
        with torch.no_grad():
            return {"rows": vertex_op(specs, activation, l, params, task["x"])}
    leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    x = task["x"].detach().requires_grad_(l > 0)
    with torch.enable_grad():
        out = vertex_op(specs, activation, l, leaves, x)
        wrt = list(leaves.values()) + ([x] if l > 0 else [])
        if op == "backward":
            grads = torch.autograd.grad(out, wrt, task["g"], allow_unused=True)
            extra: dict = {}
        elif op == "last":
            y, train = task["y"], task["train"]
            logp = F.log_softmax(out, dim=-1)
            loss = F.nll_loss(logp[train], y[train], reduction="sum") / task["total_train"]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            pred = out.detach().argmax(-1)
            correct = {name: (int((pred[m] == y[m]).sum()), int(m.sum())) for name, m in task["masks"].items()}
            extra = {"loss": float(loss.detach()), "correct": correct}
        else:
            raise ValueError(f"unknown tensor task op {op!r}")
    names = list(leaves)
    res = {"grads": {n: (g if g is not None else torch.zeros_like(params[n])) for n, g in zip(names, grads)}}
    res["grad_x"] = grads[len(names)] if l > 0 else None
    res.update(extra)
    return res
