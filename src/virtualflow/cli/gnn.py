"""``virtualflow gnn``: train a GNN job Dorylus-style (graph servers + stateless tensor workers,
bounded staleness) and report time per epoch, accuracy, cost and value, optionally beside the
CPU-only (graph servers do the tensor work, same total workers) and single-process PyTorch
Geometric baselines.

Example::

    virtualflow gnn examples/gnn_sbm.py --graph-servers 2 --tensor-workers 2 --staleness 0 --baselines cpu,pyg

``JOB`` is ``file.py[:function]`` or ``module:function`` returning a ``virtualflow.gnn.GNNJob``
(default function ``make_job``). Bad input raises ``ValueError`` (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys

log = logging.getLogger(__name__)

BASELINES = ("cpu", "pyg")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gnn", help="train a GNN Dorylus-style: graph servers, tensor workers, bounded staleness; cost and value",
        description="Train a GNN job on P graph servers (edge-cut partitions) and L stateless tensor workers "
        "with staleness bound S, and report time per epoch, accuracy, cost and value (docs/gnn.md).")
    p.add_argument("job", help="file.py[:function] or module:function returning a virtualflow.gnn.GNNJob")
    p.add_argument("--graph-servers", "-P", type=int, default=1, help="graph-server processes (default 1)")
    p.add_argument("--tensor-workers", "-L", type=int, default=2,
                   help="stateless tensor workers (default 2; 0 = CPU-only)")
    p.add_argument("--staleness", "-S", type=int, default=0,
                   help="epochs an interval may run ahead of the slowest (default 0: synchronous)")
    p.add_argument("--intervals", "-K", type=int, default=2, help="vertex intervals per graph server (default 2)")
    p.add_argument("--epochs", type=int, help="override the job's epochs")
    p.add_argument("--mode", choices=("process", "simulated"), default="process",
                   help="real processes (default) or the same logic in this process on a virtual clock")
    p.add_argument("--worker-backend", choices=("process", "ray"), default="process",
                   help="tensor workers as local processes (default) or Ray tasks")
    p.add_argument("--ray-address", help="Ray cluster for --worker-backend ray ('auto', HOST:PORT; default: a local one)")
    p.add_argument("--update", choices=("round", "interval"), default="round",
                   help="round: a step once every interval has a new gradient (S=0: full-graph; default); "
                   "interval: a step per interval-epoch (Dorylus)")
    p.add_argument("--no-pipeline", action="store_true", help="run the intervals' steps in lockstep (S=0 only)")
    p.add_argument("--order", choices=("rcm", "natural"), default="rcm", help="partition order (default rcm)")
    p.add_argument("--baselines", default="",
                   help="comma-separated: cpu (CPU-only: P+L graph servers doing the tensor work, the same total "
                   "intervals), pyg "
                   "(single-process PyTorch Geometric)")
    g = p.add_argument_group("emulated cheap-worker limits (tensor workers)")
    g.add_argument("--latency-s", type=float, default=0.0, help="invocation latency per task (default 0)")
    g.add_argument("--bandwidth-bytes-per-s", type=float, default=0.0,
                   help="transfer rate for a task's tensors (default 0 = unlimited)")
    g.add_argument("--cold-start-s", type=float, default=0.0, help="added to a new worker's first task (default 0)")
    g.add_argument("--timeout-prob", type=float, default=0.0, help="chance a task attempt hangs (default 0)")
    g.add_argument("--task-timeout-s", type=float, default=60.0,
                   help="kill and relaunch a worker after this long on one task (default 60)")
    from virtualflow.gnn.price import PriceModel

    d = PriceModel()
    q = p.add_argument_group("price model (docs/gnn.md)")
    q.add_argument("--server-usd-per-hour", type=float, default=d.server_usd_per_hour,
                   help=f"$ per server hour (default {d.server_usd_per_hour})")
    q.add_argument("--usd-per-gb-s", type=float, default=d.usd_per_gb_s,
                   help=f"$ per tensor-worker GB-second (default {d.usd_per_gb_s})")
    q.add_argument("--worker-gb", type=float, default=d.worker_gb, help=f"tensor-worker memory, GB (default {d.worker_gb})")
    q.add_argument("--usd-per-request", type=float, default=d.usd_per_request,
                   help=f"$ per tensor-worker invocation (default {d.usd_per_request})")
    p.add_argument("--target", type=float, help="report the time until an epoch's validation accuracy >= this")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    p.set_defaults(func=main)


def parse_baselines(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n not in BASELINES:
            raise ValueError(f"--baselines: unknown baseline {n!r}; choose from {', '.join(BASELINES)}")
    return names


def load_job(spec: str):
    from virtualflow.gnn.job import GNNJob
    from virtualflow.config.job import resolve_spec

    job = resolve_spec(spec)()
    if not isinstance(job, GNNJob):
        raise TypeError(f"{spec!r} returned {type(job).__name__}, not virtualflow.gnn.GNNJob")
    return job


def main(args: argparse.Namespace) -> int:
    from virtualflow.backends.gnn import train_dorylus  # builds the executor the options ask for
    from virtualflow.gnn import DorylusOptions, PriceModel, WorkerLimits, train_pyg
    from virtualflow.gnn.report import add_ratios, format_table, summarize

    baselines = parse_baselines(args.baselines)
    price = PriceModel(server_usd_per_hour=args.server_usd_per_hour, usd_per_gb_s=args.usd_per_gb_s,
                       worker_gb=args.worker_gb, usd_per_request=args.usd_per_request)
    limits = WorkerLimits(latency_s=args.latency_s, bandwidth_bytes_per_s=args.bandwidth_bytes_per_s,
                          cold_start_s=args.cold_start_s, timeout_prob=args.timeout_prob,
                          task_timeout_s=args.task_timeout_s)
    opts = DorylusOptions(graph_servers=args.graph_servers, tensor_workers=args.tensor_workers,
                          intervals=args.intervals, staleness=args.staleness, pipeline=not args.no_pipeline,
                          mode=args.mode, order=args.order, limits=limits, worker_backend=args.worker_backend,
                          ray_address=args.ray_address, update=args.update)
    job = load_job(args.job)
    if args.epochs is not None:
        job = dataclasses.replace(job, epochs=args.epochs)
    n = job.graph.x.size(0)
    # With --json stdout is the JSON document alone: the description goes to stderr.
    print(f"graph: {n} vertices, {job.graph.edge_index.size(1)} edges; {opts.graph_servers} graph servers x "
          f"{opts.intervals} intervals, {opts.tensor_workers} tensor workers, staleness {opts.staleness}, "
          f"{job.epochs} epochs, mode {opts.mode}", flush=True, file=sys.stderr if args.json else sys.stdout)
    name = f"dorylus S={opts.staleness}" if opts.tensor_workers else "cpu-only"
    records = [summarize(name, train_dorylus(job, opts), price, n, args.target)]
    if "cpu" in baselines and opts.tensor_workers:
        servers = opts.graph_servers + opts.tensor_workers  # same total workers, same total intervals
        cpu = dataclasses.replace(opts, graph_servers=servers, tensor_workers=0, staleness=0, pipeline=True,
                                  intervals=max(1, opts.graph_servers * opts.intervals // servers))
        records.append(summarize("cpu-only", train_dorylus(job, cpu), price, n, args.target))
    if "pyg" in baselines:
        records.append(summarize("pyg", train_pyg(job, threads=1), price, n, args.target))
    add_ratios(records)
    diverged = [r["run"] for r in records if r.get("diverged")]
    if args.json:
        print(json.dumps(json_safe(records), indent=2, allow_nan=False))
    else:
        print(format_table(records))
        print(f"price model: servers ${price.server_usd_per_hour}/h for the whole run; tensor workers "
              f"${price.usd_per_gb_s}/GB-s x {price.worker_gb} GB of task time + ${price.usd_per_request}/request; "
              f"value = 1/(epoch-run seconds x $)")
    if diverged:
        print(f"error: {', '.join(diverged)}: the loss became non-finite (NaN or inf); no value is reported for "
              f"{'it' if len(diverged) == 1 else 'them'} (lower the learning rate, or check the features)",
              file=sys.stderr)
        return 1
    return 0


def json_safe(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN or Infinity) and
    other non-JSON scalars (numpy, tensors) turned into floats."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    x = float(value)
    return x if math.isfinite(x) else None
