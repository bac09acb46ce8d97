"""Tensor parallelism with mixed precision and torch.compile, in-process (ranks as threads over
tests/fabric.py running the real ring collectives).

- Under ``torch.autocast`` (bf16-mixed, 16-mixed) a converted block computes its matmuls in the
  autocast dtype where the unconverted block's ``F.linear`` does: one rank is the block under
  autocast bit for bit; t ranks add the row-parallel partial sums in float32 and round once
  (:class:`virtualflow.parallel.collectives.Precision`), within tolerance of it.
- The autograd Functions' backward runs in the forward's dtypes (autocast is off by then).
- 16-mixed: an inf in one rank's shard skips the step on every rank of the tensor group.
- ``torch.compile``: the collectives are opaque to dynamo (graph breaks there only); a stage is
  compiled once: later steps and a new generation's communicator recompile nothing, and the
  compiled stage trains the eager stage's weights.

``python tests/unit/test_tp_precision.py`` measures :data:`virtualflow.config.composition.TOLERANCES`
(worker processes, about 2 minutes on 2 cores).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # for `python <this file>`

from nanogpt import nanogpt_layers  # noqa: E402
from test_tp_convert import _gpt2_block, _OneCopyAtATime, inputs, on_ranks, one_rank  # noqa: E402
from virtualflow.comm.ring import Collectives  # noqa: E402
from virtualflow.parallel import tensor_parallel_layer, tensor_splits  # noqa: E402
from virtualflow.runtime.amp import LossScaler  # noqa: E402
from virtualflow.runtime.pipeline.tensor_grid import rebind_comm  # noqa: E402
from virtualflow.runtime.step.finish import TensorSlots  # noqa: E402

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def run_autocast(layer, x, g, dtype):
    """Output, input gradient and {name: gradient} of ``(y * g).sum()``, forward under autocast
    (``dtype`` None: without)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        y = layer(x)
    (y.float() * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_and_16_mixed_blocks_are_the_block_under_autocast(precision, bias):
    dtype = DTYPES[precision]
    layer = nanogpt_layers(torch.float32, bias=bias)[2]  # two nanoGPT blocks
    x, g = inputs(torch.float32)
    y_ref, gx_ref, grads_ref = run_autocast(layer, x, g, dtype)
    y32, _, _ = run_autocast(layer, x, g, None)
    cast_error = (y32 - y_ref).abs().max().item()
    assert cast_error > 1e-4  # the reference really computes in the low precision
    # One rank: the block's own kernels on the same operands, bit for bit.
    y, gx, grads = run_autocast(tensor_parallel_layer(layer, one_rank()), x, g, dtype)
    assert y.dtype == y_ref.dtype == torch.float32  # the residual stream keeps its dtype
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    # t ranks: the row-parallel sums are cut in t pieces (added in float32, rounded once): within a
    # fraction of what the low precision itself costs (a block computing in float32 would be a
    # whole cast_error away).
    for t, chunks in ((2, 1), (2, 3), (4, 1)):
        outs = on_ranks(t, lambda comm: run_autocast(tensor_parallel_layer(layer, comm, chunks=chunks), x, g, dtype))
        splits = tensor_splits(layer, t)
        for y, gx, _ in outs:
            assert (y - y_ref).abs().max().item() <= 0.5 * cast_error
            torch.testing.assert_close(gx, gx_ref, atol=1e-2 * gx_ref.abs().max().item(), rtol=0)
        for name, want in grads_ref.items():
            got = splits[name].merge([grads[name] for _, _, grads in outs])
            assert got.dtype == want.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0, msg=name)


def test_hugging_face_gpt2_block_under_bf16_autocast():
    """Conv1D projections (weights stored [in, out], passed transposed): the same kernels as the
    block's own under autocast with one rank; t = 2 within a fraction of bf16's own error."""
    block = _gpt2_block(torch.float32)
    x, g = inputs(torch.float32)
    y_ref, gx_ref, grads_ref = run_autocast(block, x, g, torch.bfloat16)
    cast_error = (run_autocast(block, x, g, None)[0] - y_ref).abs().max().item()
    y, gx, grads = run_autocast(tensor_parallel_layer(block, one_rank()), x, g, torch.bfloat16)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    outs = on_ranks(2, lambda comm: run_autocast(tensor_parallel_layer(block, comm), x, g, torch.bfloat16))
    splits = tensor_splits(block, 2)
    for y, _, _ in outs:
        assert (y - y_ref).abs().max().item() <= 0.5 * cast_error
    for name, want in grads_ref.items():
        got = splits[name].merge([grads[name] for _, _, grads in outs])
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0, msg=name)


