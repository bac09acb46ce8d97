"""Fully sharded parameters (``reduction="fsdp"``) against PyTorch's FSDP2 in the same run: memory
per worker, step time, and a model that does not fit one worker's memory limit.

The workload is a GPT-like language model (:mod:`bench.harness.gpt`: pre-norm blocks in one
``nn.ModuleList``, tied head, no dropout) with AdamW, about 105 M parameters (``--quick``: 21 M),
a global batch of ``B`` sequences in ``V`` micro-batches (virtual nodes), gloo, one thread per
process. Every run trains the same model from the same initialisation on the same samples.

* **PyTorch's way** (bench/harness/fsdp2.py): ``fully_shard`` on each block, then on the root,
  at W = 1, 2 and 4 processes (a reduce-scatter after each micro-batch's backward, as FSDP2 does by
  default), and the plain unsharded loop in one process (W = 1: the memory baseline).
* **virtualflow**: ``virtualflow.train(job, workers=W, reduction="fsdp")`` at W = 1, 2 and 4, in the
  default mode and with ``deterministic=True``, and the unsharded deterministic run at W = 1
  (``reduction="allreduce"``: the reference the deterministic runs must equal bit for bit).

Measured per process, at the end of the last step (before any final gather): the peak resident
memory (VmHWM) of the whole run and of the steady steps alone (``steady``: the peak is reset after
the last warm-up step through ``/proc/self/clear_refs``, so building the model and the first steps
do not count), the peak address space (VmPeak), and the bytes of every tensor storage it holds
(``live tensors``: a walk of its live tensors, each storage once); for the PyTorch runs also the
parameters, gradients and optimizer state by name. virtualflow's workers report theirs through a
``ranks="all"`` callback (:class:`MemoryProbe`) that writes one file per worker. Step time: the
median of the steps after the warm-up (virtualflow: ``Result.history``'s ``step_time_s``; PyTorch:
rank 0's end-to-end step); with ``--reps`` above 1 the runs of one W rotate their order and a ratio
is the median over repetitions of the ratio of the same repetition.

Targets (issue 43):

* ``mem_formula`` (W = 1, 2, 4): what sharding leaves per worker in training, measured by the
  allocator, is at most 1/W of the unsharded training state U (parameters + gradients + AdamW
  state, measured in the plain loop) plus the two largest units gathered, plus 10 %:
  ``(peak_W - peak_unsharded + U) / (1.10 (U / W + L1 + L2)) <= 1``. ``peak`` is the largest
  number of bytes the C allocator has in use during a steady step (the last one), all threads
  (:mod:`bench.harness.alloc`); ``peak_unsharded`` the unsharded virtualflow run's in the default
  mode (``reduction="allreduce"``, W = 1), which holds U plus the activations of one micro-batch,
  the step's transients and the process's own heap (data set, Python, libraries). A micro-batch
  is B/V sequences at every W, so its activations are the same in every run and cancel, as the
  heap does: ``peak_W - (peak_unsharded - U)`` is the training state a sharded worker holds at its
  peak (its shards, gradient shards and AdamW shards, the units gathered, the gradients waiting
  for the reduction). The same figure by RSS (steady-step VmHWM) is printed for the record, with
  no target: RSS also counts what the allocator keeps after a free (the whole model built before
  it is sharded, freed arenas not returned), so it overstates what is held. FSDP2's figure by the
  allocator, ``peak_W - peak_plain + U`` (the plain loop its baseline), is printed next to it;
* ``mem_tensors`` (W = 1, 2, 4): the same bound on the bytes of the tensors a worker holds at the
  end of a step (the allocator's view: every live tensor storage; RSS also counts memory the C
  allocator keeps after tensors are freed, such as the whole model built before it is sharded);
* ``mem_vs_fsdp2`` (W = 1, 2, 4): virtualflow's largest worker VmHWM / FSDP2's largest rank's <= 1,
  over the whole run (start-up included: what a memory limit sees);
* ``time_ratio`` (W = 2, 4): virtualflow default mode / FSDP2 step time <= 1.05;
* ``det_ratio`` (W = 1, 2, 4): deterministic / default mode step time <= 1.15;
* deterministic runs at W = 1, 2 and 4 bit-identical to the unsharded deterministic run;
* **a model that does not fit**: a per-worker address-space limit (``RLIMIT_AS``, set in each
  worker before the model is built) halfway between the sharded W = 4 workers' peak address space
  during training and the unsharded worker's, both measured in this run (so a final export that
  gathers more than training holds shows here as a failure at the end): the unsharded run must
  fail with an out-of-memory error that names ``reduction="fsdp"`` (``--reduction fsdp``), and the sharded
  deterministic run on 4 workers must complete under the same limit, bit-identical to the
  unsharded deterministic run made without it.

* ``resize_pause`` (each change of a run launched on 4 workers, resized 4 -> 3 -> 4 in the default
  mode with ``JobHandle.resize(n, wait=True)``): the pause, the wall time between the old
  generation's last step and the new one's first (``metrics.jsonl``'s step records) minus one
  ordinary step of the new generation, is at most 1 s plus the bytes the resize moves at the
  bandwidth measured here (a gloo send of 64 MiB between two processes); the bytes moved are
  the engine's own plan (:func:`virtualflow.plan.param_shards.moves` per unit: every range of a
  shard that changes holder, parameter and AdamW moments; a newcomer's shard twice, through its
  deputy).

Host offload (``offload="cpu"``, W = 4, default mode) runs once for the record, without a target:
on this machine the device is the host.

This is a 2-core CPU machine: 2 processes fill it and 4 share it, so the step times are ratios at
equal worker counts, not scaling results; each run records the CPU other processes used meanwhile.
From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.sharded_params            # the 105 M model
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.sharded_params --quick    # the 21 M model, fewer steps
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench import harness as H
from bench.harness import gpt
from bench.harness import resize_pause as R
from bench.harness.alloc import PeakSampler
from bench.harness.fsdp2 import apply_as_limit, fsdp2_rank, reset_peak_rss, run_fsdp2, vmpeak_mib

NAME = "sharded_params"
MODULE = "bench.sharded_params"
TARGET_KEYS = ("mem_formula", "mem_tensors", "mem_vs_fsdp2", "time_ratio", "det_ratio", "resize_pause")
TARGET_TIME = 1.05
TARGET_DET = 1.15
TARGET_MEM_VS_FSDP2 = 1.0
SLACK = 0.10
WORKERS = (1, 2, 4)
TIME_WORKERS = (2, 4)
"""The worker counts of the step-time target against FSDP2 (at W = 1 the ratio is shown, unchecked)."""
LIMIT_WORKERS = 4
RESIZE_SIZES = (4, 3, 4)
"""The resize measured: launched on 4 workers, shrunk to 3, grown back to 4 (default mode)."""
RESIZE_FIXED_S = 1.0
"""The resize pause's allowance on top of the shards' moving time."""
MOVED_BYTES_PER_ELEMENT = 12
"""What a resize moves per parameter element: the fp32 parameter and AdamW's two fp32 moments."""
OOM_WORDS = ("out of memory", "can't allocate", "cannot allocate", "memoryerror", "std::bad_alloc")
KNOB_FORMS = ("--reduction fsdp", "reduction='fsdp'", 'reduction="fsdp"', "reduction=fsdp")

