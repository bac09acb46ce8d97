"""The grid planner's per-layer CPU overhead (``GridProblem.overhead_s`` and ``cores``): a fixed
cost per layer and micro-batch that a tensor-parallel group does not divide, taken as many times
as the ``D T`` workers running the layer at once outnumber the shared cores. Pure and exact: the
planner's prediction against the formula written out here, on a layout without a pipeline
(P = 1: the step is ``m`` micro-batches of the whole chain, plus the gradient all-reduce)."""

from __future__ import annotations

import pytest

from virtualflow.plan.grid import GridProblem, choose_grid, predict_layout
from virtualflow.plan.grid_model import contention, layer_costs
from virtualflow.plan.pipeline.partition import LayerProfile, Link

LINK = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-4)


def problem(**kw) -> GridProblem:
    layers = [LayerProfile(forward_s=f, backward_s=2 * f, activation_bytes=1024.0, param_bytes=4096.0,
                           stash_bytes=1024.0, name=f"l{i}") for i, f in enumerate([0.004, 0.030, 0.030, 0.008])]
    return GridProblem(layers=layers, tensor_parallel=[0, 1, 1, 0], heads=4, workers=4, virtual_nodes=4,
                       link=LINK, **kw)


OVERHEAD = [(0.001, 0.002), (0.003, 0.004), (0.003, 0.004), (0.001, 0.001)]


def test_the_overhead_is_added_undivided_times_the_contention_of_the_workers_running_the_layer():
    bare, loaded = problem(), problem(overhead_s=OVERHEAD, cores=2)
    assert [contention(loaded, d, t) for d, t in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]] == [1, 1, 1, 2, 2]
    assert contention(problem(overhead_s=OVERHEAD), 4, 4) == 1  # no core count: a device each
    for d, t in [(1, 1), (2, 2), (1, 4), (4, 1)]:
        busy = max(1.0, d * t / 2)
        a, b = layer_costs(bare, t, 1, d), layer_costs(loaded, t, 1, d)
        assert b.f == pytest.approx([x + busy * o for x, (o, _) in zip(a.f, OVERHEAD)], rel=1e-12)
        assert b.b == pytest.approx([x + busy * o for x, (_, o) in zip(a.b, OVERHEAD)], rel=1e-12)
        assert (b.w, b.act, b.params, b.stash, b.tp_comm_s) == (a.w, a.act, a.params, a.stash, a.tp_comm_s)


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 1, 2), (4, 1, 1)])
def test_a_layout_without_a_pipeline_is_predicted_m_times_the_chain_with_its_overhead(layout):
    d, _, t = layout
    bare, loaded = problem(), problem(overhead_s=OVERHEAD, cores=2)
    cand = next(c for c in choose_grid(bare).candidates if (c.data, c.stages, c.tensor) == layout)
    m = 4 // d
    extra = m * max(1.0, d * t / 2) * sum(f + b for f, b in OVERHEAD)
    assert predict_layout(loaded, cand).step_time_s == pytest.approx(cand.step_time_s + extra, rel=1e-9)
    # all zeros is no overhead
    zero = problem(overhead_s=[(0.0, 0.0)] * 4, cores=2)
    assert predict_layout(zero, cand).step_time_s == pytest.approx(cand.step_time_s, rel=1e-12)


def test_bad_overheads_and_core_counts_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"overhead_s has 2 entries for 4 layers"):
        problem(overhead_s=OVERHEAD[:2])
    with pytest.raises(ValueError, match=r"overhead_s\[1\]=\(-1.0, 0.0\) must be finite seconds >= 0"):
        problem(overhead_s=[(0.0, 0.0), (-1.0, 0.0), (0.0, 0.0), (0.0, 0.0)])
    with pytest.raises(ValueError, match=r"cores=0 must be a finite number > 0"):
        problem(cores=0)


def test_the_explanation_states_the_overhead_and_its_contention():
    plan = choose_grid(problem(overhead_s=OVERHEAD, cores=2))
    best = plan.best
    busy = max(1.0, best.data * best.tensor / 2)
    assert (f"The layers' CPU overhead (19.000 ms per micro-batch, not divided by T) is taken {busy:g}x: "
            f"{best.data * best.tensor} workers run each layer at once on 2 shared cores.") in plan.explain
    assert "CPU overhead" not in choose_grid(problem()).explain
