"""Summary, targets and report: the step and collective summaries (they check the targets), the
tables, and :func:`markdown`.
"""

from __future__ import annotations

from bench import harness as H
from bench.coconet.workload import (
    EVAL_EVERY, GLOBAL_BATCH, LR, NAME, RSS_SAVING_TARGET, RS_TARGET, STEP_TARGET, WIDTHS, WORLD, param_count,
)


# --------------------------------------------------------------------------------------------
# Summary, targets, report.


def summarize_step(m: dict, warmup: int, targets: H.Targets | None) -> dict:
    n_params = param_count()
    full_opt_bytes = 2 * n_params * 4
    s: dict = {"params": n_params, "full_adam_state_bytes": full_opt_bytes}
    em = m["emulation"]["pairs"]
    ok = all("error" not in r[k] for r in em for k in r)
    rows = {}
    if ok:
        ratios = [H.steady_median(r["sharded"]["step_times"], warmup)
                  / H.steady_median(r["allreduce"]["step_times"], warmup) for r in em]
        for mode in ("allreduce", "sharded"):
            rows[mode] = {
                "step_s": H.median([H.steady_median(r[mode]["step_times"], warmup) for r in em]),
                "vmhwm_mib": [H.median([r[mode]["vmhwm_mib"][k] for r in em]) for k in range(WORLD)],
                "opt_state_bytes": em[0][mode]["opt_state_bytes"],
            }
        s["emulation"] = {
            "step_ratio": H.median(ratios), "per_pair_ratios": ratios, "rows": rows,
            "pair_other_load_cores": [max(r[k].get("other_load_cores", float("nan")) for k in r) for r in em],
            "same_model": em[0]["allreduce"]["param_head"] is not None and max(
                abs(a - b) for a, b in zip(em[0]["allreduce"]["param_head"], em[0]["sharded"]["param_head"])),
            "checksums": [em[0]["allreduce"]["checksum"], em[0]["sharded"]["checksum"]],
            "sharded_ledger_rank0": em[0]["sharded"]["ledger"],
        }
    else:
        s["emulation"] = {"error": [r[k].get("error") for r in em for k in r if "error" in r[k]]}
    s["torch"] = {}
    for mode, r in m["torch"].items():
        if "error" in r:
            s["torch"][mode] = {"error": r["error"]}
        else:
            s["torch"][mode] = {"step_s": H.steady_median(r["step_times"], warmup), "vmhwm_mib": r["vmhwm_mib"],
                                "opt_state_bytes": r["opt_state_bytes"]}
    vf_pairs = m["virtualflow"].get("pairs")
    if vf_pairs:
        errs = [r[k]["error"] for r in vf_pairs for k in r if "error" in r[k]]
        if errs:
            s["virtualflow"] = {"error": errs}
        else:
            vf_ratios = [H.steady_median(r["sharded"]["step_times"], warmup)
                         / H.steady_median(r["allreduce"]["step_times"], warmup)
                         for r in vf_pairs]
            s["virtualflow"] = {
                "step_ratio": H.median(vf_ratios), "per_pair_ratios": vf_ratios,
                "pair_other_load_cores": [max(r[k].get("other_load_cores", float("nan")) for k in r) for r in vf_pairs],
                "rows": {red: {"step_s": H.median([H.steady_median(r[red]["step_times"], warmup) for r in vf_pairs]),
                               "peak_rss_mib": [H.median([r[red]["peak_rss_mib"][k] for r in vf_pairs])
                                                for k in range(WORLD)],
                               "training_vmhwm_rank0_mib": H.median([r[red]["training_vmhwm_rank0_mib"]
                                                                     for r in vf_pairs]),
                               "gathered_opt_state_bytes": vf_pairs[0][red]["gathered_opt_state_bytes"],
                               "optimizer_bytes": vf_pairs[0][red]["optimizer_bytes"]}
                         for red in ("allreduce", "sharded")},
                "checksums": [vf_pairs[0]["allreduce"]["checksum"], vf_pairs[0]["sharded"]["checksum"]],
            }
    # Which measurement the targets read: virtualflow.train when it has the option, else the emulation.
    src = "virtualflow" if "step_ratio" in s.get("virtualflow", {}) else "emulation"
    s["targets_from"] = src
    if targets is not None:
        t = targets
        how = ("virtualflow.train reduction='sharded' vs 'allreduce'" if src == "virtualflow"
               else "plain-torch emulation (virtualflow.train has no reduction='sharded' yet): ring RS + Adam on "
                    "the slice + ring AG vs gloo all-reduce + full Adam")
        ratio = s[src].get("step_ratio", float("nan"))
        t.at_most("step_ratio", f"sharded / all-reduce step time, {how}", ratio, STEP_TARGET)
        vrows = s.get("virtualflow", {}).get("rows", {})
        full = shard = None
        bytes_where = ""
        if src == "virtualflow" and all(vrows[red]["optimizer_bytes"][k] for red in vrows for k in range(WORLD)):
            full = max(vrows["allreduce"]["optimizer_bytes"])
            shard = max(vrows["sharded"]["optimizer_bytes"])
            bytes_where = "virtualflow Result.optimizer_bytes"
        elif rows:
            full = rows["allreduce"]["opt_state_bytes"][0]
            shard = max(rows["sharded"]["opt_state_bytes"])
            bytes_where = "emulation, each rank's Adam moment tensors"
        if full is not None:
            s["opt_bytes_ratio"] = full / shard
            t.at_least("opt_bytes_ratio", f"optimizer state bytes, all-reduce / sharded (largest rank; {bytes_where}), "
                       f"p={WORLD}", full / shard, 0.99 * WORLD)
            if src == "virtualflow":
                rss_full = s["virtualflow"]["rows"]["allreduce"]["training_vmhwm_rank0_mib"]
                rss_shard = s["virtualflow"]["rows"]["sharded"]["training_vmhwm_rank0_mib"]
                where = ("virtualflow rank 0's peak RSS (VmHWM) at its last evaluation before the end of training, "
                         "i.e. before the final state is gathered and written")
            else:
                rss_full = max(rows["allreduce"]["vmhwm_mib"])
                rss_shard = max(rows["sharded"]["vmhwm_mib"])
                where = "emulation processes' peak RSS (VmHWM)"
            saved_opt_mib = (full - shard) / 2**20
            frac = (rss_full - rss_shard) / saved_opt_mib
            s["rss"] = {"full_mib": rss_full, "sharded_mib": rss_shard, "saved_mib": rss_full - rss_shard,
                        "opt_bytes_saved_mib": saved_opt_mib, "saving_fraction": frac, "where": where}
            t.at_least("rss_saving_fraction", f"peak RSS saved / Adam state saved ({where}; "
                       f"{rss_full:.0f} -> {rss_shard:.0f} MiB, state saved {saved_opt_mib:.0f} MiB)",
                       frac, RSS_SAVING_TARGET)
        else:
            t.holds("optimizer state bytes ÷ p", False, "no optimizer bytes measured (the runs failed)")
    return s


