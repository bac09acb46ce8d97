"""``reduction="sharded"`` with a weight tied across pipeline stages (a GPT's token embedding on
stage 0, its head on the last stage), run in-process by ``train_local``.

- Deterministic mode, 2 stages x 2 replicas (and 3 x 2 with an uneven replica split): every
  state-dict entry and every loss is bit-identical to the unpipelined single-worker deterministic
  run and to the same pipeline with ``reduction="allreduce"``; with clipping (the norm, which
  counts the tied weight once, is the same bits) and under bf16 autocast too. Both copies of the
  weight are equal after every step, and each replica holds only its chunk of the optimizer state.
- Default mode: within float tolerance of the unpipelined run, the norms of the allreduce run,
  and the two copies equal bit for bit.
- The two copies must be summed before the chunks are cut: a test shows a sharded run whose tied
  exchange is left out (each copy its own use's gradient) trains another model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeline_models as pm
from conftest import assert_state_close, assert_state_equal
from virtualflow.backends.inprocess import train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.runtime.pipeline import tied as tied_mod

EMB, HEAD = "0.tok.weight", "5.weight"
TOL = dict(rtol=1e-5, atol=1e-6)


def _job(p: int = 2, schedule: str = "1f1b", V: int = 4, chunks: int = 1, **extra) -> object:
    job = pm.transformer_job(Pipeline(stages=p, schedule=schedule, chunks=chunks), virtual_nodes=V,
                             model=pm.tied_gpt)
    return job.replace(**extra) if extra else job


def _run(job, steps: int, d: int, deterministic: bool, reduction: str = "sharded"):
    engines: list = []
    state, history = train_local(job, steps, replicas=d, deterministic=deterministic, reduction=reduction,
                                 engines_out=engines)
    return state, history, engines


# (stages p, schedule, replicas d, virtual nodes V, extra job fields)
DETERMINISTIC = [
    (2, "1f1b", 2, 4, {}),
    (2, "1f1b", 2, 4, dict(max_grad_norm=0.05)),
    (2, "1f1b", 2, 4, dict(precision="bf16-mixed", max_grad_norm=0.05)),
    (3, "zb_h1", 2, 7, {}),  # m = 4, 3: uneven replicas; weight gradients in W actions
    (3, "interleaved_1f1b", 2, 6, dict(chunks=2)),  # 6 pieces of one layer: head on worker 2
]


@pytest.mark.parametrize("p,schedule,d,V,extra", DETERMINISTIC,
                         ids=["p2-d2", "p2-d2-clip", "p2-d2-bf16-clip", "p3-d2-zb", "p3-v2-d2-interleaved"])
def test_deterministic_sharded_tied_gpt_is_bit_identical_to_the_unpipelined_job(p, schedule, d, V, extra):
    job = _job(p, schedule, V, **extra)
    state, history, engines = _run(job, 3, d, deterministic=True)
    ref_state, ref_losses = pm.unpipelined(job, 3, deterministic=True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    plain_state, plain, _ = _run(job, 3, d, deterministic=True, reduction="allreduce")
    assert_state_equal(state, plain_state)
    assert str([h.grad_norm for h in history]) == str([h.grad_norm for h in plain])
    if "max_grad_norm" in extra:
        assert all(h.grad_norm > extra["max_grad_norm"] for h in history)  # the clip acted
    for e in engines:  # every copy of the tied weight, on every stage and replica, is the same
        params = dict(e.model.named_parameters())
        for name in (EMB, HEAD):
            if name in params:
                assert torch.equal(params[name], state[EMB]), (e.stage_rank, e.replica, name)
    assert all(e.shard is not None and e.shard.chunk()[1] - e.shard.chunk()[0] < e.shard.flat.flat.numel()
               for e in engines)  # each replica updates its chunk only
    torch.manual_seed(job.seed)
    assert not torch.equal(state[EMB], job.model().state_dict()[EMB])  # and the weight trained


def _tied_linears() -> nn.Sequential:
    """Layer 4 reads layer 0's weight; both are nn.Linear, so under autocast both uses read its
    one bfloat16 cast and autograd adds their gradients in bfloat16."""
    first, fourth = nn.Linear(pm.FEATURES, pm.FEATURES), nn.Linear(pm.FEATURES, pm.FEATURES)
    fourth.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(pm.FEATURES, pm.FEATURES), nn.Tanh(), fourth,
                         nn.Linear(pm.FEATURES, 1))


def test_deterministic_sharded_with_both_uses_cast_under_bf16():
    # both workers must know both uses' autocast flags to round their per-VN sums alike
    job = pm.mlp_job(Pipeline(stages=2), virtual_nodes=4, model=_tied_linears, optimizer="adam")
    job = job.replace(precision="bf16-mixed", max_grad_norm=0.05)
    state, history, _ = _run(job, 3, 2, deterministic=True)
    ref_state, ref_losses = pm.unpipelined(job, 3, deterministic=True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    assert torch.equal(state["0.weight"], state["4.weight"])


def test_default_mode_sharded_tied_gpt_matches_the_unpipelined_job():
    # (3 stages: the middle worker holds no copy and adds zeros to the sum)
    for extra in ({}, dict(max_grad_norm=0.05), dict(p=3, schedule="gpipe", V=6)):
        job = _job(**extra)
        state, history, engines = _run(job, 3, 2, deterministic=False)
        ref_state, ref_losses = pm.unpipelined(job, 3, deterministic=False)
        assert_state_close(state, ref_state, **TOL)
        assert [h.loss for h in history] == pytest.approx(ref_losses, rel=1e-5)
        if "max_grad_norm" in extra:  # the norm counts the tied weight once, as the allreduce path does
            _, plain, _ = _run(job, 3, 2, deterministic=False, reduction="allreduce")
            assert [h.grad_norm for h in history] == pytest.approx([h.grad_norm for h in plain], rel=1e-5)
            assert all(h.grad_norm > 0.05 for h in history)
        copies = [dict(e.model.named_parameters())[n] for e in engines for n in (EMB, HEAD)
                  if n in dict(e.model.named_parameters())]
        assert len(copies) == 4 and all(torch.equal(c, copies[0]) for c in copies)  # copies equal, bit for bit


def test_leaving_out_the_tied_sum_trains_another_model(monkeypatch):
    """The comparison above can tell: with each copy keeping its own use's gradient (no exchange
    before the scatter) the copies drift apart and the model is not the unpipelined one."""
    monkeypatch.setattr(tied_mod.SumBeforeScatter, "before", tied_mod.NoTiedSum.before)
    job = _job()
    state, _, engines = _run(job, 3, 2, deterministic=False)
    ref_state, _ = pm.unpipelined(job, 3, deterministic=False)
    emb = dict(engines[0].model.named_parameters())[EMB]
    head = dict(engines[1].model.named_parameters())[HEAD]
    assert not torch.allclose(emb, head, **TOL)
    with pytest.raises(AssertionError):
        assert_state_close(state, ref_state, **TOL)
