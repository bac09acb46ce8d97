"""(1) virtualflow's executor against ``torch.distributed.pipelining``, alternating in the same
processes: the ranks' side (:func:`vs_rank`), the launcher's side (:func:`measure_vs`) and the
summary the targets read.
"""

from __future__ import annotations

import datetime
import time

import torch
from torch import nn

from bench import harness as H
from bench.pipeline.workload import (
    COMPUTE, CPU, SEED, TARGET_RATIO, TARGET_WEIGHT_DIFF, VS_P, VS_SCHEDULES, vs_data, vs_job, vs_model,
)
from bench.pipeline.children import Driver, start_children


# --------------------------------------------------------------------------------------------
# (1) virtualflow's executor vs torch.distributed.pipelining, alternating in the same processes.


class _TimedPg:
    """Diagnostic: virtualflow's process group, timing each call that posts a send or a receive
    (``Group.isend`` / ``irecv`` / ``recv`` make one each); everything else is passed through."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.calls: dict[str, list[float]] = {"send": [], "recv": []}

    def __getattr__(self, name: str):
        return getattr(self.pg, name)

    def send(self, tensors, dst: int, tag: int):
        return self._timed("send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._timed("recv", tensors, src, tag)

    def _timed(self, kind: str, tensors, peer: int, tag: int):
        t0 = time.perf_counter()
        work = getattr(self.pg, kind)(tensors, peer, tag)
        self.calls[kind].append(time.perf_counter() - t0)
        return work

    def take(self) -> dict[str, list[float]]:
        calls, self.calls = self.calls, {"send": [], "recv": []}
        return calls


def _torch_side(schedule: str, m: int, rank: int, hidden: int):
    """torch.distributed.pipelining stages, schedule and optimizer of this rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from virtualflow.plan.pipeline.geometry import layers_of, piece_module, resolve_bounds

    job = vs_job(schedule, m, 1, hidden)
    torch.manual_seed(SEED)
    layers = layers_of(vs_model(hidden))
    bounds = resolve_bounds(job.pipeline, len(layers))
    stages = [PipelineStage(piece_module(layers, a, b), k, len(bounds), CPU)
              for k, (a, b) in enumerate(bounds) if k % VS_P == rank]
    opt = H.sgd([q for st in stages for q in st.submod.parameters()])
    loss_fn = nn.functional.cross_entropy
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    return stages, sched, opt, any(st.is_first for st in stages), any(st.is_last for st in stages)


def _vf_engine(schedule: str, m: int, mb: int, hidden: int, rank: int, ds):
    from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
    from virtualflow.backends.inprocess import build_engine

    job = vs_job(schedule, m, mb, hidden)
    bounds = resolve_bounds(job.pipeline, len(layers_of(vs_model(hidden))))
    engine = build_engine(job, job.pipeline, bounds, rank, dataset=ds, deterministic=False, device=CPU)
    engine.set_layout(0, [list(range(m))])
    return engine


