"""The machine: processes' peak memory, the load of other processes (psutil), quiet-machine
waits, interleaved pairs, the C allocator's settings, and child processes."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence


from bench.harness.paths import REPO_ROOT


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


def rss_mib(pid: int | str = "self") -> float:
    """Resident set of the process now (VmRSS)."""
    return _status_field(pid, "VmRSS")


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


def run_under_stable_malloc(module: str, argv: list[str] | None) -> None:
    """Re-execute this process as ``python -m module argv`` with :data:`MALLOC_STABLE` set, unless
    it already runs with them: glibc reads them only at start-up, and an in-process benchmark
    compares both sides under the allocator settings virtualflow's workers run with (with glibc's
    defaults both sides fault in thousands of pages a step, and unequally)."""
    if all(os.environ.get(k) == v for k, v in MALLOC_STABLE.items()):
        return
    env = dict(os.environ, **MALLOC_STABLE)
    args = list(sys.argv[1:] if argv is None else argv)
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


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
