"""Turn a pipeline layer into its tensor-parallel form: every transformer block in it split over t ranks.

Purpose: in 3-D parallelism every worker builds the whole single-worker model, cuts its stage's
layers and converts each one with :func:`tensor_parallel_layer`: each transformer block found in
the layer (the layer itself or any submodule) that a rule recognises is replaced by a
:class:`TensorParallelBlock` holding this rank's shard; everything else (embeddings, the final
LayerNorm, the head) stays whole, replicated on the t ranks. :func:`tensor_splits` says how every
``state_dict`` entry of the *unconverted* layer is cut (and merged back), for checkpoints, whole
state gathers and optimizer state; :func:`tensor_parallel_candidates` says which layers hold a
block (the planner's input).

Recognised (:func:`register_tensor_parallel` adds rules for other classes):

- virtualflow's :class:`~virtualflow.parallel.tensor.MLPBlock` and
  :class:`~virtualflow.parallel.tensor.AttentionBlock` (with their :class:`BlockConfig`);
- nanoGPT's ``Block`` (karpathy/nanoGPT ``model.py``: ``ln_1``, ``attn`` a
  ``CausalSelfAttention`` with ``c_attn``, ``c_proj``, ``n_head``, ``ln_2``, ``mlp`` an ``MLP``
  with ``c_fc``, ``gelu``, ``c_proj``), matched by class name and structure;
- Hugging Face's ``GPT2Block`` (``Conv1D`` projections, ``sdpa`` or ``eager`` attention, no
  cross-attention), called as ``block(x)`` (an ``nn.Sequential`` of blocks). Inside a piece of
  :func:`~virtualflow.parallel.tracing.sequential_from` the blocks are inlined into one ATen
  graph and cannot be replaced: the converter refuses such a piece and names the blocks;
  :func:`virtualflow.parallel.gpt.sequential_gpt` gives nanoGPT's or GPT-2's model as untraced layers instead.

Invariants:

- **Names.** The converted layer's ``state_dict()`` keys and ``named_parameters()`` names are the
  original layer's (a :class:`TensorParallelBlock` holds the block's own children under their
  names, with sharded ``Parameter`` s), each value this rank's shard (``tensor_splits(layer,
  t)[name].shard(full, rank, t)``). The layer is deep-copied: the caller's layer is untouched.
- **Cuts.** Heads and MLP widths must divide by t (``ValueError`` naming the value, the rule and
  the knob otherwise): attention's q, k and v projections by heads (rank r holds heads
  ``[r H/t, (r+1) H/t)`` of each), the out-projection's input features by the same heads; the
  MLP's first projection by output features, the second by input features; every bias of a
  row-parallel projection, every norm and everything outside the blocks replicated.
- **Dropout seeds** follow the generator rule (:mod:`virtualflow.parallel.seeds`): one draw from
  torch's default generator per training forward of a block with dropout, so t ranks (same
  generator state) draw the same seed and a layer converted for any t (1 included: conversion
  happens on one rank too) drops the same elements; the masks are the blocks' rule's, not
  ``nn.Dropout``'s, so with dropout the converted layer is another sample of the same model
  than the unconverted one.
- **Exactness.** With dropout off, one rank and ``chunks=1``, the converted layer runs the
  original's kernels on the same shapes: bit-identical output and gradients (nanoGPT and
  Hugging Face ``sdpa``; ``eager`` attention is computed by ``F.scaled_dot_product_attention``,
  within float tolerance). With t > 1 the partial sums add in another order: within float
  tolerance (docs/coconet.md has the measured differences).
- **Autocast and compile.** Under ``torch.autocast`` the blocks compute in the autocast dtype as
  the original does (one rank: bit for bit; t ranks add the row-parallel partial sums in float32
  and round once: :class:`~virtualflow.parallel.collectives.Precision`); under ``torch.compile``
  the communicating calls are opaque to dynamo and the rest of the block compiles
  (:mod:`.sublayers`), with no guard on the communicator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from virtualflow.parallel.collectives import Comm
from virtualflow.parallel.seeds import generator_seed
from virtualflow.parallel.sublayers import GELU_KINDS, Heads, Projection, attention_sublayer, mlp_sublayer
from virtualflow.parallel.tensor import (
    ATTN_STREAM, RESID_STREAM, AttentionBlock, MLPBlock, check_chunks, stream_seed, verify_same_block,
)
from virtualflow.parallel.tracing import TracedPiece

__all__ = [
    "AttentionPlan", "BlockPlan", "MLPPlan", "Proj", "Split", "TensorParallelBlock", "register_tensor_parallel",
    "tensor_parallel_candidates", "tensor_parallel_layer", "tensor_splits",
]

LAYOUTS = ("linear", "conv1d")


# --------------------------------------------------------------------------------------------
# How a recognised block computes (a plan), and how its tensors are cut (splits).


@dataclass(frozen=True, slots=True)
class Proj:
    """A projection submodule of a block: ``path`` (relative to the block, e.g. ``"attn.c_attn"``)
    and its weight ``layout``: ``"linear"`` (``nn.Linear``, ``[out, in]``) or ``"conv1d"``
    (Hugging Face's ``Conv1D``, ``[in, out]``). Its bias is ``<path>.bias`` or None."""

    path: str
    layout: str = "linear"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"Proj({self.path!r}): layout={self.layout!r} is not one of {LAYOUTS}")


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """``x = x + dropout(out(attention(qkv(norm(x)))))``; qkv's outputs are ``[q; k; v]``, each
    ``heads`` blocks of ``hidden / heads``."""

    qkv: Proj
    out: Proj
    heads: int
    norm: str | None = None
    """Path of the pre-norm submodule (called as a module; replicated), or None."""
    causal: bool = True
    scale: float | None = None
    """Scores ``q k^T * scale``; None: ``1 / sqrt(head_dim)``."""
    attn_p: float = 0.0
    resid_p: float = 0.0


