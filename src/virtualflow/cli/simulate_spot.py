"""``virtualflow simulate-spot``: replay a spot-availability trace for a pipelined job and compare
Bamboo-style redundancy, checkpoint-restart and on-demand by value (samples per dollar).

Example::

    virtualflow simulate-spot --trace p2-xlarge-2020-11-20-hours --stages 4 -o runs/spot-p2
    virtualflow simulate-spot --generate rate=2,nodes=16,hours=24,seed=0 --stages 4 --json

Prints one table (or ``--json``) and writes ``summary.json``, ``timeline.jsonl`` and ``spot.png``
to ``-o DIR`` when given. The rules are in ``virtualflow.cluster.spot``'s docstring and
docs/bamboo.md. Bad input raises ``ValueError`` (the CLI prints one line, exit status 2).

The simulator (:mod:`virtualflow.cluster.spot`) is pure; this module owns the file system around
it: finding the source tree's measured constants (:func:`find_bench_constants`), writing the
outputs (:func:`write_outputs`) and drawing the plot (:func:`plot_spot`, a
``matplotlib.figure.Figure``: no pyplot, no backend change).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from virtualflow.cluster.spot import SpotResult, SpotTrace

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from virtualflow.cluster.spot import ON_DEMAND_PRICE, SPOT_PRICE, STRATEGIES

    p = sub.add_parser(
        "simulate-spot",
        help="replay a spot-availability trace: Bamboo redundancy vs checkpoint-restart vs on-demand",
        description="Replay a trace of how many spot instances are up over time for a pipelined job and "
        "report throughput, cost and value (samples per dollar) per strategy.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="CSV of time,count rows, or the name of a trace bundled with virtualflow "
                     "(e.g. p2-xlarge-2020-11-20-hours; an unknown name lists them)")
    src.add_argument("--generate", metavar="SPEC",
                     help="draw a trace: rate=PREEMPTIONS_PER_HOUR,nodes=N,hours=H[,seed=S][,mean_down_s=300]")
    p.add_argument("--time-unit", choices=("s", "h"),
                   help="time unit of --trace's file (default: h when its name ends in -hours, else s)")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages P (>= 2)")
    p.add_argument("--pipelines", type=int,
                   help="data-parallel pipelines D the job wants (default: the trace's max count // P)")
    p.add_argument("--constants", metavar="FILE",
                   help="JSON of the engine's measured constants (default: bench/results/bamboo_constants.json, "
                   "else bench/results/bamboo.json, of the source tree when it has a 'constants' object, else "
                   "documented defaults)")
    p.add_argument("--spot-price", type=float, default=SPOT_PRICE,
                   help=f"$ per spot instance-hour (default {SPOT_PRICE}, Bamboo's figure)")
    p.add_argument("--on-demand-price", type=float, default=ON_DEMAND_PRICE,
                   help=f"$ per on-demand instance-hour (default {ON_DEMAND_PRICE}, Bamboo's figure)")
    p.add_argument("--checkpoint-every-s", type=float,
                   help="running seconds between checkpoints (default: Young's interval per strategy)")
    p.add_argument("--sync", choices=("slowest", "proportional"), default="slowest",
                   help="data-parallel pipelines: a step waits for the slowest (default), or micro-batches "
                   "split in proportion to pipeline speed")
    p.add_argument("--seed", type=int, default=0, help="which instances a preemption takes (default 0)")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="replay the trace this many times faster (times divided; constants unchanged)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (default: all)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of the table")
    p.add_argument("-o", "--out-dir", help="write summary.json, timeline.jsonl and spot.png here")
    p.set_defaults(func=main)


def load_constants(path: str | None):
    """``--constants FILE``, else the source tree's bench results, else the defaults."""
    from virtualflow.cluster.spot import SpotConstants

    if path is not None:
        return SpotConstants.from_json(path)
    found = find_bench_constants()
    if found is not None:
        return SpotConstants.from_json(found)
    return SpotConstants()


