"""Pipelines with loader threads (``--loader-workers``) in worker processes, on tensor-parallel
stages (the one combination the in-process pipeline driver cannot run: tensor-parallel stages
talk inside their forward and backward).

A (D, P, T) = (1, 2, 2) grid of GPT stages (tests/gpt_grid_jobs.py, float64) with two loader
threads per worker trains the same model, bit for bit in deterministic mode, as the (1, 1, 2)
layout without loader threads: T = 2 layouts are bit-identical to each other whatever P
(docs/parallel3d.md), and the loaders change when a micro-batch is read, never which samples it
holds. The first stage's two tensor ranks read the inputs, the last stage's the targets.
"""

from __future__ import annotations

import virtualflow as vf
from conftest import assert_state_equal
import gpt_grid_jobs as g

STEPS = 3


def _grid(stages: int):
    return lambda: g.grid_job(stages=stages, tensor=2)


def test_tensor_parallel_stages_with_loader_threads_train_the_same_model():
    loaded = vf.train(_grid(2), workers=4, steps=STEPS, deterministic=True, loader_workers=2)
    plain = vf.train(_grid(1), workers=2, steps=STEPS, deterministic=True)
    assert [h["step"] for h in loaded.history] == list(range(STEPS))
    assert_state_equal(loaded.state_dict, plain.state_dict)
    assert [h["loss"] for h in loaded.history] == [h["loss"] for h in plain.history]
