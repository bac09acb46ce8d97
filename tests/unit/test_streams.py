"""The streaming rule (virtualflow.plan.streams) and its readers (virtualflow.runtime.streaming).

The reference here is written from docs/training.md ("Streaming datasets") alone, with its own
shuffle buffer over real samples: it reads every shard whole, concatenates them in each epoch's
shard order, cuts the stream into V parts and passes each part through the buffer. Against it:
the plan's rule, the readers of 1, 2 and 3 simulated workers (with a resize and a resume in the
middle of an epoch, a prefetcher asking for batches out of order from threads, seek or skip), an
exactly-once ledger per epoch, and the refusals.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset

import virtualflow as vf
from virtualflow.config.streaming import as_streaming
from virtualflow.plan.streams import ShuffleOrder, StreamPlan, stream_seed
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.streaming import StreamLoader, data_plan_of, loader_of

import stream_jobs

MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_batches(lengths, B, V, seed, K, steps):
    """{(step, vn): [sample ids]} by the documented rule, from whole shards."""
    ids = stream_jobs.first_ids(lengths)
    shards = [list(range(ids[k], ids[k] + n)) for k, n in enumerate(lengths)]
    N, b = sum(lengths), B // V
    S = N // B
    out = {}
    for e in range(steps // S + 1):
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(stream_seed(seed, e))).tolist()
        epoch_stream = [i for k in order for i in shards[k]]
        for v in range(V):
            part = epoch_stream[v * S * b : (v + 1) * S * b]
            if K:  # a shuffle buffer over the samples themselves
                key, buf, rest, shuffled, t = stream_seed(seed, e, v), part[:K], part[K:], [], 0
                for x in rest:
                    j = splitmix(key ^ splitmix(t)) % K
                    shuffled.append(buf[j])
                    buf[j] = x
                    t += 1
                while buf:
                    j = splitmix(key ^ splitmix(t)) % len(buf)
                    shuffled.append(buf[j])
                    last = buf.pop()
                    if j < len(buf):
                        buf[j] = last
                    t += 1
                part = shuffled
            for i in range(S):
                if e * S + i < steps:
                    out[(e * S + i, v)] = part[i * b : (i + 1) * b]
    return out


def reference_loop(steps: int) -> torch.nn.Module:
    """Plain PyTorch training on the rule's batches (stream_jobs.stream_job): VN by VN, each loss
    weighted by b/B, one optimizer step per global batch."""
    job = stream_jobs.stream_job()
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    batches = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, job.seed, 5, steps)
    for s in range(steps):
        opt.zero_grad()
        for v in range(6):
            samples = [stream_jobs.sample(i) for i in batches[(s, v)]]
            x = torch.stack([a[0] for a in samples])
            y = torch.stack([a[1] for a in samples])
            (((model(x) - y) ** 2).mean() * (2 / 12)).backward()
        opt.step()
    return model


def make(lengths=None, K=5, seek=False, B=12, V=6, seed=3):
    lengths = stream_jobs.SHARD_LENGTHS if lengths is None else lengths
    ds = vf.StreamingDataset(shards=[stream_jobs.shard(k, lengths) for k in range(len(lengths))], lengths=lengths,
                             shuffle_buffer=K, seek=seek)
    return ds, as_streaming(ds).plan(B, V, seed)


def ids_of(batch) -> list[int]:
    return batch[2].tolist()


@pytest.mark.parametrize("K", [0, 1, 5, 40])
def test_the_plan_and_a_reader_follow_the_documented_rule(K):
    ds, plan = make(K=K)
    assert (plan.steps_per_epoch, plan.part, plan.dropped_per_epoch) == (8, 16, 4)
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, K, 20)
    loader = loader_of(ds, None, plan)
    first = dict(zip(range(8), stream_jobs.first_ids()))
    for (s, v), want in ref.items():
        assert [first[k] + o for k, o in plan.samples(s, v)] == want
        assert ids_of(loader(plan.vn_indices(s, v))) == want, (s, v)
    assert loader.rebuilds == 6 * 3  # once per VN per epoch (epochs 0, 1, 2)


@pytest.mark.parametrize("K", [0, 5])
def test_exactly_once_per_epoch_with_the_documented_drop(K):
    _, plan = make(K=K)
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, K, 16)
    for e in (0, 1):
        ledger = Counter(i for (s, v), ids in ref.items() if s // 8 == e for i in ids)
        assert max(ledger.values()) == 1 and len(ledger) == 100 - plan.dropped_per_epoch
        # the dropped samples are the tail of the epoch's stream: the last shards of its order
        order = plan.shard_order(e)
        tail = [i for k in order for i in range(stream_jobs.first_ids()[k], stream_jobs.first_ids()[k]
                                                + stream_jobs.SHARD_LENGTHS[k])][-4:]
        assert set(range(100)) - set(ledger) == set(tail)
    assert plan.shard_order(0) != plan.shard_order(1)


def simulate(plan_of, layouts, steps, prefetch=False, fresh_at=()):
    """Workers that read their VNs' batches step by step: ``layouts`` maps a first step to a worker
    count (contiguous VN maps); at a step in ``fresh_at`` every worker starts with new loaders (a
    resume). With ``prefetch``, each worker asks for this step's and the next step's batches from
    two threads at once, later ones first. Returns ({(step, vn): ids}, rebuilds)."""
    ds, plan = plan_of()
    V = plan.virtual_nodes
    loaders: dict[int, StreamLoader] = {}
    got, rebuilds = {}, 0
    workers = None
    for s in range(steps):
        if s in layouts:
            workers = layouts[s]
        if s in fresh_at:
            rebuilds += sum(ld.rebuilds for ld in loaders.values())
            loaders = {}
        assignment = contiguous_assignment(V, workers)
        for w in range(workers):
            loader = loaders.setdefault(w, loader_of(ds, None, as_streaming(ds).plan(12, V, 3)))
            if prefetch:
                asks = [(s + 1, v) for v in assignment[w]] + [(s, v) for v in assignment[w]]
                threads = [threading.Thread(target=loader, args=(plan.vn_indices(t, v),)) for t, v in asks]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            for v in assignment[w]:
                got[(s, v)] = ids_of(loader(plan.vn_indices(s, v)))
        for w in list(loaders):
            if w >= workers:  # a worker that left
                rebuilds += loaders.pop(w).rebuilds
    return got, rebuilds + sum(ld.rebuilds for ld in loaders.values())


@pytest.mark.parametrize("seek", [False, True])
def test_1_2_3_workers_a_resize_and_a_resume_read_identical_vn_streams(seek):
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, 5, 20)
    for layouts, fresh_at in (({0: 1}, ()), ({0: 2}, ()), ({0: 3}, ()),
                              ({0: 3, 3: 2, 5: 1, 11: 3}, (13,)), ({0: 2, 4: 3}, (6,))):
        got, rebuilds = simulate(lambda: make(seek=seek), layouts, 20, fresh_at=fresh_at)
        assert got == ref, layouts
    # 1 worker, no interruption: each VN's reader is built once per epoch and read on after that
    _, rebuilds = simulate(lambda: make(seek=seek), {0: 1}, 20)
    assert rebuilds == 6 * 3


def test_a_prefetcher_asking_out_of_order_from_threads_reads_the_same_batches():
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, 5, 18)
    got, rebuilds = simulate(lambda: make(), {0: 2, 7: 3}, 18, prefetch=True)
    assert got == ref
    for K in (0, 5):
        got, rebuilds = simulate(lambda: make(K=K), {0: 3}, 18, prefetch=True)
        assert got == reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, K, 18)
        assert rebuilds == 6 * 3  # once per VN and epoch: reading ahead across an epoch's end rebuilds nothing more


def test_a_redone_step_gets_its_batch_again_without_a_rebuild():
    ds, plan = make()
    loader = loader_of(ds, None, plan)
    a = ids_of(loader(plan.vn_indices(2, 1)))
    ids_of(loader(plan.vn_indices(3, 1)))
    assert ids_of(loader(plan.vn_indices(2, 1))) == a  # step 2 redone after a failure
    assert loader.rebuilds == 1


def test_the_shuffle_order_emits_every_position_once_and_needs_only_what_was_read():
    for length, K in ((50, 1), (50, 7), (7, 50), (0, 3)):
        order = ShuffleOrder(12345, length, K)
        seen = []
        for p in order:
            assert p < order.read
            seen.append(p)
        assert sorted(seen) == list(range(length))
    a = ShuffleOrder(1, 40, 6)
    a.advance(13)
    b = ShuffleOrder(1, 40, 6)
    assert [next(b) for _ in range(20)][13:] == [next(a) for _ in range(7)]


def test_one_iterable_dataset_with_a_length_is_one_shard():
    class Stream(IterableDataset):
        def __iter__(self):
            return (stream_jobs.sample(i) for i in range(30))

        def __len__(self):
            return 30

    ds = as_streaming(Stream())
    plan = as_streaming(Stream()).plan(8, 4, 0)
    assert ds.lengths == (30,) and plan.steps_per_epoch == 3 and plan.dropped_per_epoch == 6
    loader = loader_of(Stream(), None, plan)
    seen = [i for s in range(3) for v in range(4) for i in ids_of(loader(plan.vn_indices(s, v)))]
    assert sorted(seen) == list(range(24))  # one shard: the same order every epoch, its last 6 dropped


def test_shards_may_be_re_iterable_objects_with_their_lengths():
    class Shard(IterableDataset):
        def __init__(self, k):
            self.k = k

        def __iter__(self):
            return (stream_jobs.sample(i) for i in range(stream_jobs.first_ids()[self.k],
                                                          stream_jobs.first_ids()[self.k] + len(self)))

        def __len__(self):
            return stream_jobs.SHARD_LENGTHS[self.k]

    ds = vf.StreamingDataset(shards=[Shard(k) for k in range(8)], shuffle_buffer=5)
    assert ds.lengths == tuple(stream_jobs.SHARD_LENGTHS)
    plan = as_streaming(ds).plan(12, 6, 3)
    loader = loader_of(ds, None, plan)
    ref = reference_batches(stream_jobs.SHARD_LENGTHS, 12, 6, 3, 5, 10)
    assert {k: ids_of(loader(plan.vn_indices(*k))) for k in ref} == ref


def test_refusals_name_the_value_and_the_knob():
    with pytest.raises(ValueError, match="shard 0 has none.*give lengths="):
        vf.StreamingDataset(shards=[lambda: iter([])])
    with pytest.raises(TypeError, match="shard 0 is a generator.*read only once"):
        vf.StreamingDataset(shards=[(i for i in range(3))], lengths=[3])
    with pytest.raises(ValueError, match="2 shards but 1 lengths"):
        vf.StreamingDataset(shards=[lambda: iter([]), lambda: iter([])], lengths=[3])
    with pytest.raises(TypeError, match="shard 0 is a int"):
        vf.StreamingDataset(shards=[5], lengths=[2])

    class NoLen(IterableDataset):
        def __iter__(self):
            return iter([])
    with pytest.raises(ValueError, match="without __len__.*StreamingDataset"):
        as_streaming(NoLen())
    with pytest.raises(ValueError, match="fewer than global_batch_size=12"):
        make(lengths=[5, 6])
    with pytest.raises(ValueError, match="shuffle_buffer=-1"):
        make(K=-1)
    _, plan = make()
    plan.set_vn_sizes(None)
    with pytest.raises(ValueError, match="--uneven-vn-sizes"):
        plan.set_vn_sizes([1, 3, 2, 2, 2, 2])
    # a shard shorter than its declared length: the file and the fix
    short = vf.StreamingDataset(shards=[lambda: iter([stream_jobs.sample(0)] * 3)], lengths=[40])
    loader = loader_of(short, None, short.plan(12, 6, 0))
    with pytest.raises(ValueError, match="shard 0 ended after fewer than 6 samples.*says it has 40"):
        loader(short.plan(12, 6, 0).vn_indices(0, 1))  # VN 1 skips to offset 6
    loader.stream = vf.StreamingDataset(shards=[lambda start: iter([stream_jobs.sample(0)] * (3 - start))], lengths=[40], seek=True)
    with pytest.raises(ValueError, match="shard 0 ended after 3 samples.*says it has 40"):
        for s in range(3):
            loader(short.plan(12, 6, 0).vn_indices(s, 0))
    no_seek = vf.StreamingDataset(shards=[lambda: iter([])], lengths=[40], seek=True)
    with pytest.raises(TypeError, match=r"seek=True.*shards\[0\]\(start\).*drop seek=True"):
        loader_of(no_seek, None, no_seek.plan(12, 6, 0))(no_seek.plan(12, 6, 0).vn_indices(0, 0))
    with pytest.raises(ValueError, match="--uneven-vn-sizes"):
        from virtualflow.launching.prepare import prepare
        with prepare(stream_jobs.stream_job, vf.LaunchOptions(workers=2, steps=2, uneven_vn_sizes=True)):
            pass


def test_a_job_with_a_streaming_dataset_passes_the_preflight():
    from virtualflow.launching.preflight import preflight

    job = stream_jobs.stream_job()
    ds = job.build_dataset()
    plan = data_plan_of(ds, job)
    assert isinstance(plan, StreamPlan)
    preflight(job, ds, plan)


def test_a_pipeline_reads_the_stream_on_its_first_and_last_stage():
    from virtualflow.runtime.pipeline.local import train_local

    state, _ = train_local(stream_jobs.pipelined_stream_job(), 12, replicas=2, deterministic=True)
    ref = reference_loop(12).state_dict()
    assert state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)
