"""The engine protocol: what a worker's generation loop asks of the engine that trains a job.

A worker (:mod:`virtualflow.runtime.worker`) lives through membership generations; the engine
holds the training state and runs steps. Two engines implement :class:`Engine`:

- :class:`virtualflow.runtime.vn_worker.VNWorkerEngine`: data parallelism over virtual nodes
  (:class:`virtualflow.runtime.engine.VNEngine`), with the plain or the sharded reduction;
- :class:`virtualflow.runtime.pipeline.worker_engine.PipelineWorkerEngine`: a pipelined job (a stage of
  one pipeline replica per worker, Bamboo's redundancy).

The worker never asks which one it holds: everything that differs between them (how a generation
is adopted and the state moved to members behind, whether the whole state is assembled by a
collective, what falls due at a step boundary, what a held generation writes) is a method here.
:func:`virtualflow.runtime.factory.build_engine` is the one place that chooses the engine, from
the job.

Invariants every engine keeps (the worker's commit rule rests on them, see its docstring):

- A step is applied only after its reduction completed; :meth:`Engine.abandon_step` after a
  peer failure leaves the state as it was before the interrupted step (or, where a step could
  complete on some members only, keeps what is needed to finish it in the next adoption).
- Methods documented as *collective* are called by every member of the generation at the same
  point of the loop, in the same order; the others are local.
- Data order and randomness are functions of (seed, step, VN id): a step redone in a later
  generation is the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from virtualflow.comm.groups import Group
from virtualflow.comm.protocol import GenerationRecord
from virtualflow.runtime.engine import StepOutcome
from virtualflow.runtime.transfer import Progress, Successor

__all__ = ["Boundary", "Engine", "Joining", "Successor"]


@dataclass(slots=True, kw_only=True)
class Joining:
    """A generation being adopted, as the worker agreed it with the other members."""

    group: Group
    record: GenerationRecord
    progress: Progress
    """This worker's own progress before the generation."""
    steps: list[int]
    """Every member's step (by generation rank), agreed by a collective."""
    target: int
    """The most advanced step: every member trains on from it."""
    src: int
    """The rank of a member at ``target`` (the source of any state transfer)."""
    state_point: Callable[[], None] | None = None
    """Fault injection: called once a state transfer has started (``state_transfer``)."""
    transferring: bool = False
    """Set by the engine while it moves state to members behind (what a fault report names)."""
    behind: list[int] = field(default_factory=list)
    """Ranks behind ``target`` (filled from ``steps``)."""

    def __post_init__(self) -> None:
        self.behind = [r for r, s in enumerate(self.steps) if s < self.target]


class Boundary(Protocol):
    """What the worker does for an engine at step boundaries: it owns the files and the reports."""

    last_eval_step: int

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint falls due after ``step`` steps (``checkpoint_every``, not the last)."""

    def eval_due(self, step: int) -> bool:
        """Whether an evaluation falls due after ``step`` steps (``Job.eval_every``)."""

    def whole_state(self, engine: Engine, group: Group, step: int) -> dict[str, Any] | None:
        """``engine.whole_state(group)`` with the step and the job's identity added (a checkpoint's
        contents); collective as the engine's is."""

    def save_checkpoint(self, step: int, state: dict[str, Any], *, prune: bool) -> str:
        """Write ``state`` as the checkpoint of ``step``; ``prune``: keep only the newest
        ``keep_checkpoints``. Returns its path."""

    def checkpointed(self, step: int, path: str, t0: float) -> None:
        """Report a checkpoint written (its save time counted from ``t0``)."""

    dcp: bool
    """``checkpoint_format="dcp"``: every member writes its part of a checkpoint (:meth:`save_sharded`)."""

    def save_sharded(self, group: Group, step: int, pieces: list[Any], meta: dict[str, Any] | None) -> str:
        """Every member: write its part of the sharded checkpoint of ``step`` (rank 0 with ``meta``,
        the state without its big tensors); returns the checkpoint's folder."""

    def drain(self) -> None:
        """Wait for a sharded save in flight."""

    def evaluate(self, model: torch.nn.Module, step: int) -> None:
        """Run ``Job.evaluate`` on ``model`` and report it (rank 0)."""


