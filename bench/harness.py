"""What every benchmark shares: workloads, the machine-load meter, interleaved pairs, child
processes, run-directory readers, targets, and the result files.

Invariants:

* A benchmark runs as ``python -m bench.NAME`` from the repository root. Nothing here edits
  ``sys.path``: virtualflow gives worker processes the launcher's ``sys.path`` (which holds the
  repository root under ``-m``), and child processes are started as ``python -m bench.NAME`` in
  the repository root. This module imports nothing from ``bench``, ``tests`` or ``examples``, so a
  worker can import its job factories (``mlp_job``, ``resize_job_1m``, ...) on their own.
* Every benchmark checks its targets through :class:`Targets`; :meth:`Run.finish` prints each
  one with "met" or "NO" and returns the exit status: 1 when any target is missed, also with
  ``--quick``. ``--target KEY=LIMIT`` replaces a target's limit (an impossible one shows the
  non-zero exit); a key that no check uses is an error (exit 2).
* ``--quick`` results go to ``bench/results/quick/`` (git-ignored) unless ``--out`` says
  otherwise, so a quick run never overwrites a recorded full run.
* Machine load: this is a shared 2-core machine. :class:`LoadMeter` reports the CPU used by
  processes *outside* this process tree while a block ran (psutil: all CPUs' busy time minus the
  CPU of this process, its live descendants and every descendant they reaped; with ``poll_s``,
  of every process seen in the tree, for descendants nobody reaps, such as Ray's workers), and
  :func:`wait_for_quiet` waits for that to fall below a threshold before a measurement.

Memory: a process's own peak resident memory is ``VmHWM`` in ``/proc/self/status`` (psutil does
not expose it on Linux). ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is NOT: on Linux it is
carried across ``fork``/``vfork`` + ``exec``, so a child started by a process holding 400 MiB
reports at least 400 MiB. Both are recorded; comparisons use VmHWM.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
QUICK_RESULTS_DIR = os.path.join(RESULTS_DIR, "quick")


def repo_path(relative: str) -> str:
    """An absolute path inside the repository (``"examples/digits.py:make_job"`` works too)."""
    return os.path.join(REPO_ROOT, relative)


def load_file(relative: str) -> ModuleType:
    """Import a file of the repository by its path (e.g. an example's analytic model), without
    touching ``sys.path``. Job factories are better passed to virtualflow as a
    ``"path.py:function"`` string: virtualflow imports those itself."""
    path = repo_path(relative)
    name = "_bench_file_" + re.sub(r"\W", "_", relative)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# Workloads (module-level functions: worker processes import them).
#
# The MLP of vn_overhead, vs_ddp and ray_overhead: 512 -> 1024 -> 1024 -> 1024 -> 10, ReLU,
# 2.6 M parameters, SGD + momentum, a synthetic classification set of 8,192 samples. On one core
# a step over a global batch of 256 takes tens of milliseconds, so per-step fixed costs are
# measured honestly without dominating.

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
DATASET_SIZE = 8192
SEED = 0


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
    """Used as ``Job.evaluate``: runs on rank 0 after the last step (before the final state is
    written); reports the worker's own peak RSS (VmHWM), ru_maxrss and its minor page faults."""
    return {"vmhwm_mib": vmhwm_mib(), "ru_maxrss_mib": ru_maxrss_mib(), "minor_faults": float(minor_faults())}


def param_count() -> int:
    return sum(p.numel() for p in mlp().parameters())


MLP_DESCRIPTION = f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-{HIDDEN}-{CLASSES} ReLU"


def mlp_job(name: str, virtual_nodes: int):
    """The MLP on bench_data, B=256. ``memory_metrics`` runs as the evaluation after the last step
    (and every VF_BENCH_EVAL_EVERY steps)."""
    import virtualflow as vf

    return vf.Job(model=mlp, optimizer=sgd, loss=cross_entropy, dataset=bench_data, global_batch_size=256,
                  virtual_nodes=virtual_nodes, seed=SEED, evaluate=memory_metrics,
                  eval_every=int(os.environ.get("VF_BENCH_EVAL_EVERY", "0")) or None, name=name)


# The elasticity workload (resize, recovery, ray_overhead): MLPs of about 1 M and 25 M parameters
# with Adam, global batch 48 in 6 virtual nodes, 4,096 generated samples.

RESIZE_BATCH = 48
RESIZE_VNS = 6
RESIZE_SAMPLES = 4096
RESIZE_MODELS = {  # model name -> layer widths, the last one = classes
    "mlp-1m": (512, 1024, 512, 10),
    "mlp-25m": (1024, 4096, 4096, 1024, 10),
}


def _widths_mlp(widths) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _widths_data(widths) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(RESIZE_SAMPLES, widths[0], generator=g)
    teacher = torch.randn(widths[0], widths[-1], generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def model_1m() -> nn.Module:
    return _widths_mlp(RESIZE_MODELS["mlp-1m"])


def model_25m() -> nn.Module:
    return _widths_mlp(RESIZE_MODELS["mlp-25m"])


def data_1m() -> TensorDataset:
    return _widths_data(RESIZE_MODELS["mlp-1m"])


def data_25m() -> TensorDataset:
    return _widths_data(RESIZE_MODELS["mlp-25m"])


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _resize_job(name: str, model, data):
    import virtualflow as vf

    return vf.Job(model=model, optimizer=adam, loss=cross_entropy, dataset=data, global_batch_size=RESIZE_BATCH,
                  virtual_nodes=RESIZE_VNS, seed=SEED, name=name)


def resize_job_1m():
    return _resize_job("resize-mlp-1m", model_1m, data_1m)


def resize_job_25m():
    return _resize_job("resize-mlp-25m", model_25m, data_25m)


RESIZE_JOBS = {"mlp-1m": resize_job_1m, "mlp-25m": resize_job_25m}


def resize_params(model: str) -> int:
    return sum(p.numel() for p in _widths_mlp(RESIZE_MODELS[model]).parameters())


def parse_models(text: str) -> list[str]:
    """``--models mlp-1m,mlp-25m`` -> the names; an unknown one is a ValueError naming the choices."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    for m in models:
        if m not in RESIZE_MODELS:
            raise ValueError(f"--models: unknown model {m!r}; choose from {', '.join(RESIZE_MODELS)}")
    return models


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


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PeakPoller:
    """Polls ``VmHWM`` of some processes from outside (every ``period_s``) until stopped.

    VmHWM is monotonic, so the last value read before a process exits is (nearly) its peak.
    """

    def __init__(self, pids_fn: Callable[[], dict[Any, int]], period_s: float = 0.2) -> None:
        self._pids_fn = pids_fn
        self._period_s = period_s
        self.peak_mib: dict[Any, float] = {}
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
            except Exception:  # noqa: BLE001 - the job may be between states; try again
                continue
            for key, pid in pids.items():
                v = vmhwm_mib(pid)
                if v == v:  # not NaN: the process still exists
                    self.peak_mib[key] = max(v, self.peak_mib.get(key, 0.0))


# --------------------------------------------------------------------------------------------
# Machine load.


def _psutil():
    try:
        import psutil
    except ImportError:
        raise SystemExit("the benchmarks measure the machine's other load with psutil: pip install psutil") from None
    return psutil


def machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (all CPUs; idle and iowait excluded)."""
    t = _psutil().cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def _tree(psutil) -> list:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants and the descendants any of them reaped
    (a process's ``children_*`` times count only children it waited for)."""
    psutil = _psutil()
    total = 0.0
    for p in _tree(psutil):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_cpu_by_pid() -> dict[int, float]:
    """Each live process of this tree: its own CPU seconds (children not included)."""
    psutil = _psutil()
    out = {}
    for p in _tree(psutil):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[p.pid] = t.user + t.system
    return out


class LoadMeter:
    """CPU cores used by processes outside this process tree while the block ran (0 = quiet).

    By default "ours" is this process, its live descendants and what they reaped, read at the
    start and the end. A descendant that exits without being waited for (Ray's workers: the
    raylet does not reap them into its ``children_*`` times) would take its CPU with it and
    show as other load; ``poll_s`` instead reads every process of the tree every ``poll_s``
    seconds and keeps the last CPU time seen of each, exited ones included (what a process used
    after its last reading is missed; the polling thread is ours and costs a little CPU).
    """

    other_cores: float = 0.0
    wall_s: float = 0.0

    def __init__(self, poll_s: float | None = None) -> None:
        self.poll_s = poll_s

    def __enter__(self) -> "LoadMeter":
        self._t0, self._b0 = time.perf_counter(), machine_busy_s()
        if self.poll_s:
            self._base = tree_cpu_by_pid()
            self._last = dict(self._base)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        else:
            self._o0 = tree_cpu_s()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._last.update(tree_cpu_by_pid())

    def __exit__(self, *exc) -> None:
        if self.poll_s:
            self._stop.set()
            self._thread.join()
            self._last.update(tree_cpu_by_pid())
            ours = sum(v - self._base.get(pid, 0.0) for pid, v in self._last.items())
        else:
            ours = tree_cpu_s() - self._o0
        self.wall_s = time.perf_counter() - self._t0
        other = (machine_busy_s() - self._b0) - ours
        self.other_cores = max(0.0, other) / self.wall_s if self.wall_s > 0 else 0.0


def wait_for_quiet(max_wait_s: float, busy_cores: float = 0.15, sample_s: float = 1.0) -> tuple[float, float]:
    """Wait up to ``max_wait_s`` until other processes use less than ``busy_cores`` over a
    ``sample_s`` window; returns (seconds waited, other load in the last sample). ``max_wait_s``
    <= 0 returns at once with (0, nan)."""
    if max_wait_s <= 0:
        return 0.0, float("nan")
    t0 = time.perf_counter()
    while True:
        with LoadMeter() as m:
            time.sleep(sample_s)
        waited = time.perf_counter() - t0
        if m.other_cores < busy_cores or waited >= max_wait_s:
            return waited, m.other_cores


def pair_order(i: int, a: Any, b: Any) -> tuple[Any, Any]:
    """Interleaving: (a, b) for even ``i``, (b, a) for odd, so neither side always goes first."""
    return (a, b) if i % 2 == 0 else (b, a)


def run_pair(runners: dict[str, Callable[[], dict]], order: Sequence[str], *, max_other_cores: float, retries: int,
             quiet_wait_s: float, label: str) -> dict[str, dict]:
    """Run each of ``runners`` once, in ``order``, on a quiet machine; repeat the pair (up to
    ``retries`` times) when other processes used more than ``max_other_cores`` during it. Each
    run's dict gets ``other_load_cores``, ``waited_for_quiet_s`` and ``attempt``."""
    for attempt in range(retries + 1):
        waited, _ = wait_for_quiet(quiet_wait_s)
        runs = {}
        for which in order:
            with LoadMeter() as meter:
                runs[which] = runners[which]()
            runs[which].update(other_load_cores=meter.other_cores, waited_for_quiet_s=waited, attempt=attempt)
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
# faults: measured here, 1,000-25,000 minor faults per step of the MLP workload, varying from one
# process to the next with the allocator's history, which moves a process's median step time by
# 10-50% (more than any effect measured). "stable" gives every training process (virtualflow
# workers and the PyTorch references alike) the same settings that keep memory in the process.

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


# --------------------------------------------------------------------------------------------
# Child processes: the PyTorch references run in fresh interpreters, like virtualflow workers,
# as ``python -m bench.NAME --child-... JSON`` in the repository root.


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def child_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def spawn_child(module: str, args: Sequence[str], threads: int, **popen: Any) -> subprocess.Popen:
    """Start ``python -m MODULE ARGS`` in the repository root; stdout and stderr are pipes."""
    return subprocess.Popen(child_command(module, *args), cwd=REPO_ROOT, env=child_env(threads),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def last_json_line(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(module: str, args: Sequence[str], threads: int, timeout_s: float = 300.0) -> Any:
    """Run ``python -m MODULE ARGS`` in a fresh process; its last stdout line is JSON."""
    proc = subprocess.run(child_command(module, *args), cwd=REPO_ROOT, env=child_env(threads), capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"child {module} {list(args)[:1]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return last_json_line(proc.stdout)


def collect_children(procs: Sequence[subprocess.Popen], what: str, timeout_s: float = 300.0) -> list[Any]:
    """Wait for every child (killing all of them when one fails) and parse their JSON lines."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"{what} exited {p.returncode}:\n{stderr[-4000:]}")
            out.append(last_json_line(stdout))
    except BaseException:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
        raise
    return out


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
    from virtualflow.rundir import read_jsonl as read

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


def steady_median(times: Sequence[float]) -> float:
    """Median step time with the first two steps (warm-up) left out when there are more."""
    return median(list(times[2:]) or list(times))


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
           quiet_wait: float | None = None) -> argparse.ArgumentParser:
    """The flags every benchmark has (``--quick``, ``--out``, ``--name``, ``--target``), plus
    ``--reps`` and ``--quiet-wait`` with the benchmark's defaults when it takes them."""
    p = argparse.ArgumentParser(description=doc.strip().split("\n")[0],
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
