"""runtime/tensor_parallel: the tensor-parallel MLP and attention blocks against the single-worker
blocks (``MLPBlock``, ``AttentionBlock``) with the same weights and the same dropout rule.

Pure tests: the token layout of the overlap chunks, the dropout rule (a slice's mask is the same
rows of the whole mask), the weight shards (the ranks' shards put together are the whole), the
errors, and the blocks on a trivial group of one rank.

Process tests: gloo groups of 2 and 3 ranks (one launch each, every case in the launch). First
docs/coconet.md's snippet with its own values, each rank's global generator in another state (the
seed alone must fix the weights), and a block built with ``seed=rank`` refused by ``from_module``
on every rank. Then every rank builds the single-worker block from the same seed, runs it itself
and compares: the output,
the input's gradient and its own weight shards' gradients against the slices of the single-worker
gradients, with and without overlap chunks, dropout on, for MLP, attention and the two stacked.
Tolerance: float64 ``atol = rtol = 1e-12`` (the sums over ranks and chunks are in another order
than the single worker's matmul, and BLAS picks kernels by shape, so a row chunk's matmul need not
give the whole one's bits; nothing else differs); float32 ``atol = 1e-5, rtol = 1e-4`` (measured
differences: docs/coconet.md). Bit-identical, because both sides run the same shapes: the fc2/out
bias gradient (summed locally from the all-gathered ``[T, h]`` gradient, as the single worker sums
it) and one rank with one chunk (``test_one_rank_is_the_single_worker_block``, rerun on MKL's AVX2
kernels by ``tests/test_comm_program.py``). Each
rank's ledger must equal the ring formulas (``comm.ring.ring_traffic``) of the collectives the
block issues: forward k reduce-scatters + k all-gathers, backward k all-gathers + the input
gradient's all-reduce(s). The unfused differentiable collectives (``reduce_scatter_rows``,
``all_gather_rows``, ``copy_to_ranks``) are checked against sums in the same launches. So is
``parallel.convert`` where threads cannot check it: a converted nanoGPT block drawing its dropout
seeds from each process's default generator (tests/unit/test_tp_convert.py has the rest).
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from virtualflow.comm.groups import Group, make_group
from virtualflow.comm.ring import Collectives, ring_traffic
from gloo_ranks import launch_ranks
from virtualflow.plan.shards import check_bounds, shard_bounds
from virtualflow.parallel import (
    DROPOUT_BLOCK_ROWS, AttentionBlock, MLPBlock, TensorParallelAttention, TensorParallelMLP, TokenLayout,
    all_gather_rows, copy_to_ranks, dropout_keep, reduce_scatter_rows, tensor_parallel_layer,
)

JOIN_S = 90.0
F64 = dict(atol=1e-12, rtol=1e-12)
F32 = dict(atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Pure.


@pytest.mark.parametrize("tokens,ranks,chunks", [(12, 2, 1), (12, 2, 3), (13, 3, 4), (5, 3, 1), (3, 2, 5), (0, 2, 2)])
def test_the_token_layout_cuts_every_chunk_over_every_rank(tokens, ranks, chunks):
    lay = TokenLayout.build(tokens, ranks, chunks)
    assert [b - a for a, b in lay.chunks] == [n for n in (b - a for a, b in shard_bounds(tokens, chunks)) if n]
    seen = []
    for c, (c0, c1) in enumerate(lay.chunks):
        owned = list(lay.owned[c])
        assert len(owned) == ranks and owned[0][0] == c0 and owned[-1][1] == c1
        check_bounds([(lo - c0, hi - c0) for lo, hi in owned], c1 - c0)  # one reduce-scatter per chunk
        check_bounds(lay.element_bounds(c, 7), (c1 - c0) * 7)
        seen += [row for lo, hi in owned for row in range(lo, hi)]
    assert sorted(seen) == list(range(tokens))  # every token row owned exactly once
    assert sum(lay.rows_owned(r) for r in range(ranks)) == tokens
    assert all(len(lay.rows_of(r)) == len(lay.chunks) for r in range(ranks))


def test_the_dropout_mask_of_any_rows_is_those_rows_of_the_whole_mask():
    tokens, width, p = 3 * DROPOUT_BLOCK_ROWS + 5, 6, 0.3
    whole = dropout_keep(11, 0, tokens, width, p)
    assert whole.shape == (tokens, width) and whole.dtype == torch.bool
    assert 0.6 < whole.float().mean().item() < 0.8
    for lo, hi in [(0, 1), (63, 65), (10, 190), (tokens - 1, tokens), (7, 7)]:
        assert torch.equal(dropout_keep(11, lo, hi, width, p), whole[lo:hi])
    assert not torch.equal(dropout_keep(12, 0, tokens, width, p), whole)  # another seed, another mask


def test_the_shards_of_all_ranks_put_together_are_the_whole_block():
    torch.manual_seed(0)
    mlp = MLPBlock(8, 10)
    full = dict(mlp.named_parameters())
    shards = [TensorParallelMLP.shard_state(full, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([s["fc1.weight"] for s in shards]), full["fc1.weight"])
    assert torch.equal(torch.cat([s["fc1.bias"] for s in shards]), full["fc1.bias"])
    assert torch.equal(torch.cat([s["fc2.weight"] for s in shards], 1), full["fc2.weight"])
    assert all(torch.equal(s["fc2.bias"], full["fc2.bias"]) for s in shards)

    attn = AttentionBlock(12, 3)
    full = dict(attn.named_parameters())
    shards = [TensorParallelAttention.shard_state(full, r, 2, 3) for r in range(2)]  # 2 heads + 1 head
    assert [s["out.weight"].shape[1] for s in shards] == [8, 4]
    for j in range(3):  # q, k, v: each rank holds its heads' rows of each
        parts = [s["qkv.weight"].view(3, -1, 12)[j] for s in shards]
        assert torch.equal(torch.cat(parts), full["qkv.weight"][j * 12:(j + 1) * 12])
    assert torch.equal(torch.cat([s["out.weight"] for s in shards], 1), full["out.weight"])


def test_the_seed_fixes_the_weights_whatever_the_global_random_state():
    """Ranks build the reference block independently: the weights must come from ``seed`` alone
    (the global generator differs between ranks), with nn.Linear's distribution."""
    for build in (lambda s: MLPBlock(16, 40, 0.1, seed=s), lambda s: AttentionBlock(12, 3, 0.1, seed=s)):
        torch.manual_seed(1)
        a = build(0)
        torch.manual_seed(2)
        state = torch.random.get_rng_state()
        b = build(0)
        assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is not touched
        c = build(1)
        pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        assert not any(torch.equal(pa[n], pc[n]) for n in pa)  # another seed, other weights
        for n, v in pa.items():
            fan_in = v.shape[-1] if n.endswith("weight") else pa[n.replace("bias", "weight")].shape[1]
            bound = fan_in ** -0.5
            assert v.abs().max() <= bound and v.abs().max() > 0.9 * bound  # U(-1/sqrt(in), 1/sqrt(in))
            assert abs(v.mean().item()) < 0.1 * bound or v.numel() < 100


