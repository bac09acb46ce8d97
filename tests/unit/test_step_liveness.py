"""A completed step is a liveness event of every member (the step's statistics all-reduce returns
on no member until all entered it): a member does not beat while its steps come faster than its
beat interval, and the coordinator counts rank 0's step report as a beat of each member. Checked
with fake clocks and a real in-process store: beats and steps together stay at most one interval
apart, the coordinator judges a member that stops within the same bound as before, and a member
that goes on beating after its steps stop is never judged."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

import virtualflow as vf
from virtualflow.comm import protocol
from virtualflow.control.coordinator import Coordinator
from virtualflow.control.membership import MembershipController
from virtualflow.control.membership.interface import JobFailed
from virtualflow.control.membership.liveness import SWEEPS_PER_TIMEOUT, Liveness
from virtualflow.runtime.channel import next_beat_at

from control_fakes import Clock, FakeLauncher

TIMEOUT_S = 3.0


def beats_of(step_times: list[float], interval: float, follows: bool, until: float) -> list[float]:
    """The beats a worker sends under :func:`next_beat_at`, stepping at ``step_times``: the
    worker's own loop (wake at the due time, look again if a step moved it), on a fake clock."""
    beats, last_beat, now = [], 0.0, 0.0
    while now < until:
        stepped = max([t for t in step_times if t <= now], default=float("-inf"))
        due = next_beat_at(last_beat, stepped, interval, follows)
        if due <= now:
            beats.append(now)
            last_beat = now
            continue
        now = min([due] + [t for t in step_times if now < t < due])  # woken by the due time (a step moves it)
    return beats


@pytest.mark.parametrize("step_s", [0.1, 0.5, 1.0, 2.0, 10.0])
def test_beats_and_steps_together_are_never_more_than_an_interval_apart(step_s):
    interval = 0.75
    steps = [step_s * k for k in range(1, int(30 / step_s) + 1)]  # steps until 30 s, then none
    beats = beats_of(steps, interval, follows=False, until=40.0)
    events = sorted(set(beats + steps + [0.0]))
    gaps = [b - a for a, b in zip(events, events[1:])]
    assert max(gaps) <= interval + 1e-9
    during = [b for b in beats if b < 30.0]
    if step_s < interval:
        assert during == []  # steps faster than the interval: no beat at all while they come
    else:
        assert len(during) <= len(steps) * int(step_s / interval)  # never more than the plain law
    after = [b for b in beats if b > 30.0]
    assert after and after[0] == pytest.approx(30.0 + interval)  # the first beat an interval after the last step
    # rank 0 follows the control sequence: it beats at its own pace whatever its steps do
    assert len(beats_of(steps, interval, follows=True, until=40.0)) == int(40.0 / interval)


def store_and_liveness(workers: int):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    launcher = FakeLauncher()
    live = Liveness(launcher, store, heartbeat_timeout_s=TIMEOUT_S)
    for w in range(workers):
        launcher.start_worker(w)
        live.joined(w, now=0.0)
    return store, launcher, live


def test_steps_stand_in_for_beats_and_a_member_that_stops_is_judged_within_the_old_bound():
    store, launcher, live = store_and_liveness(6)
    tick = 0.05
    members = [0, 1, 2, 3]  # 4 and 5 joined but are in no generation: they beat as before
    failed: dict[int, str] = {}
    t = 0.0
    while t < 60.0:  # a minute of 1 s steps: members 1-3 never beat, rank 0 and the others do
        t = round(t + tick, 2)
        if t % 1.0 == 0:
            live.stepped(members, t)
        if t % 0.75 == 0:
            for w in (0, 4, 5):
                store.add(protocol.heartbeat_key(w), 1)
        failed.update(live.judge(t, finished=False))
    assert failed == {}
    # the steps stop at 60 s: members 1 and 2 go on beating (every 0.75 s), member 3 is gone silent
    stop = 60.0
    while t < stop + 2 * TIMEOUT_S:
        t = round(t + tick, 2)
        if round(t - stop, 2) % 0.75 == 0:
            for w in (0, 1, 2, 4, 5):
                store.add(protocol.heartbeat_key(w), 1)
        for w, why in live.judge(t, finished=False).items():
            failed[w] = why
            judged_at = t
    assert list(failed) == [3] and "no heartbeat" in failed[3] and launcher.codes[3] == -9
    # judged within heartbeat_timeout x (1 + 1/SWEEPS) plus a tick of its last step, as a silent
    # worker is judged after its last beat
    assert stop + TIMEOUT_S < judged_at <= stop + TIMEOUT_S * (1 + 1 / SWEEPS_PER_TIMEOUT) + tick
    assert 3 not in live.watched()
    store.add(protocol.heartbeat_key(3), 1)  # it comes back: judged once, not again
    assert live.judge(t + 10, finished=False) == {}
    live.stepped([3], t + 11)  # a step report naming it is no beat of a worker judged gone
    assert 3 not in live.watched()


def test_the_controller_counts_a_new_step_report_for_its_members_and_not_a_re_sent_one():
    clock = Clock()
    coord = Coordinator(total_steps=100, run_dir=None)
    launcher = FakeLauncher()
    ctl = MembershipController(coord, launcher, vf.LaunchOptions(workers=3, steps=100, heartbeat_timeout_s=TIMEOUT_S),
                               virtual_nodes=6, clock=clock)
    ctl.start()
    ctl.tick([{"type": "join", "worker": w, "setup_s": 0.0} for w in range(3)]
             + [{"type": "formed", "generation": 0, "members": [0, 1, 2], "step": 0, "group_s": 0, "transfer_s": 0,
                 "bytes": 0, "source": None, "receivers": []}])

    def step(n: int) -> dict:
        return {"type": "step", "worker": 0, "step": n, "generation": 0, "members": [0, 1, 2], "loss": 1.0,
                "samples": 6, "step_time_s": 1.0, "workers": 3, "vns": [[0, 1], [2, 3], [4, 5]], "time": 0.0}

    for n in range(20):  # 20 s of steps and no beat from anyone: nobody is judged
        clock.t += 1.0
        ctl.tick([step(n)])
        assert not ctl.liveness.gone
    clock.t += 2.0
    ctl.tick([step(5)])  # a report re-sent after a regroup is not a new liveness event
    clock.t += 1.5
    with pytest.raises(JobFailed, match="no heartbeat for 3.5 s") as failed:
        ctl.tick([])  # silent for 3.5 s since their last new step: all three judged, nobody left
    assert ctl.liveness.gone == {0, 1, 2} and all(f"worker {w} " in str(failed.value) for w in range(3))
    coord.close()
