"""Speed-weighted micro-batch shares on a tensor-parallel grid, in processes: one short run.

The time model and the speed policy (a stage's ``T`` workers paced by the slowest, measured
from the stage breakdown) are tested purely in ``tests/unit/test_pipeline_weighted.py``; this run
checks that the controller's weighted map of a (D, P, T) = (2, 1, 2) grid reaches the worker
processes (every member of a replica's tensor-parallel stage runs the replica's block) and that
the model is the single worker's: within float64 tolerance (the row-parallel sums are cut in T
pieces; docs/parallel3d.md), and bit for bit the one replica of (1, 1, 2) runs with all the
micro-batches (deterministic mode's VN tree does not depend on the shares).
"""

from __future__ import annotations

import pytest

from conftest import assert_state_equal
import gpt_grid_jobs as g
import pipeline_models as pm
import virtualflow as vf
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.grid_threads import Generation, train_threads

STEPS = 3


def _tensor_grid() -> vf.Job:
    return g.grid_job(stages=1, tensor=2)


def test_a_slowed_replica_of_a_tensor_parallel_grid_runs_fewer_micro_batches_and_trains_the_same_model(run_dir):
    # 2 replicas of one stage on 2 tensor-parallel workers, V = 4; replica 1's two workers at
    # slowdown 3: per micro-batch 1 and 3 stage times, 3/1 takes 3 (equal 2/2: 6).
    result = vf.train(_tensor_grid, workers=4, steps=STEPS, deterministic=True, run_dir=run_dir,
                      slowdowns=[1, 1, 3, 3])
    assert [len(v) for v in result.history[-1]["vns"]] == [3, 3, 1, 1]
    ref_state, ref_losses = pm.unpipelined(_tensor_grid(), STEPS, True)  # one worker, no pipeline, in-process
    assert result.state_dict.keys() == ref_state.keys()
    diff = max((result.state_dict[k].double() - ref_state[k].double()).abs().max().item() for k in ref_state)
    assert diff < 1e-12
    assert [h["loss"] for h in result.history] == pytest.approx(ref_losses, rel=1e-12, abs=0)
    # (1, 1, 2), every micro-batch: its 2 workers as threads of this process (the engines a worker
    # process builds, over real gloo groups; the grid job draws no dropout)
    one = train_threads(_tensor_grid(), [Generation(members=(0, 1), steps=STEPS)],
                        options=WorkerOptions(deterministic=True, breakdown=False))
    assert_state_equal(result.state_dict, one.state["model"])
    assert [h["loss"] for h in result.history] == [o.loss for o in one.outcomes]