def test_bad_settings_are_refused_with_the_knob_to_change():
    one = Collectives(Group(0, 0, 1, None))
    with pytest.raises(ValueError, match="chunks=0"):
        TensorParallelMLP.from_module(MLPBlock(4, 8), one, chunks=0)
    with pytest.raises(ValueError, match="dropout_p=1.0"):
        MLPBlock(4, 8, 1.0)
    with pytest.raises(ValueError, match="heads=3 cannot be split over 4 ranks"):
        TensorParallelAttention.shard_state(dict(AttentionBlock(6, 3).named_parameters()), 0, 4, 3)
    with pytest.raises(ValueError, match=r"ffn_hidden\)=2 cannot be split over 3 ranks"):
        TensorParallelMLP.shard_state(dict(MLPBlock(4, 2).named_parameters()), 0, 3)
    with pytest.raises(ValueError, match="multiple of heads"):
        AttentionBlock(10, 3)
    tp = TensorParallelAttention.from_module(AttentionBlock(8, 2), one)
    with pytest.raises(ValueError, match=r"\[batch, seq, hidden=8\]"):
        tp(torch.randn(4, 8))


def test_one_rank_is_the_single_worker_block():
    """t = 1 (a trivial group): the same arithmetic, bit-identical without chunks."""
    one = Collectives(Group(0, 0, 1, None))
    assert not _compare_pieces(one)
    for chunks in (1, 3):
        failures = _compare_mlp(one, torch.float64, chunks, 0.2, tokens=(3, 4), exact=chunks == 1)
        failures += _compare_attention(one, torch.float64, chunks, 0.2, exact=chunks == 1)
        assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------------
# The comparisons (run by every rank of a launch, and by the one-rank test).

HIDDEN, FFN, HEADS = 12, 24, 3


