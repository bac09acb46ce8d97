"""A run whose batch size changes at recorded steps (``Job.batch_schedule``) is a plain PyTorch
loop that changes V at the same steps, bit for bit, on one worker or several.

The reference below is written from the documented rules only (docs/training.md, "Changing the
batch size during a run"): steps read consecutive positions of their epoch's order, a step the
rest of the epoch cannot hold starts the next epoch; each step's batch is V x the fixed per-VN
size; deterministic mode sums the per-VN gradients along the fixed VN-id tree; the optimizer's
step at batch B runs with the rate times the job's rule, the scheduler stepping the unscaled rate.
"""

from __future__ import annotations

import math

import pytest
import torch

import virtualflow as vf
from jobs import bn_job, regression_job
from pipeline_models import tree_sum
from reference import order_index
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.control.coordinator import JsonlWriter
from virtualflow.launching.composition import check_batch_schedule
from virtualflow.launching.requests import ResizeRequests
from virtualflow.launching.resume import find_resume_state
from virtualflow.plan.batch_schedule import (BatchSchedule, FixedPositions, SchedulePositions, batch_events,
                                             schedule_from_events)
from virtualflow.plan.data import DataPlan
from virtualflow.records.rundir import read_jsonl
from virtualflow.runtime.batch_change import OneBatch, ScheduledBatch
from virtualflow.runtime.checkpoint import save_state
from virtualflow.runtime.grid_threads import Generation, train_threads
from virtualflow.runtime.step_boundary import job_identity

SCHEDULE = [(3, 16), (7, 3)]
"""V=4 for steps 0-2 (B=16), V=16 for steps 3-6 (B=64: the first epoch of 256 samples ends after
step 5, step 6 starts the next), V=3 from step 7 (B=12)."""
STEPS = 10


def scheduled_job(**kw) -> vf.Job:
    return regression_job("sgd", virtual_nodes=4, global_batch_size=16, batch_schedule=SCHEDULE, lr_rule="sqrt", **kw)


