"""TEMPORARY STUB (lead's engine testing; replaced by H2's converter at merge)."""
from __future__ import annotations
import copy, math
import torch
import torch.nn.functional as F
from torch import nn
from virtualflow.parallel.collectives import copy_to_ranks, reduce_scatter_rows, all_gather_rows


class Split:
    def __init__(self, dim, groups=1):
        self.dim, self.groups = dim, groups
    def shard(self, full, rank, size):
        if self.dim is None:
            return full
        parts = full.chunk(self.groups, dim=self.dim)
        return torch.cat([p.chunk(size, dim=self.dim)[rank] for p in parts], dim=self.dim).clone()
    def merge(self, parts):
        if self.dim is None:
            return parts[0]
        per = [p.chunk(self.groups, dim=self.dim) for p in parts]
        return torch.cat([torch.cat([per[r][g] for r in range(len(parts))], dim=self.dim) for g in range(self.groups)], dim=self.dim)


def _is_block(m):
    return type(m).__name__ == "Block" and hasattr(m, "attn") and hasattr(m.attn, "c_attn") and hasattr(m, "mlp")


def _block_splits(prefix=""):
    return {prefix + "attn.c_attn.weight": Split(0, 3), prefix + "attn.c_attn.bias": Split(0, 3),
            prefix + "attn.c_proj.weight": Split(1), prefix + "mlp.c_fc.weight": Split(0),
            prefix + "mlp.c_fc.bias": Split(0), prefix + "mlp.c_proj.weight": Split(1)}


class _TPBlock(nn.Module):
    def __init__(self, block, comm):
        super().__init__()
        r, n = comm.group.rank, comm.group.size
        self.comm = comm
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.attn = nn.Module(); self.mlp = nn.Module()
        self.attn.c_attn = nn.Linear(1, 1); self.attn.c_proj = nn.Linear(1, 1); self.mlp.c_fc = nn.Linear(1, 1); self.mlp.c_proj = nn.Linear(1, 1)
        sp = _block_splits()
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            src = block.get_submodule(name); dst = self.get_submodule(name)
            dst.weight = nn.Parameter(sp.get(name + ".weight", Split(None)).shard(src.weight.detach(), r, n))
            dst.bias = nn.Parameter(sp.get(name + ".bias", Split(None)).shard(src.bias.detach(), r, n))
        self.heads = block.attn.n_head // n
        self.hd = block.attn.n_embd // block.attn.n_head

    def _rowpar(self, y, lin, shape):
        z = F.linear(y, lin.weight).reshape(-1, shape[-1])
        z = all_gather_rows(reduce_scatter_rows(z, self.comm), self.comm, z.shape[0])
        return z.reshape(shape) + lin.bias

    def forward(self, x):
        B, T, C = x.shape
        h = copy_to_ranks(self.ln_1(x), self.comm)
        q, k, v = self.attn.c_attn(h).split(self.heads * self.hd, dim=2)
        q, k, v = (z.view(B, T, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.heads * self.hd)
        x = x + self._rowpar(y, self.attn.c_proj, x.shape)
        h = copy_to_ranks(self.ln_2(x), self.comm)
        return x + self._rowpar(F.gelu(self.mlp.c_fc(h)), self.mlp.c_proj, x.shape)


def tensor_parallel_layer(layer, comm, *, chunks=1):
    if comm.group.size == 1:
        return layer
    layer = copy.deepcopy(layer)
    if _is_block(layer):
        return _TPBlock(layer, comm)
    for name, m in list(layer.named_modules()):
        if name and _is_block(m):
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            setattr(parent, name.rsplit(".", 1)[-1], _TPBlock(m, comm))
    return layer


def tensor_splits(layer, size):
    out = {}
    for name, m in layer.named_modules():
        if _is_block(m):
            out.update(_block_splits(name + "." if name else ""))
    return out


def tensor_parallel_candidates(layers):
    return [any(_is_block(m) for m in l.modules()) for l in layers]