ARENA_MAX = "2"
"""glibc malloc arenas per process in every run of this benchmark (both sides): each further arena
reserves 64 MiB of address space, so with the default (8 per core) a process's address space, what
``RLIMIT_AS`` bounds, follows its thread count more than its memory (measured: a 2-worker run's
VmPeak 600 MiB above the 1-worker run's for the same model; with 1-2 arenas they agree within 50 MiB)."""

PROBE_DIR = "VF_BENCH_PROBE_DIR"
PROBE_STEP = "VF_BENCH_PROBE_STEP"
PROBE_RESET = "VF_BENCH_PROBE_RESET"
LIMIT_ENV = "VF_BENCH_AS_LIMIT_MIB"
LAUNCHER_ENV = "VF_BENCH_LAUNCHER_PID"


# --------------------------------------------------------------------------------------------
# The job virtualflow trains (module level: its workers import it by reference).


class MemoryProbe:
    """A ``ranks="all"`` callback measuring each worker's memory (nothing when the variables are unset).

    After step ``$VF_BENCH_PROBE_RESET`` (the last warm-up step) it notes the worker's VmHWM so far
    and resets it; at step ``$VF_BENCH_PROBE_STEP`` (the last) it writes to
    ``$VF_BENCH_PROBE_DIR/rank<r>-step.json`` the peak resident memory of the whole run
    (``vmhwm_mib``) and of the steady steps alone (``steady_vmhwm_mib``), the peak address space
    (``vmpeak_mib``), the bytes of its live tensors, and the allocator's bytes in use at the start
    of the last step and their peak during it (``alloc_start_bytes``, ``alloc_peak_bytes``:
    :class:`~bench.harness.alloc.PeakSampler`, started at the end of the step before); when the job
    ends, after the final state is written, its VmHWM and VmPeak again to ``rank<r>-end.json``
    (the final export's peak)."""

    ranks = "all"

    def __init__(self) -> None:
        self.rank: int | None = None
        self.early: dict = {}
        self.sampler: PeakSampler | None = None

    def _write(self, what: str, record: dict) -> None:
        with open(os.path.join(os.environ[PROBE_DIR], f"rank{self.rank}-{what}.json"), "w") as f:
            json.dump({"rank": self.rank, **record}, f)

    def on_step_end(self, info) -> None:
        if not os.environ.get(PROBE_DIR):
            return None
        last = int(os.environ.get(PROBE_STEP, "-1"))
        if info.step == int(os.environ.get(PROBE_RESET, "-1")):
            self.early = {"early_vmhwm_mib": H.vmhwm_mib(), "peak_reset": reset_peak_rss()}
        if info.step == last - 1:
            self.sampler = PeakSampler().start()
        if info.step == last:
            self.rank = info.rank
            steady = H.vmhwm_mib()
            alloc = self.sampler.stop() if self.sampler is not None else PeakSampler()
            self._write("step", {"workers": info.workers, "steady_vmhwm_mib": steady,
                                 "alloc_start_bytes": alloc.start_bytes, "alloc_peak_bytes": alloc.peak_bytes,
                                 "vmhwm_mib": max(steady, self.early.get("early_vmhwm_mib", steady)),
                                 "vmpeak_mib": vmpeak_mib(), "live_tensor_bytes": gpt.live_tensor_bytes(),
                                 **self.early})
        return None

    def on_train_end(self, step: int) -> None:
        if os.environ.get(PROBE_DIR) and self.rank is not None:
            self._write("end", {"end_vmhwm_mib": H.vmhwm_mib(), "end_vmpeak_mib": vmpeak_mib()})


