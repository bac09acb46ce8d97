r"""A GPT of nanoGPT's shape trained on a D x P x T grid: data, pipeline and tensor parallelism.

The model is written as nanoGPT writes it (``GPT`` with ``transformer.{wte, wpe, drop, h, ln_f}``
and a tied ``lm_head``; ``Block`` with ``ln_1``, ``attn.c_attn`` / ``attn.c_proj``, ``ln_2``,
``mlp.c_fc`` / ``mlp.c_proj``). :func:`virtualflow.parallel.sequential_gpt` cuts it into the chain
a pipeline splits (embeddings, one layer per block, head) without rewriting it, and
``Pipeline(stages=P, tensor=T)`` runs every block of a stage split over T workers. The data is
synthetic (a fixed random bigram table), so nothing is downloaded. Run it with

    virtualflow run examples/gpt_3d.py --workers 8 --pipeline-stages 2 --tensor-parallel 2 --steps 20

(8 workers = 2 replicas x 2 stages x 2 tensor-parallel workers), with bf16 autocast, compiled
pieces and sharded checkpoints written in the background, then resumed on another grid and on one
worker (each checkpoint holds the single-worker layout; docs/parallel3d.md, "Checkpoints")

    virtualflow run examples/gpt_3d.py --workers 8 --pipeline-stages 2 --tensor-parallel 2 --steps 20 \
        --precision bf16-mixed --compile --checkpoint-format dcp --async-checkpoint --checkpoint-every 10 \
        --run-dir runs/gpt3d
    virtualflow run examples/gpt_3d.py --workers 8 --pipeline-stages 2 --tensor-parallel 1 --steps 40 \
        --precision bf16-mixed --compile --resume runs/gpt3d/checkpoints/step-00000010.dcp --run-dir runs/gpt3d-421
    virtualflow run examples/gpt_3d.py --workers 1 --pipeline-stages 1 --tensor-parallel 1 --steps 40 \
        --precision bf16-mixed --resume runs/gpt3d --run-dir runs/gpt3d-1

or from Python:
``vf.train("examples/gpt_3d.py:make_job", workers=4, steps=20)`` (the job's own grid: 2 stages x
2 tensor-parallel workers, one replica).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf
from virtualflow.parallel import sequential_gpt

VOCAB, SEQ, EMBD, HEADS, LAYERS, DROPOUT = 64, 32, 64, 4, 4, 0.1


class LayerNorm(nn.Module):
    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.attn_dropout, self.resid_dropout = nn.Dropout(DROPOUT), nn.Dropout(DROPOUT)
        self.n_head, self.n_embd, self.dropout = HEADS, EMBD, DROPOUT

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (z.view(B, T, HEADS, C // HEADS).transpose(1, 2) for z in self.c_attn(x).split(EMBD, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf")).softmax(dim=-1)
        y = (self.attn_dropout(att) @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(EMBD), CausalSelfAttention(), LayerNorm(EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(SEQ, EMBD), drop=nn.Dropout(DROPOUT),
            h=nn.ModuleList([Block() for _ in range(LAYERS)]), ln_f=LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them


def bigram_text(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
    seq = [torch.randint(0, VOCAB, (n,), generator=g)]
    for _ in range(SEQ):
        seq.append(torch.multinomial(table[seq[-1]], 1, generator=g).squeeze(1))
    data = torch.stack(seq, dim=1)
    return TensorDataset(data[:, :-1], data[:, 1:])


def lm_loss(logits, batch):
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def make_job() -> vf.Job:
    return vf.Job(
        model=lambda: sequential_gpt(GPT()),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0),
        dataset=bigram_text, output_loss=lm_loss,
        global_batch_size=32, virtual_nodes=8, seed=0,
        pipeline=vf.Pipeline(stages=2, tensor=2),
    )
