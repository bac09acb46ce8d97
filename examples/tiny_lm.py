"""A small GPT-style language model with the training loop a practitioner expects: bf16 mixed
precision, clipping at global norm 1, activation checkpointing of every block, AdamW with no
weight decay on biases and norms (parameter groups chosen from the model), linear warmup then
cosine decay, and accuracy reported next to the loss.

The data is synthetic (nothing is downloaded): sequences drawn from a fixed random bigram table,
so the loss has something to learn. Run it with

    virtualflow run examples/tiny_lm.py --workers 2 --steps 40

or train it from Python: ``vf.train("examples/tiny_lm.py:make_job", workers=2, steps=40)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf

VOCAB, SEQ, D, HEADS, LAYERS = 64, 32, 64, 4, 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention with dropout, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # the output matrix is the embedding's
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's initialisation: small logits at the start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def bigram_data(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, dim=1)
    tokens = torch.empty(n, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loss(model: nn.Module, batch):
    x, y = batch
    logits = model(x)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
    return ce, {"accuracy": (logits.argmax(-1) == y).float().mean()}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 5, total: int = 200):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_job() -> vf.Job:
    return vf.Job(
        model=TinyGPT, optimizer=adamw, dataset=bigram_data, loss=loss, lr_scheduler=warmup_cosine,
        global_batch_size=32, virtual_nodes=8, seed=0, name="tiny-lm",
        precision="bf16-mixed", max_grad_norm=1.0, activation_checkpointing=Block,
        tokens_per_sample=SEQ,
        # model FLOPs utilisation is reported against --peak-tflops (or a known GPU's peak)
        flops_per_sample=vf.transformer_flops(n_params=sum(p.numel() for p in TinyGPT().blocks.parameters())
                                              + VOCAB * D, n_layers=LAYERS, d_model=D, seq_len=SEQ),
    )


if __name__ == "__main__":
    result = vf.train(make_job, workers=2, steps=40, progress=True)
    print(f"final loss {result.history[-1]['loss']:.3f}")