def read_probes(probe_dir: str, workers: int) -> list[dict | None]:
    """Each worker's probe records merged (None for a worker that wrote none)."""
    probes: dict[int, dict] = {}
    for name in sorted(os.listdir(probe_dir)):
        with open(os.path.join(probe_dir, name)) as f:
            rec = json.load(f)
        probes.setdefault(rec["rank"], {}).update(rec)
    return [probes.get(r) for r in range(workers)]


def limited_model(size: str) -> torch.nn.Module:
    """The model factory: in a worker (not the launcher) of a run with ``$VF_BENCH_AS_LIMIT_MIB``,
    the address-space limit is set first, before the model's memory is allocated."""
    if os.environ.get(LIMIT_ENV) and os.environ.get(LAUNCHER_ENV) != str(os.getpid()):
        apply_as_limit(float(os.environ[LIMIT_ENV]))
    return gpt.build(size)


def make_job(size: str):
    import virtualflow as vf

    cfg = gpt.SIZES[size]
    return vf.Job(model=functools.partial(limited_model, size), optimizer=gpt.adamw, loss=gpt.lm_loss,
                  dataset=functools.partial(gpt.token_data, cfg), global_batch_size=8, virtual_nodes=4,
                  seed=H.SEED, name=f"{NAME}-{size}", callbacks=[MemoryProbe()], tokens_per_sample=cfg.seq)


def job_gpt_21m():
    return make_job("gpt-21m")


def job_gpt_105m():
    return make_job("gpt-105m")


JOBS = {"gpt-21m": job_gpt_21m, "gpt-105m": job_gpt_105m}


# --------------------------------------------------------------------------------------------
# Pure parts: the memory bound, the limit, the error's reading, the targets.


def two_largest(unit_bytes: list[int]) -> int:
    """Bytes of the two largest units gathered at once (a unit and the next one prefetched)."""
    return sum(sorted(unit_bytes, reverse=True)[:2])


def memory_bound(unsharded: int, unit_bytes: list[int], workers: int, slack: float = SLACK) -> float:
    """The issue's bound on a worker's training state: 1/W of the unsharded state, plus the two
    largest units gathered, plus ``slack``."""
    return (1.0 + slack) * (unsharded / workers + two_largest(unit_bytes))


def pick_limit(sharded_peak_mib: float, unsharded_peak_mib: float, min_gap_mib: float = 64.0) -> float | None:
    """The per-worker address-space limit: halfway between the sharded workers' peak and the
    unsharded worker's; None when they are closer than ``min_gap_mib`` (no limit separates them)."""
    if not unsharded_peak_mib - sharded_peak_mib >= min_gap_mib:  # NaN (a peak not measured) included
        return None
    return (sharded_peak_mib + unsharded_peak_mib) / 2.0


def is_oom(text: str | None) -> bool:
    low = (text or "").lower()
    return any(w in low for w in OOM_WORDS)


def names_knob(text: str | None) -> bool:
    """Does an error report name the knob that fixes it (``reduction="fsdp"`` or ``--reduction fsdp``)?"""
    low = (text or "").lower()
    return any(form in low for form in KNOB_FORMS)


def resize_allowance(moved: int, bandwidth: float) -> float:
    """The issue's bound on a resize pause: 1 s plus the moved bytes at the measured bandwidth."""
    return RESIZE_FIXED_S + moved / bandwidth


def check_resize(t: H.Targets, resize: dict) -> None:
    """The resize pause's target, one check per change of generation (a run that lost a worker,
    or a change without a second step to time, is a miss)."""
    t.holds("resize: the resized run completed every change without losing a worker",
            not resize["failures"] and len(resize["pauses"]) == len(RESIZE_SIZES) - 1, "; ".join(resize["failures"]))
    for p in resize["pauses"]:
        allowance = resize_allowance(p["moved_bytes"], resize["bandwidth_bytes_s"])
        pause = float("nan") if p["pause_s"] is None else p["pause_s"]
        t.at_most("resize_pause", f"resize {len(p['old_members'])} -> {len(p['new_members'])} workers: pause (gap "
                  f"between the generations' steps - an ordinary step) / (1 s + {H.mib(p['moved_bytes'])} moved "
                  f"/ measured bandwidth)", pause / allowance, 1.0)


