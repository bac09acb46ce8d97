"""``virtualflow run FILE.py[:FUNCTION]``: train a job on the local backend or on Ray."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time

from virtualflow.config.options import add_arguments, options_from_args
from virtualflow.plan.flops import describe as describe_throughput
from virtualflow.records.result import TrainingError
from virtualflow.records.rundir import DiskFullError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train a job",
        description="Train the job returned by FUNCTION (default make_job) in FILE.py or a module. "
        "Flags override the job's fields; every option is a field of virtualflow.LaunchOptions.",
    )
    p.add_argument("job", help="FILE.py[:FUNCTION] or package.module[:FUNCTION]; FUNCTION defaults to make_job")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_arguments(p)
    p.set_defaults(func=main)


def default_run_dir(job_spec: str) -> str:
    """``runs/<file>-<YYYYmmdd-HHMMSS>-<6 random hex digits>``: runs started in the same second get
    their own directories (and should two ever meet, the second is refused by the run lock)."""
    stem = os.path.splitext(os.path.basename(job_spec.partition(":")[0]))[0] or "job"
    return os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")


class _Interrupted(KeyboardInterrupt):
    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.reason, self.code = reason, code


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise _Interrupted("terminated (SIGTERM)", 128 + signal.SIGTERM)


def _indent(text: str) -> str:
    return "".join("  " + line for line in text.rstrip("\n").splitlines(keepends=True))


def throughput_line(rates: dict | None) -> str:
    """``throughput: 812 samples/s, 104,000 tokens/s, MFU 31.2% (peak 989 TFLOP/s per worker)``
    over the run's steady steps, or ``""`` when there is none."""
    if not rates or rates.get("samples_per_s") is None:
        return ""
    line = f"throughput: {rates['samples_per_s']:,.1f} samples/s"
    more = describe_throughput(rates)
    if more:
        line += ", " + more
    if rates.get("mfu") is not None:
        line += f" (peak {rates['peak_tflops']:g} TFLOP/s per worker)"
    return line


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: `virtualflow run --help` (and every other verb) answers without torch.
    import virtualflow as vf
    from virtualflow.api import stop_interrupted, wait_restarting
    from virtualflow.backends.ray import RayNotInstalled
    from virtualflow.runtime.dcp import is_dcp

    # --resume RUN_DIR continues that run there; a state file or a step-N.dcp folder starts a new run directory.
    continuing = args.resume and os.path.isdir(args.resume) and not is_dcp(args.resume)
    run_dir = args.run_dir or (args.resume if continuing else default_run_dir(args.job))
    options = options_from_args(args, run_dir=run_dir, progress=not args.no_progress)
    code = 0
    try:
        handle = vf.launch(args.job, options)
        # SIGTERM (a scheduler, `kill`) and Ctrl-C stop at the next step boundary, with the final
        # state written and `stopped` recorded; a second one kills the workers at once.
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            try:
                result, handle = wait_restarting(handle, args.job)
            except _Interrupted as exc:
                result, code = stop_interrupted(handle, exc.reason), exc.code
            except KeyboardInterrupt:
                result, code = stop_interrupted(handle, "interrupted (Ctrl-C)"), 130
        finally:
            signal.signal(signal.SIGTERM, previous)
    except TrainingError as exc:
        print(f"virtualflow run: training failed: {exc}", file=sys.stderr)
        # The worker's traceback under the summary: from the job's own code on, or every frame
        # with --verbose (the worker's log holds it too).
        shown = exc.worker_traceback_full if getattr(args, "verbose", False) else exc.worker_traceback
        if shown:
            print(_indent(shown), file=sys.stderr)
        return 1
    except RayNotInstalled as exc:
        print(f"virtualflow run: error: {exc}", file=sys.stderr)
        return 2
    except DiskFullError as exc:  # before the run started: nothing of it to keep
        print(f"virtualflow run: error: {exc}; free space there, or choose another --run-dir", file=sys.stderr)
        return 1
    if code:
        print(f"stopped at step {result.steps} of {handle.total_steps} ({handle.status()['stop_reason']}); the final "
              f"state is in {run_dir}/final.pt: continue with --resume {run_dir}", file=sys.stderr)
    last = result.history[-1] if result.history else {}
    line = f"done: {result.steps} steps, final loss {last.get('loss', float('nan')):.4f}"
    if result.metrics:
        line += ", " + ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    if result.generations > 1:
        line += f"; {result.generations} generations, {len(result.failures)} worker failure(s) survived"
    print(line)
    if result.stop_reason and not code:  # stopped early by a callback (or stop())
        print(f"stopped early: {result.stop_reason}")
    rates = throughput_line(result.throughput)
    if rates:
        print(rates)
    if result.autoscale is not None:
        a = result.autoscale
        tried = ", ".join(f"{k}: {v['throughput']:.1f}" for k, v in a["sizes"].items() if v["throughput"])
        where = f"settled at {a['settled_at']} workers" if a["settled_at"] else "did not settle"
        print(f"autoscale ({a['policy']}): {where} after {a['resizes']} resize(s); samples/s per worker count: {tried}")
    print(f"run directory: {run_dir} (final.pt, metrics.jsonl, events.jsonl, summary.json)")
    return code
