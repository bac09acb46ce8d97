"""Module-level job factories for the tests (worker processes must be able to import them)."""

from __future__ import annotations


import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import virtualflow as vf

from reference import order_index

FEATURES = 10


def regression_data(n: int = 256, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def pid_shuffled_data() -> TensorDataset:
    """regression_data shuffled with a seed of the process's id: a dataset that differs between
    worker processes (the mistake the join's dataset check refuses)."""
    import os

    data = regression_data()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(os.getpid()))
    return TensorDataset(*(t[perm] for t in data.tensors))


def long_metric_names_mse(model, batch):  # metric names too long for a step report
    loss = mse(model, batch)
    return loss, {f"{'m' * 30_000}{i}": loss.detach() for i in range(10)}


def classification_data(n: int = 192, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def bn_dropout_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3),
    )


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def cross_entropy(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def per_sample_loss(model, batch):  # not a scalar: a user mistake the preflight must catch
    x, y = batch
    return (model(x) - y) ** 2


def exploding_loss(model, batch):  # finite until the weights blow up
    x, y = batch
    return nn.functional.mse_loss(model(x), y) * 1e30 * 1e30


def accuracy(model) -> dict:
    ds = classification_data(96, seed=11)
    x, y = ds.tensors
    return {"accuracy": (model(x).argmax(1) == y).float().mean().item()}


OPTIMIZERS = {"sgd": sgd, "adam": adam}


def regression_job(optimizer: str = "sgd", virtual_nodes: int = 8, global_batch_size: int = 32, **kw) -> vf.Job:
    return vf.Job(
        name=f"mlp-{optimizer}",
        model=mlp,
        optimizer=OPTIMIZERS[optimizer],
        loss=mse,
        dataset=regression_data,
        global_batch_size=global_batch_size,
        virtual_nodes=virtual_nodes,
        lr_scheduler=step_lr,
        seed=5,
        **kw,
    )


def bn_job(batchnorm: str = "mean", **kw) -> vf.Job:
    return vf.Job(
        name="bn-dropout",
        model=bn_dropout_net,
        optimizer=sgd,
        loss=cross_entropy,
        dataset=classification_data,
        global_batch_size=48,
        virtual_nodes=8,
        batchnorm=batchnorm,
        seed=1,
        **kw,
    )


def make_job() -> vf.Job:
    """Importable by spec: 'jobs:make_job'."""
    return regression_job()


class SlowToImportDataset(Dataset):  # map-style dataset with per-sample __getitem__
    def __init__(self) -> None:
        self.base = regression_data()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return {"x": x, "y": y}


def dict_mse(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def dict_dataset_job() -> vf.Job:
    return vf.Job(model=mlp, optimizer=sgd, loss=dict_mse, dataset=SlowToImportDataset,
                  global_batch_size=32, virtual_nodes=4, seed=5)


# A dataset with one NaN sample placed, by the documented data order, in step 3, VN 5.
NAN_STEP, NAN_VN = 3, 5


def nan_data() -> TensorDataset:
    ds = regression_data()
    n, B, V, seed = len(ds), 32, 8, 5
    position = NAN_STEP * B + NAN_VN * (B // V) + 1  # of epoch 0's order
    x, y = ds.tensors
    x = x.clone()
    x[order_index(position, n, seed, 0), 0] = float("nan")
    return TensorDataset(x, y)


def nan_job() -> vf.Job:
    return regression_job("sgd").replace(dataset=nan_data)


def long_job() -> vf.Job:
    return regression_job("sgd", virtual_nodes=4)


class CrashingDataset(Dataset):
    """Raises for one sample that a worker reaches only after a few steps."""

    def __init__(self) -> None:
        self.base = regression_data()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        if i == 17:
            raise RuntimeError(f"boom at index {i}")
        return self.base[i]


def crashing_job() -> vf.Job:
    return regression_job("sgd").replace(dataset=CrashingDataset)


# -- elasticity -----------------------------------------------------------------------------
PACE_S = 0.004  # per virtual node: keeps a step long enough for resizes to land mid-run


def paced_cross_entropy(model, batch):
    time.sleep(PACE_S)
    return cross_entropy(model, batch)


def elastic_job() -> vf.Job:
    """Everything a state transfer must carry: BatchNorm buffers, dropout, Adam, an LR schedule."""
    return vf.Job(
        name="elastic",
        model=bn_dropout_net,
        optimizer=adam,
        loss=paced_cross_entropy,
        dataset=classification_data,
        global_batch_size=48,
        virtual_nodes=8,
        lr_scheduler=step_lr,
        seed=2,
    )


def paced_mse(model, batch):
    time.sleep(PACE_S / 8 * len(batch[0]))  # proportional to the VN's samples: 4 ms per 8
    return mse(model, batch)


def paced_regression_job() -> vf.Job:
    """No BatchNorm, no dropout: the update is the exact mean gradient whatever the VN sizes."""
    return regression_job("sgd", virtual_nodes=8, global_batch_size=64).replace(loss=paced_mse)


WIDE = 2048


def wide_mlp() -> nn.Module:
    """About 4.2 M parameters: with Adam a 50 MB state (16 MB tensors travel on their own)."""
    return nn.Sequential(nn.Linear(FEATURES, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE), nn.ReLU(),
                         nn.Linear(WIDE, 1))


def big_state_job() -> vf.Job:
    return vf.Job(
        name="big-state", model=wide_mlp, optimizer=adam, loss=mse, dataset=regression_data,
        global_batch_size=12, virtual_nodes=3, seed=5,
    )


SLOW_VN_S = 0.1


def slow_vn_cross_entropy(model, batch):
    time.sleep(SLOW_VN_S)
    return cross_entropy(model, batch)


def slow_vn_job() -> vf.Job:
    """Steps of several 100 ms virtual nodes per worker: long enough to see a survivor abandon
    a doomed step between two VNs."""
    return elastic_job().replace(loss=slow_vn_cross_entropy, virtual_nodes=12)


# ---- pipelined jobs (tests/test_pipeline_e2e.py) ----------------------------------------------
def _pipelined_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 3),
    )


def pipelined_job(schedule: str = "1f1b", stages: int = 2) -> vf.Job:
    from virtualflow.config.pipeline import Pipeline

    return vf.Job(
        model=_pipelined_net, optimizer=sgd, dataset=classification_data,
        output_loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        global_batch_size=32, virtual_nodes=8, seed=2,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
        evaluate=_accuracy, eval_every=2,
        pipeline=Pipeline(stages=stages, schedule=schedule),
    )


def _accuracy(model: nn.Module) -> dict[str, float]:
    x, y = classification_data().tensors
    return {"accuracy": float((model(x).argmax(1) == y).float().mean())}


def pipelined_slow_job() -> vf.Job:
    """pipelined_job, slowed down per step so a test can resize it mid-run."""
    job = pipelined_job()
    return job.replace(output_loss=lambda out, batch: (time.sleep(0.01), nn.functional.cross_entropy(out, batch[1]))[1])


def _ce_with_accuracy(out, batch):
    time.sleep(0.01)  # slow enough for a test to resize it mid-run
    loss = nn.functional.cross_entropy(out, batch[1])
    return loss, {"accuracy": (out.argmax(1) == batch[1]).float().mean()}


def pipelined_loop_job() -> vf.Job:
    """pipelined_job with the training loop's knobs: float16 with a loss scale that overflows at
    first (and grows every 2 applied steps), clipping, checkpointing, a metric from the loss."""
    return pipelined_job().replace(
        output_loss=_ce_with_accuracy, precision="16-mixed", loss_scale={"init_scale": 2.0 ** 20, "growth_interval": 2},
        max_grad_norm=0.5, activation_checkpointing="every", evaluate=None)


def pipelined_2bw_job() -> vf.Job:
    """A BatchNorm-free pipelined job on PipeDream-2BW (windows of 2 steps), slowed per step."""
    from virtualflow.config.pipeline import Pipeline

    return vf.Job(
        model=lambda: nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32),
                                    nn.Tanh(), nn.Linear(32, 3)),
        optimizer=sgd, dataset=classification_data,
        output_loss=lambda out, batch: (time.sleep(0.005), nn.functional.cross_entropy(out, batch[1]))[1],
        global_batch_size=32, virtual_nodes=8, seed=4,
        pipeline=Pipeline(stages=2, schedule="2bw", window=2),
    )


