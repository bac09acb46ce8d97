"""The autoscaler keeps watching: it searches again when measured conditions change after it
settled, and it reads the step breakdown to tell compute- from communication-bound sizes.
Pure: synthetic observation sequences, no processes, no clock (as tests/test_autoscale.py)."""

from __future__ import annotations

import math
import random

import pytest

from virtualflow.control.autoscale import EfficiencyPolicy, Limits, Observation, Resize, Stay, UtilityPolicy
from virtualflow.control.autoscale.base import bound, measure_sizes, replans
from virtualflow.control.autoscale_executor import AutoscaleExecutor
from virtualflow.runtime.breakdown import PARTS

V, B, PACE_S, COMM_S = 24, 96, 0.020, 0.020


def step_s(k: int, ports: int) -> float:
    """The emulated workload of examples/emulated_scaling.py with an emulated switch of ``ports``
    full-rate ports: the slowest contiguous block of VNs, plus congestion per worker beyond them."""
    blocks = {V // k + (1 if i < V % k else 0) for i in range(k)}
    return max(n * PACE_S + COMM_S * max(0.0, V / n - ports) for n in blocks)


class ChangingPlant:
    """A job that follows the policy's decisions ``delay`` steps after each, whose step time
    function changes at step ``change_at`` (load appears on the network: 6 -> 3 full-rate ports)."""

    def __init__(self, change_at: int, *, delay: int = 3, noise: float = 0.0, seed: int = 0,
                 parts: bool = False) -> None:
        self.change_at, self.delay, self.noise = change_at, delay, noise
        self.rng = random.Random(seed)
        self.parts = parts
        self.history: list[Observation] = []
        self.resizes: list[tuple[int, int, int, str]] = []

    def ports_at(self, step: int) -> int:
        return 6 if step < self.change_at else 3

    def t(self, k: int, step: int) -> float:
        return step_s(k, self.ports_at(step))

    def run(self, policy, limits: Limits, steps: int, start: int = 1) -> "ChangingPlant":
        workers, gen, pending, elapsed = start, 0, None, 0.0
        for step in range(steps):
            if pending is not None and step >= pending[1]:
                workers, gen, pending = pending[0], gen + 1, None
            t = self.t(workers, step) * (math.exp(self.rng.gauss(0, self.noise)) if self.noise else 1.0)
            elapsed += t
            parts = {}
            if self.parts:  # communication: the congestion; compute: the rest
                comm = COMM_S * max(0, workers - self.ports_at(step))
                parts = {**dict.fromkeys(PARTS, 0.0), "forward_s": (t - comm) / 3, "backward_s": 2 * (t - comm) / 3,
                         "reduction_s": comm, "step_s": t}
            self.history.append(Observation(step=step, workers=workers, throughput=B / t, step_time_s=t,
                                            cost_rate_per_h=float(workers), elapsed_s=elapsed,
                                            steps_remaining=steps - step - 1, generation=gen,
                                            worker_ids=tuple(range(workers)), parts=parts))
            d = policy.decide(self.history, limits)
            assert isinstance(d, (Stay, Resize)), d
            if isinstance(d, Resize) and pending is None and d.workers != workers:
                self.resizes.append((step, workers, d.workers, d.reason))
                pending = (d.workers, step + 1 + self.delay)
        self.final = pending[0] if pending else workers
        return self


def test_the_emulated_curves():
    # 6 ports: 480, 240, 160, 120, 100, 80, 100, 100 ms (the knee at 6, as examples/emulated_scaling.py).
    assert [round(1000 * step_s(k, 6)) for k in range(1, 9)] == [480, 240, 160, 120, 100, 80, 100, 100]
    # 3 ports: 480, 240, 160, 140, 140, 140, 160, 160 ms: the best throughput from 4 workers on.
    assert [round(1000 * step_s(k, 3)) for k in range(1, 9)] == [480, 240, 160, 140, 140, 140, 160, 160]


def test_searches_again_after_conditions_change_and_resettles_at_the_new_optimum():
    plant = ChangingPlant(change_at=250).run(EfficiencyPolicy(), Limits(1, 8), steps=600)
    before = [r for r in plant.resizes if r[0] < 250]
    after = [r for r in plant.resizes if r[0] >= 250]
    assert before[-1][2] == 6  # settled at the knee first (tests/test_autoscale.py's search)
    # After the change: 6 -> 7 fails (140 -> 160 ms), so it explores downward; 5 -> 6 and 4 -> 5 no
    # longer pay (140 ms each), 3 -> 4 does (160 -> 140 ms: efficiency 0.43): settle at 4, the same
    # throughput as 6 with a third fewer worker-seconds.
    assert [(a, b) for _, a, b, _ in after] == [(6, 7), (7, 5), (5, 4), (4, 3), (3, 4)]
    assert after[0][3].startswith("6 -> 7: conditions changed: 6 workers now run 685.7 samples/s, 0.57 x their "
                                  "measured 1200: searching again; exploring upward")
    assert plant.final == 4
    (point,) = replans(plant.history, min_steps=10, warmup_steps=3, change=0.3, window=10, limit=4)
    assert 250 <= point.step < 250 + 10 + 1 and point.workers == 6


def test_no_change_no_new_search_and_noise_does_not_trigger_one():
    for seed in range(4):
        plant = ChangingPlant(change_at=10**9, noise=0.05, seed=seed).run(EfficiencyPolicy(), Limits(1, 8), steps=500)
        assert plant.final == 6 and len(plant.resizes) <= 9
        assert replans(plant.history, min_steps=10, warmup_steps=3, change=0.3, window=10, limit=4) == []


def test_search_once_when_replanning_is_off():
    plant = ChangingPlant(change_at=250).run(EfficiencyPolicy(replan_change=0.0), Limits(1, 8), steps=600)
    assert plant.final == 6 and all(step < 250 for step, *_ in plant.resizes)


def test_utility_policy_replans_too():
    plant = ChangingPlant(change_at=250).run(UtilityPolicy(value="linear:1000"), Limits(1, 8), steps=700)
    assert any(step >= 250 for step, *_ in plant.resizes)
    assert plant.final == 4  # the best utility: fastest, and the cheapest of the fastest


def test_replans_are_bounded():
    # Conditions flip every 150 steps: at most max_replans new searches, then it stays put.
    class Flipping(ChangingPlant):
        def t(self, k, step):
            return step_s(k, 6 if (step // 150) % 2 == 0 else 1)

    plant = Flipping(change_at=0).run(EfficiencyPolicy(max_replans=2), Limits(1, 8), steps=1200, start=6)
    kw = dict(min_steps=10, warmup_steps=3, change=0.3, window=10)
    assert len(replans(plant.history, limit=10, **kw)) > 2  # it would have searched more often
    last = replans(plant.history, limit=2, **kw)[-1]
    assert len(plant.resizes) <= 3 * (8 + 1)
    assert all(step <= last.step + 16 * 9 for step, *_ in plant.resizes)  # the last search ends


@pytest.mark.parametrize("bad", [-0.1, 10, True])
def test_bad_replan_change_names_the_knob(bad):
    with pytest.raises(ValueError, match="replan_change"):
        EfficiencyPolicy(replan_change=bad)


# -- the breakdown in the autoscaler --------------------------------------------------------------
def test_measurements_know_what_bounds_each_size():
    plant = ChangingPlant(change_at=10**9, parts=True).run(EfficiencyPolicy(), Limits(1, 8), steps=300)
    measured, _ = measure_sizes(plant.history, min_steps=10, warmup_steps=3)
    assert measured[4].bound == "compute"  # no congestion below 6 workers
    assert measured[7].bound == "compute"  # 20 ms congestion in 100 ms: still mostly compute
    assert measured[7].shares["reduction_s"] == pytest.approx(0.2)
    # The verdict that stopped the search names it.
    settle = [r for r in plant.resizes if r[2] == 6][-1][3]
    assert "settling at 6" in settle


def test_a_communication_bound_size_is_named_in_the_reason():
    class Congested(ChangingPlant):  # one full-rate port: every worker but one adds 20 ms
        def ports_at(self, step):
            return 1

    plant = Congested(change_at=0, parts=True)
    plant.run(EfficiencyPolicy(), Limits(1, 8), steps=200, start=6)
    # 6 -> 7 fails (180 -> 200 ms); at 7 workers 120 of the 200 ms are congestion.
    (_, a, b, why) = plant.resizes[1]
    assert (a, b) == (7, 5) and "7 workers are communication-bound (60 % of the step)" in why
    measured, _ = measure_sizes(plant.history, min_steps=10, warmup_steps=3)
    assert measured[7].bound == "communication" and measured[7].shares["reduction_s"] == pytest.approx(0.6)
    assert bound({"forward_s": 0.2, "backward_s": 0.1, "reduction_s": 0.5, "straggler_s": 0.1}) == \
        ("communication", 0.5)
    assert bound({"forward_s": 0.1, "straggler_s": 0.6})[0] == "waiting"
    assert bound({}) == ("unknown", 0.0)


def test_executor_observations_carry_the_breakdown():
    ex = AutoscaleExecutor(EfficiencyPolicy(), None, None, limits=Limits(1, 4), global_batch_size=8,
                           virtual_nodes=4, total_steps=10, start_time=0.0, clock=lambda: 0.0)
    parts = [{"worker": w, **dict.fromkeys(PARTS, 0.01), "step_s": 0.07, "read_calls": 0, "read_bytes": 0,
              "loaded_s": 0.0} for w in (3, 5)]
    parts[1]["reduction_s"] = 0.03
    report = {"type": "step", "step": 4, "loss": 1.0, "samples": 8, "step_time_s": 0.08, "workers": 2,
              "generation": 1, "vns": [[0, 1], [2, 3]], "members": [3, 5], "compute_s": [0.02, 0.02],
              "time": 1.0, "breakdown": parts, "breakdown_step": 3}
    obs = ex.observation(report)
    assert obs.parts["reduction_s"] == pytest.approx(0.02) and obs.parts["step_s"] == pytest.approx(0.07)
    report["breakdown"] = [{"worker": 3, "input_s": "x"}]  # malformed: dropped, the step still observed
    assert ex.observation(report).parts == {}
