"""The training loop's knobs on a pipelined job (runtime/pipeline/loop.py), run in-process by
``train_local``, against a plain PyTorch gradient-accumulation loop written here.

- ``bf16-mixed`` + ``max_grad_norm`` + AdamW + warmup schedule, dropout in the model: default mode
  within float tolerance of the plain loop (same autocast, ``clip_grad_norm_`` on the full-batch
  gradient), the reported norm equal to ``clip_grad_norm_``'s within rounding; deterministic mode
  bit-identical across 1, 2 and 3 pipeline replicas (weights, losses, norms).
- ``16-mixed`` with a loss scale that overflows float16 (``init_scale=2**24``): the same steps are
  skipped as by ``torch.amp.GradScaler`` in the plain loop (on every stage and replica), the scale
  ends the same, the LR scheduler is not stepped on a skipped step, and deterministic runs are
  bit-identical across replica counts.
- Activation checkpointing (``"every"``, a class, names) on vs off: bit-identical in deterministic
  mode, dropout included. ``compile`` (the aot_eager backend) matches eager, one graph per piece.
- ``output_loss`` returning ``(loss, {name: value})``: metrics are the global batch's means.
- An optimizer factory that takes the model gets the stage's module (parameter groups by name).
- The scaler's state travels with a stage's state; no-flush schedules refuse the global knobs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeline_models as pm
from conftest import assert_state_close, assert_state_equal
from reference import step_batch
import virtualflow as vf
from virtualflow.backends.inprocess import LocalDriver, build_engine, train_local
from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.data import vn_seed
from virtualflow.plan.pipeline.geometry import layers_of, resolve_bounds
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.pipeline.stage_state import load_stage_state, stage_state

DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _mse_with_metrics(out, batch):
    err = out - batch[1]
    return (err ** 2).mean(), {"mae": err.abs().mean(), "bias": err.mean().item()}


def _job(pipeline: Pipeline, *, virtual_nodes: int = 6, **fields) -> vf.Job:
    """The MLP of pipeline_models (dropout in two places) with AdamW and a warmup schedule."""
    base = dict(model=pm.mlp, optimizer=pm.OPTIMIZERS["adamw"], output_loss=pm._mse, lr_scheduler=pm._warmup,
                dataset=pm.regression_data, global_batch_size=pm.PER_VN * virtual_nodes,
                virtual_nodes=virtual_nodes, pipeline=pipeline)
    return vf.Job(**{**base, **fields})


# ---- the plain PyTorch loop -----------------------------------------------------------------------
def plain_loop(job: vf.Job, steps: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Single process, gradient accumulation over the V virtual nodes of each global batch: each
    VN's forward and loss under ``torch.autocast``, its loss weighted by n_v / B (and scaled by a
    ``torch.amp.GradScaler`` for 16-mixed), then unscale, ``clip_grad_norm_`` and the step (skipped
    by the scaler on an inf/nan; the scheduler stepped only when the optimizer was)."""
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.build_optimizer(model)
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    scaler = torch.amp.GradScaler("cpu", **dict(job.loss_scale or {})) if job.precision == "16-mixed" else None
    ds = job.build_dataset()
    n, B, V = len(ds), job.global_batch_size, job.virtual_nodes
    per = B // V
    dtype = DTYPES[job.precision]
    model.train()
    history = []
    for s in range(steps):
        idx = step_batch(job, n, s)
        opt.zero_grad()
        total = 0.0
        metrics: dict[str, float] = {}
        scale = scaler.get_scale() if scaler else None
        for v in range(V):
            rows = idx[v * per:(v + 1) * per]
            batch = [t[rows] for t in ds.tensors]
            torch.manual_seed(vn_seed(job.seed, s, v))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = job.output_loss(model(batch[0]), batch)
            loss, found = out if isinstance(out, tuple) else (out, {})
            weighted = loss * (per / B)
            (scaler.scale(weighted) if scaler else weighted).backward()
            total += float(weighted.detach())
            for name, value in found.items():
                metrics[name] = metrics.get(name, 0.0) + float(torch.as_tensor(value).detach()) * per / B
        if scaler:
            scaler.unscale_(opt)
        norm = None
        if job.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm))
        skipped = False
        if scaler:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale
        else:
            opt.step()
        if sched is not None and not skipped:
            sched.step()
        history.append({"loss": total, "grad_norm": norm, "skipped": skipped, "loss_scale": scale,
                        "metrics": metrics or None})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


