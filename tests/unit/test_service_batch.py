"""The cluster service runs the ``elastic_batch`` policy on real jobs: what a submission may
carry, which running jobs' batches a decision changes, and how the service changes them in place
(through :meth:`virtualflow.JobHandle.change_batch`, in order with the job's resize) and relaunches
a job with the changes its run recorded.

What the job does with the change (in place at a step boundary, bit for bit the plain loop that
changes V there, recorded in events.jsonl and replayed from it) is
tests/unit/test_batch_change_requests.py."""

from __future__ import annotations

import json
import os

import pytest

from test_service_runner import FakeHandle, add
from virtualflow.cluster.policies import get_policy
from virtualflow.service.batch import batch_cell, parse_range, parse_rule
from virtualflow.service.core import Action, JobView, RoundDecision, Scheduler, batch_changes
from virtualflow.service.launcher import job_with_batch
from virtualflow.service.runner import Service, init_cluster

CELL = {"base": 16, "vn_size": 4, "range": [8, 64], "lr_rule": "sqrt", "now": 16, "fewest": 4}
"""A job of 4 virtual nodes of 4 samples that lets the scheduler run any multiple of 4 in 8..64."""


def _views(estimates: dict[str, float], *, now: int = 16) -> list[JobView]:
    """Job 1 opted in, job 2 did not; both elastic 1..4 workers, each running on 2 v100 slots and
    measured at 2 workers with the same sublinear scaling (communication that a larger batch hides)."""
    def view(jid: int, batch: dict | None, slots: tuple[str, ...]) -> JobView:
        return JobView(job_id=jid, steps=1000, elastic=True, min_workers=1, max_workers=4, slowdowns={"v100": 1.0},
                       estimates=dict(estimates), running=("v100", 2), slots=slots, batch=batch)

    return [view(1, {**CELL, "now": now}, ("v100-0", "v100-1")), view(2, None, ("v100-2", "v100-3"))]


@pytest.mark.parametrize("estimates", [{"v100/1": 10.0, "v100/2": 12.0}, {"v100/1": 10.0, "v100/2": 19.0}])
def test_a_decision_that_changes_the_batch_changes_only_an_opted_in_running_jobs(estimates):
    sched = Scheduler({"v100": 4}, get_policy("elastic_batch"), round_s=30.0)
    views = _views(estimates)
    decision = sched.plan(views, 0.0)
    decided = sched._batches
    # the policy's batch for the opted-in job (its own, 16, is not what a sublinear job runs best at) ...
    assert set(decided) == {1} and decided[1] != 16  # (job 2's batch is not the scheduler's to know)
    b = decided[1]
    assert 8 <= b <= 64 and b % 4 == 0 and b // 4 >= len(decision.slots[1])
    # ... is the change this round
    assert decision.batches == {1: b}
    # once it runs that batch there is nothing to change
    assert sched.plan(_views(estimates, now=b), 1.0).batches == {}
    # a job that did not opt in never gets one, whatever a decision says; nor one moved this round,
    # nor a batch with fewer virtual nodes than the workers it runs on after the round
    slots = {1: ("v100-0", "v100-1"), 2: ("v100-2", "v100-3")}
    assert batch_changes(views, [], slots, {1: 32, 2: 32}) == {1: 32}
    assert batch_changes(views, [Action("restart", 1, "v100", 2, slots[1])], slots, {1: 32}) == {}
    assert batch_changes(views, [], {1: ("v100-0", "v100-1", "v100-2")}, {1: 8}) == {}


class BatchHandle(FakeHandle):
    def change_batch(self, virtual_nodes, lr_rule):
        self.calls.append(("batch", virtual_nodes, lr_rule))


@pytest.fixture
def service(tmp_path):
    d = str(tmp_path / "c")
    init_cluster(d, slots={"v100": 4}, policy="elastic_batch", round_s=5.0).close()
    launched: list = []

    def launch(target, **kw):
        launched.append((target, kw))
        return BatchHandle(kw)

    s = Service(d, launch=launch)
    s.epoch_s, s.launched = 0.0, launched
    return s


def _decide(s: Service, actions: list[Action], batches: dict[int, int]) -> None:
    rows = {r.id: r for r in s.db.jobs()}
    s.enact(RoundDecision(plan=None, actions=actions, slots={}, solved=False, decision_s=0.0, batches=batches), rows)


def test_the_service_changes_a_running_jobs_batch_in_place_in_order_with_its_resize(service):
    s = service
    a = add(s, elastic=True, max_workers=4, batch=CELL)
    _decide(s, [Action("start", a, "v100", 2, ("v100-0", "v100-1"))], {})
    h = s.running[a].handle
    # a larger batch first, then the grow its new workers need it for
    _decide(s, [Action("resize", a, "v100", 4, ("v100-0", "v100-1", "v100-2", "v100-3"))], {a: 64})
    assert h.calls == [("batch", 16, "sqrt"), ("resize", 4)]
    assert s.db.job(a).batch["now"] == 64
    # a smaller batch after the shrink it waits for (2 virtual nodes: 2 workers at most)
    _decide(s, [Action("resize", a, "v100", 2, ("v100-0", "v100-1"))], {a: 8})
    assert h.calls[2:] == [("resize", 2), ("batch", 2, "sqrt")]
    row = s.db.job(a)
    assert (row.batch["now"], row.batch["fewest"]) == (8, 2)
    assert [(e["data"]["batch"], e["data"]["virtual_nodes"]) for e in s.db.events(a) if e["kind"] == "batch"] == [
        (64, 16), (8, 2)]


