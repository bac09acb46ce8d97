"""The training loop's knobs across worker processes: a transformer LM with bf16 autocast,
clipping at norm 1, activation checkpointing and AdamW groups (tests/lm_jobs.py) trains
bit-identical weights for 1, 2 and 3 workers in deterministic mode, with the sharded reduction
too; float16 loss scaling skips the same steps whatever the worker count; and a SIGKILL and a
resize in the middle of such a run leave it bit-identical to the undisturbed run."""

from __future__ import annotations

import os

import pytest
import torch

import virtualflow as vf
from conftest import assert_same_training, assert_state_close, assert_state_equal, wait_for_step
from loop_reference import loop_train
import vn_reference
import lm_jobs

FOREVER = 1_000_000
STEPS = 6


def final_state(run_dir: str) -> dict:
    return torch.load(os.path.join(run_dir, "final.pt"), weights_only=False)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("one"))
    return vf.train("lm_jobs:make_job_checkpointed", workers=1, steps=STEPS, deterministic=True, run_dir=run_dir)


def test_bf16_clip_checkpointing_bit_identical_for_1_2_3_workers_and_sharded(one_worker):
    ref_model, _ = loop_train(lm_jobs.make_job_checkpointed(), STEPS, activation_checkpointing=lm_jobs.Block)
    assert_state_close(one_worker.state_dict, ref_model.state_dict(), rtol=1e-3, atol=1e-4)
    for workers, reduction in ((2, "allreduce"), (3, "allreduce"), (3, "sharded")):
        result = vf.train("lm_jobs:make_job_checkpointed", workers=workers, steps=STEPS, deterministic=True,
                          reduction=reduction)
        assert_same_training(result, one_worker)
    # default mode: the ring sums in another order, the same model within tolerance
    default = vf.train("lm_jobs:make_job_checkpointed", workers=2, steps=STEPS)
    assert_state_close(default.state_dict, ref_model.state_dict(), rtol=1e-3, atol=1e-4)


def test_fp16_skips_the_same_steps_and_scale_for_1_and_3_sharded_workers(tmp_path):
    """1 worker, and 3 with the sharded reduction (where each worker holds a chunk of the gradient
    and the verdict comes from the all-reduced block norms)."""
    states = []
    for workers, reduction in ((1, "allreduce"), (3, "sharded")):
        run_dir = str(tmp_path / f"w{workers}")
        result = vf.train("lm_jobs:make_job_fp16", workers=workers, steps=STEPS, deterministic=True,
                          reduction=reduction, run_dir=run_dir)
        states.append((result, final_state(run_dir)))
    (a, fa), (b, fb) = states
    assert_same_training(a, b)
    assert fa["grad_scaler"] == fb["grad_scaler"]
    # step 0 and step 4 overflowed (see lm_jobs.make_job_fp16): the scale is 2**20 / 2 / 2 * 2
    assert fa["grad_scaler"]["scale"] == 2.0 ** 19


@pytest.mark.slow
def test_sigkill_and_resize_mid_run_stay_bit_identical(run_dir):
    plan = vf.FaultPlan([vf.Fault(worker=1, step=4, phase="during_reduction")])
    handle = vf.launch("lm_jobs:make_paced_job_checkpointed", workers=3, steps=FOREVER, deterministic=True,
                       fault_plan=plan, run_dir=run_dir)
    wait_for_step(handle, 8)
    handle.resize(3, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    assert [f["worker"] for f in result.failures] == [1] and "SIGKILL" in result.failures[0]["cause"]
    sizes = [h["workers"] for h in result.history]
    assert 2 in sizes and sizes[-1] == 3
    # vf.train("lm_jobs:make_job_checkpointed", workers=1, ..., deterministic=True), in this process
    ref = vn_reference.one_worker(lm_jobs.make_job_checkpointed(), result.steps)
    assert_same_training(result, ref)
