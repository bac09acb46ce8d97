"""The pipeline's per-stage deterministic reduction over the replicas runs the exchange the
``deterministic_exchange`` knob (or the automatic choice) names (runtime/pipeline/links.py,
``StageExchanges``).

- ``owners`` over an in-process fabric (threads, point to point): every replica gets the fixed
  tree's root bit for bit (a plain tree sum of the leaves), step after step with the same
  exchange object (its buffers and alternating tags), for uneven VN blocks.
- The choice: ``auto`` is :func:`choose_exchange`'s for the stage's vector, a forced knob is
  obeyed, the reason is kept per stage group, and a bad value is refused naming the knob.
"""

from __future__ import annotations

import pytest
import torch

import pipeline_models as pm
from fabric import Fabric, run_ranks
from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.plan.exchange import choose_exchange
from virtualflow.plan.vnmap import TreePlan, contiguous_assignment
from virtualflow.runtime.pipeline.links import StageExchanges
from virtualflow.runtime.pipeline.requests import StageTree


def _leaves(V: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, numel, generator=g) * torch.logspace(-5, 5, numel)  # order-sensitive sums


@pytest.mark.parametrize("V,d", [(7, 3), (8, 2), (5, 5)])
def test_owners_exchange_gives_every_replica_the_tree_root(V, d):
    assignment = contiguous_assignment(V, d)
    plan = TreePlan.build(assignment)
    fabric = Fabric(d)
    steps = [_leaves(V, 3001, seed) for seed in range(3)]

    def replica(r, group):
        ex = StageExchanges("owners")
        out = []
        for x in steps:  # one StageExchanges per generation, reused step after step
            nodes = tree_reduce_local(plan.per_worker[r], lambda vn: x[vn].clone())
            out.append(ex.run(StageTree(plan, nodes, next(iter(nodes.values())), stage=None), group))
        assert ex.choices[None][0] == "owners"
        return out

    roots = run_ranks(fabric, replica)
    for i, x in enumerate(steps):
        want = pm.tree_sum({vn: x[vn] for vn in range(V)}, 0, V)
        for r in range(d):
            assert torch.equal(roots[r][i], want)
    assert fabric.undelivered() == 0


def test_the_automatic_choice_and_the_knob():
    plan = TreePlan.build(contiguous_assignment(8, 2))
    small, large = torch.zeros(100), torch.zeros(100_000)
    auto = StageExchanges()
    assert auto.choose(None, plan, small) == choose_exchange(plan, 100, 4)[0]
    assert auto.choices[None] == choose_exchange(plan, 100, 4)
    assert auto.choose(3, plan, large) == "owners"  # a job stage of a failed-over replica
    assert set(auto.choices) == {None, 3}
    forced = StageExchanges("slots")
    assert forced.choose(None, plan, large) == "slots"
    assert "asked for" in forced.choices[None][1]
    assert StageExchanges("owners").choose(None, plan, small) == "owners"
    with pytest.raises(ValueError, match="deterministic_exchange='ring' is not one of auto, owners, slots"
                                         ".*--deterministic-exchange"):
        StageExchanges("ring")
