"""``virtualflow plot RUN_DIR [RUN_DIR ...] -o loss.png``: training curves of one or more runs.

Loss per step, the learning rate and the gradient norm (when recorded), each metric the loss
function returns and each evaluation metric, a panel each, of every run on one figure, so that
runs on 1, 2 and 4 workers can be seen to train the same model.
``--timeline`` instead draws, per run, the number of workers over steps and the step time,
with resizes, failures and new generations marked. ``--scaling`` draws, per run, the throughput
and the cost per sample at every worker count the run went through (from the autoscaler's
measurements, or from metrics.jsonl for a run without one), with the chosen size marked. ``--pipeline``
draws one step's measured pipeline schedule beside the simulator's prediction
(:mod:`virtualflow.cli.plot_pipeline`). ``--breakdown`` stacks, per worker, where each step's time went
(:mod:`virtualflow.runtime.breakdown`) over steps, with new generations marked. Needs matplotlib
(``pip install virtualflow[plot]``).

Figures are drawn with matplotlib's object API (``matplotlib.figure.Figure``), never pyplot:
plotting from a user's process (a notebook, a training script) leaves its backend and its open
figures alone. The run directory is read through :mod:`virtualflow.records.rundir` only, so a run that
is still writing (a partial last JSONL line) can be plotted.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from virtualflow.cli.figures import new_figure, save_figure
from virtualflow.records.rundir import read_jsonl, read_summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot loss and evaluation curves of runs",
                       description="Plot the curves of one or several runs: loss, learning rate, gradient norm, "
                                   "the loss function's metrics and evaluation metrics, a panel each.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default=None,
                   help="image file to write (default loss.png, timeline.png, scaling.png or pipeline.png)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--timeline", action="store_true",
                      help="workers over steps and step times, with resizes, failures and generations marked")
    kind.add_argument("--scaling", action="store_true",
                      help="throughput and cost per worker count (autoscaling measurements), the chosen size marked")
    kind.add_argument("--breakdown", action="store_true",
                      help="where the step time went: stacked time per part (input, forward, backward, reduction, "
                           "waiting for the slowest, optimizer, control) over steps, one panel per worker, "
                           "generations and resizes marked")
    kind.add_argument("--pipeline", action="store_true",
                      help="one step's measured pipeline schedule (a run with Pipeline(record_timeline=True)) "
                           "beside the simulator's prediction, with step times and bubbles printed")
    p.add_argument("--step", type=int, default=None,
                   help="with --pipeline: the step to draw (default: the last complete step of replica 0)")
    p.set_defaults(func=main)


def load_run(run_dir: str) -> dict:
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise ValueError(f"{run_dir!r} is not a virtualflow run directory (no metrics.jsonl); "
                         f"pass the --run-dir of a 'virtualflow run'")
    steps = read_jsonl(metrics_path)
    evals = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e.get("event") == "eval"]
    summary = read_summary(run_dir) or {}
    label = f"{os.path.basename(os.path.normpath(run_dir))} ({workers_label(steps, summary)})"
    return {"label": label, "steps": steps, "evals": evals}


def workers_label(steps: list[dict], summary: dict) -> str:
    """How many workers a run had, over its whole life: ``2 workers``, ``2→3 workers`` after a
    grow, ``2 workers (1–3 on the way)`` when it came back to its start; the summary's count when
    no step was recorded. (A title with only the starting count misreported resized runs.)"""
    counts = [s["workers"] for s in steps if isinstance(s.get("workers"), int) and not isinstance(s["workers"], bool)]
    if not counts:
        n = summary.get("workers")
        return f"{n} worker{'s' if n != 1 else ''}" if n is not None else "? workers"
    first, last, lo, hi = counts[0], counts[-1], min(counts), max(counts)
    if first != last:
        text = f"{first}\u2192{last} workers"
        return text if (lo, hi) == tuple(sorted((first, last))) else f"{text} ({lo}\u2013{hi} on the way)"
    text = f"{first} worker{'s' if first != 1 else ''}"
    return text if lo == hi else f"{text} ({lo}\u2013{hi} on the way)"


def plot_runs(run_dirs: list[str], output: str) -> str:
    return save_figure(runs_figure(run_dirs), output)


def _number(value: object) -> float | None:
    """A finite-or-not float from a record's field, ``None`` for anything else (bools, text, null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def curve_panels(runs: list[dict]) -> list[tuple[str, str, str]]:
    """The panels the default plot draws, as ``(kind, name, title)``, in order: the loss; the
    learning rate and the gradient norm when some step recorded them; each of the loss function's
    own metrics (``metrics`` of metrics.jsonl's records); each evaluation metric (events.jsonl)."""
    steps = [s for r in runs for s in r["steps"]]
    panels = [("loss", "loss", "training loss")]
    if any(_number(s.get("lr")) is not None for s in steps):
        panels.append(("field", "lr", "learning rate"))
    if any(_number(s.get("grad_norm")) is not None for s in steps):
        panels.append(("field", "grad_norm", "gradient norm (before clipping)"))
    train = sorted({k for s in steps if isinstance(s.get("metrics"), dict) for k, v in s["metrics"].items()
                    if _number(v) is not None})
    panels += [("train", k, f"training: {k}") for k in train]
    evals = sorted({k for r in runs for e in r["evals"] if isinstance(e.get("metrics"), dict) for k in e["metrics"]})
    panels += [("eval", k, f"evaluation: {k}") for k in evals]
    return panels


