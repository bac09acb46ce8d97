"""The membership policies decide on plain inputs, without processes, store or clock.

Each situation is one the controller's own tests drive through reports (tests/test_membership.py,
tests/test_speed_model_noise.py, tests/test_bamboo_replicas.py); here the pure policy is asked
directly and must return the decision the controller carried out there. The last tests drive the
controller (a fake launcher, an in-process store) through its named phases.
"""

from __future__ import annotations

import logging

import pytest

import virtualflow as vf
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import (
    FallBack,
    Failover,
    JobFailed,
    MembershipController,
    NoChange,
    Phase,
    Rebalance,
    Reconfigure,
    ReplicaCovered,
    ReplicaLeft,
    Shrink,
    SpeedPolicy,
)
from virtualflow.control.membership.failover import (
    decide_failover,
    decide_planned_failover,
    decide_reconfigure,
    decide_shrink,
    whole_replicas,
)
from virtualflow.control.membership.decisions import GiveUp, Grow, Recover, Resume, StartWorkers
from virtualflow.control.membership.phases import phase_of_change
from virtualflow.control.membership.sizing import decide_hold, decide_loss, decide_release, decide_resize
from virtualflow.plan.vnmap import contiguous_assignment

from control_fakes import FakeLauncher

S3 = ((0,), (1,), (2,))


# -- the speed policy --------------------------------------------------------------------------------
def speed_policy(V: int = 8, **kw) -> SpeedPolicy:
    return SpeedPolicy(virtual_nodes=V, global_batch_size=None, uneven=False, memory_limits={},
                       assign=contiguous_assignment, **kw)


def report(step: int, step_time_s: float, compute_s: list[float], vns: list[list[int]]) -> dict:
    members = list(range(len(vns)))
    return {"type": "step", "worker": 0, "step": step, "generation": 0, "step_time_s": step_time_s,
            "compute_s": list(compute_s), "members": members, "vns": vns, "vn_sizes": None}


def feed(policy: SpeedPolicy, steps: range, step_time_s: float, compute_s: list[float], vns: list[list[int]],
         generation: int = 0) -> tuple[int, Rebalance] | None:
    """Reports of ``steps`` (the first one a generation's first: no compute), a check after each,
    as the controller does; the first step whose check decided a rebalance, with the decision."""
    members = list(range(len(vns)))
    for k in steps:
        policy.observe(report(k, step_time_s, compute_s if k > steps.start else [0.0] * len(vns), vns))
        decision = policy.check(generation, members, vns, None)
        if isinstance(decision, Rebalance):
            return k, decision
        assert isinstance(decision, NoChange)
    return None


def test_a_report_carries_the_step_before_and_the_warm_up_step_is_not_measured():
    policy = speed_policy()
    vns = contiguous_assignment(8, 2)
    assert policy.observe(report(0, 0.50, [0.0, 0.0], vns))
    policy.observe(report(1, 0.30, [0.45, 0.47], vns))  # step 0's compute: warm-up
    assert policy.time_per_vn == {} and policy.reduction_s == 0.0
    policy.observe(report(2, 0.25, [0.10, 0.20], vns))  # step 1's compute, with step 1's duration 0.30
    assert policy.time_per_vn == pytest.approx({0: 0.10 / 4, 1: 0.20 / 4})
    assert policy.reduction_s == pytest.approx(0.30 - 0.20)
    assert not policy.observe({"type": "step", "step": 3, "step_time_s": 0.1})  # no compute: nothing folded


def test_a_very_slow_member_is_given_no_vn_after_patience():
    # tests/test_membership.py: worker 1 is 20x slower; the rebalance comes on step 6's report
    # (2 unusable steps, 3 observations, 3 steps of patience) and maps every VN to worker 0.
    policy = speed_policy(min_observations=3, patience=3)
    vns = contiguous_assignment(8, 2)
    assert policy.plan_map([0, 1], balance=True).assignment == vns  # no speed known yet: assign's map
    at, decision = feed(policy, range(20), 0.82, [0.04, 0.80], vns)
    assert at == 6
    assert decision.revert_to is None and decision.counts_before == (4, 4)
    assert set(decision.detail) == {"time_per_vn", "predicted_before_s", "required_gain"}
    assert decision.detail["time_per_vn"] == pytest.approx({"0": 0.01, "1": 0.2})
    plan = policy.plan_map([0, 1], balance=True)
    assert plan.assignment == [list(range(8)), []]  # 8 x 0.01 < 1 x 0.2
    assert plan.predicted_step_s == pytest.approx(0.08 + policy.reduction_s)
    assert policy.plan_map([0, 1], balance=False).assignment == vns  # balance off: assign's map


