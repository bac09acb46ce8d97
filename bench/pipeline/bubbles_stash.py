"""(2) + (3) emulated compute, p = 4: bubbles against each schedule's nominal ones, the stash
(live micro-batch contexts, from saved-tensor hooks) and the weight versions of 2BW.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from bench import harness as H
from bench.pipeline.workload import (
    COMPUTE, CPU, EMU_MB, EMU_P, EMU_SCHEDULES, PacedLayer, TARGET_BUBBLE_ERR, TARGET_TPUT_2BW, emu_data, emu_job,
)
from bench.pipeline.children import Driver, start_children
from bench.pipeline.vs_torch import message_latency


class _StashMeter:
    """Live micro-batch contexts of this process, from saved-tensor hooks. A forward pre-hook on
    each piece opens a context and notes the weight version its layers see (under 2BW's
    ``functional_call``, the snapshot in use); every tensor autograd saves during it is tagged with
    the context; the context is live while any of them is. Weight snapshots (2BW) are counted
    alive from their creation until freed (``weakref.finalize``)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        self.current = -1
        self.next_id = 0
        self.peak = 0
        self.peak_versions = 0
        self.versions_seen: set[int] = set()
        self.snapshots_alive = 0
        self.peak_snapshots_at_forward = 0
        self.peak_snapshots_transient = 0
        self.snapshots_made = 0

    def opener(self, piece: nn.Module):
        paced = next(x for x in piece.children() if isinstance(x, PacedLayer))

        def open_context(module, args) -> None:
            self.current = self.next_id
            self.next_id += 1
            ptr = paced.gain.data_ptr()
            self.version_of[self.current] = ptr
            self.versions_seen.add(ptr)
            self.peak_snapshots_at_forward = max(self.peak_snapshots_at_forward, self.snapshots_alive)

        return open_context

    def wrap_snapshot(self, engine) -> None:
        """Count the weight snapshots ``StageEngine._snapshot`` makes (2BW) while they are alive."""
        make = engine._snapshot

        def snapshot(k: int):
            version = make(k)
            self.snapshots_made += 1
            self.snapshots_alive += 1
            self.peak_snapshots_transient = max(self.peak_snapshots_transient, self.snapshots_alive)
            weakref.finalize(next(iter(version.values())), self._snapshot_freed)
            return version

        engine._snapshot = snapshot

    def _snapshot_freed(self) -> None:
        self.snapshots_alive -= 1

    def pack(self, t):
        return _Saved(self, self.current, t)

    @staticmethod
    def unpack(obj):
        return obj.t


class _Saved:
    __slots__ = ("meter", "ctx", "t")

    def __init__(self, meter: _StashMeter, ctx: int, t) -> None:
        self.meter, self.ctx, self.t = meter, ctx, t
        live = meter.live
        live[ctx] = live.get(ctx, 0) + 1
        if len(live) > meter.peak:
            meter.peak = len(live)
        versions = len({meter.version_of[c] for c in live})
        if versions > meter.peak_versions:
            meter.peak_versions = versions

    def __del__(self) -> None:
        live = self.meter.live
        live[self.ctx] -= 1
        if not live[self.ctx]:
            del live[self.ctx]


def emu_rank(cfg: dict) -> dict:
    """One rank of the emulated pipeline: every schedule in turn, with timelines and stash counts."""
    from virtualflow.plan.pipeline.geometry import bounds_from_counts
    from virtualflow.backends.inprocess import build_engine

    drv = Driver(cfg, EMU_P)
    rank, m, window = cfg["rank"], cfg["m"], cfg["window"]
    ds = emu_data()
    out: dict = {"rank": rank, "runs": {}}
    for schedule in cfg["schedules"]:
        job = emu_job(schedule, m, cfg["f"], cfg["i"], cfg["w"], window)
        engine = build_engine(job, job.pipeline, bounds_from_counts(job.pipeline.split), rank, dataset=ds,
                              deterministic=False, device=CPU)
        engine.set_layout(0, [list(range(m))])
        meter = _StashMeter()
        hooks = [piece.register_forward_pre_hook(meter.opener(piece)) for piece in engine.pieces.values()]
        meter.wrap_snapshot(engine)
        module_ptrs = {q.data_ptr() for q in engine.model.parameters()}
        per_call = 1 if job.pipeline.flush else window
        calls = cfg["flush_steps"] if job.pipeline.flush else cfg["windows"]
        timeline, call_times = [], []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            for c in range(calls):
                drv.barrier()  # line up (untimed)
                t0 = time.time()
                drv.run(engine, c * per_call, per_call)
                call_times.append(time.time() - t0)
                timeline += [{**e, "call": c} for e in engine.timeline]
                engine.timeline.clear()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        for h in hooks:
            h.remove()
        out["runs"][schedule] = {
            "timeline": timeline, "call_times": call_times, "steps_per_call": per_call, "cpu_s": cpu_s,
            "wall_s": wall_s, "peak_stash": meter.peak, "peak_versions_in_flight": meter.peak_versions,
            "versions_seen": len(meter.versions_seen), "peak_snapshots_at_forward": meter.peak_snapshots_at_forward,
            "peak_snapshots_transient": meter.peak_snapshots_transient, "snapshots_made": meter.snapshots_made,
            "forward_used_module_weights": bool(meter.versions_seen & module_ptrs), "left_live": len(meter.live),
        }
        drv.barrier()
    drv.close()
    return out


