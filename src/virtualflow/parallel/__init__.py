"""Public: model parallelism a user composes into a model - tensor-parallel blocks and tracing.

- :mod:`virtualflow.parallel.tensor`: transformer MLP and attention blocks split over the ranks of
  a group (Megatron-style, with CoCoNeT's reorder and overlap), equal to their single-worker
  blocks; built from :mod:`.collectives` (what the blocks need from communication, as a protocol),
  :mod:`.overlap` (the fused, chunked epilogue) and :mod:`.seeds` (dropout masks and weights from
  a seed alone).
- :mod:`virtualflow.parallel.convert`: :func:`tensor_parallel_layer` turns a pipeline layer into
  its tensor-parallel form (virtualflow's, nanoGPT's and Hugging Face GPT-2's blocks, and classes
  registered with :func:`register_tensor_parallel`), keeping every parameter name;
  :func:`tensor_splits` says how each state entry is cut and merged; :mod:`.layers`
  (:func:`sequential_gpt`) gives nanoGPT's and Hugging Face GPT-2's models as untraced layers it can convert.
- :mod:`virtualflow.parallel.tracing`: :func:`sequential_from` cuts a model that is not an
  ``nn.Sequential`` into pipeline pieces.

Invariant (layering): this package imports only ``plan/`` from virtualflow - no communication,
runtime or configuration code; a communicator is passed in (:class:`Comm`).
(Moved from ``runtime/tensor_parallel.py`` and ``tracing.py``, which re-export it.)
"""

from __future__ import annotations

from virtualflow.parallel.convert import (
    AttentionPlan, BlockPlan, MLPPlan, Proj, Split, TensorParallelBlock, register_tensor_parallel,
    tensor_parallel_candidates, tensor_parallel_layer, tensor_splits,
)
from virtualflow.parallel.collectives import (
    Bounds, ColumnParallelLinear, Comm, Handle, Rank, TokenLayout, all_gather_rows, copy_to_ranks,
    reduce_scatter_rows, split_range,
)
from virtualflow.parallel.overlap import EpilogueConfig, RowParallelEpilogue, epilogue
from virtualflow.parallel.seeds import (
    DROPOUT_BLOCK_ROWS, DropoutSeeds, attention_keep, check_dropout_p, dropout_keep, generator_seed, init_linears,
    keep_scale, skip_init_linear, splitmix64, sub_seed,
)
from virtualflow.parallel.tensor import (
    AttentionBlock, BlockConfig, MLPBlock, TensorParallelAttention, TensorParallelMLP, block_fingerprint,
    verify_same_block,
)
from virtualflow.parallel.gpt import GPTBlock, GPTEmbeddings, GPTHead, sequential_gpt
from virtualflow.parallel.tracing import TracedPiece, sequential_from, shared_parameters

__all__ = [
    "AttentionBlock", "AttentionPlan", "BlockConfig", "BlockPlan", "MLPPlan", "Proj", "Split", "TensorParallelBlock",
    "attention_keep", "generator_seed", "register_tensor_parallel", "sub_seed", "tensor_parallel_candidates",
    "tensor_parallel_layer", "tensor_splits", "Bounds", "ColumnParallelLinear", "Comm", "DROPOUT_BLOCK_ROWS", "DropoutSeeds",
    "EpilogueConfig", "Handle", "MLPBlock", "Rank", "RowParallelEpilogue", "TensorParallelAttention",
    "TensorParallelMLP", "TokenLayout", "TracedPiece", "all_gather_rows", "block_fingerprint", "check_dropout_p",
    "copy_to_ranks", "dropout_keep", "epilogue", "init_linears", "keep_scale", "reduce_scatter_rows",
    "sequential_from", "sequential_gpt", "GPTBlock", "GPTEmbeddings", "GPTHead", "shared_parameters", "skip_init_linear", "split_range", "splitmix64", "verify_same_block",
]
