"""The sleep-emulated pipeline workload of ``bench.bamboo_failover`` and ``bench.bamboo_replicas``:
one :class:`SleepStage` per stage, shape and times from ``VF_BF_*`` environment variables.

Invariants:

* Module level, importable on its own (torch and :mod:`bench.harness.emulated` only): the worker
  processes import ``model``, ``data``, ``output_loss`` and ``adamw`` from here.
* The shape is read from the environment when a model or data set is built, the times at every
  forward (:class:`~bench.harness.emulated.EnvSeconds`): a launcher sets ``VF_BF_WIDTH``,
  ``VF_BF_STAGES``, ``VF_BF_F_S`` and ``VF_BF_B_S`` (:func:`configure_stages`) before it starts
  the workers, which inherit its environment.
* Defaults (no variable set): width 1024, 3 stages, forward 12 ms and backward 24 ms per
  micro-batch (about four ``nn.Linear(1024, 1024)`` at micro-batch 256 on this machine).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench.harness.emulated import EmulatedLinear, EnvSeconds

__all__ = ["SleepStage", "model", "data", "output_loss", "adamw", "configure_stages"]


class SleepStage(EmulatedLinear):
    """One stage: a real ``width x width`` weight and bias; compute replaced by sleeps
    (``VF_BF_F_S`` forward, ``VF_BF_B_S`` backward, read at every call); fresh fixed gradients at
    every backward."""

    def __init__(self, width: int) -> None:
        super().__init__(width, EnvSeconds("VF_BF_F_S", 0.012), EnvSeconds("VF_BF_B_S", 0.024), reuse_grads=False)


def _width() -> int:
    return int(os.environ.get("VF_BF_WIDTH", "1024"))


def model() -> nn.Sequential:
    return nn.Sequential(*[SleepStage(_width()) for _ in range(int(os.environ.get("VF_BF_STAGES", "3")))])


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(512, _width(), generator=g), torch.zeros(512, 1))


def output_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return (out - batch[1]).pow(2).mean()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def configure_stages(*, width: int, stages: int, f_ms: float, b_ms: float) -> dict[str, str]:
    """The stages' shape and times as ``VF_BF_*`` variables (the caller puts them into
    ``os.environ``)."""
    return {"VF_BF_WIDTH": str(width), "VF_BF_STAGES": str(stages), "VF_BF_F_S": str(f_ms / 1e3),
            "VF_BF_B_S": str(b_ms / 1e3)}
