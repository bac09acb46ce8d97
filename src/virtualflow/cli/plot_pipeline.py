"""``virtualflow plot RUN_DIR --pipeline [--step N] [-o pipeline.png]``: one step's measured
pipeline schedule beside the simulator's prediction for it.

A run with ``Pipeline(record_timeline=True)`` writes ``RUN_DIR/pipeline/timeline-<rank>.jsonl``:
one record per action a worker ran (``kind``, ``stage``, ``mb``, ``step``, wall-clock ``start`` and
``end``, ``rank``, ``replica``, ``stage_rank``, ``generation``). :func:`measure` takes one step of
one pipeline replica from it (default: the last *complete* step of replica 0, so the step after
warm-up when the run has more than one) and :func:`draw` draws it as a Gantt chart, one row per
stage-rank: forward, backward, input-gradient (``I``) and weight-gradient (``W``) work in
distinct colours with the micro-batch id in each bar, sends as thin grey bars, idle time (a
receive waiting for its message, or nothing to do) left white. Beside it, the same schedule
(``p``, ``m``, ``v`` and the schedule's name from ``summary.json``) run through
:func:`virtualflow.plan.pipeline.simulate` with the *measured* per-stage mean ``F``/``B``/``I``/``W``
durations of that step as its times, so the two panels differ only by what the simulator leaves
out (sends are free, nothing else runs on the worker). :func:`report` prints the measured and
predicted step time and each stage-rank's busy time and bubble fraction (idle time over the step
time, as the simulator defines it).

A no-flush schedule (``2bw``, ``async``) runs ``window`` steps as one action list; the step's
whole window is drawn and simulated, and the times are the window's.

Every file read here is untrusted: records that are not well-formed actions are skipped, a
``summary.json`` whose pipeline entry is missing or invalid (a run still going has none) makes
the schedule be inferred from the recorded order of actions. Times are wall-clock, comparable
between the workers of one machine only.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from virtualflow.records.rundir import read_jsonl, read_summary

if TYPE_CHECKING:
    from virtualflow.plan.pipeline import Schedule
    from virtualflow.plan.pipeline.simulate import SimResult

COMPUTE = ("F", "B", "I", "W")
KINDS = COMPUTE + ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
NAMES = {"F": "forward (F)", "B": "backward (B)", "I": "input gradient (I)", "W": "weight gradient (W)"}
SEND_COLOR = "#b8b8b8"
HATCHES = (None, "//", "..", "xx", "\\\\", "++", "oo", "--")
TIMELINE_FILE = re.compile(r"timeline-(\d+)\.jsonl")
NO_TIMELINE = "record it with Pipeline(record_timeline=True)"


@dataclass(frozen=True, slots=True)
class Entry:
    """One recorded action of one worker."""

    kind: str
    stage: int
    mb: int
    step: int
    start: float
    end: float
    replica: int
    stage_rank: int
    generation: int


@dataclass(frozen=True, slots=True)
class PipelineStep:
    """One measured step (or no-flush window) of one pipeline replica, and its prediction."""

    run_dir: str
    step: int
    """The step asked for (or chosen)."""
    first_step: int
    steps: int
    """Steps the drawn action list covers: 1 for flush schedules, the window for 2bw/async."""
    replica: int
    generation: int
    schedule: Schedule
    schedule_source: str
    rows: tuple[tuple[Entry, ...], ...]
    """Per stage-rank, its recorded actions of the step in start order."""
    origin: float
    """Wall-clock time of the step's first action (time 0 of the chart)."""
    step_time: float
    """Measured: last action's end minus first action's start, over the replica's stage-ranks."""
    busy: tuple[float, ...]
    """Measured per stage-rank: seconds of F, B, I and W."""
    send: tuple[float, ...]
    """Measured per stage-rank: seconds spent in sends (the simulator counts them as free)."""
    bubble: tuple[float, ...]
    """Measured per stage-rank: ``1 - busy / step_time``."""
    f_time: tuple[float, ...]
    b_time: tuple[float, ...]
    w_time: tuple[float, ...] | None
    """Per stage: mean measured F, whole backward (B, or I + W) and W durations (seconds)."""
    predicted: SimResult
    order_matches: bool
    """Whether every stage-rank ran its compute actions in the schedule's order."""


