"""Reporting and callbacks of the training loop, in-process: the FLOPs formula against a FLOP
counter on a tiny GPT, device peaks and throughput, the callback runner (ranks, early-stop
requests, errors, state), the checks of ``Job.callbacks``, and the step records' loop fields as
the coordinator writes them and the status, progress bar and TensorBoard show them."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import virtualflow as vf
from virtualflow.comm import protocol
from virtualflow.comm.groups import Group
from virtualflow.control.coordinator import STEP_FIELDS, Coordinator
from virtualflow.launching.supervisor import ProgressRate
from virtualflow.plan.flops import peak_tflops, run_throughput, throughput, transformer_flops
from virtualflow.runtime.callbacks import Callbacks, StepInfo
from virtualflow.cli.status import training_line
import jobs
import lm_jobs

CPU = torch.device("cpu")


# -- FLOPs -------------------------------------------------------------------------------------
def test_transformer_flops_equals_a_flop_counter_on_a_tiny_gpt():
    """6 N + 12 L d T per token, times T: what torch's FLOP counter measures for one sample's
    forward and backward through lm_jobs.TinyLM (attention by explicit matmuls, tied output
    matrix), N being the weights of its linear layers (the output matrix once, not the
    position table, not biases or norms)."""
    torch.manual_seed(0)
    model = lm_jobs.TinyLM()
    x, y = lm_jobs.lm_data(1).tensors
    with FlopCounterMode(display=False) as counter:
        lm_jobs.lm_loss(model, (x, y)).backward()
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    n_params = sum(p.numel() for p in model.parameters())
    predicted = transformer_flops(n_params, lm_jobs.LAYERS, lm_jobs.D, lm_jobs.SEQ,
                                  non_embedding_params=matmul_weights)
    assert predicted == counter.get_total_flops()
    # the hand count of the same thing: 2 FLOPs per multiply-add, backward twice the forward
    T, L, D = lm_jobs.SEQ, lm_jobs.LAYERS, lm_jobs.D
    forward = 2 * matmul_weights * T + L * 2 * (2 * T * T * D)  # linear layers; Q K^T and A V
    assert predicted == 3 * forward


def test_transformer_flops_is_nanogpts_estimate_and_checks_its_inputs():
    n, L, H, Q, T = 124_000_000, 12, 12, 64, 1024  # GPT-2 small as nanoGPT's estimate_mfu counts it
    assert transformer_flops(n, L, H * Q, T) == (6 * n + 12 * L * H * Q * T) * T
    assert transformer_flops(n + 10, L, H * Q, T, non_embedding_params=n) == transformer_flops(n, L, H * Q, T)
    for bad in ({"n_params": 0}, {"n_layers": 1.5}, {"seq_len": True}):
        args = {"n_params": 100, "n_layers": 2, "d_model": 8, "seq_len": 4, **bad}
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            transformer_flops(**args)
    with pytest.raises(ValueError, match="non_embedding_params=200 .* no larger than n_params=100"):
        transformer_flops(100, 2, 8, 4, non_embedding_params=200)


def test_peaks_of_known_devices_by_name_and_precision():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "32") == 494.7  # TF32
    assert peak_tflops("NVIDIA H100 PCIe", "16-mixed") == 756.0
    assert peak_tflops("NVIDIA H200", "bf16-mixed") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312.0
    assert peak_tflops("NVIDIA L40S", "bf16-mixed") == 362.0 and peak_tflops("NVIDIA L4", "bf16-mixed") == 121.0
    assert peak_tflops("NVIDIA A10G", "bf16-mixed") == 70.0 and peak_tflops("NVIDIA A10", "bf16-mixed") == 125.0
    assert peak_tflops("cpu", "bf16-mixed") is None and peak_tflops("Some Future GPU", "32") is None


def test_throughput_of_a_step_and_of_a_resized_run():
    one = throughput(64, 0.5, 2, tokens_per_sample=128, flops_per_sample=1e9, peak_tflops_per_worker=0.5)
    assert one["samples_per_s"] == 128.0 and one["tokens_per_s"] == 128.0 * 128
    assert one["mfu"] == pytest.approx(1e9 * 128 / (0.5e12 * 2))
    assert throughput(64, 0.5, 2) == {"samples_per_s": 128.0, "tokens_per_s": None, "mfu": None}
    assert throughput(64, 0.0, 2)["samples_per_s"] is None
    # two steps on 2 workers (1 s each), one on 4 workers (0.5 s): model FLOPs over worker-seconds
    run = run_throughput([(10, 1.0, 2), (10, 1.0, 2), (10, 0.5, 4)], tokens_per_sample=3, flops_per_sample=2.0,
                         peak_tflops_per_worker=1e-12)
    assert run["samples_per_s"] == pytest.approx(30 / 2.5) and run["tokens_per_s"] == pytest.approx(90 / 2.5)
    assert run["mfu"] == pytest.approx(60 / (2 + 2 + 2))


# -- the callback runner -------------------------------------------------------------------------
class Recorder:
    def __init__(self, ranks: str = "zero", stop_at: int | None = None) -> None:
        self.ranks, self.stop_at = ranks, stop_at
        self.calls: list[tuple] = []

    def on_step_end(self, info):
        self.calls.append(("step", info.step, info.rank))
        return True if info.step == self.stop_at else None

    def on_eval(self, step, metrics):
        self.calls.append(("eval", step, dict(metrics)))

    def on_resize(self, step, old, new):
        self.calls.append(("resize", step, old, new))

    def state_dict(self):
        return {"calls": len(self.calls), "t": torch.arange(3.0) * len(self.calls)}

    def load_state_dict(self, state):
        self.calls = [("loaded",)] * int(state["calls"])


def info(step: int, rank: int = 0, **kw) -> StepInfo:
    return StepInfo(step=step, loss=1.0, metrics={"acc": 0.5}, lr=0.1, workers=2, rank=rank, **kw)


def one_member() -> Group:
    return Group(0, 0, 1, None)


def test_hooks_run_on_the_ranks_asked_and_a_true_answer_is_an_agreed_stop():
    zero, every = Recorder("zero", stop_at=2), Recorder("all")
    on_rank1 = Callbacks([zero, every], CPU)
    on_rank1.step_end(info(0, rank=1))
    assert zero.calls == [] and every.calls == [("step", 0, 1)]
    on_rank0 = Callbacks([Recorder("zero", stop_at=2), Recorder("all")], CPU)
    for s in range(3):
        on_rank0.step_end(info(s))
        assert on_rank0.zero_seen == s + 1
        assert on_rank0.agree_stop(one_member()) is (s == 2)
    assert on_rank0.stop_reason == "Recorder.on_step_end asked to stop after step 2"
    on_rank0.step_end(info(3))  # the request is kept (a failed agreement is asked again)
    assert on_rank0.agree_stop(one_member())
    assert not Callbacks([types_with(on_eval=lambda s, m: None)], CPU).decides_stop  # no collective needed


def types_with(**methods):
    return type("Custom", (), {k: staticmethod(v) for k, v in methods.items()})()


def test_an_answer_other_than_true_or_none_is_refused_naming_the_callback():
    cb = Callbacks([types_with(on_step_end=lambda info: 0.5)], CPU)
    with pytest.raises(TypeError, match=r"Custom.on_step_end returned 0.5 \(float\); return True to stop") as e:
        cb.step_end(info(4))
    assert e.value.step == 4


def test_a_callbacks_error_keeps_its_frame_and_names_the_callback_and_step():
    def on_step_end(info):
        raise KeyError("no such metric")

    with pytest.raises(KeyError) as e:
        Callbacks([Recorder(), types_with(on_step_end=on_step_end)], CPU).step_end(info(7))
    assert e.value.step == 7
    assert e.value.__notes__ == ["raised by Job.callbacks[1] (Custom).on_step_end at step 7"]
    assert e.traceback[-1].name == "on_step_end"  # the user's frame is the last one


def test_eval_resize_and_state_round_trip():
    rec = Recorder("all")
    cbs = Callbacks([rec, types_with(on_step_end=lambda info: None)], CPU)
    cbs.evaluated(4, {"accuracy": 0.9})
    assert rec.calls == [("eval", 4, {"accuracy": 0.9})]
    cbs.trained_workers = 2  # the last generation had 2 members; this one has 1
    assert cbs.adopt(one_member(), src=0, behind=[], step=6, hold=False) == 0
    assert rec.calls[-1] == ("resize", 6, 2, 1) and cbs.trained_workers == 1
    cbs.adopt(one_member(), src=0, behind=[], step=8, hold=False)  # same size: no call
    assert len(rec.calls) == 2
    state = cbs.state_dict()
    assert state[0]["class"] == "Recorder" and state[0]["ranks"] == "all" and state[1] is None
    torch.testing.assert_close(state[0]["state"]["t"], torch.tensor([0.0, 2.0, 4.0]))
    fresh = Callbacks([Recorder("all"), types_with(on_step_end=lambda info: None)], CPU)
    fresh.resume(state, step=8)
    assert len(fresh.callbacks[0].calls) == 2 and fresh.zero_seen == 8


def test_state_of_another_callback_class_is_not_loaded(caplog):
    state = Callbacks([Recorder()], CPU).state_dict()
    state[0]["class"] = "SomethingElse"
    target = Recorder()
    with caplog.at_level(logging.WARNING):
        Callbacks([target], CPU).load_state_dict(state)
    assert target.calls == [] and "the saved state is that of SomethingElse; it starts afresh" in caplog.text


def test_job_checks_its_callbacks():
    job = jobs.regression_job("sgd")
    assert isinstance(Recorder(), vf.Callback) and not isinstance(object(), vf.Callback)
    with pytest.raises(TypeError, match="Job.callbacks holds object, which has none of the callback methods"):
        job.replace(callbacks=[object()])
    with pytest.raises(ValueError, match="Recorder.ranks='some' must be 'zero'"):
        job.replace(callbacks=[Recorder("some")])
    with pytest.raises(TypeError, match="Job.callbacks must be a list"):
        job.replace(callbacks="on_step_end")


# -- the step records ----------------------------------------------------------------------------
def step_report(step: int, **fields) -> dict:
    return {"type": "step", "step": step, "loss": 0.5, "samples": 32, "step_time_s": 0.25, "workers": 2,
            "generation": 0, "vns": [[0, 1], [2, 3]], "members": [0, 1], "compute_s": None, "vn_sizes": None,
            "time": 1.0, "worker": 0, "pid": 1, **fields}


def test_step_records_have_fixed_fields_and_malformed_loop_fields_are_dropped(tmp_path):
    coord = Coordinator(total_steps=10, run_dir=str(tmp_path), tokens_per_sample=8, flops_per_sample=1e9)
    try:
        good = {"metrics": {"acc": 0.75}, "grad_norm": 1.5, "skipped": False, "loss_scale": None, "lr": 0.01,
                "peak_tflops": 1e-3, "stop_reason": None}
        bad = {"metrics": {"acc": "high", "n": [1], "ok": 2}, "grad_norm": "big", "skipped": "yes", "lr": True,
               "peak_tflops": -1, "stop_reason": "EarlyStop.on_step_end asked to stop after step 1"}
        for seq, (step, fields) in enumerate([(0, good), (1, bad), (2, {})], start=1):
            protocol.push_report(coord.store, coord.run, {**step_report(step, **fields), "seq": seq})
        coord.poll()
    finally:
        coord.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [list(r)[1:] for r in records] == [list(STEP_FIELDS)] * 3  # after "time"
    first, second, third = records
    assert first["metrics"] == {"acc": 0.75} and first["grad_norm"] == 1.5 and first["lr"] == 0.01
    assert first["samples_per_s"] == 128.0 and first["tokens_per_s"] == 1024.0
    assert first["mfu"] == pytest.approx(1e9 * 128 / (1e-3 * 1e12 * 2))
    assert second["metrics"] == {"ok": 2.0} and second["grad_norm"] is None and second["skipped"] is False
    assert second["lr"] is None and second["mfu"] == pytest.approx(first["mfu"])  # the peak first reported
    assert third["metrics"] == {} and third["loss_scale"] is None
    assert coord.progress.stop_request == "EarlyStop.on_step_end asked to stop after step 1"
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [e["step"] for e in events if e["event"] == "early_stop"] == [1]


def test_progress_bar_and_status_show_metrics_tokens_and_mfu():
    rate = ProgressRate(100, tokens_per_sample=512)
    for step, gen in ((0, 0), (1, 0)):
        rate.add({"step": step, "generation": gen, "samples": 64, "step_time_s": 0.5, "mfu": 0.25})
    text = rate.describe({"loss": 2.5, "workers": 2, "metrics": {"acc": 0.125}})
    assert "128 samples/s, 65,536 tokens/s, MFU 25.0%" in text and "loss 2.5000, acc 0.125, 2 workers" in text
    status = {"loss": 2.5, "train_metrics": {"acc": 0.125}, "lr": 3e-4, "grad_norm": 1.25, "loss_scale": None,
              "samples_per_s": 128.0, "tokens_per_s": 65536.0, "mfu": 0.25, "skipped_steps": 1}
    assert training_line(status) == ("last step: loss 2.5000, acc 0.125, lr 0.0003, grad norm 1.25, 128 samples/s, "
                                     "65,536 tokens/s, MFU 25.0%, 1 step(s) skipped by loss scaling")
    assert training_line({"loss": None}) == ""


def test_tensorboard_gets_the_loop_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from virtualflow.observe.tensorboard import TensorBoardLog

    log = TensorBoardLog(str(tmp_path))
    log.step({"step": 3, "loss": 1.0, "samples": 8, "step_time_s": 0.5, "workers": 1, "generation": 0,
              "metrics": {"acc": 0.5}, "grad_norm": 2.0, "skipped": True, "loss_scale": 1024.0, "lr": 0.1,
              "samples_per_s": 16.0, "tokens_per_s": 160.0, "mfu": 0.3})
    log.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    scalars = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}
    assert scalars["metrics/acc"] == 0.5 and scalars["train/grad_norm"] == 2.0 and scalars["train/skipped"] == 1.0
    assert scalars["train/tokens_per_s"] == 160.0 and math.isclose(scalars["train/mfu"], 0.3, rel_tol=1e-6)
    assert scalars["train/lr"] == pytest.approx(0.1) and scalars["train/loss_scale"] == 1024.0
