"""Sharded checkpoints (``checkpoint_format="dcp"``, :mod:`virtualflow.runtime.dcp`), in-process:
round trips, resharding of the sharded optimizer's chunks between 1, 2 and 3 simulated workers
and to and from the all-reduce layout, the asynchronous saver, export, and hostile folders."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading

import pytest
import torch
from torch import nn

from virtualflow.cli.export import export_model
from virtualflow.launching.resume import find_resume_state
from virtualflow.plan.shards import shard_bounds
from virtualflow.runtime.checkpoint import CorruptCheckpointError, UntrustedStateError
from virtualflow.runtime.dcp import (
    DcpSaver,
    load_dcp_state,
    load_ranges,
    model_pieces,
    optimizer_pieces,
    read_manifest,
    sharded_optimizer_pieces,
    write_rank,
)
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.BatchNorm1d(9), nn.ReLU(), nn.Linear(9, 3))


def trained(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
    return model, opt


def meta_of(model: nn.Module, rest: dict, step: int) -> dict:
    return {"model": {}, "model_keys": list(model.state_dict()), "optimizer": rest, "lr_scheduler": None,
            "step": step, "job": {"name": "t", "global_batch_size": 8, "virtual_nodes": 4, "seed": 0}}


def save_allreduce(folder: str, step: int, model: nn.Module, opt: torch.optim.Optimizer, world: int,
                   ranks: list[int] | None = None, recorded=None) -> str:
    """The checkpoint of ``step`` as ``world`` all-reduce workers write it (only ``ranks``: a crash;
    ``recorded``: the run's records' reach, as the worker asks the coordinator's store)."""
    final = os.path.join(folder, f"step-{step:08d}.dcp")
    for r in range(world) if ranks is None else ranks:
        pieces, rest = optimizer_pieces(opt.state_dict(), r, world)
        write_rank(final, r, world, f"id/s{step}", step, model_pieces(model.state_dict(), r, world) + pieces,
                   meta_of(model, rest, step) if r == 0 else None, keep=2, recorded=recorded)
    return final


def sharded_workers(model: nn.Module, opt: torch.optim.Optimizer, world: int) -> list[ShardedOptimizer]:
    """``world`` simulated workers of the sharded reduction, each holding its chunk of ``opt``'s state."""
    out = []
    for r in range(world):
        m = copy.deepcopy(model)
        o = torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True)
        params = [p for p in m.parameters() if p.requires_grad]
        shard = ShardedOptimizer(o, FlatParams(params))
        shard.load_state(opt.state_dict())
        shard.shard(r, world)
        out.append(shard)
    return out


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_state_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("world", [1, 2, 3])
def test_round_trip_whatever_the_number_of_writers(tmp_path, world):
    model, opt = trained()
    final = save_allreduce(str(tmp_path), 7, model, opt, world)
    state = load_dcp_state(final)
    assert state["step"] == 7
    assert_state_equal(state["model"], model.state_dict())
    assert list(state["model"]) == list(model.state_dict())
    assert_state_equal(state["optimizer"]["state"], opt.state_dict()["state"])
    assert state["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    names = sorted(os.listdir(final))
    assert names == [".metadata", "manifest.json"] + [f"rank-{r:05d}" for r in range(world)]
    # every worker wrote a share of the model, not rank 0 alone
    manifest = read_manifest(final)
    writers = {e["file"].split("/")[0] for e in manifest["entries"] if e["fqn"].startswith("model/")}
    assert len(writers) == world


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (1, 2), (2, 2)])
def test_sharded_chunks_reshard_to_another_worker_count_and_to_allreduce(tmp_path, old, new):
    model, opt = trained()
    whole = opt.state_dict()
    final = os.path.join(tmp_path, "step-00000004.dcp")
    for r, shard in enumerate(sharded_workers(model, opt, old)):
        rest = {"param_groups": shard.user.state_dict()["param_groups"], "state": {}}
        write_rank(final, r, old, "s", 4, model_pieces(model.state_dict(), r, old) + sharded_optimizer_pieces(shard),
                   meta_of(model, rest, 4) if r == 0 else None)
    # all-reduce: the whole state, reassembled from the chunks
    state = load_dcp_state(final)
    assert_state_equal(state["optimizer"]["state"], whole["state"])
    plain = torch.optim.AdamW(net().parameters(), lr=0.01, amsgrad=True)
    plain.load_state_dict(state["optimizer"])
    # sharded on `new` workers: each reads only its chunk's ranges, equal to what sharding the whole gives
    manifest = read_manifest(final)
    for r, expect in enumerate(sharded_workers(model, opt, new)):
        pos_of = {i: pos for pos, i in enumerate(expect.order)}
        ranges = {}
        for i, (a, view) in expect.pieces.items():
            o = expect.flat.offsets[i]
            for key in expect.local.state[view]:
                if key != "step":
                    ranges[f"optimizer/state/{pos_of[i]}/{key}"] = (a - o, a - o + view.numel())
        got = load_ranges(final, manifest, ranges)
        for i, (a, view) in expect.pieces.items():
            for key, v in expect.local.state[view].items():
                if key != "step":
                    assert torch.equal(got[f"optimizer/state/{pos_of[i]}/{key}"], v)


