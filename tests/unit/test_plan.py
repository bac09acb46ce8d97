"""Pure planning code: data order, VN slices, seeds, VN maps, reduction tree."""

from __future__ import annotations

import itertools

import pytest
import torch

from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.plan.vnmap import TreePlan, contiguous_assignment, covering_nodes, describe_assignment, split


def test_data_order_is_the_documented_formula():
    plan = DataPlan(dataset_size=100, global_batch_size=24, virtual_nodes=4, seed=3)
    assert plan.steps_per_epoch == 4  # 100 // 24; the tail of 4 samples is dropped
    for step in range(10):
        epoch, i = divmod(step, 4)
        order = torch.randperm(100, generator=torch.Generator().manual_seed(3 + epoch))
        batch = order[i * 24 : (i + 1) * 24]
        assert torch.equal(plan.step_indices(step), batch)
        for v in range(4):
            assert torch.equal(plan.vn_indices(step, v), batch[v * 6 : (v + 1) * 6])


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
