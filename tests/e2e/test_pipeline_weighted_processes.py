"""Speed-weighted micro-batch shares of pipeline replicas, in processes: one short run.

The in-process and pure tests are ``tests/unit/test_pipeline_weighted.py``; this one checks that
the controller's weighted map reaches the worker processes (each replica runs its own block) and
that deterministic mode stays bit-identical to the unpipelined deterministic run.
"""

from __future__ import annotations

import jobs
import pipeline_models as pm
from conftest import assert_state_equal
import virtualflow as vf


def test_a_slowed_replica_runs_fewer_micro_batches_and_the_model_is_the_unpipelined_one(run_dir):
    # 2 replicas x 2 stages, V = 8, replica 1 at slowdown 3: per micro-batch 1 and 3 stage times,
    # bubble 1 and 3: 7/1 takes max(8, 6) stage times, 6/2 max(7, 9), equal 4/4 max(5, 15).
    result = vf.train(jobs.pipelined_job, workers=4, steps=4, deterministic=True, run_dir=run_dir,
                      slowdowns=[1, 1, 3, 3])
    assert [len(v) for v in result.history[-1]["vns"]] == [7, 7, 1, 1]
    ref_state, ref_losses = pm.unpipelined(jobs.pipelined_job(), 4, True)  # the VN engine, 1 worker, in-process
    assert_state_equal(result.state_dict, ref_state)
    assert [h["loss"] for h in result.history] == ref_losses
