"""3-D parallelism's configuration and state plumbing, without processes: the ``Pipeline.tensor``
knob and its refusals, the worker-count rule, and the merge / shard / re-ordering of a
tensor-parallel stage's state (runtime/pipeline/tensor_grid.py) against plain tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.plan.pipeline.geometry import check_workers
from virtualflow.runtime.pipeline.tensor_grid import merge_stage_states, shard_stage_state
from virtualflow.runtime.pipeline.stage_state import optimizer_names, reorder_optimizer

import gpt_grid_jobs as g


def test_the_tensor_knob_is_checked_with_its_rule():
    with pytest.raises(ValueError, match=r"Pipeline.tensor=0 must be a positive int"):
        vf.Pipeline(stages=2, tensor=0)
    with pytest.raises(ValueError, match=r"tensor_chunks=2 .* needs tensor > 1"):
        vf.Pipeline(stages=2, tensor_chunks=2)
    assert vf.Pipeline(stages=3, tensor=2).replica_workers == 6


def test_workers_must_be_whole_replicas_of_stages_times_tensor():
    p = vf.Pipeline(stages=2, tensor=2)
    assert check_workers(p, 8) == 2
    with pytest.raises(ValueError, match=r"workers=6 is not a multiple of Pipeline.stages x tensor = 2 x 2 = 4.*"
                                         r"use workers=4 or 8"):
        check_workers(p, 6)


@pytest.mark.parametrize("change", [dict(compile=True), dict(precision="bf16-mixed"), dict(precision="16-mixed"),
                                    dict(precision="bf16-mixed", compile={"backend": "aot_eager"})])
def test_tensor_parallel_stages_take_mixed_precision_and_compile(change):
    """Once refused (the blocks did not follow autocast; compile could not capture them): the launch
    check passes them now; the runs are tests/unit/test_tp_precision.py (blocks, compile counters)
    and tests/e2e/test_parallel3d.py (bf16 + compile on two layouts, bit-identical)."""
    from virtualflow.launching.pipeline import check_tensor_parallel

    job = g.grid_job(stages=1, tensor=2).replace(**change)
    check_tensor_parallel(job.pipeline, list(job.model()))


def test_models_without_blocks_are_refused():
    plain = vf.Job(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), optimizer=lambda p: torch.optim.SGD(p, 0.1),
                   dataset=lambda: torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2)),
                   output_loss=lambda out, b: nn.functional.mse_loss(out, b[1]), global_batch_size=8,
                   virtual_nodes=2, pipeline=vf.Pipeline(stages=1, tensor=2))
    with pytest.raises(ValueError, match=r"no layer of this model has a block virtualflow knows how to split"):
        vf.train(plain, workers=2, steps=1)


def test_the_command_line_knob_alone_makes_one_tensor_parallel_stage():
    from virtualflow.config.pipeline import pipeline_of

    p = pipeline_of(g.single_job(), vf.LaunchOptions(tensor_parallel=4, steps=1))
    assert (p.stages, p.tensor) == (1, 4)
    p = pipeline_of(g.grid_job(stages=2), vf.LaunchOptions(tensor_parallel=2, steps=1))
    assert (p.stages, p.tensor) == (2, 2)


def test_the_in_process_driver_trains_tensor_parallel_stages_as_the_single_worker_model():
    """train_local with T = 2 (a thread per worker; it was refused): the (2, 2, 2) grid in float64
    is the unpipelined single-worker run within float rounding (the row-parallel sums are cut in
    two), its losses too, and every worker's engine is handed back."""
    from virtualflow.backends.inprocess import train_local
    import pipeline_models as pm

    job = g.grid_job(stages=2, tensor=2)
    engines: list = []
    state, history = train_local(job, 2, replicas=2, deterministic=True, engines_out=engines)
    ref, ref_losses = pm.unpipelined(job, 2, True)
    assert len(engines) == 8 and state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=0, atol=1e-12)
    assert [h.loss for h in history] == pytest.approx(ref_losses, rel=1e-12)


class _Rows:
    """A split along dim 0 (what a column-parallel weight uses)."""

    def shard(self, full, rank, size):
        return full.chunk(size)[rank].clone()

    def merge(self, parts):
        return torch.cat(parts)


def test_merge_and_shard_of_a_stage_state_are_inverse_and_follow_the_optimizer():
    torch.manual_seed(0)
    stage = nn.Sequential()
    stage.add_module("3", nn.Linear(4, 6))
    opt = torch.optim.Adam(stage.parameters(), lr=0.1)
    stage(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    names = optimizer_names(opt, stage)
    assert names == ["3.weight", "3.bias"]
    full = {"model": {k: v.clone() for k, v in stage.state_dict().items()}, "optimizer": opt.state_dict(),
            "lr_scheduler": None, "param_names": names}
    splits = {"3.weight": _Rows(), "3.bias": _Rows()}
    planes = [shard_stage_state(full, names, splits, t, 2) for t in range(2)]
    assert planes[1]["model"]["3.weight"].shape == (3, 4)
    assert torch.equal(planes[1]["optimizer"]["state"][0]["exp_avg"], full["optimizer"]["state"][0]["exp_avg"][3:])
    assert torch.equal(planes[0]["optimizer"]["state"][0]["step"], full["optimizer"]["state"][0]["step"])  # a scalar
    merged = merge_stage_states(planes, splits)
    for k, v in full["model"].items():
        assert torch.equal(merged["model"][k], v)
    for i, entry in full["optimizer"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(merged["optimizer"]["state"][i][k], v)


def test_optimizer_state_is_reindexed_by_name_between_parameter_orders():
    opt = {"state": {0: {"m": torch.tensor([0.0])}, 1: {"m": torch.tensor([1.0])}, 2: {"m": torch.tensor([2.0])}},
           "param_groups": [{"lr": 0.1, "params": [0, 2]}, {"lr": 0.2, "params": [1]}]}
    out = reorder_optimizer(opt, ["a", "b", "c"], ["c", "a", "b"])
    assert {k: v["m"].item() for k, v in out["state"].items()} == {1: 0.0, 2: 1.0, 0: 2.0}
    assert [grp["params"] for grp in out["param_groups"]] == [[1, 0], [2]]
    with pytest.raises(RuntimeError, match="optimizer parameters differ"):
        reorder_optimizer(opt, ["a", "b", "c"], ["a", "b", "d"])
