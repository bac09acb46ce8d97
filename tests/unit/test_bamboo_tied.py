"""Bamboo redundancy with a weight tied across pipeline workers (a GPT's embedding and head).

- Every worker's replica of its successor's stage holds its own copy of the tied weight (not the
  holder's parameter object, which the holder updates itself), equal to its source after every
  step; the trained model is the unpipelined single-worker model bit for bit (deterministic mode).
- A worker is lost mid-step (its first backward); the survivors re-lay the pipeline as a Bamboo
  failover does (``StageBuilder.relaid`` from the states they hold, the stage taken over from
  the replica), redo the step and train on: the model is the undisturbed run's and the
  unpipelined run's (deterministic mode: bit for bit; default mode: within float tolerance) -
  whether the two uses of the tied weight end up on two workers (the exchange re-planned between
  the new holders) or on one worker (2 stages -> 1 worker; and 3 stages with the tie between
  stages 0 and 1, where the redone step also splices in the eager forwards of the replica's copy).
- Two replicas, one failed over beside one at full depth: each job stage is reduced over the
  workers that run it, the tied weight's uses with their job stages; the model is the undisturbed
  two-replica job's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipeline_models as pm
from conftest import assert_state_equal
from test_bamboo_replicas import LayoutDriver
from virtualflow.backends.inprocess import LocalDriver, build_engine, train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import DataPlan
from virtualflow.plan.pipeline.failover import failover_replicas
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.layout import StageBuilder, held_states
from virtualflow.runtime.pipeline.tensor_stage import TensorStage

CPU = torch.device("cpu")
STEPS = 4


class Lost(Exception):
    """The lost worker's end (raised at its first backward of the interrupted step)."""


def _tied_near() -> nn.Sequential:
    """Layer 3 reads layer 0's weight (an MLP; the tie between job stages 0 and 1 below)."""
    first, third = nn.Linear(pm.FEATURES, pm.FEATURES), nn.Linear(pm.FEATURES, pm.FEATURES)
    third.weight = first.weight
    return nn.Sequential(first, nn.ReLU(), nn.Dropout(0.2), third, nn.Tanh(), nn.Linear(pm.FEATURES, 1))


def gpt_job(p: int):
    return pm.transformer_job(Pipeline(stages=p, redundancy=True), virtual_nodes=4, model=pm.tied_gpt)


def near_job():
    return pm.mlp_job(Pipeline(stages=3, split=(3, 2, 1), redundancy=True), virtual_nodes=4, model=_tied_near,
                      optimizer="adam")


def _engines(job, deterministic: bool, replicas: int = 1):
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    dataset = job.build_dataset()
    p = job.pipeline.stages
    engines = [build_engine(job, job.pipeline, bounds, r % p, dataset=dataset, deterministic=deterministic,
                            device=CPU, eager_every_wait=True) for r in range(p * replicas)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, replicas))
    return engines, driver, bounds, dataset


def _whole(engines) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for e in engines for k, v in e.model.state_dict().items()}


def _assert_replicas_fresh(engines) -> None:
    for r, e in enumerate(engines):
        source = engines[(r + 1) % len(engines)]
        assert_state_equal(e.replica_of_successor.model.state_dict(), source.model.state_dict())
        mine = {id(q) for q in e.model.parameters()}
        assert not any(id(q) in mine for q in e.replica_of_successor.model.parameters())


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_replica_holds_its_own_copy_of_the_tied_weight_equal_to_its_source(p, deterministic):
    job = gpt_job(p)
    engines, driver, _, _ = _engines(job, deterministic)
    for t in range(STEPS):
        driver.run(t, 1)
        _assert_replicas_fresh(engines)
    state = _whole(engines)
    assert torch.equal(state["0.tok.weight"], state["5.weight"])
    ref, _ = pm.unpipelined(job, STEPS, deterministic)
    if deterministic:
        assert_state_equal(state, ref)
    else:
        for k in ref:
            torch.testing.assert_close(state[k], ref[k])


