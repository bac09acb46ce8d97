"""(5) The spot simulator's constants (``bench/results/bamboo_constants.json``: ``bench.bamboo``'s
measured constants with this run's failover ones) and its value on the p2 trace, with what-ifs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import harness as H
from bench.bamboo_failover.workload import CONSTANTS_FILE, OTHER_CONSTANTS, P2_TRACE


# --------------------------------------------------------------------------------------------
# (5) constants for the spot simulator and its value on the p2 trace.


def other_constants() -> tuple[dict, dict, str]:
    """bench.bamboo's constants: the committed bench/results/bamboo.json if there is one, else
    the working copy."""
    committed = subprocess.run(["git", "log", "--format=%h", "-1", "--", OTHER_CONSTANTS], cwd=H.REPO_ROOT,
                               capture_output=True, text=True).stdout.strip()
    if committed:
        text = subprocess.run(["git", "show", f"HEAD:{OTHER_CONSTANTS}"], cwd=H.REPO_ROOT, capture_output=True,
                              text=True).stdout
        where = f"{OTHER_CONSTANTS} as committed in {committed}"
    else:
        with open(H.repo_path(OTHER_CONSTANTS)) as f:
            text = f.read()
        where = f"{OTHER_CONSTANTS}, working copy (not committed yet)"
    data = json.loads(text)
    return data.get("constants") or {}, data.get("constants_sources") or {}, where


def write_constants(run: H.Run, ks: dict, env: dict) -> dict:
    theirs, their_sources, where = other_constants()
    mine = {"failover_s": ks["failover_s"], "failover_slowdown": ks["slowdown"],
            "reconfigure_s": max(0.0, ks["reconfigure_s"])}
    keep = ("step_s", "samples_per_step", "redundancy_overhead", "restart_s", "checkpoint_s")
    constants = {k: theirs[k] for k in keep if k in theirs}
    constants.update(mine)
    constants["source"] = (f"{where}: {theirs.get('source', '?')}; failover_s, failover_slowdown, reconfigure_s: "
                           f"bench/bamboo_failover.py at {env['git_commit']}, {env['date']}, {env['cpu_count']}-core "
                           f"{env['cpu_model']}; emulated stage compute")
    job = f"{run.args.stages} stages, 1f1b, m={run.args.m}, one pipeline, step {1e3 * ks['full_step_s']:.0f} ms"
    sources = {k: f"{where}: {their_sources.get(k, 'measured by bench/bamboo.py')}" for k in keep if k in theirs}
    sources.update({
        "failover_s": f"measured here: SIGKILL of the middle stage -> end of the redone step, eager redundancy "
                      f"(the default), median of {len(ks['runs'])} kills ({job}; it includes one failed-over step, "
                      f"so it scales with the step; lazy: {H.num(ks['lazy'].get('failover_s'))} s)",
        "failover_slowdown": f"measured here: failed-over step / full-depth step, same run, median of "
                             f"{sum(1 for r in ks['runs'] if not r['replace_failed'])} runs ({job})",
        "reconfigure_s": f"measured here: step-time gap at the reconfigure generation minus a normal step, "
                         f"median of {sum(1 for r in ks['runs'] if r['replace_failed'])} runs ({job}); the "
                         "replacement's process start happens before, while the pipeline trains failed over",
    })
    for k in ("failover_s", "failover_slowdown"):
        if k in theirs:
            sources[k] += (f"; bench/bamboo.py measured {theirs[k]:.3g} on its own 4-stage job ({where}), not used: "
                           "this benchmark's own measurement is (see bench/results/bamboo_failover.md)")
    for k in ("step_s", "samples_per_step", "redundancy_overhead", "restart_s", "checkpoint_s"):
        if k not in constants:
            sources[k] = "default, not measured (absent from bench/results/bamboo.json)"
    payload = {"constants": constants, "sources": sources}
    out = run.path("").replace(run.name, CONSTANTS_FILE.removesuffix(".json")) + ".json"
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    return {"path": out, **payload, "bamboo_py_constants": theirs, "bamboo_py_constants_from": where}


def what_if(path: str, theirs: dict) -> list[dict]:
    """Diagnostic, not measurements: the same simulation with a few constants replaced by the
    figures Bamboo's setting has (a cloud node's start, a larger checkpoint), to show what the
    bamboo / checkpoint ratio depends on."""
    from virtualflow.cluster.spot import SpotConstants, SpotJob, compare, load_trace

    trace = load_trace(P2_TRACE)
    base = SpotConstants.from_json(path)
    job = SpotJob(stages=4)
    rows = []
    for label, change in (("measured constants (as above)", {}),
                          ("restart_s = 45 (Bamboo's node start)", {"restart_s": 45.0}),
                          ("restart_s = 45, checkpoint_s = 10 (the simulator's default guess)",
                           {"restart_s": 45.0, "checkpoint_s": 10.0}),
                          ("restart_s = 900, checkpoint_s = 60 (a large model on cloud storage)",
                           {"restart_s": 900.0, "checkpoint_s": 60.0}),
                          ("the same and redundancy_overhead = 0 (a free replica refresh)",
                           {"restart_s": 900.0, "checkpoint_s": 60.0, "redundancy_overhead": 0.0}),
                          ("bench/bamboo.py's own failover_s / failover_slowdown (4 stages) instead of these",
                           {k: theirs[k] for k in ("failover_s", "failover_slowdown") if k in theirs})):
        c = SpotConstants.from_dict({k: getattr(base, k) for k in SpotConstants.numeric_fields()} | change,
                                    where="what-if")
        res = compare(trace, c, job)
        od = res["on-demand"].samples_per_usd
        rows.append({"what": label, "changed": change, "vs_on_demand": res["bamboo"].samples_per_usd / od,
                     "checkpoint_vs_on_demand": res["checkpoint"].samples_per_usd / od,
                     "vs_checkpoint": res["bamboo"].samples_per_usd / res["checkpoint"].samples_per_usd})
    return rows


def simulate_value(path: str) -> dict:
    rel = os.path.relpath(path, H.REPO_ROOT)
    cmd = [os.path.join(os.path.dirname(sys.executable), "virtualflow"), "simulate-spot", "--trace", P2_TRACE,
           "--stages", "4", "--constants", rel, "--json"]
    proc = subprocess.run(cmd, cwd=H.REPO_ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    s = out["strategies"]
    return {"command": "virtualflow " + " ".join(cmd[1:]), "summary": out,
            "vs_on_demand": s["bamboo"]["samples_per_usd"] / s["on-demand"]["samples_per_usd"],
            "vs_checkpoint": s["bamboo"]["samples_per_usd"] / s["checkpoint"]["samples_per_usd"],
            "checkpoint_vs_on_demand": s["checkpoint"]["samples_per_usd"] / s["on-demand"]["samples_per_usd"]}
