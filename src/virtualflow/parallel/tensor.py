"""Tensor-parallel transformer blocks (Megatron-style) with CoCoNeT's reorder and overlap.

Purpose: a transformer MLP block or attention block split over the ``t`` ranks of a group, each
rank holding ``1/t`` of the block's weights, computing the single-worker block (:class:`MLPBlock`,
:class:`AttentionBlock`, in this file) up to the order of floating-point sums (see "What
'exactly' means here" below). The blocks are built from :mod:`.collectives` (the :class:`Comm`
protocol, :class:`TokenLayout`, the unfused differentiable collectives), :mod:`.overlap` (the
fused, chunked row-parallel epilogue), :mod:`.sublayers` (the two sub-layers as functions, shared
with :mod:`.convert`) and :mod:`.seeds` (the dropout rules and the weights' draw). A
:class:`BlockConfig` adds a pre-LayerNorm (``y = x + sublayer(LN(x))``, LN replicated: run by
every rank on the replicated input; its gradients are bit-identical on every rank because the
column-parallel projection's input gradient is all-reduced), dropout on the attention
probabilities, the tanh GELU, layers without biases and the generator seed rule.
(Moved from ``runtime/tensor_parallel.py``, which re-exports :mod:`virtualflow.parallel`.)

Layouts (``T`` = tokens = batch * sequence, ``h`` = hidden width, ``f`` = MLP width, rank ``r``)::

    x        [T, h]      replicated (every rank holds the same tensor)
    fc1/qkv  column-parallel: rank r holds the rows of its slice of f (MLP), or of its heads
             (attention: its rows of each of q, k and v)        -> [T, f_r] / [T, 3 h_r], local
    fc2/out  row-parallel: rank r holds the matching columns    -> z_r [T, h], a *partial sum*
    reduce-scatter along tokens: rank r gets sum_r z_r on its token rows only      [T_r, h]
    on those rows: + bias, dropout, + residual x   (pointwise work on 1/t of the elements)
    all-gather along tokens                                     -> y [T, h], replicated

A tensor ``[T, h]`` cut along tokens is one contiguous range of its flat storage per rank, which
is what the ring collectives (:class:`virtualflow.comm.ring.Collectives`) work on in place.

**Overlap** (``chunks = k``): the token rows are cut into ``k`` chunks (``shard_bounds(T, k)``)
and each chunk is itself cut over the ``t`` ranks (:class:`TokenLayout`); chunk ``c``'s
reduce-scatter is issued asynchronously while chunk ``c+1`` computes, and chunk ``c``'s epilogue
and all-gather follow as soon as its reduce-scatter is done. Every chunk is a complete
reduce-scatter over ``t`` ranks, so a rank owns ``k`` row ranges (one per chunk) instead of one;
the result is the same tensor. The MLP is token-wise, so its whole chain (fc1, gelu, fc2) is the
producer that is chunked; attention mixes the tokens of a sequence, so only its out-projection is.
Backward overlaps the same way: each chunk's all-gather of the output gradient runs while the
previous chunk's matmuls compute, and (MLP) each chunk's all-reduce of the input gradient runs
while the next chunk computes.

**Gradients** (the invariant for replicated tensors, as in Megatron): the gradient arriving at a
replicated tensor is the same on every rank (every rank computes the same loss from the same
replicated output). Under it:

* all-gather's backward is "take this rank's rows" (no communication; the adjoint of an
  all-gather, a reduce-scatter, would add ``t`` equal copies);
* reduce-scatter's backward is an all-gather: the gradient of every rank's partial ``z_r`` is the
  gradient of the sum for *all* tokens;
* the residual's gradient is the output gradient itself (known on every rank);
* the replicated input of a column-parallel layer gets the *sum* of the ranks' partial input
  gradients: one all-reduce (overlapped with the weight-gradient matmul);
* the replicated bias of the epilogue gets ``sum`` over tokens of the all-gathered gradient,
  computed locally: bit-identical to the single-worker block's, with no extra message.

So the block's input gradient is again the same on every rank, and blocks compose. Each rank's
weight shards get exactly the slices of the single-worker block's gradients
(:meth:`TensorParallelMLP.shard_state` slices a full state or gradient dict the same way). The
blocks run these steps fused in two autograd Functions (so that they can be chunked and overlapped
in both directions); :func:`copy_to_ranks`, :func:`reduce_scatter_rows` and
:func:`all_gather_rows` are the same collectives unfused, one differentiable op each, for other
compositions.

**Dropout rule** (so that ``t`` ranks and the single worker draw the same mask): the keep-mask of
the ``[T, h]`` output is cut into blocks of :data:`DROPOUT_BLOCK_ROWS` token rows; block ``b`` is
``torch.rand(DROPOUT_BLOCK_ROWS, h) >= p`` from a CPU generator seeded with
``splitmix64((seed mod 2**32) << 32 | b) mod 2**32`` (:func:`dropout_keep`; torch's CPU
generator keeps only the low 32 bits of a seed, so seed and block are mixed first). A rank draws
only the blocks that meet its rows (its share plus at most two partial blocks per chunk), so the
mask of a token depends on neither ``t`` nor ``k``. The attention probabilities' mask is drawn per
(sample, global head) (:func:`virtualflow.parallel.seeds.attention_keep`). A forward's seed is its
``dropout_seed`` or, when not given, by ``config.dropout_seeds``: the module's ``seed`` plus the
number of training forwards it ran before (``"module"``, every rank runs the same number), or one
draw from torch's default generator (``"generator"``, the pipeline's rule); each sub-layer's
residual and attention masks use streams derived from it (:func:`stream_seed`). The
single-worker blocks draw the whole masks by the same rules.

**Bytes per rank** (ring collectives, ``e`` bytes per element, even chunks): forward:
reduce-scatter ``(t-1)/t T h e`` + all-gather ``(t-1)/t T h e``; backward: all-gather
``(t-1)/t T h e`` + all-reduce ``2 (t-1)/t T h e`` of the input gradient (only when the input needs
one; MLP: one per chunk, attention: one for the qkv projection). Chunking changes only the number
of collectives (``k`` times as many), not the bytes. Under mixed precision the forward's
reduce-scatter and the backward's all-reduce carry float32 partial sums (``e = 4``), the
all-gathers the activations' own dtype (see :class:`~virtualflow.parallel.collectives.Precision`).
Saved for backward per rank: the input, fc1's
pre-activation and activation ``[T, f/t]`` (MLP), and the keep-mask of the owned rows (bool,
``[T/t, h]``).

**The same block on every rank.** ``MLPBlock(..., seed=s)`` / ``AttentionBlock(..., seed=s)`` draw
their whole weights from ``s`` (:func:`init_linears`), not from the global generator, so every
rank builds the same single-worker block and ``from_module`` cuts its slice of it; ``from_module``
also checks that the ranks' blocks are equal (:func:`verify_same_block`, one small all-reduce) and
refuses otherwise, since a rank holding another block gives a wrong output with no error.

**What "exactly" means here.** The tensor-parallel block adds the ranks' partial sums in the
ring's order and, with ``chunks = k``, multiplies row chunks of the tokens (``x[rows] @ W``); BLAS
picks its kernel by shape, so neither is the single worker's arithmetic and the outputs agree to
float tolerance, not bit for bit (the tests hold float64 to ``1e-12`` and float32 to
``atol=1e-5, rtol=1e-4``; docs/coconet.md has the measured differences). Bit-identical on every CPU are the
results whose two sides run the same kernels on the same shapes: the overlapped and the serial
schedule of the same ``k`` (the same matmuls, waited for at other times), one rank with
``chunks=1`` against the single-worker block (on one rank the out-projection's bias is folded into
``addmm``, as ``F.linear`` does), and the out-projection's bias gradient (summed locally from the
all-gathered ``[T, h]`` gradient, as the single worker sums it).

Invariants: every rank calls the same blocks in the same order with the same shapes (the
collectives run in issue order, see ``comm/ring.py``); ``t`` <= the MLP width and <= the number
of heads (no rank without weights).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from virtualflow.parallel.collectives import Comm, split_range
from virtualflow.parallel.overlap import epilogue
from virtualflow.parallel.seeds import (
    SEED_RULES, DropoutSeeds, check_dropout_p, dropout_keep, init_linears, keep_scale, skip_init_linear, sub_seed,
)
from virtualflow.parallel.sublayers import GELU_KINDS, Heads, Projection, attend, attention_sublayer, mlp_sublayer


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockConfig:
    """Options of :class:`MLPBlock` and :class:`AttentionBlock` (and so of their tensor-parallel
    forms, which ``from_module`` builds with the block's config)."""

    layer_norm: bool = False
    """Pre-LayerNorm: ``y = x + sublayer(LN(x))``. LN (``ln``) runs on every rank on the
    replicated input, with replicated parameters."""
    ln_eps: float = 1e-5
    ln_bias: bool = True
    """LN with a bias (nanoGPT's ``bias=False`` has none)."""
    bias: bool = True
    """Biases of the linear layers."""
    gelu: str = "exact"
    """MLP activation: ``"exact"`` (``nn.GELU()``) or ``"tanh"`` (GPT-2's approximation)."""
    attn_dropout_p: float = 0.0
    """Attention: dropout on the attention probabilities (training only)."""
    dropout_seeds: str = "module"
    """Where a forward's dropout seed comes from when no ``dropout_seed`` is passed: ``"module"``
    (``seed`` + forwards so far) or ``"generator"`` (one draw from torch's default generator per
    training forward with dropout; the pipeline's rule, see :mod:`virtualflow.parallel.seeds`)."""

    def __post_init__(self) -> None:
        if self.gelu not in ("exact", "tanh"):
            raise ValueError(f"BlockConfig: gelu={self.gelu!r} is not a GELU variant; use 'exact' or 'tanh'")
        if not self.ln_eps > 0:
            raise ValueError(f"BlockConfig: ln_eps={self.ln_eps} must be positive")
        check_dropout_p(self.attn_dropout_p)
        if self.dropout_seeds not in SEED_RULES:
            raise ValueError(f"BlockConfig: dropout_seeds={self.dropout_seeds!r} is not a seed rule; use one of "
                             f"{SEED_RULES}")


DEFAULT_CONFIG = BlockConfig()

# Streams of one forward's seed (seeds.sub_seed): sub-layer i's residual dropout and attention masks.
RESID_STREAM, ATTN_STREAM = 0, 1


def stream_seed(seed: int | None, sublayer: int, stream: int) -> int | None:
    """The seed of sub-layer ``sublayer``'s ``stream`` (residual dropout or attention masks) of a
    forward whose seed is ``seed`` (None: no dropout)."""
    return None if seed is None else sub_seed(seed, 2 * sublayer + stream)


def _layer_norm(hidden: int, config: BlockConfig) -> nn.LayerNorm | None:
    if not config.layer_norm:
        return None
    return nn.LayerNorm(hidden, eps=config.ln_eps, bias=config.ln_bias)


# --------------------------------------------------------------------------------------------
# The single-worker reference blocks (same math, same dropout rule).


class MLPBlock(nn.Module):
    """``y = x + dropout(fc2(gelu(fc1(LN(x)))))`` on ``[..., hidden]`` (one worker; LN only with
    ``config.layer_norm``).

    ``seed`` fixes the weights (drawn whole from it, :func:`init_linears`) and the dropout
    masks, and nothing else does: every rank that builds ``MLPBlock(..., seed=s)`` holds the same
    block, whatever its global random state, so :meth:`TensorParallelMLP.from_module` cuts the
    same block on every rank. Stacked blocks need different seeds."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout_p: float = 0.0, *, seed: int = 0,
                 config: BlockConfig = DEFAULT_CONFIG) -> None:
        super().__init__()
        check_dropout_p(dropout_p)
        self.ln = _layer_norm(hidden, config)
        self.fc1 = skip_init_linear(hidden, ffn_hidden, bias=config.bias)
        self.fc2 = skip_init_linear(ffn_hidden, hidden, bias=config.bias)
        init_linears(seed, self.fc1, self.fc2)
        self.dropout_p = dropout_p
        self.config = config
        self.seeds = DropoutSeeds(seed, config.dropout_seeds)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        h = self.fc2.out_features
        x2 = x.reshape(-1, h)
        a2 = x2 if self.ln is None else self.ln(x).reshape(-1, h)
        a = F.gelu(F.linear(a2, self.fc1.weight, self.fc1.bias), approximate=GELU_KINDS[self.config.gelu])
        zb = F.linear(a, self.fc2.weight, self.fc2.bias)
        seed = _forward_seed(self, dropout_seed)
        return epilogue(zb, None, _full_scale(stream_seed(seed, 0, RESID_STREAM), self.dropout_p, x2),
                        x2).reshape(x.shape)


class AttentionBlock(nn.Module):
    """``y = x + dropout(out(attention(qkv(LN(x)))))`` on ``[batch, seq, hidden]`` (one worker);
    qkv's rows are ``[q; k; v]``, each ``heads`` blocks of ``hidden / heads`` rows;
    ``config.attn_dropout_p`` drops attention probabilities. ``seed`` fixes the weights and the
    dropout masks, as in :class:`MLPBlock`."""

    def __init__(self, hidden: int, heads: int, dropout_p: float = 0.0, *, causal: bool = True,
                 seed: int = 0, config: BlockConfig = DEFAULT_CONFIG) -> None:
        super().__init__()
        check_dropout_p(dropout_p)
        if heads < 1 or hidden % heads:
            raise ValueError(f"AttentionBlock: hidden={hidden} must be a multiple of heads={heads}")
        self.ln = _layer_norm(hidden, config)
        self.qkv = skip_init_linear(hidden, 3 * hidden, bias=config.bias)
        self.out = skip_init_linear(hidden, hidden, bias=config.bias)
        init_linears(seed, self.qkv, self.out)  # the same block on every rank (see MLPBlock)
        self.heads = heads
        self.causal = causal
        self.dropout_p = dropout_p
        self.config = config
        self.seeds = DropoutSeeds(seed, config.dropout_seeds)

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        hidden = self.out.out_features
        x2 = _flat_tokens(x, hidden)
        a2 = x2 if self.ln is None else self.ln(x).reshape(-1, hidden)
        qkv = F.linear(a2, self.qkv.weight, self.qkv.bias)
        seed = _forward_seed(self, dropout_seed)
        heads = Heads(0, self.heads, hidden // self.heads, self.causal, None, self.config.attn_dropout_p)
        ctx = attend(qkv, x.shape[0], x.shape[1], heads, stream_seed(seed, 0, ATTN_STREAM))
        zb = F.linear(ctx, self.out.weight, self.out.bias)
        return epilogue(zb, None, _full_scale(stream_seed(seed, 0, RESID_STREAM), self.dropout_p, x2),
                        x2).reshape(x.shape)


def _forward_seed(block: Any, dropout_seed: int | None) -> int | None:
    """This forward's seed, or None when it drops nothing (eval mode, every p = 0)."""
    p_attn = getattr(block.config, "attn_dropout_p", 0.0) if isinstance(block, (AttentionBlock,
                                                                                TensorParallelAttention)) else 0.0
    if not (block.training and (block.dropout_p > 0 or p_attn > 0)):
        return None
    return block.seeds.next(dropout_seed)


def _full_scale(seed: int | None, p: float, x2: torch.Tensor) -> torch.Tensor | None:
    if seed is None or p == 0:
        return None
    keep = dropout_keep(seed, 0, x2.shape[0], x2.shape[1], p).to(x2.device)
    return keep_scale(keep, p, x2.dtype)


def _flat_tokens(x: torch.Tensor, hidden: int) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"attention input must be [batch, seq, hidden={hidden}], got {tuple(x.shape)}")
    return x.reshape(-1, hidden)