def _fail_over(job, lost: int, at: int, replicas: int = 1, deterministic: bool = True, back_at: int | None = None):
    """Train ``job`` (eager forwards at every wait), lose worker ``lost`` at its first backward of
    step ``at``, re-lay the survivors as a failover does (each replica re-laid by its own
    survivors) and train on to ``STEPS``; returns the final whole model, the re-laid engines
    with their replica and position, and the hit replica's layout."""
    engines, driver, bounds, dataset = _engines(job, deterministic, replicas)
    p = job.pipeline.stages
    for t in range(at):
        driver.run(t, 1)

    def die(phase: str) -> None:
        if phase == "mid_backward":
            raise Lost

    engines[lost].fault_point = die
    with pytest.raises(Lost):
        driver.run(at, 1)
    decision = failover_replicas([tuple((s,) for s in range(p))] * replicas, [lost])
    builder = StageBuilder(job, dataset, DataPlan.of_job(job, len(dataset)), deterministic, CPU, True, False)
    workers, flat = [], iter(decision.survivors)
    for j, runs in enumerate(decision.layouts):
        survivors = [next(flat) for _ in runs]
        got: dict[int, dict] = {}
        for r in survivors:  # the stages each survivor runs win over replicas of them
            e = engines[r]
            e.discard_step()
            for s, st in held_states(e, (r % p,), ((r + 1) % p,), bounds).items():
                if s not in got or s == r % p:
                    got[s] = st
        for pos, r in enumerate(survivors):
            # (each worker gets its own copy of the states, as over the wire: the optimizer's load keeps tensors)
            e, _ = builder.relaid(job.pipeline, bounds, [list(run) for run in runs], pos, copy.deepcopy(got),
                                  engines[r].replica_of_successor, by_job_stage=replicas > 1,
                                  tensor=TensorStage(job.pipeline, bounds, CPU))
            workers.append((e, j, pos, tuple(runs[pos])))
    assignment = contiguous_assignment(job.virtual_nodes, replicas)
    for e, j, *_ in workers:
        e.set_layout(j, assignment)
    run = LayoutDriver(workers, job.virtual_nodes).run if replicas > 1 else LocalDriver([w[0] for w in workers]).run
    for t in range(at, STEPS if back_at is None else back_at):
        run(t) if replicas > 1 else run(t, 1)
    if back_at is not None:  # a newcomer: the pipeline reconfigures to full depth (one replica)
        workers = _back_to_full_depth(job, [w[0] for w in workers], [w[3] for w in workers], bounds, builder)
        run = LocalDriver([w[0] for w in workers]).run
        for e, j, *_ in workers:
            e.set_layout(j, assignment)
        for t in range(back_at, STEPS):
            run(t, 1)
    for j in range(replicas):
        mine = [e for e, rep, *_ in workers if rep == j]
        if len(mine) >= 2:
            _assert_replicas_fresh(mine)
    hit = next(runs for runs in decision.layouts if len(runs) < p)
    return _whole(e for e, rep, *_ in workers if rep == 0), workers, [list(run) for run in hit]


def _back_to_full_depth(job, engines, runs, bounds, builder):
    """The states the failed-over workers hold (their stages, their replicas'), each job stage
    re-laid on a worker of its own (a reconfiguration with a newcomer)."""
    m, p = len(engines), job.pipeline.stages
    got: dict[int, dict] = {}
    for pos, e in enumerate(engines):
        for s, st in held_states(e, tuple(runs[pos]), tuple(runs[(pos + 1) % m]) if m >= 2 else (), bounds).items():
            if s not in got or s in runs[pos]:
                got[s] = st
    full = [[s] for s in range(p)]
    return [(builder.relaid(job.pipeline, bounds, full, pos, copy.deepcopy(got), None, by_job_stage=False,
                            tensor=TensorStage(job.pipeline, bounds, CPU))[0], 0, pos, (pos,)) for pos in range(p)]


CASES = [  # (job, lost worker, the layout after the failover, the tied weight's two names)
    ("gpt3", 2, [[0], [1, 2]], ("0.tok.weight", "5.weight")),  # the tie across workers 0 and 1
    ("gpt3", 1, [[0, 1], [2]], ("0.tok.weight", "5.weight")),  # the tie across the merged worker and worker 1
    ("gpt3", 0, [[0, 1], [2]], ("0.tok.weight", "5.weight")),  # stage 0 from the last worker's replica
    ("gpt2", 1, [[0, 1]], ("0.tok.weight", "5.weight")),       # both uses on one worker, one piece
    ("near", 1, [[0, 1], [2]], ("0.weight", "3.weight")),      # both uses on the merged worker, spliced in
]
JOBS = {"gpt3": lambda: gpt_job(3), "gpt2": lambda: gpt_job(2), "near": near_job}


