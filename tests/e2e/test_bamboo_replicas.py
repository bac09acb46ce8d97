"""Bamboo inside a job of several pipeline replicas: a lost worker's predecessor *in its own
replica* takes its stage over; that replica goes on one worker shorter while the others stay at
full depth, and each job stage is still reduced over every replica, in replica order.

Pure: the per-replica decisions (:mod:`virtualflow.plan.pipeline.failover`) and the controller's
use of them (a fake launcher). In-process: a failed-over replica (one worker running two job
stages) beside a full-depth one trains the undisturbed model bit for bit, from the first step.
In processes: a worker killed mid-step in a 2 x 3 job; the job goes on, the model is the
undisturbed one.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import virtualflow as vf
from virtualflow.plan.pipeline.geometry import Grid, bounds_from_counts, layers_of, piece_module, resolve_bounds
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.failover import (
    Fallback, ReplicasFailover, failover_replicas, flatten, reconfigure_replicas, split_replicas, standard,
)
from virtualflow.plan.vnmap import contiguous_assignment, split
from virtualflow.runtime.pipeline import (AllSum, Expect, Poll, Recv, Send, StageEngine, StageSum, StageTree,
                                          TreeOpen, TreePart)
from virtualflow.backends.inprocess import build_engine
from test_bamboo import assert_same, engines_of, job, undisturbed
from test_membership import joined_and_formed, make, record
import jobs

S3 = standard(3)


# -- decisions (pure) -----------------------------------------------------------------------------

def test_a_flat_layout_splits_into_its_replicas_at_each_first_stage():
    flat = ((0,), (1,), (2,), (0, 1), (2,))
    assert split_replicas(flat, 3) == (S3, ((0, 1), (2,)))
    assert flatten(split_replicas(flat, 3)) == flat
    assert split_replicas([[0, 1, 2]], 3) == (((0, 1, 2),),)
    with pytest.raises(ValueError, match="consecutive stages"):
        split_replicas([[0], [2], [0], [1], [2]], 3)


def test_only_the_hit_replica_fails_over_and_the_others_stay_at_full_depth():
    got = failover_replicas((S3, S3), [4])  # replica 1, stage 1
    assert got == ReplicasFailover(layouts=(S3, ((0, 1), (2,))), survivors=(0, 1, 2, 3, 5), taken_over={4: 3},
                                   failed_over=(1,), left={}, kept=(0, 1))
    assert got.layout == ((0,), (1,), (2,), (0, 1), (2,))
    first = failover_replicas((S3, S3), [0])  # replica 0's first stage: to its second worker
    assert first.layouts == (((0, 1), (2,)), S3) and first.taken_over == {0: 1} and first.survivors == (1, 2, 3, 4, 5)
    both = failover_replicas((S3, S3, S3), [1, 8])  # one loss in each of two replicas
    assert both.layouts == (((0, 1), (2,)), S3, ((0,), (1, 2))) and both.failed_over == (0, 2)
    # A replica already failed over loses another, coverable worker: it shrinks again.
    again = failover_replicas((S3, ((0,), (1, 2))), [3])
    assert again.layouts == (S3, ((0, 1, 2),)) and again.survivors == (0, 1, 2, 4)


def test_a_replica_that_cannot_cover_its_loss_leaves_whole_while_another_goes_on():
    got = failover_replicas((S3, S3), [4, 5])  # consecutive stages 1 and 2 of replica 1
    assert got.layouts == (S3,) and got.survivors == (0, 1, 2) and got.kept == (0,) and got.failed_over == ()
    assert re.search(r"consecutive stages 1 and 2", got.left[1])
    mixed = failover_replicas((S3, ((0,), (1, 2))), [1, 4])  # replica 1's doubled worker lost
    assert mixed.layouts == (((0, 1), (2,)),) and mixed.failed_over == (0,) and list(mixed.left) == [1]
    assert re.search(r"running stages \[1, 2\]", mixed.left[1])


def test_the_job_falls_back_only_when_no_replica_survives():
    got = failover_replicas((S3, S3), [1, 2, 3, 4])
    assert isinstance(got, Fallback)
    assert re.search(r"every pipeline replica.*replica 0: .*consecutive stages 1 and 2.*replica 1: .*first stage",
                     got.reason), got.reason
    single = failover_replicas((S3,), [1, 2])  # one replica: the single-pipeline decision, unchanged
    assert isinstance(single, Fallback) and re.search(r"consecutive stages 1 and 2", single.reason)
    with pytest.raises(ValueError, match="not indices of a 6-worker layout"):
        failover_replicas((S3, S3), [6])


def test_reconfiguration_restores_each_short_replica_in_replica_order():
    short = ((0,), (1, 2))
    got = reconfigure_replicas((short, S3, ((0, 1), (2,))), 1)
    assert got.layout == flatten((S3, S3, ((0, 1), (2,)))) and got.order == (0, 1, None, 2, 3, 4, 5, 6)
    got = reconfigure_replicas((short, S3, ((0, 1), (2,))), 3)
    assert got.layout == flatten((S3, S3, S3)) and got.order == (0, 1, None, 2, 3, 4, 5, None, 6)


# -- the controller (pure: a fake launcher) ---------------------------------------------------------

def redundant_controller(workers=6, **kw):
    ctl, coord, launcher, clock = make(workers, **kw)
    ctl.stages, ctl.redundancy = 3, True
    joined_and_formed(ctl, list(range(workers)), 0)
    return ctl, coord, launcher


def test_the_controller_fails_over_inside_the_hit_replica_only():
    ctl, coord, launcher = redundant_controller()
    launcher.codes[4] = -9
    ctl.tick([])
    rec = record(coord, 1)
    assert rec.members == [0, 1, 2, 3, 5] and rec.reason == "failover"
    assert rec.layout == [[0], [1], [2], [0, 1], [2]]
    assert rec.assignment == [[0, 1, 2, 3]] * 3 + [[4, 5, 6, 7]] * 2  # equal shares per replica
    assert ctl.bamboo_events == [{"kind": "failover", "step": 0, "layout": [[0, 1], [2]], "replica": 1,
                                  "failed": [4]}]
    assert ctl.target == 5  # no replace_failed: the short replica stays short


def test_the_controller_drops_an_uncoverable_replica_and_keeps_the_other():
    ctl, coord, launcher = redundant_controller()
    launcher.codes[0] = launcher.codes[2] = -9  # replica 0: stages 2 and 0 (cyclically consecutive)
    ctl.tick([])
    rec = record(coord, 1)
    assert rec.members == [3, 4, 5] and rec.layout is None and rec.reason == "failure"
    assert ctl.bamboo_events == []


def test_the_controller_falls_back_when_every_replica_is_uncoverable():
    from virtualflow.control.membership import FallbackRestart

    ctl, coord, launcher = redundant_controller()
    launcher.codes[1] = launcher.codes[2] = launcher.codes[3] = launcher.codes[5] = -9
    with pytest.raises(FallbackRestart, match=r"every pipeline replica.*redundancy cannot cover the loss"):
        ctl.tick([])
    assert [e["kind"] for e in ctl.bamboo_events] == ["fallback_restart"]


def test_replace_failed_reforms_the_short_replica_at_full_depth():
    ctl, coord, launcher = redundant_controller(replace_failed=True)
    launcher.codes[1] = -9
    ctl.tick([])
    assert record(coord, 1).layout == [[0, 1], [2], [0], [1], [2]] and launcher.started[-1] == 6
    assert ctl.target == 6
    ctl.tick([{"type": "formed", "generation": 1, "members": [0, 2, 3, 4, 5], "step": 3, "group_s": 0,
               "transfer_s": 0, "bytes": 0, "source": None, "receivers": []}])
    ctl.tick([{"type": "join", "worker": 6, "setup_s": 0.0}])
    rec = record(coord, 2)
    assert rec.reason == "reconfigure" and rec.members == [0, 6, 2, 3, 4, 5]
    assert rec.layout == [[0], [1], [2], [0], [1], [2]] and ctl.layout is None


def test_a_notice_in_one_replica_is_a_planned_failover_there():
    ctl, coord, launcher = redundant_controller()
    ctl.tick([{"type": "notice", "worker": 5, "step": 2}])
    rec = record(coord, 1)
    assert rec.members == [0, 1, 2, 3, 4] and rec.layout == [[0], [1], [2], [0], [1, 2]]
    assert rec.reason == "preempted" and not ctl.failures


# -- the per-stage reduction, in process: bit for bit from the first step ---------------------------

class LayoutDriver:
    """All workers of a job whose replicas have different layouts, in this process, cooperatively
    (as :class:`virtualflow.runtime.pipeline.local.LocalDriver`, which knows full-depth replicas
    only): point to point within a replica, each stage collective over the workers of that job
    stage, one per replica, in replica order."""

    def __init__(self, workers: list[tuple[StageEngine, int, int, tuple[int, ...]]], V: int) -> None:
        self.workers = workers  # (engine, replica, position, job stages)
        self.V = V

    def run(self, step: int) -> None:
        gens = [e.steps(step, 1) for e, *_ in self.workers]
        pending, answer, live, mail = [None] * len(gens), [None] * len(gens), set(range(len(gens))), {}

        def advance(i: int) -> None:
            try:
                pending[i] = gens[i].send(answer[i]) if pending[i] is not None else next(gens[i])
            except StopIteration:
                live.discard(i)
            answer[i] = None

        def stage_of(i: int) -> int:
            req, (_, _, _, stages) = pending[i], self.workers[i]
            return req.stage if req.stage is not None else stages[0]

        for i in range(len(gens)):
            advance(i)
        while live:
            moved = False
            for i in sorted(live):
                while i in live:
                    req, (_, rep, pos, _) = pending[i], self.workers[i]
                    if isinstance(req, Send):
                        mail[rep, req.peer, req.key] = req.tensors
                    elif isinstance(req, Poll):
                        answer[i] = (rep, pos, req.key) in mail
                    elif isinstance(req, Recv):
                        if (rep, pos, req.key) not in mail:
                            break
                        answer[i] = mail.pop((rep, pos, req.key))
                    elif not isinstance(req, (Expect, TreeOpen, TreePart)):  # (hints: nothing to do here)
                        break
                    advance(i)
                    moved = True
            if live and all(isinstance(pending[i], AllSum) for i in live) and len(live) == len(gens):
                total = pending[0].vector.clone()
                for i in range(1, len(gens)):
                    total += pending[i].vector
                for i in range(len(gens)):
                    answer[i] = total.clone()
                    advance(i)
                moved = True
            for s in range(max(max(w[3]) for w in self.workers) + 1):
                members = sorted((i for i in range(len(gens)) if s in self.workers[i][3]),
                                 key=lambda i: self.workers[i][1])
                if not all(i in live and isinstance(pending[i], (StageSum, StageTree)) and stage_of(i) == s
                           for i in members):
                    continue
                if isinstance(pending[members[0]], StageSum):
                    total = pending[members[0]].vector.clone()
                    for i in members[1:]:
                        total += pending[i].vector
                else:
                    known = {}
                    for i in members:
                        known.update(pending[i].nodes)
                    total = _combine(known, (0, self.V))
                for i in members:
                    answer[i] = total.clone()
                    advance(i)
                moved = True
            assert moved or not live, [repr(pending[i])[:100] for i in sorted(live)]


def _combine(known, node):
    if node in known:
        return known[node]
    left, right = split(node)
    return _combine(known, left) + _combine(known, right)


def merged_engine(j: vf.Job, runs: tuple[tuple[int, ...], ...], pos: int, dataset, deterministic: bool) -> StageEngine:
    """Worker ``pos`` of a replica laid out as ``runs`` (built as a re-layout builds it)."""
    from virtualflow.plan.data import DataPlan
    from virtualflow.runtime.engine import BatchLoader

    torch.manual_seed(j.seed)
    layers = layers_of(j.model())
    full = resolve_bounds(j.pipeline, len(layers))
    counts = [full[run[-1]][1] - full[run[0]][0] for run in runs]
    bounds = bounds_from_counts(counts)
    m = len(runs)
    pipeline = Pipeline(stages=m, schedule=j.pipeline.schedule, split=counts, redundancy=m >= 2)
    (a, b), (sa, sb) = bounds[pos], bounds[(pos + 1) % m]
    engine = StageEngine(
        pieces={pos: piece_module(layers, a, b)}, n_pieces=m, stage_rank=pos, build_optimizer=j.build_optimizer,
        scheduler_factory=j.lr_scheduler, pipeline=pipeline,
        plan=DataPlan(len(dataset), j.global_batch_size, j.virtual_nodes, j.seed),
        loader=BatchLoader(dataset, j.collate_fn), model_input=j.input_of, output_loss=j.output_loss, seed=j.seed,
        batchnorm=j.batchnorm, deterministic=deterministic, device=torch.device("cpu"),
        successor_pieces={(pos + 1) % m: piece_module(layers, sa, sb)} if m >= 2 else None,
    )
    if len(runs[pos]) > 1:
        engine.set_job_stages([(s, *full[s]) for s in runs[pos]])
    return engine


@pytest.mark.parametrize("deterministic,short", [(True, ((0, 1), (2,))), (True, ((0,), (1, 2))),
                                                 (False, ((0,), (1, 2)))])
def test_a_failed_over_replica_beside_a_full_one_trains_the_undisturbed_model(deterministic, short):
    """Replica 0 at full depth (3 workers), replica 1 failed over (one worker runs two job
    stages and reduces each over its own job stage's workers): every worker's model after 4 steps
    is the undisturbed 2 x 3 job's (deterministic mode: bit for bit; default: within float
    tolerance), and every replica is its successor's state."""
    j = job(3)
    dataset = j.build_dataset()
    V = j.virtual_nodes
    assignment = contiguous_assignment(V, 2)
    bounds = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    ref, ref_driver = engines_of(j, 2, deterministic)  # the undisturbed job, run by the LocalDriver
    full = [build_engine(j, j.pipeline, bounds, r, dataset=dataset, deterministic=deterministic,
                         device=torch.device("cpu")) for r in range(3)]
    workers = [(e, 0, r, (r,)) for r, e in enumerate(full)]
    workers += [(merged_engine(j, short, pos, dataset, deterministic), 1, pos, short[pos]) for pos in range(2)]
    for e, rep, *_ in workers:
        e.set_layout(rep, assignment)
    driver = LayoutDriver(workers, V)
    for t in range(4):
        ref_driver.run(t, 1)
        driver.run(t)
    want = {}
    for e in ref[:3]:
        want.update(e.model.state_dict())
    for e, rep, pos, stages in workers:
        got = e.model.state_dict()
        for k, v in got.items():
            if deterministic:
                assert_same(v, want[k], f"replica {rep} worker {pos} {k}")
            else:
                torch.testing.assert_close(v, want[k], msg=f"replica {rep} worker {pos} {k}")
    # The merged worker's optimizer state is the undisturbed stages' (one parameter group, in order).
    merged = next(e for e, rep, pos, stages in workers if len(stages) > 1)
    want_opt = [ref[s].optimizer.state_dict()["state"] for s in next(st for *_, st in workers if len(st) > 1)]
    got_opt = merged.optimizer.state_dict()["state"]
    flat_want = [v for st in want_opt for _, v in sorted(st.items())]
    assert len(got_opt) == len(flat_want)
    for (_, g), w in zip(sorted(got_opt.items()), flat_want):
        for key in w:
            if deterministic:
                assert_same(g[key], w[key], f"optimizer {key}")
            else:
                torch.testing.assert_close(g[key], w[key])
    # Replicas: the short replica's workers hold each other's stages, fresh.
    a, b = [e for e, rep, *_ in workers if rep == 1]
    assert_same(a.replica_of_successor.model.state_dict(), b.model.state_dict(), "replica of the successor")
    assert_same(b.replica_of_successor.model.state_dict(), a.model.state_dict(), "replica of the successor")


