"""Pure planning code: data order, VN slices, seeds, VN maps, reduction tree."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.permutation import epoch_indices

from reference import order_index
from virtualflow.plan.vnmap import TreePlan, contiguous_assignment, covering_nodes, describe_assignment, split


@pytest.mark.parametrize("order", ["feistel", "randperm"])
def test_data_order_is_the_documented_formula(order):
    plan = DataPlan(dataset_size=100, global_batch_size=24, virtual_nodes=4, seed=3, order=order)
    assert plan.steps_per_epoch == 4  # 100 // 24; the tail of 4 samples is dropped
    for step in range(10):
        epoch, i = divmod(step, 4)
        if order == "randperm":  # the order before data_order existed
            full = torch.randperm(100, generator=torch.Generator().manual_seed(3 + epoch))
        else:
            full = torch.tensor([order_index(p, 100, 3, epoch) for p in range(100)])
        batch = full[i * 24 : (i + 1) * 24]
        assert torch.equal(plan.step_indices(step), batch)
        for v in range(4):
            assert torch.equal(plan.vn_indices(step, v), batch[v * 6 : (v + 1) * 6])


# -- the data order: a keyed bijection computed per position (plan/permutation.py) ----------------
_SIZES = sorted({1, 2, 3, 4, 5, 6, 7, 10, 97, 100, 101, 257, 1000, 7919, 65521}
                | {2**k + d for k in range(1, 17) for d in (-1, 0, 1)})


@pytest.mark.parametrize("n", _SIZES)
def test_the_order_is_a_permutation_equal_to_the_reference(n):
    order = epoch_indices(range(n), n, seed=11, epoch=2)
    assert order.dtype == torch.int64 and order.shape == (n,)
    assert torch.equal(torch.sort(order).values, torch.arange(n))
    picks = range(n) if n <= 300 else random.Random(n).sample(range(n), 300)
    for p in picks:
        assert int(order[p]) == order_index(p, n, 11, 2), (n, p)
    # Any subset of positions, in any shape, gives those positions' indices.
    some = torch.tensor(list(picks)[::-1])
    assert torch.equal(epoch_indices(some, n, 11, 2), order[some])


def test_the_order_of_a_huge_dataset_is_spot_checked_against_the_reference():
    rng = random.Random(0)
    for n in (10**6, 10**6 + 3, 2**31 + 11, 10**9, 10**12 + 39, 2**62):
        positions = [0, 1, n - 1] + [rng.randrange(n) for _ in range(200)]
        got = epoch_indices(torch.tensor(positions), n, seed=7, epoch=5).tolist()
        assert got == [order_index(p, n, 7, 5) for p in positions], n
        assert len(set(got)) == len(set(positions)) and all(0 <= i < n for i in got)
    # 10^6 samples end to end: a bijection (one pass over the positions, in steps of 4096)
    n = 10**6
    seen = torch.zeros(n, dtype=torch.bool)
    for lo in range(0, n, 4096):
        seen[epoch_indices(range(lo, min(n, lo + 4096)), n, 3, 0)] = True
    assert bool(seen.all())


def test_the_order_differs_per_epoch_seed_and_size_and_looks_shuffled():
    n = 1000
    base = epoch_indices(range(n), n, 0, 0)
    for other in (epoch_indices(range(n), n, 0, 1), epoch_indices(range(n), n, 1, 0),
                  epoch_indices(range(n), n, 2**64 + 1, 0)):
        assert (other != base).float().mean() > 0.9
    assert torch.equal(epoch_indices(range(n), n, 2**64, 0), base)  # the seed enters modulo 2**64
    assert not torch.equal(epoch_indices(range(999), 1001, 0, 0)[:999], epoch_indices(range(999), 999, 0, 0))
    # No visible structure: few fixed points, no rank correlation with the position, and every
    # index as likely at position 0 over many seeds (chi-square, n=10, 3000 draws).
    assert int((base == torch.arange(n)).sum()) < 8
    rho = torch.corrcoef(torch.stack([torch.arange(n).double(), base.double()]))[0, 1]
    assert abs(float(rho)) < 0.1
    counts = torch.bincount(torch.tensor([int(epoch_indices(0, 10, s, 0)) for s in range(3000)]), minlength=10)
    chi2 = float(((counts - 300.0) ** 2 / 300.0).sum())
    assert chi2 < 27.9, counts  # the 0.001 quantile of chi-square with 9 degrees of freedom


def _bytes_allocated(plan: DataPlan, step: int, vn: int) -> tuple[int, torch.Tensor]:
    """Every byte torch allocates on the CPU while ``plan`` computes a VN's indices (the sum of the
    allocations: an upper bound of the peak), plus the peak of what NumPy allocates when a fresh
    copy of ``plan`` computes them (traced by ``tracemalloc``, without the profiler's own objects:
    the order's arithmetic runs on NumPy arrays)."""
    import copy
    import tracemalloc

    fresh = copy.deepcopy(plan)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        indices = plan.vn_indices(step, vn)
    tracemalloc.start()
    try:
        fresh.vn_indices(step, vn)
        numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events()) + numpy_peak, indices


