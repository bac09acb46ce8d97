"""The autoscaler with the sharded reduction (and replicas of its chunks), loader threads, bf16,
clipping and a newcomer killed, in processes.

One worker starts under a policy object that grows to ``max_workers`` at once; the newcomer is
SIGKILLed once it has joined, the survivor rebuilds the sharded optimizer state from its replica
(``shard_replicas=1``) and trains on alone, and the autoscaler grows the job back. The trained
model, optimizer and LR schedule are the single worker's without any of the helpers, bit for bit
(deterministic mode). The in-process counterpart, each pair in its own run, is
tests/unit/test_autoscale_composition.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import virtualflow as vf
from virtualflow.control.autoscale import Resize, Stay
from conftest import assert_same_training, wait_for_step
from vn_reference import one_worker
import jobs

FOREVER = 1_000_000


class GrowToMax:
    """Grows to ``max_workers`` whenever the job runs fewer."""

    name = "grow-to-max"

    def decide(self, history, limits):
        if history[-1].workers < limits.highest:
            return Resize(limits.highest, "grow to max_workers")
        return Stay("at max_workers")


def job(paced: bool) -> vf.Job:
    """An MLP with bf16 autocast and a clip that acts; ``paced``: rank 0 sleeps 0.1 s per step (the
    run takes a few dozen steps while the newcomers start; the model is the same)."""
    return jobs.regression_job(precision="bf16-mixed", max_grad_norm=0.05,
                               callbacks=[jobs.StepPace(0.1)] if paced else ())


def wait_for_members(handle, ids: set[int] | None, count: int, t0: float) -> list[int]:
    """Until ``count`` workers train in a formed generation (none of ``ids`` among them)."""
    while True:
        st = handle.status()
        members = [w["id"] for w in st["workers"] if w["rank"] is not None]
        if len(members) == count and st["formed_generation"] == st["generation"] and not (ids or set()) & set(members):
            return members
        assert not handle.done and time.monotonic() - t0 < 120, st
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_the_autoscaler_regrows_a_sharded_bf16_clipped_job_with_loaders_after_a_kill(run_dir):
    t0 = time.monotonic()
    handle = vf.launch(job(paced=True), workers=1, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       autoscale=GrowToMax(), max_workers=2, reduction="sharded", shard_replicas=1, loader_workers=2)
    try:
        first = wait_for_members(handle, None, 2, t0)
        wait_for_step(handle, handle.status()["step"] + 2)
        newcomer = next(w for w in handle.status()["workers"] if w["rank"] == 1)
        os.kill(newcomer["pid"], signal.SIGKILL)
        wait_for_members(handle, {newcomer["id"]}, 2, t0)
        wait_for_step(handle, handle.status()["step"] + 2)
        result = handle.stop()
    except BaseException:
        handle.kill()
        raise
    assert newcomer["id"] in first and [f["worker"] for f in result.failures] == [newcomer["id"]]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [1, 2, 1, 2]
    assert [(d["from"], d["to"]) for d in result.autoscale["decisions"]] == [(1, 2), (1, 2)]
    ref = one_worker(job(paced=False), result.steps)
    assert_same_training(result, ref)
    assert [h["loss"] for h in result.history] == [h["loss"] for h in ref.history]
