"""What a :class:`~virtualflow.runtime.pipeline.engine.StageEngine` asks of its driver, and what a
step returns.

Purpose: the engine never talks to the network itself; its step generator *yields* these
requests and gets the answer back through ``send()``. Two drivers answer them: the process
driver (:func:`virtualflow.runtime.pipeline.worker_engine.drive`, torch.distributed over the
generation's groups) and the in-process one (:class:`virtualflow.runtime.pipeline.local.LocalDriver`).

Invariants: a :class:`Send` never blocks; a :class:`Recv` blocks until its message is there (the
schedule checker proves no deadlock under exactly these rules); :class:`Expect`, :class:`Poll`,
:class:`TreeOpen` and :class:`TreePart` never block; the collectives (:class:`StageSum`,
:class:`StageTree`, :class:`AllSum`) complete when every member has joined and give every member
the same sum (:class:`StageScatter`: each member its chunk of it; :class:`StageGather`: every
member every chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from virtualflow.plan.vnmap import Node, TreePlan
from virtualflow.runtime.breakdown import Raw
from virtualflow.runtime.pipeline.wire import MsgKey


@dataclass(slots=True)
class Send:
    peer: int
    """Stage-rank of the receiver in the same pipeline replica."""
    key: MsgKey
    tensors: list[torch.Tensor]


@dataclass(slots=True)
class Recv:
    peer: int
    key: MsgKey


@dataclass(slots=True)
class Expect:
    """A hint, no answer expected: ``Recv(peer, key)`` will come soon. A process driver posts
    the receive now, so the message moves as soon as it is sent instead of when it is needed."""

    peer: int
    key: MsgKey


@dataclass(slots=True)
class Poll:
    """Has the message ``Recv(peer, key)`` would take arrived? Answer ``True``/``False``, never
    blocks (eager redundant forwards run while the answer is ``False``)."""

    peer: int
    key: MsgKey


@dataclass(slots=True)
class StageSum:
    """Sum ``vector`` over the pipeline replicas of this stage-rank (default mode)."""

    vector: torch.Tensor
    stage: int | None = None
    """A job stage (a worker running several after a Bamboo failover): sum over the workers that
    run that stage in every replica; ``None``: this worker's one stage group."""


@dataclass(slots=True)
class StageTree:
    """Sum the per-VN tree nodes over the replicas of this stage-rank; the root comes back."""

    plan: TreePlan
    nodes: dict[Node, torch.Tensor]
    like: torch.Tensor
    stage: int | None = None
    """As :attr:`StageSum.stage`."""
    bounds: tuple[tuple[int, int], ...] | None = None
    """``reduction="sharded"``: each replica needs only its chunk ``bounds[j]`` of the root and
    the ``gather`` ranges (a driver may give more: the owners exchange stops there, the others
    deliver the whole root); ``None``: the whole root."""
    gather: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class TreeOpen:
    """Deterministic mode, streamed (:mod:`.tree_fold`): the step's reduction ``tree`` (its nodes
    still empty) will come; a driver may start its exchange now (post its receives). Never blocks,
    no answer."""

    tree: StageTree


@dataclass(slots=True)
class TreePart:
    """Partial ``node`` of the opened ``tree`` is final: a driver may send it now (``vec`` is not
    written again before the :class:`StageTree` that finishes the exchange). Never blocks, no answer."""

    tree: StageTree
    node: Node
    vec: torch.Tensor


@dataclass(slots=True)
class StageScatter:
    """Reduce-scatter ``vector`` over the pipeline replicas of this stage-rank, in place:
    afterwards ``vector[lo_j:hi_j]`` (``bounds[j]``, ``j`` this worker's replica) holds the sum
    over the replicas; the rest is scratch (``reduction="sharded"``, :mod:`.stage_shard`)."""

    vector: torch.Tensor
    bounds: list[tuple[int, int]]


@dataclass(slots=True)
class StageGather:
    """All-gather ``vector`` over the pipeline replicas of this stage-rank, in place: each
    replica's ``vector[lo_j:hi_j]`` goes to every replica (``reduction="sharded"``)."""

    vector: torch.Tensor
    bounds: list[tuple[int, int]]


@dataclass(slots=True)
class AllSum:
    """Sum ``vector`` over every worker of the job."""

    vector: torch.Tensor


Request = (Send | Recv | Expect | Poll | StageSum | StageTree | TreeOpen | TreePart | StageScatter | StageGather
           | AllSum)


@dataclass(slots=True)
class StepResult:
    """One step as a worker saw it: its loss (summed over the VNs), the VNs with a non-finite
    loss (the step was skipped), the control value and this worker's compute seconds; and the
    training loop's figures (:class:`virtualflow.runtime.batches.StepOutcome`'s meaning)."""

    step: int
    loss: float
    bad_vns: list[int]
    control: int
    compute_s: float
    metrics: dict[str, float] | None = None
    """The loss function's metrics, each the mean over the global batch."""
    grad_norm: float | None = None
    """The whole model's gradient norm before clipping (after unscaling); ``None`` without
    ``max_grad_norm``."""
    skipped: bool = False
    """``16-mixed``: an inf/nan gradient on some stage; the step was applied nowhere."""
    loss_scale: float | None = None
    """``16-mixed``: the scale this step's loss was multiplied by."""
    breakdown_raw: Raw | None = None
    """Rank 0: every worker's raw timing of the *previous* step, with its stage
    (:class:`virtualflow.runtime.breakdown.Raw`, per stage: :mod:`.timing`); ``None`` elsewhere,
    on a generation's first step, with the breakdown off or a no-flush schedule."""

    @property
    def breakdown(self) -> list[dict[str, float] | None] | None:
        """Where every worker's time went in the *previous* step (rank order), derived from
        :attr:`breakdown_raw`."""
        return self.breakdown_raw.derive() if self.breakdown_raw is not None else None
