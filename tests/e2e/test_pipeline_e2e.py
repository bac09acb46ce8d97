"""Pipelined jobs in worker processes (gloo point to point), end to end. Few and short: the
executor's semantics are proven in-process (tests/test_pipeline_engine.py); these prove that
the process driver, the per-stage groups, the state gathering and the resize path keep them.

- A 2-stage x 2-replica run (BatchNorm, dropout, LR scheduler) is bit-identical to the
  unpipelined deterministic run of the same job on one worker.
- A run resized 1 -> 2 -> 1 pipeline replicas mid-way ends bit-identical to an undisturbed run.
- Bad input is refused before any worker starts.
- A weight tied across workers: default mode within float tolerance, deterministic mode
  bit-identical (the copies' per-VN gradients meet before the tree).
- The training loop's knobs (16-mixed with skipped steps, clipping, checkpointing, a loss metric)
  through a resize: bit-identical to the in-process run, with the same skips, scales and norms.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import virtualflow as vf
from conftest import assert_state_equal, wait_for_step
from vn_reference import Reference, deterministic_reference
import jobs

FOREVER = 1_000_000


def resized_run(factory, run_dir: str, sizes=(4, 2)) -> vf.Result:
    """Start on 2 workers, resize through ``sizes`` a few steps apart, stop; the result."""
    handle = vf.launch(factory, workers=2, steps=FOREVER, deterministic=True, run_dir=run_dir)
    for n in sizes:
        wait_for_step(handle, handle.status()["step"] + 3)
        handle.resize(n, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 2)
    return handle.stop()


def size_changes(result: vf.Result) -> list[int]:
    """The run's worker counts, each run of equal counts once."""
    sizes = [h["workers"] for h in result.history]
    return [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n]


def _events(run_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


def unpipelined(steps: int) -> Reference:
    """The unpipelined deterministic run of the job, in this process (:mod:`vn_reference`)."""
    return deterministic_reference(jobs.pipelined_job(), steps)


def test_two_stages_two_replicas_bit_identical_to_unpipelined(run_dir):
    # the stages' reductions over the replicas with the first algorithm (the default, "owners",
    # runs in the other deterministic tests here)
    result = vf.train(jobs.pipelined_job, workers=4, steps=5, deterministic=True, run_dir=run_dir,
                      deterministic_exchange="slots")
    ref = vf.train(jobs.pipelined_job().replace(pipeline=None), workers=1, steps=5, deterministic=True)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert [e["algorithm"] for e in _events(run_dir, "exchange")] == ["slots"]
    assert [h["loss"] for h in result.history] == [h["loss"] for h in ref.history]
    assert result.history[-1]["workers"] == 4
    # evaluation runs on the whole model, gathered from the stages (every 2 steps and at the end)
    assert [e["step"] for e in result.eval_history] == [2, 4, 5]
    assert result.eval_history == ref.eval_history and 0 < result.metrics["accuracy"] <= 1
    # final.pt holds the whole model and every stage's optimizer state
    assert len(result.optimizer_state_dict["pipeline_stages"]) == 2


def test_resize_one_two_one_replicas_bit_identical(run_dir):
    result = resized_run(jobs.pipelined_slow_job, run_dir)
    assert size_changes(result) == [2, 4, 2]
    ref = unpipelined(result.steps)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert [h["step"] for h in result.history] == list(range(result.steps))


@pytest.mark.parametrize("bad, message", [
    (dict(workers=3), "not a multiple of Pipeline.stages=2"),
    (dict(workers=9, pipeline_stages=9), "has 8 layers but the pipeline needs 9"),
    (dict(workers=2, schedule="2bw"), "BatchNorm"),
    (dict(workers=2, virtual_nodes=5), "not divisible by virtual_nodes=5"),
    (dict(workers=2, schedule="interleaved_1f1b", chunks=2, virtual_nodes=3, global_batch_size=24),
     "m=3 micro-batches is not a multiple of p=2"),
])
def test_bad_pipelines_are_refused_before_any_worker_starts(bad, message):
    with pytest.raises(ValueError, match=message):
        vf.train(jobs.pipelined_job, steps=1, **bad)


def test_resize_to_a_partial_pipeline_is_refused():
    from virtualflow.control.membership import check_resize

    with pytest.raises(ValueError, match="whole pipeline replicas: resize to 2 or 4"):
        check_resize(3, virtual_nodes=8, min_workers=1, stages=2)
    check_resize(16, virtual_nodes=8, min_workers=1, stages=2)  # 8 replicas of 2 stages: allowed
    with pytest.raises(ValueError, match="9 pipeline replicas"):
        check_resize(18, virtual_nodes=8, min_workers=1, stages=2)


def test_output_loss_is_required_for_a_pipeline():
    job = jobs.pipelined_job()
    with pytest.raises(ValueError, match="needs Job.output_loss"):
        job.replace(output_loss=None, loss=lambda m, b: m(b[0]).sum())
    with pytest.raises(ValueError, match="output_loss"):
        vf.train(job.replace(pipeline=None, output_loss=None, loss=lambda m, b: torch.nn.functional.cross_entropy(
            m(b[0]), b[1])), workers=2, steps=1, pipeline_stages=2)


def test_killed_worker_leaves_the_whole_replicas_training_bit_identical(run_dir):
    """SIGKILL of rank 0 (stage 0 of replica 0): its replica's other worker leaves, the other
    replica goes on (its workers keep their stages), and the model is the undisturbed one."""
    handle = vf.launch(jobs.pipelined_slow_job, workers=4, steps=FOREVER, deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 3)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 0)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    assert size_changes(result) == [4, 2]
    assert [f["worker"] for f in result.failures] == [victim["id"]]
    assert_state_equal(result.state_dict, unpipelined(result.steps).state_dict)
    assert [h["step"] for h in result.history] == list(range(result.steps))


