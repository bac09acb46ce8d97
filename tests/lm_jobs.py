"""A small transformer language model as a user would bring it: token embedding, causal
self-attention with dropout, an MLP, LayerNorm, and the output matrix tied to the embedding;
AdamW with parameter groups chosen by name (no weight decay on biases and norms, as nanoGPT's
``configure_optimizers``), linear warmup then cosine decay."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf

VOCAB, SEQ, D, HEADS, LAYERS = 48, 12, 32, 2, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias: a key bias has an exactly zero gradient (softmax ignores it), which Adam would turn
        # from rounding noise into full-size steps, hiding any real difference in a comparison
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // HEADS)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        att = self.drop(att)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(SEQ, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_data(n: int = 96, seed: int = 11) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def lm_loss_with_metrics(model: nn.Module, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
    acc = (logits.argmax(-1) == y).float().mean()
    return loss, {"acc": acc, "tokens": float(y.numel())}


def adamw_groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 2, total: int = 12):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lm_job(**kw) -> vf.Job:
    fields = dict(model=TinyLM, optimizer=lambda model: adamw_groups(model), dataset=lm_data,
                  global_batch_size=24, virtual_nodes=6, loss=lm_loss, lr_scheduler=warmup_cosine, seed=3,
                  precision="bf16-mixed", max_grad_norm=1.0, name="tiny-lm")
    fields.update(kw)
    return vf.Job(**fields)


def make_job() -> vf.Job:
    return lm_job()


def make_job_checkpointed() -> vf.Job:
    return lm_job(activation_checkpointing=Block)


def make_job_fp16() -> vf.Job:
    # A scale of 2**20 overflows float16 in backward: step 0 is skipped (on every worker) and the
    # scale halves; after growth_interval=3 applied steps it doubles and step 4 overflows again.
    return lm_job(precision="16-mixed", loss_scale={"init_scale": 2.0 ** 20, "growth_interval": 3})


PACE_S = 0.004


def paced_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """``lm_loss`` after a few ms of sleep: steps long enough for a resize to land mid-run."""
    import time

    time.sleep(PACE_S)
    return lm_loss(model, batch)


def make_paced_job_checkpointed() -> vf.Job:
    return lm_job(activation_checkpointing=Block, loss=paced_lm_loss)
