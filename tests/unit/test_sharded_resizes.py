"""The sharded deterministic engine through resizes, in this process: whatever step a resize lands
on and whatever VN map each generation gets, the run is bit-identical to one worker.

``tests/e2e/test_sharded.py`` runs the same job (BatchNorm, dropout, Adam, an LR schedule,
checkpoints every 4 steps) as worker processes, 2 -> 3 -> 2 with an uneven map; there the steps
the resizes land on and the maps come from timing (when the newcomer is up, the measured
speeds). Here every worker is a :class:`~virtualflow.runtime.engine.VNEngine` on a thread of the
in-process fabric and the schedule is chosen: resizes before, on and after a checkpoint step, the
newcomer first or last, maps with a worker that runs no VN (rank 0 too), and the worker that
leaves being rank 0. Between generations the members do what a worker does: gather the
optimizer state (:meth:`VNEngine.before_regroup`, a collective of the old generation), move the
whole state to the newcomer (:func:`~virtualflow.runtime.vn_worker.full_state`, cloned as a
transfer copies it), cut it again (:meth:`VNEngine.set_membership`); at checkpoint steps rank 0
gathers the optimizer state (a collective, as ``boundary`` does).

Dropout draws from the process's one random generator, which threads share: each VN's forward
runs under a lock and is seeded inside it with the seed the engine chose for that VN (the
engine's own seeding is recorded per thread), so every worker sees the stream the engine meant.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import jobs
from conftest import assert_state_equal, flat_optimizer_state
from fabric import Fabric, run_ranks
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.runtime import batches, engine as engine_mod
from virtualflow.runtime.engine import BatchLoader, VNEngine
from virtualflow.runtime.transfer import Progress
from virtualflow.runtime.vn_worker import full_state, load_full_state

CHECKPOINT_EVERY = 4

_forward_lock = threading.Lock()
_seed = threading.local()


def _record_seed(seed: int, device: torch.device) -> None:
    _seed.value = seed


def serialized_cross_entropy(model, batch):
    """The job's loss, its forward seeded with this thread's VN seed under the process-wide lock."""
    with _forward_lock:
        batches.seed_random_streams(_seed.value, torch.device("cpu"))
        return jobs.cross_entropy(model, batch)


@pytest.fixture(autouse=True)
def per_thread_seeds(monkeypatch):
    monkeypatch.setattr(engine_mod, "seed_random_streams", _record_seed)


def the_job():
    return jobs.elastic_job().replace(loss=serialized_cross_entropy)


def build(reduction: str) -> VNEngine:
    j = the_job()
    torch.manual_seed(j.seed)
    model = j.model()
    opt = j.build_optimizer(model)
    sched = j.lr_scheduler(opt)
    ds = j.build_dataset()
    plan = DataPlan.of_job(j, len(ds))
    return VNEngine(model, opt, sched, j.compute_loss, plan, BatchLoader(ds, None), seed=j.seed,
                    batchnorm=j.batchnorm, deterministic=True, device=torch.device("cpu"), reduction=reduction)


def reference(steps: int) -> VNEngine:
    e = build("allreduce")
    e.set_membership(Group(0, 0, 1, None), [list(range(8))])
    for s in range(steps):
        e.step(s)
    return e


def run_sharded(generations: list[tuple[list[int], list[list[int]], int]]) -> tuple[VNEngine, dict, list]:
    """``generations``: (member worker ids, VN map, steps) each. Returns rank 0's engine of the
    last generation, its gathered optimizer state and the (step, members, map) each step ran with."""
    engines: dict[int, VNEngine] = {}
    step = 0
    ran: list[tuple[int, list[int], list[list[int]]]] = []
    final_opt: dict = {}
    for g, (members, assignment, steps) in enumerate(generations):
        last = g == len(generations) - 1
        new = [w for w in members if w not in engines]
        if new:  # a newcomer receives the whole state from the most advanced member (all are equal)
            src = engines[next(w for w in members if w in engines)] if engines else None
            for w in new:
                engines[w] = build("sharded")
                if src is not None:
                    load_full_state(engines[w], copy.deepcopy(full_state(src, Progress(step, 0))))
        fabric = Fabric(len(members))
        first = step

        def body(rank: int, group) -> dict | None:
            group.generation = g
            e = engines[members[rank]]
            e.set_membership(group, assignment)
            for s in range(first, first + steps):
                e.step(s)
                if (s + 1) % CHECKPOINT_EVERY == 0:  # a checkpoint: rank 0 gathers the optimizer state
                    e.gather_optimizer_state(root=0)
            if last:
                return e.gather_optimizer_state(root=0)
            e.before_regroup()  # the next generation cuts the state again
            return None

        out = run_ranks(fabric, body)
        assert fabric.undelivered() == 0
        ran += [(s, members, assignment) for s in range(first, first + steps)]
        step += steps
        for w in list(engines):  # a worker that left takes nothing with it (it gathered first)
            if w not in members:
                del engines[w]
        final_opt = out[0]
    return engines[generations[-1][0][0]], final_opt, ran


def check_same(sharded: VNEngine, opt_state: dict, ref: VNEngine) -> None:
    assert_state_equal(sharded.model.state_dict(), ref.model.state_dict())
    assert_state_equal(flat_optimizer_state(opt_state), flat_optimizer_state(ref.optimizer.state_dict()))
    assert sharded.scheduler.state_dict() == ref.scheduler.state_dict()


EVEN2 = [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("first,middle,map3,map2,members3,members2", [
    # the e2e test's maps; the resize before, on and after a checkpoint step
    (3, 4, [[0, 1, 2, 3, 4], [5, 6], [7]], [[0, 1, 2, 3, 4, 5], [6, 7]], [0, 1, 2], [0, 1]),
    (4, 3, [[0, 1, 2, 3], [4, 5], [6, 7]], [[0, 1, 2, 3, 4, 5], [6, 7]], [0, 1, 2], [0, 1]),
    (5, 7, [[0, 1, 2, 3, 4], [5, 6], [7]], [[0, 1, 2, 3, 4, 5], [6, 7]], [0, 1, 2], [0, 1]),
    # a worker with no VN (the newcomer, then rank 0), and one left without any in the end
    (2, 5, [[0, 1, 2, 3, 4, 5, 6], [7], []], [[0, 1, 2, 3, 4, 5, 6, 7], []], [0, 1, 2], [0, 1]),
    (6, 2, [[], [0, 1, 2, 3], [4, 5, 6, 7]], [[], [0, 1, 2, 3, 4, 5, 6, 7]], [0, 1, 2], [0, 1]),
    # the newcomer becomes rank 0; then the old rank 0 leaves
    (1, 4, [[0, 1, 2], [3, 4, 5, 6], [7]], [[0, 1, 2, 3, 4], [5, 6, 7]], [2, 0, 1], [1, 2]),
])
def test_sharded_run_through_resizes_is_bit_identical_to_one_worker(first, middle, map3, map2, members3, members2):
    last = 3
    generations = [([0, 1], EVEN2, first), (members3, map3, middle), (members2, map2, last)]
    sharded, opt_state, _ = run_sharded(generations)
    ref = reference(first + middle + last)
    check_same(sharded, opt_state, ref)
