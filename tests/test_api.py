"""The public surface: job forms, Result, run directory, launch/status/wait, evaluation."""

from __future__ import annotations

import json
import os

import torch

import virtualflow as vf
from conftest import assert_state_close, assert_state_equal
import jobs
from reference import reference_train

HERE = os.path.dirname(os.path.abspath(__file__))


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
