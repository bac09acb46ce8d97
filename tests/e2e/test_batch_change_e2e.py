"""A batch change asked while a job runs (:meth:`virtualflow.JobHandle.change_batch`, what the
cluster service's elastic-batch decisions call), end to end on the local backend: the workers
take it at a step boundary in place, the run records the step it applied at, and a plain run
given the recorded changes (``schedule_from_events``) ends with the same bits (deterministic)."""

from __future__ import annotations

import time

import pytest

import virtualflow as vf
from conftest import assert_state_equal, flat_optimizer_state, wait_for_step
import jobs
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.batch_schedule import schedule_from_events
from virtualflow.records.rundir import read_jsonl
from virtualflow.runtime.grid_threads import Generation, train_threads

pytestmark = pytest.mark.slow


def _recorded(run_dir: str, count: int, handle, timeout_s: float = 120.0) -> list[dict]:
    """Wait until ``count`` ``batch`` records are in the run's events (each is written once a
    worker has run a step at the new batch)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in read_jsonl(f"{run_dir}/events.jsonl") if e["event"] == "batch"]
        if len(got) >= count:
            return got
        assert not handle.done and time.monotonic() < deadline, f"{count} batch change(s) not recorded"
        time.sleep(0.02)


def test_a_requested_batch_change_is_applied_in_place_recorded_and_replays_bit_for_bit(run_dir):
    handle = vf.launch(jobs.paced_regression_job, workers=2, steps=1_000_000, deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 2)
    handle.change_batch(16, "sqrt")  # B 64 -> 128 from the next step not yet run
    first = _recorded(run_dir, 1, handle)[0]
    wait_for_step(handle, first["step"] + 2)
    handle.change_batch(2, "sqrt")  # B 128 -> 16, still a virtual node for each of the 2 workers
    second = _recorded(run_dir, 2, handle)[1]
    wait_for_step(handle, second["step"] + 2)
    result = handle.stop()
    assert (first["virtual_nodes"], first["global_batch_size"], first["lr_multiplier"]) == (16, 128, 2 ** 0.5)
    assert (second["virtual_nodes"], second["global_batch_size"]) == (2, 16) and second["step"] > first["step"]
    # every step ran the batch the records say, with no restart in between (one generation)
    assert [h["samples"] for h in result.history] == [
        64 if s < first["step"] else 128 if s < second["step"] else 16 for s in range(result.steps)]
    assert result.generations == 1
    schedule, rule = schedule_from_events(read_jsonl(f"{run_dir}/events.jsonl"))
    assert schedule == [(first["step"], 16), (second["step"], 2)] and rule == "sqrt"
    replay = jobs.regression_job("sgd", virtual_nodes=8, global_batch_size=64).replace(batch_schedule=schedule,
                                                                                       lr_rule=rule)
    # (the replay in this process, worker threads: deterministic mode's bits do not depend on where workers run)
    again = train_threads(replay, [Generation(members=(0, 1), steps=result.steps)],
                          options=WorkerOptions(deterministic=True))
    assert_state_equal(result.state_dict, again.state["model"])
    assert_state_equal(flat_optimizer_state(result.optimizer_state_dict), flat_optimizer_state(again.state["optimizer"]))
