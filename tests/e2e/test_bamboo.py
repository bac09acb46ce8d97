"""Bamboo's redundant stages (``Pipeline(redundancy=True)``): every worker keeps a replica of its
successor's stage, equal to the successor's real state after every step.

In-process (:class:`virtualflow.runtime.pipeline.local.LocalDriver`: the same requests as the
process driver), the standard is bit-equality of the replica with the original: parameters,
buffers (BatchNorm statistics and counters), optimizer state and LR schedule.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.backends.inprocess import LocalDriver, build_engine, train_local
from vn_reference import one_worker, undisturbed_pipeline
import jobs


def net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(jobs.FEATURES, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3),
    )


def job(stages: int, schedule: str = "1f1b", redundancy: bool = True, chunks: int = 1) -> vf.Job:
    return vf.Job(
        model=net, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01), dataset=jobs.classification_data,
        output_loss=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        global_batch_size=32, virtual_nodes=8, seed=4,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        pipeline=Pipeline(stages=stages, schedule=schedule, redundancy=redundancy, chunks=chunks),
    )


@functools.lru_cache(maxsize=None)
def undisturbed(stages: int, steps: int) -> dict[str, torch.Tensor]:
    """The model after ``steps`` deterministic steps of :func:`jobs.pipelined_redundant_job`
    without redundancy on ``stages`` stages (3: 1F1B; 4: GPipe, as
    :func:`jobs.pipelined_redundant_job_4`): what every failover of the process tests must train,
    run in this process once per module (several tests compare with the same run)."""
    pipeline = Pipeline(stages=stages, schedule={3: "1f1b", 4: "gpipe"}[stages])
    return undisturbed_pipeline(jobs.pipelined_redundant_job().replace(pipeline=pipeline), steps)


def engines_of(j: vf.Job, replicas: int = 1, deterministic: bool = False):
    torch.manual_seed(j.seed)
    bounds = resolve_bounds(j.pipeline, len(layers_of(j.model())))
    dataset = j.build_dataset()
    engines = [build_engine(j, j.pipeline, bounds, r % j.pipeline.stages, dataset=dataset,
                            deterministic=deterministic, device=torch.device("cpu"))
               for r in range(j.pipeline.stages * replicas)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(j.virtual_nodes, replicas))
    return engines, driver


def assert_same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.is_floating_point() else a,
                           b.reshape(-1).view(torch.uint8) if b.is_floating_point() else b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (what, a.keys(), b.keys())
        for k in a:
            assert_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, (what, a, b)


def assert_replicas_fresh(engines, p: int) -> None:
    for r, e in enumerate(engines):
        rep = e.replica_of_successor
        succ = engines[(r // p) * p + (r % p + 1) % p]
        assert rep.stage_rank == succ.stage_rank
        assert_same(rep.model.state_dict(), succ.model.state_dict(), f"worker {r} replica model")
        assert_same(rep.optimizer.state_dict(), succ.optimizer.state_dict(), f"worker {r} replica optimizer")
        assert (rep.scheduler is None) == (succ.scheduler is None)  # a stage without parameters has none
        if rep.scheduler is not None:
            assert_same(rep.scheduler.state_dict(), succ.scheduler.state_dict(), f"worker {r} replica scheduler")


@pytest.mark.parametrize("stages,schedule,replicas,deterministic", [
    (3, "1f1b", 1, False), (4, "1f1b", 1, True), (4, "gpipe", 1, False), (2, "zb_h1", 2, False),
    (3, "1f1b", 2, True),
])
def test_each_replica_equals_its_successor_after_every_step(stages, schedule, replicas, deterministic):
    engines, driver = engines_of(job(stages, schedule), replicas, deterministic)
    for t in range(5):
        driver.run(t, 1)
        assert_replicas_fresh(engines, stages)
    # The replica really moved: it is not still the initial model.
    fresh = engines_of(job(stages, schedule), replicas, deterministic)[0]
    moved = [not torch.equal(a, b) for e, f in zip(engines, fresh)
             for a, b in zip(e.replica_of_successor.model.parameters(), f.replica_of_successor.model.parameters())]
    assert moved and all(moved)


def test_interleaved_pieces_are_replicated_whole():
    engines, driver = engines_of(job(2, "interleaved_1f1b", chunks=2))
    for t in range(3):
        driver.run(t, 1)
        assert_replicas_fresh(engines, 2)
    assert sorted(engines[0].replica_of_successor.pieces) == [1, 3]


def test_redundancy_does_not_change_the_trained_model():
    with_, _ = train_local(job(3), 4, deterministic=True)
    without, _ = train_local(job(3, redundancy=False), 4, deterministic=True)
    assert_same(with_, without, "model")


def test_a_replica_holds_a_copy_of_its_successor():
    engines, driver = engines_of(job(3))
    driver.run(0, 1)
    for r, e in enumerate(engines):
        succ = engines[(r + 1) % 3]
        stage_bytes = sum(t.numel() * t.element_size() for t in
                          list(succ.model.parameters()) + list(succ.model.buffers()))
        opt_bytes = sum(v.numel() * v.element_size() for st in succ.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        assert e.replica_of_successor.nbytes() == stage_bytes + opt_bytes


# -- eager redundant forwards ----------------------------------------------------------------------

def _capture_eager(engines):
    """Per worker: the eager forwards of every step, taken just before the step's commit drops them."""
    seen = {r: {} for r in range(len(engines))}
    for r, e in enumerate(engines):
        rep = e.replica_of_successor
        original = rep.end_step

        def end_step(applied, rep=rep, r=r, original=original):
            seen[r].update(rep.eager)
            original(applied)
        rep.end_step = end_step
    return seen


