"""Pipelines with overlapped input (``loader_workers``): a stage's micro-batches are loaded by
loader threads while the current ones compute (runtime/prefetch.py, :class:`StepAhead`).

In-process (the cooperative pipeline driver, runtime/pipeline/local.py), against the unpipelined
single-worker run of the same job (``pipeline_models.unpipelined``, the VN engine on one worker):

- 1F1B with two replicas, deterministic: bit-identical weights and losses; default mode:
  bit-identical to the same pipeline without loader threads. Every sample was read on a loader
  thread (so the test fails if the stages load on the spot).
- 2BW (a window of steps): bit-identical to the independent reference of 2BW's weight law.
- A layout change mid-run (an uneven, weight-shaped map, then a resize to one replica): the
  batches loaded for the old map are dropped, the model is still the unpipelined one.
- Bamboo's eager redundant forwards (the last stage's replica of the first stage reads the
  micro-batches too) and a weight tied across stages: bit-identical. A failed-over replica (one
  worker running two job stages, beside a full-depth replica): the worker that took the first or
  the last stage over reads its micro-batches ahead; the model is the undisturbed one.
- The step breakdown (on a per-thread fake clock, as tests/unit/test_breakdown.py): with loader
  threads the first and last stages wait for no input (``input_s`` 0) while the loaders still
  read every sample (``loaded_s``); without them the stages read it themselves.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import pipeline_models as pm
import virtualflow as vf
from conftest import assert_state_equal
from test_breakdown import CLOCK, INPUT_S, SlowSamples, _Sleep
from test_bamboo import assert_same, engines_of, job as bamboo_job
from test_bamboo_replicas import LayoutDriver
from virtualflow.backends.inprocess import LocalDriver, build_engine, train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import bounds_from_counts, layers_of, piece_module, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline import StageEngine
from virtualflow.runtime.streaming import data_plan_of, loader_of
from virtualflow.runtime import breakdown, prefetch
from virtualflow.runtime.pipeline import executor, microbatch

READS: list[tuple[str, int]] = []
"""(thread name, sample) of every read of :class:`RecordedData` since the last clear."""


class RecordedData(torch.utils.data.Dataset):
    """pipeline_models' regression data, recording which thread read each sample."""

    def __init__(self) -> None:
        self.data = pm.regression_data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        READS.append((threading.current_thread().name, int(i)))
        return self.data[i]


def _engines(job: vf.Job, replicas: int, loader_workers: int) -> list:
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    dataset = job.build_dataset()
    return [build_engine(job, job.pipeline, bounds, r % job.pipeline.stages, dataset=dataset, deterministic=True,
                         device=torch.device("cpu"), loader_workers=loader_workers)
            for r in range(job.pipeline.stages * replicas)]


