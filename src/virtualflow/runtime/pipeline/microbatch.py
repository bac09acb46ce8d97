"""Micro-batch preparation: what a piece's forward takes in and what its backward gives back.

Purpose: turn a micro-batch (step, VN) into a piece's input - the VN's data on the first piece, a
received forward message on the others - and a forward's output into what the schedule moves on
(the next piece's message, or the weighted loss on the last piece); pair outputs with their
gradients for the backward.

Invariants:

- **Micro-batch = virtual node.** The first piece loads the VN's samples (``plan.vn_indices``) and
  seeds the random streams with ``vn_seed(seed, step, vn)``; the last piece weights the loss by
  ``n_v / B``, exactly as the VN engine does (and the metrics ``output_loss`` may return with it).
- **Random streams travel with the micro-batch**: a piece's forward continues the stream from the
  generator state its message carries and records the state after it (:mod:`.wire`).
- **Same samples, loaded ahead or not.** A stage's batches come from the batch source chosen at
  construction (:func:`virtualflow.runtime.prefetch.batch_source`): loaded when the forward asks,
  or by loader threads ahead of it (``loader_workers``); a batch is the one of (step, VN) and its
  indices either way, so the model is the same. The time the forward waited for it is the step
  breakdown's ``input_s``; what loading cost (the loaders' time and reads) its I/O profile.
- A received floating-point activation becomes a leaf that requires grad; it is cloned before the
  piece's forward when the piece starts with an in-place operation (a leaf cannot be modified in
  place), so its gradient can still be read after the backward.
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from virtualflow.plan.pipeline.geometry import tensors_of
from virtualflow.plan.data import DataPlan, vn_seed
from virtualflow.runtime.batches import check_loss, seed_random_streams, split_loss, to_device
from virtualflow.runtime.breakdown import StepClock
from virtualflow.runtime.pipeline.loop import weighted_metrics
from virtualflow.runtime.pipeline.wire import read_forward_message
from virtualflow.runtime.prefetch import LoadNow, StepAhead


@dataclass(slots=True)
class MicroBatch:
    """What one (piece, micro-batch) holds between its forward and its backward."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: tuple[torch.Tensor, ...] = ()
    rng: torch.Tensor | None = None
    batch: Any = None
    n: int = 0
    version: dict[str, torch.Tensor] | None = None
    out_grads: list[torch.Tensor | None] | None = None
    in_grads: list[torch.Tensor] | None = None
    metrics: dict[str, float] | None = None
    """The last piece: the loss function's metrics times the VN's share of the global batch."""
    share: float = 0.0
    """The last piece: the VN's share of the global batch, which weights its loss (``outputs[0]``)
    in the backward (:mod:`virtualflow.runtime.step.weighting`)."""


def starts_in_place(module: nn.Module) -> bool:
    """Does ``module``'s first child contain an in-place operation (``inplace=True``)?"""
    return any(getattr(mod, "inplace", False) for mod in next(iter(module.children()), nn.Identity()).modules())


class MicroBatchPrep:
    """Inputs and outputs of one worker's pieces (see the module docstring)."""

    def __init__(self, *, plan: DataPlan, source: LoadNow | StepAhead, model_input: Callable[[Any], Any],
                 output_loss: Callable[[Any, Any], torch.Tensor], seed: int, device: torch.device,
                 n_pieces: int, pieces: dict[int, nn.Module], clock: StepClock) -> None:
        """``source``: where the micro-batches' data comes from (loaded now or ahead, chosen once);
        ``clock``: the stage's step clock (the loads' cost goes to its I/O profile)."""
        self.plan = plan
        self.source = source
        self.model_input = model_input
        self.output_loss = output_loss
        self.seed = seed
        self.device = device
        self.clock = clock
        self.first, self.last = 0, n_pieces - 1
        self.clone_input = {k: starts_in_place(m) for k, m in pieces.items()}
        self.load_s = 0.0
        """Seconds the forwards spent getting micro-batches' data so far (waiting for a loader, or
        loading; and the copy to the device): the step breakdown's ``input_s``."""

    def set_vns(self, vns: Sequence[int]) -> None:
        """This worker's replica runs ``vns`` (a new generation): what the source loads ahead."""
        self.source.set_vns(vns)

    def close(self) -> None:
        """Stop the loader threads (if any)."""
        self.source.close()

    def _load(self, step: int, vn: int, indices: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        batch, _, stats = self.source.take(step, vn, indices)
        batch = to_device(batch, self.device)
        self.load_s += time.perf_counter() - t0
        self.clock.add_load(stats)
        return batch

    def inputs(self, k: int, step: int, vn: int, message: list[torch.Tensor] | None, ctx: MicroBatch,
               clone: bool | None = None) -> Any:
        """Piece ``k``'s input for micro-batch (step, VN): the VN's data (``message`` None, with a
        fresh random stream) or the received message's activations (its stream continued)."""
        if message is None:  # the first piece: the VN's data, a fresh random stream
            indices = self.plan.vn_indices(step, vn)
            ctx.batch, ctx.n = self._load(step, vn, indices), len(indices)
            seed_random_streams(vn_seed(self.seed, step, vn), self.device)
            return self.model_input(ctx.batch)
        tensors = read_forward_message(message, self.device)
        ins = []
        for t in tensors:
            t = t.detach()
            if t.is_floating_point():
                t.requires_grad_(True)
            ins.append(t)
        ctx.inputs = ins
        clone = self.clone_input[k] if clone is None else clone
        x = [t.clone() if clone and t.is_floating_point() else t for t in ins]
        return x[0] if len(x) == 1 else tuple(x)

    def finish_forward(self, k: int, step: int, vn: int, out: Any, ctx: MicroBatch) -> None:
        """Keep piece ``k``'s output: the loss and the VN's share on the last piece, the activations
        on the others; and the generator state(s) after the forward."""
        if k == self.last:
            if ctx.batch is None:
                indices = self.plan.vn_indices(step, vn)
                ctx.batch, ctx.n = self._load(step, vn, indices), len(indices)
            where = f"Job.output_loss at step {step} in virtual node {vn}"
            loss, metrics = split_loss(self.output_loss(out, ctx.batch), where)
            check_loss(loss, where)
            ctx.share = ctx.n / self.plan.global_batch_size
            ctx.outputs = (loss,)  # weighted by ctx.share in the backward (StageLoop.weighting)
            ctx.metrics = weighted_metrics(metrics, ctx.share) if metrics else None
        else:
            ctx.outputs = tensors_of(out)
        if k != self.first:
            ctx.batch = None if k != self.last else ctx.batch
        ctx.rng = torch.get_rng_state()
        if self.device.type == "cuda":
            ctx.rng = (ctx.rng, torch.cuda.get_rng_state(self.device))

    @staticmethod
    def grad_pairs(ctx: MicroBatch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(outputs that need a backward, their gradients): on the last piece the loss and None
        (the caller weights it by ``ctx.share``: :meth:`StageLoop.weighting.root`)."""
        if ctx.out_grads is None:  # the last piece: the loss
            return [ctx.outputs[0]], None
        outs, grads = [], []
        floats = [o for o in ctx.outputs if o.is_floating_point()]
        for o, g in zip(floats, ctx.out_grads):
            if o.requires_grad:
                outs.append(o)
                grads.append(g)
        return outs, grads

    @staticmethod
    def input_grads(ctx: MicroBatch, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The backward message: one gradient per floating-point input (zeros where none came)."""
        wanted = [t for t in ctx.inputs if t.is_floating_point()]
        return [g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, grads)]
