"""Emulated compute: the one timed layer of the benchmarks, whose forward and backward *sleep*
for given times instead of (or besides) computing.

This is a shared 2-core machine: real compute of 4-6 pipeline stages cannot overlap here, but
sleeps can, so a benchmark that needs more "devices" than cores replaces (part of) a layer's
compute by sleeps of the times the real layer would take.

Invariants:

* :func:`sleep_through` is an identity on its input (a copy, ``x.clone()``, so autograd sees a
  new tensor), sleeps ``forward_s`` in the forward and ``backward_s`` in the backward and passes
  the incoming gradient through unchanged. A time of 0 or less does not sleep.
* Parameters handed to it get the gradients it is told to give (``grads``): fixed tensors made
  once, a fill value made into fresh tensors of each parameter's shape at every backward, or none.
  Autograd accumulates them like real gradients, so optimizers, reductions and Bamboo's replica
  hand-over do their real work on real sizes.
* A time is a float fixed at construction or an :class:`EnvSeconds` read from the environment at
  every call: worker processes inherit the launcher's environment, so a launcher sets the times
  of the layers its workers build (a model is built in each worker, not shipped).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import nn

__all__ = ["EnvSeconds", "Seconds", "seconds_of", "sleep_for", "sleep_through", "EmulatedLinear"]


@dataclass(frozen=True)
class EnvSeconds:
    """A time read from the environment variable ``name`` at every call (``default`` when unset)."""

    name: str
    default: float

    def __call__(self) -> float:
        return float(os.environ.get(self.name, str(self.default)))


Seconds = Union[float, EnvSeconds]


def seconds_of(s: Seconds) -> float:
    """The time ``s`` stands for now."""
    return s() if isinstance(s, EnvSeconds) else float(s)


def sleep_for(seconds: float) -> None:
    """Sleep ``seconds`` (nothing for 0 or less): the emulated compute itself."""
    if seconds > 0:
        time.sleep(seconds)


class _SleepThrough(torch.autograd.Function):
    """See :func:`sleep_through`. ``grads``: a tuple of tensors (given as they are), a float (fresh
    ``torch.full`` tensors of each parameter's shape) or None (no gradient for the parameters)."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float, grads, *params):
        ctx.backward_s, ctx.grads = backward_s, grads
        ctx.shapes = tuple(p.shape for p in params)
        sleep_for(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        sleep_for(ctx.backward_s)
        if ctx.grads is None:
            given = (None,) * len(ctx.shapes)
        elif isinstance(ctx.grads, float):
            given = tuple(torch.full(shape, ctx.grads) for shape in ctx.shapes)
        else:
            given = tuple(ctx.grads)
        return (grad, None, None, None, *given)


def sleep_through(x: torch.Tensor, forward_s: float, backward_s: float, params: Sequence[torch.Tensor] = (),
                  grads: Sequence[torch.Tensor] | float | None = None) -> torch.Tensor:
    """``x`` (a copy) after sleeping ``forward_s``; its backward sleeps ``backward_s``, passes the
    gradient through and gives each of ``params`` its gradient from ``grads`` (see the module's
    invariants)."""
    if grads is not None and not isinstance(grads, float):
        grads = tuple(grads)
        if len(grads) != len(params):
            raise ValueError(f"sleep_through got {len(grads)} fixed gradients for {len(params)} parameters; "
                             "give one per parameter, a fill value, or None")
    return _SleepThrough.apply(x, forward_s, backward_s, grads, *params)


class EmulatedLinear(nn.Module):
    """An ``nn.Linear(width, width)``'s parameters (``weight`` ~ N(0, 1/width), ``bias`` zeros);
    compute replaced by sleeps: the forward sleeps ``forward_s`` and passes the activations
    through, the backward sleeps ``backward_s`` and gives ``weight`` and ``bias`` the fixed
    gradient ``grad`` of their size.

    ``reuse_grads``: True makes the gradient tensors once (plain attributes, not buffers: buffers
    travel in Bamboo's replica message) and hands them to autograd at every backward; False makes
    fresh ones at every backward (their allocation is then part of the backward's CPU time).
    """

    def __init__(self, width: int, forward_s: Seconds, backward_s: Seconds, *, grad: float = 1e-4,
                 reuse_grads: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.bias = nn.Parameter(torch.zeros(width))
        self.forward_s, self.backward_s = forward_s, backward_s
        self._grads: tuple[torch.Tensor, ...] | float = float(grad)
        if reuse_grads:
            self._grads = (torch.full((width, width), grad), torch.full((width,), grad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sleep_through(x, seconds_of(self.forward_s), seconds_of(self.backward_s), (self.weight, self.bias),
                             self._grads)
