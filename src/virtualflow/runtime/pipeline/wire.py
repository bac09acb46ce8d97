"""The wire format of a pipeline: message keys and the layout of every message a stage sends.

Purpose: one place that says what travels between the workers of a pipeline replica, so the
executor, the redundancy code and both drivers agree on it.

Invariants:

- A message key is ``(kind, from_piece, micro-batch)``: ``"F"`` a forward activation from piece
  ``from_piece`` to the next, ``"B"`` an input gradient from piece ``from_piece`` to the previous,
  ``"R"`` (Bamboo) a stage's step handed to the worker holding its replica (the third field is
  then the step). The micro-batch id is its index within the action list; the process driver
  turns keys into gloo tags, the in-process driver uses them as mailbox keys.
- A forward message is ``[outputs (detached)..., CPU generator state (, CUDA generator state)]``:
  the random stream travels with the micro-batch, so the next piece continues it
  (:func:`forward_message`, :func:`read_forward_message`).
- A backward message is the list of input gradients, one per floating-point input.
- ``"T"`` (deterministic mode, a weight shared by two workers): per-VN gradients of a copy sent to
  the weight's owner, or the summed gradient sent back (:func:`tied_key`; the second field is
  then the link, the third the step; :mod:`.tied`); streamed, one message per micro-batch
  (:func:`tied_vn_key`).
- A replica update is ``[reduced gradients (flat) | new BatchNorm statistics (flat, maybe empty) |
  buffers after the step's forwards...]`` (:func:`replica_update`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

MsgKey = tuple[str, int, int]  # ("F" | "B" | "R" | "T", from piece, micro-batch id within the action list)


def recv_key(a: Any) -> MsgKey:
    """The message key a RECV_F / RECV_B action waits for."""
    return ("F", a.stage - 1, a.microbatch) if a.kind == "RECV_F" else ("B", a.stage + 1, a.microbatch)


def forward_message(outputs: Sequence[torch.Tensor], rng: Any) -> list[torch.Tensor]:
    """A piece's forward message: its outputs and the generator state(s) after its forward."""
    extra = list(rng) if isinstance(rng, tuple) else [rng]
    return [o.detach() for o in outputs] + extra


def read_forward_message(message: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Continue the random stream a forward message carries (on this process's generators);
    returns its activation tensors. The generator states may be views into a received buffer:
    the generators get their own copies."""
    if device.type == "cuda":
        *tensors, rng, cuda_rng = message
        torch.cuda.set_rng_state(cuda_rng.cpu().clone(), device)
    else:
        *tensors, rng = message
    torch.set_rng_state(rng.cpu().clone())
    return tensors


def replica_key(stage_rank: int, step: int) -> MsgKey:
    """The key of stage-rank ``stage_rank``'s step ``step`` handed to its replica's holder."""
    return ("R", stage_rank, step)


def tied_key(sender: int, receiver: int, phase: int, stages: int, step: int) -> MsgKey:
    """The key of a tied weight's message from stage-rank ``sender`` to ``receiver`` (``phase`` 0:
    per-VN gradients, 1: the total) in step ``step``: one link per (sender, receiver, phase), so
    the drivers' per-link shape tables never mix two messages."""
    return ("T", (sender * stages + receiver) * 2 + phase, step)


def tied_vn_key(sender: int, receiver: int, stages: int, step: int, index: int) -> MsgKey:
    """The key of a tied weight's per-VN gradients of micro-batch ``index`` (of step ``step``) from
    stage-rank ``sender`` to ``receiver``, sent as that micro-batch's backward ends (a streamed
    step, :mod:`.tree_fold`): one link per (sender, receiver, micro-batch), apart from
    :func:`tied_key`'s."""
    return ("T", (2 + index) * stages * stages + sender * stages + receiver, step)


def replica_update(grads: torch.Tensor, bn_new: torch.Tensor, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A stage's step for its replica: reduced gradients, new BatchNorm statistics, buffers."""
    return [grads, bn_new, *buffers]