def _emu_schedule(schedule: str, m: int, window: int):
    from virtualflow.plan.pipeline import SCHEDULES

    if schedule == "interleaved_1f1b":
        return SCHEDULES[schedule](EMU_P, m, 2)
    if schedule == "2bw":
        return SCHEDULES[schedule](EMU_P, m, window)
    return SCHEDULES[schedule](EMU_P, m)


def _nominal_times(schedule: str, f: float, i: float, w: float) -> tuple[list, list, list]:
    """Per-stage (f, b, w) the emulation was built with. zb_h1: stage 0 has no input gradient to
    compute (its input is data), so its ``I`` is empty and its ``W`` runs the whole backward (the
    executor's split); elsewhere ``I`` = i, ``W`` = w."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    n = EMU_P * v
    return [f / v] * n, [(i + w) / v] * n, [(i + w) / v] + [w / v] * (n - 1)


def _measured_times(timelines: list[list[dict]], n_stages: int, calls: set) -> tuple[list, list, list]:
    """Per-stage median durations from the timelines: (F, B or I + W, W or 0)."""
    d: dict[tuple[str, int], list[float]] = {}
    for tl in timelines:
        for e in tl:
            if e["call"] in calls and e["kind"] in COMPUTE:
                d.setdefault((e["kind"], e["stage"]), []).append(e["end"] - e["start"])
    med = {k: H.median(v) for k, v in d.items()}
    fs = [med[("F", s)] for s in range(n_stages)]
    if ("B", 0) in med:
        return fs, [med[("B", s)] for s in range(n_stages)], [0.0] * n_stages
    ws = [med[("W", s)] for s in range(n_stages)]
    return fs, [med[("I", s)] + ws[s] for s in range(n_stages)], ws


def measure_emu(args) -> dict:
    from virtualflow.plan.pipeline import simulate

    cfg = {"schedules": list(EMU_SCHEDULES), "m": args.emu_m, "f": args.f_ms / 1e3, "i": args.i_ms / 1e3,
           "w": args.w_ms / 1e3, "window": args.window, "flush_steps": args.emu_steps, "windows": args.emu_windows}
    H.wait_for_quiet(args.quiet_wait)
    with H.LoadMeter() as meter:
        ranks = start_children("--child-emu", EMU_P, cfg)
    m, f, i, w, window = cfg["m"], cfg["f"], cfg["i"], cfg["w"], cfg["window"]
    res: dict = {"other_load_cores": meter.other_cores, "config": cfg, "schedules": {}}
    for s in EMU_SCHEDULES:
        sched = _emu_schedule(s, m, window)
        sim = simulate(sched, *_nominal_times(s, f, i, w))
        per = [r["runs"][s] for r in ranks]
        n_calls = len(per[0]["call_times"])
        calls = set(range(1 if n_calls > 1 else 0, n_calls))  # the first call is warm-up
        timelines = [[e for e in p["timeline"] if e["call"] in calls] for p in per]
        bubbles, spans = [], []
        per_rank = [[] for _ in range(EMU_P)]
        for c in sorted(calls):
            ev = [[e for e in tl if e["call"] == c and e["kind"] in COMPUTE] for tl in timelines]
            span = max(e["end"] for r in ev for e in r) - min(e["start"] for r in ev for e in r)
            spans.append(span)
            for r in range(EMU_P):
                per_rank[r].append(1 - sum(e["end"] - e["start"] for e in ev[r]) / span)
            bubbles.append(sum(b[-1] for b in per_rank) / EMU_P)
        lat = message_latency(timelines)
        comm = H.median(lat) if lat else 0.0
        calib = simulate(sched, *_measured_times(timelines, sched.stages, calls), comm_time=comm)
        measured = H.median(bubbles)
        sim_bubble = sum(sim.bubble) / EMU_P
        calib_bubble = sum(calib.bubble) / EMU_P
        call_time = H.median([max(xs) for xs in zip(*(p["call_times"] for p in per))][min(calls):])
        spc = per[0]["steps_per_call"]
        row = res["schedules"][s] = {
            "measured_bubble": measured, "measured_bubble_per_rank": [H.median(b) for b in per_rank],
            "simulated_bubble": sim_bubble, "simulated_bubble_per_rank": list(sim.bubble),
            "error_points": 100 * (measured - sim_bubble),
            "calibrated_bubble": calib_bubble, "calibrated_error_points": 100 * (measured - calib_bubble),
            "message_latency_median_s": comm, "message_latency_p90_s": H.quantile(lat, 0.9) if lat else None,
            "measured_span_s": H.median(spans), "simulated_span_s": float(sim.step_time),
            "calibrated_span_s": float(calib.step_time),
            "call_time_s": call_time, "steps_per_call": spc,
            "throughput_samples_s": m * EMU_MB * spc / call_time,
            "peak_stash_measured": [p["peak_stash"] for p in per], "stash_bound": list(sched.stash_bound),
            "simulator_peak_stash": list(sim.peak_stash), "weight_versions_bound": list(sched.weight_versions),
            "peak_versions_in_flight": [p["peak_versions_in_flight"] for p in per],
            "peak_snapshots_at_forward": [p["peak_snapshots_at_forward"] for p in per],
            "peak_snapshots_transient": [p["peak_snapshots_transient"] for p in per],
            "forward_used_module_weights": [p["forward_used_module_weights"] for p in per],
            "contexts_left_live": [p["left_live"] for p in per],
            "cpu_cores": sum(p["cpu_s"] / p["wall_s"] for p in per),
            "raw_bubbles": bubbles, "raw_spans_s": spans, "raw_call_times_s": [p["call_times"] for p in per],
        }
        if s == "1f1b":
            row["analytic_bubble"] = (EMU_P - 1) / (m + EMU_P - 1)
        print(f"  {s:17s} bubble {100 * measured:5.1f} %, simulated {100 * sim_bubble:5.1f} %"
              + (f", analytic {100 * row['analytic_bubble']:5.1f} %" if s == "1f1b" else "")
              + f", calibrated {100 * calib_bubble:5.1f} % (message latency {1e3 * comm:.2f} ms); span "
              f"{1e3 * row['measured_span_s']:.0f} ms (sim {1e3 * row['simulated_span_s']:.0f}, calibrated "
              f"{1e3 * row['calibrated_span_s']:.0f}); {row['throughput_samples_s']:.0f} samples/s; stash "
              f"{row['peak_stash_measured']} (bound {row['stash_bound']})"
              + (f"; versions in flight {row['peak_versions_in_flight']}, snapshots alive "
                 f"{row['peak_snapshots_at_forward']} (transient {row['peak_snapshots_transient']})"
                 if s == "2bw" else ""), flush=True)
    return res


def summarize_emu(emu: dict, targets: H.Targets) -> None:
    rows = emu["schedules"]
    for s, row in rows.items():
        targets.at_most("bubble_error", f"emulated p={EMU_P} {s}: |measured bubble - simulated| (points)",
                        abs(row["error_points"]), 100 * TARGET_BUBBLE_ERR)
    one = rows["1f1b"]
    targets.at_most("bubble_error", f"emulated p={EMU_P} 1f1b: |measured bubble - analytic (p-1)/(m+p-1)| (points)",
                    abs(100 * (one["measured_bubble"] - one["analytic_bubble"])), 100 * TARGET_BUBBLE_ERR)
    for s in ("interleaved_1f1b", "zb_h1"):
        targets.holds(f"emulated {s} bubble below 1f1b's", rows[s]["measured_bubble"] < one["measured_bubble"],
                      f"{100 * rows[s]['measured_bubble']:.1f} % vs {100 * one['measured_bubble']:.1f} %")
    targets.at_least("throughput_2bw", "emulated 2bw / 1f1b throughput (samples/s, a window of steps each)",
                     rows["2bw"]["throughput_samples_s"] / one["throughput_samples_s"], TARGET_TPUT_2BW)
    for s, row in rows.items():
        targets.holds(f"peak stashed activations per rank == stash_bound ({s})",
                      row["peak_stash_measured"] == row["stash_bound"],
                      f"measured {row['peak_stash_measured']}, bound {row['stash_bound']}")
    v = rows["2bw"]
    targets.holds("2bw: weight versions held per stage == 2 (snapshots alive at every forward, peak)",
                  v["peak_snapshots_at_forward"] == v["weight_versions_bound"],
                  f"measured {v['peak_snapshots_at_forward']}, bound {v['weight_versions_bound']}")
    targets.holds("2bw: weight versions used by live micro-batches <= 2 per stage",
                  all(x <= 2 for x in v["peak_versions_in_flight"]), f"measured {v['peak_versions_in_flight']}")
