"""(1)-(3) kill the middle stage: failover time, failed-over slowdown (no replacement) and the
reconfiguration pause (with a replacement), eager and lazy back to back; stuck runs recorded.
"""

from __future__ import annotations

import os
import random
import tempfile

from bench import harness as H
from bench.bamboo_failover.workload import SEED
from bench.bamboo_failover.running import failover_split, kill_stage, launch, steps_once, wait_until


# --------------------------------------------------------------------------------------------
# (1)-(3) kill the middle stage: failover, slowdown (no replacement), reconfiguration (replacement).


def one_kill(args, replace: bool, frac: float, mode: str = "eager") -> dict:
    """Kill the middle stage ``frac`` of a full-depth step after the ``--before-steps``-th step
    was seen; ``mode``: the job's ``Pipeline.redundant_compute``."""
    stage = args.stages // 2
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        os.environ["VF_BF_COMPUTE"] = mode  # the worker processes inherit it at launch
        try:
            handle = launch(args, run_dir, replace)
        finally:
            os.environ["VF_BF_COMPUTE"] = "eager"
        try:
            H.wait_steps(handle, run_dir, args.before_steps, timeout_s=180)
            full = H.steady_median([m["step_time_s"] for m in H.run_metrics(run_dir)])
            with H.LoadMeter() as meter:
                t_kill, victim, _ = kill_stage(handle, stage, frac * full)
                try:
                    if replace:
                        wait_until(handle, lambda: any(e["event"] == "reconfigure" for e in H.run_events(run_dir)),
                              args.stuck_s, "the reconfiguration")
                        gen = next(e["generation"] for e in H.run_events(run_dir)
                                   if e["event"] == "generation" and e.get("reason") == "reconfigure")
                        wait_until(handle, lambda: sum(1 for m in H.run_metrics(run_dir) if m["generation"] >= gen)
                              >= args.after_steps, args.stuck_s, "steps after the reconfiguration")
                    else:
                        n0 = len(H.run_metrics(run_dir))
                        H.wait_steps(handle, run_dir, n0 + args.after_steps, timeout_s=args.stuck_s)
                except Exception as exc:  # noqa: BLE001 - a stuck or failed job is a finding: recorded
                    return {**stuck_row(handle, run_dir, replace, victim, stage, t_kill, exc), "mode": mode}
            result = handle.stop()
        finally:
            if not handle.done:
                try:
                    handle.stop(timeout_s=30)
                except Exception:  # noqa: BLE001 - already recorded
                    pass
        metrics, events = H.run_metrics(run_dir), H.run_events(run_dir)
    fw = {str(w): dict(v) for w, v in sorted(result.redundant_forwards.items())}
    row: dict = {"mode": mode, "replace_failed": replace, "victim_worker": victim, "victim_stage": stage, "kill_frac": frac,
                 "redundant_forwards": fw, "reused": sum(int(v.get("reused", 0)) for v in fw.values()),
                 "other_load_cores": meter.other_cores, "steps": len(metrics),
                 "every_step_once": steps_once(metrics) and [h["step"] for h in result.history] == list(range(len(metrics))),
                 "failures": [f.get("worker") for f in result.failures]}
    row.update(failover_split(metrics, events, t_kill))
    before = [m["step_time_s"] for m in metrics if m["generation"] < row["failover_generation"]][args.warmup:]
    fo_gen = row["failover_generation"]
    fo_steps = [m for m in metrics if m["generation"] == fo_gen]
    row["full_step_s"] = H.median(before)
    row["failed_over_steps_s"] = [m["step_time_s"] for m in fo_steps]
    if not replace:
        row["failed_over_step_s"] = H.median(row["failed_over_steps_s"][2:])
        row["slowdown"] = row["failed_over_step_s"] / row["full_step_s"]
    else:
        rc = next(e for e in events if e["event"] == "reconfigure")
        ready = next((e for e in events if e["event"] == "ready" and e["time"] >= t_kill), None)
        new = [m for m in metrics if m["generation"] > fo_gen]
        formed = next((e for e in events if e["event"] == "formed" and e.get("change") == "reconfigure"), None)
        normal_new = H.steady_median([m["step_time_s"] for m in new])
        gap = new[0]["time"] - fo_steps[-1]["time"]
        row.update({"replacement_startup_s": ready.get("startup_s") if ready else None,
                    "kill_to_ready_s": ready["time"] - t_kill if ready else None,
                    "ready_to_reconfigure_event_s": rc["time"] - ready["time"] if ready else None,
                    "reconfigure_layout": rc.get("layout"), "reconfigure_gap_s": gap,
                    "full_step_after_s": normal_new, "reconfigure_s": gap - normal_new,
                    "reconfigure_formed_pause_s": formed.get("pause_s") if formed else None,
                    "formed_after_last_failed_over_step_s": formed["time"] - fo_steps[-1]["time"] if formed else None,
                    "first_step_after_formed_s": new[0]["time"] - formed["time"] if formed else None,
                    "reconfigure_transfer_bytes": formed.get("transfer_bytes") if formed else None,
                    "first_reconfigured_step_time_s": new[0]["step_time_s"],
                    "failed_over_steps_during_startup": len(fo_steps)})
    return row


