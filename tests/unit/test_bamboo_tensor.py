"""Bamboo's redundancy on tensor-parallel stages (``Pipeline(redundancy=True, tensor=T)``), without
processes: the replica a worker builds of its successor's stage is the successor's own tensor
shard (the same splits, parameter for parameter, in the same order, so the pairwise refresh and
the failed-over stage compute what the lost one did), and the failover policy judges tensor
groups as it judges workers without tensor parallelism. tests/e2e/test_bamboo.py kills a
tensor-parallel stage's member in processes and checks the trained model bit for bit.
"""

from __future__ import annotations

import types

import pytest
import torch

import virtualflow as vf
from virtualflow.control.membership.decisions import FallBack
from virtualflow.control.membership.decisions import NoChange
from virtualflow.control.membership.failover import (decide_failover, decide_planned_failover, decide_reconfigure,
                                                     decide_shrink, member_runs)
from virtualflow.plan.data import DataPlan
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.runtime.pipeline.layout import StageBuilder
from virtualflow.runtime.pipeline.tensor_grid import whole_splits
from virtualflow.runtime.pipeline.tensor_stage import TensorParallelStage
from conftest import assert_state_equal
import gpt_grid_jobs as g

CPU = torch.device("cpu")


def _tensor(job: vf.Job, t: int) -> TensorParallelStage:
    """Tensor rank ``t``'s :class:`TensorParallelStage` of ``job`` (a fake tensor group)."""
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    stage = TensorParallelStage(job.pipeline, bounds, CPU, subgroup=None, build_optimizer=job.build_optimizer)
    # (a fake tensor group: the converter's check that every rank converts the same layer sums
    # over the group, here every rank's equal numbers)
    comm = types.SimpleNamespace(group=types.SimpleNamespace(size=2, rank=t), all_reduce=lambda buf: buf.mul_(2))
    stage.planes = types.SimpleNamespace(comm=comm, t=t)
    stage.rank = t
    return stage


def _engine(job: vf.Job, t: int, stage_rank: int):
    """Worker (``stage_rank``, tensor rank ``t``)'s stage engine, built as the worker builds it."""
    tensor = _tensor(job, t)
    torch.manual_seed(job.seed)
    layers = layers_of(job.model())
    ds = job.build_dataset()
    builder = StageBuilder(job, ds, DataPlan.of_job(job, len(ds)), True, CPU, False, False)
    return builder.stage(job.pipeline, layers, tensor.bounds, stage_rank, tensor, "allreduce")


@pytest.mark.parametrize("t", [0, 1])
def test_a_replica_is_the_successors_own_tensor_shard(t):
    job = g.grid_job(stages=2, tensor=2, redundancy=True)
    torch.manual_seed(job.seed)
    whole = layers_of(job.model())
    bounds = resolve_bounds(job.pipeline, len(whole))
    for s in range(2):
        replica = _engine(job, t, s).replica_of_successor
        k = replica.stage_rank
        own = _engine(job, t, k)  # what the successor's tensor rank t runs
        # The refresh sends the successor's gradients flat, in its parameters' order: the same.
        assert [n for n, _ in replica.model.named_parameters()] == [n for n, _ in own.model.named_parameters()]
        assert [q.shape for q in replica.params] == [q.shape for q in own.params]
        assert_state_equal(replica.model.state_dict(), own.model.state_dict())
        assert replica.optimizer.state_dict() == own.optimizer.state_dict()  # (no state before a step)
        piece = replica.model
        # ... and it is shard t of the whole model's layers, cut by the successor's splits.
        splits = whole_splits(whole, 2)
        ref = {f"{i}.{n}": v for i in range(*bounds[k]) for n, v in whole[i].state_dict().items()}
        sharded = [key for key in ref if splits.get(key) is not None and not splits[key].replicated]
        assert sharded
        for key, value in piece.state_dict().items():
            split = splits.get(key)
            want = ref[key] if split is None else split.shard(ref[key], t, 2)
            assert torch.equal(value, want), key


def test_a_tensor_parallel_replica_runs_no_eager_forward():
    """A tensor-parallel forward is a collective of its stage's group, and each worker picks its
    idle slots by its own timing: the replica is refreshed, never run ahead."""
    assert not vf.Pipeline(stages=2, tensor=2, redundancy=True).eager_forwards
    assert vf.Pipeline(stages=2, redundancy=True).eager_forwards


def _narrow(layout):
    return None if layout is None else [list(run) for run in layout]