def test_allreduce_checkpoint_loads_into_the_sharded_optimizer(tmp_path):
    model, opt = trained()
    final = save_allreduce(str(tmp_path), 3, model, opt, 2)
    state = load_dcp_state(final)
    m = net()
    o = torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True)
    shard = ShardedOptimizer(o, FlatParams(list(m.parameters())))
    shard.load_state(state["optimizer"])
    shard.shard(1, 3)  # cut for worker 1 of 3: it holds its chunk of the saved state
    ref = sharded_workers(model, opt, 3)[1]
    for (i, (_, view)), (_, (_, rview)) in zip(sorted(shard.pieces.items()), sorted(ref.pieces.items())):
        assert_state_equal(shard.local.state[view], ref.local.state[rview])


def test_an_interrupted_save_leaves_the_previous_checkpoint_newest(tmp_path):
    folder = tmp_path / "checkpoints"
    model, opt = trained()
    save_allreduce(str(folder), 4, model, opt, 2)
    save_allreduce(str(folder), 8, model, opt, 2, ranks=[1])  # worker 0 died before writing its part
    assert sorted(os.listdir(folder)) == ["step-00000004.dcp", "step-00000008.dcp.partial"]
    path, step = find_resume_state(str(tmp_path), None)
    assert (path, step) == (str(folder / "step-00000004.dcp"), 4)
    # a later complete save removes the interrupted one and keeps the newest two
    save_allreduce(str(folder), 12, model, opt, 2)
    save_allreduce(str(folder), 16, model, opt, 2)
    assert sorted(os.listdir(folder)) == ["step-00000012.dcp", "step-00000016.dcp"]


def test_a_retry_of_an_interrupted_step_ignores_the_old_attempts_files(tmp_path):
    model, opt = trained()
    final = str(tmp_path / "step-00000004.dcp")
    pieces, rest = optimizer_pieces(opt.state_dict(), 1, 2)
    write_rank(final, 1, 2, "attempt-1", 4, model_pieces(model.state_dict(), 1, 2) + pieces, None)
    # a new attempt (another save id): worker 0's part alone does not complete it with the old part
    pieces0, rest0 = optimizer_pieces(opt.state_dict(), 0, 2)
    assert not write_rank(final, 0, 2, "attempt-2", 4, model_pieces(model.state_dict(), 0, 2) + pieces0,
                          meta_of(model, rest0, 4))
    assert write_rank(final, 1, 2, "attempt-2", 4, model_pieces(model.state_dict(), 1, 2) + pieces, None)
    assert_state_equal(load_dcp_state(final)["model"], model.state_dict())


def test_a_retry_with_fewer_workers_drops_the_old_attempts_extra_parts(tmp_path):
    model, opt = trained()
    final = str(tmp_path / "step-00000004.dcp")
    pieces, _ = optimizer_pieces(opt.state_dict(), 2, 3)
    write_rank(final, 2, 3, "attempt-1", 4, model_pieces(model.state_dict(), 2, 3) + pieces, None)  # then a crash
    save_allreduce(str(tmp_path), 4, model, opt, 2)
    assert sorted(os.listdir(final)) == [".metadata", "manifest.json", "rank-00000", "rank-00001"]
    assert_state_equal(load_dcp_state(final)["model"], model.state_dict())


def test_export_through_the_command_line(tmp_path, capsys):
    from virtualflow.cli.main import main

    model, opt = trained()
    save_allreduce(str(tmp_path / "run" / "checkpoints"), 6, model, opt, 2)
    out = str(tmp_path / "model.pt")
    assert main(["export", str(tmp_path / "run"), "--to", out]) == 0
    assert "model at step 6" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "empty"), "--to", out]) == 2
    assert "neither a run directory nor a checkpoint" in capsys.readouterr().err


def test_async_saver_returns_after_the_host_copy_and_keeps_one_save_in_flight():
    saver = DcpSaver(asynchronous=True)
    release, calls = threading.Event(), []
    t = torch.ones(4)
    pieces = model_pieces({"w": t}, 0, 1)

    def job(staged):
        release.wait(5)
        calls.append(staged[0].tensor.clone())

    saver.save(job, pieces)
    t.add_(1)  # training goes on: the save holds its own host copy
    assert calls == []
    release.set()
    saver.save(job, pieces)  # waits for the first
    saver.drain()
    assert [c.tolist() for c in calls] == [[1.0] * 4, [2.0] * 4]

    def failing(staged):
        raise OSError("disk gone")

    saver.save(failing, pieces)
    with pytest.raises(OSError, match="disk gone"):
        saver.drain()
    sync = DcpSaver(asynchronous=False)  # the save is done when save() returns
    sync.save(lambda staged: calls.append(staged[0].tensor.clone()), pieces)
    assert calls[-1].tolist() == [2.0] * 4
    with pytest.raises(OSError, match="disk gone"):
        sync.save(failing, pieces)