def stuck_row(handle, run_dir: str, replace: bool, victim: int, stage: int, t_kill: float, exc: Exception) -> dict:
    """A kill after which the job did not go on: what it had done, its events since the kill."""
    metrics, events = H.run_metrics(run_dir), H.run_events(run_dir)
    try:
        st = handle.status()
        st = {k: st.get(k) for k in ("state", "step", "generation", "formed_generation", "workers", "redundancy")}
    except Exception as e:  # noqa: BLE001
        st = {"error": repr(e)}
    row = {"replace_failed": replace, "victim_worker": victim, "victim_stage": stage, "stuck": True,
           "error": f"{type(exc).__name__}: {str(exc)[-500:]}", "status": st,
           "last_steps": [(m["step"], m["generation"], round(m["time"] - t_kill, 3)) for m in metrics[-3:]],
           "events_since_kill": [{"t_s": round(e["time"] - t_kill, 3), **{k: v for k, v in e.items()
                                                                          if k not in ("time", "error")},
                                  **({"error": str(e["error"])[:200]} if "error" in e else {})}
                                 for e in events if e["time"] >= t_kill - 0.5 and e["event"] != "step"]}
    print(f"  {'replace' if replace else 'no replacement'}: the job did not go on after the kill of stage {stage} "
          f"(worker {victim}): {row['error']}; last steps {row['last_steps']}; events since the kill: "
          f"{[(e['t_s'], e['event']) for e in row['events_since_kill']]}", flush=True)
    return row


def _kill_line(i: int, r: dict) -> str:
    line = (f"  {'replace' if r['replace_failed'] else 'no replacement'} {i} ({r['mode']}): kill stage "
            f"{r['victim_stage']} {1e3 * r['kill_after_last_step_end_s']:.0f} ms after step {r['last_step_before']}: "
            f"failover {r['failover_s']:.3f} s (detect {1e3 * r['detect_s']:.0f} ms, form {1e3 * r['form_s']:.0f} ms, "
            f"redone step {1e3 * r['redone_step_s']:.0f} ms, {r['reused']} eager forwards reused); layout {r['layout']}")
    if r["replace_failed"]:
        line += (f"; replacement ready {r['kill_to_ready_s']:.2f} s after the kill; reconfigure gap "
                 f"{r['reconfigure_gap_s']:.2f} s -> pause {r['reconfigure_s']:.2f} s (first step "
                 f"{r['first_reconfigured_step_time_s']:.2f} s)")
    else:
        line += (f"; steps {1e3 * r['full_step_s']:.0f} -> {1e3 * r['failed_over_step_s']:.0f} ms "
                 f"({r['slowdown']:.2f}x)")
    return line + f"; every step once: {r['every_step_once']}; other load {r['other_load_cores']:.2f} cores"