@dataclass(frozen=True, slots=True)
class MLPPlan:
    """``x = x + dropout(proj(act(fc(norm(x)))))``. ``gelu``: ``"exact"`` or ``"tanh"`` (``F.gelu``,
    fused into the chunked epilogue); or ``activation``: the path of an element-wise module to call
    (Hugging Face's ``act``). Exactly one of the two."""

    fc: Proj
    proj: Proj
    norm: str | None = None
    gelu: str | None = "exact"
    activation: str | None = None
    resid_p: float = 0.0

    def __post_init__(self) -> None:
        if (self.gelu is None) == (self.activation is None):
            raise ValueError(f"MLPPlan: give exactly one of gelu={self.gelu!r} and activation={self.activation!r}")
        if self.gelu is not None and self.gelu not in GELU_KINDS:
            raise ValueError(f"MLPPlan: gelu={self.gelu!r} is not one of 'exact', 'tanh'")


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """A recognised block: its residual sub-layers in the order its forward runs them. What a rule
    registered with :func:`register_tensor_parallel` returns."""

    name: str
    """For messages, e.g. ``"nanoGPT Block"``."""
    sublayers: tuple[AttentionPlan | MLPPlan, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class Split:
    """How one tensor is cut over ``size`` ranks. ``dim`` None: replicated (every rank holds the
    whole tensor). Else dimension ``dim`` is ``blocks`` equal blocks (3 for ``[q; k; v]``), each
    of ``units`` equal units (heads, or MLP features); rank ``r`` holds units
    ``[r units/size, (r+1) units/size)`` of every block, the blocks' pieces concatenated in order.
    The same cut applies to any tensor of the parameter's shape (gradients, Adam's moments)."""

    dim: int | None = None
    blocks: int = 1
    units: int = 1

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``full`` (a new contiguous tensor; replicated: ``full`` itself)."""
        if self.dim is None:
            return full
        if not 0 <= rank < size:
            raise ValueError(f"Split.shard: rank={rank} is not in [0, size={size})")
        n = full.shape[self.dim]
        if self.units % size or n % (self.blocks * self.units):
            raise ValueError(f"Split.shard: {self.units} units of dimension {self.dim} (length {n}, {self.blocks} "
                             f"block(s)) cannot be cut evenly over size={size} ranks; use a size that divides "
                             f"{self.units}")
        block = n // self.blocks
        piece = block // size
        parts = [full.narrow(self.dim, j * block + rank * piece, piece) for j in range(self.blocks)]
        return torch.cat(parts, self.dim).contiguous()

    def merge(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece, in rank order (the inverse of :meth:`shard`,
        bit for bit; replicated: ``parts[0]``)."""
        if not parts:
            raise ValueError("Split.merge: no parts")
        if self.dim is None:
            return parts[0]
        pieces = [p.chunk(self.blocks, self.dim) if self.blocks > 1 else (p,) for p in parts]
        return torch.cat([pieces[r][j] for j in range(self.blocks) for r in range(len(parts))], self.dim)


REPLICATED = Split()

Rule = Callable[[nn.Module], BlockPlan]
"""A recognised class's rule: the block -> its plan (raising ``ValueError`` for a variant it
cannot split)."""

_REGISTERED: dict[type, Rule] = {}


def register_tensor_parallel(cls: type, converter: Rule) -> None:
    """Recognise instances of ``cls`` (and of its subclasses) as transformer blocks: ``converter``
    maps such a block to its :class:`BlockPlan` (which submodules are the norms and projections,
    the heads, the activation, the dropout probabilities). The block's forward must compute what
    the plan says (pre-norm residual sub-layers); its other tensors stay replicated. A rule
    registered for a class wins over the built-in ones."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_tensor_parallel: cls must be an nn.Module subclass, got {cls!r}")
    if not callable(converter):
        raise TypeError(f"register_tensor_parallel: converter must be callable (block -> BlockPlan), got "
                        f"{type(converter).__name__}")
    _REGISTERED[cls] = converter


# --------------------------------------------------------------------------------------------
# The built-in rules.


def _dropout_p(module: nn.Module, attr: str) -> float:
    d = getattr(module, attr, None)
    return float(d.p) if isinstance(d, nn.Dropout) else 0.0


def _is_nanogpt_block(m: nn.Module) -> bool:
    attn, mlp = getattr(m, "attn", None), getattr(m, "mlp", None)
    return (type(m).__name__ == "Block" and all(hasattr(m, a) for a in ("ln_1", "ln_2"))
            and type(attn).__name__ == "CausalSelfAttention" and type(mlp).__name__ == "MLP"
            and all(isinstance(getattr(attn, a, None), nn.Linear) for a in ("c_attn", "c_proj"))
            and all(isinstance(getattr(mlp, a, None), nn.Linear) for a in ("c_fc", "c_proj"))
            and hasattr(attn, "n_head"))


def _nanogpt_plan(m: nn.Module) -> BlockPlan:
    attn, mlp = m.attn, m.mlp
    act = getattr(mlp, "gelu", None)
    gelu, activation = (GELU_KINDS_BACK[act.approximate], None) if isinstance(act, nn.GELU) else (None, "mlp.gelu")
    return BlockPlan("nanoGPT Block", (
        AttentionPlan(Proj("attn.c_attn"), Proj("attn.c_proj"), int(attn.n_head), norm="ln_1", causal=True,
                      attn_p=_dropout_p(attn, "attn_dropout"), resid_p=_dropout_p(attn, "resid_dropout")),
        MLPPlan(Proj("mlp.c_fc"), Proj("mlp.c_proj"), norm="ln_2", gelu=gelu, activation=activation,
                resid_p=_dropout_p(mlp, "dropout")),
    ))


GELU_KINDS_BACK = {"none": "exact", "tanh": "tanh"}


def _is_gpt2_block(m: nn.Module) -> bool:
    return type(m).__name__ == "GPT2Block" and type(m).__module__.startswith("transformers.")


def _gpt2_plan(m: nn.Module) -> BlockPlan:
    attn, mlp = m.attn, m.mlp
    where = "Hugging Face GPT2Block"
    if hasattr(m, "crossattention"):
        raise ValueError(f"{where}: add_cross_attention=True is not supported by the tensor-parallel converter "
                         f"(only self-attention blocks); build the model with add_cross_attention=False")
    impl = getattr(attn.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"{where}: attn_implementation={impl!r} is not supported by the tensor-parallel "
                         f"converter; use attn_implementation='sdpa' (or 'eager')")
    if impl == "eager" and getattr(attn, "reorder_and_upcast_attn", False):
        raise ValueError(f"{where}: reorder_and_upcast_attn=True is not supported by the tensor-parallel converter; "
                         f"set it to False")
    act = mlp.act
    gelu, activation = (GELU_KINDS_BACK[act.approximate], None) if isinstance(act, nn.GELU) else (None, "mlp.act")
    return BlockPlan(where, (
        # Called as block(x) there is no attention mask: Hugging Face's sdpa path is then causal,
        # its eager path attends to every position.
        AttentionPlan(Proj("attn.c_attn", "conv1d"), Proj("attn.c_proj", "conv1d"), int(attn.num_heads),
                      norm="ln_1", causal=impl == "sdpa", scale=float(attn.scaling),
                      attn_p=_dropout_p(attn, "attn_dropout"), resid_p=_dropout_p(attn, "resid_dropout")),
        MLPPlan(Proj("mlp.c_fc", "conv1d"), Proj("mlp.c_proj", "conv1d"), norm="ln_2", gelu=gelu,
                activation=activation, resid_p=_dropout_p(mlp, "dropout")),
    ))


def _mlp_block_plan(m: MLPBlock) -> BlockPlan:
    return BlockPlan("MLPBlock", (MLPPlan(Proj("fc1"), Proj("fc2"), norm="ln" if m.ln is not None else None,
                                          gelu=m.config.gelu, resid_p=m.dropout_p),))


def _attention_block_plan(m: AttentionBlock) -> BlockPlan:
    return BlockPlan("AttentionBlock", (AttentionPlan(
        Proj("qkv"), Proj("out"), m.heads, norm="ln" if m.ln is not None else None, causal=m.causal,
        attn_p=m.config.attn_dropout_p, resid_p=m.dropout_p),))


_BUILT_IN: tuple[tuple[Callable[[nn.Module], bool], Rule], ...] = (
    (lambda m: isinstance(m, MLPBlock), _mlp_block_plan),
    (lambda m: isinstance(m, AttentionBlock), _attention_block_plan),
    (_is_nanogpt_block, _nanogpt_plan),
    (_is_gpt2_block, _gpt2_plan),
)
_BUILT_IN_NAMES = ("MLPBlock", "AttentionBlock", "Block", "GPT2Block")
"""Class names of the built-in rules (to recognise a block inlined in a traced graph)."""


def _plan_of(module: nn.Module) -> BlockPlan | None:
    for cls in type(module).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls](module)
    for matches, rule in _BUILT_IN:
        if matches(module):
            return rule(module)
    return None


def _is_recognised(module: nn.Module) -> bool:
    """Whether a rule matches (without building the plan, which may refuse a variant)."""
    return any(cls in _REGISTERED for cls in type(module).__mro__) or any(m(module) for m, _ in _BUILT_IN)


def _find_blocks(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Recognised blocks and already converted ones, outermost first (nothing inside one is
    searched)."""
    if isinstance(module, TensorParallelBlock) or _is_recognised(module):
        return [(prefix, module)]
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        found += _find_blocks(child, f"{prefix}.{name}" if prefix else name)
    return found


def _inlined_blocks(layer: nn.Module) -> list[str]:
    """Recognised blocks that a traced piece (sequential_from) inlined into its graph: ``path
    (Class)`` from the graph nodes' module stacks."""
    names = set(_BUILT_IN_NAMES) | {cls.__name__ for cls in _REGISTERED}
    found: dict[str, None] = {}
    for piece in [m for m in layer.modules() if isinstance(m, TracedPiece)]:
        for code in (piece.train_code, piece.eval_code):
            for node in code.graph.nodes:
                for path, cls in (node.meta.get("nn_module_stack") or {}).values():
                    cls_name = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", "")
                    if cls_name in names:
                        found[f"{path.removeprefix('model.')} ({cls_name})"] = None
    return list(found)


def _refuse_inlined(layer: nn.Module, what: str) -> None:
    inlined = _inlined_blocks(layer)
    if inlined:
        shown = ", ".join(inlined[:4]) + (f" and {len(inlined) - 4} more" if len(inlined) > 4 else "")
        raise ValueError(
            f"{what}: the layer is a piece traced by sequential_from, whose blocks {shown} are inlined into one ATen "
            f"graph: they cannot be replaced by their tensor-parallel form (unsupported: converting traced pieces); "
            f"build the stage's layers as an nn.Sequential of the untraced modules (virtualflow.parallel.sequential_gpt"
            f"(model) does it for a Hugging Face GPT-2; otherwise the embedding, the blocks called as block(x), the "
            f"final norm and head), or run this stage with tensor=1")


# --------------------------------------------------------------------------------------------
# Splits of a block's tensors.


def _plan_and_width(block: nn.Module, size: int) -> tuple[BlockPlan, int]:
    """The block's plan and the factor from its MLP widths to the whole ones (a converted block
    holds 1/t of them; then ``size`` must be its t)."""
    if not isinstance(block, TensorParallelBlock):
        return _plan_of(block), 1
    t = block.comm.group.size
    if size != t:
        raise ValueError(f"tensor_splits: size={size} but the layer holds a {block.plan.name} converted for "
                         f"tensor={t}; pass size={t} (or the unconverted layer)")
    return block.plan, t


def _check_divides(plan: BlockPlan, block: nn.Module, size: int, width_factor: int = 1) -> None:
    for sub in plan.sublayers:
        if isinstance(sub, AttentionPlan):
            hidden = _weight_of(block, sub.out).shape[0 if sub.out.layout == "linear" else 1]
            if sub.heads < 1 or hidden % sub.heads:
                raise ValueError(f"{plan.name}: hidden={hidden} is not a multiple of heads={sub.heads}")
            if sub.heads % size:
                raise ValueError(f"{plan.name}: heads={sub.heads} is not divisible by tensor={size} (every rank "
                                 f"holds heads/tensor whole heads); choose tensor among the divisors of {sub.heads}")
        else:
            width = _out_features(block, sub.fc) * width_factor
            if width % size:
                raise ValueError(f"{plan.name}: the MLP width {width} ({sub.fc.path}) is not divisible by "
                                 f"tensor={size}; choose tensor among the divisors of {width}")


def _weight_of(block: nn.Module, proj: Proj) -> torch.Tensor:
    weight = getattr(block.get_submodule(proj.path), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{proj.path}: a projection needs a 2-D weight, got {type(weight).__name__}")
    return weight


def _out_features(block: nn.Module, proj: Proj) -> int:
    return _weight_of(block, proj).shape[0 if proj.layout == "linear" else 1]


def _block_splits(block: nn.Module, plan: BlockPlan, size: int, width_factor: int = 1) -> dict[str, Split]:
    """Split of every sharded tensor of ``block`` (names relative to it); the rest is replicated.
    ``width_factor``: t for a converted block (its MLP widths are 1/t of the whole)."""
    _check_divides(plan, block, size, width_factor)
    out: dict[str, Split] = {}

    def column(proj: Proj, blocks: int, units: int) -> None:  # cut the output features
        out[f"{proj.path}.weight"] = Split(0 if proj.layout == "linear" else 1, blocks, units)
        if getattr(block.get_submodule(proj.path), "bias", None) is not None:
            out[f"{proj.path}.bias"] = Split(0, blocks, units)

    def row(proj: Proj, units: int) -> None:  # cut the input features; the bias stays whole
        out[f"{proj.path}.weight"] = Split(1 if proj.layout == "linear" else 0, 1, units)

    for sub in plan.sublayers:
        if isinstance(sub, AttentionPlan):
            column(sub.qkv, 3, sub.heads)
            row(sub.out, sub.heads)
        else:
            width = _out_features(block, sub.fc) * width_factor
            column(sub.fc, 1, width)
            row(sub.proj, width)
    return out


def tensor_splits(layer: nn.Module, size: int) -> dict[str, Split]:
    """For every ``state_dict`` key of the *unconverted* ``layer``: how it is cut over ``size``
    ranks (the :class:`Split` replicated for what stays whole). ``Split.shard`` gives the value
    :func:`tensor_parallel_layer` puts under that key on rank ``r``; ``Split.merge`` of the ranks'
    values gives the whole tensor back, bit for bit. A layer already converted for ``size`` ranks
    gives the same splits (its state's keys are the original's)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_splits: size={size!r} must be an int >= 1 (the tensor-parallel degree)")
    _refuse_inlined(layer, "tensor_splits")
    splits = {key: REPLICATED for key in layer.state_dict()}
    for path, block in _find_blocks(layer):
        plan, factor = _plan_and_width(block, size)
        for name, split in _block_splits(block, plan, size, factor).items():
            splits[f"{path}.{name}" if path else name] = split
    return splits


def tensor_parallel_candidates(layers: Sequence[nn.Module]) -> list[bool]:
    """For each layer: whether it holds a block the converter can split. Not one: a traced piece
    with inlined blocks, or a recognised block in a variant its rule refuses (cross-attention...);
    :func:`tensor_parallel_layer` raises for both. Whether heads and widths divide by a given t is
    checked by :func:`tensor_splits` (``ValueError`` naming the value)."""
    return [_convertible(layer) for layer in layers]


def _convertible(layer: nn.Module) -> bool:
    blocks = _find_blocks(layer)
    if not blocks or _inlined_blocks(layer):
        return False
    try:
        for _, block in blocks:
            if not isinstance(block, TensorParallelBlock):
                _plan_of(block)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# The converted block.


class TensorParallelBlock(nn.Module):
    """This rank's shard of a recognised block: the block's own children (norms, projections with
    sharded weights, dropouts, activation) under their own names, run by :mod:`.sublayers`
    according to its :class:`BlockPlan`. ``forward(x)`` takes the block's input; further
    arguments are accepted only when None or False (Hugging Face passes ``use_cache=False``)."""

    def __init__(self, block: nn.Module, plan: BlockPlan, comm: Comm, *, chunks: int = 1) -> None:
        super().__init__()
        check_chunks(chunks)
        persistent = set(block.state_dict(keep_vars=True))
        for name, child in block.named_children():
            self.add_module(name, child)
        for name, param in block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in block.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name in persistent)
        self.train(block.training)
        self.plan = plan
        self.comm = comm
        self.chunks = chunks
        self.original = type(block).__name__
        size, rank = comm.group.size, comm.group.rank
        self._heads: dict[int, Heads] = {}
        for i, sub in enumerate(plan.sublayers):
            if isinstance(sub, AttentionPlan):
                hidden = _weight_of(self, sub.out).shape[0 if sub.out.layout == "linear" else 1]
                local = sub.heads // size
                self._heads[i] = Heads(rank * local, local, hidden // sub.heads, sub.causal, sub.scale, sub.attn_p)
        self._dropout = any(s.resid_p > 0 or getattr(s, "attn_p", 0.0) > 0 for s in plan.sublayers)

    def _proj(self, proj: Proj) -> Projection:
        module = self.get_submodule(proj.path)
        weight = module.weight if proj.layout == "linear" else module.weight.t()
        return Projection(weight, getattr(module, "bias", None))

    def forward(self, x: torch.Tensor, *args, dropout_seed: int | None = None, **kwargs) -> torch.Tensor:
        extra = [f"argument {i + 1}" for i, a in enumerate(args) if a is not None and a is not False]
        extra += [f"{k}=" for k, v in kwargs.items() if v is not None and v is not False]
        if extra:
            raise ValueError(f"tensor-parallel {self.plan.name}: called with {', '.join(extra)}; only block(x) is "
                             f"supported (no attention mask, cache or encoder states): call the block with its "
                             f"input alone, or leave this layer unconverted (tensor=1)")
        seed = None
        if self.training and self._dropout:
            seed = dropout_seed if dropout_seed is not None else generator_seed()
        for i, sub in enumerate(self.plan.sublayers):
            norm = self.get_submodule(sub.norm) if sub.norm else None
            resid_seed = stream_seed(seed if sub.resid_p > 0 else None, i, RESID_STREAM)
            if isinstance(sub, AttentionPlan):
                heads = self._heads[i]
                x = attention_sublayer(x, norm, self._proj(sub.qkv), self._proj(sub.out), heads, self.comm,
                                       chunks=self.chunks, resid_p=sub.resid_p, resid_seed=resid_seed,
                                       attn_seed=stream_seed(seed if sub.attn_p > 0 else None, i, ATTN_STREAM))
            else:
                act = GELU_KINDS[sub.gelu] if sub.gelu is not None else self.get_submodule(sub.activation)
                x = mlp_sublayer(x, norm, self._proj(sub.fc), self._proj(sub.proj), act, self.comm,
                                 chunks=self.chunks, resid_p=sub.resid_p, resid_seed=resid_seed)
        return x

    def extra_repr(self) -> str:
        return (f"{self.plan.name} on rank {self.comm.group.rank} of {self.comm.group.size}, "
                f"chunks={self.chunks}")


def tensor_parallel_layer(layer: nn.Module, comm: Comm, *, chunks: int = 1, verify: bool = True) -> nn.Module:
    """The ``comm.group.size``-way form of one pipeline layer, for rank ``comm.group.rank``.

    A deep copy of ``layer`` in which every recognised block (the layer itself or any submodule,
    outermost first) is replaced by a :class:`TensorParallelBlock` holding this rank's shard
    (one rank converts too, so that dropout follows one rule for every t); the rest stays
    whole. A layer without a recognised block is returned as it is (not copied). Every rank of
    the group must call this with the same layer, together: ``verify`` checks that (one small
    all-reduce) and raises ``ValueError`` on every rank otherwise. ``chunks``: overlap chunks of
    the blocks' row-parallel epilogues (1 = no overlap)."""
    check_chunks(chunks)
    _refuse_inlined(layer, "tensor_parallel_layer")
    blocks = _find_blocks(layer)
    if not blocks:
        return layer
    size, rank = comm.group.size, comm.group.rank
    for path, block in blocks:  # refuse before any collective
        if isinstance(block, TensorParallelBlock):
            raise ValueError(f"tensor_parallel_layer: {path or 'the layer'} is already a tensor-parallel "
                             f"{block.plan.name} (converted for tensor={block.comm.group.size}); convert the "
                             f"unconverted layer, once")
        _check_divides(_plan_of(block), block, size)
    if verify:
        verify_same_block(layer, comm, f"layer ({type(layer).__name__})", "tensor_parallel_layer")
    out = copy.deepcopy(layer)
    for path, block in _find_blocks(out):
        plan = _plan_of(block)
        with torch.no_grad():
            for name, split in _block_splits(block, plan, size).items():
                owner_path, _, leaf = name.rpartition(".")
                owner = block.get_submodule(owner_path)
                old = getattr(owner, leaf)
                setattr(owner, leaf, nn.Parameter(split.shard(old.detach(), rank, size).clone(),
                                                  requires_grad=old.requires_grad))
        converted = TensorParallelBlock(block, plan, comm, chunks=chunks)
        if not path:
            return converted
        parent_path, _, child = path.rpartition(".")
        out.get_submodule(parent_path).register_module(child, converted)
    return out
