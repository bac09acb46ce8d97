"""Sharded parameters (``reduction="fsdp"``) against the unsharded deterministic run and a plain loop.

Every worker is a thread of this process (``train_threads``: the real engines over real gloo
groups). Deterministic mode: the weights and the optimizer state after training on 1, 2, 3 and 4
workers, through resizes, with each knob, are the unsharded deterministic run's, byte for byte
(the model is dropout-free: threads share the random generator; tests/e2e/test_fsdp_e2e.py runs
dropout in worker processes). Default mode: within float tolerance of a plain accumulation loop.
The pure parts (the in-order fold, the moves, the units) are checked against their definitions.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_state_equal
from fsdp_jobs import tied_gpt, tied_gpt_job
from loop_reference import loop_train
from virtualflow.comm.reduce import tree_reduce_local
from virtualflow.config.worker_options import WorkerOptions
from virtualflow.plan.param_shards import BLOCK_ELEMS, InOrderFold, interleaved_assignment, moves, unit_bounds
from virtualflow.plan.vnmap import covering_nodes
from virtualflow.runtime.clipping import BLOCK
from virtualflow.runtime.fsdp.units import ROOT, check_units, resolve_units, unit_params
from virtualflow.runtime.grid_threads import Generation, train_threads


def train(job, members=None, steps=3, *, gens=None, deterministic=True, reduction="fsdp", **knobs):
    gens = gens or [Generation(members=tuple(range(members)), steps=steps)]
    opts = WorkerOptions(deterministic=deterministic, reduction=reduction, **knobs)
    return train_threads(job, gens, options=opts, timeout_s=60)


def assert_same_run(a, b) -> None:
    assert_state_equal(a.state["model"], b.state["model"])
    sa, sb = a.state["optimizer"]["state"], b.state["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for pos in sa:
        assert_state_equal(sa[pos], sb[pos])
    assert [o.loss for o in a.outcomes] == [o.loss for o in b.outcomes]


# -- deterministic mode: the unsharded run's bits --------------------------------------------
LOOPS = {
    "bf16, clipping": dict(precision="bf16-mixed", max_grad_norm=0.05),
    "activation checkpointing, clipping": dict(activation_checkpointing="every", max_grad_norm=0.5),
    "16-mixed loss scaling": dict(precision="16-mixed"),
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_bit_identical_to_the_unsharded_run_on_1_to_4_workers(loop):
    job = tied_gpt_job(**LOOPS[loop])
    ref = train(job, 1, reduction="allreduce")
    assert len({o.loss for o in ref.outcomes}) == 3  # it trains
    for workers in (1, 2, 3, 4):
        assert_same_run(ref, train(job, workers))


def test_a_worker_without_virtual_nodes_and_uneven_maps_run_ghost_rounds():
    job = tied_gpt_job(max_grad_norm=0.05)
    ref = train(job, 1, reduction="allreduce")
    for assignment in ([[0, 1, 2, 3, 4, 5, 6, 7], []], [[0], [1, 2, 3, 4, 5], [6, 7]]):
        got = train(job, gens=[Generation(members=tuple(range(len(assignment))), steps=3, assignment=assignment)])
        assert_same_run(ref, got)


def test_resizes_move_the_shards_and_keep_the_bits():
    job = tied_gpt_job(precision="bf16-mixed", max_grad_norm=0.05)
    ref = train(job, 1, steps=6, reduction="allreduce")
    shrink = [Generation(members=(0, 1, 2, 3), steps=2), Generation(members=(0, 1, 2), steps=2),
              Generation(members=(0, 1), steps=2)]
    grow_and_swap = [Generation(members=(0, 1), steps=2), Generation(members=(0, 1, 2, 3), steps=2),
                     Generation(members=(1, 3, 4), steps=2)]  # 0 and 2 leave, 4 joins
    for gens in (shrink, grow_and_swap):
        assert_same_run(ref, train(job, gens=gens))


@pytest.mark.parametrize("knobs", [dict(offload="cpu"), dict(keep_gathered=True), dict(reduce_dtype="bf16"),
                                   dict(shard_units=("Block",))])
def test_knobs_keep_the_bits(knobs):
    job = tied_gpt_job(max_grad_norm=0.05)
    assert_same_run(train(job, 1, reduction="allreduce"), train(job, 3, **knobs))


def test_gathering_in_bf16_is_bit_identical_across_worker_counts():
    """``param_dtype="bf16"`` (FSDP2's MixedPrecisionPolicy) rounds every gathered weight, so it is
    not the unsharded autocast run (which keeps LayerNorm and embedding weights in float32), but
    it is the same for any number of workers, and near the autocast run."""
    job = tied_gpt_job(precision="bf16-mixed")
    two, three = train(job, 2, param_dtype="bf16"), train(job, 3, param_dtype="bf16")
    assert_same_run(two, three)
    ref = train(job, 1, reduction="allreduce")
    for k, v in ref.state["model"].items():
        torch.testing.assert_close(three.state["model"][k], v, atol=5e-2, rtol=0)


def test_loader_threads_and_the_breakdown_keep_the_bits():
    job = tied_gpt_job(precision="bf16-mixed", max_grad_norm=0.05)
    got = train(job, 3, loader_workers=2, breakdown=True)
    assert_same_run(train(job, 1, reduction="allreduce"), got)
    for o in got.outcomes[1:]:  # per worker (step 0 has no previous step's intervals)
        assert len(o.breakdown) == 3 and all(w["forward_s"] > 0 and w["backward_s"] > 0 for w in o.breakdown)


def test_the_autoscalers_decisions_resize_sharded_parameters_bit_identically():
    """The real autoscale executor (``efficiency`` policy, step times from a fixed curve) decides
    the sizes; each decision is the next generation, as the membership controller applies it."""
    from test_autoscale_composition import STEP_S, Controller, Events
    from virtualflow.control.autoscale import EfficiencyPolicy, Limits
    from virtualflow.control.autoscale_executor import AutoscaleExecutor
    from virtualflow.plan.vnmap import contiguous_assignment

    job, steps = tied_gpt_job(max_grad_norm=0.05), 6
    ctl = Controller([0])
    ex = AutoscaleExecutor(EfficiencyPolicy(min_steps=2, warmup_steps=0), ctl, Events(), limits=Limits(1, 3),
                           global_batch_size=job.global_batch_size, virtual_nodes=job.virtual_nodes,
                           total_steps=steps, start_time=0.0, clock=lambda: 0.0)
    sizes = []
    for step in range(steps):
        ctl.members = list(range(ctl.target))
        n = len(ctl.members)
        sizes.append(n)
        ex.update([{"type": "step", "step": step, "samples": job.global_batch_size, "step_time_s": STEP_S[n],
                    "workers": n, "generation": len(set(sizes)) - 1, "members": list(ctl.members),
                    "time": float(step), "vns": contiguous_assignment(job.virtual_nodes, n), "compute_s": [0.1] * n,
                    "breakdown": None}])
    assert sizes == [1, 1, 2, 2, 3, 3]
    gens = [Generation(members=tuple(range(n)), steps=sizes.count(n)) for n in sorted(set(sizes))]
    assert_same_run(train(job, 1, steps=steps, reduction="allreduce"), train(job, gens=gens))


# -- default mode: a plain accumulation loop's result within float tolerance --------------------
def test_default_mode_matches_a_plain_accumulation_loop():
    job = tied_gpt_job(max_grad_norm=0.05)
    model, record = loop_train(job, 3)
    plain = model.state_dict()
    for workers in (2, 3):
        got = train(job, workers, deterministic=False)
        assert [round(o.loss, 4) for o in got.outcomes] == [round(x, 4) for x in record["loss"]]
        for k, v in plain.items():
            torch.testing.assert_close(got.state["model"][k], v, atol=2e-5, rtol=1e-4)


# -- what a worker holds -----------------------------------------------------------------------
def test_each_worker_holds_its_shards_only_between_steps():
    job = tied_gpt_job()
    run = train(job, 3)
    whole = sum(p.numel() for p in tied_gpt().parameters())
    held, opt = 0, 0
    for e in run.engines:
        store = e.vn.update.store
        assert all(u.full.untyped_storage().nbytes() == 0 for u in store.units[:-1])  # blocks freed
        held += sum(u.shard.numel() for u in store.units)
        opt += e.vn.update.state_bytes()
        assert e.vn.update.state_bytes() < 0.5 * 2 * 4 * whole  # AdamW's two moments: about a third here
    assert held == whole  # every element in exactly one shard
    assert opt == 2 * 4 * whole + 4 * sum(len(e.vn.update.pieces) for e in run.engines)  # + a step per piece


# -- the pure parts --------------------------------------------------------------------------------
def test_the_in_order_fold_is_the_tree_sum():
    for v in range(1, 14):
        leaves = [torch.randn(5, dtype=torch.float32) * 10 ** random.randint(-3, 3) for _ in range(v)]
        ref = tree_reduce_local([(0, v)], lambda i: leaves[i].clone())[(0, v)]
        fold, stack = InOrderFold(v), []
        for i in range(v):
            stack.append(leaves[i].clone())
            for _ in fold.push():
                right = stack.pop()
                stack[-1].add_(right)
        assert fold.complete and len(stack) == 1
        assert torch.equal(stack[0].view(torch.int32), ref.view(torch.int32))


def test_rounds_hand_out_consecutive_vn_ids():
    assert interleaved_assignment([3, 3, 2]) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert interleaved_assignment([0, 2]) == [[], [0, 1]]


def test_shards_start_on_norm_blocks_and_moves_cover_each_new_shard_once():
    assert BLOCK_ELEMS == BLOCK
    numels = [3 * BLOCK + 7, 30, 2 * BLOCK]
    for w in (1, 2, 3, 5):
        b = unit_bounds(numels, w)
        starts = {0, 3 * BLOCK + 7, 3 * BLOCK + 37} | {k * BLOCK for k in range(4)} | {
            3 * BLOCK + 37 + k * BLOCK for k in range(2)}
        assert b[0][0] == 0 and b[-1][1] == sum(numels) and all(lo in starts or lo == hi for lo, hi in b)
        for w2 in (1, 2, 4):
            new = unit_bounds(numels, w2)
            for d, (a, z) in enumerate(new):
                got = sorted((m.lo, m.hi) for m in moves(b, new) if m.dst == d)
                assert sum(hi - lo for lo, hi in got) == z - a and (not got or (got[0][0] == a and got[-1][1] == z))


def test_units_default_to_the_blocks_and_refuse_shared_weights():
    model = tied_gpt()
    units = unit_params(model, resolve_units(model, None))
    assert [u.name for u in units] == [f"transformer.h.{i}" for i in range(4)] + [ROOT]
    assert "lm_head.weight" not in units[-1].names  # the tied weight once, in the root unit
    with pytest.raises(ValueError, match=r"shard_units=\['nope'\].*--shard-units"):
        resolve_units(model, ["nope"])
    with pytest.raises(ValueError, match="inside unit"):
        resolve_units(model, ["transformer.h", "transformer.h.0"])
    model.transformer.h[1].mlp.c_fc.weight = model.transformer.h[0].mlp.c_fc.weight
    with pytest.raises(ValueError, match="shared by units"):
        unit_params(model, resolve_units(model, None))
    with pytest.raises(ValueError, match="fewer than workers"):
        check_units(units, 10 ** 6)
    assert covering_nodes(8, 0, 8) == [(0, 8)]


def test_a_sequential_with_parameterless_layers_shards_its_layers():
    """The default units of an ``nn.Sequential`` are its layers; an activation holds no parameter
    and is no unit."""
    import jobs
    job = jobs.regression_job(optimizer="adam", max_grad_norm=0.05)
    assert_same_run(train(job, 1, reduction="allreduce"), train(job, 3))
    model = job.model()
    assert [u.name for u in unit_params(model, resolve_units(model, None))] == ["0", "2"]


def test_an_out_of_memory_failure_names_the_knobs_that_fit_the_model():
    from types import SimpleNamespace

    from virtualflow.runtime.failure_report import memory_hint
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2359296 bytes")
    plain = SimpleNamespace(cfg=SimpleNamespace(options=SimpleNamespace(reduction="allreduce")))
    sharded = SimpleNamespace(cfg=SimpleNamespace(options=SimpleNamespace(reduction="fsdp")))
    assert "reduction='fsdp' (--reduction fsdp)" in memory_hint(oom, plain)
    assert "--workers" in memory_hint(oom, sharded) and "--offload cpu" in memory_hint(MemoryError(), sharded)
    assert memory_hint(ValueError("a bad batch"), plain) == ""


def test_a_checkpoint_that_pins_rank_0s_gathered_values_leaves_the_next_step_working():
    """A ``.pt`` checkpoint's digest reads the gathered values through numpy, which makes their
    storage unresizable: the unit then takes a new gather buffer and the state keeps the old."""
    from virtualflow.comm.groups import Group
    from virtualflow.runtime.checkpoint import content_digest
    from virtualflow.runtime.fsdp.store import ParamStore

    model = tied_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    store = ParamStore(model, unit_params(model, resolve_units(model, None)), device=torch.device("cpu"),
                       offload=None, param_dtype=None, keep_gathered=False)
    store.cut(0, 1)
    values = store.gather_to(Group(0, 0, 1, None))
    content_digest(values)  # (pins every gathered buffer's storage)
    store.free_all()  # a new buffer for each unit; the values keep theirs
    store.gather_all()
    assert_state_equal({k: v for k, v in model.state_dict().items()}, before)
    assert all(torch.equal(v, torch.cat([model.state_dict(keep_vars=True)[n].detach().reshape(-1)
                                          for n in u.unit.names])) for u, v in zip(store.units, values))
