"""What one worker holds under each layout (``virtualflow.plan.memory``, docs/memory.md) and
``virtualflow plan --grid --reduction fsdp``'s memory model built on it.

The formulas are checked against numbers computed by hand here, against a model's own tensors
(the bytes of torch's AdamW state after a step, and a shard of every parameter as the workers cut
it), and the grid's choice against the same terms.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from virtualflow.cli.main import main
from virtualflow.plan.grid import GridProblem, choose_grid, fsdp_bytes
from virtualflow.plan.memory import check_host_memory, optimizer_slots, worker_bytes
from virtualflow.plan.pipeline.partition import LayerProfile

MiB = 2**20


def test_each_layout_by_hand():
    units, slots = [100, 60, 40], 2  # 200 elements, AdamW, float32
    a = worker_bytes("allreduce", units, slots, 4)
    assert (a.params, a.grads, a.optimizer, a.gathered) == (800, 800, 1600, 0)
    s = worker_bytes("sharded", units, slots, 4)
    assert (s.params, s.grads, s.optimizer, s.gathered) == (800, 800, 2 * 50 * 4, 0)
    f = worker_bytes("fsdp", units, slots, 4, root_numel=10)
    shards = 25 + 15 + 10 + 3  # ceil(n / 4) of each unit and of the root
    assert (f.params, f.grads, f.optimizer) == (shards * 4, shards * 4, 2 * shards * 4)
    # the root and the two largest units gathered: parameters, and their gradients before the reduce-scatter
    assert f.gathered_params == (10 + 100 + 60) * 4 and f.gathered_grads == (10 + 100 + 60) * 4
    assert f.total == f.state + f.gathered and f.host == 0 and f.device == f.total


def test_fsdp_divides_the_state_by_the_workers_and_adds_the_gathered_units():
    units = [1000, 1000, 1000, 3000]
    whole = worker_bytes("allreduce", units, 2, 1).state
    for w in (1, 2, 3, 4, 8):
        f = worker_bytes("fsdp", units, 2, w)
        assert f.state == pytest.approx(whole / w, rel=0.01)  # ceil per unit only
        assert f.gathered_params == (3000 + 1000) * 4
    one = worker_bytes("fsdp", units, 2, 1)
    assert one.state == whole and one.total == whole + one.gathered


def test_dtypes_keep_gathered_and_offload():
    units = [64, 32, 16]
    f = worker_bytes("fsdp", units, 2, 2, gathered_bytes=2, reduce_bytes=2)  # bf16 gathers and reduction
    assert f.gathered_params == (64 + 32) * 2 and f.gathered_grads == (64 + 32) * 2
    kept = worker_bytes("fsdp", units, 2, 2, keep_gathered=True)
    assert kept.gathered_params == (64 + 32 + 16) * 4 and kept.gathered_grads == (64 + 32) * 4
    off = worker_bytes("fsdp", units, 2, 2, offload=True, activations=1000)
    assert off.host == off.state and off.device == off.gathered + 1000
    assert off.total == off.host + off.device


def test_optimizer_slots_are_torchs_state_per_element():
    model = nn.Linear(8, 4)
    for make in (lambda p: torch.optim.AdamW(p, lr=0.1), lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1)):
        opt = make(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        held = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
        n = sum(p.numel() for p in model.parameters())
        assert optimizer_slots(type(opt).__name__, opt.param_groups) * n == held, type(opt).__name__
    with pytest.raises(ValueError, match=r"^optimizer_slots: Adagrad is not Adam, AdamW or SGD.*\(Job.optimizer\)$"):
        optimizer_slots("Adagrad", [{}])


def test_the_shards_cover_every_parameter_of_a_model_once():
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 1))
    flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in model]
    for w in (1, 2, 3, 4, 5):
        parts = [flat.tensor_split(w) for flat in flats]  # each unit cut in w near-equal contiguous parts
        assert all(sum(x.numel() for x in cut) == flat.numel() for cut, flat in zip(parts, flats))
        largest = sum(max(x.numel() for x in cut) for cut in parts)
        assert worker_bytes("fsdp", [f.numel() for f in flats], 0, w).params == largest * 4


@pytest.mark.parametrize("call, message", [
    (lambda: worker_bytes("zero3", [1], 2, 1), r"layout='zero3' is not one of"),
    (lambda: worker_bytes("fsdp", [1], 2, 0), r"workers=0 must be a positive integer"),
    (lambda: worker_bytes("fsdp", [-1], 2, 1), r"element counts must be >= 0"),
    (lambda: worker_bytes("sharded", [1], 2, 1, offload=True), r"offload applies to layout='fsdp' only"),
])
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_host_memory_rule():
    check_host_memory(10, 3, 30)
    with pytest.raises(ValueError, match=r"3 worker\(s\) on this host x .* more than the .* GiB available"):
        check_host_memory(10, 3, 29)


# ---- the grid planner ------------------------------------------------------------------------------


def _layer(params: float, stash: float = 1 * MiB) -> LayerProfile:
    return LayerProfile(forward_s=1e-3, backward_s=2e-3, activation_bytes=stash, param_bytes=params,
                        stash_bytes=stash)


def test_the_grid_plans_fsdp_without_pipeline_or_tensor_parallelism_and_its_memory_is_the_formula():
    layers = [_layer(8 * MiB) for _ in range(4)]
    problem = GridProblem(layers=layers, tensor_parallel=[True] * 4, heads=4, workers=4, virtual_nodes=4,
                          reduction="fsdp")
    plan = choose_grid(problem)
    assert {(c.data, c.stages, c.tensor) for c in plan.candidates} == {(4, 1, 1)}
    best = plan.best
    # Adam (factor 4): weights, gradients and 2 moments of 32 MiB / 4; two 8 MiB units gathered with their
    # gradients; the stash of one VN at a time (one micro-batch runs at a time without a pipeline)
    assert best.memory_bytes == pytest.approx(4 * 32 * MiB / 4 + 2 * (8 + 8) * MiB + 4 * MiB)
    assert best.memory_bytes == pytest.approx(fsdp_bytes(problem, 4).total + 4 * MiB)
    assert best.data_bytes == pytest.approx(3 * 3 / 4 * 32 * MiB)
    whole = choose_grid(GridProblem(layers=layers, tensor_parallel=[False] * 4, heads=1, workers=4,
                                    virtual_nodes=4, reduction="allreduce"))
    flat = next(c for c in whole.candidates if c.stages == 1)
    assert flat.memory_bytes == pytest.approx(4 * 32 * MiB + 4 * MiB)
    assert best.allreduce_s == pytest.approx(1.5 * flat.allreduce_s)


def test_a_limit_only_fsdp_meets_and_given_units():
    layers = [_layer(8 * MiB) for _ in range(4)]
    limit = 80 * MiB  # unsharded: 128 MiB of state; sharded (ZeRO-1): 2 x 32 + 16 = 80 MiB + the stash
    for reduction, fits in (("allreduce", False), ("sharded", False), ("fsdp", True)):
        plan = choose_grid(GridProblem(layers=layers, tensor_parallel=[False] * 4, heads=1, workers=4,
                                       virtual_nodes=4, reduction=reduction, memory_limit_bytes=limit,
                                       schedules=("1f1b",)))
        flat = next(c for c in plan.candidates if c.stages == 1)
        assert flat.fits is fits, (reduction, flat.memory_bytes / MiB)
    units = GridProblem(layers=layers, tensor_parallel=[False] * 4, heads=1, workers=4, virtual_nodes=4,
                        reduction="fsdp", unit_bytes=(16 * MiB, 12 * MiB, 4 * MiB), root_bytes=2 * MiB)
    w = fsdp_bytes(units, 2)
    assert w.gathered_params == (16 + 12 + 2) * MiB and w.params == (8 + 6 + 2 + 1) * MiB
    with pytest.raises(ValueError, match=r"unit_bytes/root_bytes describe reduction='fsdp''s units"):
        GridProblem(layers=layers, tensor_parallel=[False] * 4, heads=1, workers=4, virtual_nodes=4,
                    unit_bytes=(1.0,))


def test_plan_grid_cli_prints_the_fsdp_terms(capsys):
    from test_plan_grid import JOB

    assert main(["plan", JOB, "--workers", "2", "--grid", "--reduction", "fsdp", "--repeats", "1",
                 "--threads", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    terms, best = data["memory_terms"], data["grid"]["best"]
    assert (best["data"], best["stages"], best["tensor"]) == (2, 1, 1)
    assert sum(terms.values()) == pytest.approx(best["memory_bytes"]) and terms["activations"] > 0
    # the job's model: a Sequential of 6 layers, the default units (no root); Adam: 2 moments (the profiler's
    # measured factor also counts Adam's step counters)
    assert terms["optimizer"] == pytest.approx(2 * terms["params"], rel=1e-3) and terms["gathered_params"] > 0
    assert main(["plan", JOB, "--workers", "2", "--grid", "--reduction", "fsdp", "--repeats", "1",
                 "--threads", "1", "--shard-units", "1,2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("memory per worker of the best, fsdp (W=2): params"))
    assert "gathered params" in line and "units: 2 + the root" in line
    assert main(["plan", JOB, "--workers", "2", "--grid", "--shard-units", "1", "--repeats", "1"]) == 2
    assert "add --reduction fsdp" in capsys.readouterr().err