def test_1f1b_with_two_replicas_reads_on_loader_threads_and_trains_the_unpipelined_model():
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=6).replace(dataset=RecordedData)
    steps = 4
    READS.clear()
    state, history = train_local(job, steps, replicas=2, deterministic=True, loader_workers=2)
    reads = list(READS)
    ref_state, ref_losses = pm.unpipelined(job, steps, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses
    # The first and the last stage of each replica read every sample of every step (the next
    # step's are read ahead too), all of them on loader threads.
    assert len(reads) >= 2 * job.global_batch_size * steps
    assert {name.startswith("vf-loader") for name, _ in reads} == {True}
    # Default mode: the same bits as the same pipeline loading on the spot.
    plain, plain_history = train_local(job, steps, replicas=2, deterministic=False)
    loaded, loaded_history = train_local(job, steps, replicas=2, deterministic=False, loader_workers=3)
    assert_state_equal(loaded, plain)
    assert [h.loss for h in loaded_history] == [h.loss for h in plain_history]


def test_2bw_window_with_loaders_follows_the_weight_law():
    p, V, window, steps = 3, 4, 3, 5
    split = (3, 3, 3)
    job = pm.mlp_job(Pipeline(stages=p, schedule="2bw", split=split, window=window), virtual_nodes=V)
    state, history = train_local(job, steps, replicas=1, deterministic=True, loader_workers=2)
    ref_state, ref_losses, _ = pm.stream_reference(job, steps, split, pm.versions_2bw(steps, V, p),
                                                   deterministic=True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == pytest.approx(ref_losses, rel=1e-6)


def test_a_layout_change_mid_run_drops_the_old_maps_batches():
    """Two replicas on an even map, then an uneven (weight-shaped) one, then one replica: the
    model of six steps is the unpipelined one, bit for bit."""
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=6)
    engines = _engines(job, replicas=2, loader_workers=2)
    try:
        driver = LocalDriver(engines)
        driver.set_layout([[0, 1, 2], [3, 4, 5]])
        history = driver.run(0, 1) + driver.run(1, 1)
        # step 2's batches of VNs 0-2 (replica 0) and 3-5 (replica 1) are loaded by now
        assert engines[0].prep.source.prefetcher.pending > 0
        driver.set_layout([[0, 1, 2, 3, 4], [5]])  # balance: replica 0 is 5x as fast
        assert all(e.prep.source.prefetcher.pending == 0 for e in engines)  # the old map's batches dropped
        history += driver.run(2, 1) + driver.run(3, 1)
        for e in engines[2:]:  # a resize to one replica: replica 1's workers leave
            e.close()
        driver = LocalDriver(engines[:2])
        driver.set_layout([list(range(6))])
        history += driver.run(4, 1) + driver.run(5, 1)
        state = {k: v for e in engines[:2] for k, v in e.model.state_dict().items()}
    finally:
        for e in engines:
            e.close()
    ref_state, ref_losses = pm.unpipelined(job, 6, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses


def test_bamboo_eager_forwards_and_tied_weights_with_loaders():
    """Bamboo: the last stage's replica of the first stage reads the micro-batches too (eager
    forwards at every wait); a tied embedding and head across stages: both bit-identical."""
    job = pm.mlp_job(Pipeline(stages=3, redundancy=True, redundant_compute="eager"), virtual_nodes=4)
    engines: list = []
    state, history = train_local(job, 3, replicas=1, deterministic=True, loader_workers=2, eager_every_wait=True,
                                 engines_out=engines)
    assert sum(e.replica_of_successor.forwards for e in engines) > 0  # the replicas did run forwards
    ref_state, ref_losses = pm.unpipelined(job, 3, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses

    tied = pm.transformer_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4, model=pm.tied_gpt)
    state, history = train_local(tied, 3, replicas=2, deterministic=True, loader_workers=2)
    ref_state, ref_losses = pm.unpipelined(tied, 3, True)
    assert_state_equal(state, ref_state)
    assert [h.loss for h in history] == ref_losses


def _failed_over_engine(j: vf.Job, runs: tuple[tuple[int, ...], ...], pos: int, dataset) -> StageEngine:
    """Worker ``pos`` of a Bamboo replica laid out as ``runs`` (as a re-layout builds it), with
    two loader threads."""
    torch.manual_seed(j.seed)
    layers = layers_of(j.model())
    full = resolve_bounds(j.pipeline, len(layers))
    counts = [full[run[-1]][1] - full[run[0]][0] for run in runs]
    bounds = bounds_from_counts(counts)
    m = len(runs)
    (a, b), (sa, sb) = bounds[pos], bounds[(pos + 1) % m]
    engine = StageEngine(
        pieces={pos: piece_module(layers, a, b)}, n_pieces=m, stage_rank=pos, build_optimizer=j.build_optimizer,
        scheduler_factory=j.lr_scheduler, pipeline=Pipeline(stages=m, split=counts, redundancy=True),
        plan=data_plan_of(dataset, j), loader=loader_of(dataset, j.collate_fn, data_plan_of(dataset, j)),
        model_input=j.input_of, output_loss=j.output_loss, seed=j.seed, batchnorm=j.batchnorm, deterministic=True,
        device=torch.device("cpu"), successor_pieces={(pos + 1) % m: piece_module(layers, sa, sb)},
        loader_workers=2)
    if len(runs[pos]) > 1:
        engine.set_job_stages([(s, *full[s]) for s in runs[pos]])
    return engine


@pytest.mark.parametrize("short", [((0, 1), (2,)), ((0,), (1, 2))])
def test_a_failed_over_replica_reads_its_lost_stages_micro_batches_with_loaders(short):
    """Bamboo after a failover: replica 1 runs on two workers, one of them two job stages (the
    first stage's inputs or the last stage's targets now read by the worker that took the stage
    over), beside replica 0 at full depth, every worker with loader threads: the model of four
    steps is the undisturbed job's without loaders, bit for bit (as
    tests/e2e/test_bamboo_replicas.py proves it without loaders)."""
    j = bamboo_job(3)
    dataset = j.build_dataset()
    assignment = contiguous_assignment(j.virtual_nodes, 2)
    ref, ref_driver = engines_of(j, 2, True)
    bounds = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    full = [build_engine(j, j.pipeline, bounds, r, dataset=dataset, deterministic=True, device=torch.device("cpu"),
                         loader_workers=2) for r in range(3)]
    workers = [(e, 0, r, (r,)) for r, e in enumerate(full)]
    workers += [(_failed_over_engine(j, short, pos, dataset), 1, pos, short[pos]) for pos in range(2)]
    try:
        for e, rep, *_ in workers:
            e.set_layout(rep, assignment)
        driver = LayoutDriver(workers, j.virtual_nodes)
        for t in range(4):
            ref_driver.run(t, 1)
            driver.run(t)
        for e, rep, pos, stages in workers:  # the readers (first and last job stage) loaded step 4 ahead
            reads = 0 in stages or 2 in stages
            assert (e.prep.source.prefetcher.pending > 0) == reads, (rep, pos)
        want = {k: v for e in ref[:3] for k, v in e.model.state_dict().items()}
        for e, rep, pos, _ in workers:
            for k, v in e.model.state_dict().items():
                assert_same(v, want[k], f"replica {rep} worker {pos} {k}")
    finally:
        for e, *_ in workers:
            e.close()


@pytest.fixture
def fake_clock(monkeypatch):
    fake = CLOCK.module()
    for mod in (breakdown, prefetch, executor, microbatch):
        monkeypatch.setattr(mod, "time", fake)
    return CLOCK


class Slow(nn.Module):
    """Sleeps on the fake clock in its forward and its backward (emulated compute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x)


def slow_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), Slow(), nn.Tanh(), nn.Linear(16, 16), Slow(), nn.Linear(16, 1), Slow())


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_loaders_move_the_stages_input_off_the_critical_path(fake_clock, loader_workers):
    p, V = 3, 4
    job = pm.mlp_job(Pipeline(stages=p, schedule="1f1b"), virtual_nodes=V, model=slow_mlp).replace(
        dataset=lambda: SlowSamples(n=64))
    B = job.global_batch_size
    _, history = train_local(job, 4, replicas=1, deterministic=False, loader_workers=loader_workers)
    for h in history[1:]:
        rows = h.breakdown
        assert rows is not None and len(rows) == p
        for stage, row in enumerate(rows):
            reads = stage in (0, p - 1)  # the first stage reads the inputs, the last the targets
            assert row["loaded_s"] == pytest.approx(B * INPUT_S if reads else 0.0)  # every sample is read
            waited = B * INPUT_S if reads and not loader_workers else 0.0
            assert row["input_s"] == pytest.approx(waited, abs=1e-9)  # ... by the stage itself, or not


def test_tensor_parallel_stages_with_loader_threads_train_the_same_model():
    """A (1, 2, 2) grid of GPT stages (float64) with two loader threads per worker, every worker a
    thread on real gloo groups (:func:`virtualflow.runtime.grid_threads.train_threads`), against the
    (1, 1, 2) layout without loaders: bit for bit (layouts of one T are bit-identical whatever P, and
    the loaders change when a micro-batch is read, never which samples it holds)."""
    import gpt_grid_jobs as g
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.grid_threads import Generation, train_threads

    def run(stages: int, loaders: int):
        job = g.grid_job(stages=stages, tensor=2)
        options = WorkerOptions(deterministic=True, loader_workers=loaders)
        return train_threads(job, [Generation(members=tuple(range(2 * stages)), steps=3)], options=options)

    loaded, plain = run(2, 2), run(1, 0)
    assert_state_equal(loaded.state["model"], plain.state["model"])
    assert [o.loss for o in loaded.outcomes] == [o.loss for o in plain.outcomes]