def reference(job: vf.Job, steps: int, *, tree: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Plain PyTorch: the final weights and each step's dataset indices' count."""
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    sched = job.lr_scheduler(opt)
    x_all, y_all = job.build_dataset().tensors
    n_data, n = len(x_all), job.global_batch_size // job.virtual_nodes
    changes = dict(job.batch_schedule)
    params = list(model.parameters())
    v_now, epoch, pos, sizes = job.virtual_nodes, 0, 0, []
    for s in range(steps):
        v_now = changes.get(s, v_now)
        b = v_now * n
        if pos + b > n_data:  # the rest of the epoch cannot hold the step: the next epoch
            epoch, pos = epoch + 1, 0
        idx = torch.tensor([order_index(p, n_data, job.seed, epoch) for p in range(pos, pos + b)])
        pos += b
        sizes.append(b)
        leaves = {}
        opt.zero_grad(set_to_none=True)
        for v in range(v_now):
            sl = idx[v * n:(v + 1) * n]
            torch.manual_seed(vf.vn_seed(job.seed, s, v))
            loss = job.compute_loss(model, (x_all[sl], y_all[sl])) * (n / b)
            if tree:
                grads = torch.autograd.grad(loss, params)
                leaves[v] = torch.cat([g.reshape(-1) for g in grads])
            else:
                loss.backward()
        if tree:
            flat, at = tree_sum(leaves, 0, v_now), 0
            for p in params:
                p.grad = flat[at:at + p.numel()].view_as(p).clone()
                at += p.numel()
        base = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * math.sqrt(b / job.global_batch_size)
        opt.step()
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sizes


def _assert_same(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for k, v in ref.items():
        assert torch.equal(state["model"][k], v), k


@pytest.mark.parametrize("generations", [
    [Generation(members=(0,), steps=STEPS)],
    [Generation(members=(0, 1), steps=STEPS)],
    # a third worker joins at step 5, after the change to V=16: it runs V=16, then V=3
    [Generation(members=(0, 1), steps=5), Generation(members=(0, 1, 2), steps=STEPS - 5)],
], ids=["1 worker", "2 workers", "2 then 3 workers"])
def test_deterministic_changes_of_v_are_the_plain_loop_bit_for_bit(generations):
    job = scheduled_job()
    ref, sizes = reference(job, STEPS, tree=True)
    assert sizes == [16] * 3 + [64] * 4 + [12] * 3
    run = train_threads(job, generations, options=WorkerOptions(deterministic=True))
    _assert_same(run.state, ref)


def test_default_mode_on_one_worker_is_the_plain_accumulating_loop_bit_for_bit():
    job = scheduled_job()
    ref, _ = reference(job, STEPS, tree=False)
    run = train_threads(job, [Generation(members=(0,), steps=STEPS)])
    _assert_same(run.state, ref)


def test_a_schedule_without_a_change_reads_the_fixed_batch_order():
    """The data rule reduces to the fixed-batch one: same epoch, position and contiguous run for
    every step, across epoch boundaries (256 samples, B=24: 10 steps an epoch, 16 dropped)."""
    fixed = FixedPositions(256, 24)
    none = SchedulePositions(256, BatchSchedule(24, 4, (), "linear"))
    assert [none.locate(s) for s in range(35)] == [fixed.locate(s) for s in range(35)]
    # with changes: a step the epoch's rest cannot hold starts the next epoch
    sched = SchedulePositions(256, BatchSchedule(16, 4, tuple(SCHEDULE), "sqrt"))
    assert [sched.locate(s)[:3] for s in (2, 3, 5, 6, 7)] == [
        (0, 32, 16), (0, 48, 64), (0, 176, 64), (1, 0, 64), (1, 64, 12)]


def test_the_checkpoint_records_the_changes_run_and_a_resume_must_repeat_them(tmp_path):
    job = scheduled_job()
    run = train_threads(job, [Generation(members=(0,), steps=5)])
    assert run.state["batch_schedule"] == [[3, 16]]  # steps 0-4 ran the first change only
    assert run.engines[0].learning_rate() == 0.05 * 0.7 * 2.0  # step 5: StepLR's rate x sqrt(64 / 16)
    state = {**run.state, "step": 5, "job": job_identity(job)}
    path = str(tmp_path / "step-5.pt")
    save_state(path, state)
    # a later change (a new decision from step 5 on) resumes; another past resumes nowhere
    assert find_resume_state(path, job.replace(batch_schedule=[(3, 16), (5, 2)])) == (path, 5)
    run.engines[0].batch.check_resume(state)
    with pytest.raises(ValueError, match=r"^the checkpoint \(step 5\) ran batch_schedule=\[\(3, 16\)\], the job's "
                                         r"schedule up to that step is \[\(3, 8\)\]; resume with Job.batch_schedule"):
        find_resume_state(path, job.replace(batch_schedule=[(3, 8)]))
    with pytest.raises(ValueError, match=r"^the checkpoint \(step 5\) ran batch_schedule=\[\(3, 16\)\], the job's "
                                         r"schedule up to that step is \[\(3, 8\)\]"):
        ScheduledBatch(BatchSchedule(16, 4, ((3, 8),), "sqrt"), torch.optim.SGD([torch.zeros(1)], lr=1.0)
                       ).check_resume(state)
    with pytest.raises(ValueError, match=r"ran batch_schedule=\[\(3, 16\)\], the job's schedule up to that step is \[\]"):
        OneBatch().check_resume(state)


def test_the_batch_events_replay_the_run_bit_for_bit(tmp_path):
    """The launch writes one ``batch`` record per change to events.jsonl (as the supervisor does);
    a job rebuilt from them trains to the same bits."""
    job = scheduled_job()
    events = JsonlWriter(str(tmp_path / "events.jsonl"))
    for fields in batch_events(job):
        events.write({"event": "batch", **fields})
    events.close()
    records = read_jsonl(str(tmp_path / "events.jsonl"))
    assert [(r["step"], r["virtual_nodes"], r["global_batch_size"]) for r in records] == [(3, 16, 64), (7, 3, 12)]
    assert records[0]["lr_multiplier"] == 2.0
    schedule, rule = schedule_from_events(records)
    replay = regression_job("sgd", virtual_nodes=4, global_batch_size=16, batch_schedule=schedule, lr_rule=rule)
    gens = [Generation(members=(0, 1), steps=STEPS)]
    opts = WorkerOptions(deterministic=True)
    _assert_same(train_threads(replay, gens, options=opts).state, train_threads(job, gens, options=opts).state["model"])
    assert batch_events(regression_job()) == [] and schedule_from_events([{"event": "step"}]) == ([], None)
    # a resumed launch writes its whole schedule again (new decisions after its resume step): it is the run's
    relaunch = batch_events(job.replace(batch_schedule=[(3, 16), (5, 2)]))
    log = [{"event": "start"}, *records, {"event": "start"}, *({"event": "batch", **f} for f in relaunch)]
    assert schedule_from_events(log) == ([(3, 16), (5, 2)], "sqrt")


@pytest.mark.parametrize("knobs, message", [
    (dict(batch_schedule=[(3, 8)]), r"^Job.batch_schedule=\[\(3, 8\)\] has no Job.lr_rule; give 'linear', 'sqrt'"),
    (dict(lr_rule="linear"), r"^Job.lr_rule='linear' is set but Job.batch_schedule is empty"),
    (dict(batch_schedule=[(3, 8), (3, 2)], lr_rule="linear"),
     r"^Job.batch_schedule change \(3, 2\) starts at step 3, not after step 3; first steps must be >= 1 and strictly"),
    (dict(batch_schedule=[(0, 8)], lr_rule="linear"), r"^Job.batch_schedule change \(0, 8\) starts at step 0"),
    (dict(batch_schedule=[(2, 0)], lr_rule="linear"),
     r"^Job.batch_schedule change \(2, 0\) has virtual_nodes=0; a step needs at least one virtual node$"),
    (dict(batch_schedule=[(2, 1.5)], lr_rule="linear"), r"^Job.batch_schedule holds \(2, 1.5\); each change is a pair"),
    (dict(batch_schedule=5, lr_rule="linear"), r"^Job.batch_schedule=5 must be a list of \(first_step, virtual_nodes\)"),
    (dict(batch_schedule=[(2, 8)], lr_rule="cubic"), r"^Job.lr_rule='cubic' must be 'linear', 'sqrt' or \{batch: "),
    (dict(batch_schedule=[(2, 8)], lr_rule={64: 1.0}),
     r"^Job.lr_rule has no multiplier for batch sizes \[16, 32\] that Job.batch_schedule runs"),
    (dict(batch_schedule=[(2, 8)], lr_rule={16: 1.0, 32: 0.0}), r"^Job.lr_rule multipliers \{32: 0.0\} must be positive"),
])
def test_bad_schedules_are_refused_when_the_job_is_built_in_one_line(knobs, message):
    with pytest.raises(ValueError, match=message) as info:
        regression_job("sgd", virtual_nodes=4, global_batch_size=16, **knobs)
    assert "\n" not in str(info.value)


def test_a_dataset_smaller_than_a_scheduled_batch_is_refused():
    job = regression_job("sgd", virtual_nodes=4, global_batch_size=16, batch_schedule=[(2, 80)], lr_rule="linear")
    with pytest.raises(ValueError, match=r"^the dataset has 256 samples, fewer than global_batch_size=320"):
        DataPlan.of_job(job, 256)


@pytest.mark.parametrize("changes, facts, message", [
    (dict(pipeline=vf.Pipeline(stages=2)), {}, r"^Job.batch_schedule with Job.pipeline"),
    ({}, dict(reduction="fsdp"), r"^Job.batch_schedule with reduction='fsdp'"),
    ({}, dict(balance=True), r"^Job.batch_schedule with balance"),
    ({}, dict(workers=4), r"^Job.batch_schedule runs virtual_nodes=3 from step 7, fewer than the 4 workers"),
])
def test_what_a_batch_schedule_does_not_combine_with_is_refused_at_launch(changes, facts, message):
    job = scheduled_job(output_loss=lambda out, batch: out.sum()).replace(**changes)
    opts = vf.LaunchOptions(**{"workers": 2, "steps": 1, **facts})
    with pytest.raises(ValueError, match=message):
        check_batch_schedule(job, False, opts, opts.start_workers)
    with pytest.raises(ValueError, match=r"^Job.batch_schedule with a streaming dataset"):
        check_batch_schedule(scheduled_job(), True, vf.LaunchOptions(workers=2, steps=1), 2)
    check_batch_schedule(scheduled_job(), False, vf.LaunchOptions(workers=3, steps=1), 3)  # nothing refused


def test_batchnorm_running_statistics_are_the_mean_over_the_steps_new_v_in_both_modes():
    """BatchNorm's ``mean`` rule divides by the step's V: deterministic mode (the tree's tail) and
    default mode (the statistics vector) keep the same running statistics across the changes."""
    job = bn_job(batch_schedule=[(2, 16), (4, 4)], lr_rule="linear")
    gens = [Generation(members=(0,), steps=6)]
    det = train_threads(job, gens, options=WorkerOptions(deterministic=True)).state["model"]
    default = train_threads(job, gens).state["model"]
    for k, v in default.items():
        torch.testing.assert_close(det[k], v, rtol=1e-5, atol=1e-6)


def test_a_resize_or_a_join_beyond_the_smallest_scheduled_v_is_refused():
    """The run's workers are bounded by the smallest V it runs (3, from step 7), not its first V."""

    class Backend:
        def check_capacity(self, workers):
            pass

    class Controller:
        target, members = 3, [0, 1, 2]

    requests = ResizeRequests(scheduled_job(), 1, "token", "job", None, Backend(), Controller(), lambda: None)
    requests.ask(3)
    with pytest.raises(ValueError, match=r"^resize to workers=4 is more than virtual_nodes=3"):
        requests.ask(4)
    assert requests.grow_for_join().startswith("the job already has 3 workers for virtual_nodes=3")
