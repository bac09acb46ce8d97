"""The autoscaler grows a pipelined job by one whole replica, in processes.

A 2-stage pipelined job starts as one replica (2 workers) under a policy that asks for one more
worker than it runs (3: a partial replica); the executor applies whole replicas only, so the job
grows to 2 replicas (4 workers) in place, and the trained model is the single-worker unpipelined
job's, bit for bit (deterministic mode).
"""

from __future__ import annotations

import json
import os
import time

import pytest

import virtualflow as vf
from virtualflow.control.autoscale import Resize, Stay
from conftest import assert_state_equal, wait_for_step
from vn_reference import one_worker
import jobs

FOREVER = 1_000_000


class OneMoreWorker:
    """Asks for one worker more than the job runs, until the job runs two or more."""

    name = "one-more-worker"

    def decide(self, history, limits):
        workers = history[-1].workers
        return Resize(workers + 1, "one more worker") if workers < 4 else Stay("grown")


@pytest.mark.timeout(300)
def test_the_autoscaler_grows_a_pipelined_job_by_a_whole_replica_bit_identically(run_dir):
    handle = vf.launch(jobs.pipelined_slow_job, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       autoscale=OneMoreWorker(), max_workers=4)
    try:
        t0 = time.monotonic()
        while len(handle.controller.members) < 4 or handle.status()["formed_generation"] != handle.status()["generation"]:
            assert not handle.done and time.monotonic() - t0 < 120, handle.status()
            time.sleep(0.05)
        wait_for_step(handle, handle.status()["step"] + 2)
        result = handle.stop()
    except BaseException:
        handle.kill()
        raise
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 4]
    assert [(d["from"], d["to"]) for d in result.autoscale["decisions"]] == [(2, 4)]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        notes = [e["message"] for e in map(json.loads, f) if e["event"] == "autoscale_note"]
    assert any("asked for 3 workers; applying 4 (whole replicas of 2" in n for n in notes), notes
    ref = one_worker(jobs.pipelined_job().replace(pipeline=None), result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert [h["loss"] for h in result.history] == [h["loss"] for h in ref.history]
