"""Where the step time goes (runtime/breakdown.py): the parts are recognised where known latencies
are injected (input, forward, backward, communication, a slow member) and add up to the step.

In-process tests run the VN engine on one worker with emulated input latency (a dataset that
sleeps per sample), emulated compute (a module that sleeps in forward and in backward) and
emulated communication (a group whose all-reduce sleeps); the combination of workers (waiting
for the slowest) is proven on made-up vectors and once end to end in tests/test_observability.py.

Tolerance: each measured part is at least the latency injected into it and at most that plus
``SLACK`` (the real compute and Python around it on a loaded 2-core machine); the parts add up to
the step period to float32 rounding, and the period matches the wall time between the test's
own calls of ``step`` within 5 %.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime import breakdown
from virtualflow.runtime.engine import BatchLoader, VNEngine

INPUT_S = 0.002  # per sample
FORWARD_S = 0.004  # per VN
BACKWARD_S = 0.006  # per VN
COMM_S = 0.015  # per step (the statistics' all-reduce)
SLACK = 0.012


class SlowSamples(Dataset):
    """A map-style dataset whose every ``__getitem__`` sleeps (emulated storage latency)."""

    def __init__(self, n: int = 64, latency_s: float = INPUT_S) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.latency_s)
        return self.x[i], self.y[i]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(BACKWARD_S)
        return g


class SlowNet(nn.Module):
    """A linear model whose forward sleeps FORWARD_S and whose backward sleeps BACKWARD_S."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return _Sleep.apply(self.lin(x))


class SlowGroup(Group):
    """A one-member group whose all-reduce takes COMM_S (emulated communication)."""

    def all_reduce(self, tensor, async_op=False):
        time.sleep(COMM_S)
        return super().all_reduce(tensor, async_op)


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def engine(*, deterministic: bool, loader_workers: int = 0, group: Group | None = None,
           dataset: Dataset | None = None, V: int = 2, B: int = 8) -> VNEngine:
    torch.manual_seed(0)
    model = SlowNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = dataset or SlowSamples()
    plan = DataPlan(len(ds), B, V, 0)
    eng = VNEngine(model, opt, None, mse, plan, BatchLoader(ds, None), seed=0, batchnorm="mean",
                   deterministic=deterministic, device=torch.device("cpu"), loader_workers=loader_workers)
    eng.set_membership(group or Group(0, 0, 1, None), contiguous_assignment(V, 1))
    return eng


def run_steps(eng: VNEngine, steps: int) -> tuple[list[dict], list[float]]:
    """(rank 0's breakdown of each step but the last, the test's own wall time of each step)."""
    parts, walls = [], []
    t = time.perf_counter()
    for s in range(steps):
        out = eng.step(s)
        now = time.perf_counter()
        if s > 0:
            walls.append(now - t)  # step s-1 ran from its call to this one's (t .. now minus step s)
            assert out.breakdown is not None and len(out.breakdown) == 1
            parts.append(out.breakdown[0])
        else:
            assert out.breakdown is None  # a generation's first step has no previous one
        t = now
    return parts, walls


