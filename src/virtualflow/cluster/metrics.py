"""Summaries of a simulation: JCT statistics, makespan, utilisation, cost, SLOs, fairness; plots.

Definitions (all times in seconds unless a key says ``_h``):

- **JCT** of a job = finish - arrival, over the measurement window (job ids ``[lo, hi)``; all jobs
  without a window). ``unfinished`` counts window jobs that had not finished when the simulation
  stopped; they are left out of the JCT statistics (a non-zero count means the numbers are a
  lower bound: the cluster was saturated or ``max_sim_s`` cut the run).
- **makespan** = last finish - first arrival over all finished jobs.
- **utilisation** = GPU-seconds held by jobs / (total GPUs x the simulated span). GPUs of a job
  that finished mid-round are idle for the rest of the round and not counted; time lost to
  restarts/resizes is counted (the GPUs are held).
- **cost** = sum over types of GPU-hours held x price ($ per GPU-hour), when the cluster has prices.
- **SLO violations**: window jobs with ``slo_s`` whose JCT exceeds it (unfinished ones count).
- **finish-time-fairness ratio** rho = JCT / (isolated time x max(1, N x g / G)), with the job's
  isolated time on its requested GPUs of its fastest type, N the time-averaged number of active
  jobs while it was in the system, g its GPU count and G the cluster's GPUs: the slowdown
  against running alone on an equal 1/N share of the cluster (Themis' rho). rho <= 1 is fair.

Plotting imports matplotlib lazily (an optional dependency) and uses ``matplotlib.figure.Figure``
directly, never pyplot, so it does not touch the caller's backend or figures.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from virtualflow.cluster.simulator import SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["window_mask", "summarize", "write_summary", "plot_jct_cdf", "plot_jct_vs_load"]


def window_mask(result: SimResult, window: tuple[int, int] | None = None) -> np.ndarray:
    """Bool mask of the jobs in the window (default: the result's window; None: every job)."""
    w = window if window is not None else result.window
    ids = np.array([j.job_id for j in result.jobs])
    if w is None:
        return np.ones(len(ids), dtype=bool)
    return (ids >= w[0]) & (ids < w[1])


def _stats(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"avg": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"avg": float(x.mean()), "median": float(np.median(x)), "p99": float(np.percentile(x, 99))}


def summarize(result: SimResult, window: tuple[int, int] | None = None) -> dict[str, Any]:
    """A JSON-ready dict of the run's metrics over ``window`` (see the module docstring)."""
    m = window_mask(result, window)
    fin = np.isfinite(result.finish_s)
    jct = result.jct_s[m & fin]
    st = _stats(jct)
    cl = result.cluster
    G = cl.total_gpus
    scales = np.array([j.scale_factor for j in result.jobs], dtype=float)
    first = float(result.arrival_s.min())
    last = float(np.nanmax(result.finish_s)) if fin.any() else result.end_s
    span = max(result.end_s - first, 1e-9)
    held_by_type = result.gpu_s.sum(axis=0)
    out: dict[str, Any] = {
        "policy": result.policy,
        "jobs": len(result.jobs),
        "window": list(w) if (w := window if window is not None else result.window) is not None else None,
        "window_jobs": int(m.sum()),
        "finished": int((m & fin).sum()),
        "unfinished": int((m & ~fin).sum()),
        "avg_jct_s": st["avg"],
        "median_jct_s": st["median"],
        "p99_jct_s": st["p99"],
        "avg_jct_h": st["avg"] / 3600.0,
        "median_jct_h": st["median"] / 3600.0,
        "p99_jct_h": st["p99"] / 3600.0,
        "makespan_s": float(last - first) if fin.any() else float("nan"),
        "simulated_s": float(result.end_s - first),
        "utilisation": float(result.gpu_s.sum() / (G * span)),
        "utilisation_by_type": {t: float(held_by_type[c] / (cl.gpus[t] * span)) for c, t in enumerate(cl.types)},
        "restarts": int(result.restarts[m].sum()),
        "resizes": int(result.resizes[m].sum()),
        "lost_to_changes_s": float(result.lost_s[m].sum()),
        "rounds": result.rounds,
        "policy_solves": result.solves,
        "policy_solve_s": result.solve_s,
        "skipped_fragmented": result.skipped_fragmented,
    }
    if cl.prices is not None:
        prices = np.array([cl.prices[t] for t in cl.types])
        out["cost_usd"] = float((result.gpu_s.sum(axis=0) / 3600.0 * prices).sum())
    slo = np.array([j.slo_s if j.slo_s is not None else np.nan for j in result.jobs])
    has = m & np.isfinite(slo)
    viol = has & (~fin | (result.jct_s > slo))
    out["slo_jobs"] = int(has.sum())
    out["slo_violations"] = int(viol.sum())
    fair_share = np.maximum(1.0, result.contention * scales / G)
    rho = result.jct_s / (result.isolated_s * fair_share)
    r = rho[m & fin]
    out["ftf_rho"] = {"avg": float(r.mean()) if r.size else float("nan"),
                      "max": float(r.max()) if r.size else float("nan"),
                      "frac_gt_1": float((r > 1).mean()) if r.size else float("nan")}
    return out


def per_job_records(result: SimResult) -> list[dict[str, Any]]:
    """One record per job (for JSONL output)."""
    out = []
    for i, j in enumerate(result.jobs):
        out.append({"job_id": j.job_id, "job_type": j.job_type, "gpus": j.scale_factor, "elastic": j.elastic,
                    "weight": j.weight, "arrival_s": float(result.arrival_s[i]),
                    "finish_s": None if not np.isfinite(result.finish_s[i]) else float(result.finish_s[i]),
                    "restarts": int(result.restarts[i]), "resizes": int(result.resizes[i]),
                    "lost_s": float(result.lost_s[i])})
    return out


def write_summary(result: SimResult, out_dir: str, summary: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Write ``summary.json``, ``jobs.jsonl`` and ``jct_cdf.png`` (if matplotlib is installed) to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    summary = dict(summary) if summary is not None else summarize(result)
    paths = {"summary": os.path.join(out_dir, "summary.json"), "jobs": os.path.join(out_dir, "jobs.jsonl")}
    with open(paths["summary"], "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    with open(paths["jobs"], "w") as f:
        for rec in per_job_records(result):
            f.write(json.dumps(rec) + "\n")
    try:
        m = window_mask(result) & np.isfinite(result.finish_s)
        paths["cdf"] = plot_jct_cdf({result.policy: result.jct_s[m]}, os.path.join(out_dir, "jct_cdf.png"))
    except ImportError:
        pass
    return paths


def _figure() -> tuple[Figure, Axes]:
    """A figure of its own, outside pyplot: no backend is chosen or changed and no global figure
    list keeps it alive, so plotting from library code leaves the user's matplotlib as it was."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.5), layout="tight")
    return fig, fig.subplots()


def plot_jct_cdf(jcts: Mapping[str, Sequence[float] | np.ndarray], path: str, title: str = "JCT CDF") -> str:
    """CDF of job completion times (hours), one line per label."""
    fig, ax = _figure()
    for label, x in jcts.items():
        x = np.sort(np.asarray(x, dtype=float)) / 3600.0
        if x.size:
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.savefig(path, dpi=120)
    return path


def plot_jct_vs_load(series: Mapping[str, Sequence[tuple[float, float]]], path: str,
                     title: str = "average JCT vs load", ylabel: str = "average JCT (hours)") -> str:
    """One line per label through (rate in jobs/hour, JCT in hours) points."""
    fig, ax = _figure()
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("input job rate (jobs/hour)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.savefig(path, dpi=120)
    return path
