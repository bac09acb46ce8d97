"""Paths of the repository and the benchmarks' workloads (module-level job factories that worker
processes import by reference)."""

from __future__ import annotations

import functools

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench.harness.machine import minor_faults, ru_maxrss_mib, vmhwm_mib


# --------------------------------------------------------------------------------------------
# Workloads (module-level functions: worker processes import them).
#
# The MLP of vn_overhead, vs_ddp and ray_overhead: 512 -> 1024 -> 1024 -> 1024 -> 10, ReLU,
# 2.6 M parameters, SGD + momentum, a synthetic classification set of 8,192 samples. On one core
# a step over a global batch of 256 takes tens of milliseconds, so per-step fixed costs are
# measured honestly without dominating.

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
DATASET_SIZE = 8192
SEED = 0


def bench_data() -> TensorDataset:
    """8,192 samples of 512 features, labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET_SIZE, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def memory_metrics(model: nn.Module) -> dict[str, float]:
    """Used as ``Job.evaluate``: runs on rank 0 after the last step (before the final state is
    written); reports the worker's own peak RSS (VmHWM), ru_maxrss and its minor page faults."""
    return {"vmhwm_mib": vmhwm_mib(), "ru_maxrss_mib": ru_maxrss_mib(), "minor_faults": float(minor_faults())}


def param_count() -> int:
    return sum(p.numel() for p in mlp().parameters())


def batch_indices(n: int, batch: int, step: int, lo: int = 0, hi: int | None = None, seed: int = SEED) -> torch.Tensor:
    """Dataset indices of positions ``[lo, hi)`` (default: all) of global ``step``'s batch of
    ``batch`` samples from ``n``, in virtualflow's data order (``Job.data_order="feistel"``,
    :func:`virtualflow.epoch_indices`): the samples a plain loop must read to train on what a job
    does. The plain loop gets the order the way a PyTorch user's sampler does, one whole epoch
    at a time (computed once, then sliced: nothing per step), so no baseline pays for the order
    per step; the tests check the order against their own reference."""
    hi = batch if hi is None else hi
    epoch, i = divmod(step, n // batch)
    return _epoch_order(n, seed, epoch)[i * batch + lo:i * batch + hi]


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    import virtualflow as vf

    return vf.epoch_indices(range(n), n, seed, epoch)


MLP_DESCRIPTION = f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-{HIDDEN}-{CLASSES} ReLU"


def mlp_job(name: str, virtual_nodes: int):
    """The MLP on bench_data, B=256. ``memory_metrics`` runs as the evaluation after the last step
    (and every VF_BENCH_EVAL_EVERY steps)."""
    import virtualflow as vf

    return vf.Job(model=mlp, optimizer=sgd, loss=cross_entropy, dataset=bench_data, global_batch_size=256,
                  virtual_nodes=virtual_nodes, seed=SEED, evaluate=memory_metrics,
                  eval_every=int(os.environ.get("VF_BENCH_EVAL_EVERY", "0")) or None, name=name)


# The elasticity workload (resize, recovery, ray_overhead): MLPs of about 1 M and 25 M parameters
# with Adam, global batch 48 in 6 virtual nodes, 4,096 generated samples.

RESIZE_BATCH = 48
RESIZE_VNS = 6
RESIZE_SAMPLES = 4096
RESIZE_MODELS = {  # model name -> layer widths, the last one = classes
    "mlp-1m": (512, 1024, 512, 10),
    "mlp-25m": (1024, 4096, 4096, 1024, 10),
}


def _widths_mlp(widths) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _widths_data(widths) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(RESIZE_SAMPLES, widths[0], generator=g)
    teacher = torch.randn(widths[0], widths[-1], generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def model_1m() -> nn.Module:
    return _widths_mlp(RESIZE_MODELS["mlp-1m"])


def model_25m() -> nn.Module:
    return _widths_mlp(RESIZE_MODELS["mlp-25m"])


def data_1m() -> TensorDataset:
    return _widths_data(RESIZE_MODELS["mlp-1m"])


def data_25m() -> TensorDataset:
    return _widths_data(RESIZE_MODELS["mlp-25m"])


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _resize_job(name: str, model, data):
    import virtualflow as vf

    return vf.Job(model=model, optimizer=adam, loss=cross_entropy, dataset=data, global_batch_size=RESIZE_BATCH,
                  virtual_nodes=RESIZE_VNS, seed=SEED, name=name)


def resize_job_1m():
    return _resize_job("resize-mlp-1m", model_1m, data_1m)


def resize_job_25m():
    return _resize_job("resize-mlp-25m", model_25m, data_25m)


RESIZE_JOBS = {"mlp-1m": resize_job_1m, "mlp-25m": resize_job_25m}


def resize_params(model: str) -> int:
    return sum(p.numel() for p in _widths_mlp(RESIZE_MODELS[model]).parameters())


def parse_models(text: str) -> list[str]:
    """``--models mlp-1m,mlp-25m`` -> the names; an unknown one is a ValueError naming the choices."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    for m in models:
        if m not in RESIZE_MODELS:
            raise ValueError(f"--models: unknown model {m!r}; choose from {', '.join(RESIZE_MODELS)}")
    return models