def test_a_relaunch_carries_the_changes_its_run_recorded(service):
    s = service
    a = add(s, elastic=True, max_workers=4, batch={**CELL, "now": 8})  # 8 was asked, never run
    _decide(s, [Action("start", a, "v100", 2, ("v100-0", "v100-1"))], {})
    assert "batch" not in s.launched[-1][1]  # a first start runs the job's own batch
    s.running[a].handle.step = 5
    _decide(s, [Action("preempt", a)], {})
    row = s.db.job(a)
    os.makedirs(row.run_dir, exist_ok=True)
    open(os.path.join(row.run_dir, "final.pt"), "wb").close()
    with open(os.path.join(row.run_dir, "events.jsonl"), "w") as f:
        for e in [{"event": "start"}, {"event": "batch", "step": 3, "virtual_nodes": 16, "global_batch_size": 64,
                                       "lr_multiplier": 2.0, "lr_rule": "sqrt"}]:
            f.write(json.dumps(e) + "\n")
    _decide(s, [Action("start", a, "v100", 2, ("v100-0", "v100-1"))], {})
    assert s.launched[-1][1]["batch"] == {"batch_schedule": [[3, 16]], "lr_rule": "sqrt"}
    assert s.db.job(a).batch["now"] == 64  # the batch the run recorded
    job = job_with_batch("jobs:make_job", [[3, 16]], "sqrt")
    assert job.batch_schedule == [(3, 16)] and job.lr_rule == "sqrt"


@pytest.mark.parametrize("knobs, message", [
    (dict(batch_range=(64, 8)), r"^--batch-size-range/--lr-rule: batch_size_range=\(64, 8\) is empty"),
    (dict(batch_range=(6, 64)), r"^--batch-size-range/--lr-rule: batch_size_range=\(6, 64\) does not divide into "
                                r"virtual nodes of vn_size=4"),
    (dict(lr_rule=None), r"^--batch-size-range/--lr-rule: batch_size_range=\(8, 64\) has no lr_rule"),
    (dict(lr_rule={8: 0.5, 16: 1.0}), r"^--batch-size-range/--lr-rule: lr_rule has no multiplier for batch sizes "
                                      r"\[12, 20"),
    (dict(batch_range=(32, 64)), r"^--batch-size-range/--lr-rule: the job's global_batch_size=16 must lie in "
                                 r"batch_size_range=\(32, 64\)"),
    (dict(vn_size=8), r"^--vn-size 8 is not the job's samples per virtual node \(global_batch_size=16 / "
                      r"virtual_nodes=4 = 4\)"),
    (dict(min_workers=3), r"^--batch-size-range 8:64: B_MIN=8 is 2 virtual nodes of 4 samples, fewer than the 3 "
                          r"workers"),
    (dict(batch_range=None), r"^--lr-rule is set but --batch-size-range is not"),
])
def test_a_bad_elastic_batch_submission_is_refused_in_one_line(knobs, message):
    args = dict(batch_range=(8, 64), lr_rule="sqrt", vn_size=None, min_workers=1)
    args.update(knobs)
    with pytest.raises(ValueError, match=message) as err:
        batch_cell(args["batch_range"], args["lr_rule"], args["vn_size"], global_batch_size=16, virtual_nodes=4,
                   min_workers=args["min_workers"], max_workers=4, elastic=True)
    assert "\n" not in str(err.value)


def test_the_submit_options_parse_or_are_refused_in_one_line():
    assert parse_range("8:64") == (8, 64) and parse_rule("sqrt") == "sqrt"
    assert parse_rule('{"8": 0.5, "16": 1}') == {8: 0.5, 16: 1}
    with pytest.raises(ValueError, match=r"^--batch-size-range '8-64' must be B_MIN:B_MAX"):
        parse_range("8-64")
    with pytest.raises(ValueError, match=r"^--lr-rule 'cubic' must be linear, sqrt or a JSON object"):
        parse_rule("cubic")
    cell = batch_cell((8, 64), "sqrt", 4, global_batch_size=16, virtual_nodes=4, min_workers=1, max_workers=4,
                      elastic=True)
    assert cell == CELL


def test_submit_refuses_bad_elastic_batch_options_before_building_the_job(service):
    from virtualflow.cli.cluster import check_submission

    common = dict(steps=10, workers=None, elastic=True, min_workers=1, max_workers=2, priority=1.0, job_type=None,
                  checkpoint_every=None)
    with pytest.raises(ValueError, match=r"^--lr-rule is set but --batch-size-range is not"):
        check_submission(service.dir, "jobs:make_job", lr_rule="sqrt", **common)
    with pytest.raises(ValueError, match=r"^--batch-size-range '8' must be B_MIN:B_MAX"):
        check_submission(service.dir, "jobs:make_job", batch_size_range="8", lr_rule="sqrt", **common)
    with pytest.raises(ValueError, match=r"^--lr-rule '\{8: 1\}' must be linear, sqrt or a JSON object"):
        check_submission(service.dir, "jobs:make_job", batch_size_range="8:64", lr_rule="{8: 1}", **common)


def test_a_round_measures_a_job_only_at_its_own_batch(service):
    """The service's estimates are of the job's own batch (the policy fits the others from them):
    the steps a job made at another batch are not folded in."""
    s = service
    a = add(s, elastic=True, max_workers=4, batch=CELL)
    _decide(s, [Action("start", a, "v100", 2, ("v100-0", "v100-1"))], {})
    s.running[a].samples = [(0.0, 0), (1.0, 10), (2.0, 20)]
    s._end_round(2.0)
    assert s.db.job(a).estimates == {"v100/2": 10.0}
    s.db.update_job(a, batch={**CELL, "now": 64})
    s.running[a].samples = [(2.0, 20), (3.0, 22), (4.0, 24)]
    s._end_round(2.0)
    assert s.db.job(a).estimates == {"v100/2": 10.0}
