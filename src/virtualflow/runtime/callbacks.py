"""A worker's step-boundary callbacks (``Job.callbacks``): when each hook runs, where, and how
their state travels. The protocol users implement is :class:`virtualflow.config.loop.Callback`.

Invariants:

- **on_step_end** runs right after each step (applied, or skipped by loss scaling), before the
  step boundary's checkpoints and evaluations, so the checkpoint written after step ``s``
  holds callback state that has seen step ``s``. ``ranks="zero"`` callbacks run on rank 0,
  ``ranks="all"`` ones on every member of the generation.
- **An early stop is agreed.** ``on_step_end`` returning True asks the job to stop after that
  step. When any callback has ``on_step_end``, every member enters one small all-reduce at
  every step boundary (:meth:`Callbacks.agree_stop`), so all of them stop after the same step.
  A request is kept: should that all-reduce fail (a peer died), the worker asks again at the
  next boundary it reaches.
- **on_eval** runs where the evaluation ran: on rank 0, for every callback.
- **on_train_end** runs once when the job ends (done or stopped), after the final state is
  written, where the callback runs; a worker that leaves or fails does not call it.
- **on_resize** runs when a generation starts training with another number of members than the
  last one this job trained in (a held generation does not count): on every member for
  ``ranks="all"``, on rank 0 for ``ranks="zero"``.
- **State.** A callback with ``state_dict()`` and ``load_state_dict()`` keeps its state across
  checkpoints (rank 0's copies, under the state file's ``callbacks`` key: plain data only) and
  state transfers: when a generation forms, ``ranks="all"`` callbacks' state goes from the member
  the training state comes from to every member behind it (newcomers), with that state;
  ``ranks="zero"`` callbacks' state from the member whose copy has seen the most steps to every
  member with an older copy, so a new rank 0 continues from it. Limit: between formations only
  rank 0 holds a ``ranks="zero"`` callback's newest state; if that worker fails, the new rank 0
  continues from the copy it received when the generation formed (or from the last checkpoint).
- **Errors are the user's.** An exception raised by a callback ends the worker with the
  callback's own frames in the reported traceback; a note names the callback, the hook and the
  step (as an error in ``Job.loss`` is reported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from virtualflow.comm.groups import Group
from virtualflow.runtime.transfer import broadcast_state

__all__ = ["Callbacks", "StepInfo"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class StepInfo:
    """What ``on_step_end`` is told about a step (the fields of
    :class:`virtualflow.config.loop.StepInfo`)."""

    step: int
    """The step just finished (0-based, as in ``Result.history``); the model holds the weights
    after it."""
    loss: float
    """The step's loss: the mean over the global batch."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss function's extra metrics, each the mean over the global batch."""
    grad_norm: float | None = None
    """The whole step's gradient norm before clipping (None without ``max_grad_norm``)."""
    skipped: bool = False
    """True when loss scaling (``16-mixed``) skipped the step: the weights did not change."""
    lr: float | None = None
    """The learning rate the step used (the optimizer's first parameter group)."""
    workers: int = 1
    """Members of the generation that ran the step."""
    rank: int = 0
    """This worker's rank in that generation."""
    model: torch.nn.Module | None = None
    """The model this worker holds (the whole model with data parallelism; None for a
    pipelined job, whose workers hold stages)."""


def _stateful(cb: Any) -> bool:
    return callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None))


