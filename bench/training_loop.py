"""The modern training loop's knobs through virtualflow, each against the plain PyTorch way.

Sections (``--sections``; every one runs virtualflow and the plain loop in the same process,
steps alternating between them so that the machine's noise falls on both alike):

* ``precision``: ``precision="bf16-mixed"`` vs ``"32"``, step time and the step's peak memory,
  through virtualflow and through a plain loop with ``torch.autocast``. No target: on a CPU bf16
  is faster only where it has bf16 instructions (AVX512-BF16, AMX), else usually *slower*; the
  table records what this machine does.
* ``checkpointing``: ``activation_checkpointing=Block`` on a 12-block residual MLP (a
  transformer's MLP half: LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual). Targets: the
  step's peak memory divided by >= 2, step time <= 1.4x, both through virtualflow; the plain loop
  (``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` in the model's forward)
  beside it.
* ``compile``: ``compile=True`` through virtualflow vs ``torch.compile(model)`` in a plain loop;
  target: step time ratio <= 1.02. Compile time (first step minus a steady step, each side from a
  reset dynamo with inductor's on-disk caches off unless ``--compile-cache``) and dynamo's
  counters (graphs, frames, recompiles) are reported; no graph may be compiled during the timed
  steps. This section runs in ``--compile-reps`` fresh processes (3; 2 with ``--quick``), each with
  its own A/A check (a second plain eager loop on its own model): two identical loops in one
  process differ by a few percent here, depending on where each process put its tensors, so one
  process cannot resolve a 2 % target. Its ratios are medians over the processes.
* ``clipping``: ``max_grad_norm=1.0`` vs none at 25 M parameters (the harness's ``mlp-25m``, Adam),
  with the all-reduce and the sharded reduction; target: overhead <= 2 % of the step. The plain
  loop with ``torch.nn.utils.clip_grad_norm_`` beside it, and the clip alone on the same
  gradients.

How virtualflow runs here: in this process, through the worker's own engine builder
(``VNWorkerEngine.build(job, ...)``, which applies the job's knobs as a worker does) with a
one-worker group, so that process start-up and the launcher's polling do not enter the times.
The same workloads under ``virtualflow.train`` are what the end-to-end tests run.

Step time: wall time of one ``step`` call (the loss is read back, and on CUDA the device is
synchronised, inside it), medians after warm-up steps; a ratio is the median over adjacent pairs
of steps (A then B, then B then A) of their time ratio.

Memory, "step peak": the highest amount of memory the allocator held during one step above what
it held when the step began: gradients (set to None between steps, so allocated again in each
backward), saved activations, recomputed activations, temporaries. On CPU it is read from
``torch.profiler(profile_memory=True)``'s allocation events (every allocation and free of
PyTorch's CPU allocator, summed in time order); on CUDA from ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``. Process RSS is not used: the allocator keeps freed pages, so
RSS hides what a step frees and reuses. Memory is measured on a step of its own (the profiler
slows the step it watches), never on a timed one.

GPU: every section runs on ``cuda`` too when ``torch.cuda.is_available()`` (``--device``); where
it is not, the GPU sections are skipped with one line saying so.

From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.training_loop            # about 10 minutes on CPU
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.training_loop --quick    # fewer steps, same targets
    .venv/bin/python -m bench.training_loop --device cuda --out bench/results/gpu   # the GPU parts
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from bench import harness as H

NAME = "training_loop"
MODULE = "bench.training_loop"
SECTIONS = ("precision", "checkpointing", "compile", "clipping")
TARGET_KEYS = ("ckpt_mem_divisor", "ckpt_time_ratio", "compile_time_ratio", "clip_overhead_pct")
TARGET_CKPT_MEM = 2.0
TARGET_CKPT_TIME = 1.4
TARGET_COMPILE = 1.02
TARGET_CLIP_PCT = 2.0


# --------------------------------------------------------------------------------------------
# Workloads.


class Block(nn.Module):
    """A transformer's MLP half: pre-norm, d -> 4d -> d with GELU, residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """``layers`` blocks between an input projection and a classifier head.
    ``checkpoint_blocks``: the plain PyTorch way of activation checkpointing, in the forward."""

    def __init__(self, in_features: int, d: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        self.checkpoint_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class Workload:
    """A model, its data and batch: ``kind`` "stack" (:class:`Stack`) or "mlp-25m" (the harness's)."""

    kind: str
    d: int = 0
    layers: int = 0
    batch: int = 256
    virtual_nodes: int = 2
    in_features: int = 256
    samples: int = 4096

    def model(self) -> nn.Module:
        if self.kind == "mlp-25m":
            return H.model_25m()
        return Stack(self.in_features, self.d, self.layers, H.CLASSES)

    def data(self) -> TensorDataset:
        in_features = H.RESIZE_MODELS["mlp-25m"][0] if self.kind == "mlp-25m" else self.in_features
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.samples, in_features, generator=g)
        y = (x @ torch.randn(in_features, H.CLASSES, generator=g)).argmax(dim=1)
        return TensorDataset(x, y)

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    def params(self) -> int:
        return sum(p.numel() for p in self.model().parameters())

    def describe(self) -> str:
        if self.kind == "mlp-25m":
            return (f"MLP {'-'.join(map(str, H.RESIZE_MODELS['mlp-25m']))} ({self.params() / 1e6:.1f} M params), "
                    f"B={self.batch} in {self.virtual_nodes} VNs")
        return (f"{self.layers} residual MLP blocks d={self.d} (4d hidden, LayerNorm, GELU; "
                f"{self.params() / 1e6:.2f} M params), B={self.batch} in {self.virtual_nodes} VNs")

    def job(self, **knobs: Any):
        import virtualflow as vf

        return vf.Job(model=self.model, optimizer=self.optimizer, loss=H.cross_entropy, dataset=self.data,
                      global_batch_size=self.batch, virtual_nodes=self.virtual_nodes, seed=H.SEED,
                      name=f"{NAME}-{self.kind}", **knobs)


