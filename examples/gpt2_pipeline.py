"""A tiny GPT-2 trained as a character-level language model, cut into a 4-stage pipeline.

The model is Hugging Face's ``GPT2LMHeadModel`` (random initialisation, nothing downloaded),
which is not an ``nn.Sequential``: :func:`virtualflow.parallel.tracing.sequential_from` traces it and cuts
it before blocks 1, 2 and 3 into four chained pieces, one per pipeline stage (1F1B schedule).
The text is the dataset descriptions that ship with scikit-learn
(``sklearn/datasets/descr/*.rst``, about 80 kB), read in sorted file order and tokenised one
character per token, so the data is the same on every machine and nothing is fetched.

    python examples/gpt2_pipeline.py --out gpt2_pipeline.png --steps 50
    virtualflow run examples/gpt2_pipeline.py --workers 4 --steps 50

Run as a script, it first checks on one batch, in plain PyTorch, that the pieces compute the
same loss as the untraced GPT-2, then trains the pipelined job on 4 workers and the same job
without a pipeline on 1 worker, and plots both loss curves on one figure.

The embedding and output matrices are untied (``tie_word_embeddings=False``) so that the run is
exact in deterministic mode too: tied, they are one weight read by the first and the last stage;
each stage then holds a copy and virtualflow sums the copies' gradients before every update
(default mode only; see ``virtualflow.parallel.tracing.shared_parameters`` and docs/pipeline.md).
"""

from __future__ import annotations

import argparse
import copy
import pathlib

import torch
from torch import nn
from torch.utils.data import Dataset

import virtualflow as vf
from virtualflow import Pipeline
from virtualflow.parallel import sequential_from

SEQ_LEN = 64
"""Characters per sample (the model's context length)."""
GLOBAL_BATCH, VIRTUAL_NODES = 16, 8
MICRO_BATCH = GLOBAL_BATCH // VIRTUAL_NODES
"""Samples per virtual node: the pipeline's micro-batch, and the batch size traced."""
SPLIT_POINTS = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
"""Pieces start at these GPT-2 blocks: 4 pieces for 4 stages."""


def corpus() -> tuple[str, torch.Tensor]:
    """(the vocabulary, the whole text as token ids): one token per distinct character.

    Not cached (reading 80 kB takes milliseconds): run as a script, this file's functions reach
    the worker processes by value (cloudpickle), and an ``lru_cache`` wrapper would not."""
    import sklearn.datasets  # the .rst files ship inside the package

    folder = pathlib.Path(sklearn.datasets.__file__).parent / "descr"
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.rst")))
    vocab = "".join(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    return vocab, torch.tensor([index[ch] for ch in text], dtype=torch.long)


class CharWindows(Dataset):
    """Non-overlapping windows of the text: sample ``i`` is (``SEQ_LEN`` characters, the same
    characters shifted by one), the inputs and the next-character targets."""

    def __init__(self) -> None:
        self.ids = corpus()[1]
        self.count = (len(self.ids) - 1) // SEQ_LEN

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} out of range [0, {self.count})")
        window = self.ids[i * SEQ_LEN: i * SEQ_LEN + SEQ_LEN + 1]
        return window[:-1], window[1:]


def gpt2() -> nn.Module:
    """The untraced model: 4 blocks of width 64 (about 0.2 M parameters), dropout 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(corpus()[0]), n_positions=SEQ_LEN, n_embd=64, n_layer=4, n_head=4,
        tie_word_embeddings=False,  # see the module docstring
        use_cache=False,  # training only: no key/value cache in the traced graph
        bos_token_id=0, eos_token_id=0,  # the defaults (50256) lie outside this vocabulary
    )
    return GPT2LMHeadModel(config)


def logits_of(output) -> torch.Tensor:
    """GPT-2 returns a ModelOutput; the last pipeline piece returns its logits."""
    return output.logits


def model() -> nn.Sequential:
    example = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    return sequential_from(gpt2(), example, SPLIT_POINTS, output=logits_of)


def output_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    """Mean next-character cross-entropy over every position of the micro-batch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def make_job() -> vf.Job:
    return vf.Job(
        name="gpt2-pipeline",
        model=model,
        optimizer=optimizer,
        dataset=CharWindows,
        output_loss=output_loss,
        global_batch_size=GLOBAL_BATCH,
        virtual_nodes=VIRTUAL_NODES,
        pipeline=Pipeline(stages=4, schedule="1f1b"),
        seed=0,
    )


def make_unpipelined_job() -> vf.Job:
    """The same job without a pipeline: same model, data, seed and optimizer."""
    return make_job().replace(pipeline=None, name="gpt2-unpipelined")


def check_pieces() -> float:
    """On one batch, in plain PyTorch: the pieces' loss equals the untraced GPT-2's, in eval mode
    and in train mode (dropout drawn after the same seed). Returns the loss."""
    torch.manual_seed(0)
    original = gpt2()
    reference = copy.deepcopy(original)
    pieces = sequential_from(original, torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long), SPLIT_POINTS,
                             output=logits_of)
    data = CharWindows()
    batch = tuple(torch.stack(column) for column in zip(*(data[i] for i in range(MICRO_BATCH))))
    for training in (False, True):
        pieces.train(training), reference.train(training)
        torch.manual_seed(1)
        got = output_loss(pieces(batch[0]), batch)
        torch.manual_seed(1)
        want = output_loss(logits_of(reference(batch[0])), batch)
        if not torch.equal(got, want):
            raise AssertionError(f"pieces' loss {got.item()} != GPT-2's {want.item()} (training={training})")
    return want.item()


def plot(curves: dict[str, list[float]], path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    # The runs should coincide: draw the first wide and pale, the second thin and dashed on top.
    styles = [dict(linewidth=4, alpha=0.45), dict(linewidth=1.2, linestyle="--")]
    for (label, losses), style in zip(curves.items(), styles):
        ax.plot(range(1, len(losses) + 1), losses, label=label, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title(f"tiny GPT-2 on scikit-learn's dataset descriptions (B={GLOBAL_BATCH}, V={VIRTUAL_NODES})")
    ax.legend()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpt2_pipeline.png", help="where to write the loss-curve figure")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps for each run")
    args = parser.parse_args()

    print(f"pieces == GPT-2 on one batch (loss {check_pieces():.4f})")
    piped = vf.train(make_job, workers=4, steps=args.steps)
    plain = vf.train(make_unpipelined_job, workers=1, steps=args.steps)
    curves = {
        "4-stage pipeline (1F1B), 4 workers": [r["loss"] for r in piped.history],
        "no pipeline, 1 worker": [r["loss"] for r in plain.history],
    }
    for label, losses in curves.items():
        print(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    a, b = curves.values()
    print(f"largest per-step loss difference between the runs: {max(abs(x - y) for x, y in zip(a, b)):.3g}")
    plot(curves, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
