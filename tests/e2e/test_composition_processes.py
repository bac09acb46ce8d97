"""Pairs of capabilities from docs/composition.md that need worker processes: a weight tied across
pipeline stages (a tied embedding and head) with tensor-parallel stages, and with a failure and a
resize. Two short runs; the in-process pairs are in tests/unit/test_composition.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.backends.inprocess import train_local
from virtualflow.parallel.gpt import sequential_gpt
from conftest import assert_state_equal, wait_for_step
import gpt_grid_jobs as g
import jobs
import pipeline_models

FOREVER = 1_000_000


def _tied_gpt() -> nn.Module:
    """nanoGPT's GPT with its token embedding tied to the head (layers 0 and 5 of the cut)."""
    return sequential_gpt(g.grid_gpt(dropout=0.0, tied=True).double())


def tied_grid_job(tensor: int = 1) -> vf.Job:
    return g.grid_job(stages=2, tensor=tensor).replace(model=_tied_gpt)


def test_a_tied_embedding_and_head_on_tensor_parallel_stages_is_the_tensor_1_model():
    """(D, P, T) = (1, 2, 2): the embedding (stage 0) and the head (stage 1) share one weight,
    replicated on both tensor ranks; each plane sums its two uses' gradients as a T = 1 pipeline
    does, so the run is the T = 1 model (in-process) within float64 tolerance."""
    steps = 3
    ref, history = train_local(tied_grid_job(), steps, deterministic=True)
    result = vf.train(tied_grid_job, workers=4, steps=steps, deterministic=True)
    assert torch.equal(result.state_dict["0.wte.weight"], result.state_dict["5.lm_head.weight"])  # still tied
    assert result.state_dict.keys() == ref.keys()
    assert max((result.state_dict[k] - ref[k]).abs().max().item() for k in ref) < 1e-12
    assert max(abs(h["loss"] - r.loss) for h, r in zip(result.history, history, strict=True)) < 1e-12


def _tied_mlp() -> nn.Sequential:
    first, last = nn.Linear(10, 10), nn.Linear(10, 10)
    last.weight = first.weight  # one weight read by the first and the last layer
    return nn.Sequential(first, nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), last)


def _slow_mse(out, batch):
    time.sleep(0.01)  # slow enough to resize mid-run
    return nn.functional.mse_loss(out, batch[1])


def _pairs() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)  # every process builds the same data
    return torch.utils.data.TensorDataset(torch.randn(64, 10, generator=gen), torch.randn(64, 10, generator=gen))


def tied_pipelined_job() -> vf.Job:
    return vf.Job(model=_tied_mlp, optimizer=jobs.sgd, output_loss=_slow_mse, dataset=_pairs,
                  global_batch_size=16, virtual_nodes=4, seed=3, pipeline=vf.Pipeline(stages=2))


@pytest.mark.slow
def test_a_weight_tied_across_stages_survives_a_failure_and_a_grow_bit_identically(run_dir):
    """2 stages x 2 replicas, the weight shared by stage 0 and stage 1: worker 2 (stage 0 of
    replica 1) dies mid-backward of step 2 (its replica leaves), then the job grows back to 2
    replicas (the newcomers receive their stage's copy of the shared weight): bit-identical to
    the unpipelined deterministic run."""
    plan = vf.FaultPlan([vf.Fault(worker=2, step=2, phase="mid_backward")])
    handle = vf.launch(tied_pipelined_job, workers=4, steps=FOREVER, deterministic=True, fault_plan=plan,
                       run_dir=run_dir)
    try:
        wait_for_step(handle, 4)
        handle.resize(4, wait=True, timeout_s=120)
        wait_for_step(handle, handle.status()["step"] + 2)
        result = handle.stop()
    except BaseException:
        handle.kill()
        raise
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [4, 2, 4]
    assert [f["worker"] for f in result.failures] == [2]
    assert [h["step"] for h in result.history] == list(range(result.steps))
    ref_state, ref_losses = pipeline_models.unpipelined(tied_pipelined_job(), result.steps, True)
    assert_state_equal(result.state_dict, ref_state)
    assert [h["loss"] for h in result.history] == ref_losses
