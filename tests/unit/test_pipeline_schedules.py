"""Pipeline schedules, their validity checker and the event simulator (pure, no processes)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from virtualflow.plan.pipeline import (
    SCHEDULES, Action, Schedule, ScheduleError, check, gpipe, interleaved_1f1b, one_f_one_b,
    pipedream_2bw, pipedream_async, simulate, zero_bubble_h1,
)

GRID = [(p, m) for p in range(1, 9) for m in range(1, 9)]


def _all_schedules():
    for p, m in GRID:
        yield gpipe(p, m)
        yield one_f_one_b(p, m)
        yield zero_bubble_h1(p, m)
        yield pipedream_async(p, m)
        yield pipedream_async(p, m, steps=3)
        if m >= p - 1:
            yield pipedream_2bw(p, m)
            yield pipedream_2bw(p, m, steps=3)
        for v in range(1, 5):
            if v == 1 or m % p == 0:
                yield interleaved_1f1b(p, m, v)


def _replace_rank(s: Schedule, rank: int, acts) -> Schedule:
    actions = list(s.actions)
    actions[rank] = tuple(acts)
    return dataclasses.replace(s, actions=tuple(actions))


# ---- every generated schedule is valid, with tight bounds --------------------------------------


def test_every_schedule_on_the_grid_passes_the_checker_with_its_stated_bounds():
    count = 0
    for s in _all_schedules():
        result = check(s)
        count += 1
        assert result.peak_stash == s.stash_bound, (s.name, s.p, s.m, s.v)  # bound stated is reached
        if s.flush:
            assert result.peak_weight_versions == (1,) * s.stages
        elif s.name == "2bw":
            assert result.peak_weight_versions == (2,) * s.stages
        else:
            assert all(a <= b for a, b in zip(result.peak_weight_versions, s.weight_versions))
            if s.steps * s.m >= 2 * s.p:  # steady state reached: the bound is exact
                assert result.peak_weight_versions == s.weight_versions
    assert count > 500


def test_stated_bounds_are_the_documented_formulas():
    for p, m in GRID:
        assert gpipe(p, m).stash_bound == (m,) * p
        assert one_f_one_b(p, m).stash_bound == tuple(min(m, p - r) for r in range(p))
        assert zero_bubble_h1(p, m).stash_bound == (min(m, p),) * p  # 1F1B's peak (rank 0)
        assert max(zero_bubble_h1(p, m).stash_bound) == max(one_f_one_b(p, m).stash_bound)
        assert pipedream_async(p, 1, steps=2 * p).weight_versions == tuple(p - s for s in range(p))
    s = interleaved_1f1b(4, 8, 2)
    assert s.stages == 8 and s.stash_bound == tuple(min(16, 2 * (4 - 1 - r) + 4 + 1) for r in range(4))


def test_stage_placement_and_chunks_for_interleaved():
    s = interleaved_1f1b(3, 6, 4)
    for r, acts in enumerate(s.actions):
        for a in acts:
            assert a.stage % 3 == r and a.chunk == a.stage // 3
            if a.peer is not None:
                assert a.peer != r
    # p = 1: all chunks on one rank pass data locally, no send/recv at all
    assert all(a.peer is None for a in interleaved_1f1b(1, 5, 3).actions[0])


def test_each_schedule_runs_every_piece_exactly_once():
    s = zero_bubble_h1(3, 5)
    kinds = [a.kind for acts in s.actions for a in acts if a.peer is None]
    assert kinds.count("F") == kinds.count("I") == kinds.count("W") == 15 and "B" not in kinds
    s = pipedream_2bw(4, 4, steps=3)
    mbs = sorted(a.microbatch for acts in s.actions for a in acts if a.kind == "F" and a.stage == 0)
    assert mbs == list(range(12)) and not s.flush and s.steps == 3


def test_registry_and_determinism():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "2bw", "async"}
    assert zero_bubble_h1(5, 7) == zero_bubble_h1(5, 7)
    assert interleaved_1f1b(4, 8, 3) == interleaved_1f1b(4, 8, 3)
    a, b = simulate(zero_bubble_h1(5, 7), 1, 2, 1), simulate(zero_bubble_h1(5, 7), 1, 2, 1)
    assert a == b


# ---- constraint errors -----------------------------------------------------------------------


def test_interleaved_constraint_names_value_rule_and_knob():
    with pytest.raises(ValueError, match=r"m=6 micro-batches is not a multiple of p=4.*v=2.*m=4 or m=8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"m=3 .*p=4.*use m=4"):
        interleaved_1f1b(4, 3, 2)
    interleaved_1f1b(4, 6, 1)  # v=1 is plain 1F1B: any m


def test_2bw_constraint_and_knob_errors():
    with pytest.raises(ValueError, match=r"m=2 micro-batches per step is below p-1=3.*at least 3"):
        pipedream_2bw(4, 2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"p={bad}"):
            one_f_one_b(bad, 4)
        with pytest.raises(ValueError, match=rf"m={bad}"):
            gpipe(2, bad)
        with pytest.raises(ValueError, match=rf"v={bad}"):
            interleaved_1f1b(2, 4, bad)
    with pytest.raises(ValueError, match="kind='X'"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="peer"):
        Action("SEND_F", 0, 0)


# ---- the checker catches hand-broken schedules --------------------------------------------------


def test_checker_catches_backward_before_forward():
    s = one_f_one_b(1, 2)  # F0 F... on one rank: [F0, B0, F1, B1]
    acts = list(s.actions[0])
    acts[0], acts[1] = acts[1], acts[0]
    with pytest.raises(ScheduleError, match=r"rank 0, action 0: rule 'forward-before-backward'") as e:
        check(_replace_rank(s, 0, acts))
    assert (e.value.rank, e.value.index, e.value.rule) == (0, 0, "forward-before-backward")


def test_checker_catches_a_missing_recv_and_a_missing_send():
    s = one_f_one_b(3, 4)
    acts = list(s.actions[1])
    k = next(i for i, a in enumerate(acts) if a.kind == "RECV_F" and a.microbatch == 2)
    with pytest.raises(ScheduleError, match=rf"rank 1, action {k}: rule 'input-arrived'"):
        check(_replace_rank(s, 1, acts[:k] + acts[k + 1:]))
    acts = list(s.actions[0])
    k = next(i for i, a in enumerate(acts) if a.kind == "SEND_F" and a.microbatch == 2)
    with pytest.raises(ScheduleError, match=r"rank 1, .*'send-recv-match'.*no matching send on rank 0"):
        check(_replace_rank(s, 0, acts[:k] + acts[k + 1:]))


def test_checker_catches_a_deadlock():
    # rank 0 runs 1F1B (waits for micro-batch 0's gradient before sending micro-batch 1),
    # rank 1 runs GPipe (waits for micro-batch 1 before sending micro-batch 0's gradient)
    s = gpipe(2, 2)
    f0, sf0, f1, sf1, rb0, b0, rb1, b1 = s.actions[0]
    broken = _replace_rank(s, 0, [f0, sf0, rb0, b0, f1, sf1, rb1, b1])
    with pytest.raises(ScheduleError, match=r"rule 'deadlock'.*rank 0 waits .*RECV_B.*rank 1 waits .*RECV_F"):
        check(broken)


def test_checker_catches_stash_over_bound_duplicates_and_misplaced_stages():
    s = dataclasses.replace(gpipe(4, 8), stash_bound=one_f_one_b(4, 8).stash_bound)
    over = r"rank 0, action \d+: rule 'stash'.*5 stashed activations, over its bound 4"
    with pytest.raises(ScheduleError, match=over):
        check(s)
    s = one_f_one_b(2, 3)
    acts = list(s.actions[1])
    assert acts[-2].kind == "B"
    with pytest.raises(ScheduleError, match=r"rank 1, action 12: rule 'exactly-once'.*second time"):
        check(_replace_rank(s, 1, acts + [acts[-2]]))
    single = one_f_one_b(1, 3)
    missing = r"rank 0, action 5: rule 'exactly-once'.*never runs B of micro-batch 2"
    with pytest.raises(ScheduleError, match=missing):
        check(_replace_rank(single, 0, single.actions[0][:-1]))
    moved = [Action("F", 0, 0, 0, None)] + acts
    with pytest.raises(ScheduleError, match=r"rank 1, action 0: rule 'well-formed'.*stage 0 lives on rank 0"):
        check(_replace_rank(s, 1, moved))


def test_checker_catches_too_few_weight_versions():
    s = dataclasses.replace(pipedream_2bw(4, 4, steps=3), weight_versions=(1, 2, 2, 2))
    with pytest.raises(ScheduleError, match=r"rank 0, .*'weight-versions'.*stage 0 holds 2 weight versions"):
        check(s)
    s = dataclasses.replace(pipedream_async(4, 1, steps=8), weight_versions=(3, 3, 2, 1))
    with pytest.raises(ScheduleError, match=r"stage 0 holds 4 weight versions"):
        check(s)


# ---- simulator --------------------------------------------------------------------------------


def test_1f1b_and_gpipe_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1():
    f, b = Fraction(1), Fraction(5, 2)
    for p, m in GRID:
        for make in (gpipe, one_f_one_b):
            r = simulate(make(p, m), f, b)
            assert r.step_time == (m + p - 1) * (f + b)
            assert all(1 - busy / r.step_time == Fraction(p - 1, m + p - 1) for busy in r.busy)
            assert r.bubble[0] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert simulate(gpipe(p, m), 1, 2).peak_stash == (m,) * p
        assert simulate(one_f_one_b(p, m), 1, 2).peak_stash == tuple(min(m, p - r) for r in range(p))


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1():
    # p*v stages of equal times, m a multiple of p (the schedule's constraint)
    for p in range(1, 9):
        for m in range(p, 9, p):
            for v in range(1, 5):
                r = simulate(interleaved_1f1b(p, m, v), 1, 2)
                assert r.step_time == (v * m + p - 1) * 3
                assert all(1 - Fraction(x, r.step_time) == Fraction(p - 1, v * m + p - 1) for x in r.busy)


def test_zero_bubble_h1_beats_1f1b_when_w_is_nonzero():
    for p, m in GRID:
        for f, b, w in ((1, 2, 1), (2, 3, 1), (1, 3, 2)):
            zb, base = simulate(zero_bubble_h1(p, m), f, b, w), simulate(one_f_one_b(p, m), f, b)
            if p == 1:
                assert zb.step_time == base.step_time == m * (f + b)
            else:
                assert zb.step_time < base.step_time
                assert max(zb.bubble) < min(base.bubble)
        if m >= p:  # H1's bubble with F = I = W: (p-1)(F + I - W), a third of 1F1B's
            assert simulate(zero_bubble_h1(p, m), 1, 2, 1).step_time == 3 * m + (p - 1)


def test_2bw_and_async_have_no_flush_so_steps_stream_faster():
    for p in range(2, 9):
        for m in range(max(1, p - 1), 9):
            one = simulate(one_f_one_b(p, m), 1, 2).step_time
            for s in (pipedream_2bw(p, m, steps=4), pipedream_async(p, m, steps=4)):
                assert simulate(s, 1, 2).step_time == (4 * m + p - 1) * 3 < 4 * one


def test_timeline_respects_order_dependencies_and_comm():
    s = interleaved_1f1b(2, 4, 2)
    r = simulate(s, [1, 2, 1, 3], [2, 4, 2, 6], comm_time=Fraction(1, 2))
    end = {}
    for slots in r.timeline:
        for prev, cur in zip(slots, slots[1:]):
            assert prev.end <= cur.start
        for slot in slots:
            end[slot.action.kind, slot.action.stage, slot.action.microbatch] = slot.end
    for (kind, stage, mb), t in end.items():
        if kind == "F" and stage > 0:
            assert t - {1: 2, 2: 1, 3: 3}[stage] >= end["F", stage - 1, mb] + Fraction(1, 2)
    assert r.step_time == max(slots[-1].end for slots in r.timeline)
    assert r.step_time > simulate(s, [1, 2, 1, 3], [2, 4, 2, 6]).step_time


def test_gpipe_with_comm_and_uneven_stages():
    for p, m in GRID:
        assert simulate(gpipe(p, m), 1, 2, comm_time=1).step_time == (m + p - 1) * 3 + 2 * (p - 1)
        fs = [1 + s % 3 for s in range(p)]
        r = simulate(one_f_one_b(p, m), fs, [2 * x for x in fs])
        slowest = max(range(p), key=lambda s: fs[s])
        assert r.step_time >= m * 3 * fs[slowest] and r.bubble[slowest] == min(r.bubble)


def test_simulator_input_errors():
    s = one_f_one_b(3, 3)
    with pytest.raises(ValueError, match="f_time has 2 values for 3 stages"):
        simulate(s, [1, 1], 2)
    with pytest.raises(ValueError, match="w_time=3 on stage 0 exceeds b_time=2"):
        simulate(zero_bubble_h1(3, 3), 1, 2, 3)
    with pytest.raises(ValueError, match="negative"):
        simulate(s, -1, 2)
    with pytest.raises(ScheduleError):  # simulate checks first
        simulate(dataclasses.replace(gpipe(3, 3), stash_bound=(1, 1, 1)), 1, 2)