def test_patience_counts_measured_steps_not_checks():
    policy = speed_policy(min_observations=1, patience=3)
    vns = contiguous_assignment(8, 2)
    policy.observe(report(0, 0.5, [0.0, 0.0], vns))
    policy.observe(report(1, 0.11, [0.4, 0.4], vns))
    for k in (2, 3):
        policy.observe(report(k, 0.11, [0.04, 0.1], vns))
        assert isinstance(policy.check(0, [0, 1], vns, None), NoChange)
    for _ in range(20):  # checks without a new measurement decide nothing and count nothing
        assert policy.check(0, [0, 1], vns, None) == NoChange("no new measurement")
    policy.observe(report(4, 0.11, [0.04, 0.1], vns))
    assert isinstance(policy.check(0, [0, 1], vns, None), NoChange)
    policy.observe(report(5, 0.11, [0.04, 0.1], vns))
    assert isinstance(policy.check(0, [0, 1], vns, None), Rebalance)
    assert [len(a) for a in policy.plan_map([0, 1], balance=True).assignment] == [6, 2]


def test_a_rebalance_that_made_steps_slower_is_reverted_then_not_proposed_while_speeds_stay():
    # tests/test_speed_model_noise.py: worker 1 measures 4x slower on the even map, but the
    # rebalanced map runs slower steps (0.08 s against 0.05 s): reverted, and not tried again.
    T = 0.01
    policy = speed_policy(V=8, min_observations=3, patience=3)
    even = contiguous_assignment(8, 3)
    counts = [len(a) for a in even]
    at, decision = feed(policy, range(40), 0.05, [c * t for c, t in zip(counts, [T, 4 * T, T])], even)
    assert decision.trial_step_s == pytest.approx(0.05) and decision.counts_before == tuple(counts)
    plan = policy.plan_map([0, 1, 2], balance=True)
    policy.new_generation(1)
    new = [len(a) for a in plan.assignment]
    assert new != counts
    step = at + 1
    revert = feed(policy, range(step, step + 40), 0.08, [c * t for c, t in zip(new, [T, 4 * T, T])],
                  plan.assignment, generation=1)
    assert revert is not None
    _, decision = revert
    assert decision.revert_to == tuple(counts) and decision.detail["reverted"] is True
    assert decision.detail["measured_step_s"] == pytest.approx(0.08)
    assert decision.detail["measured_before_s"] == pytest.approx(0.05)
    assert policy.plan_map([0, 1, 2], balance=True, counts=decision.revert_to).assignment == even
    key = ((0, 1, 2), tuple(new))
    assert policy.still_rejected(key)
    # Once a worker's speed really moves (more than REJECT_MOVE), the rejection is forgotten.
    policy.speed = type(policy.speed)()
    for w, t in ((0, T), (1, 2 * T), (2, T)):
        for _ in range(20):
            policy.speed.observe(w, t)
    assert not policy.still_rejected(key) and not policy.rejected


# -- Bamboo failover ---------------------------------------------------------------------------------
def test_a_loss_fails_over_inside_the_hit_replica_only():
    # tests/test_bamboo_replicas.py: 2 replicas of 3 stages, worker 4 lost.
    d = decide_failover(stages=3, members=list(range(6)), layout=None, formed=None, dead={4}, replace_failed=False)
    assert d == Failover(
        members=(0, 1, 2, 3, 5), kind="failover", layout=((0,), (1,), (2,), (0, 1), (2,)),
        layout_after=((0,), (1,), (2,), (0, 1), (2,)), target=5, replacements=0, dropped=(4,),
        covered=(ReplicaCovered(1, {"4": 3}, [[0, 1], [2]], numbered=True),), left=())


