"""The training loop's knobs in the VN engine, in-process on one worker, against the plain PyTorch
loop of tests/loop_reference.py: mixed precision, clipping by the whole step's norm, loss scaling
with skipped steps, activation checkpointing, compile, metrics from the loss, an optimizer
factory that takes the model, and the checks that refuse bad combinations."""

from __future__ import annotations

import types

import pytest
import torch

import virtualflow as vf
from virtualflow.comm.groups import Group
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.data import DataPlan
from virtualflow.plan.vnmap import contiguous_assignment
from virtualflow.runtime.vn_worker import VNWorkerEngine
from lm_jobs import Block, lm_job, lm_loss_with_metrics, make_job_fp16
from loop_reference import loop_train


def engine(job: vf.Job, *, deterministic: bool = False, reduction: str = "allreduce"):
    ds = job.build_dataset()
    plan = DataPlan.of_job(job, len(ds))
    cfg = types.SimpleNamespace(options=WorkerOptions(deterministic=deterministic, reduction=reduction, shard_replicas=0,
                                                      deterministic_exchange="auto", loader_workers=0, breakdown=False))
    eng = VNWorkerEngine.build(job, ds, plan, cfg, torch.device("cpu")).vn
    eng.set_membership(Group(0, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))
    return eng


def run(job, steps, **kw):
    eng = engine(job, **kw)
    outcomes = [eng.step(s) for s in range(steps)]
    return eng, outcomes


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close_states(a, b, rtol, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-identical: {bad}"


@pytest.mark.parametrize("deterministic,reduction", [(False, "allreduce"), (True, "allreduce"), (True, "sharded")])
def test_bf16_clipping_adamw_groups_match_the_plain_loop(deterministic, reduction):
    """bf16 autocast, clip_grad_norm_(1.0), AdamW with groups chosen from the model, warmup +
    cosine: the engine's weights, losses and reported norms equal the plain loop's (the clip is
    active: the norms are above 1)."""
    job = lm_job()
    steps = 5
    ref_model, ref = loop_train(job, steps)
    eng, outs = run(job, steps, deterministic=deterministic, reduction=reduction)
    assert [o.skipped for o in outs] == [False] * steps
    assert max(ref["norm"]) > 1.0, "the clip never acted: the test would not see a wrong norm"
    for o, loss, norm in zip(outs, ref["loss"], ref["norm"]):
        # the sums run in another order (the tree, the buckets): bf16 rounding and Adam's
        # normalisation of small gradients carry that difference a little further each step
        assert o.loss == pytest.approx(loss, rel=1e-4)
        assert o.grad_norm == pytest.approx(norm, rel=1e-3)
    assert_close_states(weights(eng.model), weights(ref_model), rtol=1e-3, atol=1e-4)
    # the groups survive: biases and norms are not decayed
    assert [g["weight_decay"] for g in eng.optimizer.param_groups] == [0.1, 0.0]


def test_deterministic_sharded_equals_deterministic_allreduce_with_clipping():
    """The block norm is the same whether the gradient is whole or cut into chunks."""
    job = lm_job()
    a, outs_a = run(job, 4, deterministic=True)
    b, outs_b = run(job, 4, deterministic=True, reduction="sharded")
    assert [o.grad_norm for o in outs_a] == [o.grad_norm for o in outs_b]
    assert_equal_states(weights(a.model), weights(b.model))


def test_fp16_loss_scaling_skips_the_same_steps_as_grad_scaler():
    """A scale of 2**20 overflows float16: the engine skips exactly the steps GradScaler skips
    (the first, and again when the scale has grown back), ends with the same scale, and the
    weights agree."""
    job = make_job_fp16()
    steps = 8
    ref_model, ref = loop_train(job, steps)
    eng, outs = run(job, steps)
    assert any(ref["skipped"]) and not all(ref["skipped"])
    assert [o.skipped for o in outs] == ref["skipped"]
    assert [o.loss_scale for o in outs] == ref["scale"]
    assert eng.scaler.state_dict()["scale"] == ref_scale_after(job, ref)
    assert_close_states(weights(eng.model), weights(ref_model), rtol=2e-3, atol=2e-4)


def ref_scale_after(job, ref):
    """GradScaler's rule applied to the skips: halve on a skip, double after growth_interval
    applied steps in a row."""
    scale, tracker = job.loss_scale["init_scale"], 0
    for skipped in ref["skipped"]:
        if skipped:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == job.loss_scale["growth_interval"]:
                scale, tracker = scale * 2.0, 0
    return scale


def test_activation_checkpointing_trains_the_same_model_bit_for_bit():
    """Dropout inside the checkpointed blocks draws the same mask on recompute."""
    plain, outs_a = run(lm_job(), 3, deterministic=True)
    ckpt, outs_b = run(lm_job(activation_checkpointing=Block), 3, deterministic=True)
    names, _ = run(lm_job(activation_checkpointing="every"), 3, deterministic=True)
    assert [o.loss for o in outs_a] == [o.loss for o in outs_b]
    assert_equal_states(weights(plain.model), weights(ckpt.model))
    assert_equal_states(weights(plain.model), weights(names.model))
    assert getattr(ckpt.model.h[0].forward, "__virtualflow_checkpointed__", False)


def test_activation_checkpointing_matches_the_plain_checkpointed_loop():
    job = lm_job(activation_checkpointing=Block)
    ref_model, _ = loop_train(job, 3, activation_checkpointing=Block)
    eng, _ = run(job, 3)
    assert_close_states(weights(eng.model), weights(ref_model), rtol=1e-4, atol=1e-5)


def test_compile_compiles_once_for_every_vn_step_and_generation():
    """torch.compile once per worker: no recompilation per VN, per step or after a new
    generation (dynamo's counters); the result is eager's within float tolerance."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager, _ = run(lm_job(precision="32"), 3)
    job = lm_job(precision="32", compile={"backend": "aot_eager"})
    eng = engine(job)
    eng.step(0)
    frames = dict(counters["stats"])
    eng.step(1)
    eng.set_membership(Group(1, 0, 1, None), contiguous_assignment(job.virtual_nodes, 1))  # a new generation
    eng.step(2)
    assert counters["stats"]["unique_graphs"] == frames["unique_graphs"] >= 1
    assert_close_states(weights(eng.model), weights(eager.model), rtol=1e-4, atol=1e-5)
    assert set(eng.model.state_dict()) == set(eager.model.state_dict())  # no _orig_mod. prefix


def test_loss_metrics_are_weighted_means_over_the_global_batch():
    job = lm_job(loss=lm_loss_with_metrics, precision="32", max_grad_norm=None)
    eng, outs = run(job, 2)
    ds = job.build_dataset()
    from reference import step_batch

    torch.manual_seed(job.seed)
    model = job.model()
    idx = step_batch(job, len(ds), 0)
    x, y = ds.tensors
    model.eval()  # dropout changes logits, not which metric is computed: compare on the shapes only
    assert set(outs[0].metrics) == {"acc", "tokens"}
    # every VN has B/V samples of SEQ tokens: the weighted mean of "tokens" is exactly that
    assert outs[0].metrics["tokens"] == pytest.approx(y[idx[: job.global_batch_size // job.virtual_nodes]].numel())
    assert 0.0 <= outs[0].metrics["acc"] <= 1.0
    assert outs[0].grad_norm is None and not outs[0].skipped


def test_loss_metrics_weighted_by_vn_share():
    """Two VNs of different mean values: the reported metric is their mean weighted by n_v / B."""
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(8, 1), torch.zeros(8, 1))

    def loss(model, batch):
        x, _ = batch
        return model(x).pow(2).mean(), {"xmean": x.mean()}

    job = vf.Job(model=lambda: torch.nn.Linear(1, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                 dataset=data, global_batch_size=8, virtual_nodes=2, loss=loss)
    _, outs = run(job, 1)
    assert outs[0].metrics["xmean"] == pytest.approx(3.5)  # the mean of 0..7 whatever the VN split


# -- refusals ------------------------------------------------------------------------------------
def test_bad_knobs_name_value_rule_and_knob():
    with pytest.raises(ValueError, match=r"precision='fp8'.*--precision"):
        lm_job(precision="fp8")
    with pytest.raises(ValueError, match=r"loss_scale.*16-mixed"):
        lm_job(loss_scale={"init_scale": 8.0})
    with pytest.raises(ValueError, match=r"max_grad_norm=-1.*> 0"):
        lm_job(max_grad_norm=-1)
    with pytest.raises(TypeError, match="compile="):
        lm_job(compile="yes")
    with pytest.raises(ValueError, match=r"growth_factor.*> 1"):
        lm_job(precision="16-mixed", loss_scale={"growth_factor": 0.5})
    with pytest.raises(ValueError, match=r"'eager'.*activation_checkpointing.*dropout mask.*aot_eager"):
        lm_job(compile={"backend": "eager"}, activation_checkpointing="every")
    with pytest.raises(ValueError, match=r"--max-grad-norm"):
        vf.LaunchOptions(steps=1, max_grad_norm=0.0)


def test_preflight_refuses_unknown_module_names_and_half_weights_with_fp16():
    from virtualflow.launching.preflight import preflight

    job = lm_job(activation_checkpointing=["h.0", "nope"])
    ds = job.build_dataset()
    plan = DataPlan.of_job(job, len(ds))
    with pytest.raises(ValueError, match=r"\['nope'\].*modules include"):
        preflight(job, ds, plan)
    half = lm_job(model=lambda: __import__("lm_jobs").TinyLM().half(), precision="16-mixed")
    with pytest.raises(ValueError, match=r"16-mixed.*float32.*parameters are torch.float16.*--precision"):
        preflight(half, ds, plan)


def test_preflight_refuses_compile_that_cannot_work():
    """An unknown backend, and fullgraph=True on a forward with a graph break, are refused with
    the knob named (dynamo's own reason in the message)."""
    from virtualflow.launching.preflight import preflight

    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))

    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x):
            y = self.lin(x)
            print("a graph break")  # dynamo cannot put print in a graph
            return y

    def job(**kw):
        return vf.Job(model=Breaks, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=data,
                      global_batch_size=4, virtual_nodes=2, loss=lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), **kw)

    plan = DataPlan(8, 4, 2, 0)
    with pytest.raises(ValueError, match=r"no such backend.*Job.compile"):
        preflight(job(compile={"backend": "nonesuch"}), data, plan)
    with pytest.raises(ValueError, match=r"cannot trace.*fullgraph.*Job.compile"):
        preflight(job(compile={"backend": "aot_eager", "fullgraph": True}), data, plan)
    preflight(job(compile={"backend": "aot_eager"}), data, plan)  # graph breaks are fine without fullgraph