def _ragged_collate(samples):
    """Pads a VN's token sequences to a length that depends on its samples (so the activations
    crossing pipeline stages change shape from micro-batch to micro-batch)."""
    ids = torch.stack([s[0] for s in samples])
    length = 3 + int(ids[:, 0].sum()) % 4
    return ids[:, :length], torch.stack([s[1] for s in samples])


class _MeanOverTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def ragged_pipelined_job() -> vf.Job:
    from virtualflow.config.pipeline import Pipeline

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 20, (128, 6), generator=g)
    labels = (ids[:, 0] % 3).long()
    return vf.Job(
        model=lambda: nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Tanh(), _MeanOverTokens(),
                                    nn.Linear(8, 3)),
        optimizer=sgd, dataset=TensorDataset(ids, labels), collate_fn=_ragged_collate,
        output_loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        global_batch_size=32, virtual_nodes=8, seed=1, pipeline=Pipeline(stages=3, schedule="1f1b"),
    )


def pipelined_redundant_job() -> vf.Job:
    """A 3-stage pipelined job with Bamboo's redundant stages, slowed per step (resizes mid-run)."""
    from virtualflow.config.pipeline import Pipeline

    return vf.Job(
        model=_pipelined_net, optimizer=adam, dataset=classification_data,
        output_loss=lambda out, batch: (time.sleep(0.004), nn.functional.cross_entropy(out, batch[1]))[1],
        global_batch_size=32, virtual_nodes=8, seed=2,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
        pipeline=Pipeline(stages=3, schedule="1f1b", redundancy=True),
    )


