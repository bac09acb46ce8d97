"""``virtualflow run FILE.py[:FUNCTION]``: train a job on the local backend or on Ray."""

from __future__ import annotations

import argparse
import os
import sys
import time

import virtualflow as vf
from virtualflow.api import TrainingError
from virtualflow.backends.ray import RayNotInstalled, parse_resources
from virtualflow.spec import parse_slowdowns


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train a job",
        description="Train the job returned by FUNCTION (default make_job) in FILE.py or a module. "
        "Flags override the job's fields.",
    )
    p.add_argument("job", help="FILE.py[:FUNCTION] or package.module[:FUNCTION]; FUNCTION defaults to make_job")
    p.add_argument("--workers", type=int, default=None,
                   help="number of local worker processes (default 1; with --autoscale, --min-workers)")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="optimizer steps to run")
    length.add_argument("--epochs", type=int, help="epochs to run (len(dataset) // B steps each)")
    p.add_argument("--global-batch-size", type=int, help="override Job.global_batch_size (B)")
    p.add_argument("--virtual-nodes", type=int, help="override Job.virtual_nodes (V)")
    p.add_argument("--seed", type=int, help="override Job.seed")
    p.add_argument("--deterministic", action="store_true", help="bit-identical weights for any worker count")
    p.add_argument("--threads-per-worker", type=int, help="torch threads per worker (default: cores / workers; 1 if deterministic)")
    p.add_argument("--run-dir", help="where metrics.jsonl, events.jsonl, summary.json and final.pt go "
                   "(default runs/<file>-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    rb = p.add_argument_group("backend")
    rb.add_argument("--backend", choices=("local", "ray", "external"), default="local",
                    help="local: worker processes on this machine (default); ray: one Ray actor per worker, "
                    "on any node of a Ray cluster (pip install virtualflow[ray]); external: wait for workers "
                    "started elsewhere with `virtualflow worker --join ADDR:PORT --token-file FILE`")
    rb.add_argument("--listen", metavar="ADDR:PORT",
                    help="external backend: the address workers join (e.g. 10.0.0.5:29400; 0.0.0.0 for every interface)")
    rb.add_argument("--token-file", metavar="FILE",
                    help="the job's secret token: joins and control requests must be signed with it (default: a new "
                    "random token written to RUN_DIR/token, mode 0600)")
    rb.add_argument("--address", metavar="auto|HOST:PORT",
                    help="Ray cluster to use (default: RAY_ADDRESS, else a new local Ray instance)")
    rb.add_argument("--cpus-per-worker", type=float, metavar="C",
                    help="Ray CPUs per worker actor, fractions allowed (default 1; also the thread budget)")
    rb.add_argument("--gpus-per-worker", type=float, metavar="G", help="Ray GPUs per worker actor (default 0)")
    rb.add_argument("--resources", metavar="JSON|NAME=AMOUNT,...",
                    help="custom Ray resources per worker, e.g. accel_a100=1 or '{\"accel_a100\": 1}'")
    rb.add_argument("--placement-timeout", type=float, metavar="SECONDS",
                    help="give up on a worker actor Ray has not placed after this long (default 60)")
    el = p.add_argument_group("elasticity and fault tolerance")
    el.add_argument("--min-workers", type=int, default=1,
                    help="below this many workers the job holds (checkpointed) and waits; also the autoscaler's "
                    "lower bound (default 1)")
    el.add_argument("--min-workers-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long to wait for workers below --min-workers before failing (default 60)")
    el.add_argument("--replace-failed", action="store_true",
                    help="start a replacement worker for every worker lost, as a cluster manager would")
    el.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="SECONDS",
                    help="a worker silent this long is declared hung, killed and removed (default 3)")
    el.add_argument("--checkpoint-every", type=int, metavar="N",
                    help="write checkpoints/step-N.pt every N steps (the last two are kept)")
    el.add_argument("--slowdowns", metavar="F1,F2,...",
                    help="emulate unequal workers: one slowdown factor per worker (1 = full speed), e.g. 1,1,3,3; "
                    "turns on speed-based VN mapping")
    el.add_argument("--balance", action="store_true",
                    help="map VNs by measured worker speed and rebalance as speeds drift (on with --slowdowns)")
    el.add_argument("--uneven-vn-sizes", action="store_true",
                    help="let VN sizes differ per worker (faster workers get bigger VNs); implies --balance")
    el.add_argument("--resume", metavar="RUN_DIR_OR_FILE",
                    help="continue from the newest good checkpoint of a run (e.g. one whose coordinator died)")
    au = p.add_argument_group("autoscaling")
    au.add_argument("--autoscale", metavar="POLICY",
                    help="grow and shrink the job while it trains to find the most resource-efficient worker count: "
                    "efficiency (add workers while the scaling efficiency of the last addition > threshold), "
                    "utility (while the utility gain exceeds the added cost), straggler (replace slow workers), "
                    "fixed; parameters as NAME:PARAM=VALUE,..., e.g. efficiency:threshold=0.2,step_size=2 or "
                    "utility:value=deadline:30m:100")
    au.add_argument("--max-workers", type=int, metavar="N", help="the autoscaler's upper bound (needed with --autoscale)")
    au.add_argument("--price-per-worker-hour", type=float, default=1.0, metavar="PRICE",
                    help="what a worker costs per hour, for the cost the autoscaler weighs (default 1)")
    p.set_defaults(func=main)


