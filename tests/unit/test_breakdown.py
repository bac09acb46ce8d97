"""Where the step time goes (runtime/breakdown.py): the parts are recognised where known latencies
are injected (input, forward, backward, communication, a slow member) and add up to the step.

In-process tests run the VN engine on one worker with emulated input latency (a dataset that
sleeps per sample), emulated compute (a module that sleeps in forward and in backward) and
emulated communication (a group whose all-reduce sleeps); the combination of workers (waiting
for the slowest) is proven on made-up vectors and once end to end in tests/test_observability.py.

Fake clock: the latencies are not slept. Every thread has its own virtual clock, which only its
own emulated latencies advance; the engine, its breakdown and its prefetcher read it (their
``time`` module is replaced for the test). So each measured part equals the latency injected into
it (real compute and Python cost nothing on this clock), the parts add up to the step period, and
the period matches the test's own clock between calls of ``step`` -- on any machine, at any load.
A loader thread's reads advance its own clock, not the training thread's: with prefetching the
training thread waits for nothing it did not read itself.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime import breakdown, engine as engine_module, prefetch, probe
from virtualflow.runtime.step import compute
from virtualflow.runtime.engine import BatchLoader, VNEngine

INPUT_S = 0.002  # per sample
FORWARD_S = 0.004  # per VN
BACKWARD_S = 0.006  # per VN
COMM_S = 0.015  # per step (the statistics' all-reduce)


class FakeClock:
    """Per-thread virtual time: ``sleep`` advances the calling thread's clock at once, and
    ``perf_counter``/``monotonic``/``time`` read it; every other ``time`` attribute is the real one."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _now(self) -> float:
        return getattr(self._local, "t", 1000.0)

    def sleep(self, seconds: float) -> None:
        self._local.t = self._now() + seconds

    def module(self) -> types.SimpleNamespace:
        ns = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
        ns.perf_counter = ns.monotonic = ns.time = self._now
        ns.sleep = self.sleep
        return ns


CLOCK = FakeClock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    fake = CLOCK.module()
    for mod in (engine_module, compute, probe, breakdown, prefetch):
        monkeypatch.setattr(mod, "time", fake)
    return CLOCK


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
        CLOCK.sleep(self.latency_s)
        return self.x[i], self.y[i]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        CLOCK.sleep(FORWARD_S)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        CLOCK.sleep(BACKWARD_S)
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
        CLOCK.sleep(COMM_S)
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
    t = CLOCK._now()
    for s in range(steps):
        out = eng.step(s)
        now = CLOCK._now()
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


