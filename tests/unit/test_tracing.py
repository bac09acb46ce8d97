"""``virtualflow.parallel.tracing.sequential_from``: a model that is not an ``nn.Sequential`` (GPT-2 from
Hugging Face transformers, a small model with a skip connection and BatchNorm) cut into chained
pieces that compute bit-identical outputs and gradients, in eval mode and in train mode with
dropout; and the errors for bad split points, outputs and inputs.

The GPT-2 is tiny and randomly initialised (nothing is downloaded); it is traced once per module
(about 2.5 s: ``torch.export`` runs twice, in train and in eval mode).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # in the test extra (pyproject.toml): these tests must run, not skip
from torch import nn

from virtualflow.config.pipeline import Pipeline
from virtualflow.plan.pipeline.geometry import layers_of, piece_module, resolve_bounds, tensors_of
from virtualflow.parallel.tracing import TracedPiece, sequential_from, shared_parameters

transformers.logging.set_verbosity_error()

VOCAB = 96
BLOCKS = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a float tensor (torch.equal would call -0.0 == 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), f"{what} differs (max |diff| {(a - b).abs().max().item():.3g})"


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def tokens(batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def traced():
    """(the traced GPT-2 whose weights the pieces share, an independent copy, the pieces)."""
    model = gpt2()
    reference = copy.deepcopy(model)  # made before tracing: the pieces must not need it
    seq = sequential_from(model, tokens(), BLOCKS, output=lambda out: out.logits)
    return model, reference, seq


def run_chain(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The pieces one after another, each given only its predecessor's output (what a pipeline
    stage sees), checking every boundary carries tensors."""
    for layer in layers_of(seq):
        x = layer(x)
        tensors_of(x)
    return x


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def compare_forward_backward(model, reference, seq, ids, *, training: bool, seed: int = 0) -> torch.Tensor:
    for m in (model, reference, seq):
        m.train(training)
        m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout draws for both, if the pieces draw them at run time
    expected = reference(ids).logits
    torch.manual_seed(seed)
    got = run_chain(seq, ids)
    assert_bit_equal(got, expected, f"logits ({'train' if training else 'eval'} mode)")
    loss_of(expected, ids).backward()
    loss_of(got, ids).backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # the pieces hold these very tensors
        assert param.grad is not None, name
        assert_bit_equal(param.grad, ref_params[name].grad, f"gradient of {name}")
    return got


def test_gpt2_eval_mode_bit_identical(traced):
    model, reference, seq = traced
    assert len(seq) == 4 and all(isinstance(p, TracedPiece) for p in seq)
    compare_forward_backward(model, reference, seq, tokens(), training=False)


def test_gpt2_train_mode_dropout_reproduced_from_seed(traced):
    model, reference, seq = traced
    a = compare_forward_backward(model, reference, seq, tokens(), training=True, seed=3)
    b = compare_forward_backward(model, reference, seq, tokens(), training=True, seed=4)
    seq.eval()
    with torch.no_grad():
        plain = seq(tokens())
    # The comparison above means something only if dropout really ran, and drew from the seed.
    assert not torch.equal(a, b) and not torch.equal(a.detach(), plain)


def test_gpt2_other_shapes_and_pipeline_stages(traced):
    """Dynamic shapes: another batch size and sequence length; and the pieces cut into stages as
    the pipeline runtime cuts them (virtualflow.runtime.pipeline) compute the same thing."""
    model, reference, seq = traced
    seq.eval(), reference.eval()
    ids = tokens(batch=3, length=11, seed=1)
    with torch.no_grad():
        expected = reference(ids).logits
        assert_bit_equal(seq(ids), expected, "logits at another shape")
        layers = layers_of(seq)
        x = ids
        for lo, hi in resolve_bounds(Pipeline(stages=2), len(layers)):
            x = piece_module(layers, lo, hi)(x)
        assert_bit_equal(x, expected, "logits through 2 stages")


def test_gpt2_pieces_hold_the_models_weights(traced):
    model, _, seq = traced
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    # GPT-2 ties the output matrix to the token embedding: one tensor, read by pieces 0 and 3.
    assert shared_parameters(seq) == {"0.tensors.transformer.wte.weight": (0, 3)}
    held = seq[1].tensors.get_parameter("transformer.h.1.attn.c_attn.weight")
    assert held is model.transformer.h[1].attn.c_attn.weight
    assert "1.tensors.transformer.h.1.attn.c_attn.weight" in seq.state_dict()
    # The boundaries: piece 0 takes the token ids; later ones the hidden state plus what the
    # blocks need from the start (the attention mask, the batch size and length as 0-d tensors).
    mid = seq[0].eval()(tokens())
    assert isinstance(mid, tuple) and len(mid) > 1 and all(isinstance(t, torch.Tensor) for t in mid)