def assert_adds_up(p: dict) -> None:
    total = sum(p[k] for k in breakdown.PARTS)
    assert total == pytest.approx(p["step_s"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("deterministic", [False, True])
def test_each_part_is_recognised_and_they_add_up(deterministic):
    V, B = 2, 8
    eng = engine(deterministic=deterministic, group=SlowGroup(0, 0, 1, None), V=V, B=B)
    parts, _ = run_steps(eng, 5)
    comm = COMM_S if deterministic else 0.0  # default mode: one member, no reduction at all
    for p in parts:
        assert_adds_up(p)
        assert B * INPUT_S <= p["input_s"] <= B * INPUT_S + SLACK
        assert V * FORWARD_S <= p["forward_s"] <= V * FORWARD_S + SLACK
        assert V * BACKWARD_S <= p["backward_s"] <= V * BACKWARD_S + SLACK
        assert comm <= p["reduction_s"] <= comm + SLACK
        assert p["straggler_s"] == 0.0  # alone: nobody to wait for
        assert p["optimizer_s"] < SLACK and p["control_s"] < SLACK
        assert p["read_calls"] == 0  # sleeping reads nothing
        assert p["loaded_s"] == pytest.approx(p["input_s"], rel=0.05, abs=1e-3)


def test_step_period_matches_the_callers_clock():
    eng = engine(deterministic=True, group=SlowGroup(0, 0, 1, None))
    steps = 6
    t0 = time.perf_counter()
    parts = []
    for s in range(steps):
        out = eng.step(s)
        if out.breakdown is not None:
            parts.append(out.breakdown[0])
    wall = time.perf_counter() - t0
    # Steps 0..steps-2 are broken down; their periods cover the wall time up to the last step's start.
    last_step_s = eng.clock.now() - eng.clock._start  # noqa: SLF001 - the running step's own time
    assert sum(p["step_s"] for p in parts) == pytest.approx(wall - last_step_s, rel=0.05)


def test_the_loop_between_steps_is_control_and_the_engines_bookkeeping_is_overhead():
    # What the caller does between steps (a worker's report, commands) is the control plane;
    # what the engine does inside a step outside the timed intervals is its overhead (issue 26:
    # both were "control", and the engine's share read as control-plane cost).
    LOOP_S = 0.02
    eng = engine(deterministic=False)
    parts = []
    for s in range(5):
        out = eng.step(s)
        if out.breakdown is not None:
            parts.append(out.breakdown[0])
        time.sleep(LOOP_S)  # the caller's loop
    for p in parts:
        assert_adds_up(p)
        assert LOOP_S <= p["control_s"] <= LOOP_S + SLACK
        assert p["overhead_s"] < SLACK
    # derive(): the loop time is control, capped by what the timed parts leave; the rest is overhead.
    (p,) = breakdown.derive([raw(forward_s=0.01, optimizer_s=0.001, period_s=0.02, arrive_s=0.011, loop_s=0.004)])
    assert p["control_s"] == pytest.approx(0.004) and p["overhead_s"] == pytest.approx(0.005)
    (p,) = breakdown.derive([raw(forward_s=0.01, period_s=0.012, arrive_s=0.01, loop_s=0.004)])
    assert p["control_s"] == pytest.approx(0.002) and p["overhead_s"] == 0.0
    # A record written before overhead_s existed still reads (its overhead was in control_s).
    old = [{"worker": 0, **{k: 0.0 for k in breakdown.PARTS if k != "overhead_s"}, "step_s": 0.01,
            "read_calls": 0, "read_bytes": 0, "loaded_s": 0.0}]
    assert breakdown.clean(old)[0]["overhead_s"] == 0.0


def test_prefetching_moves_input_off_the_critical_path():
    V, B = 4, 16
    eng = engine(deterministic=False, loader_workers=4, V=V, B=B)
    parts, _ = run_steps(eng, 5)
    for p in parts[1:]:  # step 0's batches were not prefetched
        assert_adds_up(p)
        assert p["loaded_s"] >= B * INPUT_S  # the loaders still read every sample ...
        assert p["input_s"] < 0.5 * B * INPUT_S  # ... but the compute hardly waits for them


def test_io_profile_counts_the_dataset_reads(tmp_path):
    files = []
    for i in range(16):
        f = tmp_path / f"{i}.bin"
        f.write_bytes(bytes(1000 + i))
        files.append(str(f))

    class Files(Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            with open(files[i], "rb") as fh:
                data = fh.read()
            return torch.tensor([float(len(data)) / 1000] * 8), torch.zeros(1)

    eng = engine(deterministic=False, dataset=Files(), V=2, B=8)
    parts, _ = run_steps(eng, 3)
    plan = eng.plan
    for step, p in enumerate(parts):
        idx = torch.cat([plan.vn_indices(step, vn) for vn in range(2)]).tolist()
        assert p["read_bytes"] == sum(1000 + i for i in idx)
        assert p["read_calls"] >= len(idx)  # one read returning the data, one finding the end


# -- rank 0's arithmetic over several workers ------------------------------------------------------
def raw(**kw) -> list[float]:
    base = dict.fromkeys(breakdown.RAW, 0.0)
    base.update(kw)
    return [base[k] for k in breakdown.RAW]


def test_waiting_for_the_slowest_is_split_from_communication():
    # Worker 1 computes 30 ms longer; both then spend 5 ms communicating.
    fast = raw(input_s=0.01, forward_s=0.02, backward_s=0.03, blocked_s=0.035, optimizer_s=0.002,
               period_s=0.1, arrive_s=0.062)
    slow = raw(input_s=0.01, forward_s=0.035, backward_s=0.045, blocked_s=0.005, optimizer_s=0.002,
               period_s=0.1, arrive_s=0.092)
    a, b = breakdown.derive([fast, slow])
    assert a["straggler_s"] == pytest.approx(0.030) and a["reduction_s"] == pytest.approx(0.005)
    assert b["straggler_s"] == 0.0 and b["reduction_s"] == pytest.approx(0.005)
    for p in (a, b):
        assert_adds_up(p)


def test_emulated_slowness_is_split_between_forward_and_backward():
    (p,) = breakdown.derive([raw(forward_s=0.01, backward_s=0.03, emulated_s=0.08, period_s=0.2, arrive_s=0.12)])
    assert p["forward_s"] == pytest.approx(0.03) and p["backward_s"] == pytest.approx(0.09)
    assert_adds_up(p)


def test_a_missing_worker_vector_means_no_breakdown():
    assert breakdown.derive([raw(period_s=0.1), raw()]) is None  # a worker without a finished step
    assert breakdown.derive([]) is None


@pytest.mark.parametrize("bad", [None, [], [{"worker": 0}], [{"worker": "0"}], "x",
                                 [{"worker": 0, **{k: -1.0 for k in breakdown.PARTS + ("step_s",)
                                                   + breakdown.IO_FIELDS}}],
                                 [{"worker": 0, **{k: float("nan") for k in breakdown.PARTS + ("step_s",)
                                                   + breakdown.IO_FIELDS}}]])
def test_malformed_reports_are_dropped(bad):
    assert breakdown.clean(bad) is None


def test_summary_and_advice():
    def rec(step, inp):
        p = {"worker": 0, **dict.fromkeys(breakdown.PARTS, 0.01), "step_s": 0.06 + inp, "read_calls": 4,
             "read_bytes": 4000, "loaded_s": inp}
        p["input_s"] = inp
        return {"step": step + 1, "breakdown_step": step, "generation": 0, "breakdown": [p]}

    s = breakdown.summarize([rec(i, 0.1) for i in range(4)], loader_workers=0)
    assert s.steps == 4 and s.share["input_s"] == pytest.approx(0.1 / 0.16)
    assert "--loader-workers" in s.advice
    assert breakdown.summarize([rec(i, 0.0) for i in range(4)]).advice is None
    assert "still stalls" in breakdown.summarize([rec(0, 0.1)], loader_workers=2).advice
    lines = breakdown.format_table(s)
    assert any("reads" in line for line in lines)
    assert breakdown.summarize([{"step": 0, "loss": 1.0}]) is None


def test_options_validate_the_new_knobs():
    with pytest.raises(ValueError, match=r"loader_workers=-1 .*--loader-workers"):
        vf.LaunchOptions(steps=1, loader_workers=-1)
    with pytest.raises(ValueError, match=r"profile='3-1' .*--profile"):
        vf.LaunchOptions(steps=1, profile="3-1")
    assert vf.LaunchOptions(steps=1, profile="4").profile_steps == (2, 6)
    assert vf.LaunchOptions(steps=1, profile="0-0").profile_steps == (0, 1)