def _capture_forwards(engines, step_of):
    """Per worker: the outputs of its own stage's forwards, in call order per step."""
    out = {r: [] for r in range(len(engines))}
    for r, e in enumerate(engines):
        for module in e.pieces.values():
            module.register_forward_hook(lambda mod, args, result, r=r: out[r].append((step_of[0], result.detach())))
    return out


@pytest.mark.parametrize("stages,schedule,deterministic", [(3, "1f1b", False), (4, "gpipe", True), (2, "1f1b", False)])
def test_eager_forwards_equal_the_successors_own_forwards(stages, schedule, deterministic, monkeypatch):
    """Each worker runs its successor's forward of every micro-batch it sent (the first stage's from
    the data) on its replica: outputs, bit for bit, those of the successor's own forward. (At every
    wait, not only in the bubbles: in one process the bubbles' timing means nothing.)"""
    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    j = job(stages, schedule)
    engines, driver = engines_of(j, 1, deterministic)
    assert all(e.eager for e in engines)
    eager = _capture_eager(engines)
    step_of = [0]
    own = _capture_forwards(engines, step_of)
    steps = 3
    for t in range(steps):
        step_of[0] = t
        driver.run(t, 1)
    m = j.virtual_nodes
    for r, e in enumerate(engines):
        succ = (r + 1) % stages
        real = {(t, vn): out for (t, out), vn in zip(own[succ], [v for _ in range(steps) for v in range(m)])}
        rep = e.replica_of_successor
        assert rep.forwards + rep.skipped == m * steps
        assert len(eager[r]) == rep.forwards
        for key, entry in eager[r].items():
            assert_same(entry.outputs[0], real[key], f"worker {r} eager forward {key}")
        if rep.forwards:  # what the kept forwards held: at least their outputs
            assert rep.peak_kept_bytes >= max(e.outputs[0].numel() * 4 for e in eager[r].values())
        assert not rep.eager  # dropped at the commit
    # In one process a receive waits only when the cooperative order has not run the sender yet;
    # the workers that met such waits ran their redundant forwards there.
    assert sum(e.replica_of_successor.forwards for e in engines) >= m


@pytest.mark.parametrize("p,m,b", [(2, 8, 2.0), (3, 8, 2.0), (4, 6, 1.5), (4, 12, 2.0)])
def test_eager_forwards_go_in_the_schedules_bubbles(p, m, b):
    """Where eager forwards may go: the waits of the 1F1B schedule's simulation (receives, and the
    tail after a rank's last action); on every rank they add up to its whole bubble,
    (p - 1)(f + b), the verified formula."""
    from virtualflow.runtime.pipeline import idle_slots, schedule_for

    slots = idle_slots("1f1b", p, m, b)
    actions = schedule_for(Pipeline(stages=p), m).actions
    for r in range(p):
        assert len(slots[r]) == len(actions[r]) + 1
        assert sum(slots[r]) == pytest.approx((p - 1) * (1 + b))
        for a, wait in zip(actions[r], slots[r]):
            assert wait >= 0 and (wait == 0 or a.kind in ("RECV_F", "RECV_B"))


