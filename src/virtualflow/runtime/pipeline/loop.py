"""The training loop's knobs on a pipeline stage: precision, loss scaling, clipping, checkpointing,
compile, and the loss function's metrics.

Purpose: :class:`StageLoop` is what one worker's :class:`~virtualflow.runtime.pipeline.StageEngine`
knows of ``Job.precision``, ``loss_scale``, ``max_grad_norm``, ``activation_checkpointing`` and
``compile``; :func:`stage_loop` builds it from a job and the model's layers. The step's part of
the work is done by the flush step (:mod:`.flush`) with the helpers here, so the decisions are
those of the VN engine:

- **Autocast per piece.** Each piece's forward (and, on the last piece, ``Job.output_loss``) runs
  under :func:`virtualflow.runtime.amp.autocast`; parameters, gradients and optimizer state stay
  in the model's dtype (activations and their gradients travel in the dtype autocast gave them).
- **Global loss-scaling decisions.** Every worker holds a :class:`~virtualflow.runtime.amp.LossScaler`;
  the last piece multiplies its weighted loss by the scale before the backward; after the step's
  reduction every worker unscales its gradients and counts a non-finite element; that count is
  summed over **every** worker in the step's stats all-reduce, so a step is skipped on every
  stage and replica or on none, and each worker's scaler takes the same ``update(found_inf)``.
- **The whole model's norm, one rule.** The norm is :class:`virtualflow.runtime.clipping.NormBlocks`'s,
  the VN engine's: every worker writes the block sums of the parameters it counts into their
  entries (their place in the whole model's parameter order) of a vector in the step's stats.
  Only replica 0's workers fill it (every replica's chunk, with the sharded reduction in default
  mode), and a weight shared by layers on several workers counts at its first layer only, so
  every entry has exactly one non-zero contributor and the all-reduce is exact (float64 holds
  the gradients' dtype exactly); the norm is the vector's sum in the gradients' dtype, taken the
  same way on every worker. A parameter's gradient does not depend on how the model is cut or how
  many replicas ran (deterministic mode), so neither does the norm: the pipelined run's norm, and
  its clipped update, are the unpipelined run's bit for bit. Tensor-parallel stages: a sharded
  parameter's shards fill one slot each, summed over the tensor group (exact too).
- **Metrics**: ``output_loss`` may return ``(loss, {name: value})``; the last piece weights each
  value by the virtual node's share of the global batch (``n_v / B``) and sums; the sums of the
  replicas' last pieces meet in one more small all-reduce after the stats (only when the loss
  returned metrics), which also carries their names from replica 0's last piece (the other workers
  cannot know them). They are reported, never trained on: equal across replica counts within
  float rounding (the loss itself follows the VN tree in deterministic mode).
- **Checkpointing and compile per piece**, once per worker
  (:func:`virtualflow.runtime.model_prep.prepare_model`): ``"every"`` checkpoints each layer of
  each piece; module names are those of ``named_modules()`` of the layer list (``"3.attn"``: layer
  3's ``attn``; for an ``nn.Sequential`` model the whole model's own names), and a piece takes the
  names (or classes) it holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Generator, Mapping, Sequence

import torch
from torch import nn

from virtualflow.config.composition import check
from virtualflow.runtime.amp import LossScaler, autocast
from virtualflow.runtime.clipping import NormBlocks, norm_dtype
from virtualflow.runtime.model_prep import prepare_model
from virtualflow.runtime.pipeline.requests import AllSum, Request
from virtualflow.runtime.step.finish import ONE_SLOT, OneSlot, StepFinish, TensorSlots
from virtualflow.runtime.step.weighting import LossWeighting

__all__ = ["StageLoop", "check_checkpoint_spec", "check_schedule", "checkpoint_spec_for", "model_norm_blocks",
           "share_metrics", "stage_loop", "weighted_metrics"]


@dataclass(slots=True)
class StageLoop:
    """One worker's training-loop settings (see the module docstring). The defaults train as the
    pipeline did before these knobs: float32, no scaling, no clipping, nothing prepared."""

    precision: str = "32"
    scaler: LossScaler | None = None
    """``"16-mixed"``: this worker's loss scaler (every worker holds one; they evolve identically)."""
    max_grad_norm: float | None = None
    blocks: NormBlocks | None = None
    """The whole model's norm blocks (when clipping): the norm's entries of the stats vector."""
    norm_names: Mapping[str, int] | None = None
    """Whole-model parameter name (``"<layer>.<name>"``, a shared weight at its first layer) ->
    its index in the model's parameter order (the blocks' order)."""
    norm_excluded: frozenset[str] = frozenset()
    """Parameter names (whole-model, ``"<layer>.<name>"``) of copies of a weight shared across
    workers at a layer after its first: not counted in the norm (the first copy is)."""
    activation_checkpointing: Any = None
    compile: bool | Mapping[str, Any] = False
    slots_of: Callable[[torch.device], OneSlot | TensorSlots] = lambda device: ONE_SLOT
    """How this worker's gradients fill the norm's slots and join their inf/nan flags: alone
    (:data:`~virtualflow.runtime.step.finish.ONE_SLOT`), or over its tensor-parallel group
    (:class:`~virtualflow.runtime.step.finish.TensorSlots`, set once when a tensor-parallel stage
    is built: :meth:`TensorParallelStage.hook_loop <virtualflow.runtime.pipeline.tensor_stage.TensorParallelStage.hook_loop>`)."""
    finish: StepFinish = field(init=False)
    """The step finish of these settings (:mod:`virtualflow.runtime.step.finish`): the norm is
    taken to clip only (a stage learns an inf/nan from the flags in the stats)."""
    weighting: LossWeighting = field(init=False)
    """What the last piece's backward starts from: its loss weighted by the VN's share (and, with
    ``16-mixed``, scaled), as the VN engine's (:mod:`virtualflow.runtime.step.weighting`)."""

    def __post_init__(self) -> None:
        self.finish = StepFinish(self.scaler, self.max_grad_norm,
                                 self.blocks if self.max_grad_norm is not None else None)
        self.weighting = LossWeighting(self.scaler)

    @property
    def checks_grads(self) -> bool:
        """Does the step unscale, check or measure its reduced gradient?"""
        return self.scaler is not None or self.max_grad_norm is not None

    @property
    def norm_entries(self) -> int:
        """Entries of the stats vector the norm takes (the blocks', when clipping)."""
        return self.blocks.size if self.max_grad_norm is not None and self.blocks is not None else 0

    def check_schedule(self, pipeline: Any) -> None:
        """:func:`check_schedule` with these settings."""
        check_schedule(pipeline, precision=self.precision, max_grad_norm=self.max_grad_norm,
                       activation_checkpointing=self.activation_checkpointing)

    def autocast(self, device: torch.device) -> ContextManager[Any]:
        return autocast(device, self.precision)

    def prepare(self, pieces: Mapping[int, nn.Module]) -> None:
        """Activation checkpointing, then compile, on each piece (once per worker)."""
        for piece in pieces.values():
            prepare_model(piece, activation_checkpointing=checkpoint_spec_for(piece, self.activation_checkpointing),
                          compile=self.compile)

    def norm_params(self, model: nn.Module) -> list[tuple[int, torch.Tensor]]:
        """A stage module's trainable parameters the norm counts, as (index in the whole model's
        parameter order, parameter): each once, shared copies in :attr:`norm_excluded` left out."""
        if self.max_grad_norm is None or self.norm_names is None:
            return []
        out = []
        for name, q in model.named_parameters():
            if q.requires_grad and name not in self.norm_excluded:
                if name not in self.norm_names:
                    raise RuntimeError(f"the stage's parameter {name!r} is not a parameter of the whole model's "
                                       f"layers; the gradient norm cannot place it")
                out.append((self.norm_names[name], q))
        return out

    def slots(self, device: torch.device) -> OneSlot | TensorSlots:
        """How this worker's gradients fill the norm's slots and join their inf/nan flags
        (:attr:`slots_of`)."""
        return self.slots_of(device)