def parse_strategies(spec: str) -> list[str]:
    from virtualflow.cluster.spot import STRATEGIES

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--strategies {spec!r} names no strategy; choose from {', '.join(STRATEGIES)}")
    for n in names:
        if n not in STRATEGIES:
            raise ValueError(f"--strategies: unknown strategy {n!r}; choose from {', '.join(STRATEGIES)}")
    return names


def format_table(s: dict) -> str:
    cols = [("strategy", "{}"), ("samples", "{:.4g}"), ("hours", "{:.2f}"), ("cost $", "{:.2f}"),
            ("samples/s", "{:.2f}"), ("samples/$", "{:.1f}"), ("value vs on-demand", "{:.2f}x"),
            ("lost steps", "{:.0f}"), ("failovers", "{}"), ("fallback restarts", "{}"), ("reconfigurations", "{}")]
    keys = ["strategy", "samples", "hours", "cost_usd", "samples_per_s", "samples_per_usd", "value_vs_on_demand",
            "lost_steps", "failovers", "restarts", "reconfigurations"]
    rows = []
    for r in s["strategies"].values():
        row = []
        for (_, fmt), k in zip(cols, keys):
            v = r.get(k)
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((h, _), w) in enumerate(zip(cols, widths)))]
    for r in rows:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from virtualflow.cluster.spot import SpotJob, compare, generate_trace, load_trace, parse_generate_spec, summary

    strategies = parse_strategies(args.strategies)
    trace = (load_trace(args.trace, time_unit=args.time_unit) if args.trace
             else generate_trace(**parse_generate_spec(args.generate)))
    if args.speedup != 1.0:
        trace = trace.compressed(args.speedup)
    constants = load_constants(args.constants)
    job = SpotJob(stages=args.stages, pipelines=args.pipelines, spot_price=args.spot_price,
                  on_demand_price=args.on_demand_price, checkpoint_every_s=args.checkpoint_every_s,
                  seed=args.seed, sync=args.sync)
    results = compare(trace, constants, job, strategies)
    s = summary(trace, constants, job, results)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        j = s["job"]
        print(f"trace {trace.name}: {trace.span_s / 3600:.2f} h, max {trace.max_count} instances, "
              f"{trace.instances_lost} preempted; job: {j['stages']} stages x {j['pipelines']} pipeline(s), "
              f"spot ${j['spot_price']}/h, on-demand ${j['on_demand_price']}/h, sync {j['sync']}, seed {j['seed']}")
        print(format_table(s))
        if "bamboo_vs_checkpoint" in s:
            print(f"bamboo vs checkpoint-restart (samples/$): {s['bamboo_vs_checkpoint']:.2f}x")
        every = ", ".join(f"{k} {r['checkpoint_every_s']:.0f} s" for k, r in s["strategies"].items()
                          if r.get("checkpoint_every_s") is not None)
        if every:
            print(f"checkpoint every: {every} ({j['checkpoint_every_from']})")
        defaulted = constants.defaulted
        note = ("all of them defaults, NOT measurements" if len(defaulted) == len(constants.numeric_fields())
                else f"defaults, not measured: {', '.join(defaulted)}" if defaulted else "all measured")
        print(f"constants from {constants.source} ({note}): "
              + ", ".join(f"{k}={getattr(constants, k):g}" for k in constants.numeric_fields()))
    if args.out_dir:
        paths = write_outputs(args.out_dir, trace, s, results)
        print(f"wrote {', '.join(sorted(paths.values()))}", file=sys.stderr if args.json else sys.stdout)
    return 0


BENCH_CONSTANTS = ("bamboo_constants.json", "bamboo.json")
"""Files under ``bench/results`` holding the engine's measured constants, most complete first
(``bench/bamboo_failover/`` merges ``bench/bamboo/``'s with its failover measurements)."""


