"""Autoscaling policies on synthetic observation sequences: no processes, no clock.

A small plant stands in for the job: it runs at the worker count last decided, produces one
:class:`Observation` per step from a throughput curve (optionally with noise or outliers), and
applies a ``Resize`` only ``delay`` steps after it is decided (a newcomer needs time to start),
as the executor and the membership controller do. Each test states what the policy must do on
it: reach the known optimum, stay in bounds, make a bounded number of resizes, ignore noise.
"""

from __future__ import annotations

import copy
import math
import os
import random
import sys
from dataclasses import dataclass

import pytest

from virtualflow.control.autoscale import (
    POLICIES,
    DeadlineUtility,
    EfficiencyPolicy,
    FixedPolicy,
    LinearUtility,
    Limits,
    Observation,
    Rebalance,
    Replace,
    Resize,
    SizeMeasurement,
    Stay,
    StragglerPolicy,
    UtilityPolicy,
    make_policy,
    measure_sizes,
    parse_utility,
    scaling_efficiency,
)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
import emulated_scaling as emu  # noqa: E402

B = emu.B
# The emulated workload's analytic step times (examples/emulated_scaling.py, defaults: V=24,
# pace 20 ms, a 6-port emulated switch): 480, 240, 160, 120, 100, 80, 100, 100 ms for 1-8
# workers, 160 ms for 9-12. Scaling efficiency of each addition: 1->2 1.00, 2->3 1.00,
# 3->4 1.00, 4->5 0.80, 5->6 1.25, 6->7 -1.20: the efficiency rule's answer is 6.
STEP_MS = {k: emu.step_time_s(k) * 1000 for k in range(1, 13)}


def emulated_step_s(k: int) -> float:
    return STEP_MS[k] / 1000.0


class Plant:
    """A job that follows the policy's decisions, ``delay`` steps after each."""

    def __init__(self, step_s, start: int, *, total_steps: int = 1000, delay: int = 3, noise: float = 0.0,
                 seed: int = 0, price: float = 1.0, outliers: dict[int, float] | None = None) -> None:
        self.step_s, self.workers, self.total = step_s, start, total_steps
        self.delay, self.noise, self.price = delay, noise, price
        self.rng = random.Random(seed)
        self.outliers = outliers or {}
        self.history: list[Observation] = []
        self.generation = 0
        self.elapsed = 0.0
        self.pending: tuple[int, int] | None = None  # (workers, step it lands)
        self.resizes: list[tuple[int, int, int, str]] = []  # (step, from, to, reason)
        self.sizes_seen: list[int] = [start]

    def run(self, policy, limits: Limits, steps: int | None = None) -> "Plant":
        for step in range(steps or self.total):
            if self.pending is not None and step >= self.pending[1]:
                self.workers = self.pending[0]
                self.generation += 1
                self.pending = None
                self.sizes_seen.append(self.workers)
            t = self.step_s(self.workers)
            if self.noise:
                t *= math.exp(self.rng.gauss(0.0, self.noise))
            t *= self.outliers.get(step, 1.0)
            self.elapsed += t
            self.history.append(Observation(
                step=step, workers=self.workers, throughput=B / t, step_time_s=t,
                cost_rate_per_h=self.workers * self.price, elapsed_s=self.elapsed,
                steps_remaining=self.total - step - 1, generation=self.generation,
                worker_ids=tuple(range(self.workers)),
            ))
            d = policy.decide(self.history, limits)
            assert isinstance(d, (Stay, Resize)), d
            if isinstance(d, Resize) and self.pending is None and d.workers != self.workers:
                assert limits.min_workers <= d.workers <= limits.max_workers, d
                self.resizes.append((step, self.workers, d.workers, d.reason))
                self.pending = (d.workers, step + 1 + self.delay)
        return self

    def final(self) -> int:
        return self.pending[0] if self.pending else self.workers

    def last_resize_step(self) -> int:
        return self.resizes[-1][0] if self.resizes else -1


# --------------------------------------------------------------------------------------------
# efficiency


