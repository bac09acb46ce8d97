"""Pipeline partitioner: optimal against brute force, memory respected, deterministic ties,
clear errors, the 1F1B step prediction (pure, no processes)."""

from __future__ import annotations

import math
import random

import pytest

from pipeline_reference import all_splits, best_replicated_split, best_split, min_peak_memory, stage_costs
from virtualflow.plan.pipeline.partition import (
    InfeasiblePartition, LayerProfile, Link, Partition, equal_layer_split, evaluate_split, partition,
)

FAST = Link(bandwidth_bytes_per_s=math.inf)


def _layers(rng: random.Random, n: int, *, integer: bool = False) -> list[LayerProfile]:
    def val(hi: float) -> float:
        return float(rng.randint(0, int(hi))) if integer else rng.uniform(0, hi)
    return [LayerProfile(forward_s=val(5), backward_s=val(10), activation_bytes=val(100),
                         param_bytes=val(50), stash_bytes=val(30), name=f"l{i}") for i in range(n)]


def _cases(seed: int, count: int, *, integer: bool):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 9)
        p = rng.randint(1, min(4, n))
        layers = _layers(rng, n, integer=integer)
        bw = rng.choice([math.inf, 10.0, 50.0, 200.0])
        lat = rng.choice([0.0, 0.5, 2.0])
        in_flight = None if rng.random() < 0.7 else [rng.randint(0, 4) for _ in range(p)]
        factor = rng.choice([1.0, 2.0, 4.0])
        limit = None
        if rng.random() < 0.6:  # a limit between the least and the most memory any split needs
            peaks = [max(m) for *_, m in all_splits(layers, p, bandwidth=1.0, latency=0.0, factor=factor,
                                                      in_flight=in_flight)]
            # mostly feasible (some binding), sometimes just below the least any split needs
            limit = min(peaks) * 0.95 if rng.random() < 0.15 else rng.uniform(min(peaks), max(peaks))
            if integer:
                limit = float(math.floor(limit))
        yield layers, p, Link(bandwidth_bytes_per_s=bw, latency_s=lat), in_flight, factor, limit


def _check_case(layers, p, link, in_flight, factor, limit, *, exact: bool):
    ref = best_split(layers, p, bandwidth=link.bandwidth_bytes_per_s, latency=link.latency_s,
                     factor=factor, in_flight=in_flight, limit=limit)
    kw = dict(link=link, in_flight=in_flight, optimizer_state_factor=factor, memory_limit_bytes=limit)
    if ref is None:
        with pytest.raises(InfeasiblePartition):
            partition(layers, p, **kw)
        return "infeasible"
    got = partition(layers, p, **kw)
    # its own accounting agrees with the reference's costing of the same split
    times, mems = stage_costs(layers, got.cuts, bandwidth=link.bandwidth_bytes_per_s, latency=link.latency_s,
                              factor=factor, in_flight=in_flight)
    assert got.stage_time_s == pytest.approx(times, rel=1e-12, abs=1e-12)
    assert got.stage_memory_bytes == pytest.approx(mems, rel=1e-12, abs=1e-12)
    assert len(got.boundaries) == p and all(b > a for a, b in got.boundaries)
    if limit is not None:
        assert max(mems) <= limit
    if exact:  # integer data: every sum is exact, so ties are exact and the tie rule is testable
        assert (got.bottleneck_s, got.cuts) == ref
    else:
        assert got.bottleneck_s == pytest.approx(ref[0], rel=1e-12)
    return "ok"


def test_optimal_against_brute_force_random():
    outcomes = [_check_case(*case, exact=False) for case in _cases(seed=14, count=160, integer=False)]
    assert outcomes.count("ok") > 120 and "infeasible" in outcomes


def test_optimal_and_tie_rule_against_brute_force_integer_data():
    # small integers make many splits tie exactly: the lexicographically smallest cuts must win
    outcomes = [_check_case(*case, exact=True) for case in _cases(seed=41, count=120, integer=True)]
    assert outcomes.count("ok") > 90


def test_ties_go_to_earliest_cuts():
    layers = [LayerProfile(forward_s=1, backward_s=1, activation_bytes=0, param_bytes=0)] * 4
    layers = layers + [LayerProfile(forward_s=10, backward_s=0, activation_bytes=0, param_bytes=0)]
    # bottleneck is the 10 s layer; every cut set keeping stage 0 <= 10 s ties: earliest wins
    got = partition(layers, 2, link=FAST)
    assert got.bottleneck_s == 10 and got.cuts == (4,)
    got = partition(layers, 3, link=FAST)
    assert got.bottleneck_s == 10 and got.cuts == (1, 4)
    # and it is deterministic
    assert all(partition(layers, 3, link=FAST) == got for _ in range(3))