# Sizes per device: CPU ones fit a shared 2-core machine at one thread; GPU ones keep an H100 busy.
WORKLOADS = {
    "cpu": {
        "precision": Workload("stack", d=128, layers=4, batch=512, virtual_nodes=2),
        # activation-dominated (what checkpointing is for): micro-batch 1024 >> width 128
        "checkpointing": Workload("stack", d=128, layers=12, batch=2048, virtual_nodes=2),
        # B = 2048 (a step of ~0.1 s at one thread): the engine's fixed per-step cost (~0.3 ms) and
        # the machine's noise are small beside it; at B = 512 (up to issue 43) they were 1-2 %
        "compile": Workload("stack", d=128, layers=4, batch=2048, virtual_nodes=2, samples=16384),
        # 25 M parameters; the batch sets what the clip is compared with (B=1024: ~150 GFLOP a step)
        "clipping": Workload("mlp-25m", batch=1024, virtual_nodes=4),
    },
    "cuda": {
        "precision": Workload("stack", d=1024, layers=8, batch=8192, virtual_nodes=2, in_features=1024,
                              samples=32768),
        "checkpointing": Workload("stack", d=1024, layers=12, batch=16384, virtual_nodes=2, in_features=1024,
                                  samples=65536),
        "compile": Workload("stack", d=1024, layers=8, batch=8192, virtual_nodes=2, in_features=1024,
                            samples=32768),
        "clipping": Workload("mlp-25m", batch=16384, virtual_nodes=4, samples=65536),
    },
}


