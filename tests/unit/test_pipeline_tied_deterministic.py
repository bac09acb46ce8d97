"""Deterministic mode with a weight read by two pipeline pieces (a tied embedding and head).

- A tiny GPT (token embedding tied to the output head, tests/pipeline_models.py ``tied_gpt``)
  pipelined over 2 and 3 stages, 1 and 2 replicas, with GPipe, 1F1B, zero-bubble and interleaved
  1F1B, trains bit-identically (every state-dict entry, the per-step losses) to the unpipelined
  deterministic run, and both copies of the shared weight stay equal.
- Both uses on one worker's two pieces (interleaved): bit-identical too (this was silently wrong:
  the worker's tree vector held the weight's gradient twice).
- Under bf16 autocast: bit-identical too, whether both uses read autocast's cast of the weight
  (two nn.Linear: their sum is rounded to bfloat16 as autograd's) or one (the GPT's head; its
  embedding stays float32). With clipping, float32 and bf16: the same bits for every cut and
  replica count (the weight counted once in the norm).
- The comparison can tell: summing the two uses' gradients after the tree (each copy's tree, then
  one addition) instead of per virtual node before it gives other bits (a plain PyTorch check on
  the same model's gradients).
- Refused, with the knob named: three uses in different pieces (at launch and when the stage is
  built), a layer that reads the shared weight twice (on the first forward), a no-flush schedule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import pipeline_models as pm
from conftest import assert_state_equal
from virtualflow.backends.inprocess import train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.launching.pipeline import plan_pipeline

EMB, HEAD = "0.tok.weight", "5.weight"


def _check(job, steps: int, replicas: int) -> dict[str, torch.Tensor]:
    state, history = train_local(job, steps, replicas=replicas, deterministic=True)
    ref_state, ref_losses = pm.unpipelined(job, steps, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    return state


# (schedule, stages p, chunks v, replicas d, virtual nodes V); m = V / d per replica
GRID = [
    ("gpipe", 2, 1, 1, 4),
    ("1f1b", 2, 1, 2, 6),             # m=3,3
    ("1f1b", 3, 1, 1, 5),             # the head on worker 2, the embedding on worker 0
    ("zb_h1", 3, 1, 2, 7),            # m=4,3: uneven replicas; weight gradients in W actions
    ("interleaved_1f1b", 2, 2, 1, 4),  # head in piece 3 (worker 1), embedding in piece 0 (worker 0)
    ("interleaved_1f1b", 3, 2, 2, 6),  # 6 pieces of one layer each, m=3,3
]


@pytest.mark.parametrize("schedule,p,v,d,V", GRID, ids=[f"{s}-p{p}-v{v}-d{d}-V{V}" for s, p, v, d, V in GRID])
def test_tied_gpt_bit_identical_to_unpipelined(schedule, p, v, d, V):
    job = pm.transformer_job(Pipeline(stages=p, schedule=schedule, chunks=v), virtual_nodes=V, model=pm.tied_gpt)
    state = _check(job, steps=3, replicas=d)
    assert torch.equal(state[EMB], state[HEAD])  # the two copies took the same updates
    torch.manual_seed(job.seed)
    assert not torch.equal(state[EMB], job.model().state_dict()[EMB])  # and they trained


def _tied_near() -> nn.Sequential:
    first, third = nn.Linear(pm.FEATURES, pm.FEATURES), nn.Linear(pm.FEATURES, pm.FEATURES)
    third.weight = first.weight
    return nn.Sequential(first, nn.ReLU(), nn.Dropout(0.2), third, nn.Tanh(), nn.Linear(pm.FEATURES, 1))


@pytest.mark.parametrize("d", [1, 2])
def test_both_uses_on_one_workers_two_pieces_bit_identical(d):
    pipe = Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2, split=(1, 2, 2, 1))  # layers 0 and 3: worker 0
    job = pm.mlp_job(pipe, virtual_nodes=4 * d, model=_tied_near, optimizer="adam")
    _check(job, steps=3, replicas=d)


def _tied_linears() -> nn.Sequential:
    """Layer 4 reads layer 0's weight; both are nn.Linear, which autocast casts (an nn.Embedding it
    leaves in float32)."""
    first, fourth = nn.Linear(pm.FEATURES, pm.FEATURES), nn.Linear(pm.FEATURES, pm.FEATURES)
    fourth.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(pm.FEATURES, pm.FEATURES), nn.Tanh(), fourth,
                         nn.Linear(pm.FEATURES, 1))


@pytest.mark.parametrize("model,pipe,d", [
    (_tied_linears, Pipeline(stages=2), 2),                                     # both uses cast, two workers
    (_tied_linears, Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2, split=(2, 1, 2, 1)), 1),  # one worker
    (_tied_linears, Pipeline(stages=3, schedule="zb_h1"), 1),
    ("gpt", Pipeline(stages=3), 2),                                             # one use cast (the head)
])
def test_bf16_autocast_bit_identical_to_unpipelined(model, pipe, d):
    """Under autocast the unpipelined job adds two cast uses' gradients in bfloat16 (one cached
    cast of the weight); the pipeline rounds its per-VN float32 sum to bfloat16 and back, which is
    that addition."""
    if model == "gpt":
        job = pm.transformer_job(pipe, virtual_nodes=4, model=pm.tied_gpt)
    else:
        job = pm.mlp_job(pipe, virtual_nodes=4, model=model, optimizer="adam")
    _check(job.replace(precision="bf16-mixed"), steps=3, replicas=d)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_clipping_with_a_tied_weight_is_the_same_whatever_the_cut(precision):
    """max_grad_norm: the whole model's norm (the shared weight counted once) and the clipped
    update are bit-identical for 1, 2 and 3 stages and 1 or 2 replicas (the norm's rule is
    every layout's: docs/training.md; against the unpipelined run: test_grad_norm_layouts.py)."""
    runs = []
    for pipe, d in [(Pipeline(stages=1), 1), (Pipeline(stages=2), 2), (Pipeline(stages=3, schedule="zb_h1"), 1),
                    (Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2, split=(2, 1, 2, 1)), 1)]:
        job = pm.mlp_job(pipe, virtual_nodes=4, model=_tied_linears, optimizer="adam")
        state, history = train_local(job.replace(precision=precision, max_grad_norm=0.05), 3, replicas=d,
                                     deterministic=True)
        runs.append((state, [(h.loss, h.grad_norm) for h in history]))
    assert all(n > 0.05 for _, history in runs for _, n in history)  # the clip acted
    for state, history in runs[1:]:
        assert_state_equal(state, runs[0][0])
        assert history == runs[0][1]


