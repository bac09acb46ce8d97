"""``virtualflow cluster replay --dir CLUSTER_DIR``: predict a cluster's runs from its own records.

Reads the cluster directory's database (jobs, events, rounds, configuration) and each job's
per-step metrics, measures the machine's constants and each job's rates
(:func:`virtualflow.service.replay.measure`), replays the service's decisions in virtual time
(:func:`virtualflow.service.replay.replay`) and prints each finished job's predicted JCT beside
the actual one, the median error and the makespans. ``--round-s``, ``--policy``, ``--min-run-s``
and ``--slots`` ask "what if" with the same jobs and constants.

``--export DIR`` also writes the run as inputs of ``virtualflow simulate --model service``: the
trace (``trace.json``: each job as type ``job-<id>``, its steps, elastic range, priority and
arrival), its measured throughputs (``throughputs.json``: a (type, workers) the job never ran on
is extrapolated as the service extrapolates), the measured pauses (``costs.json``) and
``export.json`` (the cluster's configuration, which entries were measured, the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from virtualflow.service.replay import ReplayConfig, ReplayCosts, ReplayJob, ReplayResult, measure, replay

MECHANISMS = ("recorded", "default", "lease_first", "gavel")
DIR_HELP = "the cluster directory of a service that ran jobs (its database and the jobs' run directories)"


def add_parser(csub: argparse._SubParsersAction) -> None:
    """Add ``replay`` to the ``cluster`` verb's sub-commands (``cli/cluster.py`` calls this)."""
    p = csub.add_parser("replay",
                          help="predict a cluster's job completion times by replaying the service in virtual time",
                          description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--dir", required=True, help=DIR_HELP)
    p.add_argument("--round-s", type=float, default=None, metavar="SECONDS", help="what if: another round length")
    p.add_argument("--policy", default=None, help="what if: another policy")
    p.add_argument("--min-run-s", type=float, default=None, metavar="SECONDS", help="what if: another --min-run-s")
    p.add_argument("--slots", default=None, metavar="TYPE=N,...", help="what if: other slot counts (same types)")
    p.add_argument("--observed", action="store_true",
                   help="trace-driven: each start takes the pause it really took and each measurement reports what "
                        "the service measured (how well the decisions are reproduced, apart from the machine's noise)")
    p.add_argument("--mechanism", choices=MECHANISMS, default="recorded",
                   help="the round mechanics to replay with: 'recorded' (what the cluster's database says the "
                        "service ran; 'default' for a database from before they were recorded), 'default' (this "
                        "virtualflow's defaults), 'lease_first' (one global queue, lease holders first, no "
                        "carried deficits: the defaults before Gavel's mechanics), 'gavel'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--export", metavar="OUT_DIR", default=None,
                   help="also write the run as virtualflow simulate --model service inputs (trace.json, "
                        "throughputs.json, costs.json, export.json with the command line) to OUT_DIR")
    p.set_defaults(func=run)


def read_run(cluster_dir: str) -> dict[str, Any]:
    """A finished (or stopped) cluster's records: ``config``, ``jobs`` (rows), ``events``,
    ``rounds``, ``steps`` (job id -> [(time, step, workers)] from its metrics), ``slowdowns``
    (job id -> type -> factor, as the service gives them)."""
    from virtualflow.service.core import type_slowdowns
    from virtualflow.service.runner import gavel_table
    from virtualflow.service.state import DB_NAME, ClusterDB

    if not os.path.isfile(os.path.join(cluster_dir, DB_NAME)):
        raise ValueError(f"--dir {cluster_dir} holds no cluster database ({DB_NAME}); give the directory of "
                         f"`virtualflow cluster start --dir`")
    db = ClusterDB(cluster_dir)
    try:
        cfg = db.config()
        rows, events, rounds = db.jobs(), db.events(), db.rounds(limit=10**7)
    finally:
        db.close()
    types = tuple(cfg["slots"])
    overrides = {str(k): float(v) for k, v in (cfg.get("slowdowns") or {}).items()}
    table = gavel_table()
    slowdowns = {r.id: type_slowdowns(types, table, overrides,
                                      job_type=r.job_type if r.job_type and table.has(r.job_type, 1) else None)
                 for r in rows}
    steps: dict[int, list[tuple[float, int, int]]] = {}
    for r in rows:
        recs = []
        path = os.path.join(r.run_dir, "metrics.jsonl") if r.run_dir else ""
        if path and os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        m = json.loads(line)
                    except ValueError:
                        continue  # a torn last line: the run was killed mid-write
                    if isinstance(m, dict) and "loss" in m and all(isinstance(m.get(k), (int, float))
                                                                   for k in ("time", "step", "workers")):
                        recs.append((float(m["time"]), int(m["step"]), int(m["workers"])))
        steps[r.id] = recs
    return {"config": cfg, "jobs": rows, "events": events, "rounds": rounds, "steps": steps, "slowdowns": slowdowns}


def mechanism_config(name: str, round_s: float, recorded: dict | None = None) -> Any:
    """The ``--mechanism`` choice as a :class:`~virtualflow.cluster.mechanism.MechanismConfig`
    (``recorded``: the knobs in the cluster's configuration, for ``"recorded"``)."""
    from virtualflow.service.core import mechanism_knobs, mechanism_of

    if name not in MECHANISMS:
        raise ValueError(f"--mechanism {name!r} must be one of {list(MECHANISMS)}")
    return mechanism_of(recorded if name == "recorded" else mechanism_knobs(name), round_s)


def predict(run_: dict[str, Any], *, round_s: float | None = None, policy: str | None = None,
            min_run_s: float | None = None, slots: dict[str, int] | None = None, observed: bool = False,
            mechanism: str = "recorded") -> tuple[list[ReplayJob], ReplayCosts, ReplayConfig, ReplayResult]:
    """Measure ``run_`` (from :func:`read_run`) and replay it (with the what-if overrides)."""
    cfg = run_["config"]
    jobs, costs = measure(run_["jobs"], run_["events"], run_["rounds"], run_["steps"],
                          round_s=float(cfg["round_s"]), slowdowns=run_["slowdowns"], observed=observed)
    config = ReplayConfig(slots=dict(slots or {str(k): int(v) for k, v in cfg["slots"].items()}),
                          policy=policy or cfg["policy"], round_s=float(round_s or cfg["round_s"]),
                          min_run_s=float(cfg.get("min_run_s", 0.0) if min_run_s is None else min_run_s),
                          mechanism=mechanism_config(mechanism, float(round_s or cfg["round_s"]), cfg.get("mechanism")))
    return jobs, costs, config, replay(jobs, config, costs)


def compare(rows: list[Any], result: ReplayResult) -> dict[str, Any]:
    """Predicted vs actual for the jobs that finished done in the run."""
    done = [r for r in rows if r.state == "done" and r.finished_s is not None and r.id in result.jct_s]
    per = [{"job": r.id, "actual_jct_s": r.finished_s - r.submitted_s, "predicted_jct_s": result.jct_s[r.id],
            "error": abs(result.jct_s[r.id] - (r.finished_s - r.submitted_s)) / max(r.finished_s - r.submitted_s, 1e-9),
            "restarts": r.restarts, "predicted_restarts": result.restarts[r.id],
            "resizes": r.resizes, "predicted_resizes": result.resizes[r.id]} for r in done]
    out: dict[str, Any] = {"jobs": per}
    if done:
        t0 = min(r.submitted_s for r in done)
        actual_ms = max(r.finished_s for r in done) - t0
        pred_ms = max(result.finish_s[r.id] for r in done) - t0
        out.update(jct_error_median=statistics.median(p["error"] for p in per), makespan_actual_s=actual_ms,
                   makespan_predicted_s=pred_ms, makespan_error=abs(pred_ms - actual_ms) / max(actual_ms, 1e-9))
    return out


def _parse_slots(spec: str | None) -> dict[str, int] | None:
    if spec is None:
        return None
    out = {}
    for part in spec.split(","):
        name, _, n = part.strip().partition("=")
        if not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--slots item {part!r} must look like TYPE=N with N >= 1, e.g. v100=2")
        out[name] = int(n)
    return out


def run(args: argparse.Namespace) -> int:
    if args.round_s is not None:  # 0 must not fall back to the recorded length unnoticed
        from virtualflow.cluster import bounds

        bounds.number(args.round_s, where="cluster replay", field="--round-s", lo=0, lo_open=True,
                      hi=bounds.MAX_PAUSE_S, meaning="seconds per scheduling round")
    data = read_run(args.dir)
    if not any(r.state == "done" for r in data["jobs"]):
        raise ValueError(f"the cluster in {args.dir} has no finished job to compare with; replay it once jobs are done")
    slots = _parse_slots(args.slots)
    if slots is not None and set(slots) != set(data["config"]["slots"]):
        raise ValueError(f"--slots {args.slots} must name the cluster's types {list(data['config']['slots'])}")
    jobs, costs, config, result = predict(data, round_s=args.round_s, policy=args.policy, min_run_s=args.min_run_s,
                                          slots=slots, observed=args.observed, mechanism=args.mechanism)
    cmp_ = compare(data["jobs"], result)
    if args.export:
        info = export(data, jobs, costs, args.export)
        if not args.json:
            print(f"exported to {args.export}; simulate it with:\n  {info['command']}")
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"costs": asdict(costs), "config": {"slots": config.slots, "policy": str(config.policy),
                                                              "round_s": config.round_s, "min_run_s": config.min_run_s,
                                                              "mechanism": args.mechanism},
                          **cmp_}, indent=2))
        return 0
    print(f"replay of {args.dir}: policy {config.policy}, slots {config.slots}, rounds of {config.round_s:g} s, "
          f"min_run_s {config.min_run_s:g}, mechanism {args.mechanism}")
    print("measured: " + ", ".join(f"{k} {v:.2f} s" for k, v in _costs(costs).items()))
    print(f"{'job':>5} {'actual JCT (s)':>15} {'predicted (s)':>14} {'error':>7} {'restarts':>9} {'resizes':>8}")
    for p in cmp_["jobs"]:
        print(f"{p['job']:>5} {p['actual_jct_s']:>15.1f} {p['predicted_jct_s']:>14.1f} {p['error']:>7.1%} "
              f"{p['restarts']:>4}/{p['predicted_restarts']:<4} {p['resizes']:>3}/{p['predicted_resizes']:<4}")
    print(f"median JCT error {cmp_['jct_error_median']:.1%}; makespan actual {cmp_['makespan_actual_s']:.1f} s, "
          f"predicted {cmp_['makespan_predicted_s']:.1f} s (error {cmp_['makespan_error']:.1%}); "
          f"restarts/resizes: actual/predicted")
    return 0