# ---- bf16 + clipping --------------------------------------------------------------------------------
BF16_CLIP = dict(precision="bf16-mixed", max_grad_norm=0.05)


@pytest.mark.parametrize("pipeline", [Pipeline(stages=2, schedule="1f1b"),
                                      Pipeline(stages=2, schedule="interleaved_1f1b", chunks=2)],
                         ids=["1f1b", "interleaved"])
def test_bf16_clipping_matches_the_plain_loop(pipeline):
    job = _job(pipeline, virtual_nodes=8, **BF16_CLIP)
    steps = 4
    ref_state, ref = plain_loop(job, steps)
    assert all(h["grad_norm"] > job.max_grad_norm for h in ref)  # clipping is at work every step
    for replicas in (1, 2):
        state, history = train_local(job, steps, replicas=replicas)
        assert_state_close(state, ref_state, rtol=1e-5, atol=1e-6)
        assert [h.grad_norm for h in history] == pytest.approx([h["grad_norm"] for h in ref], rel=1e-5)
        assert [h.loss for h in history] == pytest.approx([h["loss"] for h in ref], rel=1e-5)
        assert not any(h.skipped for h in history) and all(h.loss_scale is None for h in history)


def test_bf16_clipping_deterministic_is_bit_identical_across_replicas():
    job = _job(Pipeline(stages=3, schedule="1f1b"), **BF16_CLIP)
    runs = [train_local(job, 3, replicas=d, deterministic=True) for d in (1, 2, 3)]
    state0, hist0 = runs[0]
    for state, history in runs[1:]:
        assert_state_equal(state, state0)
        assert [h.grad_norm for h in history] == [h.grad_norm for h in hist0]
        assert [h.loss for h in history] == [h.loss for h in hist0]
    ref_state, ref = plain_loop(job, 3)
    assert_state_close(state0, ref_state, rtol=1e-5, atol=1e-6)
    assert [h.grad_norm for h in hist0] == pytest.approx([h["grad_norm"] for h in ref], rel=1e-5)


def _tied_mlp() -> nn.Sequential:
    """Layer 4 reads layer 0's weight: with 2 stages, each worker holds a copy."""
    first, fourth = nn.Linear(pm.FEATURES, pm.FEATURES), nn.Linear(pm.FEATURES, pm.FEATURES)
    fourth.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(pm.FEATURES, pm.FEATURES), nn.Tanh(), fourth,
                         nn.Linear(pm.FEATURES, 1))


def test_a_weight_shared_across_workers_counts_once_in_the_norm():
    """(float32: under autocast the plain loop sums the two uses' gradients in bfloat16 through one
    cached cast, the pipeline in float32 over its copies, so bf16 would compare roundings.)"""
    job = _job(Pipeline(stages=2), virtual_nodes=4, model=_tied_mlp, max_grad_norm=0.05)
    ref_state, ref = plain_loop(job, 3)
    for replicas in (1, 2):
        state, history = train_local(job, 3, replicas=replicas)
        assert torch.equal(state["4.weight"], state["0.weight"])
        assert [h.grad_norm for h in history] == pytest.approx([h["grad_norm"] for h in ref], rel=1e-5)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6)


# ---- 16-mixed: global skips ------------------------------------------------------------------------
FP16_OVERFLOW = dict(precision="16-mixed", loss_scale={"init_scale": 2.0 ** 24, "growth_interval": 2},
                     max_grad_norm=1.0)


def test_fp16_overflow_skips_the_steps_gradscaler_skips():
    job = _job(Pipeline(stages=2, schedule="1f1b"), **FP16_OVERFLOW)
    steps = 20
    ref_state, ref = plain_loop(job, steps)
    skipped_ref = [h["skipped"] for h in ref]
    # float16 overflows first (the scale backs off), then trains; the scale grows every 2 applied
    # steps and overflows again now and then
    assert skipped_ref[0] and sum(not s for s in skipped_ref) >= 8 and any(skipped_ref[10:])
    for replicas in (1, 2):
        state, history = train_local(job, steps, replicas=replicas)
        assert [h.skipped for h in history] == skipped_ref
        assert [h.loss_scale for h in history] == [h["loss_scale"] for h in ref]
        assert_state_close(state, ref_state, rtol=1e-5, atol=1e-6)
        applied = [i for i, h in enumerate(ref) if not h["skipped"]]
        assert [history[i].grad_norm for i in applied] == pytest.approx([ref[i]["grad_norm"] for i in applied],
                                                                          rel=1e-4)


