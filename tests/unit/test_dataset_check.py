"""Workers whose datasets differ are refused (issue 40, item 12): each worker fingerprints a few
fixed samples of the dataset it built and the coordinator compares every join with the first.
Pure and in-process: the fingerprint, the comparison, and the coordinator's check of signed join
reports (a newcomer's too)."""

from __future__ import annotations

import random

import torch
from torch.utils.data import IterableDataset, TensorDataset

from virtualflow.comm import protocol
from virtualflow.config.streaming import StreamingDataset
from virtualflow.control.coordinator import Coordinator
from virtualflow.runtime.dataset_check import CAUSE, compare, fingerprint


def _shuffled(seed: int | None) -> TensorDataset:
    """A dataset built with a shuffle: seeded (the same in every process) or not."""
    x = torch.arange(64, dtype=torch.float32).reshape(32, 2)
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    perm = torch.randperm(32, generator=g) if g is not None else torch.tensor(random.sample(range(32), 32))
    return TensorDataset(x[perm], x[perm, :1] * 2)


def test_the_same_dataset_built_twice_has_the_same_fingerprint():
    assert fingerprint(_shuffled(7)) == fingerprint(_shuffled(7))
    fp = fingerprint(_shuffled(7))
    assert set(fp) == {"len", "sample 0", "sample 16", "sample 31"} and fp["len"] == "32"


def test_an_unseeded_shuffle_differs_and_the_message_names_samples_and_cause():
    random.seed(1)
    a = fingerprint(_shuffled(None))
    random.seed(2)
    b = fingerprint(_shuffled(None))
    assert compare(a, 0, a, 1) is None
    msg = compare(a, 0, b, 1)
    assert msg is not None and msg.startswith("worker 1's dataset differs from worker 0's (sample 0: ")
    assert f"{a['sample 0']} vs {b['sample 0']}" in msg and msg.endswith(CAUSE)
    assert "seed your shuffle" in msg
    # a different length is named too
    short = fingerprint(TensorDataset(torch.zeros(31, 2)))
    assert "len: 32 vs 31" in compare(a, 0, short, 3)


def test_a_random_augmentation_is_not_a_difference_and_the_generators_are_restored():
    class Augmented(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((2,), float(i)) + torch.rand(2), random.random()

    torch.manual_seed(123)
    random.seed(5)
    before = (torch.random.get_rng_state(), random.getstate())
    first = fingerprint(Augmented())
    assert torch.equal(torch.random.get_rng_state(), before[0]) and random.getstate() == before[1]
    torch.manual_seed(999)
    assert fingerprint(Augmented()) == first


def test_objects_of_the_jobs_own_are_hashed_by_type_not_address():
    class Thing:
        pass

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"x": torch.tensor([i]), "meta": Thing()}

    assert fingerprint(DS()) == fingerprint(DS())


def test_streaming_datasets_hash_their_lengths_and_first_sample():
    def ds(offset: int) -> StreamingDataset:
        return StreamingDataset(shards=[lambda: iter([]), lambda: (torch.tensor([i + offset]) for i in range(4))],
                                lengths=[0, 4])

    assert fingerprint(ds(0)) == fingerprint(ds(0))
    assert set(fingerprint(ds(0))) == {"len", "shards", "stream sample 0 of shard 1"}
    assert "stream sample 0 of shard 1" in compare(fingerprint(ds(0)), 0, fingerprint(ds(1)), 1)

    class Stream(IterableDataset):
        def __init__(self, start):
            self.start = start

        def __len__(self):
            return 3

        def __iter__(self):
            return iter([torch.tensor(self.start + i) for i in range(3)])

    assert fingerprint(Stream(0)) == fingerprint(Stream(0)) != fingerprint(Stream(5))


def _join(coord: Coordinator, worker: int, seq: int, dataset) -> None:
    fp = fingerprint(dataset) if dataset is not None else None
    protocol.push_report(coord.store, coord.run, {"type": "join", "setup_s": 0.1, "dataset": fp,
                                                  "worker": worker, "pid": 1000 + worker, "seq": seq})


def test_the_coordinator_fails_the_job_on_a_worker_or_newcomer_whose_dataset_differs():
    coord = Coordinator(total_steps=10, run_dir=None)
    events = []
    coord.event = lambda kind, **f: events.append((kind, f))  # type: ignore[method-assign]
    random.seed(1)
    _join(coord, 0, 1, _shuffled(3))
    _join(coord, 1, 1, _shuffled(3))
    _join(coord, 2, 1, None)  # could not fingerprint: not compared
    coord.poll()
    assert coord.progress.errors == []
    _join(coord, 3, 1, _shuffled(4))  # a newcomer (a resize), built with another seed
    coord.poll()
    (err,) = coord.progress.errors
    assert err["worker"] == 3 and err["pid"] == 1003 and err["phase"] == "joining"
    assert err["error"].startswith("DatasetMismatch: worker 3's dataset differs from worker 0's (sample 0: ")
    assert err["error"].endswith(CAUSE)
    assert [k for k, _ in events if k == "dataset_mismatch"] == ["dataset_mismatch"]
    coord.close()


def test_the_failure_reads_as_one_line_naming_the_worker():
    from types import SimpleNamespace

    from virtualflow.backends.external import ExternalBackend
    from virtualflow.launching.outcome import worker_failure

    err = worker_failure([{"worker": 1, "pid": 42, "error": "DatasetMismatch: worker 1's dataset differs from "
                           f"worker 0's (sample 0: a vs b): {CAUSE}", "traceback": "", "step": None,
                           "phase": "joining"}],
                         SimpleNamespace(state_dir="/tmp/x", run_dir=None, backend=ExternalBackend(("127.0.0.1", 0))))
    assert str(err).startswith("worker 1 (pid 42) failed: DatasetMismatch: worker 1's dataset differs")
    assert "seed your shuffle" in str(err) and "while joining" in str(err)
