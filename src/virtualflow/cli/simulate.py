"""``virtualflow simulate``: replay a trace (or a generated workload) through a scheduling policy.

Example::

    virtualflow simulate --cluster v100=12,p100=12,k80=12 --generate rate=2.0,jobs=800,seed=0 \\
        --policy las --window 300:700 -o runs/sim-las

With ``--model service`` the trace is played through the cluster service's own scheduler
(``virtualflow cluster start``: learned estimates, pins, start pauses; see
:mod:`virtualflow.service.model`), e.g. a finished cluster's run exported by ``virtualflow
cluster replay --export DIR``::

    virtualflow simulate --model service --cluster v100=2,k80=2 --slowdowns k80=2 \
        --trace DIR/trace.json --throughputs DIR/throughputs.json --costs DIR/costs.json \
        --policy elastic_fair --round-s 6

Prints one line of metrics and writes ``summary.json``, ``jobs.jsonl`` and ``jct_cdf.png`` to
``-o DIR`` when given. Bad input raises ``ValueError`` (the CLI prints one line, exit status 2).
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a cluster scheduling policy on a job trace",
        description="Run a Gavel-style scheduling policy and the round-based mechanism on a trace of jobs "
        "(Gavel TSV, or generated) over a heterogeneous cluster, on simulated time.",
    )
    p.add_argument("--cluster", default="v100=12,p100=12,k80=12",
                   help="GPU counts per accelerator type (default v100=12,p100=12,k80=12)")
    p.add_argument("--gpus-per-server", type=int, default=4, help="GPUs per server, every type (default 4)")
    p.add_argument("--prices", help="$ per GPU-hour per type, e.g. v100=2.48,p100=1.46,k80=0.45 (cost metric)")
    p.add_argument("--throughputs", help="throughput table: Gavel JSON or virtualflow JSON "
                   "(default: Gavel's simulation_throughputs.json, bundled with virtualflow)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Gavel .trace file (TSV), virtualflow's JSON trace (*.json: elastic ranges, "
                     "any job type of the table), or the name of a Gavel trace bundled with virtualflow "
                     "(e.g. small_test, max_min_fairness; an unknown name lists them)")
    src.add_argument("--generate", metavar="SPEC",
                     help="generate jobs: rate=JOBS_PER_HOUR,jobs=N,seed=S[,elastic=FRACTION][,priorities=1/5/10]"
                     "[,steps_reference=one|scale]")
    p.add_argument("--policy", default="las", help="scheduling policy (default las); see docs/cluster.md")
    p.add_argument("--window", help="measurement window of job ids LO:HI (default: every job)")
    p.add_argument("--round-s", type=float, default=360.0, help="round length in seconds (default 360)")
    p.add_argument("--restart-cost-s", type=float, default=45.0,
                   help="seconds lost per checkpoint-restart (preemption, move) (default 45)")
    p.add_argument("--resize-cost-s", type=float, default=1.5,
                   help="seconds lost per in-place resize of an elastic job (default 1.5)")
    p.add_argument("--mechanism", choices=("default", "virtualflow", "gavel", "lease_first"), default="default",
                   help="round mechanics: default (per-type queues in the cluster's type order, equal priors, "
                        "carried deficits, consolidated placement only; 'virtualflow' is the same), gavel (the same "
                        "plus spread placement when no consolidated one exists) or lease_first (one global queue, "
                        "lease holders first after an allocation change: the default before issue 17); the names "
                        "of virtualflow cluster start --mechanism (default: default)")
    p.add_argument("--elastic-resize", choices=("in_place", "restart"), default="in_place",
                   help="how elastic jobs change GPU count (default in_place)")
    p.add_argument("--reallocate-on-events", action="store_true",
                   help="end a round at each job arrival or completion and re-plan at once: elastic jobs shrink "
                        "when a job arrives and grow back when one completes (default: at round boundaries)")
    p.add_argument("--recompute", choices=("on_change", "every_round"), default="on_change",
                   help="when the policy is re-solved (default on_change: arrivals and completions)")
    p.add_argument("--model", choices=("rounds", "service"), default="rounds",
                   help="rounds (default): the policies on Gavel's idealised rounds (a change costs "
                        "--restart-cost-s / --resize-cost-s of the round it happens in); service: the cluster "
                        "service's own scheduler (virtualflow cluster start) in virtual time: estimates learned "
                        "from a prior, jobs pinned until their first step, start and resume pauses (--costs), one "
                        "server per type")
    p.add_argument("--costs", metavar="JSON",
                   help="--model service: the machine's pauses and latencies (seconds; keys of "
                        "virtualflow.service.replay.ReplayCosts, e.g. costs.json of virtualflow cluster replay "
                        "--export; missing keys keep their defaults). Without it: start and resume pauses of "
                        "--restart-cost-s, resizes of --resize-cost-s, no other latency")
    p.add_argument("--slowdowns", metavar="TYPE=F,...",
                   help="--model service: the service's slowdown factors per type, as cluster start --slowdowns "
                        "(default: from the throughput table, per job type)")
    p.add_argument("--min-run-s", type=float, default=0.0, metavar="SECONDS",
                   help="--model service: as cluster start --min-run-s (default 0)")
    p.add_argument("--max-hours", type=float, help="stop after this many simulated hours")
    p.add_argument("-o", "--out-dir", help="write summary.json, jobs.jsonl, jct_cdf.png here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric options bounded by what they mean (one line naming the flag and the rule): a
    round of a second to a day, costs of at most a day, at most ten years of simulated time."""
    from virtualflow.cluster import bounds

    bounds.number(args.round_s, where="simulate", field="--round-s", lo=1, hi=bounds.MAX_PAUSE_S,
                  meaning="seconds per scheduling round")
    for flag, v in (("--restart-cost-s", args.restart_cost_s), ("--resize-cost-s", args.resize_cost_s),
                    ("--min-run-s", args.min_run_s)):
        bounds.number(v, where="simulate", field=flag, lo=0, hi=bounds.MAX_PAUSE_S, meaning="seconds, a day at most")
    if args.max_hours is not None:
        bounds.number(args.max_hours, where="simulate", field="--max-hours", lo=0, lo_open=True,
                      hi=bounds.MAX_SIM_S / 3600, meaning="simulated hours, ten years at most")
    bounds.number(args.gpus_per_server, where="simulate", field="--gpus-per-server", lo=1,
                  hi=bounds.MAX_GPUS_PER_JOB, integral=True, meaning="GPUs per server")


