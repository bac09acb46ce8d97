"""parallel/convert: pipeline layers turned into their tensor-parallel form, against the unconverted layers.

In-process: t ranks are threads over ``tests/fabric.py`` running the real ring collectives
(``comm.ring.Collectives`` over a ``FakeGroup``). The model is nanoGPT's (its ``LayerNorm``,
``CausalSelfAttention``, ``MLP`` and ``Block`` classes, as a user has them in ``model.py``: the
tests' one copy, ``tests/nanogpt.py``)
cut into pipeline layers: embeddings, blocks, the final norm and head. Checked:

- t = 2 and 4: output, input gradient and every parameter's gradient (the ranks' shards merged
  by ``tensor_splits``) equal the unconverted layer's; float64 to 1e-12, float32 to
  ``atol=1e-5, rtol=1e-4`` (measured differences: docs/coconet.md); chunks 1 and 3;
- t = 1: bit-identical to the unconverted layer (dropout off, chunks=1), float32 and float64;
- the LayerNorms' gradients are bit-identical on every rank;
- dropout (residual and attention probabilities): t = 1, 2 and 4 drop the same elements (float64
  to 1e-12); the seed is one draw from the default generator per forward, and
  ``torch.utils.checkpoint``'s recompute draws the same;
- ``tensor_splits``: shard then merge gives every tensor back bit for bit; the converted layer's
  ``state_dict`` holds exactly the original's keys, each value its rank's shard;
- Hugging Face's ``GPT2Block`` the same (when transformers is installed), and the refusal of a
  piece traced by ``sequential_from``;
- errors: heads or MLP width not divisible, extra forward arguments, bad chunks, a rank holding
  another layer.

Threads share torch's default generator, so the threaded cases pass explicit ``dropout_seed``;
the generator rule across real processes is checked in tests/e2e/test_tensor_parallel.py.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric, run_ranks
from nanogpt import nanogpt_layers
from virtualflow.comm.groups import Group
from virtualflow.comm.ring import Collectives
from virtualflow.parallel import convert as convert_module
from virtualflow.parallel import (
    AttentionBlock, BlockConfig, BlockPlan, MLPBlock, MLPPlan, Proj, Split, TensorParallelBlock, generator_seed,
    register_tensor_parallel, tensor_parallel_candidates, tensor_parallel_layer, tensor_splits,
)

F64 = dict(atol=1e-12, rtol=1e-12)
F32 = dict(atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Helpers.


def one_rank() -> Collectives:
    return Collectives(Group(0, 0, 1, None))


class _OneCopyAtATime:
    """``copy`` for the converter while ranks run as threads of this process: every rank deep-copies
    the same layer, and deep copies of one module from several threads at once are not safe (a
    worker process copies its own); one at a time (no collective runs inside a copy)."""

    lock = threading.Lock()

    @staticmethod
    def deepcopy(x, memo=None):
        with _OneCopyAtATime.lock:
            return copy.deepcopy(x, memo)


def on_ranks(t: int, body):
    """``body(comm)`` on t threads, each with its Collectives over the in-process fabric."""
    def run(rank, group):
        comm = Collectives(group)
        try:
            return body(comm)
        finally:
            comm.close()
    saved = convert_module.copy
    convert_module.copy = _OneCopyAtATime
    try:
        return run_ranks(Fabric(t), run)
    finally:
        convert_module.copy = saved


def run_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, **kwargs):
    """Output, input gradient and {name: gradient} of one forward + backward of ``(y * g).sum()``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x, **kwargs)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def inputs(dtype, batch=3, seq=6, hidden=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, hidden, generator=gen, dtype=dtype),
            torch.randn(batch, seq, hidden, generator=gen, dtype=dtype))