def check_targets(t: H.Targets, fig: dict) -> list[list]:
    """Check every target on the measured figures (plain numbers, no processes); the table's rows.

    ``fig``: ``unsharded_state_bytes`` (U), ``unit_bytes``, ``vf_unsharded_steady_vmhwm_mib``,
    ``vf_unsharded_alloc_peak_bytes``, ``plain_alloc_peak_bytes`` (FSDP2's baseline: the plain loop),
    ``per_w`` {W: ``fsdp2_step_s``, ``vf_step_s``, ``det_step_s`` (lists, one per repetition),
    ``fsdp2_vmhwm_mib``, ``vf_vmhwm_mib`` (whole run), ``fsdp2_steady_vmhwm_mib``,
    ``vf_steady_vmhwm_mib`` (steady steps; each per rank), ``vf_live_tensor_bytes``,
    ``vf_alloc_peak_bytes``, ``fsdp2_alloc_peak_bytes`` (per rank),
    ``det_bit_identical``}, and ``limit``
    (None when not run) with ``limit_mib``, ``unsharded_error``, ``sharded_error``,
    ``sharded_bit_identical``."""
    U, units = fig["unsharded_state_bytes"], fig["unit_bytes"]
    rows = []
    for w, r in sorted(fig["per_w"].items()):
        bound = memory_bound(U, units, w)
        left = max(r["vf_alloc_peak_bytes"]) - fig["vf_unsharded_alloc_peak_bytes"] + U
        mem = t.at_most("mem_formula", f"W={w}: virtualflow's state per worker by the allocator's peak in a steady "
                        f"step (peak_W - peak_unsharded + U) / (1.10 (U/W + two largest units))", left / bound, 1.0)
        rss_left = (max(r["vf_steady_vmhwm_mib"]) - fig["vf_unsharded_steady_vmhwm_mib"]) * 2 ** 20 + U
        fsdp2_left = max(r["fsdp2_alloc_peak_bytes"]) - fig["plain_alloc_peak_bytes"] + U
        held = max(r["vf_live_tensor_bytes"])
        mem_t = t.at_most("mem_tensors", f"W={w}: virtualflow's tensors held per worker at a step's end (every live "
                          f"storage) / (1.10 (U/W + two largest units))", held / bound, 1.0)
        vs = max(r["vf_vmhwm_mib"]) / max(r["fsdp2_vmhwm_mib"])
        mem2 = t.at_most("mem_vs_fsdp2", f"W={w}: virtualflow / FSDP2 peak RSS per worker over the whole run "
                         f"(largest)", vs, TARGET_MEM_VS_FSDP2)
        time_ratio = H.median([a / b for a, b in zip(r["vf_step_s"], r["fsdp2_step_s"])])
        tm = (t.at_most("time_ratio", f"W={w}: virtualflow (default mode) / FSDP2 step time", time_ratio, TARGET_TIME)
              if w in TIME_WORKERS else None)
        det_ratio = H.median([a / b for a, b in zip(r["det_step_s"], r["vf_step_s"])])
        dm = t.at_most("det_ratio", f"W={w}: deterministic / default mode step time", det_ratio, TARGET_DET)
        bit = t.holds(f"W={w}: deterministic fsdp weights bit-identical to the unsharded deterministic run",
                      r["det_bit_identical"])
        rows.append([w, f"{H.median(r['fsdp2_step_s']):.3f}", f"{H.median(r['vf_step_s']):.3f}",
                     f"{H.median(r['det_step_s']):.3f}", f"{time_ratio:.3f} {'-' if tm is None else H.yes_no(tm)}",
                     f"{det_ratio:.3f} {H.yes_no(dm)}",
                     f"{max(r['fsdp2_vmhwm_mib']):.0f} / {max(r['fsdp2_steady_vmhwm_mib']):.0f}",
                     f"{max(r['vf_vmhwm_mib']):.0f} / {max(r['vf_steady_vmhwm_mib']):.0f}",
                     f"{vs:.3f} {H.yes_no(mem2)}",
                     f"{left / 2 ** 20:.0f} / {bound / 2 ** 20:.0f} {H.yes_no(mem)}", f"{fsdp2_left / 2 ** 20:.0f}",
                     f"{rss_left / 2 ** 20:.0f}",
                     f"{held / 2 ** 20:.0f} {H.yes_no(mem_t)}", H.yes_no(bit)])
    if fig.get("resize") is not None:
        check_resize(t, fig["resize"])
    lim = fig.get("limit")
    if lim is not None:
        t.holds(f"no fit: a per-worker limit separates the sharded and unsharded peaks "
                f"({H.num(lim['limit_mib'], '.0f')} MiB)", lim["limit_mib"] is not None)
        if lim["limit_mib"] is not None:
            t.holds("no fit: unsharded training under the limit fails with an out-of-memory error",
                    is_oom(lim["unsharded_error"]))
            t.holds("no fit: its report names the knob that fixes it (reduction='fsdp', --reduction fsdp)",
                    names_knob(lim["unsharded_error"]))
            t.holds(f"no fit: sharded training on {LIMIT_WORKERS} workers completes under the same limit",
                    lim["sharded_error"] is None, lim["sharded_error"] or "")
            t.holds("no fit: ... bit-identical to the unsharded deterministic run made without the limit",
                    lim["sharded_bit_identical"])
    return rows


HEADER = ["W", "FSDP2 step s", "vf step s", "vf det step s", "vf / FSDP2 (<= 1.05)", "det / default (<= 1.15)",
          "FSDP2 VmHWM MiB run / steady", "vf VmHWM MiB run / steady", "vf / FSDP2 mem, run (<= 1)",
          "vf state by allocator / bound MiB", "FSDP2 state by allocator MiB", "vf state by RSS MiB",
          "tensors held MiB", "det bit-identical"]


# --------------------------------------------------------------------------------------------
# The runs.


def run_torch(args, workers: int, *, sharded: bool, save: str | None = None) -> dict:
    """FSDP2 on ``workers`` ranks (or the plain loop: ``sharded=False``, 1 worker)."""
    with H.LoadMeter() as meter:
        ranks = run_fsdp2(MODULE, workers, size=args.size, V=args.vns, B=args.batch, steps=args.steps,
                          warmup=args.warmup, sharded=sharded, save=save, timeout_s=args.timeout)
    return {"ranks": ranks, "other_load_cores": meter.other_cores,
            "median_step_s": H.median(ranks[0]["step_times"][args.warmup:])}


def _probe_env(probe_dir: str, args, limit_mib: float | None) -> dict[str, str]:
    env = {PROBE_DIR: probe_dir, PROBE_STEP: str(args.steps - 1), PROBE_RESET: str(args.warmup - 1)}
    if limit_mib is not None:
        env.update({LIMIT_ENV: f"{limit_mib:.1f}", LAUNCHER_ENV: str(os.getpid())})
    return env