class Callbacks:
    """The job's callbacks on one worker (see the module docstring)."""

    def __init__(self, callbacks: Sequence[Any], device: torch.device) -> None:
        self.callbacks = list(callbacks)
        self.ranks = [getattr(cb, "ranks", "zero") for cb in self.callbacks]
        self.device = device
        self.decides_stop = any(callable(getattr(cb, "on_step_end", None)) for cb in self.callbacks)
        """Whether step boundaries agree on a stop (the same on every worker: the same job)."""
        self.stop_reason: str | None = None
        """Why a callback on this worker asked to stop (None: none did)."""
        self.zero_seen = -1
        """Steps the ``ranks="zero"`` callbacks' state on this worker has seen (-1: a newcomer's)."""
        self.trained_workers = 0
        """Members of the last generation this worker trained in (0: none yet)."""

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _here(self, i: int, rank: int) -> bool:
        return self.ranks[i] == "all" or rank == 0

    def _call(self, i: int, hook: str, step: int, *args: Any) -> Any:
        cb = self.callbacks[i]
        fn = getattr(cb, hook, None)
        if not callable(fn):
            return None
        try:
            return fn(*args)
        except Exception as exc:
            exc.add_note(f"raised by Job.callbacks[{i}] ({type(cb).__name__}).{hook}"
                         + (f" at step {step}" if step >= 0 else ""))
            if step >= 0 and not isinstance(getattr(exc, "step", None), int):
                try:
                    exc.step = step  # type: ignore[attr-defined]  # the failure report's step
                except AttributeError:
                    pass
            raise

    # -- hooks --------------------------------------------------------------------------------
    def step_end(self, info: StepInfo) -> None:
        """``on_step_end(info)`` of the callbacks that run on ``info.rank``; a True answer is
        remembered as :attr:`stop_reason`."""
        for i, cb in enumerate(self.callbacks):
            if not self._here(i, info.rank):
                continue
            answer = self._call(i, "on_step_end", info.step, info)
            if answer is None or answer is False:
                continue
            if answer is not True:
                err = TypeError(f"{type(cb).__name__}.on_step_end returned {answer!r} ({type(answer).__name__}); "
                                f"return True to stop the job after this step, or None to go on")
                err.step = info.step  # type: ignore[attr-defined]
                raise err
            if self.stop_reason is None:
                self.stop_reason = f"{type(cb).__name__}.on_step_end asked to stop after step {info.step}"
        if info.rank == 0:
            self.zero_seen = info.step + 1

    def agree_stop(self, group: Group) -> bool:
        """Collective (every member, every step boundary, when any callback has ``on_step_end``):
        whether a callback on any member asked to stop."""
        if not self.decides_stop:
            return False
        flag = torch.tensor([1.0 if self.stop_reason is not None else 0.0], dtype=torch.float64, device=self.device)
        group.all_reduce(flag)
        return bool(flag.item() > 0)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """``on_eval(step, metrics)`` of every callback (where the evaluation ran: rank 0)."""
        for i in range(len(self.callbacks)):
            self._call(i, "on_eval", step, step, dict(metrics))

    def finished(self, step: int, rank: int) -> None:
        """``on_train_end(step)`` of the callbacks that run on ``rank``: the job is over (done or
        stopped) with ``step`` steps, the final state written. Not called on a worker that
        leaves a resize or fails: the job goes on elsewhere."""
        for i in range(len(self.callbacks)):
            if self._here(i, rank):
                self._call(i, "on_train_end", step, step)

    def resized(self, step: int, old: int, new: int, rank: int) -> None:
        for i in range(len(self.callbacks)):
            if self._here(i, rank):
                self._call(i, "on_resize", step, step, old, new)

    # -- state ----------------------------------------------------------------------------------
    def has_state(self, ranks: tuple[str, ...] = ("zero", "all")) -> bool:
        return any(_stateful(cb) and r in ranks for cb, r in zip(self.callbacks, self.ranks))

    def state_dict(self, ranks: tuple[str, ...] = ("zero", "all")) -> list[dict[str, Any] | None]:
        """One entry per callback: ``{"class", "ranks", "state"}`` for a stateful one of ``ranks``,
        else None (a checkpoint's ``callbacks`` key)."""
        return [{"class": type(cb).__name__, "ranks": r, "state": cb.state_dict()} if _stateful(cb) and r in ranks
                else None for cb, r in zip(self.callbacks, self.ranks)]

    def load_state_dict(self, states: Any, ranks: tuple[str, ...] = ("zero", "all")) -> None:
        """Load :meth:`state_dict`'s entries into the callbacks of ``ranks``; an entry that does not
        fit its callback (another class: the job's callbacks changed) is skipped with a warning."""
        if not isinstance(states, list):
            logger.warning("the callbacks' state is a %s, not a list: not loaded", type(states).__name__)
            return
        for i, (cb, r) in enumerate(zip(self.callbacks, self.ranks)):
            entry = states[i] if i < len(states) else None
            if r not in ranks or not _stateful(cb):
                continue
            if not isinstance(entry, dict) or entry.get("class") != type(cb).__name__:
                found = entry.get("class") if isinstance(entry, dict) else None
                logger.warning("Job.callbacks[%d] (%s): the saved state is %s; it starts afresh", i,
                               type(cb).__name__, f"that of {found}" if found else "missing")
                continue
            self._call(i, "load_state_dict", -1, entry["state"])

    def resume(self, states: Any, step: int) -> None:
        """A checkpoint's ``callbacks`` entry (None: a state file without one), at ``step``."""
        if states is not None:
            self.load_state_dict(states)
        self.zero_seen = step

    def adopt(self, group: Group, *, src: int, behind: Sequence[int], step: int, hold: bool) -> int:
        """Collective (every member, when a generation forms, after the training state moved):
        bring every member's callback state up to date, then call ``on_resize`` if the number of
        members changed. ``src``/``behind``: the training state's source and receivers (ranks);
        ``step``: the step the generation starts from. Returns the bytes moved."""
        if not self.callbacks:
            return 0
        rank, size = group.rank, group.size
        vec = torch.zeros(2 * size, dtype=torch.float64, device=self.device)
        vec[2 * rank] = self.zero_seen + 1  # +1: a newcomer's -1 becomes 0, never confused with a slot
        vec[2 * rank + 1] = self.trained_workers
        group.all_reduce(vec)
        vals = [int(round(v)) for v in vec.tolist()]
        seen, before = [v - 1 for v in vals[0::2]], vals[1::2]
        moved = 0
        if behind and self.has_state(("all",)):
            mine = self.state_dict(("all",)) if rank == src else None
            state, n = broadcast_state(group, src, mine, self.device, receivers=list(behind))
            if rank in behind:
                self.load_state_dict(state, ("all",))
            moved += n
        top = max(seen)
        older = [r for r, s in enumerate(seen) if s < top]
        if top >= 0 and older:
            if self.has_state(("zero",)):
                zsrc = seen.index(top)
                mine = self.state_dict(("zero",)) if rank == zsrc else None
                state, n = broadcast_state(group, zsrc, mine, self.device, receivers=older)
                if rank in older:
                    self.load_state_dict(state, ("zero",))
                moved += n
            self.zero_seen = top
        if not hold:
            old = before[src]
            if old and old != size:
                self.resized(step, old, size, rank)
            self.trained_workers = size
        return moved
