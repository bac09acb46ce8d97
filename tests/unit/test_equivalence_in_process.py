"""k workers x V virtual nodes train what a plain PyTorch loop trains, every worker a thread of this
process (:func:`virtualflow.runtime.grid_threads.train_threads`: the engines a worker process
builds, over real gloo groups), for every (V, k) of the grid and both optimizers; and deterministic
mode's Adam on 3 workers is one worker's, bit for bit.

This is tests/e2e/test_equivalence.py's grid without a process per worker; that file keeps one
(V, k) in worker processes (the same checks through the coordinator and its records). Jobs with
dropout stay there: the threads of this process share torch's default generator."""

from __future__ import annotations

import pytest
import torch

from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads
from conftest import assert_state_close, assert_state_equal, flat_optimizer_state
from jobs import regression_job
from reference import reference_train
from vn_reference import one_worker

STEPS = 20  # 256 samples / B=32 -> 8 steps per epoch: 20 steps cross two epoch boundaries

CONFIGS = [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (8, 1), (8, 2), (8, 3), (8, 4)]


def threaded(job, workers: int, steps: int, deterministic: bool = False):
    """``vf.train(job, workers=workers, steps=steps, deterministic=deterministic)``, in threads."""
    return train_threads(job, [Generation(members=tuple(range(workers)), steps=steps)],
                         options=WorkerOptions(deterministic=deterministic, breakdown=False))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("virtual_nodes,workers", CONFIGS)
def test_matches_plain_pytorch_reference(optimizer, virtual_nodes, workers):
    job = regression_job(optimizer, virtual_nodes=virtual_nodes)
    run = threaded(job, workers, STEPS)
    model, opt, losses = reference_train(job, STEPS)

    assert len(run.outcomes) == STEPS
    assert_state_close(run.state["model"], model.state_dict(), rtol=1e-5, atol=1e-6)
    assert_state_close(flat_optimizer_state(run.state["optimizer"]),
                       flat_optimizer_state(opt.state_dict()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([o.loss for o in run.outcomes], losses, rtol=1e-5, atol=1e-6)
    assert run.state["lr_scheduler"]["last_epoch"] == STEPS
    # Training did something: the reference itself is not a no-op.
    assert losses[-1] < losses[0]



def test_deterministic_mode_adam_bit_identical():
    """(In worker processes, deterministic Adam against one worker: tests/e2e/test_elastic.py,
    test_shard_replicas_e2e.py and test_deterministic_scale.py, whose jobs train with Adam.)"""
    job = regression_job("adam", virtual_nodes=8)
    base = one_worker(job, 12)
    run = threaded(job, 3, 12, deterministic=True)
    assert_state_equal(run.state["model"], base.state_dict)
    assert_state_equal(flat_optimizer_state(run.state["optimizer"]), flat_optimizer_state(base.optimizer_state_dict))
    # and it is still the same training as the default mode, within float tolerance
    ref, _, _ = reference_train(job, 12)
    assert_state_close(run.state["model"], ref.state_dict(), rtol=1e-5, atol=1e-6)
