"""virtualflow.parallel.sequential_gpt: nanoGPT's and Hugging Face GPT-2's models as the chain of
layers a pipeline cuts (embeddings, one layer per block, head), computing the models' own logits
bit for bit and sharing their parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from virtualflow.parallel import sequential_gpt, tensor_parallel_candidates

import gpt_grid_jobs as g


def test_nanogpt_is_cut_into_embeddings_blocks_and_head_with_its_own_logits():
    torch.manual_seed(0)
    model = g.grid_gpt(dropout=0.0, tied=True).double().eval()
    chain = sequential_gpt(model)
    assert len(chain) == g.LAYERS + 2
    assert tensor_parallel_candidates(list(chain)) == [False] + [True] * g.LAYERS + [False]
    idx = torch.randint(0, g.VOCAB, (3, g.SEQ))
    assert torch.equal(chain(idx), model(idx)[0])
    # the same parameters (a tied embedding and head stay one tensor)
    assert {id(p) for p in chain.parameters()} == {id(p) for p in model.parameters()}
    assert chain[0].wte.weight is chain[-1].lm_head.weight


def test_hugging_face_gpt2_is_cut_the_same_way():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    chain = sequential_gpt(model)
    assert tensor_parallel_candidates(list(chain)) == [False, True, True, False]
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert torch.allclose(chain(idx), model(idx).logits, atol=1e-6, rtol=1e-5)


def test_other_models_are_refused_naming_what_is_missing():
    with pytest.raises(TypeError, match=r"has no transformer, lm_head.*sequential_from"):
        sequential_gpt(nn.Linear(2, 2))
