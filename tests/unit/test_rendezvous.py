"""A generation's rendezvous (:func:`virtualflow.runtime.channel.rendezvous`): members wait on one
key the store wakes them on, so the store's calls per member are a constant whatever the others
take, and the coordinator's abort releases the members still waiting; the simulated fleet's
members make the same few calls per resize at any size (counted on a real in-process store; no
timing thresholds)."""

from __future__ import annotations

import datetime
import queue
import threading
import time

import torch.distributed as dist

from bench.harness.fleet import Counting, in_process_fleet
from bench.harness.fleet_plane import ControlPlane
from virtualflow.comm import protocol
from virtualflow.control.coordinator import Coordinator
from virtualflow.runtime.channel import Rejections, aborted, rendezvous


def member(coord: Coordinator, counts: dict[str, float], g: int, size: int, out: list[bool]) -> threading.Thread:
    store = Counting(dist.TCPStore("127.0.0.1", coord.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=30)), counts)

    def run() -> None:
        out.append(rendezvous(store, g, size, 30.0, lambda: aborted(store, coord.run, g, Rejections(None))))

    return threading.Thread(target=run, daemon=True)


def arrived(coord: Coordinator, g: int) -> int:
    return int(coord.store.add(protocol.arrived_key(g), 0))


def until(cond) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < 30, "the members did not get there"
        time.sleep(0.005)


def test_members_wait_without_polling_the_store_however_late_the_last_one_comes():
    size = 8
    coord = Coordinator(total_steps=1, run_dir=None)
    counts: dict[str, float] = {}
    out: list[bool] = []
    try:
        early = [member(coord, counts, 0, size, out) for _ in range(size - 1)]
        for t in early:
            t.start()
        until(lambda: arrived(coord, 0) == size - 1)
        time.sleep(0.3)  # a poller (every 20 ms at most) would have made over 100 calls by now
        assert counts["ops"] == 2 * (size - 1)  # each early member: its add and its one wait
        late = member(coord, counts, 0, size, out)
        late.start()
        for t in early + [late]:
            t.join(30)
        assert out == [True] * size
        # add + wait + the abort check after waking, per member; the last one also sets the key
        assert counts["ops"] == 3 * size + 1
    finally:
        coord.close()


def test_an_abort_releases_the_members_still_waiting_and_they_give_the_generation_up():
    size = 6
    coord = Coordinator(total_steps=1, run_dir=None)
    counts: dict[str, float] = {}
    out: list[bool] = []
    try:
        waiting = [member(coord, counts, 3, size, out) for _ in range(size - 2)]
        for t in waiting:
            t.start()
        until(lambda: arrived(coord, 3) == size - 2)
        coord.abort(3)  # a member died before it arrived
        for t in waiting:
            t.join(30)
        assert out == [False] * (size - 2)
        late: list[bool] = []
        t = member(coord, counts, 3, size, late)  # one that comes after the abort does not wait
        t.start()
        t.join(30)
        assert late == [False]
    finally:
        coord.close()


def test_a_forged_release_does_not_abort_and_a_lone_member_does_not_wait():
    coord = Coordinator(total_steps=1, run_dir=None)
    counts: dict[str, float] = {}
    out: list[bool] = []
    try:
        coord.store.set(protocol.abort_key(5), "not signed")
        coord.store.set(protocol.ready_key(5), "1")  # someone else releases generation 5 early
        t = member(coord, counts, 5, 4, out)
        t.start()
        t.join(30)
        assert out == [True]  # released; the forged abort flag is refused (the group's own rendezvous waits)
        t = member(coord, counts, 6, 1, out)
        t.start()
        t.join(30)
        # the forged flag: add, wait, check and get; the lone member: its add only
        assert out == [True, True] and counts["ops"] == 4 + 1
    finally:
        coord.close()


def client_ops(plane: ControlPlane) -> float:
    plane.launcher.stats.clear()
    plane.inbox.put(("stats",))
    until(lambda: plane.call(plane.launcher.poll) is not None and "client" in plane.launcher.stats)
    return plane.launcher.stats["client"]["member_ops"]


def test_a_members_store_calls_for_a_resize_of_the_simulated_fleet_do_not_grow_with_it():
    per_member = []
    for workers in (8, 24):
        plane = ControlPlane(workers, queue.Queue(), queue.Queue(), run_dir=None, heartbeat_timeout_s=60.0)
        in_process_fleet(plane, step_s=0.5)
        plane.start()
        try:
            until(lambda: plane.ctl.formed == 0 and plane.coord.progress.step >= 1)
            before = client_ops(plane)
            plane.call(plane.ctl.request_resize, workers + workers // 8)
            until(lambda: plane.ctl.formed == plane.ctl.generation == 1)
            per_member.append((client_ops(plane) - before) / len(plane.ctl.members))
            assert plane.error is None
        finally:
            plane.inbox.put(("stop",))
            plane.stop()
    # each member: the announced command, its pointer (wait, read), the record, arrived, the count,
    # the wait, the abort check; the joiners' join and the steps meanwhile add well under one each
    assert all(8 <= c < 9.5 for c in per_member), per_member
