"""Tensor parallelism x sharded checkpoints, and a checkpoint of any grid resuming on any other.

In this process, without groups: the stages of a D x P x T grid are built as the workers build them
(:class:`~virtualflow.runtime.pipeline.tensor_stage.TensorParallelStage`: the whole model's layers
converted into tensor rank t's shards, loaded from a state in the single-worker layout), every
generation rank writes its part of a sharded checkpoint as a worker does (``sharded_parts`` then
``write_rank``: tensor shards as they are, no gather), and the checkpoint is read back and resumed
on another grid (``resume_from``'s re-cut, the stages of the new grid built from it). Each
direction's loaded state - the model and the optimizer state, Adam's moments and step - is
compared bit for bit with the single-worker model and ``torch.optim.AdamW`` it came from.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import virtualflow as vf
from conftest import assert_state_equal
from virtualflow.plan.pipeline.geometry import layers_of, piece_module, resolve_bounds
from virtualflow.runtime.dcp import load_dcp_state, model_pieces, optimizer_pieces, write_rank
from virtualflow.runtime.pipeline.pieces import stage_model
from virtualflow.runtime.pipeline.tensor_grid import merge_stage_states
from virtualflow.runtime.pipeline.tensor_stage import named_stage_state, tensor_stage
from virtualflow.runtime.pipeline.worker_engine import PipelineWorkerEngine
from virtualflow.runtime.regrid import optimizer_names, restage, unstage
from virtualflow.launching.resume import _check_same_pipeline
import gpt_grid_jobs as g

CPU = torch.device("cpu")


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def job(stages: int = 1, tensor: int = 1, optimizer=_adamw) -> vf.Job:
    """The 3-D tests' GPT with AdamW over one parameter group (moments and a step per parameter)."""
    return g.grid_job(stages=stages, tensor=tensor).replace(optimizer=optimizer)


