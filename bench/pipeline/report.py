"""The markdown report: the diagnostic, emulated and head-to-head tables, and :func:`markdown`.
"""

from __future__ import annotations

from bench import harness as H
from bench.pipeline.workload import EMU_MB, EMU_P, NAME, TARGET_RATIO, VS_CLASSES, VS_IN, VS_P, vs_model


# --------------------------------------------------------------------------------------------
# Report.


def _diag_table(vs: dict) -> str:
    rows = []
    for i, rep in enumerate(vs["reps"]):
        for s, r in rep["schedules"].items():
            d = r.get("diag")
            if not d:
                continue
            rows.append([str(i), s, H.ms(d["vf_step_s"], 2), H.ms(d["torch_step_s"], 2)]
                        + [" / ".join(f"{1e3 * x[k]:.1f}" for x in d["per_rank_s"])
                           for k in ("compute", "recv", "send", "other")]
                        + [" / ".join(f"{x['gloo_sends']:.0f} + {x['gloo_recvs']:.0f}" for x in d["per_rank_s"]),
                           " / ".join(f"{1e3 * x['gloo_send_s']:.1f} + {1e3 * x['gloo_recv_s']:.1f}"
                                      for x in d["per_rank_s"])]
                        + [f"{H.ms(d['message_latency_median_s'], 2)} ({H.ms(d['message_latency_p90_s'], 2)})"])
    return H.md_table(["rep", "schedule", "virtualflow ms", "torch ms", "compute ms (rank 0 / 1)",
                       "blocked in receives ms", "sends ms", "rest of the step ms", "gloo sends + receives posted",
                       "ms in those calls", "message latency ms (p90)"], rows)


def _emu_table(rows: dict) -> str:
    header = ["schedule", "bubble measured", "simulated (nominal)", "error (points)", "analytic",
              "calibrated (measured times + median message latency)", "span ms (simulated)", "samples/s",
              "peak stash per rank", "stash_bound"]
    out = []
    for s, r in rows.items():
        out.append([s, f"{100 * r['measured_bubble']:.1f} %", f"{100 * r['simulated_bubble']:.1f} %",
                    f"**{r['error_points']:+.1f}**",
                    f"{100 * r['analytic_bubble']:.1f} %" if "analytic_bubble" in r else "",
                    f"{100 * r['calibrated_bubble']:.1f} % ({H.ms(r['message_latency_median_s'], 2)} ms; p90 "
                    f"{H.ms(r['message_latency_p90_s'], 2)})",
                    f"{1e3 * r['measured_span_s']:.0f} ({1e3 * r['simulated_span_s']:.0f})",
                    f"{r['throughput_samples_s']:.0f}", str(r["peak_stash_measured"]), str(r["stash_bound"])])
    return H.md_table(header, out)


def _vs_table(vs_sum: dict) -> str:
    two = all("ratio2" in o for o in vs_sum.values())
    return H.md_table(["schedule", "virtualflow ms", "torch ms", "ratio", "per-rep ratios", "p25 ratio",
                       f"<= {TARGET_RATIO}", "final weights"]
                      + (["diagnostic: over one gloo device, ratio (per rep)"] if two else []),
                      [[s, H.ms(o["vf_step_s"], 2), H.ms(o["torch_step_s"], 2), f"**{o['ratio']:.3f}**",
                        " ".join(f"{x:.3f}" for x in o["ratios"]), f"{o['p25_ratio']:.3f}", H.yes_no(o["met"]),
                        "bit-identical" if o["bit_identical"] else f"max diff {o['max_abs_weight_diff']:.1e}"]
                       + ([f"{o['ratio2']:.3f} ({' '.join(f'{x:.3f}' for x in o['ratios2'])})"] if two else [])
                       for s, o in vs_sum.items()])