def test_scaling_efficiency_formula():
    def m(k, r):
        return SizeMeasurement(k, r, B / r, 5, 0, 0.0, 0, float(k))
    assert scaling_efficiency(m(2, 100.0), m(3, 150.0)) == pytest.approx(1.0)  # linear
    assert scaling_efficiency(m(3, 90.0), m(4, 99.0)) == pytest.approx(9.0 / 30.0)
    assert scaling_efficiency(m(4, 100.0), m(6, 100.0)) == 0.0
    assert scaling_efficiency(m(6, 100.0), m(7, 90.0)) < 0


def test_efficiency_reaches_known_optimum_from_one_worker():
    plant = Plant(emulated_step_s, start=1).run(EfficiencyPolicy(), Limits(1, 12))
    assert plant.final() == 6
    # Up one at a time to 7, where the addition fails, then back to 6: 7 resizes, each size once.
    assert [(a, b) for _, a, b, _ in plant.resizes] == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 6)]
    assert plant.resizes[3][3].startswith("4 -> 5: scaling efficiency 1.00 > 0.10 (3 -> 4)")
    assert "settling at 6" in plant.resizes[-1][3]
    # Settled early in a long job (7 trials of 3 + 3 + 10 steps), then never moved again.
    assert plant.last_resize_step() < 7 * 16 + 10


@pytest.mark.parametrize("seed", range(6))
def test_efficiency_with_noisy_steps_still_finds_the_optimum(seed):
    plant = Plant(emulated_step_s, start=1, noise=0.02, seed=seed).run(EfficiencyPolicy(), Limits(1, 12))
    assert plant.final() == 6
    assert len(plant.resizes) <= 12 + 1
    assert plant.last_resize_step() < 150


@pytest.mark.parametrize("factor", [10.0, 0.1])
def test_efficiency_ignores_a_single_noisy_sample(factor):
    clean = Plant(emulated_step_s, start=1, total_steps=400).run(EfficiencyPolicy(), Limits(1, 12))
    # One very slow (or very fast) step inside each size's measurement window.
    marks = {s: factor for s, *_ in clean.resizes}
    p = EfficiencyPolicy()
    # The 2nd measured step after each resize lands (decided at s, lands at s + 1 + delay).
    marks = {s + 1 + 3 + p.warmup_steps + 1: factor for s in marks}
    marks[p.warmup_steps + 1] = factor  # and one in the first size's window
    noisy = Plant(emulated_step_s, start=1, total_steps=400, outliers=marks).run(EfficiencyPolicy(), Limits(1, 12))
    assert [(a, b) for _, a, b, _ in noisy.resizes] == [(a, b) for _, a, b, _ in clean.resizes]
    assert noisy.final() == 6


def test_efficiency_respects_max_workers():
    linear = lambda k: 1.0 / k  # noqa: E731 - perfect scaling: it would grow forever
    plant = Plant(linear, start=2, total_steps=500).run(EfficiencyPolicy(), Limits(1, 5))
    assert plant.final() == 5
    assert max(plant.sizes_seen) == 5
    assert len(plant.resizes) == 3


def test_efficiency_explores_downward_when_the_first_addition_fails_and_respects_min():
    worse = lambda k: 0.1 * k  # noqa: E731 - every worker added slows the job down
    plant = Plant(worse, start=4, total_steps=500).run(EfficiencyPolicy(), Limits(2, 8))
    assert [(a, b) for _, a, b, _ in plant.resizes] == [(4, 5), (5, 3), (3, 2)]
    assert "exploring downward" in plant.resizes[1][3]
    assert plant.final() == 2 and min(plant.sizes_seen) == 2


def test_efficiency_downward_search_settles_where_the_size_above_paid():
    # Optimum 3 (efficiency rule): starting at 5, 5->6 fails, 4 and 3 are tried, 2->3 passes.
    ms = {1: 100, 2: 52, 3: 36, 4: 35, 5: 34.5, 6: 34.4}
    plant = Plant(lambda k: ms[k] / 1000, start=5, total_steps=500).run(EfficiencyPolicy(), Limits(1, 6))
    assert [(a, b) for _, a, b, _ in plant.resizes] == [(5, 6), (6, 4), (4, 3), (3, 2), (2, 3)]
    assert plant.final() == 3