def _check(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor, exact: bool, tol: dict) -> None:
    try:
        if exact:
            assert torch.equal(got, want), f"not bit-identical, max |diff| {(got - want).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(got, want, **tol)
    except AssertionError as exc:
        failures.append(f"{what}: {exc}")


def _expected_traffic(ops: list[tuple[str, list[tuple[int, int]]]], rank: int, itemsize: int) -> dict:
    out: dict[str, list[int]] = {}
    for op, bounds in ops:
        t = ring_traffic(op, bounds, rank, itemsize)
        acc = out.setdefault(op, [0, 0, 0])
        acc[0] += t.bytes_sent
        acc[1] += t.bytes_received
        acc[2] += 1
    return out


def _issued_ops(tokens: int, width: int, ranks: int, chunks: int, mlp: bool) -> list[tuple[str, list]]:
    """The collectives one forward + backward of a block issues (the module docstring's bytes)."""
    lay = TokenLayout.build(tokens, ranks, chunks)
    per_chunk = [lay.element_bounds(c, width) for c in range(len(lay.chunks))]
    ops = [("reduce_scatter", b) for b in per_chunk] + [("all_gather", b) for b in per_chunk]  # forward
    ops += [("all_gather", b) for b in per_chunk]  # backward of the reduce-scatters
    if mlp:  # the input gradient's all-reduce, one per chunk
        ops += [("all_reduce", shard_bounds((c1 - c0) * width, ranks)) for c0, c1 in lay.chunks]
    else:  # attention: one for the qkv projection's input
        ops += [("all_reduce", shard_bounds(tokens * width, ranks))]
    return ops


def _check_ledger(failures: list[str], what: str, comm: Collectives, ops, itemsize: int) -> None:
    want = _expected_traffic(ops, comm.group.rank, itemsize)
    got = {op: [int(v["bytes_sent"]), int(v["bytes_received"]), int(v["count"])]
           for op, v in comm.ledger.by_op().items()}
    if got != want:
        failures.append(f"{what}: ledger {got} != ring formula {want} (bytes sent, received, count)")