def test_eager_forwards_start_once_the_bubbles_are_measured():
    """By default the first step runs none (its forward and backward times, which size the
    bubbles, are not measured yet); later steps run them where the schedule waits."""
    engines, driver = engines_of(job(3))
    driver.run(0, 1)
    assert all(e.replica_of_successor.forwards == 0 and e.replica_of_successor.skipped == 8 for e in engines)
    assert all(e.fb_times is not None and min(e.fb_times) > 0 for e in engines)
    for t in range(1, 4):
        driver.run(t, 1)
        assert_replicas_fresh(engines, 3)
    assert all(e.replica_of_successor.forwards + e.replica_of_successor.skipped == 32 for e in engines)
    assert sum(e.replica_of_successor.forwards for e in engines) > 0


def test_lazy_redundancy_runs_no_redundant_forward():
    j = job(3).replace(pipeline=Pipeline(stages=3, redundancy=True, redundant_compute="lazy"))
    engines, driver = engines_of(j)
    for t in range(3):
        driver.run(t, 1)
        assert_replicas_fresh(engines, 3)
    assert all(not e.eager and e.replica_of_successor.forwards == 0 for e in engines)
    with pytest.raises(ValueError, match=r"redundant_compute='soon' must be 'eager'.*or 'lazy'"):
        Pipeline(stages=3, redundancy=True, redundant_compute="soon")
    # Schedules a failover does not re-lay keep no eager forwards.
    assert not Pipeline(stages=2, schedule="zb_h1", redundancy=True).eager_forwards


def test_a_redone_step_takes_the_lost_stage_from_eager_forwards_bit_for_bit():
    """The failed-over worker runs its own layers [0, 3) and the lost stage's [3, 8) as one piece;
    with the lost stage's eager forward spliced in, loss, every gradient, BatchNorm statistics and
    the random stream after it are those of running all the layers (dropout and BatchNorm inside
    the spliced stage)."""
    import copy
    from types import SimpleNamespace

    from virtualflow.plan.pipeline.geometry import piece_module
    from virtualflow.runtime.pipeline import StageEngine, _Eager, _Reuse

    torch.manual_seed(0)
    layers = layers_of(net())
    for layer in layers:  # non-trivial running statistics
        if isinstance(layer, nn.BatchNorm1d):
            layer.running_mean.uniform_(-1, 1)
    x = torch.randn(16, jobs.FEATURES)
    y = torch.randint(0, 3, (16,))
    lo, hi = 3, 8

    def run(module, forward):
        torch.manual_seed(11)
        out = forward(module)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss.detach(), {n: q.grad for n, q in module.named_parameters()}, \
            {n: b.clone() for n, b in module.named_buffers()}, torch.get_rng_state()

    plain = piece_module(copy.deepcopy(layers), 0, len(layers))
    want = run(plain, lambda mod: mod(x))

    # The predecessor's forward of its own layers, then the eager forward on its replica.
    own = piece_module(copy.deepcopy(layers), 0, lo)
    torch.manual_seed(11)
    h = own(x)
    rng = torch.get_rng_state()
    replica = piece_module(copy.deepcopy(layers), lo, hi)
    torch.set_rng_state(rng)
    h_e = h.detach().requires_grad_(True)
    out_e = replica(h_e)
    entry = _Eager(inputs=[h_e], outputs=(out_e,), single=True, rng=torch.get_rng_state(),
                   buffers={n: b.detach().clone() for n, b in replica.named_buffers()},
                   params=dict(replica.named_parameters()))

    merged = piece_module(copy.deepcopy(layers), 0, len(layers))
    fake = SimpleNamespace(reuse=_Reuse(lo, hi, {}), device=torch.device("cpu"), reused_forwards=0)
    got = run(merged, lambda mod: StageEngine._spliced_forward(fake, mod, x, entry))
    assert fake.reused_forwards == 1
    assert_same(got[0], want[0], "loss")
    assert_same(got[1], want[1], "gradients")
    assert_same(got[2], want[2], "buffers")
    assert_same(got[3], want[3], "random stream after the forward")
    assert all(q.grad is None for q in replica.parameters())  # the replica's copies took no gradient


