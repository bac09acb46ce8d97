"""The benchmark's names and targets, and the part-2 workload: the resize benchmarks' 25 M-parameter
MLP with Adam, global batch 48 (:func:`coconet_job` for ``virtualflow.train``; model, data and
optimizer for the plain-torch ranks), and its memory readings.

Invariant: importable on its own (worker and child processes build the model from here).
"""

from __future__ import annotations

import torch
from torch import nn

from bench import harness as H


NAME = "coconet"
MODULE = "bench.coconet"
TARGET_KEYS = ("rs_speedup", "step_ratio", "opt_bytes_ratio", "rss_saving_fraction")
WORLD = 2
RS_TARGET = 1.8
STEP_TARGET = 1.00
RSS_SAVING_TARGET = 0.8

# The part-2 workload: the resize benchmarks' 25 M-parameter MLP with Adam, global batch 48.
WIDTHS = (1024, 4096, 4096, 1024, 10)
GLOBAL_BATCH = 48
VIRTUAL_NODES = 2
SAMPLES = 4096
LR = 1e-3


# --------------------------------------------------------------------------------------------
# (2) The sharded step: the workload, plain-torch variants, and virtualflow.train.


def coconet_model() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def coconet_data():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, WIDTHS[0], generator=g)
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def coconet_adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _proc_status_mib(name: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def coconet_memory(model: nn.Module) -> dict[str, float]:
    """``Job.evaluate`` (rank 0, every ``EVAL_EVERY`` steps and after the last): the worker's peak
    and current resident memory."""
    return {"vmhwm_mib": _proc_status_mib("VmHWM"), "vmrss_mib": _proc_status_mib("VmRSS")}


EVAL_EVERY = 4


def coconet_job():
    """The part-2 job for virtualflow.train (imported by the worker processes)."""
    import virtualflow as vf

    return vf.Job(model=coconet_model, optimizer=coconet_adam, loss=H.cross_entropy, dataset=coconet_data,
                  global_batch_size=GLOBAL_BATCH, virtual_nodes=VIRTUAL_NODES, seed=H.SEED,
                  evaluate=coconet_memory, eval_every=EVAL_EVERY, name="coconet")


def param_count() -> int:
    return sum(p.numel() for p in coconet_model().parameters())
