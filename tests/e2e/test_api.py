"""The public surface: job forms, Result, run directory, launch/status/wait, evaluation."""

from __future__ import annotations

import json
import os

import torch

import virtualflow as vf
from conftest import assert_state_close, assert_state_equal
import jobs
from reference import reference_train

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_job_form_trains_the_same_model():
    by_object = vf.train(jobs.make_job(), workers=2, steps=6, deterministic=True)
    by_function = vf.train(jobs.make_job, workers=2, steps=6, deterministic=True)
    by_module_spec = vf.train("jobs:make_job", workers=1, steps=6, deterministic=True)
    by_file_spec = vf.train(os.path.join(HERE, "jobs.py") + ":make_job", workers=3, steps=6, deterministic=True)
    for r in (by_function, by_module_spec, by_file_spec):
        assert_state_equal(r.state_dict, by_object.state_dict)


def test_run_dir_records(run_dir):
    result = vf.train(jobs.bn_job(evaluate=jobs.accuracy, eval_every=4), workers=2, steps=10, run_dir=run_dir)
    assert result.run_dir == run_dir
    files = set(os.listdir(run_dir))
    assert {"metrics.jsonl", "events.jsonl", "summary.json", "final.pt"} <= files
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == list(range(10))
    assert [m["loss"] for m in metrics] == [h["loss"] for h in result.history]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    kinds = [e["event"] for e in events]
    assert kinds.count("join") == 2 and kinds.count("generation") == 1 and kinds.count("step") == 10
    assert [e["step"] for e in events if e["event"] == "eval"] == [4, 8, 10]
    assert kinds[-1] == "done"
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["status"] == "done" and summary["steps_completed"] == 10 and summary["workers"] == 2
    assert summary["versions"]["torch"] == torch.__version__
    final = torch.load(os.path.join(run_dir, "final.pt"), weights_only=False)
    assert_state_equal(final["model"], result.state_dict)
    # evaluation ran on the final model
    assert set(result.metrics) == {"accuracy"} and 0.0 <= result.metrics["accuracy"] <= 1.0
    assert [e["step"] for e in result.eval_history] == [4, 8, 10]


def test_epochs_and_launch_status():
    handle = vf.launch(jobs.regression_job(), workers=2, epochs=2)  # 256 // 32 = 8 steps per epoch
    assert handle.total_steps == 16
    st = handle.status()
    assert st["total_steps"] == 16 and [w["vns"] for w in st["workers"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    result = handle.wait(timeout_s=120)
    assert result.steps == 16 and not result.stopped
    assert handle.status()["state"] == "done" and handle.status()["step"] == 16


def test_generic_dataset_and_collate_path():
    """A per-sample Dataset returning dicts goes through default_collate and matches tensors."""
    r = vf.train(jobs.dict_dataset_job, workers=2, steps=8)
    job = jobs.dict_dataset_job()
    plain = vf.Job(model=job.model, optimizer=job.optimizer, loss=jobs.mse, dataset=jobs.regression_data,
                   global_batch_size=32, virtual_nodes=4, seed=5)
    ref, _, _ = reference_train(plain, 8)
    assert_state_close(r.state_dict, ref.state_dict(), rtol=1e-5, atol=1e-6)


def test_overrides_change_what_the_model_sees():
    r = vf.train(jobs.regression_job(), workers=1, steps=4, global_batch_size=64, virtual_nodes=4, seed=9)
    ref, _, _ = reference_train(jobs.regression_job(global_batch_size=64, virtual_nodes=4).replace(seed=9), 4)
    assert_state_close(r.state_dict, ref.state_dict(), rtol=1e-5, atol=1e-6)
    assert r.history[0]["samples"] == 64


def test_lambdas_and_closures_train_on_two_workers():
    """Jobs travel by value with cloudpickle: a closure returning a Job whose fields are lambdas."""
    def make(lr):
        return lambda: vf.Job(model=lambda: jobs.mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
                              loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                              dataset=lambda: jobs.regression_data(), global_batch_size=32, virtual_nodes=8,
                              lr_scheduler=lambda o: jobs.step_lr(o), seed=5)

    by_lambdas = vf.train(make(0.05), workers=2, steps=6, deterministic=True)
    by_module = vf.train(jobs.regression_job(), workers=1, steps=6, deterministic=True)
    assert_state_equal(by_lambdas.state_dict, by_module.state_dict)


MAIN_SCRIPT = '''
import sys, torch, virtualflow as vf
from torch import nn
from torch.utils.data import Dataset

class Squares(Dataset):  # defined in __main__: workers cannot import it, it travels by value
    def __len__(self): return 96
    def __getitem__(self, i):
        x = torch.full((4,), float(i) / 96)
        return x, (x ** 2).sum(0, keepdim=True)

def make_job():
    return vf.Job(model=lambda: nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), dataset=Squares,
                  global_batch_size=16, virtual_nodes=4, seed=3)

if __name__ == "__main__":
    two = vf.train(make_job, workers=2, steps=5, deterministic=True)
    one = vf.train(make_job(), workers=1, steps=5, deterministic=True)
    assert two.steps == 5 and all(torch.equal(two.state_dict[k], one.state_dict[k]) for k in one.state_dict)
    print("same model", two.history[-1]["loss"])
'''


def test_a_job_defined_in_main_trains_on_two_workers(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "main_job.py"
    script.write_text(MAIN_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "same model" in p.stdout