def markdown(run: H.Run, args, vs: dict, vs_sum: dict, vs2: dict | None, vs2_sum: dict | None, emu: dict | None) -> str:
    lines = [f"# {run.name}: pipeline executor vs torch.distributed.pipelining; bubbles; stash", "",
             H.env_markdown(), ""]
    loads = [r["other_load_cores"] for r in vs["reps"]]
    lines += [
        "## (1) Step time against torch.distributed.pipelining (real compute)", "",
        f"Model: MLP {VS_IN}-{args.hidden}x7-{VS_CLASSES} as an `nn.Sequential` of 8 layers "
        f"({sum(q.numel() for q in vs_model(args.hidden).parameters()) / 1e6:.2f} M params), SGD + momentum; "
        f"p = {VS_P} processes x 1 thread (gloo, one TCPStore on a free port), m = {args.m} micro-batches of "
        f"{args.mb}; interleaved: 2 pieces per rank. virtualflow = `build_engine` + `StageEngine.steps` driven by "
        f"`links.drive(..., links=Links())` (one `Links` per engine, kept across steps; its executor, not "
        f"the worker loop of `virtualflow.train`); torch = `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / "
        f"`ScheduleInterleaved1F1B`, then `optimizer.step()`. Alternating step by step in the same 2 processes, "
        f"{args.vs_steps} steps each ({args.vs_warmup} warm-up), {args.vs_reps} repetitions in fresh processes "
        f"(other load {', '.join(f'{x:.2f}' for x in loads)} cores); step time = the slower rank's; ratio = median "
        f"over repetitions of (median step ratio).", "",
        _vs_table(vs_sum), ""]
    if args.two_devices:
        lines += [
            "Diagnostic column: a third side in the same alternation, the same executor and driver over a "
            "group built with one gloo device (one TCP connection per pair of ranks, both directions of a link on "
            "it), as pipelined jobs built it before their groups became duplex (`make_group(..., duplex=True)`: "
            "two devices, the driver's tags put each direction on its own connection). The ratio column is the "
            "duplex group, what a training job gets.", ""]
    if vs2 is not None:
        lines += [
            f"The same comparison at hidden = {vs2['hidden']} (about {(vs2['hidden'] / args.hidden) ** 2:.0f}x the "
            f"compute and {vs2['hidden'] / args.hidden:.0f}x the bytes per message; "
            f"{sum(q.numel() for q in vs_model(vs2['hidden']).parameters()) / 1e6:.2f} M params; {len(vs2['reps'])} "
            f"repetition(s); a diagnostic, not a target): a fixed cost per message shows as about the same "
            f"milliseconds and a smaller ratio.", "",
            _vs_table(vs2_sum), ""]
    if args.diag_steps:
        lines += [
            "### Where the executor's step time goes (diagnostic)", "",
            f"{args.diag_steps} more alternating steps per schedule and repetition in the same processes, with the "
            f"executor's timeline on (the first {max(1, args.diag_steps // 5)} not counted); per rank, median ms per "
            f"step: compute = its F/B actions; blocked in receives = RECV actions (waiting for the peer's compute "
            f"included); sends = SEND actions (packing and posting); rest = the step's wall time minus all actions "
            f"(posting receives, the optimizer, the per-step all-reduce, the engine's bookkeeping). gloo sends + "
            f"receives posted: the calls into virtualflow's `ProcessGroupGloo` that post a send or a receive "
            f"(per step, and the ms spent inside them: sends within the SEND actions, receives mostly in the "
            f"rest, posted when the engine announces them); torch.distributed.pipelining posts one send and one "
            f"receive per message. Message latency = receive end - send end for a message whose receiver was "
            f"already waiting.", "",
            _diag_table(vs), ""]
    if emu is None:
        return "\n".join(lines + [f"Reproduce: `{run.command(NAME, ' --skip-emulated')}`"])
    e = emu["config"]
    rows = emu["schedules"]
    v2 = rows["2bw"]
    lines += [
        "## (2) Bubbles with emulated compute, (3) stashed activations", "",
        f"p = {EMU_P} processes (other load {emu['other_load_cores']:.2f} cores), m = {e['m']} micro-batches of "
        f"{EMU_MB}; sleep-paced layers, per stage and micro-batch: forward {args.f_ms:g} ms, backward "
        f"{args.i_ms + args.w_ms:g} ms (input-gradient path {args.i_ms:g} ms + weight-gradient path {args.w_ms:g} ms; "
        f"interleaved: 8 pieces of half these times). {e['flush_steps']} steps per flush schedule, 2BW "
        f"{e['windows']} windows of {e['window']} steps; the first call is warm-up. virtualflow = `drive` with one "
        f"`Links` per engine. Bubble = mean over ranks of 1 - compute / (first compute start .. last compute end over "
        f"all ranks), median over steps (2BW: windows). Simulated = `simulate(schedule, f, b, w)` with the nominal "
        f"times, comm 0; calibrated = the same with the timeline's median action times and the median message "
        f"latency (receive end - send end, receiver already waiting). Throughput = samples / wall time of a call "
        f"(a step; 2BW a window of {e['window']}), flush and all-reduce included.", "",
        _emu_table(rows), "",
        f"2BW / 1F1B throughput: {v2['throughput_samples_s'] / rows['1f1b']['throughput_samples_s']:.3f}x. 2BW weight "
        f"versions: snapshots alive at every forward, peak per stage {v2['peak_snapshots_at_forward']} (bound "
        f"{v2['weight_versions_bound']}); versions used by live micro-batches {v2['peak_versions_in_flight']} "
        f"(the last stage holds one micro-batch at a time). Besides the snapshots, each stage keeps its module's own "
        f"parameters (the optimizer's copy, {'also' if any(v2['forward_used_module_weights']) else 'never'} read by a "
        f"forward), and the rotation after each update clones the new snapshot before dropping the oldest: "
        f"{v2['peak_snapshots_transient']} snapshots alive for an instant.", "",
        f"Reproduce: `{run.command(NAME)}`"]
    return "\n".join(lines)
