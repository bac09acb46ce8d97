"""Pairs of capabilities from docs/composition.md that no other test exercises together.

- The VN engine with the knobs of several rows at once, in this process (one engine per thread,
  real gloo groups over an in-process TCP store, as tests/e2e/test_hetero.py does): uneven VN maps
  that change between generations (what ``balance`` publishes, and what a survivor of a resize
  adopts), loader threads (``loader_workers``), the step breakdown, ``bf16-mixed`` and clipping,
  with either reduction - bit-identical in deterministic mode to one worker without any of the
  helpers, every breakdown adding up to its step.
- The refusals at launch (``virtualflow.launching.composition``): each is one line naming the
  value, the rule and the knob, raised before any worker starts.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import types

import pytest
import torch
import torch.distributed as dist

import virtualflow as vf
from virtualflow.backends.inprocess import build_engine, train_local
from virtualflow.comm.groups import Group, make_group
from virtualflow.config.pipeline import Pipeline
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.data import DataPlan
from virtualflow.runtime import breakdown
from virtualflow.runtime.pipeline.local import LocalDriver
from virtualflow.runtime.pipeline.requests import StepResult
from virtualflow.runtime.vn_worker import VNWorkerEngine
from conftest import assert_state_equal
import gpt_grid_jobs as g
import jobs
import pipeline_models as pm

CPU = torch.device("cpu")


def loop_job() -> vf.Job:
    """A dropout-free MLP (the threads share the process's generator) with bf16 autocast and a
    clip that acts (the norms are above it)."""
    return jobs.regression_job(precision="bf16-mixed", max_grad_norm=0.05)


def engine(job: vf.Job, *, reduction: str, loader_workers: int, breakdown_on: bool):
    ds = job.build_dataset()
    cfg = types.SimpleNamespace(options=WorkerOptions(deterministic=True, reduction=reduction, shard_replicas=0,
                                                      deterministic_exchange="auto", loader_workers=loader_workers,
                                                      breakdown=breakdown_on))
    return VNWorkerEngine.build(job, ds, DataPlan.of_job(job, len(ds)), cfg, CPU).vn


def train_in_threads(job: vf.Job, segments: list[tuple[list[list[int]], int]], **knobs):
    """One engine per rank, each in a thread; ``segments`` are generations ``(VN map, steps)`` over
    the same ranks. Returns each rank's final weights and rank 0's step outcomes."""
    n = len(segments[0][0])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    engines = [engine(job, **knobs) for _ in range(n)]  # built one after another: the generator is shared
    states: list = [None] * n
    outcomes: list = []
    errors: list = []

    def body(rank: int) -> None:
        groups = []
        try:
            eng, step = engines[rank], 0
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))
            for gen, (assignment, steps) in enumerate(segments):
                if gen:
                    eng.before_regroup()  # what a worker does between generations (sharded: gathers the state)
                group = make_group(client, gen, rank, n, 60.0, CPU) if n > 1 else Group(gen, 0, 1, None)
                groups.append(group)
                eng.set_membership(group, assignment)
                for _ in range(steps):
                    out = eng.step(step)
                    if rank == 0:
                        outcomes.append(out)
                    step += 1
            eng.close()
            states[rank] = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        finally:
            for group in groups:
                group.close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(s is not None for s in states), "a worker thread did not finish in 120 s"
    return states, outcomes


MAPS = [([[0, 1, 2, 3], [4, 5, 6, 7]], 2), ([[0, 1, 2, 3, 4, 5], [6, 7]], 2), ([[0], [1, 2, 3, 4, 5, 6, 7]], 2)]
"""Three generations of two workers: even, then the maps a speed-based rebalance publishes."""


@pytest.mark.parametrize("reduction", ["allreduce", "sharded"])
def test_rebalanced_maps_with_loaders_breakdown_bf16_and_clipping_are_one_workers_model(reduction):
    job = loop_job()
    steps = sum(s for _, s in MAPS)
    (ref,), ref_out = train_in_threads(job, [([list(range(8))], steps)], reduction="allreduce", loader_workers=0,
                                       breakdown_on=False)
    states, outs = train_in_threads(job, MAPS, reduction=reduction, loader_workers=2, breakdown_on=True)
    for state in states:
        assert_state_equal(state, ref)
    assert [o.loss for o in outs] == [o.loss for o in ref_out]
    assert [o.grad_norm for o in outs] == [o.grad_norm for o in ref_out]
    assert min(o.grad_norm for o in outs) > job.max_grad_norm, "the clip never acted"
    # The breakdown: every step but a generation's first reports both workers, parts adding up.
    reported = [o.breakdown for o in outs if o.breakdown is not None]
    assert len(reported) == steps - len(MAPS)
    for parts in reported:
        assert len(parts) == 2
        for p in parts:
            assert sum(p[k] for k in breakdown.PARTS) == pytest.approx(p["step_s"], rel=1e-5, abs=1e-6)


def test_a_peer_lost_mid_step_with_loaders_breakdown_bf16_and_clipping_is_one_workers_model():
    """A failure, engine side: worker 1 of 2 drops out before step 2 (its group closes, as a killed
    process's does); worker 0's step fails, it abandons it (its loader threads' batches dropped),
    adopts a generation alone and redoes the step - bit-identical to one worker without loaders,
    the breakdown of every later step adding up."""
    job = loop_job()
    steps, lost_at = 5, 2
    (ref,), ref_out = train_in_threads(job, [([list(range(8))], steps)], reduction="allreduce", loader_workers=0,
                                       breakdown_on=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    engines = [engine(job, reduction="allreduce", loader_workers=2, breakdown_on=True) for _ in range(2)]
    groups: list = [None, None]
    outs: list = []
    errors: list = []
    ready = threading.Barrier(2)

    def body(rank: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))
            groups[rank] = make_group(client, 0, rank, 2, 6.0, CPU)  # the lost peer surfaces within 6 s (3 s was too short to form the group on a loaded machine)
            engines[rank].set_membership(groups[rank], [[0, 1, 2, 3], [4, 5, 6, 7]])
            for s in range(lost_at):
                out = engines[rank].step(s)
                if rank == 0:
                    outs.append(out)
            ready.wait(timeout=60)
            if rank == 1:
                groups[1].close()  # lost: its connections close
                return
            eng = engines[0]
            with pytest.raises(Exception):
                eng.step(lost_at)
            eng.abandon_step()
            groups[0].close()
            eng.set_membership(Group(1, 0, 1, None), [list(range(8))])
            outs.extend(eng.step(s) for s in range(lost_at, steps))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    engines[0].close()
    engines[1].close()
    state = {k: v.detach().clone() for k, v in engines[0].model.state_dict().items()}
    assert_state_equal(state, ref)
    assert [o.loss for o in outs] == [o.loss for o in ref_out]
    assert [o.grad_norm for o in outs] == [o.grad_norm for o in ref_out]
    assert outs[lost_at].breakdown is None  # the new generation's first step
    for o in outs[lost_at + 1:]:
        (p,) = o.breakdown
        assert sum(p[k] for k in breakdown.PARTS) == pytest.approx(p["step_s"], rel=1e-5, abs=1e-6)


# -- pipelines -------------------------------------------------------------------------------------
def test_a_weight_tied_across_stages_with_unequal_replica_shares_is_the_unpipelined_model():
    """A tied embedding and head (stages 0 and 1) on 2 replicas running 5 and 1 of 6 micro-batches
    (the unequal blocks speed-weighted shares give, tests/unit/test_pipeline_weighted.py): each
    micro-batch's two uses meet before the VN tree whatever its replica, so deterministic mode is
    bit-identical to the unpipelined run."""
    job = pm.transformer_job(Pipeline(stages=2), virtual_nodes=6, model=pm.tied_gpt)
    dataset = job.build_dataset()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, job.pipeline, bounds, r % 2, dataset=dataset, deterministic=True, device=CPU,
                            eager_every_wait=False) for r in range(4)]
    driver = LocalDriver(engines)
    driver.set_layout([[0, 1, 2, 3, 4], [5]])
    steps = 3
    history = [h for t in range(steps) for h in driver.run(t, 1)]
    state = {k: v.detach().clone() for e in engines[:2] for k, v in e.model.state_dict().items()}
    ref_state, ref_losses = pm.unpipelined(job, steps, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses


needs_stage_breakdown = pytest.mark.skipif(
    "breakdown" not in StepResult.__dataclass_fields__,
    reason="the pipeline's step breakdown per stage (StepResult.breakdown) is not in this tree yet")


def _breakdown_adds_up(history: list, workers: int) -> None:
    assert history[0].breakdown is None  # a generation's first step has no previous one
    for h in history[1:]:
        assert h.breakdown is not None and len(h.breakdown) == workers
        for row in h.breakdown:
            assert sum(row[k] for k in breakdown.PARTS) == pytest.approx(row["step_s"], rel=1e-6, abs=1e-9)
            assert row["forward_s"] > 0 and row["backward_s"] > 0


@needs_stage_breakdown
def test_the_breakdown_of_a_pipeline_with_a_weight_tied_across_stages_adds_up():
    job = pm.transformer_job(Pipeline(stages=2), virtual_nodes=4, model=pm.tied_gpt)
    _, history = train_local(job, 3, replicas=2, deterministic=True)
    _breakdown_adds_up(history, 4)


@needs_stage_breakdown
def test_the_breakdown_of_a_redundant_pipeline_adds_up():
    job = pm.mlp_job(Pipeline(stages=3, redundancy=True), virtual_nodes=4)
    _, history = train_local(job, 3, deterministic=True)
    _breakdown_adds_up(history, 3)


# -- refused at launch ----------------------------------------------------------------------------
def _tensor_job() -> vf.Job:
    return g.grid_job(stages=1, tensor=2)


def test_emulated_slowdowns_without_balance_still_run_tensor_parallel_launch_checks():
    """``balance=False`` keeps slowdowns as emulation only: the balance refusal does not fire (the
    launch goes on to the next check, here that every block splits ``tensor`` ways)."""
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by tensor=3"):
        vf.train(lambda: g.grid_job(stages=1, tensor=3), workers=3, steps=1, slowdowns=[1, 2, 3], balance=False)


def test_a_failure_with_balance_on_maps_the_survivors_by_their_measured_speed():
    """balance + a failure, in the membership controller (a fake launcher, a real store; no
    process): worker 2 is 3x slower, so the map is rebalanced; when worker 0 dies, the failure
    generation maps all 8 VNs over the two survivors by the speeds measured so far (the slow one
    gets fewer), and the survivors adopt it as the engines above adopt any uneven map."""
    from test_membership import _feed, joined_and_formed, make, record

    ctl, coord, launcher, _ = make(3, balance=True, min_observations=2, rebalance_patience=2)
    joined_and_formed(ctl, [0, 1, 2], 0)
    at = _feed(ctl, 0, 0, 20, 0.32, [0.1, 0.1, 0.3])
    assert at is not None and ctl.generation == 1 and record(coord, 1).reason == "rebalance"
    ctl.tick([{"type": "formed", "generation": 1, "members": [0, 1, 2], "step": at + 1, "group_s": 0,
               "transfer_s": 0, "bytes": 0, "source": None, "receivers": []}])
    launcher.codes[0] = -9
    ctl.tick([])
    rec = record(coord, 2)
    assert rec.reason == "failure" and rec.members == [1, 2]
    assert sorted(v for a in rec.assignment for v in a) == list(range(8))
    assert len(rec.assignment[0]) > len(rec.assignment[1]) > 0  # by speed: the fast survivor gets more


# -- the page -------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPABILITIES = ["pipeline", "tensor parallel", "sharded reduction", "deterministic", "heterogeneous speeds",
                "autoscaler", "resize", "failure recovery", "Bamboo", "tied weights", "breakdown",
                "overlapped input", "mixed precision", "clipping", "sharded parameters"]


def test_the_composition_page_has_one_row_per_pair_and_names_tests_that_exist():
    """docs/composition.md: every pair of the 15 capabilities once, each "works" or "refused at
    launch" row naming a test, the counts line true, and every test named there defined in its
    file (files of features not in this tree yet are listed in the skip reason)."""
    text = open(os.path.join(ROOT, "docs", "composition.md")).read()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and line.count("|") == 5 and not line.startswith("| A ")]
    rows = [r for r in rows if r[0] in CAPABILITIES]
    pairs = [(r[0], r[1]) for r in rows]
    want = [(a, b) for i, a in enumerate(CAPABILITIES) for b in CAPABILITIES[i + 1:]]
    assert pairs == want
    status = [r[2] for r in rows]
    assert set(status) <= {"works", "refused at launch", "unknown"}
    counts = {s: status.count(s) for s in ("works", "refused at launch", "unknown")}
    assert (f"105 pairs: **{counts['works']} works**, **{counts['refused at launch']} refused at launch**, "
            f"**{counts['unknown']} unknown**") in text
    missing_files = set()
    for a, b, s, cell in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`", cell)
        if s != "unknown":
            assert named, (a, b)
        for path, name in named:
            full = os.path.join(ROOT, path)
            if not os.path.exists(full):
                missing_files.add(path)
                continue
            assert re.search(rf"^(async )?def {name}\(", open(full).read(), re.M), f"{path}::{name} ({a} + {b})"
    if missing_files:
        pytest.skip(f"named on the page, not in this tree yet: {sorted(missing_files)}")