def _points(run: dict, kind: str, name: str) -> list[tuple[int, float]]:
    if kind == "eval":
        rows = [(e.get("step"), (e.get("metrics") or {}).get(name)) for e in run["evals"]]
    elif kind == "train":
        rows = [(s.get("step"), (s.get("metrics") or {}).get(name) if isinstance(s.get("metrics"), dict) else None)
                for s in run["steps"]]
    else:
        rows = [(s.get("step"), s.get(name)) for s in run["steps"]]
    return [(step, float(v)) for step, v in rows if isinstance(step, int) and _number(v) is not None]


def runs_figure(run_dirs: list[str], columns: int = 3) -> Figure:
    """Every run's curves, one panel per quantity (:func:`curve_panels`), up to ``columns`` panels a
    row; each run keeps its line style in every panel, so a run is followed across them."""
    runs = [load_run(d) for d in run_dirs]
    panels = curve_panels(runs)
    cols = min(columns, len(panels))
    rows = -(-len(panels) // cols)
    fig = new_figure(6 * cols, 4.2 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for p, (kind, name, title) in enumerate(panels):
        ax = axes[p // cols][p % cols]
        for i, run in enumerate(runs):
            pts = _points(run, kind, name)
            if pts:
                ax.plot(*zip(*pts), linestyle=styles[i % len(styles)], linewidth=1.4,
                        marker="o" if kind == "eval" else None, label=run["label"])
        ax.set(title=title, xlabel="step", ylabel=name)
        if kind == "loss" and all(v > 0 for r in runs for _, v in _points(r, kind, name)):
            ax.set_yscale("log")  # a loss that can be negative (a log-likelihood's) stays linear
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for p in range(len(panels), rows * cols):
        axes[p // cols][p % cols].axis("off")
    return fig


def plot_timeline(run_dirs: list[str], output: str) -> str:
    return save_figure(timeline_figure(run_dirs), output)


def timeline_figure(run_dirs: list[str]) -> Figure:
    fig = new_figure(8 * len(run_dirs), 6)
    axes = fig.subplots(2, len(run_dirs), squeeze=False, sharex="col")
    for col, run_dir in enumerate(run_dirs):
        run = load_run(run_dir)
        events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
        steps = run["steps"]
        xs = [s["step"] for s in steps]
        ax, ax2 = axes[0][col], axes[1][col]
        ax.step(xs, [s["workers"] for s in steps], where="post", color="tab:blue", linewidth=1.8, label="workers")
        ax2.plot(xs, [s["step_time_s"] * 1000 for s in steps], color="tab:gray", linewidth=0.8, label="step time")
        marks = {"resize_request": ("tab:green", "--", "resize request"),
                 "failure": ("tab:red", "-", "worker lost"),
                 "formed": ("tab:purple", ":", "generation formed"),
                 "failover": ("tab:orange", "-", "failover (Bamboo)"),
                 "reconfigure": ("tab:cyan", "--", "reconfigure (Bamboo)"),
                 "fallback_restart": ("black", "-", "fallback restart"),
                 "preemption_notice": ("tab:brown", ":", "preemption notice")}
        seen = set()
        for e in events:
            kind = e.get("event")
            if kind not in marks:
                continue
            if kind == "formed" and e.get("generation") == 0:
                continue
            step = e.get("step")
            if step is None:
                step = _step_at(steps, e.get("time"))
            color, style, label = marks[kind]
            for a in (ax, ax2):
                a.axvline(step, color=color, linestyle=style, linewidth=1.0,
                          label=label if (kind not in seen and a is ax) else None)
            seen.add(kind)
            if kind == "formed":
                # Hung from the top of the axes, inside them: a label above the data ran past
                # the axes' top and was clipped.
                ax.annotate(f"g{e['generation']}: {e.get('change', '')} {e.get('pause_s', 0) * 1000:.0f} ms",
                            xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -3),
                            textcoords="offset points", fontsize=7, rotation=90, va="top", ha="left")
        ax.set(title=f"{run['label']}: workers over steps", ylabel="workers")
        ax.set_ylim(0, max([s["workers"] for s in steps] + [1]) + 1.5)
        ax2.set(xlabel="step", ylabel="step time (ms)")
        for a in (ax, ax2):
            a.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    return fig


_COLORS = {"input_s": "tab:orange", "forward_s": "tab:blue", "backward_s": "tab:cyan", "p2p_s": "tab:pink",
           "bubble_s": "tab:brown", "reduction_s": "tab:green",
           "straggler_s": "tab:red", "optimizer_s": "tab:purple", "overhead_s": "tab:olive", "control_s": "tab:gray"}


def plot_breakdown(run_dirs: list[str], output: str) -> str:
    return save_figure(breakdown_figure(run_dirs), output)


def breakdown_figure(run_dirs: list[str]) -> Figure:
    """Per run (a column) and worker (a row): stacked milliseconds of each part over steps; a
    dotted line where a new generation starts (a resize, a failure, a rebalance). Every panel has
    the same y-axis, so that runs and workers compare at a glance."""
    from virtualflow.runtime import breakdown

    tables = []
    for run_dir in run_dirs:
        run = load_run(run_dir)
        rows = breakdown.rows(run["steps"])
        if not rows:
            raise ValueError(f"{run_dir!r} has no step breakdown in metrics.jsonl (a run with breakdown=False, a "
                             f"pipelined run, or one whose generations each ran a single step)")
        tables.append((run, rows))
    n_rows = max(len({w for _, _, w, _ in rows}) for _, rows in tables)
    fig = new_figure(8 * len(run_dirs), 2.6 * n_rows + 0.6)
    axes = fig.subplots(n_rows, len(run_dirs), squeeze=False, sharex="col", sharey="all")
    for col, (run, rows) in enumerate(tables):
        workers = sorted({w for _, _, w, _ in rows})
        starts = []  # (step, generation) where a generation's first broken-down step is
        last_gen = None
        for step, gen, _, _ in rows:
            if gen != last_gen:
                starts.append((step, gen))
                last_gen = gen
        for r in range(n_rows):
            ax = axes[r][col]
            if r >= len(workers):
                ax.axis("off")
                continue
            wid = workers[r]
            mine = [(step, p) for step, _, w, p in rows if w == wid]
            xs = [step for step, _ in mine]
            ax.stackplot(xs, *[[1000 * p[k] for _, p in mine] for k in breakdown.PARTS],
                         labels=[k.removesuffix("_s") for k in breakdown.PARTS],
                         colors=[_COLORS[k] for k in breakdown.PARTS], step="mid", alpha=0.85)
            for step, gen in starts[1:]:
                ax.axvline(step - 0.5, color="black", linestyle=":", linewidth=1.0)
                ax.annotate(f"g{gen}", xy=(step - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                            textcoords="offset points", fontsize=7, va="top")
            ax.set(ylabel="ms", title=f"{run['label']}: worker {wid}")
            ax.grid(alpha=0.3)
            if r == 0:
                ax.legend(fontsize=7, loc="upper right", ncol=4)
        axes[min(len(workers), n_rows) - 1][col].set_xlabel("step")
    return fig


def _step_at(steps: list[dict], t: float | None) -> int:
    """The step being run at wall-clock time ``t`` (events carry times, steps carry end times)."""
    if t is None or not steps:
        return 0
    for s in steps:
        if s.get("time", 0) >= t:
            return s["step"]
    return steps[-1]["step"]


def scaling_table(run_dir: str, warmup_steps: int = 2) -> tuple[list[dict], int | None, str]:
    """Per worker count: throughput (samples/s) and worker-seconds per 1,000 samples, and the
    chosen size. From the autoscaler's ``autoscale_size`` events (frozen medians) when the run
    had one, else the median over metrics.jsonl's steps (skipping ``warmup_steps`` per generation);
    the chosen size is where the autoscaler settled, else the final worker count."""
    import statistics

    run = load_run(run_dir)  # validates the run directory
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    sizes = {e["workers"]: e for e in events if e.get("event") == "autoscale_size"}
    price = next((e.get("cost_rate_per_h") / e["workers"] for e in sizes.values() if e.get("cost_rate_per_h")), 1.0)
    rows: list[dict] = []
    if sizes:
        source = "autoscaler's measurements"
        for k in sorted(sizes):
            rows.append({"workers": k, "throughput": sizes[k]["throughput"]})
    else:
        source = "median step time per worker count (metrics.jsonl)"
        by_k: dict[int, list[float]] = {}
        seen: dict[int, int] = {}
        for s in run["steps"]:
            g = s.get("generation", 0)
            seen[g] = seen.get(g, 0) + 1
            if seen[g] > warmup_steps and s.get("step_time_s", 0) > 0:
                by_k.setdefault(s["workers"], []).append(s["samples"] / s["step_time_s"])
        for k in sorted(by_k):
            rows.append({"workers": k, "throughput": statistics.median(by_k[k])})
    for r in rows:
        r["worker_s_per_1k_samples"] = 1000.0 * r["workers"] / r["throughput"]
        r["cost_per_1k_samples"] = r["worker_s_per_1k_samples"] * price / 3600.0
    settled = [e for e in events if e.get("event") == "autoscale_settled"]
    chosen = settled[-1]["workers"] if settled else (run["steps"][-1]["workers"] if run["steps"] else None)
    return rows, chosen, source


def plot_scaling(run_dirs: list[str], output: str) -> str:
    return save_figure(scaling_figure(run_dirs), output)


def scaling_figure(run_dirs: list[str]) -> Figure:
    fig = new_figure(7 * len(run_dirs), 4.5)
    axes = fig.subplots(1, len(run_dirs), squeeze=False)
    for col, run_dir in enumerate(run_dirs):
        rows, chosen, source = scaling_table(run_dir)
        ax = axes[0][col]
        if not rows:
            ax.set_title(f"{os.path.basename(os.path.normpath(run_dir))}: no measured steps")
            continue
        ks = [r["workers"] for r in rows]
        ax.plot(ks, [r["throughput"] for r in rows], marker="o", color="tab:blue", label="throughput")
        ax.set(xlabel="workers", ylabel="samples/s")
        ax2 = ax.twinx()
        ax2.plot(ks, [r["worker_s_per_1k_samples"] for r in rows], marker="s", linestyle="--", color="tab:orange",
                 label="cost")
        ax2.set_ylabel("worker-seconds per 1,000 samples")
        if chosen in ks:
            r = rows[ks.index(chosen)]
            ax.plot([chosen], [r["throughput"]], marker="*", markersize=18, color="tab:red", linestyle="none",
                    label=f"chosen: {chosen} workers")
            # Toward the middle of the axes: at the largest worker count a label to the right of
            # the marker ran past the axes and was clipped.
            right = chosen == max(ks) and len(ks) > 1
            ax.annotate(f"{chosen} workers\n{r['throughput']:.0f} samples/s", (chosen, r["throughput"]),
                        textcoords="offset points", xytext=(-8 if right else 8, -28), fontsize=8, color="tab:red",
                        ha="right" if right else "left")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        handles = ax.get_legend_handles_labels()
        handles2 = ax2.get_legend_handles_labels()
        ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="lower right")
        ax.set_title(f"{os.path.basename(os.path.normpath(run_dir))}: throughput and cost per worker count\n({source})",
                     fontsize=9)
    return fig


def main(args: argparse.Namespace) -> int:
    if args.step is not None and not args.pipeline:
        raise ValueError("--step goes with --pipeline (the step whose pipeline schedule to draw)")
    if args.pipeline:
        from virtualflow.cli import plot_pipeline

        return plot_pipeline.main(args)
    if args.scaling:
        out = plot_scaling(args.run_dirs, args.output or "scaling.png")
    elif args.breakdown:
        out = plot_breakdown(args.run_dirs, args.output or "breakdown.png")
    elif args.timeline:
        out = plot_timeline(args.run_dirs, args.output or "timeline.png")
    else:
        out = plot_runs(args.run_dirs, args.output or "loss.png")
    print(f"wrote {out}")
    return 0