def _assert_model(got: dict, want: dict, deterministic: bool) -> None:
    """Bit for bit in deterministic mode; default mode sums in another order (float tolerance)."""
    if deterministic:
        assert_state_equal(got, want)
    else:
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], msg=k)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name,lost,layout,tied", CASES, ids=[f"{c[0]}-lost{c[1]}" for c in CASES])
def test_a_tied_gpt_fails_over_mid_step_to_the_undisturbed_and_unpipelined_model(name, lost, layout, tied,
                                                                                 deterministic):
    job = JOBS[name]()
    state, relaid, runs = _fail_over(job, lost, at=2, deterministic=deterministic)
    assert runs == layout
    undisturbed, _ = train_local(job, STEPS, deterministic=deterministic)
    ref, _ = pm.unpipelined(job, STEPS, deterministic)
    _assert_model(state, undisturbed, deterministic)
    _assert_model(state, ref, deterministic)
    assert torch.equal(state[tied[0]], state[tied[1]])
    torch.manual_seed(job.seed)
    assert not torch.equal(state[tied[0]], job.model().state_dict()[tied[0]])  # it trained
    if (name, lost) in (("gpt3", 2), ("near", 1)):  # the redone step took the lost stage, which reads the
        # tied weight, from the eager forwards run on the replica's copy of it
        assert sum(e.reused_forwards for e, *_ in relaid) > 0


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name,lost", [("gpt3", 5), ("gpt3", 4), ("gpt3", 1), ("near", 4), ("near", 1),
                                       ("gpt2", 3), ("gpt2", 0)])
def test_a_failed_over_replica_beside_a_full_one_with_a_tied_weight(name, lost, deterministic):
    """Two replicas, one fails over: each job stage (the tied weight's uses with it) is reduced
    over the workers that run it - where the failed-over replica runs both uses on one worker, in
    default mode each use keeps a twin copy so that its gradient goes with its own job stage -
    and the model is the undisturbed two-replica job's (deterministic mode: bit for bit)."""
    job = JOBS[name]()
    job = job.replace(virtual_nodes=8, global_batch_size=2 * job.global_batch_size)
    state, workers, _ = _fail_over(job, lost, at=2, replicas=2, deterministic=deterministic)
    undisturbed, _ = train_local(job, STEPS, replicas=2, deterministic=deterministic)
    for e, rep, pos, _ in workers:
        for k, v in e.model.state_dict().items():
            if deterministic:
                assert_state_equal({k: v}, {k: undisturbed[k]})
            else:
                torch.testing.assert_close(v, undisturbed[k])


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name,lost", [("gpt2", 1), ("near", 1), ("gpt3", 2)])
def test_a_failed_over_pipeline_with_a_tied_weight_reconfigures_to_full_depth(name, lost, deterministic):
    """After the failover (step 1) a newcomer arrives (step 3): each job stage goes back to a
    worker of its own, with the tied weight's copy and its optimizer state from whoever ran or held
    the stage - also where one worker ran both uses - and the model is the unpipelined run's."""
    job = JOBS[name]()
    state, _, _ = _fail_over(job, lost, at=1, deterministic=deterministic, back_at=3)
    ref, _ = pm.unpipelined(job, STEPS, deterministic)
    _assert_model(state, ref, deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name,lost,replicas", [("near", 4, 2), ("gpt2", 1, 1)])
def test_clipping_counts_the_tied_weight_once_after_a_failover(name, lost, replicas, deterministic):
    """``max_grad_norm`` small enough to clip every step: where one worker runs both uses (one
    parameter, or a twin in default mode) the weight counts once in the norm, as in the undisturbed
    run."""
    job = JOBS[name]()
    job = job.replace(virtual_nodes=4 * replicas, global_batch_size=replicas * job.global_batch_size,
                      max_grad_norm=0.05)
    state, workers, _ = _fail_over(job, lost, at=2, replicas=replicas, deterministic=deterministic)
    undisturbed, _ = train_local(job, STEPS, replicas=replicas, deterministic=deterministic)
    for e, *_ in workers:
        _assert_model(e.model.state_dict(), {k: undisturbed[k] for k in e.model.state_dict()}, deterministic)


@pytest.mark.parametrize("name,lost", [("gpt3", 2), ("gpt2", 1), ("near", 1)])
def test_under_bf16_autocast_a_failover_with_a_tied_weight_is_the_unpipelined_model(name, lost):
    """``precision="bf16-mixed"``, deterministic: where both uses read autocast's one cast of the
    weight (two ``nn.Linear``) the unpipelined job adds their gradients in bfloat16 inside one
    graph; the redone step then runs the lost stage's forwards again rather than splicing in eager
    forwards of its own graph, and the model is the unpipelined run's bit for bit."""
    job = JOBS[name]().replace(precision="bf16-mixed")
    state, relaid, _ = _fail_over(job, lost, at=2)
    ref, _ = pm.unpipelined(job, STEPS, True)
    assert_state_equal(state, ref)
    if name == "near":
        assert sum(e.reused_forwards for e, *_ in relaid) == 0
