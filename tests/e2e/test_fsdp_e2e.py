"""Sharded parameters (``reduction="fsdp"``) in worker processes, against the unsharded run.

The job is a small transformer LM with dropout (each worker process draws its VNs' masks from
``vn_seed``), its output matrix tied to the embedding, AdamW groups chosen by name, bf16
autocast, clipping, activation checkpointing and a warmup-cosine schedule
(tests/lm_jobs.py). In deterministic mode:

- 3 sharded workers writing sharded checkpoints (each owner its own ranges, no gather) train the
  weights of 1 unsharded worker bit for bit, and the checkpoint resumes on 2 sharded workers and
  on 1 unsharded worker, bit for bit;
- resized 3 -> 2 -> 4 while it trains, the shards move in place (each new owner receives its
  ranges from their old owners; a newcomer's through a surviving deputy) and the run ends
  bit-identical to one unsharded worker's;
- a worker SIGKILLed in the middle of a backward takes its shards with it: the run falls back to
  its last checkpoint by itself (``train`` restarts it) and ends bit-identical to the undisturbed run.
"""

from __future__ import annotations

import os

import pytest
from conftest import assert_same_training, wait_for_step
from vn_reference import one_worker

import lm_jobs
import virtualflow as vf


def job() -> vf.Job:
    return lm_jobs.lm_job(activation_checkpointing=lm_jobs.Block)


@pytest.mark.timeout(240)
def test_sharded_checkpoints_resume_on_any_worker_count_and_unsharded(run_dir, tmp_path):
    ref = one_worker(job(), 6)
    sharded = vf.train(job(), workers=3, steps=4, deterministic=True, reduction="fsdp", checkpoint_every=2,
                       checkpoint_format="dcp", run_dir=run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step-00000002.dcp"]
    assert_same_training(sharded, one_worker(job(), 4))
    os.remove(os.path.join(run_dir, "final.pt"))  # (resume from the sharded checkpoint, not the final state)
    for workers, reduction in ((2, "fsdp"), (1, "allreduce")):
        resumed = vf.train(job(), workers=workers, steps=6, deterministic=True, reduction=reduction, resume=run_dir,
                           run_dir=str(tmp_path / f"{workers}-{reduction}"))
        assert resumed.history[0]["step"] == 2
        assert_same_training(resumed, ref, first_step=2)


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_backward_falls_back_to_the_checkpoint_bit_identically(run_dir):
    plan = vf.FaultPlan([vf.Fault(worker=1, step=3, phase="mid_backward")])
    got = vf.train(job(), workers=3, steps=6, deterministic=True, reduction="fsdp", checkpoint_every=2,
                   fault_plan=plan, run_dir=run_dir)
    events = [line for line in open(os.path.join(run_dir, "events.jsonl")) if '"fallback_restart"' in line]
    assert events, "the loss did not fall back to the checkpoint"
    assert_same_training(got, one_worker(job(), 6), first_step=None)


@pytest.mark.timeout(240)
def test_resized_while_training_the_shards_move_and_the_bits_stay(run_dir):
    handle = vf.launch(lm_jobs.make_paced_job_checkpointed, workers=3, steps=1_000_000, deterministic=True,
                       reduction="fsdp", run_dir=run_dir)
    for n in (2, 4):
        wait_for_step(handle, handle.status()["step"] + 2)
        handle.resize(n, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2, 4]
    assert_same_training(result, one_worker(lm_jobs.make_job_checkpointed(), result.steps))  # (unpaced: the same model)
