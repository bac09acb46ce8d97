"""Mistakes in the user's code reach the user with their real cause: a worker's exception keeps its
traceback (the job's frames first), its step and its line; a model instance, an unguarded job file,
a dict batch indexed by position, swapped loss arguments and a device this machine lacks are each
named for what they are; the progress bar's pace comes from steady steps only."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.backends.local import check_local_device
from virtualflow.config.job import JobImportError, importing_job_file, resolve_spec
from virtualflow.plan.data import DataPlan
from virtualflow.launching.preflight import JobCodeError, _call, build_job, preflight
from virtualflow.records.result import TrainingError, WorkerTraceback, job_frame, job_traceback
from virtualflow.launching.supervisor import ProgressRate

FAILING_JOB = '''
import torch
from torch import nn
import virtualflow as vf

calls = 0

def loss(model, batch):
    global calls
    if torch.is_grad_enabled():  # the launcher's preflight runs the loss without gradients
        calls += 1
    if calls > 2 * FAIL_AT:  # two VNs per worker and step: the first call of step FAIL_AT
        raise RuntimeError("the loss gave up")
    return nn.functional.mse_loss(model(batch[0]), batch[1])

def make_job():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return vf.Job(model=lambda: nn.Linear(8, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=data,
                  loss=loss, global_batch_size=16, virtual_nodes=4)
'''


def _job_file(tmp_path, text: str, name: str = "userjob.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# -- a worker's exception ----------------------------------------------------------------------
def test_worker_exception_keeps_traceback_step_and_log(tmp_path, run_dir):
    path = _job_file(tmp_path, FAILING_JOB.replace("FAIL_AT", "2"))
    with pytest.raises(TrainingError) as info:
        vf.train(f"{path}:make_job", workers=2, steps=6, checkpoint_every=1, run_dir=run_dir)
    err = info.value
    raise_line = 'raise RuntimeError("the loss gave up")'
    assert err.step == 2 and err.worker in (0, 1)
    assert f"failed: RuntimeError: the loss gave up (at step 2; logs in " in str(err)
    assert "\n" not in str(err)
    # From the job's own code on: the loss's file and line first, virtualflow's frames counted.
    lines = err.worker_traceback.splitlines()
    assert lines[0].startswith("Traceback (most recent call last; ") and "frames of virtualflow" in lines[0]
    raise_lineno = FAILING_JOB.splitlines().index(f"        {raise_line}") + 1
    assert lines[1] == f'  File "{path}", line {raise_lineno}, in loss' and lines[2].strip() == raise_line
    assert lines[-1] == "RuntimeError: the loss gave up"
    assert "virtualflow/runtime" not in err.worker_traceback
    # The full one has the frames that led there, and is the cause Python prints above the error.
    assert "virtualflow/runtime/engine.py" in err.worker_traceback_full and raise_line in err.worker_traceback_full
    assert isinstance(err.__cause__, WorkerTraceback) and err.worker_traceback.rstrip() in str(err.__cause__)
    printed = "".join(traceback.format_exception(err))
    assert printed.index(raise_line) < printed.index("The above exception was the direct cause")
    # The worker's log holds it, and the events record the real step.
    assert f"(at step 2; logs in {os.path.join(run_dir, 'logs')})" in str(err)
    with open(os.path.join(run_dir, "logs", f"worker-{err.worker}.log")) as f:
        log = f.read()
    assert f"virtualflow worker {err.worker} failed at step 2: RuntimeError: the loss gave up" in log
    assert raise_line in log and "virtualflow/runtime/engine.py" in log
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert {e["step"] for e in events if e["event"] in ("error", "failed")} == {2}
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1] == "step-00000002.pt"


def test_checkpoints_without_run_dir_are_announced_as_temporary(monkeypatch, caplog):
    from virtualflow import api

    class NotStarted(Exception):
        pass

    def start(self):
        raise NotStarted(self.state_dir)

    monkeypatch.setattr(api.JobHandle, "start", start)  # what launch decided is enough; no worker starts
    with caplog.at_level(logging.WARNING, logger="virtualflow"), pytest.raises(NotStarted) as info:
        vf.launch(lambda: vf.Job(model=lambda: nn.Linear(6, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                 dataset=_data, loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                                 global_batch_size=8, virtual_nodes=2), steps=4, checkpoint_every=2)
    state_dir = info.value.args[0]
    shutil.rmtree(state_dir)
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint_every=2 without run_dir: the checkpoints go to the temporary folder {state_dir}, which is removed "
        f"when the run succeeds (kept if it fails); give run_dir= (--run-dir) to keep them"]


def test_cli_prints_the_worker_traceback_under_the_summary(monkeypatch, capsys):
    from virtualflow.cli import run as cli_run

    err = TrainingError("worker 1 (pid 7) failed: KeyError: 'x' (at step 3; logs in /r/logs)")
    err.worker_traceback = 'Traceback (most recent call last; 4 frames of virtualflow before the job\'s code left out):\n' \
                           '  File "/u/job.py", line 5, in loss\nKeyError: \'x\'\n'
    err.worker_traceback_full = "FULL TRACEBACK\n"

    def failing_launch(job, options):
        raise err

    import virtualflow as vf
    monkeypatch.setattr(vf, "launch", failing_launch)  # the verb imports virtualflow when it runs
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli_run.add_parser(sub)
    args = parser.parse_args(["run", "job.py", "--steps", "1", "--run-dir", "unused"])
    assert cli_run.main(args) == 1
    stderr = capsys.readouterr().err.splitlines()
    assert stderr[0] == f"virtualflow run: training failed: {err}"
    assert stderr[1:] == ["  " + line for line in err.worker_traceback.splitlines()]
    args.verbose = True
    assert cli_run.main(args) == 1
    assert capsys.readouterr().err.splitlines()[1:] == ["  FULL TRACEBACK"]


def test_job_traceback_starts_at_the_jobs_code(tmp_path):
    path = _job_file(tmp_path, '''
        def loss(model, batch):
            return helper(batch)

        def helper(batch):
            return batch["missing"]
    ''', "lossmod.py")
    import importlib.util

    spec = importlib.util.spec_from_file_location("lossmod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    job = vf.Job(model=lambda: nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 dataset=torch.utils.data.TensorDataset(torch.zeros(4, 2)), loss=mod.loss,
                 global_batch_size=4, virtual_nodes=2)
    with pytest.raises(JobCodeError) as info:
        _call("Job.loss", job.compute_loss, None, {})  # virtualflow calls the job's code, as a worker does
    exc = info.value.__cause__
    full = "".join(traceback.format_exception(exc))
    short = job_traceback(exc)
    assert "virtualflow/launching/preflight.py" in full and "virtualflow/config/job.py" in full  # what is left out
    assert short.splitlines() == [
        "Traceback (most recent call last; 2 frames of virtualflow before the job's code left out):",
        f'  File "{path}", line 3, in loss',
        "    return helper(batch)",
        "           ^^^^^^^^^^^^^",
        f'  File "{path}", line 6, in helper',
        '    return batch["missing"]',
        "           ~~~~~^^^^^^^^^^^",
        "KeyError: 'missing'",
    ]
    assert job_frame(exc) == f'{path}, line 6, in helper (return batch["missing"])'
    # An error with no frame of the job's (virtualflow's own) keeps every frame.
    try:
        DataPlan(3, 4, 2, 0)
    except ValueError as own:
        assert job_traceback(own, internal=lambda f: True) == "".join(traceback.format_exception(own))


# -- errors that name the real cause -----------------------------------------------------------
def _data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))


class DictData(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"x": torch.full((6,), float(i)), "y": torch.ones(1)}


def test_model_or_optimizer_instance_is_refused_naming_the_factory():
    with pytest.raises(TypeError, match=r"Job.model must be a zero-argument factory that returns the model, got a "
                                        r"Linear instance; pass the function that builds it \(e.g. model=lambda: "):
        vf.Job(model=nn.Linear(6, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=_data,
               loss=lambda m, b: m(b[0]).mean(), global_batch_size=8, virtual_nodes=2)


    def instance_job():
        return vf.Job(model=nn.Linear(6, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=_data,
                      loss=lambda m, b: m(b[0]).mean(), global_batch_size=8, virtual_nodes=2)

    # Through the launcher's preflight: the line of the job function, not the dataclass's __init__.
    with pytest.raises(JobCodeError, match=rf"got a Linear instance; .*; raised at {re.escape(__file__)}, line \d+, "
                                           rf"in instance_job \(return vf.Job\(model=nn.Linear\(6, 1\), "):
        build_job(instance_job, "")
    model = nn.Linear(6, 1)
    with pytest.raises(TypeError, match=r"Job.optimizer must be a factory taking the model's parameters, got a SGD "
                                        r"instance; pass e.g. optimizer=lambda params: torch.optim.SGD\(params"):
        vf.Job(model=lambda: nn.Linear(6, 1), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=_data,
               loss=lambda m, b: m(b[0]).mean(), global_batch_size=8, virtual_nodes=2)


def _preflight(job: vf.Job) -> str:
    dataset = job.build_dataset()
    with pytest.raises(JobCodeError) as info:
        preflight(job, dataset, DataPlan(len(dataset), job.global_batch_size, job.virtual_nodes, job.seed))
    return str(info.value)


def test_loss_errors_name_the_users_exception_and_line(tmp_path):
    path = _job_file(tmp_path, '''
        from torch import nn

        def dict_by_position(m, b):
            x, y = b[0], b[1]
            return nn.functional.mse_loss(m(x), y)

        def swapped(batch, model):
            x, y = batch
            return nn.functional.mse_loss(model(x), y)
    ''', "losses.py")
    dict_by_position = resolve_spec(f"{path}:dict_by_position")
    swapped = resolve_spec(f"{path}:swapped")
    common = dict(model=lambda: nn.Linear(6, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  global_batch_size=8, virtual_nodes=2)
    msg = _preflight(vf.Job(dataset=DictData, loss=dict_by_position, **common))
    assert msg == (f"Job.loss raised KeyError: 0 on virtual node 0's batch of step 0, a dict(x: Tensor[4, 6] float32, "
                   f"y: Tensor[4, 1] float32); the batch is a dict (keys 'x', 'y'): index it by key, not by position; "
                   f"raised at {path}, line 5, in dict_by_position (x, y = b[0], b[1])")
    msg = _preflight(vf.Job(dataset=_data, loss=swapped, **common))
    assert msg == (f"Job.loss raised TypeError: cannot unpack non-iterable Linear object on virtual node 0's batch of "
                   f"step 0, a list(Tensor[4, 6] float32, Tensor[4, 1] float32); the error is about the model (Linear) "
                   f"where the loss expected the batch: Job.loss is called as loss(model, batch), model first; raised "
                   f"at {path}, line 9, in swapped (x, y = batch)")
    assert "dataset items must be tensors" not in msg


UNGUARDED = '''
import torch
from torch import nn
import virtualflow as vf

def make_job():
    return vf.Job(model=lambda: nn.Linear(6, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  dataset=torch.utils.data.TensorDataset(torch.zeros(32, 6), torch.zeros(32, 1)),
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch_size=8, virtual_nodes=2)

result = vf.train(make_job, workers=2, steps=2)
'''


def test_job_file_that_trains_at_import_is_told_to_guard_it(tmp_path):
    path = _job_file(tmp_path, UNGUARDED, "unguarded.py")
    # What `virtualflow run unguarded.py` does first: import the file to find make_job.
    with pytest.raises(JobImportError) as info:
        resolve_spec(path)
    assert str(info.value) == (
        f"{path} starts training when it is imported (virtualflow.train/launch runs at its top level), and "
        f"virtualflow imports the file to read its job function: guard the module's training code with "
        f'`if __name__ == "__main__":`')
    assert importing_job_file() is None
    guarded = _job_file(tmp_path, UNGUARDED.replace("result = ", 'if __name__ == "__main__":\n    result = '),
                        "guarded.py")
    assert resolve_spec(guarded).__name__ == "make_job"  # imported without training


GUARDS = """
from virtualflow.config.job import JobImportError, check_main_guard

