"""``virtualflow status RUN_DIR``: step, generation and membership phase, the last step's loss,
metrics and throughput (tokens/s, MFU), workers and recent step times of a run."""

from __future__ import annotations

import argparse
import statistics

from virtualflow.records.rundir import json_text, read_status, run_state
from virtualflow.runtime.breakdown import PARTS, Summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a run's progress and workers",
                       description="Show the step, generation, membership phase, workers (id, pid, VNs), recent "
                                   "step times of a run and where its last steps' time went per worker.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(func=main)


def format_status(run_dir: str, status: dict, state: str) -> str:
    lines = []
    head = f"{status.get('job', '?')} in {run_dir}: {status.get('state')}"
    if state == "orphaned":
        head += " (its coordinator is gone: continue with `virtualflow run JOB --resume RUN_DIR`)"
    elif state == "finished":
        head += " (finished)"
    lines.append(head)
    # The membership controller's phase (control/membership/phases.py); a status written before
    # the controller had named phases has none.
    phase = f" membership {status['phase']}," if status.get("phase") else ""
    lines.append(f"step {status.get('step')}/{status.get('total_steps')}, generation {status.get('generation')},{phase} "
                 f"target {status.get('target_workers')} workers, {status.get('failures', 0)} failure(s) survived")
    training = training_line(status)
    if training:
        lines.append(training)
    if status.get("stop_reason"):
        lines.append(f"stop requested: {status['stop_reason']}")
    times = status.get("recent_step_times_s") or []
    if times:
        lines.append(f"recent step times: median {statistics.median(times) * 1000:.1f} ms, last "
                     + ", ".join(f"{t * 1000:.1f}" for t in times[-5:]) + " ms")
    if status.get("balance"):
        pred, meas = status.get("predicted_step_s"), status.get("measured_step_s")
        lines.append("speed-based VN map: predicted step "
                     + (f"{pred * 1000:.1f} ms" if pred else "-") + ", measured "
                     + (f"{meas * 1000:.1f} ms" if meas else "-"))
    red = status.get("redundancy")
    if red:
        layout = red.get("layout")
        lines.append("redundant stages (Bamboo): " + ("full depth" if layout is None else
                     "failed over, workers run stages " + " | ".join(",".join(map(str, r)) for r in layout)))
        for e in red.get("events") or []:
            what = e.get("layout") if e.get("kind") != "fallback_restart" else e.get("reason")
            lines.append(f"  {e.get('kind')} at step {e.get('step')}: {what}")
    auto = status.get("autoscale")
    if auto:
        where = f"settled at {auto['settled_at']}" if auto.get("settled_at") else "searching"
        lines.append(f"autoscale {auto['policy']} in [{auto['min_workers']}, {auto['max_workers']}]: {where}, "
                     f"{auto.get('decisions', 0)} decision(s)"
                     + (f"; last: {auto['last_decision']}" if auto.get("last_decision") else "")
                     + (f"; OFF ({auto['disabled']})" if auto.get("disabled") else ""))
    lines.append(f"{'worker':>6} {'pid':>8} {'rank':>5} {'ms/VN':>7}  VNs")
    for w in status.get("workers", []):
        vns = w.get("vns") or []
        span = (f"{vns[0]}-{vns[-1]}" if len(vns) > 1 else str(vns[0])) if vns else w.get("state", "-")
        rank = "-" if w.get("rank") is None else str(w["rank"])
        t = w.get("time_per_vn_s")
        speed = f"{t * 1000:.1f}" if t else "-"
        lines.append(f"{w['id']:>6} {w.get('pid') or '-':>8} {rank:>5} {speed:>7}  {span}")
    lines += breakdown_lines(status.get("breakdown"))
    return "\n".join(lines)


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def training_line(status: dict) -> str:
    """``last step: loss 2.31, acc 0.52, lr 3e-04, grad norm 1.2, 812 samples/s, 104,000 tokens/s,
    MFU 31.2%`` (what the status holds of it), or ``""`` before the first step."""
    loss = _num(status.get("loss"))
    if loss is None:
        return ""
    parts = [f"loss {loss:.4f}"]
    metrics = status.get("train_metrics")
    if isinstance(metrics, dict):
        parts += [f"{str(k)[:40]} {v:.4g}" for k, v in list(metrics.items())[:8] if _num(v) is not None]
    for key, label, fmt in (("lr", "lr", "{:.3g}"), ("grad_norm", "grad norm", "{:.4g}"),
                            ("loss_scale", "loss scale", "{:g}"), ("samples_per_s", "", "{:,.0f} samples/s"),
                            ("tokens_per_s", "", "{:,.0f} tokens/s")):
        value = _num(status.get(key))
        if value is not None:
            parts.append((label + " " if label else "") + fmt.format(value))
    mfu = _num(status.get("mfu"))
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    skipped = status.get("skipped_steps")
    if isinstance(skipped, int) and skipped > 0:
        parts.append(f"{skipped} step(s) skipped by loss scaling")
    return "last step: " + ", ".join(parts)


def breakdown_lines(data: object) -> list[str]:
    """The breakdown table of ``status.json`` (its last steps), or nothing when it has none."""
    from virtualflow.runtime.breakdown import format_table

    try:
        summary = Summary(steps=int(data["steps"]), mean=data["mean_s"], share=data["share"],  # type: ignore[index]
                          per_worker={int(k): v for k, v in data["per_worker"].items()},  # type: ignore[index]
                          io={int(k): v for k, v in data["io_per_step"].items()},  # type: ignore[index]
                          advice=data.get("advice"))  # type: ignore[union-attr]
        for m in [*summary.per_worker.values(), summary.share]:
            m.setdefault("overhead_s", 0.0)  # a status written before the engine's overhead was apart
            m.setdefault("p2p_s", 0.0)  # ... or before pipeline stages were broken down
            m.setdefault("bubble_s", 0.0)
        for m in summary.per_worker.values():
            [float(m[k]) for k in PARTS + ("step_s",)]
        lines = format_table(summary)
    except (TypeError, KeyError, ValueError, AttributeError):
        return []  # no breakdown yet (or an older run's status)
    return lines


def main(args: argparse.Namespace) -> int:
    status = read_status(args.run_dir)
    state = run_state(args.run_dir, status)
    if args.json:
        print(json_text({**status, "run_state": state}, indent=2))  # standard JSON (NaN as "nan")
    else:
        print(format_status(args.run_dir, status, state))
    return 0