class Engine(Protocol):
    """What a worker's generation loop asks of the engine that trains its job.

    Life: built before the worker joins (:func:`virtualflow.runtime.factory.build_engine`); then, per generation,
    :meth:`adopt`, :meth:`step` after :meth:`step` with the boundary work between them
    (:meth:`boundary` on every member, :meth:`boundary_on_rank0` after rank 0's step report), and
    one of: a failure (:meth:`abandon_step`), a planned regroup (:meth:`before_regroup`), a held
    generation (:meth:`hold`), the end (:meth:`whole_state` for the final state, then
    :meth:`final_report`). :meth:`close` releases its threads.
    """

    model: torch.nn.Module | None
    """The whole model where this worker holds it (a pipelined job: on rank 0 after
    :meth:`whole_state`), what ``Job.evaluate`` receives."""
    slowdown: float
    """Emulated slowness (tests, benchmarks): a factor on each compute's duration."""
    phase: str
    """Where the current step is, reported when a peer fails (``idle`` between steps)."""
    generation_broken: Callable[[], bool] | None
    """Asked during a step: True once the coordinator declared the generation broken."""
    generation_hops_duplex: bool
    """Whether the generation's own group carries point-to-point hops both ways (a pipeline
    without tensor parallelism): the worker then builds it with a connection per direction
    (:func:`virtualflow.comm.groups.make_group`'s ``duplex``). Set by
    :func:`virtualflow.runtime.factory.build_engine`, which knows the job's layout; the worker
    only passes it on."""

    def install_fault_point(self, fn: Callable[[int, str], None]) -> None:
        """Call ``fn(step, phase)`` at each fault-injection point (:mod:`runtime.faults`)."""

    def resume_from(self, state: dict[str, Any]) -> None:
        """Start from a checkpoint's state (loaded now, or once the worker's place is known)."""

    def prepare_to_join(self) -> None:
        """A newcomer, before it joins: allocate what a state transfer will fill (best effort)."""

    def check_state_held(self, run_dir: str) -> None:
        """Before forming a generation after a failure: raise when this worker no longer holds a
        part of the state nobody else holds (naming ``run_dir`` to resume from)."""

    def adopt(self, joining: Joining) -> tuple[int, float]:
        """Collective. Adopt a generation: its group, its VN assignment (and layout), bringing
        members behind to ``joining.target`` (by a state transfer). Returns the bytes moved and
        the seconds the transfer took. After it every member holds the same training state."""

    def step(self, step: int, control: int | Callable[[], int] = 0) -> StepOutcome:
        """Collective. Run step ``step`` (0-based) and apply it unless a VN's loss was not finite
        (``bad_vns``); ``control`` (rank 0: its control position, or a callable giving it, read
        as late as the engine can: a command given during the step then lands at its boundary)
        rides in the reduction and comes back as the maximum over the members. Raises
        :class:`PeerFailure`."""

    def abandon_step(self) -> None:
        """Local. Forget the step a peer failure interrupted (see the module's invariants); the
        generation's group is broken and released."""

    def whole_state(self, group: Group) -> dict[str, Any] | None:
        """Collective for an engine whose state is spread over the members (sharded, pipelined):
        the whole training state (``model``, ``optimizer``, ``lr_scheduler`` and the engine's
        own keys) on rank 0, ``None`` on the others. Format of the checkpoint files: fixed."""

    def boundary(self, group: Group, step: int, work: Boundary) -> None:
        """Collective. After step ``step`` on every member, before rank 0 reports it: the
        checkpoints and evaluations whose state takes every member."""

    def boundary_on_rank0(self, step: int, work: Boundary) -> None:
        """Rank 0 only, after its step report: the checkpoints and evaluations it does alone."""

    def hold(self, group: Group, step: int, work: Boundary) -> str | None:
        """Collective. A held generation (no training until the coordinator resumes): write a
        checkpoint; returns its path on rank 0, ``None`` elsewhere."""

    wants_successor: bool
    """Whether :meth:`before_regroup` needs the next generation's members (sharded parameters;
    an engine without the attribute: no)."""

    def before_regroup(self, successor: Successor | None = None) -> None:
        """Collective. A planned regroup follows this step: gather what a leaving member holds
        (``successor``: the next generation's members, when known; sharded parameters move their
        shards by it)."""

    def learning_rate(self) -> float | None:
        """Local. The learning rate of the optimizer's first parameter group now (the one the next
        step uses), for the step reports and callbacks; None when this worker holds no optimizer."""

    def non_finite_note(self, step: int, path: str) -> str:
        """What became of a step with a non-finite loss and where its state was saved (``path``)."""

    def final_report(self) -> dict[str, Any]:
        """The engine's fields of the worker's ``done`` report (optimizer and replica bytes,
        redundant forwards)."""

    def state_bytes(self) -> int | None:
        """About how many bytes a state file of this worker takes; None when it cannot be told."""

    def close(self) -> None:
        """Release the engine's threads (loaders); the engine is not used afterwards."""
