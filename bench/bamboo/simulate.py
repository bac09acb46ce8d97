"""(3) The spot simulator's constants from this run's measurements, and the simulator run on them.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench import harness as H
from bench.bamboo.workload import NOT_MEASURED, P2_TRACE


# --------------------------------------------------------------------------------------------
# (3) Constants and the simulator.


def constants_of(args, ov: dict, rs: dict, fo: dict | None, env: dict) -> tuple[dict, dict]:
    source = (f"bench/bamboo.py, repository at {env['git_commit']}"
              f"{' + uncommitted edits' if env['virtualflow_source'].get('uncommitted_changes') else ''}, "
              f"{env['date']}, {env['cpu_count']}-core {env['cpu_model']}; emulated stage compute")
    constants = {"step_s": ov["step_without_s"], "samples_per_step": float(args.m * args.mb),
                 "redundancy_overhead": max(0.0, ov["overhead"] - 1.0),
                 "restart_s": max(0.0, rs["restart_s"]), "checkpoint_s": max(0.0, rs["checkpoint_s"]),
                 "source": source}
    sources = {
        "step_s": f"measured: median step of the job without redundancy ({args.stages} stages, 1f1b, m={args.m})",
        "samples_per_step": "the measured job's global batch (one pipeline)",
        "redundancy_overhead": f"measured: eager redundancy (Pipeline(redundancy=True), the default "
                               f"redundant_compute='eager': replica refresh + eager redundant forwards), median over "
                               f"interleaved triples of step(eager)/step(without) - 1 ({args.stages} stages, 1f1b, "
                               f"m={args.m}); lazy (refresh only) measured beside it: "
                               f"{max(0.0, ov['overhead_lazy'] - 1.0):.4f}",
        "restart_s": "measured: virtualflow.launch(resume=RUN_DIR) on this machine, launch -> first resumed step, "
                     "minus a normal step (no instance to acquire or boot, a small model on a local disk)",
        "checkpoint_s": f"measured: {rs['checkpoint_from']}",
        "failover_slowdown": NOT_MEASURED,
        "failover_s": NOT_MEASURED,
        "reconfigure_s": "default, not measured: reconfiguration exists (replace_failed) but this benchmark does not "
                         "measure it yet",
    }
    if fo is not None and fo.get("failover_s") is not None:
        constants["failover_s"] = max(0.0, fo["failover_s"])
        constants["failover_slowdown"] = max(1.0, fo["slowdown"])
        sources["failover_s"] = (f"measured: {fo['stages']} stages, worker {fo['victim_worker']} SIGKILLed at the "
                                 f"start of step {fo['loss_step']} (FaultPlan), end of the step before -> end of the "
                                 f"redone step")
        sources["failover_slowdown"] = (f"measured: {fo['stages']} stages, median step after the failover / before "
                                        f"(one worker running two stages)")
    elif fo is not None:
        sources["failover_s"] = sources["failover_slowdown"] = "default, not measured: the failover run failed"
    return constants, sources


def simulator_source() -> str:
    """The simulator's last commit, and whether the tree measured has uncommitted edits to it."""
    spot = ("src/virtualflow/cluster/spot.py", "src/virtualflow/cluster/spot_constants.py")

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=H.REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git, or not a checkout
            return ""

    return (git("log", "-1", "--format=%h", "--", *spot) or "never committed") + (
        " + uncommitted edits" if git("status", "--porcelain", "--", *spot) else "")


def simulate(const_path: str, stages: int) -> dict:
    """``virtualflow simulate-spot`` on the shipped p2 trace with our constants file (JSON)."""
    cmd = [sys.executable, "-m", "virtualflow.cli.main", "simulate-spot", "--trace", P2_TRACE,
           "--stages", str(stages), "--constants", const_path, "--json"]
    try:
        import virtualflow.cluster.spot  # noqa: F401
    except ImportError as exc:
        return {"available": False, "why": f"virtualflow.cluster.spot not importable: {exc}"}
    proc = subprocess.run(cmd, cwd=H.REPO_ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"available": False, "why": f"exit {proc.returncode}: {proc.stderr[-1500:]}", "command": cmd}
    return {"available": True, "command": cmd, "summary": json.loads(proc.stdout)}
