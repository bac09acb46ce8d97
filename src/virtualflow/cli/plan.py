"""``virtualflow plan FILE.py[:FUNCTION] --stages P``: plan a pipelined run without training.

Builds the job, profiles each layer of its model on one virtual node's batch on this machine
(:mod:`virtualflow.runtime.profile`; the predictions: :mod:`virtualflow.plan.pipeline.predict`), and prints the worker grid (``W = P stages x d pipeline
replicas``), the chosen split (layers per stage and their names), the predicted time per stage,
the simulated step time and bubble (beside the analytic ``(p-1)/(m+p-1)`` for 1F1B), memory per
worker, and the equal-layer split's prediction for comparison. ``--json`` prints the same as one
JSON object.

Flags override the job's ``Job.pipeline`` (a job without one needs ``--stages``); ``--split``
defaults to the job's split, or ``auto`` for a job without a pipeline. Bad input raises
``ValueError`` (the CLI prints one line, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Any

from virtualflow.config.pipeline import Pipeline, merge_knobs
from virtualflow.plan.pipeline.geometry import Grid
from virtualflow.plan.pipeline.schedules import SCHEDULE_NAMES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="profile a pipelined job's layers and predict its split, step time, bubble and memory",
        description="Profile each layer of the job's model on one virtual node's batch (no training) and "
        "print where the pipeline cuts it, the predicted time per stage, step time, bubble and memory per "
        "worker, beside the equal-layer split. Flags override the job's Job.pipeline.",
    )
    p.add_argument("job", help="FILE.py[:FUNCTION] or package.module[:FUNCTION]; FUNCTION defaults to make_job")
    p.add_argument("--stages", type=int, help="p: workers per pipeline replica (default: the job's Pipeline.stages)")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, help="pipeline schedule (default: the job's, else 1f1b)")
    p.add_argument("--chunks", type=int, help="model pieces per worker (interleaved_1f1b only; default 1)")
    p.add_argument("--workers", type=int, help="W = stages x replicas (default: --stages, one replica)")
    p.add_argument("--memory-limit-gib", type=float, help="per-worker memory limit the split must respect")
    p.add_argument("--split", help="auto, equal, or layer counts per piece such as 3,2,2,1 "
                   "(default: the job's split, else auto)")
    p.add_argument("--bandwidth-gbps", type=float,
                   help="link between consecutive stages, GB/s (default 2, loopback)")
    p.add_argument("--latency-us", type=float, help="link latency per message, microseconds (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per layer, median taken (default 3)")
    p.add_argument("--device", default="cpu", help="device to profile on (default cpu)")
    p.add_argument("--threads", type=int,
                   help="torch threads while profiling on CPU (default: cores / workers, as the local backend)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=main)


def pipeline_from_args(base: Pipeline | None, args: argparse.Namespace) -> Pipeline:
    """The job's pipeline with the flags given applied by THE knob merger
    (:func:`virtualflow.config.pipeline.merge_knobs`); a job without one needs ``--stages``. Where
    the job gives no split that fits, ``plan`` chooses ``auto`` (its documented default: the verb
    exists to find a split)."""
    return merge_knobs(base, stages=args.stages, schedule=args.schedule, chunks=args.chunks, split=args.split,
                       memory_limit_gib=args.memory_limit_gib, new_split="auto")


def _link(args: argparse.Namespace):
    from virtualflow.plan.pipeline.partition import Link
    from virtualflow.plan.pipeline.predict import LOOPBACK

    if args.bandwidth_gbps is None and args.latency_us is None:
        return LOOPBACK
    bw = LOOPBACK.bandwidth_bytes_per_s if args.bandwidth_gbps is None else args.bandwidth_gbps * 1e9
    lat = LOOPBACK.latency_s if args.latency_us is None else args.latency_us * 1e-6
    if not (bw > 0):
        raise ValueError(f"--bandwidth-gbps {args.bandwidth_gbps} must be positive")
    return Link(bandwidth_bytes_per_s=bw, latency_s=lat)


def _names(names: list[str]) -> str:
    if len(names) > 6:
        names = names[:3] + ["..."] + names[-2:]
    return ", ".join(names)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def main(args: argparse.Namespace) -> int:
    """``virtualflow plan``. The job's own code runs here (its file's import, the job function,
    the model's construction and forward/backward passes while profiling): a ``sys.exit`` in it
    is reported as an error naming it, not obeyed silently with the job's exit status."""
    try:
        return _plan(args)
    except SystemExit as exc:  # argparse is done: only the job's code can raise it here
        raise ValueError(f"the job {args.job!r} called sys.exit({exc.code!r}) while plan imported, built or profiled "
                         f"it; a job's code must not exit the process (nothing was planned)") from None