# --------------------------------------------------------------------------------------------
# The two ways of training: virtualflow's engine, and the plain loop.


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VFSide:
    """virtualflow's VN engine for ``job``, built as a worker builds it, in a one-worker group."""

    def __init__(self, job, device: torch.device, reduction: str = "allreduce") -> None:
        from virtualflow.comm.groups import Group
        from virtualflow.plan.data import DataPlan
        from virtualflow.runtime.vn_worker import VNWorkerEngine
        from virtualflow.config.worker_options import WorkerOptions
        from virtualflow.runtime.worker_config import WorkerConfig

        cfg = WorkerConfig(store_host="127.0.0.1", store_port=0, job_source=None, total_steps=1 << 30,
                           state_dir="/nonexistent", overrides={}, threads=1, resume_path=None,
                           initial_workers=1, slowdowns={},
                           options=WorkerOptions(deterministic=False, device=str(device), collective_timeout_s=60.0,
                                                 control_plane=False, reduction=reduction, breakdown=False))
        self.job, self.device = job, device
        ds = job.build_dataset()
        plan = DataPlan(len(ds), job.global_batch_size, job.virtual_nodes, job.seed)
        self.engine = VNWorkerEngine.build(job, ds, plan, cfg, device)
        self.engine.vn.set_membership(Group(0, 0, 1, None), [list(range(job.virtual_nodes))])
        self.model = self.engine.model
        self.step_no = 0
        self.last = None

    def step(self) -> None:
        self.last = self.engine.step(self.step_no)
        self.step_no += 1
        sync(self.device)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class PlainSide:
    """The loop a PyTorch user writes: accumulation over the same micro-batches, ``torch.autocast``,
    ``clip_grad_norm_``, ``torch.utils.checkpoint`` in the model, ``torch.compile``."""

    def __init__(self, w: Workload, device: torch.device, *, precision: str = "32", max_grad_norm: float | None = None,
                 checkpointing: bool = False, compile: bool = False) -> None:
        torch.manual_seed(H.SEED)
        model = w.model().to(device)
        if checkpointing:
            model.checkpoint_blocks = True
        self.opt = w.optimizer(model.parameters())
        self.model = model
        self.call = torch.compile(model) if compile else model
        self.X, self.Y = w.data().tensors  # on the host; each micro-batch goes to the device, as virtualflow's
        self.w, self.device, self.max_grad_norm = w, device, max_grad_norm
        self.dtype = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
        self.step_no = 0

    def step(self) -> None:
        w, n = self.w, self.w.batch // self.w.virtual_nodes
        idx = H.batch_indices(len(self.X), w.batch, self.step_no)  # virtualflow's data order
        xb, yb = self.X[idx], self.Y[idx]
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for v in range(w.virtual_nodes):
            x, y = xb[v * n : (v + 1) * n].to(self.device), yb[v * n : (v + 1) * n].to(self.device)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = nn.functional.cross_entropy(self.call(x), y) / w.virtual_nodes
            loss.backward()
            total += loss.detach()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        float(total)  # the loss read back, as virtualflow does
        self.step_no += 1
        sync(self.device)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# Measuring.


