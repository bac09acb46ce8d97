"""``virtualflow plot RUN_DIR [RUN_DIR ...] -o loss.png``: training curves of one or more runs.

Loss per step (and, when the job evaluates, each evaluation metric) of every run on one
figure, so that runs on 1, 2 and 4 workers can be seen to train the same model. Needs
matplotlib (``pip install virtualflow[plot]``).
"""

from __future__ import annotations

import argparse
import json
import os


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot loss and evaluation curves of runs",
                       description="Plot loss (and evaluation metric) curves of one or several runs.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default="loss.png", help="image file to write (default loss.png)")
    p.set_defaults(func=main)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_run(run_dir: str) -> dict:
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise ValueError(f"{run_dir!r} is not a virtualflow run directory (no metrics.jsonl); "
                         f"pass the --run-dir of a 'virtualflow run'")
    steps = read_jsonl(metrics_path)
    evals = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e.get("event") == "eval"]
    summary = {}
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    workers = summary.get("workers") or (steps[0]["workers"] if steps else "?")
    label = f"{os.path.basename(os.path.normpath(run_dir))} ({workers} worker{'s' if workers != 1 else ''})"
    return {"label": label, "steps": steps, "evals": evals}


def plot_runs(run_dirs: list[str], output: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("plotting needs matplotlib: pip install 'virtualflow[plot]'") from exc
    runs = [load_run(d) for d in run_dirs]
    metric_names = sorted({k for r in runs for e in r["evals"] for k in e["metrics"]})
    n = 1 + len(metric_names)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.2), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        ax = axes[0][0]
        ax.plot([s["step"] for s in run["steps"]], [s["loss"] for s in run["steps"]],
                linestyle=styles[i % len(styles)], linewidth=1.4, label=run["label"])
        for j, name in enumerate(metric_names, start=1):
            pts = [(e["step"], e["metrics"][name]) for e in run["evals"] if name in e["metrics"]]
            if pts:
                axes[0][j].plot(*zip(*pts), marker="o", linestyle=styles[i % len(styles)], label=run["label"])
    axes[0][0].set(title="training loss", xlabel="step", ylabel="loss")
    axes[0][0].set_yscale("log")
    for j, name in enumerate(metric_names, start=1):
        axes[0][j].set(title=f"evaluation: {name}", xlabel="step", ylabel=name)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(args: argparse.Namespace) -> int:
    out = plot_runs(args.run_dirs, args.output)
    print(f"wrote {out}")
    return 0