@pytest.mark.parametrize("source", ["dcp", "pt"])
@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_export_writes_a_model_plain_pytorch_loads(tmp_path, source, ext):
    model, opt = trained()
    run = tmp_path / "run"
    if source == "dcp":
        save_allreduce(str(run / "checkpoints"), 5, model, opt, 3)
    else:
        from virtualflow.runtime.checkpoint import save_state
        save_state(str(run / "final.pt"), {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5,
                                            "job": {}})
    to = str(tmp_path / f"model{ext}")
    _, step, n = export_model(str(run), to)
    assert step == 5 and n == len(model.state_dict())
    if ext == ".pt":
        sd = torch.load(to, weights_only=True)
    else:
        from safetensors.torch import load_file
        sd = load_file(to)
    fresh = net()
    fresh.load_state_dict(sd)
    assert_state_equal(fresh.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match=r"\.safetensors or \.pt"):
        export_model(str(run), str(tmp_path / "model.bin"))


# -- hostile folders ----------------------------------------------------------------------------
def _shard(final: str, rank: int) -> str:
    return os.path.join(final, f"rank-{rank:05d}", "__0_0.distcp")


def _damage_missing(final: str, other: str) -> str:
    os.remove(_shard(final, 1))
    return "is missing"


def _damage_truncated(final: str, other: str) -> str:
    path = _shard(final, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return "is truncated"


def _damage_foreign(final: str, other: str) -> str:
    shutil.copyfile(_shard(other, 1), _shard(final, 1))  # the same worker's shard of another job
    return "does not match the manifest"


def _damage_manifest(final: str, other: str) -> str:
    path = os.path.join(final, "manifest.json")
    m = json.loads(open(path).read())
    m["entries"][0]["hi"] -= 1  # what an editor changed
    open(path, "w").write(json.dumps(m))
    return "manifest.json does not match its checksum"


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/virtualflow-test-dcp-pwned",))


def _plant_pickle(path: str, pad_to: int) -> None:
    import pickle

    data = pickle.dumps(_Boom())
    with open(path, "wb") as f:
        f.write(data + b"\0" * max(0, pad_to - len(data)))  # same size: only the digest tells


def _damage_dcp_metadata(final: str, other: str) -> str:
    path = os.path.join(final, ".metadata")  # DCP's pickle, which plain dcp.load would unpickle
    _plant_pickle(path, os.path.getsize(path))
    return ".metadata does not match the manifest"


def _damage_meta_pickle(final: str, other: str) -> str:
    path = os.path.join(final, "rank-00000", "meta.pt")
    _plant_pickle(path, os.path.getsize(path))
    return "meta.pt does not match the manifest"  # caught by its digest before anything is unpickled


def _damage_renamed(final: str, other: str) -> str:
    shutil.rmtree(final)
    shutil.copytree(final.replace("step-00000008", "step-00000004"), final)  # an older checkpoint under a new name
    return "is the checkpoint of step 4, in a folder named for step 8"


@pytest.mark.parametrize("damage", [_damage_missing, _damage_truncated, _damage_foreign, _damage_manifest,
                                    _damage_dcp_metadata, _damage_meta_pickle, _damage_renamed])
def test_a_damaged_checkpoint_is_a_one_line_error_naming_the_file_and_the_previous_one_is_used(tmp_path, damage):
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    save_allreduce(str(folder), 4, model, opt, 2)
    final = save_allreduce(str(folder), 8, model, opt, 2)
    other_model, other_opt = trained(steps=3)
    other = save_allreduce(str(tmp_path / "other"), 8, other_model, other_opt, 2)
    expect = damage(final, other)
    with pytest.raises(CorruptCheckpointError) as err:
        load_dcp_state(final)
    msg = str(err.value)
    assert expect in msg and "\n" not in msg and final in msg and "previous checkpoint" in msg
    path, step = find_resume_state(str(tmp_path / "run"), None)
    assert step == 4 and path.endswith("step-00000004.dcp")
    assert not os.path.exists("/tmp/virtualflow-test-dcp-pwned")


def test_a_file_named_like_a_checkpoint_folder_is_skipped(tmp_path):
    model, opt = trained()
    save_allreduce(str(tmp_path / "run" / "checkpoints"), 4, model, opt, 1)
    open(tmp_path / "run" / "checkpoints" / "step-00000009.dcp", "w").write("not a folder")
    assert find_resume_state(str(tmp_path / "run"), None)[1] == 4


def test_a_symlinked_checkpoint_folder_is_refused(tmp_path):
    model, opt = trained()
    real = save_allreduce(str(tmp_path / "elsewhere"), 4, model, opt, 1)
    os.makedirs(tmp_path / "run" / "checkpoints")
    os.symlink(real, tmp_path / "run" / "checkpoints" / "step-00000009.dcp")
    with pytest.raises(UntrustedStateError, match="symbolic link"):
        find_resume_state(str(tmp_path / "run"), None)


def test_the_dcp_metadata_lets_plain_torch_load_the_folder(tmp_path):
    """``.metadata`` is written for plain ``torch.distributed.checkpoint`` users (never read here)."""
    import torch.distributed.checkpoint as dcp

    model, opt = trained()
    final = save_allreduce(str(tmp_path), 2, model, opt, 3)
    sd = {f"model/{k}": torch.empty(v.numel(), dtype=v.dtype) for k, v in model.state_dict().items()}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=final, no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[f"model/{k}"], v.reshape(-1))