@pytest.mark.parametrize("phase", ["send_recv", "mid_backward", "during_reduction", "after_reduction"])
def test_a_crash_in_any_phase_of_a_pipelined_step_leaves_the_other_replica_bit_identical(phase, run_dir):
    """Fault injection inside a pipelined step (2 stages x 2 replicas; worker 2 = stage 0 of
    replica 1 SIGKILLs itself at step 3): the other replica goes on, the interrupted step is
    redone (or was committed everywhere), no step is lost or doubled, and the model is the
    undisturbed one."""
    plan = vf.FaultPlan([vf.Fault(worker=2, step=3, phase=phase)])
    result = vf.train(jobs.pipelined_job, workers=4, steps=7, deterministic=True, fault_plan=plan, run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [2]
    assert size_changes(result) == [4, 2]
    assert_state_equal(result.state_dict, unpipelined(result.steps).state_dict)
    assert [h["step"] for h in result.history] == list(range(7))


def test_a_commit_that_reached_only_some_members_is_finished_from_their_stats(run_dir):
    """Step 3's commit all-reduce completes on worker 0 (it applies the step) but not on worker 1
    (a ``lose`` fault), and worker 3 dies after it: stage 1's only survivor missed the step its
    stage-0 partner applied. It finishes the step from worker 0's stats (its gradients were
    reduced already): every stage at step 4, nothing redone, the undisturbed model."""
    plan = vf.FaultPlan([vf.Fault(worker=3, step=3, phase="after_reduction"),
                         vf.Fault(worker=1, step=3, phase="after_reduction", action="lose")])
    result = vf.train(jobs.pipelined_job, workers=4, steps=7, deterministic=True, fault_plan=plan, run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [3]
    assert size_changes(result) == [4, 2]
    assert [h["step"] for h in result.history] == list(range(7))
    assert_state_equal(result.state_dict, unpipelined(result.steps).state_dict)


def test_2bw_resize_keeps_the_weight_versions_bit_identical(run_dir):
    """PipeDream-2BW across a grow and a shrink: the newcomers receive the older weight version
    too, resizes land at window ends, and the run equals the undisturbed in-process run."""
    from virtualflow.backends.inprocess import train_local

    result = resized_run(jobs.pipelined_2bw_job, run_dir)
    assert size_changes(result) == [2, 4, 2]
    sizes = [h["workers"] for h in result.history]
    assert all(result.history[i]["step"] % 2 == 0 for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1])
    state, history = train_local(jobs.pipelined_2bw_job(), result.steps, deterministic=True)
    assert_state_equal(result.state_dict, state)
    assert [h["loss"] for h in result.history] == [r.loss for r in history]


def _tied_model():
    from torch import nn

    first, last = nn.Linear(10, 10), nn.Linear(10, 10)
    last.weight = first.weight  # one weight read by the first and the last layer
    return nn.Sequential(first, nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), last)


