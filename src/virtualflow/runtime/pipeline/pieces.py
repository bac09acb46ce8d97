"""A worker's model pieces as one module, with its optimizer and learning-rate scheduler.

Purpose: what a stage (:class:`~virtualflow.runtime.pipeline.engine.StageEngine`) and a copy of a
stage (:class:`~virtualflow.runtime.pipeline.redundancy.StageReplica`) both hold, built the same
way so that the same update code gives the same values.

Invariants: the module holds the pieces' layers under their whole-model names (``"0"``, ``"1"``,
...), so its ``state_dict`` is this worker's slice of the whole model's ``state_dict``; a worker
whose pieces have no parameters has a :class:`NoOptimizer` and no scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn


class NoOptimizer:
    """The optimizer of a worker without parameters: nothing to update, an empty state."""

    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def stage_model(pieces: dict[int, nn.Module], build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None
                ) -> tuple[dict[int, nn.Module], nn.Sequential, list[torch.Tensor], Any, Any]:
    """(pieces sorted by index, their layers as one module, its trainable parameters, optimizer,
    scheduler). ``build_optimizer`` takes that module (``Job.build_optimizer``: a factory that
    takes the model gets the stage's module, whose parameter names are the whole model's
    ``"<layer index>.<name>"`` for this worker's layers only)."""
    pieces = dict(sorted(pieces.items()))
    model = nn.Sequential(OrderedDict(
        (name, layer) for k in pieces for name, layer in pieces[k].named_children()
    ))
    params = [q for q in model.parameters() if q.requires_grad]
    # A worker whose pieces have no parameters (a stage of activations only) has no optimizer.
    optimizer = build_optimizer(model) if params else NoOptimizer()
    scheduler = scheduler_factory(optimizer) if scheduler_factory is not None and params else None
    return pieces, model, params, optimizer, scheduler


def apply_update(optimizer: Any, scheduler: Any) -> None:
    """Take the optimizer step on the gradients in ``.grad`` (and the scheduler's), then clear them."""
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def flat_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient, flat (zeros where it has none)."""
    return [q.grad.reshape(-1) if q.grad is not None else q.new_zeros(q.numel()) for q in params]


def load_grads(params: list[torch.Tensor], flat: torch.Tensor, *, clone: bool = True) -> int:
    """Set each parameter's ``.grad`` from ``flat`` (parameter after parameter); returns the
    elements used. ``clone=False``: views of ``flat``."""
    offset = 0
    for q in params:
        g = flat[offset: offset + q.numel()].view_as(q)
        q.grad = g.clone() if clone else g
        offset += q.numel()
    return offset
