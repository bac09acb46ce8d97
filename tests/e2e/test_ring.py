"""comm/ring: the ring reduce-scatter / all-gather against plain sums and concatenations.

Pure tests check the schedule (simulated ranks in one process) and the byte formulas. Process
tests run gloo groups of 2, 3 and 4 ranks (one launch each, many cases per launch): every rank
builds every rank's input from a seed, so it computes the expected sum or concatenation itself;
each rank's ledger must equal the closed-form byte counts of the module docstring. A last launch
kills a peer and expects ``PeerFailure`` within the group's timeout, then a refused next op.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from virtualflow.comm.groups import Group, PeerFailure, make_group
from virtualflow.comm.ring import (Collectives, Ledger, ag_schedule, ring_traffic, rs_schedule)
from gloo_ranks import launch_ranks
from virtualflow.plan.shards import shard_bounds

JOIN_S = 60.0
KILL_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------------------------
# Pure: schedule, byte formulas, validation, size 1.


def _bounds_from_sizes(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


CHUNKS = {
    "even": lambda p: [5] * p,
    "uneven": lambda p: [3 + 2 * r for r in range(p)],
    "empty": lambda p: [0 if r % 2 else 4 + r for r in range(p)],  # every other rank owns nothing
    "first_empty": lambda p: [0] + [7] * (p - 1),
}


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_the_schedule_reduces_and_gathers_simulated_ranks(p, kind):
    bounds = _bounds_from_sizes(CHUNKS[kind](p))
    n = bounds[-1][1]
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(p)]
    flats = [x.clone() for x in inputs]
    for k in range(p - 1):  # every rank sends, then every rank adds what it received
        msgs = {}
        for r in range(p):
            cs, _ = rs_schedule(r, p)[k]
            lo, hi = bounds[cs]
            msgs[(r + 1) % p] = (cs, flats[r][lo:hi].clone())
        for r in range(p):
            cs_left, data = msgs[r]
            assert cs_left == rs_schedule(r, p)[k][1]  # the receiver expects the chunk it gets
            lo, hi = bounds[cs_left]
            flats[r][lo:hi] += data
    total = sum(inputs)
    for r in range(p):
        lo, hi = bounds[r]
        torch.testing.assert_close(flats[r][lo:hi], total[lo:hi])
    # all-gather: every rank ends with every chunk, and receives each chunk but its own once
    for r in range(p):
        got = [c for _, c in ag_schedule(r, p)]
        assert sorted(got + [r]) == list(range(p))
        assert [s for s, _ in ag_schedule(r, p)][0] == r  # it starts by forwarding its own chunk


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_ring_traffic_equals_the_closed_forms(p, kind):
    sizes = CHUNKS[kind](p)
    bounds = _bounds_from_sizes(sizes)
    total = sum(sizes)
    for itemsize in (4, 8):
        for r in range(p):
            left, right = (r - 1) % p, (r + 1) % p
            rs = ring_traffic("reduce_scatter", bounds, r, itemsize)
            ag = ring_traffic("all_gather", bounds, r, itemsize)
            ar = ring_traffic("all_reduce", bounds, r, itemsize)
            if p == 1:
                assert rs.bytes_sent == rs.bytes_received == ag.bytes_sent == ag.bytes_received == 0
                continue
            assert rs.bytes_sent == (total - sizes[r]) * itemsize
            assert rs.bytes_received == (total - sizes[left]) * itemsize
            assert ag.bytes_sent == (total - sizes[right]) * itemsize
            assert ag.bytes_received == (total - sizes[r]) * itemsize
            assert ar.bytes_sent == rs.bytes_sent + ag.bytes_sent
            # one message per non-empty chunk forwarded (segments far larger than the chunks)
            assert rs.messages_sent == sum(1 for c in range(p) if c != r and sizes[c])
            assert ag.messages_sent == sum(1 for c in range(p) if c != right and sizes[c])


def test_ring_traffic_counts_segments():
    bounds = shard_bounds(1000, 2)  # 500 each
    t = ring_traffic("reduce_scatter", bounds, 0, 4, segment_bytes=4 * 128)  # 128 elements a segment
    assert (t.bytes_sent, t.messages_sent, t.messages_received) == (2000, 4, 4)


def test_even_all_reduce_sends_the_textbook_two_p_minus_one_over_p():
    n, p = 1200, 4
    bounds = shard_bounds(n, p)
    assert ring_traffic("all_reduce", bounds, 1, 4).bytes_sent == 2 * (p - 1) * n // p * 4


def test_size_one_is_a_no_op_and_inputs_are_validated():
    ledger = Ledger()
    c = Collectives(Group(0, 0, 1, None), ledger)
    x = torch.arange(6.0)
    h = c.reduce_scatter(x, [(0, 6)], async_op=True)
    assert h.done()
    h.wait()
    assert c.all_gather(x, [(0, 6)]) is None and c.all_reduce(x) is None
    assert torch.equal(x, torch.arange(6.0))
    assert ledger.totals()["count"] == 3 and ledger.totals()["bytes_sent"] == 0
    with pytest.raises(ValueError, match="1-D contiguous"):
        c.reduce_scatter(torch.zeros(2, 3), [(0, 6)])
    with pytest.raises(ValueError, match="bounds for a group of 1"):
        c.reduce_scatter(x, [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="contiguously"):
        c.all_gather(x, [(1, 6)])
    with pytest.raises(ValueError, match="segment_bytes"):
        Collectives(Group(0, 0, 1, None), segment_bytes=0)
    c.close()
    c.close()  # idempotent
    closed = Collectives(Group(3, 0, 2, None))  # a group of 2 whose process group was closed
    with pytest.raises(PeerFailure, match="closed"):
        closed.all_reduce(x)


def test_ledger_totals_and_by_op():
    from virtualflow.comm.ring import LedgerEntry
    led = Ledger()
    led._add(LedgerEntry("reduce_scatter", bytes_sent=10, bytes_received=12, messages=1, wall_s=0.5, wait_s=0.1))
    led._add(LedgerEntry("all_gather", bytes_sent=3, messages=2))
    led._add(LedgerEntry("reduce_scatter", bytes_sent=5))
    assert led.totals()["bytes_sent"] == 18 and led.totals()["count"] == 3
    assert led.by_op()["reduce_scatter"]["bytes_sent"] == 15 and led.by_op()["all_gather"]["messages"] == 2
    led.clear()
    assert led.totals()["count"] == 0


# --------------------------------------------------------------------------------------------
# Processes.


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _cases(p: int) -> list[tuple[str, list[int], torch.dtype, int]]:
    """(name, chunk sizes, dtype, segment_bytes)."""
    big = 1 << 30
    return [
        ("even_f32", [1000] * p, torch.float32, big),
        ("uneven_f64", [97 + 31 * r for r in range(p)], torch.float64, big),
        ("empty_f32", CHUNKS["empty"](p), torch.float32, big),
        ("first_empty_f64", CHUNKS["first_empty"](p), torch.float64, big),
        ("segmented_f32", [1001 + r for r in range(p)], torch.float32, 4 * 100),  # 100 elements a message
        ("all_empty_f32", [0] * p, torch.float32, big),
    ]


def _check_cases(rank: int, p: int, group: Group) -> None:
    for seed, (name, sizes, dtype, seg) in enumerate(_cases(p)):
        for native in (False, True):  # our ring; the backend's own ops (the NCCL code path, on gloo)
            _check_case(rank, p, group, seed, f"{name}{' native' if native else ''}", sizes, dtype, seg, native)


def _check_case(rank: int, p: int, group: Group, seed: int, name: str, sizes: list[int], dtype: torch.dtype,
                seg: int, native: bool) -> None:
    bounds = _bounds_from_sizes(sizes)
    n = bounds[-1][1]
    total = sum(_input(seed, r, n, torch.float64) for r in range(p)).to(dtype)
    ledger = Ledger()
    c = Collectives(group, ledger, segment_bytes=seg, native=native)
    lo, hi = bounds[rank]
    item = torch.tensor([], dtype=dtype).element_size()

    x = _input(seed, rank, n, dtype)
    c.reduce_scatter(x, bounds)
    torch.testing.assert_close(x[lo:hi], total[lo:hi], msg=lambda m: f"{name} reduce_scatter: {m}")

    y = torch.full((n,), float("nan"), dtype=dtype)
    y[lo:hi] = _input(seed, rank, n, dtype)[lo:hi]
    c.all_gather(y, bounds)
    want = torch.cat([_input(seed, r, n, dtype)[a:b] for r, (a, b) in enumerate(bounds)])
    assert torch.equal(y, want), f"{name} all_gather"

    z = _input(seed, rank, n, dtype)
    c.all_reduce(z)
    torch.testing.assert_close(z, total, msg=lambda m: f"{name} all_reduce: {m}")
    c.close()
    if native:
        return
    by_op = ledger.by_op()
    for op, b in (("reduce_scatter", bounds), ("all_gather", bounds), ("all_reduce", shard_bounds(n, p))):
        t = ring_traffic(op, b, rank, item, segment_bytes=seg)
        got = by_op[op]
        assert (got["bytes_sent"], got["bytes_received"], got["messages"]) == \
            (t.bytes_sent, t.bytes_received, t.messages_sent), f"{name} {op}: ledger {got} != {t}"
    left = (rank - 1) % p
    assert by_op["reduce_scatter"]["bytes_sent"] == (n - sizes[rank]) * item
    assert by_op["reduce_scatter"]["bytes_received"] == (n - sizes[left]) * item
    assert by_op["all_gather"]["bytes_sent"] == (n - sizes[(rank + 1) % p]) * item


def _check_async(rank: int, p: int, group: Group) -> None:
    """Two ops in flight at once: right results, run in issue order, and overlapped with the
    caller's (sleep-emulated) compute over a (sleep-emulated) slow link."""
    ledger = Ledger()
    link_s = 0.25
    c = Collectives(group, ledger, link=lambda nbytes: time.sleep(link_s))
    n = 4000 * p
    bounds = shard_bounds(n, p)
    a = _input(100, rank, n, torch.float32)
    b = torch.zeros(n)
    lo, hi = bounds[rank]
    b[lo:hi] = rank + 1.0
    t0 = time.perf_counter()
    ha = c.reduce_scatter(a, bounds, async_op=True)
    hb = c.all_gather(b, bounds, async_op=True)
    issued_s = time.perf_counter() - t0
    assert issued_s < link_s / 2, f"issuing took {issued_s:.3f} s: the ops did not run in the background"
    assert not ha.done()
    time.sleep(link_s * (p - 1))  # "compute" while reduce-scatter's p-1 messages cross the link
    while not hb.done():
        time.sleep(0.002)
    seen_a_done_first = ha.done()  # FIFO: b cannot finish before a
    ha.wait()
    hb.wait()
    total = sum(_input(100, r, n, torch.float32) for r in range(p))
    torch.testing.assert_close(a[lo:hi], total[lo:hi])
    assert torch.equal(b, torch.cat([torch.full((bh - bl,), r + 1.0) for r, (bl, bh) in enumerate(bounds)]))
    assert seen_a_done_first
    assert [e.op for e in ledger.entries] == ["reduce_scatter", "all_gather"]
    rs = ledger.entries[0]
    # the reduce-scatter's wall time is its p-1 link delays; the caller was blocked for little of it
    assert rs.wall_s >= link_s * (p - 1) * 0.9
    assert rs.wait_s < link_s, f"exposed wait {rs.wait_s:.3f} s: no overlap with the compute"
    # close() finishes what is queued, then stops the thread; later ops are refused
    hc = c.all_gather(b, bounds, async_op=True)
    c.close()
    assert hc.done() and not c._thread.is_alive()
    hc.wait()
    with pytest.raises(RuntimeError, match="closed"):
        c.reduce_scatter(a, bounds)