def test_efficiency_starting_at_max_explores_downward():
    plant = Plant(emulated_step_s, start=8, total_steps=500).run(EfficiencyPolicy(), Limits(1, 8))
    # 8 -> 7: 7->8 did not pay; 7 -> 6: 6->7 did not pay; 5->6 paid: settle at 6.
    assert [(a, b) for _, a, b, _ in plant.resizes] == [(8, 7), (7, 6), (6, 5), (5, 6)]
    assert plant.final() == 6


def test_efficiency_step_size():
    plant = Plant(emulated_step_s, start=1, total_steps=500).run(EfficiencyPolicy(step_size=2), Limits(1, 12))
    # 1, 3, 5, 7 (5->7: s = 2.5 x (100/100 - 1) = 0 fails) -> settle 5; never an even count.
    assert [b for *_, b, _ in plant.resizes] == [3, 5, 7, 5]
    assert plant.final() == 5


def test_efficiency_flat_noisy_curve_makes_a_bounded_number_of_resizes():
    flat = lambda k: 0.05  # noqa: E731 - no size is better than another: noise decides
    for seed in range(5):
        plant = Plant(flat, start=3, total_steps=1500, noise=0.05, seed=seed).run(EfficiencyPolicy(), Limits(1, 10))
        assert len(plant.resizes) <= 10 + 1
        assert plant.last_resize_step() < 200  # then settled for the remaining ~1300 steps
        visits = plant.sizes_seen
        assert all(visits.count(k) <= 2 for k in set(visits))  # a size is left and re-entered at most once


def assert_decide_is_pure(policy, history, limits) -> list:
    """``policy.decide`` is a function of its arguments (invariant 1 of the module): on every
    prefix of ``history``, the policy, after deciding on the other prefixes in a scrambled order
    (forwards, then backwards), gives the decision that a fresh copy of it gives; deciding
    changes neither the policy nor the observations it is given. Returns the decisions."""
    pristine, original = copy.deepcopy(policy), copy.deepcopy(list(history))
    # What a fresh policy decides, each on its own copy of the observations.
    expected = [copy.deepcopy(pristine).decide(copy.deepcopy(original[:t]), limits)
                for t in range(1, len(original) + 1)]
    order = list(range(len(expected)))
    random.Random(0).shuffle(order)
    for i in order + order[::-1]:
        given = list(history[: i + 1])
        assert policy.decide(given, limits) == expected[i], f"decision on the first {i + 1} steps changed"
        assert given == original[: i + 1], f"decide changed its input (the first {i + 1} steps)"
    assert policy == pristine, "decide changed the policy"
    return expected


def test_decide_is_pure():
    searching = Plant(emulated_step_s, start=1, total_steps=160).run(EfficiencyPolicy(), Limits(1, 12)).history
    stragglers = _straggler_history({0: 100.0, 1: 100.0, 2: 45.0, 3: 98.0})
    cases = [
        ("efficiency", searching, Limits(1, 12)),
        ("efficiency:step_size=2,min_steps=3", searching, Limits(2, 9)),  # starts outside: brought in
        ("utility:value=linear:20", searching, Limits(1, 12)),
        ("utility:value=deadline:40s:100", searching, Limits(1, 12)),
        ("straggler", stragglers, Limits(1, 5)),
        ("straggler", stragglers, Limits(1, 4)),
        ("fixed", searching, Limits(1, 12)),
    ]
    kinds = set()
    for spec, history, limits in cases:
        decisions = assert_decide_is_pure(make_policy(spec), history, limits)
        kinds |= {(type(d).__name__, getattr(d, "settled", None)) for d in decisions}
    # Every kind of decision was among those checked: searching, settled, resize, replace, rebalance.
    assert kinds >= {("Stay", False), ("Stay", True), ("Resize", None), ("Replace", None), ("Rebalance", None)}