def measure_kills(args) -> dict:
    """Each kill (``--reps`` of each kind, without / with a replacement) twice: eager (the
    default, whose runs give (1)-(3) and the constants) and lazy, the same kill point (fraction of
    a step) for both, back to back, their order alternated."""
    rng = random.Random(SEED)
    runs = []
    j = 0
    for i in range(args.reps):
        for replace in (False, True):
            frac = rng.random()
            H.wait_for_quiet(args.quiet_wait)
            for mode in (("eager", "lazy") if j % 2 == 0 else ("lazy", "eager")):
                r = one_kill(args, replace, frac, mode)
                r["kill"] = j
                runs.append(r)
                if not r.get("stuck"):
                    print(_kill_line(i, r), flush=True)
            j += 1
    stuck = [r for r in runs if r.get("stuck")]
    done = [r for r in runs if not r.get("stuck")]
    lazy = [r for r in done if r["mode"] == "lazy"]
    runs = [r for r in done if r["mode"] == "eager"]
    no_rep = [r for r in runs if not r["replace_failed"]]
    rep = [r for r in runs if r["replace_failed"]]

    def arm(rs: list[dict]) -> dict:
        if not rs:
            return {"runs": 0}
        return {"runs": len(rs), "failover_s": H.median([r["failover_s"] for r in rs]),
                "detect_s": H.median([r["detect_s"] for r in rs]), "form_s": H.median([r["form_s"] for r in rs]),
                "redone_step_s": H.median([r["redone_step_s"] for r in rs]),
                "redone_step_time_s": H.median([r["redone_step_time_s"] for r in rs]),
                "reused": sum(r["reused"] for r in rs), "reused_median": H.median([r["reused"] for r in rs]),
                "every_step_once": all(r["every_step_once"] for r in rs)}

    # Per kill, eager's failover minus lazy's (the same kill point, back to back).
    by_kill = {}
    for r in runs + lazy:
        by_kill.setdefault(r["kill"], {})[r["mode"]] = r
    diffs = [d["eager"]["failover_s"] - d["lazy"]["failover_s"] for d in by_kill.values() if len(d) == 2]
    redone_diffs = [d["eager"]["redone_step_s"] - d["lazy"]["redone_step_s"] for d in by_kill.values() if len(d) == 2]
    return {"runs": runs, "lazy_runs": lazy, "stuck": stuck, "failover_s": H.median([r["failover_s"] for r in runs]),
            "eager": arm(runs), "lazy": arm(lazy),
            "eager_minus_lazy_failover_s": H.median(diffs) if diffs else None,
            "eager_minus_lazy_redone_step_s": H.median(redone_diffs) if redone_diffs else None,
            "detect_s": H.median([r["detect_s"] for r in runs]), "form_s": H.median([r["form_s"] for r in runs]),
            "redone_step_s": H.median([r["redone_step_s"] for r in runs]),
            "full_step_s": H.median([r["full_step_s"] for r in runs]),
            "failed_over_step_s": H.median([r["failed_over_step_s"] for r in no_rep]),
            "slowdown": H.median([r["slowdown"] for r in no_rep]),
            "reconfigure_s": H.median([r["reconfigure_s"] for r in rep]),
            "reconfigure_gap_s": H.median([r["reconfigure_gap_s"] for r in rep]),
            "formed_after_last_failed_over_step_s": H.median([r["formed_after_last_failed_over_step_s"] for r in rep
                                                              if r["formed_after_last_failed_over_step_s"] is not None]),
            "first_step_after_formed_s": H.median([r["first_step_after_formed_s"] for r in rep
                                                   if r["first_step_after_formed_s"] is not None]),
            "first_reconfigured_step_time_s": H.median([r["first_reconfigured_step_time_s"] for r in rep]),
            "kill_to_ready_s": H.median([r["kill_to_ready_s"] for r in rep if r["kill_to_ready_s"] is not None]),
            "every_step_once": all(r["every_step_once"] for r in runs + lazy)}
