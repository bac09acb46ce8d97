"""The markdown report: tables of the triples and coverage, where the time goes, failover and
stall notes, and :func:`markdown` (the whole page).
"""

from __future__ import annotations

from bench import harness as H
from bench.bamboo.workload import MODES, NAME, P2_TRACE, TARGET_OVERHEAD
from bench.bamboo.measure import coverage


# --------------------------------------------------------------------------------------------
# Report.


def _triples_table(ov: dict) -> str:
    rows = []
    for i, t in enumerate(ov["triples"]):
        cov = coverage([t["eager"]])
        rows.append([str(i), " then ".join(t["order"]), *(f"{1e3 * t[k]['step_s']:.1f}" for k in MODES),
                     f"{t['ratio_lazy']:.3f}", f"**{t['ratio_eager']:.3f}**",
                     ", ".join(f"{c['forwards']}/{c['skipped']}" for c in cov.values()),
                     " / ".join(f"{t[k]['other_load_cores']:.2f}" for k in MODES)])
    return H.md_table(["triple", "order", "step without (ms)", "step lazy (ms)", "step eager (ms)", "lazy / without",
                       "eager / without", "eager forwards run / skipped (per worker)",
                       "other load (cores; without / lazy / eager)"], rows)


def _coverage_table(ov: dict) -> str:
    return H.md_table(["worker", "eager forwards run", "skipped (no idle slot)", "covered", "run per step",
                       "seconds in them per step (ms)", "memory kept (peak per step)"],
                      [[w, str(c["forwards"]), str(c["skipped"]), f"{100 * c['covered']:.1f} %" if c["covered"] is not None
                        else "-", f"{c['forwards_per_step']:.2f}", f"{1e3 * c['seconds_per_step']:.1f}",
                        H.mib(c["peak_bytes"])]
                       for w, c in ov["coverage"].items()])


def where_time_goes(ov: dict, rep: dict) -> dict:
    """The time lazy redundancy adds (the replica refresh) against what the refresh does on the
    slowest worker, timed in-process: building the message (a cat of the gradients) and the
    replica's step; and the time eager adds on top of lazy against the eager forwards' own
    seconds per step (run while a receive would wait: what they add is the wait they cause when
    the message arrives during one)."""
    added = ov["step_lazy_s"] - ov["step_without_s"]
    cpu = max(r["replica_apply_s"] + r["message_cat_s"] for r in rep["workers"])
    eager_s = [c["seconds_per_step"] for c in ov["coverage"].values() if c["seconds_per_step"] is not None]
    return {"added_step_s": added, "cat_plus_apply_s": cpu, "rest_s": added - cpu,
            "eager_added_step_s": ov["step_eager_s"] - ov["step_lazy_s"],
            "eager_forward_s_per_step_max": max(eager_s) if eager_s else None,
            "eager_total_added_step_s": ov["step_eager_s"] - ov["step_without_s"]}


def _failover_md(fo: dict | None) -> list[str]:
    if fo is None:
        return ["## (2b) Failover", "", "Not run (`--failover-reps 0`).", ""]
    rows = []
    for i, r in enumerate(fo["runs"]):
        if "error" in r:
            rows.append([str(i), f"failed: {r['error'][:200]}", "", "", "", "", "", ""])
            continue
        rows.append([str(i), str(r["failover_events"][0]["layout"] if r["failover_events"] else "none"),
                     f"{r['failover_s']:.2f}" if r["failover_s"] is not None else "",
                     f"{1e3 * r['step_before_s']:.0f}", f"{1e3 * r['step_after_s']:.0f}", f"{r['slowdown']:.2f}",
                     H.yes_no(r["no_step_lost"]), str(r.get("reused", "-"))])
    return [
        "## (2b) Failover (a worker SIGKILLed, its predecessor runs its stage from the replica)", "",
        f"The same layers, {fo['stages']} stages, one pipeline, redundancy on (eager, the default) ({fo['stages']} processes on 2 cores: "
        f"sleep-emulated compute overlaps, but the optimizer and replica steps of the workers share the 2 cores). "
        f"Worker {fo['victim_worker']} SIGKILLs itself at the start of step {fo['loss_step']} "
        f"(`FaultPlan(Fault(worker={fo['victim_worker']}, step={fo['loss_step']}, phase='before_forward'))`). "
        f"Failover = end of step {fo['loss_step'] - 1} -> end of the redone step {fo['loss_step']} (loss -> first "
        f"completed step, the redone step included); slowdown = median step after the failover / median step "
        f"before it. Reused: the lost stage's eager forwards the redone step spliced in (`Result.redundant_forwards`"
        f"[w]['reused'], summed: the victim dies at the start of its step, but its predecessor goes on with that "
        f"step's forwards and sends them, and may run the victim's forwards of them on its replica in its "
        f"bubbles before the failure is noticed; `bench/bamboo_failover.py` kills at random points of a step and "
        f"compares with lazy).", "",
        H.md_table(["run", "layout after", "failover (s)", "step before (ms)", "step after (ms)", "slowdown",
                    "every step once", "reused forwards"], rows), ""] + _stall_note(fo)