def test_a_replica_that_cannot_cover_its_loss_leaves_whole():
    d = decide_failover(stages=3, members=list(range(6)), layout=None, formed=None, dead={0, 2},
                        replace_failed=False)
    assert isinstance(d, Failover) and d.kind == "failure" and d.members == (3, 4, 5)
    assert d.layout is None and d.layout_after is None and d.covered == ()
    assert [(x.replica, x.workers) for x in d.left] == [(0, (0, 1, 2))]
    assert isinstance(d.left[0], ReplicaLeft) and d.left[0].reason


def test_with_no_replica_left_the_run_falls_back():
    d = decide_failover(stages=3, members=list(range(6)), layout=None, formed=None, dead={1, 2, 3, 5},
                        replace_failed=False)
    assert isinstance(d, FallBack) and d.reason.startswith("every pipeline replica lost a stage")


def test_replace_failed_counts_the_replacements_and_the_full_depth_target():
    d = decide_failover(stages=3, members=list(range(6)), layout=None, formed=None, dead={1}, replace_failed=True)
    assert d.layout == ((0, 1), (2,), (0,), (1,), (2,)) and d.replacements == 1 and d.target == 6
    # ... and the newcomer, once ready, takes its stage back: full depth again.
    r = decide_reconfigure(stages=3, members=list(d.members), layout=d.layout_after, ready=[6, 7])
    assert r == Reconfigure(members=(0, 6, 2, 3, 4, 5), added=(6,), layout=S3 + S3, layout_after=None)
    assert isinstance(decide_reconfigure(stages=3, members=[0, 1, 2], layout=None, ready=[6]), NoChange)


def test_losses_in_quick_succession_are_judged_on_the_formed_generation():
    # Generation 1 (after losing 4) has not formed when 1 is lost too: the workers still hold
    # generation 0's stages, so both losses are judged together on its members and layout.
    d = decide_failover(stages=3, members=[0, 1, 2, 3, 5], layout=((0,), (1,), (2,), (0, 1), (2,)),
                        formed=(list(range(6)), None), dead={4, 1}, replace_failed=False)
    assert d.members == (0, 2, 3, 5) and d.layout == ((0, 1), (2,), (0, 1), (2,))
    assert [c.replica for c in d.covered] == [0, 1]


def test_a_notice_is_a_planned_failover_unless_it_leaves_too_few():
    d = decide_planned_failover(stages=3, members=list(range(6)), layout=None, noticed=[4], replace_failed=False,
                                min_workers=1)
    assert isinstance(d, Failover) and d.members == (0, 1, 2, 3, 5) and d.dropped == (4,)
    d = decide_planned_failover(stages=3, members=list(range(6)), layout=None, noticed=[4], replace_failed=False,
                                min_workers=6)
    assert d == FallBack("below min_workers=6")


def test_a_failed_over_job_shrinks_by_whole_replicas_from_the_last():
    layout = ((0,), (1,), (2,), (0, 1), (2,))
    assert decide_shrink(stages=3, members=[0, 1, 2, 3, 5], layout=layout, target=3) == Shrink(
        members=(0, 1, 2), removed=(3, 5), target=3, layout=S3, layout_after=None)
    assert decide_shrink(stages=3, members=[0, 1, 2, 3, 5], layout=layout, target=4).target == 3
    keep = decide_shrink(stages=3, members=[0, 1, 2, 3, 5], layout=layout, target=5)
    assert keep.removed == () and keep.target == 5


def test_without_redundancy_a_pipelined_job_keeps_whole_replicas():
    assert whole_replicas(list(range(6)), {4}, 3) == [0, 1, 2]
    assert whole_replicas(list(range(6)), {0, 4}, 3) == []


# -- sizes: losses, holds, notices and resizes without redundancy ------------------------------------
def loss(members, failed, **kw):
    args = dict(stages=None, replace_failed=False, target=len(members), min_workers=1, step=7)
    args.update(kw)
    return decide_loss(members=members, failed=failed, pids={w: 1000 + w for w in failed}, **args)


