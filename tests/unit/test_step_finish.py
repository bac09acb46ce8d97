"""The step finish and the optimizer update (``runtime/step``), each layout's view of one gradient.

What is held against what: every way a layout can hold a step's reduced gradient (whole in
``p.grad``, the deterministic tree's flat sum, chunks whose block sums are all-reduced, a
pipeline stage's float64 parts) gives the same norm, the same skip and the same clipped gradient
as the plain one, bit for bit where the rule says so.
"""

from __future__ import annotations

import pytest
import torch

from virtualflow.runtime.amp import LossScaler, NoLossScale
from virtualflow.runtime.clipping import BLOCK, NormBlocks
from virtualflow.runtime.step.finish import (ChunkGrads, FlatSum, Part, StepFinish, TensorSlots, WholeGrads,
                                             range_parts)
from virtualflow.runtime.step.update import ShardedUpdate, WholeUpdate, make_update


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, BLOCK + 7), (5,), (2 * BLOCK,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def _flat(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def test_the_flat_sum_and_any_cut_into_chunks_give_the_same_norm_bits():
    params = _params()
    finish = StepFinish.of(params, "32", None, max_grad_norm=1.0)
    flat = _flat(params)
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    whole = FlatSum(flat.clone(), params).norm(finish)
    cuts = finish.cuts()
    for cut in cuts[1:-1]:
        # two holders' block sums meet in an all-reduce: every entry has one non-zero contributor
        halves = [finish.block_sums(range_parts(flat, [(i, p, o) for i, (p, o) in enumerate(zip(params, offsets))],
                                                lo, hi), flat.device) for lo, hi in ((0, cut), (cut, flat.numel()))]
        held = ChunkGrads(flat, params, offsets, 0, cut, lambda sums, other=halves[1]: sums.add_(other))
        assert torch.equal(held.norm(finish), whole)
        assert torch.equal(finish.norm(halves[0] + halves[1]), whole)


def test_whole_grads_follow_torch_clip_grad_norm():
    params = _params(1)
    ref = [p.grad.clone() for p in params]
    ref_norm = torch.nn.utils.clip_grad_norm_(_with_grads(ref), 0.5)  # clips ``ref`` in place
    finish = StepFinish.of(params, "32", None, max_grad_norm=0.5)
    norm, skipped = finish.finish(WholeGrads(params))
    assert not skipped and norm == float(ref_norm)
    for p, g in zip(params, ref):
        assert torch.equal(p.grad, g)


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters holding ``grads`` (clipped in place by torch)."""
    out = []
    for g in grads:
        q = torch.nn.Parameter(torch.zeros_like(g))
        q.grad = g
        out.append(q)
    return out


def test_loss_scaling_skips_an_inf_gradient_and_clips_nothing():
    params = _params(2)
    params[1].grad[0] = float("inf")
    before = [p.grad.clone() for p in params]
    finish = StepFinish.of(params, "16-mixed", {"init_scale": 4.0}, max_grad_norm=0.5)
    norm, skipped = finish.finish(WholeGrads(params))
    assert skipped and norm == float("inf")
    for p, g in zip(params, before):  # unscaled, not clipped
        assert torch.equal(p.grad, g * torch.tensor(0.25))
    finish.update(skipped)
    assert finish.loss_scale == 2.0 and finish.scaler is finish.scaling


def test_no_loss_scale_never_skips_and_saves_nothing():
    finish = StepFinish.of(_params(3), "bf16-mixed", None, max_grad_norm=None)
    scaling = finish.scaling
    assert isinstance(scaling, NoLossScale) and scaling.scale is None and finish.scaler is None
    assert finish.blocks is None  # no norm is taken: nothing to clip, nothing to decide
    assert not scaling.skips(float("nan")) and not scaling.skips_flagged(3.0)
    assert scaling.checkpoint_entries() == {} and scaling.state_dict() is None
    loss = torch.tensor(2.0)
    assert scaling.scale_loss(loss) is loss
    assert isinstance(StepFinish.of(_params(3), "16-mixed", None, None).scaling, LossScaler)


def test_a_stage_local_part_with_tensor_slots_fills_each_shard_in_its_slot():
    q_shard, q_rep = torch.nn.Parameter(torch.zeros(BLOCK)), torch.nn.Parameter(torch.zeros(3))
    q_shard.grad, q_rep.grad = torch.full((BLOCK,), 2.0), torch.full((3,), 1.0)
    blocks = NormBlocks([BLOCK, 3], torch.float32, slots=[2, 1])
    finish = StepFinish(None, 1.0, blocks)
    summed: list[torch.Tensor] = []
    slots = TensorSlots(lambda v: summed.append(v.clone()), frozenset({id(q_shard)}), rank=1,
                        device=torch.device("cpu"))
    found, sums = finish.local([q_shard.grad, q_rep.grad], [Part(0, q_shard, q_shard.grad), Part(1, q_rep, q_rep.grad)],
                               torch.device("cpu"), slots)
    assert found == 0.0 and sums.dtype == torch.float64
    assert sums.tolist() == [0.0, 4.0 * BLOCK, 3.0]  # slot 1 of parameter 0, then parameter 1
    norm, skipped = finish.verdict(torch.tensor(0.0), sums)
    assert not skipped and torch.equal(norm, blocks.norm(sums))


def test_the_update_is_chosen_once_and_refuses_what_it_cannot_do():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    assert isinstance(make_update("allreduce", opt, params), WholeUpdate)
    with pytest.raises(ValueError, match="reduction='ring' is not known"):
        make_update("ring", opt, params)
    with pytest.raises(ValueError, match="shard_replicas=1 keeps replicas"):
        make_update("allreduce", opt, params, shard_replicas=1)
    sharded = make_update("sharded", opt, params)
    assert isinstance(sharded, ShardedUpdate) and sharded.shard is sharded.opt and not sharded.keeps_gradient