def test_communication_moves_the_cut():
    # four equal layers; layer 1's output is huge, so the cut goes after layer 0 or 2 instead
    big, small = 1000.0, 1.0
    layers = [LayerProfile(forward_s=1, backward_s=1, activation_bytes=a, param_bytes=0)
              for a in (small, big, small, small)]
    link = Link(bandwidth_bytes_per_s=100.0, latency_s=0.0)
    got = partition(layers, 2, link=link)
    assert got.cuts != (2,)
    assert got.stage_comm_s[0] == pytest.approx(2 * small / 100) and got.stage_comm_s[-1] == 0
    assert got.bottleneck_s == pytest.approx(6.0)  # 3 layers on one stage beats paying 20 s to cut at 2
    free = partition(layers, 2, link=FAST)
    assert free.cuts == (2,) and free.bottleneck_s == 4.0


def test_memory_limit_forces_a_slower_split():
    # 1F1B, p=2: stage 0 keeps 2 micro-batches of stash, stage 1 one
    layers = [LayerProfile(forward_s=1, backward_s=0, activation_bytes=0, param_bytes=0, stash_bytes=10)] * 4
    free = partition(layers, 2, link=FAST)
    assert free.cuts == (2,) and free.stage_memory_bytes == (40.0, 20.0)
    tight = partition(layers, 2, link=FAST, memory_limit_bytes=30)
    assert tight.cuts == (1,) and tight.stage_memory_bytes == (20.0, 30.0) and tight.bottleneck_s == 3.0
    assert tight.peak_memory_bytes <= 30
    # the schedule's own in-flight counts change the answer (e.g. GPipe with m=4 keeps 4 everywhere)
    gpipe = partition(layers, 2, link=FAST, in_flight=[4, 4], memory_limit_bytes=80)
    assert gpipe.cuts == (2,) and gpipe.stage_memory_bytes == (80.0, 80.0)
    # parameters count optimizer_state_factor times
    heavy = [LayerProfile(forward_s=1, backward_s=0, activation_bytes=0, param_bytes=10)] * 2
    assert partition(heavy, 2, link=FAST, optimizer_state_factor=2.0).stage_memory_bytes == (20.0, 20.0)


def test_infeasible_memory_names_the_smallest_peak_and_stage():
    layers = [LayerProfile(forward_s=1, backward_s=0, activation_bytes=0, param_bytes=0, stash_bytes=10)] * 4
    assert min_peak_memory(layers, 2) == 30
    with pytest.raises(InfeasiblePartition, match=r"memory_limit_bytes=29 .*smallest achievable peak is 30 "
                       r"bytes.*stage 1 \(layers 1-3, 1 micro-batches in flight\).*at least 30"):
        partition(layers, 2, link=FAST, memory_limit_bytes=29)
    with pytest.raises(ValueError, match="--pipeline-stages"):
        partition(layers, 2, link=FAST, memory_limit_bytes=29)


def test_more_stages_than_layers():
    layers = [LayerProfile(forward_s=1, backward_s=1, activation_bytes=0, param_bytes=0)] * 4
    with pytest.raises(ValueError, match=r"stages=5 exceeds the model's 4 layers.*lower --pipeline-stages "
                                         r"to at most 4"):
        partition(layers, 5, link=FAST)
    with pytest.raises(ValueError, match=r"stages=0 must be an integer >= 1"):
        partition(layers, 0, link=FAST)
    with pytest.raises(ValueError, match="no layers"):
        partition([], 1, link=FAST)
    with pytest.raises(ValueError, match=r"stages=5 exceeds"):
        equal_layer_split(4, 5)


@pytest.mark.parametrize("field, value", [("forward_s", -1.0), ("backward_s", math.nan),
                                          ("activation_bytes", math.inf), ("param_bytes", -5),
                                          ("stash_bytes", "10")])
def test_bad_profiles(field, value):
    kw = dict(forward_s=1.0, backward_s=1.0, activation_bytes=1.0, param_bytes=1.0, stash_bytes=0.0)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"layer 'fc1': {field}=.* must be a finite number >= 0"):
        LayerProfile(name="fc1", **kw)


