"""(4) The time-compressed replay of a window of the p2 spot trace, and the simulator's prediction
for the availability the job actually had.
"""

from __future__ import annotations

import os
import tempfile
import time

from bench import harness as H
from bench.bamboo_failover.workload import P2_TRACE
from bench.bamboo_failover.running import full_depth, kill_stage, launch, steps_once, wait_until
from bench.bamboo_failover.kills import stuck_row


# --------------------------------------------------------------------------------------------
# (4) time-compressed replay of a window of the p2 trace.


def replay_plan(args) -> dict:
    from virtualflow.cluster.spot import load_trace

    trace = load_trace(P2_TRACE)
    lo, hi = (60.0 * x for x in args.replay_window_min)
    drops = []
    for i in range(1, len(trace.counts)):
        t = trace.times_s[i]
        if lo <= t < hi and trace.counts[i] < trace.counts[i - 1]:
            drops.append({"trace_t_s": t, "lost": trace.counts[i - 1] - trace.counts[i],
                          "at_s": (t - lo) / args.replay_speedup})
    return {"trace": P2_TRACE, "window_min": list(args.replay_window_min), "speedup": args.replay_speedup,
            "span_s": (hi - lo) / args.replay_speedup, "drops": drops,
            "fleet_counts_in_window": sorted({trace.count_at(t) for t in (lo, hi)})}


def run_replay(args, plan: dict) -> dict:
    order = [1 % args.stages, 2 % args.stages, 0] if args.stages >= 3 else [1, 0]
    kills: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        handle = launch(args, run_dir, True)
        try:
            H.wait_steps(handle, run_dir, 2, timeout_s=180)
            first = H.run_metrics(run_dir)
            step_s = H.median([m["step_time_s"] for m in first[1:]] or [first[0]["step_time_s"]])
            t0 = first[-1]["time"]
            with H.LoadMeter() as meter:
                for j, d in enumerate(plan["drops"]):
                    due = t0 + d["at_s"]
                    while time.time() < due:
                        if handle.done:
                            handle.wait(0)
                        time.sleep(0.01)
                    try:
                        wait_until(handle, lambda: full_depth(handle, run_dir, args.stages), args.stuck_s,
                              "full depth before a kill")
                    except Exception as exc:  # noqa: BLE001 - recorded: the replay stops here
                        row = stuck_row(handle, run_dir, True, kills[-1]["worker"] if kills else -1,
                                         kills[-1]["stage"] if kills else -1, t0 + (kills[-1]["at_s"] if kills else 0),
                                         exc)
                        return {**row, "kills": kills}
                    if time.time() >= t0 + plan["span_s"] - 1.0:
                        print(f"  replay: kill {j} skipped: full depth only at the end of the window", flush=True)
                        continue
                    stage = order[j % len(order)]
                    t_kill, victim, step = kill_stage(handle, stage, 0.0)
                    kills.append({"due_s": d["at_s"], "at_s": t_kill - t0, "deferred_s": t_kill - due,
                                  "stage": stage, "worker": victim, "step": step, "trace_t_s": d["trace_t_s"]})
                    print(f"  replay: kill {j} (trace {d['trace_t_s'] / 60:.1f} min): stage {stage} (worker {victim}) "
                          f"at {t_kill - t0:.1f} s (due {d['at_s']:.1f} s)", flush=True)
                t_end = t0 + plan["span_s"]
                while time.time() < t_end:
                    if handle.done:
                        handle.wait(0)
                    time.sleep(0.02)
                wait_until(handle, lambda: H.run_metrics(run_dir)[-1]["time"] >= t_end, 120, "a step after the window")
            result = handle.stop()
        finally:
            if not handle.done:
                try:
                    handle.stop(timeout_s=30)
                except Exception:  # noqa: BLE001 - already recorded
                    pass
        metrics, events = H.run_metrics(run_dir), H.run_events(run_dir)
    hist_steps = [h["step"] for h in result.history]
    in_window = [m for m in metrics if t0 < m["time"] <= t_end]
    samples = sum(m["samples"] for m in in_window)
    readies = sorted(e["time"] for e in events if e["event"] == "ready")
    for k in kills:
        tk = t0 + k["at_s"]
        nxt = [t for t in readies if t > tk]
        k["ready_at_s"] = nxt[0] - t0 if nxt else None
    full = [m["step_time_s"] for m in in_window if m["workers"] == args.stages]
    fo = [m["step_time_s"] for m in in_window if m["workers"] < args.stages]
    return {"t0_wall": t0, "span_s": t_end - t0, "step_s_at_start": step_s, "kills": kills,
            "full_depth_steps": len(full), "failed_over_steps": len(fo),
            "median_full_step_s": H.median(full), "median_failed_over_step_s": H.median(fo),
            "steps": len(metrics), "history_steps": len(hist_steps),
            "every_step_once": hist_steps == list(range(len(hist_steps))) and steps_once(metrics),
            "lost_steps": len(set(range(max(hist_steps) + 1)) - set(hist_steps)) if hist_steps else None,
            "doubled_steps": len(hist_steps) - len(set(hist_steps)),
            "failovers": sum(1 for e in events if e["event"] == "failover"),
            "reconfigurations": sum(1 for e in events if e["event"] == "reconfigure"),
            "fallbacks": sum(1 for e in events if e["event"] == "fallback_restart"),
            "failures": len(result.failures), "samples_in_window": samples,
            "measured_samples_per_s": samples / (t_end - t0), "other_load_cores": meter.other_cores,
            "step_times": [(round(m["time"] - t0, 3), m["workers"], round(m["step_time_s"], 4)) for m in metrics]}