def assert_close(got, want, exact, tol, what):
    if exact:
        assert torch.equal(got, want), f"{what}: not bit-identical, max |diff| {(got - want).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def compare_tp(layer, t, x, g, tol, chunks=1, **kwargs) -> float:
    """Run ``layer`` converted on t ranks and compare with the unconverted layer. Returns the max
    abs difference seen (output, input gradient, every merged parameter gradient)."""
    y_ref, gx_ref, grads_ref = run_layer(layer, x, g, **kwargs)
    splits = tensor_splits(layer, t)
    outs = on_ranks(t, lambda comm: run_layer(tensor_parallel_layer(layer, comm, chunks=chunks), x, g, **kwargs))
    worst = 0.0
    for rank, (y, gx, grads) in enumerate(outs):
        assert_close(y, y_ref, False, tol, f"rank {rank} output")
        assert_close(gx, gx_ref, False, tol, f"rank {rank} input grad")
        assert set(grads) == set(grads_ref)
        worst = max(worst, (y - y_ref).abs().max().item(), (gx - gx_ref).abs().max().item())
    for name, want in grads_ref.items():
        merged = splits[name].merge([grads[name] for _, _, grads in outs])
        assert_close(merged, want, False, tol, f"grad {name}")
        worst = max(worst, (merged - want).abs().max().item())
        if splits[name].replicated:  # the same on every rank (LayerNorms: bit for bit)
            for rank, (_, _, grads) in enumerate(outs):
                exact = "ln" in name
                assert_close(grads[name], outs[0][2][name], exact, tol, f"grad {name} rank {rank} vs 0")
    return worst


# --------------------------------------------------------------------------------------------
# Equal to the unconverted layers.


@pytest.mark.parametrize("t", [2, 4])
def test_converted_nanogpt_block_equals_the_block_float64(t):
    layers = nanogpt_layers()
    x, g = inputs(torch.float64)
    for layer in (layers[1], layers[2], nanogpt_layers(bias=False)[1]):
        for chunks in (1, 3):
            compare_tp(layer, t, x, g, F64, chunks=chunks)


def test_converted_nanogpt_block_float32_within_tolerance(capsys):
    layers = nanogpt_layers(torch.float32)
    x, g = inputs(torch.float32)
    worst = max(compare_tp(layers[2], t, x, g, F32, chunks=c) for t in (2, 4) for c in (1, 2))
    with capsys.disabled():
        print(f"\nnanoGPT two blocks, float32, t = 2 and 4: max |diff| {worst:.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_rank_conversion_is_bit_identical(dtype):
    layers = nanogpt_layers(dtype, bias=False)
    x, g = inputs(dtype)
    comm = one_rank()
    for layer in (layers[1], layers[2]):
        conv = tensor_parallel_layer(layer, comm)
        assert conv is not layer
        y_ref, gx_ref, grads_ref = run_layer(layer, x, g)
        y, gx, grads = run_layer(conv, x, g)
        assert_close(y, y_ref, True, {}, "output")
        assert_close(gx, gx_ref, True, {}, "input grad")
        for name, want in grads_ref.items():
            assert_close(grads[name], want, True, {}, f"grad {name}")


def test_the_whole_model_layer_by_layer_with_replicated_embeddings_and_head():
    layers = nanogpt_layers()
    idx = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(3))
    assert tensor_parallel_candidates(list(layers)) == [False, True, True, False]

    def body(comm):
        # Each rank its own copy: a layer with nothing to split is returned as it is, and two
        # threads' backwards must not accumulate into one .grad (a worker process has its own).
        mine = [_OneCopyAtATime.deepcopy(layer) for layer in layers]
        converted = nn.Sequential(*[tensor_parallel_layer(layer, comm) for layer in mine])
        converted.zero_grad()
        loss = converted(idx).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in converted.named_parameters()}

    layers.zero_grad()
    ref = layers(idx).logsumexp(-1).mean()
    ref.backward()
    splits = {f"{i}.{k}": s for i, layer in enumerate(layers) for k, s in tensor_splits(layer, 2).items()}
    outs = on_ranks(2, body)
    for loss, _ in outs:
        assert_close(loss, ref.detach(), False, F64, "loss")
    for name, p in layers.named_parameters():
        assert_close(splits[name].merge([grads[name] for _, grads in outs]), p.grad, False, F64, f"grad {name}")
    assert layers[0] is tensor_parallel_layer(layers[0], one_rank())  # nothing to split: the layer itself


# --------------------------------------------------------------------------------------------
# Names and splits.