def test_bad_link_and_knobs():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0 must be > 0"):
        Link(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="latency_s=-1"):
        Link(bandwidth_bytes_per_s=1.0, latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=nan"):
        Link(bandwidth_bytes_per_s=math.nan)
    layers = [LayerProfile(forward_s=1, backward_s=1, activation_bytes=0, param_bytes=0)] * 3
    with pytest.raises(ValueError, match=r"in_flight has 2 entries for stages=3"):
        partition(layers, 3, link=FAST, in_flight=[1, 1])
    with pytest.raises(ValueError, match=r"in_flight\[1\]=-1"):
        partition(layers, 3, link=FAST, in_flight=[1, -1, 1])
    with pytest.raises(ValueError, match=r"memory_limit_bytes=-1"):
        partition(layers, 3, link=FAST, memory_limit_bytes=-1)
    with pytest.raises(ValueError, match=r"optimizer_state_factor=nan"):
        partition(layers, 3, link=FAST, optimizer_state_factor=math.nan)
    with pytest.raises(ValueError, match=r"layers\[1\] is a dict"):
        partition([layers[0], {}], 1, link=FAST)


def test_equal_layer_split():
    assert equal_layer_split(10, 4) == ((0, 2), (2, 4), (4, 7), (7, 10))
    assert equal_layer_split(4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert equal_layer_split(5, 1) == ((0, 5),)
    for n in range(1, 12):
        for p in range(1, n + 1):
            sizes = [b - a for a, b in equal_layer_split(n, p)]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)


def test_evaluate_split_and_never_worse_than_equal():
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(2, 9)
        p = rng.randint(1, min(4, n))
        layers = _layers(rng, n)
        link = Link(bandwidth_bytes_per_s=50.0, latency_s=0.1)
        base = evaluate_split(layers, equal_layer_split(n, p), link=link)
        best = partition(layers, p, link=link)
        assert best.bottleneck_s <= base.bottleneck_s
        assert evaluate_split(layers, best.boundaries, link=link) == best
    layers = _layers(rng, 4)
    with pytest.raises(ValueError, match=r"boundaries\[1\]=\(3, 3\) is not a non-empty range"):
        evaluate_split(layers, [(0, 3), (3, 3)], link=FAST)
    with pytest.raises(ValueError, match="boundaries end at layer 3 but the model has 4 layers"):
        evaluate_split(layers, [(0, 3)], link=FAST)


def test_step_time_prediction_1f1b():
    layers = [LayerProfile(forward_s=f, backward_s=2 * f, activation_bytes=0, param_bytes=0)
              for f in (1.0, 1.0, 2.0, 1.0)]
    got = partition(layers, 3, link=FAST)
    assert got.bottleneck_s == 6.0 and got.bottleneck == 0 and got.cuts == (2, 3)  # 6 = 6: lowest index
    for m in (1, 2, 3, 8):
        assert got.step_time_s(m) == (m + 3 - 1) * 6.0
        assert got.bubble_fraction(m) == pytest.approx(2 / (m + 2))
    with pytest.raises(ValueError, match="micro_batches=0"):
        got.step_time_s(0)


def test_step_time_matches_event_simulator_for_equal_stages():
    from virtualflow.plan.pipeline import one_f_one_b, simulate
    layers = [LayerProfile(forward_s=1.0, backward_s=2.0, activation_bytes=0, param_bytes=0)] * 8
    for p in (1, 2, 4):
        got = partition(layers, p, link=FAST)
        f = sum(layers[i].forward_s for i in range(*got.boundaries[0]))
        b = sum(layers[i].backward_s for i in range(*got.boundaries[0]))
        for m in (1, 3, 8):
            sim = simulate(one_f_one_b(p, m), f_time=f, b_time=b)
            assert got.step_time_s(m) == pytest.approx(sim.step_time)


def test_describe_table():
    layers = [LayerProfile(forward_s=0.001, backward_s=0.002, activation_bytes=2**20, param_bytes=2**20,
                           stash_bytes=2**20, name=f"blocks.{i}") for i in range(5)]
    got = partition(layers, 2, link=Link(bandwidth_bytes_per_s=2**30, latency_s=1e-5), memory_limit_bytes=2**26)
    text = got.describe(micro_batches=8)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "layers", "n"]
    assert "(blocks.0..blocks." in lines[2] and lines[-1].startswith("1F1B step with m=8")
    assert f"bottleneck: stage {got.bottleneck} (*)" in text and "limit 64.0 MiB" in text
    assert isinstance(got, Partition) and got.stages == 2 and sum(got.stage_sizes) == 5


