"""The worker knobs travel whole: :class:`WorkerOptions` is derived from the ``LaunchOptions``
table (the fields marked ``worker=True``), survives the trips a worker configuration makes
(pickle, cloudpickle), and the engine factory decides, from the job's layout, what the worker
loop used to read from ``job.pipeline`` (runtime/factory.py)."""

from __future__ import annotations

import dataclasses
import pickle

import cloudpickle
import pytest
import torch

from virtualflow.config.options import LaunchOptions
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime import factory
from virtualflow.runtime.worker_config import WorkerConfig

import gpt_grid_jobs as g
import jobs


def config(**knobs) -> WorkerConfig:
    return WorkerConfig(options=WorkerOptions(**knobs), store_host="127.0.0.1", store_port=0, job_source=None,
                        total_steps=1, state_dir="/nonexistent", overrides={}, threads=1, resume_path=None,
                        initial_workers=1, slowdowns={})


def test_the_worker_options_are_the_tables_worker_knobs_with_their_defaults():
    table = {f.name: f for f in dataclasses.fields(LaunchOptions) if f.metadata["worker"]}
    derived = {f.name: f for f in dataclasses.fields(WorkerOptions)}
    assert list(derived) == list(table)
    assert {"reduction", "deterministic", "deterministic_exchange", "shard_replicas", "breakdown"} <= set(derived)
    assert all(derived[n].default == table[n].default and derived[n].type == table[n].type for n in table)
    assert "interface" not in derived  # resolved on each worker's machine: WorkerConfig's


def test_of_copies_the_values_as_given_and_the_object_is_frozen_and_picklable():
    opts = LaunchOptions(steps=1, reduction="sharded", shard_replicas=1, deterministic=True,
                         deterministic_exchange="slots", profile="3-4", checkpoint_format="dcp")
    w = WorkerOptions.of(opts)
    assert (w.reduction, w.shard_replicas, w.deterministic, w.deterministic_exchange, w.checkpoint_format) == \
        ("sharded", 1, True, "slots", "dcp")
    assert w.profile_steps == opts.profile_steps == (3, 5) and WorkerOptions().profile_steps is None
    assert pickle.loads(pickle.dumps(w)) == w and pickle.loads(cloudpickle.dumps(config(reduction="sharded"))) \
        == config(reduction="sharded")
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.reduction = "allreduce"
    assert "reduction" in WorkerOptions.__doc__ and "reduce-scatter" in WorkerOptions.__doc__


def test_the_factory_says_whether_the_generation_group_carries_hops_both_ways(monkeypatch):
    cpu = torch.device("cpu")
    vn_job = jobs.regression_job()
    assert factory.build_engine(config(), 0, vn_job, vn_job.build_dataset(), None, cpu).generation_hops_duplex is False
    pipelined = jobs.pipelined_job()
    engine = factory.build_engine(config(), 0, pipelined, pipelined.build_dataset(), None, cpu)
    assert engine.generation_hops_duplex is True  # no tensor parallelism: hops on the generation's group
    grid = g.grid_job(stages=2, tensor=2)
    assert factory.build_engine(config(), 0, grid, grid.build_dataset(), None, cpu).generation_hops_duplex is False
    # the subgroup passes the caller's duplex through (no longer read from the group's name)
    seen = []
    monkeypatch.setattr(factory, "make_subgroup", lambda *a, duplex, **kw: seen.append((a[2], duplex)))
    engine.subgroup(0, "plane0", 0, 2, duplex=True)
    engine.subgroup(0, "stage0", 0, 2)
    assert seen == [("plane0", True), ("stage0", False)]