def test_options_refuse_async_without_dcp_and_unknown_formats():
    import virtualflow as vf

    with pytest.raises(ValueError, match="checkpoint_format='dcp'"):
        vf.LaunchOptions(steps=1, async_checkpoint=True)
    with pytest.raises(ValueError, match="checkpoint_format='zip'"):
        vf.LaunchOptions(steps=1, checkpoint_format="zip")
    vf.LaunchOptions(steps=1, checkpoint_format="dcp", async_checkpoint=True)


def test_shard_bounds_cover_the_flat_model_whatever_the_world():
    model, _ = trained()
    total = sum(v.numel() for v in model.state_dict().values())
    for world in (1, 2, 3, 5):
        got = sum(p.tensor.numel() for r in range(world) for p in model_pieces(model.state_dict(), r, world))
        assert got == total == shard_bounds(total, world)[-1][1]


@pytest.mark.parametrize("reduction", ["allreduce", "sharded"])
def test_a_workers_sharded_parts_hold_what_its_whole_state_holds(tmp_path, reduction):
    """The engine's own path: what a worker writes as its part of a sharded checkpoint reads back
    as the state file's contents (model, optimizer, LR scheduler), in both reductions."""
    import jobs
    from virtualflow.comm.groups import Group
    from virtualflow.plan.data import DataPlan
    from virtualflow.runtime.vn_worker import VNWorkerEngine
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.worker_config import WorkerConfig

    job = jobs.elastic_job().replace(loss=jobs.cross_entropy)
    cfg = WorkerConfig(store_host="127.0.0.1", store_port=0, job_source=None, total_steps=100, state_dir=str(tmp_path),
                       overrides={}, threads=1, resume_path=None, initial_workers=1, slowdowns={},
                       options=WorkerOptions(deterministic=True, device="cpu", collective_timeout_s=60.0,
                                             control_plane=False, reduction=reduction, breakdown=False))
    ds = job.build_dataset()
    engine = VNWorkerEngine.build(job, ds, DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed), cfg,
                                  torch.device("cpu"))
    group = Group(0, 0, 1, None)
    engine.vn.set_membership(group, [list(range(job.virtual_nodes))])
    for s in range(3):
        engine.step(s)
    pieces, meta = engine.sharded_parts(group)
    meta.update({"step": 3, "job": {}})
    final = str(tmp_path / "step-00000003.dcp")
    assert write_rank(final, 0, 1, "x", 3, pieces, meta)
    got, whole = load_dcp_state(final), engine.whole_state(group)
    assert_state_equal(got["model"], whole["model"])
    assert_state_equal(got["optimizer"]["state"], whole["optimizer"]["state"])
    assert got["optimizer"]["param_groups"] == whole["optimizer"]["param_groups"]
    assert got["lr_scheduler"] == whole["lr_scheduler"]
    engine.close()


def _forge_manifest(final: str) -> None:
    """What a forger with write access does: recompute every digest and the manifest's checksum."""
    import hashlib

    path = os.path.join(final, "manifest.json")
    m = json.loads(open(path).read())
    for name in m["files"]:
        data = open(os.path.join(final, name), "rb").read()
        m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    open(path, "w").write(json.dumps(m))


def test_even_with_forged_digests_nothing_in_the_folder_is_run(tmp_path):
    """The digests catch damage; code in a file is refused by what reads it: DCP's ``.metadata``
    is never unpickled, ``meta.pt`` is read with ``weights_only=True``."""
    marker = "/tmp/virtualflow-test-dcp-pwned"
    model, opt = trained()
    final = save_allreduce(str(tmp_path), 4, model, opt, 2)
    path = os.path.join(final, ".metadata")
    _plant_pickle(path, 0)
    _forge_manifest(final)
    assert_state_equal(load_dcp_state(final)["model"], model.state_dict())  # .metadata is not read
    shutil.copyfile(os.path.join(final, "rank-00000", "meta.pt"), os.path.join(tmp_path, "meta.pt.bak"))
    torch.save({"model": {}, "step": _Boom()}, os.path.join(final, "rank-00000", "meta.pt"))  # a torch file
    _forge_manifest(final)
    with pytest.raises(UntrustedStateError, match="system"):
        load_dcp_state(final)
    assert not os.path.exists(marker)
    shard = _shard(final, 1)
    torch.save(_Boom(), shard)  # a tensor shard replaced by code, its entries pointed at it
    m = json.loads(open(os.path.join(final, "manifest.json")).read())
    for e in m["entries"]:
        if e["file"].endswith("rank-00001/__0_0.distcp"):
            e["offset"], e["length"] = 0, os.path.getsize(shard)
    open(os.path.join(final, "manifest.json"), "w").write(json.dumps(m))
    shutil.copyfile(os.path.join(tmp_path, "meta.pt.bak"), os.path.join(final, "rank-00000", "meta.pt"))
    _forge_manifest(final)
    with pytest.raises(UntrustedStateError, match="a shard holds a pickled object"):
        load_dcp_state(final)
    assert not os.path.exists(marker)