@dataclass
class _Remembers:
    """A policy that keeps state between calls (what the built-in ones must not do)."""

    name: str = "remembers"
    largest: int = 0

    def decide(self, history, limits):
        self.largest = max(self.largest, history[-1].workers)
        return Resize(self.largest) if self.largest != history[-1].workers else Stay()


@dataclass
class _EatsItsInput:
    """A policy that changes the observations it is given."""

    name: str = "eats"

    def decide(self, history, limits):
        history[-1].per_worker_throughput.clear()
        return Stay()


def test_the_purity_check_catches_state_and_changed_inputs():
    searching = Plant(emulated_step_s, start=1, total_steps=80).run(EfficiencyPolicy(), Limits(1, 12)).history
    with pytest.raises(AssertionError, match="decision on the first"):
        assert_decide_is_pure(_Remembers(), searching, Limits(1, 12))
    with pytest.raises(AssertionError, match="changed its input"):
        assert_decide_is_pure(_EatsItsInput(), _straggler_history({0: 100.0, 1: 50.0}), Limits(1, 4))


def test_measurements_are_frozen_and_skip_warmup():
    obs = [Observation(step=i, workers=1, throughput=100.0 + i, step_time_s=1.0, cost_rate_per_h=1.0,
                       elapsed_s=float(i), steps_remaining=100 - i, generation=0) for i in range(20)]
    done, counts = measure_sizes(obs, min_steps=5, warmup_steps=2)
    assert done[1].throughput == 104.0  # median of steps 2-6
    assert done[1].at_step == 6 and counts[1] == 5


def test_out_of_range_size_is_brought_back():
    obs = [Observation(step=0, workers=9, throughput=1.0, step_time_s=1.0, cost_rate_per_h=9.0,
                       elapsed_s=1.0, steps_remaining=10)]
    assert EfficiencyPolicy().decide(obs, Limits(1, 8)) == Resize(8, "9 -> 8: outside [1, 8]")


# --------------------------------------------------------------------------------------------
# utility


def test_utility_linear_reaches_its_optimum():
    # Minimises (value_per_hour/price + k) x T_k: with 20 worker-hours' price per hour, k = 6.
    expected = min(STEP_MS, key=lambda k: (20 + k) * STEP_MS[k])
    assert expected == 6
    plant = Plant(emulated_step_s, start=1).run(UtilityPolicy(value="linear:20"), Limits(1, 12))
    assert plant.final() == 6
    assert len(plant.resizes) <= 8 and plant.last_resize_step() < 7 * 16 + 10
    assert "utility net gain" in plant.resizes[2][3]


def test_utility_cheap_time_stays_small():
    # Time worth nothing: every added worker only costs; the first addition fails -> stays at 1.
    plant = Plant(emulated_step_s, start=1).run(UtilityPolicy(value="linear:0"), Limits(1, 12))
    assert plant.final() == 1
    assert [(a, b) for _, a, b, _ in plant.resizes] == [(1, 2), (2, 1)]


def test_utility_deadline_takes_the_cheapest_size_that_meets_it():
    # Near-linear scaling with a small per-worker overhead: every worker added costs a little.
    step_s = lambda k: 1.0 / k + 0.01  # noqa: E731
    total = 2000
    # 2000 steps: at 4 workers 2000 x 0.26 = 520 s; at 3, 687 s. A 600 s deadline needs >= 4.
    util = DeadlineUtility(deadline_s=600.0, value=1000.0)
    plant = Plant(step_s, start=1, total_steps=total).run(UtilityPolicy(value=util), Limits(1, 8))
    assert plant.final() == 4
    assert max(plant.sizes_seen) == 5  # 4 -> 5 tried: it no longer pays
    assert plant.history[-1].elapsed_s <= 600.0