def test_redundancy_needs_a_flush_schedule_and_two_stages():
    with pytest.raises(ValueError, match=r"redundancy=True.*stages >= 2 \(got 1\)"):
        Pipeline(stages=1, redundancy=True)
    with pytest.raises(ValueError, match=r"redundancy=True.*flush schedule.*got '2bw'"):
        Pipeline(stages=2, schedule="2bw", redundancy=True)


@pytest.mark.slow
def test_redundant_pipeline_trains_the_same_model_in_processes_across_a_grow(run_dir):
    """3 stages with redundancy, grown from one pipeline to two (the newcomers receive their
    stage and the replica of their successor's): the model of the run without redundancy."""
    from conftest import assert_state_equal, wait_for_step

    handle = vf.launch(jobs.pipelined_redundant_job, workers=3, steps=1_000_000, deterministic=True,
                       run_dir=run_dir)
    wait_for_step(handle, 3)
    handle.resize(6, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    assert {h["workers"] for h in result.history} == {3, 6}
    assert_state_equal(result.state_dict, undisturbed(3, result.steps))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["allreduce", "sharded"])
def test_a_preemption_notice_releases_the_worker_at_a_step_boundary(reduction, run_dir):
    """SIGTERM to a training worker is a preemption notice: the job regroups without it at a step
    boundary (no failure, no step redone, the sharded optimizer's chunk handed over) and it
    leaves cleanly; the model is the undisturbed one, bit for bit."""
    import json
    import os
    import signal
    import time

    from conftest import assert_same_training, wait_for_step

    handle = vf.launch(jobs.elastic_job, workers=3, steps=1_000_000, deterministic=True, reduction=reduction,
                       run_dir=run_dir)
    wait_for_step(handle, 3)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 300  # liveness, not speed: ~30 s for the whole test under load 15
    while len([w for w in handle.status()["workers"] if w["rank"] is not None]) != 2:
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.05)
    # The regroup takes effect at a step boundary a few steps after it is published (more steps
    # when steps are fast): wait until steps of the 2 workers are recorded, not a step count.
    while sum(1 for h in list(handle.coordinator.history) if h["workers"] == 2) < 3:
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.05)
    result = handle.stop()
    assert result.failures == []
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["worker"] for e in events if e["event"] == "preemption_notice"] == [victim["id"]]
    formed = [e for e in events if e["event"] == "formed" and e.get("change") == "preempted"]
    assert len(formed) == 1 and formed[0]["noticed"] == [victim["id"]]
    assert [e["worker"] for e in events if e["event"] == "leave"] == [victim["id"]]
    assert_same_training(result, one_worker(jobs.elastic_job().replace(loss=jobs.cross_entropy), result.steps))


# -- failover and reconfiguration decisions (pure) -------------------------------------------

def test_failover_gives_a_lost_stage_to_its_predecessor():
    from virtualflow.plan.pipeline.failover import Failover, failover, standard

    got = failover(standard(4), [2])
    assert got == Failover(((0,), (1, 2), (3,)), (0, 1, 3), {2: 1})
    assert failover(standard(4), [1, 3]).layout == ((0, 1), (2, 3))
    assert failover(standard(3), [2]).layout == ((0,), (1, 2))
    assert failover(((0,), (1, 2), (3,)), [2]).layout == ((0,), (1, 2, 3))
    first = failover(standard(3), [0])  # the second worker runs the first stage (from the last one's replica)
    assert first.layout == ((0, 1), (2,)) and first.survivors == (1, 2) and first.taken_over == {0: 1}


