"""The heart of the suite: k workers x V virtual nodes train what a plain PyTorch loop trains.

Every (V, k) of the grid, with SGD and with Adam, is trained with the workers as threads of one
process in tests/unit/test_equivalence_in_process.py (the engines a worker process builds, over
real gloo groups); here one uneven (V, k) goes through worker processes and the coordinator's
records, with each optimizer."""

from __future__ import annotations

import pytest
import torch

import virtualflow as vf
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads
from conftest import assert_state_close, assert_state_equal, flat_optimizer_state
from jobs import bn_job, regression_job
from reference import reference_train
from vn_reference import one_worker

STEPS = 20  # 256 samples / B=32 -> 8 steps per epoch: 20 steps cross two epoch boundaries

CONFIGS = [(8, 3)]  # the whole grid: tests/unit/test_equivalence_in_process.py


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("virtual_nodes,workers", CONFIGS)
def test_matches_plain_pytorch_reference(optimizer, virtual_nodes, workers):
    job = regression_job(optimizer, virtual_nodes=virtual_nodes)
    result = vf.train(job, workers=workers, steps=STEPS)
    model, opt, losses = reference_train(job, STEPS)

    assert result.steps == STEPS and len(result.history) == STEPS
    assert_state_close(result.state_dict, model.state_dict(), rtol=1e-5, atol=1e-6)
    assert_state_close(flat_optimizer_state(result.optimizer_state_dict),
                       flat_optimizer_state(opt.state_dict()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([h["loss"] for h in result.history], losses, rtol=1e-5, atol=1e-6)
    assert result.lr_scheduler_state_dict["last_epoch"] == STEPS
    # Each record says who ran what; together the workers ran every VN exactly once.
    for h in result.history:
        assert h["workers"] == workers and sorted(v for vns in h["vns"] for v in vns) == list(range(virtual_nodes))
    # Training did something: the reference itself is not a no-op.
    assert losses[-1] < losses[0]


def test_bn_dropout_workers_agree_and_match_reference():
    job = bn_job()
    model, _, ref_losses = reference_train(job, 12)
    # One worker: the worker's engine in this process (one thread: its dropout draws are a worker's).
    one = train_threads(job, [Generation(members=(0,), steps=12)],
                        options=WorkerOptions(deterministic=False, breakdown=False))
    runs = {1: (one.state["model"], [o.loss for o in one.outcomes])}
    for w in (2, 4):
        r = vf.train(job, workers=w, steps=12)
        runs[w] = (r.state_dict, [h["loss"] for h in r.history])
    for w, (state, losses) in runs.items():
        assert_state_close(state, model.state_dict(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        # Running statistics were updated once per step, not once per VN.
        assert int(state["1.num_batches_tracked"]) == 12


def test_batchnorm_first_follows_vn0():
    job = bn_job(batchnorm="first")
    model, _, _ = reference_train(job, 6)
    r = vf.train(job, workers=2, steps=6)
    assert_state_close(r.state_dict, model.state_dict(), rtol=1e-5, atol=1e-6)
    # The default ("mean") statistics differ: its plain reference, which processes match
    # (test_bn_dropout_workers_agree_and_match_reference).
    mean, _, _ = reference_train(bn_job(), 6)
    assert not torch.allclose(mean.state_dict()["1.running_mean"], r.state_dict["1.running_mean"])


def test_deterministic_mode_is_bit_identical_for_any_worker_count():
    job = bn_job()
    base = one_worker(job, 10)  # vf.train(job, workers=1, steps=10, deterministic=True), in this process
    # 2, 5, 7 and 8 workers (and 3 again) with BatchNorm and dropout, resized and killed:
    # test_deterministic_scale.py
    for w in (3, 4):
        r = vf.train(job, workers=w, steps=10, deterministic=True)
        assert_state_equal(r.state_dict, base.state_dict)
        assert_state_equal(flat_optimizer_state(r.optimizer_state_dict),
                           flat_optimizer_state(base.optimizer_state_dict))
        assert [h["loss"] for h in r.history] == [h["loss"] for h in base.history]