def _run(block, x: torch.Tensor, g: torch.Tensor, seed: int | None):
    x = x.detach().clone().requires_grad_()
    y = block(x) if seed is None else block(x, dropout_seed=seed)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _compare(failures, what, comm, ref, tp, x, g, dtype, shard, exact, mlp):
    tol = F64 if dtype == torch.float64 else F32
    rank, size = comm.group.rank, comm.group.size
    for call, seed in enumerate((None, 1234)):  # the module's own seed sequence, then an explicit seed
        ref.zero_grad(set_to_none=True)
        tp.zero_grad(set_to_none=True)
        comm.ledger.clear()
        y_tp, gx_tp = _run(tp, x, g, seed)
        _check_ledger(failures, f"{what} call {call}", comm,
                      _issued_ops(x.numel() // x.shape[-1], x.shape[-1], size, tp.chunks, mlp), x.element_size())
        y_ref, gx_ref = _run(ref, x, g, seed)
        _check(failures, f"{what} call {call} output", y_tp, y_ref, exact, tol)
        _check(failures, f"{what} call {call} input grad", gx_tp, gx_ref, exact, tol)
        want = shard({n: p.grad for n, p in ref.named_parameters()}, rank, size)
        for n, p in tp.named_parameters():
            bias_out = n in ("fc2.bias", "out.bias")
            _check(failures, f"{what} call {call} grad {n}", p.grad, want[n], exact or bias_out, tol)
    if ref.dropout_p > 0:  # dropout really is on: the output differs from the eval-mode output
        ref.eval()
        with torch.no_grad():
            if torch.equal(ref(x), y_ref):
                failures.append(f"{what}: dropout had no effect")
        ref.train()


def _compare_mlp(comm, dtype, chunks, p, tokens=(3, 4), exact=False) -> list[str]:
    torch.manual_seed(1)
    ref = MLPBlock(HIDDEN, FFN, p, seed=77).to(dtype)
    tp = TensorParallelMLP.from_module(ref, comm, chunks=chunks)
    x = torch.randn(*tokens, HIDDEN, dtype=dtype)
    g = torch.randn(*tokens, HIDDEN, dtype=dtype)
    failures: list[str] = []
    _compare(failures, f"mlp {dtype} chunks={chunks} p={p}", comm, ref, tp, x, g, dtype, TensorParallelMLP.shard_state,
             exact, True)
    return failures


def _compare_attention(comm, dtype, chunks, p, exact=False) -> list[str]:
    torch.manual_seed(2)
    ref = AttentionBlock(HIDDEN, HEADS, p, seed=78).to(dtype)
    tp = TensorParallelAttention.from_module(ref, comm, chunks=chunks)
    x = torch.randn(2, 5, HIDDEN, dtype=dtype)
    g = torch.randn(2, 5, HIDDEN, dtype=dtype)
    failures: list[str] = []

    def shard(full, rank, size):
        return TensorParallelAttention.shard_state(full, rank, size, HEADS)

    _compare(failures, f"attention {dtype} chunks={chunks} p={p}", comm, ref, tp, x, g, dtype, shard, exact, False)
    return failures


def _compare_stack(comm, chunks) -> list[str]:
    """Attention then MLP: the first block's input gradient comes through the second's."""
    torch.manual_seed(3)
    attn, mlp = AttentionBlock(HIDDEN, HEADS, 0.1, seed=5).double(), MLPBlock(HIDDEN, FFN, 0.1, seed=6).double()
    tp_attn = TensorParallelAttention.from_module(attn, comm, chunks=chunks)
    tp_mlp = TensorParallelMLP.from_module(mlp, comm, chunks=chunks)
    x = torch.randn(2, 6, HIDDEN, dtype=torch.float64)
    g = torch.randn(2, 6, HIDDEN, dtype=torch.float64)
    (y_ref, gx_ref), (y_tp, gx_tp) = [_run(lambda v, a=a, m=m: m(a(v)), x, g, None)
                                      for a, m in ((attn, mlp), (tp_attn, tp_mlp))]
    failures: list[str] = []
    _check(failures, f"stack chunks={chunks} output", y_tp, y_ref, False, F64)
    _check(failures, f"stack chunks={chunks} input grad", gx_tp, gx_ref, False, F64)
    rank, size = comm.group.rank, comm.group.size
    want = TensorParallelAttention.shard_state({n: p.grad for n, p in attn.named_parameters()}, rank, size, HEADS)
    for n, p in tp_attn.named_parameters():
        _check(failures, f"stack chunks={chunks} attention grad {n}", p.grad, want[n], False, F64)
    return failures


def _compare_pieces(comm) -> list[str]:
    """The unfused differentiable collectives: reduce-scatter then all-gather is a sum; the
    reduce-scatter's backward gives every rank's partial the whole gradient; copy_to_ranks sums
    the ranks' gradients."""
    rank, size = comm.group.rank, comm.group.size
    tokens, width = 7, 5
    gen = torch.Generator().manual_seed(9)
    zs = [torch.randn(tokens, width, generator=gen, dtype=torch.float64) for _ in range(size)]  # every rank's
    g = torch.randn(tokens, width, generator=gen, dtype=torch.float64)
    ws = [torch.randn(width, generator=gen, dtype=torch.float64) for _ in range(size)]
    failures: list[str] = []
    z = zs[rank].clone().requires_grad_()
    part = reduce_scatter_rows(z, comm)
    lo, hi = shard_bounds(tokens, size)[rank]
    _check(failures, "reduce_scatter_rows", part, sum(zs)[lo:hi], False, F64)
    y = all_gather_rows(part * 2, comm, tokens)
    _check(failures, "all_gather_rows", y, 2 * sum(zs), False, F64)
    (y * g).sum().backward()
    _check(failures, "reduce_scatter_rows backward", z.grad, 2 * g, True, F64)
    x = zs[0].clone().requires_grad_()
    (copy_to_ranks(x, comm) * ws[rank]).sum().backward()
    _check(failures, "copy_to_ranks backward", x.grad, sum(ws).expand(tokens, width), False, F64)
    return failures


def _guide_snippet(comm: Collectives) -> list[str]:
    """docs/coconet.md's tensor-parallel snippet, its own values: every rank builds
    ``MLPBlock(hidden=1024, ffn_hidden=4096, dropout_p=0.1, seed=0)`` itself, its global
    generator in another state than the other ranks' (as after rank-dependent work), cuts its
    shard with ``chunks=4`` and computes ``tp(x)``, which must equal its own ``block(x)``."""
    rank = comm.group.rank
    failures: list[str] = []
    torch.manual_seed(100 + rank)
    block = MLPBlock(hidden=1024, ffn_hidden=4096, dropout_p=0.1, seed=0)  # the reference block
    tp = TensorParallelMLP.from_module(block, comm, chunks=4)             # this rank's 1/t of it
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))  # the same on every rank
    with torch.no_grad():
        _check(failures, "guide snippet: tp(x) vs block(x)", tp(x), block(x), False, F32)
    # A rank that builds another block is refused on every rank, before any wrong output.
    for name, build in (("MLPBlock", lambda s: MLPBlock(8, 12, seed=s)),
                        ("AttentionBlock", lambda s: AttentionBlock(12, 3, seed=s))):
        cls = TensorParallelMLP if name == "MLPBlock" else TensorParallelAttention
        try:
            cls.from_module(build(rank), comm)
            failures.append(f"{name} with seed=rank: from_module did not refuse")
        except ValueError as exc:
            if f"the {name} passed to from_module differs between the {comm.group.size} ranks" not in str(exc):
                failures.append(f"{name} with seed=rank: unexpected error {exc}")
        cls.from_module(build(7), comm)  # the same seed everywhere: accepted
    return failures