def default_run_dir(job_spec: str) -> str:
    stem = os.path.splitext(os.path.basename(job_spec.partition(":")[0]))[0] or "job"
    return os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or (args.resume if args.resume and os.path.isdir(args.resume) else default_run_dir(args.job))
    try:
        result = vf.train(
            args.job,
            workers=args.workers,
            steps=args.steps,
            epochs=args.epochs,
            global_batch_size=args.global_batch_size,
            virtual_nodes=args.virtual_nodes,
            seed=args.seed,
            deterministic=args.deterministic,
            threads_per_worker=args.threads_per_worker,
            run_dir=run_dir,
            progress=not args.no_progress,
            min_workers=args.min_workers,
            min_workers_timeout_s=args.min_workers_timeout,
            replace_failed=args.replace_failed,
            heartbeat_timeout_s=args.heartbeat_timeout,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            slowdowns=parse_slowdowns(args.slowdowns, args.workers or 1) if args.slowdowns else None,
            balance=True if (args.balance or args.slowdowns or args.uneven_vn_sizes) else None,
            uneven_vn_sizes=args.uneven_vn_sizes,
            autoscale=args.autoscale,
            max_workers=args.max_workers,
            price_per_worker_hour=args.price_per_worker_hour,
            backend=args.backend,
            address=args.address,
            cpus_per_worker=args.cpus_per_worker,
            gpus_per_worker=args.gpus_per_worker,
            resources=parse_resources(args.resources) if args.resources is not None else None,
            placement_timeout_s=args.placement_timeout,
            listen=args.listen,
            token_file=args.token_file,
        )
    except TrainingError as exc:
        print(f"virtualflow run: training failed: {exc}", file=sys.stderr)
        return 1
    except RayNotInstalled as exc:
        print(f"virtualflow run: error: {exc}", file=sys.stderr)
        return 2
    last = result.history[-1] if result.history else {}
    line = f"done: {result.steps} steps, final loss {last.get('loss', float('nan')):.4f}"
    if result.metrics:
        line += ", " + ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    if result.generations > 1:
        line += f"; {result.generations} generations, {len(result.failures)} worker failure(s) survived"
    print(line)
    if result.autoscale is not None:
        a = result.autoscale
        tried = ", ".join(f"{k}: {v['throughput']:.1f}" for k, v in a["sizes"].items() if v["throughput"])
        where = f"settled at {a['settled_at']} workers" if a["settled_at"] else "did not settle"
        print(f"autoscale ({a['policy']}): {where} after {a['resizes']} resize(s); samples/s per worker count: {tried}")
    print(f"run directory: {run_dir} (final.pt, metrics.jsonl, events.jsonl, summary.json)")
    return 0