def test_workers_that_complete_the_set_at_once_finalize_it_once(tmp_path):
    """Several workers may see every record at the same moment: one claims the finalization, the
    others return without touching the folder (two of them once raced to rename it)."""
    import threading

    from virtualflow.runtime import dcp as dcp_module

    model, _ = trained()
    final = str(tmp_path / "checkpoints" / "step-00000004.dcp")
    world = 2
    for r in range(world):
        # each part written without finalizing: the set completes only when both records exist
        pieces = model_pieces(model.state_dict(), r, world)
        real = dcp_module._finalize
        dcp_module._finalize = lambda *a, **k: False
        try:
            write_rank(final, r, world, "id/s4", 4, pieces, meta_of(model, {}, 4) if r == 0 else None)
        finally:
            dcp_module._finalize = real
    results, errors = [], []

    def finalize() -> None:
        try:
            results.append(dcp_module._finalize(final, world, "id/s4", 4, None))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=finalize) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(results) == [False] * 5 + [True]
    assert os.path.isdir(final) and not os.path.exists(final + ".partial")
    assert not [n for n in os.listdir(final) if n.startswith(".finalizing")]


# -- pruning: complete or absent after any crash (issue 40, item 3) -------------------------------
class _Killed(Exception):
    """Stands for a SIGKILL in the middle of a deletion."""