def test_utility_spec_parsing():
    assert parse_utility("linear:20") == LinearUtility(20.0)
    assert parse_utility("deadline:30m:100") == DeadlineUtility(1800.0, 100.0, 0.0)
    assert parse_utility("deadline:2h:100:-50") == DeadlineUtility(7200.0, 100.0, -50.0)
    assert parse_utility("deadline:90:1") == DeadlineUtility(90.0, 1.0)
    for bad in ["quadratic:3", "linear", "linear:abc", "deadline:soon:100", "deadline:10m", "", "linear:-1"]:
        with pytest.raises(ValueError, match="accepted forms: linear:VALUE_PER_HOUR"):
            parse_utility(bad)
    with pytest.raises(ValueError, match="does not parse"):
        make_policy("utility:value=linear:x")


# --------------------------------------------------------------------------------------------
# straggler and fixed


def _straggler_history(speeds: dict[int, float], steps: int = 8, vns: dict[int, int] | None = None,
                       noisy: dict[tuple[int, int], float] | None = None, seen_before: tuple[int, ...] = ()):
    history = []
    for i, w in enumerate(seen_before):  # earlier generations with workers that have left since
        history.append(Observation(step=i, workers=len(speeds), throughput=10.0, step_time_s=1.0,
                                   cost_rate_per_h=1.0, elapsed_s=1.0, steps_remaining=100, generation=i,
                                   worker_ids=tuple(sorted(speeds))[1:] + (w,)))
    g = len(seen_before)
    for s in range(steps):
        pw = {w: v * (noisy or {}).get((s, w), 1.0) for w, v in speeds.items()}
        history.append(Observation(step=g + s, workers=len(speeds), throughput=sum(pw.values()), step_time_s=1.0,
                                   cost_rate_per_h=float(len(speeds)), elapsed_s=float(s), steps_remaining=100,
                                   generation=g, worker_ids=tuple(sorted(speeds)),
                                   per_worker_throughput=pw if s > 0 else {},
                                   vn_counts=vns or {w: 2 for w in speeds}))
    return history


def test_straggler_is_replaced():
    d = StragglerPolicy().decide(_straggler_history({0: 100.0, 1: 100.0, 2: 45.0, 3: 98.0}), Limits(1, 5))
    assert isinstance(d, Replace) and d.worker == 2
    assert "below 0.80 x the median" in d.reason


def test_no_straggler_within_the_fraction():
    d = StragglerPolicy().decide(_straggler_history({0: 100.0, 1: 100.0, 2: 85.0, 3: 98.0}), Limits(1, 5))
    assert isinstance(d, Stay)


def test_straggler_ignores_a_single_slow_sample():
    h = _straggler_history({0: 100.0, 1: 100.0, 2: 99.0, 3: 98.0}, noisy={(6, 1): 0.1})
    assert isinstance(StragglerPolicy().decide(h, Limits(1, 5)), Stay)


def test_straggler_gets_fewer_vns_when_it_cannot_be_replaced():
    speeds = {0: 100.0, 1: 100.0, 2: 45.0, 3: 98.0}
    # No room for a replacement under max_workers: fewer VNs instead.
    d = StragglerPolicy().decide(_straggler_history(speeds), Limits(1, 4))
    assert isinstance(d, Rebalance) and d.worker == 2 and "max_workers=4" in d.reason
    # Already given fewer VNs (the mapper did it): nothing more to do.
    d = StragglerPolicy().decide(_straggler_history(speeds, vns={0: 3, 1: 3, 2: 1, 3: 3}), Limits(1, 4))
    assert isinstance(d, Stay)


def test_straggler_replacements_are_bounded():
    speeds = {10: 100.0, 11: 100.0, 12: 45.0}
    d = StragglerPolicy(max_replacements=2).decide(_straggler_history(speeds, seen_before=(3, 4)), Limits(1, 8))
    assert isinstance(d, Rebalance) and "budget spent" in d.reason


