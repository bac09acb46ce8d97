"""One comparable record per run (time, accuracy, cost, value) and the console table (pure)."""

from __future__ import annotations

import math

from virtualflow.gnn.engine import GNNResult
from virtualflow.gnn.price import PriceModel, value


def summarize(name: str, r: GNNResult, price: PriceModel, num_nodes: int, target: float | None = None,
              metric: str = "val_acc") -> dict:
    """``servers``: billed per hour (graph servers, CPU-only servers, or the one PyG machine);
    tensor workers billed per GB-second of task time."""
    cost = price.cost(servers=r.servers, wall_s=r.wall_s, worker_busy_s=r.tw_busy_s, requests=r.tw_tasks)
    epochs = len(r.history)
    # A run whose loss became non-finite trained nothing worth a value: it is marked, and its
    # value (and its accuracies, computed from NaN weights) are not reported.
    diverged = any(not math.isfinite(float(h.get("loss", 0.0))) for h in r.history)
    rec = {
        "run": name, "servers": r.servers, "tensor_workers": r.tensor_workers, "epochs": epochs,
        "wall_s": r.wall_s, "epoch_s": r.wall_s / max(1, epochs), "startup_s": r.startup_s,
        **{k: v for k, v in r.accuracy.items()}, "loss": r.history[-1]["loss"] if r.history else None,
        **cost, "value": value(r.wall_s, cost["cost_usd"]),
        "vertex_epochs_per_usd": num_nodes * epochs / cost["cost_usd"] if cost["cost_usd"] > 0 else float("inf"),
        "tw_busy_s": r.tw_busy_s, "tw_tasks": r.tw_tasks, "relaunches": r.relaunches, "timeouts": r.timeouts,
        "max_lead": r.staleness.max_lead, "stale_reads": r.staleness.stale_reads, "updates": r.updates,
        "edge_cut": r.edge_cut, "intervals": r.num_intervals,
    }
    if target is not None:
        rec["target"] = {"metric": metric, "value": target, "time_s": r.time_to(metric, target)}
    if diverged:
        rec.update(diverged=True, value=None, vertex_epochs_per_usd=None,
                   **{k: None for k in r.accuracy})
        if "target" in rec:
            rec["target"]["time_s"] = None
    return rec


def add_ratios(records: list[dict], against: str = "cpu-only") -> None:
    """``value_vs_<against>`` on every record, when a record of that name is there."""
    base = next((r for r in records if r["run"] == against), None)
    for r in records:
        r[f"value_vs_{against}"] = (r["value"] / base["value"]
                                    if base and base["value"] and r["value"] is not None else None)


def format_table(records: list[dict]) -> str:
    cols = [("run", "run", "{}"), ("servers", "servers", "{}"), ("tensor workers", "tensor_workers", "{}"),
            ("epoch s", "epoch_s", "{:.3f}"), ("test acc", "test_acc", "{:.3f}"), ("cost $", "cost_usd", "{:.3g}"),
            ("value 1/(s*$)", "value", "{:.4g}"), ("value vs cpu-only", "value_vs_cpu-only", "{:.2f}x"),
            ("to target s", None, "{:.2f}"), ("relaunches", "relaunches", "{}")]
    rows = []
    for r in records:
        row = []
        for _, key, fmt in cols:
            v = (r.get("target") or {}).get("time_s") if key is None else r.get(key)
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, (h, _, _) in enumerate(cols)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((h, _, _), w) in enumerate(zip(cols, widths)))]
    out += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(out)
