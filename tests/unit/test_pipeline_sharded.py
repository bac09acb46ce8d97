"""A pipelined job with ``reduction="sharded"``: each stage's optimizer state sharded over its
pipeline replicas (``virtualflow.runtime.pipeline.stage_shard``), run in-process by ``train_local``.

- Deterministic mode with D = 2 replicas is bit-identical (weights, BatchNorm buffers, losses) to
  the unpipelined deterministic job on one worker (the VN engine, ``pipeline_models.unpipelined``)
  and to the plain PyTorch reference (``tests/reference.py``) within float tolerance; default mode
  is equal within float tolerance.
- Each replica holds about 1 / D of its stage's optimizer state; the chunks gathered are the whole
  state of the same job without sharding, bit for bit, and a job resumed from them (with D = 2
  sharded, or one plain replica) ends bit-identical to an uninterrupted one (an MLP, and a GPT
  whose embedding and head share a weight across the two stages).
- D = 1 is the plain path (bit-identical to ``reduction="allreduce"``).
- What is not supported is refused with the knob; a weight tied across stages is sharded like
  any other (``test_pipeline_sharded_tied.py``).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import pipeline_models as pm
from conftest import assert_state_close, assert_state_equal
from reference import reference_train
import virtualflow as vf
from virtualflow.backends.inprocess import train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.local import LocalDriver, build_engine
from virtualflow.runtime.pipeline.stage_shard import check_stage_sharding
from virtualflow.runtime.pipeline.stage_state import resume_stage

TOL = dict(rtol=1e-5, atol=1e-6)


def _train(job, steps, replicas, deterministic, reduction="sharded"):
    engines: list = []
    state, history = train_local(job, steps, replicas=replicas, deterministic=deterministic, reduction=reduction,
                                 engines_out=engines)
    return state, history, engines


# (schedule, stages, chunks, replicas, virtual nodes)
GRID = [("1f1b", 2, 1, 2, 6), ("gpipe", 3, 1, 2, 7), ("interleaved_1f1b", 2, 2, 2, 8), ("zb_h1", 2, 1, 2, 6)]


@pytest.mark.parametrize("schedule,p,v,d,V", GRID, ids=[f"{g[0]}-p{g[1]}-d{g[3]}" for g in GRID])
def test_deterministic_sharded_is_bit_identical_to_the_unpipelined_job(schedule, p, v, d, V):
    # Adam with an LR schedule and BatchNorm: the chunk's update, the stage's tail (statistics,
    # loss) and the parameters' all-gather all have to be exact.
    job = pm.mlp_job(Pipeline(stages=p, schedule=schedule, chunks=v), virtual_nodes=V, bn=True, optimizer="adam",
                     scheduler=True)
    state, history, engines = _train(job, 4, d, deterministic=True)
    ref_state, ref_losses = pm.unpipelined(job, 4, deterministic=True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    for e in engines[p:]:  # every replica holds the same parameters after the all-gather
        assert_state_equal(e.model.state_dict(), engines[e.stage_rank].model.state_dict())


def test_deterministic_sharded_with_clipping_and_a_transformer():
    job = pm.transformer_job(Pipeline(stages=3, schedule="1f1b"), virtual_nodes=6).replace(max_grad_norm=0.05)
    state, history, _ = _train(job, 3, 2, deterministic=True)
    ref_state, ref_losses = pm.unpipelined(job, 3, deterministic=True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    ref_norms = [h.grad_norm for h in train_local(job, 3, replicas=2, deterministic=True)[1]]
    assert [h.grad_norm for h in history] == ref_norms and all(n > 0.05 for n in ref_norms)  # it clipped


def test_default_mode_sharded_matches_the_unpipelined_job_and_the_plain_reference():
    # SGD with momentum (Adam would blow the rounding noise of a zero-gradient bias up to +-lr).
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=8, bn=True, optimizer="sgd", scheduler=True)
    state, history, _ = _train(job, 4, 2, deterministic=False)
    ref_state, ref_losses = pm.unpipelined(job, 4, deterministic=False)
    assert_state_close(state, ref_state, **TOL)
    assert [h.loss for h in history] == pytest.approx(ref_losses, rel=1e-6)
    model, _, plain_losses = reference_train(job, 4)
    assert_state_close(state, {k: v.detach() for k, v in model.state_dict().items()}, **TOL)
    # with clipping: each replica writes its chunk's blocks of the norm (a chunk starts on a block)
    clipped = job.replace(max_grad_norm=0.05)
    state, history, _ = _train(clipped, 3, 2, deterministic=False)
    ref_state, _ = pm.unpipelined(clipped, 3, deterministic=False)
    assert_state_close(state, ref_state, **TOL)
    ref_norms = [h.grad_norm for h in train_local(clipped, 3, replicas=2, deterministic=False)[1]]
    assert [h.grad_norm for h in history] == pytest.approx(ref_norms, rel=1e-5)


def test_one_replica_is_the_plain_path():
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4, optimizer="adamw", scheduler=True)
    for deterministic in (True, False):
        sharded, _, _ = _train(job, 3, 1, deterministic)
        plain, _, _ = _train(job, 3, 1, deterministic, reduction="allreduce")
        assert_state_equal(sharded, plain)


def _gather_whole(shards) -> dict:
    """The stage's whole optimizer state from its replicas' chunks: ``ShardedOptimizer.gather_state``
    run by every replica at once (threads), over an in-process all-reduce and all-gather."""
    d = len(shards)
    barrier = threading.Barrier(d)
    box: list = [None] * d
    out: list = [None] * d

    def run(j: int) -> None:
        def all_reduce(t: torch.Tensor) -> None:
            box[j] = t.clone()
            barrier.wait()
            total = sum(box[1:], box[0].clone())
            barrier.wait()
            t.copy_(total)

        def gather(chunk: torch.Tensor) -> torch.Tensor:
            box[j] = chunk.clone()
            barrier.wait()
            whole = torch.cat(box)  # chunks are contiguous, in replica order
            barrier.wait()
            return whole

        out[j] = shards[j].opt.gather_state(gather, all_reduce)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0]


class _StageSlice:
    """The whole model as ``resume_stage`` loads it, for an engine holding only its stage."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict({k: state[k] for k in self.module.state_dict()})


