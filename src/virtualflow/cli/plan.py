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

``--grid`` (or ``--workers W`` without ``--stages`` for a job without a pipeline) chooses the 3-D
grid instead: ``W = D replicas x P stages x T tensor-parallel workers``, the schedule, the chunks,
the micro-batches per VN and the split, by :func:`virtualflow.plan.grid.choose_grid` on the same
profile, and prints the top candidates and why the best wins (exit status 1 when none fits the
memory limit). Tensor-parallel layers come from
``virtualflow.parallel.convert.tensor_parallel_candidates`` (``--tensor-parallel-layers auto``),
every layer holding an ``nn.Linear`` (``linear``), none, or given indices.
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
    g = p.add_argument_group("grid planning (--grid: choose D x P x T for --workers)")
    g.add_argument("--grid", action="store_true",
                   help="choose the data x pipeline x tensor grid for --workers (the default when --workers is given "
                        "without --stages and the job has no pipeline)")
    g.add_argument("--heads", type=int, help="attention heads: T must divide them (default: read from the model's "
                   "attention modules, else the column-parallel width of its tensor-parallel layers)")
    g.add_argument("--tensor-parallel-layers", default="auto",
                   help="which layers are tensor-parallel blocks: auto (virtualflow.parallel.convert), linear (every "
                        "layer holding an nn.Linear), none, or layer indices such as 1,2,3 (default auto)")
    g.add_argument("--tp-bandwidth-gbps", type=float, help="link inside a tensor-parallel group, GB/s "
                   "(default: --bandwidth-gbps)")
    g.add_argument("--tp-latency-us", type=float, help="its latency per message, microseconds (default: --latency-us)")
    g.add_argument("--microbatches-per-vn", default="1",
                   help="micro-batches a virtual node may be cut into, tried in turn (default 1: the pipeline engine "
                        "runs one micro-batch per VN; larger values are a what-if, e.g. 1,2,4)")
    g.add_argument("--reduction", choices=("allreduce", "sharded", "fsdp"), default="allreduce",
                   help="data-parallel gradient reduction: ring all-reduce, sharded (reduce-scatter + all-gather, "
                        "optimizer state divided across replicas) or fsdp (parameters, gradients and optimizer state "
                        "divided, each unit gathered for its use; no pipeline or tensor parallelism)")
    g.add_argument("--shard-units", help="with --reduction fsdp: the sharding units, comma-separated module or class "
                   "names (default: the blocks of the model's first nn.ModuleList/nn.Sequential)")
    g.add_argument("--top", type=int, default=5, help="candidates printed (default 5)")
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
    if getattr(args, "grid", False) or (args.workers is not None and args.stages is None and job.pipeline is None):
        return _plan_grid(args, job)
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



# ---- grid planning (--grid) ------------------------------------------------------------------------


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{flag} {text!r} must be comma-separated non-negative integers such as 1,2,4")
    return values


def tensor_parallel_layers(spec: str, layers: list) -> tuple[list[bool], str]:
    """Which layers are tensor-parallel blocks under ``--tensor-parallel-layers spec``, and where
    that came from (a line for the output)."""
    from torch import nn

    n = len(layers)
    if spec == "none":
        return [False] * n, "none (--tensor-parallel-layers none)"
    if spec == "linear":
        flags = [any(isinstance(m, nn.Linear) for m in layer.modules()) for layer in layers]
        return flags, "every layer holding an nn.Linear (--tensor-parallel-layers linear)"
    if spec == "auto":
        try:
            from virtualflow.parallel.convert import tensor_parallel_candidates
        except ImportError:
            return [False] * n, ("none: virtualflow.parallel.convert.tensor_parallel_candidates is not available, so "
                                 "no layer is counted as tensor-parallel (T=1 only; --tensor-parallel-layers linear or "
                                 "indices to say which)")
        flags = [bool(x) for x in tensor_parallel_candidates(layers)]
        if len(flags) != n:
            raise ValueError(f"tensor_parallel_candidates gave {len(flags)} flags for {n} layers; it must give one "
                             f"per layer (or use --tensor-parallel-layers linear or indices)")
        return flags, "virtualflow.parallel.convert.tensor_parallel_candidates (--tensor-parallel-layers auto)"
    picks = _ints(spec, "--tensor-parallel-layers")
    bad = [i for i in picks if i >= n]
    if bad:
        raise ValueError(f"--tensor-parallel-layers {spec!r} names layer {bad[0]} but the model has {n} layers "
                         f"(0..{n - 1}); give indices below {n}, auto, linear or none")
    return [i in picks for i in range(n)], "given by --tensor-parallel-layers"