# ---- PipeDream stage replication ---------------------------------------------------------------


def _replication_cases(seed: int, count: int, *, integer: bool):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 6)
        p = rng.randint(1, min(3, n))
        w = rng.randint(p, 5)
        layers = _layers(rng, n, integer=integer)
        # powers of two keep integer-data sums exact through the divisions
        bw = rng.choice([math.inf, 8.0, 64.0]) if integer else rng.choice([math.inf, 10.0, 100.0])
        lat = rng.choice([0.0, 0.5])
        m = rng.choice([1, 2, 4])
        limit = None
        if rng.random() < 0.4:
            peaks = [max(mm) for *_, mm in all_splits(layers, p, bandwidth=1.0, latency=0.0)]
            limit = rng.uniform(min(peaks), max(peaks))
        yield layers, p, w, Link(bandwidth_bytes_per_s=bw, latency_s=lat), m, limit


@pytest.mark.parametrize("integer", [False, True])
def test_replication_optimal_against_brute_force(integer):
    for layers, p, w, link, m, limit in _replication_cases(seed=2 + integer, count=60, integer=integer):
        ref = best_replicated_split(layers, p, w, bandwidth=link.bandwidth_bytes_per_s, latency=link.latency_s,
                                    limit=limit, micro_batches=m)
        got = partition(layers, p, link=link, replicate=True, workers=w, micro_batches=m, memory_limit_bytes=limit)
        assert ref is not None
        assert got.workers <= w and all(r >= 1 for r in got.stage_replicas)
        again = evaluate_split(layers, got.boundaries, link=link, replicas=got.stage_replicas, micro_batches=m)
        assert again.stage_time_s == got.stage_time_s
        if integer and link.latency_s == 0:  # dyadic data: exact, so the tie rule is testable
            assert (got.bottleneck_s, got.cuts, got.stage_replicas) == ref
        else:
            assert got.bottleneck_s == pytest.approx(ref[0], rel=1e-12)


def test_replication_helps_a_heavy_stage_and_costs_an_allreduce():
    layers = [LayerProfile(forward_s=1, backward_s=2, activation_bytes=0, param_bytes=p) for p in (0, 0, 0, 100)]
    link = Link(bandwidth_bytes_per_s=100.0)
    plain = partition(layers, 2, link=link)
    assert plain.bottleneck_s == 6.0 and plain.stage_replicas == (1, 1) and plain.stage_allreduce_s == (0.0, 0.0)
    # 4 workers: stage [0,3) on 3 replicas (no params: free all-reduce), stage [3,4) on one
    rep = partition(layers, 2, link=link, replicate=True, workers=4)
    assert rep.cuts == (3,) and rep.stage_replicas == (3, 1) and rep.bottleneck_s == 3.0
    # replicating the layer with parameters costs 2 (r-1)/r * 100 / 100 per micro-batch
    assert link.allreduce_s(100, 2) == pytest.approx(1.0) and link.allreduce_s(100, 1) == 0.0
    one = evaluate_split(layers, ((0, 3), (3, 4)), link=link, replicas=(2, 2))
    assert one.stage_time_s == (4.5, 1.5 + 1.0) and one.stage_allreduce_s == (0.0, 1.0)
    # amortised over m micro-batches (a flush schedule reduces once per step)
    assert evaluate_split(layers, ((0, 3), (3, 4)), link=link, replicas=(2, 2),
                          micro_batches=4).stage_allreduce_s == (0.0, 0.25)
    assert "replicas" in rep.describe()


def test_replication_errors():
    layers = [LayerProfile(forward_s=1, backward_s=1, activation_bytes=0, param_bytes=0)] * 4
    with pytest.raises(ValueError, match=r"workers=2 is fewer than stages=3.*--workers to at least 3"):
        partition(layers, 3, link=FAST, replicate=True, workers=2)
    with pytest.raises(ValueError, match="replicate=True needs workers"):
        partition(layers, 3, link=FAST, replicate=True)
    with pytest.raises(ValueError, match="workers=4 is only used with replicate=True"):
        partition(layers, 3, link=FAST, workers=4)
    with pytest.raises(ValueError, match=r"micro_batches=0 must be an integer >= 1"):
        partition(layers, 3, link=FAST, micro_batches=0)
    with pytest.raises(ValueError, match=r"replicas\[1\]=0 must be an integer >= 1"):
        evaluate_split(layers, ((0, 2), (2, 4)), link=FAST, replicas=(1, 0))