def start():
    check_main_guard("worker processes")

if __name__ == "__main__":
    start()  # guarded: children that import this script again do not start anything
    print("guarded: started")
try:
    start()
except JobImportError as exc:
    print("unguarded:", exc)
"""


def test_processes_that_reimport_the_script_need_its_main_guard(tmp_path):
    # multiprocessing's spawn/forkserver children import the main script again (the GNN engine's
    # processes do): unguarded top-level code there is refused before any child starts.
    script = _job_file(tmp_path, GUARDS, "script.py")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": src}).stdout.splitlines()
    assert out == ["guarded: started",
                   f"unguarded: {script}, line 11, starts worker processes from the script's top level, and every "
                   f"new process imports the script again (and would start them again): guard the module's "
                   f'training code with `if __name__ == "__main__":`']


def test_a_device_this_machine_lacks_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"device='cdua' is not a torch device name; use e.g. cpu, cuda or cuda:1"):
        check_local_device("cdua")
    if torch.version.cuda is None:
        missing, rule = "cuda", rf"this torch \({re.escape(torch.__version__)}\) is a CPU-only build; install a CUDA build"
    else:
        n = torch.cuda.device_count()
        missing, rule = f"cuda:{n}", "choose one of them|torch sees no CUDA device"
    with pytest.raises(ValueError, match=rule):
        check_local_device(missing)
    check_local_device("cpu")
    # Through the launcher: refused before the job is built or any worker starts.
    with pytest.raises(ValueError, match=rule):
        vf.launch(lambda: pytest.fail("the job must not be built"), workers=1, steps=1, device=missing)


# -- progress ----------------------------------------------------------------------------------
def test_progress_pace_comes_from_steady_steps():
    rate = ProgressRate(total_steps=10, smoothing=0.5)

    def step(i, t, generation=0, samples=32):
        rate.add({"step": i, "step_time_s": t, "generation": generation, "samples": samples, "loss": 1.0,
                  "workers": 2})

    step(0, 13.0)  # the first step of a generation (forming it, first allocations): no estimate from it
    assert rate.step_s is None and rate.eta_s is None and "eta ?" in rate.describe({"loss": 1.0, "workers": 2})
    step(1, 0.2)
    step(2, 0.4)
    assert rate.step_s == pytest.approx(0.5 * 0.4 + 0.5 * 0.2)
    assert rate.samples_per_s == pytest.approx(0.5 * 32 / 0.4 + 0.5 * 32 / 0.2)
    assert rate.eta_s == pytest.approx(7 * 0.3)
    step(3, 5.0, generation=1)  # a resize: the new generation's first step is left out again
    assert rate.step_s == pytest.approx(0.3) and rate.eta_s == pytest.approx(6 * 0.3)
    assert rate.describe({"loss": 0.5, "workers": 3}) == "eta 00:01, 0.3 s/step, 120 samples/s, loss 0.5000, 3 workers"


# -- records that would be lost, datasets that differ (issue 40, items 7 and 12) ---------------
def test_a_dataset_that_differs_between_worker_processes_fails_the_job_naming_the_cause():
    import jobs

    job = jobs.regression_job().replace(dataset=jobs.pid_shuffled_data)
    with pytest.raises(vf.TrainingError, match=r"failed: DatasetMismatch: worker \d's dataset differs from worker "
                                               r"\d's \(sample 0: .*seed your shuffle"):
        vf.train(job, workers=2, steps=3)


def test_metric_names_too_long_for_a_step_report_are_refused_before_training():
    import jobs

    job = jobs.regression_job().replace(loss=jobs.long_metric_names_mse)
    with pytest.raises(vf.LossShapeError, match=r"metric name of 30001 characters.*at most 200"):
        vf.train(job, workers=1, steps=3)
