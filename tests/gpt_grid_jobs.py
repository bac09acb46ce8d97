"""A GPT-style job of nanoGPT's shape for the 3-D parallelism tests (worker processes import it).

The model is nanoGPT's ``GPT`` as ``model.py`` has it (the tests' one copy, ``tests/nanogpt.py``,
with the explicit causal softmax), small, in float64 so that layouts that change the order of a
sum can be compared tightly. The job cuts it with
:func:`virtualflow.parallel.sequential_gpt`: the user's model is not rewritten.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from nanogpt import GPT, GPTConfig
from virtualflow.parallel.gpt import sequential_gpt

VOCAB, SEQ, EMBD, HEADS, LAYERS = 40, 8, 32, 4, 4


def grid_config(dropout: float = 0.0, bias: bool = True) -> GPTConfig:
    """The grid jobs' nanoGPT shape; the explicit causal softmax (``flash=False``)."""
    return GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, dropout=dropout,
                     bias=bias, flash=False)


def grid_gpt(dropout: float = 0.0, bias: bool = True, tied: bool = False) -> GPT:
    """nanoGPT's ``GPT`` of the grid jobs' shape (float32; :func:`gpt_model` makes it float64)."""
    return GPT(grid_config(dropout, bias), tied=tied)


def tokens(n: int = 64, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def gpt_model(dropout: float = 0.0, float32: bool = False) -> nn.Module:
    model = grid_gpt(dropout=dropout)
    return sequential_gpt(model if float32 else model.double())


def _lm_loss(logits, batch):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))


def _slow_lm_loss(logits, batch):
    time.sleep(0.02)  # slow enough for a test to resize or kill it mid-run
    return _lm_loss(logits, batch)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _adamw_groups(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay on matrices only, chosen by parameter shape."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3)


def grid_job(stages: int = 1, tensor: int = 1, schedule: str = "1f1b", dropout: float = 0.0,
             adam: bool = False, slow: bool = False, float32: bool = False, **pipeline) -> vf.Job:
    """The GPT job on a ``stages x tensor`` pipeline (``stages=1, tensor=1``: still a pipeline job of
    one stage; :func:`single_job` is the plain reference)."""
    return vf.Job(
        model=lambda: gpt_model(dropout, float32), optimizer=_adamw_groups if adam else _sgd, dataset=tokens,
        output_loss=_slow_lm_loss if slow else _lm_loss,
        global_batch_size=16, virtual_nodes=4, seed=3,
        pipeline=vf.Pipeline(stages=stages, tensor=tensor, schedule=schedule, **pipeline),
    )


def single_job(dropout: float = 0.0, adam: bool = False) -> vf.Job:
    """The same job without a pipeline: the single-worker reference."""
    return grid_job(dropout=dropout, adam=adam).replace(pipeline=None)


def make_job() -> vf.Job:
    return grid_job(stages=2, tensor=2)
