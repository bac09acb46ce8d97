"""``reduction="sharded"`` with a weight tied across pipeline stages, in worker processes: a tied
GPT (token embedding on stage 0, head on stage 1) on 2 stages x 2 replicas, deterministic, with
clipping, trains bit-identically to the unpipelined single-worker run (the in-process cases:
tests/unit/test_pipeline_sharded_tied.py)."""

from __future__ import annotations

import torch

import virtualflow as vf
import pipeline_models as pm


def sharded_tied_job() -> vf.Job:
    return pm.transformer_job(vf.Pipeline(stages=2), virtual_nodes=4, model=pm.tied_gpt).replace(max_grad_norm=0.05)


def test_a_tied_gpt_sharded_over_two_replicas_is_the_unpipelined_model():
    steps = 3
    result = vf.train(sharded_tied_job, workers=4, steps=steps, deterministic=True, reduction="sharded")
    ref_state, ref_losses = pm.unpipelined(sharded_tied_job(), steps, deterministic=True)
    assert result.state_dict.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(result.state_dict[k], v), k
    assert [h["loss"] for h in result.history] == ref_losses
    assert torch.equal(result.state_dict["0.tok.weight"], result.state_dict["5.weight"])
