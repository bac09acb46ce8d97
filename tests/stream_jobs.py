"""Streaming jobs for the tests (worker processes import them): uneven shards of a regression
stream, each sample carrying its id, read by the rule of virtualflow.plan.streams.

The ledger jobs' loss appends the sample ids of every batch it sees to ``ledger-<pid>.txt`` in the
folder ``VF_TEST_LEDGER``: the exactly-once ledger of tests/e2e/test_streaming_e2e.py.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import virtualflow as vf

FEATURES = 6
SHARD_LENGTHS = [13, 0, 29, 7, 21, 2, 17, 11]
"""Uneven, one empty: 100 samples."""


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``i`` (a pure function of its id): (x, y, id)."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(FEATURES, generator=g)
    y = (x[:1] * 2 - x[1:2]).tanh()
    return x, y, torch.tensor(i)


def first_ids(lengths: list[int] = SHARD_LENGTHS) -> list[int]:
    out, n = [], 0
    for length in lengths:
        out.append(n)
        n += length
    return out


def shard(k: int, lengths: list[int] = SHARD_LENGTHS):
    """Shard ``k``: a generator of its samples, from ``start`` (the seek form)."""
    first = first_ids(lengths)[k]

    def read(start: int = 0):
        return (sample(first + j) for j in range(start, lengths[k]))
    return read


def stream(shuffle_buffer: int = 5, seek: bool = False) -> vf.StreamingDataset:
    return vf.StreamingDataset(shards=[shard(k) for k in range(len(SHARD_LENGTHS))], lengths=SHARD_LENGTHS,
                               shuffle_buffer=shuffle_buffer, seek=seek)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def mse(model, batch):
    x, y, _ = batch
    return ((model(x) - y) ** 2).mean()


def ledger_mse(model, batch):
    """``mse``, and the batch's sample ids appended to the ledger (``VF_TEST_LEDGER``)."""
    with open(os.path.join(os.environ["VF_TEST_LEDGER"], f"ledger-{os.getpid()}.txt"), "a") as f:
        f.write(" ".join(str(i) for i in batch[2].tolist()) + "\n")
    return mse(model, batch)


def paced_ledger_mse(model, batch):
    time.sleep(0.01)
    return ledger_mse(model, batch)


def stream_job() -> vf.Job:
    """B=12, V=6: 8 steps per epoch (4 samples dropped per epoch), a shuffle buffer of 5."""
    return vf.Job(name="stream", model=mlp, optimizer=adam, loss=mse, dataset=stream,
                  global_batch_size=12, virtual_nodes=6, seed=3)


def ledger_stream_job() -> vf.Job:
    """``stream_job`` keeping the ledger: the same training."""
    return stream_job().replace(loss=ledger_mse)


def paced_stream_job() -> vf.Job:
    return stream_job().replace(loss=paced_ledger_mse)


def pipelined_stream_job() -> vf.Job:
    """The same stream and model, cut into 2 pipeline stages (the last one's loss reads the batch)."""
    return stream_job().replace(loss=None, output_loss=lambda out, batch: ((out - batch[1]) ** 2).mean(),
                                pipeline=vf.Pipeline(stages=2))
