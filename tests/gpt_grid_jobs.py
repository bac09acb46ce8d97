"""A GPT-style job of nanoGPT's shape for the 3-D parallelism tests (worker processes import it).

The model classes are written as nanoGPT's ``model.py`` has them (``LayerNorm`` with an optional
bias, ``CausalSelfAttention`` with ``c_attn`` / ``c_proj`` / two dropouts, ``MLP`` with ``c_fc`` /
``gelu`` / ``c_proj`` / dropout, ``Block`` with ``ln_1`` / ``attn`` / ``ln_2`` / ``mlp``, ``GPT``
with ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``), small, in float64 so that layouts
that change the order of a sum can be compared tightly. The job cuts it with
:func:`virtualflow.parallel.sequential_gpt`: the user's model is not rewritten.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from virtualflow.parallel.gpt import sequential_gpt

VOCAB, SEQ, EMBD, HEADS, LAYERS = 40, 8, 32, 4, 4


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, dropout: float = 0.0, bias: bool = True, tied: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(SEQ, EMBD), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(EMBD, HEADS, dropout, bias) for _ in range(LAYERS)]),
            ln_f=LayerNorm(EMBD, bias=bias)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def tokens(n: int = 64, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def gpt_model(dropout: float = 0.0, float32: bool = False) -> nn.Module:
    model = GPT(dropout=dropout)
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