def run_vf(args, workers: int, *, reduction: str, deterministic: bool, limit_mib: float | None = None,
           **knobs) -> dict:
    """``virtualflow.train`` of the job (``knobs``: more ``LaunchOptions``); its step times,
    per-worker memory, final weights (or the error, under a limit)."""
    import virtualflow as vf

    probe_dir = tempfile.mkdtemp(prefix="sharded_params-probe-")
    env = _probe_env(probe_dir, args, limit_mib)
    os.environ.update(env)
    try:
        with H.LoadMeter() as meter:
            result = vf.train(JOBS[args.size], workers=workers, steps=args.steps, virtual_nodes=args.vns,
                              global_batch_size=args.batch, threads_per_worker=1, reduction=reduction,
                              deterministic=deterministic, **knobs)
    except Exception as exc:  # noqa: BLE001 - under a limit the failure is the measurement
        if limit_mib is None:
            raise
        tb = getattr(exc, "worker_traceback", None)
        return {"error": f"{type(exc).__name__}: {exc}" + (f"\n{tb}" if tb else ""),
                "failed_at_step": getattr(exc, "step", None)}
    finally:
        for k in env:
            os.environ.pop(k, None)
    times = [h["step_time_s"] for h in result.history]
    return {"median_step_s": H.median(times[args.warmup:]), "step_times": times,
            "losses": [h["loss"] for h in result.history], "failures": [f["cause"] for f in result.failures],
            "error": f"workers lost: {result.failures}" if result.failures else None,
            "probes": read_probes(probe_dir, workers),
            "optimizer_bytes": dict(result.optimizer_bytes), "peak_rss_mib": dict(result.peak_rss_mib),
            "other_load_cores": meter.other_cores, "state_dict": result.state_dict}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank_figure(run: dict, key: str, rank: int) -> float:
    """A figure of one rank of a PyTorch run (``ranks``) or one worker of a virtualflow run (``probes``)."""
    return run["ranks"][rank][key] if "ranks" in run else probe_mib(run, key)[rank]


def probe_mib(run: dict, key: str) -> list[float]:
    """Each worker's probed figure (NaN for a worker that wrote none, or none of it: no glibc)."""
    return [float("nan") if not p or p.get(key) is None else p[key] for p in run["probes"]]


def measure_baselines(args) -> dict:
    """The unsharded runs at W = 1: the plain loop (U, the training state), virtualflow's default
    mode (the RSS baseline of the memory bound) and its deterministic mode (the weights every
    deterministic run must equal: ``reference``; its address space, the limit's upper side)."""
    plain = run_torch(args, 1, sharded=False)["ranks"][0]
    U = sum(plain["state_bytes"][k] for k in ("params", "grads", "optimizer"))
    print(f"  plain loop (W=1): {H.median(plain['step_times'][args.warmup:]):.3f} s/step, state {H.mib(U)}, "
          f"VmHWM {plain['vmhwm_mib']:.0f} MiB (steady steps {plain['steady_vmhwm_mib']:.0f}), allocator "
          f"{H.mib(plain['alloc_peak_bytes'])} at a steady step's peak", flush=True)
    base = run_vf(args, 1, reduction="allreduce", deterministic=False)
    base.pop("state_dict")
    ref = run_vf(args, 1, reduction="allreduce", deterministic=True)
    reference = ref.pop("state_dict")
    for name, r in (("default", base), ("deterministic", ref)):
        print(f"  virtualflow unsharded {name} (W=1): {r['median_step_s']:.3f} s/step, VmHWM "
              f"{probe_mib(r, 'vmhwm_mib')[0]:.0f} MiB (steady steps {probe_mib(r, 'steady_vmhwm_mib')[0]:.0f}), "
              f"VmPeak {probe_mib(r, 'vmpeak_mib')[0]:.0f} MiB, allocator "
              f"{H.mib(probe_mib(r, 'alloc_start_bytes')[0])} at a steady step's start, "
              f"{H.mib(probe_mib(r, 'alloc_peak_bytes')[0])} at its peak", flush=True)
    return {"unsharded_state_bytes": U, "plain_state_bytes": plain["state_bytes"],
            "plain_alloc_peak_bytes": plain["alloc_peak_bytes"],
            "plain_vmhwm_mib": plain["vmhwm_mib"], "plain_step_s": H.median(plain["step_times"][args.warmup:]),
            "vf_unsharded_vmhwm_mib": probe_mib(base, "vmhwm_mib")[0], "vf_unsharded_step_s": base["median_step_s"],
            "vf_unsharded_steady_vmhwm_mib": probe_mib(base, "steady_vmhwm_mib")[0],
            "vf_unsharded_alloc_peak_bytes": probe_mib(base, "alloc_peak_bytes")[0],
            "vf_unsharded_alloc_start_bytes": probe_mib(base, "alloc_start_bytes")[0],
            "vf_unsharded_det_vmpeak_mib": probe_mib(ref, "vmpeak_mib")[0],
            "vf_unsharded_det_vmhwm_mib": probe_mib(ref, "vmhwm_mib")[0],
            "vf_unsharded_det_step_s": ref["median_step_s"],
            "raw": {"plain": plain, "vf_default": base, "vf_deterministic": ref}, "reference": reference}