def test_a_weight_tied_across_workers_trains_like_the_unpipelined_model(run_dir):
    """Default mode: each worker holds a copy of the shared weight; their gradients are summed
    before every update, so the copies stay equal and the model is the unpipelined one."""
    from virtualflow.backends.inprocess import train_local
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.grid_threads import Generation, train_threads

    job = jobs.pipelined_job().replace(model=_tied_model, evaluate=None)
    # vf.train(job.replace(pipeline=None), workers=1, steps=4): the worker's engine, in this process
    ref = train_threads(job.replace(pipeline=None), [Generation(members=(0,), steps=4)],
                        options=WorkerOptions(deterministic=False, breakdown=False)).state["model"]
    for replicas in (1, 2):
        state, _ = train_local(job, 4, replicas=replicas)
        torch.testing.assert_close(state["4.weight"], state["0.weight"], rtol=0, atol=0)  # the copies agree
        for k in ref:
            torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)
    result = vf.train(job, workers=4, steps=4, run_dir=run_dir)
    for k in ref:
        torch.testing.assert_close(result.state_dict[k], ref[k], rtol=1e-5, atol=1e-6)


def test_a_weight_tied_across_workers_deterministic_bit_identical(run_dir):
    """Deterministic mode, 2 stages x 2 replicas in processes: the last stage sends its copy's
    per-VN gradients to the first (gloo point to point), which sums each VN's two uses before the
    tree and sends the total back: bit-identical to the unpipelined deterministic run. The stages'
    reductions over the replicas run the ``owners`` exchange (the automatic choice)."""
    import pipeline_models

    job = jobs.pipelined_job().replace(model=_tied_model, evaluate=None)
    ref_state, ref_losses = pipeline_models.unpipelined(job, 4, True)  # the VN engine in this process
    result = vf.train(job, workers=4, steps=4, deterministic=True, run_dir=run_dir)
    assert_state_equal(result.state_dict, ref_state)
    assert [h["loss"] for h in result.history] == ref_losses
    chosen = _events(run_dir, "exchange")  # rank 0 reports its stage's choice
    assert chosen and all(e["algorithm"] == "owners" and e["reason"].startswith("stage 0: ") for e in chosen)


def test_a_weight_tied_across_workers_is_refused_where_it_cannot_be_exact():
    import dataclasses

    from virtualflow.launching.pipeline import plan_pipeline

    job = jobs.pipelined_job().replace(model=_tied_model, evaluate=None)
    plan_pipeline(job, job.build_dataset(), 2, deterministic=True)  # two uses: exact (test above)

    def three_uses():
        from torch import nn

        first, mid, last = nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10)
        mid.weight = last.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), mid, nn.Tanh(), last)

    three = job.replace(model=three_uses)
    with pytest.raises(ValueError, match=r"read by 3 layers in different pipeline pieces \(0.weight, 2.weight, "
                                         r"4.weight\).*deterministic=False"):
        plan_pipeline(three, three.build_dataset(), 2, deterministic=True)
    no_flush = job.replace(pipeline=dataclasses.replace(job.pipeline, schedule="async"))
    with pytest.raises(ValueError, match="the async schedule"):
        plan_pipeline(no_flush, no_flush.build_dataset(), 2)
    # both uses on one worker (interleaved pieces 0 and 2 of 2 workers): nothing shared, exact
    def tied_near():
        from torch import nn

        first, third = nn.Linear(10, 10), nn.Linear(10, 10)
        third.weight = first.weight
        return nn.Sequential(first, nn.ReLU(), third, nn.Linear(10, 10))

    one = job.replace(model=tied_near, pipeline=dataclasses.replace(job.pipeline, schedule="interleaved_1f1b",
                                                                    chunks=2, split=(1, 1, 1, 1)))
    assert plan_pipeline(one, one.build_dataset(), 2, deterministic=True).split == (1, 1, 1, 1)


