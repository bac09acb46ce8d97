"""``shard_replicas=1`` end to end: a SIGKILLed worker's chunk of the sharded optimizer state is
rebuilt in place from its successor's replica, and training goes on bit-identical to the
undisturbed run (deterministic mode: weights, optimizer state, LR schedule, every step once).

Each worker of three is killed in turn, in a phase on each side of the commit rule
(runtime/shard_replica.py): before the commit (the step is redone) and after it (the step is
completed from the replica). The in-process tests (tests/unit/test_shard_replicas.py) cover every
lost rank for 2-4 workers and the states in between.
"""

from __future__ import annotations

import pytest

import virtualflow as vf
from conftest import assert_same_training
import jobs

STEPS = 6
OPTIONS = dict(workers=3, steps=STEPS, deterministic=True, reduction="sharded", shard_replicas=1)


@pytest.fixture(scope="module")
def undisturbed():
    return vf.train(jobs.elastic_job, **OPTIONS)  # BatchNorm, dropout, Adam, an LR schedule


@pytest.mark.slow
@pytest.mark.parametrize("victim,phase", [(0, "after_update"), (1, "during_reduction"), (2, "after_reduction")])
def test_a_killed_workers_chunk_is_rebuilt_in_place(victim, phase, undisturbed, run_dir):
    plan = vf.FaultPlan([vf.Fault(worker=victim, step=3, phase=phase)])
    result = vf.train(jobs.elastic_job, fault_plan=plan, run_dir=run_dir, **OPTIONS)
    assert [f["worker"] for f in result.failures] == [victim]
    assert result.generations == 2 and {h["workers"] for h in result.history[4:]} == {2}
    assert_same_training(result, undisturbed)
    # after_update: the commit had completed, so the survivors completed step 3 (recorded by the
    # 3 workers) instead of redoing it.
    assert result.history[3]["workers"] == (3 if phase == "after_update" else 2)
    # The replica costs as much optimizer state as the chunk it copies, plus that chunk's gradient.
    for w, held in undisturbed.optimizer_bytes.items():
        assert held < undisturbed.replica_bytes[w] < 2 * held


@pytest.mark.slow
def test_the_rebuilt_state_reaches_a_replacement(undisturbed, run_dir):
    """2 workers, min_workers=2: worker 1 is killed, worker 0 rebuilds the whole state alone (its
    own chunk and its replica of worker 1's), holds until the replacement has joined, and hands it
    the state: the run goes on as if nothing had happened."""
    plan = vf.FaultPlan([vf.Fault(worker=1, step=3, phase="mid_backward")])
    result = vf.train(jobs.elastic_job, fault_plan=plan, run_dir=run_dir, min_workers=2, replace_failed=True,
                      **{**OPTIONS, "workers": 2})
    assert [f["worker"] for f in result.failures] == [1]
    assert {h["workers"] for h in result.history} == {2} and result.generations == 3  # start, hold, resume
    assert_same_training(result, undisturbed)


@pytest.mark.slow
def test_two_neighbours_killed_in_one_step_lose_a_chunk_and_say_so(run_dir):
    # Both at the start of step 3: neither can reach it before the other has finished step 2.
    plan = vf.FaultPlan([vf.Fault(worker=0, step=3, phase="before_forward"),
                         vf.Fault(worker=1, step=3, phase="before_forward")])
    with pytest.raises(vf.TrainingError, match=r"both holders of chunk 0 \(ranks 0 and 1\).*--resume RUN_DIR"):
        vf.train(jobs.elastic_job, fault_plan=plan, run_dir=run_dir, **OPTIONS)