def measure_w(args, workers: int, tmp: str, reference: dict[str, torch.Tensor]) -> dict:
    """``args.reps`` repetitions of FSDP2, virtualflow's default and deterministic modes at
    ``workers`` (the order rotating); the figures of one W."""
    save = os.path.join(tmp, f"fsdp2-w{workers}.pt")
    runners = {"fsdp2": lambda: run_torch(args, workers, sharded=True, save=save),
               "vf": lambda: run_vf(args, workers, reduction=args.reduction, deterministic=False),
               "det": lambda: run_vf(args, workers, reduction=args.reduction, deterministic=True)}
    runs: dict[str, list[dict]] = {k: [] for k in runners}
    diffs, bits = [], []
    for rep in range(args.reps):
        H.wait_for_quiet(args.quiet_wait)
        names = list(runners)
        for name in names[rep % 3:] + names[:rep % 3]:
            runs[name].append(runners[name]())
        diffs.append(H.state_max_abs_diff(runs["vf"][-1].pop("state_dict"), torch.load(save)))
        bits.append(same_bits(runs["det"][-1].pop("state_dict"), reference))
        print(f"  W={workers} rep {rep}: FSDP2 {runs['fsdp2'][-1]['median_step_s']:.3f} s, virtualflow "
              f"{runs['vf'][-1]['median_step_s']:.3f} s, deterministic {runs['det'][-1]['median_step_s']:.3f} s; "
              f"max |w_vf - w_FSDP2| {diffs[-1]:.1e}, deterministic bit-identical {bits[-1]}", flush=True)
    last = {k: v[-1] for k, v in runs.items()}
    return {
        "fsdp2_step_s": [r["median_step_s"] for r in runs["fsdp2"]],
        "vf_step_s": [r["median_step_s"] for r in runs["vf"]],
        "det_step_s": [r["median_step_s"] for r in runs["det"]],
        **{f"{side}{key}": [H.median([rank_figure(r, key, k) for r in runs[run]]) for k in range(workers)]
           for side, run in (("fsdp2_", "fsdp2"), ("vf_", "vf"), ("det_", "det"))
           for key in ("vmhwm_mib", "steady_vmhwm_mib", "alloc_peak_bytes")},
        "det_vmpeak_mib": probe_mib(last["det"], "vmpeak_mib"),
        "det_end_vmpeak_mib": probe_mib(last["det"], "end_vmpeak_mib"),
        "vf_end_vmhwm_mib": probe_mib(last["vf"], "end_vmhwm_mib"),
        "fsdp2_state_bytes": [r["state_bytes"] for r in last["fsdp2"]["ranks"]],
        "vf_live_tensor_bytes": probe_mib(last["vf"], "live_tensor_bytes"),
        "vf_alloc_start_bytes": probe_mib(last["vf"], "alloc_start_bytes"),
        "vf_optimizer_bytes": last["vf"]["optimizer_bytes"],
        "det_bit_identical": all(bits), "max_abs_weight_diff_vs_fsdp2": max(diffs),
        "other_load_cores": max(r["other_load_cores"] for rs in runs.values() for r in rs),
        "raw": runs,
    }


def measure_offload(args, workers: int = max(WORKERS)) -> dict:
    """Host offload (``offload="cpu"``, default mode) for the record: on this CPU machine the device
    is the host, so it shows the path's cost, not a saving of device memory (no target)."""
    r = run_vf(args, workers, reduction=args.reduction, deterministic=False, offload="cpu")
    r.pop("state_dict")
    out = {"workers": workers, "median_step_s": r["median_step_s"], "vmhwm_mib": probe_mib(r, "vmhwm_mib"),
           "steady_vmhwm_mib": probe_mib(r, "steady_vmhwm_mib"),
           "live_tensor_bytes": probe_mib(r, "live_tensor_bytes"), "other_load_cores": r["other_load_cores"]}
    print(f"  offload='cpu' (W={workers}, default mode): {out['median_step_s']:.3f} s/step, VmHWM "
          f"{max(out['vmhwm_mib']):.0f} MiB (steady {max(out['steady_vmhwm_mib']):.0f}), tensors held "
          f"{max(out['live_tensor_bytes']) / 2 ** 20:.0f} MiB", flush=True)
    return out


def measure_resize(args) -> dict:
    """The resize pause (:mod:`bench.harness.resize_pause`): the gloo point-to-point bandwidth on
    this machine, then the job launched on 4 workers, resized 4 -> 3 -> 4 (default mode), each
    change's pause from its records and the bytes the engine's plan moves for it."""
    from virtualflow.runtime.fsdp.units import resolve_units, unit_params

    bandwidth = R.p2p_bandwidth()
    print(f"  gloo point-to-point bandwidth: {bandwidth / 2 ** 20:.0f} MiB/s (a 64 MiB send between 2 processes)",
          flush=True)
    model = gpt.build(args.size)
    numels = [[p.numel() for p in u.params] for u in unit_params(model, resolve_units(model, None))]
    del model
    run = R.resize_run(JOBS[args.size], RESIZE_SIZES, virtual_nodes=args.vns, global_batch_size=args.batch,
                       threads_per_worker=1, reduction=args.reduction, deterministic=False, timeout_s=args.timeout)
    pauses = R.pauses(run["steps"], run["formed"])
    for p in pauses:
        p["moved_bytes"] = R.moved_bytes(numels, p["old_members"], p["new_members"], MOVED_BYTES_PER_ELEMENT)
        print(f"  resize {len(p['old_members'])} -> {len(p['new_members'])} after step {p['step'] - 1}: "
              f"{p['gap_s']:.3f} s between the steps' ends, ordinary step {H.num(p['ordinary_step_s'], '.3f')} s, "
              f"pause {H.num(p['pause_s'], '.3f')} s; moved {H.mib(p['moved_bytes'])} "
              f"({p['moved_bytes'] / bandwidth:.3f} s at the bandwidth); the controller's pause from the request "
              f"{H.num(p['controller_pause_s'])} s",
              flush=True)
    return {"bandwidth_bytes_s": bandwidth, "pauses": pauses, "failures": run["failures"],
            "steps": run["steps"], "formed": run["formed"]}