# ---- reading ---------------------------------------------------------------------------------
def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**53


def _time(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _entry(rec: dict[str, Any]) -> Entry | None:
    """The action of one record, or None when the record is not a well-formed one."""
    kind = rec.get("kind")
    generation = rec.get("generation", 0)
    ints = [rec.get(k) for k in ("stage", "mb", "step", "replica", "stage_rank")]
    start, end = rec.get("start"), rec.get("end")
    if (not isinstance(kind, str) or kind not in KINDS or not all(_count(x) for x in ints)
            or not _count(generation) or not _time(start) or not _time(end) or end < start):
        return None
    stage, mb, step, replica, stage_rank = ints
    return Entry(kind, stage, mb, step, float(start), float(end), replica, stage_rank, generation)


def read_timeline(run_dir: str) -> list[Entry]:
    """Every well-formed action of ``RUN_DIR/pipeline/timeline-<rank>.jsonl``; a ``ValueError``
    that says how to record one when there is none."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist; pass the --run-dir of a 'virtualflow run'")
    folder = os.path.join(run_dir, "pipeline")
    names = []
    if os.path.isdir(folder) and not os.path.islink(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if TIMELINE_FILE.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
                names.append(path)
    entries = [e for path in names for e in map(_entry, read_jsonl(path)) if e is not None]
    if not entries:
        what = "is empty" if names else "does not exist"
        raise ValueError(f"{run_dir!r} has no pipeline timeline (pipeline/timeline-<rank>.jsonl {what}); "
                         f"{NO_TIMELINE}")
    return entries


def _summary_pipeline(run_dir: str) -> tuple[int, str, int] | None:
    """(stages, schedule, chunks) from summary.json, or None when it has no valid entry."""
    from virtualflow.config.pipeline import Pipeline

    try:
        summary = read_summary(run_dir)
    except ValueError:
        return None
    entry = (summary or {}).get("pipeline")
    if not isinstance(entry, dict):
        return None
    stages, schedule, chunks = entry.get("stages"), entry.get("schedule"), entry.get("chunks", 1)
    if not (_count(stages) and isinstance(schedule, str) and _count(chunks)):
        return None
    try:
        Pipeline(stages=stages, schedule=schedule, chunks=chunks)
    except (ValueError, TypeError):
        return None
    return stages, schedule, chunks


# ---- one step --------------------------------------------------------------------------------
class _Incomplete(ValueError):
    pass


def _schedule(p: int, name: str, v: int, m: int, steps: int) -> Schedule:
    from virtualflow.config.pipeline import Pipeline
    from virtualflow.runtime.pipeline import schedule_for

    return schedule_for(Pipeline(stages=p, schedule=name, chunks=v), m, steps)


def _compute_order(schedule: Schedule, r: int) -> list[tuple[str, int, int]]:
    return [(a.kind, a.stage, a.microbatch) for a in schedule.actions[r] if a.kind in COMPUTE]


def _build(run_dir: str, entries: list[Entry], step: int, replica: int,
           known: tuple[int, str, int] | None) -> PipelineStep:
    at_step = [e for e in entries if e.step == step]
    generation = max(e.generation for e in at_step)
    mine = [e for e in entries if e.generation == generation]
    firsts = {e.mb for e in mine if e.step == step and e.kind == "F" and e.stage == 0}
    if not firsts:
        raise _Incomplete(f"step {step} has no forward of stage 0 in the timeline")
    m = len(firsts)
    first_step = step - min(firsts) // m
    group = [e for e in mine if e.step - e.mb // m == first_step]
    if known is not None:
        p, name, v = known
    else:
        p = 1 + max(e.stage_rank for e in group)
        pieces = 1 + max(e.stage for e in group)
        if pieces % p:
            raise _Incomplete(f"step {step}: {pieces} stages recorded on {p} stage-ranks")
        v, name = pieces // p, None
    # One record per (stage-rank, action): a resumed run appends to the files, keep the latest.
    latest: dict[tuple[int, str, int, int], Entry] = {}
    for e in group:
        if e.stage_rank >= p or e.stage >= p * v or e.stage % p != e.stage_rank:
            continue  # not an action this stage-rank can run
        key = (e.stage_rank, e.kind, e.stage, e.mb)
        if key not in latest or e.start > latest[key].start:
            latest[key] = e
    rows = tuple(tuple(sorted((e for e in latest.values() if e.stage_rank == r), key=lambda e: (e.start, e.end)))
                 for r in range(p))
    steps = len({e.step for e in latest.values()})
    measured = [[(e.kind, e.stage, e.mb) for e in row if e.kind in COMPUTE] for row in rows]

    if name is None:
        source, schedule = _infer(p, v, m, steps, measured, step)
    else:
        source = "from summary.json"
        try:
            schedule = _schedule(p, name, v, m, steps)
        except ValueError as exc:
            raise _Incomplete(f"step {step}: schedule {name!r} with p={p}, m={m}, v={v}: {exc}") from None
    for r in range(p):
        want, got = _compute_order(schedule, r), measured[r]
        if set(got) != set(want):
            missing = len(set(want) - set(got))
            extra = len(set(got) - set(want))
            raise _Incomplete(f"step {step} of replica {replica}: stage-rank {r} recorded {len(got)} of the "
                              f"{len(want)} compute actions {schedule.name} runs"
                              + (f" ({missing} missing)" if missing else "")
                              + (f" ({extra} that it does not run)" if extra else ""))
    order_matches = all(measured[r] == _compute_order(schedule, r) for r in range(p))

    everything = [e for row in rows for e in row]
    origin = min(e.start for e in everything)
    step_time = max(e.end for e in everything) - origin
    busy = tuple(sum(e.end - e.start for e in row if e.kind in COMPUTE) for row in rows)
    send = tuple(sum(e.end - e.start for e in row if e.kind.startswith("SEND")) for row in rows)
    bubble = tuple(1.0 - b / step_time if step_time > 0 else 0.0 for b in busy)

    f_time, b_time, w_time = mean_times(everything, schedule.stages, schedule.split_backward())
    from virtualflow.plan.pipeline.simulate import simulate

    predicted = simulate(schedule, f_time, b_time, w_time)
    return PipelineStep(
        run_dir=run_dir, step=step, first_step=first_step, steps=schedule.steps, replica=replica,
        generation=generation, schedule=schedule, schedule_source=source, rows=rows, origin=origin,
        step_time=step_time, busy=busy, send=send, bubble=bubble, f_time=f_time, b_time=b_time,
        w_time=w_time, predicted=predicted, order_matches=order_matches,
    )


def mean_times(entries: Sequence[Entry], stages: int, split: bool
               ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...] | None]:
    """Per stage: the mean measured forward, whole backward and (split backward) weight-gradient
    durations, as :func:`~virtualflow.plan.pipeline.simulate` takes them: ``b`` is ``B``'s mean, or
    ``I``'s mean plus ``W``'s when the backward is split, and ``w`` is ``W``'s mean (None unsplit)."""
    def mean(kind: str, s: int) -> float:
        xs = [e.end - e.start for e in entries if e.kind == kind and e.stage == s]
        return sum(xs) / len(xs) if xs else 0.0

    f = tuple(mean("F", s) for s in range(stages))
    if split:
        w = tuple(mean("W", s) for s in range(stages))
        return f, tuple(mean("I", s) + w[s] for s in range(stages)), w
    return f, tuple(mean("B", s) for s in range(stages)), None


def _infer(p: int, v: int, m: int, steps: int, measured: list[list[tuple[str, int, int]]],
           step: int) -> tuple[str, Schedule]:
    """The schedule whose compute order every stage-rank followed (no valid summary.json)."""
    from virtualflow.config.pipeline import SCHEDULE_NAMES

    matches: list[Schedule] = []
    for name in SCHEDULE_NAMES:
        if (name == "interleaved_1f1b") != (v > 1):
            continue
        try:
            schedule = _schedule(p, name, v, m, steps)
        except ValueError:
            continue
        if all(measured[r] == _compute_order(schedule, r) for r in range(p)):
            matches.append(schedule)
    if not matches:
        raise _Incomplete(f"step {step}: the run has no summary.json pipeline entry and the recorded order of "
                          f"actions (p={p}, m={m}, v={v}) is no schedule's")
    others = [s.name for s in matches[1:]]
    return ("inferred from the timeline" + (f"; {', '.join(others)} runs the same order" if others else ""),
            matches[0])


def measure(run_dir: str, step: int | None = None, replica: int = 0) -> PipelineStep:
    """Step ``step`` of pipeline replica ``replica`` as recorded in ``run_dir``'s timeline (default:
    its last complete step), with the simulator's prediction for it."""
    entries = [e for e in read_timeline(run_dir) if e.replica == replica]
    if not entries:
        raise ValueError(f"{run_dir!r}: the pipeline timeline has no action of replica {replica}; {NO_TIMELINE}")
    known = _summary_pipeline(run_dir)
    recorded = sorted({e.step for e in entries})
    if step is not None:
        if step not in recorded:
            raise ValueError(f"step {step} is not in {run_dir!r}'s pipeline timeline (replica {replica} has steps "
                             f"{_ranges(recorded)}); pass one of them with --step")
        return _build(run_dir, entries, step, replica, known)
    reason = ""
    for candidate in reversed(recorded):
        try:
            return _build(run_dir, entries, candidate, replica, known)
        except _Incomplete as exc:
            reason = reason or str(exc)
    raise ValueError(f"{run_dir!r}: no step of replica {replica} is complete in the pipeline timeline ({reason})")


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


# ---- text ------------------------------------------------------------------------------------
def _what(ps: PipelineStep) -> str:
    if ps.steps == 1:
        return f"step {ps.step}"
    return f"steps {ps.first_step}-{ps.first_step + ps.steps - 1} (one no-flush window, with step {ps.step})"


def report(ps: PipelineStep) -> str:
    """The measured and predicted step time and, per stage-rank, busy time and bubble fraction."""
    s = ps.schedule
    ms = 1000.0
    lines = [f"{os.path.basename(os.path.normpath(ps.run_dir))}: {_what(ps)}, replica {ps.replica}, generation "
             f"{ps.generation}: {s.name}, p={s.p}, m={s.m}, v={s.v} (schedule {ps.schedule_source})"]
    per_stage = []
    for k in range(s.stages):
        if ps.w_time is None:
            per_stage.append(f"stage {k}: F {ps.f_time[k] * ms:.3f} B {ps.b_time[k] * ms:.3f}")
        else:
            per_stage.append(f"stage {k}: F {ps.f_time[k] * ms:.3f} I {(ps.b_time[k] - ps.w_time[k]) * ms:.3f} "
                             f"W {ps.w_time[k] * ms:.3f}")
    lines.append("mean measured times (ms): " + "; ".join(per_stage))
    lines.append(f"{'stage-rank':>10}  {'measured busy':>13}  {'sends':>9}  {'bubble':>6}  |  "
                 f"{'predicted busy':>14}  {'bubble':>6}")
    for r in range(s.p):
        lines.append(f"{r:>10}  {ps.busy[r] * ms:>10.3f} ms  {ps.send[r] * ms:>6.3f} ms  {ps.bubble[r]:>6.1%}  |  "
                     f"{float(ps.predicted.busy[r]) * ms:>11.3f} ms  {ps.predicted.bubble[r]:>6.1%}")
    what = "step" if ps.steps == 1 else "window"
    per = "" if ps.steps == 1 else (f" ({ps.step_time / ps.steps * ms:.3f} and "
                                    f"{float(ps.predicted.step_time) / ps.steps * ms:.3f} ms per step)")
    lines.append(f"{what} time: measured {ps.step_time * ms:.3f} ms, predicted {float(ps.predicted.step_time) * ms:.3f}"
                 f" ms{per} (simulated with the mean times above; sends free)")
    if not ps.order_matches:
        lines.append(f"note: the recorded order of actions differs from {s.name}'s on some stage-rank")
    return "\n".join(lines)


# ---- drawing ---------------------------------------------------------------------------------
def draw(ps: PipelineStep, output: str) -> str:
    """The measured chart and the predicted one side by side, on one shared time axis (ms)."""
    from matplotlib.patches import Patch

    from virtualflow.cli.figures import new_figure

    s = ps.schedule
    measured = [[(e.kind, e.stage, e.mb, e.start - ps.origin, e.end - ps.origin) for e in row] for row in ps.rows]
    predicted = [[(sl.action.kind, sl.action.stage, sl.action.microbatch, float(sl.start), float(sl.end))
                  for sl in row] for row in ps.predicted.timeline]
    span = max(ps.step_time, float(ps.predicted.step_time)) * 1000.0 or 1.0
    fig = new_figure(15, 1.6 + 0.55 * s.p)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, 2, sharex=True)  # own y tick labels: each panel its bubbles
    panels = (
        (axes[0], measured, ps.step_time, ps.bubble,
         f"measured: {_what(ps)}, replica {ps.replica} ({s.name}, p={s.p}, m={s.m}, v={s.v})"),
        (axes[1], predicted, float(ps.predicted.step_time), ps.predicted.bubble,
         "predicted: simulate() with the measured per-stage mean times"),
    )
    for ax, rows, total, bubbles, title in panels:
        for r, row in enumerate(rows):
            _draw_row(ax, r, row, s.p, s.v, span)
        ax.axvline(total * 1000.0, color="black", linestyle="--", linewidth=0.8)
        what = "step" if ps.steps == 1 else "window"
        ax.set_title(f"{title}\n{what} time {total * 1000.0:.2f} ms", fontsize=9)
        ax.set_xlabel("ms since the first action")
        ax.grid(axis="x", alpha=0.3)
        ax.set_yticks(range(s.p))
        ax.set_yticklabels([f"stage-rank {r}\nbubble {b:.0%}" for r, b in enumerate(bubbles)], fontsize=8)
        ax.set_ylim(s.p - 0.5, -0.5)  # stage-rank 0 on top
    axes[0].set_xlim(0, span * 1.02)
    kinds = [k for k in COMPUTE if any(a.kind == k for acts in s.actions for a in acts)]
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", linewidth=0.3, label=NAMES[k]) for k in kinds]
    if s.v > 1:
        handles += [Patch(facecolor="white", edgecolor="black", hatch=HATCHES[c % len(HATCHES)], linewidth=0.3,
                          label=f"chunk {c}") for c in range(s.v)]
    handles += [Patch(facecolor=SEND_COLOR, label="send"),
                Patch(facecolor="white", edgecolor="black", linewidth=0.3, label="idle (waiting)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    return output


def _draw_row(ax: Any, y: int, row: list[tuple[str, int, int, float, float]], p: int, v: int, span: float) -> None:
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    sends: list[tuple[float, float]] = []
    for kind, stage, mb, start, end in row:
        left, width = start * 1000.0, (end - start) * 1000.0
        if kind.startswith("SEND"):
            sends.append((left, width))
            continue
        if kind not in COMPUTE:
            continue  # a receive: waiting, drawn as idle
        groups.setdefault((kind, stage // p), []).append((left, width))
        label = str(mb)
        if width >= span * 0.011 * len(label):
            ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=6,
                    color="white" if kind != "W" else "black", clip_on=True)
    for (kind, chunk), bars in groups.items():
        lefts, widths = zip(*bars)
        ax.barh([y] * len(bars), widths, left=lefts, height=0.8, color=COLORS[kind], edgecolor="black",
                linewidth=0.3, hatch=HATCHES[chunk % len(HATCHES)] if v > 1 else None)
    if sends:
        lefts, widths = zip(*sends)
        ax.barh([y] * len(sends), widths, left=lefts, height=0.25, color=SEND_COLOR, linewidth=0)


def plot_pipeline(run_dir: str, output: str, step: int | None = None) -> tuple[str, str]:
    """Measure ``run_dir``'s step ``step`` (default: the last complete one), draw it to
    ``output``; returns the image's path and the :func:`report` text."""
    ps = measure(run_dir, step)
    text = report(ps)
    return draw(ps, output), text


def main(args: argparse.Namespace) -> int:
    """``virtualflow plot RUN_DIR --pipeline``: prints the report, writes the image."""
    if len(args.run_dirs) != 1:
        raise ValueError(f"--pipeline draws one run's schedule; pass one RUN_DIR (got {len(args.run_dirs)})")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step {args.step} must be a step number (>= 0)")
    out, text = plot_pipeline(args.run_dirs[0], args.output or "pipeline.png", args.step)
    print(text)
    print(f"wrote {out}")
    return 0
