"""The sharded optimizer (``reduction="sharded"``): each worker updates its chunk of the flat
parameter vector and holds only that chunk's optimizer state.

In-process tests run p "workers" as threads over a small in-memory fabric (all-gather and
all-reduce by copying), so the optimizer's slicing, update and state gathering are proven
without processes: the standard is a plain PyTorch optimizer stepping the whole model with the
same gradients, bit for bit. The end-to-end tests run the real engine on the local backend
(own ring reduce-scatter and all-gather over gloo) against the default engine.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from torch import nn

import virtualflow as vf
from virtualflow.runtime.sharded import FlatParams, ShardedOptimizer, ShardLost, check_optimizer
from conftest import assert_same_training, assert_state_close, flat_optimizer_state, wait_for_step
from vn_reference import deterministic_reference
import jobs


class Fabric:
    """Collectives between p threads: in-place all-gather by chunk, all-reduce in rank order."""

    def __init__(self, p: int) -> None:
        self.p = p
        self.barrier = threading.Barrier(p, timeout=30)
        self.slots: list = [None] * p

    def all_gather(self, rank: int, buf: torch.Tensor, bounds) -> None:
        self.slots[rank] = buf
        self.barrier.wait()
        for q, (lo, hi) in enumerate(bounds):
            if q != rank:
                buf[lo:hi].copy_(self.slots[q][lo:hi])
        self.barrier.wait()

    def all_reduce(self, rank: int, v: torch.Tensor) -> None:
        self.slots[rank] = v.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for q in range(1, self.p):
            total += self.slots[q]
        self.barrier.wait()
        v.copy_(total)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.Tanh(), nn.Linear(5, 3))


def grads(steps: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=g) for _ in range(steps)]


def make_opt(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    ps = list(model.parameters())
    if kind == "adam_groups":  # two groups with their own learning rates
        return torch.optim.Adam([{"params": ps[:2], "lr": 0.02}, {"params": ps[2:]}], lr=0.005, weight_decay=0.01)
    if kind == "adamw_amsgrad":
        return torch.optim.AdamW(ps, lr=0.01, amsgrad=True)
    if kind == "sgd_mixed":  # momentum in one group, none in the other: state only where torch keeps it
        return torch.optim.SGD([{"params": ps[:3], "momentum": 0.9}, {"params": ps[3:]}], lr=0.05, nesterov=False)
    raise AssertionError(kind)


def reference(kind: str, gs: list[torch.Tensor]):
    model = net()
    opt = make_opt(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    flat = FlatParams([p for p in model.parameters()])
    for g in gs:
        flat.grad.copy_(g)
        opt.step()
        sched.step()
    return model.state_dict(), opt.state_dict()


def run_sharded(kind: str, gs: list[torch.Tensor], sizes: list[int]) -> list:
    """Train with len(gs) steps, the worker count changing to sizes[k] every len(gs)//len(sizes)
    steps (the whole state gathered and cut again at each change); returns every rank's final
    (model state, gathered optimizer state, bytes of optimizer state held) of the last size."""
    models = [net() for _ in range(max(sizes))]
    opts = [make_opt(kind, m) for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    flats = [FlatParams(list(m.parameters())) for m in models]
    shards = [ShardedOptimizer(o, f) for o, f in zip(opts, flats)]
    per = len(gs) // len(sizes)
    out: list = [None] * max(sizes)
    errors: list[BaseException] = []

    for phase, p in enumerate(sizes):
        fabric = Fabric(p)
        steps = gs[phase * per:] if phase == len(sizes) - 1 else gs[phase * per:(phase + 1) * per]

        def worker(rank: int) -> None:
            try:
                s, f = shards[rank], flats[rank]
                s.shard(rank, p)
                for g in steps:
                    f.grad.copy_(g)  # the reduced gradient (only the chunk is read)
                    s.step()
                    fabric.all_gather(rank, f.flat, s.bounds)
                    s.scheduler_step(scheds[rank])
                held = s.state_bytes()
                lo, hi = s.chunk()

                def everywhere(chunk: torch.Tensor) -> torch.Tensor:
                    whole = chunk.new_zeros(f.numel)
                    whole[lo:hi] = chunk
                    fabric.all_gather(rank, whole, s.bounds)
                    return whole

                def to_rank0(chunk: torch.Tensor):
                    whole = everywhere(chunk)
                    return whole if rank == 0 else None

                # A checkpoint's gather: only rank 0 gets the state (the others None).
                at_root = s.gather_state(to_rank0, lambda v: fabric.all_reduce(rank, v))
                assert (at_root is None) == (rank != 0)
                state = s.gather_state(everywhere, lambda v: fabric.all_reduce(rank, v))
                if at_root is not None:
                    assert_optimizer_state_equal(at_root, state)
                s.keep_full(state)
                out[rank] = (models[rank].state_dict(), state, held)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                fabric.barrier.abort()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        # A worker that sat this phase out (the size shrank) gets the whole state as a newcomer would.
        for r in range(p, max(sizes)):
            models[r].load_state_dict(out[0][0])
            shards[r].load_state(out[0][1])
            scheds[r].load_state_dict(scheds[0].state_dict())
    return out[: sizes[-1]]


def assert_optimizer_state_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        assert sorted(a["state"][k]) == sorted(b["state"][k]), k
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (k, name)
                assert torch.equal(v, w), (k, name)
            else:
                assert v == w


@pytest.mark.parametrize("kind", ["adam_groups", "adamw_amsgrad", "sgd_mixed"])
@pytest.mark.parametrize("sizes", [[1], [2], [3], [2, 3, 2], [4, 1]])
def test_sharded_update_is_bit_identical_to_the_whole_optimizer(kind, sizes):
    model = net()
    numel = sum(p.numel() for p in model.parameters())
    gs = grads(6, numel)
    ref_model, ref_opt = reference(kind, gs)
    results = run_sharded(kind, gs, sizes)
    for model_state, opt_state, _ in results:
        for k, v in ref_model.items():
            assert torch.equal(model_state[k], v), k
        assert_optimizer_state_equal(opt_state, ref_opt)


def test_each_worker_holds_its_chunk_of_the_optimizer_state():
    model = net()
    numel = sum(p.numel() for p in model.parameters())
    gs = grads(2, numel)
    results = run_sharded("adamw_amsgrad", gs, [4])
    held = [r[2] for r in results]
    moments = 3 * numel * 4  # exp_avg, exp_avg_sq, max_exp_avg_sq in float32
    # Each worker holds about a quarter of the moments (chunks on 16-element boundaries), plus
    # one step counter per parameter piece.
    assert sum(held) >= moments
    for h in held:
        assert h <= moments / 4 + 3 * 16 * 4 + 4 * 8
    assert max(held) < moments / 2


def test_a_failure_loses_a_chunk_and_says_how_to_recover():
    model = net()
    s = ShardedOptimizer(torch.optim.Adam(model.parameters()), FlatParams(list(model.parameters())))
    s.shard(0, 2)
    with pytest.raises(ShardLost, match=r"--resume RUN_DIR.*reduction='allreduce'"):
        s.check_held()


def test_unsupported_optimizers_and_layouts_are_refused_with_the_knob():
    model = net()
    ps = list(model.parameters())
    for opt in (torch.optim.RMSprop(ps), torch.optim.Adagrad(ps), torch.optim.LBFGS(ps)):
        with pytest.raises(ValueError, match=rf"Adam, AdamW and SGD; Job.optimizer built torch.optim.*"
                                             rf"{type(opt).__name__}.*--reduction allreduce"):
            check_optimizer(opt, ps)
    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    with pytest.raises(ValueError, match=r"one dtype and device.*float32.*float64"):
        check_optimizer(torch.optim.Adam(mixed.parameters()), list(mixed.parameters()))
    vf.LaunchOptions(steps=1, reduction="sharded", pipeline_stages=2)  # each stage sharded over its replicas
    with pytest.raises(ValueError, match=r"shard_replicas=1 .*pipeline_stages=2.*--shard-replicas"):
        vf.LaunchOptions(steps=1, reduction="sharded", shard_replicas=1, pipeline_stages=2)
    with pytest.raises(ValueError, match=r"reduction='tree' is not known.*--reduction"):
        vf.LaunchOptions(steps=1, reduction="tree")


def test_flat_parameters_keep_the_model_and_its_state_dict():
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatParams(list(model.parameters()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    x = torch.randn(4, 7)
    model(x).sum().backward()
    manual = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(flat.grad, manual)  # autograd accumulated into the flat gradient
    model.zero_grad(set_to_none=True)
    flat.zero_grad()  # re-attached
    model(x).sum().backward()
    assert torch.equal(flat.grad, manual)


# -- end to end on the local backend ----------------------------------------------------------

FOREVER = 1_000_000


def generations_run(result) -> list[str]:
    """One line per stretch of steps a run made with the same generation: its steps and VN map
    (where the resizes landed and what the map was)."""
    lines, start = [], 0
    hist = result.history
    for i, h in enumerate(hist):
        if i == len(hist) - 1 or hist[i + 1].get("generation") != h.get("generation"):
            lines.append(f"  steps {hist[start]['step']}-{h['step']}: generation {h.get('generation')}, "
                         f"VN map {h.get('vns')}")
            start = i + 1
    return lines


def differing(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ in any bit (or are missing on one side)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t.reshape(-1)
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k].shape != b[k].shape
                  or a[k].dtype != b[k].dtype or not torch.equal(raw(a[k]), raw(b[k])))


SEEN_ABOVE = ("checkpoint", "formed", "generation", "membership_phase", "exchange", "step")


def divergence(result, ref, events: list[dict]) -> str:
    """What a bit-identity failure needs to be explained: the first step whose loss (the tree's
    sum, bit-identical in deterministic mode) differs, the losses around it, each run's
    generations, failures and the checkpoints written."""
    mine = {h["step"]: h["loss"] for h in result.history}
    theirs = {h["step"]: h["loss"] for h in ref.history}
    first = next((s for s in sorted(theirs) if mine.get(s) != theirs[s]), None)
    out = [f"first step whose loss differs: {first} (none: every step's loss is equal, so the last update "
           f"or the final state's gathering differs)" if first is None else
           f"first step whose loss differs: {first}"]
    if first is not None:
        out += [f"  step {s}: {mine.get(s)!r} here, {theirs[s]!r} in the reference"
                for s in range(max(0, first - 2), first + 3) if s in theirs]
    out.append(f"  final model tensors that differ: {differing(result.state_dict, ref.state_dict)}; optimizer "
               f"state: {differing(flat_optimizer_state(result.optimizer_state_dict), flat_optimizer_state(ref.optimizer_state_dict))}")
    out += ["this run:"] + generations_run(result)
    out += [f"  generation {e['generation']} formed at step {e['step']}: members {e['members']} ({e.get('change')}), "
            f"state sent from {e.get('source')} to {e.get('receivers')}" for e in events if e["event"] == "formed"]
    out.append(f"  checkpoints at steps {[e['step'] for e in events if e['event'] == 'checkpoint']}")
    out.append(f"  failures: {result.failures}; other events: "
               f"{[(e['event'], e.get('step')) for e in events if e['event'] not in SEEN_ABOVE]}")
    out += ["the reference:"] + generations_run(ref) + [f"  failures: {ref.failures}"]
    return "\n".join(out)


@pytest.mark.slow
def test_sharded_deterministic_run_with_resizes_and_an_uneven_map_is_bit_identical(run_dir):
    """2 workers of unequal speed (uneven VN map) -> 3 -> 2, a checkpoint on the way: weights,
    optimizer state and LR schedule bit-identical to the unsharded deterministic run. Where the
    resizes land and which maps the generations get depend on timing (when the newcomer is up,
    the measured speeds): tests/unit/test_sharded_resizes.py runs chosen ones in process. A
    failure prints where the runs parted (:func:`divergence`)."""
    handle = vf.launch(jobs.elastic_job, workers=2, steps=FOREVER, deterministic=True, reduction="sharded",
                       slowdowns=[1.0, 2.5], checkpoint_every=4, run_dir=run_dir)
    for n in (3, 2):
        wait_for_step(handle, handle.status()["step"] + 3)
        handle.resize(n, wait=True, timeout_s=120)
    wait_for_step(handle, handle.status()["step"] + 3)
    result = handle.stop()
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    sizes = [h["workers"] for h in result.history]
    assert [n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] != n] == [2, 3, 2], "\n".join(
        generations_run(result))
    assert any(len(set(map(len, h["vns"]))) > 1 for h in result.history), "the map never became uneven"
    ref = deterministic_reference(jobs.elastic_job().replace(loss=jobs.cross_entropy), result.steps)
    try:
        assert [h["loss"] for h in result.history] == [h["loss"] for h in ref.history]
        assert_same_training(result, ref)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{divergence(result, ref, events)}") from None
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    assert checkpoints and all(e["step"] % 4 == 0 and e["save_s"] >= 0 for e in checkpoints)


@pytest.mark.slow
def test_sharded_default_mode_matches_the_all_reduce_engine(run_dir):
    """Default mode sums in another order (the ring's), so: equal within float tolerance. (A
    job with a bias right before a BatchNorm is not a fair check: that bias's gradient is
    rounding noise, which Adam scales up to full-size steps in either engine.)"""
    job = jobs.regression_job("adam", virtual_nodes=6, global_batch_size=36)
    result = vf.train(job, workers=3, steps=12, reduction="sharded", slowdowns=[1.0, 1.0, 3.0], run_dir=run_dir)
    ref = vf.train(job, workers=3, steps=12)
    assert_state_close(result.state_dict, ref.state_dict, rtol=1e-5, atol=1e-6)
    assert [h["step"] for h in result.history] == list(range(12))
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    # Optimizer memory ÷ 3: each worker held a third of Adam's moments (chunks on 16-element
    # boundaries, plus one step counter per parameter piece); the default engine holds them all.
    whole = set(ref.optimizer_bytes.values())
    assert len(whole) == 1
    whole = whole.pop()
    assert whole > 0 and len(result.optimizer_bytes) == 3
    for held in result.optimizer_bytes.values():
        assert held <= whole / 3 + 2 * 16 * 4 + 4 * 4


@pytest.mark.slow
def test_a_failure_with_sharded_state_stops_with_the_way_out_and_resume_continues_exactly(run_dir):
    """One copy of each optimizer chunk: a crash cannot be repaired in place. The job stops naming
    --resume; resuming from the last checkpoint (the optimizer state gathered whole) loses nothing."""
    plan = vf.FaultPlan([vf.Fault(worker=1, step=6, phase="during_reduction")])
    with pytest.raises(vf.TrainingError, match=r"--resume RUN_DIR"):
        vf.train(jobs.elastic_job, workers=3, steps=12, deterministic=True, reduction="sharded", fault_plan=plan,
                 checkpoint_every=4, run_dir=run_dir)
    result = vf.train(jobs.elastic_job().replace(loss=jobs.cross_entropy), workers=2, steps=12, deterministic=True,
                      reduction="sharded", resume=run_dir)
    assert result.history[0]["step"] == 4
    ref = deterministic_reference(jobs.elastic_job().replace(loss=jobs.cross_entropy), 12)
    assert_same_training(result, ref, first_step=4)