class _Matmuls(TorchDispatchMode):
    """Records the operand dtypes of every matmul (mm, addmm) run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.seen.append((func.overloadpacket.__name__, args[-1].dtype))
        return func(*args, **(kwargs or {}))


class _Recording:
    """A Comm that records the dtype of every collective's buffer."""

    def __init__(self, comm: Collectives) -> None:
        self.comm, self.group, self.dtypes = comm, comm.group, []

    def reduce_scatter(self, flat, bounds, *, async_op=False):
        self.dtypes.append(("reduce_scatter", flat.dtype))
        return self.comm.reduce_scatter(flat, bounds, async_op=async_op)

    def all_gather(self, flat, bounds, *, async_op=False):
        self.dtypes.append(("all_gather", flat.dtype))
        return self.comm.all_gather(flat, bounds, async_op=async_op)

    def all_reduce(self, flat, *, async_op=False):
        self.dtypes.append(("all_reduce", flat.dtype))
        return self.comm.all_reduce(flat, async_op=async_op)


def test_the_functions_backward_runs_in_the_forwards_dtype_and_partial_sums_travel_in_float32():
    layer = nanogpt_layers(torch.float32)[1]
    x, g = inputs(torch.float32)

    def body(comm):
        rec = _Recording(comm)
        block = tensor_parallel_layer(layer, comm)
        rebind_comm(block, rec)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), _Matmuls() as fwd:
            y = block(xx)
        forward_collectives = list(rec.dtypes)
        with _Matmuls() as bwd:  # autocast is off here, as in a training step's backward
            (y * g).sum().backward()
        return fwd.seen, bwd.seen, forward_collectives, rec.dtypes[len(forward_collectives):]

    for fwd, bwd, fwd_comm, bwd_comm in on_ranks(2, body):
        # forward: the column-parallel projections and fc1 in bfloat16; the row-parallel partial
        # sums (attention's out-projection, fc2) as float32 matmuls of bfloat16 values
        assert [d for _, d in fwd].count(torch.bfloat16) == 2 and [d for _, d in fwd].count(torch.float32) == 2
        # backward: every weight and activation gradient in bfloat16, but the two column-parallel
        # input gradients (partial sums: float32)
        assert [d for _, d in bwd].count(torch.float32) == 2 and [d for _, d in bwd].count(torch.bfloat16) >= 6
        assert ("reduce_scatter", torch.float32) in fwd_comm and ("all_gather", torch.float32) in fwd_comm
        assert ("all_gather", torch.bfloat16) in bwd_comm  # the replicated output gradient: exact
        assert {d for op, d in bwd_comm if op == "all_reduce"} == {torch.float32}


def test_an_overflow_in_one_shard_skips_the_step_on_every_tensor_rank():
    """16-mixed: the scaler's inf verdict is summed over the tensor group (the stage's hook,
    runtime/pipeline/tensor_stage.py), so an inf in rank 1's shard alone skips the step on both
    ranks, and both scales back off together."""
    def body(comm):
        scaler = LossScaler({"init_scale": 2.0 ** 16})
        shard = torch.ones(4) * (float("inf") if comm.group.rank == 1 else 1.0)
        replicated = torch.ones(3)
        slots = TensorSlots(lambda v: comm.all_reduce(v), frozenset({id(shard)}), comm.group.rank, torch.device("cpu"))
        found = scaler.found_inf([shard, replicated], slots.any_of)
        skipped = scaler.skips_flagged(found)
        scaler.update(skipped)
        return skipped, scaler.scale

    assert on_ranks(2, body) == [(True, 2.0 ** 15), (True, 2.0 ** 15)]


def _train_stage(layers, comm, batches, compiled: bool, barrier=None, snapshots=None):
    """Three SGD steps of the whole model converted on ``comm`` (one pipeline stage) under bf16
    autocast; before the third step a new communicator is bound, as a new generation does.
    ``snapshots``: dynamo's counters after the first step and at the end (rank 0)."""
    from torch._dynamo.utils import counters

    # (a layer without a block is returned as it is: each rank trains its own copy)
    stage = torch.nn.Sequential(*[tensor_parallel_layer(_OneCopyAtATime.deepcopy(layer), comm) for layer in layers])
    if compiled:
        stage.forward = torch.compile(stage.forward, backend="aot_eager")
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    fresh = Collectives(comm.group)
    for step, (idx, targets) in enumerate(batches):
        if step == 2:
            rebind_comm(stage, fresh)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = stage(idx)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if barrier is not None and step in (0, len(batches) - 1):
            barrier.wait()  # every rank has finished this step (and compiled what it needed)
            if comm.group.rank == 0:
                snapshots.append({k: dict(v) for k, v in counters.items()})
            barrier.wait()
    fresh.close()
    return {n: p.detach().clone() for n, p in stage.named_parameters()}