def test_fixed_holds_where_the_other_policies_move():
    fixed = make_policy("fixed")
    assert isinstance(fixed, FixedPolicy)
    # Situations that call for a move: every step at which the efficiency search resized, a
    # worker count outside the bounds (a user's resize), a straggler that can be replaced, and
    # one that can only be given fewer VNs.
    searching = Plant(emulated_step_s, start=3, total_steps=200).run(EfficiencyPolicy(), Limits(1, 12))
    assert len(searching.resizes) >= 3
    situations = [(searching.history[: s + 1], Limits(1, 12)) for s, *_ in searching.resizes]
    situations.append(([Observation(step=0, workers=9, throughput=1.0, step_time_s=1.0, cost_rate_per_h=9.0,
                                    elapsed_s=1.0, steps_remaining=10)], Limits(1, 8)))
    stragglers = _straggler_history({0: 100.0, 1: 100.0, 2: 45.0, 3: 98.0})
    situations += [(stragglers, Limits(1, 5)), (stragglers, Limits(1, 4))]
    for history, limits in situations:
        moves = [make_policy(n).decide(history, limits) for n in ("efficiency", "utility", "straggler")]
        assert not all(isinstance(d, Stay) for d in moves), moves  # the situation does call for a move
        assert fixed.decide(history, limits) == Stay("fixed: no autoscaling")  # not settled: no search ran
    # Run end to end, the job keeps the size it started with.
    plant = Plant(emulated_step_s, start=3, total_steps=200).run(fixed, Limits(1, 12))
    assert plant.resizes == [] and plant.sizes_seen == [3]


# --------------------------------------------------------------------------------------------
# bad input and the registry


def test_min_greater_than_max():
    with pytest.raises(ValueError, match=r"min_workers=5 is greater than max_workers=3.*--min-workers, --max-workers"):
        Limits(5, 3)
    with pytest.raises(ValueError, match="positive integer"):
        Limits(0, 3)


@pytest.mark.parametrize("threshold", [0, -0.1, 1.01, 2, float("nan")])
def test_threshold_outside_0_1(threshold):
    with pytest.raises(ValueError, match=r"threshold=.* must be in \(0, 1\]"):
        EfficiencyPolicy(threshold=threshold)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        make_policy(f"efficiency:threshold={threshold}")


def test_threshold_one_is_accepted():
    assert EfficiencyPolicy(threshold=1.0).threshold == 1.0


def test_unknown_policy_lists_the_accepted_names():
    with pytest.raises(ValueError, match="unknown autoscaling policy 'greedy'; accepted: efficiency, utility, straggler, fixed"):
        make_policy("greedy")


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted: threshold, step_size, min_steps, warmup_steps"):
        make_policy("efficiency:treshold=0.2")
    with pytest.raises(ValueError, match="is not a int"):
        make_policy("efficiency:step_size=two")


def test_registry_builds_every_policy_from_a_spec():
    assert set(POLICIES) == {"efficiency", "utility", "straggler", "fixed"}
    p = make_policy("efficiency:threshold=0.2,step_size=2,min_steps=3")
    assert p == EfficiencyPolicy(threshold=0.2, step_size=2, min_steps=3)
    u = make_policy("utility:value=deadline:30m:100,min_steps=4")
    assert u.value == DeadlineUtility(1800.0, 100.0) and u.min_steps == 4
    assert make_policy("straggler:fraction=0.7").fraction == 0.7
    assert isinstance(make_policy("fixed"), FixedPolicy)
    own = EfficiencyPolicy(threshold=0.3)
    assert make_policy(own) is own
    with pytest.raises(ValueError, match="must be a policy name"):
        make_policy(42)


# --------------------------------------------------------------------------------------------
# the emulated workload (examples/emulated_scaling.py): its analytic model and its sleeps


def test_emulated_workload_saturates_at_6_workers():
    assert emu.efficiency_optimum(12) == 6
    assert emu.efficiency_optimum(12, start=3) == 6
    assert max(range(1, 13), key=emu.throughput) == 6
    # Worker-seconds per step: flat up to 6 workers (5: uneven blocks), then growing.
    ws = {k: round(k * emu.step_time_s(k), 6) for k in range(1, 13)}
    assert ws[1] == ws[2] == ws[3] == ws[4] == ws[6] == 0.48 and ws[5] == 0.5
    assert [ws[k] for k in range(6, 13)] == sorted(ws[k] for k in range(6, 13)) and ws[7] > ws[6]


