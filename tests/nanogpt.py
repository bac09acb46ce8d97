"""nanoGPT's model (karpathy/nanoGPT ``model.py``) as a user has it: the one copy the tests share.

``GPTConfig``, ``LayerNorm`` (optional bias), ``CausalSelfAttention`` (``c_attn`` / ``c_proj`` /
two dropouts), ``MLP`` (``c_fc`` / ``gelu`` / ``c_proj`` / dropout), ``Block`` (``ln_1`` /
``attn`` / ``ln_2`` / ``mlp``) and ``GPT`` (``transformer.{wte, wpe, drop, h, ln_f}``,
``lm_head``), plus the model cut by hand into pipeline layers (``Embed``, ``Block``,
``TwoBlocks``, ``Head``: :func:`nanogpt_layers`).

The attention has nanoGPT's two paths (``GPTConfig.flash``): ``scaled_dot_product_attention``
(the converter tests, ``tests/unit/test_tp_convert.py``) or the explicit causal softmax (the 3-D
grid jobs, ``tests/gpt_grid_jobs.py``, float64 across layouts). Both build the same parameters in
the same order, so a seed gives the same weights whichever path runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 23
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True
    """Attention through ``scaled_dot_product_attention`` (nanoGPT's fast path); ``False``: the
    explicit causal softmax, its mask built in the forward (no buffer: the state dict is the
    same), for tests that compare layouts whose sums differ in order."""


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.flash and hasattr(torch.nn.functional, "scaled_dot_product_attention")

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT's ``GPT``: ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``, its weights
    initialised as nanoGPT's ``_init_weights`` does; ``tied``: the token embedding is the head's
    weight."""

    def __init__(self, config, tied: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
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



class Embed(nn.Module):
    """nanoGPT's embeddings as the first pipeline layer (replicated under tensor parallelism)."""

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class TwoBlocks(nn.Module):
    """A layer whose blocks are submodules (a ModuleList), as nanoGPT's ``transformer.h``."""

    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([Block(config) for _ in range(2)])
        self.scale = nn.Parameter(torch.ones(config.n_embd))

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x * self.scale


def nanogpt_layers(dtype=torch.float64, **overrides) -> nn.Sequential:
    """nanoGPT cut into pipeline layers, every weight drawn from a fixed seed (LayerNorms too, so
    that their gradients are not trivially those of ones and zeros)."""
    config = GPTConfig(**overrides)
    torch.manual_seed(0)
    model = nn.Sequential(Embed(config), Block(config), TwoBlocks(config), Head(config)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model
