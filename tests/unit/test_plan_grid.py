"""The 3-D grid planner (``virtualflow.plan.grid``) and ``virtualflow plan --grid``: pure, fast.

The planner's choice is compared with an independent brute force written here from the cost
model's formulas (module docstring of ``plan/grid.py``): every ``(D, P, T)``, schedule, chunks,
micro-batches per VN and *every* split, each simulated with the schedule simulator, the best that
fits taken. Hand-computed cases check single formulas and the decisions they drive.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from virtualflow.cli.main import main
from virtualflow.plan.grid import GridCandidate, GridProblem, choose_grid, predict_layout, rank_key
from virtualflow.plan.pipeline.partition import LayerProfile, Link
from virtualflow.plan.pipeline.schedules import build_schedule
from virtualflow.plan.pipeline.simulate import simulate

MiB = 2**20
FAST = Link(bandwidth_bytes_per_s=1e11, latency_s=1e-6)


def _layer(f: float, params: float, act: float, stash: float | None = None, name: str = "") -> LayerProfile:
    return LayerProfile(forward_s=f, backward_s=2 * f, activation_bytes=act, param_bytes=params,
                        stash_bytes=act if stash is None else stash, name=name)


# ---- an independent brute force over the same cost model ------------------------------------------


def _compositions(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n - parts + 2):
        for rest in _compositions(n - first, parts - 1):
            yield (first, *rest)


def _brute(pr: GridProblem):
    """Every candidate ``(D, P, T, schedule, v, k, counts) -> (fits, step_s)`` of the model."""
    L, W, V = len(pr.layers), pr.workers, pr.virtual_nodes
    tp_link = pr.tp_link or pr.link
    out = {}
    for T in [t for t in range(1, W + 1) if W % t == 0 and pr.heads % t == 0]:
        if T > 1 and not any(pr.tensor_parallel):
            continue
        for P in [p for p in range(1, W // T + 1) if (W // T) % p == 0 and p <= L]:
            D = W // (T * P)
            if D > V:
                continue
            for k in pr.microbatches_per_vn:
                m = k * math.ceil(V / D)
                shapes = [("1f1b", 1)] if P == 1 else (
                    [(s, 1) for s in pr.schedules if s != "interleaved_1f1b"]
                    + [("interleaved_1f1b", v) for v in pr.chunks
                       if "interleaved_1f1b" in pr.schedules and P * v <= L and m % P == 0])
                for sched, v in shapes:
                    schedule = build_schedule(sched, P, m, v)
                    for counts in _compositions(L, P * v):
                        out[(D, P, T, sched, v, k, counts)] = _cost(pr, tp_link, D, P, T, v, k, m, counts, schedule)
    return out


def _cost(pr, tp_link, D, P, T, v, k, m, counts, schedule):
    per = []  # per layer: (f, b, w, act, params, stash)
    for i, lay in enumerate(pr.layers):
        pairs = int(pr.tensor_parallel[i])
        tp = pairs > 0 and T > 1
        div = T if tp else 1
        a = lay.activation_bytes / k
        ring = pairs * (a / T / tp_link.bandwidth_bytes_per_s + tp_link.latency_s) if tp else 0.0
        wg = 0.5 * lay.backward_s if pr.weight_grad_s is None else pr.weight_grad_s[i]
        per.append((lay.forward_s / k / div + 2 * (T - 1) * ring, lay.backward_s / k / div + 3 * (T - 1) * ring,
                    wg / k / div, a, lay.param_bytes / div, lay.stash_bytes / k / div))
    pieces, start = [], 0
    for c in counts:
        pieces.append(per[start:start + c])
        start += c
    n = len(pieces)
    F, B, Wt, S, G = [], [], [], [], []
    for s, pc in enumerate(pieces):
        hop = pc[-1][3] / pr.link.bandwidth_bytes_per_s + pr.link.latency_s if s < n - 1 else 0.0
        F.append(sum(x[0] for x in pc) + hop)
        B.append(sum(x[1] for x in pc) + hop)
        Wt.append(sum(x[2] for x in pc))
        S.append(sum(x[5] for x in pc))
        G.append(sum(x[4] for x in pc))
    zb = schedule.name == "zb_h1"
    sim = simulate(schedule, F, B, Wt if zb else None)
    step, peak_mem = 0.0, 0.0
    for r in range(P):
        grad = sum(G[s] for s in range(r, n, P))
        ar = 0.0 if D == 1 else 2 * (D - 1) / D * grad / pr.link.bandwidth_bytes_per_s + 2 * (D - 1) * pr.link.latency_s
        step = max(step, float(sim.timeline[r][-1].end) + ar)
        held = peak = 0.0
        for slot in sim.timeline[r]:
            kind = slot.action.kind
            if kind == "F":
                held += S[slot.action.stage]
                peak = max(peak, held)
            elif kind == ("W" if zb else "B"):
                held -= S[slot.action.stage]
        peak_mem = max(peak_mem, pr.optimizer_state_factor * grad + peak)
    fits = pr.memory_limit_bytes is None or peak_mem <= pr.memory_limit_bytes
    return fits, step


def _model(n_blocks: int = 3) -> list[LayerProfile]:
    """An embedding-like layer, ``n_blocks`` transformer blocks of unequal cost, a head."""
    return ([_layer(1e-3, 2 * MiB, 1 * MiB, name="emb")]
            + [_layer((3 + i) * 1e-3, 8 * MiB, 1 * MiB, 3 * MiB, name=f"block{i}") for i in range(n_blocks)]
            + [_layer(2e-3, 4 * MiB, 0.25 * MiB, name="head")])


SCENARIOS = {
    "fast links": dict(link=Link(bandwidth_bytes_per_s=5e9, latency_s=2e-5), tp_link=FAST),
    "slow data link": dict(link=Link(bandwidth_bytes_per_s=2e8, latency_s=1e-4), tp_link=FAST),
    "memory-bound": dict(link=Link(bandwidth_bytes_per_s=5e9, latency_s=2e-5), tp_link=FAST,
                         memory_limit_bytes=60 * MiB),
    "slow tp link, V=2": dict(link=FAST, tp_link=Link(bandwidth_bytes_per_s=1e9, latency_s=5e-4), virtual_nodes=2),
    "two pairs per block, zb measured": dict(link=Link(bandwidth_bytes_per_s=5e9, latency_s=2e-5),
                                             tp_link=Link(bandwidth_bytes_per_s=2e10, latency_s=1e-4),
                                             tensor_parallel=[0, 2, 2, 2, 0],
                                             weight_grad_s=[1e-3, 2e-3, 3e-3, 4e-3, 1e-3],
                                             memory_limit_bytes=60 * MiB),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_choice_is_the_brute_force_optimum(name):
    layers = _model()
    knobs = {"virtual_nodes": 4, "tensor_parallel": [False, True, True, True, False], **SCENARIOS[name]}
    pr = GridProblem(layers=layers, heads=4, workers=4, microbatches_per_vn=(1, 2), **knobs)
    plan = choose_grid(pr)
    every = _brute(pr)
    fitting = {key: t for key, (fits, t) in every.items() if fits}
    assert fitting, name
    optimum = min(fitting.values())
    best = plan.best
    assert best is not None and best.fits
    key = (best.data, best.stages, best.tensor, best.schedule, best.chunks, best.microbatches_per_vn, best.counts)
    assert key in fitting, key
    assert best.step_time_s == pytest.approx(fitting[key], rel=1e-12)  # the same model, computed twice
    assert best.step_time_s == pytest.approx(optimum, rel=1e-9), (name, plan.table(5))
    # Every layout's candidate is that layout's best split, and the ranking is sorted by time among those that fit.
    for c in plan.candidates:
        ck = (c.data, c.stages, c.tensor, c.schedule, c.chunks, c.microbatches_per_vn)
        same = [t for kk, (fits, t) in every.items() if kk[:6] == ck and fits == c.fits]
        assert c.step_time_s == pytest.approx(min(same), rel=1e-9), (ck, c.counts)
    times = [c.step_time_s for c in plan.candidates if c.fits]
    assert all(b >= a - 1e-12 for a, b in zip(times, times[1:]))


def test_without_a_search_the_partitioner_and_equal_split_are_used_and_never_beat_the_search():
    pr = GridProblem(layers=_model(5), tensor_parallel=[False] + [True] * 5 + [False], heads=2, workers=4,
                     virtual_nodes=4, link=Link(bandwidth_bytes_per_s=5e9, latency_s=2e-5), tp_link=FAST,
                     microbatches_per_vn=(1,))
    searched = choose_grid(pr)
    quick = choose_grid(GridProblem(**{**{f: getattr(pr, f) for f in pr.__slots__}, "max_splits": 1}))
    assert {c.split for c in quick.candidates if c.stages > 1} <= {"auto", "equal"}
    assert {c.split for c in searched.candidates} == {"searched"}
    assert quick.best.step_time_s >= searched.best.step_time_s * (1 - 1e-12)



def test_predict_layout_re_costs_an_exact_layout_on_another_problem():
    """A layout chosen on one problem, predicted on another (other layer times, another link): the
    brute-force cost of that exact layout and split; on the same problem, the candidate itself."""
    knobs = {"virtual_nodes": 4, "tensor_parallel": [False, True, True, True, False], "heads": 4, "workers": 4,
             "microbatches_per_vn": (1, 2)}
    pr = GridProblem(layers=_model(), **knobs)
    slow = Link(bandwidth_bytes_per_s=1e8, latency_s=3e-3)
    other = GridProblem(layers=[LayerProfile(forward_s=0.5 * x.forward_s, backward_s=0.5 * x.backward_s,
                                             activation_bytes=x.activation_bytes, param_bytes=x.param_bytes,
                                             stash_bytes=x.stash_bytes) for x in _model()],
                        link=slow, tp_link=slow, **knobs)
    every = _brute(other)
    for c in choose_grid(pr).candidates:
        assert predict_layout(pr, c) == c
        again = predict_layout(other, c)
        key = (c.data, c.stages, c.tensor, c.schedule, c.chunks, c.microbatches_per_vn, c.counts)
        assert (again.fits, again.step_time_s) == (every[key][0], pytest.approx(every[key][1], rel=1e-12))
    with pytest.raises(ValueError, match="re-plan on this problem"):
        three = GridProblem(layers=_model()[:3], **{**knobs, "tensor_parallel": [0, 1, 1]})
        predict_layout(three, choose_grid(pr).best)

# ---- hand-computed cases ----------------------------------------------------------------------------


def test_two_layers_on_a_slow_link_pick_pure_data_parallel_with_the_formula_time():
    # Big activations, small weights, a slow link: a pipeline hop costs more than the all-reduce.
    slow = Link(bandwidth_bytes_per_s=1e8, latency_s=1e-3)
    layers = [_layer(1e-3, 0.1 * MiB, 4 * MiB), _layer(1e-3, 0.1 * MiB, 4 * MiB)]
    plan = choose_grid(GridProblem(layers=layers, tensor_parallel=[False, False], heads=1, workers=2,
                                   virtual_nodes=4, link=slow, microbatches_per_vn=(1,)))
    best = plan.best
    assert (best.data, best.stages, best.tensor) == (2, 1, 1)
    # m = 2 VNs per replica, each (f + b) = 2 x 3 ms; then the ring all-reduce of 0.2 MiB over 2.
    g = 0.2 * MiB
    assert best.step_time_s == pytest.approx(2 * 6e-3 + (2 * 1 / 2 * g / 1e8 + 2 * 1e-3))
    assert best.data_bytes == pytest.approx(g)
    assert "vs pure data parallel" not in plan.explain and "best: D=2 P=1 T=1" in plan.explain


def test_a_model_too_big_for_one_worker_picks_p_or_t_above_1():
    layers = _model()
    whole = 4 * sum(x.param_bytes for x in layers)  # Adam: 4 bytes per parameter byte, before any stash
    plan = choose_grid(GridProblem(layers=layers, tensor_parallel=[False, True, True, True, False], heads=4,
                                   workers=4, virtual_nodes=4, memory_limit_bytes=0.9 * whole, tp_link=FAST))
    assert all(not c.fits for c in plan.candidates if c.stages == 1 and c.tensor == 1)
    assert plan.best.stages * plan.best.tensor > 1 and plan.best.memory_bytes <= 0.9 * whole
    assert "does not fit" in plan.explain  # the pure data-parallel layout is named and why it lost


def test_a_limit_that_rules_out_t_1_is_respected():
    # One huge block that no pipeline split can share: only T shards its weights.
    layers = [_layer(1e-3, 100 * MiB, 1 * MiB, name="block"), _layer(1e-3, 1 * MiB, 1 * MiB, name="head")]
    plan = choose_grid(GridProblem(layers=layers, tensor_parallel=[True, False], heads=4, workers=4, virtual_nodes=4,
                                   memory_limit_bytes=250 * MiB, tp_link=FAST))
    assert all(not c.fits for c in plan.candidates if c.tensor == 1)
    assert plan.best is not None and plan.best.tensor >= 2 and plan.best.fits


def test_high_tp_latency_penalises_t():
    # One VN (so D = 1): W = 2 is either T = 2 or P = 2; a compute-heavy block halves under T = 2.
    layers = [_layer(10e-3, 1 * MiB, 1 * MiB), _layer(10e-3, 1 * MiB, 1 * MiB)]

    def choose(alpha: float):
        return choose_grid(GridProblem(layers=layers, tensor_parallel=[True, True], heads=2, workers=2,
                                       virtual_nodes=1, microbatches_per_vn=(1,), link=FAST,
                                       tp_link=Link(bandwidth_bytes_per_s=1e11, latency_s=alpha))).best

    low = choose(1e-6)
    assert (low.data, low.stages, low.tensor) == (1, 1, 2)
    # Hand formula: per layer (f + b) / 2 plus 5 ring steps of A/2 bytes, each with its latency.
    ring = 0.5 * MiB / 1e11 + 1e-6
    assert low.step_time_s == pytest.approx(2 * (30e-3 / 2 + 5 * ring))
    assert low.tp_bytes == pytest.approx(2 * 5 * 0.5 * MiB)  # m=1: 5 (T-1)/T A per block, 2 blocks
    high = choose(5e-3)
    assert (high.stages, high.tensor) == (2, 1)
    assert "adds 4 collectives to each of their 2 column/row-parallel pairs" in choose_grid(GridProblem(
        layers=layers, tensor_parallel=[True, True], heads=2, workers=2, virtual_nodes=1,
        microbatches_per_vn=(1,), link=FAST, tp_link=FAST)).explain


def test_t_not_dividing_heads_is_never_a_candidate():
    layers = [_layer(20e-3, 1 * MiB, 1 * MiB)] * 3
    plan = choose_grid(GridProblem(layers=layers, tensor_parallel=[True] * 3, heads=4, workers=6, virtual_nodes=1,
                                   link=FAST, tp_link=FAST, microbatches_per_vn=(1,)))
    assert {c.tensor for c in plan.candidates} <= {1, 2}  # 3 and 6 divide W=6 but not heads=4
    assert plan.best.tensor == 2  # TP pays on these compute-heavy blocks, up to what heads allow


def test_ties_follow_the_documented_rule():
    def cand(**kw):
        base = dict(data=1, stages=1, tensor=1, schedule="1f1b", chunks=1, microbatches_per_vn=1, micro_batches=1,
                    counts=(2,), split="searched", step_time_s=1.0, pipeline_s=1.0, allreduce_s=0.0, bubble=0.0,
                    memory_bytes=1.0, fits=True, tp_bytes=0.0, hop_bytes=0.0, data_bytes=0.0)
        return GridCandidate(**{**base, **kw})

    a = cand(data=2, stages=1, tensor=1)
    b = cand(data=1, stages=2, tensor=1, schedule="1f1b", counts=(1, 1))
    c = cand(data=1, stages=1, tensor=2)
    assert sorted([c, b, a], key=rank_key) == [a, b, c]  # larger D, then smaller T
    assert sorted([b, cand(stages=1, counts=(2,))], key=rank_key)[0] is not b  # then smaller P
    faster_unfit = cand(step_time_s=0.5, fits=False)
    assert sorted([faster_unfit, a], key=rank_key)[0] is a  # fitting first
    assert sorted([a, cand(data=2, step_time_s=1.0 + 1e-13, hop_bytes=-1.0)], key=rank_key)[0] is not a  # a tie
    four = [cand(stages=4, schedule=s, counts=(1,) * 4) for s in ("gpipe", "zb_h1", "1f1b", "interleaved_1f1b")]
    assert sorted(four, key=rank_key)[0].schedule == "interleaved_1f1b"  # Megatron's default for P > 2


@pytest.mark.parametrize("knobs,message", [
    (dict(workers=0), "GridProblem.workers=0 must be a positive integer (W = D x P x T workers); set --workers"),
    (dict(memory_limit_bytes=-1.0), "memory_limit_bytes=-1.0 must be a finite number > 0"),
    (dict(heads=0),
     "GridProblem.heads=0 must be a positive integer (attention heads; T must divide them); set --heads"),
    (dict(heads=-2), "heads=-2"),
    (dict(virtual_nodes=0), "virtual_nodes=0"),
    (dict(tensor_parallel=[True]), "tensor_parallel has 1 entries for 2 layers"),
    (dict(tensor_parallel=[0, -1]), "tensor_parallel[1]=-1 must be an integer >= 0"),
    (dict(schedules=("2bw",)), "schedules has '2bw'"),
    (dict(microbatches_per_vn=(0,)), "microbatches_per_vn=0 must be a positive integer"),
    (dict(optimizer_state_factor=0.5), "optimizer_state_factor=0.5 must be a finite number >= 1"),
])
def test_bad_input_names_the_value_the_rule_and_the_knob(knobs, message):
    base = dict(layers=[_layer(1e-3, 1.0, 1.0)] * 2, tensor_parallel=[False, False], heads=1, workers=2,
                virtual_nodes=2)
    with pytest.raises(ValueError) as err:
        GridProblem(**{**base, **knobs})
    assert message in str(err.value)
    if "memory_limit" in message:
        assert "--memory-limit-gib" in str(err.value)


def test_no_grid_at_all_is_an_error_naming_the_rules():
    with pytest.raises(ValueError, match=r"no grid \(D, P, T\) with D x P x T = workers=4 has D <= virtual_nodes=1"):
        choose_grid(GridProblem(layers=[_layer(1e-3, 1.0, 1.0)], tensor_parallel=[False], heads=1, workers=4,
                                virtual_nodes=1))


def test_nothing_fits_gives_no_best_and_the_smallest_need():
    plan = choose_grid(GridProblem(layers=[_layer(1e-3, 10 * MiB, 1.0)] * 2, tensor_parallel=[False, False],
                                   heads=1, workers=2, virtual_nodes=2, memory_limit_bytes=1 * MiB))
    assert plan.best is None and "no layout fits" in plan.explain and "--memory-limit-gib" in plan.explain


# ---- the command line -----------------------------------------------------------------------------


VOCAB, SEQ, HIDDEN, HEADS = 64, 32, 64, 4
JOB = __file__ + ":make_grid_job"
"""A job spec for ``virtualflow plan`` (docs/parallel3d.md runs it too)."""


def make_grid_job():
    """A tiny pipelined transformer: embedding, 2 x (attention block, MLP block), head. Layers 1-4 are
    Megatron blocks (``virtualflow.parallel``'s single-worker ``AttentionBlock``/``MLPBlock``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    from virtualflow.config.job import Job
    from virtualflow.parallel import AttentionBlock, MLPBlock

    def model():
        return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), AttentionBlock(HIDDEN, HEADS, seed=1),
                             MLPBlock(HIDDEN, 4 * HIDDEN, seed=2), AttentionBlock(HIDDEN, HEADS, seed=3),
                             MLPBlock(HIDDEN, 4 * HIDDEN, seed=4), nn.Linear(HIDDEN, VOCAB))

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    return Job(model=model, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
               output_loss=lambda out, b: F.cross_entropy(out.reshape(-1, VOCAB), b[1].reshape(-1)),
               dataset=TensorDataset(tokens[:, :-1], tokens[:, 1:]), global_batch_size=32, virtual_nodes=8,
               name="grid-tiny")


