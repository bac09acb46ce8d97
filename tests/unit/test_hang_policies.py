"""The hang policies, on a fake clock: the step watchdog (:mod:`virtualflow.control.membership.watchdog`)
and the external backend's deadline for welcomed workers that never join."""

from __future__ import annotations

import pytest

from virtualflow.control.membership.decisions import GiveUp, NoChange
from virtualflow.control.membership.watchdog import (AUTO_FIRST_STEP_S, AUTO_FLOOR_S, AUTO_MULTIPLE, StepWatchdog,
                                                     Wedged, decide_unformed, decide_wedged)


def stepped(w: StepWatchdog, t0: float, gaps: list[float]) -> float:
    """A generation formed at ``t0`` whose steps then came at these gaps; returns the last step's time."""
    w.restart(t0)
    t = t0 + 1.0  # the first step (not a gap between steps)
    w.step(t)
    for g in gaps:
        t += g
        w.step(t)
    return t


def test_automatic_limit_is_a_multiple_of_the_median_gap_with_a_floor():
    w = StepWatchdog(None)
    t = stepped(w, 0.0, [0.01] * 20)  # millisecond steps: the floor rules
    assert w.limit_s() == AUTO_FLOOR_S
    assert w.check(t + AUTO_FLOOR_S) is None
    stalled = w.check(t + AUTO_FLOOR_S + 0.5)
    assert stalled is not None and not stalled.first and stalled.limit_s == AUTO_FLOOR_S
    assert "step_timeout_s=auto" in stalled.why and "--step-timeout" in stalled.why
    slow = StepWatchdog(None)
    gaps = [30.0, 31.0, 29.0, 500.0, 30.0]  # one long checkpoint does not move the median
    t = stepped(slow, 0.0, gaps)
    assert slow.limit_s() == AUTO_MULTIPLE * 30.0
    assert slow.check(t + 299.0) is None and slow.check(t + 301.0) is not None


def test_a_generations_first_step_gets_the_first_step_allowance():
    w = StepWatchdog(None)
    assert w.check(1e6) is None  # never started: nothing is timed
    w.restart(100.0)
    assert w.first_limit_s() == AUTO_FIRST_STEP_S and w.limit_s() == AUTO_FIRST_STEP_S
    assert w.check(100.0 + AUTO_FIRST_STEP_S - 1) is None
    stalled = w.check(100.0 + AUTO_FIRST_STEP_S + 1)
    assert stalled is not None and stalled.first and "first step" in stalled.why
    w.step(150.0)  # the first step came: the gap from the formation is not a step time
    assert list(w.gaps) == [] and w.limit_s() == AUTO_FLOOR_S


def test_idle_stops_the_watch_until_the_next_formation_and_late_steps_are_not_progress():
    w = StepWatchdog(None)
    stepped(w, 0.0, [0.1, 0.1])
    w.idle()  # a loss: the old generation was aborted
    assert w.check(1e6) is None
    w.step(10.0)  # a late step report of the aborted generation
    assert w.since is None and w.check(1e6) is None
    w.restart(20.0)
    assert w.check(20.0 + AUTO_FIRST_STEP_S + 1) is not None


def test_a_given_step_timeout_is_the_limit_for_every_step_and_zero_turns_it_off():
    w = StepWatchdog(5.0)
    w.restart(0.0)
    assert w.limit_s() == 5.0 and w.check(5.0) is None and w.check(5.1).first
    t = stepped(w, 0.0, [0.001] * 10)
    assert w.limit_s() == 5.0 and w.check(t + 4.9) is None
    assert "step_timeout_s=5" in w.check(t + 5.1).why
    off = StepWatchdog(0.0)
    stepped(off, 0.0, [0.001])
    assert not off.enabled and off.check(1e9) is None
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_timeout_s=.* must be None .automatic., 0 .off."):
            StepWatchdog(bad)