def vs_rank(cfg: dict) -> dict:
    """One rank of the comparison: every schedule of ``cfg['schedules']`` in turn; virtualflow and
    torch alternate step by step, then (``cfg['diag_steps']``) more steps with the timeline on."""
    import torch.distributed as dist

    drv = Driver(cfg, VS_P)
    rank, world, m, mb, hidden = cfg["rank"], cfg["world"], cfg["m"], cfg["mb"], cfg["hidden"]
    dist.init_process_group("gloo", store=dist.PrefixStore("torch", drv.store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out: dict = {"rank": rank, "schedules": {}}
    ds = vs_data()
    X, Y = ds.tensors
    for schedule in cfg["schedules"]:
        engine = _vf_engine(schedule, m, mb, hidden, rank, ds)
        stages, sched, opt, has_first, has_last = _torch_side(schedule, m, rank, hidden)
        plan = engine.plan

        def torch_step(t: int) -> float:
            idx = torch.cat([plan.vn_indices(t, v) for v in range(m)])
            losses: list = []
            sched.step(*((X[idx],) if has_first else ()), target=Y[idx] if has_last else None,
                       losses=losses if has_last else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(torch.stack(losses).sum() / m) if losses else float("nan")

        sides = {"vf": lambda t: drv.run(engine, t)[0].loss, "torch": torch_step}
        engine2 = None
        if drv.group2 is not None:  # diagnostic: the same executor over a group with one gloo device
            engine2 = _vf_engine(schedule, m, mb, hidden, rank, ds)
            sides["vf2"] = lambda t: drv.run(engine2, t, two_devices=True)[0].loss
        names = list(sides)

        def alternate(first: int, n: int, times: dict, losses: dict, stamps: list | None = None) -> None:
            for t in range(first, first + n):
                k = t % len(names)  # every side goes first in turn
                for which in names[k:] + names[:k]:
                    if which not in times:
                        continue
                    dist.barrier()
                    t0, w0 = time.perf_counter(), time.time()
                    losses[which].append(sides[which](t))
                    times[which].append(time.perf_counter() - t0)
                    if which == "vf" and stamps is not None:
                        stamps.append((w0, time.time(), drv.group.pg.take()))

        times: dict[str, list[float]] = {k: [] for k in names}
        losses: dict[str, list[float]] = {k: [] for k in names}
        alternate(0, cfg["steps"], times, losses)
        theirs = {k: v for st in stages for k, v in st.submod.state_dict().items()}
        mine = engine.model.state_dict()
        row = out["schedules"][schedule] = {
            "times": times, "losses": losses, "n_pieces": engine.n_pieces,
            "max_abs_weight_diff": H.state_max_abs_diff(theirs, mine),
            "bit_identical": all(torch.equal(mine[k], theirs[k]) for k in theirs),
        }
        if engine2 is not None:
            mine2 = engine2.model.state_dict()
            row["bit_identical"] = row["bit_identical"] and all(torch.equal(mine2[k], theirs[k]) for k in theirs)
        if cfg["diag_steps"]:
            engine.timeline, pg = [], drv.group.pg
            drv.group.pg = _TimedPg(pg)
            diag_times: dict[str, list[float]] = {"vf": [], "torch": []}
            stamps: list = []
            alternate(cfg["steps"], cfg["diag_steps"], diag_times, {"vf": [], "torch": []}, stamps)
            drv.group.pg = pg
            row["diag"] = {"times": diag_times, "stamps": stamps, "first_step": cfg["steps"],
                           "timeline": [{k: e[k] for k in ("kind", "stage", "mb", "step", "start", "end")}
                                        for e in engine.timeline]}
            engine.timeline = None
        dist.barrier()
    drv.close()
    dist.destroy_process_group()
    return out


def message_latency(timelines: list[list[dict]], call_key: str = "call") -> list[float]:
    """Per message whose receiver was already waiting: receive end - send end (seconds)."""
    sends = {}
    for tl in timelines:
        for e in tl:
            if e["kind"] in ("SEND_F", "SEND_B"):
                to = e["stage"] + 1 if e["kind"] == "SEND_F" else e["stage"] - 1
                sends[e["kind"][-1], to, e["mb"], e[call_key]] = e
    out = []
    for tl in timelines:
        for e in tl:
            if e["kind"] in ("RECV_F", "RECV_B"):
                snd = sends.get((e["kind"][-1], e["stage"], e["mb"], e[call_key]))
                if snd is not None and e["start"] < snd["end"]:
                    out.append(max(0.0, e["end"] - snd["end"]))
    return out


def _breakdown(per_rank: list[dict], warm: int) -> dict:
    """From the diagnostic steps' timelines: per rank, median ms per step in compute, blocked in
    receives, in sends and the rest of the step; message latencies."""
    ranks = []
    for d in per_rank:
        steps = range(d["first_step"] + warm, d["first_step"] + len(d["stamps"]))
        parts: dict[str, list[float]] = {"step": [], "compute": [], "recv": [], "send": [], "other": [],
                                         "gloo_sends": [], "gloo_recvs": [], "gloo_send_s": [], "gloo_recv_s": []}
        for t, (w0, w1, calls) in zip(steps, d["stamps"][warm:]):
            ev = [e for e in d["timeline"] if e["step"] == t]
            compute = sum(e["end"] - e["start"] for e in ev if e["kind"] in COMPUTE)
            recv = sum(e["end"] - e["start"] for e in ev if e["kind"].startswith("RECV"))
            send = sum(e["end"] - e["start"] for e in ev if e["kind"].startswith("SEND"))
            for k, v in (("step", w1 - w0), ("compute", compute), ("recv", recv), ("send", send),
                         ("other", w1 - w0 - compute - recv - send), ("gloo_sends", len(calls["send"])),
                         ("gloo_recvs", len(calls["recv"])), ("gloo_send_s", sum(calls["send"])),
                         ("gloo_recv_s", sum(calls["recv"]))):
                parts[k].append(v)
        ranks.append({k: H.median(v) for k, v in parts.items()})
    lat = message_latency([[e for e in d["timeline"] if e["step"] >= d["first_step"] + warm] for d in per_rank],
                           "step")
    vf_t = [max(xs) for xs in zip(*(d["times"]["vf"] for d in per_rank))][warm:]
    th_t = [max(xs) for xs in zip(*(d["times"]["torch"] for d in per_rank))][warm:]
    return {"per_rank_s": ranks, "message_latency_median_s": H.median(lat) if lat else None,
            "message_latency_p90_s": H.quantile(lat, 0.9) if lat else None, "messages": len(lat),
            "vf_step_s": H.median(vf_t), "torch_step_s": H.median(th_t)}


def measure_vs(args, hidden: int, n_reps: int, diag_steps: int) -> dict:
    reps = []
    for rep in range(n_reps):
        k = rep % len(VS_SCHEDULES)
        order = list(VS_SCHEDULES[k:] + VS_SCHEDULES[:k])
        cfg = {"schedules": order, "m": args.m, "mb": args.mb, "hidden": hidden, "steps": args.vs_steps,
               "diag_steps": diag_steps, "two_devices": args.two_devices}
        H.wait_for_quiet(args.quiet_wait)
        with H.LoadMeter() as meter:
            ranks = start_children("--child-vs", VS_P, cfg)
        w = args.vs_warmup
        row: dict = {"other_load_cores": meter.other_cores, "order": order, "schedules": {}}
        for s in VS_SCHEDULES:
            per = [r["schedules"][s] for r in ranks]
            vf_t = [max(xs) for xs in zip(*(p["times"]["vf"] for p in per))]
            th_t = [max(xs) for xs in zip(*(p["times"]["torch"] for p in per))]
            vf_med, th_med = H.median(vf_t[w:]), H.median(th_t[w:])
            r = row["schedules"][s] = {
                "vf_step_s": vf_med, "torch_step_s": th_med, "ratio": vf_med / th_med,
                "p25_ratio": H.p25(vf_t[w:]) / H.p25(th_t[w:]),
                "max_abs_weight_diff": max(p["max_abs_weight_diff"] for p in per),
                "bit_identical": all(p["bit_identical"] for p in per),
                "last_loss_vf": per[-1]["losses"]["vf"][-1], "last_loss_torch": per[-1]["losses"]["torch"][-1],
                "raw_vf_step_s": vf_t, "raw_torch_step_s": th_t,
            }
            if "vf2" in per[0]["times"]:
                vf2_t = [max(xs) for xs in zip(*(p["times"]["vf2"] for p in per))]
                r["vf2_step_s"] = H.median(vf2_t[w:])
                r["ratio2"] = r["vf2_step_s"] / th_med
                r["raw_vf2_step_s"] = vf2_t
            line = (f"  hidden={hidden} rep {rep} {s:17s} virtualflow {1e3 * vf_med:7.2f} ms, torch {1e3 * th_med:7.2f} ms, ratio "
                    f"{r['ratio']:.3f} (p25 {r['p25_ratio']:.3f}); max |weight diff| {r['max_abs_weight_diff']:.1e}"
                    f"{' (bit-identical)' if r['bit_identical'] else ''}")
            if "ratio2" in r:
                line += (f"\n      diagnostic, over a group with one gloo device (both directions on one connection): "
                         f"{1e3 * r['vf2_step_s']:.2f} ms, ratio {r['ratio2']:.3f}")
            if "diag" in per[0]:
                d = r["diag"] = _breakdown([p["diag"] for p in per], max(1, diag_steps // 5))
                line += "\n      timeline on: vf {:.2f} ms, torch {:.2f} ms; per rank ms compute/recv/send/other " \
                        "(gloo sends+receives posted: n, ms): {}; message latency {:.2f} ms (p90 {:.2f})".format(
                            1e3 * d["vf_step_s"], 1e3 * d["torch_step_s"],
                            " | ".join("/".join(f"{1e3 * x[k]:.1f}" for k in ("compute", "recv", "send", "other"))
                                       + f" ({x['gloo_sends'] + x['gloo_recvs']:.0f}, "
                                         f"{1e3 * (x['gloo_send_s'] + x['gloo_recv_s']):.1f})"
                                       for x in d["per_rank_s"]),
                            1e3 * (d["message_latency_median_s"] or 0), 1e3 * (d["message_latency_p90_s"] or 0))
            print(line, flush=True)
        reps.append(row)
    return {"hidden": hidden, "reps": reps}


def summarize_vs(vs: dict, args, targets: H.Targets | None) -> dict:
    """Per schedule: the median ratio over repetitions (checked against the target when
    ``targets`` is given; the second model size is a diagnostic)."""
    out = {}
    for s in VS_SCHEDULES:
        rows = [r["schedules"][s] for r in vs["reps"]]
        ratios = [r["ratio"] for r in rows]
        ratio = H.median(ratios)
        met = ratio <= TARGET_RATIO
        if targets is not None:
            met = targets.at_most(f"ratio_{s}", f"p={VS_P} m={args.m} mb={args.mb} hidden={vs['hidden']} {s}: "
                                  f"virtualflow / torch.distributed.pipelining step time (median of {len(ratios)} "
                                  f"repetitions)", ratio, TARGET_RATIO)
        out[s] = {"ratio": ratio, "ratios": ratios, "met": met,
                  "p25_ratio": H.median([r["p25_ratio"] for r in rows]),
                  "vf_step_s": H.median([r["vf_step_s"] for r in rows]),
                  "torch_step_s": H.median([r["torch_step_s"] for r in rows]),
                  "max_abs_weight_diff": max(r["max_abs_weight_diff"] for r in rows),
                  "bit_identical": all(r["bit_identical"] for r in rows)}
        if all("ratio2" in r for r in rows):
            out[s]["ratio2"] = H.median([r["ratio2"] for r in rows])
            out[s]["ratios2"] = [r["ratio2"] for r in rows]
    if targets is not None:
        targets.at_most("weight_diff", "same computation: max |final weight difference| virtualflow vs torch",
                        max(o["max_abs_weight_diff"] for o in out.values()), TARGET_WEIGHT_DIFF)
    return out