def _rank_main(rank: int, p: int, port: int, what: str, errors) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, p, False, timeout=datetime.timedelta(seconds=30))
        timeout_s = KILL_TIMEOUT_S if what == "kill" else 30.0
        group = make_group(store, 0, rank, p, timeout_s, torch.device("cpu"))
        if what == "kill":
            _killed_peer(rank, p, group)
        elif what == "silent":
            _silent_peer(rank, p, group)
        else:
            _check_cases(rank, p, group)
            _check_async(rank, p, group)
            group.all_reduce(torch.zeros(1))  # nobody closes its sockets while a peer still reads
            group.close()
    except BaseException:  # noqa: BLE001 - reported to the test process
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    errors.put((rank, None))


def _launch(p: int, what: str) -> dict[int, str | None]:
    return launch_ranks(_rank_main, p, what, timeout_s=JOIN_S)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_collectives_in_processes(p):
    out = _launch(p, "cases")
    failed = {r: e for r, e in out.items() if e is not None}
    assert not failed, "\n".join(f"rank {r}:\n{e}" for r, e in failed.items())
    assert sorted(out) == list(range(p)), f"ranks that reported: {sorted(out)} (a rank hung or died)"


def _killed_peer(rank: int, p: int, group: Group) -> None:
    """The last rank dies after one good op; the others must see PeerFailure within the group's
    timeout and their Collectives must refuse the next op."""
    c = Collectives(group)
    n = 1 << 16
    c.reduce_scatter(torch.ones(n), shard_bounds(n, p))  # one good op first
    if rank == p - 1:
        os._exit(0)  # dies without a goodbye (as SIGKILL would)
    t0 = time.perf_counter()
    with pytest.raises(PeerFailure) as exc:
        for _ in range(50):  # the death surfaces in one of the next ops
            c.reduce_scatter(torch.ones(n), shard_bounds(n, p))
    elapsed = time.perf_counter() - t0
    assert elapsed < KILL_TIMEOUT_S + 5, f"PeerFailure after {elapsed:.1f} s (group timeout {KILL_TIMEOUT_S} s)"
    assert exc.value.generation == 0
    with pytest.raises(PeerFailure, match="earlier collective"):
        c.all_gather(torch.ones(n), shard_bounds(n, p))
    c.close()
    group.close()  # releases a survivor still waiting on us (gloo has no abort)