def tensor_parallel_pairs(layers: list, flags: list[bool]) -> tuple[list[int], int | None]:
    """Per layer, its column/row-parallel pairs (0 for a replicated layer), and the gcd of the
    units its shards are cut in (heads, MLP features; ``None`` when unknown), from
    ``virtualflow.parallel.convert.tensor_splits``: a pair is a row-parallel weight (cut along its
    input dimension). Without that function, or for a layer it does not recognise, a flagged
    layer counts as one pair."""
    pairs = [1 if tp else 0 for tp in flags]
    try:
        from virtualflow.parallel.convert import tensor_splits
    except ImportError:
        return pairs, None
    units: list[int] = []
    for i, (layer, tp) in enumerate(zip(layers, flags)):
        if not tp:
            continue
        try:
            splits = tensor_splits(layer, 1)
        except (ValueError, TypeError):  # not a block the converter knows (e.g. --tensor-parallel-layers linear)
            continue
        rows = sum(1 for key, sp in splits.items() if key.endswith("weight") and sp.dim == 1)
        pairs[i] = max(rows, 1)
        units += [sp.units for sp in splits.values() if sp.dim is not None]
    return pairs, (math.gcd(*units) if units else None)


def detect_heads(layers: list, flags: list[bool]) -> tuple[int, str]:
    """Attention heads of the tensor-parallel layers (their gcd): ``heads``/``num_heads`` of the
    attention modules, else the gcd of the first ``nn.Linear``'s output width of each (the
    column-parallel split unit); 1 when no layer is tensor-parallel."""
    from torch import nn

    heads = [int(getattr(m, attr)) for layer, tp in zip(layers, flags) if tp for m in layer.modules()
             for attr in ("heads", "num_heads") if isinstance(getattr(m, attr, None), int)]
    if heads:
        return math.gcd(*heads), "from the attention modules of the tensor-parallel layers"
    widths = [next((m.out_features for m in layer.modules() if isinstance(m, nn.Linear)), 0)
              for layer, tp in zip(layers, flags) if tp]
    widths = [w for w in widths if w > 0]
    if widths:
        return math.gcd(*widths), "no attention heads found: the column-parallel width of the tensor-parallel layers"
    return 1, "no tensor-parallel layer"


def _tp_link(args: argparse.Namespace, link):
    from virtualflow.plan.pipeline.partition import Link

    if args.tp_bandwidth_gbps is None and args.tp_latency_us is None:
        return link
    bw = link.bandwidth_bytes_per_s if args.tp_bandwidth_gbps is None else args.tp_bandwidth_gbps * 1e9
    lat = link.latency_s if args.tp_latency_us is None else args.tp_latency_us * 1e-6
    if not (bw > 0):
        raise ValueError(f"--tp-bandwidth-gbps {args.tp_bandwidth_gbps} must be positive")
    if not (lat >= 0):
        raise ValueError(f"--tp-latency-us {args.tp_latency_us} must be >= 0")
    return Link(bandwidth_bytes_per_s=bw, latency_s=lat)


def _describe_link(link) -> str:
    return f"{link.bandwidth_bytes_per_s / 1e9:g} GB/s + {link.latency_s * 1e6:g} us"