@pytest.mark.parametrize("model", ["mlp", "tied_gpt"])  # tied_gpt: both stages hold the shared weight's state
def test_optimizer_state_is_sharded_gathers_whole_and_resumes(model):
    p, d, V = 2, 2, 6
    if model == "mlp":
        job = pm.mlp_job(Pipeline(stages=p, schedule="1f1b"), virtual_nodes=V, bn=True, optimizer="adam",
                         scheduler=True)
    else:
        job = pm.transformer_job(Pipeline(stages=p, schedule="1f1b"), virtual_nodes=V, model=pm.tied_gpt)
    state, _, engines = _train(job, 2, d, deterministic=True)
    _, _, plain = _train(job, 2, d, deterministic=True, reduction="allreduce")
    gathered = []
    for s in range(p):
        shards = [engines[j * p + s].shard for j in range(d)]
        whole = plain[s].optimizer.state_dict()
        whole_bytes = sum(v.numel() * v.element_size() for st in whole["state"].values() for v in st.values()
                          if isinstance(v, torch.Tensor))
        for sh in shards:  # each replica holds about half of its stage's state
            assert sh.state_bytes() < 0.6 * whole_bytes
        assert sum(sh.state_bytes() for sh in shards) >= whole_bytes  # (+ a step count per piece of a chunk)
        full = _gather_whole(shards)
        assert full["state"].keys() == whole["state"].keys()
        for i in whole["state"]:
            for key, value in whole["state"][i].items():
                assert torch.equal(full["state"][i][key], value), (s, i, key)
        gathered.append(full)
        with pytest.raises(RuntimeError, match="gather_stage_optimizer"):
            engines[s].optimizer.state_dict()  # a chunk is never read as the stage's state
    saved = {"model": state, "optimizer": {"pipeline_stages": gathered},
             "lr_scheduler": {"pipeline_stages": [engines[s].scheduler.state_dict() for s in range(p)]},
             "grad_scaler": None}
    ref_state, ref_losses = pm.unpipelined(job, 4, deterministic=True)
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    for replicas, reduction in ((2, "sharded"), (1, "allreduce"), (2, "allreduce"), (1, "sharded")):
        resumed = []
        for r in range(p * replicas):
            e = build_engine(job, job.pipeline, bounds, r % p, dataset=job.build_dataset(), deterministic=True,
                             device=torch.device("cpu"), reduction=reduction)
            # (a copy each, as from a file: torch's load_state_dict keeps the tensors it is given)
            resume_stage(e, _StageSlice(e.model), copy.deepcopy(saved), r % p)
            resumed.append(e)
        driver = LocalDriver(resumed)
        driver.set_layout(contiguous_assignment(V, replicas))
        losses = [res.loss for t in (2, 3) for res in driver.run(t, 1)]
        final = {k: v for e in resumed[:p] for k, v in e.model.state_dict().items()}
        assert_state_equal(final, ref_state)
        assert losses == ref_losses[2:]