def parse_window(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    lo, sep, hi = spec.partition(":")
    try:
        w = (int(lo), int(hi))
    except ValueError:
        raise ValueError(f"--window {spec!r} must be LO:HI job ids, e.g. 300:700") from None
    if not sep or not 0 <= w[0] < w[1]:
        raise ValueError(f"--window {spec!r} must be LO:HI with 0 <= LO < HI, e.g. 300:700")
    return w


def parse_prices(spec: str | None) -> dict[str, float] | None:
    if not spec:
        return None
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, val = part.partition("=")
        try:
            out[name.strip()] = float(val)
        except ValueError:
            raise ValueError(f"--prices item {part!r} must be TYPE=DOLLARS_PER_GPU_HOUR, e.g. v100=2.48") from None
        if not sep:
            raise ValueError(f"--prices item {part!r} must be TYPE=DOLLARS_PER_GPU_HOUR")
    return out


def gavel_data_from_env():
    """Gavel's data folder: ``$VIRTUALFLOW_GAVEL_DATA`` when set, else the copy bundled with
    virtualflow (:func:`virtualflow.cluster.gavel_data_dir`, which reads no environment)."""
    from virtualflow.cluster.gavel_data import GAVEL_DATA_ENV, gavel_data_dir

    return gavel_data_dir(os.environ.get(GAVEL_DATA_ENV), knob=f"${GAVEL_DATA_ENV}")


def load_table(path: str | None):
    """A throughput table from Gavel's JSON or virtualflow's JSON (default: Gavel's, bundled)."""
    from virtualflow.cluster import ThroughputTable

    if path is None:
        try:
            path = os.path.join(gavel_data_from_env(), "simulation_throughputs.json")
        except FileNotFoundError as exc:  # a user error: one line, exit status 2 (not a traceback)
            raise ValueError(f"no --throughputs given and {exc}") from None
    if not os.path.isfile(path):
        raise ValueError(f"--throughputs {path!r} does not exist; give a JSON throughput table or leave it out "
                         "to use Gavel's, bundled with virtualflow")
    return ThroughputTable.from_file(path)


def trace_path(spec: str) -> str:
    """``--trace``: a file, else the name of a Gavel trace bundled with virtualflow."""
    from virtualflow.cluster import gavel_trace_names, gavel_trace_path

    if os.path.isfile(spec):
        return spec
    if os.sep not in spec and "/" not in spec:
        folder = gavel_data_from_env()
        names = gavel_trace_names(folder)
        if spec in names or f"{spec}.trace" in names:
            return str(gavel_trace_path(spec, folder))
    raise ValueError(f"--trace {spec!r} does not exist; give a Gavel .trace file, the name of a bundled one "
                     f"({', '.join(gavel_trace_names(gavel_data_from_env()))}), or use --generate")


def main(args: argparse.Namespace) -> int:
    from virtualflow.cluster import Cluster, get_policy
    from virtualflow.cluster.mechanism import MechanismConfig
    from virtualflow.cluster.metrics import summarize, write_summary
    from virtualflow.cluster.simulator import SimConfig, simulate
    from virtualflow.cluster.traces import generate_jobs, parse_generate_spec, read_gavel_trace, read_json_trace

    check_numbers(args)
    if args.model != "service":
        given = [f for f, v in (("--costs", args.costs), ("--slowdowns", args.slowdowns),
                                ("--min-run-s", args.min_run_s)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --model service only (the service's knobs); add "
                             f"--model service or leave them out")
    cluster = Cluster.parse(args.cluster, gpus_per_server=args.gpus_per_server, prices=parse_prices(args.prices))
    table = load_table(args.throughputs)
    if args.trace:
        source = trace_path(args.trace)
        jobs = (read_json_trace if source.endswith(".json") else read_gavel_trace)(source, table)
    else:
        cfg = parse_generate_spec(args.generate)
        jobs = generate_jobs(table, cfg)
        source = f"generated {cfg.num_jobs} jobs at {cfg.rate_per_hour} jobs/h, seed {cfg.seed}"
    policy = get_policy(args.policy)
    sim_cfg = SimConfig(
        mechanism={"gavel": MechanismConfig.gavel, "lease_first": MechanismConfig.lease_first}.get(
            args.mechanism, MechanismConfig)(
            round_s=args.round_s, restart_cost_s=args.restart_cost_s, resize_cost_s=args.resize_cost_s,
            elastic_resize=args.elastic_resize, reallocate_on_events=args.reallocate_on_events),
        recompute=args.recompute, window=parse_window(args.window),
        max_sim_s=args.max_hours * 3600.0 if args.max_hours else None, progress=not args.no_progress)
    log.info("simulating %s on %s (%d GPUs), %s", args.policy, args.cluster, cluster.total_gpus, source)
    if args.model == "service":
        result = simulate_as_service(args, jobs, cluster, table, policy, sim_cfg)
    else:
        result = simulate(jobs, cluster, table, policy, sim_cfg)
    s = summarize(result)
    if s["makespan_s"] >= 7200 or s["makespan_s"] != s["makespan_s"]:  # hours (NaN: nothing finished)
        times = (f"JCT avg {s['avg_jct_h']:.2f} h, median {s['median_jct_h']:.2f} h, p99 {s['p99_jct_h']:.2f} h; "
                 f"makespan {s['makespan_s'] / 3600:.1f} h")
    else:  # a short trace (e.g. a cluster's exported run): seconds
        times = (f"JCT avg {s['avg_jct_s']:.1f} s, median {s['median_jct_s']:.1f} s, p99 {s['p99_jct_s']:.1f} s; "
                 f"makespan {s['makespan_s']:.1f} s")
    line = (f"{args.policy}: {s['finished']}/{s['window_jobs']} jobs done; {times}; utilisation "
            f"{s['utilisation']:.1%}; restarts {s['restarts']}, resizes {s['resizes']}")
    if "cost_usd" in s:
        line += f"; cost ${s['cost_usd']:.0f}"
    if s["slo_jobs"]:
        line += f"; SLO violations {s['slo_violations']}/{s['slo_jobs']}"
    print(line)
    if s["unfinished"]:
        print(f"warning: {s['unfinished']} jobs of the window had not finished when the simulation stopped")
    if args.out_dir:
        paths = write_summary(result, args.out_dir, s)
        print(f"wrote {', '.join(sorted(paths.values()))}")
    return 0


def load_costs(path: str | None, restart_cost_s: float, resize_cost_s: float):
    """``--costs``: a JSON object of :class:`~virtualflow.service.replay.ReplayCosts` fields (a
    ``{"costs": {...}}`` wrapper, as ``cluster replay --json`` prints, is accepted); without it the
    rounds model's change costs as pauses and no other latency."""
    from virtualflow.cluster import bounds
    from virtualflow.service.replay import ReplayCosts

    if path is None:
        return ReplayCosts(start_s=0.0, resume_s=restart_cost_s, grow_s=resize_cost_s, shrink_s=resize_cost_s,
                           launch_s=0.0, first_launch_s=0.0, stop_s=0.0, done_s=0.0, idle_s=0.0)
    if not os.path.isfile(path):
        raise ValueError(f"--costs {path!r} does not exist; give a JSON file of pauses (costs.json of "
                         f"virtualflow cluster replay --export) or leave it out")
    data = bounds.load_json(path, what="--costs")
    if isinstance(data, dict) and isinstance(data.get("costs"), dict):
        data = data["costs"]
    known = set(ReplayCosts.__slots__)  # type: ignore[attr-defined]
    if not isinstance(data, dict):
        raise ValueError(f"--costs {path}: expected a JSON object of pauses in seconds, got {type(data).__name__}")
    if set(data) - known:
        raise ValueError(f"--costs {path}: unknown keys {sorted(set(data) - known)}; the keys are {sorted(known)} "
                         f"(seconds)")
    return ReplayCosts(**{k: bounds.number(v, where=f"--costs {path}", field=k, lo=0, hi=bounds.MAX_PAUSE_S,
                                           meaning="seconds of a pause or latency, a day at most")
                          for k, v in data.items()})


NO_SERVICE_INPUTS = {"min_cost": "prices", "min_cost_slo": "prices and SLOs", "las_space_sharing": "co-location throughputs"}
"""Policies whose inputs the cluster service does not have (so --model service cannot play them)."""


def simulate_as_service(args: argparse.Namespace, jobs, cluster, table, policy, sim_cfg):
    """``--model service``: the trace through the cluster service's scheduler (service/model.py)."""
    from virtualflow.service.core import parse_slowdowns
    from virtualflow.service.model import simulate_service

    mech = sim_cfg.mechanism
    if mech.reallocate_on_events or mech.elastic_resize != "in_place":
        raise ValueError("--model service plays the service's mechanics: it re-plans at round boundaries and "
                         "resizes elastic jobs in place; leave out --reallocate-on-events / --elastic-resize restart")
    if sim_cfg.recompute != "on_change" or sim_cfg.max_sim_s is not None:
        raise ValueError("--model service re-solves the policy when the jobs change or an estimate drifts and runs "
                         "every job to completion; leave out --recompute / --max-hours")
    if not (args.min_run_s >= 0):
        raise ValueError(f"--min-run-s {args.min_run_s} must be >= 0 seconds")
    if args.policy in NO_SERVICE_INPUTS:
        raise ValueError(f"--policy {args.policy} needs {NO_SERVICE_INPUTS[args.policy]}, which the cluster service does "
                         f"not have yet (docs/cluster_service.md, Limits); simulate it with --model rounds")
    costs = load_costs(args.costs, args.restart_cost_s, args.resize_cost_s)
    slowdowns = parse_slowdowns(args.slowdowns) if args.slowdowns else None
    bar = None
    on_round = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=None, unit="h", desc=f"simulate {args.policy} (service)",
                   bar_format="{desc}: {n:.1f} simulated h [{elapsed}]")
        last = [min(j.arrival_s for j in jobs)]

        def tick(r) -> None:
            bar.update((r.end_s - last[0]) / 3600.0)
            last[0] = r.end_s

        on_round = tick
    try:
        return simulate_service(jobs, cluster, table, policy, round_s=mech.round_s, costs=costs,
                                slowdowns=slowdowns, min_run_s=args.min_run_s, mechanism=mech,
                                window=sim_cfg.window, on_round=on_round)
    finally:
        if bar is not None:
            bar.close()