def test_emulated_loss_finds_its_step_and_sleeps_the_communication(monkeypatch):
    import torch
    import virtualflow as vf

    sleeps: list[float] = []
    monkeypatch.setattr(emu.time, "sleep", sleeps.append)
    loss = emu.EmulatedLoss(pace_s=0.0, comm_s=0.001, seed=0)
    model = emu.model()
    batch = (torch.randn(4, emu.FEATURES), torch.zeros(4, dtype=torch.long))
    plain = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    # A worker holding VNs 3-5 of 24 (k = 8) for steps 100-102.
    for step in (100, 101, 102):
        for vn in (3, 4, 5):
            torch.default_generator.manual_seed(vf.vn_seed(0, step, vn))
            assert torch.equal(loss(model, batch), plain)  # the math is untouched
    # No communication before the first step it ran; then (24/3 - 6) x comm_s per step.
    assert sleeps == [pytest.approx(0.001 * 2)] * 2
    # Pickling sends the parameters only: each process counts its own steps, so a copy (a new
    # worker) sleeps nothing on the first step it runs, where the original would.
    import pickle
    clone = pickle.loads(pickle.dumps(loss))
    assert (clone.pace_s, clone.comm_s, clone.seed, clone.V) == (0.0, 0.001, 0, emu.V)
    for vn in (3, 4, 5):
        torch.default_generator.manual_seed(vf.vn_seed(0, 103, vn))
        clone(model, batch)
    assert len(sleeps) == 2
    torch.default_generator.manual_seed(vf.vn_seed(0, 103, 3))
    loss(model, batch)
    assert sleeps[2:] == [pytest.approx(0.001 * 2)]


# --------------------------------------------------------------------------------------------
# bad input through train/launch and the command line: refused before any worker starts


@pytest.mark.parametrize("kwargs, message", [
    (dict(autoscale="efficiency"), r"needs max_workers= \(--max-workers\)"),
    (dict(autoscale="efficiency", min_workers=3, max_workers=2),
     r"min_workers=3 is greater than max_workers=2"),
    (dict(autoscale="efficiency:threshold=1.5", max_workers=4), r"must be in \(0, 1\]"),
    (dict(autoscale="utility:value=linear", max_workers=4), r"accepted forms: linear:VALUE_PER_HOUR"),
    (dict(autoscale="greedy", max_workers=4), r"accepted: efficiency, utility, straggler, fixed"),
    (dict(autoscale="efficiency", max_workers=30), r"max_workers=30 is more than virtual_nodes=24"),
    (dict(max_workers=4), r"give autoscale= \(--autoscale POLICY\) too"),
    (dict(autoscale="efficiency", workers=5, max_workers=4), r"starting workers=5 is outside \[min_workers=1, max_workers=4\]"),
    (dict(autoscale="utility", max_workers=4, price_per_worker_hour=0), r"price_per_worker_hour=0 must be a finite number > 0"),
])
def test_launch_refuses_bad_autoscale_options(kwargs, message):
    import virtualflow as vf

    with pytest.raises(ValueError, match=message):
        vf.launch(emu.make_job(pace_s=0.0, comm_s=0.0), steps=5, **kwargs)


def test_cli_reports_a_bad_policy_in_one_line(capsys):
    from virtualflow.cli.main import main as cli

    job = os.path.join(EXAMPLES, "emulated_scaling.py")
    assert cli(["run", job, "--steps", "5", "--autoscale", "bogus", "--max-workers", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown autoscaling policy 'bogus'; accepted: efficiency, utility, straggler, fixed" in err
    assert "Traceback" not in err
    assert cli(["run", job, "--steps", "5", "--autoscale", "efficiency", "--min-workers", "3",
                "--max-workers", "2", "--no-progress"]) == 2
    assert "min_workers=3 is greater than max_workers=2" in capsys.readouterr().err
