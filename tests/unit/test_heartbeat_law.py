"""The heartbeat's law (:func:`virtualflow.runtime.channel.heartbeat_interval_s`): the fleet's
beats cost the store a bounded rate, a live worker still beats several times per heartbeat
timeout, and only rank 0 reads the control sequence on every beat (the others' beat is one store
call: the abort flag is read only when the coordinator's abort mark moved the counter), checked
against a brute-force count of store calls on a real in-process store."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from bench.harness.fleet import Counting
from virtualflow.comm import protocol
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.runtime.channel import ABORT_MARK, BEATS_PER_TIMEOUT, HEARTBEATS_PER_S, Heartbeat, heartbeat_interval_s
from virtualflow.runtime.worker_config import WorkerConfig

RUN = protocol.RunKey("k" * 64, "job-heartbeat-law")
BASE = 0.05


@pytest.mark.parametrize("timeout_s", [1.0, 3.0, 15.0])
def test_the_fleet_rate_is_bounded_and_a_live_worker_beats_four_times_per_timeout(timeout_s):
    for workers in [1, 2, 8, 50, 51, 64, 256, 749, 750, 1024, 4096, 100_000]:
        interval = heartbeat_interval_s(workers, BASE, timeout_s, follows=False)
        assert BASE <= interval <= max(BASE, timeout_s / BEATS_PER_TIMEOUT)
        rate = workers / interval  # the fleet's beats a second, by the law's own statement
        expected = min(workers / BASE, max(HEARTBEATS_PER_S, BEATS_PER_TIMEOUT * workers / timeout_s))
        assert rate == pytest.approx(expected)
        assert heartbeat_interval_s(workers, BASE, timeout_s, follows=True) == BASE  # rank 0: commands on time
    # the figures the docs state: 50 ms up to 50 workers, 0.256 s at 256, 0.75 s (the cap) at 1,024
    assert [heartbeat_interval_s(w, BASE, 3.0, False) for w in (50, 256, 1024)] == pytest.approx([0.05, 0.256, 0.75])


def heartbeat(workers: int) -> tuple[Heartbeat, dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    cfg = WorkerConfig(options=WorkerOptions(heartbeat_timeout_s=2.0, coordinator_timeout_s=15.0),
                       store_host="127.0.0.1", store_port=store.port, job_source=None, total_steps=1,
                       state_dir="/nonexistent", overrides={}, threads=1, resume_path=None, initial_workers=workers,
                       slowdowns={})
    return Heartbeat(cfg, 3, run=RUN), store


def test_only_rank_0_follows_the_control_sequence_and_the_others_beat_in_one_call():
    hb, raw = heartbeat(workers=400)
    counts: dict[str, float] = {}
    store = Counting(raw, counts)
    for n, op in enumerate(["slowdown", "slowdown", "regroup"], start=1):
        raw.set(protocol.control_key(n), protocol.seal_command(RUN, n, op, {"worker": 9, "factor": 2.0, "generation": 1}))
    raw.set(protocol.CONTROL_SEQ_KEY, "3")
    assert hb.interval_s() == pytest.approx(0.4)  # before any generation: the starting fleet's pace, not following
    hb.watch(0, rank=5, workers=400, acted=1)
    hb._beat(store)
    assert counts["ops"] == 2 and not hb.commands  # the counter; a new generation's abort flag, once
    counts.clear()
    hb._beat(store)
    assert counts["ops"] == 1  # then the counter alone
    assert int(raw.add(protocol.heartbeat_key(3), 0)) == 2
    hb.watch(1, rank=0, workers=400, acted=1)  # rank 0 of the next generation, which acted on command 1
    assert hb.interval_s() == BASE
    counts.clear()
    hb._beat(store)
    assert hb.control_seq == 3 and sorted(hb.commands) == [2, 3]  # command 1 needed no reading
    assert counts["ops"] == 3 + 2 * 2  # counter, sequence, abort flag; check + get per new command
    hb.watch(1, rank=2, workers=10, acted=3)
    assert hb.interval_s() == BASE  # 10 workers: the base pace
    hb._beat(store)
    counts.clear()
    hb._beat(store)
    assert counts["ops"] == 1 and not hb.broken()
    raw.set(protocol.abort_key(1), protocol.seal_abort(RUN, 1))
    hb._beat(store)
    assert not hb.broken()  # a flag without the coordinator's mark is not looked for
    raw.add(protocol.heartbeat_key(3), ABORT_MARK)  # what Coordinator.abort adds after the flag
    hb._beat(store)
    assert hb.broken()  # the abort flag is still seen by every member, at its next beat


def test_an_abort_marks_the_watched_heartbeats_and_the_mark_is_not_a_beat():
    from virtualflow.control.coordinator import Coordinator
    from virtualflow.control.membership.liveness import Liveness

    from control_fakes import FakeLauncher

    coord = Coordinator(total_steps=1, run_dir=None)
    counts: dict[str, float] = {}
    coord.store = Counting(coord.store, counts)
    live = Liveness(FakeLauncher(), coord.store, heartbeat_timeout_s=3.0)
    for w in range(4):
        live.joined(w, now=0.0)
    live.judge(now=1.0, finished=False)
    counts.clear()
    coord.abort(0, beating=live.watched())
    assert counts["ops"] == 1 + 4  # the signed flag, then one mark per watched worker
    assert [int(coord.store.add(protocol.heartbeat_key(w), 0)) for w in range(4)] == [ABORT_MARK] * 4
    failed = live.judge(now=3.5, finished=False)  # silent since 0 s: the marks did not count as beats
    assert sorted(failed) == [0, 1, 2, 3]
    coord.close()