def predict_replay(args, rp: dict, kills_summary: dict) -> dict:
    """The simulator on the availability the job had: p instances, p - 1 from each kill to its
    replacement's ``ready``; constants measured in (1)-(3) of this run."""
    from virtualflow.cluster.spot import SpotConstants, SpotJob, predict
    from virtualflow.cluster.spot_traces import SpotTrace

    p = args.stages
    times, counts = [0.0], [p]
    for k in rp["kills"]:
        back = k["ready_at_s"] if k["ready_at_s"] is not None else rp["span_s"]
        times += [k["at_s"], min(back, rp["span_s"])]
        counts += [p - 1, p]
    trace = SpotTrace(times_s=tuple(times), counts=tuple(counts), end_s=rp["span_s"], name="replayed availability")
    c = SpotConstants(step_s=kills_summary["full_step_s"], samples_per_step=float(args.m * args.mb),
                      redundancy_overhead=0.0, failover_s=kills_summary["failover_s"],
                      failover_slowdown=kills_summary["slowdown"], reconfigure_s=max(0.0, kills_summary["reconfigure_s"]),
                      restart_s=5.0, checkpoint_s=0.0, source="bench/bamboo_failover.py (1)-(3), this run")
    job = SpotJob(stages=p, pipelines=1, checkpoint_every_s=3e8)
    res = predict(trace, c, "bamboo", job)
    predicted = res.produced_between(0.0, rp["span_s"]) / rp["span_s"]
    # Diagnostic: the same with the replay's own full-depth step (the machine's load during the
    # replay), everything else unchanged.
    c_own = SpotConstants.from_dict({k: getattr(c, k) for k in SpotConstants.numeric_fields()}
                                    | {"step_s": rp["median_full_step_s"]}, where="replay's own step")
    own = predict(trace, c_own, "bamboo", job).produced_between(0.0, rp["span_s"]) / rp["span_s"]
    # The same with the trace's own timing (each instance back when its replacement was ready is
    # what the job saw; the plan alone does not say when a replacement is ready).
    return {"trace": {"times_s": times, "counts": counts, "end_s": rp["span_s"]},
            "constants": {k: v for k, v in c.to_dict().items() if k != "defaulted"},
            "predicted_samples_per_s": predicted, "failovers": res.failovers, "restarts": res.restarts,
            "reconfigurations": res.reconfigurations,
            "error": rp["measured_samples_per_s"] / predicted - 1.0,
            "predicted_with_replay_step_samples_per_s": own,
            "error_with_replay_step": rp["measured_samples_per_s"] / own - 1.0,
            "full_speed_samples_per_s": args.m * args.mb / kills_summary["full_step_s"]}