def _costs(costs: ReplayCosts) -> dict[str, float]:
    return {k: getattr(costs, k) for k in costs.__slots__}  # type: ignore[attr-defined]


def export(run_: dict[str, Any], jobs: list[ReplayJob], costs: ReplayCosts, out_dir: str) -> dict[str, Any]:
    """Write ``run_`` (from :func:`read_run`, measured into ``jobs`` and ``costs``) as the inputs of
    ``virtualflow simulate --model service`` (see the module docstring); returns export.json's content."""
    from dataclasses import asdict

    from virtualflow.cluster.model import JobSpec
    from virtualflow.cluster.traces import write_json_trace
    from virtualflow.service.core import MECHANISMS, JobView, base_rate, estimate_key, mechanism_knobs
    from virtualflow.service.replay import job_rate

    cfg = run_["config"]
    slots = {str(k): int(v) for k, v in cfg["slots"].items()}
    if not jobs:
        raise ValueError("the cluster ran no job: nothing to export")
    os.makedirs(out_dir, exist_ok=True)
    t0 = min(j.arrival_s for j in jobs)
    bases = [b for j in jobs if j.rates and (b := base_rate(JobView(job_id=j.job_id, steps=j.steps,
                                                                      slowdowns=j.slowdowns, estimates=j.rates)))]
    prior = statistics.median(bases) if bases else 1.0
    biggest = max(slots.values())
    table: dict[str, dict[str, dict[str, float]]] = {}
    measured: dict[str, list[str]] = {}
    specs = []
    for j in sorted(jobs, key=lambda j: (j.arrival_s, j.job_id)):
        name = f"job-{j.job_id}"
        # An elastic job never gets more workers than the largest type has (the service caps it;
        # databases from before submit refused more hold such jobs): the trace asks for what the
        # table covers, or `simulate` finds no throughput at the job's scale factor.
        hi = min(j.max_workers, biggest) if j.elastic else j.max_workers
        table[name] = {t: {str(g): job_rate(j, t, g, prior) for g in range(1, hi + 1)} for t in slots}
        measured[name] = sorted(k for k in j.rates if k in {estimate_key(t, g) for t in slots for g in range(1, hi + 1)})
        specs.append(JobSpec(job_id=len(specs), job_type=name, scale_factor=hi,
                             min_gpus=min(j.min_workers, hi) if j.elastic else None, total_steps=float(j.steps),
                             weight=j.priority, arrival_s=j.arrival_s - t0,
                             slo_s=None if j.deadline_s is None else max(j.deadline_s - j.arrival_s, 1e-3)))
    paths = {k: os.path.join(out_dir, f"{k}.json") for k in ("trace", "throughputs", "costs", "export")}
    write_json_trace(paths["trace"], specs)
    with open(paths["throughputs"], "w") as f:
        json.dump({"throughputs": table}, f, indent=1)
    with open(paths["costs"], "w") as f:
        json.dump(asdict(costs), f, indent=1)
    # The service's slowdown factors (what it assumed of each type); jobs naming a known job type
    # may have had their own: the most common set is exported.
    sets = [tuple(sorted(j.slowdowns.items())) for j in jobs]
    common = max(set(sets), key=sets.count)
    mech = next((m for m in MECHANISMS if cfg.get("mechanism") and mechanism_knobs(m) == cfg["mechanism"]), "default")
    slowdown_arg = ",".join(f"{t}={v:g}" for t, v in common)
    command = (f"virtualflow simulate --model service --cluster {','.join(f'{t}={n}' for t, n in slots.items())} "
               f"--slowdowns {slowdown_arg} --trace {paths['trace']} --throughputs {paths['throughputs']} "
               f"--costs {paths['costs']} --policy {cfg['policy']} --round-s {float(cfg['round_s']):g} "
               f"--min-run-s {float(cfg.get('min_run_s', 0.0)):g} --mechanism {mech}")
    info = {"slots": slots, "slowdowns": dict(common), "policy": cfg["policy"],
            "round_s": float(cfg["round_s"]), "min_run_s": float(cfg.get("min_run_s", 0.0)), "mechanism": mech,
            "jobs": {f"job-{j.job_id}": {"trace_index": i, "measured": measured[f"job-{j.job_id}"]}
                     for i, j in enumerate(sorted(jobs, key=lambda j: (j.arrival_s, j.job_id)))},
            "jobs_with_other_slowdowns": sum(s != common for s in sets), "command": command}
    with open(paths["export"], "w") as f:
        json.dump(info, f, indent=1)
    return info
