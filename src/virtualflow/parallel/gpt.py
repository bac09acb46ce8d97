"""A GPT-style model as the chain of layers a pipeline cuts: embeddings, one layer per block, head.

Purpose: nanoGPT's ``GPT`` and Hugging Face's ``GPT2LMHeadModel`` are not ``nn.Sequential``; a
pipeline needs a chain of layers, and tensor parallelism needs the transformer blocks as modules
(:func:`virtualflow.parallel.tensor_parallel_layer` recognises them). :func:`sequential_gpt`
builds that chain from the model's own modules, without tracing: ``[embeddings, block 0, ...,
block L-1, head]``, sharing the model's parameters (a tied embedding and output matrix stays one
parameter, read by the first and the last layer).

The shape it recognises (both models use these names): ``model.transformer.wte`` (token
embedding), ``.wpe`` (position embedding), ``.drop``, ``.h`` (the blocks, each called on the
hidden states alone), ``.ln_f`` and ``model.lm_head``. The chain computes
``lm_head(ln_f(blocks(drop(wte(idx) + wpe(positions)))))``: the logits of every position, as the
models compute them in training (nanoGPT's ``model(idx, targets)``, Hugging Face's
``model(idx).logits`` without an attention mask or past key values; Hugging Face's attention must be
``sdpa``, its default, which is causal without a mask).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["GPTEmbeddings", "GPTHead", "GPTBlock", "sequential_gpt"]


class GPTEmbeddings(nn.Module):
    """Token plus position embeddings, then the embedding dropout: ``idx [B, S] -> x [B, S, h]``."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module | None) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTBlock(nn.Module):
    """One transformer block called on the hidden states alone; a block that returns a tuple
    (Hugging Face's, with its optional attention weights and cache) gives its first element."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, (tuple, list)) else out


class GPTHead(nn.Module):
    """The final LayerNorm and the output matrix: ``x [B, S, h] -> logits [B, S, vocab]``."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def sequential_gpt(model: nn.Module) -> nn.Sequential:
    """``model`` (nanoGPT's ``GPT`` or Hugging Face's ``GPT2LMHeadModel`` shape, see the module
    docstring) as ``nn.Sequential(embeddings, block 0, ..., block L-1, head)`` sharing its modules.
    Raises ``TypeError`` naming what is missing for a model of another shape."""
    tr = getattr(model, "transformer", None)
    missing = [name for name, owner in (("transformer", model), ("lm_head", model)) if getattr(owner, name, None) is None]
    if tr is not None:
        missing += [f"transformer.{n}" for n in ("wte", "wpe", "h", "ln_f") if getattr(tr, n, None) is None]
    if missing:
        raise TypeError(
            f"sequential_gpt: {type(model).__name__} is not of nanoGPT's or Hugging Face GPT-2's shape: it has no "
            f"{', '.join(missing)}; cut other models with virtualflow.parallel.sequential_from(model, example, "
            f"split_points) or write the model as an nn.Sequential")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        raise ValueError(f"sequential_gpt: attn_implementation={impl!r}; the blocks are called on the hidden states "
                         f"alone (no mask), which is causal only with 'sdpa': load the model with "
                         f"attn_implementation='sdpa'")
    layers: list[tuple[str, nn.Module]] = [("0", GPTEmbeddings(tr.wte, tr.wpe, getattr(tr, "drop", None)))]
    for i, block in enumerate(tr.h):
        layers.append((str(i + 1), GPTBlock(block)))
    layers.append((str(len(tr.h) + 1), GPTHead(tr.ln_f, model.lm_head)))
    return nn.Sequential(OrderedDict(layers))