def _plan_grid(args: argparse.Namespace, job: Any) -> int:
    """``virtualflow plan --grid``: profile the layers, then :func:`virtualflow.plan.grid.choose_grid`."""
    import torch

    from virtualflow.plan.grid import GRID_SCHEDULES, GridProblem, choose_grid
    from virtualflow.plan.pipeline.geometry import layers_of
    from virtualflow.runtime.profile import profile_model

    if args.stages is not None:
        raise ValueError(f"--stages {args.stages} fixes P while --grid chooses it; give one of them")
    if args.split is not None:
        raise ValueError(f"--split {args.split!r} applies to a fixed pipeline; --grid searches the splits (drop it)")
    if args.workers is None:
        raise ValueError("--grid needs --workers W: the workers the grid D x P x T must fill")
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be a positive integer")
    if args.heads is not None and args.heads < 1:
        raise ValueError(f"--heads {args.heads} must be a positive integer (T must divide it)")
    if job.output_loss is None:
        raise ValueError("grid planning profiles the model layer by layer and needs Job.output_loss=(outputs, "
                         "batch) -> scalar; the job gives only Job.loss")
    ks = _ints(args.microbatches_per_vn, "--microbatches-per-vn")
    schedules = (args.schedule,) if args.schedule is not None else GRID_SCHEDULES
    chunks = (2,) if args.chunks is None else ((args.chunks,) if args.chunks > 1 else ())
    link = _link(args)
    tp_link = _tp_link(args, link)
    threads = args.threads
    if threads is None and str(args.device).startswith("cpu"):
        threads = max(1, (os.cpu_count() or 1) // args.workers)
    profile = profile_model(job, repeats=args.repeats, device=args.device, threads=threads,
                            weight_grad="zb_h1" in schedules)  # first: it reports errors in the job's own code
    with torch.random.fork_rng():
        torch.manual_seed(job.seed)
        model = job.model()
        layers = layers_of(model)  # the profile keeps sizes, not modules: look at the blocks here
    sharding = fsdp_units(model, args)
    flags, tp_source = tensor_parallel_layers(args.tensor_parallel_layers, layers)
    pairs, units = tensor_parallel_pairs(layers, flags)
    if args.heads is not None:
        heads, heads_source = args.heads, "--heads"
    elif units is not None:
        heads, heads_source = units, "the gcd of the units (heads, MLP features) virtualflow.parallel.convert cuts"
    else:
        heads, heads_source = detect_heads(layers, flags)
    problem = GridProblem(
        layers=profile.layers, tensor_parallel=pairs, heads=heads, workers=args.workers,
        virtual_nodes=job.virtual_nodes,
        memory_limit_bytes=None if args.memory_limit_gib is None else args.memory_limit_gib * 2**30,
        optimizer_state_factor=profile.optimizer_state_factor, link=link, tp_link=tp_link,
        weight_grad_s=profile.weight_grad_s, vn_batch=profile.micro_batch_size, microbatches_per_vn=ks,
        schedules=schedules, chunks=chunks, reduction=args.reduction,
        unit_bytes=None if sharding is None else sharding[0], root_bytes=0.0 if sharding is None else sharding[1],
    )
    plan = choose_grid(problem)
    terms = memory_terms(problem, plan.best)
    tp_layers = [i for i, x in enumerate(flags) if x]
    if args.json:
        print(json.dumps({
            "job": args.job, "name": job.name,
            "profile": {"device": profile.device, "repeats": profile.repeats, "elapsed_s": profile.elapsed_s,
                        "micro_batch_size": profile.micro_batch_size,
                        "optimizer_state_factor": profile.optimizer_state_factor,
                        "layers": [dataclasses.asdict(layer) for layer in profile.layers]},
            "tensor_parallel_source": tp_source, "heads_source": heads_source,
            "grid": plan.as_json(top=args.top), "memory_terms": None if terms is None else terms.terms(),
        }, indent=2))
        return 0 if plan.best is not None else 1
    lines = [
        f"job {job.name!r} ({args.job}): {len(profile.layers)} layers; global batch {job.global_batch_size} = "
        f"{job.virtual_nodes} virtual nodes x {profile.micro_batch_size}; profiled on {profile.device} in "
        f"{profile.elapsed_s:.2f} s (median of {profile.repeats})",
        f"grid search: W={args.workers} workers = D x P x T; {len(plan.candidates)} layouts (each with its best split)",
        f"tensor-parallel layers: {', '.join(map(str, tp_layers)) if tp_layers else 'none'} ({tp_source}); "
        f"{sum(pairs)} column/row-parallel pairs",
        f"heads: {heads} ({heads_source}); T must divide them",
        f"links: between stages and replicas {_describe_link(link)}; inside a tensor-parallel group "
        f"{_describe_link(tp_link)}; optimizer-state factor {profile.optimizer_state_factor:.2f}; reduction "
        f"{args.reduction}",
        plan.table(args.top),
        plan.explain,
    ]
    if terms is not None:
        lines.append(f"memory per worker of the best, {terms.describe()}; units: {len(sharding[0])} + the root "
                     f"({_mib(max(sharding[0], default=0))} the largest, {_mib(sharding[1])} the root)")
    print("\n".join(lines))
    return 0 if plan.best is not None else 1


def fsdp_units(model: Any, args: argparse.Namespace) -> tuple[list[float], float] | None:
    """With ``--reduction fsdp``: the parameter bytes of each sharding unit and of the root unit,
    resolved as the workers resolve them (:mod:`virtualflow.runtime.fsdp.units`); else ``None``."""
    if args.reduction != "fsdp":
        if getattr(args, "shard_units", None) is not None:
            raise ValueError(f"--shard-units {args.shard_units!r} names reduction='fsdp''s units; add --reduction fsdp")
        return None
    from virtualflow.runtime.fsdp.units import ROOT, resolve_units, unit_params

    spec = None if args.shard_units is None else [n.strip() for n in args.shard_units.split(",") if n.strip()]
    units = unit_params(model, resolve_units(model, spec))
    size = [float(sum(p.numel() * p.element_size() for p in u.params)) for u in units]
    return ([b for u, b in zip(units, size) if u.name != ROOT],
            sum(b for u, b in zip(units, size) if u.name == ROOT))


def memory_terms(problem: Any, best: Any) -> Any:
    """The best candidate's memory per worker, term by term, with ``--reduction fsdp``
    (:func:`virtualflow.plan.grid.fsdp_bytes`; its activations are the rest of the candidate's
    peak); ``None`` otherwise or without a best."""
    from virtualflow.plan.grid import fsdp_bytes

    if problem.reduction != "fsdp" or best is None:
        return None
    return fsdp_bytes(problem, best.data, activations=best.memory_bytes - fsdp_bytes(problem, best.data).total)