def _stall_note(fo: dict) -> list[str]:
    stalls = [(i, r["failover_s"]) for i, r in enumerate(fo["runs"])
              if "error" not in r and r.get("failover_s") is not None and r["failover_s"] > 30.0]
    if not stalls:
        return []
    return [f"**Stall**: run(s) {', '.join(f'{i} ({t:.1f} s)' for i, t in stalls)} went on only after more than "
            f"30 s: a stall, not a failover time (about the groups' 120 s timeout, `virtualflow/comm/groups.py`: a "
            f"receive waiting on a live peer that is not released), every step still done once. Left to the "
            f"engine's owner; the median above and the `failover_s` constant in this file include it "
            f"(`bench/results/bamboo_constants.json` takes failover_s from `bench/bamboo_failover.py` instead).", ""]


def markdown(run: H.Run, args, cal: dict, ov: dict, small: dict | None, rep: dict, rs: dict, fo: dict | None,
             constants: dict, sources: dict, sim: dict) -> str:
    params_stage = args.layers_per_stage * (args.width * args.width + args.width)
    lines: list[str] = [f"# {run.name}: Bamboo's redundant stages (replica refresh + eager redundant forwards) - "
                        f"overhead, restart, simulator constants", "", H.env_markdown(), ""]
    lines += [
        "**Not measured here, and why**: the **reconfiguration pause** (a replacement taking its stage back, "
        "`replace_failed`) and the **time-compressed replay** of a real trace are measured by "
        "`bench/bamboo_failover.py` (`bench/results/bamboo_failover.md`), not here; this file's constants leave "
        "`reconfigure_s` to the simulator's default and `bench/results/bamboo_constants.json` takes it from there. "
        "**Eager redundant forwards** (`Pipeline(redundancy=True)`'s default, `redundant_compute=\"eager\"`) are "
        "measured in (1) against lazy redundancy (`redundant_compute=\"lazy\"`: the replica refresh alone) and "
        "no redundancy; the eager forwards are SLEEP-EMULATED like every forward here (they take the emulated "
        "compute time but no CPU), so they stand for a device's idle slots, not for this CPU's cores.", "",
        "## (1) Redundancy overhead through `virtualflow.train`: without / lazy / eager", "",
        f"Job: {args.stages} stages (one worker process each, 1 thread), 1F1B, m = {args.m} micro-batches of "
        f"{args.mb}, AdamW; each stage {args.layers_per_stage} SLEEP-EMULATED Linear({args.width}, {args.width}) "
        f"layers ({params_stage / 1e6:.2f} M real parameters per stage, {args.stages * params_stage / 1e6:.2f} M "
        f"in all). Each layer sleeps forward {1e3 * args.f_s:.2f} ms and backward {1e3 * args.b_s:.2f} ms per "
        f"micro-batch: "
        + (f"the real `nn.Linear`'s times at micro-batch {args.mb} on this machine (calibrated, 1 thread, "
           f"fastest of {cal['reps']}: {1e3 * cal['forward_s']:.2f} / {1e3 * cal['backward_s']:.2f} ms)"
           if cal else "given on the command line (`--f-ms`, `--b-ms`)")
        + ". Parameters, gradients, the optimizer, the replica message and the replica's optimizer step are real; "
        f"the matrix multiplications are not. {len(ov['triples'])} interleaved triples (orders in turn, every "
        f"mode first, second and third equally often over 6 triples): **without** redundancy; **lazy** "
        f"(`Pipeline(redundancy=True, redundant_compute=\"lazy\")`: the replica refresh, no redundant forward); "
        f"**eager** (`Pipeline(redundancy=True)`, the default: the refresh + each worker runs its successor "
        f"stage's forward of the micro-batches it sent on its replica, in the schedule's bubbles). "
        f"{args.steps} steps per run ({args.warmup} warm-up), per run the median step time (rank 0's time between "
        f"step ends); a triple with more than {args.max_other_cores} cores of other load (`LoadMeter`) was "
        f"repeated up to {args.retries} times while the first {args.retry_budget:g} s lasted, then kept.", "",
        _triples_table(ov), "",
        f"**Overhead, eager (the default): {ov['overhead']:.3f}x** (median of per-triple eager / without, every "
        f"triple kept; target <= {TARGET_OVERHEAD}; key `redundancy_overhead`); **lazy: {ov['overhead_lazy']:.3f}x** "
        f"(key `redundancy_overhead_lazy`); eager / lazy {ov['eager_vs_lazy']:.3f}x. Per-triple spread: eager "
        f"{min(ov['ratios']):.3f}-{max(ov['ratios']):.3f}x, lazy {min(ov['ratios_lazy']):.3f}-"
        f"{max(ov['ratios_lazy']):.3f}x. Triples with at most {args.max_other_cores} cores of other load: "
        + (f"eager {ov['quiet_overhead']:.3f}x, lazy {ov['quiet_overhead_lazy']:.3f}x ({len(ov['quiet_ratios'])} "
           f"triples)" if ov["quiet_ratios"] else "none")
        + f" (a diagnostic). Eager was faster than lazy in {sum(t['eager_vs_lazy'] < 1 for t in ov['triples'])} of "
        f"{len(ov['triples'])} triples (eager / lazy {min(t['eager_vs_lazy'] for t in ov['triples']):.3f}-"
        f"{max(t['eager_vs_lazy'] for t in ov['triples']):.3f})"
        + (": a systematic difference this benchmark does not explain (both run the same refresh; eager's "
           "forwards sleep and use no CPU; one difference is that the engine hands the wait of a polled receive "
           "to a thread, which may take the message's transfer off the step's path under this load: not checked)"
           if all(t["eager_vs_lazy"] < 1 for t in ov["triples"]) else "")
        + f". Median steps {1e3 * ov['step_without_s']:.1f} ms without, "
        f"{1e3 * ov['step_lazy_s']:.1f} ms lazy, {1e3 * ov['step_eager_s']:.1f} ms eager; throughput "
        f"{args.m * args.mb / ov['step_without_s']:.0f} / {args.m * args.mb / ov['step_lazy_s']:.0f} / "
        f"{args.m * args.mb / ov['step_eager_s']:.0f} samples/s.", "",
        f"Eager coverage (`Result.redundant_forwards`, summed over the {len(ov['triples'])} eager runs, warm-up "
        f"steps included; a worker owes one forward per micro-batch and step, {args.m} per step here):", "",
        _coverage_table(ov), ""]
    if small is not None:
        w = where_time_goes(small, rep)
        if cal is None and getattr(args, "small_f_ms", None) is None:
            lines += ["**Caveat**: in this run the micro-batch diagnostic below used the main run's emulated layer "
                      "times (given on the command line, not calibrated for its micro-batch: a gap of the benchmark "
                      "then, fixed since with `--small-f-ms`/`--small-b-ms`), so it has the same compute per "
                      "micro-batch as the main triples, not 1/8 of it: it does not show what it was meant to and is "
                      "not interpreted.", ""]
        lines += [
            f"**Diagnostic, not a target**: the same triples at micro-batch {small['mb']} ({args.m * small['mb']} "
            f"samples per step instead of {args.m * args.mb}"
            + ("" if cal is None and getattr(args, "small_f_ms", None) is None else
               f": 1/{args.mb // small['mb']} of the compute per parameter and step")
            + f"; emulated layer forward {1e3 * small['f_s']:.2f} ms, backward {1e3 * small['b_s']:.2f} ms), "
            f"{small['steps']} steps per run ({small['warmup']} warm-up):", "",
            _triples_table(small), "",
            f"Overhead at micro-batch {small['mb']}: eager **{small['overhead']:.3f}x**, lazy "
            f"{small['overhead_lazy']:.3f}x (steps {1e3 * small['step_without_s']:.1f} -> lazy "
            f"{1e3 * small['step_lazy_s']:.1f} -> eager {1e3 * small['step_eager_s']:.1f} ms: the refresh "
            f"+{1e3 * w['added_step_s']:.1f} ms, the eager forwards {1e3 * w['eager_added_step_s']:+.1f} ms more). "
            f"The refresh costs about a fixed time per step (message + duplicate optimizer step, proportional to the "
            f"stage's parameters), so its share falls as the compute per parameter and step grows.", "",
            "Eager coverage at this micro-batch:", "", _coverage_table(small), ""]
    w = where_time_goes(ov, rep)
    eager_fw = w["eager_forward_s_per_step_max"]
    fst, bst = args.layers_per_stage * args.f_s, args.layers_per_stage * args.b_s
    lines += [
        f"Where the added time goes (micro-batch {args.mb}). **Lazy** (the refresh): +{1e3 * w['added_step_s']:.1f} "
        f"ms per step; the slowest worker's message build (cat of the gradients) + replica step "
        f"(`StageReplica.apply`), timed in-process, are {1e3 * w['cat_plus_apply_s']:.1f} ms; the rest "
        f"({1e3 * w['rest_s']:.1f} ms) is the message's transfer and waiting (the exchange sits between the "
        f"reduction and the step's commit, on the critical path) plus noise. **Eager on top of lazy**: "
        f"{1e3 * w['eager_added_step_s']:+.1f} ms per step (median eager step - median lazy step) while the "
        f"busiest worker spends "
        + (f"{1e3 * eager_fw:.1f} ms per step in eager forwards" if eager_fw is not None else "no time in eager forwards")
        + ". The engine starts an eager forward only in one of the schedule's bubbles (a receive whose predicted "
        "wait, from the schedule simulated with the worker's measured forward/backward times of its last step, "
        "still holds the forward within 1.1x, and while the message has not arrived; or the tail after its last "
        "action) and skips the rest (counted; a failover recomputes them; the first step, with no times "
        "measured yet, skips all). In a bubble they cost nothing; what they add is the wait when the awaited "
        "message arrives while a forward is running (at most one forward, here one stage's emulated forward "
        f"{1e3 * fst:.1f} ms, per receive that catches one), plus keeping their graphs until the commit. "
        f"**How many can fit**: a worker owes m = {args.m} forwards of its successor's stage per step, m x f = "
        f"{1e3 * args.m * fst:.0f} ms of emulated forward, while 1F1B leaves each worker (p - 1)(f + b) = "
        f"{1e3 * (args.stages - 1) * (fst + bst):.0f} ms idle per step (f = {1e3 * fst:.1f}, b = {1e3 * bst:.1f} "
        f"ms per stage and micro-batch: the fill and drain bubble): at most "
        f"{min(1.0, (args.stages - 1) * (fst + bst) / (args.m * fst)):.0%} of them fit in the nominal schedule; "
        "measured coverage above. More stages (a bigger bubble) cover more; more micro-batches fewer.", "",
        "### Replica memory, extra bytes per step, the duplicate optimizer step", "",
        H.md_table(["worker (stage)", "replica of stage", "replica bytes (`StageReplica.nbytes()`)",
                    "successor's params + buffers + optimizer state", "message bytes per step",
                    "replica apply (ms)", "own optimizer step (ms)", "cat of the gradients (ms)"],
                   [[str(r["worker"]), str(r["replica_of"]), f"{r['replica_bytes']:,} ({H.mib(r['replica_bytes'])})",
                     f"{r['expected_bytes']:,}", f"{r['message_bytes']:,} ({H.mib(r['message_bytes'])})",
                     f"{1e3 * r['replica_apply_s']:.1f}", f"{1e3 * r['own_optimizer_step_s']:.1f}",
                     f"{1e3 * r['message_cat_s']:.1f}"] for r in rep["workers"]]), "",
        f"Extra bytes sent per step (all workers): {rep['message_bytes_per_step']:,} "
        f"({H.mib(rep['message_bytes_per_step'])}): one message per worker of its stage's reduced gradients "
        f"(+ BatchNorm statistics and buffers; none here). The replica holds parameters + buffers + AdamW state "
        f"(exp_avg, exp_avg_sq, step) = about 3x the successor's parameter bytes. Timed in-process after a step "
        f"(1 thread): `StageReplica.apply` (clone of the gradients + AdamW step) and, for comparison, the stage's "
        f"own optimizer step.", "",
        "## (2) Checkpoint write and restart from a checkpoint", "",
        f"The redundant job with `checkpoint_every={args.checkpoint_every}`, {3 * args.checkpoint_every} steps, then "
        f"`virtualflow.launch(..., resume=RUN_DIR)` on fresh processes ({len(rs['runs'])} repetition(s)). Restart = "
        f"launch call -> end of the first resumed step, minus a normal step (process start, imports, model build, "
        f"checkpoint load, group formation). Checkpoint = {rs['checkpoint_from']}.", "",
        H.md_table(["rep", "launch -> first resumed step (s)", "normal step (ms)", "restart (s)",
                    "checkpoint pause between steps (ms)", "save_s reported (ms)"],
                   [[str(i), f"{r['launch_to_first_step_s']:.2f}", f"{1e3 * r['normal_step_s']:.0f}",
                     f"{r['restart_s']:.2f}", ", ".join(f"{1e3 * g:.0f}" for g in r["checkpoint_pause_s"]),
                     ", ".join(f"{1e3 * s:.0f}" for s in r["checkpoint_save_s_reported"]) or "none"]
                    for i, r in enumerate(rs["runs"])]), "",
        *_failover_md(fo),
        "## (3) Constants for the spot simulator (`constants` in bamboo.json)", "",
        H.md_table(["constant", "value", "source"],
                   [[k, f"{constants[k]:.4g}" if k in constants else "(left out: the simulator's default)", sources[k]]
                    for k in sources]), ""]
    lines += ["### The simulator on the shipped p2 trace (its output, not a measurement)", ""]
    if sim.get("available"):
        s = sim["summary"]
        rows = []
        for k, r in s["strategies"].items():
            rows.append([k, f"{r.get('samples_per_s', float('nan')):.2f}", f"{r.get('cost_usd', float('nan')):.2f}",
                         f"{r.get('samples_per_usd', float('nan')):.1f}",
                         f"{r['value_vs_on_demand']:.2f}x" if r.get("value_vs_on_demand") is not None else "-",
                         str(r.get("failovers", "-")), str(r.get("restarts", "-"))])
        lines += [f"`virtualflow simulate-spot --trace {P2_TRACE} --stages {args.sim_stages} --constants "
                  f"bench/results/{run.name}.json` (simulator at {sim.get('simulator_source', '?')}):", "",
                  H.md_table(["strategy", "samples/s", "cost $", "samples/$", "value vs on-demand", "failovers",
                              "restarts"], rows), ""]
        if "bamboo_vs_checkpoint" in s:
            lines += [f"Bamboo vs checkpoint-restart (samples/$): **{s['bamboo_vs_checkpoint']:.2f}x** (issue: >= 1.5x); "
                      f"Bamboo vs on-demand: **{s['strategies']['bamboo']['value_vs_on_demand']:.2f}x** (issue: >= 2x). "
                      f"Constants measured here: {', '.join(k for k in sources if k in constants)}; defaults (not "
                      f"measured): {', '.join(k for k in sources if k not in constants) or 'none'}. These value "
                      f"ratios are the simulator's, reported and not checked as targets here.", ""]
        alt = sim.get("restart_default")
        if alt is not None:
            a = alt["summary"]
            lines += [f"Sensitivity (simulator): the measured restart ({constants['restart_s']:.1f} s) reuses this "
                      f"machine, already up, with a small model on a local disk; a cloud restart also gets and boots "
                      f"an instance. With `restart_s` left at the simulator's default "
                      f"({a['constants']['restart_s']:g} s, Bamboo's figure) and the other measured constants: Bamboo "
                      f"{a['strategies']['bamboo']['value_vs_on_demand']:.2f}x on-demand, "
                      f"{a.get('bamboo_vs_checkpoint', float('nan')):.2f}x checkpoint-restart.", ""]
    else:
        lines += [f"Not run: {sim.get('why')}", ""]
    given = "".join(f" --{k.replace('_', '-')} {getattr(args, k):g}" for k in ("f_ms", "b_ms")
                    if getattr(args, k) is not None)
    lines += [f"Reproduce: `{run.command(NAME, given)}`"
              + (" (the emulated layer times given: a calibration on this loaded machine would measure the other "
                 "load, not the layer)" if given else "")]
    return "\n".join(lines)
