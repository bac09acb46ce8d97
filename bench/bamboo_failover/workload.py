"""The benchmark's names and targets, and its job: one pipeline of :mod:`bench.harness.sleep_stages`'
sleep-emulated stages with ``Pipeline(redundancy=True)``; the job's shape from ``VF_BF_*``
environment variables (:func:`configure`), and the schedule's nominal step times.

Invariant: importable on its own (the worker processes import ``failover_job``'s parts).
"""

from __future__ import annotations

import os

from bench import harness as H
from bench.harness.sleep_stages import adamw, configure_stages, data, model, output_loss


NAME = "bamboo_failover"
TARGET_KEYS = ("failover_s", "failover_slowdown", "replay_error", "value_vs_on_demand", "value_vs_checkpoint")
TARGET_FAILOVER_S = 1.0
TARGET_SLOWDOWN = 1.5
TARGET_REPLAY_ERROR = 0.10
TARGET_VS_ON_DEMAND = 2.0
TARGET_VS_CHECKPOINT = 1.5
P2_TRACE = "p2-xlarge-2020-11-20-hours"
CONSTANTS_FILE = "bamboo_constants.json"
OTHER_CONSTANTS = "bench/results/bamboo.json"
SEED = H.SEED


# --------------------------------------------------------------------------------------------
# The workload: bench/harness/sleep_stages.py's sleep-emulated stages (shape from VF_BF_*
# variables); the job around them from VF_BF_M / VF_BF_MB / VF_BF_COMPUTE.


def failover_job():
    import virtualflow as vf

    env = os.environ
    m = int(env.get("VF_BF_M", "8"))
    return vf.Job(model=model, optimizer=adamw, output_loss=output_loss, dataset=data,
                  global_batch_size=m * int(env.get("VF_BF_MB", "4")), virtual_nodes=m, seed=SEED, name=NAME,
                  pipeline=vf.Pipeline(stages=int(env.get("VF_BF_STAGES", "3")), schedule="1f1b", redundancy=True,
                                       redundant_compute=env.get("VF_BF_COMPUTE", "eager")))


def configure(args) -> None:
    os.environ.update(configure_stages(width=args.width, stages=args.stages, f_ms=args.f_ms, b_ms=args.b_ms),
                      VF_BF_M=str(args.m), VF_BF_MB=str(args.mb))


def nominal_full_s(args) -> float:
    return (args.m + args.stages - 1) * (args.f_ms + args.b_ms) / 1e3


def nominal_failed_over_s(args) -> float:
    """1F1B with one worker running two consecutive stages: it does 2 (f + b) per micro-batch
    for m micro-batches, plus the other p - 2 stages' fill and drain of (f + b) each."""
    return (2 * args.m + args.stages - 2) * (args.f_ms + args.b_ms) / 1e3
