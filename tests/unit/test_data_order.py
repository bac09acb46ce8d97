"""The data order as a job's knob: ``Job.data_order``, the checkpoint's record of it, and resume's
refusal of a checkpoint trained with another order (states from before the knob: ``"randperm"``),
and the engine reading either order as the reference does. In-process: nothing is started."""

from __future__ import annotations

import os

import pytest
import torch

from virtualflow.comm.groups import Group
from virtualflow.launching.resume import find_resume_state
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.checkpoint import save_state
from virtualflow.runtime.engine import BatchLoader, VNEngine
from virtualflow.runtime.step_boundary import job_identity

import jobs
from reference import order_index, reference_train, step_batch


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


def test_the_engine_trains_on_the_order_the_reference_computes():
    """One worker, 8 VNs, across an epoch boundary (256 samples, B=32: 8 steps per epoch): for
    either order the engine's losses and weights are the plain reference's, which reads the order
    by its rule; and the two orders do train on different batches."""
    steps, seen = 10, {}
    for order in ("feistel", "randperm"):
        job = jobs.regression_job("sgd").replace(data_order=order)
        torch.manual_seed(job.seed)
        model = job.model()
        ds = job.build_dataset()
        opt = job.optimizer(model.parameters())
        eng = VNEngine(model, opt, job.lr_scheduler(opt), job.loss, DataPlan.of_job(job, len(ds)),
                       BatchLoader(ds, None), seed=job.seed, batchnorm=job.batchnorm, deterministic=False,
                       device=torch.device("cpu"))
        eng.set_membership(Group(0, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
        losses = [eng.step(s).loss for s in range(steps)]
        ref_model, _, ref_losses = reference_train(job, steps)
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7), order
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(eng.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
        seen[order] = losses
    assert seen["feistel"][1:] != pytest.approx(seen["randperm"][1:], rel=1e-3)