# --------------------------------------------------------------------------------------------
# The tensor-parallel blocks.


class _Linear(nn.Module):
    """A weight and a bias (so that parameter names match ``nn.Linear``'s: ``fc1.weight``...)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None


def block_fingerprint(block: nn.Module) -> list[int]:
    """Three 16-bit numbers hashed from ``block``'s parameters and persistent buffers (names,
    shapes, dtypes, bytes) and, where it has them, its dropout p, seed and config: equal blocks
    give equal numbers."""
    h = hashlib.blake2b(digest_size=6)
    seeds = getattr(block, "seeds", None)
    h.update(repr((type(block).__name__, getattr(block, "dropout_p", None), getattr(seeds, "seed", None),
                   getattr(block, "config", None))).encode())
    for name, t in block.state_dict(keep_vars=True).items():
        h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    d = h.digest()
    return [int.from_bytes(d[i:i + 2], "little") for i in (0, 2, 4)]


def verify_same_block(block: nn.Module, comm: Comm, what: str, call: str = "from_module") -> None:
    """Raise ``ValueError`` on every rank unless every rank of ``comm.group`` holds the same
    ``block`` (by :func:`block_fingerprint`).

    One all-reduce of ``[f, f^2]`` per fingerprint number ``f``: the ranks' numbers are all equal
    exactly when ``t * sum(f^2) == sum(f)^2`` (Cauchy-Schwarz), and with 16-bit numbers every
    sum is an integer below 2**53, exact in float64. Every rank computes the same verdict."""
    t = comm.group.size
    first = next(iter(block.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")  # NCCL takes CUDA tensors only
    f = torch.tensor(block_fingerprint(block), dtype=torch.float64, device=device)
    buf = torch.cat([f, f * f])
    comm.all_reduce(buf)
    n = f.numel()
    if t > 1 and not torch.equal(buf[n:] * t, buf[:n] * buf[:n]):
        raise ValueError(
            f"the {what} passed to {call} differs between the {t} ranks (weights, dropout_p or seed): each "
            f"rank would hold a shard of another block and the output would be wrong; build it with the same "
            f"arguments and seed=... on every rank (the seed fixes the weights) and load the same state, or pass "
            f"verify=False to skip this check")


def check_chunks(chunks: int) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be an int >= 1 (1 = no overlap; k = k overlap chunks)")


def _replicated(full: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full.items() if k.startswith(prefix)}


def _optional(full: Mapping[str, torch.Tensor], key: str, cut) -> dict[str, torch.Tensor]:
    return {key: cut(full[key])} if key in full else {}


class TensorParallelMLP(nn.Module):
    """The MLP block over the ranks of ``comm.group``: rank ``r`` holds fc1's rows and fc2's
    columns of its slice of the MLP width, fc2's bias and the LayerNorm (replicated)."""

    def __init__(self, fc1: _Linear, fc2: _Linear, comm: Comm, *, dropout_p: float = 0.0, chunks: int = 1,
                 seed: int = 0, config: BlockConfig = DEFAULT_CONFIG, ln: nn.Module | None = None) -> None:
        super().__init__()
        check_dropout_p(dropout_p)
        check_chunks(chunks)
        if (ln is None) == config.layer_norm:
            raise ValueError(f"TensorParallelMLP: config.layer_norm={config.layer_norm} but ln is "
                             f"{'missing' if ln is None else 'given'}; pass the block's LayerNorm exactly when "
                             f"layer_norm=True")
        self.ln = ln
        self.fc1, self.fc2 = fc1, fc2
        self.comm = comm
        self.dropout_p = dropout_p
        self.chunks = chunks
        self.config = config
        self.seeds = DropoutSeeds(seed, config.dropout_seeds)

    @staticmethod
    def shard_state(full: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s slices of an :class:`MLPBlock`'s ``fc1.weight``, ``fc1.bias``,
        ``fc2.weight``, ``fc2.bias`` and ``ln.*`` (parameters or their gradients; the biases and
        the LayerNorm where the block has them), as views."""
        f = full["fc1.weight"].shape[0]
        lo, hi = split_range(f, size, rank, "the MLP width (ffn_hidden)", "use fewer ranks or a wider MLP")
        out = {"fc1.weight": full["fc1.weight"][lo:hi], "fc2.weight": full["fc2.weight"][:, lo:hi]}
        out |= _optional(full, "fc1.bias", lambda v: v[lo:hi]) | _optional(full, "fc2.bias", lambda v: v)
        return out | _replicated(full, "ln.")

    @classmethod
    def from_module(cls, mlp: MLPBlock, comm: Comm, *, chunks: int = 1, verify: bool = True) -> "TensorParallelMLP":
        """This rank's shard of ``mlp`` (copies of its weights' slices; same dropout p, seed and
        config).

        ``verify``: first check that every rank passed the same block (:func:`verify_same_block`,
        one small all-reduce, so every rank must call this together); a rank holding another block
        would make the output wrong with no error."""
        if verify:
            verify_same_block(mlp, comm, "MLPBlock")
        with torch.no_grad():
            s = cls.shard_state(dict(mlp.named_parameters()), comm.group.rank, comm.group.size)
            s = {k: v.detach().clone() for k, v in s.items()}
        return cls(_Linear(s["fc1.weight"], s.get("fc1.bias")), _Linear(s["fc2.weight"], s.get("fc2.bias")), comm,
                   dropout_p=mlp.dropout_p, chunks=chunks, seed=mlp.seeds.seed, config=mlp.config,
                   ln=copy.deepcopy(mlp.ln))

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        width = self.fc2.weight.shape[0]
        if x.shape[-1] != width:
            raise ValueError(f"TensorParallelMLP: input's last dimension {x.shape[-1]} != hidden={width}")
        seed = _forward_seed(self, dropout_seed)
        return mlp_sublayer(x, self.ln, Projection(self.fc1.weight, self.fc1.bias),
                            Projection(self.fc2.weight, self.fc2.bias), GELU_KINDS[self.config.gelu], self.comm,
                            chunks=self.chunks, resid_p=self.dropout_p,
                            resid_seed=stream_seed(seed if self.dropout_p > 0 else None, 0, RESID_STREAM))


class TensorParallelAttention(nn.Module):
    """The attention block over the ranks of ``comm.group``: rank ``r`` holds the q, k, v rows of
    its heads and the out-projection's columns of its heads, the out bias and the LayerNorm
    (replicated)."""

    def __init__(self, qkv: _Linear, out: _Linear, comm: Comm, *, heads: int, dropout_p: float = 0.0,
                 causal: bool = True, chunks: int = 1, seed: int = 0, config: BlockConfig = DEFAULT_CONFIG,
                 ln: nn.Module | None = None) -> None:
        super().__init__()
        check_dropout_p(dropout_p)
        check_chunks(chunks)
        hidden = out.weight.shape[0]
        if heads < 1 or hidden % heads:
            raise ValueError(f"TensorParallelAttention: hidden={hidden} must be a multiple of heads={heads}")
        if (ln is None) == config.layer_norm:
            raise ValueError(f"TensorParallelAttention: config.layer_norm={config.layer_norm} but ln is "
                             f"{'missing' if ln is None else 'given'}; pass the block's LayerNorm exactly when "
                             f"layer_norm=True")
        self.ln = ln
        self.qkv, self.out = qkv, out
        self.comm = comm
        self.heads = heads
        self.head_dim = hidden // heads
        self.local_heads = out.weight.shape[1] // self.head_dim
        self.first_head = split_range(heads, comm.group.size, comm.group.rank, "heads",
                                      "use fewer ranks or more heads")[0]
        self.dropout_p = dropout_p
        self.causal = causal
        self.chunks = chunks
        self.config = config
        self.seeds = DropoutSeeds(seed, config.dropout_seeds)

    @staticmethod
    def shard_state(full: Mapping[str, torch.Tensor], rank: int, size: int, heads: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s slices of an :class:`AttentionBlock`'s parameters (or gradients)."""
        hidden = full["out.weight"].shape[0]
        d = hidden // heads
        lo, hi = split_range(heads, size, rank, "heads", "use fewer ranks or more heads")
        rows = [slice(j * hidden + lo * d, j * hidden + hi * d) for j in range(3)]
        out = {"qkv.weight": torch.cat([full["qkv.weight"][s] for s in rows]),
               "out.weight": full["out.weight"][:, lo * d:hi * d]}
        out |= _optional(full, "qkv.bias", lambda v: torch.cat([v[s] for s in rows]))
        out |= _optional(full, "out.bias", lambda v: v)
        return out | _replicated(full, "ln.")

    @classmethod
    def from_module(cls, block: AttentionBlock, comm: Comm, *, chunks: int = 1,
                    verify: bool = True) -> "TensorParallelAttention":
        """This rank's shard of ``block``; ``verify`` as in :meth:`TensorParallelMLP.from_module`."""
        if verify:
            verify_same_block(block, comm, "AttentionBlock")
        with torch.no_grad():
            s = cls.shard_state(dict(block.named_parameters()), comm.group.rank, comm.group.size, block.heads)
            s = {k: v.detach().clone() for k, v in s.items()}
        return cls(_Linear(s["qkv.weight"], s.get("qkv.bias")), _Linear(s["out.weight"], s.get("out.bias")), comm,
                   heads=block.heads, dropout_p=block.dropout_p, causal=block.causal, chunks=chunks,
                   seed=block.seeds.seed, config=block.config, ln=copy.deepcopy(block.ln))

    def forward(self, x: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        _flat_tokens(x, self.out.weight.shape[0])
        seed = _forward_seed(self, dropout_seed)
        heads = Heads(self.first_head, self.local_heads, self.head_dim, self.causal, None, self.config.attn_dropout_p)
        return attention_sublayer(
            x, self.ln, Projection(self.qkv.weight, self.qkv.bias), Projection(self.out.weight, self.out.bias),
            heads, self.comm, chunks=self.chunks, resid_p=self.dropout_p,
            resid_seed=stream_seed(seed if self.dropout_p > 0 else None, 0, RESID_STREAM),
            attn_seed=stream_seed(seed if heads.attn_p > 0 else None, 0, ATTN_STREAM))
