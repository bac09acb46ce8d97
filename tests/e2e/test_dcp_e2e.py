"""Sharded asynchronous checkpoints end to end (``checkpoint_format="dcp"``, ``async_checkpoint``).

A 2-worker sharded deterministic job checkpoints every 4 steps in the background; worker 0 is
SIGKILLed while writing its part of the step-8 checkpoint. The step-8 folder stays partial, the
step-4 checkpoint stays complete and is the one a resume picks; resumed on 3 workers with the
all-reduce reduction (the optimizer state reassembled from the 2 workers' chunks), the job ends
bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import assert_same_training
from vn_reference import one_worker

import jobs
import virtualflow as vf
from virtualflow.launching.resume import find_resume_state


@pytest.mark.timeout(120)
def test_killed_during_an_async_save_then_resumed_on_3_allreduce_workers_is_bit_identical(run_dir):
    plan = vf.FaultPlan([vf.Fault(worker=0, step=8, phase="during_checkpoint")])
    job = jobs.elastic_job().replace(loss=jobs.cross_entropy)
    with pytest.raises(vf.TrainingError):
        vf.train(job, workers=2, steps=12, deterministic=True, reduction="sharded", checkpoint_every=4,
                 checkpoint_format="dcp", async_checkpoint=True, fault_plan=plan, run_dir=run_dir)
    folder = os.path.join(run_dir, "checkpoints")
    names = sorted(os.listdir(folder))
    assert "step-00000004.dcp" in names and "step-00000008.dcp" not in names, names
    assert "step-00000008.dcp.partial" in names  # the interrupted save, never read
    path, step = find_resume_state(run_dir, job)
    assert (os.path.basename(path), step) == ("step-00000004.dcp", 4)
    result = vf.train(job, workers=3, steps=12, deterministic=True, resume=run_dir)
    assert result.history[0]["step"] == 4
    ref = one_worker(job, 12)
    assert_same_training(result, ref, first_step=4)


@pytest.mark.timeout(120)
def test_a_pipelined_sharded_checkpoint_resumes_on_another_replica_count_and_stage_count(tmp_path):
    """2 stages x 2 replicas write their stages' shares (no gather); resumed as 2 stages x 1
    replica, and as 4 stages x 1 (the optimizer state follows its parameters by name), the run
    ends as the unpipelined reference."""
    from conftest import assert_state_equal

    first = str(tmp_path / "first")
    vf.train(jobs.pipelined_job, workers=4, steps=4, deterministic=True, run_dir=first, checkpoint_every=2,
             checkpoint_format="dcp", async_checkpoint=True)
    os.remove(os.path.join(first, "final.pt"))  # as if it had stopped after step 3
    assert sorted(os.listdir(os.path.join(first, "checkpoints"))) == ["step-00000002.dcp"]
    second = str(tmp_path / "second")
    shutil.copytree(first, second)  # each resume continues in its run directory
    result = vf.train(jobs.pipelined_job, workers=2, steps=7, deterministic=True, resume=first)
    assert result.history[0]["step"] == 2
    ref = one_worker(jobs.pipelined_job().replace(pipeline=None), 7)
    assert_state_equal(result.state_dict, ref.state_dict)
    four = vf.train(jobs.pipelined_job, workers=4, steps=7, deterministic=True, pipeline_stages=4, resume=second)
    assert four.history[0]["step"] == 2
    assert_state_equal(four.state_dict, ref.state_dict)