def test_a_loss_leaves_the_survivors_smaller_or_starts_replacements():
    # tests/test_membership.py: worker 1 of 3 killed: the job goes on with 2 (target 2).
    assert loss([0, 1, 2], {1: "was killed by SIGKILL"}) == Recover((0, 2), target=2, replacements=0, hold=False)
    assert loss([0, 1, 2], {1: "x"}, replace_failed=True) == Recover((0, 2), target=3, replacements=1, hold=False)
    assert loss([0, 1, 2], {1: "x"}, min_workers=3).hold
    # A pipelined job keeps its whole replicas: the rest of a broken replica leaves (and is replaced).
    assert loss([0, 1, 2, 3], {1: "x"}, stages=2, replace_failed=True) == Recover((2, 3), 4, 2, hold=False)


def test_a_loss_nobody_survives_gives_up_naming_the_workers_and_the_way_on():
    d = loss([0, 1], {0: "exited with code 1", 1: "exited with code 1"})
    assert isinstance(d, GiveUp) and d.message.startswith("worker 0 (pid 1000) exited with code 1; worker 1")
    assert "no worker is left" in d.message and "--resume RUN_DIR" in d.message
    d = loss([0, 1, 2, 3], {0: "x", 3: "y"}, stages=2)
    assert isinstance(d, GiveUp) and "every pipeline replica lost a stage" in d.message
    assert "a larger multiple of 2" in d.message


def hold(**kw):
    args = dict(members=[0], ready=[], target=1, min_workers=2, held_s=5.0, timeout_s=30.0, replace_failed=False,
                checkpoint="ck/step-7.pt", step=7)
    args.update(kw)
    return decide_hold(**args)


def test_a_hold_resumes_with_enough_ready_workers_and_gives_up_after_its_timeout():
    assert hold(ready=[5, 6], target=3) == Resume((0, 5, 6), (5, 6))
    assert hold(ready=[5, 6]) == Resume((0, 5), (5,))  # up to max(min_workers, target)
    d = hold(held_s=31.0)
    assert isinstance(d, GiveUp) and "below min_workers=2" in d.message and "ck/step-7.pt" in d.message
    assert hold(replace_failed=True) == StartWorkers(1)
    assert hold(target=3) == StartWorkers(2)
    assert isinstance(hold(), NoChange)


def test_a_notice_releases_the_noticed_member_or_its_whole_replica():
    assert decide_release(members=[0, 1, 2], noticed=[1], stages=None, min_workers=1) == Shrink((0, 2), (1,), 2)
    assert decide_release(members=[0, 1, 2, 3], noticed=[3], stages=2, min_workers=1) == Shrink((0, 1), (2, 3), 2)
    assert isinstance(decide_release(members=[0, 1], noticed=[1], stages=None, min_workers=2), NoChange)
    assert isinstance(decide_release(members=[0, 1], noticed=[0, 1], stages=None, min_workers=1), NoChange)


def test_a_grow_waits_for_ready_newcomers_and_a_shrink_keeps_the_lowest_ranks():
    assert decide_resize(members=[0, 1], ready=[], target=3) == Grow((0, 1), (), need=1)
    assert decide_resize(members=[0, 1], ready=[2, 3], target=3) == Grow((0, 1, 2), (2,), need=1)
    assert decide_resize(members=[0, 1, 2], ready=[], target=1) == Shrink((0,), (1, 2), 1)
    assert isinstance(decide_resize(members=[0, 1], ready=[2], target=2), NoChange)


# -- the controller's phases -------------------------------------------------------------------------
def formed(g: int, members: list[int], step: int = 0) -> dict:
    return {"type": "formed", "generation": g, "members": members, "step": step, "group_s": 0, "transfer_s": 0,
            "bytes": 0, "source": None, "receivers": []}


