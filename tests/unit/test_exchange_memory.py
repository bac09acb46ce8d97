"""No worker's memory grows over 500 steps of any exchange (issue 44).

The VN engine runs on two workers in this process (one thread each, real gloo groups over an
in-process TCP store, as tests/unit/test_composition.py does) with each way of bringing the
gradients together: the default mode's bucketed all-reduce, deterministic mode's ``owners`` and
``slots`` exchanges, each also with ``reduction="sharded"``. After a warm-up, the cyclic garbage
collector is switched off for the 500 measured steps: a buffer that only a reference cycle keeps
alive then stays, as it does in a worker between the collector's rare full passes (the ``slots``
exchange's ``S x numel`` buffer did, through a self-calling closure: 3.4-7 GB workers on a 25 M
model). The process's resident memory (VmRSS) after the 500 steps may exceed the one after the
warm-up by at most ``GROWTH_BOUND_MIB``: the leak grew it by ``2 workers x 2 slots x numel x 4``
bytes per step here, 30 times the bound over the 500 steps.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from virtualflow.comm.groups import make_group
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.vn_worker import VNWorkerEngine

CPU = torch.device("cpu")
WORKERS = 2
VIRTUAL_NODES = 2
WARMUP_STEPS = 10
STEPS = 500
WIDTH = 192
GROWTH_BOUND_MIB = 16.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc/self/status")


def model() -> nn.Module:
    """About 40 K parameters: a leaf vector of 160 KiB (a slots buffer of 2 x that)."""
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    return TensorDataset(x, x[:, :1].tanh())


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def mse(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


def release_free_memory() -> None:
    """Hand memory malloc holds free back to the kernel (glibc's ``malloc_trim``), so that a step
    reusing it shows in RSS again (what an earlier test freed would otherwise hide a leak)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure is only less sensitive
        pass


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_growth(deterministic: bool, exchange: str, reduction: str) -> tuple[float, float, int]:
    """(RSS after the warm-up, after the measured steps, in MiB; objects the collector freed then)."""
    job = vf.Job(model=model, optimizer=sgd, loss=mse, dataset=data, global_batch_size=4,
                 virtual_nodes=VIRTUAL_NODES, seed=1, name="exchange-memory")
    ds = job.build_dataset()
    cfg = types.SimpleNamespace(options=WorkerOptions(deterministic=deterministic, reduction=reduction,
                                                      shard_replicas=0, deterministic_exchange=exchange))
    engines = [VNWorkerEngine.build(job, ds, DataPlan.of_job(job, len(ds)), cfg, CPU).vn for _ in range(WORKERS)]
    per = VIRTUAL_NODES // WORKERS
    assignment = [list(range(r * per, (r + 1) * per)) for r in range(WORKERS)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    barrier = threading.Barrier(WORKERS, timeout=60)
    marks: dict[str, float] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        group = None
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))
            group = make_group(client, 0, rank, WORKERS, 60.0, CPU)
            eng = engines[rank]
            eng.set_membership(group, assignment)
            for step in range(WARMUP_STEPS + STEPS):
                if step == WARMUP_STEPS:
                    barrier.wait()
                    if rank == 0:
                        gc.collect()
                        gc.disable()
                        release_free_memory()
                        marks["warm"] = rss_mib()
                    barrier.wait()
                eng.step(step)
            barrier.wait()
            if rank == 0:
                marks["end"] = rss_mib()
            eng.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()
        finally:
            if group is not None:
                group.close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(WORKERS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        freed = gc.collect()
        gc.enable()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish in 120 s"
    return marks["warm"], marks["end"], freed


@pytest.mark.parametrize("reduction", ["allreduce", "sharded"])
@pytest.mark.parametrize("deterministic,exchange", [(False, "auto"), (True, "owners"), (True, "slots")],
                         ids=["default", "owners", "slots"])
def test_no_exchange_grows_memory(deterministic: bool, exchange: str, reduction: str) -> None:
    warm, end, freed = rss_growth(deterministic, exchange, reduction)
    assert end - warm <= GROWTH_BOUND_MIB, (
        f"{exchange if deterministic else 'default'} exchange, reduction={reduction}: RSS grew from {warm:.0f} MiB "
        f"to {end:.0f} MiB over {STEPS} steps (bound {GROWTH_BOUND_MIB:.0f} MiB); the cyclic collector then freed "
        f"{freed} objects")
