"""A small MLP on generated regression data: the quickest real virtualflow job.

    virtualflow run examples/synthetic.py --workers 2 --steps 50
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf


def make_dataset(n: int = 2048, features: int = 16, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_job() -> vf.Job:
    return vf.Job(
        name="synthetic-mlp",
        model=make_model,
        optimizer=make_optimizer,
        loss=mse_loss,
        dataset=make_dataset,
        global_batch_size=64,
        virtual_nodes=8,
        seed=0,
    )


if __name__ == "__main__":
    result = vf.train(make_job, workers=2, steps=50, progress=True)
    print(f"final loss {result.history[-1]['loss']:.4f}")
