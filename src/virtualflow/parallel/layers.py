"""Known models as chains of untraced pipeline layers whose blocks the converter can split.

Purpose: :func:`virtualflow.parallel.tracing.sequential_from` cuts any traceable model, but inlines
its blocks into ATen graphs, which :func:`virtualflow.parallel.convert.tensor_parallel_layer`
cannot split. For a Hugging Face GPT-2 language model, :func:`gpt2_layers` gives the same model as
an ``nn.Sequential`` of its own modules: the embeddings, every ``GPT2Block`` called as
``block(x)``, and the final norm with the head. Tensor parallelism then converts each block.

Invariants: the layers hold the model's own modules (no copies: a weight tied between the
embedding and the head is one object, see :func:`virtualflow.parallel.tracing.shared_parameters`
for what that means in a pipeline); the chain computes ``model(ids).logits`` for ``ids`` without
an attention mask (no padding), with the model's ``sdpa`` causal attention; nothing is imported
from ``transformers`` (the model is read by attribute).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GPT2Embeddings", "GPT2Head", "gpt2_layers"]


class GPT2Embeddings(nn.Module):
    """``drop(wte(ids) + wpe(positions))``: the first layer of :func:`gpt2_layers`."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        embeds = self.wte(ids)
        return self.drop(embeds + self.wpe(positions).to(embeds.device))


class GPT2Head(nn.Module):
    """``lm_head(ln_f(x))``: the last layer of :func:`gpt2_layers` (the logits)."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt2_layers(model: nn.Module) -> nn.Sequential:
    """A Hugging Face ``GPT2LMHeadModel`` as ``nn.Sequential(GPT2Embeddings, *blocks, GPT2Head)``:
    ``layers(ids) == model(ids).logits`` (ids without padding). Raises ``ValueError`` for a model
    without that structure or whose attention is not ``sdpa`` (the blocks, called without a mask,
    are causal only with ``sdpa``)."""
    transformer = getattr(model, "transformer", None)
    parts = ("wte", "wpe", "drop", "h", "ln_f")
    if transformer is None or not all(hasattr(transformer, p) for p in parts) or not hasattr(model, "lm_head"):
        raise ValueError(f"gpt2_layers: {type(model).__name__} is not a GPT-2 language model (needs "
                         f"transformer.{{{', '.join(parts)}}} and lm_head, as transformers' GPT2LMHeadModel); "
                         f"cut other models with sequential_from")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"gpt2_layers: attn_implementation={impl!r}; the blocks are called without a mask, which "
                         f"is causal only with 'sdpa': load the model with attn_implementation='sdpa'")
    t = transformer
    return nn.Sequential(GPT2Embeddings(t.wte, t.wpe, t.drop), *t.h, GPT2Head(t.ln_f, model.lm_head))