def near(x: float) -> object:
    """Equal on the fake clock, up to float rounding (a report is float32)."""
    return pytest.approx(x, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("deterministic", [False, True])
def test_each_part_is_recognised_and_they_add_up(deterministic):
    V, B = 2, 8
    eng = engine(deterministic=deterministic, group=SlowGroup(0, 0, 1, None), V=V, B=B)
    parts, walls = run_steps(eng, 5)
    comm = COMM_S if deterministic else 0.0  # default mode: one member, no reduction at all
    assert len(parts) == 4
    for p, wall in zip(parts, walls):
        assert_adds_up(p)
        assert p["input_s"] == near(B * INPUT_S)
        assert p["forward_s"] == near(V * FORWARD_S)
        assert p["backward_s"] == near(V * BACKWARD_S)
        assert p["reduction_s"] == near(comm)
        assert p["straggler_s"] == 0.0  # alone: nobody to wait for
        assert p["optimizer_s"] == near(0.0) and p["control_s"] == near(0.0) and p["overhead_s"] == near(0.0)
        assert p["step_s"] == near(wall) == near(B * INPUT_S + V * (FORWARD_S + BACKWARD_S) + comm)
        assert p["read_calls"] == 0  # sleeping reads nothing
        assert p["loaded_s"] == near(p["input_s"])


def test_step_period_matches_the_callers_clock():
    eng = engine(deterministic=True, group=SlowGroup(0, 0, 1, None))
    steps = 6
    t0 = CLOCK._now()
    parts = []
    for s in range(steps):
        out = eng.step(s)
        if out.breakdown is not None:
            parts.append(out.breakdown[0])
        CLOCK.sleep(0.001 * s)  # the caller's loop, a different length each time
    wall = CLOCK._now() - t0
    # Steps 0..steps-2 are broken down; their periods cover the wall time up to the last step's start.
    last_step_s = eng.clock.now() - eng.clock._start  # noqa: SLF001 - the running step's own time
    assert len(parts) == steps - 1
    assert sum(p["step_s"] for p in parts) == pytest.approx(wall - last_step_s, rel=1e-5)


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
        CLOCK.sleep(LOOP_S)  # the caller's loop
    assert len(parts) == 4
    for p in parts:
        assert_adds_up(p)
        assert p["control_s"] == near(LOOP_S)
        assert p["overhead_s"] == near(0.0)
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
    assert len(parts) == 4
    for p in parts[1:]:  # step 0's batches were not prefetched
        assert_adds_up(p)
        assert p["loaded_s"] == near(B * INPUT_S)  # the loaders still read every sample (on their clocks) ...
        assert p["input_s"] == near(0.0)  # ... and the training thread read none of them
    # without loader threads the training thread reads them itself
    parts, _ = run_steps(engine(deterministic=False, loader_workers=0, V=V, B=B), 3)
    assert [p["input_s"] for p in parts] == [near(B * INPUT_S)] * 2


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


def test_rank_0_hands_the_raw_rows_on_and_the_coordinator_derives_what_rank_0_did():
    """The report carries the raw rows (rank 0 derives nothing in its step); the coordinator's
    derivation equals the one rank 0 made before, record for record, through JSON."""
    import json

    fast = raw(input_s=0.01, forward_s=0.02, backward_s=0.03, blocked_s=0.035, optimizer_s=0.002,
               period_s=0.1, arrive_s=0.062, read_calls=3.0, read_bytes=4096.0)
    slow = raw(input_s=0.01, forward_s=0.035, backward_s=0.045, blocked_s=0.005, optimizer_s=0.002,
               period_s=0.1, arrive_s=0.092)
    members = [7, 3]
    before = [{"worker": w, **parts} for w, parts in zip(members, breakdown.derive([fast, slow]))]
    wire = json.loads(json.dumps(breakdown.Raw([fast, slow]).to_report()))
    assert breakdown.from_report(wire, members) == breakdown.clean(before)
    assert breakdown.Raw([fast, slow]).derive() == breakdown.derive([fast, slow])


def test_tensor_planes_report_their_first_plane_and_stages_wait_for_their_own_group():
    """A tensor-parallel grid reports plane 0's rows (ranks 0, T, 2T, ...): the others are None
    and absent from the report; each stage's straggler wait is against its own group."""
    a = raw(forward_s=0.01, blocked_s=0.02, period_s=0.05, arrive_s=0.02)
    b = raw(forward_s=0.01, blocked_s=0.01, period_s=0.05, arrive_s=0.03)
    spread = breakdown.Raw([a, b], groups=[1, 2]).spread(2)
    assert spread.rows == [a, None, b, None] and spread.groups == [1, 0, 2, 0]
    derived = spread.derive()
    assert derived[1] is None and derived[3] is None
    assert derived[0] == breakdown.derive([a, b], groups=[1, 2])[0]
    assert derived[0]["straggler_s"] == 0.0  # alone in its stage: no one to wait for
    assert breakdown.derive([a, b])[0]["straggler_s"] == pytest.approx(0.01)  # one group: waits for b
    got = breakdown.from_report(spread.to_report(), [10, 11, 12, 13])
    assert [r["worker"] for r in got] == [10, 12]


@pytest.mark.parametrize("bad", [
    None, "x", {"rows": "x"}, {"rows": []},
    {"rows": [raw(period_s=0.1)[:-1]]}, {"rows": [[True] * len(breakdown.RAW)]},
    {"rows": [raw(period_s=0.1)], "groups": [1, 2]}, {"rows": [raw(period_s=0.1)], "groups": [True]},
    {"rows": [raw(period_s=0.1), raw(period_s=0.1)]},  # more rows than members
    {"rows": [raw()]},  # no finished step
])
def test_malformed_raw_reports_are_dropped(bad):
    assert breakdown.from_report(bad, [0]) is None


def test_the_coordinator_derives_a_step_reports_raw_rows_into_its_record(tmp_path):
    """End to end through the signed report channel: rank 0's raw rows become the step record's
    ``breakdown`` on the coordinator (metrics.jsonl), keyed by worker id."""
    import json

    from virtualflow.comm import protocol
    from virtualflow.control.coordinator import Coordinator

    rows = [raw(forward_s=0.01, blocked_s=0.02, period_s=0.05, arrive_s=0.02),
            raw(forward_s=0.02, blocked_s=0.01, period_s=0.05, arrive_s=0.03)]
    report = {"type": "step", "step": 1, "loss": 0.5, "samples": 32, "step_time_s": 0.05, "workers": 2,
              "generation": 0, "vns": [[0, 1], [2, 3]], "members": [4, 9], "compute_s": None, "vn_sizes": None,
              "time": 1.0, "worker": 4, "pid": 1, "seq": 1, "breakdown_raw": breakdown.Raw(rows).to_report(),
              "breakdown_step": 0}
    coord = Coordinator(total_steps=10, run_dir=str(tmp_path))
    try:
        protocol.push_report(coord.store, coord.run, report)
        coord.poll()
    finally:
        coord.close()
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    want = [{"worker": w, **parts} for w, parts in zip([4, 9], breakdown.derive(rows))]
    assert record["breakdown_step"] == 0 and record["breakdown"] == want  # JSON keeps floats exactly
    assert "breakdown_raw" not in record


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
