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
    """Used as ``Job.evaluate``: runs once, on rank 0, after the last step (before the final state
    is written); reports the worker's own peak RSS (VmHWM) and ru_maxrss (see above)."""
    return {"vmhwm_mib": vmhwm_mib(), "ru_maxrss_mib": ru_maxrss_mib(), "minor_faults": float(minor_faults())}


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
# Machine load. Other work on this 2-core machine (a test suite, another benchmark) would be
# measured as our step time: wait for a quiet machine before each run and record how much CPU
# everything else used while it ran.


def _machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (all cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (workers, reference processes)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def wait_for_quiet(max_wait_s: float = 180.0, busy_cores: float = 0.15, sample_s: float = 1.0) -> float:
    """Wait until the machine's other load is below ``busy_cores`` over a ``sample_s`` window
    (at most ``max_wait_s``); returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        b0, o0 = _machine_busy_s(), _own_cpu_s()
        time.sleep(sample_s)
        busy = (_machine_busy_s() - b0) - (_own_cpu_s() - o0)
        waited = time.perf_counter() - t0
        if busy / sample_s < busy_cores or waited >= max_wait_s:
            return waited


class LoadMeter:
    """CPU used by processes other than ours while the block ran, in cores (0 = quiet machine)."""

    def __enter__(self) -> "LoadMeter":
        self._t0, self._b0, self._o0 = time.perf_counter(), _machine_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        other = (_machine_busy_s() - self._b0) - (_own_cpu_s() - self._o0)
        self.other_cores = max(0.0, other) / wall if wall > 0 else 0.0


def run_pair(runners: dict[str, Any], order: Sequence[str], *, max_other_cores: float, retries: int,
             quiet_wait_s: float, label: str) -> dict[str, dict]:
    """Run each of ``runners`` once, in ``order``, on a quiet machine; repeat the pair (up to
    ``retries`` times) when other processes used more than ``max_other_cores`` during it."""
    for attempt in range(retries + 1):
        waited = wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else 0.0
        runs = {}
        for which in order:
            with LoadMeter() as meter:
                runs[which] = runners[which]()
            runs[which]["other_load_cores"] = meter.other_cores
            runs[which]["waited_for_quiet_s"] = waited
            runs[which]["attempt"] = attempt
        load = max(r["other_load_cores"] for r in runs.values())
        if load <= max_other_cores or attempt == retries:
            if load > max_other_cores:
                print(f"  {label}: other processes used {load:.2f} cores during this pair (kept: out of retries)")
            return runs
        print(f"  {label}: other processes used {load:.2f} cores during this pair: repeating it", flush=True)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# The C allocator. With glibc's defaults, freed blocks above the (dynamic) mmap threshold and
# free memory at the top of the heap go back to the OS, and touching them again costs page
# faults: measured here, 1,000-25,000 minor faults per step of this workload, varying from one
# process to the next with the allocator's history, which moves a process's median step time by
# 10-50% (more than any effect measured). "stable" mode gives every training process (virtualflow
# workers and the PyTorch references alike) the same settings that keep memory in the process:
# identical conditions on both sides, no faults in the steady state, much less noise.

MALLOC_STABLE = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


def apply_malloc_mode(mode: str) -> dict[str, str]:
    """Set (for child processes, which inherit the environment) the allocator settings of ``mode``."""
    if mode == "stable":
        for k, v in MALLOC_STABLE.items():
            os.environ.setdefault(k, v)
    elif mode == "default":
        for k in MALLOC_STABLE:
            os.environ.pop(k, None)
    else:
        raise ValueError(f"malloc mode {mode!r} must be 'stable' or 'default'")
    return {k: os.environ[k] for k in MALLOC_STABLE if k in os.environ}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1])."""
    if not xs:
        return float("nan")
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def paired_ratios(a_runs: Sequence[Sequence[float]], b_runs: Sequence[Sequence[float]], warmup: int,
                  stat=median) -> list[float]:
    """stat(a's post-warm-up step times) / stat(b's), for each interleaved pair of runs."""
    return [stat(a[warmup:]) / stat(b[warmup:]) for a, b in zip(a_runs, b_runs)]


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
        "virtualflow_source": vf_source(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def vf_source() -> dict[str, Any]:
    """Which virtualflow code is measured: its path, and its git commit / uncommitted edits."""
    import virtualflow

    path = os.path.dirname(os.path.abspath(virtualflow.__file__))
    info: dict[str, Any] = {"path": path, "snapshot_of": os.environ.get("VF_BENCH_SNAPSHOT_OF")}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                             timeout=10)
        if rev.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=path, capture_output=True,
                                   text=True, timeout=10).stdout.strip()
            info.update(commit=rev.stdout.strip(), uncommitted_changes=bool(dirty))
    except Exception:
        pass
    return info


def describe_source() -> str:
    s = vf_source()
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
        f"  python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} from {describe_source()}\n"
        f"  Real-compute ratios at equal thread/worker counts; machine noise is cancelled by interleaving runs."
    )


def env_markdown() -> str:
    env = environment()
    return (
        f"Hardware: {env['cpu_count']}-core CPU machine, {env['cpu_model']}, no GPU ({env['platform']}).  \n"
        f"Versions: python {env['python']}, torch {env['torch']}, virtualflow {env['virtualflow']} "
        f"from {describe_source()}, {env['date']}."
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


def bench_job(name: str, virtual_nodes: int):
    """The job both benchmarks train: the MLP on bench_data, B=256. ``memory_metrics`` runs as
    the evaluation after the last step (and every VF_BENCH_EVAL_EVERY steps): VmHWM, faults."""
    import virtualflow as vf

    return vf.Job(
        model=mlp,
        optimizer=sgd,
        loss=cross_entropy,
        dataset=bench_data,
        global_batch_size=256,
        virtual_nodes=virtual_nodes,
        seed=SEED,
        evaluate=memory_metrics,
        eval_every=int(os.environ.get("VF_BENCH_EVAL_EVERY", "0")) or None,
        name=name,
    )