def test_grid_places_ranks_in_replicas_of_different_depths():
    g = Grid(3, 2, 4, sizes=(3, 2))
    assert (g.replica, g.stage_rank, g.rank_of(1, 0), g.rank_of(0, 2)) == (1, 1, 3, 2)
    assert "2 pipeline replicas of 3, 2 workers" in g.describe()
    with pytest.raises(ValueError, match="rank 5 is not in 2 replicas"):
        Grid(3, 2, 5, sizes=(3, 2))


# -- in processes ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_worker_killed_mid_step_fails_over_in_its_replica_and_the_model_is_undisturbed(run_dir, monkeypatch):
    """2 replicas x 3 stages, deterministic: replica 1's middle worker SIGKILLs itself in its
    first backward of step 3. Its predecessor takes stage 1 over; replica 0 stays at full depth;
    no step is lost or recorded twice; the final model is the undisturbed run's, bit for bit."""
    from conftest import assert_state_equal

    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    plan = vf.FaultPlan([vf.Fault(worker=4, step=3, phase="mid_backward")])
    result = vf.train(jobs.pipelined_redundant_job, workers=6, steps=6, deterministic=True, fault_plan=plan,
                      run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [4]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [6, 5]
    assert [h["step"] for h in result.history] == list(range(6))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    failover = [e for e in events if e["event"] == "failover"]
    assert [(e["replica"], e["layout"], e["taken_over"]) for e in failover] == [(1, [[0, 1], [2]], {"4": 3})]
    assert_state_equal(result.state_dict, undisturbed(3, 6))


@pytest.mark.slow
def test_the_short_replica_reforms_at_full_depth_when_a_worker_returns(run_dir):
    """replace_failed: replica 1's last worker dies in its step-3 reduction; its predecessor runs stages 1-2 while replica 0
    stays at full depth; the replacement, once ready, takes stage 2 back (6 workers, full depth
    again); every step once, the undisturbed model."""

    from conftest import assert_state_equal, wait_for_members, wait_for_step

    plan = vf.FaultPlan([vf.Fault(worker=5, step=3, phase="during_reduction")])
    handle = vf.launch(jobs.pipelined_redundant_job, workers=6, steps=1_000_000, deterministic=True,
                       fault_plan=plan, replace_failed=True, run_dir=run_dir)
    wait_for_members(handle, 6, formed=True, generation=2, timeout_s=90)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [6, 5, 6]
    assert [h["step"] for h in result.history] == list(range(result.steps))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [(e["replica"], e["layout"]) for e in events if e["event"] == "failover"] == [(1, [[0], [1, 2]])]
    assert [e["layout"] for e in events if e["event"] == "reconfigure"] == [[[0], [1], [2], [0], [1], [2]]]
    assert_state_equal(result.state_dict, undisturbed(3, result.steps))


@pytest.mark.slow
def test_a_preemption_notice_in_one_replica_hands_its_stage_over_at_a_step_boundary(run_dir):
    """SIGTERM to replica 0's last worker of a 2 x 3 job: at the next step boundary its
    predecessor takes stage 2 over, replica 1 stays at full depth, the noticed worker leaves
    cleanly: no failure, no step redone, the undisturbed model."""
    import signal

    from conftest import assert_state_equal, wait_for_members, wait_for_step

    handle = vf.launch(jobs.pipelined_redundant_job, workers=6, steps=1_000_000, deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 3)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 2)
    os.kill(victim["pid"], signal.SIGTERM)
    wait_for_members(handle, 5, formed=True)
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    assert result.failures == []
    assert [h["step"] for h in result.history] == list(range(result.steps))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [(e["replica"], e["layout"], e["noticed"]) for e in events if e["event"] == "failover"] == \
        [(0, [[0], [1, 2]], [victim["id"]])]
    assert [e["worker"] for e in events if e["event"] == "leave"] == [victim["id"]]
    assert_state_equal(result.state_dict, undisturbed(3, result.steps))