def test_state_dict_names_are_the_original_names_and_values_the_shards():
    layers = nanogpt_layers(bias=False)
    for layer in (layers[1], layers[2]):
        for t in (1, 2, 4):
            splits = tensor_splits(layer, t)
            state = layer.state_dict()
            assert set(splits) == set(state)
            for key, full in state.items():
                parts = [splits[key].shard(full, r, t) for r in range(t)]
                assert torch.equal(splits[key].merge(parts), full), key
            convs = on_ranks(t, lambda comm: tensor_parallel_layer(layer, comm))
            assert tensor_splits(convs[0], t) == splits  # a converted layer gives the same splits
            for rank, conv in enumerate(convs):
                assert [n for n, _ in conv.named_parameters()] == [n for n, _ in layer.named_parameters()]
                conv_state = conv.state_dict()
                assert list(conv_state) == list(state)
                for key, full in state.items():
                    assert torch.equal(conv_state[key], splits[key].shard(full, rank, t)), key
    # A parameter a rank holds half of: qkv rows of its heads (q, k and v each), the MLP's columns.
    s = tensor_splits(layers[1], 2)
    assert s["attn.c_attn.weight"] == Split(0, 3, 4) and s["attn.c_proj.weight"] == Split(1, 1, 4)
    assert s["mlp.c_fc.weight"] == Split(0, 1, 64) and s["mlp.c_proj.weight"] == Split(1, 1, 64)
    assert s["ln_1.weight"].replicated


def test_split_cuts_q_k_and_v_by_heads():
    full = torch.arange(12.0).view(12, 1)  # 3 blocks (q, k, v) of 2 heads of 2 rows
    split = Split(0, 3, 2)
    assert split.shard(full, 0, 2).view(-1).tolist() == [0, 1, 4, 5, 8, 9]
    assert split.shard(full, 1, 2).view(-1).tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(split.merge([split.shard(full, r, 2) for r in range(2)]), full)
    adam_state = torch.randn(12, 1)  # optimizer state of the parameter's shape: the same cut
    assert torch.equal(split.merge([split.shard(adam_state, r, 2) for r in range(2)]), adam_state)
    with pytest.raises(ValueError, match="cannot be cut evenly over size=4"):
        split.shard(full, 0, 4)


# --------------------------------------------------------------------------------------------
# Dropout.


def test_dropout_masks_do_not_depend_on_t():
    """Residual and attention-probability dropout: t = 1, 2, 4 give the same output and
    gradients for one seed (float64 to 1e-12); the seed changes them."""
    layers = nanogpt_layers(dropout=0.2)
    x, g = inputs(torch.float64)
    layer = layers[1]
    one = tensor_parallel_layer(layer, one_rank())
    y1, gx1, grads1 = run_layer(one, x, g, dropout_seed=1234)
    y_other, _, _ = run_layer(one, x, g, dropout_seed=1235)
    layer.eval()
    with torch.no_grad():
        y_eval = layer(x)
    layer.train()
    assert not torch.allclose(y1, y_eval) and not torch.allclose(y1, y_other)
    for t in (2, 4):
        splits = tensor_splits(layer, t)
        outs = on_ranks(t, lambda comm: run_layer(tensor_parallel_layer(layer, comm), x, g, dropout_seed=1234))
        for y, gx, _ in outs:
            assert_close(y, y1, False, F64, f"t={t} output")
            assert_close(gx, gx1, False, F64, f"t={t} input grad")
        for name, want in grads1.items():
            assert_close(splits[name].merge([gr[name] for _, _, gr in outs]), want, False, F64, f"t={t} grad {name}")


def test_the_seed_is_one_draw_from_the_default_generator_and_checkpoint_recomputes_it():
    layer = tensor_parallel_layer(nanogpt_layers(dropout=0.2)[1], one_rank())
    x, g = inputs(torch.float64)
    torch.manual_seed(7)
    seed = generator_seed()
    after_one_draw = torch.random.get_rng_state()
    torch.manual_seed(7)
    y, gx, grads = run_layer(layer, x, g)
    assert torch.equal(torch.random.get_rng_state(), after_one_draw)  # exactly one draw per forward
    y_seed, gx_seed, grads_seed = run_layer(layer, x, g, dropout_seed=seed)
    assert torch.equal(y, y_seed) and torch.equal(gx, gx_seed)

    torch.manual_seed(7)
    layer.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_()
    yc = torch.utils.checkpoint.checkpoint(layer, xc, use_reentrant=False)
    (yc * g).sum().backward()
    assert torch.equal(yc.detach(), y) and torch.equal(xc.grad, gx)  # the recompute drew the same seed
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    layer.eval()
    state = torch.random.get_rng_state()
    layer(x)
    assert torch.equal(torch.random.get_rng_state(), state)  # eval mode draws nothing