@pytest.mark.parametrize("layout,lost,why", [
    (((0,), (1,), (2,), (3,)), [1, 2], r"consecutive stages 1 and 2"),
    (((0,), (1,), (2,)), [0, 2], r"consecutive stages 2 and 0"),
    (((0,), (1,)), [0, 1], r"consecutive stages"),
    (((0,), (1, 2), (3,)), [1], r"running stages \[1, 2\]"),
])
def test_failover_falls_back_where_no_replica_covers_the_loss(layout, lost, why):
    from virtualflow.plan.pipeline.failover import Fallback, failover

    got = failover(layout, lost)
    assert isinstance(got, Fallback)
    import re
    assert re.search(why, got.reason), got.reason


def test_reconfiguration_hands_taken_over_stages_back_to_newcomers():
    from virtualflow.plan.pipeline.failover import check_layout, reconfigure

    got = reconfigure(((0,), (1, 2), (3,)), 1)
    assert got.layout == ((0,), (1,), (2,), (3,)) and got.order == (0, 1, None, 2)
    got = reconfigure(((0, 1), (2, 3)), 1)
    assert got.layout == ((0,), (1,), (2, 3)) and got.order == (0, None, 1)
    assert reconfigure(((0, 1), (2, 3)), 5).layout == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="consecutive stages"):
        check_layout([[0], [2], [1]], 3)


# -- failover end to end ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("phase", ["before_forward", "send_recv", "mid_backward", "during_reduction",
                                   "after_reduction"])
def test_a_single_pipeline_fails_over_in_any_phase_and_trains_the_undisturbed_model(phase, run_dir, monkeypatch):
    """3 stages, one pipeline, redundancy: the middle worker SIGKILLs itself at step 3 in
    ``phase``; stage 0's worker takes stage 1 over from its replica, the pipeline goes on two
    workers deep, no step is lost or doubled, and the model is the undisturbed run's, bit for bit.
    (Eager forwards at every wait, so that the redone step's reuse does not hang on timing.)"""
    import json
    import os

    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    from conftest import assert_state_equal

    plan = vf.FaultPlan([vf.Fault(worker=1, step=3, phase=phase)])
    result = vf.train(jobs.pipelined_redundant_job, workers=3, steps=7, deterministic=True, fault_plan=plan,
                      run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [1]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2]
    assert [h["step"] for h in result.history] == list(range(7))
    # The replica each survivor holds at the end (reported): its successor's stage.
    assert sorted(result.replica_bytes) == [0, 2] and all(b > 0 for b in result.replica_bytes.values())
    assert sorted(result.replica_refresh_s) == [0, 2] and all(t > 0 for t in result.replica_refresh_s.values())
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    failover = [e for e in events if e["event"] == "failover"]
    assert len(failover) == 1 and failover[0]["layout"] == [[0, 1], [2]]
    # Eager redundant forwards (the default): worker 0 ran stage 1's forwards of what it sent on
    # its replica; once the middle stage's forwards of step 3 had begun, the redone step 3 took
    # them instead of running stage 1's layers again.
    assert all(c["forwards"] > 0 for c in result.redundant_forwards.values())
    if phase in ("mid_backward", "during_reduction"):
        assert result.redundant_forwards[0]["reused"] > 0
    assert_state_equal(result.state_dict, undisturbed(3, 7))


@pytest.mark.slow
def test_four_stages_fail_over_mid_backward_reusing_eager_forwards(run_dir, monkeypatch):
    """4 stages (GPipe), one pipeline: stage 2's worker dies in its first backward of step 2;
    worker 1 runs stages 1-2, its redone step takes stage 2's forwards from its eager ones, and the
    model is the undisturbed run's, bit for bit."""
    from conftest import assert_state_equal

    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    plan = vf.FaultPlan([vf.Fault(worker=2, step=2, phase="mid_backward")])
    result = vf.train(jobs.pipelined_redundant_job_4, workers=4, steps=5, deterministic=True, fault_plan=plan,
                      run_dir=run_dir)
    assert [h["step"] for h in result.history] == list(range(5))
    assert [h["workers"] for h in result.history][-1] == 3
    # GPipe runs every forward before any backward: stage 2's forwards were all sent before it died.
    assert result.redundant_forwards[1]["reused"] > 0
    assert all(c["peak_bytes"] > 0 for c in result.redundant_forwards.values())
    assert_state_equal(result.state_dict, undisturbed(4, 5))


