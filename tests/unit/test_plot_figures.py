"""What the plots say (issue 26): titles name the worker counts a run went through, labels stay
inside the figure, and several runs' breakdowns share one y-axis. Synthetic run directories, no
training."""

from __future__ import annotations

import json
import os

import pytest

from test_rundir import write_synthetic_run

pytest.importorskip("matplotlib")


def _draw(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    fig.tight_layout()
    canvas.draw()
    return canvas.get_renderer()


def _inside(inner, outer, slack: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack and inner.x1 <= outer.x1 + slack
            and inner.y1 <= outer.y1 + slack)


def test_title_names_the_worker_counts_after_resizes(tmp_path):
    from virtualflow.cli.plot import load_run, timeline_figure, workers_label

    run_dir = str(tmp_path / "cli")
    write_synthetic_run(run_dir)  # 1 -> 2 -> 3 -> 2 workers; summary.json says 2
    assert load_run(run_dir)["label"] == "cli (1\u21922 workers (1\u20133 on the way))"
    fig = timeline_figure([run_dir])
    assert fig.axes[0].get_title().startswith("cli (1\u21922 workers")
    assert workers_label([{"workers": 2}, {"workers": 3}], {}) == "2\u21923 workers"
    assert workers_label([{"workers": 1}] * 3, {}) == "1 worker"
    assert workers_label([], {"workers": 4}) == "4 workers"


def test_timeline_and_scaling_labels_are_not_clipped(tmp_path):
    from virtualflow.cli.plot import scaling_figure, timeline_figure

    run_dir = str(tmp_path / "run")
    write_synthetic_run(run_dir)
    # The autoscaler settled at its largest size: the label at the right edge.
    with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": "autoscale_settled", "workers": 3}) + "\n")
    for fig in (timeline_figure([run_dir]), scaling_figure([run_dir])):
        renderer = _draw(fig)
        texts = [(ax, t) for ax in fig.axes for t in ax.texts]
        assert texts
        for ax, t in texts:  # inside their own axes: not over the title, the other axis or the edge
            assert _inside(t.get_window_extent(renderer), ax.get_window_extent(renderer)), t.get_text()


def _breakdown_run(run_dir: str, compute_s: float) -> None:
    os.makedirs(run_dir, exist_ok=True)
    zero = {k: 0.0 for k in ("input_s", "reduction_s", "straggler_s", "optimizer_s", "overhead_s", "control_s",
                             "loaded_s")}
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(1, 6):
            parts = [{"worker": w, **zero, "forward_s": compute_s, "backward_s": compute_s, "step_s": 2 * compute_s,
                      "read_calls": 0, "read_bytes": 0} for w in range(2)]
            f.write(json.dumps({"step": step, "loss": 1.0, "samples": 8, "step_time_s": 2 * compute_s, "workers": 2,
                                "generation": 0, "breakdown": parts, "breakdown_step": step - 1}) + "\n")
    open(os.path.join(run_dir, "events.jsonl"), "w").close()


def test_breakdown_of_several_runs_shares_one_y_axis(tmp_path):
    from virtualflow.cli.plot import breakdown_figure

    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    _breakdown_run(fast, 0.001)
    _breakdown_run(slow, 0.050)
    fig = breakdown_figure([fast, slow])
    _draw(fig)
    limits = {ax.get_ylim() for ax in fig.axes if ax.axison}
    assert len(limits) == 1 and next(iter(limits))[1] >= 100.0  # the slow run's 100 ms fits every panel