def test_fp16_skips_are_global_and_deterministic_across_replicas():
    job = _job(Pipeline(stages=2, schedule="gpipe"), virtual_nodes=4, **FP16_OVERFLOW)
    (s1, h1), (s2, h2) = (train_local(job, 14, replicas=d, deterministic=True) for d in (1, 2))
    assert any(h.skipped for h in h1) and not all(h.skipped for h in h1)
    assert [h.skipped for h in h2] == [h.skipped for h in h1]
    assert [h.loss_scale for h in h2] == [h.loss_scale for h in h1]
    assert_state_equal(s2, s1)


def test_bamboo_replicas_take_the_same_skips_and_clipping():
    """Pipeline.redundancy: each worker's copy of its successor's stage stays bit-identical to
    the successor through skipped (16-mixed) and clipped steps."""
    job = _job(Pipeline(stages=3, redundancy=True), virtual_nodes=4, **FP16_OVERFLOW)
    dataset = job.build_dataset()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, job.pipeline, bounds, r, dataset=dataset, deterministic=False,
                            device=torch.device("cpu")) for r in range(3)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, 1))
    history = [driver.run(t, 1)[0] for t in range(12)]
    assert any(h.skipped for h in history) and not all(h.skipped for h in history)
    for r, e in enumerate(engines):
        successor = engines[(r + 1) % 3]
        assert_state_equal(e.replica_of_successor.model.state_dict(), successor.model.state_dict())
        assert e.loop.scaler.state_dict() == successor.loop.scaler.state_dict()


def test_a_skipped_step_does_not_step_the_optimizer_or_the_scheduler():
    """Every step overflows (the scale stays huge): the weights stay the
    initial ones and the scheduler never moves; BatchNorm statistics move as the forwards ran."""
    job = _job(Pipeline(stages=2), precision="16-mixed",
               loss_scale={"init_scale": 2.0 ** 60}).replace(model=lambda: pm.mlp(bn=True))
    torch.manual_seed(job.seed)
    init = {k: v.clone() for k, v in job.model().state_dict().items()}
    state, history = train_local(job, 3)
    assert all(h.skipped for h in history)
    for k, v in init.items():
        if "running" in k:
            assert not torch.equal(state[k], v), k
        elif v.is_floating_point():
            assert torch.equal(state[k], v), k
    # the scale backed off once per step, from its initial value, as GradScaler's
    _, ref = plain_loop(job.replace(model=pm.mlp), 3)
    assert [h.loss_scale for h in history] == [h["loss_scale"] for h in ref]
    assert all(h["skipped"] for h in ref)


# ---- activation checkpointing and compile ----------------------------------------------------------
@pytest.mark.parametrize("spec", ["every", nn.Linear, ("3", "Dropout")], ids=["every", "class", "names"])
def test_activation_checkpointing_is_bit_identical(spec):
    pipeline = Pipeline(stages=2, schedule="zb_h1")
    base = _job(pipeline, virtual_nodes=4, precision="bf16-mixed")
    plain, plain_h = train_local(base, 2, deterministic=True)
    ckpt, ckpt_h = train_local(base.replace(activation_checkpointing=spec), 2, deterministic=True)
    assert_state_equal(ckpt, plain)
    assert [h.loss for h in ckpt_h] == [h.loss for h in plain_h]


def test_activation_checkpointing_wraps_the_pieces_layers():
    job = _job(Pipeline(stages=2), activation_checkpointing="every")
    dataset = job.build_dataset()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    engine = build_engine(job, job.pipeline, bounds, 1, dataset=dataset, deterministic=False,
                          device=torch.device("cpu"))
    for piece in engine.pieces.values():
        assert all(getattr(layer.forward, "__virtualflow_checkpointed__", False) for layer in piece.children())
    with pytest.raises(ValueError, match="neither module names nor class names"):
        build_engine(job.replace(activation_checkpointing=("99",)), job.pipeline, bounds, 0, dataset=dataset,
                     deterministic=False, device=torch.device("cpu"))