@pytest.mark.slow
def test_a_failed_over_pipeline_reconfigures_to_full_depth_when_a_worker_returns(run_dir):
    """replace_failed: after the failover a replacement starts; when it is ready the pipeline
    re-forms at a step boundary, the replacement taking back the stage its predecessor ran;
    every step once, the undisturbed model."""
    import json
    import os

    from conftest import assert_state_equal, wait_for_members, wait_for_step

    plan = vf.FaultPlan([vf.Fault(worker=2, step=3, phase="mid_backward")])
    handle = vf.launch(jobs.pipelined_redundant_job, workers=3, steps=1_000_000, deterministic=True,
                       fault_plan=plan, replace_failed=True, run_dir=run_dir)
    wait_for_members(handle, 3, generation=2, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2, 3]
    assert [h["step"] for h in result.history] == list(range(result.steps))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["layout"] for e in events if e["event"] == "failover"] == [[[0], [1, 2]]]
    assert [e["layout"] for e in events if e["event"] == "reconfigure"] == [[[0], [1], [2]]]
    # The newcomer received its stage and the replica of its successor's: bytes reported.
    assert [e["transfer_bytes"] > 0 for e in events if e["event"] == "formed" and e["change"] == "reconfigure"] == [True]
    # Visible in `virtualflow status` and on the timeline plot.
    from virtualflow.cli.main import main
    from virtualflow.cli.status import format_status
    from virtualflow.records.rundir import read_status

    status = read_status(run_dir)
    text = format_status(run_dir, status, "finished")
    assert "redundant stages (Bamboo): full depth" in text
    assert "failover at step" in text and "[[0], [1, 2]]" in text and "reconfigure at step" in text
    png = os.path.join(run_dir, "timeline.png")
    assert main(["plot", run_dir, "--timeline", "-o", png]) == 0 and os.path.getsize(png) > 0
    assert_state_equal(result.state_dict, undisturbed(3, result.steps))


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2])
def test_a_preemption_notice_hands_the_stage_to_the_predecessor_at_a_step_boundary(rank, run_dir):
    """SIGTERM to a worker of a single redundant pipeline: at the next step boundary its stage goes
    to the worker holding its replica (the first stage: to the second worker, from the last one's
    replica) and it leaves cleanly: no failure, no step redone, the undisturbed model."""
    import json
    import os
    import signal

    from conftest import assert_state_equal, wait_for_members, wait_for_step

    handle = vf.launch(jobs.pipelined_redundant_job, workers=3, steps=1_000_000, deterministic=True, run_dir=run_dir)
    wait_for_step(handle, 3)
    victim = next(w for w in handle.status()["workers"] if w["rank"] == rank)
    os.kill(victim["pid"], signal.SIGTERM)
    wait_for_members(handle, 2, formed=True)  # the 2-member generation is published AND formed
    wait_for_step(handle, handle.status()["step"] + 2)
    result = handle.stop()
    assert result.failures == []
    assert [h["step"] for h in result.history] == list(range(result.steps))
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [3, 2]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    failover = [e for e in events if e["event"] == "failover"]
    expected = [[0, 1], [2]] if rank == 0 else [[0], [1, 2]]
    assert len(failover) == 1 and failover[0]["noticed"] == [victim["id"]] and failover[0]["layout"] == expected
    assert [e["worker"] for e in events if e["event"] == "leave"] == [victim["id"]]
    assert_state_equal(result.state_dict, undisturbed(3, result.steps))


@pytest.mark.slow
def test_the_first_stage_fails_over_to_the_second_worker_from_the_last_ones_replica(run_dir):
    import json
    import os

    from conftest import assert_state_equal

    plan = vf.FaultPlan([vf.Fault(worker=0, step=3, phase="during_reduction")])
    result = vf.train(jobs.pipelined_redundant_job, workers=3, steps=6, deterministic=True, fault_plan=plan,
                      run_dir=run_dir)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [(e["layout"], e["taken_over"]) for e in events if e["event"] == "failover"] == [([[0, 1], [2]], {"0": 1})]
    assert [h["step"] for h in result.history] == list(range(6))
    assert_state_equal(result.state_dict, undisturbed(3, 6))


