"""``shard_replicas=1``: each chunk of the sharded optimizer state also lives on the next worker.

In-process: p "workers" are threads over an in-memory fabric (all-reduce, broadcast and
point-to-point messages by copying), running the real :class:`ShardedOptimizer` and the real
exchange and rebuild of :mod:`virtualflow.runtime.shard_replica`. The standard is a plain PyTorch
optimizer stepping the whole model with the same gradients: after a worker is lost at any point of
a step, the survivors' rebuilt state (parameters and optimizer state) is that optimizer's, bit for
bit, after the step the commit rule names.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import pytest
import torch
from torch import nn

from virtualflow.plan.shards import shard_bounds
from virtualflow.runtime.shard_replica import (Holder, chunk_sources, exchange_gradients, plan_rebuild,
                                               rebuild_state)
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer, ShardLost


# -- the pure rules --------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_lost_rank_is_supplied_by_its_successor(p):
    for lost in range(p):
        alive = set(range(p)) - {lost}
        sources = chunk_sources(p, alive)
        assert sources[lost] == (lost + 1) % p
        assert all(sources[k] == k for k in alive)


def test_two_neighbours_lost_lose_a_chunk_and_say_so():
    with pytest.raises(ShardLost, match=r"both holders of chunk 1 \(ranks 1 and 2\).*--resume RUN_DIR"):
        chunk_sources(4, {0, 3})
    with pytest.raises(ShardLost, match=r"chunk 0 \(ranks 0 and 1\), chunk 1 \(ranks 1 and 0\)"):
        chunk_sources(2, set())
    assert chunk_sources(4, {1, 3}) == [1, 1, 3, 3]  # two failures, not neighbours: nothing lost


def holder(member, rank, progress, pending=False, size=3, generation=5, finished=False):
    return Holder(member=member, generation=generation, rank=rank, size=size, progress=progress, pending=pending,
                  finished=finished)


def test_the_commit_rule_redoes_or_completes_the_interrupted_step():
    # Nobody applied step 7: whoever entered the commit drops it, the step is redone.
    plan = plan_rebuild([holder(0, 0, 7, pending=True), holder(1, 2, 7)])
    assert (plan.target, plan.finish, plan.drop, plan.sources) == (7, frozenset(), {0}, (0, 1, 1))
    # Rank 2 applied step 7 (its all-gather failed or not): rank 0, whose commit failed, applies it too.
    plan = plan_rebuild([holder(0, 0, 7, pending=True), holder(1, 2, 8)])
    assert (plan.target, plan.finish, plan.drop) == (8, {0}, frozenset())
    # Rank 2 went on to step 8's commit: it drops that one, rank 0 catches up with step 7.
    plan = plan_rebuild([holder(0, 0, 7, pending=True), holder(1, 2, 8, pending=True)])
    assert (plan.target, plan.finish, plan.drop) == (8, {0}, {1})


def test_states_the_rule_cannot_reconcile_stop_with_shard_lost():
    with pytest.raises(ShardLost, match="different generations"):
        plan_rebuild([holder(0, 0, 7), holder(1, 2, 7, generation=4)])
    with pytest.raises(ShardLost, match="without the gradients to catch up"):
        plan_rebuild([holder(0, 0, 7), holder(1, 2, 8)])  # rank 0 never entered step 7's commit
    with pytest.raises(ShardLost, match="while the optimizer state was being rebuilt"):
        plan_rebuild([holder(0, 0, 8, finished=True), holder(1, 2, 8)])
    with pytest.raises(ShardLost, match="both holders of chunk 0"):
        plan_rebuild([holder(0, 2, 7)])


def test_the_knob_is_checked_where_it_is_set():
    import virtualflow as vf

    with pytest.raises(ValueError, match=r"shard_replicas=1 .*reduction='allreduce'.*--shard-replicas"):
        vf.LaunchOptions(workers=2, steps=1, shard_replicas=1)
    with pytest.raises(ValueError, match=r"shard_replicas=2 must be 0 .* or 1"):
        vf.LaunchOptions(workers=2, steps=1, reduction="sharded", shard_replicas=2)
    vf.LaunchOptions(workers=2, steps=1, reduction="sharded", shard_replicas=1)


# -- an in-process fabric --------------------------------------------------------------------------
class Fabric:
    """Collectives and messages between the threads of one generation."""

    def __init__(self, p: int, generation: int) -> None:
        self.p, self.generation = p, generation
        self.barrier = threading.Barrier(p, timeout=30)
        self.slots: list = [None] * p
        self.boxes: dict = {}
        self.lock = threading.Lock()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), queue.Queue())

    def group(self, rank: int) -> "Member":
        return Member(self, rank)


class _Done:
    def __init__(self, fn: Callable[[], None] = lambda: None) -> None:
        self.fn = fn

    def wait(self) -> None:
        self.fn()


class Member:
    """What the rebuild and the exchange use of a :class:`~virtualflow.comm.groups.Group`."""

    def __init__(self, fabric: Fabric, rank: int) -> None:
        self.fabric, self.rank, self.size, self.generation = fabric, rank, fabric.p, fabric.generation

    def all_reduce(self, t: torch.Tensor) -> None:
        f = self.fabric
        f.slots[self.rank] = t.clone()
        f.barrier.wait()
        total = f.slots[0].clone()
        for q in range(1, f.p):
            total += f.slots[q]
        f.barrier.wait()
        t.copy_(total)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        f = self.fabric
        if self.rank == src:
            f.slots[src] = t.clone()
        f.barrier.wait()
        if self.rank != src:
            t.copy_(f.slots[src])
        f.barrier.wait()

    def all_gather(self, flat: torch.Tensor, bounds) -> None:
        f = self.fabric
        f.slots[self.rank] = flat
        f.barrier.wait()
        for q, (lo, hi) in enumerate(bounds):
            if q != self.rank:
                flat[lo:hi].copy_(f.slots[q][lo:hi])
        f.barrier.wait()

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> _Done:
        self.fabric.box(self.rank, dst, tag).put(t.clone())
        return _Done()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(t, src, tag).wait()

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> _Done:
        box = self.fabric.box(src, self.rank, tag)
        return _Done(lambda: t.copy_(box.get(timeout=30)))


def run_threads(n: int, fn: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


# -- a model, its optimizers and the whole-model reference ------------------------------------------
def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.Tanh(), nn.Linear(5, 3))


def make_opt(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    ps = list(model.parameters())
    if kind == "adam_groups":
        return torch.optim.Adam([{"params": ps[:2], "lr": 0.02}, {"params": ps[2:]}], lr=0.005, weight_decay=0.01)
    if kind == "adamw_amsgrad":
        return torch.optim.AdamW(ps, lr=0.01, amsgrad=True)
    if kind == "sgd_mixed":
        return torch.optim.SGD([{"params": ps[:3], "momentum": 0.9}, {"params": ps[3:]}], lr=0.05, weight_decay=0.1)
    raise AssertionError(kind)


def grads(steps: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=g) for _ in range(steps)]


def reference(kind: str, gs: list[torch.Tensor]):
    model = net()
    opt = make_opt(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    flat = FlatParams(list(model.parameters()))
    for g in gs:
        flat.grad.copy_(g)
        opt.step()
        sched.step()
    return flat.flat.clone(), opt.state_dict()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def assert_same_state(a: dict, b: dict) -> None:
    """The optimizer state dicts ``a`` and ``b`` hold the same entries, bit for bit."""
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        assert sorted(a["state"][k]) == sorted(b["state"][k]), k
        for name, v in a["state"][k].items():
            assert same_bits(v, b["state"][k][name]), (k, name)


class Worker:
    """One worker's model, optimizer, scheduler and sharded optimizer with a replica."""

    def __init__(self, kind: str) -> None:
        self.model = net()
        self.opt = make_opt(kind, self.model)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.flat = FlatParams(list(self.model.parameters()))
        self.shard = ShardedOptimizer(self.opt, self.flat, replicas=1)
        self.progress = 0

    def exchange(self, g: torch.Tensor, member: Member) -> None:
        """The step up to the commit: the reduced gradient held, the replica's exchanged."""
        self.flat.grad.copy_(g)
        exchange_gradients(self.shard, member)
        self.shard.pending = True

    def apply(self, member: Member | None) -> None:
        """The step from the commit on; ``member`` None: the all-gather failed (deferred)."""
        self.shard.step()
        if member is not None:
            member.all_gather(self.flat.flat, self.shard.bounds)
        self.shard.scheduler_step(self.sched)
        self.progress += 1


