"""Streaming input vs a map-style dataset of the same samples, with loader threads on.

Workload: 4,096 samples of 256 features (10 classes), each read with an EMULATED storage latency
of 0.2 ms per sample (a sleep: like slow storage it frees the CPU), an MLP 256-1024-1024-10,
B = 64 in V = 8 virtual nodes, 1 worker, 1 thread. The same samples two ways:

* **map-style**: a ``Dataset`` whose ``__getitem__`` sleeps and returns sample ``i`` (read in the
  order of ``randperm``), the way virtualflow loaded data before streams;
* **streaming**: ``virtualflow.StreamingDataset`` of 16 shards of 256 samples, each shard a
  generator that sleeps per sample, a shuffle buffer of 64 per virtual node (the rule of
  docs/training.md, "Streaming datasets": each VN reads its part of the epoch's stream with an
  open reader).

Both with ``loader_workers=2`` (the next VNs' batches read by 2 threads while the current ones
compute): target streaming / map-style median step time <= 1.05 (key ``stream_ratio``). The same
pair without loader threads is reported beside it (not a target). Runs are interleaved (A B B A)
after waiting for a quiet machine (``--quiet-wait``); the other load measured during the runs is
printed and recorded, and only a run on a quiet machine is a measurement.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.streaming            # about 2 minutes
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.streaming --quick    # about 1 minute
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import Dataset

from bench import harness as H

NAME = "streaming"
TARGET_KEYS = ("stream_ratio",)
N, FEATURES, CLASSES = 4096, 256, 10
SHARDS = N // 256
LATENCY_S = 0.0002
B, V = 64, 8
LOADERS = 2
SHUFFLE = 64
TARGET_RATIO = 1.05


def _samples() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    return x, (x[:, :CLASSES].argmax(1))


class MapSamples(Dataset):
    """Sample ``i``, read with the emulated latency."""

    def __init__(self) -> None:
        self.x, self.y = _samples()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        time.sleep(LATENCY_S)
        return self.x[i], self.y[i]


def stream_samples():
    import virtualflow as vf

    x, y = _samples()
    per = N // SHARDS

    def shard(k: int):
        def read():
            for i in range(k * per, (k + 1) * per):
                time.sleep(LATENCY_S)
                yield x[i], y[i]
        return read
    return vf.StreamingDataset(shards=[shard(k) for k in range(SHARDS)], lengths=[per] * SHARDS,
                               shuffle_buffer=SHUFFLE)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, CLASSES))


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def cross_entropy(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def map_job():
    import virtualflow as vf

    return vf.Job(name="stream-bench", model=mlp, optimizer=sgd, loss=cross_entropy, dataset=MapSamples,
                  global_batch_size=B, virtual_nodes=V, seed=0)


def stream_job():
    return map_job().replace(dataset=stream_samples)


def run(tmp: str, kind: str, steps: int, loaders: int) -> list[float]:
    import virtualflow as vf

    run_dir = os.path.join(tmp, f"{kind}-{loaders}")
    result = vf.train(f"bench.streaming:{kind}_job", workers=1, steps=steps, threads_per_worker=1, run_dir=run_dir,
                      overwrite=True, loader_workers=loaders)
    return [h["step_time_s"] for h in result.history]


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, reps=3, reps_help="interleaved repetitions of each configuration", quiet_wait=30.0)
    args = p.parse_args(argv)
    run_ = H.Run(NAME, args, TARGET_KEYS)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    reps = 1 if args.quick else args.reps
    steps, warmup = (24, 6) if args.quick else (48, 8)  # warm-up: each VN fills its shuffle buffer first
    print(H.banner(f"streaming vs map-style input: {N} samples, EMULATED latency {LATENCY_S * 1e3:g} ms per sample, "
                   f"B={B}, V={V}, 1 worker, {reps} interleaved repetition(s) of {steps} steps"))
    waited, load = H.wait_for_quiet(args.quiet_wait)
    print(f"  waited {waited:.0f} s for a quiet machine (other load {load:.2f} cores)")
    tmp = tempfile.mkdtemp(prefix="streaming-")
    configs = {f"{kind}_{n}": (kind, n) for n in (LOADERS, 0) for kind in ("map", "stream")}
    samples: dict[str, list[float]] = {k: [] for k in configs}
    meter = H.LoadMeter()
    order = list(configs)
    with meter:
        for r in range(reps):
            for name in (order if r % 2 == 0 else order[::-1]):
                kind, n = configs[name]
                times = run(tmp, kind, steps, n)
                samples[name].append(statistics.median(times[warmup:]))
                print(f"  rep {r + 1} {name:>10}: median step {samples[name][-1] * 1000:7.1f} ms")
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Each repetition runs the two of a pair back to back: the ratio within a pair cancels drift.
    pairs = [a / b for a, b in zip(samples[f"stream_{LOADERS}"], samples[f"map_{LOADERS}"])]
    ratio = statistics.median(pairs)
    ratio_sync = statistics.median(a / b for a, b in zip(samples["stream_0"], samples["map_0"]))
    run_.targets.at_most("stream_ratio", f"streaming / map-style median step time, loader_workers={LOADERS} "
                         f"(median of {len(pairs)} back-to-back pairs)", ratio, TARGET_RATIO)
    print(f"  pair ratios (streaming / map-style, loader_workers={LOADERS}): "
          f"{', '.join(f'{r:.3f}' for r in pairs)}")
    rows = [[f"map-style, loader_workers={LOADERS}", f"{med[f'map_{LOADERS}'] * 1000:.1f}", "1.00"],
            [f"streaming, loader_workers={LOADERS}", f"{med[f'stream_{LOADERS}'] * 1000:.1f}", f"{ratio:.3f}"],
            ["map-style, loader_workers=0", f"{med['map_0'] * 1000:.1f}", "1.00"],
            ["streaming, loader_workers=0", f"{med['stream_0'] * 1000:.1f}", f"{ratio_sync:.3f}"]]
    print("\n" + H.text_table(["configuration", "median step (ms)", "ratio to map-style"], rows))
    print(f"other processes used {meter.other_cores:.2f} cores on average during the runs"
          f"{' (NOT quiet: treat the numbers as indicative)' if meter.other_cores > 0.3 else ''}")
    payload = {"benchmark": run_.name, "environment": H.environment(),
               "config": {"samples": N, "features": FEATURES, "shards": SHARDS, "latency_s_per_sample": LATENCY_S,
                          "B": B, "V": V, "loaders": LOADERS, "shuffle_buffer": SHUFFLE, "steps": steps,
                          "warmup": warmup, "reps": reps},
               "median_step_s": med, "samples": samples, "stream_ratio": ratio, "pair_ratios": pairs,
               "stream_ratio_no_loaders": ratio_sync,
               "quiet_wait_s": waited, "other_load_cores": meter.other_cores}
    md = f"""# {run_.name}: streaming input vs a map-style dataset of the same samples

Workload: {N} samples of {FEATURES} features read with an **emulated storage latency of
{LATENCY_S * 1e3:g} ms per sample** (a sleep), an MLP {FEATURES}-1024-1024-{CLASSES}, B = {B} in V = {V}
virtual nodes, 1 worker, 1 thread. Map-style: `__getitem__` per sample in the epoch's `randperm`
order. Streaming: `virtualflow.StreamingDataset`, {SHARDS} shards of {N // SHARDS} samples, a
shuffle buffer of {SHUFFLE} per VN. Medians of steady steps ({steps} steps, {warmup} warm-up),
{reps} interleaved repetition(s).

{H.md_table(["configuration", "median step (ms)", "ratio to map-style"], rows)}

The ratios are medians of back-to-back pairs (streaming / map-style within one repetition):
{", ".join(f"{r:.3f}" for r in pairs)} with loader threads.

Reproduce: `{run_.command(NAME)}`

Waited {waited:.0f} s for a quiet machine; other processes used {meter.other_cores:.2f} cores on average
during the runs.

{H.env_markdown()}
"""
    return run_.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