def test_gpt2_copy_and_untouched_state():
    """Tracing draws no random numbers and leaves train/eval flags alone; the pieces deep-copy."""
    model = gpt2()
    model.train()
    model.transformer.h[2].eval()
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    seq = sequential_from(model, tokens(), ["transformer.h.2"], output=lambda out: out.logits)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == flags
    twin = copy.deepcopy(seq).eval()
    seq.eval()
    with torch.no_grad():
        assert_bit_equal(twin(tokens()), seq(tokens()), "logits of a deep copy")
    assert not ({id(p) for p in twin.parameters()} & {id(p) for p in model.parameters()})


class SkipNet(nn.Module):
    """Not a chain: the input skips to the end, BatchNorm and dropout in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mid = nn.Sequential(nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16))
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.mid(self.inp(x))
        return self.out(h) + x * scale, h.mean()


def test_skip_connection_batchnorm_and_two_inputs():
    torch.manual_seed(0)
    model = SkipNet()
    reference = copy.deepcopy(model)
    x, scale = torch.randn(8, 6), torch.tensor(0.5)
    seq = sequential_from(model, (x, scale), ["mid", "out"])
    for training, seed in ((True, 1), (True, 2), (False, 0)):
        seq.train(training), reference.train(training)
        torch.manual_seed(seed)
        expected = reference(x, scale)
        torch.manual_seed(seed)
        got = run_chain(seq, (x, scale))
        assert isinstance(got, tuple) and len(got) == 2
        for g, e in zip(got, expected):
            assert_bit_equal(g, e, f"output (training={training})")
        # BatchNorm statistics: the pieces update the model's own buffers, as the copy updates its.
        assert_bit_equal(model.mid[0].running_mean, reference.mid[0].running_mean, "running mean")
        (got[0].sum() + got[1]).backward()
        (expected[0].sum() + expected[1]).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_bit_equal(p.grad, q.grad, f"gradient of {name}")
    # x and scale are carried past the middle piece to the last one, which adds them back.
    middle = seq[1](seq[0]((x, scale)))
    assert isinstance(middle, tuple) and len(middle) == 3


def test_errors_name_the_value_and_the_fix():
    model = gpt2()
    ids = tokens()
    with pytest.raises(ValueError, match=r"'transformer\.h\.9' is not a submodule.*did you mean"):
        sequential_from(model, ids, ["transformer.h.9"], output=lambda out: out.logits)
    with pytest.raises(ValueError, match=r"not in the order.*give \['transformer\.h\.1', 'transformer\.h\.3'\]"):
        sequential_from(model, ids, ["transformer.h.3", "transformer.h.1"], output=lambda out: out.logits)
    with pytest.raises(ValueError, match="more than once"):
        sequential_from(model, ids, ["transformer.h.1", "transformer.h.1"])
    with pytest.raises(TypeError, match="example_input must be a tensor"):
        sequential_from(model, {"input_ids": ids}, ["transformer.h.1"])
    # GPT-2 returns a ModelOutput holding a cache torch.export cannot flatten: the error says
    # how to pick the logits.
    with pytest.raises(RuntimeError, match=r"could not trace GPT2LMHeadModel.*output=lambda out: out\.logits"):
        sequential_from(model, ids, ["transformer.h.1"])
    # A model returning a dict traces, but the last piece must return tensors.
    with pytest.raises(ValueError, match=r"returns a dict, but the last piece must return a tensor.*output="):
        sequential_from(model, ids, ["transformer.h.1"], output=lambda out: {"logits": out.logits})


def test_error_for_a_piece_with_nothing_to_do():
    torch.manual_seed(0)
    model = SkipNet()
    with pytest.raises(ValueError, match=r"piece 1 \(between 'mid' and 'mid\.0'\) would compute no tensor"):
        sequential_from(model, (torch.randn(4, 6), torch.tensor(1.0)), ["mid", "mid.0"])
    seq = sequential_from(model, (torch.randn(4, 6), torch.tensor(1.0)), ["out"])
    with pytest.raises(ValueError, match=r"piece 0 of 2.* takes 2 value\(s\).*got 1"):
        seq[0](torch.randn(4, 6))
