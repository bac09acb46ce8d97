"""Failures end the job fast, with the worker, the step and the cause in the message."""

from __future__ import annotations

import os
import signal
import time

import pytest

import virtualflow as vf
from virtualflow.runtime.checkpoint import load_state
from conftest import assert_state_close
import jobs
from reference import reference_train


def test_nan_loss_names_step_and_vn_and_keeps_last_good_state(run_dir):
    with pytest.raises(vf.TrainingError) as info:
        vf.train(jobs.nan_job, workers=3, steps=10, run_dir=run_dir)
    msg = str(info.value)
    assert f"non-finite loss at step {jobs.NAN_STEP} in virtual node {jobs.NAN_VN};" in msg
    state = load_state(os.path.join(run_dir, "checkpoint.pt"))
    assert state["step"] == jobs.NAN_STEP
    # The kept state is the good one: that of the clean reference after NAN_STEP steps.
    ref, _, _ = reference_train(jobs.regression_job("sgd"), jobs.NAN_STEP)
    assert_state_close(state["model"], ref.state_dict(), rtol=1e-5, atol=1e-6)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert '"status": "failed"' in f.read()


def test_losing_the_last_worker_fails_fast_with_its_id_and_signal():
    # With survivors the job goes on (tests/test_elastic.py); with none it must fail clearly.
    handle = vf.launch(jobs.long_job, workers=1, steps=100_000)
    deadline = time.monotonic() + 60
    while handle.status()["step"] < 3:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    victim = handle.status()["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(vf.TrainingError, match=rf"worker 0 \(pid {victim['pid']}\) was killed by SIGKILL at step \d+, "
                       r"and no worker is left"):
        handle.wait(timeout_s=30)
    assert time.monotonic() - t0 < 10
    assert handle.status()["state"] == "failed"
    # No worker is left behind.
    for w in handle.backend.workers.values():
        assert w.proc.poll() is not None


def test_worker_exception_is_reported_with_its_message(tmp_path):
    # The loss is a scalar for VN batches of 4 (preflight passes) but not for the last
    # worker's... simplest real crash: a collate that fails for one specific index.
    with pytest.raises(vf.TrainingError, match=r"worker \d \(pid \d+\) failed: .*boom at index"):
        vf.train(jobs.crashing_job, workers=2, steps=20)


def test_stop_keeps_the_state_reached():
    handle = vf.launch(jobs.long_job, workers=2, steps=100_000)
    deadline = time.monotonic() + 60
    while handle.status()["step"] < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    result = handle.stop()
    assert result.stopped and 5 <= result.steps < 100_000
    assert len(result.history) == result.steps
    ref, _, _ = reference_train(jobs.long_job(), result.steps)
    assert_state_close(result.state_dict, ref.state_dict(), rtol=1e-5, atol=1e-6)
