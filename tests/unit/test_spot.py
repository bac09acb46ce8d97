"""The spot simulator (``virtualflow.cluster.spot``) against hand calculations, its rules, the shipped
traces and the ``simulate-spot`` command line. Pure and fast: no processes, no sleeping."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from virtualflow.cluster.spot import (
    SpotConstants,
    SpotJob,
    SpotTrace,
    bamboo_trace_names,
    compare,
    generate_trace,
    load_trace,
    node_events,
    parse_generate_spec,
    parse_trace,
    predict,
    summary,
)

# Round numbers for hand calculations: one pipeline runs 8 samples/s (1 s steps of 8 samples);
# with redundancy 8 / 1.25 = 6.4 samples/s, failed over 6.4 / 2 = 3.2 samples/s.
HAND = SpotConstants(step_s=1.0, samples_per_step=8.0, redundancy_overhead=0.25, failover_slowdown=2.0,
                     failover_s=10.0, reconfigure_s=20.0, restart_s=50.0, checkpoint_s=5.0, source="test")
# $0.9 and $3.6 per instance-hour: $0.00025 and $0.001 per instance-second.
PRICES = dict(spot_price=0.9, on_demand_price=3.6)


def trace(rows: list[tuple[float, int]], end_s: float) -> SpotTrace:
    return SpotTrace(times_s=tuple(float(t) for t, _ in rows), counts=tuple(c for _, c in rows), end_s=end_s,
                     name="hand")


def check_tiles(res, tr: SpotTrace) -> None:
    """The timeline tiles [start, end] and its samples add up to the totals."""
    tl = res.timeline
    assert tl[0].start_s == tr.start_s and math.isclose(tl[-1].end_s, tr.end_s)
    assert all(math.isclose(a.end_s, b.start_s) for a, b in zip(tl, tl[1:]))
    assert math.isclose(sum(iv.samples for iv in tl) - res.lost_samples, res.samples, abs_tol=1e-6)
    assert math.isclose(sum(iv.cost_usd for iv in tl), res.cost_usd)


# --------------------------------------------------------------------------------- hand calculations


def test_one_preemption_by_hand():
    """4 instances, P = 4 (one pipeline), one instance lost at 100 s and back at 300 s, 600 s in all;
    checkpoints every 60 s of running time, 5 s each.

    bamboo (6.4 samples/s; 3.2 failed over):
      0-60 run 384 | 60-65 ckpt | 65-100 run 35 s = 224 | loss: 100-110 failover (no lost step) |
      110-135 run 25 s x 3.2 = 80 (60 s since the checkpoint) | 135-140 ckpt | 140-200 run 192 |
      200-205 ckpt | 205-265 run 192 | 265-270 ckpt | 270-300 run 96 | return: 300-320 reconfigure |
      320-350 run 30 s x 6.4 = 192 | 350-355 ckpt | 355-415 run 384 | 415-420 ckpt | 420-480 run 384 |
      480-485 ckpt | 485-545 run 384 | 545-550 ckpt | 550-600 run 320
      samples = 384+224+80+192+192+96+192+384+384+384+320 = 2832; 8 checkpoints.
    checkpoint-restart (8 samples/s):
      0-60 run 480 | 60-65 ckpt | 65-100 run 280 | loss: the 280 samples since the checkpoint are
      lost (35 steps); 3 < 4 instances: wait 100-300 | 300-350 restart | 350-410 run 480 |
      410-415 ckpt | 415-475 run 480 | 475-480 ckpt | 480-540 run 480 | 540-545 ckpt | 545-600 run 440
      samples = 480+280+480+480+480+440 - 280 = 2360; 4 checkpoints.
    cost (both spot): instance-seconds 4 x 100 + 3 x 200 + 4 x 300 = 2200 -> 2200 x $0.00025 = $0.55.
    on-demand: 4 instances x 600 s x $0.001 = $2.40 for 8 x 600 = 4800 samples.
    value (samples/$): bamboo 2832 / 0.55 = 5149.1; checkpoint 2360 / 0.55 = 4290.9; on-demand 2000.
    """
    tr = trace([(0, 4), (100, 3), (300, 4)], 600.0)
    job = SpotJob(stages=4, checkpoint_every_s=60.0, **PRICES)
    r = compare(tr, HAND, job)
    b, c, od = r["bamboo"], r["checkpoint"], r["on-demand"]
    assert b.samples == pytest.approx(2832.0)
    assert (b.lost_samples, b.failovers, b.restarts, b.reconfigurations, b.checkpoints) == (0, 1, 0, 1, 8)
    assert c.samples == pytest.approx(2360.0)
    assert c.lost_samples == pytest.approx(280.0) and c.lost_steps == pytest.approx(35.0)
    assert (c.failovers, c.restarts, c.reconfigurations, c.checkpoints) == (0, 1, 0, 4)
    assert b.cost_usd == pytest.approx(0.55) and c.cost_usd == pytest.approx(0.55)
    assert od.samples == pytest.approx(4800.0) and od.cost_usd == pytest.approx(2.40)
    assert b.samples_per_usd == pytest.approx(2832 / 0.55)
    assert c.samples_per_usd == pytest.approx(2360 / 0.55)
    assert od.samples_per_usd == pytest.approx(2000.0)
    assert b.samples_per_s == pytest.approx(2832 / 600)
    s = summary(tr, HAND, job, r)
    assert s["strategies"]["bamboo"]["value_vs_on_demand"] == pytest.approx(2832 / 0.55 / 2000)
    assert s["bamboo_vs_checkpoint"] == pytest.approx(2832 / 2360)
    for res in (b, c, od):
        check_tiles(res, tr)
    # The timeline says when each pause happened.
    pauses = [(iv.state, iv.start_s, iv.end_s) for iv in b.timeline if iv.state in ("failover", "reconfigure")]
    assert pauses == [("failover", 100.0, 110.0), ("reconfigure", 300.0, 320.0)]
    assert [iv.state for iv in c.timeline if iv.start_s >= 100][:2] == ["waiting", "restart"]
    assert [e.kind for e in b.events] == ["failover", "reconfigure"]


def test_two_stages_lost_at_once_falls_back_to_the_checkpoint():
    """P = 3 on 3 instances: any two of three stages are adjacent (the ring 0-1-2-0), so losing two
    at 100 s cannot be covered.

    bamboo: 0-60 run 384 | 60-65 ckpt | 65-100 run 224, lost at the fallback (224 / 8 = 28 steps) |
    1 < 3 up: wait 100-200 | 200-250 restart | 250-310 run 384 | 310-315 ckpt | 315-375 run 384 |
    375-380 ckpt | 380-400 run 128.  samples = 384 + 384 + 384 + 128 = 1280.
    """
    tr = trace([(0, 3), (100, 1), (200, 3)], 400.0)
    b = predict(tr, HAND, "bamboo", stages=3, checkpoint_every_s=60.0, **PRICES)
    assert b.samples == pytest.approx(1280.0)
    assert b.lost_samples == pytest.approx(224.0) and b.lost_steps == pytest.approx(28.0)
    assert (b.failovers, b.restarts) == (0, 1)
    assert [e.kind for e in b.events] == ["fallback_restart", "restart"]
    check_tiles(b, tr)


def test_losing_the_node_that_runs_two_stages_falls_back():
    """P = 3: one loss is a failover; a second loss (whichever instance: the one running two stages,
    or the other, whose successor is the missing stage) cannot be covered."""
    tr = trace([(0, 3), (100, 2), (150, 1), (250, 3)], 400.0)
    for seed in range(4):
        b = predict(tr, HAND, "bamboo", stages=3, checkpoint_every_s=60.0, seed=seed, **PRICES)
        assert (b.failovers, b.restarts) == (1, 1)
        assert [e.kind for e in b.events][:2] == ["failover", "fallback_restart"]
        check_tiles(b, tr)


def test_which_losses_redundancy_covers_follows_the_drawn_instances():
    """P = 4 on 4 instances (stage s on instance s), two lost at once: covered (two failovers) when
    the drawn instances are not neighbours on the ring, else a fallback restart."""
    tr = trace([(0, 4), (100, 2), (200, 4)], 400.0)
    seen = set()
    for seed in range(12):
        lost = node_events(tr, seed)[1].lost
        adjacent = (lost[1] - lost[0]) % 4 in (1, 3)
        b = predict(tr, HAND, "bamboo", stages=4, checkpoint_every_s=60.0, seed=seed, **PRICES)
        assert (b.restarts, b.failovers) == ((1, 0) if adjacent else (0, 2)), (seed, lost)
        seen.add(adjacent)
    assert seen == {True, False}


def test_reconfiguration_adds_pipelines_when_instances_allow():
    """P = 2; 2 instances, then 4 at 100 s (the job wants max 4 // 2 = 2 pipelines); no checkpoint
    falls due (every 1000 s).

    bamboo: 0-100 one pipeline 6.4 -> 640 | 100-120 reconfigure | 120-300 two pipelines 12.8 x 180
      = 2304.  samples = 2944.
    checkpoint: 0-100 8 -> 800 | grows by checkpoint + restart, 100-155 (5 + 50 s, nothing lost) |
      155-300 16 x 145 = 2320.  samples = 3120.
    With --pipelines 1 nobody grows.
    """
    tr = trace([(0, 2), (100, 4)], 300.0)
    job = SpotJob(stages=2, checkpoint_every_s=1000.0, **PRICES)
    b = predict(tr, HAND, "bamboo", job)
    c = predict(tr, HAND, "checkpoint", job)
    assert b.samples == pytest.approx(2944.0) and (b.reconfigurations, b.restarts) == (1, 0)
    assert c.samples == pytest.approx(3120.0) and (c.reconfigurations, c.restarts, c.lost_samples) == (1, 0, 0)
    assert b.timeline[-1].pipelines == 2 and c.timeline[-1].pipelines == 2
    one = SpotJob(stages=2, pipelines=1, checkpoint_every_s=1000.0, **PRICES)
    b1 = predict(tr, HAND, "bamboo", one)
    assert b1.samples == pytest.approx(6.4 * 300) and b1.reconfigurations == 0
    assert predict(tr, HAND, "on-demand", one).cost_usd == pytest.approx(2 * 300 * 0.001)


def test_failed_over_pipeline_is_repaired_when_an_instance_returns():
    """P = 4, 8 instances, 2 pipelines. One loss: failover (1 pipeline failed over); the returning
    instance fills the hole (a reconfiguration) and both pipelines run full again."""
    tr = trace([(0, 8), (100, 7), (200, 8)], 400.0)
    b = predict(tr, HAND, "bamboo", stages=4, checkpoint_every_s=1000.0, **PRICES)
    assert (b.failovers, b.reconfigurations, b.restarts) == (1, 1, 0)
    states = [(iv.state, iv.failed_over, iv.pipelines) for iv in b.timeline]
    assert states == [("running", 0, 2), ("failover", 1, 2), ("running", 1, 2), ("reconfigure", 0, 2),
                      ("running", 0, 2)]
    # slowest sync: 2 pipelines with one failed over run at 2 x 6.4 / 2 = 6.4 samples/s.
    # 0-100 12.8 x 100 | 100-110 failover | 110-200 6.4 x 90 | 200-220 reconfigure | 220-400 12.8 x 180
    assert b.samples == pytest.approx(1280 + 576 + 2304)
    # proportional: (6.4 + 3.2) x 90 in the failed-over stretch.
    p = predict(tr, HAND, "bamboo", stages=4, checkpoint_every_s=1000.0, sync="proportional", **PRICES)
    assert p.samples == pytest.approx(1280 + 9.6 * 90 + 2304)


def test_fewer_full_pipelines_replace_failed_over_ones_when_faster():
    """P = 4 on 16 instances, one lost. slowest sync: 4 pipelines, one failed over, run like
    4 / 1.5 = 2.67 pipelines < 3 full ones: the job reconfigures to 3 at once (no lost step).
    proportional: 3 + 1 / 1.5 = 3.67 > 3: it stays failed over until the instance returns."""
    tr = trace([(0, 16), (100, 15), (200, 16)], 400.0)
    c = SpotConstants(failover_slowdown=1.5, reconfigure_s=20.0)
    slow = predict(tr, c, "bamboo", stages=4, checkpoint_every_s=1000.0)
    assert (slow.failovers, slow.reconfigurations, slow.lost_samples) == (1, 2, 0)
    assert [iv.pipelines for iv in slow.timeline if iv.state == "running"] == [4, 3, 4]
    prop = predict(tr, c, "bamboo", stages=4, checkpoint_every_s=1000.0, sync="proportional")
    assert (prop.failovers, prop.reconfigurations) == (1, 1)
    assert [(iv.pipelines, iv.failed_over) for iv in prop.timeline if iv.state == "running"] == \
        [(4, 0), (4, 1), (4, 0)]


def test_a_preempted_spare_costs_nothing():
    """P = 4 on 5 instances: one spare. Whatever instance goes, the job keeps its pipeline: a spare
    hit changes nothing, a stage hit is refilled from the spare (failover, then reconfiguration)."""
    tr = trace([(0, 5), (100, 4)], 300.0)
    for seed in range(6):
        lost = node_events(tr, seed)[1].lost
        b = predict(tr, HAND, "bamboo", stages=4, checkpoint_every_s=1000.0, seed=seed, **PRICES)
        c = predict(tr, HAND, "checkpoint", stages=4, checkpoint_every_s=1000.0, seed=seed, **PRICES)
        if lost == (4,):
            assert b.samples == pytest.approx(6.4 * 300) and c.samples == pytest.approx(8 * 300)
            assert (b.failovers, c.restarts) == (0, 0)
        else:
            assert (b.failovers, b.reconfigurations, c.restarts) == (1, 1, 1)


def test_invariants_on_generated_traces():
    """On many drawn traces, both spot strategies: the timeline tiles the span, cost = instance-hours
    x spot price, 0 <= samples <= what full pipelines could train, lost work only with restarts,
    and bamboo never loses work without a fallback restart."""
    c = SpotConstants(reconfigure_s=5.0, restart_s=30.0, checkpoint_s=3.0)
    for seed in range(12):
        tr = generate_trace(rate_per_hour=20, nodes=3 + seed % 6, hours=3, seed=seed, mean_down_s=200)
        job = SpotJob(stages=2 + seed % 3, seed=seed, sync=("slowest", "proportional")[seed % 2])
        if tr.max_count < job.stages:
            continue
        d = job.resolved_pipelines(tr)
        for name in ("bamboo", "checkpoint"):
            r = predict(tr, c, name, job)
            check_tiles(r, tr)
            assert r.cost_usd == pytest.approx(tr.instance_hours() * job.spot_price)
            assert 0 <= r.samples <= d * c.samples_per_step / c.step_s * tr.span_s + 1e-6
            assert r.lost_samples >= 0 and (r.lost_samples == 0 or r.restarts > 0), (seed, name)
            assert all(iv.pipelines <= d and iv.instances == tr.count_at(iv.start_s) for iv in r.timeline
                       if iv.end_s > iv.start_s)
            assert all(iv.rate == 0 for iv in r.timeline if iv.state != "running")
        assert predict(tr, c, "bamboo", job).failovers + predict(tr, c, "bamboo", job).restarts > 0


# ------------------------------------------------------------------------------------------- traces


README_TRACES = {  # name: (span in hours, max count), as data/bamboo/README.md says
    "p2-xlarge-2020-11-20-hours": (88.695, 16),
    "g4dn-xlarge-us-east-1c-2020-11-20": (88194 / 3600, 12),
    "g4dn-xlarge-us-east-1d-2020-11-23": (45668 / 3600, 12),
    "p2-xlarge-us-east-1e-2020-11-23": (68252 / 3600, 10),
}


def test_shipped_traces_load_as_the_readme_says():
    assert set(bamboo_trace_names()) == set(README_TRACES)
    for name, (hours, max_count) in README_TRACES.items():
        tr = load_trace(name)
        assert tr.start_s == 0.0 and tr.span_s / 3600 == pytest.approx(hours) and tr.max_count == max_count
        assert load_trace(f"{name}.csv") == tr
        assert all(c >= 0 for c in tr.counts) and list(tr.times_s) == sorted(tr.times_s)
    p2 = load_trace("p2-xlarge-2020-11-20-hours")  # hours: 0.030 h = 108 s
    assert p2.times_s[:3] == (0.0, pytest.approx(108.0), pytest.approx(212.4)) and p2.counts[:3] == (0, 9, 2)
    # 16 -> 15 -> 16 at the same time (18.821 h) is kept as a loss and an arrival.
    same = [c for t, c in zip(p2.times_s, p2.counts) if t == pytest.approx(18.821 * 3600)]
    assert same == [15, 16]
    assert load_trace("p2-xlarge-us-east-1e-2020-11-23").counts == (10, 9, 10, 9, 10, 9, 10)


def test_parse_trace_rows_and_errors(tmp_path):
    tr = parse_trace("0,2\n10,2\n10,3\n\n25,3\n25,1\n40,1\n", name="t")
    assert tr.times_s == (0.0, 10.0, 25.0) and tr.counts == (2, 3, 1) and tr.end_s == 40.0
    assert parse_trace("0,1\n1,1\n", time_unit="h").end_s == 3600.0
    for text, message in [
        ("0,1\n5\n", r"t:2: expected 2 comma-separated columns \(time,count\), got 1"),
        ("0,1\nfive,2\n", r"t:2: 'five,2' is not two numbers time,count"),
        ("0,1\n-5,2\n", r"t:2: time \(s\)=-5 must be >= 0"),
        ("0,1\n5,2.5\n", r"t:2: count=2.5 must be a whole number"),
        ("0,1\n5,-1\n", r"t:2: count=-1 must be >= 0"),
        ("0,1\n5,2\n4,2\n", "t:3: time 4 is before the previous row's 5; times must not decrease"),
        ("\n\n", "t: no rows"),
        ("0,1\n0,2\n", "it spans 0 s"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_trace(text, name="t")
    with pytest.raises(ValueError, match="--trace '.*nope.csv' does not exist; .*p2-xlarge-2020-11-20-hours"):
        load_trace(str(tmp_path / "nope.csv"))
    with pytest.raises(ValueError, match="--time-unit 'min' must be 's'"):
        parse_trace("0,1\n1,1\n", time_unit="min")


def test_generated_traces_are_reproducible_by_seed():
    a = generate_trace(rate_per_hour=6, nodes=8, hours=50, seed=3)
    assert a == generate_trace(rate_per_hour=6, nodes=8, hours=50, seed=3)
    assert a.times_s != generate_trace(rate_per_hour=6, nodes=8, hours=50, seed=4).times_s
    assert a.counts[0] == 8 and a.max_count == 8 and min(a.counts) >= 0 and a.span_s == 50 * 3600
    assert list(a.times_s) == sorted(a.times_s)
    assert all(abs(x - y) == 1 for x, y in zip(a.counts, a.counts[1:]))  # one instance per change
    assert a.instances_lost == pytest.approx(6 * 50, rel=0.2)  # a Poisson process of rate 6/h
    # Down times: mean_down_s on average (time-averaged instances down ~ rate x mean down time).
    b = generate_trace(rate_per_hour=6, nodes=8, hours=50, seed=3, mean_down_s=600)
    down = 8 - b.instance_hours() / 50
    assert down == pytest.approx(6 * 600 / 3600, rel=0.25)
    assert generate_trace(rate_per_hour=0, nodes=4, hours=1).counts == (4,)
    assert parse_generate_spec("rate=2,nodes=16,hours=24,seed=1,mean_down_s=60") == dict(
        rate_per_hour=2.0, nodes=16, hours=24.0, seed=1, mean_down_s=60.0)
    for spec, message in [("rate=2,nodes=16", "lacks hours="), ("rate=2,nodes=x,hours=1", "nodes='x' is not a "
                          "valid integer"), ("rate=2,nodes=4,hours=1,colour=red", "'colour=red' is not KEY=VALUE")]:
        with pytest.raises(ValueError, match=message):
            parse_generate_spec(spec)
    with pytest.raises(ValueError, match="--generate hours=-1 must be a finite number > 0"):
        generate_trace(rate_per_hour=1, nodes=4, hours=-1)


def test_time_compression_scales_time_only():
    tr = load_trace("p2-xlarge-us-east-1e-2020-11-23")
    fast = tr.compressed(100)
    assert fast.counts == tr.counts and fast.span_s == pytest.approx(tr.span_s / 100)
    assert np.allclose(np.asarray(fast.times_s) * 100, tr.times_s)
    assert fast.instance_hours() == pytest.approx(tr.instance_hours() / 100)
    assert [(e.joined, e.lost) for e in node_events(fast, 5)] == [(e.joined, e.lost) for e in node_events(tr, 5)]
    job = SpotJob(stages=2)
    od, od_fast = predict(tr, HAND, "on-demand", job), predict(fast, HAND, "on-demand", job)
    assert od_fast.samples_per_s == pytest.approx(od.samples_per_s)  # constants unchanged
    assert od_fast.samples == pytest.approx(od.samples / 100)
    b = predict(fast, HAND, "bamboo", job)
    assert b.failovers + b.restarts > 0 and b.timeline[-1].end_s == pytest.approx(fast.end_s)
    with pytest.raises(ValueError, match="--speedup 0 must be a finite number > 0"):
        tr.compressed(0)


def test_node_events_draw_uniformly_from_the_seed():
    tr = trace([(0, 10), (1, 5), (2, 10), (3, 0)], 4.0)
    ev = node_events(tr, 7)
    assert ev == node_events(tr, 7)
    assert ev[0].joined == tuple(range(10)) and len(ev[1].lost) == 5 and ev[2].joined == tuple(range(10, 15))
    up = set(range(10)) - set(ev[1].lost) | set(range(10, 15))
    assert set(ev[3].lost) == up
    hits = np.zeros(10)
    for seed in range(400):
        for n in node_events(tr, seed)[1].lost:
            hits[n] += 1
    assert hits.min() > 150 and hits.max() < 250  # each instance ~200 times in 400 x 5 of 10


# ---------------------------------------------------------------------------------------- constants


def test_constants_json_schema(tmp_path):
    f = tmp_path / "bamboo.json"
    f.write_text(json.dumps({"constants": {"step_s": 0.5, "redundancy_overhead": 0.08, "failover_s": 0.4,
                                           "source": "bench/bamboo.py at abc123"}, "other": 1}))
    c = SpotConstants.from_json(f)
    assert (c.step_s, c.redundancy_overhead, c.failover_s) == (0.5, 0.08, 0.4)
    assert c.source == f"{f}: bench/bamboo.py at abc123"
    assert "restart_s" in c.defaulted and "step_s" not in c.defaulted and c.restart_s == 45.0
    g = tmp_path / "plain.json"
    g.write_text(json.dumps({n: 1.0 for n in SpotConstants.numeric_fields()}))
    assert SpotConstants.from_json(g).defaulted == ()
    for body, message in [({"constants": {"step": 1}}, "unknown constant 'step'"),
                          ({"constants": {"restart_s": -1}}, "restart_s=-1 must be >= 0"),
                          ({"constants": {"failover_slowdown": 0.5}}, "failover_slowdown=0.5 must be >= 1"),
                          ({"constants": {"step_s": "1"}}, "step_s='1' must be a number"),
                          ({"constants": [1]}, "expected a JSON object")]:
        f.write_text(json.dumps(body))
        with pytest.raises(ValueError, match=message):
            SpotConstants.from_json(f)
    f.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        SpotConstants.from_json(f)
    with pytest.raises(ValueError, match="--constants '.*none.json' does not exist"):
        SpotConstants.from_json(tmp_path / "none.json")


def test_constants_left_out_are_defaults_and_say_so():
    d = SpotConstants()
    assert d.defaulted == SpotConstants.numeric_fields() and "defaults (not measurements)" in d.source
    assert (d.redundancy_overhead, d.failover_slowdown, d.restart_s) == (0.15, 1.5, 45.0)
    m = SpotConstants(step_s=2.0, source="bench")
    assert m.step_s == 2.0 and "step_s" not in m.defaulted and len(m.defaulted) == 7 and m.source == "bench"
    assert HAND.defaulted == ()


def test_timeline_windows_for_a_measured_replay():
    """``produced_between`` reads the prediction over any window (what a time-compressed replay on
    real workers is compared with): in the hand case of test_one_preemption_by_hand."""
    tr = trace([(0, 4), (100, 3), (300, 4)], 600.0)
    b = predict(tr, HAND, "bamboo", stages=4, checkpoint_every_s=60.0, **PRICES)
    assert b.produced_between(0, 600) == pytest.approx(2832.0)
    assert b.produced_between(100, 135) == pytest.approx(80.0)  # failover 100-110, then 25 s x 3.2
    assert b.produced_between(50, 70) == pytest.approx(10 * 6.4 + 5 * 6.4)  # 50-60 run, ckpt, 65-70 run


def test_job_validation():
    tr = trace([(0, 4)], 10.0)
    for kw, message in [(dict(stages=1), "--stages=1 must be >= 2"),
                        (dict(stages=4, pipelines=0), "--pipelines=0 must be >= 1"),
                        (dict(stages=4, spot_price=-1), "--spot-price=-1 must be > 0"),
                        (dict(stages=4, checkpoint_every_s=0), "--checkpoint-every-s=0 must be"),
                        (dict(stages=4, sync="fastest"), "--sync 'fastest' must be 'slowest' or 'proportional'")]:
        with pytest.raises(ValueError, match=message):
            SpotJob(**kw)
    with pytest.raises(ValueError, match="--stages 5 is more than the trace's max count 4"):
        predict(tr, HAND, "bamboo", stages=5)
    with pytest.raises(ValueError, match="unknown strategy 'varuna'; choose from bamboo, checkpoint, on-demand"):
        predict(tr, HAND, "varuna", stages=4)


def test_default_checkpoint_interval_is_young_per_strategy():
    tr = load_trace("p2-xlarge-us-east-1e-2020-11-23")
    c = SpotConstants(checkpoint_s=10.0)
    r = compare(tr, c, SpotJob(stages=2))
    for name in ("bamboo", "checkpoint"):
        res = r[name]
        want = math.sqrt(2 * 10.0 * tr.span_s / max(res.restarts, 1)) if res.restarts else tr.span_s
        assert res.checkpoint_every_s == pytest.approx(want, rel=0.02), name


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_table_outputs_and_json(tmp_path, capsys, monkeypatch):
    from virtualflow.cli.main import main

    monkeypatch.setattr("virtualflow.cli.simulate_spot.find_bench_constants", lambda: None)  # hermetic

    consts = tmp_path / "c.json"
    consts.write_text(json.dumps({"constants": {"redundancy_overhead": 0.1, "source": "unit test"}}))
    out_dir = tmp_path / "out"
    assert main(["simulate-spot", "--trace", "p2-xlarge-2020-11-20-hours", "--stages", "4",
                 "--constants", str(consts), "-o", str(out_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("strategy"))
    for col in ("samples", "hours", "cost $", "samples/s", "samples/$", "value vs on-demand", "lost steps",
                "failovers", "fallback restarts", "reconfigurations"):
        assert col in header
    assert any(ln.startswith("bamboo ") for ln in lines) and any(ln.startswith("on-demand ") for ln in lines)
    assert "4 stages x 4 pipeline(s)" in out and "bamboo vs checkpoint-restart" in out
    assert f"constants from {consts}: unit test (defaults, not measured: step_s" in out
    s = json.loads((out_dir / "summary.json").read_text())
    assert s["constants"]["redundancy_overhead"] == 0.1 and s["strategies"]["on-demand"]["value_vs_on_demand"] == 1
    recs = [json.loads(x) for x in (out_dir / "timeline.jsonl").read_text().splitlines()]
    assert {r["strategy"] for r in recs} == {"bamboo", "checkpoint", "on-demand"}
    assert {"interval", "event"} <= {r["type"] for r in recs}
    assert (out_dir / "spot.png").stat().st_size > 10_000
    assert main(["simulate-spot", "--generate", "rate=4,nodes=8,hours=5,seed=1", "--stages", "2", "--json",
                 "--strategies", "bamboo,on-demand", "--speedup", "10"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["strategies"]) == {"bamboo", "on-demand"} and s["trace"]["span_h"] == pytest.approx(0.5)


def test_cli_default_constants_are_said_to_be_defaults(capsys, monkeypatch):
    from virtualflow.cli import simulate_spot
    from virtualflow.cli.main import main

    monkeypatch.setattr("virtualflow.cli.simulate_spot.find_bench_constants", lambda: None)
    assert simulate_spot.load_constants(None).defaulted == SpotConstants.numeric_fields()
    assert main(["simulate-spot", "--trace", "p2-xlarge-us-east-1e-2020-11-23", "--stages", "2"]) == 0
    assert "all of them defaults, NOT measurements" in capsys.readouterr().out


def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from virtualflow.cli.main import main

    monkeypatch.setattr("virtualflow.cli.simulate_spot.find_bench_constants", lambda: None)  # hermetic
    bad_c = tmp_path / "bad_c.json"
    bad_c.write_text(json.dumps({"constants": {"restart_s": -45}}))

    bad = tmp_path / "bad.csv"
    bad.write_text("0,4\n10,x\n")
    neg = tmp_path / "neg.csv"
    neg.write_text("0,4\n-3,2\n")
    base = ["simulate-spot", "--stages", "4"]
    for argv, message in [
        (["--trace", str(tmp_path / "missing.csv")], "--trace '.*missing.csv' does not exist"),
        (["--trace", str(bad)], r"--trace .*bad.csv:2: '10,x' is not two numbers time,count"),
        (["--trace", str(neg)], r"--trace .*neg.csv:2: time \(s\)=-3 must be >= 0"),
        (["--trace", "p2-xlarge-2020-11-20-hours", "--strategies", "bamboo,spot"], "unknown strategy 'spot'"),
        (["--trace", "p2-xlarge-2020-11-20-hours", "--stages", "1"], "--stages=1 must be >= 2"),
        (["--trace", "p2-xlarge-2020-11-20-hours", "--speedup", "-2"], "--speedup -2.0 must be"),
        (["--trace", "p2-xlarge-2020-11-20-hours", "--constants", str(tmp_path / "c.json")],
         "--constants '.*c.json' does not exist"),
        (["--generate", "rate=1,nodes=4"], "lacks hours="),
        (["--trace", "p2-xlarge-2020-11-20-hours", "--constants", str(bad_c)],
         "--constants .*bad_c.json: constants: restart_s=-45 must be >= 0"),
    ]:
        assert main(base + argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("virtualflow simulate-spot: error: "), err
        assert re.search(message, err[0]), (message, err[0])
