"""Bamboo's redundancy with the sharded reduction (``Pipeline(redundancy=True)``,
``reduction="sharded"``), in-process: 2 stages x 2 pipeline replicas, deterministic mode.

- Every worker's replica of its successor's stage holds that successor's chunk of the optimizer
  state, bit for bit (the same bounds, the same Adam state), and the whole stage's weights (its
  holders' all-gather), and about half the optimizer state a whole replica would hold.
- The job trains the unpipelined single-worker model, bit for bit; default mode and clipping
  keep every replica equal to its successor's chunk too.
- A failover mid-run: replica 0's second worker is lost after step 2; its chunk of stage 1's state
  is rebuilt from its predecessor's replica (:mod:`virtualflow.runtime.pipeline.shard_failover`),
  the failed-over replica runs both stages on one worker beside the full-depth one (the re-laid
  engines, built as a re-layout builds them), and after 4 steps every worker's model is the
  undisturbed run's and the unpipelined run's, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipeline_models as pm
from test_bamboo import assert_same, job
from test_bamboo_replicas import LayoutDriver
from virtualflow.runtime.pipeline.local import LocalDriver, build_engine
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.layout import StageBuilder, held_states
from virtualflow.runtime.pipeline.shard_failover import RUNS, chunk_payload, merge_chunks, sharded_holdings
from virtualflow.runtime.pipeline.stage_shard import StageShard
from virtualflow.runtime.pipeline.tensor_stage import TensorStage
from virtualflow.runtime.streaming import data_plan_of

P, D, STEPS = 2, 2, 4


def sharded_engines(j, reduction="sharded", deterministic=True):
    torch.manual_seed(j.seed)
    bounds = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    dataset = j.build_dataset()
    engines = [build_engine(j, j.pipeline, bounds, r % P, dataset=dataset, deterministic=deterministic,
                            device=torch.device("cpu"), reduction=reduction) for r in range(P * D)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(j.virtual_nodes, D))
    return engines, driver


def chunk_state(update: StageShard) -> list:
    return [(i, a, st) for i, (a, view) in sorted(update.opt.pieces.items())
            for st in [update.opt.local.state.get(view, {})]]


def whole_model(engines) -> dict[str, torch.Tensor]:
    return {k: v for e in engines[:P] for k, v in e.model.state_dict().items()}


def test_each_replica_mirrors_its_successors_chunk_and_the_job_trains_the_unpipelined_model():
    j = job(P)
    engines, driver = sharded_engines(j)
    losses = [r.loss for t in range(STEPS) for r in driver.run(t, 1)[:1]]
    ref_state, ref_losses = pm.unpipelined(j, STEPS, deterministic=True)
    for k, v in whole_model(engines).items():
        assert_same(v, ref_state[k], k)
    assert losses == ref_losses
    _, plain = sharded_engines(j, reduction="allreduce")
    plain_engines = plain.engines
    for t in range(STEPS):
        plain.run(t, 1)
    for e in engines:
        replica = e.replica_of_successor
        successor = engines[e.replica * P + replica.stage_rank]
        assert isinstance(replica.update, StageShard) and replica.update.bounds == successor.update.bounds
        assert replica.update.chunk() == successor.update.chunk() != (0, successor.update.flat.numel)
        assert_same(chunk_state(replica.update), chunk_state(successor.update), f"replica held by {e.stage_rank}")
        assert_same(replica.model.state_dict(), successor.model.state_dict(), "replica weights")
        whole = plain_engines[engines.index(e)].replica_of_successor
        assert replica.update.state_bytes() < 0.6 * whole.update.state_bytes()  # (Adam: 2 of 2 chunks' floats)


@pytest.mark.parametrize("deterministic,clip", [(False, None), (False, 0.05), (True, 0.05)])
def test_replicas_mirror_the_chunk_in_default_mode_and_with_clipping(deterministic, clip):
    # Default mode reduce-scatters the chunks; clipping cuts them on the norm's blocks and scales
    # each chunk by the whole step's norm: the replica takes the same steps.
    j = job(P).replace(max_grad_norm=clip)
    engines, driver = sharded_engines(j, deterministic=deterministic)
    norms = [driver.run(t, 1)[0].grad_norm for t in range(3)]
    assert clip is None or all(n > clip for n in norms)  # it clipped
    for e in engines:
        replica = e.replica_of_successor
        successor = engines[e.replica * P + replica.stage_rank]
        assert_same(chunk_state(replica.update), chunk_state(successor.update), "the successor's chunk")
        assert_same(replica.model.state_dict(), successor.model.state_dict(), "replica weights")


def test_a_failover_rebuilds_the_lost_chunk_from_the_predecessors_replica_bit_for_bit():
    j = job(P)
    ref_engines, ref_driver = sharded_engines(j)
    engines, driver = sharded_engines(j)
    for t in range(2):
        ref_driver.run(t, 1)
        driver.run(t, 1)
    lost = engines[1]  # replica 0, stage 1; its predecessor (replica 0, stage 0) holds its replica
    holder = engines[0].replica_of_successor
    assert_same(chunk_state(holder.update), chunk_state(lost.update), "the lost worker's chunk")
    survivors = [e for e in engines if e is not lost]
    # What make_stages_whole does over the new generation's group: chunk j of stage s from the
    # worker that ran it, else from its predecessor's replica; every holder of s merges them.
    held = [h for e in survivors for h in sharded_holdings(e)]
    assert sorted((s, c, kind) for s, c, _, _, kind in held) == [(0, 0, 2), (0, 1, 1), (0, 1, 2), (1, 0, 1),
                                                                  (1, 1, 1), (1, 1, 2)]
    for s in range(P):
        payloads = []
        for c in range(D):
            src = sorted((h for h in held if h[:2] == (s, c)), key=lambda h: h[4] != RUNS)[0]
            payloads.append(chunk_payload(src[3]))
        for h in held:
            if h[0] == s:
                merge_chunks(h[3], payloads)
    full = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    got = {}
    for e in survivors:
        got.update(held_states(e, (e.stage_rank,), ((e.stage_rank + 1) % P,), full))
    # The re-laid job (built as a re-layout builds it): replica 0 is one worker running both
    # stages; replica 1 stays at full depth.
    dataset = j.build_dataset()
    builder = StageBuilder(job=j, dataset=dataset, plan=data_plan_of(dataset, j), deterministic=True,
                           device=torch.device("cpu"), eager_every_wait=False, breakdown=False)
    tensor = TensorStage(j.pipeline, full, torch.device("cpu"))
    workers = []
    for rep, runs in enumerate((((0, 1),), ((0,), (1,)))):
        for pos, run in enumerate(runs):
            mine = copy.deepcopy(got)  # (each member its own tensors, as the wire gives them)
            e, _ = builder.relaid(j.pipeline, full, [list(r) for r in runs], pos, mine, None, by_job_stage=True,
                                  tensor=tensor)
            e.set_layout(rep, contiguous_assignment(j.virtual_nodes, D))
            workers.append((e, rep, pos, run))
    relaid = LayoutDriver(workers, j.virtual_nodes)
    for t in range(2, STEPS):
        ref_driver.run(t, 1)
        relaid.run(t)
    want = whole_model(ref_engines)
    ref_state, _ = pm.unpipelined(j, STEPS, deterministic=True)
    for e, rep, pos, _ in workers:
        for k, v in e.model.state_dict().items():
            assert_same(v, want[k], f"replica {rep} worker {pos} {k}")
            assert_same(v, ref_state[k], f"unpipelined {k}")