def test_phase_of_a_published_change():
    assert phase_of_change("start", hold=False) is Phase.FORMING
    assert phase_of_change("failure", hold=False) is phase_of_change("failover", hold=False) is Phase.RECOVERING
    assert all(phase_of_change(k, hold=False) is Phase.CHANGING
               for k in ("grow", "shrink", "rebalance", "reconfigure", "preempted", "resume"))
    assert phase_of_change("hold", hold=True) is phase_of_change("failure", hold=True) is Phase.HOLDING
    assert Phase.FINISHED.terminal and Phase.FAILED.terminal and not Phase.HOLDING.terminal


def test_the_controller_walks_its_phases_and_logs_every_transition(caplog):
    events = []
    coord = Coordinator(total_steps=100, run_dir=None)
    coord.event = lambda kind, **f: events.append((kind, f))  # type: ignore[method-assign]
    launcher, now = FakeLauncher(), [0.0]
    options = vf.LaunchOptions(workers=3, steps=100, min_workers=2, min_workers_timeout_s=30, heartbeat_timeout_s=100)
    ctl = MembershipController(coord, launcher, options, virtual_nodes=8, clock=lambda: now[0], last_step=5)
    assert ctl.phase is Phase.NEW and ctl.last_step == 5
    with caplog.at_level(logging.INFO, logger="virtualflow.control.membership"):
        ctl.start()
        assert ctl.phase is Phase.FORMING and ctl.busy
        ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(3)] + [formed(0, [0, 1, 2], 5)])
        assert ctl.phase is Phase.TRAINING and not ctl.busy
        ctl.request_resize(2)
        ctl.tick([])
        assert ctl.phase is Phase.CHANGING and ctl.change_in_flight.kind == "shrink"
        launcher.codes[2] = 0
        ctl.tick([formed(1, [0, 1], 6)])
        assert ctl.phase is Phase.TRAINING
        launcher.codes[1] = -9  # one left, below min_workers=2: a hold
        ctl.tick([])
        assert ctl.phase is Phase.HOLDING and ctl.hold and ctl.hold_since == 0.0
        ctl.tick([formed(2, [0], 6)])
        assert ctl.phase is Phase.HOLDING  # formed, still holding: members checkpoint and wait
        now[0] = 31.0
        with pytest.raises(JobFailed, match="below min_workers=2"):
            ctl.tick([])
        assert ctl.phase is Phase.FAILED
        ctl.tick([{"type": "done", "worker": 0}])  # a terminal phase is never left
        assert ctl.phase is Phase.FAILED and not ctl.finished
    walk = [(f["previous"], f["phase"]) for k, f in events if k == "membership_phase"]
    assert walk == [("new", "forming"), ("forming", "training"), ("training", "changing"),
                    ("changing", "training"), ("training", "holding"), ("holding", "failed")]
    logged = [r.getMessage() for r in caplog.records if r.name == "virtualflow.control.membership.controller"
              and r.getMessage().startswith("membership ")]
    assert [m.split(" (")[0] for m in logged] == [f"membership {a} -> {b}" for a, b in walk]


def test_a_loss_is_recovering_and_the_last_step_finishes():
    coord = Coordinator(total_steps=100, run_dir=None)
    launcher = FakeLauncher()
    ctl = MembershipController(coord, launcher, vf.LaunchOptions(workers=2, steps=100), virtual_nodes=8,
                               clock=lambda: 0.0)
    ctl.start()
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(2)] + [formed(0, [0, 1])])
    launcher.codes[1] = -9
    ctl.tick([])
    assert ctl.phase is Phase.RECOVERING and ctl.change_in_flight.kind == "failure"
    ctl.tick([formed(1, [0], 3)])
    assert ctl.phase is Phase.TRAINING
    ctl.tick([{"type": "done", "worker": 0}])
    assert ctl.phase is Phase.FINISHED and ctl.finished


def test_status_shows_the_phase_and_reads_an_older_status_without_one():
    from virtualflow.cli.status import format_status

    status = {"job": "j", "state": "running", "step": 3, "total_steps": 10, "generation": 1,
              "target_workers": 2, "workers": []}
    assert "generation 1, membership recovering, target 2 workers" in format_status(
        "RUN", {**status, "phase": "recovering"}, "running")
    assert "generation 1, target 2 workers" in format_status("RUN", status, "running")