def trained_reference(optimizer=_adamw) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The single-worker model and optimizer after two steps (every state tensor is filled)."""
    j = job(optimizer=optimizer)
    torch.manual_seed(j.seed)
    model = j.model()
    opt = j.build_optimizer(model)
    x, y = g.tokens(8)[:]
    for _ in range(2):
        F.cross_entropy(model(x).reshape(-1, g.VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class _Comm:
    """What converting a layer needs of the tensor-parallel group: its size and rank, and the
    all-reduce of the same-block check (every rank converts the same block: a sum of T equal parts)."""

    def __init__(self, rank: int, size: int) -> None:
        self.group = types.SimpleNamespace(rank=rank, size=size)

    def all_reduce(self, buf: torch.Tensor) -> None:
        buf.mul_(self.group.size)


def build_grid(stages: int, tensor: int, state: dict, optimizer=_adamw) -> dict[tuple[int, int], tuple]:
    """Per (stage, tensor rank): the worker's tensor stage object and its stage, built and resumed
    from ``state`` (any grid's, re-cut by ``resume_from`` as a worker does)."""
    j = job(stages, tensor, optimizer)
    pipeline = j.pipeline
    out = {}
    for s in range(stages):
        for t in range(tensor):
            torch.manual_seed(j.seed)
            model = j.model()
            bounds = resolve_bounds(pipeline, len(layers_of(model)))
            engine = types.SimpleNamespace(job=j, model=model, full_bounds=bounds, pipeline=pipeline)
            PipelineWorkerEngine.resume_from(engine, state)
            ts = tensor_stage(pipeline, list(bounds), CPU, subgroup=None, build_optimizer=j.build_optimizer)
            ts.planes, ts.rank = types.SimpleNamespace(comm=_Comm(t, tensor), t=t), t

            def build(model=model, ts=ts, bounds=bounds, s=s):
                layers = ts.convert(layers_of(model), s)
                pieces = {k: piece_module(layers, a, b) for k, (a, b) in enumerate(bounds) if k % stages == s}
                _, module, _, optimizer, scheduler = stage_model(pieces, j.build_optimizer, None)
                return types.SimpleNamespace(model=module, optimizer=optimizer, scheduler=scheduler, loop=None,
                                             replica_of_successor=None, stage_rank=s, prev_version=None)

            out[s, t] = ts, ts.build(build, model, engine.resume_state, s)
    return out


def single_worker_layout(grid: dict[tuple[int, int], tuple], stages: int, tensor: int) -> tuple[dict, dict]:
    """The grid's model and optimizer state put back together (the shards merged by their splits),
    as the whole model's ``state_dict`` and each parameter's optimizer state by name."""
    model, by_name = {}, {}
    for s in range(stages):
        planes = [named_stage_state(grid[s, t][1]) for t in range(tensor)]
        merged = merge_stage_states(planes, grid[s, 0][0].splits) if tensor > 1 else planes[0]
        model.update(merged["model"])
        for pos, st in merged["optimizer"]["state"].items():
            by_name[merged["param_names"][pos]] = st
    return model, by_name


def assert_is_reference(model_state: dict, by_name: dict, ref_model, ref_opt) -> None:
    assert_state_equal(model_state, ref_model.state_dict())
    names = optimizer_names(ref_opt, ref_model)
    ref = ref_opt.state_dict()["state"]
    assert sorted(by_name) == sorted(names[i] for i in ref)
    for i, st in ref.items():
        assert_state_equal(by_name[names[i]], st)


def write_grid(folder: str, grid: dict[tuple[int, int], tuple], replicas: int, stages: int, tensor: int) -> None:
    """Every generation rank of a ``replicas x stages x tensor`` grid writes its part (rank
    ``r``: tensor rank ``r % T`` of stage ``(r // T) % P``), as :meth:`PipelineWorkerEngine.boundary` does."""
    size = replicas * stages * tensor
    for r in range(size):
        ts, stage = grid[(r // tensor) % stages, r % tensor]
        pieces, meta = ts.sharded_parts(stage, r, size)
        if meta is not None:
            meta.update(step=5, job={"seed": 3})
        write_rank(folder, r, size, "save", 5, pieces, meta)


def whole_pipelined(model, opt, stages: int) -> dict:
    """The reference as a gathered ``.pt`` state of ``stages`` stages (no recorded stage names)."""
    j = job(stages)
    bounds = resolve_bounds(j.pipeline, len(layers_of(model)))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": None, "step": 5}
    state = restage(state, optimizer_names(opt, model), bounds, stages)
    del state["pipeline"]["stage_params"]
    return state


def test_an_optimizer_of_several_groups_resumes_on_another_data_and_tensor_width(tmp_path):
    """nanoGPT's AdamW groups (weight decay on matrices only) cannot move between stages, but
    resume on another D and T: a (2, 1, 2) checkpoint (its one stage's state as gathered) written
    sharded and resumed on (1, 1, 4), bit for bit, each parameter's state in its group."""
    from gpt_grid_jobs import _adamw_groups

    ref_model, ref_opt = trained_reference(_adamw_groups)
    bounds = [[0, len(layers_of(ref_model))]]
    state = {"model": ref_model.state_dict(), "optimizer": {"pipeline_stages": [ref_opt.state_dict()]},
             "lr_scheduler": {"pipeline_stages": [None]}, "step": 5,
             "pipeline": {"stages": 1, "bounds": bounds, "schedule": "1f1b"}}
    grid = build_grid(1, 2, state, _adamw_groups)
    folder = str(tmp_path / "step-00000005.dcp")
    write_grid(folder, grid, 2, 1, 2)
    again = build_grid(1, 4, load_dcp_state(folder), _adamw_groups)
    assert_is_reference(*single_worker_layout(again, 1, 4), ref_model, ref_opt)
    for t in range(4):
        groups = again[0, t][1].optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert all(q.dim() >= 2 for q in groups[0]["params"]) and all(q.dim() < 2 for q in groups[1]["params"])


GRIDS = [((1, 2, 2), (2, 2, 1)), ((2, 1, 2), (1, 3, 2)), ((1, 2, 2), (1, 1, 4)), ((2, 2, 1), (1, 2, 2)),
         ((2, 2, 2), (1, 2, 2))]


@pytest.mark.parametrize("written,resumed", GRIDS, ids=["".join(map(str, a)) + "-" + "".join(map(str, b)) for a, b in GRIDS])
def test_a_tensor_parallel_sharded_checkpoint_resumes_on_another_grid_bit_for_bit(tmp_path, written, resumed):
    ref_model, ref_opt = trained_reference()
    d, p, t = written
    grid = build_grid(p, t, whole_pipelined(ref_model, ref_opt, p))
    assert_is_reference(*single_worker_layout(grid, p, t), ref_model, ref_opt)  # the grid holds the reference
    folder = str(tmp_path / "step-00000005.dcp")
    write_grid(folder, grid, d, p, t)
    state = load_dcp_state(folder)
    assert state["pipeline"]["tensor"] == t and state["pipeline"]["replicas"] == d
    assert_state_equal(state["model"], ref_model.state_dict())
    assert_state_equal(unstage(state, optimizer_names(ref_opt, ref_model))["optimizer"]["state"][0],
                       ref_opt.state_dict()["state"][0])
    d2, p2, t2 = resumed
    again = build_grid(p2, t2, state)
    assert_is_reference(*single_worker_layout(again, p2, t2), ref_model, ref_opt)


def test_a_shard_is_written_as_it_is_held_not_gathered(tmp_path):
    """Tensor rank t writes its own shards (entries ``<fqn>@tp<t>``), each a 1/D share: no
    worker writes a whole cut tensor."""
    import json

    ref_model, ref_opt = trained_reference()
    grid = build_grid(2, 2, whole_pipelined(ref_model, ref_opt, 2))
    folder = str(tmp_path / "step-00000005.dcp")
    write_grid(folder, grid, 2, 2, 2)
    entries = json.load(open(f"{folder}/manifest.json"))["entries"]
    cut = [e for e in entries if "@tp" in e["fqn"]]
    assert cut and all(int(e["file"][len("rank-"):][:5]) % 2 == int(e["fqn"].rsplit("@tp", 1)[1]) for e in cut)
    fqn = next(e["fqn"] for e in cut if e["fqn"].endswith("attn.c_attn.weight@tp1"))
    whole = ref_model.state_dict()[fqn[len("model/"):].rsplit("@tp", 1)[0]]
    assert sum(e["hi"] - e["lo"] for e in entries if e["fqn"] == fqn) == whole.numel() // 2  # the shard: half
    shares = [sum(e["hi"] - e["lo"] for e in cut if e["file"].startswith(f"rank-{r:05d}/")) for r in range(8)]
    assert shares[1] and shares[5] and abs(shares[1] - shares[5]) <= 1  # stage 0's tensor rank 1: one share a replica
    assert not any(e["fqn"] == fqn.rsplit("@tp", 1)[0] for e in entries)  # never written whole


@pytest.mark.parametrize("grid_shape", [(1, 2, 2), (2, 1, 2)])
def test_a_tensor_parallel_checkpoint_resumes_without_a_pipeline(tmp_path, grid_shape):
    """A (D, P, T) checkpoint loads into the unpipelined model and optimizer of one worker (what
    the VN engine's ``resume_from`` does), bit for bit."""
    ref_model, ref_opt = trained_reference()
    d, p, t = grid_shape
    folder = str(tmp_path / "step-00000005.dcp")
    write_grid(folder, build_grid(p, t, whole_pipelined(ref_model, ref_opt, p)), d, p, t)
    j = job()
    torch.manual_seed(0)
    model = j.model()
    opt = _adamw(model.parameters())
    state = unstage(load_dcp_state(folder), optimizer_names(opt, model))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert_state_equal(model.state_dict(), ref_model.state_dict())
    for i, st in ref_opt.state_dict()["state"].items():
        assert_state_equal(opt.state_dict()["state"][i], st)


@pytest.mark.parametrize("world", [1, 3])
def test_an_unpipelined_checkpoint_resumes_on_a_tensor_parallel_grid(tmp_path, world):
    """The other way: a sharded checkpoint of an unpipelined run (``world`` workers, each an even
    share) resumes on a (1, 2, 2) grid: each stage's shards are cut from it, bit for bit."""
    ref_model, ref_opt = trained_reference()
    folder = str(tmp_path / "step-00000005.dcp")
    model_sd = ref_model.state_dict()
    for r in range(world):
        pieces = model_pieces(model_sd, r, world)
        more, rest = optimizer_pieces(ref_opt.state_dict(), r, world)
        meta = {"model": {}, "model_keys": list(model_sd), "optimizer": rest, "lr_scheduler": None, "step": 5,
                "job": {"seed": 3}} if r == 0 else None
        write_rank(folder, r, world, "save", 5, pieces + more, meta)
    grid = build_grid(2, 2, load_dcp_state(folder))
    assert_is_reference(*single_worker_layout(grid, 2, 2), ref_model, ref_opt)


def test_an_unpipelined_pt_state_resumes_on_a_tensor_parallel_grid():
    """A single worker's ``.pt`` state (one optimizer over the whole model) on (1, 3, 2)."""
    ref_model, ref_opt = trained_reference()
    state = {"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict(), "lr_scheduler": None, "step": 5}
    grid = build_grid(3, 2, state)
    assert_is_reference(*single_worker_layout(grid, 3, 2), ref_model, ref_opt)


def test_a_pt_state_of_one_grid_resumes_on_another_by_name():
    """A ``.pt`` state (gathered: no recorded stage names) of 2 stages resumes on 3 stages with
    tensor=2, the names of each saved stage derived from its bounds."""
    ref_model, ref_opt = trained_reference()
    grid = build_grid(3, 2, whole_pipelined(ref_model, ref_opt, 2))
    assert_is_reference(*single_worker_layout(grid, 3, 2), ref_model, ref_opt)


def test_only_an_optimizer_of_several_groups_is_refused_on_another_grid():
    """At launch: another grid is accepted (re-cut by name), except for an optimizer of several
    parameter groups (which group a parameter joins is the job's choice), named with the knobs."""
    ref_model, ref_opt = trained_reference()
    state = whole_pipelined(ref_model, ref_opt, 2)
    _check_same_pipeline("ck", state, job(3, 2))
    _check_same_pipeline("ck", state, job().replace(pipeline=None))
    groups = g.grid_job(stages=2, adam=True, split=(3, 3))
    two = {**state, "optimizer": {"pipeline_stages": [{"state": {}, "param_groups": [{}, {}]}] * 2}}
    _check_same_pipeline("ck", two, groups)  # its own grid
    with pytest.raises(ValueError, match=r"several parameter groups.*--pipeline-stages 2 --split"):
        _check_same_pipeline("ck", two, g.grid_job(stages=3, adam=True))
