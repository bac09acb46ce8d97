"""One gradient-norm rule for every layout (``Job.max_grad_norm``, docs/training.md).

- A pipelined deterministic run (2 stages; 1 and 2 replicas; a weight tied across the stages and
  none) with a ``max_grad_norm`` that clips every step trains bit-identically to the unpipelined
  run of the same job (the VN engine on one worker), and reports the same norm each step. The
  models hold parameters of more than one 4096-element block, so the rule's blocks are exercised.
- A float64 model's norm is float64: the clip factor is ``clip_grad_norm_``'s on the same float64
  gradient within float64 rounding (not float32's), on one worker and pipelined.
- The rule itself (:class:`virtualflow.runtime.clipping.NormBlocks`), checked against a plain
  formulation: per-parameter blocks of 4096 elements, each block's sum of squares, summed; the
  sharded reduction's chunks start on blocks for any worker count; the bits do not depend on the
  thread count.

Process-free: the pipeline runs in-process (``backends.inprocess.train_local``); the sharded
reduction's norm against one worker's: tests/unit/test_composition.py. The tensor-parallel case
(P=2,T=2 against P=1,T=2) needs processes: tests/e2e/test_parallel3d.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipeline_models as pm
import virtualflow as vf
from conftest import assert_state_equal
from virtualflow.backends.inprocess import train_local
from virtualflow.comm.groups import Group
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.clipping import BLOCK
from virtualflow.runtime.engine import BatchLoader, VNEngine

from reference import step_batch

WIDE = 72  # a 72x72 weight: 5184 elements, one full 4096-element block and a partial one


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, WIDE, generator=g)
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True).tanh())


def _tied() -> nn.Sequential:
    """Layer 4 reads layer 0's weight: with 2 stages the weight lives on both workers."""
    first, fifth = nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE)
    fifth.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(WIDE, WIDE), nn.Tanh(), fifth, nn.Linear(WIDE, 1))


def _untied() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh(), nn.Linear(WIDE, 40), nn.Tanh(), nn.Linear(40, WIDE),
                         nn.Tanh(), nn.Linear(WIDE, 1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _mse(out, batch):
    return nn.functional.mse_loss(out, batch[1])


def _job(model, pipeline, *, virtual_nodes: int = 4, max_grad_norm: float = 0.01) -> vf.Job:
    return vf.Job(model=model, optimizer=_sgd, output_loss=_mse, dataset=_data, global_batch_size=4 * virtual_nodes,
                  virtual_nodes=virtual_nodes, seed=2, pipeline=pipeline, max_grad_norm=max_grad_norm)


def _vn_engine(job: vf.Job, **kw) -> tuple[nn.Module, VNEngine]:
    job = job.replace(pipeline=None)
    ds = job.build_dataset()
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    eng = VNEngine(model, opt, job.lr_scheduler(opt) if job.lr_scheduler else None, job.compute_loss,
                   DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed), BatchLoader(ds, None),
                   seed=job.seed, batchnorm=job.batchnorm, deterministic=True, device=torch.device("cpu"),
                   max_grad_norm=job.max_grad_norm,
                   **kw)
    return model, eng


def _unpipelined(job: vf.Job, steps: int) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    model, eng = _vn_engine(job)
    eng.set_membership(Group(0, 0, 1, None), [list(range(job.virtual_nodes))])
    history = []
    for s in range(steps):
        out = eng.step(s)
        history.append((out.loss, out.grad_norm))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


# ---- pipelined = unpipelined -------------------------------------------------------------------
CASES = [
    (_tied, Pipeline(stages=2), 1),
    (_tied, Pipeline(stages=2, schedule="gpipe"), 2),
    (_untied, Pipeline(stages=2), 1),
    (_untied, Pipeline(stages=2, schedule="zb_h1"), 2),
    (pm.tied_gpt, Pipeline(stages=2), 1),
    ("nanogpt", Pipeline(stages=2), 1),  # the case: nanoGPT via sequential_gpt, float32, SGD
]


def _case_job(model, pipe) -> vf.Job:
    if model == "nanogpt":
        import gpt_grid_jobs as g

        return g.grid_job(stages=pipe.stages, float32=True).replace(max_grad_norm=0.01)
    if model is pm.tied_gpt:
        return pm.transformer_job(pipe, virtual_nodes=4, model=model).replace(max_grad_norm=0.01)
    return _job(model, pipe)


@pytest.mark.parametrize("model,pipe,d", CASES,
                         ids=[f"{getattr(m, '__name__', m)}-{p.schedule}-d{d}" for m, p, d in CASES])
def test_a_pipelined_clipped_run_is_the_unpipelined_run_bit_for_bit(model, pipe, d):
    steps = 4
    job = _case_job(model, pipe)
    ref_state, ref_history = _unpipelined(job, steps)
    assert all(n > job.max_grad_norm for _, n in ref_history)  # the clip acted on every step
    state, history = train_local(job, steps, replicas=d, deterministic=True)
    assert [(h.loss, h.grad_norm) for h in history] == ref_history
    assert_state_equal(state, ref_state)