def train(kind: str, p: int, gs: list[torch.Tensor]) -> list[Worker]:
    workers = [Worker(kind) for _ in range(p)]
    fabric = Fabric(p, generation=3)

    def body(r: int) -> None:
        w, m = workers[r], fabric.group(r)
        w.shard.shard(r, p, fabric.generation)
        for g in gs:
            w.exchange(g, m)
            w.apply(m)

    run_threads(p, body)
    return workers


def rebuild(workers: list[Worker], members: list[int]) -> list:
    """The next generation: ``members`` (indices into ``workers``) rebuild the state; returns
    each one's (parameters, whole optimizer state)."""
    fabric = Fabric(len(members), generation=4)
    out: list = [None] * len(members)

    def body(i: int) -> None:
        w = workers[members[i]]
        rebuild_state(w.shard, fabric.group(i), w.progress)
        out[i] = (w.flat.flat.clone(), w.shard.full)

    run_threads(len(members), body)
    return out


KINDS = ["adam_groups", "adamw_amsgrad", "sgd_mixed"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_replica_is_the_predecessors_chunk_bit_for_bit(kind, p):
    numel = sum(q.numel() for q in net().parameters())
    workers = train(kind, p, grads(4, numel))
    for r, w in enumerate(workers):
        pred = workers[(r - 1) % p].shard
        rep = w.shard.replica
        assert rep is not None and rep.rank == (r - 1) % p and (rep.lo, rep.hi) == pred.chunk()
        assert sorted(rep.pieces) == sorted(pred.pieces)
        for i, (a, view) in rep.pieces.items():
            mine, theirs = rep.optimizer.state[view], pred.local.state[pred.pieces[i][1]]
            assert sorted(mine) == sorted(theirs)
            for key in mine:
                assert same_bits(mine[key], theirs[key]), (r, i, key)
        # The replica stepped a copy of the predecessor's parameters (in the gradient buffer, free
        # outside this worker's chunk) to the values the all-gather brought.
        assert same_bits(w.flat.grad[rep.lo : rep.hi], workers[(r - 1) % p].flat.flat[rep.lo : rep.hi])
        # The cost: as much optimizer state as the predecessor's chunk holds, and its gradient.
        lo, hi = pred.chunk()
        assert w.shard.replica_bytes() == pred.state_bytes() + (hi - lo) * 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_survivors_rebuild_the_whole_state_after_any_rank_is_lost(kind, p):
    numel = sum(q.numel() for q in net().parameters())
    gs = grads(3, numel)
    ref_flat, ref_opt = reference(kind, gs)
    for lost in range(p):
        workers = train(kind, p, gs)
        workers.append(Worker(kind))  # a newcomer (replace_failed) takes part too
        workers[-1].progress = -1
        members = [r for r in range(p) if r != lost] + [p]
        results = rebuild(workers, members)
        for flat, full in results:
            assert same_bits(flat, ref_flat), lost
            assert_same_state(full, ref_opt)
        for _, full in results[:-1]:  # the newcomer's learning rate comes with the state transfer
            assert full["param_groups"] == ref_opt["param_groups"]


@pytest.mark.parametrize("p", [3, 4])
@pytest.mark.parametrize("outcome", ["redone", "completed"])
def test_a_step_interrupted_between_the_commit_and_the_all_gather(p, outcome):
    """Step 3 of 4: every worker exchanged the replica's gradient; the last one is killed. Redone:
    nobody's commit completed (everyone pending). Completed: the lost worker and rank 0 applied the
    step (rank 0's all-gather failed: it holds only its own and its replica's new chunks), the
    others' commits failed. Either way the survivors agree, bit for bit."""
    kind = "adam_groups"
    numel = sum(q.numel() for q in net().parameters())
    gs = grads(4, numel)
    workers = train(kind, p, gs[:3])
    fabric = Fabric(p, generation=3)
    run_threads(p, lambda r: workers[r].exchange(gs[3], fabric.group(r)))
    lost = p - 1
    if outcome == "completed":
        workers[lost].apply(None)
        workers[0].apply(None)
    ref_flat, ref_opt = reference(kind, gs if outcome == "completed" else gs[:3])
    results = rebuild(workers, list(range(p - 1)))
    for r, (flat, full) in enumerate(results):
        assert same_bits(flat, ref_flat), r
        assert_same_state(full, ref_opt)
        if outcome == "redone" or r == 0:  # who caught up gets the learning rate with the state transfer
            assert full["param_groups"] == ref_opt["param_groups"]


def test_two_neighbours_lost_in_one_generation_stop_with_shard_lost():
    numel = sum(q.numel() for q in net().parameters())
    workers = train("adam_groups", 4, grads(1, numel))
    with pytest.raises(ShardLost, match="both holders of chunk 1"):
        rebuild(workers, [0, 3])


def test_a_chunk_with_no_elements_needs_no_replica_traffic():
    # 48 elements over 4 ranks on 16-element boundaries: rank 3's chunk is empty.
    model = nn.Linear(47, 1, bias=True)
    assert sum(q.numel() for q in model.parameters()) == 48
    assert shard_bounds(48, 4, 16)[3] == (48, 48)
    ps = [nn.Linear(47, 1) for _ in range(4)]
    shards = [ShardedOptimizer(torch.optim.Adam(m.parameters()), FlatParams(list(m.parameters())), replicas=1)
              for m in ps]
    fabric = Fabric(4, generation=0)

    def body(r: int) -> None:
        s = shards[r]
        s.shard(r, 4, 0)
        s.flat.grad.fill_(1.0)
        exchange_gradients(s, fabric.group(r))
        s.step()

    run_threads(4, body)
    assert shards[0].replica.hi == shards[0].replica.lo  # rank 0 holds rank 3's empty chunk
    assert not fabric.boxes.get((3, 0, 18))


def test_a_failure_while_a_completed_step_is_rebuilt_stops_with_shard_lost():
    """Rank 1 completed step 2 from its pending gradients in a rebuild that then failed (its
    progress still says 1): the next attempt must not take its state for step 1's."""
    numel = sum(q.numel() for q in net().parameters())
    gs = grads(2, numel)
    workers = train("adam_groups", 3, gs[:1])
    fabric = Fabric(3, generation=3)
    run_threads(3, lambda r: workers[r].exchange(gs[1], fabric.group(r)))
    workers[0].apply(None)
    rebuild(workers, [0, 1])  # rank 2 lost; rank 1 completes step 1 (finished)
    assert workers[1].shard.finished and workers[1].progress == 1
    with pytest.raises(ShardLost, match="while the optimizer state was being rebuilt"):
        rebuild(workers, [0, 1])


def test_an_empty_chunk_at_the_end_takes_part_in_the_clipping_norm():
    """More workers than 4096-element blocks (max_grad_norm with the sharded reduction): chunks
    start on the norm's blocks (each parameter's own), the last workers' chunks are empty at
    offset numel, and the chunks' block sums together are the whole gradient's bit for bit."""
    from virtualflow.plan.shards import shard_bounds
    from virtualflow.runtime.clipping import BLOCK, NormBlocks

    numels = [1027, 5000]
    blocks = NormBlocks(numels, torch.float32)
    bounds = shard_bounds(sum(numels), 4, 16, blocks.cuts())
    assert bounds == [(0, 5123), (5123, 6027), (6027, 6027), (6027, 6027)]
    g = torch.randn(sum(numels), generator=torch.Generator().manual_seed(3))
    offsets = [0, 1027]

    def sums_of(lo, hi):
        out = blocks.zeros(torch.device("cpu"))
        for i, (o, n) in enumerate(zip(offsets, numels)):
            a, b = max(lo, o), min(hi, o + n)
            if a < b:
                blocks.fill(out, i, g[a:b], first=(a - o) // BLOCK)
        return out

    total = torch.zeros(blocks.size)
    for lo, hi in bounds:
        total += sums_of(lo, hi)
    assert torch.equal(total, sums_of(0, sum(numels)))