def test_the_sum_per_virtual_node_matters():
    """Plain PyTorch, no virtualflow: the per-VN gradients of the embedding's and the head's uses
    of the shared weight, summed per VN then along the fixed tree (what autograd and the
    unpipelined job do), differ in their bits from each use summed along the tree and then added
    (what summing the copies after their reductions would give). So the bit-identity above is not
    an accident of this model."""
    torch.manual_seed(0)
    model = pm.tied_gpt()
    emb = model[0].tok.weight
    x, y = pm.token_data().tensors
    V = 8
    per_vn = []
    for vn in range(V):
        xb, yb = x[vn * 4: (vn + 1) * 4], y[vn * 4: (vn + 1) * 4]
        copy = emb.detach().clone().requires_grad_(True)  # the head's use on its own copy
        out = nn.functional.linear(model[4](model[3](model[2](model[1](model[0](xb))))), copy)
        loss = nn.functional.cross_entropy(out.reshape(-1, pm.VOCAB), yb.reshape(-1)) / V
        emb.grad = None
        loss.backward()
        per_vn.append((emb.grad.clone(), copy.grad.clone()))
    before = pm.tree_sum({v: a + b for v, (a, b) in enumerate(per_vn)}, 0, V)
    after = pm.tree_sum({v: a for v, (a, _) in enumerate(per_vn)}, 0, V) + \
        pm.tree_sum({v: b for v, (_, b) in enumerate(per_vn)}, 0, V)
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-7)
    assert not torch.equal(before, after)


def _three_uses() -> nn.Sequential:
    a, b, c = (nn.Linear(pm.FEATURES, pm.FEATURES) for _ in range(3))
    b.weight = a.weight
    c.weight = a.weight
    return nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), c, nn.Linear(pm.FEATURES, 1))


def test_three_uses_in_different_pieces_are_refused_naming_the_knobs():
    job = pm.mlp_job(Pipeline(stages=3), virtual_nodes=3, model=_three_uses)
    message = "read by 3 layers in different pipeline pieces.*Pipeline.split.*deterministic=False"
    with pytest.raises(ValueError, match=message):
        plan_pipeline(job, job.build_dataset(), 3, deterministic=True)
    with pytest.raises(ValueError, match="read by 3 layers.*deterministic=False"):
        train_local(job, 1, deterministic=True)
    # default mode sums the copies after the replicas' reduction (equal within float tolerance)
    plan_pipeline(job, job.build_dataset(), 3)
    state, _ = train_local(job, 2)
    assert torch.equal(state["0.weight"], state["4.weight"])
    # all three uses in one piece: nothing is shared between pieces, autograd sums them as unpipelined
    one = job.replace(pipeline=Pipeline(stages=2, split=(5, 1)))
    plan_pipeline(one, one.build_dataset(), 2, deterministic=True)
    _check(one, steps=2, replicas=1)


class _TwiceHead(nn.Module):
    """A head that reads its (tied) weight twice: with the embedding's use, three uses."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(h, self.weight), self.weight)  # (bf16: one cached cast)


def _twice() -> nn.Sequential:
    first = nn.Linear(pm.FEATURES, pm.FEATURES)
    return nn.Sequential(first, nn.Tanh(), _TwiceHead(first.weight), nn.Linear(pm.FEATURES, 1))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])  # bf16: both reads of one autocast cast
def test_a_layer_reading_the_shared_weight_twice_is_refused_on_the_first_forward(precision):
    job = pm.mlp_job(Pipeline(stages=2), virtual_nodes=2, model=_twice).replace(precision=precision)
    plan_pipeline(job, job.build_dataset(), 2, deterministic=True)  # two locations: launch cannot tell
    with pytest.raises(ValueError, match="piece 1 reads a shared weight of shape \\(8, 8\\) 2 times.*3 uses"):
        train_local(job, 1, deterministic=True)


def test_no_flush_schedules_still_refuse_a_weight_shared_across_workers():
    job = pm.mlp_job(Pipeline(stages=2), virtual_nodes=4, model=_tied_near)
    far = job.replace(pipeline=Pipeline(stages=2, split=(1, 5)))  # layers 0 and 3 on two workers
    with pytest.raises(ValueError, match="the 2bw schedule.*flush schedule"):
        plan_pipeline(far.replace(pipeline=dataclasses.replace(far.pipeline, schedule="2bw")),
                      far.build_dataset(), 2)
    # with Pipeline.redundancy it is planned (and trains the unpipelined model: tests/unit/test_bamboo_tied.py)
    plan_pipeline(far.replace(pipeline=dataclasses.replace(far.pipeline, redundancy=True)), far.build_dataset(), 2,
                  deterministic=True)
