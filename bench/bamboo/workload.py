"""The benchmark's names and targets, and its job: sleep-emulated ``nn.Linear`` layers with real
parameters (:class:`EmulatedLinear`, on :mod:`bench.harness.emulated`), shape and times from
``VF_BAMBOO_*`` environment variables.

Invariants: importable on its own (the worker processes import ``bamboo_job``'s model, data, loss and
optimizer from here); the launcher puts the shape into the environment (:func:`configure`) before
it starts workers, which inherit it.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H
from bench.harness import emulated as harness_emulated
from bench.harness.emulated import EnvSeconds


NAME = "bamboo"
TARGET_KEYS = ("redundancy_overhead", "redundancy_overhead_lazy", "failover_slowdown", "failover_s")
TARGET_OVERHEAD = 1.15
TARGET_FAILOVER_SLOWDOWN = 1.5
TARGET_FAILOVER_S = 1.0
SEED = H.SEED
P2_TRACE = "p2-xlarge-2020-11-20-hours"
NOT_MEASURED = "default, not measured"


# --------------------------------------------------------------------------------------------
# The workload: sleep-emulated Linear layers with real parameters (imported by the workers).


class EmulatedLinear(harness_emulated.EmulatedLinear):
    """An ``nn.Linear(width, width)``'s parameters; compute replaced by sleeps (``VF_BAMBOO_F_S`` /
    ``VF_BAMBOO_B_S`` seconds per micro-batch, set by the launcher from its calibration); the fixed
    gradients are made once."""

    def __init__(self, width: int) -> None:
        super().__init__(width, EnvSeconds("VF_BAMBOO_F_S", 0.002), EnvSeconds("VF_BAMBOO_B_S", 0.004))


def _width() -> int:
    return int(os.environ.get("VF_BAMBOO_WIDTH", "1024"))


def _layers() -> int:
    return int(os.environ.get("VF_BAMBOO_LAYERS", "8"))


def model() -> nn.Sequential:
    return nn.Sequential(*[EmulatedLinear(_width()) for _ in range(_layers())])


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = int(os.environ.get("VF_BAMBOO_SAMPLES", "2048"))
    return TensorDataset(torch.randn(n, _width(), generator=g), torch.zeros(n, 1))


def output_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return (out - batch[1]).pow(2).mean()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def bamboo_job():
    """The measured job; stages, schedule, batch and redundancy from ``VF_BAMBOO_*`` (the launcher
    sets them; worker processes inherit the environment)."""
    import virtualflow as vf

    env = os.environ
    mode = env.get("VF_BAMBOO_REDUNDANCY", "without")
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=int(env.get("VF_BAMBOO_B", "256")), virtual_nodes=int(env.get("VF_BAMBOO_M", "8")),
                  seed=SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_BAMBOO_STAGES", "2")), schedule="1f1b",
                                       redundancy=mode != "without",
                                       redundant_compute="lazy" if mode == "lazy" else "eager"))


MODES = ("without", "lazy", "eager")
"""No redundancy; ``redundancy=True, redundant_compute="lazy"`` (replica refresh only);
``redundancy=True`` with the default ``redundant_compute="eager"`` (refresh + eager forwards)."""


def configure(args, redundancy: bool | str | None = None) -> None:
    """Put the job's shape into the environment (read by ``bamboo_job`` here and in the workers);
    ``redundancy``: one of :data:`MODES`, or ``True`` (the default mode, eager) / ``False``."""
    os.environ.update(VF_BAMBOO_WIDTH=str(args.width), VF_BAMBOO_LAYERS=str(args.layers_per_stage * args.stages),
                      VF_BAMBOO_STAGES=str(args.stages), VF_BAMBOO_M=str(args.m), VF_BAMBOO_B=str(args.m * args.mb),
                      VF_BAMBOO_SAMPLES=str(max(2048, 4 * args.m * args.mb)),
                      VF_BAMBOO_F_S=str(args.f_s), VF_BAMBOO_B_S=str(args.b_s))
    if redundancy is not None:
        mode = {True: "eager", False: "without"}.get(redundancy, redundancy)
        if mode not in MODES:
            raise ValueError(f"redundancy mode {redundancy!r} must be one of {MODES}")
        os.environ["VF_BAMBOO_REDUNDANCY"] = mode