def _converted_nanogpt(comm: Collectives) -> list[str]:
    """parallel/convert in processes: a nanoGPT block (dropout 0.2 on the residuals and the
    attention probabilities) converted for t ranks, with seeds from the default generator (as a
    pipeline stage runs it: every rank's generator in the same state), equals the block
    converted for one rank, plainly and under torch.utils.checkpoint's recompute."""
    from nanogpt import nanogpt_layers  # the user's nanoGPT classes

    failures: list[str] = []
    rank = comm.group.rank
    torch.manual_seed(100 + rank)  # the generators differ until the stage sets them
    layer = nanogpt_layers(n_head=6, n_embd=12, dropout=0.2)[1]  # weights from a fixed seed
    one = tensor_parallel_layer(layer, Collectives(Group(0, 0, 1, None)))
    tp = tensor_parallel_layer(layer, comm, chunks=2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 12, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 7, 12, generator=gen, dtype=torch.float64)
    results = []
    for module, checkpointed in ((one, False), (tp, False), (tp, True)):
        torch.manual_seed(42)  # the micro-batch's stream, the same on every rank
        xi = x.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(module, xi, use_reentrant=False) if checkpointed else module(xi)
        (y * g).sum().backward()
        results.append((y.detach(), xi.grad))
    _check(failures, "converted nanoGPT block output", results[1][0], results[0][0], False, F64)
    _check(failures, "converted nanoGPT block input grad", results[1][1], results[0][1], False, F64)
    _check(failures, "converted nanoGPT block checkpointed output", results[2][0], results[1][0], True, F64)
    _check(failures, "converted nanoGPT block checkpointed input grad", results[2][1], results[1][1], True, F64)
    return failures


def _all_cases(comm: Collectives) -> list[str]:
    failures: list[str] = _guide_snippet(comm)
    failures += _converted_nanogpt(comm)
    failures += _compare_pieces(comm)
    for chunks in (1, 2, 3):
        failures += _compare_mlp(comm, torch.float64, chunks, 0.1, tokens=(3, 4))
        failures += _compare_attention(comm, torch.float64, chunks, 0.1)
    failures += _compare_mlp(comm, torch.float64, 2, 0.0, tokens=(7,))  # uneven rows, no dropout
    failures += _compare_mlp(comm, torch.float32, 3, 0.1, tokens=(4, 5))
    failures += _compare_attention(comm, torch.float32, 2, 0.1)
    failures += _compare_stack(comm, 2)
    return failures


# --------------------------------------------------------------------------------------------
# Processes.


def _rank_main(rank: int, p: int, port: int, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, p, False, timeout=datetime.timedelta(seconds=30))
        group = make_group(store, 0, rank, p, 30.0, torch.device("cpu"))
        comm = Collectives(group)
        failures = _all_cases(comm)
        comm.close()
        group.all_reduce(torch.zeros(1))  # nobody closes its sockets while a peer still reads
        group.close()
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, [traceback.format_exc()]))
        raise SystemExit(1)
    results.put((rank, failures))


def _launch(p: int) -> dict[int, list[str]]:
    return launch_ranks(_rank_main, p, timeout_s=JOIN_S)


@pytest.mark.parametrize("p", [2, 3])
def test_tensor_parallel_blocks_equal_the_single_worker_blocks_in_processes(p):
    out = _launch(p)
    assert sorted(out) == list(range(p)), f"ranks that reported: {sorted(out)}"
    problems = [f"rank {r}: {f}" for r in sorted(out) for f in out[r]]
    assert not problems, "\n".join(problems)