def summarize_collectives(c: dict, targets: H.Targets) -> None:
    for key, r in c["sizes"].items():
        targets.at_least("rs_speedup", f"ring reduce-scatter vs gloo reduce_scatter, {r['numel'] / 1e6:.0f} M float32, "
                         f"2 ranks (speed-up)", r["rs_speedup"], RS_TARGET)
    targets.holds("ring bytes per rank = (N - N/p) * 4 (ledger vs closed form)",
                  all(r["ring_bytes_ok"] for r in c["sizes"].values()))


def collectives_table(c: dict) -> tuple[list[str], list[list]]:
    header = ["N (M fp32)", "ring RS ms", "gloo reduce_scatter ms", "gloo _reduce_scatter_base ms",
              "gloo all_reduce ms", "RS speed-up", ">= 1.8", "vs all-reduce", "ring AG ms", "gloo allgather ms",
              "gloo _allgather_base ms", "AG speed-up", "ring RS GB/s"]
    rows = []
    for r in c["sizes"].values():
        m = r["median_s"]
        rows.append([f"{r['numel'] / 1e6:.0f}", H.ms(m["ring"]), H.ms(m["gloo_reduce_scatter"]),
                     H.ms(m["gloo_reduce_scatter_base"]), H.ms(m["gloo_all_reduce"]), f"{r['rs_speedup']:.2f}",
                     H.yes_no(r["rs_speedup"] >= RS_TARGET), f"{r['rs_speedup_vs_all_reduce']:.2f}",
                     H.ms(m["ring_ag"]), H.ms(m["gloo_allgather"]), H.ms(m["gloo_allgather_base"]),
                     f"{r['ag_speedup']:.2f}", f"{r['ring_rs_algbw_gbps']:.2f}"])
    return header, rows


