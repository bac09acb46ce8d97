"""The benchmark's names and targets, and its two workloads: (1) the real-compute MLP run against
``torch.distributed.pipelining``, and (2) the emulated one: :class:`PacedLayer`, whose forward
and backward sleep (:func:`bench.harness.emulated.sleep_through`) with the input-gradient and
weight-gradient paths timed apart.

Invariant: importable on its own (worker and child processes build the jobs from here).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H
from bench.harness.emulated import sleep_through


NAME = "pipeline"
MODULE = "bench.pipeline"
VS_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
EMU_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "2bw")
TARGET_KEYS = ("ratio_gpipe", "ratio_1f1b", "ratio_interleaved_1f1b", "weight_diff", "bubble_error",
               "throughput_2bw", "ratio_deterministic")
TARGET_RATIO = 1.00
TARGET_WEIGHT_DIFF = 1e-4
TARGET_BUBBLE_ERR = 0.05
TARGET_TPUT_2BW = 1.00
SEED = H.SEED
CPU = torch.device("cpu")
COMPUTE = ("F", "B", "I", "W")

# (1) the real-compute workload
VS_P = 2
VS_IN, VS_HIDDEN, VS_CLASSES = 256, 512, H.CLASSES
VS_DATASET = 4096

# (2) the emulated workload
EMU_P = 4
EMU_WIDTH = 16
EMU_MB = 4


def vs_data() -> TensorDataset:
    """The harness's synthetic classification set, cut to 4,096 samples of its first 256 features
    (labels from its teacher)."""
    x, y = H.bench_data().tensors
    return TensorDataset(x[:VS_DATASET, :VS_IN].contiguous(), y[:VS_DATASET])


def vs_model(hidden: int = VS_HIDDEN) -> nn.Sequential:
    """8 layers: 7 Linear+ReLU blocks and a Linear head (p=2: 4 + 4 layers; v=2: 2 per piece)."""
    blocks = [nn.Sequential(nn.Linear(VS_IN, hidden), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(hidden, VS_CLASSES))


def vs_loss(out: torch.Tensor, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def vs_job(schedule: str, m: int, mb: int, hidden: int, replicas: int = 1):
    """``m`` micro-batches of ``mb`` samples per pipeline replica (one VN each)."""
    import virtualflow as vf

    chunks = 2 if schedule == "interleaved_1f1b" else 1
    return vf.Job(model=lambda: vs_model(hidden), optimizer=H.sgd, output_loss=vs_loss, dataset=vs_data,
                  global_batch_size=m * mb * replicas, virtual_nodes=m * replicas, seed=SEED,
                  pipeline=vf.Pipeline(stages=VS_P, schedule=schedule, chunks=chunks), name=NAME)


# --------------------------------------------------------------------------------------------
# (2) + (3) emulated compute: sleep-paced layers, p = 4.


class PacedLayer(nn.Module):
    """Forward sleeps ``f``; backward sleeps ``i`` on the input-gradient path and ``w`` on the
    weight-gradient path; ``x * gain + bias`` saves tensors for backward like a real layer."""

    def __init__(self, width: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.f, self.i, self.w = f, i, w

    def forward(self, x):
        return sleep_through(x, self.f, self.i) * sleep_through(self.gain, 0.0, self.w) + self.bias


def emu_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, EMU_WIDTH, generator=g)
    return TensorDataset(x, x.tanh())


def emu_loss(out, batch):
    return nn.functional.mse_loss(out, batch[1])


def emu_job(schedule: str, m: int, f: float, i: float, w: float, window: int):
    """p * v paced layers (times / v each), one per piece; piece 0 also holds a small Linear, so its
    backward has an input-gradient path too (every stage's B = i + w)."""
    import virtualflow as vf

    v = 2 if schedule == "interleaved_1f1b" else 1
    n = EMU_P * v

    def model():
        return nn.Sequential(nn.Linear(EMU_WIDTH, EMU_WIDTH),
                             *[PacedLayer(EMU_WIDTH, f / v, i / v, w / v) for _ in range(n)])

    pipe = vf.Pipeline(stages=EMU_P, schedule=schedule, chunks=v, split=[2] + [1] * (n - 1), record_timeline=True,
                       window=window)
    return vf.Job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), output_loss=emu_loss,
                  dataset=emu_data, global_batch_size=m * EMU_MB, virtual_nodes=m, seed=SEED, pipeline=pipe,
                  name=NAME)