def test_activation_shapes_changing_between_micro_batches_cross_processes_exactly(run_dir):
    """Sequence lengths differ per virtual node: the driver's new-link, same-shape and
    changed-shape messages all occur, and the run equals the in-process one."""
    from virtualflow.backends.inprocess import train_local

    result = vf.train(jobs.ragged_pipelined_job, workers=3, steps=4, deterministic=True, run_dir=run_dir)
    state, history = train_local(jobs.ragged_pipelined_job(), 4, deterministic=True)
    assert_state_equal(result.state_dict, state)
    assert [h["loss"] for h in result.history] == [r.loss for r in history]


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """A pipelined run stopped after checkpointing resumes to the state an undisturbed run
    reaches: on the same stages and split, on other stages (its ``.pt`` optimizer state re-cut
    by parameter name), and without a pipeline."""
    first = str(tmp_path / "first")
    vf.train(jobs.pipelined_job, workers=4, steps=4, deterministic=True, run_dir=first, checkpoint_every=2)
    result = vf.train(jobs.pipelined_job, workers=2, steps=7, deterministic=True, resume=first)
    assert [h["step"] for h in result.history][-3:] == [4, 5, 6]
    assert_state_equal(result.state_dict, unpipelined(7).state_dict)
    at2 = os.path.join(first, "checkpoints", "step-00000002.pt")  # (first now holds the resumed run's final.pt)
    four = vf.train(jobs.pipelined_job, workers=4, steps=7, deterministic=True, pipeline_stages=4, resume=at2)
    assert_state_equal(four.state_dict, result.state_dict)
    plain = vf.train(jobs.pipelined_job().replace(pipeline=None), workers=1, steps=7, deterministic=True, resume=at2)
    assert_state_equal(plain.state_dict, result.state_dict)


def test_a_lost_worker_is_replaced_by_a_whole_pipeline_with_replace_failed(run_dir):
    """replace_failed on a 2x2 pipelined run: a SIGKILL costs a replica (2 workers), two
    replacements start and the job grows back to 4 workers, bit-identical to an undisturbed run."""
    handle = vf.launch(jobs.pipelined_slow_job, workers=4, steps=FOREVER, deterministic=True, run_dir=run_dir,
                       replace_failed=True)
    wait_for_step(handle, 3)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (handle.status()["step"] > 0 and len([w for w in handle.status()["workers"] if w["rank"] is not None]) == 4
               and handle.status().get("generation", 0) >= 2):
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.05)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    assert size_changes(result) == [4, 2, 4]
    assert_state_equal(result.state_dict, unpipelined(result.steps).state_dict)


def test_loop_knobs_survive_a_resize_bit_identically(run_dir):
    """16-mixed (the loss scale overflows at first), max_grad_norm, activation checkpointing and a
    metric from output_loss, resized 2 -> 4 -> 2 workers mid-way (the scaler's state moves with a
    stage's): the same model, skips, scales, norms and metrics as the undisturbed in-process run."""
    from virtualflow.backends.inprocess import train_local

    result = resized_run(jobs.pipelined_loop_job, run_dir, sizes=(4, 2))
    assert size_changes(result) == [2, 4, 2]
    state, history = train_local(jobs.pipelined_loop_job(), result.steps, deterministic=True)
    assert_state_equal(result.state_dict, state)
    assert any(h.skipped for h in history) and not all(h.skipped for h in history)
    for h, r in zip(result.history, history):
        assert (h["loss"], h["skipped"], h["loss_scale"]) == (r.loss, r.skipped, r.loss_scale)
        if not r.skipped:  # (a skipped step's norm is inf or nan)
            assert h["grad_norm"] == r.grad_norm
        assert h["metrics"] == pytest.approx(r.metrics, rel=1e-12)