def timed_steps(sides: dict[str, Any], steps: int, warmup: int) -> dict[str, list[float]]:
    """Every side steps ``steps`` times, round-robin, the order rotating each round; each step's wall
    time. The first ``warmup`` rounds are dropped."""
    names = list(sides)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(steps):
        k = r % len(names)
        order = names[k:] + names[:k] if r % 2 == 0 else list(reversed(names[k:] + names[:k]))
        for name in order:
            t0 = time.perf_counter()
            sides[name].step()
            times[name].append(time.perf_counter() - t0)
    return {k: v[warmup:] for k, v in times.items()}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a's step time / b's in the same round."""
    return statistics.median(x / y for x, y in zip(a, b)) if a and b else float("nan")


def step_peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The allocator's peak during one ``step()`` above what it held at the step's start (see the
    module docstring)."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def applied(side: VFSide, knob: str) -> bool:
    """Whether virtualflow's engine applied the job's ``knob`` (an engine from before the knob was
    wired in ignores it: then the comparison would be of the same thing)."""
    model = side.model
    if knob == "activation_checkpointing":
        return any(getattr(m.forward, "__virtualflow_checkpointed__", False) for m in model.modules())
    if knob == "compile":
        forward = vars(model).get("forward")  # torch.compile of the model's forward, set on the instance
        return (getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")
                or hasattr(forward, "_torchdynamo_orig_callable"))
    if knob == "max_grad_norm":
        return side.last is not None and getattr(side.last, "grad_norm", None) is not None
    if knob == "precision":
        seen: list[torch.dtype] = []
        lin = next(m for m in model.modules() if isinstance(m, nn.Linear))
        h = lin.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        try:
            side.step()
        finally:
            h.remove()
        return bool(seen) and seen[0] != torch.float32
    raise ValueError(knob)


def not_applied_line(knob: str) -> str:
    return (f"  virtualflow's engine did not apply {knob} (an engine from before the training-loop knobs): "
            f"its figures below are those of the plain engine")


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def close_all(sides: dict[str, Any]) -> None:
    for s in sides.values():
        s.close()
    sides.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Sections. Each returns its rows (dicts) and a table; targets go to ``run.targets``.


def section_precision(dev: torch.device, args, run: H.Run) -> dict:
    w = WORKLOADS[dev.type]["precision"]
    sides = {
        "vf 32": VFSide(w.job(precision="32"), dev),
        "vf bf16-mixed": VFSide(w.job(precision="bf16-mixed"), dev),
        "plain 32": PlainSide(w, dev),
        "plain bf16-mixed": PlainSide(w, dev, precision="bf16-mixed"),
    }
    ok = applied(sides["vf bf16-mixed"], "precision")
    if not ok:
        print(not_applied_line("precision"))
    times = timed_steps(sides, args.steps, args.warmup)
    peaks = {k: step_peak_bytes(s.step, dev) for k, s in sides.items()}
    close_all(sides)
    rows = []
    for way in ("vf", "plain"):
        t32, t16 = times[f"{way} 32"], times[f"{way} bf16-mixed"]
        rows.append({"way": way, "ms_32": 1e3 * statistics.median(t32), "ms_bf16": 1e3 * statistics.median(t16),
                     "time_ratio_bf16_over_32": paired_ratio(t16, t32),
                     "peak_32_bytes": peaks[f"{way} 32"], "peak_bf16_bytes": peaks[f"{way} bf16-mixed"]})
    header = ["way", "fp32 ms", "bf16-mixed ms", "bf16/fp32 time", "fp32 step peak MiB", "bf16 step peak MiB"]
    table = [[("virtualflow" if r["way"] == "vf" else "plain loop"), f"{r['ms_32']:.1f}", f"{r['ms_bf16']:.1f}",
              f"{r['time_ratio_bf16_over_32']:.3f}", mib(r["peak_32_bytes"]), mib(r["peak_bf16_bytes"])]
             for r in rows]
    vf_vs_plain = {p: paired_ratio(times[f"vf {p}"], times[f"plain {p}"]) for p in ("32", "bf16-mixed")}
    return {"workload": w.describe(), "engine_applied": ok, "rows": rows, "vf_over_plain": vf_vs_plain,
            "table": (header, table), "raw_times": times,
            "note": ("no target (on a CPU, bf16 is faster only with bf16 instructions: AVX512-BF16 or AMX; "
                     f"this one {'has' if cpu_has_bf16() else 'lacks'} them)") if dev.type == "cpu" else "no target"}


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def section_checkpointing(dev: torch.device, args, run: H.Run) -> dict:
    w = WORKLOADS[dev.type]["checkpointing"]
    sides = {
        "vf off": VFSide(w.job(), dev),
        "vf on": VFSide(w.job(activation_checkpointing=Block), dev),
        "plain off": PlainSide(w, dev),
        "plain on": PlainSide(w, dev, checkpointing=True),
    }
    ok = applied(sides["vf on"], "activation_checkpointing")
    if not ok:
        print(not_applied_line("activation_checkpointing"))
    times = timed_steps(sides, args.steps, args.warmup)
    peaks = {k: step_peak_bytes(s.step, dev) for k, s in sides.items()}
    close_all(sides)
    rows = []
    for way in ("vf", "plain"):
        rows.append({"way": way, "ms_off": 1e3 * statistics.median(times[f"{way} off"]),
                     "ms_on": 1e3 * statistics.median(times[f"{way} on"]),
                     "time_ratio": paired_ratio(times[f"{way} on"], times[f"{way} off"]),
                     "peak_off_bytes": peaks[f"{way} off"], "peak_on_bytes": peaks[f"{way} on"],
                     "mem_divisor": peaks[f"{way} off"] / max(1, peaks[f"{way} on"])})
    vf = rows[0]
    tag = f"[{dev.type}] "
    run.targets.at_least("ckpt_mem_divisor", f"{tag}checkpointing through virtualflow: step peak memory off / on",
                         vf["mem_divisor"] if ok else float("nan"), TARGET_CKPT_MEM, "x")
    run.targets.at_most("ckpt_time_ratio", f"{tag}checkpointing through virtualflow: step time on / off",
                        vf["time_ratio"] if ok else float("nan"), TARGET_CKPT_TIME, "x")
    header = ["way", "off ms", "on ms", "time on/off", "off step peak MiB", "on step peak MiB", "memory off/on"]
    table = [[("virtualflow" if r["way"] == "vf" else "plain loop"), f"{r['ms_off']:.1f}", f"{r['ms_on']:.1f}",
              f"{r['time_ratio']:.3f}", mib(r["peak_off_bytes"]), mib(r["peak_on_bytes"]), f"{r['mem_divisor']:.2f}"]
             for r in rows]
    grads = 4 * w.params()
    return {"workload": w.describe(), "engine_applied": ok, "rows": rows, "table": (header, table),
            "gradient_bytes": grads, "raw_times": times,
            "note": f"the step peak includes the gradients allocated in the backward ({mib(grads)} MiB) on both sides"}


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_compiled": int(counters["frames"]["ok"]),
            "recompiles": int(sum(counters["recompiles"].values()))}


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def compile_child(cfg: dict) -> dict:
    """One process's compile measurement (``--child-compile JSON``): each compiled side from a reset
    dynamo, warmed on its own, then every side (virtualflow and the plain loop, compiled and eager,
    and a second plain eager loop on its own model: the A/A check) steps in alternating rounds."""
    import torch._dynamo
    import torch._inductor.config

    dev = torch.device(cfg["device"])
    torch.set_num_threads(cfg["threads"])
    w = WORKLOADS[dev.type]["compile"]
    if not cfg["compile_cache"]:  # a cold compile: inductor's on-disk caches would hide the second one
        torch._inductor.config.force_disable_caches = True
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    # inductor's one-time start-up (imports, the C++/Triton toolchain's first use) on a throw-away
    # function, so that it is charged to neither side
    torch._dynamo.reset()
    t0 = time.perf_counter()
    torch.compile(lambda x: (x * 2).relu().sum())(torch.randn(8, device=dev))
    startup_s = time.perf_counter() - t0
    first: dict[str, float] = {}
    counts: dict[str, dict[str, int]] = {}
    sides: dict[str, Any] = {}
    # Each side compiled from a reset dynamo and warmed on its own (its graphs, frames and
    # recompiles are its own); the reset drops the other side's compiled code, which is compiled
    # again in the untimed round below.
    for name, make in (("vf compiled", lambda: VFSide(w.job(compile=True), dev)),
                       ("plain compiled", lambda: PlainSide(w, dev, compile=True))):
        torch._dynamo.reset()
        c0 = dynamo_counts()
        side = make()
        t0 = time.perf_counter()
        side.step()
        first[name] = time.perf_counter() - t0
        for _ in range(max(1, cfg["warmup"] - 1)):
            side.step()
        counts[name] = delta(c0, dynamo_counts())
        sides[name] = side
    ok = applied(sides["vf compiled"], "compile")
    timed_steps(sides, 1, 0)  # both compiled sides run once more: the reset dropped one's code
    sides["vf eager"] = VFSide(w.job(), dev)
    sides["plain eager"] = PlainSide(w, dev)
    sides["plain eager (A/A)"] = PlainSide(w, dev)
    c0 = dynamo_counts()
    times = timed_steps(sides, cfg["steps"], cfg["warmup"])
    during = delta(c0, dynamo_counts())
    close_all(sides)
    return {"times": times, "first": first, "counts": counts, "during": during, "applied": ok,
            "startup_s": startup_s}


def section_compile(dev: torch.device, args, run: H.Run) -> dict:
    """``--compile-reps`` fresh processes (each places its tensors anew: two identical loops in one
    process differ by a few percent on this kind of machine, see ``aa_ratios``); every ratio is
    the median over the processes of each one's paired ratio."""
    w = WORKLOADS[dev.type]["compile"]
    cfg = {"device": str(dev), "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
           "compile_cache": args.compile_cache}
    reps = []
    for i in range(args.compile_reps):
        H.wait_for_quiet(args.quiet_wait)
        r = H.run_child(MODULE, ["--child-compile", json.dumps(cfg)], args.threads, timeout_s=900.0)
        t = r["times"]
        r["ratios"] = {"compiled": paired_ratio(t["vf compiled"], t["plain compiled"]),
                       "eager": paired_ratio(t["vf eager"], t["plain eager"]),
                       "aa": paired_ratio(t["plain eager (A/A)"], t["plain eager"])}
        print(f"  process {i + 1}: virtualflow / plain compiled {r['ratios']['compiled']:.3f}, eager "
              f"{r['ratios']['eager']:.3f}; A/A (plain eager / plain eager) {r['ratios']['aa']:.3f}; "
              f"dynamo {r['counts']['vf compiled']}", flush=True)
        reps.append(r)
    ok = all(r["applied"] for r in reps)
    if not ok:
        print(not_applied_line("compile"))
    ratios = {k: [r["ratios"][k] for r in reps] for k in ("compiled", "eager", "aa")}
    ratio = statistics.median(ratios["compiled"])
    during = {k: sum(r["during"][k] for r in reps) for k in reps[0]["during"]}
    first = {k: statistics.median(r["first"][k] for r in reps) for k in reps[0]["first"]}
    med = {k: statistics.median(x for r in reps for x in r["times"][k]) for k in reps[0]["times"]}
    counts = reps[0]["counts"]
    tag = f"[{dev.type}] "
    run.targets.at_most("compile_time_ratio", f"{tag}compile: virtualflow compiled / plain compiled step time "
                        f"(median of {len(reps)} processes)", ratio if ok else float("nan"), TARGET_COMPILE, "x")
    run.targets.holds(f"{tag}compile: virtualflow's compile=True compiled the model (dynamo counters)",
                      all(r["counts"]["vf compiled"]["unique_graphs"] >= 1 for r in reps), f"{counts['vf compiled']}")
    run.targets.holds(f"{tag}compile: no graph compiled during the timed steps (dynamo counters)",
                      during["unique_graphs"] == 0 and during["recompiles"] == 0, f"{during}")
    rows = [{"way": way, "ms_eager": 1e3 * med[f"{way} eager"], "ms_compiled": 1e3 * med[f"{way} compiled"],
             "first_step_s": first[f"{way} compiled"],
             "compile_s": first[f"{way} compiled"] - med[f"{way} compiled"],
             "dynamo": counts[f"{way} compiled"]} for way in ("vf", "plain")]
    header = ["way", "eager ms", "compiled ms", "first step s", "compile s", "graphs", "frames", "recompiles"]
    table = [[("virtualflow" if r["way"] == "vf" else "plain loop"), f"{r['ms_eager']:.1f}", f"{r['ms_compiled']:.1f}",
              f"{r['first_step_s']:.1f}", f"{r['compile_s']:.1f}", r["dynamo"]["unique_graphs"],
              r["dynamo"]["frames_compiled"], r["dynamo"]["recompiles"]] for r in rows]
    return {"workload": w.describe(), "engine_applied": ok, "rows": rows, "table": (header, table),
            "vf_over_plain_compiled": ratio, "vf_over_plain_eager": statistics.median(ratios["eager"]),
            "aa_ratio": statistics.median(ratios["aa"]), "per_process_ratios": ratios,
            "dynamo_during_timed_steps": during, "inductor_startup_s": statistics.median(r["startup_s"] for r in reps),
            "raw_times": [r["times"] for r in reps]}


