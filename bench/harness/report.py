"""Statistics, run-directory readers, hardware and versions, tables, targets (met / NO, the
exit status), the common command line and a run's result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from bench.harness.paths import BENCH_DIR, QUICK_RESULTS_DIR, RESULTS_DIR


# --------------------------------------------------------------------------------------------
# Statistics.


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1])."""
    if not xs:
        return float("nan")
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def p25(xs: Sequence[float]) -> float:
    return quantile(xs, 0.25)


def paired_ratios(a_runs: Sequence[Sequence[float]], b_runs: Sequence[Sequence[float]], warmup: int,
                  stat: Callable[[Sequence[float]], float] = median) -> list[float]:
    """stat(a's post-warm-up step times) / stat(b's), for each interleaved pair of runs."""
    return [stat(a[warmup:]) / stat(b[warmup:]) for a, b in zip(a_runs, b_runs)]


def state_max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --------------------------------------------------------------------------------------------
# Run directories (metrics.jsonl, events.jsonl) of jobs the benchmark launched.


def read_jsonl(path: str) -> list[dict]:
    from virtualflow.records.rundir import read_jsonl as read

    return read(path)


def run_metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def run_events(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "events.jsonl"))


def wait_steps(handle, run_dir: str, n: int, *, generation: int | None = None, timeout_s: float = 300.0) -> list[dict]:
    """Block until ``n`` steps (of ``generation`` if given) are in metrics.jsonl; returns its lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = run_metrics(run_dir)
        have = [m for m in lines if generation is None or m["generation"] == generation]
        if len(have) >= n:
            return lines
        if handle.done:
            handle.wait(0)  # raises the job's error, if any
            raise RuntimeError(f"the job ended after {len(lines)} steps, before {n} steps were seen")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(have)} of {n} steps after {timeout_s} s in {run_dir}")
        time.sleep(0.05)


def steady_median(times: Sequence[float], warmup: int = 2) -> float:
    """Median step time with the first ``warmup`` steps left out when there are more."""
    return median(list(times[warmup:]) or list(times))


def normal_before(old: list[dict], t_request: float) -> float:
    """A normal step of the old generation: the median before the request, its first two steps
    left out (all of the generation's steps when fewer are left)."""
    before = [m["step_time_s"] for m in old if m["time"] <= t_request][2:]
    return median(before or [m["step_time_s"] for m in old])


def pause_of(metrics: list[dict], events: list[dict], gen_old: int, gen_new: int, t_request: float) -> dict:
    """The pause of an in-place change from ``gen_old`` to ``gen_new``: the gap between the last
    old-generation step and the first new one, minus a normal step (the old generation's median
    before the request, or the new generation's); ``idle`` = the gap minus the first new step's
    own time (the survivors train nothing)."""
    old = [m for m in metrics if m["generation"] == gen_old]
    new = [m for m in metrics if m["generation"] == gen_new]
    normal_old = normal_before(old, t_request)
    normal_new = steady_median([m["step_time_s"] for m in new])
    gap = new[0]["time"] - old[-1]["time"]
    formed = next(e for e in events if e["event"] == "formed" and e["generation"] == gen_new)
    ready = [e for e in events if e["event"] == "ready" and e["time"] >= t_request]
    return {
        "gap_s": gap, "normal_step_old_s": normal_old, "normal_step_new_s": normal_new,
        "pause_s": gap - normal_old, "pause_vs_new_s": gap - normal_new,
        "pause_judged_s": gap - min(normal_old, normal_new),
        "idle_s": gap - new[0]["step_time_s"],
        "first_new_step_time_s": new[0]["step_time_s"], "boundary_step": old[-1]["step"],
        "formed_pause_s": formed["pause_s"], "group_s": formed["group_s"], "transfer_s": formed["transfer_s"],
        "transfer_bytes": formed["transfer_bytes"],
        "newcomer_startup_s": ready[0]["startup_s"] if ready else None,
        "request_to_boundary_s": old[-1]["time"] - t_request,
    }


def restart_pause(old_handle, old_dir: str, new_dir: str, after: int,
                  relaunch: Callable[[str, str], Any]) -> tuple[Any, dict]:
    """The restart way (torchrun/TorchElastic, Ray Train): stop ``old_handle`` (its state at that
    step boundary is written to final.pt), then ``relaunch(new_dir, resume_path)`` on fresh
    processes; the pause is measured like :func:`pause_of` (``judged``: the smaller reading)."""
    gen = run_metrics(old_dir)[-1]["generation"]
    t_request = time.time()
    old_handle.stop(timeout_s=120)
    t_stopped = time.time()
    old = [m for m in run_metrics(old_dir) if m["generation"] == gen]
    handle = relaunch(new_dir, os.path.join(old_dir, "final.pt"))
    t_launched = time.time()
    lines = wait_steps(handle, new_dir, after)
    normal_old = normal_before(old, t_request)
    normal_new = median([m["step_time_s"] for m in lines[2:]])
    gap = lines[0]["time"] - old[-1]["time"]
    return handle, {
        "gap_s": gap, "normal_step_old_s": normal_old, "normal_step_new_s": normal_new,
        "pause_s": gap - normal_old, "pause_vs_new_s": gap - normal_new,
        "pause_judged_s": gap - max(normal_old, normal_new),  # the restart's most favourable reading
        "from_request_s": lines[0]["time"] - t_request, "idle_s": gap - lines[0]["step_time_s"],
        "boundary_step": old[-1]["step"], "resumed_step": lines[0]["step"],
        "stop_returned_after_boundary_s": t_stopped - old[-1]["time"],
        "launch_call_s": t_launched - t_stopped,
        "launch_to_first_step_s": lines[0]["time"] - t_launched,
    }


# --------------------------------------------------------------------------------------------
# Hardware, versions, the code measured.


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(args: Sequence[str], cwd: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001 - no git, or not a checkout
        return None


def vf_source() -> dict[str, Any]:
    """Which virtualflow code is measured: its path, and its git commit / uncommitted edits."""
    import virtualflow

    path = os.path.dirname(os.path.abspath(virtualflow.__file__))
    info: dict[str, Any] = {"path": path, "snapshot_of": os.environ.get("VF_BENCH_SNAPSHOT_OF")}
    rev = _git(["rev-parse", "--short", "HEAD"], path)
    if rev is not None and rev.returncode == 0:
        dirty = _git(["status", "--porcelain", "--", "."], path)
        info.update(commit=rev.stdout.strip(), uncommitted_changes=bool(dirty and dirty.stdout.strip()))
    return info


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        vf_version = version("virtualflow")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        vf_version = "unknown"
    rev = _git(["rev-parse", "--short", "HEAD"], BENCH_DIR)
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "virtualflow": vf_version,
        "git_commit": rev.stdout.strip() if rev is not None else "",
        "virtualflow_source": vf_source(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def describe_source(s: dict[str, Any] | None = None) -> str:
    s = s or vf_source()
    if s.get("commit"):
        return f"{s['path']} at {s['commit']}" + (" + uncommitted edits" if s.get("uncommitted_changes") else "")
    if s.get("snapshot_of"):
        return f"snapshot of {s['snapshot_of']} ({s['path']})"
    return s["path"]


def banner(title: str) -> str:
    env = environment()
    return (
        f"{title}\n"
        f"  {env['cpu_count']}-core CPU machine ({env['cpu_model']}), no GPU; {env['platform']}\n"
        f"  python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} from {describe_source()}"
    )


def env_markdown(env: dict[str, Any] | None = None) -> str:
    env = env or environment()
    return (
        f"Hardware: {env['cpu_count']}-core CPU machine, {env['cpu_model']}, no GPU ({env['platform']}).  \n"
        f"Versions: python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} "
        f"from {describe_source(env['virtualflow_source'])}, {env['date']}."
    )


# --------------------------------------------------------------------------------------------
# Tables.


def md_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c).replace("**", "") for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(r, widths))

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def mib(bytes_: float) -> str:
    """``bytes_`` in MiB with one decimal and the unit: ``"12.5 MiB"``."""
    return f"{bytes_ / 2 ** 20:.1f} MiB"


def ms(seconds: float | None, digits: int = 1, none: str = "") -> str:
    """``seconds`` in milliseconds with ``digits`` decimals, no unit; ``none`` for None."""
    return none if seconds is None else f"{1e3 * seconds:.{digits}f}"


def num(x: float | None, fmt: str = ".3f", none: str = "-") -> str:
    """``x`` formatted with ``fmt``; ``none`` for None (a value not measured)."""
    return none if x is None else format(x, fmt)


def yes_no(ok: bool) -> str:
    return "yes" if ok else "NO"


# --------------------------------------------------------------------------------------------
# Targets.


@dataclass(slots=True)
class Check:
    label: str
    met: bool
    value: float | None = None
    rule: str = ""
    key: str | None = None

    def line(self) -> str:
        detail = " ".join(x for x in ("" if self.value is None else f"{self.value:.4g}", self.rule) if x)
        return f"  {'met' if self.met else 'NO ':3s}  {self.label}" + (f": {detail}" if detail else "")


@dataclass
class Targets:
    """The targets a benchmark checks. ``overrides`` (from ``--target KEY=LIMIT``) replace the
    limit of the checks with that key."""

    overrides: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    used: set[str] = field(default_factory=set)

    def limit(self, key: str, default: float) -> float:
        self.used.add(key)
        return self.overrides.get(key, default)

    def at_most(self, key: str, label: str, value: float, limit: float, unit: str = "") -> bool:
        lim = self.limit(key, limit)
        met = value == value and value <= lim  # NaN never meets a target
        self.checks.append(Check(label, met, value, f"(target <= {lim:g}{unit}; --target {key}=...)", key))
        return met

    def at_least(self, key: str, label: str, value: float, limit: float, unit: str = "") -> bool:
        lim = self.limit(key, limit)
        met = value == value and value >= lim
        self.checks.append(Check(label, met, value, f"(target >= {lim:g}{unit}; --target {key}=...)", key))
        return met

    def holds(self, label: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(label, bool(ok), None, detail))
        return bool(ok)

    @property
    def all_met(self) -> bool:
        return all(c.met for c in self.checks)

    def unknown_overrides(self) -> list[str]:
        return sorted(set(self.overrides) - self.used)

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]

    def markdown(self) -> str:
        return "\n".join(f"- {'met' if c.met else '**NO**'}: {c.label}"
                         + ("" if c.value is None else f": {c.value:.4g}") + (f" {c.rule}" if c.rule else "")
                         for c in self.checks)

    def as_json(self) -> list[dict[str, Any]]:
        return [{"label": c.label, "met": c.met, "value": c.value, "rule": c.rule, "key": c.key}
                for c in self.checks]