# ---- float64: the norm has the gradients' dtype ------------------------------------------------
def _float64_job(pipeline=None) -> vf.Job:
    return _job(lambda: _untied().double(), pipeline, max_grad_norm=0.01).replace(
        dataset=lambda: TensorDataset(*(t.double() for t in _data().tensors)))


def _torch_norm_of_first_step(job: vf.Job) -> float:
    """Plain PyTorch: the full global batch's gradient at the initial weights, its norm as
    ``clip_grad_norm_`` computes it (float64 gradients: a float64 norm)."""
    torch.manual_seed(job.seed)
    model = job.model()
    x, y = job.build_dataset().tensors
    idx = step_batch(job, len(x), 0)
    nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm)
    assert norm.dtype == torch.float64
    return float(norm)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_float64_models_norm_is_clip_grad_norm_s_in_float64(pipelined):
    """Each VN's gradient summed along the tree equals the full batch's within float64 rounding;
    the norm then does too (a float32 norm would be off by ~1e-8 relative)."""
    job = _float64_job(Pipeline(stages=2) if pipelined else None)
    if pipelined:
        _, history = train_local(job, 1, deterministic=True)
        norm = history[0].grad_norm
    else:
        norm = _unpipelined(job, 1)[1][0][1]
    ref = _torch_norm_of_first_step(job)
    assert norm > job.max_grad_norm
    assert abs(norm - ref) <= 1e-13 * ref, (norm, ref)


def test_chunks_start_on_blocks_for_any_worker_count():
    """The sharded reduction's chunks (:func:`shard_bounds` with the norm's cuts) cover the flat
    gradient and each starts on a block of some parameter, for any number of workers."""
    from virtualflow.plan.shards import check_bounds, shard_bounds
    from virtualflow.runtime.clipping import NormBlocks

    numels = [3, 5000, 4096, 70000, 1, 9000]
    cuts = NormBlocks(numels, torch.float32).cuts()
    starts = {o + k for o, n in zip([sum(numels[:i]) for i in range(len(numels))], numels)
              for k in range(0, n, BLOCK)} | {sum(numels)}
    for parts in range(1, 30):
        bounds = shard_bounds(sum(numels), parts, 16, cuts)
        check_bounds(bounds, sum(numels))
        assert all(lo in starts for lo, _ in bounds), (parts, bounds)


def test_the_rule_matches_a_plain_formulation_and_has_the_gradients_dtype():
    from virtualflow.runtime.clipping import NormBlocks

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        grads = [torch.randn(n, generator=g, dtype=dtype) for n in (5000, 3, 4096, 8193)]
        blocks = NormBlocks([t.numel() for t in grads], dtype)
        sums = torch.zeros(blocks.size, dtype=dtype)
        for i, t in enumerate(grads):
            blocks.fill(sums, i, t)
        # plain: each parameter cut into 4096-element rows (the last zero-padded), rows' squares summed
        rows = []
        for t in grads:
            padded = torch.zeros(-(-t.numel() // BLOCK) * BLOCK, dtype=dtype)
            padded[: t.numel()] = t
            rows.append((padded.view(-1, BLOCK) ** 2).sum(dim=1))
        plain = torch.cat(rows)
        assert torch.equal(sums, plain)
        norm = blocks.norm(sums)
        assert norm.dtype == dtype
        torch_norm = torch.linalg.vector_norm(torch.cat(grads))
        assert torch.allclose(norm, torch_norm, rtol=4 * torch.finfo(dtype).eps * 10, atol=0)


def test_the_norm_of_a_long_block_vector_does_not_depend_on_the_thread_count():
    """More than 16384 blocks (a model of over 64M elements): the final sum is taken in pieces
    each summed by one thread, so 1, 2 and 3 threads give the same bits - where torch's plain sum
    of the same vector does not (so the comparison can tell)."""
    from virtualflow.runtime.clipping import NormBlocks

    blocks = NormBlocks([BLOCK] * 70000, torch.float32)
    sums = torch.rand(blocks.size, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    norms, plain = [], []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            norms.append(blocks.norm(sums))
            plain.append(sums.sum().item())
    finally:
        torch.set_num_threads(before)
    assert len(set(plain)) > 1
    assert all(torch.equal(n, norms[0]) for n in norms)
    # and each block's sum is one thread's row too: the same for any thread count and cut
    g = torch.randn(200 * BLOCK + 77, generator=torch.Generator().manual_seed(1))
    one = NormBlocks([g.numel()], torch.float32)
    filled = []
    try:
        for threads, cut in ((1, 0), (3, 0), (3, 130)):
            torch.set_num_threads(threads)
            out = one.zeros(torch.device("cpu"))
            one.fill(out, 0, g[: cut * BLOCK], 0)
            one.fill(out, 0, g[cut * BLOCK:], cut)
            filled.append(out)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(f, filled[0]) for f in filled)
    assert torch.allclose(norms[0], sums.double().sum().sqrt().float(), rtol=1e-6)
