"""The ``owners`` exchange on one machine: a group whose members all reached the store over loopback
is ``local`` on every member (a vote counted in the store), and its exchange cuts an owner's chunk
into :data:`LOCAL_DEPTH` messages instead of :data:`DEPTH` (same additions: the root's bits do not
depend on the cut, checked piece by piece in test_exchange_pipelined.py)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import virtualflow.comm.groups as groups_mod
from virtualflow.comm.groups import Group, make_group
from virtualflow.comm.net import loopback_store
from virtualflow.plan.exchange import DEPTH, LOCAL_DEPTH, SEGMENT, OwnerSchedule, depth_for, segment_for, units
from virtualflow.plan.vnmap import TreePlan
from virtualflow.runtime.step.exchange import owner_exchange

CPU = torch.device("cpu")
T = datetime.timedelta(seconds=30)


def test_a_store_on_loopback_is_local_any_other_is_not():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    assert loopback_store(store)
    assert loopback_store(dist.PrefixStore("gen/1", dist.PrefixStore("job", store)))  # under prefixes too
    assert not loopback_store(dist.HashStore())  # not a TCP store: nothing is known, so not local


def build_pair(monkeypatch=None, remote_rank: int | None = None) -> list[Group]:
    """A two-member gloo group built from two threads over a store on 127.0.0.1; with
    ``remote_rank``, that member votes as if it had reached the store over a link."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    if remote_rank is not None:
        real = groups_mod.loopback_store
        monkeypatch.setattr(groups_mod, "loopback_store",
                            lambda s: False if threading.current_thread().name == f"member-{remote_rank}" else real(s))
    out: list = [None, None]

    def body(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=T)
        out[rank] = make_group(client, 3, rank, 2, 30.0, CPU)

    threads = [threading.Thread(target=body, args=(r,), name=f"member-{r}", daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(g, Group) for g in out), out
    return out


def test_members_that_all_reached_the_store_over_loopback_agree_the_group_is_local():
    groups = build_pair()
    try:
        assert [g.local for g in groups] == [True, True]
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("remote_rank", [0, 1])
def test_one_member_over_a_link_makes_the_group_not_local_on_every_member(monkeypatch, remote_rank):
    groups = build_pair(monkeypatch, remote_rank)
    try:
        assert [g.local for g in groups] == [False, False]  # the same answer on both, whoever voted remote
    finally:
        for g in groups:
            g.close()


def test_a_single_worker_or_hand_made_group_is_not_local():
    assert not Group(0, 0, 1, None).local


def test_local_groups_cut_an_owners_chunk_into_fewer_messages():
    assert depth_for(True) == LOCAL_DEPTH < DEPTH == depth_for(False)
    chunk = 878_254  # the 2.6 M MLP over 3 workers
    assert segment_for(chunk, SEGMENT, LOCAL_DEPTH) == chunk  # one message per piece and owner
    assert segment_for(chunk, SEGMENT, DEPTH) == -(-chunk // DEPTH)
    assert segment_for(25_000_000 // 3, SEGMENT, LOCAL_DEPTH) == SEGMENT  # the message cap still holds
    bounds = [(0, 400), (400, 800)]
    assert len(units(bounds, None, 64, depth=1)) == 2 * 7  # 400 / 64 -> 7 segments each: the cap
    with pytest.raises(ValueError, match="depth=0"):
        units(bounds, None, SEGMENT, depth=0)


@pytest.mark.parametrize("local", [True, False])
def test_the_runtimes_exchange_is_cut_by_its_groups_locality(local):
    plan = TreePlan.build([[0, 1, 2], [3, 4, 5], [6, 7]])
    numel = 3_000_000
    ex = owner_exchange(plan, Group(0, 0, 3, None, local=local), numel, dtype=torch.float32, device=CPU)
    want = OwnerSchedule.build(plan, numel, depth=LOCAL_DEPTH if local else DEPTH)
    assert ex.schedule.units == want.units
    assert len(ex.schedule.units) == (3 if local else 3 * DEPTH)
