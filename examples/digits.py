"""A small CNN with BatchNorm and dropout on scikit-learn's handwritten digits (no download).

1,797 8x8 images, split once (seeded) into 1,437 for training and 360 held out; the held-out
accuracy is reported every ``eval_every`` steps and at the end.

    virtualflow run examples/digits.py --workers 2 --epochs 5
    virtualflow run examples/digits.py --workers 4 --epochs 5 --deterministic
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf

EVAL_SAMPLES = 360


@functools.lru_cache(maxsize=1)
def _split() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no network

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(2024))
    x, y = (x[order] - 0.3) / 0.4, y[order]
    return TensorDataset(x[EVAL_SAMPLES:], y[EVAL_SAMPLES:]), TensorDataset(x[:EVAL_SAMPLES], y[:EVAL_SAMPLES])


def train_set() -> TensorDataset:
    return _split()[0]


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def scheduler(opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)


def loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def evaluate(model: nn.Module) -> dict[str, float]:
    x, y = _split()[1].tensors
    logits = model(x)
    return {
        "accuracy": (logits.argmax(1) == y).float().mean().item(),
        "eval_loss": nn.functional.cross_entropy(logits, y).item(),
    }


def make_job() -> vf.Job:
    return vf.Job(
        name="digits-cnn",
        model=DigitsCNN,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        loss=loss,
        dataset=train_set,
        global_batch_size=64,
        virtual_nodes=8,
        evaluate=evaluate,
        eval_every=22,  # about once per epoch (1,437 // 64 = 22 steps)
        seed=0,
    )
