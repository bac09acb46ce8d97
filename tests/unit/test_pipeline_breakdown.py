"""The step breakdown of a pipelined job, per stage (``virtualflow.runtime.pipeline.timing``).

- Each request a stage's step yields is timed into its part: sends and posted receives
  ``p2p_s``, receives and the statistics all-reduce ``bubble_s``, the stage's reduction over its
  replicas ``blocked_s`` (the first one arrives), the sharded all-gather ``optimizer_s``: checked
  with a clock the test drives, so exact and free of timing thresholds.
- Rank 0 splits waiting for a straggler from communication within each stage group.
- ``train_local``: every step after a generation's first reports every worker's parts on rank 0
  (only there), the parts add up to the step, and compute lands on the compute parts.
- Records and tables: older records without the pipeline parts still read; a VN run's table
  has no pipeline columns, a pipelined run's has them.
"""

from __future__ import annotations

import pytest
import torch

import pipeline_models as pm
from virtualflow.backends.inprocess import train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.runtime import breakdown
from virtualflow.runtime.pipeline.local import LocalDriver
from virtualflow.runtime.pipeline.requests import (AllSum, Expect, Recv, Send, StageGather, StageScatter, StageSum,
                                                   StepResult)
from virtualflow.runtime.pipeline.timing import StageTiming


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_request_is_timed_into_its_part():
    clock = FakeTime()
    timing = StageTiming()
    timing.clock.now = clock
    timing.new_generation((0, 1), stage_rank=0)
    # (request, seconds the driver keeps the stage waiting for it, compute after it)
    script = [(Expect(1, ("B", 1, 0)), 0.001, 0.010), (Send(1, ("F", 0, 0), []), 0.002, 0.0),
              (Recv(1, ("B", 1, 0)), 0.030, 0.020), (StageScatter(torch.zeros(4), [(0, 4)]), 0.004, 0.0),
              (StageSum(torch.zeros(1)), 0.003, 0.0), (AllSum(torch.zeros(1)), 0.050, 0.001),
              (StageGather(torch.zeros(4), [(0, 4)]), 0.006, 0.0)]

    def step():
        for req, _, compute in script:
            yield req
            clock.t += compute
        return StepResult(0, 0.0, [], 0, 0.0)

    def drive(gen):
        req = next(gen)
        i = 0
        try:
            while True:
                assert req is script[i][0]  # passed on unchanged
                clock.t += script[i][1]
                i += 1
                req = gen.send(None)
        except StopIteration as stop:
            return stop.value

    timing.begin()
    assert isinstance(drive(timing.timed(step())), StepResult)
    timing.compute("F", 0.008, input_s=0.002)
    timing.compute("B", 0.005, emulated_s=0.001)
    clock.t += 0.002
    timing.begin()
    got = dict(zip(breakdown.RAW, timing.clock.previous()))
    assert got["p2p_s"] == pytest.approx(0.003)
    assert got["bubble_s"] == pytest.approx(0.080)
    assert got["blocked_s"] == pytest.approx(0.007)  # the scatter (entered there) and the tail's sum
    assert got["optimizer_s"] == pytest.approx(0.006)  # the sharded parameters' all-gather
    assert (got["input_s"], got["forward_s"], got["backward_s"], got["emulated_s"]) == pytest.approx(
        (0.002, 0.006, 0.005, 0.001))
    assert got["period_s"] == pytest.approx(sum(s for _, s, _ in script) + sum(c for _, _, c in script) + 0.002)


def test_stragglers_are_found_within_each_stage_group():
    def raw(arrive, blocked):
        v = dict.fromkeys(breakdown.RAW, 0.0)
        v.update(period_s=0.1, arrive_s=arrive, blocked_s=blocked, forward_s=0.01)
        return [v[k] for k in breakdown.RAW]

    # stage 0's replicas arrive at 10 and 30 ms, stage 1's at 50 and 52 ms
    rows = [raw(0.010, 0.025), raw(0.050, 0.004), raw(0.030, 0.005), raw(0.052, 0.002)]
    parts = breakdown.derive(rows, groups=[1, 2, 1, 2])
    assert [p["straggler_s"] for p in parts] == pytest.approx([0.020, 0.002, 0.0, 0.0])
    assert [p["reduction_s"] for p in parts] == pytest.approx([0.005, 0.002, 0.005, 0.002])
    one_group = breakdown.derive(rows)  # as if one reduction: everyone waits for the last (52 ms)
    assert one_group[0]["straggler_s"] == pytest.approx(0.025)


@pytest.mark.parametrize("schedule,reduction", [("1f1b", "allreduce"), ("zb_h1", "sharded")])
def test_train_local_reports_every_stage_on_rank_0(schedule, reduction):
    p, d = 2, 2
    job = pm.mlp_job(Pipeline(stages=p, schedule=schedule), virtual_nodes=4, bn=True)
    _, history = train_local(job, 4, replicas=d, deterministic=False, reduction=reduction)
    assert history[0].breakdown is None  # a generation's first step has no previous one
    for h in history[1:]:
        assert h.breakdown is not None and len(h.breakdown) == p * d
        for row in h.breakdown:
            assert all(row[k] >= 0 for k in breakdown.PARTS)
            assert sum(row[k] for k in breakdown.PARTS) == pytest.approx(row["step_s"], rel=1e-6, abs=1e-9)
            assert row["forward_s"] > 0 and row["backward_s"] > 0 and row["p2p_s"] > 0
            assert row["input_s"] > 0  # each replica's first and last stage load their micro-batches


def test_engines_other_than_rank_0_report_nothing():
    engines: list = []
    job = pm.mlp_job(Pipeline(stages=2, schedule="1f1b"), virtual_nodes=4)
    train_local(job, 2, replicas=1, engines_out=engines)
    driver = LocalDriver(engines)
    driver.set_layout([[0, 1, 2, 3]])
    assert [e.timing.slot for e in engines] == [(0, 2), (1, 2)]
    block = torch.zeros(engines[1].timing.block_numel, dtype=torch.float64)
    assert engines[1].timing.raw(block) is None


def test_old_records_read_and_tables_show_pipeline_parts_only_for_pipelines():
    row = {"worker": 0, **{k: 0.001 for k in breakdown.PARTS if k not in breakdown.PIPELINE_PARTS},
           "step_s": 0.008, "read_calls": 0, "read_bytes": 0, "loaded_s": 0.0}
    assert breakdown.clean([row])[0]["bubble_s"] == 0.0  # a record from before pipelines reported
    vn = breakdown.summarize([{"breakdown": [row], "breakdown_step": 0}])
    assert "bubble" not in "\n".join(breakdown.format_table(vn))
    piped = breakdown.summarize([{"breakdown": [{**row, "p2p_s": 0.001, "bubble_s": 0.002, "step_s": 0.011}],
                                  "breakdown_step": 0}])
    table = "\n".join(breakdown.format_table(piped))
    assert "bubble" in table and "p2p" in table
