"""The sleep-emulated GPT-style chain of ``bench.parallel3d``: one table of per-layer costs, used
both by the grid planner (:func:`layer_profiles`) and by the job that runs it (:func:`grid_job`).

A layer is emulated compute plus a tiny real model part:

* ``embed`` and ``head`` (replicated: never tensor-parallel): a real ``nn.Linear(HIDDEN,
  HIDDEN)``, then a sleep of the table's forward time (its backward time in the backward);
* ``attn*`` and ``mlp*`` (tensor-parallel): a sleep, then a real pre-LayerNorm sub-layer of a
  transformer layer of nanoGPT's shape (virtualflow's :class:`~virtualflow.parallel.AttentionBlock`
  with ``HEADS`` heads, :class:`~virtualflow.parallel.MLPBlock` 4x wide): on
  ``Pipeline(tensor=T)`` the converter splits it and its collectives really run. The bench knows ``T`` for the
  layout it builds, so a block sleeps its cost divided by ``T`` (a tensor-parallel block's compute
  divides by ``T``); a replicated layer sleeps its full cost.

Sleeping frees the CPU, so 4 worker processes overlap on 2 cores as 4 devices would. The real
parts are small (hidden 32, 8 tokens, 4 samples per VN): their CPU time is the framework's share,
not the emulated compute's.

Invariants: importable on its own (torch, virtualflow, :mod:`bench.harness.emulated`); worker
processes import :func:`grid_job`'s pieces from here. The parameter bytes of the table are the real
model's (:func:`real_param_bytes`), so the planner's gradient all-reduce moves what the job moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench.harness.emulated import sleep_through

HIDDEN, HEADS, SEQ, VN_BATCH, VIRTUAL_NODES = 32, 4, 8, 4, 4
FLOAT_BYTES = 4


@dataclass(frozen=True)
class EmulatedLayer:
    name: str
    forward_ms: float
    """Emulated forward per micro-batch (one VN) at T = 1; the backward is ``BACKWARD_FACTOR`` times it."""
    tensor_parallel: bool


BACKWARD_FACTOR = 2.0
TABLE: tuple[EmulatedLayer, ...] = (
    EmulatedLayer("embed", 5.0, False),
    EmulatedLayer("attn0", 30.0, True),
    EmulatedLayer("mlp0", 30.0, True),
    EmulatedLayer("attn1", 30.0, True),
    EmulatedLayer("mlp1", 30.0, True),
    EmulatedLayer("head", 10.0, False),
)
"""THE cost table: ms of emulated forward per layer per micro-batch (one VN), backward 2x. A
transformer layer is two rows (its attention and its MLP sub-layer: one column/row-parallel pair
each), so that each row is one tensor-parallel pair."""


class SleepLinear(nn.Module):
    """A replicated layer: a real Linear, then a sleep of ``forward_s`` (``backward_s`` backward)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sleep_through(self.linear(x), self.forward_s, self.backward_s)


class SleepBlock(nn.Module):
    """A tensor-parallel layer: a sleep of ``forward_s`` (``backward_s`` backward), then a real
    pre-LayerNorm attention (``kind="attn"``) or MLP (``"mlp"``) sub-layer of nanoGPT's shape,
    split by the converter with ``tensor > 1``."""

    def __init__(self, kind: str, forward_s: float, backward_s: float, seed: int) -> None:
        super().__init__()
        from virtualflow.parallel import AttentionBlock, BlockConfig, MLPBlock

        cfg = BlockConfig(layer_norm=True)
        self.block = (AttentionBlock(HIDDEN, HEADS, seed=seed, config=cfg) if kind == "attn"
                      else MLPBlock(HIDDEN, 4 * HIDDEN, seed=seed, config=cfg))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(sleep_through(x, self.forward_s, self.backward_s))


def model(tensor: int = 1, scale: float = 1.0) -> nn.Sequential:
    """The chain for a layout with ``tensor`` workers per stage (blocks sleep ``1 / tensor`` of
    their cost); ``scale`` multiplies every sleep (0: the framework alone)."""
    layers = []
    for i, layer in enumerate(TABLE):
        div = tensor if layer.tensor_parallel else 1
        f = scale * layer.forward_ms / 1e3 / div
        b = BACKWARD_FACTOR * f
        layers.append(SleepBlock(layer.name.rstrip("0123456789"), f, b, seed=i) if layer.tensor_parallel
                      else SleepLinear(f, b))
    return nn.Sequential(*layers)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(VN_BATCH * VIRTUAL_NODES * 8, SEQ, HIDDEN, generator=g)
    return TensorDataset(x, torch.tanh(x))


def output_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return (out - batch[1]).pow(2).mean()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def real_param_bytes() -> list[int]:
    """Bytes of each layer's real parameters (float32), whole (T = 1)."""
    return [sum(p.numel() for p in layer.parameters()) * FLOAT_BYTES for layer in model()]


def grid_job(tensor: int, stages: int, schedule: str, chunks: int, split: tuple[int, ...], scale: float = 1.0,
             precision: str = "32"):
    """The job of one layout: ``Pipeline(stages, tensor, schedule, chunks, split)`` at ``precision``
    (``Job.precision``: the real parts' autocast); its replicas come from the number of workers it
    is run on."""
    import virtualflow as vf

    return vf.Job(model=lambda: model(tensor, scale), optimizer=sgd, dataset=data, output_loss=output_loss,
                  global_batch_size=VN_BATCH * VIRTUAL_NODES, virtual_nodes=VIRTUAL_NODES, seed=0, precision=precision,
                  pipeline=vf.Pipeline(stages=stages, tensor=tensor, schedule=schedule, chunks=chunks,
                                       split=tuple(split)))