def test_virtualflow_blocks_with_layer_norm_and_attention_dropout():
    """MLPBlock / AttentionBlock with the new options: the converter (generator rule) and
    from_module, on 2 ranks, equal the single-worker blocks; LN grads equal on every rank."""
    config = BlockConfig(layer_norm=True, ln_bias=False, bias=False, gelu="tanh", attn_dropout_p=0.25,
                         dropout_seeds="generator")
    x, g = inputs(torch.float64, hidden=12)
    for block in (MLPBlock(12, 20, 0.2, seed=3, config=config).double(),
                  AttentionBlock(12, 4, 0.2, seed=4, config=config).double()):
        with torch.no_grad():
            block.ln.weight.add_(0.3 * torch.randn_like(block.ln.weight))
        torch.manual_seed(5)
        seed = generator_seed()
        torch.manual_seed(5)
        y_gen, _, _ = run_layer(block, x, g)
        y_ref, gx_ref, grads_ref = run_layer(block, x, g, dropout_seed=seed)
        assert torch.equal(y_gen, y_ref)  # the single worker drew that seed too
        splits = tensor_splits(block, 2)
        outs = on_ranks(2, lambda comm: run_layer(tensor_parallel_layer(block, comm), x, g, dropout_seed=seed))
        for y, gx, grads in outs:
            assert_close(y, y_ref, False, F64, "output")
            assert_close(gx, gx_ref, False, F64, "input grad")
            assert torch.equal(grads["ln.weight"], outs[0][2]["ln.weight"])
        for name, want in grads_ref.items():
            assert_close(splits[name].merge([gr[name] for _, _, gr in outs]), want, False, F64, name)


# --------------------------------------------------------------------------------------------
# Hugging Face GPT2Block.


def _gpt2_block(dtype, dropout=0.0):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_head=4, n_layer=1, n_positions=16, resid_pdrop=dropout,
                                     attn_pdrop=dropout, embd_pdrop=dropout)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    block = GPT2Block(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.shape[0] == 16 else 0.0))
    return block


def test_hugging_face_gpt2_block():
    block = _gpt2_block(torch.float64)
    x, g = inputs(torch.float64)
    conv = tensor_parallel_layer(block, one_rank())
    y_ref, gx_ref, grads_ref = run_layer(block, x, g)
    y, gx, grads = run_layer(conv, x, g)  # one rank: HF's own kernels (Conv1D's addmm, sdpa, NewGELU)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    for t in (2, 4):
        compare_tp(block, t, x, g, F64)
    assert tensor_splits(block, 2)["attn.c_attn.weight"] == Split(1, 3, 4)  # Conv1D: [in, out]
    with pytest.raises(ValueError, match="only block\\(x\\) is supported"):
        conv(x, None, torch.zeros(1))
    block.crossattention = nn.Linear(2, 2)  # as GPT2Config(add_cross_attention=True) adds
    assert tensor_parallel_candidates([block]) == [False]
    with pytest.raises(ValueError, match="add_cross_attention=True is not supported"):
        tensor_parallel_layer(block, one_rank())


def test_hugging_face_gpt2_block_float32_and_dropout(capsys):
    block = _gpt2_block(torch.float32)
    x, g = inputs(torch.float32)
    worst = max(compare_tp(block, t, x, g, F32, chunks=c) for t in (2, 4) for c in (1, 2))
    with capsys.disabled():
        print(f"\nHF GPT2Block, float32, t = 2 and 4: max |diff| {worst:.3g}")
    block = _gpt2_block(torch.float64, dropout=0.2)
    x, g = inputs(torch.float64)
    y1, _, _ = run_layer(tensor_parallel_layer(block, one_rank()), x, g, dropout_seed=99)
    for y, _, _ in on_ranks(2, lambda comm: run_layer(tensor_parallel_layer(block, comm), x, g, dropout_seed=99)):
        assert_close(y, y1, False, F64, "dropout output")


