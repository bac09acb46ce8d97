"""3-D parallelism (D replicas x P stages x T tensor-parallel workers) end to end, in worker
processes, on a GPT of nanoGPT's shape (tests/gpt_grid_jobs.py, float64) cut by
``virtualflow.parallel.sequential_gpt``.

What "the same model" means on a grid (docs/parallel3d.md):

- ``T = 1`` layouts are bit-identical to the single-worker run in deterministic mode (the
  pipeline's promise: every micro-batch is a VN, the reduction over replicas is the VN tree).
- Tensor parallelism splits each block's matmuls over T workers (a row-parallel layer's sum over
  its input features is cut into T partial sums added by a reduce-scatter), so ``T > 1`` layouts
  agree with the single-worker run within float tolerance (measured here in float64: about 1e-16
  after 3 steps) and are **bit-identical to each other for the same T and tensor_chunks**, whatever
  D and P: every worker runs the same shapes (a micro-batch is a VN), the tensor-parallel sums run
  in the ring's fixed order for T, and the reduction over replicas is the fixed VN tree.

Few and short (each launch is a few worker processes on this 2-core machine): one run per layout
of the issue's list (with interleaved 1F1B, the sharded reduction and zero-bubble among them), one
resize 1 -> 2 -> 1 replicas, one SIGKILL of a tensor-parallel member, dropout, clipping (GPipe), a
no-flush schedule (2BW), a resume from a tensor-parallel checkpoint.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import virtualflow as vf
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.breakdown import PARTS
from virtualflow.runtime.grid_threads import Generation, train_threads
from conftest import assert_state_equal, wait_for_step
from vn_reference import deterministic_reference
import gpt_grid_jobs as g

FOREVER = 1_000_000
STEPS = 3


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _grid(stages: int, tensor: int, schedule: str = "1f1b", **pipeline):
    return lambda: g.grid_job(stages=stages, tensor=tensor, schedule=schedule, **pipeline)


T2_LAYOUTS = {  # (D, P): the pipeline knobs; every flush schedule trains the same model
    (1, 2): dict(schedule="interleaved_1f1b", chunks=2),
    (2, 1): dict(),  # with reduction="sharded"
    (2, 2): dict(schedule="zb_h1"),
}


@pytest.fixture(scope="module")
def single():
    """The single-worker, unpipelined run: the reference of every layout (in this process:
    :mod:`vn_reference`)."""
    return deterministic_reference(g.single_job(), STEPS)


@pytest.fixture(scope="module")
def t2_runs():
    """The T = 2 layouts of the issue, each once (module scope: shared by the tests below); (2, 1, 2)
    with the sharded reduction: each (stage, tensor shard)'s optimizer state sharded over the D
    replicas."""
    return {(d, p, 2): vf.train(_grid(p, 2, **knobs), workers=d * p * 2, steps=STEPS, deterministic=True,
                                reduction="sharded" if (d, p) == (2, 1) else "allreduce")
            for (d, p), knobs in T2_LAYOUTS.items()}


def test_data_and_pipeline_without_tensor_parallelism_is_bit_identical(single):
    result = vf.train(_grid(2, 1), workers=4, steps=STEPS, deterministic=True)  # (D, P, T) = (2, 2, 1)
    assert_state_equal(result.state_dict, single.state_dict)
    assert [h["loss"] for h in result.history] == [h["loss"] for h in single.history]


def test_tensor_parallel_layouts_of_one_width_are_bit_identical_to_each_other(single, t2_runs):
    runs = list(t2_runs.values())
    for other in runs[1:]:
        assert_state_equal(other.state_dict, runs[0].state_dict)
        assert [h["loss"] for h in other.history] == [h["loss"] for h in runs[0].history]
    sharded = t2_runs[(2, 1, 2)]
    # SGD momentum: one buffer per parameter; sharded over D = 2, each worker holds about half of its
    # tensor shard's (the (1, 2, 2) run's workers hold a stage each: the two stages' sum is a whole shard)
    whole_shard = sum(t2_runs[(1, 2, 2)].optimizer_bytes.values())
    assert max(sharded.optimizer_bytes.values()) < 0.6 * whole_shard
    for layout, result in t2_runs.items():
        assert result.history[-1]["workers"] == layout[0] * layout[1] * layout[2]
        # the single-worker model, within float64 tolerance (the row-parallel sums' order differs)
        assert _max_diff(result.state_dict, single.state_dict) < 1e-12, layout
        assert [h["loss"] for h in result.history] == pytest.approx([h["loss"] for h in single.history],
                                                                    rel=1e-12, abs=0)


def test_four_way_tensor_parallelism_is_the_single_worker_model_within_tolerance(single):
    result = vf.train(_grid(1, 4), workers=4, steps=STEPS, deterministic=True)  # (1, 1, 4)
    assert _max_diff(result.state_dict, single.state_dict) < 1e-12
    # every parameter was trained: the merged shards moved from the initial weights
    init = g.gpt_model().state_dict()
    moved = [k for k in init if not torch.equal(init[k], result.state_dict[k])]
    assert len(moved) == len(init)


def test_resize_data_parallel_replicas_of_a_tensor_parallel_stage(run_dir):
    """(D, 1, 2): grow 1 -> 2 replicas and back mid-run (whole 2-worker replicas join and leave)."""
    handle = vf.launch(lambda: g.grid_job(tensor=2, slow=True, dropout=0.1), workers=2, steps=FOREVER,
                       deterministic=True, run_dir=run_dir)
    for n in (4, 2):
        wait_for_step(handle, handle.status()["step"] + 2)
        handle.resize(n, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 4, 2]
    ref = vf.train(lambda: g.grid_job(tensor=2, dropout=0.1), workers=2, steps=result.steps, deterministic=True)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert [h["step"] for h in result.history] == list(range(result.steps))


def test_a_killed_tensor_parallel_member_leaves_the_other_replica_bit_identical(run_dir):
    """(2, 1, 2): SIGKILL of rank 3 (tensor rank 1 of replica 1's stage): replica 1's other member
    leaves, replica 0 redoes the interrupted step and goes on; the model is the undisturbed one."""
    handle = vf.launch(lambda: g.grid_job(tensor=2, slow=True, dropout=0.1), workers=4, steps=FOREVER,
                       deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 2)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [4, 2]
    assert [f["worker"] for f in result.failures] == [victim["id"]]
    ref = vf.train(lambda: g.grid_job(tensor=2, dropout=0.1), workers=2, steps=result.steps, deterministic=True)
    assert_state_equal(result.state_dict, ref.state_dict)
    assert [h["step"] for h in result.history] == list(range(result.steps))


def test_dropout_masks_do_not_depend_on_the_tensor_parallel_width(single):
    """With dropout, a tensor-parallel block draws its masks by virtualflow's rule (seeded from the
    micro-batch's random stream, per token block and global head), not from torch's dropout: the
    masks are the same for every T, so T = 2 and T = 4 agree within float tolerance. (The resize
    and SIGKILL tests above run with dropout: bit-identical across D.)"""
    runs = [vf.train(lambda t=t: g.grid_job(tensor=t, dropout=0.1), workers=t, steps=STEPS, deterministic=True)
            for t in (2, 4)]
    assert _max_diff(runs[0].state_dict, runs[1].state_dict) < 1e-12
    assert _max_diff(runs[0].state_dict, single.state_dict) > 1e-6  # the masks did act (single: no dropout)


def test_clipping_sums_the_shards_norms_over_the_tensor_parallel_group(run_dir):
    """max_grad_norm on a (1, 2, 2) grid (GPipe): the norm's blocks are each parameter's (each
    shard's, summed over the stage's tensor group), so the norm and the clipped update are the
    (1, 1, 2) run's bit for bit, and the single worker's within float64 rounding (the model is
    float64, so is the norm: docs/training.md)."""
    kw = dict(max_grad_norm=0.05)
    a = deterministic_reference(g.single_job().replace(**kw), STEPS)
    b = vf.train(lambda: g.grid_job(stages=2, tensor=2, schedule="gpipe").replace(**kw), workers=4, steps=STEPS,
                 deterministic=True, run_dir=run_dir)
    c = vf.train(lambda: g.grid_job(tensor=2, schedule="gpipe").replace(**kw), workers=2, steps=STEPS,
                 deterministic=True)
    norms = [h["grad_norm"] for h in b.history]
    assert norms == [h["grad_norm"] for h in c.history] and min(norms) > 0.05
    assert all(n != float(torch.tensor(n).float()) for n in norms)  # float64 norms, not float32 roundings
    assert_state_equal(b.state_dict, c.state_dict)
    assert norms == pytest.approx([h["grad_norm"] for h in a.history], rel=1e-13)
    assert _max_diff(a.state_dict, b.state_dict) < 1e-12
    # the step breakdown of a grid: one row per stage, from its tensor rank 0 (generation ranks 0 and 2),
    # each adding up to its step
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        members = next(e["members"] for e in map(json.loads, f) if e["event"] == "generation")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for e in map(json.loads, f) if e.get("breakdown") for r in e["breakdown"]]
    assert rows and {r["worker"] for r in rows} == {members[0], members[2]}
    for r in rows:
        assert r["forward_s"] > 0 and sum(r[k] for k in PARTS) == pytest.approx(r["step_s"], rel=1e-6, abs=1e-9)


def test_a_checkpoint_holds_the_whole_model_and_resumes_on_any_grid(tmp_path):
    """A (1, 1, 2) run's checkpoint (Adam: moments sharded like their parameters) holds the merged,
    single-worker layout: resumed on the same grid it continues bit for bit; resumed without tensor
    parallelism it continues within float tolerance."""
    job = lambda: g.grid_job(tensor=2, adam=True)  # noqa: E731
    # The uninterrupted (1, 1, 2) run: its 2 workers as threads of this process (the engines a
    # worker process builds, over real gloo groups; the grid job draws no dropout).
    straight = train_threads(job(), [Generation(members=(0, 1), steps=4)],
                             options=WorkerOptions(deterministic=True, breakdown=False)).state["model"]
    vf.train(job, workers=2, steps=2, deterministic=True, run_dir=str(tmp_path / "a"), checkpoint_every=1)
    again = vf.train(job, workers=2, steps=4, deterministic=True, resume=str(tmp_path / "a"),
                     run_dir=str(tmp_path / "b"))
    assert_state_equal(again.state_dict, straight)
    plain = vf.train(lambda: g.grid_job(adam=True), workers=1, steps=4, deterministic=True,
                     resume=str(tmp_path / "a"), run_dir=str(tmp_path / "c"))
    assert _max_diff(plain.state_dict, straight) < 1e-12
    assert len(again.optimizer_state_dict["pipeline_stages"]) == 1


def test_a_no_flush_schedule_runs_on_the_grid():
    """PipeDream-2BW (windows of 2 steps, updates from the previous weight version) on (1, 2, 2):
    the same law as on (1, 2, 1), within float tolerance."""
    a = vf.train(_grid(2, 1, "2bw", window=2), workers=2, steps=4, deterministic=True)
    b = vf.train(_grid(2, 2, "2bw", window=2), workers=4, steps=4, deterministic=True)
    assert _max_diff(a.state_dict, b.state_dict) < 1e-12
    assert [h["loss"] for h in b.history] == pytest.approx([h["loss"] for h in a.history], rel=1e-12, abs=0)


def test_a_sharded_tensor_parallel_checkpoint_resumes_on_one_worker_and_on_another_grid(tmp_path):
    """A (1, 2, 2) run writes sharded checkpoints in the background (each tensor rank its shards,
    no gather). Its step-2 checkpoint resumed on (2, 1, 2) (other D and P, re-cut by name; the same
    T) continues bit for bit as the run that never stopped; resumed on one unpipelined worker
    (T = 1), within float tolerance (the row-parallel sums are no longer cut in T pieces)."""
    straight = vf.train(_grid(2, 2), workers=4, steps=3, deterministic=True, run_dir=str(tmp_path / "a"),
                        checkpoint_every=2, checkpoint_format="dcp", async_checkpoint=True)
    ck = str(tmp_path / "a" / "checkpoints" / "step-00000002.dcp")
    grid = vf.train(_grid(1, 2), workers=4, steps=3, deterministic=True, resume=ck, run_dir=str(tmp_path / "b"))
    assert grid.history[0]["step"] == 2
    assert_state_equal(grid.state_dict, straight.state_dict)
    plain = vf.train(g.single_job, workers=1, steps=3, deterministic=True, resume=ck, run_dir=str(tmp_path / "c"))
    assert plain.history[0]["step"] == 2
    assert _max_diff(plain.state_dict, straight.state_dict) < 1e-12


def test_bf16_with_compile_is_bit_identical_across_layouts_of_one_width():
    """bf16-mixed with compile on (1, 1, 2) against eager bf16-mixed on (1, 2, 2) (float32 model:
    autocast leaves float64 alone): bit for bit. The layouts run the same shapes and ring order
    (docs/parallel3d.md); compiling (dynamo captures everything but the blocks' collectives; the
    aot_eager backend runs the captured ATen ops one by one: no C++ build in a 60 s test) changes
    no bit; the same run with inductor is tests/unit/test_tp_precision.py's business."""
    def job(stages, **kw):
        return lambda: g.grid_job(stages=stages, tensor=2, float32=True).replace(precision="bf16-mixed", **kw)

    compiled = vf.train(job(1, compile={"backend": "aot_eager"}), workers=2, steps=2, deterministic=True)
    eager = vf.train(job(2), workers=4, steps=2, deterministic=True)
    assert_state_equal(compiled.state_dict, eager.state_dict)
    assert [h["loss"] for h in compiled.history] == [h["loss"] for h in eager.history]
    init = g.gpt_model(float32=True).state_dict()
    assert all(not torch.equal(init[k], eager.state_dict[k]) for k in init)  # every weight trained