def find_bench_constants() -> Path | None:
    """The first of :data:`BENCH_CONSTANTS` in the source tree this package runs from that has a
    ``constants`` object; None otherwise (an installed package has no bench/)."""
    root = Path(__file__).resolve().parents[3]  # src/virtualflow/cli/ -> the checkout
    if not (root / "pyproject.toml").is_file():
        return None
    for name in BENCH_CONSTANTS:
        path = root / "bench" / "results" / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path} is not valid JSON; fix it or give --constants FILE") from None
        if isinstance(data, Mapping) and isinstance(data.get("constants"), Mapping):
            return path
    return None


def plot_spot(trace: SpotTrace, results: Mapping[str, SpotResult], path: str, title: str | None = None,
              bins: int = 300) -> str:
    """Instances, throughput per strategy and cumulative cost per strategy over time (hours), one
    panel each. Throughput is the samples produced per bin of span / ``bins`` (checkpoint pauses
    every few minutes would make a raw step plot a solid band); restarts are marked below it.
    Uses ``matplotlib.figure.Figure`` (no pyplot, no backend change)."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 7.5), layout="tight")
    ax_n, ax_r, ax_c = fig.subplots(3, 1, sharex=True)
    t0 = trace.start_s
    xs = [(t - t0) / 3600.0 for t in trace.times_s] + [trace.span_s / 3600.0]
    ax_n.step(xs, list(trace.counts) + [trace.counts[-1]], where="post", color="0.3")
    ax_n.set_ylabel("instances up")
    ax_n.set_title(title or trace.name)
    edges = np.linspace(trace.start_s, trace.end_s, bins + 1)
    width = edges[1] - edges[0]
    for name, res in results.items():
        ends = np.array([res.timeline[0].start_s] + [iv.end_s for iv in res.timeline]) if res.timeline else edges[:1]
        produced = np.concatenate([[0.0], np.cumsum([iv.samples for iv in res.timeline])])
        spent = np.concatenate([[0.0], np.cumsum([iv.cost_usd for iv in res.timeline])])
        rate = np.diff(np.interp(edges, ends, produced)) / width
        mid = (edges[:-1] + edges[1:] - 2 * t0) / 2 / 3600.0
        (line,) = ax_r.plot(mid, rate, lw=0.9, label=name)
        ax_c.plot((ends - t0) / 3600.0, spent, label=name, color=line.get_color(),
                  ls="--" if name == "checkpoint" else "-")
        marks = [(e.t_s - t0) / 3600.0 for e in res.events if e.kind in ("fallback_restart", "restart")]
        if marks:
            ax_r.plot(marks, [0.0] * len(marks), "|", ms=8, color=line.get_color())
    ax_r.set_ylabel(f"samples/s (mean per {width / 60:.3g} min)")
    ax_r.set_ylim(bottom=0)
    ax_r.legend(fontsize=7, loc="lower right", framealpha=0.6, title="| = restart", title_fontsize=7)
    ax_c.set_ylabel("cumulative cost ($)")
    ax_c.set_xlabel("hours")
    ax_c.legend(fontsize=7, loc="upper left", framealpha=0.6)
    fig.savefig(path, dpi=120)
    return path


def write_outputs(out_dir: str, trace: SpotTrace, summary_dict: Mapping[str, Any],
                  results: Mapping[str, SpotResult]) -> dict[str, str]:
    """``summary.json``, ``timeline.jsonl`` (one interval or event per line, with its strategy)
    and ``spot.png`` (if matplotlib is installed) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"summary": os.path.join(out_dir, "summary.json"), "timeline": os.path.join(out_dir, "timeline.jsonl")}
    with open(paths["summary"], "w") as f:
        json.dump(summary_dict, f, indent=2)
        f.write("\n")
    with open(paths["timeline"], "w") as f:
        for name, res in results.items():
            for iv in res.timeline:
                f.write(json.dumps({"type": "interval", "strategy": name, **asdict(iv)}) + "\n")
            for ev in res.events:
                f.write(json.dumps({"type": "event", "strategy": name, **asdict(ev)}) + "\n")
    try:
        paths["plot"] = plot_spot(trace, results, os.path.join(out_dir, "spot.png"))
    except ImportError:
        pass
    return paths