def clip_alone_ms(w: Workload, dev: torch.device, reps: int = 5) -> float:
    """``clip_grad_norm_`` on 25 M parameters' gradients, by itself (median ms)."""
    torch.manual_seed(H.SEED)
    params = [p.to(dev) for p in w.model().parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    out = []
    for _ in range(reps + 1):
        sync(dev)
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        sync(dev)
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out[1:])


def section_clipping(dev: torch.device, args, run: H.Run) -> dict:
    w = WORKLOADS[dev.type]["clipping"]
    rows = []
    tag = f"[{dev.type}] "
    for label, make_off, make_on, knob_side in (
        ("virtualflow, all-reduce", lambda: VFSide(w.job(), dev), lambda: VFSide(w.job(max_grad_norm=1.0), dev), True),
        ("virtualflow, sharded", lambda: VFSide(w.job(), dev, "sharded"),
         lambda: VFSide(w.job(max_grad_norm=1.0), dev, "sharded"), True),
        ("plain loop", lambda: PlainSide(w, dev), lambda: PlainSide(w, dev, max_grad_norm=1.0), False),
    ):
        sides = {"off": make_off(), "on": make_on()}
        times = timed_steps(sides, args.clip_steps, args.clip_warmup)
        ok = applied(sides["on"], "max_grad_norm") if knob_side else True
        if not ok:
            print(not_applied_line(f"max_grad_norm ({label})"))
        close_all(sides)
        ratio = paired_ratio(times["on"], times["off"])
        pct = 100.0 * (ratio - 1.0)
        rows.append({"way": label, "ms_off": 1e3 * statistics.median(times["off"]),
                     "ms_on": 1e3 * statistics.median(times["on"]), "overhead_pct": pct, "engine_applied": ok,
                     "raw_times": times})
        if knob_side:
            run.targets.at_most("clip_overhead_pct", f"{tag}clipping overhead through {label} (% of the step)",
                                pct if ok else float("nan"), TARGET_CLIP_PCT, "%")
        print(f"  {label}: off {rows[-1]['ms_off']:.0f} ms, on {rows[-1]['ms_on']:.0f} ms, "
              f"overhead {pct:+.2f}%", flush=True)
    alone = clip_alone_ms(w, dev)
    header = ["way", "no clipping ms", "max_grad_norm=1 ms", "overhead %"]
    table = [[r["way"], f"{r['ms_off']:.1f}", f"{r['ms_on']:.1f}", f"{r['overhead_pct']:+.2f}"] for r in rows]
    return {"workload": w.describe(), "rows": rows, "table": (header, table), "clip_alone_ms": alone,
            "clip_alone_pct_of_plain_step": 100.0 * alone / rows[-1]["ms_off"]}