def step_table(s: dict) -> tuple[list[str], list[list]]:
    header = ["variant", "step ms", "vs all-reduce", "peak RSS MiB (r0, r1)", "optimizer state MiB (r0, r1)",
              "vf: r0 training peak RSS MiB"]
    rows = []
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    em = s.get("emulation", {})
    base = em.get("rows", {}).get("allreduce", {}).get("step_s")
    for mode, label in (("allreduce", "emulation: gloo all-reduce + full Adam"),
                        ("sharded", "emulation: ring RS + Adam on slice + ring AG")):
        r = em.get("rows", {}).get(mode)
        if r:
            rows.append([label, H.ms(r["step_s"]), f"{em['step_ratio'] if mode == 'sharded' else 1.0:.3f}",
                         ", ".join(f"{v:.0f}" for v in r["vmhwm_mib"]), ", ".join(mib(b) for b in r["opt_state_bytes"]),
                         ""])
    vf_rows = s.get("virtualflow", {}).get("rows", {})
    for red in ("allreduce", "sharded"):
        r = vf_rows.get(red)
        if r:
            ratio = s["virtualflow"]["step_ratio"] if red == "sharded" else 1.0
            rows.append([f"virtualflow.train reduction={red!r}", H.ms(r["step_s"]), f"{ratio:.3f}",
                         ", ".join(f"{v:.0f}" for v in r["peak_rss_mib"]),
                         ", ".join(mib(b) if b else "?" for b in r["optimizer_bytes"]),
                         f"{r['training_vmhwm_rank0_mib']:.0f}"])
    for mode, label in (("ddp", "torch DDP + Adam"), ("zero", "torch DDP + ZeroRedundancyOptimizer(Adam)"),
                        ("fsdp2", "torch FSDP2 fully_shard + Adam")):
        r = s["torch"].get(mode, {})
        if "error" in r:
            rows.append([label, "error: " + r["error"][:120], "", "", "", ""])
        elif r:
            rows.append([label, H.ms(r["step_s"]), f"{r['step_s'] / base:.3f}" if base else "",
                         ", ".join(f"{v:.0f}" for v in r["vmhwm_mib"]), ", ".join(mib(b) for b in r["opt_state_bytes"]),
                         ""])
    return header, rows


