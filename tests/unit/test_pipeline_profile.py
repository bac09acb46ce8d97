"""Layer profiler, auto split, predictions and the ``virtualflow plan`` verb (fast, in-process)."""

from __future__ import annotations

import json
import math
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from virtualflow.cli.main import main
from virtualflow.config.job import Job
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.partition import InfeasiblePartition, LayerProfile, Link
from virtualflow.runtime.profile import (
    ModelProfile, ProfileError, auto_split, min_peak_split, predict, profile_layers, profile_model, stage_in_flight,
    make_schedule,
)

FREE = Link(bandwidth_bytes_per_s=math.inf)


def _job(model, *, inputs: int, outputs: int = 2, batch: int = 32, vns: int = 4, optimizer=None, **pipe) -> Job:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * batch, inputs, generator=gen), torch.randn(4 * batch, outputs, generator=gen))
    return Job(model=model, optimizer=optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3)),
               output_loss=lambda out, b: F.mse_loss(out, b[1]), dataset=data, global_batch_size=batch,
               virtual_nodes=vns, pipeline=Pipeline(**{"stages": 2, **pipe}))


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 2))


def test_profile_sizes_exact_times_positive_rng_untouched():
    job = _job(_mlp, inputs=16)  # B=32, V=4: a micro-batch of 8
    b = 8
    rng = torch.get_rng_state()
    prof = profile_model(job, repeats=2)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's random stream is untouched
    layers = prof.layers
    assert [p.name for p in layers] == ["0:Linear", "1:ReLU", "2:Linear", "3:Linear"]
    assert prof.micro_batch_size == b
    for p in layers:
        assert p.forward_s > 0 and p.backward_s > 0, p
    assert [p.param_bytes for p in layers] == [4 * (16 * 32 + 32), 0, 4 * (32 * 8 + 8), 4 * (8 * 2 + 2)]
    assert [p.activation_bytes for p in layers] == [4 * b * 32, 4 * b * 32, 4 * b * 8, 4 * b * 2]
    # Saved for backward: each Linear its input (not its weight: parameters are resident), ReLU its output.
    assert [p.stash_bytes for p in layers[:3]] == [4 * b * 16, 4 * b * 32, 4 * b * 32]
    assert layers[3].stash_bytes >= 4 * b * 8  # its input, plus what the loss keeps
    assert 4.0 <= prof.optimizer_state_factor < 4.1  # Adam: weights, gradients, two moments (+ step counters)
    assert len(profile_layers(job, repeats=1)) == 4


def test_optimizer_state_factor_and_weight_grad_split():
    sgd = profile_model(_job(_mlp, inputs=16, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                        repeats=1, weight_grad=True)
    assert sgd.optimizer_state_factor == pytest.approx(3.0)  # weights, gradients, momentum
    assert sgd.weight_grad_s is not None and len(sgd.weight_grad_s) == 4
    assert sgd.weight_grad_s[1] <= sgd.layers[1].backward_s  # ReLU: (almost) all input gradient
    assert sgd.weight_grad_s[0] == sgd.layers[0].backward_s  # layer 0 has no input gradient to send


def test_user_error_names_the_layer():
    job = _job(lambda: nn.Sequential(nn.Linear(16, 8), nn.Linear(5, 2)), inputs=16)
    with pytest.raises(ProfileError, match=r"layer 1 \(1:Linear\) raised RuntimeError"):
        profile_model(job, repeats=1)


def _heavy_model() -> nn.Sequential:
    light = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(5)]
    heavy = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 64))
    return nn.Sequential(light[0], light[1], heavy, light[2], light[3], light[4])


def test_auto_split_isolates_the_heavy_layer_and_beats_equal():
    job = _job(_heavy_model, inputs=64, outputs=64, batch=64, stages=3)
    prof = profile_model(job, repeats=5)
    assert prof.layers[2].forward_s + prof.layers[2].backward_s > 3 * max(
        p.forward_s + p.backward_s for k, p in enumerate(prof.layers) if k != 2)
    counts, part = auto_split(job, link=FREE, profiles=prof)
    assert (2, 3) in part.boundaries and counts == part.stage_sizes and sum(counts) == 6
    auto = predict(job, None, counts, prof, link=FREE)
    equal = predict(job, None, "equal", prof, link=FREE)
    assert equal["counts"] == [2, 2, 2]
    assert auto["bottleneck_s"] <= equal["bottleneck_s"]
    assert auto["bottleneck_s"] == pytest.approx(part.bottleneck_s)
    assert auto["piece_layers"][auto["bounds"].index([2, 3])] == ["2:Sequential"]