def test_unsupported_combinations_are_refused_with_the_knob():
    with pytest.raises(ValueError, match=r"schedule='2bw'.*flush schedule.*--reduction"):
        check_stage_sharding(Pipeline(stages=2, schedule="2bw"))
    with pytest.raises(ValueError, match=r"shard_replicas=1.*--shard-replicas"):
        check_stage_sharding(Pipeline(stages=2, schedule="1f1b"), shard_replicas=1)
    with pytest.raises(ValueError, match=r"shard_replicas=1 .*pipeline_stages=2.*--shard-replicas"):
        vf.LaunchOptions(steps=1, reduction="sharded", shard_replicas=1, pipeline_stages=2)
    vf.LaunchOptions(steps=1, reduction="sharded", pipeline_stages=2)  # the combination itself is allowed
    # a weight tied across stages is sharded like any other (tests/unit/test_pipeline_sharded_tied.py)
    tied = pm.transformer_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4, model=pm.tied_gpt)
    state, _ = train_local(tied, 1, replicas=2, reduction="sharded", deterministic=True)
    assert_state_equal(state, pm.unpipelined(tied, 1, deterministic=True)[0])
    rms = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4).replace(
        optimizer=lambda ps: torch.optim.RMSprop(ps))
    with pytest.raises(ValueError, match=r"Adam, AdamW and SGD.*--reduction allreduce"):
        train_local(rms, 1, replicas=2, reduction="sharded")


FP16_OVERFLOW = dict(precision="16-mixed", loss_scale={"init_scale": 2.0 ** 24, "growth_interval": 2},
                     max_grad_norm=1.0)


def test_fp16_skips_and_clipping_are_the_unsharded_ones():
    # float16 overflows at first (skipped steps, the scale backs off), then trains with clipping:
    # default mode checks each replica's chunk (its inf/nan, its part of the norm), deterministic
    # mode the whole root; both take the same skips, scales and norms as without sharding.
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4, optimizer="adamw",
                     scheduler=True).replace(**FP16_OVERFLOW)
    for deterministic in (False, True):
        state, history, _ = _train(job, 8, 2, deterministic)
        ref_state, ref, _ = _train(job, 8, 2, deterministic, reduction="allreduce")
        assert any(h.skipped for h in ref) and not all(h.skipped for h in ref)
        assert [h.skipped for h in history] == [h.skipped for h in ref]
        assert [h.loss_scale for h in history] == [h.loss_scale for h in ref]
        if deterministic:
            assert_state_equal(state, ref_state)
            assert str([h.grad_norm for h in history]) == str([h.grad_norm for h in ref])  # (nan == nan)
        else:
            assert_state_close(state, ref_state, **TOL)
            applied = [i for i, h in enumerate(ref) if not h.skipped]  # (a skipped step's norm is inf/nan)
            assert [history[i].grad_norm for i in applied] == pytest.approx([ref[i].grad_norm for i in applied],
                                                                              rel=1e-5)


def test_a_lost_chunk_cannot_be_cut_again():
    # After a failure the survivors hold chunks of the old layout only: the next layout cannot be
    # cut from them (the worker raises ShardLost naming the run directory to resume from).
    from virtualflow.runtime.sharded import ShardLost

    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4, optimizer="adam")
    _, _, engines = _train(job, 1, 2, deterministic=False)
    survivor = engines[0].shard
    survivor.cut(0, 2)  # the same layout: kept
    with pytest.raises(ShardLost, match=r"--resume RUN_DIR"):
        survivor.cut(0, 1)