def measure_limit(args, sharded_peak: float, unsharded_peak: float, export_peak: float,
                  reference: dict[str, torch.Tensor]) -> dict:
    """The model that does not fit: the runs under a per-worker address-space limit between the
    training peaks (``export_peak``: the sharded workers' largest at the job's end, for the record)."""
    limit = pick_limit(sharded_peak, unsharded_peak)
    out = {"limit_mib": limit, "sharded_peak_mib": sharded_peak, "unsharded_peak_mib": unsharded_peak,
           "sharded_export_peak_mib": export_peak,
           "unsharded_error": None, "sharded_error": "not run", "sharded_bit_identical": False}
    if limit is None:
        print(f"  no limit separates the sharded peak {sharded_peak:.0f} MiB from the unsharded "
              f"{unsharded_peak:.0f} MiB")
        return out
    print(f"  limit RLIMIT_AS = {limit:.0f} MiB per worker (address space in training: sharded W={LIMIT_WORKERS} "
          f"{sharded_peak:.0f} MiB, unsharded {unsharded_peak:.0f} MiB; sharded at the job's end, after the final "
          f"export: {export_peak:.0f} MiB)", flush=True)
    unsharded = run_vf(args, 1, reduction="allreduce", deterministic=True, limit_mib=limit)
    out["unsharded_error"] = unsharded.get("error") or "completed (no error)"
    sharded = run_vf(args, LIMIT_WORKERS, reduction=args.reduction, deterministic=True, limit_mib=limit)
    out["sharded_error"] = sharded.get("error")
    out["sharded_failed_at_step"] = sharded.get("failed_at_step")  # == steps: after training, in the final export
    out["sharded_bit_identical"] = "state_dict" in sharded and same_bits(sharded.pop("state_dict"), reference)
    out["sharded_vmpeak_mib"] = probe_mib(sharded, "vmpeak_mib") if "probes" in sharded else None
    print(f"  under the limit: unsharded virtualflow: {out['unsharded_error'].splitlines()[0][:300]}\n"
          f"    sharded virtualflow (W={LIMIT_WORKERS}): {(out['sharded_error'] or 'completed')[:2000]}\n"
          f"    bit-identical to the unsharded deterministic run: {out['sharded_bit_identical']}"
          + (f"\n    (it failed after its last step, {args.steps - 1}: in the final state's export)"
             if out["sharded_failed_at_step"] == args.steps else ""), flush=True)
    return out


# --------------------------------------------------------------------------------------------
# Report and command line.