@pytest.mark.slow
def test_a_failover_after_a_commit_that_reached_only_some_members(run_dir):
    """Step 3's commit all-reduce completes on worker 0 but not on worker 1 (a ``lose`` fault)
    and worker 2 dies: worker 1 finishes step 3 from worker 0's stats (its replica of stage 2
    included), then takes stage 2 over; no step lost or redone, the undisturbed model."""
    import json
    import os

    from conftest import assert_state_equal

    plan = vf.FaultPlan([vf.Fault(worker=2, step=3, phase="after_reduction"),
                         vf.Fault(worker=1, step=3, phase="after_reduction", action="lose")])
    result = vf.train(jobs.pipelined_redundant_job, workers=3, steps=6, deterministic=True, fault_plan=plan,
                      run_dir=run_dir)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["layout"] for e in events if e["event"] == "failover"] == [[[0], [1, 2]]]
    assert [f["worker"] for f in result.failures] == [2]
    assert [h["step"] for h in result.history] == list(range(6))
    assert_state_equal(result.state_dict, undisturbed(3, 6))


@pytest.mark.slow
def test_a_loss_redundancy_cannot_cover_restarts_from_the_last_checkpoint(run_dir):
    """Two consecutive stages lost in one step (the replica of the second was on the first): a
    fallback_restart event says why, and train() launches the job again from its last
    checkpoint; it ends with the undisturbed model. Without a checkpoint it ends naming --resume."""
    import json
    import os

    from conftest import assert_state_equal

    plan = vf.FaultPlan([vf.Fault(worker=1, step=5, phase="during_reduction"),
                         vf.Fault(worker=2, step=5, phase="during_reduction")])
    result = vf.train(jobs.pipelined_redundant_job, workers=3, steps=8, deterministic=True, fault_plan=plan,
                      checkpoint_every=4, run_dir=run_dir)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    fallback = [e for e in events if e["event"] == "fallback_restart"]
    # Worker 2's loss fails over to worker 1; worker 1 then dies (in the redone step or at once):
    # the worker running stages 1 and 2 (or two consecutive stages) lost.
    assert len(fallback) == 1 and ("stages [1, 2]" in fallback[0]["reason"]
                                   or "consecutive stages 1 and 2" in fallback[0]["reason"]), fallback
    assert [e["resume_step"] for e in events if e["event"] == "start"] == [0, 4]
    assert [h["step"] for h in result.history] == list(range(4, 8))
    assert_state_equal(result.state_dict, undisturbed(3, 8))
    with pytest.raises(vf.TrainingError, match=r"redundancy cannot cover the loss.*--resume"):
        vf.train(jobs.pipelined_redundant_job, workers=3, steps=8, deterministic=True, fault_plan=plan,
                 run_dir=os.path.join(run_dir, "no-checkpoint"))


