"""Streaming datasets across worker processes (tests/stream_jobs.py: 8 uneven shards, one empty,
a shuffle buffer of 5, V=6, 8 steps per epoch).

1. 2 workers (loading ahead in 2 threads each) train bit-identical weights to 1 worker
   (deterministic mode), and both match a
   single-process loop that reads the shards by the documented rule (tests/unit/test_streams.py's
   reference) within float tolerance; so does the job cut into 2 pipeline stages on 2 workers.
2. Exactly-once across a failure, a resize and a resume: 3 workers lose one to a SIGKILL, grow
   back to 3, are stopped, and the run is resumed on 1 worker. Every batch any process trained
   on (the ledger the loss writes) is one the rule assigns - so over each epoch every sample id
   appears exactly once but the documented drop - and the final weights are bit-identical to the
   uninterrupted 1-worker run.
"""

from __future__ import annotations

import os

import pytest

import virtualflow as vf
from conftest import assert_same_training, assert_state_close, wait_for_step
import stream_jobs
import vn_reference
from test_streams import reference_batches, reference_loop

FOREVER = 1_000_000
STEPS = 20  # two and a half epochs


@pytest.fixture(scope="module")
def one_worker():
    """``vf.train("stream_jobs:stream_job", workers=1, steps=STEPS, deterministic=True)``, in this
    process (:mod:`vn_reference`: the worker's engine reading the stream)."""
    return vn_reference.one_worker(stream_jobs.stream_job(), STEPS)


def test_two_workers_equal_one_and_the_single_process_reference(one_worker):
    two = vf.launch("stream_jobs:stream_job", workers=2, steps=STEPS, deterministic=True, loader_workers=2)
    # a pipeline's first stage reads the stream (its last stage too, for the targets)
    piped = vf.launch("stream_jobs:pipelined_stream_job", workers=2, steps=STEPS, deterministic=True)
    assert_same_training(two.wait(timeout_s=120), one_worker)
    ref = reference_loop(STEPS).state_dict()
    assert_state_close(one_worker.state_dict, ref, rtol=1e-5, atol=1e-6)
    assert_state_close(piped.wait(timeout_s=120).state_dict, ref, rtol=1e-5, atol=1e-6)


def read_ledger(folder: str) -> set[tuple[int, ...]]:
    out = set()
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            out |= {tuple(map(int, line.split())) for line in f if line.strip()}
    return out


def test_exactly_once_across_a_sigkill_a_resize_and_a_resume_on_another_count(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    monkeypatch.setenv("VF_TEST_LEDGER", str(ledger))
    run_dir = str(tmp_path / "run")
    plan = vf.FaultPlan([vf.Fault(worker=1, step=3, phase="during_reduction")])
    handle = vf.launch("stream_jobs:paced_stream_job", workers=3, steps=FOREVER, deterministic=True,
                       fault_plan=plan, run_dir=run_dir)
    wait_for_step(handle, 5)
    handle.resize(3, wait=True, timeout_s=120)  # a newcomer takes over VNs, most likely mid-epoch
    wait_for_step(handle, handle.status()["step"] + 2)
    stopped = handle.stop()
    assert [f["worker"] for f in stopped.failures] == [1]
    sizes = [h["workers"] for h in stopped.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2, 3]
    steps = stopped.steps + 6
    # Another job function (the same training, without the pacing): it starts from that run's state
    # in a run directory of its own (the stopped run's directory records the paced job's identity).
    resumed = vf.launch("stream_jobs:ledger_stream_job", workers=1, steps=steps, deterministic=True, resume=run_dir,
                        run_dir=str(tmp_path / "resumed"))
    result = resumed.wait(timeout_s=120)
    # the uninterrupted 1-worker run, in this process (vn_reference)
    assert_same_training(result, vn_reference.one_worker(stream_jobs.stream_job(), steps), first_step=stopped.steps)

    # Every batch trained on (a redone step repeats its own) is the rule's, and all of them were:
    # over each epoch every sample id appears exactly once but the documented drop of 4.
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, 5, steps)
    assert read_ledger(str(ledger)) == {tuple(ids) for ids in ref.values()}
    for epoch in range(steps // 8):
        ids = [i for (s, _), batch in ref.items() if s // 8 == epoch for i in batch]
        assert len(ids) == len(set(ids)) == 100 - 4