def test_a_step_of_a_billion_samples_costs_memory_of_its_batch_only():
    B = 1024
    for n in (10**4, 10**9):
        plan = DataPlan(dataset_size=n, global_batch_size=B, virtual_nodes=8, seed=1)
        step = plan.steps_per_epoch * 3 + 7  # epoch 3
        allocated, indices = _bytes_allocated(plan, step, 5)
        assert allocated < 2 << 20, (n, allocated)  # ~0.8 MB for B=1024, whatever n (randperm at 10^9: 8 GB)
        positions = range(7 * B + 5 * 128, 7 * B + 6 * 128)
        assert indices.tolist() == [order_index(p, n, 1, 3) for p in positions]
    legacy = DataPlan(dataset_size=10**6, global_batch_size=B, virtual_nodes=8, seed=1, order="randperm")
    assert _bytes_allocated(legacy, 0, 5)[0] >= 8 * 10**6  # the old order: 8 bytes per sample, every epoch


def test_data_order_errors_name_the_value_and_the_knob():
    with pytest.raises(ValueError, match=r"data_order='shuffle' is not one of 'feistel', 'randperm' \(Job.data_ord"):
        DataPlan(100, 8, 4, order="shuffle")
    with pytest.raises(ValueError, match=r"positions must lie in 0..9"):
        epoch_indices(torch.tensor([3, 10]), 10, 0, 0)
    with pytest.raises(ValueError, match=r"n=0 samples"):
        epoch_indices(0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"epoch=-1"):
        epoch_indices(0, 10, 0, -1)
    with pytest.raises(ValueError, match=r"materialises a randperm epoch"):
        DataPlan(100, 8, 4).epoch_order(0)


def test_each_epoch_visits_distinct_samples():
    plan = DataPlan(dataset_size=64, global_batch_size=16, virtual_nodes=8, seed=0)
    seen = torch.cat([plan.vn_indices(s, v) for s in range(4) for v in range(8)])
    assert sorted(seen.tolist()) == list(range(64))
    assert not torch.equal(plan.step_indices(0), plan.step_indices(4))  # next epoch reshuffles


def test_vn_seed_is_stable_and_distinct():
    assert vn_seed(0, 0, 0) == vn_seed(0, 0, 0)
    seeds = {vn_seed(s, t, v) for s, t, v in itertools.product(range(3), range(20), range(16))}
    assert len(seeds) == 3 * 20 * 16
    assert all(0 <= x < 2**63 for x in seeds)
    assert vn_seed(1, 2, 3) == 5797055558538453683  # frozen: changing it changes every run's dropout


def test_plan_errors_name_value_rule_and_knob():
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by virtual_nodes=4"):
        DataPlan(100, 10, 4)
    with pytest.raises(ValueError, match=r"has 8 samples, fewer than global_batch_size=16"):
        DataPlan(8, 16, 4)
    with pytest.raises(ValueError, match=r"vn=4 is outside 0..3"):
        DataPlan(100, 8, 4).vn_indices(0, 4)


@pytest.mark.parametrize("V", range(1, 17))
def test_contiguous_assignment(V):
    for W in range(1, V + 1):
        a = contiguous_assignment(V, W)
        assert len(a) == W and sum(a, []) == list(range(V))
        sizes = [len(x) for x in a]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match=rf"virtual_nodes={V} is smaller than workers={V + 1}"):
        contiguous_assignment(V, V + 1)


def test_describe_assignment():
    assert describe_assignment(contiguous_assignment(8, 3)) == (
        "worker 0 runs VNs 0-2, worker 1 runs VNs 3-5, worker 2 runs VNs 6-7"
    )
    assert describe_assignment([[0], [1, 3]]) == "worker 0 runs VN 0, worker 1 runs VNs 1,3"
    assert describe_assignment([[0, 1], []]) == "worker 0 runs VNs 0-1, worker 1 runs no VN"


@pytest.mark.parametrize("V", range(1, 20))
def test_covering_nodes_partition_blocks_into_tree_nodes(V):
    def is_tree_node(node):
        stack = [(0, V)]
        while stack:
            n = stack.pop()
            if n == node:
                return True
            if n[1] - n[0] > 1:
                stack.extend(split(n))
        return False

    for lo in range(V):
        for hi in range(lo + 1, V + 1):
            nodes = covering_nodes(V, lo, hi)
            covered = [v for a, b in nodes for v in range(a, b)]
            assert covered == list(range(lo, hi))
            assert all(is_tree_node(n) for n in nodes)
            assert len(nodes) <= 2 * max(1, (V - 1).bit_length())  # O(log V) partial sums per worker


def test_tree_plan_slots():
    plan = TreePlan.build(contiguous_assignment(8, 3))
    assert plan.per_worker == (((0, 2), (2, 3)), ((3, 4), (4, 6)), ((6, 8),))
    assert TreePlan.build([[0, 1, 2, 3]]).slots == [(0, 4)]
    with pytest.raises(ValueError, match="contiguous"):
        TreePlan.build([[0, 2], [1, 3]])


def test_tree_plan_with_a_worker_without_vns():
    # A worker with no VN holds no node; the others' nodes still partition the whole tree.
    plan = TreePlan.build([[0, 1, 2], [], [3, 4, 5, 6, 7]])
    assert plan.per_worker == (((0, 2), (2, 3)), (), ((3, 4), (4, 8)))
    assert plan.virtual_nodes == 8
    assert TreePlan.build([[], [0, 1, 2, 3]]).slots == [(0, 4)]