def _plan(args: argparse.Namespace) -> int:
    from virtualflow.launching.preflight import build_job
    from virtualflow.plan.pipeline.predict import auto_split, micro_batches, predict, split_partition
    from virtualflow.runtime.profile import profile_model

    for knob in ("stages", "chunks", "workers", "repeats", "threads"):
        value = getattr(args, knob)
        if value is not None and value < 1:
            raise ValueError(f"--{knob} {value} must be a positive integer")
    if args.memory_limit_gib is not None and not args.memory_limit_gib > 0:
        raise ValueError(f"--memory-limit-gib {args.memory_limit_gib} must be positive")
    job = build_job(args.job, args.job)
    pipeline = pipeline_from_args(job.pipeline, args)
    if job.output_loss is None:
        raise ValueError("a pipelined job needs Job.output_loss=(outputs, batch) -> scalar; the job gives only Job.loss")
    job = job.replace(pipeline=pipeline)
    workers = args.workers if args.workers is not None else pipeline.stages
    replicas, _ = micro_batches(job, pipeline, workers)  # checks the grid before any profiling
    grid = Grid(stages=pipeline.stages, replicas=replicas, rank=0)
    link = _link(args)
    threads = args.threads
    if threads is None and str(args.device).startswith("cpu"):
        threads = max(1, (os.cpu_count() or 1) // workers)
    profile = profile_model(job, repeats=args.repeats, device=args.device, threads=threads,
                            weight_grad=pipeline.schedule == "zb_h1")
    if pipeline.split == "auto":
        counts, chosen_part = auto_split(job, pipeline, workers=workers, link=link, profiles=profile)
    else:
        chosen_part = split_partition(job, pipeline, pipeline.split, profile, workers=workers, link=link)
        counts = chosen_part.stage_sizes
    chosen = predict(job, pipeline, counts, profile, workers=workers, link=link)
    equal = predict(job, pipeline, "equal", profile, workers=workers, link=link)
    speedup = equal["step_time_s"] / chosen["step_time_s"] if chosen["step_time_s"] > 0 else math.nan

    if args.json:
        print(json.dumps({
            "job": args.job, "name": job.name, "grid": grid.describe(),
            "pipeline": {"stages": pipeline.stages, "schedule": pipeline.schedule, "chunks": pipeline.chunks,
                         "split": pipeline.split if isinstance(pipeline.split, str) else list(pipeline.split),
                         "memory_limit_gib": pipeline.memory_limit_gib},
            "profile": {"device": profile.device, "repeats": profile.repeats, "elapsed_s": profile.elapsed_s,
                        "micro_batch_size": profile.micro_batch_size,
                        "optimizer_state_factor": profile.optimizer_state_factor,
                        "layers": [dataclasses.asdict(layer) for layer in profile.layers]},
            "chosen": chosen, "equal": equal, "speedup_over_equal": speedup,
        }, indent=2))
        return 0

    m = chosen["micro_batches"]
    lines = [
        f"job {job.name!r} ({args.job}): {len(profile.layers)} layers; global batch {job.global_batch_size} = "
        f"{job.virtual_nodes} virtual nodes x {profile.micro_batch_size}; profiled on {profile.device} in "
        f"{profile.elapsed_s:.2f} s (median of {profile.repeats})",
        f"grid: {grid.describe()}; schedule {pipeline.schedule}"
        + (f" with {pipeline.chunks} chunks per worker" if pipeline.chunks > 1 else "")
        + f", m = {m} micro-batches (virtual nodes) per replica",
        f"split ({pipeline.split if isinstance(pipeline.split, str) else 'given'}): "
        f"{','.join(str(c) for c in chosen['counts'])}",
    ]
    for s, names in enumerate(chosen["piece_layers"]):
        a, b = chosen["bounds"][s]
        lines.append(f"  stage {s} (worker {chosen['piece_worker'][s]}): layers {a}-{b - 1} [{_names(names)}]")
    lines.append(chosen_part.describe())
    lines.append(_summary("predicted", pipeline, chosen))
    lines.append("memory per worker: " + ", ".join(_mib(x) for x in chosen["memory_bytes"])
                 + (f" (limit {pipeline.memory_limit_gib} GiB)" if pipeline.memory_limit_gib is not None else ""))
    if chosen["weight_grad"] == "estimated":
        lines.append("note: the weight-gradient share of each backward is estimated as half")
    lines.append(_summary(f"equal split {','.join(str(c) for c in equal['counts'])}", pipeline, equal)
                 + f"; peak memory {_mib(equal['peak_memory_bytes'])}"
                 + ("" if equal["fits"] else " (over the limit)"))
    if chosen["counts"] != equal["counts"]:
        lines.append(f"chosen split vs equal: {speedup:.2f}x predicted step speed")
    print("\n".join(lines))
    return 0


def _summary(label: str, pipeline: Pipeline, pred: dict) -> str:
    p, m, v = pipeline.stages, pred["micro_batches"], pipeline.chunks
    text = (f"{label}: stage times {', '.join(_ms(t) for t in pred['piece_time_s'])}; bottleneck "
            f"{_ms(pred['bottleneck_s'])}; step {_ms(pred['step_time_s'])} (simulated {pred['schedule']}, p={p}, "
            f"m={m}), bubble {pred['bubble']:.1%}")
    if pred["analytic_bubble"] is not None:
        formula = "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)"
        text += f" (analytic {formula} = {pred['analytic_bubble']:.1%} with equal stage times)"
    return text