def test_plan_grid_cli_prints_the_table_and_the_explanation(capsys, monkeypatch):
    job = JOB
    assert main(["plan", job, "--workers", "4", "--repeats", "1", "--threads", "1"]) == 0  # no --stages: grid
    out = capsys.readouterr().out
    assert "tensor-parallel layers: 1, 2, 3, 4" in out
    header = r"#\s+D\s+P\s+T\s+schedule\s+chunks\s+mb/VN\s+m\s+split\s+step ms\s+bubble %\s+MiB/worker\s+TP MiB\s+" \
             r"hop MiB\s+data MiB\s+fits"
    assert re.search(header, out), out  # column widths follow the rows
    assert "\nbest: D=" in out

    assert main(["plan", job, "--workers", "4", "--grid", "--repeats", "1", "--threads", "1", "--json",
                 "--tensor-parallel-layers", "1,2,3,4", "--top", "3",
                 "--tp-bandwidth-gbps", "50", "--microbatches-per-vn", "1,2", "--schedule", "1f1b"]) == 0
    data = json.loads(capsys.readouterr().out)
    grid = data["grid"]
    assert grid["tensor_parallel_layers"] == [1, 2, 3, 4] and len(grid["candidates"]) == 3
    assert grid["heads"] == HEADS and data["heads_source"].startswith("the gcd of the units")
    assert grid["tp_link"]["bandwidth_bytes_per_s"] == 50e9
    assert grid["best"] == grid["candidates"][0] and grid["best"]["fits"]
    assert grid["explain"].startswith("best: D=")
    assert {c["schedule"] for c in grid["candidates"]} <= {"1f1b"}  # --schedule restricts the search