def markdown(run: H.Run, args, c: dict | None, s: dict | None, load: dict) -> str:
    parts = ["# coconet: ring reduce-scatter vs gloo, sharded step vs all-reduce + Adam\n", H.env_markdown(), "",
             "Machine load (CPU cores used by other processes while each part ran): "
             + ", ".join(f"{k} {v:.2f}" for k, v in load.items()) + ".", ""]
    if c:
        h, rows = collectives_table(c)
        parts += ["## (1) Collectives, 2 ranks, gloo over loopback",
                  f"Median over {args.reps} interleaved repetitions ({args.warmup} warm-up) of the slower rank's time. "
                  "`RS speed-up` = the faster of gloo's two reduce-scatter entry points / our ring (target >= 1.8); "
                  "`vs all-reduce` = gloo all-reduce of the whole vector / our ring reduce-scatter. gloo's "
                  "reduce-scatter is an all-reduce underneath (it moves twice a ring reduce-scatter's bytes). "
                  "Ring bytes per rank per op (ledger) = (N - N/p) x 4 = the closed form: "
                  f"{'yes' if all(r['ring_bytes_ok'] for r in c['sizes'].values()) else 'NO'}.", "",
                  H.md_table(h, rows), ""]
    if s:
        h, rows = step_table(s)
        em = s.get("emulation", {})
        parts += ["## (2) Sharded data-parallel step",
                  f"Workload: MLP {'-'.join(map(str, WIDTHS))} ReLU ({s['params'] / 1e6:.1f} M params), Adam lr={LR}, "
                  f"global batch {GLOBAL_BATCH} (half per process), 2 processes x 1 thread; {args.steps} steps per run "
                  f"({args.warmup_steps} warm-up), {args.step_reps} interleaved pairs (a pair during which other processes "
                  f"used more than {args.max_other_cores} cores is measured again, {args.retries} time(s) at most); "
                  f"a step's time = the slower rank's (virtualflow: `Result.history`'s `step_time_s`); `step ms` = median over "
                  f"the pairs of each run's median; `vs all-reduce` = the median of the pairs' ratios (sharded rows; "
                  f"the target), torch rows: their median / the emulated all-reduce's. Full Adam state = 2 x params x 4 B = {s['full_adam_state_bytes'] / 2**20:.0f} MiB.",
                  "",
                  f"Targets read from: **{s['targets_from']}**"
                  + ("" if s["targets_from"] == "virtualflow" else
                     " (virtualflow.train had no reduction='sharded' when this ran: a plain-torch emulation of the "
                     "sharded step stands in for it)") + ".", "",
                  H.md_table(h, rows), ""]
        if "step_ratio" in em:
            parts.append(f"Emulation: per-pair ratios {', '.join(f'{x:.3f}' for x in em['per_pair_ratios'])} (other "
                         f"load {', '.join(f'{x:.2f}' for x in em['pair_other_load_cores'])} cores); "
                         f"first 8 parameters differ by at most {em['same_model']:.1e} between the two (same model).")
        if "step_ratio" in s.get("virtualflow", {}):
            v = s["virtualflow"]
            parts.append(f"virtualflow.train: per-pair ratios {', '.join(f'{x:.3f}' for x in v['per_pair_ratios'])} "
                         f"(other load {', '.join(f'{x:.2f}' for x in v['pair_other_load_cores'])} cores); "
                         f"final state checksums {v['checksums'][0]:.6f} (allreduce), {v['checksums'][1]:.6f} (sharded).")
        elif "error" in s.get("virtualflow", {}):
            parts.append(f"virtualflow.train failed: {s['virtualflow']['error']}")
        if "rss" in s:
            r = s["rss"]
            parts.append(f"Peak RSS: {r['full_mib']:.0f} MiB (all-reduce) vs {r['sharded_mib']:.0f} MiB (sharded), "
                         f"{r['saved_mib']:.0f} MiB saved of the {r['opt_bytes_saved_mib']:.0f} MiB of Adam state "
                         f"sharded away ({r['where']}).")
        parts.append("Peak RSS columns: each process's own VmHWM at its end (virtualflow: `Result.peak_rss_mib`, "
                     "read when the worker exits, i.e. including writing the final state, which gathers the whole "
                     "optimizer state in a sharded run); `vf: r0 training peak` is rank 0's VmHWM read by "
                     f"`Job.evaluate` at its last periodic evaluation before the end (every {EVAL_EVERY} steps; the evaluation "
                     "after the last step comes after a sharded run has gathered the whole optimizer state for the "
                     "final state, so it is not used). Optimizer state = the "
                     "bytes of each rank's own Adam moment tensors (virtualflow rows: `Result.optimizer_bytes`, step counters "
                     "included).")
        parts.append("ZeroRedundancyOptimizer assigns whole parameters to ranks (its state is only as even as the "
                     "parameter sizes allow); FSDP2 shards every parameter and all-gathers it per layer.")
    parts += ["", f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(parts)