def test_after_the_abort_the_members_that_did_not_answer_are_wedged():
    w = StepWatchdog(2.0)
    w.restart(0.0)
    stalled = w.check(3.0)
    heard = {0: 1.0, 1: 3.5}  # worker 1 reported a fault after the abort at 3.0; worker 0 said nothing
    assert decide_wedged(members=[0, 1], heard=heard, faulted=(), since=3.0, now=12.0, grace_s=10.0, stalled=stalled) is None
    verdict = decide_wedged(members=[0, 1], heard=heard, faulted=(), since=3.0, now=13.0, grace_s=10.0, stalled=stalled)
    assert isinstance(verdict, Wedged) and verdict.workers == (0,)
    assert "did not answer the generation's abort within 10 s" in verdict.causes[0]
    assert "step_timeout_s=2" in verdict.causes[0]
    everyone = decide_wedged(members=[0, 1], heard={0: 4.0, 1: 3.5}, faulted=(), since=3.0, now=13.0, grace_s=10.0,
                             stalled=stalled)
    assert isinstance(everyone, NoChange)  # all alive: the generation is only retried
    # Worker 1's own collective timed out just before the abort: its fault report came at 2.9, it
    # then waits for its next generation and says nothing more. It is alive, not wedged.
    early = decide_wedged(members=[0, 1], heard={0: 1.0, 1: 2.9}, faulted={1}, since=3.0, now=13.0, grace_s=10.0,
                          stalled=stalled)
    assert isinstance(early, Wedged) and early.workers == (0,)
    alone = decide_wedged(members=[0], heard={}, faulted=(), since=3.0, now=13.0, grace_s=10.0, stalled=stalled)
    assert isinstance(alone, Wedged) and alone.workers == (0,)


def test_a_generation_that_cannot_form_is_bounded():
    kw = dict(generation=4, kind="failure", members=[0, 1], limit_s=300.0, timeout_s=None)
    within = decide_unformed(joined=[0, 1], heard={}, since=0.0, now=300.0, **kw)
    assert isinstance(within, NoChange)
    starting = decide_unformed(joined=[0], heard={}, since=0.0, now=1e6, **kw)
    assert isinstance(starting, NoChange)  # a member still starting is judged by its start-up
    wedged = decide_unformed(joined=[0, 1], heard={0: 10.0, 1: -5.0}, since=0.0, now=301.0, **kw)
    assert isinstance(wedged, Wedged) and wedged.workers == (1,)
    assert "did not take part in forming generation 4 (failure)" in wedged.causes[1]
    stuck = decide_unformed(joined=[0, 1], heard={0: 10.0, 1: 20.0}, since=0.0, now=301.0, **kw)
    assert isinstance(stuck, GiveUp) and "generation 4 (failure, members [0, 1]) did not form" in stuck.message
    assert "--step-timeout" in stuck.message
    off = decide_unformed(joined=[0, 1], heard={}, since=0.0, now=1e9, **{**kw, "timeout_s": 0.0})
    assert isinstance(off, NoChange)


def test_a_welcomed_worker_that_never_beats_or_stops_beating_before_its_join_is_judged():
    from virtualflow.backends.external import WelcomeWatch

    watch = WelcomeWatch(first_beat_s=30.0, silence_s=3.0)
    watch.welcomed(0, 0.0)  # dies right after its welcome: never beats
    watch.welcomed(1, 0.0)  # beats during its set-up, then freezes
    watch.welcomed(2, 0.0)  # beats, then joins: no longer judged here
    counts = {0: 0, 1: 0, 2: 0}
    for t in range(1, 11):
        counts[1] += 1
        counts[2] += 1
        assert watch.judge(counts, float(t)) == {}
    watch.joined(2)
    assert watch.judge(counts, 13.0) == {}  # worker 1's last beat was at 10: 3 s is not more than 3 s
    silent = watch.judge(counts, 13.5)
    assert list(silent) == [1] and "went silent during its set-up (no heartbeat for 3.5 s" in silent[1]
    assert watch.judge(counts, 30.0) == {}  # worker 0: 30 s is not more than 30 s
    silent = watch.judge(counts, 30.5)
    assert list(silent) == [0] and "never started beating (no heartbeat within 30 s of its welcome" in silent[0]
    assert watch.watched == [] and watch.judge(counts, 1e6) == {}  # each judged once
