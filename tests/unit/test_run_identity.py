"""A run directory records which job's run it holds; continuing it with another job is refused
(issue 40, item 13), while a resume with other step or worker counts goes on."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest
import torch

import virtualflow as vf
from virtualflow.config.job import source_from
from virtualflow.launching.prepare import prepare, prepare_run_dir
from virtualflow.runtime.checkpoint import save_state

JOB_FILE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

import virtualflow as vf


def data():
    g = torch.Generator().manual_seed({data_seed})
    return TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))


def model():
    return nn.Sequential(nn.Linear(4, {hidden}), nn.ReLU(), nn.Linear({hidden}, 1))


def make_job():
    return vf.Job(name="{name}", model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), dataset=data,
                  global_batch_size=16, virtual_nodes=4, seed=0)
'''


def job_file(tmp_path, stem: str, name: str, hidden: int = 8, data_seed: int = 1) -> str:
    path = tmp_path / f"{stem}.py"
    path.write_text(textwrap.dedent(JOB_FILE.format(name=name, hidden=hidden, data_seed=data_seed)))
    return f"{path}:make_job"


def start(job: str, **options) -> None:
    """What a launch decides before any worker starts (the run directory prepared), then let go."""
    with prepare(job, vf.LaunchOptions(**options)) as setup:
        if setup.run_lock is not None:
            setup.run_lock.release()


def finish(run_dir: str, job: str, step: int) -> bytes:
    """The ``final.pt`` the run of ``job`` would leave at ``step``; returns its bytes."""
    built = vf.config.job.resolve_spec(job)()
    torch.manual_seed(built.seed)
    model = built.model()
    save_state(os.path.join(run_dir, "final.pt"), {
        "model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "step": step,
        "job": {"name": built.name, "global_batch_size": 16, "virtual_nodes": 4, "seed": 0,
                "data_order": built.data_order}})
    with open(os.path.join(run_dir, "final.pt"), "rb") as f:
        return f.read()


def test_another_job_with_the_same_model_and_batch_cannot_continue_a_run(tmp_path):
    """The reported case: a second job file whose model, B, V and seed match resumed into the first
    job's run directory without a word and replaced its final.pt."""
    run = str(tmp_path / "run")
    first = job_file(tmp_path, "first", "first-job")
    other = job_file(tmp_path, "other", "other-job", data_seed=2)  # the same model, another dataset
    start(first, run_dir=run, steps=4)
    final = finish(run, first, 4)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError) as err:
        start(other, resume=run, steps=8)
    text = str(err.value)
    assert "holds a run of another job" in text and "'first:make_job'" in text and "'other:make_job'" in text
    assert "--run-dir" in text and "--overwrite" in text
    # nothing of the run there changed
    with open(os.path.join(run, "final.pt"), "rb") as f:
        assert f.read() == final
    with open(os.path.join(run, "metrics.jsonl")) as f:
        assert json.loads(f.read())["step"] == 3
    # the same job continues it, with other step and worker counts
    start(first, resume=run, steps=8, workers=2)
    # the other job may start from that state in a run directory of its own, or afresh there with --overwrite
    start(other, resume=run, run_dir=str(tmp_path / "new"), steps=8)
    start(other, run_dir=run, steps=8, overwrite=True)
    from virtualflow.launching.identity import IDENTITY_FILE

    with open(os.path.join(run, IDENTITY_FILE)) as f:
        assert json.load(f)["job"] == "other:make_job"


def identity_of(job: str) -> dict:
    from virtualflow.launching.identity import job_label, run_identity

    built = vf.config.job.resolve_spec(job)()
    torch.manual_seed(built.seed)
    signature = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in built.model().state_dict().items()]
    return run_identity(built, job_label(job, source_from(job)), signature)


def test_what_the_identity_holds_and_what_may_change(tmp_path):
    from virtualflow.launching.identity import IDENTITY_FILE, check_identity

    base = identity_of(job_file(tmp_path, "a", "a"))
    run = str(tmp_path / "run")
    os.makedirs(run)
    prepare_run_dir(run, vf.LaunchOptions(steps=4), None, 0, base)
    check_identity(run, dict(base))
    os.makedirs(tmp_path / "w")
    wider = identity_of(job_file(tmp_path / "w", "a", "a", hidden=9))  # the same names, another shape
    with pytest.raises(ValueError, match="the model's state_dict names, shapes or dtypes"):
        check_identity(run, wider)
    for key, value in (("global_batch_size", 32), ("virtual_nodes", 8), ("seed", 1), ("name", "b"),
                       ("data_order", "randperm")):
        with pytest.raises(ValueError, match=f"{key}="):
            check_identity(run, {**base, key: value})
    check_identity(run, {**base, "job": None})  # a Job object has no function name: not compared
    # a record that cannot be read is dropped (logged) and written again by the next launch
    for junk in ("{not json", "[" * 200_000 + "]" * 200_000, json.dumps({**base, "format": "other"})):
        with open(os.path.join(run, IDENTITY_FILE), "w") as f:
            f.write(junk)
        check_identity(run, {**base, "seed": 5})
    os.unlink(os.path.join(run, IDENTITY_FILE))
    os.mkfifo(os.path.join(run, IDENTITY_FILE))  # not a file: dropped without opening it (no hang)
    check_identity(run, {**base, "seed": 5})


def test_a_job_is_named_the_same_however_it_is_passed(tmp_path):
    from virtualflow.launching.identity import job_label

    spec = job_file(tmp_path, "tiny", "t")
    fn = vf.config.job.resolve_spec(spec)
    assert job_label(spec, source_from(spec)) == "tiny:make_job"
    assert job_label(fn, source_from(fn)) == "tiny:make_job"
    assert job_label(fn(), source_from(fn())) is None
    assert job_label("pkg.tiny:make_job", vf.config.job.JobSource("spec", target="pkg.tiny:make_job")) == "tiny:make_job"


def test_resuming_a_named_sharded_checkpoint_never_takes_its_folder_for_the_run_directory(tmp_path):
    """``--resume RUN/checkpoints/step-N.dcp`` (issue 40, item 11): the folder is the state to resume,
    not a run directory to write into (as with a state file, a new run directory is used)."""
    from virtualflow.runtime.dcp import model_pieces, optimizer_pieces, write_rank

    job = job_file(tmp_path, "first", "first-job")
    built = vf.config.job.resolve_spec(job)()
    torch.manual_seed(built.seed)
    model = built.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    final = str(tmp_path / "run" / "checkpoints" / "step-00000004.dcp")
    pieces, rest = optimizer_pieces(opt.state_dict(), 0, 1)
    write_rank(final, 0, 1, "id", 4, model_pieces(model.state_dict(), 0, 1) + pieces,
               {"model": {}, "model_keys": list(model.state_dict()), "optimizer": rest, "lr_scheduler": None,
                "step": 4, "job": {"name": "first-job", "global_batch_size": 16, "virtual_nodes": 4, "seed": 0,
                                   "data_order": built.data_order}})
    before = sorted(os.listdir(final))
    with prepare(job, vf.LaunchOptions(resume=final, steps=8)) as setup:
        assert setup.resume_path == final and setup.resume_step == 4
        assert setup.run_dir is None and setup.state_dir != final
        shutil.rmtree(setup.state_dir)  # the temporary state directory (the run would remove it)
    assert sorted(os.listdir(final)) == before
