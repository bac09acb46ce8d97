"""The control plane at scale, in process: the simulated fleet of ``bench/harness/fleet.py``
against the real coordinator and controller, and the fixes that keep the coordinator's work per
tick and per generation from growing with W (no timing thresholds: fake clocks, store-call
counts, and the fleet's own record of the steps it applied)."""

from __future__ import annotations

import queue
import time

import pytest

import virtualflow as vf
from bench.harness.fleet import Counting, in_process_fleet
from bench.harness.fleet_plane import ControlPlane
from virtualflow.comm import protocol
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import MembershipController
from virtualflow.control.membership.liveness import Liveness
from virtualflow.control.membership.losses import STORM_MAX_S, STORM_SETTLE_S
from virtualflow.control.status_pace import StatusPace

from control_fakes import Clock, FakeLauncher


def counted_controller(workers: int, clock: Clock | None = None):
    coord = Coordinator(total_steps=100, run_dir=None)
    counts: dict[str, float] = {}
    coord.store = Counting(coord.store, counts)
    launcher = FakeLauncher()
    ctl = MembershipController(coord, launcher, vf.LaunchOptions(workers=workers, steps=100),
                               virtual_nodes=4 * workers, clock=clock or Clock())
    return ctl, coord, launcher, counts


def formed(ctl, members, g):
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in members]
             + [{"type": "formed", "generation": g, "members": members, "step": 0, "group_s": 0, "transfer_s": 0,
                 "bytes": 0, "source": None, "receivers": []}])


