"""A GPT-like language model for the memory benchmarks (``sharded_params``), its synthetic data,
loss and AdamW, and what its state weighs.

The model is nanoGPT's shape (pre-norm blocks in one ``nn.ModuleList``, causal attention, a
4x MLP, the output matrix tied to the token embedding) without dropout, so that two programs
that train it on the same samples compute the same thing whatever their random streams. Its
sharding units are FSDP2's usual ones: each block, and the root (embeddings, final norm, the
tied head) holding every parameter outside the blocks.

Invariants: :func:`build` is deterministic given ``torch.manual_seed``; the data set is a
function of its size and seed only; :func:`state_bytes` counts each tensor's *local* bytes once
(a DTensor's shard on this rank, a plain tensor whole), so it is what a worker holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape."""

    vocab: int
    seq: int
    d: int
    heads: int
    layers: int

    def describe(self) -> str:
        return (f"GPT d={self.d} heads={self.heads} layers={self.layers} vocab={self.vocab} seq={self.seq}, tied "
                f"head, no dropout")


SIZES = {
    "gpt-21m": GPTConfig(vocab=8192, seq=64, d=384, heads=6, layers=10),
    "gpt-105m": GPTConfig(vocab=8192, seq=64, d=768, heads=12, layers=14),
}
"""The ``--quick`` model (about 21 M parameters) and the full run's (about 105 M: the issue's
"at least 100 M")."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d), nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.fc1 = nn.Linear(cfg.d, 4 * cfg.d)
        self.fc2 = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, the blocks, a final norm, the head tied to ``wte``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(size: str) -> GPT:
    return GPT(SIZES[size])


def token_data(cfg: GPTConfig, n: int = 256, seed: int = 1234) -> TensorDataset:
    """``n`` sequences of ``cfg.seq + 1`` tokens (inputs, next tokens): each token one of 16
    successors of the one before (``31 x + step mod vocab``, the step drawn from 0..15), so the loss
    has something to learn. Built in O(n seq) memory: a vocab x vocab bigram table would be 256 MiB
    at vocab 8192, a transient peak in every process larger than the sharded state measured."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (n,), generator=g)
    steps = torch.randint(0, 16, (n, cfg.seq), generator=g)
    for t in range(cfg.seq):
        tokens[:, t + 1] = (31 * tokens[:, t] + steps[:, t]) % cfg.vocab
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean next-token cross entropy over the batch."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (groups chosen from the model, as users do)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95))


def unit_param_bytes(model: nn.Module) -> list[int]:
    """Bytes of each sharding unit's parameters (each block, then the root: every parameter outside
    the blocks, a tied one counted once), whole (unsharded)."""
    blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = sum(p.numel() * p.element_size() for p in _unique(model.parameters()) if id(p) not in in_blocks)
    return blocks + [root]


def param_count(size: str) -> int:
    return sum(p.numel() for p in _unique(build(size).parameters()))


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this process holds of ``t``: a DTensor's local shard, a plain tensor whole, 0 for None."""
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """What this process holds of the training state: parameters, gradients and the optimizer's
    tensors (AdamW's moments and steps), each counted once by its local bytes."""
    params = _unique(model.parameters())
    opt = 0
    if optimizer is not None:
        for st in optimizer.state.values():
            opt += sum(local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": sum(local_bytes(p) for p in params), "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer": opt}


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage this process's Python objects hold now, each storage
    counted once (views and DTensor shards by their whole storage, padding included): what a
    worker holds at a step boundary, however its engine names it (parameters, shards, gradients,
    optimizer state, communication buffers, the data set)."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no attribute lookups on arbitrary objects
            continue
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        if t.device.type != "cpu" or t.is_sparse:
            continue
        try:  # (a tensor subclass without storage; a fake tensor torch.compile left behind has no data)
            storage = t.untyped_storage()
            nbytes, ptr = storage.nbytes(), storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if nbytes:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())
