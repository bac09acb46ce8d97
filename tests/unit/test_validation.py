"""Bad input gets a clear error naming the value, the rule and the knob, before any worker starts."""

from __future__ import annotations

import threading

import pytest

import virtualflow as vf
from virtualflow.backends.local import LocalBackend
import jobs


@pytest.fixture(autouse=True)
def no_workers(monkeypatch):
    """Any test here that reaches a worker start is a failure: errors must come first."""

    def refuse(self, worker_id):
        raise AssertionError("a worker was started before the input was validated")

    monkeypatch.setattr(LocalBackend, "start_worker", refuse)


def test_batch_not_divisible_by_virtual_nodes():
    with pytest.raises(ValueError, match=r"global_batch_size=30 is not divisible by virtual_nodes=8; choose a multiple of 8"):
        jobs.regression_job(global_batch_size=30)
    with pytest.raises(ValueError, match=r"global_batch_size=36 is not divisible by virtual_nodes=8"):
        vf.train(jobs.regression_job(), workers=1, steps=1, global_batch_size=36)


def test_fewer_virtual_nodes_than_workers():
    with pytest.raises(ValueError, match=r"virtual_nodes=4 is smaller than workers=5.*at most 4 workers"):
        vf.train(jobs.regression_job(virtual_nodes=4), workers=5, steps=1)


def test_dataset_smaller_than_global_batch():
    job = jobs.regression_job(global_batch_size=512)  # the dataset has 256 samples
    with pytest.raises(ValueError, match=r"256 samples, fewer than global_batch_size=512.*lower global_batch_size"):
        vf.train(job, workers=1, steps=1)


@pytest.mark.parametrize("workers", [0, -1, 1.5])
def test_workers_must_be_positive(workers):
    with pytest.raises(ValueError, match=rf"workers={workers!r} must be a positive integer"):
        vf.train(jobs.regression_job(), workers=workers, steps=1)


@pytest.mark.parametrize("kw", [{}, {"steps": 3, "epochs": 1}])
def test_steps_xor_epochs(kw):
    with pytest.raises(ValueError, match=r"give exactly one of steps and epochs"):
        vf.train(jobs.regression_job(), workers=1, **kw)


def test_job_capturing_what_cannot_be_pickled_is_refused_before_start():
    lock = threading.Lock()  # lambdas and closures travel by value; a lock cannot travel at all
    job = jobs.regression_job().replace(model=lambda: (lock, jobs.mlp())[1])
    with pytest.raises(vf.JobImportError, match=r"the Job cannot be sent to worker processes.*build such objects"):
        vf.train(job, workers=1, steps=1)


def test_missing_module_and_function():
    with pytest.raises(vf.JobImportError, match=r"cannot import the job module of 'no_such_module_xyz:make_job'"):
        vf.train("no_such_module_xyz:make_job", workers=1, steps=1)
    with pytest.raises(vf.JobImportError, match=r"has no function 'nope'"):
        vf.train("jobs:nope", workers=1, steps=1)
    with pytest.raises(vf.JobImportError, match=r"does not exist"):
        vf.train("missing/file.py:make_job", workers=1, steps=1)


def test_loss_that_is_not_a_scalar():
    job = jobs.regression_job().replace(loss=jobs.per_sample_loss)
    with pytest.raises(vf.LossShapeError, match=r"scalar.*returned \(4, 1\).*\.mean\(\)"):
        vf.train(job, workers=2, steps=1)


def test_job_field_validation():
    with pytest.raises(TypeError, match=r"Job.model must be callable"):
        vf.Job(model=None, optimizer=jobs.sgd, loss=jobs.mse, dataset=jobs.regression_data,
               global_batch_size=8, virtual_nodes=2)
    with pytest.raises(ValueError, match=r"Job.virtual_nodes=0 must be a positive int"):
        jobs.regression_job(virtual_nodes=0)
    with pytest.raises(ValueError, match=r"batchnorm='sum' must be 'mean' or 'first'"):
        jobs.bn_job(batchnorm="sum")
    with pytest.raises(TypeError, match=r"map-style"):
        vf.Job(model=jobs.mlp, optimizer=jobs.sgd, loss=jobs.mse, dataset=42, global_batch_size=8, virtual_nodes=2)