def _silent_peer(rank: int, p: int, group: Group) -> None:
    """Rank 1 never joins the op; rank 0's wait ends when the (emulated) coordinator's abort flag
    rises, long before the group's timeout."""
    if rank == 1:
        time.sleep(3.0)
        group.close()
        return
    c = Collectives(group)
    t_abort = time.monotonic() + 0.3
    group.abort_check = lambda: time.monotonic() > t_abort
    t0 = time.perf_counter()
    with pytest.raises(PeerFailure, match="declared the generation broken"):
        c.reduce_scatter(torch.ones(1 << 16), shard_bounds(1 << 16, p))
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(PeerFailure, match="earlier collective"):
        c.all_gather(torch.ones(8), shard_bounds(8, p))
    group.close()
    c.close(timeout_s=KILL_TIMEOUT_S)


def test_a_killed_peer_raises_peer_failure_and_breaks_the_collectives():
    out = _launch(3, "kill")
    assert 2 not in out  # the killed rank reports nothing
    for r in (0, 1):
        assert r in out, f"rank {r} never reported (hung)"
        assert out[r] is None, f"rank {r}:\n{out[r]}"


def test_an_aborted_generation_ends_the_wait_on_a_silent_peer():
    out = _launch(2, "silent")
    assert sorted(out) == [0, 1], f"ranks that reported: {sorted(out)}"
    assert out[0] is None, f"rank 0:\n{out[0]}"
