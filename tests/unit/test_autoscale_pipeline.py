"""The autoscaler on pipelined (and tensor-parallel) jobs, without processes or a clock.

A pipelined job of P stages x T tensor workers runs whole replicas: every size the policies
choose and the executor applies is a multiple of P x T (``Limits.unit``), the bounds rounded
inwards, and the sizes are searched with the replica time model
(:mod:`virtualflow.control.autoscale.pipeline`), which is checked here against the schedule
simulator. The executor is driven through a fake controller and step reports with fixed times.
"""

from __future__ import annotations

import pytest

from virtualflow.config.pipeline import Pipeline
from virtualflow.control.autoscale import (
    EfficiencyPolicy, Limits, Observation, Replace, Resize, Stay, StragglerPolicy, pipeline_limits, replica_step,
)
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.plan.pipeline.schedules import build_schedule
from virtualflow.plan.pipeline.simulate import simulate

B = 32


# -- the bounds and the time model ------------------------------------------------------------------
def test_the_bounds_are_rounded_inwards_to_whole_replicas():
    limits = Limits(1, 7, unit=2)
    assert (limits.lowest, limits.highest) == (2, 6)
    assert limits.sizes() == (2, 4, 6)
    assert [limits.clamp(n) for n in (1, 2, 3, 5, 7, 9)] == [2, 2, 2, 4, 6, 6]
    assert [limits.toward(n, 4) for n in (1, 3, 4, 5, 7, 9)] == [2, 2, 4, 6, 6, 6]
    assert Limits(1, 7).sizes() == tuple(range(1, 8))  # unpipelined: every count, as before
    with pytest.raises(ValueError, match=r"^min_workers=3 and max_workers=3 hold no whole pipeline replica of 2 "
                                         r"workers.*--max-workers of at least 4"):
        Limits(3, 3, unit=2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,virtual_nodes", [(2, 4), (3, 8), (4, 6)])
def test_the_replica_time_model_is_the_simulated_step_of_the_busiest_replica(schedule, stages, virtual_nodes):
    """Independent formulation: the simulator's step for the busiest replica's ceil(V/D)
    micro-batches, each stage 0.4 s forward + 0.6 s backward."""
    for d in range(1, virtual_nodes + 1):
        m = -(-virtual_nodes // d)
        sim = simulate(build_schedule(schedule, stages, m), [0.4] * stages, [0.6] * stages)
        assert replica_step(d, virtual_nodes=virtual_nodes, stages=stages, schedule=schedule) == \
            pytest.approx(float(sim.step_time))
    assert replica_step(virtual_nodes + 1, virtual_nodes=virtual_nodes, stages=stages) == float("inf")


def test_sizes_whose_busiest_replica_runs_as_many_micro_batches_are_never_tried():
    """V = 4: 3 replicas run 2, 1 and 1 micro-batches, as slow as 2 replicas (2 and 2)."""
    limits = pipeline_limits(Limits(1, 8), Pipeline(stages=2), virtual_nodes=4)
    assert limits.unit == 2 and limits.sizes() == (2, 4, 8)
    tensor = pipeline_limits(Limits(1, 16), Pipeline(stages=2, tensor=2), virtual_nodes=4)
    assert tensor.unit == 4 and tensor.sizes() == (4, 8, 16)
    assert pipeline_limits(Limits(1, 8), None, virtual_nodes=4) == Limits(1, 8)


# -- the policies, on a plant that follows their decisions ---------------------------------------------
def pipeline_step_s(stages: int, virtual_nodes: int, unit: int):
    """The job's real step at ``workers``: 10 ms per stage and micro-batch, the 1F1B bubble, and
    a reduction the model leaves out (2 ms per replica beyond the first)."""
    def step(workers: int) -> float:
        d = workers // unit
        return (-(-virtual_nodes // d) + stages - 1) * 0.010 + 0.002 * (d - 1)
    return step


def run(policy, limits: Limits, step_s, start: int, steps: int = 200, delay: int = 2) -> list[tuple[int, int, str]]:
    """Observations at the size last decided (``delay`` steps after each decision); returns the
    resizes (from, to, reason). Every decision is checked to be whole replicas within bounds."""
    history: list[Observation] = []
    workers, generation, pending, elapsed, resizes = start, 0, None, 0.0, []
    for step in range(steps):
        if pending is not None and step >= pending[1]:
            workers, generation, pending = pending[0], generation + 1, None
        t = step_s(workers)
        elapsed += t
        history.append(Observation(step=step, workers=workers, throughput=B / t, step_time_s=t,
                                   cost_rate_per_h=float(workers), elapsed_s=elapsed, steps_remaining=steps - step - 1,
                                   generation=generation, worker_ids=tuple(range(workers))))
        d = policy.decide(history, limits)
        assert isinstance(d, (Stay, Resize)), d
        if isinstance(d, Resize) and pending is None and d.workers != workers:
            assert d.workers % limits.unit == 0 and limits.lowest <= d.workers <= limits.highest, d
            resizes.append((workers, d.workers, d.reason))
            pending = (d.workers, step + 1 + delay)
    return resizes


def test_efficiency_grows_in_whole_replicas_and_the_time_model_skips_the_useless_one():
    """V = 4, 2 stages: 2 -> 4 workers pays (m 4 -> 2); 6 (3 replicas) runs no fewer micro-batches
    than 4 and pays the reduction, so a measuring-only search settles at 4, where 8 (m = 1) was
    faster. With the time model 6 is never tried: 2 -> 4 -> 8."""
    policy = EfficiencyPolicy(min_steps=3, warmup_steps=1)
    step_s = pipeline_step_s(stages=2, virtual_nodes=4, unit=2)
    blind = run(policy, Limits(1, 8, unit=2), step_s, start=2)
    assert [(a, b) for a, b, _ in blind] == [(2, 4), (4, 6), (6, 4)]
    modelled = run(policy, pipeline_limits(Limits(1, 8), Pipeline(stages=2), virtual_nodes=4), step_s, start=2)
    assert [(a, b) for a, b, _ in modelled] == [(2, 4), (4, 8)]
    assert step_s(8) < step_s(4) < step_s(6)


def test_efficiency_does_not_try_an_addition_the_time_model_already_fails():
    """4 stages, V = 8, threshold 0.5: 1 -> 2 replicas is predicted 0.57 (tried, measured 0.55);
    2 -> 3 is predicted 0.33 (m 4 -> 3 against a fill of 3): settled at 2 replicas untried."""
    policy = EfficiencyPolicy(threshold=0.5, min_steps=3, warmup_steps=1)
    limits = pipeline_limits(Limits(4, 16), Pipeline(stages=4), virtual_nodes=8)
    assert limits.sizes() == (4, 8, 12, 16)
    resizes = run(policy, limits, pipeline_step_s(stages=4, virtual_nodes=8, unit=4), start=4)
    assert [(a, b) for a, b, _ in resizes] == [(4, 8)]
    blind = run(policy, Limits(4, 16, unit=4), pipeline_step_s(stages=4, virtual_nodes=8, unit=4), start=4)
    assert [(a, b) for a, b, _ in blind][:2] == [(4, 8), (8, 12)]
    history = [Observation(step=s, workers=8, throughput=B, step_time_s=1.0, cost_rate_per_h=8.0, elapsed_s=s,
                           steps_remaining=100, generation=1) for s in range(10)]
    history = [Observation(step=s, workers=4, throughput=B / 1.55, step_time_s=1.55, cost_rate_per_h=4.0,
                           elapsed_s=s, steps_remaining=100) for s in range(-10, 0)] + history
    d = policy.decide(history, limits)
    assert isinstance(d, Stay) and d.settled
    assert "the pipeline time model predicts scaling efficiency 0.33 <= 0.50 (8 -> 12 workers)" in d.reason


def test_a_tensor_parallel_job_moves_in_replicas_of_stages_x_tensor():
    limits = pipeline_limits(Limits(1, 16), Pipeline(stages=2, tensor=2), virtual_nodes=8)
    resizes = run(EfficiencyPolicy(min_steps=3, warmup_steps=1), limits,
                  pipeline_step_s(stages=2, virtual_nodes=8, unit=4), start=4)
    assert [(a, b) for a, b, _ in resizes] == [(4, 8), (8, 12), (12, 16)]


def test_a_size_outside_whole_replicas_is_brought_back():
    policy = EfficiencyPolicy(min_steps=3, warmup_steps=1)
    history = [Observation(step=0, workers=5, throughput=1.0, step_time_s=1.0, cost_rate_per_h=5.0, elapsed_s=1.0,
                           steps_remaining=9)]
    d = policy.decide(history, Limits(1, 8, unit=2))
    assert isinstance(d, Resize) and d.workers == 4 and "whole replicas of 2 workers" in d.reason


def _speeds(speeds: dict[int, float]) -> list[Observation]:
    return [Observation(step=s, workers=len(speeds), throughput=B, step_time_s=1.0, cost_rate_per_h=4.0, elapsed_s=s,
                        steps_remaining=100, worker_ids=tuple(speeds), per_worker_throughput=speeds,
                        vn_counts=dict.fromkeys(speeds, 4)) for s in range(10)]


def test_a_pipelined_straggler_is_replaced_with_room_for_a_whole_replica_only():
    history = _speeds({0: 10.0, 1: 10.0, 2: 3.0, 3: 10.0})  # replicas [0 1] [2 3]: worker 2 is slow
    policy = StragglerPolicy()
    d = policy.decide(history, Limits(1, 6, unit=2))
    assert isinstance(d, Replace) and d.worker == 2 and "of its stage's workers" in d.reason
    assert not isinstance(policy.decide(history, Limits(1, 5, unit=2)), Replace)  # 5 holds no third replica


def test_a_heavier_stage_is_not_a_straggler():
    """Stage 1 does 2.5x the work of stage 0 in both replicas: compared stage by stage nobody is
    slow (compared with every worker, as an unpipelined job's would be, stage 1 would be)."""
    history = _speeds({0: 10.0, 1: 4.0, 2: 10.0, 3: 4.0})
    assert isinstance(StragglerPolicy().decide(history, Limits(1, 6, unit=2)), Stay)
    assert isinstance(StragglerPolicy().decide(history, Limits(1, 6)), Replace)


# -- the executor ---------------------------------------------------------------------------------
class FakeController:
    """What the executor reads and calls: members, the change in flight, resizes and publishes.
    A requested change forms at once when :meth:`form` is called (newcomers get fresh ids)."""

    def __init__(self, members: list[int]) -> None:
        self.members, self.target = list(members), len(members)
        self.busy = self.hold = self.finished = False
        self.balance, self.layout = False, None
        self.next_id = max(members) + 1
        self.requests: list[int] = []
        self.published: list[tuple[str, list[int]]] = []

    def request_resize(self, workers: int, source: str = "api") -> None:
        self.requests.append(workers)
        self.target = workers

    def publish(self, members: list[int], *, kind: str, detail: dict | None = None) -> None:
        self.published.append((kind, list(members)))
        self.members, self.target = list(members), len(members)

    def form(self) -> None:
        while len(self.members) < self.target:
            self.members.append(self.next_id)
            self.next_id += 1
        del self.members[self.target:]


class Events:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.records.append((kind, fields))


def report(step: int, ctl: FakeController, generation: int, step_s: float, compute_s: list[float] | None = None,
           vns: int = 4) -> dict:
    n = len(ctl.members)
    return {"type": "step", "step": step, "samples": B, "step_time_s": step_s, "workers": n, "generation": generation,
            "members": list(ctl.members), "vns": [list(range(vns))] * n, "time": float(step),
            "compute_s": compute_s or [0.1] * n}


def executor(policy, ctl: FakeController, events: Events, limits: Limits, pipeline: Pipeline | None,
             virtual_nodes: int = 4) -> AutoscaleExecutor:
    return AutoscaleExecutor(policy, ctl, events, limits=limits, global_batch_size=B, virtual_nodes=virtual_nodes,
                             total_steps=1000, start_time=0.0, clock=lambda: 0.0, pipeline=pipeline)


class Asks:
    """A policy that asks for a fixed worker count once the job has run a step."""

    name = "asks"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def decide(self, history, limits):
        return Resize(self.workers, f"-> {self.workers}")


def test_the_executor_never_leaves_a_partial_replica():
    """A policy's count in workers is rounded to whole replicas away from the current size (one more
    worker grows by a replica), within the bounds rounded inwards."""
    ctl, events = FakeController([0, 1]), Events()
    ex = executor(Asks(3), ctl, events, Limits(1, 7), Pipeline(stages=2))
    assert (ex.limits.lowest, ex.limits.highest) == (2, 6)
    applied = []
    for step, asked in enumerate([3, 100, 3, 1, 5]):
        ex.policy = Asks(asked)
        ex.update([report(step, ctl, step, 1.0)])
        ctl.form()
        applied.append(len(ctl.members))
    # 2 -> 3 asked: 4; 4 -> 100: 6 (max_workers=7 rounded down); 6 -> 3: 2; 2 -> 1: stays at 2
    # (min_workers=1 rounded up to one replica); 2 -> 5: 6.
    assert applied == [4, 6, 2, 2, 6]
    assert ctl.requests == [4, 6, 2, 6]
    assert all(n % 2 == 0 for n in ctl.requests)
    notes = [f["message"] for k, f in events.records if k == "autoscale_note"]
    assert any("asked for 3 workers; applying 4 (whole replicas of 2" in n for n in notes), notes


def test_the_executor_grows_a_pipelined_job_replica_by_replica_to_the_modelled_optimum():
    """The efficiency policy through the executor: reports of the job's real step time at each size
    (V = 4, 2 stages), the controller forming every requested size: 2 -> 4 -> 8 workers, 6 never."""
    ctl, events = FakeController([0, 1]), Events()
    step_s = pipeline_step_s(stages=2, virtual_nodes=4, unit=2)
    ex = executor(EfficiencyPolicy(min_steps=3, warmup_steps=1), ctl, events, Limits(1, 8), Pipeline(stages=2))
    generation = 0
    for step in range(40):
        before = len(ctl.requests)
        ex.update([report(step, ctl, generation, step_s(len(ctl.members)))])
        if len(ctl.requests) > before:
            ctl.form()
            generation += 1
    assert ctl.requests == [4, 8]
    assert ex.settled_at == 8
    assert [d["to"] for d in ex.decisions] == [4, 8]
    assert sorted(int(k) for k in ex.summary()["sizes"]) == [2, 4, 8]


def test_the_executor_replaces_a_straggler_s_whole_replica():
    """Worker 2 (replica 1 of [0 1][2 3]) is slow: a fresh replica joins (4 -> 6), then replica 1
    leaves whole ([0 1 4 5]): every remaining worker keeps its stage."""
    ctl, events = FakeController([0, 1, 2, 3]), Events()
    ex = executor(StragglerPolicy(window=3, warmup_steps=0), ctl, events, Limits(1, 6), Pipeline(stages=2))
    for step in range(5):
        ex.update([report(step, ctl, 0, 1.0, compute_s=[0.1, 0.1, 0.4, 0.1])])
    assert ctl.requests == [6]
    ctl.form()
    ex.update([])
    assert ctl.published == [("shrink", [0, 1, 4, 5])]
    assert ex.decisions[0]["worker"] == 2 and ex.decisions[0]["to"] == 6


# -- at launch ----------------------------------------------------------------------------------------
def _tensor_job():
    import gpt_grid_jobs as g

    return g.grid_job(stages=1, tensor=2)


def _pipelined_job():
    import jobs

    return jobs.pipelined_job()


def _redundant_job():
    import jobs

    return jobs.pipelined_redundant_job()


def _tied_job():
    import pipeline_models as pm

    return pm.transformer_job(Pipeline(stages=2), virtual_nodes=4, model=pm.tied_gpt)


@pytest.mark.parametrize("make_job,unit", [(_pipelined_job, 2), (_tensor_job, 2), (_redundant_job, 3), (_tied_job, 2)],
                         ids=["pipeline-autoscale", "tensor-autoscale", "bamboo-autoscale", "tied-autoscale"])
def test_a_pipelined_or_tensor_parallel_launch_takes_the_autoscaler_in_whole_replicas(make_job, unit, tmp_path):
    """Once refused at launch (the ``pipeline+autoscale`` row): the launch's checks pass (Bamboo's
    redundant stages and a weight tied across stages included), and the executor built from its
    setup, as the supervisor builds it, grows the job by one whole replica."""
    from virtualflow.config.options import make_options
    from virtualflow.launching.prepare import prepare

    opts = make_options(None, dict(workers=unit, steps=1, autoscale="efficiency:min_steps=3,warmup_steps=0",
                                   max_workers=2 * unit, run_dir=str(tmp_path / "run")))
    with prepare(make_job, opts) as setup:
        ctl = FakeController(list(range(unit)))
        ex = AutoscaleExecutor(setup.autoscale, ctl, Events(), limits=setup.autoscale_limits,
                               global_batch_size=setup.job.global_batch_size, virtual_nodes=setup.job.virtual_nodes,
                               total_steps=10, start_time=0.0, clock=lambda: 0.0, pipeline=setup.job.pipeline)
        setup.run_lock.release()
    assert ex.limits.unit == unit and ex.limits.sizes() == (unit, 2 * unit)
    for step in range(3):
        ex.update([report(step, ctl, 0, 1.0, vns=setup.job.virtual_nodes)])
    assert ctl.requests == [2 * unit]