def test_sequential_gpt_of_gpt2_is_the_model_and_converts():
    """sequential_gpt on GPT-2: the untraced chain computes model(ids).logits bit for bit (eval, and train
    with dropout after the same manual_seed: the same modules draw in the same order); converted
    for 2 ranks it equals the chain (float64)."""
    transformers = pytest.importorskip("transformers")
    from virtualflow.parallel import sequential_gpt
    config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=16, n_layer=2, n_head=4,
                                     tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    layers = sequential_gpt(model)
    ids = torch.randint(0, 20, (3, 8), generator=torch.Generator().manual_seed(1))
    for training in (False, True):
        model.train(training)
        torch.manual_seed(4)
        want = model(ids).logits
        torch.manual_seed(4)
        assert torch.equal(layers(ids), want)
    assert tensor_parallel_candidates(list(layers)) == [False, True, True, False]
    model.eval()
    want = model(ids).logits.detach()
    outs = on_ranks(2, lambda comm: nn.Sequential(*[tensor_parallel_layer(l, comm) for l in layers])(ids).detach())
    for got in outs:
        assert_close(got, want, False, F64, "converted GPT-2 logits")
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='eager'.*'sdpa'"):
        sequential_gpt(model)
    with pytest.raises(TypeError, match="not of nanoGPT's or Hugging Face GPT-2's shape"):
        sequential_gpt(nn.Linear(2, 2))


def test_a_traced_piece_is_refused_with_its_blocks_named():
    """sequential_from inlines the blocks into one ATen graph (Hugging Face's GPT-2 as nanoGPT's):
    the converter cannot replace them, says so and names them."""
    from virtualflow.parallel import sequential_from
    layers = nanogpt_layers(torch.float32)
    model = nn.Sequential(layers[0], layers[1], layers[3])
    pieces = sequential_from(model, torch.zeros(2, 8, dtype=torch.long), ["1.mlp"], dynamic=False)
    assert tensor_parallel_candidates(list(pieces)) == [False, False]
    with pytest.raises(ValueError, match=r"blocks 1 \(Block\) are inlined.*nn.Sequential of the untraced"):
        tensor_parallel_layer(pieces[1], one_rank())


# --------------------------------------------------------------------------------------------
# Registration and errors.


class MyMLP(nn.Module):
    """A user's own pre-norm MLP block, registered with a plan."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_a_registered_class_is_converted():
    register_tensor_parallel(MyMLP, lambda m: BlockPlan("MyMLP", (MLPPlan(Proj("up"), Proj("down"), norm="norm"),)))
    torch.manual_seed(0)
    block = MyMLP().double()
    x, g = inputs(torch.float64, hidden=8)
    assert tensor_parallel_candidates([block, nn.Linear(8, 8)]) == [True, False]
    compare_tp(block, 2, x, g, F64)
    assert isinstance(on_ranks(2, lambda comm: tensor_parallel_layer(block, comm))[0], TensorParallelBlock)


def test_bad_layers_are_refused_with_the_value_the_rule_and_the_knob():
    block = nanogpt_layers(n_head=3, n_embd=12)[1]
    with pytest.raises(ValueError, match="heads=3 is not divisible by tensor=2.*divisors of 3"):
        on_ranks(2, lambda comm: tensor_parallel_layer(block, comm))
    with pytest.raises(ValueError, match="heads=3 is not divisible by tensor=2"):
        tensor_splits(block, 2)
    mlp = MLPBlock(8, 6)
    with pytest.raises(ValueError, match="MLP width 6 .*not divisible by tensor=4"):
        tensor_splits(mlp, 4)
    with pytest.raises(ValueError, match="chunks=0"):
        tensor_parallel_layer(block, one_rank(), chunks=0)
    with pytest.raises(ValueError, match="size=0"):
        tensor_splits(block, 0)
    conv = tensor_parallel_layer(block, one_rank())
    with pytest.raises(ValueError, match="already a tensor-parallel nanoGPT Block"):
        tensor_parallel_layer(nn.Sequential(conv), one_rank())
    with pytest.raises(ValueError, match="size=2 but the layer holds a nanoGPT Block converted for tensor=1"):
        tensor_splits(conv, 2)
    with pytest.raises(ValueError, match="nanoGPT Block: called with argument 1"):
        conv(torch.zeros(1, 2, 12), torch.ones(1))

    def differing(comm):  # rank 1 holds other weights
        other = nanogpt_layers()[1]
        if comm.group.rank == 1:
            with torch.no_grad():
                other.ln_1.weight.add_(1.0)
        return tensor_parallel_layer(other, comm)

    with pytest.raises(ValueError, match="differs between the 2 ranks"):
        on_ranks(2, differing)
