"""Pipeline partitioner (issue 14): the automatic split's measured step time against its
prediction and against the equal-layer split.

A chain of 12 layers with unequal, SLEEP-EMULATED compute (each layer is a small Linear followed
by an autograd function that sleeps ``cost x pace`` in its forward and twice that in its backward;
sleeping frees the CPU, so 4 worker processes overlap on 2 cores as 4 devices would). The costs
are uneven on purpose (one heavy layer, a heavy tail), so the equal-layer split is unbalanced.

1. ``virtualflow.runtime.profile.profile_model`` measures every layer on this machine;
   ``auto_split`` picks the 4-stage split; ``predict`` gives its 1F1B step time (simulated,
   m = 8 micro-batches) and the equal split's.
2. Both splits train in 4 worker processes (``virtualflow.train``, 1F1B, m = 8); the step time is
   the median of rank 0's step times after warm-up.

Targets: |measured / predicted - 1| <= 10 % for the chosen split (key ``prediction_error``), and
the chosen split's measured step time no worse than the equal split's (key ``vs_equal``, ratio
<= 1.00). From the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline_partition           # ~2 min
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline_partition --quick   # ~1 min
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import harness as H
from bench.harness.emulated import sleep_through

NAME = "pipeline_partition"
TARGET_KEYS = ("prediction_error", "vs_equal")
COSTS = (1, 1, 1, 5, 1, 1, 1, 1, 2, 2, 3, 3)
"""Forward cost of each layer in units of the pace; backward costs twice as much."""
STAGES, V, VN_BATCH, FEATURES = 4, 8, 4, 16
B = V * VN_BATCH


def pace_s() -> float:
    return float(os.environ.get("VF_PIPELINE_PACE_S", "0.002"))


class SleepLayer(nn.Module):
    """A real small Linear + tanh, then emulated compute: forward sleeps ``cost x pace``, backward twice that."""

    def __init__(self, cost: int) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.cost = cost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.cost * pace_s()
        return sleep_through(torch.tanh(self.linear(x)), t, 2 * t)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B * 16, FEATURES, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).tanh())


def model() -> nn.Module:
    return nn.Sequential(*[SleepLayer(c) for c in COSTS], nn.Linear(FEATURES, 1))


def job(split=(1,) * 4):
    import virtualflow as vf

    return vf.Job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), dataset=data,
                  output_loss=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
                  global_batch_size=B, virtual_nodes=V, seed=0,
                  pipeline=vf.Pipeline(stages=STAGES, schedule="1f1b", split=tuple(split)))


def measure(split: tuple[int, ...], steps: int, warm: int) -> dict:
    import virtualflow as vf

    with tempfile.TemporaryDirectory() as tmp, H.LoadMeter() as load:
        result = vf.train(lambda: job(split), workers=STAGES, steps=steps, run_dir=os.path.join(tmp, "run"),
                          threads_per_worker=1)
    times = [h["step_time_s"] for h in result.history[warm:]]
    return {"split": list(split), "step_s": H.median(times), "steps": times,
            "other_load_cores": load.other_cores}


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__)
    p.add_argument("--pace", type=float, default=0.002, help="seconds of emulated forward per cost unit")
    args = p.parse_args(argv)
    run = H.Run(NAME, args, TARGET_KEYS)
    os.environ["VF_PIPELINE_PACE_S"] = str(args.pace)  # workers inherit it
    logging.getLogger("virtualflow").setLevel(logging.ERROR)
    steps, warm = (10, 3) if args.quick else (20, 5)
    print(H.banner(f"virtualflow pipeline partitioner: {len(COSTS) + 1} layers, costs {COSTS} x {args.pace * 1e3:g} ms, "
                   f"{STAGES} stages, 1F1B, m={V}"))
    print("  COMPUTE IS SLEEP-EMULATED (forward sleeps cost x pace, backward twice that): 4 processes overlap on 2 cores.")
    from virtualflow.runtime.profile import auto_split, predict, profile_model

    probe = job()
    pipeline = probe.pipeline
    profile = profile_model(probe, repeats=5, threads=1)
    counts, _ = auto_split(probe, pipeline, workers=STAGES, profiles=profile)
    equal = "equal"
    pred_auto = predict(probe, pipeline, counts, profile, workers=STAGES)
    pred_equal = predict(probe, pipeline, equal, profile, workers=STAGES)
    equal_counts = tuple(pred_equal["counts"])
    print(f"  auto split {tuple(counts)}: predicted step {pred_auto['step_time_s'] * 1e3:.1f} ms; "
          f"equal split {equal_counts}: predicted {pred_equal['step_time_s'] * 1e3:.1f} ms", flush=True)
    waited, _ = H.wait_for_quiet(30.0)
    auto_run = measure(tuple(counts), steps, warm)
    equal_run = measure(equal_counts, steps, warm)
    err = auto_run["step_s"] / pred_auto["step_time_s"] - 1
    ratio = auto_run["step_s"] / equal_run["step_s"]
    print(f"  measured: auto {auto_run['step_s'] * 1e3:.1f} ms (prediction error {err * 100:+.1f} %), "
          f"equal {equal_run['step_s'] * 1e3:.1f} ms (predicted {pred_equal['step_time_s'] * 1e3:.1f} ms); "
          f"auto / equal = {ratio:.3f}")
    t = run.targets
    t.at_most("prediction_error", "auto split: |measured / predicted step time - 1|", abs(err), 0.10)
    t.at_most("vs_equal", "auto split step time / equal split step time (measured)", ratio, 1.00)
    payload = {
        "benchmark": run.name, "environment": H.environment(),
        "config": {"costs": COSTS, "pace_s": args.pace, "stages": STAGES, "virtual_nodes": V, "vn_batch": VN_BATCH,
                   "schedule": "1f1b", "steps": steps, "warm": warm, "quick": args.quick,
                   "compute": "sleep-emulated (forward cost x pace, backward 2x)"},
        "auto": {"counts": list(counts), "predicted_step_s": pred_auto["step_time_s"], **auto_run},
        "equal": {"counts": list(equal_counts), "predicted_step_s": pred_equal["step_time_s"], **equal_run},
        "prediction_error": err, "auto_over_equal": ratio, "quiet_wait_s": waited,
    }
    rows = [["auto", str(tuple(counts)), f"{pred_auto['step_time_s'] * 1e3:.1f}", f"{auto_run['step_s'] * 1e3:.1f}",
             f"{auto_run['other_load_cores']:.2f}"],
            ["equal", str(equal_counts), f"{pred_equal['step_time_s'] * 1e3:.1f}", f"{equal_run['step_s'] * 1e3:.1f}",
             f"{equal_run['other_load_cores']:.2f}"]]
    md = (f"# Pipeline partitioner: chosen split vs prediction and vs the equal split\n\n"
          f"{H.env_markdown(payload['environment'])}\n\n"
          f"Command: `{run.command(NAME)}`. {len(COSTS)} sleep-emulated layers (forward costs {COSTS} x "
          f"{args.pace * 1e3:g} ms, backward 2x) + a Linear head; {STAGES} worker processes, 1F1B, m = {V}; "
          f"median of rank 0's step times after {warm} warm-up steps.\n\n"
          + H.md_table(["split", "layers per stage", "predicted step ms", "measured step ms", "other load (cores)"],
                       rows)
          + f"\n\nPrediction error of the chosen split: {err * 100:+.1f} %; chosen / equal (measured): {ratio:.3f}.\n")
    return run.finish(payload, md)


if __name__ == "__main__":
    sys.exit(main())