def markdown(run: H.Run, args, fig: dict, rows: list[list]) -> str:
    lim = fig.get("limit")
    U = fig["unsharded_state_bytes"]
    lines = [
        f"# {run.name}: reduction='fsdp' against FSDP2 (fully_shard per block, gloo)", "", H.env_markdown(), "",
        f"Workload: {gpt.SIZES[args.size].describe()} ({fig['params'] / 1e6:.1f} M parameters), AdamW, global batch "
        f"{args.batch} sequences in V={args.vns} micro-batches, {args.steps} steps ({args.warmup} warm-up), "
        f"{args.reps} repetition(s), 1 thread per process, virtualflow reduction={args.reduction!r}. Unsharded "
        f"training state U = {H.mib(U)} (parameters {H.mib(fig['plain_state_bytes']['params'])}, gradients "
        f"{H.mib(fig['plain_state_bytes']['grads'])}, AdamW {H.mib(fig['plain_state_bytes']['optimizer'])}, "
        f"measured in the plain loop, whose VmHWM is {fig['plain_vmhwm_mib']:.0f} MiB); two largest units "
        f"{H.mib(two_largest(fig['unit_bytes']))}; unsharded virtualflow worker (default mode) VmHWM "
        f"{fig['vf_unsharded_vmhwm_mib']:.0f} MiB, {fig['vf_unsharded_steady_vmhwm_mib']:.0f} MiB in the steady "
        f"steps; the C allocator's peak in a steady step: unsharded virtualflow "
        f"{H.mib(fig['vf_unsharded_alloc_peak_bytes'])}, plain loop {H.mib(fig['plain_alloc_peak_bytes'])}. VmHWM "
        f"columns: the whole run's peak / the steady steps' peak (the worker with the largest). State by "
        f"allocator: peak_W - peak_unsharded + U (FSDP2: - the plain loop's peak); by RSS: steady VmHWM_W - "
        f"VmHWM_unsharded + U, for the record.", "",
        H.md_table(HEADER, rows), ""]
    off = fig.get("offload")
    if off is not None:
        lines += [f"Host offload (`offload=\"cpu\"`, default mode, W={off['workers']}; the device is the host "
                  f"here): {off['median_step_s']:.3f} s/step, VmHWM {max(off['vmhwm_mib']):.0f} MiB (steady "
                  f"{max(off['steady_vmhwm_mib']):.0f}), tensors held {max(off['live_tensor_bytes']) / 2 ** 20:.0f} "
                  f"MiB.", ""]
    if lim is not None:
        lines += [f"Model that does not fit: per-worker RLIMIT_AS {H.num(lim['limit_mib'], '.0f')} MiB, halfway "
                  f"between the peak address spaces in training (sharded W={LIMIT_WORKERS}: "
                  f"{lim['sharded_peak_mib']:.0f} MiB, unsharded: {lim['unsharded_peak_mib']:.0f} MiB; the sharded "
                  f"workers' largest at the job's end, after the final export: "
                  f"{lim['sharded_export_peak_mib']:.0f} MiB).", "",
                  f"- unsharded virtualflow: `{(lim['unsharded_error'] or '').splitlines()[0][:300]}`",
                  f"- sharded virtualflow on {LIMIT_WORKERS} workers: "
                  f"`{(lim['sharded_error'] or 'completed').splitlines()[0][:300]}`; bit-identical to the "
                  f"unsharded deterministic run: {lim['sharded_bit_identical']}", ""]
    rz = fig.get("resize")
    if rz is not None:
        lines += [f"Resize pause (launched on {RESIZE_SIZES[0]} workers, default mode; gloo point-to-point "
                  f"bandwidth {rz['bandwidth_bytes_s'] / 2 ** 20:.0f} MiB/s):", ""]
        lines += [f"- {len(p['old_members'])} -> {len(p['new_members'])} workers after step {p['step'] - 1}: "
                  f"{p['gap_s']:.3f} s between the steps' ends, an ordinary step {H.num(p['ordinary_step_s'])} s, "
                  f"pause {H.num(p['pause_s'])} s; {H.mib(p['moved_bytes'])} moved, allowance "
                  f"{resize_allowance(p['moved_bytes'], rz['bandwidth_bytes_s']):.3f} s" for p in rz["pauses"]]
        lines += [""]
    lines += [f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    p = H.parser(__doc__, reps=1, reps_help="repetitions of each W (the order of FSDP2, default and deterministic "
                 "rotating)", quiet_wait=60.0)
    p.add_argument("--size", choices=sorted(gpt.SIZES), default="gpt-105m", help="the model (--quick: gpt-21m)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the medians")
    p.add_argument("--vns", type=int, default=4, help="V: micro-batches (virtual nodes) per step")
    p.add_argument("--batch", type=int, default=16, help="B: sequences per step")
    p.add_argument("--reduction", default="fsdp", choices=("fsdp", "sharded"),
                   help="virtualflow's layout measured (sharded: ZeRO-1/2, for comparison)")
    p.add_argument("--no-limit", action="store_true", help="skip the model-that-does-not-fit part")
    p.add_argument("--no-resize", action="store_true", help="skip the resize pause")
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on one run, seconds")
    p.add_argument("--child-fsdp2", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_fsdp2:
        return args
    if args.quick:
        args.size, args.steps, args.warmup, args.batch = "gpt-21m", 5, 2, 8
        args.quiet_wait = min(args.quiet_wait, 10.0)
    if args.steps <= args.warmup or args.warmup < 1:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} (at least 1)")
    if any(args.vns % w for w in (*WORKERS, LIMIT_WORKERS)) or args.batch % args.vns:
        p.error(f"--vns={args.vns} must be a multiple of {max(WORKERS)} and divide --batch={args.batch}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_fsdp2:
        print(json.dumps(fsdp2_rank(json.loads(args.child_fsdp2))))
        return 0
    H.apply_malloc_mode("stable")
    os.environ.setdefault("MALLOC_ARENA_MAX", ARENA_MAX)
    run = H.Run(NAME, args, TARGET_KEYS)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    model = gpt.build(args.size)
    params, unit_bytes = sum(p.numel() for p in set(model.parameters())), gpt.unit_param_bytes(model)
    del model
    print(H.banner(f"reduction={args.reduction!r} vs FSDP2 (fully_shard per block, gloo): {args.size} "
                   f"({params / 1e6:.1f} M params), B={args.batch} in V={args.vns}, "
                   f"W = {', '.join(map(str, WORKERS))}"))
    tmp = tempfile.mkdtemp(prefix="sharded_params-")

    fig = measure_baselines(args)
    reference = fig.pop("reference")
    per_w = {w: measure_w(args, w, tmp, reference) for w in WORKERS}
    offload = measure_offload(args) if args.reduction == "fsdp" else None
    resize = measure_resize(args) if args.reduction == "fsdp" and not args.no_resize else None
    limit = None
    if not args.no_limit:
        det = per_w[LIMIT_WORKERS]
        limit = measure_limit(args, max(det["det_vmpeak_mib"]), fig["vf_unsharded_det_vmpeak_mib"],
                              max(det["det_end_vmpeak_mib"]), reference)
    fig.update(params=params, unit_bytes=unit_bytes, per_w=per_w, limit=limit, offload=offload, resize=resize)
    rows = check_targets(run.targets, fig)
    print()
    print(H.text_table(HEADER, rows))
    config = {"size": args.size, "params": params, "model": gpt.SIZES[args.size].describe(), "steps": args.steps,
              "warmup": args.warmup, "reps": args.reps, "virtual_nodes": args.vns, "global_batch": args.batch,
              "reduction": args.reduction, "quick": args.quick, "threads_per_process": 1, "slack": SLACK,
              "malloc_env": {k: os.environ.get(k) for k in (*H.MALLOC_STABLE, "MALLOC_ARENA_MAX")},
              "memory": "VmHWM / VmPeak / live tensor bytes at the end of the last step, before any final gather "
                        "(virtualflow: MemoryProbe, a ranks='all' callback); FSDP2: also parameters, gradients and "
                        "optimizer state by name (local shards)",
              "timing": "median step time after the warm-up (virtualflow: Result.history step_time_s; PyTorch: rank "
                        "0 end to end); ratio = median over repetitions of the same repetition's ratio"}
    payload = {"benchmark": run.name, "environment": H.environment(), "config": config,
               "results": fig}
    return run.finish(payload, markdown(run, args, fig, rows), dump=lambda x: json.dumps(x, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