def _rmtree_killed_halfway(monkeypatch):
    """``shutil.rmtree`` in the checkpoint module deletes half of the files of the first complete
    checkpoint it is asked to delete, then the process "dies"."""
    import virtualflow.runtime.dcp as dcp_mod

    real = shutil.rmtree
    calls = []

    def killed(path, ignore_errors=False, onerror=None, **kw):
        import re

        if calls or not re.fullmatch(r"step-\d+\.dcp(\..*)?", os.path.basename(path)) or path.endswith(".partial"):
            return real(path, ignore_errors=ignore_errors)  # not a complete checkpoint's deletion
        calls.append(path)
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        for f in files[: len(files) // 2 + 1]:
            os.unlink(f)
        raise _Killed(path)

    monkeypatch.setattr(dcp_mod.shutil, "rmtree", killed)
    return calls


def test_a_crash_in_the_middle_of_a_prune_leaves_the_newest_two_complete(tmp_path, monkeypatch):
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    for step in (4, 8):
        save_allreduce(str(folder), step, model, opt, 2)
    calls = _rmtree_killed_halfway(monkeypatch)
    with pytest.raises(_Killed):
        save_allreduce(str(folder), 12, model, opt, 2)  # the third completes, the prune of step 4 is cut short
    assert calls  # the deletion did start
    complete = sorted(n for n in os.listdir(folder) if n.endswith(".dcp"))
    assert complete == ["step-00000008.dcp", "step-00000012.dcp"]
    for name in complete:  # whatever is named as a checkpoint is whole
        read_manifest(str(folder / name))
    leftover = [n for n in os.listdir(folder) if n not in complete]
    assert len(leftover) == 1 and leftover[0].startswith("step-00000004.dcp.")
    # the leftover is never a resume candidate, nor an error: the newest good one is used
    path, step = find_resume_state(str(tmp_path / "run"), None)
    assert step == 12 and path == str(folder / "step-00000012.dcp")
    # the next prune removes it, and keeps the newest two
    monkeypatch.undo()
    save_allreduce(str(folder), 16, model, opt, 2)
    assert sorted(os.listdir(folder)) == ["step-00000012.dcp", "step-00000016.dcp"]


def test_the_newest_sharded_checkpoint_the_records_reach_is_never_pruned(tmp_path):
    """Workers cut off from the coordinator may train on, and checkpoint, steps nobody recorded:
    the newest checkpoint the records reach stays (docs/elasticity.md, "The coordinator cut off"),
    as with single-file checkpoints, and is the one a resume starts from."""
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    for step in (4, 8, 12, 16):
        save_allreduce(str(folder), step, model, opt, 2, recorded=lambda: 5)
    assert sorted(os.listdir(folder)) == ["step-00000004.dcp", "step-00000012.dcp", "step-00000016.dcp"]
    asked = []
    save_allreduce(str(folder), 20, model, opt, 2, recorded=lambda: asked.append(1) or 13)  # the records moved on
    assert sorted(os.listdir(folder)) == ["step-00000012.dcp", "step-00000016.dcp", "step-00000020.dcp"]
    assert asked  # asked at the prune, not before the save
    save_allreduce(str(folder), 24, model, opt, 2, recorded=lambda: None)  # the store says nothing: the newest two
    assert sorted(os.listdir(folder)) == ["step-00000020.dcp", "step-00000024.dcp"]


def test_what_an_interrupted_prune_left_is_removed_and_never_read(tmp_path):
    from virtualflow.runtime.dcp import remove_discarded

    folder = tmp_path / "checkpoints"
    model, opt = trained()
    save_allreduce(str(folder), 4, model, opt, 1)
    os.rename(folder / "step-00000004.dcp", folder / "step-00000004.dcp.discarded-0123abcd")
    (folder / "step-00000004.dcp.discarded-0123abcd" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no checkpoints in it"):
        find_resume_state(str(tmp_path), None)
    assert remove_discarded(str(folder)) == ["step-00000004.dcp.discarded-0123abcd"]
    assert os.listdir(folder) == []


def test_a_start_that_continues_the_run_removes_what_an_interrupted_prune_left(tmp_path):
    import virtualflow as vf
    from virtualflow.launching.prepare import prepare_run_dir

    run = tmp_path / "run"
    model, opt = trained()
    final = save_allreduce(str(run / "checkpoints"), 4, model, opt, 1)
    save_allreduce(str(run / "checkpoints"), 8, model, opt, 1)
    os.rename(final, final + ".discarded-0123abcd")
    path, step = find_resume_state(str(run), None)
    prepare_run_dir(str(run), vf.LaunchOptions(steps=20), path, step)
    assert sorted(os.listdir(run / "checkpoints")) == ["step-00000008.dcp"]


def test_the_single_file_prune_keeps_the_newest_and_removes_orphaned_sidecars(tmp_path):
    from virtualflow.runtime.checkpoint import prune_state_files

    for step in (2, 4, 6, 8):
        (tmp_path / f"step-{step:08d}.pt").write_bytes(b"x")
        (tmp_path / f"step-{step:08d}.pt.sha256").write_text("legacy")
    (tmp_path / "step-00000001.pt.sha256").write_text("its state file went, a crash before the sidecar")
    (tmp_path / "step-00000009.dcp").mkdir()  # another format: not this prune's
    removed = prune_state_files(str(tmp_path), 2)
    assert sorted(removed) == ["step-00000001.pt.sha256", "step-00000002.pt", "step-00000002.pt.sha256",
                               "step-00000004.pt", "step-00000004.pt.sha256"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000006.pt", "step-00000006.pt.sha256", "step-00000008.pt",
                                            "step-00000008.pt.sha256", "step-00000009.dcp"]
    # the newest state the run's records reach is never removed (here: steps up to 7)
    (tmp_path / "step-00000010.pt").write_bytes(b"x")
    (tmp_path / "step-00000012.pt").write_bytes(b"x")
    prune_state_files(str(tmp_path), 2, recorded=7)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt")) == [
        "step-00000006.pt", "step-00000010.pt", "step-00000012.pt"]


# -- --resume RUN/checkpoints/step-N.dcp (item 11) ----------------------------------------------
def test_resume_from_a_named_sharded_checkpoint_folder(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    save_allreduce(str(folder), 4, model, opt, 2)
    save_allreduce(str(folder), 8, model, opt, 2)
    for given in (str(folder / "step-00000004.dcp"), str(folder / "step-00000004.dcp") + os.sep):
        path, step = find_resume_state(given, None)
        assert step == 4 and os.path.normpath(path) == str(folder / "step-00000004.dcp")


def test_a_named_sharded_checkpoint_continues_its_run_directory_only_when_asked(tmp_path):
    from virtualflow.launching.prepare import continues

    run = tmp_path / "run"
    model, opt = trained()
    final = save_allreduce(str(run / "checkpoints"), 4, model, opt, 1)
    assert continues(str(run), final) and continues(str(run), final + os.sep)
    assert not continues(str(tmp_path / "other"), final)


# -- hostile folders: nothing blocks, nothing escapes as a traceback (item 8) --------------------
def _bounded(fn, timeout_s: float = 60.0, unblock: str | None = None):
    """``fn()`` on a thread; if it is still running after ``timeout_s`` (blocked on a FIFO), the
    FIFO ``unblock`` is opened for writing (which frees it) and the test fails."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        if unblock is not None:
            fd = os.open(unblock, os.O_RDWR | os.O_NONBLOCK)  # a writer: the blocked open returns
            t.join(10)
            os.close(fd)
        pytest.fail(f"blocked for {timeout_s} s (opened a FIFO)")
    return out


@pytest.mark.parametrize("which", ["manifest.json", "rank-00000/__0_0.distcp", "rank-00000/meta.pt"])
def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(tmp_path, which):
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    final = save_allreduce(str(folder), 4, model, opt, 1)
    target = os.path.join(final, which)
    os.unlink(target)
    os.mkfifo(target)
    for fn in (lambda: find_resume_state(str(tmp_path / "run"), None),
               lambda: export_model(str(tmp_path / "run"), str(tmp_path / "model.pt"))):
        out = _bounded(fn, unblock=target)
        assert isinstance(out.get("error"), UntrustedStateError), out
        assert "not a regular file" in str(out["error"]) and target in str(out["error"])


def test_a_shard_swapped_for_a_fifo_after_the_check_does_not_block_the_read(tmp_path):
    """DCP reads the shards itself, after the digests were checked: it opens them as the checks do."""
    model, opt = trained()
    final = save_allreduce(str(tmp_path), 4, model, opt, 1)
    manifest = read_manifest(final)
    shard = _shard(final, 0)
    os.unlink(shard)
    os.mkfifo(shard)
    out = _bounded(lambda: load_ranges(final, manifest, {"model/0.weight": (0, 54)}), unblock=shard)
    assert isinstance(out.get("error"), (UntrustedStateError, CorruptCheckpointError)), out
    assert "not a regular file" in str(out["error"]) or os.path.basename(shard) in str(out["error"])


def test_a_deeply_nested_manifest_is_a_one_line_error_naming_the_file(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    model, opt = trained()
    save_allreduce(str(folder), 4, model, opt, 1)
    final = save_allreduce(str(folder), 8, model, opt, 1)
    with open(os.path.join(final, "manifest.json"), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CorruptCheckpointError, match="nested too deeply") as err:
        read_manifest(final)
    assert os.path.join(final, "manifest.json") in str(err.value)
    assert find_resume_state(str(tmp_path / "run"), None)[1] == 4  # reported, the previous one used


def test_a_shard_of_another_size_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    import hashlib as real_hashlib

    import virtualflow.runtime.dcp_read as dcp_mod  # the reader hashes the files

    model, opt = trained()
    final = save_allreduce(str(tmp_path), 4, model, opt, 1)
    shard = _shard(final, 0)
    os.truncate(shard, 4 << 30)  # 4 GiB, sparse: hashing it is what must not happen
    hashed = []

    class Counting:
        @staticmethod
        def sha256(*a):
            h = real_hashlib.sha256(*a)

            class Wrapped:
                def update(self, block):
                    hashed.append(len(block))
                    if sum(hashed) > 64 << 20:
                        raise AssertionError("hashed a file whose size already differs from the manifest's")
                    h.update(block)

                def hexdigest(self):
                    return h.hexdigest()
            return Wrapped()

    monkeypatch.setattr(dcp_mod, "hashlib", Counting)
    with pytest.raises(CorruptCheckpointError, match=f"{4 << 30} bytes, the manifest records"):
        read_manifest(final)


@pytest.mark.parametrize("link", ["rank", "checkpoints"])
def test_symlinked_rank_and_checkpoints_folders_are_refused(tmp_path, link):
    model, opt = trained()
    real = save_allreduce(str(tmp_path / "elsewhere" / "checkpoints"), 4, model, opt, 1)
    run = tmp_path / "run"
    if link == "checkpoints":
        os.makedirs(run)
        os.symlink(os.path.dirname(real), run / "checkpoints")
        where = str(run / "checkpoints")
    else:
        final = save_allreduce(str(run / "checkpoints"), 4, model, opt, 1)
        shutil.rmtree(os.path.join(final, "rank-00000"))
        os.symlink(os.path.join(real, "rank-00000"), os.path.join(final, "rank-00000"))
        where = os.path.join(final, "rank-00000")
    with pytest.raises(UntrustedStateError, match="symbolic link") as err:
        find_resume_state(str(run), None)
    assert where in str(err.value)


# -- export of a model with tied weights (item 10) ------------------------------------------------
class Tied(nn.Module):
    """A language model's shape: the output matrix is the embedding's (one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.wte(idx))))