def test_pairs_and_units_come_from_the_converters_splits(monkeypatch):
    import types
    from dataclasses import dataclass

    from virtualflow.cli.plan import tensor_parallel_pairs

    @dataclass
    class Cut:  # the shape of virtualflow.parallel.convert.Split that the CLI reads
        dim: int | None
        units: int = 1

    def tensor_splits(layer, size):
        if layer == "plain":
            raise ValueError("not a block")
        return {"attn.qkv.weight": Cut(0, 4), "attn.out.weight": Cut(1, 4), "attn.out.bias": Cut(None),
                "mlp.fc1.weight": Cut(0, 6), "mlp.fc2.weight": Cut(1, 6), "ln.weight": Cut(None)}

    fake = types.SimpleNamespace(tensor_splits=tensor_splits)
    monkeypatch.setitem(sys.modules, "virtualflow.parallel.convert", fake)
    pairs, units = tensor_parallel_pairs(["emb", "block", "plain", "head"], [False, True, True, False])
    assert pairs == [0, 2, 1, 0] and units == 2  # a transformer layer: attention + MLP; gcd(4 heads, 6 features)
    monkeypatch.setitem(sys.modules, "virtualflow.parallel.convert", None)
    assert tensor_parallel_pairs(["a", "b"], [True, False]) == ([1, 0], None)


@pytest.mark.parametrize("args,message", [
    (["--workers", "4", "--grid", "--stages", "2"], "--stages 2 fixes P while --grid chooses it"),
    (["--grid"], "--grid needs --workers W"),
    (["--workers", "4", "--tensor-parallel-layers", "9"], "names layer 9 but the model has 6 layers"),
    (["--workers", "4", "--memory-limit-gib", "-1"], "--memory-limit-gib -1.0 must be positive"),
])
def test_plan_grid_cli_errors_are_one_line(capsys, args, message):
    assert main(["plan", JOB, "--repeats", "1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("virtualflow plan: error: ") and message in err[0], err