@pytest.mark.slow
def test_a_tensor_parallel_stage_fails_over_to_its_predecessors_tensor_group(run_dir):
    """(D, P, T) = (1, 2, 2) with redundancy: each tensor rank t of stage 0 holds shard t of stage
    1's replica, refreshed from stage 1's tensor rank t. Stage 1's tensor rank 1 (worker 3) is
    SIGKILLed mid-backward of step 2: its tensor group leaves (worker 2 too), stage 0's group runs
    both stages with the replica's shards over its own tensor group, the interrupted step is
    redone, and the trained model is the undisturbed grid's bit for bit (and plain PyTorch's on one
    worker within the tensor split's float tolerance: float64, the row-parallel sums cut in 2)."""
    import json
    import os

    from conftest import assert_state_equal
    from reference import reference_train
    from virtualflow.config.worker_options import WorkerOptions
    from virtualflow.runtime.grid_threads import Generation, train_threads
    import gpt_grid_jobs as g

    steps = 4
    plan = vf.FaultPlan([vf.Fault(worker=3, step=2, phase="mid_backward")])
    result = vf.train(lambda: g.grid_job(stages=2, tensor=2, redundancy=True), workers=4, steps=steps,
                      deterministic=True, fault_plan=plan, run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [3]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [4, 2]
    assert [h["step"] for h in result.history] == list(range(steps))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        failover = [e for e in map(json.loads, f) if e["event"] == "failover"]
    assert len(failover) == 1 and failover[0]["layout"] == [[0, 1]]
    assert failover[0]["taken_over"] == {"2": 0, "3": 1}
    # The undisturbed (1, 2, 2) grid, its 4 workers as threads of this process (the engines a
    # worker process builds, over real gloo groups; the grid job draws no dropout).
    ref = train_threads(g.grid_job(stages=2, tensor=2), [Generation(members=(0, 1, 2, 3), steps=steps)],
                        options=WorkerOptions(deterministic=True, breakdown=False))
    assert_state_equal(result.state_dict, ref.state["model"])
    assert [h["loss"] for h in result.history] == [o.loss for o in ref.outcomes]
    plain, _, _ = reference_train(g.single_job(), steps)  # plain PyTorch, one process, no pipeline
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(result.state_dict[k], v, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_a_sharded_stage_fails_over_with_its_chunk_from_the_predecessors_replica(run_dir, monkeypatch):
    """2 stages x 2 pipeline replicas, ``reduction="sharded"`` (each stage's Adam state in two
    chunks), deterministic: replica 0's second worker SIGKILLs itself in its first backward of
    step 3. Its chunk of stage 1's optimizer state lives on only in its predecessor's replica
    (which stepped it with the lost worker's own reduced gradient chunk at every flush); the
    failover rebuilds stage 1 from it and the other replica's chunk, no step is lost or doubled,
    and the model is the unpipelined single-worker run's, bit for bit."""
    import json
    import os

    from conftest import assert_state_equal

    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    job = jobs.pipelined_redundant_job().replace(pipeline=Pipeline(stages=2, schedule="1f1b", redundancy=True))
    plan = vf.FaultPlan([vf.Fault(worker=1, step=3, phase="mid_backward")])
    result = vf.train(job, workers=4, steps=6, deterministic=True, reduction="sharded", fault_plan=plan,
                      run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [1]
    assert [h["step"] for h in result.history] == list(range(6))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        failover = [e for e in map(json.loads, f) if e["event"] == "failover"]
    assert [(e["replica"], e["layout"], e["taken_over"]) for e in failover] == [(0, [[0, 1]], {"1": 0})]
    assert_state_equal(result.state_dict, one_worker(job.replace(pipeline=None), 6).state_dict)


def tied_redundant_job() -> vf.Job:
    """The tied GPT of tests/pipeline_models.py (token embedding = head weight) on 3 stages with
    redundancy: the embedding on worker 0, the head on worker 2."""
    import pipeline_models as pm

    return pm.transformer_job(Pipeline(stages=3, redundancy=True), virtual_nodes=4, model=pm.tied_gpt)


@pytest.mark.slow
def test_a_tied_gpt_fails_over_a_sigkill_to_the_unpipelined_model(run_dir, monkeypatch):
    """A weight tied across workers with redundancy, in processes: the head's worker SIGKILLs
    itself mid-backward of step 2; the middle worker takes the head's stage over from its replica
    (its own copy of the tied weight), the tied sum runs between the new holders (workers 0 and
    1), and the model is the unpipelined deterministic run's, bit for bit (the in-process proofs
    of every layout: tests/unit/test_bamboo_tied.py)."""
    import json
    import os

    import pipeline_models as pm
    from conftest import assert_state_equal

    monkeypatch.setenv("VIRTUALFLOW_EAGER_EVERY_WAIT", "1")
    plan = vf.FaultPlan([vf.Fault(worker=2, step=2, phase="mid_backward")])
    result = vf.train(tied_redundant_job, workers=3, steps=5, deterministic=True, fault_plan=plan, run_dir=run_dir)
    assert [f["worker"] for f in result.failures] == [2]
    assert [h["step"] for h in result.history] == list(range(5))
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        failover = [e for e in map(json.loads, f) if e["event"] == "failover"]
    assert len(failover) == 1 and failover[0]["layout"] == [[0], [1, 2]]
    ref_state, ref_losses = pm.unpipelined(tied_redundant_job(), 5, True)
    assert_state_equal(result.state_dict, ref_state)
    assert [h["loss"] for h in result.history] == ref_losses
