"""The non-timing logic of ``bench.sharded_params``: the memory bound, the limit between the two
peaks, the reading of an out-of-memory report, the targets' verdicts on given figures, and what
the measured state weighs (against sums written out by hand from plain PyTorch). No processes."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from bench import harness as H
from bench import sharded_params as S
from bench.harness import gpt
from bench.harness import resize_pause as R
from bench.harness.fsdp2 import rank_slices

TINY = gpt.GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)
MIB = 2 ** 20


def test_memory_bound_is_1_over_w_of_the_state_plus_the_two_largest_units_plus_ten_percent():
    units = [10, 40, 30, 20]
    assert S.two_largest(units) == 70
    assert S.memory_bound(1000, units, 4) == pytest.approx(1.1 * (250 + 70))
    assert S.memory_bound(1000, units, 2, slack=0.0) == pytest.approx(500 + 70)
    assert S.two_largest([7]) == 7


def test_the_limit_lies_halfway_between_the_peaks_or_nowhere():
    assert S.pick_limit(1000.0, 2000.0) == 1500.0
    assert S.pick_limit(1000.0, 1050.0) is None  # closer than the 64 MiB margin
    assert S.pick_limit(2000.0, 1000.0) is None  # sharding did not lower the peak
    assert S.pick_limit(float("nan"), 2000.0) is None  # a peak not measured


def test_an_out_of_memory_report_is_recognised_and_the_knob_must_be_named():
    torch_oom = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 2621440000 bytes. Error code 12 (Cannot allocate memory)")
    assert S.is_oom(torch_oom) and S.is_oom("MemoryError") and not S.is_oom("ValueError: bad shape")
    assert not S.is_oom(None)
    assert not S.names_knob(torch_oom)
    assert not S.names_knob("reduction='allreduce' holds every parameter; see the docs")
    assert S.names_knob("worker 0 ran out of memory ... shard the parameters: --reduction fsdp")
    assert S.names_knob('... use reduction="fsdp" (--reduction fsdp)')


def test_rank_slices_cut_the_batch_as_virtualflows_contiguous_vns():
    assert rank_slices(16, 4, 2, 1) == (8, 2, 4)  # rank 1: positions 8..15 in 2 micro-batches of 4
    assert rank_slices(8, 4, 4, 3) == (6, 1, 2)
    with pytest.raises(ValueError, match="multiple"):
        rank_slices(8, 4, 3, 0)


def _figures(**w4) -> dict:
    mib = lambda x: x * MIB  # noqa: E731
    per_w = {
        1: {"fsdp2_step_s": [1.0], "vf_step_s": [5.0], "det_step_s": [5.0], "fsdp2_vmhwm_mib": [1000.0],
            "vf_vmhwm_mib": [910.0], "det_bit_identical": True},  # W=1: no step-time target against FSDP2
        2: {"fsdp2_step_s": [2.0], "vf_step_s": [1.0], "det_step_s": [1.1], "fsdp2_vmhwm_mib": [900.0, 910.0],
            "vf_vmhwm_mib": [700.0, 705.0], "det_bit_identical": True},
        4: {"fsdp2_step_s": [2.0, 2.2], "vf_step_s": [2.0, 2.2], "det_step_s": [2.2, 2.4],
            "fsdp2_vmhwm_mib": [800.0] * 4, "vf_vmhwm_mib": [650.0] * 4, "det_bit_identical": True},
    }
    for r in per_w.values():  # the steady steps' peaks: the whole run's unless a case says otherwise
        n = len(r["vf_vmhwm_mib"])
        r.update(vf_steady_vmhwm_mib=r["vf_vmhwm_mib"], fsdp2_steady_vmhwm_mib=r["fsdp2_vmhwm_mib"],
                 vf_live_tensor_bytes=[mib(320 / n)] * n,
                 vf_alloc_peak_bytes=[mib(600 - 320 + 320 / n)] * n,  # the unsharded peak, U replaced by U/W
                 fsdp2_alloc_peak_bytes=[mib(700 - 320 + 320 / n)] * n)
    per_w[4].update(w4)
    return {"unsharded_state_bytes": mib(320), "unit_bytes": [mib(7)] * 10 + [mib(12)],
            "vf_unsharded_steady_vmhwm_mib": 900.0, "vf_unsharded_alloc_peak_bytes": mib(600),
            "plain_alloc_peak_bytes": mib(700), "per_w": per_w,
            "resize": {"bandwidth_bytes_s": mib(100), "failures": [], "pauses": [
                {"old_members": [0, 1, 2, 3], "new_members": [0, 1, 2], "pause_s": 1.4, "moved_bytes": mib(50)},
                {"old_members": [0, 1, 2], "new_members": [0, 1, 2, 4], "pause_s": 0.2, "moved_bytes": mib(80)}]},
            "limit": {"limit_mib": 1300.0, "unsharded_error": "TrainingError: worker 0: out of memory; use "
                      "--reduction fsdp", "sharded_error": None, "sharded_bit_identical": True}}


def _verdicts(fig: dict) -> tuple[H.Targets, dict[str, list[bool]]]:
    t = H.Targets()
    S.check_targets(t, fig)
    by_key: dict[str, list[bool]] = {}
    for c in t.checks:
        by_key.setdefault(c.key or c.label, []).append(c.met)
    return t, by_key


def test_targets_met_on_figures_within_every_bound():
    t, v = _verdicts(_figures())
    assert t.all_met, t.lines()
    assert v["mem_formula"] == [True] * 3 and v["time_ratio"] == [True, True] and v["det_ratio"] == [True] * 3
    assert v["mem_tensors"] == [True] * 3 and v["resize_pause"] == [True, True]
    # W=4: state by the allocator = (600 - 240 - 600) MiB + 320 MiB = 80 MiB against 1.1 (80 + 19) MiB
    formula = [c for c in t.checks if c.key == "mem_formula"][2]
    assert formula.value == pytest.approx(80 / (1.1 * 99))
    # 4 -> 3: a 1.4 s pause against 1 s + 50 MiB at 100 MiB/s
    assert [c for c in t.checks if c.key == "resize_pause"][0].value == pytest.approx(1.4 / 1.5)


@pytest.mark.parametrize("change, key", [
    ({"vf_step_s": [2.2, 2.4]}, "time_ratio"),  # 1.1x FSDP2 in both repetitions
    ({"det_step_s": [2.4, 2.6]}, "det_ratio"),  # 1.2x the default mode
    ({"fsdp2_vmhwm_mib": [600.0, 640.0, 600.0, 600.0]}, "mem_vs_fsdp2"),  # 650 MiB above FSDP2's largest 640
    ({"vf_vmhwm_mib": [820.0] * 4}, "mem_vs_fsdp2"),  # a start-up peak above FSDP2's, the steady steps below
    ({"vf_alloc_peak_bytes": [MIB * 400] * 4}, "mem_formula"),  # 400 - 600 + 320 = 120 MiB > 1.1 x 99 MiB
    ({"vf_live_tensor_bytes": [MIB * 110] * 4}, "mem_tensors"),  # 110 MiB held > 1.1 x 99 MiB
])
def test_each_missed_target_is_a_no(change, key):
    t, v = _verdicts(_figures(**change))
    assert not t.all_met
    assert v[key][-2:] == [True, False] and all(v[key][:-2])
    assert all(all(m) for k, m in v.items() if k != key)


def test_the_rss_figure_is_printed_without_a_target():
    t, v = _verdicts(_figures(vf_steady_vmhwm_mib=[2000.0] * 4))  # RSS far above the bound: no target on it
    assert t.all_met


@pytest.mark.parametrize("pauses, failures, missed", [
    ([1.6, 0.2], [], [False, True]),  # 1.6 s > 1 s + 0.5 s
    ([0.2, None], [], [True, False]),  # no second step to time the pause by: a miss
])
def test_a_slow_or_untimed_resize_is_a_no(pauses, failures, missed):
    fig = _figures()
    for p, s in zip(fig["resize"]["pauses"], pauses):
        p["pause_s"] = s
    t, v = _verdicts(fig)
    assert v["resize_pause"] == missed and not t.all_met


def test_a_resize_that_lost_a_worker_is_a_no():
    fig = _figures()
    fig["resize"].update(failures=["worker 3 exited"], pauses=fig["resize"]["pauses"][:1])
    t, _ = _verdicts(fig)
    assert [c.met for c in t.checks if c.label.startswith("resize: the resized run")] == [False]


def test_the_ratio_is_the_median_of_each_repetitions_own_ratio():
    # repetition ratios 1.0, 1.0, 1.5: median 1.0 (one disturbed repetition does not decide)
    t, v = _verdicts(_figures(fsdp2_step_s=[2.0, 2.0, 2.0], vf_step_s=[2.0, 2.0, 3.0], det_step_s=[2.0, 2.0, 3.0]))
    assert v["time_ratio"] == [True, True]
    assert [c for c in t.checks if c.key == "time_ratio"][1].value == pytest.approx(1.0)
    assert len([c for c in t.checks if c.key == "det_ratio"]) == 3


def test_the_no_fit_checks():
    fig = _figures()
    fig["limit"].update(unsharded_error="RuntimeError: DefaultCPUAllocator: can't allocate memory",
                        sharded_error="TrainingError: worker 2 exited", sharded_bit_identical=False)
    t, v = _verdicts(fig)
    labels = {c.label: c.met for c in t.checks if c.label.startswith("no fit")}
    assert [m for lab, m in labels.items() if "fails with" in lab] == [True]
    assert [m for lab, m in labels.items() if "names the knob" in lab] == [False]
    assert [m for lab, m in labels.items() if "completes" in lab] == [False]
    fig["limit"]["limit_mib"] = None  # no limit separates the peaks: that alone is reported, as a miss
    t, _ = _verdicts(fig)
    assert [c.met for c in t.checks if c.label.startswith("no fit")] == [False]


def test_state_bytes_count_parameters_gradients_and_adamw_state_once():
    model = gpt.GPT(TINY)
    n = sum(p.numel() for p in set(model.parameters()))  # the tied head counted once
    assert n == sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    opt = gpt.adamw(model)
    x, y = gpt.token_data(TINY, n=4).tensors
    gpt.lm_loss(model, (x, y)).backward()
    opt.step()
    held = gpt.state_bytes(model, opt)
    steps = sum(1 for _ in model.parameters())  # AdamW keeps one scalar step per parameter
    assert held == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * steps}
    assert gpt.state_bytes(model, None)["optimizer"] == 0


def test_live_tensor_bytes_see_a_new_storage_once_whatever_its_views():
    before = gpt.live_tensor_bytes()
    big = torch.empty(3 * MIB, dtype=torch.uint8)
    views = [big[:10], big.view(torch.float32)]  # noqa: F841 - held: views share the storage
    grown = gpt.live_tensor_bytes() - before
    assert 3 * MIB <= grown < 3 * MIB + MIB // 4  # this test's own small tensors aside
    del big, views


def test_unit_bytes_are_the_blocks_then_the_root_and_cover_the_model():
    model = gpt.GPT(TINY)
    units = gpt.unit_param_bytes(model)
    assert len(units) == TINY.layers + 1
    d = TINY.d
    block = 4 * (2 * 2 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d)
    assert units[:-1] == [block] * TINY.layers
    assert units[-1] == 4 * (TINY.vocab * d + TINY.seq * d + 2 * d)  # wte (= head), wpe, ln_f
    assert sum(units) == 4 * sum(p.numel() for p in model.parameters())


def test_the_probe_writes_each_workers_figures_at_its_step_and_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setenv(S.PROBE_DIR, str(tmp_path))
    monkeypatch.setenv(S.PROBE_STEP, "4")
    monkeypatch.setenv(S.PROBE_RESET, "2")
    probe, held = S.MemoryProbe(), torch.ones(1000)  # a tensor the probe must see
    probe.on_step_end(SimpleNamespace(step=2, rank=1, workers=2))  # the peak so far noted, and reset
    probe.on_step_end(SimpleNamespace(step=3, rank=1, workers=2))
    assert os.listdir(tmp_path) == []
    probe.on_step_end(SimpleNamespace(step=4, rank=1, workers=2))
    probe.on_train_end(4)
    assert sorted(os.listdir(tmp_path)) == ["rank1-end.json", "rank1-step.json"]
    probes = S.read_probes(str(tmp_path), 3)
    assert probes[0] is None and probes[2] is None
    rec = probes[1]
    assert rec["rank"] == 1 and rec["workers"] == 2 and rec["vmhwm_mib"] > 0 and rec["vmpeak_mib"] >= rec["vmhwm_mib"]
    # (the kernel updates VmHWM lazily: a later reading may fall a few pages below an earlier one)
    assert rec["end_vmpeak_mib"] >= rec["vmpeak_mib"] and rec["end_vmhwm_mib"] >= rec["steady_vmhwm_mib"] - 0.5
    assert rec["live_tensor_bytes"] >= held.nbytes and probe.ranks == "all"
    assert rec["peak_reset"] is True  # Linux >= 4.0
    assert rec["vmhwm_mib"] == max(rec["early_vmhwm_mib"], rec["steady_vmhwm_mib"]) > 0
    run = {"probes": probes}
    assert S.probe_mib(run, "vmhwm_mib")[1] == rec["vmhwm_mib"]
    assert S.probe_mib(run, "vmhwm_mib")[0] != S.probe_mib(run, "vmhwm_mib")[0]  # no figures: NaN


def test_the_model_factory_leaves_the_launcher_unlimited(monkeypatch):
    import resource

    monkeypatch.setenv(S.LIMIT_ENV, "1")  # 1 MiB: would break this process if applied
    monkeypatch.setenv(S.LAUNCHER_ENV, str(os.getpid()))
    before = resource.getrlimit(resource.RLIMIT_AS)
    monkeypatch.setattr(gpt, "build", lambda size: gpt.GPT(TINY))  # the 21 M model is too big for a unit test
    assert isinstance(S.limited_model("gpt-21m"), gpt.GPT)
    assert resource.getrlimit(resource.RLIMIT_AS) == before


class FakeRuns:
    """Stands in for the processes: the figures each run would report (``slow``: virtualflow's
    default mode 1.2x FSDP2's step time)."""

    def __init__(self, slow: bool = False) -> None:
        self.slow = slow
        self.state = {k: v.clone() for k, v in gpt.GPT(TINY).state_dict().items()}
        self.calls: list[tuple] = []

    def torch(self, args, workers, *, sharded, save=None):
        self.calls.append(("torch", workers, sharded, None))
        if save:
            torch.save(self.state, save)
        state = {"params": 320 * MIB // 4 // workers, "grads": 320 * MIB // 4 // workers,
                 "optimizer": 320 * MIB // 2 // workers, "live_tensors": 320 * MIB // workers}
        rss = 680 + 320 / workers
        ranks = [{"rank": r, "step_times": [1.0] * args.steps, "state_bytes": state, "vmhwm_mib": rss,
                  "alloc_peak_bytes": (700 - 320 + 320 // workers) * MIB,
                  "steady_vmhwm_mib": rss,
                  "vmpeak_mib": 1500.0} for r in range(workers)]
        return {"ranks": ranks, "other_load_cores": 0.0, "median_step_s": 1.0}

    def vf(self, args, workers, *, reduction, deterministic, limit_mib=None, **knobs):
        self.calls.append(("vf", workers, reduction, deterministic, *knobs.values(), limit_mib))
        if limit_mib is not None and reduction == "allreduce":
            return {"error": "TrainingError: worker 0 failed: RuntimeError: DefaultCPUAllocator: can't allocate "
                             "memory (shard the parameters: --reduction fsdp)"}
        unsharded = reduction == "allreduce"
        peak = 1800.0 if unsharded else 1400.0
        rss = 900.0 if unsharded else 900.0 - 320 + 320 / workers  # what sharding leaves: U / W
        alloc = 600 * MIB if unsharded else (600 - 320 + 320 // workers) * MIB
        probes = [{"rank": r, "workers": workers, "vmhwm_mib": rss, "steady_vmhwm_mib": rss, "vmpeak_mib": peak,
                   "live_tensor_bytes": 320 * MIB // workers, "alloc_start_bytes": alloc - 50 * MIB,
                   "alloc_peak_bytes": alloc} for r in range(workers)]
        step = 1.2 if self.slow and not deterministic else 1.0
        return {"median_step_s": step, "step_times": [step] * args.steps, "probes": probes, "error": None,
                "optimizer_bytes": {r: 1 for r in range(workers)}, "other_load_cores": 0.0,
                "state_dict": {k: v.clone() for k, v in self.state.items()}}

    def resize_run(self, job, sizes, **knobs):
        """A launched run resized 4 -> 3 -> 4: steps of 1 s, each change's first step 0.3 s late."""
        self.calls.append(("resize", tuple(sizes), knobs["reduction"], knobs["deterministic"], None))
        steps, t = [], 0.0
        for g, n in enumerate(sizes):
            for k in range(3):
                t += 1.0 + (0.3 if k == 0 and g else 0.0)
                steps.append({"step": len(steps), "generation": g, "time": t, "step_time_s": 1.0, "workers": n})
        formed = [{"event": "formed", "generation": 0, "members": [0, 1, 2, 3]},
                  {"event": "formed", "generation": 1, "members": [0, 1, 2], "pause_s": 0.9},
                  {"event": "formed", "generation": 2, "members": [0, 1, 2, 4], "pause_s": 0.8}]
        return {"steps": steps, "formed": formed, "failures": []}


@pytest.mark.parametrize("slow", [False, True])
def test_a_run_checks_every_target_and_writes_its_results(tmp_path, monkeypatch, slow):
    fake = FakeRuns(slow)
    monkeypatch.setattr(S, "run_torch", fake.torch)
    monkeypatch.setattr(S, "run_vf", fake.vf)
    monkeypatch.setattr(gpt, "build", lambda size: gpt.GPT(TINY))
    monkeypatch.setattr(R, "resize_run", fake.resize_run)
    monkeypatch.setattr(R, "p2p_bandwidth", lambda: 100.0 * MIB)
    for key in (*H.MALLOC_STABLE, "MALLOC_ARENA_MAX"):  # main sets them for its children: restored after
        monkeypatch.setenv(key, os.environ.get(key, "1"))
    code = S.main(["--quick", "--quiet-wait", "0", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "sharded_params.json").read_text())
    assert code == (1 if slow else 0) and out["all_targets_met"] is not slow
    missed = {c["key"] for c in out["target_checks"] if not c["met"]}
    assert missed == ({"time_ratio"} if slow else set())
    # six per W (no step-time target at W=1), five for the model that does not fit, three for the resize
    assert len(out["target_checks"]) == 5 + 2 * 6 + 5 + 3
    pauses = out["results"]["resize"]["pauses"]
    assert [p["pause_s"] for p in pauses] == [pytest.approx(0.3), pytest.approx(0.3)]
    assert [p["new_members"] for p in pauses] == [[0, 1, 2], [0, 1, 2, 4]] and all(p["moved_bytes"] > 0 for p in pauses)
    assert ("resize", (4, 3, 4), "fsdp", False, None) in fake.calls
    # the limit lies between the sharded W=4 peak (1400) and the unsharded one (1800), in both limited runs
    limits = {c[-1] for c in fake.calls if c[-1] is not None}
    assert limits == {1600.0}
    limited = [c for c in fake.calls if c[-1] is not None]
    assert limited == [("vf", 1, "allreduce", True, 1600.0), ("vf", 4, "fsdp", True, 1600.0)]
    assert ("vf", 4, "fsdp", False, "cpu", None) in fake.calls  # host offload, for the record
    assert "Target checks" in (tmp_path / "sharded_params.md").read_text()


def test_the_bytes_a_resize_moves_are_the_ranges_that_change_holder():
    block, per_elem = 4096, 12  # a unit of 12 norm blocks; fp32 parameter and two AdamW moments
    unit = [[12 * block]]
    # 4 -> 3 (the highest rank leaves): shards of 3 blocks become shards of 4; blocks 3, 6, 7, 9, 10, 11 move
    assert R.moved_bytes(unit, [0, 1, 2, 3], [0, 1, 2], per_elem) == 6 * block * per_elem
    # 3 -> 4 (worker 4 joins as rank 3): blocks 3, 6, 7 move; 9..11 go to its deputy (rank 0), then to it
    assert R.moved_bytes(unit, [0, 1, 2], [0, 1, 2, 4], per_elem) == (1 + 2 + 3 + 3) * block * per_elem
    assert R.moved_bytes(unit * 2, [0, 1, 2], [0, 1, 2], per_elem) == 0  # no change: nothing moves


def test_a_pause_is_the_gap_between_the_generations_steps_less_an_ordinary_step():
    times = [1.0, 2.0, 3.0, 5.5, 6.5, 7.6, 9.0, 11.0, 12.0]  # step 3: new generation, 2.5 s after step 2
    gens = [0, 0, 0, 1, 1, 1, 1, 2, 2]
    step_s = [1.0, 1.0, 1.0, 2.5, 1.0, 1.1, 1.4, 2.0, 1.0]
    steps = [{"step": i, "time": t, "generation": g, "step_time_s": s}
             for i, (t, g, s) in enumerate(zip(times, gens, step_s))]
    formed = [{"generation": 0, "members": [0, 1, 2, 3]}, {"generation": 1, "members": [0, 1, 2], "pause_s": 3.0},
              {"generation": 2, "members": [0, 1, 2, 5], "pause_s": 2.0}]
    first, second = R.pauses(steps, formed)
    # the ordinary step: the median of the two steps after the first (1.0, 1.1), not the later slow 1.4
    assert first["step"] == 3 and first["ordinary_step_s"] == pytest.approx(1.05)
    assert first["pause_s"] == pytest.approx(2.5 - 1.05) and first["controller_pause_s"] == 3.0
    assert first["old_members"] == [0, 1, 2, 3] and first["new_members"] == [0, 1, 2]
    assert second["gap_s"] == pytest.approx(2.0) and second["pause_s"] == pytest.approx(1.0)
    assert R.pauses(steps[:8], formed)[1]["pause_s"] is None  # the new generation's first step only
    assert S.resize_allowance(50 * MIB, 100 * MIB) == pytest.approx(1.5)


def test_the_allocator_counts_a_tensor_of_another_thread_while_alive_and_not_once_freed():
    import threading

    from bench.harness import alloc

    assert alloc.available()  # glibc >= 2.33 on the machines this benchmark runs on
    held: list[torch.Tensor] = []
    sampler = alloc.PeakSampler().start()
    worker = threading.Thread(target=lambda: held.append(torch.ones(16 * MIB, dtype=torch.uint8)))
    worker.start()
    worker.join()
    sampler.stop()  # the tensor is alive now: the peak counts it
    assert sampler.peak_bytes - sampler.start_bytes >= 16 * MIB - MIB // 4  # this test's small objects aside
    before = alloc.in_use_bytes()
    held.clear()
    assert alloc.in_use_bytes() <= before - 16 * MIB + MIB // 4