def pipelined_redundant_job_4() -> vf.Job:
    """:func:`pipelined_redundant_job` on 4 stages (GPipe)."""
    from virtualflow.config.pipeline import Pipeline

    return pipelined_redundant_job().replace(pipeline=Pipeline(stages=4, schedule="gpipe", redundancy=True))


# ---- deterministic mode at scale (tests/e2e/test_deterministic_scale.py) -----------------------
class MLPAndLM(nn.Module):
    """Two nets side by side in one model: the BatchNorm + dropout MLP of :func:`bn_dropout_net`
    and :class:`lm_jobs.TinyLM` (causal attention with dropout, LayerNorm, a tied output matrix).
    Their losses add, so one run checks both (a worker process costs about a second to start
    here: the runs, not the models, are what a test of many worker counts pays for)."""

    def __init__(self) -> None:
        super().__init__()
        from lm_jobs import TinyLM

        self.mlp = bn_dropout_net()
        self.lm = TinyLM()


def mlp_and_lm_data(n: int = 96) -> TensorDataset:
    from lm_jobs import lm_data

    x, y = classification_data(n, seed=4).tensors
    idx, targets = lm_data(n, seed=9).tensors
    return TensorDataset(x, y, idx, targets)


def mlp_and_lm_loss(model: MLPAndLM, batch) -> torch.Tensor:
    from lm_jobs import lm_loss

    x, y, idx, targets = batch
    return cross_entropy(model.mlp, (x, y)) + lm_loss(model.lm, (idx, targets))


class StepPace:
    """Rank 0 sleeps after every step, so a step lasts at least ``seconds`` whatever the worker
    count (the others wait in the next exchange): a job resized several times then runs a few
    dozen steps while newcomers start, not hundreds, and its reference stays short. Sleeping
    frees the CPU for the newcomers. It changes nothing the model sees."""

    ranks = "zero"

    def __init__(self, seconds: float = 0.25) -> None:
        self.seconds = seconds

    def on_step_end(self, info) -> None:
        time.sleep(self.seconds)


def long_warmup_cosine(optimizer: torch.optim.Optimizer):
    """Warmup then a cosine that stays far from 0 for the steps a test runs (a rate of 0 would
    stop the weights changing, and a later difference could not show)."""
    from lm_jobs import warmup_cosine

    return warmup_cosine(optimizer, warmup=2, total=1000)


def mlp_and_lm_job(virtual_nodes: int = 16, paced: bool = False) -> vf.Job:
    """Deterministic mode's hardest everyday case: BatchNorm statistics and the loss ride the
    exchange, dropout draws per VN, AdamW with groups, clipping by the whole step's norm, warmup
    then cosine. B = 48 is a multiple of V = 16 and V = 12 (3 or 4 samples per VN). ``paced``:
    with :class:`StepPace` (for runs resized while they train)."""
    from lm_jobs import adamw_groups

    return vf.Job(
        name=f"mlp-and-lm-v{virtual_nodes}", model=MLPAndLM, optimizer=adamw_groups,
        loss=mlp_and_lm_loss, dataset=mlp_and_lm_data, global_batch_size=48, virtual_nodes=virtual_nodes,
        lr_scheduler=long_warmup_cosine, max_grad_norm=1.0, seed=6, callbacks=[StepPace()] if paced else (),
    )