def until(cond, plane: ControlPlane, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if plane.error is not None:
            raise plane.error
        assert time.monotonic() - t0 < timeout_s, "the fleet did not get there"
        time.sleep(0.01)


# -- the fixes, without a fleet ---------------------------------------------------------------
def test_publishing_a_generation_costs_the_same_store_calls_for_8_and_40_members():
    calls = []
    for w in (8, 40):
        ctl, coord, _, counts = counted_controller(w)
        ctl.start()
        calls.append(counts["ops"])
        assert [protocol.parse_next(coord.run, coord.store.get(protocol.next_key(m, -1)), m, -1)
                for m in range(w)] == ["0"] * w
        coord.close()
    assert calls[0] == calls[1]  # the pointers go in one call (they were one per member)


def test_the_heartbeat_sweep_is_one_store_call_and_still_finds_the_silent_worker():
    ctl, coord, launcher, counts = counted_controller(40)
    store = coord.store
    live = Liveness(launcher, store, heartbeat_timeout_s=3.0)
    for w in range(40):
        launcher.start_worker(w)
        live.joined(w, now=0.0)
    store.set(protocol.heartbeat_key(7), "not a number")  # someone else wrote there: a change
    before = counts["ops"]
    assert live.judge(now=1.0, finished=False) == {}
    assert counts["ops"] - before == 1
    for w in range(40):
        if w != 5:
            store.add(protocol.heartbeat_key(w), 1) if w != 7 else store.set(protocol.heartbeat_key(7), "1")
    failed = live.judge(now=2.0, finished=False)
    assert failed == {}
    for w in range(40):
        if w not in (5, 7):
            store.add(protocol.heartbeat_key(w), 1)
    store.add(protocol.heartbeat_key(7), 1)
    failed = live.judge(now=4.5, finished=False)
    assert list(failed) == [5] and "no heartbeat" in failed[5] and launcher.codes[5] == -9
    coord.close()


def test_the_abort_flag_is_written_once_however_many_members_report_the_break():
    calls = []
    for reporters in (1, 4):
        ctl, coord, _, counts = counted_controller(4)
        ctl.start()
        formed(ctl, [0, 1, 2, 3], 0)
        before = counts["ops"]
        ctl.tick([{"type": "fault", "worker": w, "generation": 0, "phase": "step", "step": 0, "error": "x"}
                  for w in range(reporters)])
        calls.append(counts["ops"] - before)
        assert coord.store.check([protocol.abort_key(0)])
        coord.close()
    assert calls[0] == calls[1]  # one write of the flag (it was one per report)


def test_losses_that_hit_an_unformed_recovery_are_answered_with_one_generation():
    clock = Clock()
    ctl, coord, launcher, _ = counted_controller(6, clock)
    ctl.start()
    formed(ctl, list(range(6)), 0)
    clock.t, launcher.codes[5] = 1.0, -9
    ctl.tick([])
    assert ctl.generation == 1  # a lone loss in a small job: answered at once
    for t, w in ((1.1, 4), (1.3, 3)):
        clock.t, launcher.codes[w] = t, -9
        ctl.tick([])
    assert ctl.generation == 1 and coord.store.check([protocol.abort_key(1)])
    clock.t = 1.3 + STORM_SETTLE_S - 0.01
    ctl.tick([])
    assert ctl.generation == 1  # still gathering
    clock.t = 1.3 + STORM_SETTLE_S
    ctl.tick([])
    rec = protocol.parse_generation(coord.run, coord.store.get(protocol.generation_key(2)), 2)
    assert ctl.generation == 2 and rec.members == [0, 1, 2]
    assert [protocol.parse_next(coord.run, coord.store.get(protocol.next_key(w, 1)), w, 1) for w in range(3)] == ["2"] * 3
    coord.close()


def test_a_first_loss_in_a_large_fleet_is_gathered_with_the_ones_that_follow():
    clock = Clock()
    ctl, coord, launcher, _ = counted_controller(32, clock)
    ctl.start()
    formed(ctl, list(range(32)), 0)
    clock.t, launcher.codes[31] = 1.0, -9
    ctl.tick([])
    assert ctl.generation == 0 and coord.store.check([protocol.abort_key(0)])
    clock.t, launcher.codes[30] = 1.2, -9
    ctl.tick([])
    clock.t = 1.2 + STORM_SETTLE_S
    ctl.tick([])
    assert ctl.generation == 1 and ctl.members == list(range(30))
    coord.close()


# -- the fleet ----------------------------------------------------------------------------------
def test_a_fleet_of_32_records_every_step_once_through_a_resize_a_storm_and_hostile_reports(tmp_path):
    plane = ControlPlane(32, queue.Queue(), queue.Queue(), run_dir=str(tmp_path), heartbeat_timeout_s=60.0)
    in_process_fleet(plane, step_s=0.02)
    plane.start()
    try:
        until(lambda: plane.ctl.formed == 0 and plane.coord.progress.step >= 3, plane)
        plane.call(plane.ctl.request_resize, 36)
        until(lambda: plane.ctl.formed == plane.ctl.generation == 1, plane)
        assert plane.ctl.members == list(range(36))
        g, step = plane.ctl.generation, plane.coord.progress.step
        for w in (3, 9, 20):  # a storm: one generation answers all three
            plane.inbox.put(("die", w, "exit"))
        until(lambda: plane.ctl.formed == plane.ctl.generation > g and plane.coord.progress.step > step + 2, plane)
        assert plane.ctl.generation == g + 1
        assert sorted(set(range(36)) - set(plane.ctl.members)) == [3, 9, 20]
        for i in range(5):
            plane.coord.store.queue_push(protocol.REPORTS_QUEUE, f"unsigned {i}")
        plane.coord.store.queue_push(protocol.REPORTS_QUEUE, "x" * (protocol.MAX_REPORT_BYTES + 1))
        step = plane.coord.progress.step
        until(lambda: plane.coord.progress.step > step + 2, plane)
        assert plane.coord.rejects.logged + plane.coord.rejects.suppressed == 6
        plane.launcher.stats.clear()
        plane.inbox.put(("stats",))
        until(lambda: plane.call(plane.launcher.poll) is not None and "client" in plane.launcher.stats, plane)
        applied = plane.launcher.stats["client"]["applied"]
        # every step the fleet had applied is recorded once, in order, once its report is read
        # (the last ones may still be on their way: wait for them, however loaded the machine)
        until(lambda: plane.coord.progress.step >= len(applied), plane)
        recorded = [h["step"] for h in plane.coord.history]
        assert recorded[:len(applied)] == applied
        assert recorded == list(range(len(recorded)))
        assert plane.error is None
    finally:
        plane.inbox.put(("stop",))
        plane.stop()


def test_the_status_table_estimates_the_speeds_once_not_once_per_worker():
    ctl, coord, _, _ = counted_controller(40)
    ctl.start()
    model = ctl.speed_policy.speed
    calls, estimates = [], model.estimates
    model.estimates = lambda: calls.append(1) or estimates()
    rows = ctl.worker_table()
    assert [r["id"] for r in rows] == list(range(40)) and len(calls) == 1
    coord.close()


def test_a_storm_that_goes_on_is_answered_within_its_bound():
    clock = Clock()
    ctl, coord, launcher, _ = counted_controller(40, clock)
    ctl.start()
    formed(ctl, list(range(40)), 0)
    t, w = 1.0, 39
    while t < 1.0 + STORM_MAX_S:  # a loss every 0.4 s: never quiet for STORM_SETTLE_S
        clock.t, launcher.codes[w] = t, -9
        ctl.tick([])
        assert ctl.generation == 0
        t, w = t + 0.4, w - 1
    clock.t = 1.0 + STORM_MAX_S
    ctl.tick([])
    assert ctl.generation == 1 and ctl.members == list(range(w + 1))
    coord.close()


def test_status_writes_are_paced_by_their_own_cost():
    clock, cpu = Clock(), Clock()
    pace = StatusPace(floor_s=0.5, budget=0.01, clock=clock, cpu=cpu)
    written = []

    def write(cost_s):
        return lambda: (written.append(clock.t), setattr(cpu, "t", cpu.t + cost_s))

    for t in [i / 10 for i in range(30)]:  # a cheap table (small W): every 0.5 s, as before
        clock.t = t
        pace.write(write(0.001))
    assert [round(t, 1) for t in written] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    written.clear()
    for t in [i / 10 for i in range(30, 71)]:  # 20 ms a write (a large W): every 2 s, 1 % of a core
        clock.t = t
        pace.write(write(0.020))
    assert [round(t, 1) for t in written] == [3.0, 5.0, 7.0]
    clock.t = 7.1
    assert pace.write(write(0.020), force=True) and round(written[-1], 1) == 7.1  # a forced write goes at once
    clock.t = 8.0
    assert not pace.write(write(0.020))  # ... and counts towards the pace


def test_the_monitor_ticks_keep_their_per_worker_part_a_fixed_share_of_a_core():
    from virtualflow.control.status_pace import BUSY_TICK_S, TICK_S, monitor_tick_s

    assert [monitor_tick_s(w, busy=False) for w in (1, 8, 64, 500)] == [TICK_S] * 4  # small jobs: as before
    assert monitor_tick_s(4096, busy=True) == BUSY_TICK_S  # a change forming: looked at closely at any size
    per_worker_s = 3e-6  # what one worker's exit-code check costs a tick (its order of magnitude)
    shares = [w * per_worker_s / monitor_tick_s(w, busy=False) for w in (500, 1024, 4096, 10_000, 100_000)]
    assert max(shares) == pytest.approx(min(shares))  # the same share however large the fleet
    assert monitor_tick_s(1024, busy=False) == pytest.approx(0.1024) and monitor_tick_s(10_000, False) == pytest.approx(1.0)