def model_norm_blocks(layers: Sequence[nn.Module], tensor: int = 1) -> tuple[NormBlocks, dict[str, int]]:
    """The whole model's :class:`NormBlocks` and each trainable parameter's index in it, by
    whole-model name (``nn.Sequential(*layers)``'s: a weight shared by layers once, at its first
    layer, as ``model.parameters()`` gives it to the unpipelined run). ``tensor`` > 1: the
    parameters tensor parallelism shards get ``tensor`` slots of ``numel / tensor`` elements."""
    whole = nn.Sequential(*layers)
    named = [(n, q) for n, q in whole.named_parameters() if q.requires_grad]
    sharded: frozenset[str] = frozenset()
    if tensor > 1:
        from virtualflow.runtime.pipeline.tensor_grid import whole_splits

        sharded = frozenset(n for n, split in whole_splits(layers, tensor).items() if not split.replicated)
    numels = [q.numel() // tensor if n in sharded else q.numel() for n, q in named]
    slots = [tensor if n in sharded else 1 for n, _ in named]
    blocks = NormBlocks(numels, norm_dtype(q.dtype for _, q in named), slots)
    return blocks, {n: i for i, (n, _) in enumerate(named)}


def checkpoint_spec_for(piece: nn.Module, spec: Any) -> Any:
    """The part of ``Job.activation_checkpointing`` that applies to ``piece`` (``None``: nothing in
    it): ``"every"`` as is, a class if the piece holds an instance, the names it holds."""
    if spec is None or spec == "every":
        return spec
    modules = dict(piece.named_modules())
    if isinstance(spec, type):
        return spec if any(isinstance(m, spec) for n, m in modules.items() if n) else None
    classes = {type(m).__name__ for n, m in modules.items() if n}
    mine = tuple(name for name in spec if (name in modules and name) or name in classes)
    return mine or None


def check_checkpoint_spec(layers: Sequence[nn.Module], spec: Any) -> None:
    """Refuse names or a class that no layer of the model holds (a piece only sees its own)."""
    if spec is None or spec == "every":
        return
    whole = nn.Sequential(*layers)
    modules = dict(whole.named_modules())
    if isinstance(spec, type):
        if not any(isinstance(m, spec) for n, m in modules.items() if n):
            raise ValueError(f"activation_checkpointing={spec.__name__}: the model has no module of that class")
        return
    classes = {type(m).__name__ for n, m in modules.items() if n}
    missing = [name for name in spec if not ((name in modules and name) or name in classes)]
    if missing:
        known = [n for n in modules if n][:12]
        raise ValueError(f"activation_checkpointing names {missing}, which are neither module names nor class names of "
                         f"the pipelined model's layers (names are '<layer index>.<name in the layer>'); its modules "
                         f"include {known}")


def check_schedule(pipeline: Any, *, precision: str, max_grad_norm: float | None,
                   activation_checkpointing: Any) -> None:
    """Refuse the knobs a no-flush schedule (``2bw``, ``async``) cannot honour (the table's row
    ``no_flush+loop``, :mod:`virtualflow.config.composition`): ``16-mixed`` and ``max_grad_norm``
    need the whole step's gradient before any update, which such a schedule applies stage by stage
    as each finishes; activation checkpointing would recompute a micro-batch with the stage's
    newest weights, not the stashed version its forward ran on."""
    check("no_flush+loop", flush=pipeline.flush, schedule=pipeline.schedule, precision=precision,
          max_grad_norm=max_grad_norm, activation_checkpointing=activation_checkpointing)


def stage_loop(job: Any, layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], stages: int) -> StageLoop:
    """A worker's :class:`StageLoop` for ``job`` (a fresh scaler: each worker holds its own).
    ``layers``/``bounds``/``stages``: the whole model's layers and how they are cut (the norm's
    blocks, and the shared weights' copies not counted)."""
    from virtualflow.plan.pipeline.geometry import tied_parameters

    check_checkpoint_spec(layers, job.activation_checkpointing)
    excluded = frozenset(f"{i}.{name}" for locs in tied_parameters(layers, bounds, stages) for i, name in locs[1:])
    blocks, names = (model_norm_blocks(layers, job.pipeline.tensor)
                     if job.max_grad_norm is not None else (None, None))
    return StageLoop(precision=job.precision, scaler=LossScaler.of(job.precision, job.loss_scale),
                     max_grad_norm=job.max_grad_norm, blocks=blocks, norm_names=names, norm_excluded=excluded,
                     activation_checkpointing=job.activation_checkpointing, compile=job.compile)


