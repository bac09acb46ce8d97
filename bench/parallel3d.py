"""3-D parallelism (issue 31), planner side: the grid ``virtualflow plan --grid`` chooses against
the best pure data-parallel, pure pipeline and pure tensor-parallel layouts of the same workers.

Per-layer costs are EMULATED (nothing runs): GPT-style transformer layers of hidden size ``h``,
sequence ``s`` and ``b`` samples per VN, costed by FLOPs at a device rate (a block's forward
``24 b s h^2 + 4 b s^2 h`` FLOPs, its backward twice that; weights ``12 h^2`` parameters; the output
activation ``b s h`` values; the stash ``16`` activations per block), plus an embedding and a
head. Every time below is the planner's PREDICTION (:mod:`virtualflow.plan.grid`), in three
scenarios: a small model on one node, a large model that does not fit one worker, and the large
model with tensor-parallel groups on a slow link (PCIe, no NVLink).

Targets (each scenario): the chosen grid fits the memory limit (``chosen_fits``), and its predicted
step time is no worse than the best pure layout that fits (key ``chosen_vs_pure``, ratio <= 1.00:
the planner's search contains every pure layout, so this checks the search and the ranking).

Measured step times: :func:`measure` is the hook for the engine's runs (``Pipeline(stages=P,
tensor=T)`` on ``D`` replicas). It returns ``None`` until the lead fills it in, and the
predicted-vs-measured comparison is then printed as "not measured": no number is made up. From
the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.parallel3d           # ~10 s
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.parallel3d --quick   # ~3 s
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench import harness as H
from virtualflow.plan.grid import GridCandidate, GridPlan, GridProblem, choose_grid
from virtualflow.plan.pipeline.partition import LayerProfile, Link

NAME = "parallel3d"
TARGET_KEYS = ("chosen_vs_pure",)
BYTES = 2  # bf16 weights and activations


@dataclass(frozen=True)
class Scenario:
    name: str
    hidden: int
    layers: int
    heads: int
    seq: int
    vn_batch: int
    virtual_nodes: int
    workers: int
    memory_limit_gib: float | None
    link: Link
    tp_link: Link
    flops_per_s: float = 100e12
    vocab: int = 50304


NVLINK = Link(bandwidth_bytes_per_s=200e9, latency_s=5e-6)
SCENARIOS = (
    Scenario("small model, one node", hidden=1024, layers=24, heads=16, seq=1024, vn_batch=4, virtual_nodes=16,
             workers=8, memory_limit_gib=80, link=Link(bandwidth_bytes_per_s=100e9, latency_s=1e-5), tp_link=NVLINK),
    Scenario("large model, does not fit one worker", hidden=6144, layers=40, heads=48, seq=2048, vn_batch=1,
             virtual_nodes=32, workers=8, memory_limit_gib=80, link=Link(bandwidth_bytes_per_s=100e9, latency_s=1e-5),
             tp_link=NVLINK),
    Scenario("large model, tensor-parallel groups without NVLink", hidden=6144, layers=40, heads=48, seq=2048,
             vn_batch=1, virtual_nodes=32, workers=8, memory_limit_gib=80,
             link=Link(bandwidth_bytes_per_s=100e9, latency_s=1e-5),
             tp_link=Link(bandwidth_bytes_per_s=16e9, latency_s=2e-5)),
)


def emulated_layers(sc: Scenario) -> tuple[list[LayerProfile], list[int]]:
    """Per-layer costs of one VN micro-batch at T = 1 (see the module docstring)."""
    b, s, h = sc.vn_batch, sc.seq, sc.hidden
    act = b * s * h * BYTES
    block_f = (24 * b * s * h * h + 4 * b * s * s * h) / sc.flops_per_s
    emb = LayerProfile(forward_s=2 * b * s * h / sc.flops_per_s, backward_s=4 * b * s * h / sc.flops_per_s,
                       activation_bytes=act, param_bytes=(sc.vocab + s) * h * BYTES, stash_bytes=b * s * 8,
                       name="embedding")
    blocks = [LayerProfile(forward_s=block_f, backward_s=2 * block_f, activation_bytes=act,
                           param_bytes=12 * h * h * BYTES, stash_bytes=16 * act, name=f"block{i}")
              for i in range(sc.layers)]
    head_f = 2 * b * s * h * sc.vocab / sc.flops_per_s
    head = LayerProfile(forward_s=head_f, backward_s=2 * head_f, activation_bytes=b * s * sc.vocab * BYTES,
                        param_bytes=sc.vocab * h * BYTES, stash_bytes=act + b * s * sc.vocab * BYTES, name="head")
    return [emb, *blocks, head], [0] + [2] * sc.layers + [0]  # a block: attention + MLP, two column/row pairs


def problem_of(sc: Scenario, quick: bool) -> GridProblem:
    layers, tp = emulated_layers(sc)
    return GridProblem(layers=layers, tensor_parallel=tp, heads=sc.heads, workers=sc.workers,
                       virtual_nodes=sc.virtual_nodes, vn_batch=sc.vn_batch,
                       memory_limit_bytes=None if sc.memory_limit_gib is None else sc.memory_limit_gib * 2**30,
                       optimizer_state_factor=8.0,  # bf16 weights and gradients + fp32 master weights and Adam moments
                       link=sc.link, tp_link=sc.tp_link, microbatches_per_vn=(1,) if quick else (1, 2))


# ---- LEAD: the measured side ---------------------------------------------------------------------


def measure(layout: GridCandidate) -> float | None:
    """Measured seconds per step of ``layout`` (``D`` replicas of ``Pipeline(stages=P, tensor=T)``
    with its schedule, chunks and split) on emulated layers, or ``None`` when not measured.

    HOOK, NOT A MEASUREMENT: returns ``None`` until the grid engine exists; the lead fills in the
    run (sleep-emulated layers as in ``bench.pipeline_partition``). Never return a made-up number."""
    return None


# ---- the comparison -------------------------------------------------------------------------------


def pure_layouts(plan: GridPlan) -> dict[str, GridCandidate | None]:
    """The best candidate of each pure layout (None when the grid does not allow it)."""
    w = plan.problem.workers

    def first(pred) -> GridCandidate | None:
        return next((c for c in plan.candidates if pred(c)), None)

    return {
        "pure data parallel": first(lambda c: c.data == w),
        "pure pipeline": first(lambda c: c.stages == w),
        "pure tensor": first(lambda c: c.tensor == w),
    }


def main(argv: list[str] | None = None) -> int:
    args = H.parser(__doc__).parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    print(H.banner("virtualflow 3-D grid planner: chosen grid vs pure layouts (PREDICTED times, emulated layer costs)"))
    t = run.targets
    rows, results, worst_ratio = [], [], 0.0
    for sc in SCENARIOS:
        plan = choose_grid(problem_of(sc, args.quick))
        chosen = plan.best
        pures = pure_layouts(plan)
        print(f"\n== {sc.name}: h={sc.hidden}, {sc.layers} blocks, heads={sc.heads}, seq={sc.seq}, "
              f"{sc.virtual_nodes} VNs x {sc.vn_batch}, W={sc.workers}, limit {sc.memory_limit_gib} GiB")
        print(plan.table(5))
        print(plan.explain)
        config = {k: ({"bandwidth_bytes_per_s": v.bandwidth_bytes_per_s, "latency_s": v.latency_s}
                      if isinstance(v, Link) else v) for k, v in sc.__dict__.items()}
        entry = {"scenario": sc.name, "config": config,
                 "chosen": None if chosen is None else chosen.as_json(), "pure": {}, "layouts": len(plan.candidates)}
        t.holds(f"{sc.name}: the chosen grid fits the memory limit", chosen is not None and chosen.fits,
                "" if chosen is None else f"{chosen.memory_bytes / 2**30:.1f} GiB per worker")
        if chosen is None:
            results.append(entry)
            continue
        for label, cand in [("chosen", chosen), *pures.items()]:
            measured = None if cand is None else measure(cand)
            if cand is None:
                rows.append([sc.name, label, "not allowed", "", "", "", "", "not measured"])
                continue
            rows.append([sc.name, label, cand.describe(), H.ms(cand.step_time_s, 2), f"{cand.bubble * 100:.1f}",
                         f"{cand.memory_bytes / 2**30:.1f}", H.yes_no(cand.fits),
                         "not measured" if measured is None else H.ms(measured, 2)])
            if label != "chosen":
                entry["pure"][label] = cand.as_json() | {"measured_step_s": measured}
        entry["chosen"]["measured_step_s"] = measure(chosen)
        fitting = [c for c in pures.values() if c is not None and c.fits]
        if fitting:
            ratio = chosen.step_time_s / min(c.step_time_s for c in fitting)
            worst_ratio = max(worst_ratio, ratio)
            entry["chosen_over_best_pure"] = ratio
        results.append(entry)
    t.at_most("chosen_vs_pure", "chosen / best fitting pure layout, predicted step time (worst scenario)",
              worst_ratio, 1.00)
    header = ["scenario", "layout", "grid", "predicted step ms", "bubble %", "GiB/worker", "fits", "measured step ms"]
    print("\n" + H.text_table(header, rows))
    print("\npredicted vs measured: not measured (measure() returns None until the grid engine exists)")
    payload = {"benchmark": run.name, "environment": H.environment(), "quick": args.quick,
               "scenarios": results, "predicted_vs_measured": "not measured",
               "note": "every time is the planner's prediction on emulated per-layer costs; nothing was run"}
    md = ("# 3-D grid planner: chosen grid vs pure layouts\n\n" + H.env_markdown(payload["environment"])
          + f"\n\nCommand: `{run.command(NAME)}`. PREDICTED step times from `virtualflow.plan.grid` on emulated "
          "GPT-style layer costs (100 TFLOP/s, bf16); nothing is measured yet (`measure()` returns None).\n\n"
          + H.md_table(header, rows) + "\n\nPredicted vs measured: not measured.\n")
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