def test_a_compiled_tensor_parallel_stage_compiles_once_and_trains_the_eager_stages_weights():
    import threading

    import torch._dynamo
    from torch._dynamo.utils import counters

    whole = nanogpt_layers(torch.float32)
    layers = [whole[0], whole[1], whole[3]]  # embeddings, a block, final norm and head
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 23, (3, 8), generator=gen), torch.randint(0, 23, (3, 8), generator=gen))
               for _ in range(3)]
    eager = on_ranks(2, lambda comm: _train_stage(layers, comm, batches, compiled=False))
    torch._dynamo.reset()
    counters.clear()
    barrier, snapshots = threading.Barrier(2), []
    try:
        compiled = on_ranks(2, lambda comm: _train_stage(layers, comm, batches, True, barrier, snapshots))
    finally:
        torch._dynamo.reset()
    first, last = snapshots
    assert first["stats"]["unique_graphs"] > 0
    assert last["stats"] == first["stats"] and last["frames"] == first["frames"]  # steps 2, 3 and a new comm
    assert "recompiles" not in last
    breaks = " ".join(last.get("graph_break", {}))
    assert "column_parallel" in breaks and "row_parallel" in breaks
    assert all(k.startswith("Skip calling `torch.compiler.disable()`d function") for k in last["graph_break"])
    # aot_eager runs the captured ATen graphs op for op: the eager stage's weights, bit for bit
    for got, want in zip(compiled, eager):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    initial = dict(layers[2].named_parameters())  # the head (replicated)
    assert not torch.equal(compiled[0]["2.lm_head.weight"], initial["lm_head.weight"])  # it trained


def measure_tolerances(steps: int = 3) -> dict[str, tuple[float, float]]:
    """For each precision: the max absolute and relative difference of the weights after ``steps``
    deterministic steps of tests/gpt_grid_jobs.py's GPT (float32) on (D, P, T) = (1, 1, 2) against
    the unpipelined single worker (worker processes). What composition.TOLERANCES records."""
    import gpt_grid_jobs as g
    import virtualflow as vf

    def job(tensor: int, precision: str):
        j = g.grid_job(tensor=tensor, float32=True).replace(precision=precision)
        return lambda: j if tensor > 1 else j.replace(pipeline=None)

    out = {}
    for precision in ("32", "bf16-mixed", "16-mixed"):
        ref = vf.train(job(1, precision), workers=1, steps=steps, deterministic=True).state_dict
        got = vf.train(job(2, precision), workers=2, steps=steps, deterministic=True).state_dict
        diff = {k: (got[k].double() - ref[k].double()).abs() for k in ref}
        out[precision] = (max(d.max().item() for d in diff.values()),
                          max((d / ref[k].double().abs().clamp_min(1e-6)).max().item() for k, d in diff.items()))
    return out


if __name__ == "__main__":
    from virtualflow.config.composition import TOLERANCES

    for precision, (abs_diff, rel_diff) in measure_tolerances().items():
        print(f"T=2 vs T=1, {precision}: max |diff| {abs_diff:.3g}, max relative {rel_diff:.3g}; "
              f"TOLERANCES (atol, rtol) = {TOLERANCES[('tensor parallel', precision)]}")


class _Jittery(_Recording):
    """A Comm whose rank 1 issues every collective a random few milliseconds late."""

    def __init__(self, comm: Collectives, seed: int) -> None:
        super().__init__(comm)
        self.rng = random.Random(seed)

    def _late(self):
        if self.group.rank == 1:
            time.sleep(self.rng.random() * 0.004)

    def reduce_scatter(self, flat, bounds, *, async_op=False):
        self._late()
        return super().reduce_scatter(flat, bounds, async_op=async_op)

    def all_gather(self, flat, bounds, *, async_op=False):
        self._late()
        return super().all_gather(flat, bounds, async_op=async_op)

    def all_reduce(self, flat, *, async_op=False):
        self._late()
        return super().all_reduce(flat, async_op=async_op)


def test_bf16_blocks_are_bit_identical_whatever_the_timing_of_the_overlapped_collectives():
    """Deterministic across layouts of one T: a layout changes which workers hold a stage and when
    its collectives run, not the shapes or the ring's order of a sum. Here: the overlapped (3
    chunks) bf16 block on 2 ranks, rank 1 late by random amounts, run three times: the same bits."""
    layer = nanogpt_layers(torch.float32)[2]
    x, g = inputs(torch.float32)

    def body(comm, seed):
        block = tensor_parallel_layer(layer, comm, chunks=3)
        rebind_comm(block, _Jittery(comm, seed))
        return run_autocast(block, x, g, torch.bfloat16)

    runs = [on_ranks(2, lambda comm, s=seed: body(comm, s)) for seed in range(3)]
    for run in runs[1:]:
        for (y, gx, grads), (y0, gx0, grads0) in zip(run, runs[0]):
            assert torch.equal(y, y0) and torch.equal(gx, gx0)
            assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