def test_predict_matches_the_1f1b_formulas_on_equal_stages():
    layers = [LayerProfile(forward_s=1.0, backward_s=2.0, activation_bytes=10, param_bytes=100, stash_bytes=7,
                           name=f"l{k}") for k in range(4)]
    job = _job(_mlp, inputs=16, vns=8)
    out = predict(job, Pipeline(stages=2), [2, 2], layers, workers=4, link=FREE)  # d=2 replicas: m = 8/2 = 4
    p, m = 2, 4
    assert (out["replicas"], out["micro_batches"]) == (2, m)
    assert out["step_time_s"] == pytest.approx((m + p - 1) * 6.0)
    assert out["bubble"] == pytest.approx((p - 1) / (m + p - 1)) == pytest.approx(out["analytic_bubble"])
    assert out["in_flight"] == [2, 1]
    # memory per worker: factor 4 (no measured optimizer) x weights + in-flight x stash
    assert out["memory_bytes"] == [4 * 200 + 2 * 14, 4 * 200 + 1 * 14]
    inter = predict(job, Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2), "equal", layers, link=FREE)
    assert inter["bubble"] == pytest.approx((p - 1) / (2 * 8 + p - 1))  # one replica: m = 8, v = 2
    assert stage_in_flight(make_schedule(Pipeline(stages=3, schedule="gpipe"), 5)) == (5, 5, 5)


def test_memory_limit_binds_and_an_impossible_one_is_a_clear_error():
    job = _job(_heavy_model, inputs=64, outputs=64, stages=3)
    prof = profile_model(job, repeats=1)
    with pytest.raises(InfeasiblePartition, match=r"Pipeline.memory_limit_gib=1e-06 per worker is below") as err:
        auto_split(job, Pipeline(stages=3, memory_limit_gib=1e-6), link=FREE, profiles=prof)
    need = float(re.search(r"Raise memory_limit_gib to at least ([0-9.e-]+)", str(err.value)).group(1))
    counts, part = auto_split(job, Pipeline(stages=3, memory_limit_gib=need), link=FREE, profiles=prof)
    assert part.peak_memory_bytes <= need * 2**30  # the advice is enough
    in_flight = stage_in_flight(make_schedule(job.pipeline, 4))
    peak, _ = min_peak_split(prof.layers, in_flight, prof.optimizer_state_factor)
    assert peak <= need * 2**30 < peak * 1.01


def _write_job(tmp_path) -> str:
    path = tmp_path / "pjob.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.utils.data import TensorDataset
        from virtualflow.config.job import Job

        def make_job():
            return Job(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                                   nn.Linear(16, 2)),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                       output_loss=lambda out, b: F.mse_loss(out, b[1]),
                       dataset=TensorDataset(torch.randn(64, 8), torch.randn(64, 2)),
                       global_batch_size=32, virtual_nodes=8, name="tiny")
    """))
    return str(path)


def test_plan_cli_prints_the_split(tmp_path, capsys):
    job = _write_job(tmp_path)
    assert main(["plan", job, "--stages", "2", "--workers", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "grid: 4 workers = 2 stages x 2 pipeline replicas" in out
    assert "m = 4 micro-batches" in out
    assert re.search(r"split \(auto\): \d,\d", out)
    assert "stage 0 (worker 0): layers 0-" in out and "0:Linear" in out
    assert "analytic (p-1)/(m+p-1) = 20.0%" in out
    assert "memory per worker:" in out and "equal split 2,3:" in out

    assert main(["plan", job, "--stages", "2", "--split", "1,4", "--json", "--repeats", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["counts"] == [1, 4] and data["equal"]["counts"] == [2, 3]
    assert len(data["profile"]["layers"]) == 5 and data["profile"]["optimizer_state_factor"] == pytest.approx(2.0)


@pytest.mark.parametrize("args,message", [
    (["--stages", "2", "--memory-limit-gib", "1e-9"], "Pipeline.memory_limit_gib=1e-09 per worker is below"),
    (["--stages", "2", "--workers", "3"], "workers=3 is not a multiple of Pipeline.stages=2"),
    (["--stages", "2", "--split", "2,x"], "--split '2,x' must be auto, equal"),
    (["--stages", "6"], "the model has 5 layers but the pipeline needs 6"),
    ([], "the job has no Job.pipeline: give --stages P"),
])
def test_plan_cli_errors_are_one_line(tmp_path, capsys, args, message):
    assert main(["plan", _write_job(tmp_path), "--repeats", "1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("virtualflow plan: error: ") and message in err[0], err