def test_compile_compiles_a_plain_sequential():
    """torch's own containers are compiled too (nn.Module.compile would build no graph for them)."""
    from torch._dynamo.utils import counters

    from virtualflow.runtime.model_prep import compile_model

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    compile_model(model, {"backend": "aot_eager"})
    model(torch.randn(3, 4)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_block_sums_do_not_depend_on_the_cut():
    """Any cut of a parameter on its block boundaries gives the same block sums bit for bit (what
    makes the norm independent of the worker count and the chunks); a cut inside a block is refused."""
    from virtualflow.runtime.clipping import BLOCK, ROWS_PER_PASS, NormBlocks

    total = (ROWS_PER_PASS + 3) * BLOCK + 77
    g = torch.randn(total, generator=torch.Generator().manual_seed(0))
    blocks = NormBlocks([total], torch.float32)
    whole = blocks.zeros(torch.device("cpu"))
    blocks.fill(whole, 0, g)
    assert torch.allclose(whole.sum(), g.pow(2).sum(), rtol=1e-5)
    for cuts in ([0, BLOCK, total], [0, 5 * BLOCK, (ROWS_PER_PASS + 1) * BLOCK, total],
                 [0, (ROWS_PER_PASS + 3) * BLOCK, total]):
        acc = blocks.zeros(torch.device("cpu"))
        for a, b in zip(cuts, cuts[1:]):
            part = blocks.zeros(torch.device("cpu"))
            blocks.fill(part, 0, g[a:b], first=a // BLOCK)
            acc += part
        assert torch.equal(acc, whole), cuts
    with pytest.raises(ValueError, match="blocks"):
        blocks.fill(whole, 0, g[:100])


def test_loss_scaler_follows_grad_scaler_with_any_factors():
    """Factors that are not powers of two: the scale is GradScaler's at every step (the product in
    double, kept in float32), and the state dicts have the same keys."""
    from virtualflow.runtime.amp import LossScaler

    knobs = {"init_scale": 2.0 ** 60, "backoff_factor": 0.9, "growth_factor": 1.7, "growth_interval": 2}
    ours, theirs = LossScaler(knobs), torch.amp.GradScaler("cpu", **knobs)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for overflow in [True, True, False, False, False, True, False, False, True, True, False, False]:
        theirs.scale(torch.ones(1))
        p.grad = torch.tensor([float("inf") if overflow else 1.0])
        theirs.unscale_(opt)
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
        assert ours.scale == theirs.get_scale()
    assert set(ours.state_dict()) == set(theirs.state_dict())