@pytest.mark.parametrize("stages,replicas,dead", [
    (2, 1, {3}), (2, 1, {2}), (3, 2, {9}), (3, 2, {4, 5}), (3, 1, {0}),
])
def test_a_failover_judges_tensor_groups_as_workers_without_tensor_parallelism(stages, replicas, dead):
    """T = 2: the decision over workers is the T = 1 decision over the tensor groups (group ``i``:
    workers ``2i, 2i+1``), every group's members taking its part; a lost member loses its group."""
    t = 2
    members = list(range(stages * replicas * t))
    wide = decide_failover(stages=stages * t, members=members, layout=None, formed=None, dead=dead,
                           replace_failed=True, tensor=t)
    groups = {w // t for w in dead}
    plain = decide_failover(stages=stages, members=list(range(stages * replicas)), layout=None, formed=None,
                            dead=groups, replace_failed=True)
    assert wide.members == tuple(w for i in plain.members for w in (t * i, t * i + 1))
    assert wide.dropped == tuple(w for i in plain.dropped for w in (t * i, t * i + 1))
    assert set(wide.dropped) >= dead
    assert [list(r) for r in wide.layout] == [list(r) for r in plain.layout for _ in range(t)]
    assert wide.target == plain.target * t and wide.replacements == plain.replacements * t
    assert [c.layout for c in wide.covered] == [c.layout for c in plain.covered]  # the event: tensor groups
    for w, c in zip(wide.covered, plain.covered):
        assert w.taken_over == {str(t * int(k) + j): t * v + j for k, v in c.taken_over.items() for j in range(t)}
    runs, sizes = member_runs(wide.layout, len(wide.members), stages * t, t)
    assert runs == [len(r) for r in wide.layout] and sum(sizes) == len(wide.members)
    # The next loss is judged on the failed-over layout, by groups again.
    if wide.layout is not None and len(wide.members) > t:
        again = decide_failover(stages=stages * t, members=list(wide.members), layout=wide.layout,
                                formed=(list(wide.members), wide.layout), dead=dead | {wide.members[-1]},
                                replace_failed=False, tensor=t)
        plain_again = decide_failover(stages=stages, members=list(plain.members), layout=plain.layout,
                                      formed=(list(plain.members), plain.layout),
                                      dead=groups | {plain.members[-1]}, replace_failed=False)
        assert type(again) is type(plain_again)
        if isinstance(plain_again, FallBack):
            assert again.reason == plain_again.reason
        else:
            assert again.members == tuple(w for i in plain_again.members for w in (t * i, t * i + 1))


def test_losing_both_tensor_groups_of_a_two_stage_replica_falls_back():
    d = decide_failover(stages=4, members=[0, 1, 2, 3], layout=None, formed=None, dead={1, 2},
                        replace_failed=False, tensor=2)
    assert isinstance(d, FallBack) and "consecutive stages" in d.reason


def test_a_notice_to_one_member_hands_its_whole_tensor_group_over():
    d = decide_planned_failover(stages=4, members=[10, 11, 12, 13], layout=None, noticed=[13],
                                replace_failed=False, min_workers=1, tensor=2)
    assert d.members == (10, 11) and d.dropped == (12, 13)
    assert [list(r) for r in d.layout] == [[0, 1], [0, 1]]
    assert d.covered[0].taken_over == {"12": 10, "13": 11}
    too_few = decide_planned_failover(stages=4, members=[10, 11, 12, 13], layout=None, noticed=[13],
                                      replace_failed=False, min_workers=3, tensor=2)
    assert isinstance(too_few, FallBack)


def test_newcomers_reform_a_failed_over_pipeline_as_whole_tensor_groups():
    """After stage 1's group (workers 2, 3) was lost, newcomers 7, 8 take stage 1 back as one tensor
    group (tensor ranks in the order they got ready); one ready newcomer is not a group yet."""
    lost = decide_failover(stages=4, members=[0, 1, 2, 3], layout=None, formed=None, dead={3},
                           replace_failed=True, tensor=2)
    assert lost.replacements == 2 and lost.target == 4
    waiting = decide_reconfigure(stages=4, members=list(lost.members), layout=lost.layout_after, ready=[7], tensor=2)
    assert isinstance(waiting, NoChange)
    d = decide_reconfigure(stages=4, members=list(lost.members), layout=lost.layout_after, ready=[7, 8, 9], tensor=2)
    plain = decide_reconfigure(stages=2, members=[0], layout=((0, 1),), ready=[7])
    assert d.members == (0, 1, 7, 8) and d.added == (7, 8) and plain.members == (0, 7)
    assert [list(r) for r in d.layout] == [list(r) for r in plain.layout for _ in range(2)] == [[0], [0], [1], [1]]
    assert d.layout_after is None


def test_a_failed_over_grid_shrinks_by_whole_replicas_of_tensor_groups():
    """Two replicas of a (2, 3, 2) grid, replica 0 failed over (its stage 1's group lost): a shrink
    to 6 workers drops the last replica, 6 workers, as the plain rule drops it."""
    lost = decide_failover(stages=6, members=list(range(12)), layout=None, formed=None, dead={3},
                           replace_failed=False, tensor=2)
    d = decide_shrink(stages=6, members=list(lost.members), layout=lost.layout_after, target=6, tensor=2)
    plain = decide_shrink(stages=3, members=[0, 2, 3, 4, 5], layout=((0, 1), (2,), (0,), (1,), (2,)), target=3)
    assert plain.members == (0, 2) and plain.removed == (3, 4, 5)
    assert d.members == (0, 1, 4, 5) and d.removed == (6, 7, 8, 9, 10, 11) and d.target == 4
    assert [list(r) for r in d.layout] == [[0, 1], [0, 1], [2], [2]]