# ---- the loss function's metrics ----------------------------------------------------------------
def weighted_metrics(metrics: Mapping[str, Any], weight: float) -> dict[str, float]:
    """One virtual node's metrics times its share of the global batch."""
    return {name: float(v.detach().float().item() if isinstance(v, torch.Tensor) else v) * weight
            for name, v in metrics.items()}


def metric_header(sums: Mapping[str, float] | None) -> tuple[bytes, int]:
    """(the metric names as UTF-8 JSON, their count) of the source's sums."""
    if not sums:
        return b"", 0
    names = sorted(sums)
    return json.dumps(names).encode(), len(names)


def share_metrics(sums: Sequence[Mapping[str, float]] | None, source: bool, n_bytes: int, k: int, n_steps: int,
                  device: torch.device) -> Generator[Request, Any, list[dict[str, float]] | None]:
    """Collective (every worker, after a stats all-reduce that carried ``(n_bytes, k)`` from the
    source): sum each step's metric sums over the workers that hold some (the replicas' last
    pieces, ``sums``: one mapping per step of the ``n_steps``, ``None`` elsewhere) and give every worker the names the
    source (replica 0's last piece) encoded. Returns one ``{name: value}`` per step (``None`` when
    the names do not decode: they are dropped, not trusted)."""
    if n_bytes <= 0 or k <= 0:
        return None
    vec = torch.zeros(n_bytes + k * n_steps, dtype=torch.float64, device=device)
    if sums is not None:
        first = next((x for x in sums if x), None)
        names = sorted(first) if first else []
        for i, step_sums in enumerate(sums):
            for j, name in enumerate(names[:k]):
                vec[n_bytes + i * k + j] = float(step_sums.get(name, 0.0))
        if source:
            encoded, _ = metric_header(first)
            vec[:n_bytes] = torch.tensor(list(encoded[:n_bytes]), dtype=torch.float64)
    total = yield AllSum(vec)
    try:
        names = json.loads(bytes(int(b) for b in total[:n_bytes].round().tolist()).decode())
        if not (isinstance(names, list) and len(names) == k and all(isinstance(n, str) for n in names)):
            raise ValueError("not a list of metric names")
    except (ValueError, UnicodeDecodeError):
        return None
    values = total[n_bytes:].reshape(-1, k)
    return [{n: float(values[i, j]) for j, n in enumerate(names)} for i in range(values.shape[0])]