def _trained_tied() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        model(torch.arange(8)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("source", ["pt", "dcp"])
def test_export_of_a_model_with_tied_weights_to_safetensors(tmp_path, source):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    from virtualflow.runtime.checkpoint import save_state, shared_names

    model, opt = _trained_tied()
    assert shared_names(model.state_dict()) == {"head.weight": "wte.weight"}
    run = tmp_path / "run"
    if source == "pt":
        save_state(str(run / "final.pt"), {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
                                            "job": {}})
    else:
        pieces, rest = optimizer_pieces(opt.state_dict(), 0, 1)
        meta = {**meta_of(model, rest, 3), "model_aliases": shared_names(model.state_dict())}
        write_rank(str(run / "checkpoints" / "step-00000003.dcp"), 0, 1, "id", 3,
                   model_pieces(model.state_dict(), 0, 1) + pieces, meta)
        loaded = load_dcp_state(str(run / "checkpoints" / "step-00000003.dcp"))["model"]
        assert loaded["head.weight"] is loaded["wte.weight"]  # tied again, as the model ties them
    to = str(tmp_path / "model.safetensors")
    _, step, n = export_model(str(run), to)
    assert step == 3 and n == len(model.state_dict())
    # the tensor is stored once, the alias recorded in the metadata
    stored = load_file(to)
    assert sorted(stored) == ["mid.bias", "mid.weight", "wte.weight"]
    with safe_open(to, framework="pt") as f:
        assert json.loads(f.metadata()["aliases"]) == {"head.weight": "wte.weight"}
    # loaded back with safetensors' own load_model: the model's tie holds the trained matrix
    fresh = Tied()
    with torch.no_grad():
        fresh.wte.weight.zero_()
    assert load_model(fresh, to) == (set(), [])
    assert fresh.head.weight is fresh.wte.weight
    assert_state_equal(fresh.state_dict(), model.state_dict())
    # or restored from the metadata into a plain state_dict
    with safe_open(to, framework="pt") as f:
        aliases = json.loads(f.metadata()["aliases"])
    sd = {**stored, **{alias: stored[name] for alias, name in aliases.items()}}
    other = Tied()
    other.load_state_dict(sd)
    x = torch.arange(11)
    assert torch.equal(other(x), model(x))


def test_export_of_the_tiny_lm_example_to_safetensors(tmp_path):
    """``examples/tiny_lm.py`` ties its output matrix to the embedding (the export failed on it)."""
    import importlib.util

    from safetensors.torch import load_model

    from virtualflow.runtime.checkpoint import save_state

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_lm.py")
    spec = importlib.util.spec_from_file_location("tiny_lm_for_export", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(3)
    model = mod.TinyGPT()
    save_state(str(tmp_path / "run" / "final.pt"), {"model": model.state_dict(), "optimizer": {}, "step": 1,
                                                     "job": {}})
    to = str(tmp_path / "tiny.safetensors")
    export_model(str(tmp_path / "run"), to)
    torch.manual_seed(4)
    fresh = mod.TinyGPT()
    load_model(fresh, to)
    assert fresh.head.weight is fresh.wte.weight
    assert_state_equal(fresh.state_dict(), model.state_dict())


# -- export of a run with sharded parameters (reduction="fsdp") ----------------------------------
def _gathered_model(engines: list) -> dict:
    """The model's ``state_dict`` as a sharded-parameter run's last call gathers it to rank 0 for
    ``final.pt`` (each engine's own ``models.model_state``, a collective over a gloo group of its
    workers on an in-process store)."""
    import datetime
    import torch.distributed as dist

    from virtualflow.comm.groups import make_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    out: list = [None] * len(engines)

    def gather(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))
        group = make_group(client, 1, rank, len(engines), 60.0, torch.device("cpu"))
        try:
            out[rank] = engines[rank].models.model_state(group)
        finally:
            group.close()

    threads = [threading.Thread(target=gather, args=(r,), daemon=True) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[0] is not None and out[1:] == [None] * (len(engines) - 1)
    return out[0]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """tests/fsdp_jobs.py's tied nanoGPT trained 2 steps on 2 sharded-parameter workers (threads
    over real gloo groups), saved as its workers save it: ``final.pt`` (the model gathered to rank
    0) in one run directory, a sharded checkpoint (each owner writes its ranges, no gather) in another."""
    from fsdp_jobs import tied_gpt_job
    from virtualflow.comm.groups import Group
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.checkpoint import save_state
    from virtualflow.runtime.grid_threads import Generation, train_threads

    run = train_threads(tied_gpt_job(max_grad_norm=0.05), [Generation(members=(0, 1), steps=2)],
                        options=WorkerOptions(reduction="fsdp"), timeout_s=60)
    root = tmp_path_factory.mktemp("fsdp_export")
    model = _gathered_model(run.engines)
    assert_state_equal(model, run.state["model"])
    save_state(str(root / "pt" / "final.pt"), {**run.state, "model": model, "step": 2, "job": {}})
    final = str(root / "dcp" / "checkpoints" / "step-00000002.dcp")
    held = []
    for rank, engine in enumerate(run.engines):
        pieces, meta = engine.sharded_parts(Group(0, rank, 2, None))
        held.append(sum(p.tensor.numel() for p in pieces if p.fqn.startswith("model/")))
        write_rank(final, rank, 2, "id/s2", 2, pieces, None if meta is None else {**meta, "step": 2, "job": {}})
    assert sum(held) == sum(v.numel() for v in model.values()) and 0 not in held  # each wrote its shards only
    return root, model


@pytest.mark.parametrize("source", ["pt", "dcp"])
@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_export_of_a_sharded_parameter_run_writes_the_whole_model(tmp_path, fsdp_run, source, ext):
    from fsdp_jobs import tied_gpt

    root, whole = fsdp_run
    to = str(tmp_path / f"model{ext}")
    _, step, n = export_model(str(root / source), to)
    assert step == 2 and n == len(whole)
    if ext == ".pt":
        sd = torch.load(to, weights_only=True)
    else:
        from safetensors.torch import load_file
        sd = load_file(to)
    model = tied_gpt()
    assert model.load_state_dict(sd, strict=False).missing_keys in ([], ["lm_head.weight"])  # (safetensors: tied once)
    assert_state_equal(model.state_dict(), whole)  # every weight, as rank 0 gathered it


@pytest.mark.parametrize("source", ["pt", "dcp"])
def test_export_of_a_sharded_parameter_run_keeps_the_tied_matrix_once(tmp_path, fsdp_run, source):
    """As an unsharded run's export: safetensors' own ``load_model`` ties the names the model ties."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    from fsdp_jobs import tied_gpt

    root, whole = fsdp_run
    to = str(tmp_path / "model.safetensors")
    export_model(str(root / source), to)
    with safe_open(to, framework="pt") as f:
        assert json.loads(f.metadata().get("aliases", "{}")) == {"lm_head.weight": "transformer.wte.weight"}
    model = tied_gpt()
    assert load_model(model, to) == (set(), [])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_state_equal(model.state_dict(), whole)