@pytest.mark.parametrize("schedule, checkpointing", [("1f1b", "every"), ("2bw", None)])
def test_compile_matches_eager_and_compiles_each_piece_once(schedule, checkpointing):
    """(dynamo's plain "eager" backend does not restore the random state for a checkpointed
    recompute, so dropout differs there: aot_eager, like inductor, recomputes in its graph.)"""
    from torch._dynamo.utils import counters

    job = _job(Pipeline(stages=2, schedule=schedule), virtual_nodes=4, activation_checkpointing=checkpointing)
    eager, eager_h = train_local(job, 3)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_h = train_local(job.replace(compile={"backend": "aot_eager"}), 3)
    # one graph per piece (2 workers x 1 piece) for 3 steps x 4 micro-batches: no recompilation
    assert counters["stats"]["unique_graphs"] == 2 and counters["frames"]["ok"] == 2
    assert_state_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert [h.loss for h in compiled_h] == pytest.approx([h.loss for h in eager_h], rel=1e-6)


# ---- metrics, optimizer factories, state, refusals -------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_loss_metrics_are_the_global_batch_means(schedule):
    job = _job(Pipeline(stages=2, schedule=schedule), output_loss=_mse_with_metrics)
    steps = 3
    _, ref = plain_loop(job.replace(pipeline=Pipeline(stages=2)), 1)
    for replicas in (1, 2):
        _, history = train_local(job, steps, replicas=replicas)
        assert [sorted(h.metrics) for h in history] == [["bias", "mae"]] * steps
        assert history[0].metrics == pytest.approx(ref[0]["metrics"], rel=1e-5)


def test_an_optimizer_factory_taking_the_model_gets_the_stage_module():
    seen: list[list[str]] = []

    def no_decay_on_biases(model):
        names = [n for n, _ in model.named_parameters()]
        seen.append(names)
        decay = [q for n, q in model.named_parameters() if not n.endswith("bias")]
        rest = [q for n, q in model.named_parameters() if n.endswith("bias")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=3e-3, eps=1e-5)

    job = _job(Pipeline(stages=2), virtual_nodes=4, optimizer=no_decay_on_biases)
    state, _ = train_local(job, 3)
    # each stage's factory saw that stage's parameters, under the whole model's names
    torch.manual_seed(job.seed)
    whole = [n for n, _ in job.model().named_parameters()]
    assert sorted(n for names in seen for n in names) == sorted(whole)
    assert all(len(names) < len(whole) for names in seen)
    ref_state, _ = plain_loop(job, 3)
    assert_state_close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_the_scaler_state_travels_with_a_stage():
    job = _job(Pipeline(stages=2), virtual_nodes=4, **FP16_OVERFLOW)
    dataset = job.build_dataset()
    torch.manual_seed(job.seed)
    bounds = resolve_bounds(job.pipeline, len(layers_of(job.model())))
    engines = [build_engine(job, job.pipeline, bounds, r, dataset=dataset, deterministic=False,
                            device=torch.device("cpu")) for r in range(2)]
    driver = LocalDriver(engines)
    driver.set_layout(contiguous_assignment(job.virtual_nodes, 1))
    driver.run(0, 3)
    state = stage_state(engines[1])
    assert state["grad_scaler"]["scale"] == engines[1].loop.scaler.scale < 2.0 ** 24
    fresh = build_engine(job, job.pipeline, bounds, 1, dataset=dataset, deterministic=False,
                         device=torch.device("cpu"))
    assert fresh.loop.scaler.scale == 2.0 ** 24
    load_stage_state(fresh, state)
    assert fresh.loop.scaler.state_dict() == engines[1].loop.scaler.state_dict()


@pytest.mark.parametrize("knobs", [dict(max_grad_norm=1.0), dict(precision="16-mixed"),
                                   dict(activation_checkpointing="every")], ids=["clip", "fp16", "checkpointing"])
def test_no_flush_schedules_refuse_the_knobs_they_cannot_honour(knobs):
    """Clipping and loss scaling need the whole step before any update; a checkpointed recompute
    would use the newest weights, not the stashed version (it changes the gradients: measured)."""
    from virtualflow.launching.pipeline import plan_pipeline

    job = _job(Pipeline(stages=2, schedule="2bw"), virtual_nodes=4, **knobs)
    with pytest.raises(ValueError, match="use a flush schedule") as refused:
        train_local(job, 1)
    assert next(iter(knobs)) in str(refused.value)
    with pytest.raises(ValueError, match="use a flush schedule"):  # at launch, before any worker
        plan_pipeline(job, job.build_dataset(), 2)


def test_bf16_on_a_no_flush_schedule_trains():
    job = _job(Pipeline(stages=2, schedule="async", window=2), virtual_nodes=4, precision="bf16-mixed")
    _, history = train_local(job, 2)
    assert all(h.loss > 0 and not h.bad_vns for h in history)
