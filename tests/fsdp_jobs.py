"""Jobs of the sharded-parameter tests (``reduction="fsdp"``; worker processes import them).

``tied_gpt_job``: nanoGPT's ``GPT`` (the tests' copy), float32, output matrix tied to the token
embedding, no dropout (the in-process tests run every worker as a thread of one process, and
threads share the random generator), AdamW with weight decay on matrices only (groups chosen by
shape, as nanoGPT's ``configure_optimizers``); 8 virtual nodes, so 3 workers hold 3, 3 and 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import virtualflow as vf
from gpt_grid_jobs import _adamw_groups, grid_config, tokens
from nanogpt import GPT


def tied_gpt() -> nn.Module:
    return GPT(grid_config(dropout=0.0), tied=True)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits  # nanoGPT's (logits, loss)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def tied_gpt_job(**kw) -> vf.Job:
    fields = dict(model=tied_gpt, optimizer=_adamw_groups, dataset=tokens, loss=lm_loss, global_batch_size=16,
                  virtual_nodes=8, seed=3)
    fields.update(kw)
    return vf.Job(**fields)


def make_job() -> vf.Job:
    return tied_gpt_job(precision="bf16-mixed", max_grad_norm=0.05)
