"""The worker's engine protocol (runtime/engines.py) and the one BatchNorm state module."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from virtualflow.runtime import worker
from virtualflow.runtime.batchnorm import BatchNormState, PieceBatchNorm
from virtualflow.runtime.engines import Engine
from virtualflow.runtime.pipeline.worker_engine import PipelineWorkerEngine
from virtualflow.runtime.vn_worker import VNWorkerEngine

ATTRIBUTES = {"model", "slowdown", "phase", "generation_broken"}


def protocol_methods() -> set[str]:
    return {n for n, v in vars(Engine).items() if not n.startswith("_") and callable(v)}


def test_both_engines_implement_every_method_of_the_protocol_with_its_parameters():
    methods = protocol_methods()
    assert {"adopt", "step", "abandon_step", "whole_state", "boundary", "hold", "close"} <= methods
    for cls in (VNWorkerEngine, PipelineWorkerEngine):
        for name in methods:
            impl = getattr(cls, name)
            want = list(inspect.signature(getattr(Engine, name)).parameters)
            assert list(inspect.signature(impl).parameters) == want, (cls.__name__, name)


def test_the_worker_never_asks_which_engine_it_runs():
    tree = ast.parse(Path(worker.__file__).read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"pipelined", "sharded", "collective_state", "stage", "shard"}
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"]


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2),
                               torch.nn.BatchNorm1d(2))


def test_batchnorm_holders_restore_to_the_snapshot_and_change_nothing_without_one():
    for holder_of in (BatchNormState, PieceBatchNorm):
        m = model().train()
        bn = holder_of(m)
        before = bn.flat().clone()
        assert bn and bn.numel == 12 and not bn.snapshotted
        m(torch.randn(5, 3))
        moved = bn.flat().clone()
        bn.restore()  # no snapshot: nothing changes
        assert torch.equal(bn.flat(), moved)
        bn.snapshot()
        assert bn.snapshotted
        m(torch.randn(5, 3))
        bn.restore()
        assert torch.equal(bn.flat(), moved) and not torch.equal(moved, before)
        bn.load_flat(before)
        assert torch.equal(bn.flat(), before)
    assert not BatchNormState(torch.nn.Linear(2, 2)) and not PieceBatchNorm(torch.nn.Linear(2, 2))
