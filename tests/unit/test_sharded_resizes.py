"""The sharded deterministic engine through resizes, in this process: whatever step a resize lands
on and whatever VN map each generation gets, the run is bit-identical to one worker.

``tests/e2e/test_sharded.py`` runs the same job (BatchNorm, dropout, Adam, an LR schedule,
checkpoints every 4 steps) as worker processes, 2 -> 3 -> 2 with an uneven map; there the steps
the resizes land on and the maps come from timing (when the newcomer is up, the measured
speeds). Here every worker is a :class:`~virtualflow.runtime.vn_worker.VNWorkerEngine` on a thread
of the in-process fabric and the schedule is chosen: resizes before, on and after a checkpoint
step, the newcomer first or last, maps with a worker that runs no VN (rank 0 too), and the worker
that leaves being rank 0. Each member goes through a generation as
:class:`~virtualflow.runtime.worker.Worker` does: agree on the progress, adopt the generation (the
whole state sent to a newcomer by :func:`~virtualflow.runtime.transfer.broadcast_state`, the
optimizer state cut into chunks), train, gather rank 0's state at checkpoint steps, and gather the
optimizer state before a regroup (a collective of the old generation).

Dropout draws from the process's one random generator, which threads share: each VN's forward
runs under a lock and is seeded inside it with the seed the engine chose for that VN (the
engine's own seeding is recorded per thread), so every worker sees the stream the engine meant.
"""

from __future__ import annotations

import threading

import pytest
import torch

import jobs
from conftest import assert_state_equal, flat_optimizer_state
from fabric import Fabric, run_ranks
from virtualflow.comm.groups import Group
from virtualflow.comm.protocol import GenerationRecord
from virtualflow.plan.data import DataPlan
from virtualflow.runtime import batches
from virtualflow.runtime.step import compute as compute_mod
from virtualflow.runtime.engine import BatchLoader, VNEngine
from virtualflow.runtime.engines import Joining
from virtualflow.runtime.transfer import Progress, agree_progress
from virtualflow.runtime.vn_worker import VNWorkerEngine

CHECKPOINT_EVERY = 4

_forward_lock = threading.Lock()
_seed = threading.local()


def _record_seed(seed: int, generators) -> None:
    _seed.value = seed


def serialized_cross_entropy(model, batch):
    """The job's loss, its forward seeded with this thread's VN seed under the process-wide lock."""
    with _forward_lock:
        batches.seed_random_streams(_seed.value, torch.device("cpu"))
        return jobs.cross_entropy(model, batch)


@pytest.fixture(autouse=True)
def per_thread_seeds(monkeypatch):
    monkeypatch.setattr(compute_mod, "seed_generators", _record_seed)


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


def run_sharded(generations: list[tuple[list[int], list[list[int]], int]]) -> dict:
    """``generations``: (member worker ids, VN map, steps) each, the first one's members starting
    the job. Each member does what :class:`~virtualflow.runtime.worker.Worker` does with its
    engine: agree on the progress, adopt the generation (the state transfer to a newcomer, the
    chunks cut), train, gather rank 0's state at checkpoint steps, gather the optimizer state
    before the next regroup. Returns the final state rank 0 writes (model, optimizer, scheduler)."""
    workers: dict[int, VNWorkerEngine] = {}
    progress: dict[int, Progress] = {}
    final: dict = {}
    step = 0
    for g, (members, assignment, steps) in enumerate(generations):
        last = g == len(generations) - 1
        for w in members:
            if w not in workers:
                workers[w] = VNWorkerEngine(build("sharded"))
                progress[w] = Progress(step=0 if g == 0 else -1, control=0)
                if g:
                    workers[w].prepare_to_join()
        fabric = Fabric(len(members))
        record = GenerationRecord(generation=g, members=list(members), assignment=assignment, start_step=step)
        first = step

        def body(rank: int, group) -> dict | None:
            group.generation = g
            w = workers[members[rank]]
            everyone = agree_progress(group, progress[members[rank]], torch.device("cpu"))
            target = max(p.step for p in everyone)
            src = next(r for r, p in enumerate(everyone) if p.step == target)
            w.adopt(Joining(group=group, record=record, progress=progress[members[rank]],
                            steps=[p.step for p in everyone], target=target, src=src))
            assert target == first
            for s in range(first, first + steps):
                w.step(s)
                if (s + 1) % CHECKPOINT_EVERY == 0:  # a checkpoint: rank 0 gathers the whole state
                    w.whole_state(group)
            if last:
                return w.whole_state(group)  # the final state (rank 0's)
            w.before_regroup()  # the next generation cuts the optimizer state again
            return None

        out = run_ranks(fabric, body)
        assert fabric.undelivered() == 0
        assert all(o is None for o in out[1:])
        step += steps
        for w in list(workers):
            if w in members:
                progress[w] = Progress(step=step, control=0)
            else:  # left (it gathered its chunk first)
                del workers[w]
        final = out[0]
    return final


def check_same(final: dict, ref: VNEngine) -> None:
    assert_state_equal(final["model"], ref.model.state_dict())
    assert_state_equal(flat_optimizer_state(final["optimizer"]), flat_optimizer_state(ref.optimizer.state_dict()))
    assert final["lr_scheduler"] == ref.scheduler.state_dict()


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
    final = run_sharded(generations)
    check_same(final, reference(first + middle + last))