def parse_overrides(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise ValueError(f"--target {item!r} must be KEY=NUMBER, e.g. --target time_ratio=0.5")
    return out


# --------------------------------------------------------------------------------------------
# Command line and the run's life cycle.


def parser(doc: str, *, reps: int | None = None, reps_help: str = "repetitions",
           quiet_wait: float | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """The flags every benchmark has (``--quick``, ``--out``, ``--name``, ``--target``), plus
    ``--reps`` and ``--quiet-wait`` with the benchmark's defaults when it takes them. ``prog``: the
    name in the usage line (a benchmark package passes ``python -m bench.NAME``: argparse would
    say ``__main__.py``)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n")[0],
                                epilog="Run from the repository root: python -m bench.NAME [--quick] ...")
    p.add_argument("--quick", action="store_true", help="a short run (results go to bench/results/quick/)")
    p.add_argument("--out", default=None,
                   help="directory for the result files (default bench/results, with --quick bench/results/quick)")
    p.add_argument("--name", default=None, help="stem of the result files (default: the benchmark's name)")
    p.add_argument("--target", action="append", default=[], metavar="KEY=LIMIT",
                   help="replace a target's limit (each target prints its key); e.g. an impossible limit to "
                        "check that a missed target exits non-zero")
    if reps is not None:
        p.add_argument("--reps", type=int, default=reps, help=reps_help)
    if quiet_wait is not None:
        p.add_argument("--quiet-wait", type=float, default=quiet_wait,
                       help="wait up to this many seconds for a quiet machine before each measurement (0: do not)")
    return p


class Run:
    """One benchmark invocation: its targets, its start time, where its results go."""

    def __init__(self, name: str, args: argparse.Namespace, target_keys: Sequence[str] = ()) -> None:
        """``target_keys``: the keys of the benchmark's targets, so that a mistyped ``--target``
        stops the run at once (exit 2) rather than after it."""
        self.name = args.name or name
        self.args = args
        self.quick = bool(getattr(args, "quick", False))
        self.out_dir = args.out or (QUICK_RESULTS_DIR if self.quick else RESULTS_DIR)
        try:
            overrides = parse_overrides(getattr(args, "target", []))
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        unknown = sorted(set(overrides) - set(target_keys)) if target_keys else []
        if unknown:
            raise SystemExit(f"error: --target: {name} has no target {', '.join(unknown)}; its keys are "
                             f"{', '.join(target_keys)}")
        self.targets = Targets(overrides)
        self.t_start = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t_start

    def path(self, suffix: str) -> str:
        """A result file of this run, e.g. ``run.path(".json")`` or ``run.path("_cdf.png")``."""
        os.makedirs(self.out_dir, exist_ok=True)
        return os.path.join(self.out_dir, f"{self.name}{suffix}")

    def command(self, module: str, extra: str = "") -> str:
        """How to reproduce this run (for the markdown)."""
        return f"OMP_NUM_THREADS=1 .venv/bin/python -m bench.{module}{' --quick' if self.quick else ''}{extra}"

    def finish(self, payload: dict[str, Any], markdown: str, *,
               dump: Callable[[Any], str] | None = None) -> int:
        """Write the JSON and markdown (with the target checks), print every target with met/NO,
        and return the exit status: 0 all met, 1 a target missed, 2 a ``--target`` key unused."""
        t = self.targets
        payload["target_checks"] = t.as_json()
        payload["all_targets_met"] = t.all_met
        payload.setdefault("wall_time_s", self.elapsed_s)
        md = markdown.rstrip() + "\n\n## Target checks\n\n" + (t.markdown() or "(none)") + "\n"
        jp, mp = self.path(".json"), self.path(".md")
        with open(jp, "w") as f:
            f.write(dump(payload) if dump else json.dumps(payload, indent=2))
            f.write("\n")
        with open(mp, "w") as f:
            f.write(md)
        print(f"\nwrote {jp} and {mp} ({self.elapsed_s:.0f} s)")
        print(f"targets of {self.name}{' (quick run)' if self.quick else ''}:")
        print("\n".join(t.lines()) or "  (none)")
        unknown = t.unknown_overrides()
        if unknown:
            print(f"--target: no check has the key(s) {', '.join(unknown)}; the keys are "
                  f"{', '.join(sorted(t.used)) or '(none)'}")
            return 2
        print("all targets met" if t.all_met else "TARGET MISSED: exit status 1")
        return 0 if t.all_met else 1
