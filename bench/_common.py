"""Shared pieces of the benchmarks: the workload, memory probes, statistics, result files.

The workload is one MLP (512 -> 1024 -> 1024 -> 1024 -> 10, ReLU, 2.6 M parameters) trained with
SGD + momentum on a synthetic classification set of 8,192 samples. On one core of this kind of
machine a step over a global batch of 256 takes tens of milliseconds, so per-step fixed costs
are measured honestly without dominating.

Memory: a process's *own* peak resident memory is ``VmHWM`` in ``/proc/self/status``.
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is NOT: on Linux it is carried across
``fork``/``vfork`` + ``exec``, so a child started by a process holding 400 MiB reports at least
400 MiB. Both are recorded; comparisons use VmHWM.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
DATASET_SIZE = 8192
SEED = 0

# --------------------------------------------------------------------------------------------
# The workload (module-level functions: worker processes import them).


def bench_data() -> TensorDataset:
    """8,192 samples of 512 features, labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET_SIZE, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def memory_metrics(model: nn.Module) -> dict[str, float]:
    """Used as ``Job.evaluate``: runs once, on rank 0, after the last step; reports the
    worker's own peak RSS (VmHWM), which ``Result.peak_rss_mib`` does not give (see above)."""
    return {"vmhwm_mib": vmhwm_mib(), "ru_maxrss_mib": ru_maxrss_mib()}


def param_count() -> int:
    return sum(p.numel() for p in mlp().parameters())


# --------------------------------------------------------------------------------------------
# Memory.


def _status_field(pid: int | str, name: str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(rf"^{name}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) / 1024.0 if m else float("nan")
    except OSError:
        return float("nan")


def vmhwm_mib(pid: int | str = "self") -> float:
    """Peak resident set of the process itself (not inherited across exec)."""
    return _status_field(pid, "VmHWM")


def ru_maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


class PeakPoller:
    """Polls ``VmHWM`` of some processes from outside (every ``period_s``) until stopped.

    VmHWM is monotonic, so the last value read before a process exits is (nearly) its peak.
    """

    def __init__(self, pids_fn, period_s: float = 0.2) -> None:
        self._pids_fn = pids_fn
        self._period_s = period_s
        self.peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                pids = self._pids_fn()
            except Exception:
                continue
            for key, pid in pids.items():
                v = vmhwm_mib(pid)
                if v == v:  # not NaN: the process still exists
                    self.peak_mib[key] = max(v, self.peak_mib.get(key, 0.0))


# --------------------------------------------------------------------------------------------
# Child processes (the PyTorch references run in fresh interpreters, like virtualflow workers).


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def run_child(args: Sequence[str], threads: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``python ARGS`` in a fresh process; its last stdout line is a JSON object."""
    proc = subprocess.run(
        [sys.executable, *args], env=child_env(threads), capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Statistics and reporting.


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        vf_version = version("virtualflow")
    except Exception:
        vf_version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:
        commit = ""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "virtualflow": vf_version,
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def banner(title: str) -> str:
    env = environment()
    return (
        f"{title}\n"
        f"  {env['cpu_count']}-core CPU machine ({env['cpu_model']}), no GPU; {env['platform']}\n"
        f"  python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} ({env['git_commit']})\n"
        f"  Real-compute ratios at equal thread/worker counts; machine noise is cancelled by interleaving runs."
    )


def env_markdown() -> str:
    env = environment()
    return (
        f"Hardware: {env['cpu_count']}-core CPU machine, {env['cpu_model']}, no GPU ({env['platform']}).  \n"
        f"Versions: python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} "
        f"(commit {env['git_commit']}), {env['date']}."
    )


def write_results(name: str, payload: dict[str, Any], markdown: str) -> tuple[str, str]:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    json_path = os.path.join(RESULTS_DIR, f"{name}.json")
    md_path = os.path.join(RESULTS_DIR, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown.rstrip() + "\n")
    return json_path, md_path


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def state_max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