RUNNERS = {"precision": section_precision, "checkpointing": section_checkpointing, "compile": section_compile,
           "clipping": section_clipping}


# --------------------------------------------------------------------------------------------
# Command line and report.


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, quiet_wait=60.0)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, or auto (cpu, then cuda when available); comma-separated for several")
    p.add_argument("--steps", type=int, default=16, help="timed rounds per section (each side steps once a round)")
    p.add_argument("--warmup", type=int, default=4, help="rounds left out of the medians")
    p.add_argument("--clip-steps", type=int, default=8, help="rounds of the clipping section (25 M params)")
    p.add_argument("--clip-warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--compile-reps", type=int, default=3,
                   help="fresh processes the compile section runs in (its ratios are medians over them)")
    p.add_argument("--child-compile", help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", action="store_true",
                   help="let inductor use its on-disk caches (default: off, so that compile times are cold)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.clip_steps, args.clip_warmup = 7, 2, 4, 1
        args.compile_reps = min(args.compile_reps, 2)
        args.quiet_wait = min(args.quiet_wait, 10.0)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    if args.steps <= args.warmup or args.clip_steps <= args.clip_warmup:
        p.error("--steps must exceed --warmup and --clip-steps --clip-warmup")
    return args


def devices(spec: str) -> tuple[list[torch.device], str | None]:
    """The devices to run on, and the line that says why the GPU sections are skipped (or None)."""
    have_cuda = torch.cuda.is_available()
    names = ["cpu", "cuda"] if spec == "auto" else [d.strip() for d in spec.split(",") if d.strip()]
    skip = None
    if "cuda" in names and not have_cuda:
        names = [n for n in names if n != "cuda"]
        skip = "GPU sections skipped: torch.cuda.is_available() is False on this machine"
    return [torch.device(n) for n in names], skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.run_under_stable_malloc(MODULE, argv)  # (measured in this process: see its docstring)
    if args.child_compile:
        print(json.dumps(compile_child(json.loads(args.child_compile))))
        return 0
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(args.threads)
    devs, skip = devices(args.device)
    print(H.banner(f"training loop knobs through virtualflow vs the plain PyTorch loop "
                   f"({', '.join(args.sections)}; {', '.join(d.type for d in devs) or 'no device'})"))
    if skip:
        print(f"  {skip}")
    if not devs:
        print("  nothing measured (no device left to run on); no result files written")
        return 0
    results: dict[str, dict[str, Any]] = {}
    md = [f"# {run.name}: precision, activation checkpointing, compile and clipping, virtualflow vs plain PyTorch",
          "", H.env_markdown(), "",
          "virtualflow runs in-process through the worker's engine builder (one-worker group); each section "
          "alternates steps between virtualflow and the plain loop. Step peak = the allocator's peak during one "
          "step above its level at the step's start (CPU: torch.profiler memory events; CUDA: "
          "max_memory_allocated). Ratios = median over rounds of paired step times. See the module docstring "
          "of bench/training_loop.py."]
    if skip:
        md += ["", f"_{skip}._"]
    for dev in devs:
        if dev.type == "cuda":
            md += ["", f"GPU: {torch.cuda.get_device_name(dev)}"]
        for name in args.sections:
            print(f"\n[{dev.type}] {name}: {WORKLOADS[dev.type][name].describe()}", flush=True)
            waited, load_before = H.wait_for_quiet(args.quiet_wait)
            if args.quiet_wait > 0:
                print(f"  waited {waited:.0f} s for a quiet machine (other load {load_before:.2f} cores)", flush=True)
            with H.LoadMeter() as load:
                res = RUNNERS[name](dev, args, run)
            res["other_load_cores"] = load.other_cores
            res["wall_s"] = load.wall_s
            header, rows = res.pop("table")
            print(H.text_table(header, rows))
            extra = []
            if name == "compile":
                extra.append(f"virtualflow/plain step time (median of {args.compile_reps} processes): compiled "
                             f"{res['vf_over_plain_compiled']:.3f}, eager {res['vf_over_plain_eager']:.3f}; A/A (two "
                             f"plain eager loops) {res['aa_ratio']:.3f}; dynamo during timed steps "
                             f"{res['dynamo_during_timed_steps']}; inductor's one-time start-up "
                             f"{res['inductor_startup_s']:.1f} s (charged to neither side)")
            if name == "clipping":
                extra.append(f"clip_grad_norm_ alone on these gradients: {res['clip_alone_ms']:.1f} ms "
                             f"({res['clip_alone_pct_of_plain_step']:.2f}% of the plain step)")
            if name == "precision":
                extra.append("virtualflow/plain step time: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in res["vf_over_plain"].items()) + f"; {res['note']}")
            if name == "checkpointing":
                extra.append(res["note"])
            extra.append(f"other processes used {load.other_cores:.2f} cores meanwhile ({load.wall_s:.0f} s)")
            for line in extra:
                print(f"  {line}")
            results[f"{dev.type}/{name}"] = res
            md += ["", f"## {name} ({dev.type})", "", res["workload"], "", H.md_table(header, rows), "",
                   *[f"- {line}" for line in extra]]
    md += ["", f"Figures from a shared machine are noisy; reproduce: `{run.command(NAME)}`"]
    payload = {"benchmark": run.name, "environment": H.environment(), "gpu_skipped": skip,
               "config": {"sections": args.sections, "devices": [d.type for d in devs], "steps": args.steps,
                          "warmup": args.warmup, "clip_steps": args.clip_steps, "clip_warmup": args.clip_warmup,
                          "threads": args.threads, "quick": args.quick,
                          "workloads": {d.type: {s: WORKLOADS[d.type][s].describe() for s in args.sections}
                                        for d in devs}},
               "results": results}
    return run.finish(payload, "\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
