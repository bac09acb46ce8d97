"""The data order as a job's knob: ``Job.data_order``, the checkpoint's record of it, and resume's
refusal of a checkpoint trained with another order (states from before the knob: ``"randperm"``).
In-process: synthetic states, nothing started."""

from __future__ import annotations

import os

import pytest
import torch

from virtualflow.launching.resume import find_resume_state
from virtualflow.plan.data import DataPlan
from virtualflow.runtime.checkpoint import save_state
from virtualflow.runtime.step_boundary import job_identity

import jobs
from reference import order_index, step_batch


def _state(job, step: int, **identity) -> dict:
    torch.manual_seed(job.seed)
    return {"model": job.model().state_dict(), "optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": None,
            "step": step, "job": {**job_identity(job), **identity}}


def test_the_default_order_is_feistel_and_the_plan_follows_the_job():
    job = jobs.regression_job()
    assert job.data_order == "feistel"
    n = len(job.build_dataset())
    for order in ("feistel", "randperm"):
        j = job.replace(data_order=order)
        plan = DataPlan.of_job(j, n)
        assert plan.order == order
        for step in (0, 5, n // j.global_batch_size + 1):  # into epoch 1
            assert torch.equal(plan.step_indices(step), step_batch(j, n, step))
    assert step_batch(job, n, 0).tolist() == [order_index(p, n, job.seed, 0) for p in range(32)]


def test_a_bad_data_order_names_the_value_and_the_knob():
    with pytest.raises(ValueError, match=r"Job.data_order='shuffle' must be one of 'feistel', 'randperm'"):
        jobs.regression_job().replace(data_order="shuffle")


def test_the_checkpoint_records_the_order_and_resume_refuses_another(tmp_path):
    job = jobs.regression_job()
    assert job_identity(job)["data_order"] == "feistel"
    path = str(tmp_path / "final.pt")
    save_state(path, _state(job, 4))
    assert find_resume_state(path, job) == (path, 4)
    with pytest.raises(ValueError, match=r"trained with data_order='feistel', the job has data_order='randperm'; "
                                         r"resume with Job\(data_order='feistel', \.\.\.\)"):
        find_resume_state(path, job.replace(data_order="randperm"))


def test_a_checkpoint_from_before_the_knob_was_trained_with_randperm(tmp_path):
    job = jobs.regression_job()
    old = _state(job, 6)
    del old["job"]["data_order"]  # what a worker wrote before Job.data_order existed
    save_state(os.path.join(tmp_path, "final.pt"), old)
    with pytest.raises(ValueError, match=r"trained with data_order='randperm', the job has data_order='feistel'; "
                                         r"resume with Job\(data_order='randperm'"):
        find_resume_state(str(tmp_path), job)
    assert find_resume_state(str(tmp_path), job.replace(data_order="randperm"))[1] == 6
